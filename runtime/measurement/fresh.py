"""One fresh process per prompt, as a user calls `specrt generate`: the default method (`auto`) against
`--method autoregressive`, alternating per prompt, side by side in one run.

    python -m specrt.measurement.fresh ENGINES [--prompts 16] [--max-new-tokens 96] [--untuned DIR] [--out F]

Each call is `specrt generate ENGINES --prompt TEXT --max-new-tokens N --json` (with `--method autoregressive` for
the baseline, nothing for auto). Reports per arm the decode speed (the stats' tokens over their generation time:
prefill and rounds), the processes' wall time (loading included), tokens per round and the method auto chose, and
whether every greedy output was identical to the baseline's. `--untuned DIR`: a third arm, auto on DIR (a copy of
ENGINES without its tuning: the cold start that the tuning's warm start replaces).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from specrt.measurement.bench import load_prompts

AUTO, PLAIN, COLD = "auto", "autoregressive", "auto (untuned)"


def call(engines: str, text: str, new_tokens: int, method: str | None, temperature: float) -> dict:
    """One `specrt generate` process: its JSON output and its wall time."""
    cmd = [sys.executable, "-m", "specrt.cli", "generate", engines, "--prompt", text, "--max-new-tokens",
           str(new_tokens), "--temperature", str(temperature), "--json"] + (["--method", method] if method else [])
    began = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise click.ClickException(f"{' '.join(cmd[:5])} ... failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "token_ids": out["token_ids"][0], **{k: out["stats"][k] for k in (
        "method", "method_from", "tokens", "rounds", "tokens_per_s", "mean_tokens_per_round")}}


def summary(rows: list[dict]) -> dict:
    """Per arm: tokens, decode seconds, tokens/s, wall seconds, tokens per round; and the ratios to the baseline."""
    out = {}
    arms = [m for m in (PLAIN, AUTO, COLD) if m in rows[0]]
    for m in arms:
        runs = [r[m] for r in rows]
        tokens = sum(r["tokens"] for r in runs)
        decode = sum(r["tokens"] / r["tokens_per_s"] for r in runs)
        out[m] = {"tokens": tokens, "decode_s": decode, "tokens_per_s": tokens / decode,
                  "wall_s": sum(r["wall_s"] for r in runs),
                  "tokens_per_round": sum(r["tokens"] - 1 for r in runs) / sum(r["rounds"] for r in runs),
                  "methods": sorted({f"{r['method']} ({r['method_from']})" for r in runs})}
    for m in arms[1:]:
        out[m].update(speedup=out[m]["tokens_per_s"] / out[PLAIN]["tokens_per_s"],
                      wall_ratio=out[PLAIN]["wall_s"] / out[m]["wall_s"],
                      identical=sum(r[m]["token_ids"] == r[PLAIN]["token_ids"] for r in rows))
    out["prompts"] = len(rows)
    return out


@click.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False))
@click.option("--prompts", "num_prompts", default=16, show_default=True, help="MT-Bench dev prompts (the first N).")
@click.option("--max-new-tokens", default=96, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--untuned", default=None, type=click.Path(exists=True, file_okay=False),
              help="Also auto on this engine directory (ENGINES without its tuning).")
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Every call's figures, as JSON.")
def main(engines, num_prompts, max_new_tokens, temperature, untuned, out):
    arms = {AUTO: (engines, None), PLAIN: (engines, PLAIN)} | ({COLD: (untuned, None)} if untuned else {})
    rows = []
    for i, prompt in enumerate(load_prompts(None, num_prompts)):
        order = list(arms)[i % len(arms):] + list(arms)[:i % len(arms)]   # each arm first in turn
        row = {m: call(arms[m][0], prompt.text, max_new_tokens, arms[m][1], temperature) for m in order}
        rows.append(row)
        click.echo(f"prompt {prompt.id}: " + ", ".join(
            f"{m}{'/' + r['method'] if m != PLAIN else ''} {r['tokens_per_s']:.1f} tokens/s ({r['wall_s']:.1f} s, "
            f"{r['mean_tokens_per_round']:.2f} tokens/round"
            f"{'' if m == PLAIN or r['token_ids'] == row[PLAIN]['token_ids'] else ', DIFFERENT'})"
            for m, r in row.items()))
    s = summary(rows)
    click.echo(f"\n{s['prompts']} prompts x {max_new_tokens} tokens, T = {temperature}, one process per call, "
               "the arms' order rotating per prompt")
    for m in arms:
        r = s[m]
        line = (f"{m}: {r['tokens']} tokens, {r['tokens_per_s']:.1f} tokens/s decoding, {r['wall_s']:.1f} s of "
                f"process wall time, {r['tokens_per_round']:.2f} tokens/round, method {', '.join(r['methods'])}")
        if m != PLAIN:
            line += (f"; {r['speedup']:.2f}x autoregressive decoding, {r['wall_ratio']:.2f}x its wall time, "
                     f"greedy output identical on {r['identical']} of {s['prompts']} prompts")
        click.echo(line)
    if out:
        Path(out).write_text(json.dumps({"rows": rows, "summary": s}, indent=1))


if __name__ == "__main__":
    main()
