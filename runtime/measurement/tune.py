"""`specrt tune ENGINES`: which method is fastest on this machine, and what lets a new process start warm.

Measures, in one process: the tree shapes (as `tune-tree` does: EAGLE's dynamic tree, the Medusa heads' tree; on
float32 targets), the target's pass times by batch size and width, then every method the engine set can run on
calibration prompts (never the benchmark set), greedy and sampled, alternating the methods prompt by prompt so
that a slow spell of a shared machine falls on all of them; and again with a grammar (GRAMMAR_SCHEMA, on prompts that
ask for JSON), where a grammar's forced tokens and its masks change what pays. Records the fastest per regime and
what the runs without a grammar left the adaptive policies in the engine directory (specrt.decoding.tuning);
`--method auto` uses it, per request by whether it has a grammar.
"""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from specrt.decoding import tuning
from specrt.decoding.adaptive import Costs
from specrt.decoding.calibrate import CALIBRATION_PROMPTS, calibrate, save_tree
from specrt.decoding.generate import MAX_GAMMA, METHODS, Generator
from specrt.engines.manifest import read_manifest
from specrt.errors import InputError


# The grammar regimes' workload: a JSON schema of its own making (keys the grammar forces, free strings, numbers, an
# enum and an array) on prompts that ask for such an object (never the benchmark set).
GRAMMAR_SCHEMA = {"type": "object", "additionalProperties": False,
                  "required": ["title", "author", "year", "genre", "keywords", "summary"],
                  "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                 "year": {"type": "integer"}, "genre": {"enum": ["fiction", "science", "history",
                                                                                 "poetry", "other"]},
                                 "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                                 "summary": {"type": "string"}}}
GRAMMAR_PROMPTS = [
    "Describe a book about bicycles as a JSON object with its title, author, year, genre, keywords and summary.",
    "Describe a book that teaches a new language as JSON: title, author, year, genre, keywords and a summary.",
    "Give a JSON record of a children's book about the weather: title, author, year, genre, keywords, summary.",
]


@dataclass
class TuneConfig:
    prompts: int = 2                  # calibration prompts each method decodes per regime
    new_tokens: int = 40              # tokens per prompt
    temperature: float = 0.7          # the sampled regime's
    batches: tuple[int, ...] = (1, 2, 4, 8)   # batch sizes whose pass times are recorded (8: serve's default)
    trees: bool = True                # choose the tree shapes first, as tune-tree does
    margin: float = 0.03              # the rule's method stays unless another was faster by more than this
    device: str = "auto"
    threads: int | None = None


def tune(directory: str | Path, cfg: TuneConfig = TuneConfig(), log=print) -> tuning.Tuning:
    """Measure and record the engine set's tuning for this machine; returns it."""
    if not 1 <= cfg.prompts <= len(CALIBRATION_PROMPTS) or cfg.new_tokens < 1:
        raise InputError(f"--prompts {cfg.prompts} and --max-new-tokens {cfg.new_tokens}: need 1 to "
                         f"{len(CALIBRATION_PROMPTS)} calibration prompts and at least one token")
    began = time.perf_counter()
    gen = Generator.from_engines(directory, cfg.device, cfg.threads, warm=False)
    prompts = ([gen.encode(p) for p in CALIBRATION_PROMPTS[:cfg.prompts]] if gen.tokenizer is not None else
               [[(7 * i + j) % gen.target.spec["vocab_size"] for j in range(6)] for i in range(cfg.prompts)])
    if cfg.trees and not gen.chains_only:
        _trees(gen, prompts, log)
    for b in cfg.batches:   # the passes a request or a server's batch would otherwise time first
        gen.costs(b, upto=64 if b == 1 else MAX_GAMMA + 1)
        if gen.has("eagle") or gen.has("mtp"):
            gen.eagle_costs(b, gen.eagle_shape())
    kept, searched = _self_layers(gen, prompts, cfg.new_tokens, log) if gen.has("self") else ([], [])
    methods = [m for m in METHODS if m in ("autoregressive", "ngram") or gen.has(m)]
    speeds, acceptance = {}, {}
    regimes = [(r, grammar) for grammar in (True, False) for r in tuning.REGIMES]   # the policies keep the last
    if gen.tokenizer is None:
        regimes = regimes[len(tuning.REGIMES):]
        log("no tokenizer: the regimes with a grammar are not measured (auto runs the same method for them)")
    for i, (regime, grammar) in enumerate(regimes):
        temperature = 0.0 if regime == "greedy" else cfg.temperature
        key = tuning.regime(regime == "greedy", grammar)
        if grammar:
            asked = [gen.encode(p) for p in GRAMMAR_PROMPTS[:min(cfg.prompts, len(GRAMMAR_PROMPTS))]]
            speeds[key], acceptance[key] = _race(gen, methods, asked, cfg.new_tokens, temperature, warm_up=i == 0,
                                                 grammar=gen.grammar("json_schema", GRAMMAR_SCHEMA))
        else:
            speeds[key], acceptance[key] = _race(gen, methods, prompts, cfg.new_tokens, temperature, warm_up=i == 0)
    rule = tuning.rule(gen)
    chosen = {r: _fastest(v, rule, cfg.margin) for r, v in speeds.items()}
    for r, v in speeds.items():
        line = ", ".join(f"{m} {t:.1f}" for m, t in sorted(v.items(), key=lambda kv: -kv[1]))
        log(f"{r}: tokens/s {line} -> {chosen[r]}")
    result = tuning.Tuning(machine=gen.machine, engines=tuning.engine_hashes(gen.manifest), methods=chosen, speeds=speeds,
                           acceptance=acceptance, measured=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           self_layers=kept, self_search=searched, **gen.measured())
    path = tuning.save(gen.directory, result)
    log(f"recorded {path} ({time.perf_counter() - began:.0f} s)")
    _busy_warning(log)
    return result


