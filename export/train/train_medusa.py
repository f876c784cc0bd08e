"""Train Medusa heads on the frozen target: K residual blocks on its last hidden state (and, with
`--root-token`, the default, on the target's embedding of the token that follows it; with `--sequential`, on
the embeddings of the tokens between too, Hydra-style), each feeding the target's own LM head; head k at
position t learns the target's distribution of the token t + k + 2 of self-distilled answers (its top-k logits
there, written by `data.py --batched`). Sequential heads train on the true tokens above them: at run time they
read the candidates of their branch, which are the true tokens exactly when the branch is accepted.

    python -m specrt.export.train.train_medusa --data build/distill/data.jsonl \
        --work build/medusa-train --out export/drafters/smollm2-135m-medusa

Hidden states come from the target's transformers model in bf16 (batched, cached in --work); the passes of
the heads run under bf16 autocast. Held-out rows are the draft's (1 prompt in 16, by name). Training is
seeded, shows a progress bar, saves a checkpoint every --save-every steps and at the end of each epoch, and
resumes from it (a larger --epochs trains on from it). The output directory holds
fp16 safetensors, medusa_config.json and training.json (held-out top-1/top-5 accuracy per head, against the
token that actually followed, on all held-out rows and on the greedy ones; for sequential heads, given the true
tokens above them).
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.progress import Progress

from specrt.errors import InputError
from specrt.export.medusa import MedusaHeads, save_heads
from specrt.export.sources import DEFAULT_TARGET
from specrt.export.train.train_draft import soft_loss as draft_soft_loss


@dataclass
class MedusaConfig:
    data: str = "build/distill/data.jsonl"
    target: str = DEFAULT_TARGET
    work: str = "build/medusa-train"
    out: str = "export/drafters/smollm2-135m-medusa"
    heads: int = 4
    epochs: int = 3
    batch: int = 256
    lr: float = 1e-3
    max_positions: int = 0       # train on a seeded subset of this many positions (0: all)
    max_rows: int = 0            # only the first N rows of the data, in generation order (0: all)
    root_token: bool = True      # the heads also read the token that follows the hidden state (the tree's root)
    sequential: bool = False     # head k also reads the k tokens after the root (its branch's candidates)
    vocab: str = ""              # a drafter directory whose kept output ids (specrt_vocab.json) the heads take
    kept_vocab: int = 0          # else the heads keep this many ids, chosen from the data as the draft's (0: all)
    save_every: int = 100
    max_minutes: float = 0.0     # this call's budget (0: none); rerun to continue
    seed: int = 0
    threads: int = 2
    device: str = "cpu"


PER_POSITION = ("hidden", "labels", "soft_index", "soft_values", "row")   # the feature cache's per-position tensors
RESUME_KEYS = ("target", "heads", "batch", "lr", "max_positions", "max_rows", "seed", "root_token",
               "sequential")  # a checkpoint's settings


def features(cfg: MedusaConfig) -> dict:
    """Hidden states (T, d) at answer positions; roots (T,): the token that followed; labels (T, K): the token
    k + 2 places on (-100 past the end); soft labels (T, K, k): the target's top-k logits for that token, from
    the labels `data.py --batched` wrote. Hidden states come from the target's transformers model in bf16, many
    rows per pass; cached in --work, and extended when the data has grown (rows are only ever appended)."""
    from specrt.export.train.train_draft import is_val, load_rows

    path = Path(cfg.work) / "features.pt"
    rows = load_rows(cfg.data)[:cfg.max_rows or None]
    feats = torch.load(path) if path.is_file() else None
    if feats is None or feats["rows"] < len(rows):
        new = _hidden_states(cfg, rows, feats["rows"] if feats else 0)
        feats = new if feats is None else {
            **feats, **{k: torch.cat([feats[k], new[k]]) for k in PER_POSITION}}
        feats["rows"] = len(rows)
        feats.pop("root", None)
    if "root" not in feats:       # cached by an earlier version, or extended: the roots come from the rows
        feats["root"] = roots(rows, feats["row"])
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(feats, path)
    if feats["rows"] > len(rows):  # --max-rows below what the cache holds
        keep = feats["row"] < len(rows)
        feats = {**feats, **{k: feats[k][keep] for k in (*PER_POSITION, "root")}, "rows": len(rows)}
    feats["greedy_rows"] = torch.tensor([i for i, r in enumerate(rows) if r["mode"] == "greedy"])
    feats["val_rows"] = torch.tensor([i for i, r in enumerate(rows) if is_val(r["prompt_id"])])
    return feats


def _hidden_states(cfg: MedusaConfig, rows: list[dict], first: int) -> dict:
    """The features of rows `first`.. (see `features`)."""
    from specrt.export.sources import load_source
    from specrt.export.train.data import padded
    from specrt.export.train.train_draft import load_labels

    teacher = load_labels(cfg.data)
    missing = [i for i in range(first, len(rows)) if i not in teacher]
    if missing:
        raise InputError(f"{len(missing)} rows of {cfg.data} have no target labels: make the data with "
                         "`specrt train data`")
    src = load_source(cfg.target)
    lm_head = src.model.get_output_embeddings().weight.detach().float().clone()   # before the cast
    embed = src.model.get_input_embeddings().weight
    embed = None if embed is src.model.get_output_embeddings().weight else embed.detach().float().clone()
    model = src.model.model.to(device=cfg.device, dtype=torch.bfloat16)
    K, k = cfg.heads, next(iter(teacher.values()))[0].shape[-1]
    hidden, labels, soft_i, soft_v, row_of = [], [], [], [], []
    order = sorted(range(first, len(rows)), key=lambda i: len(rows[i]["ids"]))
    with Progress() as bar, torch.no_grad():
        task = bar.add_task("target hidden states", total=len(order))
        for s in range(0, len(order), 32):
            batch = order[s:s + 32]
            ids, mask = padded(rows, batch)
            h = model(input_ids=ids.to(cfg.device), attention_mask=mask.to(cfg.device)
                      ).last_hidden_state.float().cpu()                                 # (b, S, d)
            for b, i in enumerate(batch):
                row_ids, start, n = torch.tensor(rows[i]["ids"]), rows[i]["prompt_len"], len(rows[i]["ids"])
                t = torch.arange(start - 1, n - 1)                     # positions whose next token is an answer
                values, index = teacher[i]                             # position p: the token p + 1
                lab = torch.full((len(t), K), -100, dtype=torch.int64)
                si = torch.zeros(len(t), K, k, dtype=torch.int32)
                sv = torch.full((len(t), K, k), float("-inf"), dtype=torch.half)
                for j in range(K):
                    ok = t + j + 2 < n
                    lab[ok, j] = row_ids[t[ok] + j + 2]
                    si[ok, j], sv[ok, j] = index[t[ok] + j + 1], values[t[ok] + j + 1]
                hidden.append(h[b, start - 1:n - 1].clone())
                labels.append(lab)
                soft_i.append(si)
                soft_v.append(sv)
                row_of.append(torch.full((len(t),), i))
            bar.advance(task, len(batch))
    return {"hidden": torch.cat(hidden), "labels": torch.cat(labels), "soft_index": torch.cat(soft_i),
            "soft_values": torch.cat(soft_v), "row": torch.cat(row_of), "rows": len(rows), "lm_head": lm_head,
            **({"embed": embed} if embed is not None else {})}   # the input embeddings, where not the LM head


def roots(rows: list[dict], row: torch.Tensor) -> torch.Tensor:
    """The token after each feature position: the answer tokens of each row, in the order `features` wrote
    them (one run of positions start-1 .. n-2 per row)."""
    runs, counts = torch.unique_consecutive(row, return_counts=True)
    out = [torch.tensor(rows[i]["ids"][rows[i]["prompt_len"]:]) for i in runs.tolist()]
    assert [len(o) for o in out] == counts.tolist(), "features do not match the data rows"
    return torch.cat(out)


def path_tokens(root, labels) -> torch.Tensor:
    """(T, K): the root and the true tokens after it, what sequential heads read (0 past the end of an answer,
    where the heads that would read them have no label)."""
    return torch.cat([root[:, None], labels[:, :-1].clamp(min=0)], 1)


def accuracy(heads: MedusaHeads, hidden, root, labels, batch: int = 1024) -> dict:
    K, device = labels.shape[1], heads.lm_head.weight.device
    hit1, hit5, total = torch.zeros(K), torch.zeros(K), torch.zeros(K)
    with torch.no_grad():
        for s in range(0, len(hidden), batch):
            h, tokens = hidden[s:s + batch].to(device), path_tokens(root[s:s + batch], labels[s:s + batch])
            logits = heads(h, tokens.to(device))                                      # (b, K, V)
            top = logits.topk(5, dim=-1).indices.cpu()                                # (b, K, 5)
            lab = labels[s:s + batch]
            ok = lab >= 0
            hit1 += ((top[..., 0] == lab) & ok).sum(0)
            hit5 += ((top == lab[..., None]).any(-1) & ok).sum(0)
            total += ok.sum(0)
    n = total.clamp(min=1)   # no held-out positions: 0, not NaN
    return {"top1": (hit1 / n).tolist(), "top5": (hit5 / n).tolist(), "positions": total.tolist()}


def soft_loss(logits, index, values):
    """The draft's soft cross-entropy against the target's top-k, over the whole vocabulary, on the rows that
    have labels (past the end of an answer there are none; selected first: a row of -inf has a NaN softmax)."""
    ok = torch.isfinite(values.float()).any(-1)
    return draft_soft_loss(logits[ok].float(), index[ok].long(), values[ok].float())


def train(cfg: MedusaConfig) -> None:
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    started = time.time()
    f = features(cfg)
    val = torch.isin(f["row"], f["val_rows"])
    train_idx = torch.nonzero(~val).flatten()
    if cfg.max_positions and len(train_idx) > cfg.max_positions:  # a seeded subset bounds the training time
        train_idx = train_idx[torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(cfg.seed))[
            :cfg.max_positions]]
    val_greedy = val & torch.isin(f["row"], f["greedy_rows"])
    embed = f.get("embed", f["lm_head"]) if cfg.root_token or cfg.sequential else None   # tied: the LM head's
    heads = MedusaHeads(cfg.heads, f["hidden"].shape[1], f["lm_head"], embed, cfg.sequential).to(cfg.device)
    for head in heads.heads:  # start as the identity: each head first predicts what the LM head predicts
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    params = [p for n, p in heads.named_parameters() if n.startswith("heads.")]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    steps = (len(train_idx) + cfg.batch - 1) // cfg.batch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps * cfg.epochs)
                                                                               / (steps * cfg.epochs))))
    ckpt = Path(cfg.work) / "checkpoint.pt"
    state = {"epoch": 0, "batch": 0, "step": 0, "history": [], "wall_s": 0.0, "sessions": []}
    if ckpt.is_file():
        saved = torch.load(ckpt)
        made = {k: saved.get("config", {}).get(k, getattr(MedusaConfig, k)) for k in RESUME_KEYS}
        if made != {k: v for k, v in asdict(cfg).items() if k in RESUME_KEYS}:
            raise InputError(f"{ckpt} was made with other settings ({made}): delete it to start over, or pass "
                             "another --work")
        heads.load_state_dict(saved["heads"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        state = {**state, "step": steps * saved["state"]["epoch"], **saved["state"]}   # older: by epochs only
        print(f"resumed from {ckpt} at step {state['step']} (epoch {state['epoch']})")

    def save():
        torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "state": state, "config": asdict(cfg)}, ckpt.with_suffix(".tmp"))
        ckpt.with_suffix(".tmp").replace(ckpt)

    session_end = time.time() + 60 * cfg.max_minutes if cfg.max_minutes else float("inf")
    state["sessions"].append([state["step"], state["step"]])   # this call's first and last step
    with Progress() as bar:
        task = bar.add_task("training Medusa heads", total=steps * cfg.epochs, completed=state["step"])
        while state["epoch"] < cfg.epochs and time.time() < session_end:
            order = train_idx[torch.randperm(len(train_idx),
                                             generator=torch.Generator().manual_seed(cfg.seed + state["epoch"]))]
            for s in range(state["batch"] * cfg.batch, len(order), cfg.batch):
                if time.time() > session_end:
                    break
                idx = order[s:s + cfg.batch]
                hidden, tokens = f["hidden"][idx].to(cfg.device), path_tokens(f["root"][idx], f["labels"][idx])
                with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
                    logits = heads(hidden, tokens.to(cfg.device))                               # (b, K, V)
                loss = soft_loss(logits.flatten(0, 1), f["soft_index"][idx].flatten(0, 1).to(cfg.device),
                                 f["soft_values"][idx].flatten(0, 1).to(cfg.device))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                state["batch"] += 1
                state["step"] += 1
                state["train_loss"] = loss.item()
                state["sessions"][-1][1] = state["step"]
                bar.update(task, advance=1, description=f"training Medusa heads (loss {loss.item():.3f})")
                if state["step"] % cfg.save_every == 0:
                    save()
            else:   # the epoch is done
                state["epoch"] += 1
                state["batch"] = 0
                state["wall_s"] += time.time() - started
                started = time.time()
                metrics = {name: accuracy(heads, f["hidden"][sel], f["root"][sel], f["labels"][sel])
                           for name, sel in (("held_out", val), ("held_out_greedy", val_greedy))}
                state["history"].append({"epoch": state["epoch"], "train_loss": state.get("train_loss"), **metrics})
                for name, m in metrics.items():
                    bar.console.print(f"epoch {state['epoch']} {name}: top-1 {[round(x, 3) for x in m['top1']]}, "
                                      f"top-5 {[round(x, 3) for x in m['top5']]}")
                save()
    state["wall_s"] += time.time() - started
    save()
    if state["epoch"] < cfg.epochs:
        print(f"stopped by --max-minutes at step {state['step']}/{steps * cfg.epochs}; rerun the command to resume")
    out = Path(cfg.out)
    save_heads(heads.cpu(), out)
    kept = read_kept(cfg, f["lm_head"].shape[0])
    if kept is not None:
        from specrt.export.sources import VOCAB_FILE
        (out / VOCAB_FILE).write_text(json.dumps({"kept_ids": kept}) + "\n")
    record = {"config": asdict(cfg), "history": state["history"], "wall_s": state["wall_s"],
              "steps_done": state["step"], "steps": steps * cfg.epochs, "sessions": state["sessions"],
              "train_loss": state.get("train_loss"), "train_positions": len(train_idx),
              "val_positions": int(val.sum()), "rows": f["rows"]}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"saved {out}")


def read_kept(cfg, vocab_size: int) -> list[int] | None:
    """The output ids the drafter keeps: those of the --vocab directory, else --kept-vocab ids chosen from the
    data (None: all)."""
    from specrt.export.sources import read_vocab_subset
    from specrt.export.train.train_draft import kept_vocab
    if cfg.vocab:
        kept = read_vocab_subset(Path(cfg.vocab), vocab_size)
        if kept is None:
            raise InputError(f"--vocab-from {cfg.vocab}: has no specrt_vocab.json to take the kept ids from")
        return kept
    if not cfg.kept_vocab or cfg.kept_vocab >= vocab_size:
        return None
    from specrt.export.sources import source_info
    return kept_vocab(cfg.data, vocab_size, cfg.kept_vocab, source_info(cfg.target).eos_token_ids)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in asdict(MedusaConfig()).items():
        if isinstance(default, bool):
            ap.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=default)
        else:
            ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    train(MedusaConfig(**vars(ap.parse_args(argv))))


if __name__ == "__main__":
    main()
