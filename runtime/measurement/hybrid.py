"""The time of a target pass of Granite 4.0-H (Mamba-2 beside attention) against a Llama of the same widths,
through the real ONNX Runtime engines.

    python -m specrt.measurement.hybrid [--hidden 512] [--layers 12] [--contexts 64,1024] [--reps 20] [--threads N]

Two random models, built for the CPU as `specrt build` builds them: a GraniteMoeHybrid of `--layers` layers, a
quarter of them attention (the rest Mamba-2: 2 * hidden / 64 heads of 64, state 64, one group, conv kernel 4; the
shared MLP alone, no experts, no rope, as Granite 4.0-H-Micro), and a Llama of the same hidden, MLP, head and
vocabulary widths with attention in every layer. Each pass runs S = 1 and S = 8 new tokens after each context's
cached positions; the best of `--reps` passes per (model, context, S), the models taking turns. Prints a markdown
table, and the cache bytes a position takes in each (export/hybrid.py: a Mamba-2 layer keeps its conv input and dt
of every position, a pass recomputes its state from them).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import click
import torch

from specrt.measurement.moe import pass_time

WIDTHS = (1, 8)


def engine_of(work: Path, name: str, model, max_seq_len: int, threads: int | None = None):
    from specrt.decoding.generate import Generator
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    model.save_pretrained(work / f"{name}-src")
    export_engines(str(work / f"{name}-src"), work / name, max_seq_len=max_seq_len, log=lambda *_: None)
    build(work / name, "onnxruntime", log=lambda *_: None)
    return Generator.from_engines(work / name, threads=threads).target


def models(hidden: int, layers: int, vocab: int, max_len: int) -> dict:
    import transformers
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                  num_key_value_heads=max(1, hidden // 128), max_position_embeddings=max_len,
                  tie_word_embeddings=False)
    attention = {round(i * layers / (layers // 4)) + 2 for i in range(layers // 4)}   # spread, as Granite's are
    types = ["attention" if i in attention else "mamba" for i in range(layers)]
    torch.manual_seed(0)
    return {
        f"granite 4.0-h ({types.count('attention')} attention, {types.count('mamba')} mamba-2)":
            transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
                intermediate_size=4 * hidden, shared_intermediate_size=4 * hidden, layer_types=types,
                num_local_experts=0, mamba_n_heads=2 * hidden // 64, mamba_d_head=64, mamba_d_state=64,
                mamba_n_groups=1, mamba_d_conv=4, position_embedding_type=None, **common)),
        f"llama ({layers} attention)": transformers.LlamaForCausalLM(
            transformers.LlamaConfig(intermediate_size=4 * hidden, **common)),
    }


@click.command()
@click.option("--hidden", default=512, show_default=True)
@click.option("--layers", default=12, show_default=True)
@click.option("--vocab", default=8192, show_default=True)
@click.option("--contexts", default="64,1024", show_default=True, help="Cached positions before a pass.")
@click.option("--reps", default=20, show_default=True)
@click.option("--threads", default=None, type=int, help="ONNX Runtime's threads (default: specrt's own).")
def main(hidden, layers, vocab, contexts, reps, threads):
    contexts = [int(c) for c in contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        built = models(hidden, layers, vocab, max(contexts) + max(WIDTHS) + 8)
        engines = {name: engine_of(Path(tmp), f"m{i}", m, max(contexts) + max(WIDTHS), threads)
                   for i, (name, m) in enumerate(built.items())}
        best = {(name, c, S): float("inf") for name in engines for c in contexts for S in WIDTHS}
        g = torch.Generator().manual_seed(0)
        for _ in range(reps):
            for name, engine in engines.items():
                for c in contexts:
                    for S in WIDTHS:
                        best[name, c, S] = min(best[name, c, S], pass_time(engine, S, c, g))
    cols = [(c, S) for c in contexts for S in WIDTHS]
    print(f"| ms a pass ({layers} layers, hidden {hidden}, vocab {vocab}, float32, {threads or 'default'} threads) | "
          + " | ".join(f"ctx {c}, S = {S}" for c, S in cols) + " | cache bytes a position |")
    print("|---" * (len(cols) + 2) + "|")
    for name, engine in engines.items():
        s = engine.spec
        per_position = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * 4
        print(f"| {name} | " + " | ".join(f"{best[name, c, S] * 1e3:.1f}" for c, S in cols) + f" | {per_position:,} |")


if __name__ == "__main__":
    main()
