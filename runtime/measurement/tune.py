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

from specrt.decoding import tuning
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
                           **gen.measured())
    path = tuning.save(gen.directory, result)
    log(f"recorded {path} ({time.perf_counter() - began:.0f} s)")
    _busy_warning(log)
    return result


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
