"""EAGLE's speedup on a machine, projected from a recorded acceptance trace and that machine's measured costs.

A speculative round's gain is (tokens it makes) × (a plain step's time) / (its own time). The tokens depend on
the drafter, the target and the text, not on the hardware (greedy: the same tokens anywhere, near ties aside);
the times depend on the hardware. `record` runs EAGLE with full trees every round on real engines and keeps,
per round of one sequence, what an adaptive round chooses its size from (the verified nodes' scores, most
probable first, and their depths) and which of those nodes the target accepted. `project` replays the rounds
against a machine's costs (target passes over 1..N tokens, one drafter pass, the loop's own time a round) with
the runtime's rules: a round takes a plain step or grows a tree as the rates measured so far say (TreePolicy); a
tree round grows a level while another can pay (`level_pays`, as EagleDrafter does), then verifies the number of
its most probable nodes with the most expected tokens per second, its scores scaled by how well they have
predicted acceptance. A round that verifies fewer nodes keeps the accepted
path's prefix among them (exact at T = 0; at T > 0 the same draw at every node).

`specrt gpu-check` uses it where the real weights cannot be on the device (its export is random there, and a
random drafter's acceptance says nothing): the shipped drafter's trace, recorded on the CPU, replayed against
the GPU's measured costs. It is a model: the trace keeps a round's verified nodes only, so the growth rule sees
part of each level's frontier (it grows a little less than the runtime), and a plain step moves on to the next
recorded round. How close it comes is measured on the CPU, where both can be run (docs/gpu.md, "The EAGLE projection").
"""
from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import numpy as np
import torch

from specrt.decoding.adaptive import Costs, TreePolicy
from specrt.decoding.eagle import DECAY, Figures, _best_size, level_pays
from specrt.errors import InputError

FORMAT = 1


def record(gen, prompts: list[list[int]], max_new_tokens: int = 96, temperature: float = 0.0, seed: int = 0,
           log=None) -> dict:
    """EAGLE with full trees every round (`adaptive=False`) on each prompt (token ids, one at a time) -> the
    trace: per verified round, [kind ("tree", or "lookup" for a round of prompt lookup's chain alone), the
    nodes' scores most probable first, their depths, the accepted nodes' ranks in that order], and the number
    of rounds of each prompt (`prompts`)."""
    if not prompts:
        raise InputError("record: no prompts")
    rounds, per_prompt, started = [], [], time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as generate() runs its loop
    try:
        for i, ids in enumerate(prompts):
            batch = gen.batch(1, len(ids) + max_new_tokens + 1, method="eagle", temperature=temperature,
                              seed=seed + i, adaptive=False)
            batch.drafter.trace = trace = []
            batch.add(ids, max_new_tokens)
            while True:
                batch.retire()
                if not batch.run.batch:
                    break
                batch.step()
            rounds += [[kind, [round(s, 5) for s in scores], depths, accepted]
                       for kind, scores, depths, accepted in trace]
            per_prompt.append(len(trace))
            if log:
                log(f"prompt {i + 1}/{len(prompts)}: {len(trace)} rounds, {time.perf_counter() - started:.0f} s")
    finally:
        torch.set_num_threads(threads)
    shape = batch.drafter.shape
    return {"format": FORMAT, "temperature": temperature, "max_new_tokens": max_new_tokens,
            "prompts": per_prompt, "shape": [shape.top_k, shape.depth, shape.nodes],
            "tokens_per_round": 1 + float(np.mean([len(r[3]) for r in rounds])), "rounds": rounds}


def save(trace: dict, path: str | Path) -> None:
    with gzip.open(path, "wt") as f:
        json.dump(trace, f, separators=(",", ":"))


def load(path: str | Path) -> dict:
    try:
        with gzip.open(path, "rt") as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: not an EAGLE trace ({e}); make one with `python -m specrt.measurement.projection`") from e
    if trace.get("format") != FORMAT:
        raise InputError(f"{path}: trace format {trace.get('format')!r}, this specrt reads {FORMAT}")
    return trace


