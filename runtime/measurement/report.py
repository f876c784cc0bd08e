"""Turn a bench run into results.json, report.md and PNG plots (matplotlib, Agg backend)."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from specrt.decoding.adaptive import Costs, expected_tokens

COLUMNS = ["system", "method", "T", "tokens/s", "speedup", "per prompt", "α", "c", "predicted", "tokens/round", "tree",
           "plain", "host ms", "peak MB"]
SYSTEM_ORDER = {"specrt": 0, "transformers": 1, "llama.cpp": 2}
MB = 1e6
PEER_LOOKUP_TOKENS = 8   # transformers' prompt_lookup_num_tokens, the same cap as specrt's adaptive γ


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _mean_positions(lists):
    width = max((len(xs) for xs in lists), default=0)
    return [_mean([xs[i] for xs in lists if len(xs) > i]) for i in range(width)]


def _cost_entries(info: dict) -> dict[str, dict]:
    """Each specrt system's recorded costs: "specrt" (ENGINES) and every --compare engine set."""
    return {"specrt": info["costs"], **{c["system"]: c["costs"] for c in info.get("compare", [])}}


def _costs(info: dict) -> dict[str, Costs]:
    """Each specrt system's measured costs."""
    return {name: Costs(e["draft_step_s"], {int(k): v for k, v in e["verify_s"].items()})
            for name, e in _cost_entries(info).items()}


def _self_costs(info: dict) -> dict[str, Costs]:
    """Each specrt system's costs with the self drafter's step as the drafting step, where it has one."""
    return {name: Costs(e["self_step_s"], {int(k): v for k, v in e["verify_s"].items()})
            for name, e in _cost_entries(info).items() if e.get("self_step_s") is not None}


def _order(system: str) -> tuple:
    return (SYSTEM_ORDER.get(system.split(" ")[0], len(SYSTEM_ORDER)), system)


def _eagle_c(info: dict, costs: dict[str, Costs]) -> dict[str, float]:
    """Each specrt system's EAGLE drafter pass over a tree level over its target's one-token pass."""
    return {name: e["eagle_level_s"] / costs[name].verify[1]
            for name, e in _cost_entries(info).items() if e.get("eagle_level_s") is not None}


