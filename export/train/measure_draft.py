"""Measure a target + draft engine set on the MT-Bench prompts: acceptance α at a fixed γ (per token, and
accepted over proposed), acceptance per draft position, the cost ratio c, and the speedup of `draft` over
`autoregressive` at each temperature; at temperature 0 also the draft's teacher-forced agreement with the
target (its argmax against the next token of the target's own greedy answer, at every answer position).
Runs are interleaved prompt by prompt (plain, then speculative, same prompt and seed) so that a shared machine
slows both alike.

    python -m specrt.export.train.measure_draft engines/pair --num-prompts 10 --max-new-tokens 64 --gamma 5
"""
from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

import torch


def mt_bench(n: int) -> list[str]:
    rows = resources.files("specrt").joinpath("data/mt_bench.jsonl").read_text().splitlines()
    return [json.loads(r)["turns"][0] for r in rows[:n]]


def per_token_alpha(mean_accepted: float, gamma: int) -> float:
    """The per-token acceptance probability α of the i.i.d. model (Leviathan et al.) that explains the mean
    number of drafts accepted per round: α(1 − α^γ)/(1 − α) = mean_accepted, solved by bisection. Accepted over
    proposed understates α, since drafts after the first rejection count as proposed and never accepted."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(1, gamma + 1)) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def agreement(draft, prompt_ids: list[int], answer: list[int]) -> tuple[int, int]:
    """(matches, positions): the draft engine's argmax after prompt + answer[:j] against answer[j], j ≥ 1."""
    if len(answer) < 2:
        return 0, 0
    logits = draft.run_sequence(prompt_ids + answer[:-1], num_logits=len(answer) - 1).logits[0]
    return int((logits.argmax(-1) == torch.tensor(answer[1:])).sum()), len(answer) - 1


def measure(engines: str, num_prompts: int, max_new_tokens: int, gamma: int, temperatures: list[float],
            seed: int = 0) -> dict:
    from rich.progress import track

    from specrt import Generator

    gen = Generator.from_engines(engines)
    costs = gen.costs()
    out = {"engines": engines, "num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "gamma": gamma,
           "draft_step_ms": 1e3 * costs.draft_step, "target_step_ms": 1e3 * costs.verify[1],
           "verify_ms": {k: 1e3 * v for k, v in costs.verify.items()}, "c": costs.c, "by_temperature": {}}
    prompts = mt_bench(num_prompts)
    for temp in temperatures:
        acc = prop = 0
        per_pos = [[0, 0] for _ in range(gamma)]
        time_plain = time_spec = tokens_plain = tokens_spec = 0.0
        same = hits = positions = 0
        for i, text in enumerate(track(prompts, description=f"T={temp}")):
            kw = dict(prompt=text, max_new_tokens=max_new_tokens, temperature=temp, seed=seed + i)
            plain = gen.generate(method="autoregressive", **kw)
            spec = gen.generate(method="draft", gamma=gamma, **kw)
            same += plain.token_ids == spec.token_ids
            if temp == 0:
                h, n = agreement(gen.draft, gen.encode(text), plain.token_ids[0])
                hits, positions = hits + h, positions + n
            time_plain += plain.stats["tokens"] / plain.stats["tokens_per_s"]
            time_spec += spec.stats["tokens"] / spec.stats["tokens_per_s"]
            tokens_plain += plain.stats["tokens"]
            tokens_spec += spec.stats["tokens"]
            rounds = spec.stats["rounds"]
            a = spec.stats["acceptance_rate"] or 0.0
            n_prop = rounds * gamma if rounds else 0
            for j, rate in enumerate(spec.stats["acceptance_per_position"][:gamma]):
                per_pos[j][0] += rate * rounds
                per_pos[j][1] += rounds
            acc, prop = acc + a * n_prop, prop + n_prop
        rounds = per_pos[0][1]
        alpha = per_token_alpha(acc / rounds, gamma) if rounds else None
        reached = [a / p if p else None for a, p in per_pos]
        tps_plain, tps_spec = tokens_plain / time_plain, tokens_spec / time_spec
        out["by_temperature"][str(temp)] = {
            "alpha": alpha, "accepted_over_proposed": acc / prop if prop else None,
            "mean_accepted": acc / rounds if rounds else None,
            "acceptance_per_position": reached,
            "conditional_acceptance_per_position": [
                r / prev if r is not None and prev else None for r, prev in zip(reached, [1.0] + reached[:-1])],
            "tokens_per_s_autoregressive": tps_plain, "tokens_per_s_draft": tps_spec,
            "speedup": tps_spec / tps_plain,
            "predicted_speedup": costs.predicted_speedup(alpha, gamma) if alpha is not None else None,
            "identical_outputs": same,
            "teacher_forced_agreement": hits / positions if positions else None,
        }
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engines")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    res = measure(a.engines, a.num_prompts, a.max_new_tokens, a.gamma, [float(t) for t in a.temperatures.split(",")])
    text = json.dumps(res, indent=1)
    if a.out:
        a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
