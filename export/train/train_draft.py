"""Train a small draft model for the target by distillation on the target's own answers.

The draft is a transformers model of the target's own class over its tokenizer (so it also serves as a
transformers `assistant_model`): the target's embeddings and output head, a few of the target's layers and its
final norm. Only the layers and the norm train; the embeddings and the output head stay the target's. The draft's
engine keeps a reduced output vocabulary: the K ids most frequent in the distilled data and among the teacher's
top-4 predictions at every scored position, topped up with the lowest ids (the earliest BPE merges), written to
`specrt_vocab.json`.

Three steps, each resumable (rerun the same command):
  score   the target engine scores every distilled sequence once; its top-k logits per position are the soft
          labels (`build/distill/teacher.pt`)
  train   soft cross-entropy against the teacher's top-k over the kept ids, AdamW, cosine schedule,
          checkpoint every `--save-every` steps (`build/draft-train/ckpt.pt`)
  save    fp16 safetensors + config.json + specrt_vocab.json into `--out`

    python -m specrt.export.train.train_draft --data build/distill/data.jsonl --out export/drafters/NAME
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specrt.export.sources import DEFAULT_TARGET


@dataclass
class TrainConfig:
    data: str = "build/distill/data.jsonl"   # one or more JSON-lines files, comma-separated (rows in order)
    target: str = DEFAULT_TARGET          # the model source the draft is distilled from
    engines: str = "engines/default"
    work: str = "build/draft-train"
    out: str = "export/drafters/smollm2-135m-draft"
    layers: tuple[int, ...] = (0, 1)      # target layers the draft starts from, in order
    init: str = ""                        # or a draft checkpoint directory to continue from
    kept_vocab: int = 8192
    topk: int = 16                        # teacher logits kept per position
    score_minutes: float = 10.0
    steps: int = 600
    batch_tokens: int = 4096
    lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.0
    save_every: int = 50
    eval_every: int = 50
    max_minutes: float = 40.0
    seed: int = 0
    threads: int = 2
    autocast: str = "bfloat16"            # compute dtype of the forward and backward passes ("float32": none)
    device: str = "cpu"


# settings a checkpoint may be resumed with when they differ (a larger --steps trains on from it)
RESUMABLE_WITH = ("out", "steps", "max_minutes", "score_minutes", "threads", "device")


def load_rows(paths: str) -> list[dict]:
    return [json.loads(line) for path in paths.split(",") for line in Path(path).read_text().splitlines()
            if line.strip()]


def is_val(prompt_id: str) -> bool:
    """A fixed 1-in-16 split by prompt (all answers of a prompt fall on the same side)."""
    return zlib.crc32(prompt_id.encode()) % 16 == 0


def choose_vocab(rows: list[dict], vocab_size: int, k: int, always: list[int],
                 predicted: list[torch.Tensor] = ()) -> list[int]:
    """The k ids most frequent in the data (answers and prompts) and in `predicted` (teacher top ids), topped up
    with the lowest ids."""
    counts = Counter(t for r in rows for t in r["ids"])
    for ids in predicted:
        counts.update(ids.flatten().tolist())
    kept = set(always)
    for t, _ in counts.most_common():
        if len(kept) >= k:
            break
        kept.add(t)
    t = 0
    while len(kept) < k and t < vocab_size:
        kept.add(t)
        t += 1
    return sorted(kept)


def kept_vocab(data: str, vocab_size: int, k: int, always: list[int]) -> list[int]:
    """`choose_vocab` over the training rows of `data` and their labels (the Medusa heads' and the EAGLE
    drafter's kept ids, chosen as the draft's are)."""
    rows, labels = load_rows(data), load_labels(data)
    train_rows = [i for i, r in enumerate(rows) if not is_val(r["prompt_id"])]
    return choose_vocab([rows[i] for i in train_rows], vocab_size, k, always,
                        [labels[i][1][:, :4] for i in train_rows if i in labels])


# ---- teacher ------------------------------------------------------------------------------------------------
def load_labels(paths: str) -> dict:
    """The top-k labels that `data.py --batched` wrote beside each data file (`<file>.teacher/`), keyed by row
    number over all files in order (as `load_rows` numbers them)."""
    out, offset = {}, 0
    for path in map(Path, paths.split(",")):
        for shard in sorted(path.with_suffix(".teacher").glob("*.pt")):
            out.update({offset + i: v for i, v in torch.load(shard).items()})
        offset += sum(1 for line in path.read_text().splitlines() if line.strip())
    return out


def score(engines: str, rows: list[dict], topk: int, path: Path, max_minutes: float, known: dict) -> dict:
    """Top-k target logits at every position of every row (the label of position i is token i+1) that `known`
    lacks, from the target engine; resumable. Stops at its time budget: the rows scored by then are the
    training set (rerun to score more)."""
    from rich.progress import track

    from specrt import Generator
    from specrt.decoding.drafters import chain_mask

    done = torch.load(path) if path.exists() else {}
    todo = [i for i in range(len(rows)) if i not in done and i not in known]
    if not todo:
        return {**done, **known}
    target = Generator.from_engines(engines).target
    deadline = time.time() + 60 * max_minutes
    for n, i in enumerate(track(todo, description="scoring with the target")):
        ids = torch.tensor([rows[i]["ids"][:-1]])
        S = ids.shape[1]
        cache = target.new_cache(1, S)
        out = target.forward(ids, torch.arange(S)[None].contiguous(), cache.past_len, chain_mask(1, S), S, cache)
        values, index = out.logits[0].topk(topk, dim=-1)                       # (S, k)
        done[i] = (values.half().clone(), index.int().clone())
        if n % 50 == 49:
            torch.save(done, path)
        if time.time() > deadline:
            print(f"scoring stopped by its time budget: {len(done)} of {len(todo)} rows scored")
            break
    torch.save(done, path)
    return {**done, **known}


# ---- model --------------------------------------------------------------------------------------------------
def init_draft(target, layers: tuple[int, ...]):
    """A model of the target's class and configuration with `len(layers)` layers, holding copies of the target's
    embeddings, those layers (in that order), its final norm and its output head."""
    bad = [i for i in layers if not 0 <= i < target.config.num_hidden_layers]
    if not layers or bad:
        from specrt.errors import InputError
        raise InputError(f"--layers {','.join(map(str, layers))}: the target has layers 0 to "
                         f"{target.config.num_hidden_layers - 1}; name at least one of them")
    cfg = target.config.to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "architectures", "transformers_version", "dtype",
                "torch_dtype", "quantization_config"):
        cfg.pop(key, None)
    cfg.update(num_hidden_layers=len(layers), architectures=[type(target).__name__])
    if isinstance(cfg.get("layer_types"), list):   # per-layer attention kinds (sliding windows): the kept layers'
        cfg["layer_types"] = [cfg["layer_types"][i] for i in layers]
    draft = type(target)(type(target.config)(**cfg)).float()
    src = target.state_dict()
    state = {k: v for k, v in src.items() if not k.startswith("model.layers.")}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        state.update({f"model.layers.{new}.{k[len(prefix):]}": v for k, v in src.items() if k.startswith(prefix)})
    draft.load_state_dict(state, strict=True)
    draft.generation_config.eos_token_id = target.generation_config.eos_token_id
    return draft


def batches(items: list[int], rows: list[dict], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Rows of similar length together, at most `batch_tokens` padded tokens per batch, in random order."""
    order = sorted(items, key=lambda i: len(rows[i]["ids"]))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(rows[i]["ids"]) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def collate(batch: list[int], rows: list[dict], teacher: dict, remap: torch.Tensor, answers_only: bool = False):
    """input ids (B, S), attention mask (B, S), soft labels: kept-vocab indices (B, S, k) and logits (B, S, k);
    a position counts in the loss when its mask is set and at least one teacher id is kept."""
    S = max(len(rows[i]["ids"]) for i in batch) - 1
    B, k = len(batch), next(iter(teacher.values()))[0].shape[-1]
    ids = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S, dtype=torch.bool)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    t_idx = torch.zeros(B, S, k, dtype=torch.long)
    t_val = torch.full((B, S, k), float("-inf"))
    for b, i in enumerate(batch):
        seq = rows[i]["ids"][:-1]
        n = len(seq)
        ids[b, :n] = torch.tensor(seq)
        mask[b, :n] = True
        values, index = teacher[i]
        kept = remap[index.long()]                                                   # (n, k) -1 where dropped
        t_idx[b, :n] = kept.clamp(min=0)
        t_val[b, :n] = values.float().masked_fill(kept < 0, float("-inf"))
        start = rows[i]["prompt_len"] - 1 if answers_only else 0
        loss_mask[b, start:n] = True
    loss_mask &= torch.isfinite(t_val).any(-1)
    return ids, mask, loss_mask, t_idx, t_val


