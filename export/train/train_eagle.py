"""Train the EAGLE drafter (specrt.export.eagle) on the frozen target by self-distillation.

Data: the target's own answers with its top-16 logits per position (`data.py --batched`, `make train-data`).
Features: the target's last hidden states (after the final norm, as its graph outputs them) at every position of
every row, from its transformers model in bf16, cached in --work (`features.pt`, grown as the data grows).
Slot t reads (f_t, token t + 1) and learns f_{t+1} (smooth L1, --feature-weight 1) and the target's distribution
of token t + 2 (soft cross-entropy against its top-16 over the kept ids, --token-weight 0.1), on answer slots; the input
features get uniform noise (EAGLE). With --own-weight > 0, --unroll − 1 more passes read the drafter's own
predictions of the pass before (detached, shifted into place) instead of the target's features and learn the same
targets, each with that weight: at draft time every level below the first reads predicted features, level k + 1
features k steps from the target's. Held-out prompts: the draft's (1 in 16, by name).
Checkpoint every --save-every steps in --work; rerun the same command to resume (a larger --steps trains on from
the checkpoint). Kept output ids: a drafter directory's (--vocab), else --kept-vocab ids chosen from the data as the
draft's are (0: all). --init DIR starts from a
trained drafter's weights instead of random ones (a warm start when the data grows); with --layers above its
count, the added layers start as no-ops (their output projections zero), so training starts from its outputs.

    python -m specrt.export.train.train_eagle --data build/distill/data.jsonl --work build/eagle-train \
        --out export/drafters/smollm2-135m-eagle --max-minutes 30
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn import functional as F

from specrt.errors import InputError
from specrt.export.eagle import TRAINED, EagleModel, load_eagle, new_eagle, renamed, save_eagle
from specrt.export.sources import DEFAULT_TARGET
from specrt.export.train.train_draft import is_val, load_labels, load_rows


@dataclass
class EagleTrainConfig:
    data: str = "build/distill/data.jsonl"
    target: str = DEFAULT_TARGET
    work: str = "build/eagle-train"
    out: str = "export/drafters/smollm2-135m-eagle"
    vocab: str = "export/drafters/smollm2-135m-draft"   # the kept output ids of this directory ("": --kept-vocab)
    kept_vocab: int = 0         # without --vocab: this many ids chosen from the data (0: all)
    init: str = ""              # a trained drafter directory to start from ("": random weights)
    layers: int = 1             # decoder layers (more than --init has: the added ones start as no-ops)
    steps: int = 1500
    batch_tokens: int = 4096
    lr: float = 5e-4
    warmup: int = 30
    feature_weight: float = 1.0
    token_weight: float = 0.1
    own_weight: float = 0.5
    unroll: int = 2             # passes a step: the target's features, then unroll − 1 over the drafter's own
    noise: float = 0.2          # input features + U(-noise/2, noise/2)
    eval_every: int = 100
    save_every: int = 25
    max_minutes: float = 30.0
    feature_minutes: float = 30.0
    seed: int = 0
    threads: int = 2
    device: str = "cpu"


RESUME_KEYS = ("target", "vocab", "kept_vocab", "layers", "batch_tokens", "lr", "warmup", "feature_weight",
               "token_weight", "own_weight", "unroll", "noise", "seed")


def features(cfg: EagleTrainConfig, rows: list[dict]) -> list[torch.Tensor]:
    """The target's features (n, d) of every row, fp16, from the cache in --work, computing the missing ones
    (rows are only ever appended to the data; the cache is saved as it grows, so a cut run resumes)."""
    from rich.progress import Progress

    from specrt.export.sources import load_source
    from specrt.export.train.data import padded
    path = Path(cfg.work) / "features.pt"
    feats = torch.load(path) if path.is_file() else []
    if len(feats) >= len(rows):
        return feats[:len(rows)]
    model = load_source(cfg.target).model.model.to(device=cfg.device, dtype=torch.bfloat16)
    deadline = time.time() + 60 * cfg.feature_minutes if cfg.feature_minutes else float("inf")
    todo = list(range(len(feats), len(rows)))
    with Progress() as bar, torch.no_grad():
        task = bar.add_task("target features", total=len(todo))
        for s in range(0, len(todo), 16):     # rows in order: the cache is a prefix of the data
            if time.time() > deadline:
                raise FeaturesUnfinished(f"the features' time budget ran out with {len(feats)} of {len(rows)} rows "
                                         "done (they are kept); rerun to go on")
            batch = todo[s:s + 16]
            ids, _ = padded(rows, batch)
            h = model(input_ids=ids.to(cfg.device)).last_hidden_state.cpu()       # (b, S, d), causal: pad last
            feats += [h[b, :len(rows[i]["ids"])].half().clone() for b, i in enumerate(batch)]
            bar.advance(task, len(batch))
            if (s // 16) % 8 == 7 or s + 16 >= len(todo):
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save(feats, path.with_suffix(".tmp"))
                path.with_suffix(".tmp").replace(path)
    return feats


class FeaturesUnfinished(InputError):
    """The features' time budget ran out (the cache keeps what was computed; a rerun goes on)."""