SELF_GAMMA = 3        # the chain the self drafter's layer sets are measured with (the adaptive policy off)
SELF_MIN_ALPHA = 0.1  # a set whose drafts are accepted less often ends the search (fewer layers draft worse)


def _self_layers(gen: Generator, prompts: list[list[int]], new_tokens: int, log) -> tuple[list[int], list[dict]]:
    """The layers the self drafter keeps, chosen from what they measure on this machine (the engine's skip_layers
    input takes any set): each layer but the last is ranked by the top-1 agreement of the target without it with
    the target's greedy tokens over the calibration prompts (a pass over each, teacher-forced); then layers are
    dropped in that order, the least missed first, and each set's acceptance is measured (greedy decoding, chains of
    SELF_GAMMA), its step time read off a line through two measured ones and its speedup estimated against the
    target's measured passes (Costs.predicted_speedup at the best γ), until the estimate has not grown for three
    sets or the acceptance falls below SELF_MIN_ALPHA. Returns the best set (the engine left on it) and each set's figures."""
    engine, L = gen.self_draft, gen.self_draft.layers
    if not hasattr(engine, "use_layers"):   # an engine of its own (CUDA, TensorRT): its layers are the export's
        log(f"self layers: the export's ({', '.join(map(str, engine.spec['kept_layers']))}); this build's self "
            "drafter is an engine of its own, which runs no other set")
        return [], []
    verify = gen.costs(1, draft=False).verify
    seqs = [p + gen.generate(prompt_ids=p, max_new_tokens=new_tokens, method="autoregressive").token_ids[0]
            for p in prompts]

    def agreement(kept: list[int]) -> float:
        engine.use_layers(kept)
        hits = total = 0
        for p, s in zip(prompts, seqs):
            n = len(s) - len(p)   # the logits at the positions before each new token
            top = engine.run_sequence(s[:-1], num_logits=n).logits[0].argmax(-1)
            hits, total = hits + int((top == torch.tensor(s[len(p):], device=top.device)).sum()), total + n
        return hits / total

    began = time.perf_counter()
    alone = {d: agreement([k for k in range(L) if k != d]) for d in range(L - 1)}
    order = sorted(alone, key=lambda d: (-alone[d], d))
    log(f"self layers: each dropped alone, agreement {min(alone.values()):.2f} to {max(alone.values()):.2f} "
        f"({time.perf_counter() - began:.0f} s); dropping in the order {', '.join(map(str, order))}")
    # a step's time depends on how many layers it runs (each the same work, besides the embedding and the head):
    # measured at two counts, a line through them (timed per set, the figures scattered by ±20 % on a busy machine,
    # and the noise chose the set)
    far = max(1, L // 2)
    c = {}
    for k in dict.fromkeys((L - 1, far)):
        engine.use_layers(sorted(set(range(L)) - set(order[:L - k])))
        c[k] = _step(gen, engine)
    slope = (c[L - 1] - c[far]) / (L - 1 - far) if far < L - 1 else 0.0
    log(f"self layers: a step over {L - 1} layers {c[L - 1]:.2f} of the target's pass, over {far} {c[far]:.2f}")
    kept, steps, best = list(range(L)), [], 0
    for drop in order:
        kept = [k for k in kept if k != drop]
        engine.use_layers(kept)
        step = max(c[far] + slope * (len(kept) - far), 0.05) * verify[1]
        per_position = [0.0] * SELF_GAMMA
        for ids in prompts:
            out = gen.generate(prompt_ids=ids, max_new_tokens=new_tokens, method="self", gamma=SELF_GAMMA,
                               adaptive=False)
            rates = out.stats["acceptance_per_position"] + [0.0] * SELF_GAMMA
            per_position = [a + r / len(prompts) for a, r in zip(per_position, rates)]
        alpha = sum(per_position) / (1 + sum(per_position[:-1]))   # accepted drafts / drafts reached
        costs = Costs(step, verify)
        speedup, gamma = max((costs.predicted_speedup(alpha, g), g) for g in range(1, MAX_GAMMA + 1))
        steps.append({"layers": list(kept), "dropped": drop, "agreement_alone": round(alone[drop], 4),
                      "alpha": round(alpha, 4), "step_s": step, "c": round(step / verify[1], 4),
                      "estimated_speedup": round(speedup, 4), "gamma": gamma})
        log(f"self layers: {len(kept)} of {L} (dropped {drop}): acceptance {alpha:.2f}, step {step * 1e3:.1f} ms "
            f"(c {step / verify[1]:.2f}), estimated {speedup:.2f}x at γ {gamma}")
        if speedup > steps[best]["estimated_speedup"]:
            best = len(steps) - 1
        if len(steps) - 1 - best >= 3 or alpha < SELF_MIN_ALPHA:
            break
    chosen = steps[best]["layers"]
    engine.use_layers(chosen)
    # its step as the line gives it beside the passes the tuning records (a request would time it alone, maybe
    # on a busier machine; a last timing of its own here once read 1.33 of a pass where the line said 1.00)
    step = steps[best]["step_s"]
    gen._self_costs = {b: Costs(step, cost.verify) for b, cost in gen._batch_costs.items() if isinstance(b, int)}
    log(f"self layers: keeping {len(chosen)} of {L} ({steps[best]['estimated_speedup']:.2f}x estimated, a step "
        f"{step * 1e3:.1f} ms; {time.perf_counter() - began:.0f} s)")
    return chosen, steps


def _step(gen: Generator, engine, reps: int = 7) -> float:
    """The self drafter's step over the target's one-token pass, each the best of `reps` timed in turn (a slow
    spell of a shared machine falls on both: timed apart, 25 of 30 layers once came out at 0.47 of a pass and 26
    at 0.69)."""
    context = min(64, engine.spec["max_seq_len"] - 2)   # as Generator.costs times
    step = target = float("inf")
    for _ in range(reps):
        step = min(step, engine.time_pass(context, 1, reps=1))
        target = min(target, gen.target.time_pass(context, 1, reps=1))
    return step / target


def _busy_warning(log) -> None:
    """Say so when other work shared the cores: the pass times recorded are the loaded machine's (a load of 5 on
    2 cores recorded them at about 6x their idle values, and `auto` then sized EAGLE's trees for that)."""
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load > 1.5 * cores:
        log(f"warning: the machine was busy while tuning (1-minute load average {load:.1f} on {cores} cores): the "
            "recorded pass times and speeds are that load's; run `specrt tune` again when it is quiet")


def _trees(gen: Generator, prompts: list[list[int]], log) -> None:
    """The tree shapes as tune-tree chooses them (on fewer tokens: the whole tuning takes about a minute on 2
    cores), recorded in the manifest and in the generator's copy of it."""
    if gen.has("eagle") or gen.has("mtp"):
        from specrt.decoding.eagle import save_shape, tune as tune_shape
        shape = tune_shape(gen, prompts, new_tokens=24, log=log, method="eagle" if gen.has("eagle") else "mtp")
        save_shape(gen.directory, shape)
        gen.manifest["models"]["eagle"]["dynamic_tree"] = asdict(shape)
        log(f"EAGLE tree shape {shape}")
    if gen.has("medusa"):
        save_tree(gen.directory, "medusa", calibrate(gen, "medusa", prompts, log=log))
        gen.manifest["trees"] = read_manifest(gen.directory)["trees"]


def _race(gen: Generator, methods: list[str], prompts: list[list[int]], new_tokens: int,
          temperature: float, warm_up: bool = True, grammar=None) -> tuple[dict[str, float], dict[str, list]]:
    """Tokens per second of each method over the prompts (the methods' order rotating from prompt to prompt; with
    `warm_up`, each method runs briefly first: a drafter loads at its first use), and each speculative method's
    acceptance per draft position over them; under `grammar` where one is given."""
    kw = dict(max_new_tokens=new_tokens, temperature=temperature, grammar=grammar)
    for m in methods if warm_up else ():
        gen.generate(prompt_ids=prompts[0], method=m, **dict(kw, max_new_tokens=8))
    tokens, seconds, per_position = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0.0), {}
    for i, ids in enumerate(prompts):
        for m in methods[i % len(methods):] + methods[:i % len(methods)]:
            t = time.perf_counter()
            out = gen.generate(prompt_ids=ids, method=m, **kw)
            seconds[m] += time.perf_counter() - t
            tokens[m] += out.stats["tokens"]
            per_position.setdefault(m, []).append(out.stats["acceptance_per_position"])
    acceptance = {m: [round(sum(r[d] for r in rows if len(r) > d) / sum(len(r) > d for r in rows), 4)
                      for d in range(max(map(len, rows)))]
                  for m, rows in per_position.items() if any(rows)}
    return {m: tokens[m] / seconds[m] for m in methods}, acceptance


def _fastest(speeds: dict[str, float], rule: str, margin: float) -> str:
    """The fastest method; the rule's where it is within `margin` of it (this machine's noise between runs)."""
    best = max(speeds, key=speeds.get)
    return rule if rule in speeds and speeds[rule] * (1 + margin) >= speeds[best] else best