def draft_logits(model, ids, mask, kept: torch.Tensor, loss_mask, autocast: str = "bfloat16"):
    """Logits over the kept ids at the loss positions (N, K), float32; the passes run under autocast to that
    dtype (bf16 matrix units make training several times faster on CPUs that have them; weights stay float32;
    "float32" turns it off)."""
    with torch.autocast(ids.device.type, dtype=getattr(torch, autocast), enabled=autocast != "float32"):
        hidden = model.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state   # (B, S, d)
        head = model.lm_head.weight.index_select(0, kept)                                  # (K, d)
        return (hidden[loss_mask] @ head.T).float()                                        # (N, K)


def soft_loss(logits, t_idx, t_val):
    """Cross-entropy of the draft against the teacher's top-k, renormalised over the kept ids."""
    p = torch.softmax(t_val, -1)                                                       # (N, k)
    logq = torch.log_softmax(logits, -1).gather(-1, t_idx)                             # (N, k)
    return -(p * logq.masked_fill(p == 0, 0)).sum(-1).mean()


@torch.no_grad()
def evaluate(model, val: list[int], rows, teacher, remap, kept, batch_tokens, autocast: str = "bfloat16") -> dict:
    """Top-1 agreement with the teacher on the answers of held-out greedy rows (a proxy of greedy α)."""
    model.eval()
    agree = total = 0
    loss = 0.0
    greedy = [i for i in val if rows[i]["mode"] == "greedy"]
    for batch in batches(greedy, rows, batch_tokens, random.Random(0)):
        ids, mask, lm, t_idx, t_val = on(kept.device, *collate(batch, rows, teacher, remap, answers_only=True))
        logits = draft_logits(model, ids, mask, kept, lm, autocast)
        top = teacher_top1(batch, rows, teacher, lm.cpu()).to(kept.device)
        agree += int((kept[logits.argmax(-1)] == top).sum())
        total += len(top)
        loss += float(soft_loss(logits, t_idx[lm], t_val[lm])) * len(top)
    model.train()
    return {"agreement": agree / max(total, 1), "loss": loss / max(total, 1), "positions": total}