def collate(batch: list[int], rows, feats, teacher, remap):
    """Rows padded at the end -> inputs f (b, S, d), ids (b, S); targets f' (b, S, d); the teacher's top-k at
    the next position, ids remapped to the kept ones (-1: not kept) (b, S, k) and values; answer-slot masks for
    the feature loss (b, S) and the token loss (b, S). S = longest row − 1."""
    S = max(len(rows[i]["ids"]) for i in batch) - 1
    d, k = feats[batch[0]].shape[1], teacher[batch[0]][0].shape[1]
    f, target = torch.zeros(len(batch), S, d), torch.zeros(len(batch), S, d)
    ids = torch.zeros(len(batch), S, dtype=torch.long)
    t_idx = torch.full((len(batch), S, k), -1, dtype=torch.long)
    t_val = torch.full((len(batch), S, k), float("-inf"))
    fmask, tmask = torch.zeros(len(batch), S, dtype=torch.bool), torch.zeros(len(batch), S, dtype=torch.bool)
    for b, i in enumerate(batch):
        n, m = len(rows[i]["ids"]), rows[i]["prompt_len"]
        h = feats[i].float()
        f[b, :n - 1], target[b, :n - 1] = h[:-1], h[1:]
        ids[b, :n - 1] = torch.tensor(rows[i]["ids"][1:])
        values, index = teacher[i]                                                  # (n−1, k): position p -> p+1
        t_val[b, :n - 2], t_idx[b, :n - 2] = values[1:].float(), remap[index[1:].long()]
        fmask[b, max(m - 2, 0):n - 1] = True                                        # slot t predicts token t + 2
        tmask[b, max(m - 2, 0):n - 2] = True
    return f, ids, target, t_idx, t_val, fmask, tmask


def losses(model: EagleModel, pred, target, t_idx, t_val, fmask, tmask, cfg) -> tuple[torch.Tensor, dict]:
    feat_loss = F.smooth_l1_loss(pred[fmask].float(), target[fmask])
    logq = torch.log_softmax(model.lm_head(pred[tmask]).float(), -1)                 # (N, K)
    idx, val = t_idx[tmask], t_val[tmask]
    p = torch.softmax(val.masked_fill(idx < 0, float("-inf")), -1).nan_to_num(0.0)   # teacher over kept ids
    token_loss = -(p * logq.gather(-1, idx.clamp(min=0))).sum(-1).mean()
    top1 = idx[:, 0] >= 0
    agree = (logq.argmax(-1) == idx[:, 0])[top1].float().mean()                     # the target's greedy token
    stats = {"feature": feat_loss.item(), "token": token_loss.item(), "agreement": agree.item()}
    return cfg.feature_weight * feat_loss + cfg.token_weight * token_loss, stats


def step_loss(model: EagleModel, batch, cfg, noise: bool) -> tuple[torch.Tensor, dict]:
    f, ids, target, t_idx, t_val, fmask, tmask = (t.to(cfg.device) for t in batch)
    if noise:
        f = f + (torch.rand_like(f) - 0.5) * cfg.noise
    with torch.autocast(f.device.type, dtype=torch.bfloat16):
        pred = model.train_forward(f, ids)                                          # (b, S, d)
        loss, stats = losses(model, pred, target, t_idx, t_val, fmask, tmask, cfg)
        for k in range(1, cfg.unroll if cfg.own_weight > 0 else 1):
            # pass k: slot t reads the prediction of slot t − 1 in pass k − 1 (slot 0 keeps the target's), so
            # the features it reads are k steps from the target's, as at depth k + 1 of a draft
            own = torch.cat([f[:, :1], pred[:, :-1].detach().float()], 1)
            pred = model.train_forward(own, ids)
            loss_k, stats_k = losses(model, pred, target, t_idx, t_val, fmask, tmask, cfg)
            loss = loss + cfg.own_weight * loss_k
            stats["own_agreement" if k == 1 else f"own{k}_agreement"] = stats_k["agreement"]
    return loss, stats