def project(trace: dict, costs: Costs, draft_s: float, host_s: float, plain_host_s: float,
            adaptive: bool = True) -> dict:
    """Replay the trace's rounds against seconds measured on a machine: `costs.pass_time(k)` a target pass over
    k tokens, `draft_s` one drafter pass (the catch-up or a tree level), `host_s` the loop's own time in a tree
    round, `plain_host_s` in a plain step (autoregressive decoding's). -> the projected speedup over
    autoregressive decoding, tokens per round, and the share of rounds that verify a tree. `adaptive=False`:
    every round grows every level and verifies its whole tree (EAGLE-2 as published)."""
    plain = costs.pass_time(1) + plain_host_s
    policy = TreePolicy()                 # a tree round or a plain step, from the rates measured so far
    figures = Figures()                   # the scores' calibration, decayed as the drafter's
    tokens = seconds = 0.0
    trees = 0
    starts = set(np.cumsum([0] + trace["prompts"][:-1]).tolist())
    for i, (kind, scores, depths, got) in enumerate(trace["rounds"]):
        if i in starts:   # a request: the tree policy and the calibration start from the last one's figures
            policy, figures = policy.following(), figures.following()
        if adaptive and not policy.choose():
            policy.update(False, 1.0, plain)
            tokens, seconds = tokens + 1, seconds + plain
            continue
        scores, lookup = np.asarray(scores, np.float64), kind == "lookup"
        scale = figures.calibration[0] / figures.calibration[1]
        p = np.minimum(scores * (1.0 if lookup else scale), 1.0)
        made, spent, chosen = _round(p, np.asarray(depths), got, costs, draft_s, trace["shape"], adaptive, lookup)
        spent += host_s
        tokens, seconds, trees = tokens + made, seconds + spent, trees + 1
        policy.update(True, made, spent)
        if not lookup:
            (accepted, predicted), (promised, count) = figures.calibration, figures.promise
            forecast = float(scores[chosen].sum())
            figures.calibration = [DECAY * accepted + made - 1, DECAY * predicted + forecast]
            figures.promise = [DECAY * promised + scale * forecast, DECAY * count + 1]
    rounds = max(1, len(trace["rounds"]))
    return {"speedup": round(float(tokens / seconds * plain), 4) if seconds else None,
            "tokens_per_round": round(tokens / rounds, 4), "tree_rounds": round(trees / rounds, 4)}


def _round(p: np.ndarray, depths: np.ndarray, got: list, costs: Costs, draft_s: float, shape, adaptive: bool,
           lookup: bool) -> tuple[int, float, np.ndarray]:
    """One tree round as the runtime runs it (EagleDrafter._grow): drafter passes while another level can pay
    (`level_pays`), then the nodes of the levels grown with the most expected tokens per second. `p`: the nodes'
    scaled scores, most probable first. -> (tokens made, seconds of drafting and the verify pass, the verified
    nodes' indices)."""
    k, levels = shape[0], shape[1]
    if lookup:              # prompt lookup's chain alone: no drafter pass
        passes, candidates = 0, np.arange(len(p))
    elif not adaptive:
        passes, candidates = levels, np.arange(len(p))
    else:
        passes = 1          # the catch-up pass gives the first level
        while passes < levels and level_pays(costs, p[depths <= passes], p[depths == passes][:k],
                                             draft_s * passes, draft_s, k):
            passes += 1
        candidates = np.flatnonzero(depths <= passes)
    q = p[candidates]
    n = _best_size(costs, q, draft_s * passes) if adaptive else len(q)
    chosen = candidates[:n]
    verified = set(chosen.tolist())
    kept = next((j for j, r in enumerate(got) if r not in verified), len(got))
    return 1 + kept, draft_s * passes + costs.pass_time(n + 1), chosen


def shipped_trace(temperature: float = 0.0) -> Path:
    """The shipped EAGLE drafter's trace at this temperature (0 or 0.7), next to its weights."""
    from specrt.export.sources import DRAFTERS_DIR
    return DRAFTERS_DIR / "smollm2-135m-eagle" / ("rounds_t0.json.gz" if temperature == 0 else "rounds_t07.json.gz")


def main(argv=None) -> None:
    import argparse
    from specrt.measurement.bench import load_prompts
    from specrt.decoding.generate import Generator
    ap = argparse.ArgumentParser(description="Record an EAGLE acceptance trace (full trees every round) of the "
                                 "engine set's drafter, for specrt.measurement.projection and gpu-check.")
    ap.add_argument("engines", help="an engine set with an EAGLE drafter (the default: engines/default)")
    ap.add_argument("--out", required=True, help="the trace file (.json.gz)")
    ap.add_argument("--prompts", type=Path, default=None, help="a prompt file (default: the MT-Bench dev prompts)")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    gen = Generator.from_engines(args.engines)
    if not gen.has("eagle"):
        raise SystemExit(f"{args.engines} has no EAGLE drafter: export with --eagle DIR")
    prompts = [gen.encode(p.text) for p in load_prompts(args.prompts, args.num_prompts)]
    trace = record(gen, prompts, args.max_new_tokens, args.temperature, args.seed, log=print)
    save(trace, args.out)
    print(f"{args.out}: {len(trace['rounds'])} rounds, {trace['tokens_per_round']:.3f} tokens a round (full trees)")


if __name__ == "__main__":
    main()