def on(device, *tensors):
    return tuple(t.to(device) for t in tensors)


def teacher_top1(batch, rows, teacher, loss_mask):
    S = loss_mask.shape[1]
    top = torch.full((len(batch), S), -1, dtype=torch.long)
    for b, i in enumerate(batch):
        index = teacher[i][1]
        top[b, :index.shape[0]] = index[:, 0].long()
    return top[loss_mask]


# ---- the run ------------------------------------------------------------------------------------------------
def train(cfg: TrainConfig) -> None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from specrt.errors import InputError
    from specrt.export.sources import load_source

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    work = Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = load_rows(cfg.data)
    teacher = score(cfg.engines, rows, cfg.topk, work / "teacher.pt", cfg.score_minutes, load_labels(cfg.data))
    for i, (values, _) in teacher.items():
        if values.shape[0] != len(rows[i]["ids"]) - 1:
            raise InputError(f"{work / 'teacher.pt'} does not match {cfg.data} (row {i}); delete it to rescore")
    target = load_source(cfg.target)
    eos, V = target.eos_token_ids, target.model.config.vocab_size
    train_rows = [i for i, r in enumerate(rows) if not is_val(r["prompt_id"])]
    kept_ids = choose_vocab([rows[i] for i in train_rows], V, cfg.kept_vocab or V, eos,
                            [teacher[i][1][:, :4] for i in train_rows if i in teacher])
    kept = torch.tensor(kept_ids)
    remap = torch.full((V,), -1, dtype=torch.long)
    remap[kept] = torch.arange(len(kept))
    if cfg.init:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(cfg.init, dtype=torch.float32)
    else:
        model = init_draft(target.model, cfg.layers)
    del target
    model.to(cfg.device)
    kept = kept.to(cfg.device)
    for frozen in (model.get_input_embeddings(), model.get_output_embeddings()):   # the target's (maybe tied)
        frozen.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    train_ids = [i for i, r in enumerate(rows) if i in teacher and not is_val(r["prompt_id"])]
    val_ids = [i for i, r in enumerate(rows) if i in teacher and is_val(r["prompt_id"])]
    answers = [teacher[i][1][rows[i]["prompt_len"] - 1:, 0].long() for i in val_ids if rows[i]["mode"] == "greedy"]
    coverage = float((remap[torch.cat(answers)] >= 0).float().mean()) if answers else None
    if coverage is not None:
        print(f"{len(kept_ids)} kept ids cover {coverage:.3f} of the target's greedy tokens on held-out answers")
    state = {"step": 0, "epoch": 0, "batch": 0, "history": [], "wall_s": 0.0, "sessions": []}
    best: dict = {}   # weights at the best held-out agreement so far
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        made = {**asdict(TrainConfig()), **saved["config"]}   # settings added since take their defaults
        if {k: v for k, v in made.items() if k not in RESUMABLE_WITH} != \
                {k: v for k, v in asdict(cfg).items() if k not in RESUMABLE_WITH}:
            raise InputError(f"{ckpt} was written with another configuration; delete {work} to start over")
        model.load_state_dict(saved["model"], strict=False)
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        state = {"sessions": [], **saved["state"]}
        best.update(saved.get("best", {}))
        torch.set_rng_state(saved["rng"])
        print(f"resumed at step {state['step']}")
    else:
        first = evaluate(model, val_ids, rows, teacher, remap, kept, cfg.batch_tokens, cfg.autocast)
        state["history"].append({"step": 0, **first})
        print(f"step 0 ({cfg.init or f'target layers {cfg.layers}'}): val agreement {first['agreement']:.3f} "
              f"loss {first['loss']:.3f}")

    def trainable():
        return {k: v for k, v in model.state_dict().items() if not k.startswith(("model.embed", "lm_head"))}

    def save():
        torch.save({"config": asdict(cfg), "model": trainable(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "state": state, "rng": torch.get_rng_state(), "kept_ids": kept_ids, "best": best},
                   work / "ckpt.tmp")
        (work / "ckpt.tmp").replace(ckpt)

    started = time.time() - state["wall_s"]
    session_end = time.time() + 60 * cfg.max_minutes if cfg.max_minutes else float("inf")
    state["sessions"].append([state["step"], state["step"]])   # this call's first and last step
    model.train()
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn()]
    with Progress(*columns) as bar:
        task = bar.add_task("training", total=cfg.steps, completed=state["step"])
        while state["step"] < cfg.steps and time.time() < session_end:
            order = batches(train_ids, rows, cfg.batch_tokens, random.Random(cfg.seed + state["epoch"]))
            if state["batch"] >= len(order):
                state["epoch"], state["batch"] = state["epoch"] + 1, 0
                continue
            ids, mask, lm, t_idx, t_val = on(cfg.device, *collate(order[state["batch"]], rows, teacher, remap,
                                                                   answers_only=True))
            loss = soft_loss(draft_logits(model, ids, mask, kept, lm, cfg.autocast), t_idx[lm], t_val[lm])
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
            bar.update(task, advance=1, description=f"training (loss {loss.item():.3f}, epoch {state['epoch']})")
            if state["step"] % cfg.eval_every == 0 or state["step"] == cfg.steps:
                m = evaluate(model, val_ids, rows, teacher, remap, kept, cfg.batch_tokens, cfg.autocast)
                state["history"].append({"step": state["step"], "train_loss": loss.item(), **m})
                bar.console.print(f"step {state['step']}: val agreement {m['agreement']:.3f} loss {m['loss']:.3f}")
                if m["positions"] and m["agreement"] > state.get("best_agreement", -1.0):   # the draft that ships:
                    state.update(best_step=state["step"], best_agreement=m["agreement"])     # the best seen
                    best.update({k: v.clone() for k, v in trainable().items()})
            if state["step"] % cfg.save_every == 0:
                save()
    save()
    if state["step"] < cfg.steps:  # the draft so far is still written; rerunning resumes the schedule
        print(f"stopped by --max-minutes at step {state['step']}/{cfg.steps}; rerun the command to resume")
    if best:
        model.load_state_dict(best, strict=False)
        print(f"writing the draft of step {state['best_step']} (held-out agreement {state['best_agreement']:.3f})")
    save_draft(model.cpu(), kept_ids, Path(cfg.out), {
        "config": asdict(cfg), "history": state["history"], "wall_s": state["wall_s"], "steps_done": state["step"],
        "sessions": state["sessions"], "train_loss": state.get("train_loss"), "rows": len(rows),
        "train_rows": len(train_ids), "val_rows": len(val_ids), "kept_coverage": coverage,
        "best_step": state.get("best_step")})


def save_draft(model, kept_ids: list[int], out: Path, record: dict) -> None:
    """fp16 safetensors + config.json (loaded back as float32 by the exporter), kept ids, training record."""
    out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(out, safe_serialization=True)
    model.float()
    (out / "specrt_vocab.json").write_text(json.dumps({"kept_ids": kept_ids}))
    (out / "training.json").write_text(json.dumps(record, indent=1))
    print(f"saved {out}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in asdict(TrainConfig()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, tuple):
            ap.add_argument(flag, default=",".join(map(str, default)))
        else:
            ap.add_argument(flag, type=type(default), default=default)
    a = vars(ap.parse_args(argv))
    a["layers"] = tuple(int(x) for x in str(a["layers"]).split(","))
    train(TrainConfig(**a))


if __name__ == "__main__":
    main()
