"""Train an EAGLE-3 drafter (specrt.export.eagle3) for any target `specrt export` accepts, by self-distillation.

Data: token rows {ids, prompt_len} (JSON lines, e.g. `specrt.export.train.data`'s output), or, without --data,
the target's own greedy answers to the seed tasks (through its chat template; a target without a tokenizer answers
seeded random-token prompts), written to --work/data.jsonl. Features: the target's hidden states entering the
drafter's layers (its aux states) and its top-16 logits at every position, from its transformers model, cached in
--work (`features.pt`). Draft vocabulary: the --kept-vocab ids the target writes most often in the data (all of
them when the target's vocabulary is smaller); the LM head starts from the target's rows of those ids and the final
norm from the target's.

Slot t reads fc(aux_t) and token t + 1 and learns the target's distribution of token t + 2 over the draft ids (soft
cross-entropy against its top-16; EAGLE-3 has no feature loss). Training-time test (the EAGLE-3 authors'): --unroll
− 1 more passes read the drafter's own outputs of the pass before (detached, slot t the output of slot t − 1) in
place of fc(aux), weighted 0.8^k, as tree levels below the first do; and they attend as those levels do at draft
time (see `ttt_passes`): over the first pass's keys up to slot t − k (the committed prefix, made from the target's
features) and over their own chain of ancestors, one key per pass.
--init DIR starts from an EAGLE-3 drafter's weights (same target, layers and draft vocabulary) instead of from
random ones.
A checkpoint is saved every --save-every steps in --work; rerun the same command to resume. The drafter goes to
--out in the published layout (config.json + model.safetensors) with a model card (README.md) and training.json.

    python -m specrt.export.train.train_eagle3 --target smollm2-135m --work build/eagle3-train \\
        --out build/smollm2-135m-eagle3 --steps 2000 --device cuda
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

from specrt.export.eagle3 import TRAINED, Eagle3Model, default_layers, new_eagle3, save_eagle3
from specrt.export.train.train_eagle import batches

TOP_K = 16   # the target's logits kept per position (soft labels)


@dataclass
class Eagle3TrainConfig:
    target: str = "smollm2-135m"
    out: str = "build/eagle3"
    work: str = "build/eagle3-train"
    data: str = ""               # JSON lines of {ids, prompt_len}; "": the target answers the seed tasks
    prompts: int = 175           # prompts answered when there is no --data
    max_new_tokens: int = 96
    layers: tuple = ()           # the target layers read (their inputs); (): 2, L // 2, L − 3
    kept_vocab: int = 32000      # the draft vocabulary's size (0: the target's whole vocabulary)
    steps: int = 1000
    batch_tokens: int = 4096
    lr: float = 3e-4
    warmup: int = 30
    unroll: int = 3
    max_len: int = 2048          # the drafter's max_seq_len (its rope tables)
    save_every: int = 50
    max_minutes: float = 0.0     # stop (checkpointed) after this long; rerun to go on. 0: no limit
    seed: int = 0
    device: str = "cpu"
    init: str = ""               # an EAGLE-3 drafter to start from (same target, layers, draft vocabulary)


# the settings a checkpoint resumes under (a larger --steps trains on)
RESUME_KEYS = ("target", "layers", "kept_vocab", "batch_tokens", "lr", "warmup", "unroll", "seed", "init")


def target_rows(cfg: Eagle3TrainConfig, src) -> list[dict]:
    """The training rows: --data's, or the target's greedy answers (kept in --work/data.jsonl, resumed)."""
    if cfg.data:
        return [json.loads(line) for line in Path(cfg.data).read_text().splitlines() if line.strip()]
    path = Path(cfg.work) / "data.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    prompts = _prompts(cfg, src)
    model = src.model.to(cfg.device)
    with path.open("a") as f, torch.no_grad():
        for ids in prompts[len(rows):]:
            x = torch.tensor([ids], device=cfg.device)
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            rows.append({"ids": out[0].tolist(), "prompt_len": len(ids)})
            f.write(json.dumps(rows[-1]) + "\n")
            f.flush()
    return rows


def _prompts(cfg: Eagle3TrainConfig, src) -> list[list[int]]:
    if src.tokenizer is None:   # a bare checkpoint: seeded random-token prompts
        rng = random.Random(cfg.seed)
        V = src.model.config.vocab_size
        return [[rng.randrange(V) for _ in range(rng.randint(6, 16))] for _ in range(cfg.prompts)]
    from specrt.export.train.data import seed_prompts
    tok, out = src.tokenizer, []
    for row in seed_prompts()[:cfg.prompts]:
        if tok.chat_template:
            ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                          tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
        else:
            ids = tok(row["prompt"])["input_ids"]
        out.append(list(ids))
    return out


def features(cfg: Eagle3TrainConfig, src, rows: list[dict], layers: tuple[int, ...], log=print) -> list[tuple]:
    """Per row: the aux states (n, k*d) and the target's top-16 logits at every position but the last (n − 1, 16),
    with their ids, float16. The labels come from `<data>.teacher/` where `specrt train data` wrote them for every
    row (the exact target's), else from the target. The target's transformers model runs in bfloat16 over batches
    of rows; the features are kept in --work/features/ in shards (a cut run resumes)."""
    import copy

    from rich.progress import Progress

    from specrt.export.train.data import padded
    folder = Path(cfg.work) / "features"
    folder.mkdir(parents=True, exist_ok=True)
    feats = [f for shard in sorted(folder.glob("*.pt")) for f in torch.load(shard, weights_only=True)]
    if len(feats) >= len(rows):
        return feats[:len(rows)]
    labels = _teacher(cfg, rows)
    log(f"labels: the target's top-16 in {Path(cfg.data).with_suffix('.teacher')}" if labels else
        "labels: the target's top-16, computed with the features")
    model = copy.deepcopy(src.model).to(device=cfg.device, dtype=torch.bfloat16).eval()
    runner = model if labels is None else model.model    # the LM head only where the labels are made here
    todo, shard = list(range(len(feats), len(rows))), []
    with Progress() as bar, torch.no_grad():
        task = bar.add_task("target features", total=len(todo))
        while todo:
            batch = [todo.pop(0)]   # rows in order (the shards are a prefix of the data), ≤ batch_tokens padded
            while todo and len(batch) < 32 and (len(batch) + 1) * max(len(rows[i]["ids"]) for i in
                                                                      (*batch, todo[0])) <= cfg.batch_tokens:
                batch.append(todo.pop(0))
            ids, _ = padded(rows, batch)
            out = runner(ids.to(cfg.device), output_hidden_states=True)                 # causal: padding last
            aux = torch.cat([out.hidden_states[j] for j in layers], -1).half().cpu()  # (b, S, k*d)
            for b, i in enumerate(batch):
                n = len(rows[i]["ids"])
                if labels is None:
                    values, index = out.logits[b, :n - 1].float().topk(TOP_K, -1)
                    label = (values.half().cpu(), index.int().cpu())
                else:
                    label = labels[i]
                shard.append((aux[b, :n].clone(), *label))
            bar.advance(task, len(batch))
            if len(shard) >= 256 or not todo:
                torch.save(shard, folder / "tmp")
                (folder / "tmp").replace(folder / f"{len(feats):07d}.pt")
                feats += shard
                shard = []
    return feats


def _teacher(cfg: Eagle3TrainConfig, rows: list[dict]) -> dict | None:
    """The top-16 labels `specrt train data` wrote beside --data, where they cover every row; else None."""
    from specrt.export.train.train_draft import load_labels
    if not cfg.data or not Path(cfg.data).with_suffix(".teacher").is_dir():
        return None
    labels = load_labels(cfg.data)
    ok = len(labels) == len(rows) and all(labels[i][0].shape == (len(r["ids"]) - 1, TOP_K)
                                          for i, r in enumerate(rows))
    return labels if ok else None


def draft_ids(rows: list[dict], vocab_size: int, size: int) -> list[int] | None:
    """The `size` ids the target writes most often (sorted), None where that is the whole vocabulary."""
    if size >= vocab_size:
        return None
    counts = torch.zeros(vocab_size)
    for r in rows:
        counts.index_add_(0, torch.tensor(r["ids"][r["prompt_len"]:], dtype=torch.long),
                          torch.ones(len(r["ids"]) - r["prompt_len"]))
    return sorted(counts.argsort(descending=True, stable=True)[:size].tolist())


def collate(batch: list[int], rows, feats, remap, device):
    """Rows padded at the end -> aux (b, S, k*d), ids (b, S) (token t + 1 at slot t), the target's top-16 at
    position t + 1 over the draft ids (-1: not a draft id) and values (b, S, 16), the answer slots' mask (b, S)."""
    S = max(len(rows[i]["ids"]) for i in batch) - 1
    width = feats[batch[0]][0].shape[1]
    aux, ids = torch.zeros(len(batch), S, width), torch.zeros(len(batch), S, dtype=torch.long)
    t_idx = torch.full((len(batch), S, TOP_K), -1, dtype=torch.long)
    t_val = torch.zeros(len(batch), S, TOP_K)
    mask = torch.zeros(len(batch), S, dtype=torch.bool)
    for b, i in enumerate(batch):
        n, m = len(rows[i]["ids"]), rows[i]["prompt_len"]
        a, values, index = feats[i]
        aux[b, :n - 1] = a[:-1].float()
        ids[b, :n - 1] = torch.tensor(rows[i]["ids"][1:])
        t_val[b, :n - 2], t_idx[b, :n - 2] = values[1:].float(), remap[index[1:].long()]  # (n − 1, 16)
        mask[b, max(m - 2, 0):n - 2] = True                                         # slot t predicts token t + 2
    return [t.to(device) for t in (aux, ids, t_idx, t_val, mask)]


def token_loss(model: Eagle3Model, hidden, t_idx, t_val, mask) -> tuple[torch.Tensor, float]:
    """Soft cross-entropy of the draft logits against the target's top-16 over the draft ids; the agreement with
    the target's greedy token where it is a draft id."""
    logq = torch.log_softmax(model.lm_head(model.norm(hidden[mask])).float(), -1)    # (N, K)
    idx, val = t_idx[mask], t_val[mask]
    p = torch.softmax(val.masked_fill(idx < 0, float("-inf")), -1).nan_to_num(0.0)
    loss = -(p * logq.gather(-1, idx.clamp(min=0))).sum(-1).mean()
    top1 = idx[:, 0] >= 0
    agree = (logq.argmax(-1) == idx[:, 0])[top1].float().mean().item() if top1.any() else 0.0
    return loss, agree


def ttt_passes(model: Eagle3Model, fused, ids, unroll: int) -> list[torch.Tensor]:
    """The training-time test's passes over whole sequences -> the layer's outputs of each pass [(B, S, d)].

    Pass 0 reads fused (B, S, d) (fc of the target's aux states) with causal attention. Pass k > 0 stands for tree
    level k: slot t reads the output of slot t − 1 of pass k − 1 (detached) and attends as level k does at draft
    time, where its node sits at position t = c + k after the last committed position c: to pass 0's keys at
    slots ≤ t − k (the drafter's cache, made from the target's features) and to pass j's key at slot t − k + j for
    j = 1..k (its ancestors in the tree, and itself)."""
    from specrt.export.eagle import attention_qkv
    layer, S = model.midlayer, fused.shape[1]
    cos, sin, emb = model.rope_cos[:S], model.rope_sin[:S], model.embed_tokens(ids)
    t = torch.arange(S, device=fused.device)
    keys, values, outs = [], [], []
    for k in range(unroll):
        feature = fused if k == 0 else torch.cat([fused[:, :1], outs[-1][:, :-1].detach()], 1)
        x, residual = layer.attention_input(emb, feature)                       # (B, S, 2d), (B, S, d)
        q, key, value = attention_qkv(layer.self_attn, x, cos, sin, model.args)
        keys.append(key)
        values.append(value)
        mask = torch.cat([t[None] <= t[:, None] - k] + [t[None] == t[:, None] - k + j for j in range(1, k + 1)], 1)
        y = torch.nn.functional.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                                             attn_mask=mask, enable_gqa=True)   # (B, H, S, D)
        h = residual + layer.self_attn.o_proj(y.transpose(1, 2).flatten(2))
        outs.append(h + layer.mlp(layer.post_attention_layernorm(h)))
    return outs


