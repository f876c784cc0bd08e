"""The time of a target pass of a mixture of experts against dense models, through the real ONNX Runtime engines.

    python -m specrt.measurement.moe [--experts 8] [--top-k 2] [--hidden 256] [--layers 4] [--reps 30]
                                     [--target-weights float32|int8|int4] [--threads N]

Three random models of one shape (Mixtral and Mistral layers, built for the CPU as `specrt build` builds them): the mixture (E experts of intermediate size I, k a token), a dense model of the same active size (one MLP of
k * I) and one of the same total size (E * I). Each pass runs S = 1 and S = 8 new tokens of random ids (so that a
pass's tokens choose different experts, as text does) after `--context` cached positions; the best of `--reps`
passes, the models taking turns (`--threads`: ONNX Runtime's threads; 1 measures a machine that others load more
steadily). Prints a markdown table.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click
import torch

WIDTHS = (1, 8)


def engine_of(work: Path, name: str, model, weights: str, threads: int | None = None) -> object:
    from specrt.decoding.generate import Generator
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    model.save_pretrained(work / f"{name}-src")
    export_engines(str(work / f"{name}-src"), work / name, max_seq_len=256, log=lambda *_: None)
    build(work / name, "onnxruntime", log=lambda *_: None, target_weights=weights)
    return Generator.from_engines(work / name, threads=threads).target


def models(experts: int, top_k: int, hidden: int, layers: int, size: int, vocab: int) -> dict:
    import transformers
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                  num_key_value_heads=max(1, hidden // 128), max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    return {
        f"mixtral, {experts} experts of {size}, {top_k} a token": transformers.MixtralForCausalLM(
            transformers.MixtralConfig(intermediate_size=size, num_local_experts=experts, num_experts_per_tok=top_k,
                                       **common)),
        f"dense, the active size (MLP of {top_k * size})": transformers.MistralForCausalLM(
            transformers.MistralConfig(intermediate_size=top_k * size, **common)),
        f"dense, the total size (MLP of {experts * size})": transformers.MistralForCausalLM(
            transformers.MistralConfig(intermediate_size=experts * size, **common)),
    }


def pass_time(engine, S: int, context: int, generator: torch.Generator) -> float:
    from specrt.engines.base import chain_mask
    cache = engine.new_cache(1, context + S)
    cache.truncate(context)
    ids = torch.randint(0, engine.spec["vocab_size"], (1, S), generator=generator)
    pos = (cache.past_len[:, None] + torch.arange(S)).contiguous()
    began = time.perf_counter()
    engine.forward(ids, pos, cache.past_len, chain_mask(1, S), S, cache)
    return time.perf_counter() - began


@click.command()
@click.option("--experts", default=8, show_default=True)
@click.option("--top-k", default=2, show_default=True)
@click.option("--hidden", default=256, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--size", default=768, show_default=True, help="Each expert's intermediate size.")
@click.option("--vocab", default=2048, show_default=True)
@click.option("--context", default=64, show_default=True, help="Cached positions before each pass.")
@click.option("--reps", default=30, show_default=True)
@click.option("--target-weights", type=click.Choice(["float32", "int8", "int4"]), default="float32", show_default=True)
@click.option("--threads", default=None, type=int, help="ONNX Runtime's threads (default: specrt's own).")
def main(experts, top_k, hidden, layers, size, vocab, context, reps, target_weights, threads):
    with tempfile.TemporaryDirectory() as tmp:
        engines = {name: engine_of(Path(tmp), f"m{i}", m, target_weights, threads)
                   for i, (name, m) in enumerate(models(experts, top_k, hidden, layers, size, vocab).items())}
        best = {(name, S): float("inf") for name in engines for S in WIDTHS}
        g = torch.Generator().manual_seed(0)
        for _ in range(reps):
            for name, engine in engines.items():
                for S in WIDTHS:
                    best[name, S] = min(best[name, S], pass_time(engine, S, context, g))
    print(f"| model ({layers} layers, hidden {hidden}, vocab {vocab}, {target_weights}, {threads or 'default'} "
          "threads) | S = 1 (ms) | S = 8 (ms) "
          "| S = 8 / S = 1 |")
    print("|---|---|---|---|")
    for name in engines:
        one, eight = best[name, 1] * 1e3, best[name, 8] * 1e3
        print(f"| {name} | {one:.2f} | {eight:.2f} | {eight / one:.2f} |")


if __name__ == "__main__":
    main()