def summarize(runs: list[dict], costs: dict[str, Costs], eagle_c: dict[str, float] | None = None,
              self_costs: dict[str, Costs] | None = None) -> list[dict]:
    """One row per (system, method, temperature): totals over prompts, speedup against specrt autoregressive
    at the same temperature (tokens/s over tokens/s, both measured in this run). c: the drafter's step over the
    target's (the draft model's for draft*, the self drafter's for self, the EAGLE drafter's level pass for eagle,
    0 for drafters that cost no pass)."""
    groups = defaultdict(list)
    for r in runs:
        groups[(r["system"], r["method"], r["temperature"])].append(r)
    rows = []
    for (system, method, temp), rs in groups.items():
        tokens, time_s = sum(r["tokens"] for r in rs), sum(r["time_s"] for r in rs)
        alpha = _mean([r.get("alpha") for r in rs])
        gamma = _mean([r.get("gamma_mean") or r.get("gamma") for r in rs])
        speculative = system.startswith("specrt") and method != "autoregressive"
        base = method.split("+")[0]            # the method of METHOD+typical (typical acceptance)
        chain = base in ("draft", "ngram", "self")   # the formula's model: a chain of γ drafts
        cost = (self_costs or {}).get(system) if base == "self" else costs.get(system)
        rows.append({
            "system": system, "method": method, "temperature": temp, "prompts": len(rs), "tokens": tokens,
            "time_s": time_s, "tokens_per_s": tokens / time_s, "alpha": alpha,
            "c": (cost.c if method.startswith("draft") or (base == "self" and cost) else
                  (eagle_c or {}).get(system, 0.0) if base == "eagle" else 0.0) if speculative else None,
            "distribution_preserving": all(r.get("distribution_preserving", True) for r in rs),
            "gamma_mean": gamma,
            "predicted_speedup": _predicted(cost, alpha, max(1, round(gamma)))
            if chain and cost and speculative and alpha is not None and gamma else None,
            "tree_size": _mean([r.get("tree_size") for r in rs]),
            "mean_tokens_per_round": _mean([r.get("mean_tokens_per_round") for r in rs]),
            "plain_share": _plain_share(rs),
            "host_ms_per_round": 1e3 * sum(r["loop_time_s"] for r in rs) / max(1, sum(r["rounds"] for r in rs))
            if all("loop_time_s" in r for r in rs) else None,
            "acceptance_per_position": _mean_positions([r.get("acceptance_per_position") or [] for r in rs]),
            "prompt_tokens": _mean([r.get("prompt_tokens") for r in rs]),
            "prefill_s": _mean([r.get("prefill_s") for r in rs]),
            "decode_tokens_per_s": _decode_speed(rs),
        })
    base = {r["temperature"]: r["tokens_per_s"] for r in rows
            if r["system"] == "specrt" and r["method"] == "autoregressive"}
    # each prompt's speedup against autoregressive on that prompt (run back to back): their range shows how much
    # of a row's speedup the prompts (and the machine's noise) move
    per_prompt = {(r["temperature"], r["prompt"]): r["tokens_per_s"] for r in runs
                  if r["system"] == "specrt" and r["method"] == "autoregressive" and "prompt" in r}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base[r["temperature"]] if r["temperature"] in base else None
        ratios = [x["tokens_per_s"] / per_prompt[(x["temperature"], x["prompt"])]
                  for x in groups[(r["system"], r["method"], r["temperature"])]
                  if (x["temperature"], x.get("prompt")) in per_prompt]
        r["speedup_range"] = [min(ratios), max(ratios)] if ratios else None
    return rows


def _decode_speed(runs: list[dict]) -> float | None:
    """The tokens after the first over the time after the prefill (None where a run's prefill is not known)."""
    if not runs or any(r.get("prefill_s") is None for r in runs):
        return None
    decode = sum(r["time_s"] - r["prefill_s"] for r in runs)
    return sum(r["tokens"] - 1 for r in runs) / decode if decode > 0 else None


def _plain_share(runs: list[dict]) -> float | None:
    """The share of rounds that were plain target steps (the adaptive policies' fallback)."""
    known = [r for r in runs if r.get("plain_rounds") is not None and r.get("rounds")]
    return sum(r["plain_rounds"] for r in known) / sum(r["rounds"] for r in known) if known else None


def summarize_sweep(sweep: list[dict], costs: Costs) -> list[dict]:
    """Measured speedup per (method, γ) against autoregressive on the same prompts, with the predictions of
    E[N]/(1+γc) and of the measured costs E[N]·t(1)/(γ·t_draft + t(γ+1)), from the method's pooled α."""
    if not sweep:
        return []
    base = [r for r in sweep if r["method"] == "autoregressive"]
    base_tps = sum(r["tokens"] for r in base) / sum(r["time_s"] for r in base)
    groups = defaultdict(list)
    for r in sweep:
        if r["method"] != "autoregressive":
            groups[(r["method"], r["gamma"])].append(r)
    pooled = {m: _mean([r["alpha"] for (mm, _), rs in groups.items() if mm == m for r in rs])
              for m, _ in groups}
    rows = []
    for (method, g), rs in sorted(groups.items()):
        tps = sum(r["tokens"] for r in rs) / sum(r["time_s"] for r in rs)
        alpha, c = pooled[method], costs.c if method == "draft" else 0.0
        rows.append({"method": method, "gamma": g, "temperature": rs[0]["temperature"], "tokens_per_s": tps,
                     "speedup": tps / base_tps, "alpha": _mean([r["alpha"] for r in rs]), "pooled_alpha": alpha,
                     "c": c, "predicted_simple": expected_tokens(alpha, g) / (1 + g * c) if alpha is not None else None,
                     "predicted_costs": _predicted(costs, alpha, g) if alpha is not None else None})
    return rows


