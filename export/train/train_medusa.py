"""Train Medusa heads on the frozen target: K residual blocks on its last hidden state, each feeding the
target's own LM head; head k at position t learns the token t + k + 2 of self-distilled answers.

    python -m specrt.export.train.train_medusa --engines engines/default --data build/distill/data.jsonl \
        --work build/medusa-train --out export/drafters/smollm2-135m-medusa

Hidden states come from the target's own engine (one pass per row, cached in --work). Training is seeded,
shows a progress bar, saves a checkpoint every epoch and resumes from it. The output directory holds
fp16 safetensors, medusa_config.json and training.json (held-out top-1/top-5 accuracy per head).
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.progress import Progress

from specrt.export.medusa import MedusaHeads, save_heads


@dataclass
class MedusaConfig:
    engines: str = "engines/default"
    data: str = "build/distill/data.jsonl"
    work: str = "build/medusa-train"
    out: str = "export/drafters/smollm2-135m-medusa"
    heads: int = 4
    epochs: int = 3
    batch: int = 256
    lr: float = 1e-3
    val_fraction: float = 0.1
    seed: int = 0
    threads: int = 2


def features(cfg: MedusaConfig, gen) -> dict:
    """Hidden states (T, d) at answer positions and labels (T, K) (−100 past the end), cached on disk."""
    path = Path(cfg.work) / "features.pt"
    if path.is_file():
        return torch.load(path)
    rows = [json.loads(line) for line in Path(cfg.data).read_text().splitlines() if line.strip()]
    hidden, labels, row_of = [], [], []
    with Progress() as bar:
        task = bar.add_task("target hidden states", total=len(rows))
        for i, row in enumerate(rows):
            ids, start = row["ids"], row["prompt_len"]
            S = len(ids)
            out = gen.target.run_sequence(ids)
            h = out.hidden[0, start - 1:S - 1].clone()                                # (T_i, d)
            t = torch.arange(start - 1, S - 1)
            lab = torch.full((len(t), cfg.heads), -100, dtype=torch.int64)
            for k in range(cfg.heads):
                ok = t + k + 2 < S
                lab[ok, k] = torch.tensor(ids)[t[ok] + k + 2]
            hidden.append(h)
            labels.append(lab)
            row_of.append(torch.full((len(t),), i))
            bar.advance(task)
    feats = {"hidden": torch.cat(hidden), "labels": torch.cat(labels), "row": torch.cat(row_of),
             "lm_head": gen_lm_head(gen), "rows": len(rows)}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(feats, path)
    return feats


def gen_lm_head(gen) -> torch.Tensor:
    """The target's LM head weight, read from its exported source (the same weights the graph holds)."""
    from specrt.export.model import from_hf
    from specrt.export.sources import load_source
    src = load_source(gen.manifest["models"]["target"]["source"])
    return from_hf(src.model, 8).lm_head.weight.detach().clone()


def accuracy(heads: MedusaHeads, hidden, labels, batch: int = 1024) -> dict:
    K = labels.shape[1]
    hit1, hit5, total = torch.zeros(K), torch.zeros(K), torch.zeros(K)
    with torch.no_grad():
        for s in range(0, len(hidden), batch):
            logits = heads(hidden[s:s + batch])                                       # (b, K, V)
            top = logits.topk(5, dim=-1).indices                                      # (b, K, 5)
            lab = labels[s:s + batch]
            ok = lab >= 0
            hit1 += ((top[..., 0] == lab) & ok).sum(0)
            hit5 += ((top == lab[..., None]).any(-1) & ok).sum(0)
            total += ok.sum(0)
    return {"top1": (hit1 / total).tolist(), "top5": (hit5 / total).tolist(), "positions": total.tolist()}


def train(cfg: MedusaConfig) -> None:
    from specrt.generate import Generator
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    started = time.time()
    gen = Generator.from_engines(cfg.engines, threads=cfg.threads)
    f = features(cfg, gen)
    val_rows = torch.randperm(f["rows"], generator=torch.Generator().manual_seed(cfg.seed))[
        :max(1, int(cfg.val_fraction * f["rows"]))]
    is_val = torch.isin(f["row"], val_rows)
    train_h, train_y = f["hidden"][~is_val], f["labels"][~is_val]
    val_h, val_y = f["hidden"][is_val], f["labels"][is_val]
    heads = MedusaHeads(cfg.heads, f["hidden"].shape[1], f["lm_head"])
    for head in heads.heads:  # start as the identity: each head first predicts what the LM head predicts
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    params = [p for n, p in heads.named_parameters() if n.startswith("heads.")]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    ckpt = Path(cfg.work) / "checkpoint.pt"
    state = {"epoch": 0, "history": [], "wall_s": 0.0}
    if ckpt.is_file():
        saved = torch.load(ckpt)
        heads.load_state_dict(saved["heads"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resumed from {ckpt} after epoch {state['epoch']}")
    steps = (len(train_h) + cfg.batch - 1) // cfg.batch
    with Progress() as bar:
        task = bar.add_task("training Medusa heads", total=steps * cfg.epochs, completed=steps * state["epoch"])
        while state["epoch"] < cfg.epochs:
            order = torch.randperm(len(train_h), generator=torch.Generator().manual_seed(cfg.seed + state["epoch"]))
            for s in range(0, len(order), cfg.batch):
                idx = order[s:s + cfg.batch]
                logits = heads(train_h[idx])                                          # (b, K, V)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), train_y[idx].flatten(),
                                                         ignore_index=-100)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                bar.update(task, advance=1, description=f"training Medusa heads (loss {loss.item():.3f})")
            state["epoch"] += 1
            state["wall_s"] += time.time() - started
            started = time.time()
            metrics = accuracy(heads, val_h, val_y)
            state["history"].append({"epoch": state["epoch"], "train_loss": loss.item(), **metrics})
            bar.console.print(f"epoch {state['epoch']}: held-out top-1 {[round(x, 3) for x in metrics['top1']]}, "
                              f"top-5 {[round(x, 3) for x in metrics['top5']]}")
            torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
    out = Path(cfg.out)
    save_heads(heads, out)
    record = {"config": asdict(cfg), "history": state["history"], "wall_s": state["wall_s"],
              "train_positions": len(train_h), "val_positions": len(val_h), "rows": f["rows"]}
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"saved {out}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in asdict(MedusaConfig()).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    train(MedusaConfig(**vars(ap.parse_args(argv))))


if __name__ == "__main__":
    main()