def batches(items: list[int], rows, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Rows of similar length together, at most `batch_tokens` padded tokens a batch, batches shuffled."""
    order = sorted(items, key=lambda i: (len(rows[i]["ids"]), rng.random()))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(rows[i]["ids"]) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    out += [cur] if cur else []
    rng.shuffle(out)
    return out


@torch.no_grad()
def evaluate(model, val, rows, feats, teacher, remap, cfg) -> dict:
    if not val:   # no held-out rows (a small data set)
        return {}
    totals: dict = {}
    for batch in batches(val, rows, cfg.batch_tokens, random.Random(0)):
        _, stats = step_loss(model, collate(batch, rows, feats, teacher, remap), cfg, noise=False)
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v * len(batch)
    return {k: v / len(val) for k, v in totals.items()}


def train(cfg: EagleTrainConfig) -> None:
    from rich.progress import Progress

    from specrt.export.model import from_hf
    from specrt.export.sources import load_source
    from specrt.export.train.train_medusa import read_kept
    if cfg.layers < 1:
        raise InputError(f"--layers {cfg.layers}: the drafter needs at least one decoder layer")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    work = Path(cfg.work)
    rows = load_rows(cfg.data)
    teacher = load_labels(cfg.data)
    rows = rows[:next((i for i in range(len(rows)) if i not in teacher), len(rows))]   # the labelled prefix
    feats = features(cfg, rows)
    src = load_source(cfg.target)
    V = src.model.config.vocab_size
    kept = read_kept(cfg, V)
    target = from_hf(src.model, max(2048, max(len(r["ids"]) for r in rows)))   # rope tables for every row
    model = new_eagle(target, kept, cfg.seed, cfg.layers).train()
    if cfg.init:   # a warm start (a checkpoint in --work, when there is one, replaces it below)
        init = load_eagle(cfg.init, target)
        if len(init.layers) > cfg.layers:
            raise InputError(f"--init {cfg.init} has {len(init.layers)} layers, more than --layers {cfg.layers}")
        model.grow_from(init)
    del src, target
    model.to(cfg.device)
    remap = torch.arange(V) if kept is None else torch.full((V,), -1, dtype=torch.long)
    if kept is not None:
        remap[torch.tensor(kept)] = torch.arange(len(kept))
    params = [p for n, p in model.named_parameters() if n.startswith(TRAINED)]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    train_ids = [i for i, r in enumerate(rows) if not is_val(r["prompt_id"])]
    val_ids = [i for i, r in enumerate(rows) if is_val(r["prompt_id"])][:64]
    state = {"step": 0, "epoch": 0, "batch": 0, "history": [], "wall_s": 0.0, "sessions": []}
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        made = {k: saved["config"].get(k, getattr(EagleTrainConfig, k)) for k in RESUME_KEYS}
        if made != {k: v for k, v in asdict(cfg).items() if k in RESUME_KEYS}:
            raise InputError(f"{ckpt} was made with other settings ({made}): delete it to start over, or pass "
                             "another --work")
        model.load_state_dict(renamed(saved["model"]), strict=False)
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        state = {"sessions": [], **saved["state"]}
        print(f"resumed at step {state['step']}")

    def save():
        torch.save({"config": asdict(cfg), "model": model.trained_state(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "state": state}, work / "ckpt.tmp")
        (work / "ckpt.tmp").replace(ckpt)

    started = time.time() - state["wall_s"]
    session_end = time.time() + 60 * cfg.max_minutes if cfg.max_minutes else float("inf")
    state["sessions"].append([state["step"], state["step"]])   # this call's first and last step
    with Progress() as bar:
        task = bar.add_task("training", total=cfg.steps, completed=state["step"])
        while state["step"] < cfg.steps and time.time() < session_end:
            order = batches(train_ids, rows, cfg.batch_tokens, random.Random(cfg.seed + state["epoch"]))
            if state["batch"] >= len(order):
                state["epoch"], state["batch"] = state["epoch"] + 1, 0
                continue
            loss, stats = step_loss(model, collate(order[state["batch"]], rows, feats, teacher, remap), cfg, True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            state["step"] += 1
            state["batch"] += 1
            state["wall_s"] = time.time() - started
            state["train_loss"] = loss.item()
            state["sessions"][-1][1] = state["step"]
            bar.update(task, advance=1, description=f"training (loss {loss.item():.3f}, agreement "
                                                    f"{stats['agreement']:.2f}, epoch {state['epoch']})")
            if state["step"] % cfg.eval_every == 0 or state["step"] == cfg.steps:
                m = evaluate(model, val_ids, rows, feats, teacher, remap, cfg)
                state["history"].append({"step": state["step"], "train_loss": loss.item(), **m})
                bar.console.print(f"step {state['step']}: held-out {m}")
            if state["step"] % cfg.save_every == 0:
                save()
    save()
    if state["step"] < cfg.steps:
        print(f"stopped by --max-minutes at step {state['step']}/{cfg.steps}; rerun the command to resume")
    out = Path(cfg.out)
    save_eagle(model.cpu(), out)
    record = {"config": asdict(cfg), "history": state["history"], "wall_s": state["wall_s"],
              "steps_done": state["step"], "sessions": state["sessions"], "train_loss": state.get("train_loss"),
              "rows": len(rows), "train_rows": len(train_ids), "val_rows": len(val_ids)}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"saved {out}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in asdict(EagleTrainConfig()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    train(EagleTrainConfig(**vars(ap.parse_args(argv))))


if __name__ == "__main__":
    main()