def step_loss(model: Eagle3Model, batch, unroll: int) -> tuple[torch.Tensor, dict]:
    aux, ids, t_idx, t_val, mask = batch
    fused = model.fuse(torch.zeros_like(aux[..., :model.config.hidden_size]), aux)  # (b, S, d)
    loss, stats = 0.0, {}
    for k, hidden in enumerate(ttt_passes(model, fused, ids, unroll)):
        loss_k, agree = token_loss(model, hidden, t_idx, t_val, mask)
        loss = loss + 0.8 ** k * loss_k
        stats["agreement" if k == 0 else f"own{k}_agreement"] = agree
    return loss, stats


def train_eagle3(target: str, out: str | Path, data: str = "", steps: int = 1000, device: str = "cpu",
                 work: str | Path | None = None, log=print, **options) -> Path:
    """Train (or resume) an EAGLE-3 drafter for `target` (any source `specrt export` takes) and write it to `out`;
    `options`: further Eagle3TrainConfig fields."""
    cfg = Eagle3TrainConfig(target=target, out=str(out), data=data, steps=steps, device=device,
                            work=str(work or Path(out).with_name(Path(out).name + "-work")), **options)
    return train(cfg, log)


def train(cfg: Eagle3TrainConfig, log=print) -> Path:
    from specrt.errors import InputError
    from specrt.export.model import from_hf
    from specrt.export.sources import load_source
    if cfg.device not in ("cpu", "cuda"):
        raise InputError(f"--device {cfg.device!r}: expected cpu or cuda")
    torch.manual_seed(cfg.seed)
    work = Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    src = load_source(cfg.target)
    L = src.model.config.num_hidden_layers
    layers = tuple(cfg.layers) or default_layers(L)
    rows = target_rows(cfg, src)
    feats = features(cfg, src, rows, layers, log)
    V = src.model.config.vocab_size
    kept = draft_ids(rows, V, cfg.kept_vocab or V)
    rope = {k: v for k in ("rope_theta", "rope_scaling", "rope_parameters")
            if (v := getattr(src.model.config, k, None)) is not None}
    target = from_hf(src.model.cpu().float(), cfg.max_len)
    model = new_eagle3(target, layers, kept, cfg.seed, rope)
    with torch.no_grad():   # the target's LM head rows and final norm to start from
        index = torch.arange(V) if kept is None else torch.tensor(kept)
        model.lm_head.weight.copy_(target.lm_head.weight.index_select(0, index))
        model.norm.weight.copy_(target.model.norm.weight)
    if cfg.init:
        _start_from(model, cfg.init, target)
    del src, target
    model = model.to(cfg.device).train()
    remap = torch.arange(V) if kept is None else torch.full((V,), -1, dtype=torch.long)
    if kept is not None:
        remap[torch.tensor(kept)] = torch.arange(len(kept))
    params = [p for n, p in model.named_parameters() if n.startswith(TRAINED)]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    val = [i for i in range(len(rows)) if i % 16 == 15][:32] or [len(rows) - 1]   # held out
    train_ids = [i for i in range(len(rows)) if i not in set(val)] or val
    state = {"step": 0, "epoch": 0, "batch": 0, "history": [], "wall_s": 0.0, "sessions": [], "train_loss": None}
    ckpt = work / "ckpt.pt"
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False, map_location=cfg.device)
        made = {k: saved["config"].get(k, getattr(Eagle3TrainConfig, k)) for k in RESUME_KEYS}
        if made != {k: getattr(cfg, k) for k in RESUME_KEYS}:
            raise InputError(f"{ckpt} was made with other settings ({made}): delete it to start over, or pass "
                             "another --work")
        model.load_state_dict(saved["model"], strict=False)
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        state = {"sessions": [], "train_loss": None, **saved["state"]}
        log(f"resumed at step {state['step']}")
    first = state["step"]

    def save():
        torch.save({"config": asdict(cfg), "model": model.trained_state(), "opt": opt.state_dict(),
                    "sched": sched.state_dict(), "state": state}, work / "ckpt.tmp")
        (work / "ckpt.tmp").replace(ckpt)

    started, stop_at = time.time() - state["wall_s"], time.time() + 60 * cfg.max_minutes
    autocast = torch.autocast(cfg.device, dtype=torch.bfloat16, enabled=cfg.device == "cuda" or _cpu_bf16())
    while state["step"] < cfg.steps and (not cfg.max_minutes or time.time() < stop_at):
        order = batches(train_ids, rows, cfg.batch_tokens, random.Random(cfg.seed + state["epoch"]))
        if state["batch"] >= len(order):
            state["epoch"], state["batch"] = state["epoch"] + 1, 0
            continue
        with autocast:
            loss, stats = step_loss(model, collate(order[state["batch"]], rows, feats, remap, cfg.device), cfg.unroll)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        state["step"] += 1
        state["batch"] += 1
        state["wall_s"], state["train_loss"] = time.time() - started, loss.item()
        if state["step"] % cfg.save_every == 0 or state["step"] == cfg.steps:
            with torch.no_grad(), autocast:
                held = [step_loss(model, collate([i], rows, feats, remap, cfg.device), cfg.unroll)[1] for i in val]
            m = {k: sum(h[k] for h in held) / len(held) for k in held[0]}
            state["history"].append({"step": state["step"], "train_loss": loss.item(), **m})
            log(f"step {state['step']}/{cfg.steps}: loss {loss.item():.3f}, held-out {m}")
            save()
    state["sessions"].append([first, state["step"]])
    save()
    if state["step"] < cfg.steps:
        log(f"stopped by --max-minutes at step {state['step']}/{cfg.steps}; rerun the command to resume")
    return _write(cfg, model.cpu().eval(), state, rows, layers, len(train_ids), len(val))


