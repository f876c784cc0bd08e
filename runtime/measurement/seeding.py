"""What a seed that reproduces across methods costs in acceptance, measured against standard rejection sampling.

    python -m specrt.measurement.seeding --engines ENGINES [--prompts 10] [--max-new-tokens 64] [--temperature 0.7]
        [--methods draft,medusa,eagle]

For each method and each MT-Bench dev prompt, sampled twice with the same seed, back to back: `seeding="position"`
(the default: each position's draw fixed by the seed, drafts checked against it; the same tokens with every method)
and `seeding="stream"` (the seed starts the rejection rules' random draws: Leviathan/Chen's rule for the draft
model's sampled chain, recursive rejection over siblings for the trees). Fixed speculation (adaptive off, the draft
model at γ = 4) so that both arms propose alike. Prints per method the acceptance rate (accepted drafts over
proposed, the prompts' mean), tokens per round and tokens/s of both arms, summed over the prompts, and whether the position arm's
tokens equal the autoregressive ones of the same seed (they must).
"""
from __future__ import annotations

import time

import click

from specrt.measurement.bench import load_prompts


def measure(gen, methods, prompts, max_new_tokens: int, temperature: float) -> list[dict]:
    rows = []
    refs = {}
    for i, p in enumerate(prompts):
        ids = p.ids or gen.encode(p.text)
        refs[i] = gen.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, method="autoregressive",
                               temperature=temperature, seed=i).token_ids[0]
    for method in methods:
        sums = {arm: dict(rates=[], tokens=0, rounds=0, seconds=0.0) for arm in ("position", "stream")}
        same = 0
        for i, p in enumerate(prompts):
            ids = p.ids or gen.encode(p.text)
            for arm in (("position", "stream") if i % 2 == 0 else ("stream", "position")):
                started = time.perf_counter()
                out = gen.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, method=method,
                                   temperature=temperature, seed=i, seeding=arm, adaptive=False,
                                   gamma=4 if method == "draft" else None)
                s, acc = sums[arm], out.stats
                s["seconds"] += time.perf_counter() - started
                s["rates"].append(acc["acceptance_rate"] or 0.0)
                s["tokens"] += acc["tokens"] - 1   # the first token comes from the prefill
                s["rounds"] += acc["rounds"]
                if arm == "position":
                    same += out.token_ids[0] == refs[i]
        rows.append(dict(method=method, same=same, prompts=len(prompts), **{
            arm: dict(acceptance=sum(s["rates"]) / len(s["rates"]), tokens_per_round=s["tokens"] / s["rounds"],
                      tokens_per_s=s["tokens"] / s["seconds"]) for arm, s in sums.items()}))
    return rows


@click.command()
@click.option("--engines", "engines", type=click.Path(exists=True, file_okay=False), default="engines/default",
              show_default=True, help="the engine set")
@click.option("--prompts", "n_prompts", type=int, default=10, show_default=True, help="MT-Bench dev prompts")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.7, show_default=True)
@click.option("--methods", default="draft,medusa,eagle", show_default=True, help="comma-separated methods")
def main(engines, n_prompts, max_new_tokens, temperature, methods):
    """Acceptance with seeds that fix each position's draw, against seeded standard rejection sampling."""
    from specrt.decoding.generate import Generator
    gen = Generator.from_engines(engines)
    rows = measure(gen, methods.split(","), load_prompts(None, n_prompts), max_new_tokens, temperature)
    click.echo(f"T = {temperature}, {n_prompts} MT-Bench dev prompts x {max_new_tokens} tokens, adaptive off "
               "(draft: gamma 4)\n")
    click.echo("| method | acceptance: position | stream | tokens/round: position | stream | tokens/s: position | "
               "stream | position = autoregressive |")
    click.echo("|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["position"], r["stream"]
        click.echo(f"| {r['method']} | {a['acceptance']:.3f} | {b['acceptance']:.3f} | {a['tokens_per_round']:.2f} | "
                   f"{b['tokens_per_round']:.2f} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
                   f"{r['same']}/{r['prompts']} |")


if __name__ == "__main__":
    main()
