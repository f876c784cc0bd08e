"""One fresh process per prompt, as a user calls `specrt generate`: the default method (`auto`) against
`--method autoregressive`, alternating per prompt, side by side in one run.

    python -m specrt.measurement.fresh ENGINES [--prompts 16] [--max-new-tokens 96] [--out fresh.json]

Each call is `specrt generate ENGINES --prompt TEXT --max-new-tokens N --json` (with `--method autoregressive` for
the baseline, nothing for auto). Reports per method the decode speed (the stats' tokens over their generation
time: prefill and rounds), the processes' wall time (loading included), auto's tokens per round and the method
it chose, and whether every greedy output was identical.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import click

from specrt.measurement.bench import load_prompts

AUTO, PLAIN = "auto", "autoregressive"


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
    """Per method: tokens, decode seconds, tokens/s, wall seconds, tokens per round; and the ratios."""
    out = {}
    for m in (PLAIN, AUTO):
        runs = [r[m] for r in rows]
        tokens = sum(r["tokens"] for r in runs)
        decode = sum(r["tokens"] / r["tokens_per_s"] for r in runs)
        out[m] = {"tokens": tokens, "decode_s": decode, "tokens_per_s": tokens / decode,
                  "wall_s": sum(r["wall_s"] for r in runs),
                  "tokens_per_round": sum(r["tokens"] - 1 for r in runs) / sum(r["rounds"] for r in runs),
                  "methods": sorted({f"{r['method']} ({r['method_from']})" for r in runs})}
    out["speedup"] = out[AUTO]["tokens_per_s"] / out[PLAIN]["tokens_per_s"]
    out["wall_ratio"] = out[PLAIN]["wall_s"] / out[AUTO]["wall_s"]
    out["identical"] = sum(r[AUTO]["token_ids"] == r[PLAIN]["token_ids"] for r in rows)
    out["prompts"] = len(rows)
    return out


@click.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False))
@click.option("--prompts", "num_prompts", default=16, show_default=True, help="MT-Bench dev prompts (the first N).")
@click.option("--max-new-tokens", default=96, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.option("--out", default=None, type=click.Path(dir_okay=False), help="Every call's figures, as JSON.")
def main(engines, num_prompts, max_new_tokens, temperature, out):
    rows = []
    for i, prompt in enumerate(load_prompts(None, num_prompts)):
        row = {}
        for m in (AUTO, PLAIN) if i % 2 == 0 else (PLAIN, AUTO):
            row[m] = call(engines, prompt.text, max_new_tokens, None if m == AUTO else m, temperature)
        rows.append(row)
        a, p = row[AUTO], row[PLAIN]
        click.echo(f"prompt {prompt.id}: autoregressive {p['tokens_per_s']:.1f} tokens/s ({p['wall_s']:.1f} s), "
                   f"auto/{a['method']} {a['tokens_per_s']:.1f} tokens/s ({a['wall_s']:.1f} s), "
                   f"{a['mean_tokens_per_round']:.2f} tokens/round, "
                   f"{'identical' if a['token_ids'] == p['token_ids'] else 'DIFFERENT'}")
    s = summary(rows)
    click.echo(f"\n{s['prompts']} prompts x {max_new_tokens} tokens, T = {temperature}, one process per call, "
               f"alternating per prompt; greedy outputs identical: {s['identical']} of {s['prompts']}")
    for m in (PLAIN, AUTO):
        r = s[m]
        click.echo(f"{m}: {r['tokens']} tokens, {r['tokens_per_s']:.1f} tokens/s decoding, {r['wall_s']:.1f} s of "
                   f"process wall time, {r['tokens_per_round']:.2f} tokens/round, method {', '.join(r['methods'])}")
    click.echo(f"auto / autoregressive: {s['speedup']:.2f}x decoding, {s['wall_ratio']:.2f}x process wall time")
    if out:
        Path(out).write_text(json.dumps({"rows": rows, "summary": s}, indent=1))


if __name__ == "__main__":
    main()