def _start_from(model: Eagle3Model, directory: str, target) -> None:
    """Load --init's trained weights into `model`; refused where its layers or draft vocabulary differ."""
    from specrt.errors import InputError
    from specrt.export.eagle3 import load_eagle3
    init = load_eagle3(directory, target)
    for what, mine, theirs in (("layers", model.aux_layers, init.aux_layers),
                               ("draft vocabulary", model.draft_ids, init.draft_ids)):
        tensors = isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)
        if not (torch.equal(mine, theirs) if tensors else mine == theirs):
            raise InputError(f"--init {directory}: its {what} differ from this run's (pass the same --layers and "
                             "--kept-vocab over the same data, or drop --init)")
    model.load_state_dict({k: v.float() for k, v in init.trained_state().items()}, strict=False)


def _cpu_bf16() -> bool:
    """Whether this CPU has bfloat16 instructions (AVX512-BF16, AMX): training steps in bfloat16 there take about
    0.6 of the float32 time (SmolLM2's drafter, 2 cores); elsewhere bfloat16 would be slower."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _write(cfg: Eagle3TrainConfig, model: Eagle3Model, state: dict, rows, layers, n_train: int, n_val: int) -> Path:
    out = Path(cfg.out)
    save_eagle3(model, out)
    record = {"config": asdict(cfg), "history": state["history"], "wall_s": state["wall_s"],
              "steps_done": state["step"], "steps": cfg.steps, "sessions": state["sessions"],
              "train_loss": state["train_loss"], "rows": len(rows), "train_rows": n_train, "val_rows": n_val}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    last = state["history"][-1] if state["history"] else {}
    held = ", ".join(f"{k} {v:.3f}" for k, v in last.items() if k.endswith("agreement"))
    (out / "README.md").write_text(
        f"# EAGLE-3 drafter for `{cfg.target}`\n\n"
        f"Trained by `specrt.export.train.train_eagle3` by self-distillation from the target: {len(rows)} rows of "
        f"its own answers ({n_train} for training, {n_val} held out), {state['step']} steps of "
        f"{cfg.batch_tokens} tokens on {cfg.device} ({state['wall_s'] / 60:.1f} min), {cfg.unroll} passes a step "
        f"(training-time test).\n\n"
        f"- reads the inputs of target layers {list(layers)} (`specrt_aux_layer_inputs` in config.json)\n"
        f"- draft vocabulary: {model.config.draft_vocab_size} of the target's {model.config.vocab_size} ids "
        f"(`d2t`, `t2d`)\n"
        f"- held-out agreement with the target's greedy token at the last evaluation: {held or 'not measured'}\n\n"
        f"Use: `specrt export --target {cfg.target} --eagle {out} --out ENGINES`, then `specrt build ENGINES`.\n"
        f"The layout is the published one (config.json + model.safetensors, `midlayer.*`), which vLLM and SGLang "
        f"also read.\n")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in asdict(Eagle3TrainConfig()).items():
        kind = (lambda s: tuple(int(i) for i in s.split(","))) if isinstance(default, tuple) else type(default)
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    train(Eagle3TrainConfig(**vars(ap.parse_args(argv))))


if __name__ == "__main__":
    main()