def _predicted(costs: Costs, alpha: float, gamma: int) -> float:
    """Costs.predicted_speedup, with the pass over γ + 1 tokens read off the measured passes' line where bench did
    not time it (it times 1 .. MAX_GAMMA + 1; --gamma-sweep takes γ up to 64)."""
    return expected_tokens(alpha, gamma) * costs.verify[1] / (gamma * costs.draft_step + costs.pass_time(gamma + 1))


def attach_memory(summary: list[dict], memory: list[dict]) -> None:
    """Each summary row measured for peak memory gets `peak_memory_mb`: the peak resident size while generating
    above the measuring process's size after its imports (see bench.measure_memory)."""
    peaks = {(m["system"], m["method"], m["temperature"]): m for m in memory}
    for r in summary:
        m = peaks.get((r["system"], r["method"], r["temperature"]))
        r["peak_memory_mb"] = (m["peak_rss_bytes"] - m["base_rss_bytes"]) / MB if m else None


def llamacpp_agreement(runs: list[dict]) -> dict | None:
    """How often llama.cpp's greedy output equals specrt autoregressive's on the same prompt (information only)."""
    rows = [r for r in runs if "first_divergence" in r]
    if not rows:
        return None
    return {"prompts": len(rows), "identical": sum(r["first_divergence"] is None for r in rows),
            "first_divergence": [r["first_divergence"] for r in rows]}


def floor_line(info: dict, runs: list[dict]) -> dict:
    ar = [r for r in runs if r["system"] == "specrt" and r["method"] == "autoregressive" and r["rounds"]]
    step = sum(r["decode_time_s"] for r in ar) / sum(r["rounds"] for r in ar) if ar else None
    return {"weight_bytes": info["weight_bytes"], "bandwidth_bytes_per_s": info["bandwidth_bytes_per_s"],
            "floor_step_s": info["floor_step_s"], "autoregressive_step_s": step,
            "ratio": step / info["floor_step_s"] if step else None}


# ---- formatting ---------------------------------------------------------------------------------------------
def _f(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


def table_rows(summary: list[dict]) -> list[list[str]]:
    rows = sorted(summary, key=lambda r: (r["temperature"], _order(r["system"]), r["method"] != "autoregressive",
                                          r["method"]))
    return [[r["system"], r["method"], _f(r["temperature"], "g"), _f(r["tokens_per_s"], ".1f"),
             _f(r["speedup"]), "–" if not r.get("speedup_range") else "{:.2f}–{:.2f}".format(*r["speedup_range"]),
             _f(r["alpha"]), _f(r["c"], ".3f"), _f(r["predicted_speedup"]),
             _f(r["mean_tokens_per_round"]), _f(r.get("tree_size"), ".0f"), _f(r.get("plain_share"), ".0%"),
             _f(r.get("host_ms_per_round")), _f(r.get("peak_memory_mb"), ".0f")]
            for r in rows]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def terminal_table(summary: list[dict]):
    from rich.table import Table
    table = Table(title="specrt bench (speedup: against specrt autoregressive at the same temperature)")
    # the report has host ms and per prompt; a terminal lacks the width
    shown = [i for i, c in enumerate(COLUMNS) if c not in ("host ms", "per prompt")]
    for i in shown:
        table.add_column(COLUMNS[i], justify="left" if COLUMNS[i] in ("system", "method") else "right")
    for row in table_rows(summary):
        table.add_row(*(row[i] for i in shown))
    return table


def _compare_lines(info: dict) -> list[str]:
    """What the other specrt systems are (--compare engine sets), with their own pass times."""
    ms = lambda s: _f(s * 1e3, ".1f")  # noqa: E731
    return [f"`{c['system']}`: engines `{c['engines']}`, run in the same interleaved loop; its target's pass times "
            "(ms) over k tokens: " + ", ".join(f"k={k}: {ms(t)}" for k, t in c["costs"]["verify_s"].items())
            + f"; draft step {ms(c['costs']['draft_step_s'])} ms (c there is against this target)." + "\n"
            for c in info.get("compare", [])]


def report_markdown(results: dict) -> str:
    info, cfg, fl = results["info"], results["config"], results["floor"]
    ms = lambda s: _f(s * 1e3 if s is not None else None, ".1f")  # noqa: E731
    out = [
        "# specrt bench", "",
        f"Engines `{info['engines']}` (target `{info['target']}`, draft `{info['draft'] or 'none'}`); "
        f"{cfg['num_prompts_run']} prompts from `{info['prompts']}` × {cfg['max_new_tokens']} new tokens, "
        f"temperatures {', '.join(_f(t, 'g') for t in cfg['temperatures'])}, seed {cfg['seed']}; "
        f"{info['threads']} threads (engines and torch) on {info['cores']} cores ({info['processor']}, "
        f"{info['platform']}); 1-minute load average {_f(info['load_average'], '.1f')} at the start, "
        f"{_f(info.get('load_average_end'), '.1f')} at the end.", "",
        markdown_table(COLUMNS, table_rows(results["summary"])), "",
        "Speedup: tokens/s over specrt autoregressive tokens/s at the same temperature, same prompts, this run. "
        "Per prompt: the lowest and highest of the prompts' own speedups (each prompt's tokens/s over autoregressive's "
        "on that prompt, run back to back): how far the prompts and the machine's noise move a row. "
        "α: accepted / proposed drafts (mean over prompts). c: draft step / target step (eagle: one drafter pass over "
        "a tree level / target step). Predicted: "
        "E[N]·t(1) / (γ·t_draft + t(γ+1)) from measured α, mean γ and measured pass times (chains only). "
        "Tokens/round counts the target's own token (mean accepted length + 1). Tree: nodes verified per round "
        "(medusa, draft-tree, eagle; α there is accepted length / tree depth). Plain: the share of rounds taken as "
        "plain target steps, where the measured acceptance did not pay for speculating (γ = 0 for chains, no tree for "
        "tree methods). Host ms: the loop's own time per round (wall time less engine passes, prefill "
        "included), specrt rows. transformers rows: `generate` (greedy or "
        "sampling, top-k/top-p off), assisted "
        f"generation with the same draft, prompt lookup (prompt_lookup_num_tokens={cfg['peer_lookup_tokens']}). "
        "llama.cpp: llama-cpp-python on the GGUF file the target was exported from (its own quantized weights and "
        "kernels, where specrt's target may hold them dequantized), the same prompt token ids, greedy or sampled with "
        "top-k/top-p/min-p off, n_threads = the threads above, a context of the engine's max_seq_len. Every row's "
        "tokens/s is new tokens over the wall time of the whole call, prefill included. Peak MB: see Peak memory.",
        "", *_compare_lines(info),
        "## Memory-bandwidth floor", "",
        f"Target weights {fl['weight_bytes'] / 1e6:.0f} MB (fp32) / read bandwidth "
        f"{fl['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (multi-threaded torch reduction, best of 5) = floor "
        f"**{ms(fl['floor_step_s'])} ms** per decode step "
        f"({_f(1 / fl['floor_step_s'], '.1f')} tokens/s). specrt autoregressive: {ms(fl['autoregressive_step_s'])} "
        f"ms per step, **{_f(fl['ratio'])}×** the floor.", "",
        "Target pass times (ms) over k tokens: "
        + ", ".join(f"k={k}: {ms(t)}" for k, t in info["costs"]["verify_s"].items())
        + f"; draft step {ms(info['costs']['draft_step_s'])} ms.", "",
    ]
    agree = results.get("llamacpp_agreement")
    if agree:
        firsts = [str(d) for d in agree["first_divergence"] if d is not None]
        out += [f"llama.cpp's greedy output equalled specrt autoregressive's on {agree['identical']} of "
                f"{agree['prompts']} prompts" + (f"; the others first differ at token {', '.join(firsts)}" if firsts
                                                 else "") + " (information only: different arithmetic).", ""]
    out += _prefill_section(results)
    out += _memory_section(results)
    if results["sweep"]:
        out += ["## Speedup against γ", "",
                f"Fixed γ, {cfg['sweep_prompts_run']} prompts, temperature "
                f"{_f(results['sweep'][0]['temperature'], 'g')}; speedup against autoregressive on the same prompts "
                "in the same run. Predicted from the method's α pooled over the sweep: E[N]/(1+γc), and with the "
                "measured verify cost.", "",
                markdown_table(["method", "γ", "tokens/s", "speedup", "α", "E[N]/(1+γc)", "with verify cost"],
                               [[r["method"], str(r["gamma"]), _f(r["tokens_per_s"], ".1f"), _f(r["speedup"]),
                                 _f(r["alpha"]), _f(r["predicted_simple"]), _f(r["predicted_costs"])]
                                for r in results["sweep"]]), "",
                "![speedup vs gamma](speedup_vs_gamma.png)", ""]
    out += ["![tokens per second](tokens_per_s.png)", "", "![acceptance per position](acceptance_per_position.png)",
            "", "## Notes", "",
            "- The machine may be shared (a load average above the core count means it was): absolute times are "
            "indications, and torch's thread pool (transformers peers, sampling) suffers most from "
            "oversubscription. Ratios are measured side by side: each prompt runs every method and peer back to "
            "back, so a slow spell slows them alike.",
            "- Timings include prefill; every system sees the same token ids and max_new_tokens and stops at EOS.",
            "- At temperature > 0 the systems draw different random streams: same distribution, different samples, "
            "hence different lengths and acceptance."]
    out += [f"- {n}" for n in results["notes"]]
    return "\n".join(out) + "\n"


def _prefill_section(results: dict) -> list[str]:
    rows = [r for r in sorted(results["summary"], key=lambda r: (r["temperature"], _order(r["system"]),
                                                                 r["method"] != "autoregressive", r["method"]))
            if r.get("prefill_s") is not None]
    if not rows:
        return []
    return ["## Prefill and decode", "",
            "Prefill: seconds until the first new token, mean over the prompts (specrt: the prompt's passes through "
            "the target and the method's drafter, in chunks; llama.cpp: its first token's time). Decode: the tokens "
            "after the first over the time after the prefill. Peak MB: see Peak memory.", "",
            markdown_table(["system", "method", "T", "prompt tokens", "prefill s", "decode tokens/s", "peak MB"],
                           [[r["system"], r["method"], _f(r["temperature"], "g"), _f(r["prompt_tokens"], ".0f"),
                             _f(r["prefill_s"]), _f(r["decode_tokens_per_s"], ".1f"),
                             _f(r.get("peak_memory_mb"), ".0f")] for r in rows]), ""]


def _memory_section(results: dict) -> list[str]:
    memory = results.get("memory") or []
    if not memory:
        return []
    mb = lambda b: _f(b / MB, ".0f")  # noqa: E731
    return ["## Peak memory", "",
            f"Each method and peer once more, in a fresh process of its own, on the same {memory[0]['prompts']} prompts "
            f"at temperature {_f(memory[0]['temperature'], 'g')}: the process imports its code (Python, torch, "
            "ONNX Runtime and transformers for all; transformers' model class and generation code for the "
            "transformers rows, llama-cpp-python for llama.cpp), loads only that system (specrt: the target; "
            "the method's drafter loads at its first request; transformers: the float32 target, with the draft for assisted "
            "generation; llama.cpp: the memory-mapped GGUF file and its context, KV cache included), then generates "
            "(specrt makes its static KV cache and loads the drafter at the first request). The resident set's high-water mark is reset after loading (Linux clear_refs), so load-time "
            "transients are not counted, what loading left resident is. Peak MB in the table above = peak while "
            "generating − size after imports. Host memory only (not a GPU's).", "",
            markdown_table(["system", "method", "after imports MB", "after loading MB", "peak MB (RSS)",
                            "peak above imports MB"],
                           [[m["system"], m["method"], mb(m["base_rss_bytes"]), mb(m["loaded_rss_bytes"]),
                             mb(m["peak_rss_bytes"]), mb(m["peak_rss_bytes"] - m["base_rss_bytes"])]
                            for m in memory]), ""]


# ---- plots --------------------------------------------------------------------------------------------------
def plot_all(results: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    rows = sorted(results["summary"], key=lambda r: (r["temperature"], r["system"], r["method"]))
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(rows) + 1.5))
    labels = [f"{r['system']} {r['method']} T={r['temperature']:g}" for r in rows]
    colors = [{"specrt": "tab:blue", "llama.cpp": "tab:orange"}.get(r["system"], "tab:green" if r["system"]
              .startswith("specrt") else "tab:gray") for r in rows]
    ax.barh(labels, [r["tokens_per_s"] for r in rows], color=colors)
    ax.axvline(1 / results["floor"]["floor_step_s"], color="tab:red", ls="--",
               label="bandwidth limit, 1 token per step")
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s")
    ax.legend(loc="lower right")
    paths.append(_save(fig, out / "tokens_per_s.png"))

    if results["sweep"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for i, method in enumerate(sorted({r["method"] for r in results["sweep"]})):
            rs = [r for r in results["sweep"] if r["method"] == method]
            g = [r["gamma"] for r in rs]
            color = f"C{i}"
            ax.plot(g, [r["speedup"] for r in rs], "o-", color=color, label=f"{method} measured")
            if rs[0]["pooled_alpha"] is not None:   # None: nothing was proposed
                ax.plot(g, [r["predicted_simple"] for r in rs], "--", color=color,
                        label=f"{method} E[N]/(1+γc), α={rs[0]['pooled_alpha']:.2f}")
                ax.plot(g, [r["predicted_costs"] for r in rs], ":", color=color, label=f"{method} with verify cost")
        ax.axhline(1, color="black", lw=0.5)
        ax.set_xlabel("γ (drafted tokens per round)")
        ax.set_ylabel("speedup vs autoregressive")
        ax.legend(fontsize=7)
        paths.append(_save(fig, out / "speedup_vs_gamma.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["system"] == "specrt" and r["acceptance_per_position"]:
            pos = range(1, len(r["acceptance_per_position"]) + 1)
            ax.plot(pos, r["acceptance_per_position"], "o-", label=f"{r['method']} T={r['temperature']:g}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    if ax.lines:
        ax.legend()
    paths.append(_save(fig, out / "acceptance_per_position.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


# ---- all outputs --------------------------------------------------------------------------------------------
def write_outputs(bench) -> dict:
    cfg, info = bench.config, bench.info
    costs = _costs(info)
    summary = summarize(bench.runs, costs, _eagle_c(info, costs), _self_costs(info))
    costs = costs["specrt"]
    attach_memory(summary, bench.memory)
    results = {
        "config": {"methods": list(cfg.methods), "temperatures": list(cfg.temperatures),
                   "max_new_tokens": cfg.max_new_tokens, "num_prompts_run": len({r["prompt"] for r in bench.runs}),
                   "gamma_sweep": list(cfg.gamma_sweep), "sweep_prompts_run": len({r["prompt"] for r in bench.sweep}),
                   "peers": cfg.peers, "peer_lookup_tokens": PEER_LOOKUP_TOKENS, "seed": cfg.seed,
                   "acceptance": list(cfg.acceptance)},
        "info": info, "floor": floor_line(info, bench.runs), "summary": summary,
        "sweep": summarize_sweep(bench.sweep, costs), "runs": bench.runs, "sweep_runs": bench.sweep,
        "memory": bench.memory, "llamacpp_agreement": llamacpp_agreement(bench.runs), "notes": bench.notes,
    }
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(report_markdown(results))
    paths += plot_all(results, out)
    return {"summary": summary, "paths": paths, "results": results}
