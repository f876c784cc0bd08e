"""`specrt bench`: every method of specrt beside transformers' own decoding (and llama.cpp where installed), on one
prompt set, in one run.

Runs are interleaved prompt by prompt (specrt methods and peers back to back on the same prompt) so that a
shared, noisy machine slows all of them alike: absolute times are indications, ratios are measured side by side.
Peak memory is measured afterwards, one fresh process per method or peer (see `measure_memory`).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import click
import numpy as np
import torch

from specrt.measurement import llamacpp, rss
from specrt.measurement.report import PEER_LOOKUP_TOKENS
from specrt.errors import BackendError, InputError, SpecrtError

MT_BENCH, LONG_PROMPTS = "mt_bench.jsonl", "long_prompts.jsonl"   # the packaged prompt sets (specrt/data)
LLAMACPP = ("llama.cpp", "generate")   # the llama.cpp row's (system, method)


@dataclass
class Prompt:
    id: str
    text: str | None = None
    ids: list[int] | None = None


@dataclass
class BenchConfig:
    engines: Path
    prompts: Path | None = None          # None: a packaged set, MT-Bench or (long_prompts) the long prompts
    methods: tuple[str, ...] = ("autoregressive", "draft", "ngram")
    temperatures: tuple[float, ...] = (0.0, 0.7)
    max_new_tokens: int = 128
    num_prompts: int = 8
    gamma_sweep: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    sweep_prompts: int = 2
    peers: bool = True
    out: Path = Path("bench-out")
    seed: int = 0
    threads: int | None = None
    device: str = "auto"                 # the engines' device (auto: the one they were built for); the peers' too
    llamacpp: bool | None = None         # None: with the peers, where llama-cpp-python is installed
    memory: bool = True                  # peak memory of each method and peer, one fresh process each
    compare: tuple[Path, ...] = ()       # other engine sets (an int4 target, say) whose methods run beside
    long_prompts: bool = False           # the packaged long prompts (2.6k-6.6k tokens) instead of MT-Bench
    acceptance: tuple[str, ...] = ("exact",)   # with "typical": each speculative method again at T > 0, typical
    datastore: Path | None = None        # rest's datastore (specrt datastore build), for every engine set


@dataclass
class Bench:
    """What one bench run measured; `results()` is results.json."""
    config: BenchConfig
    runs: list[dict] = field(default_factory=list)
    sweep: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    memory: list[dict] = field(default_factory=list)


# ---- prompts ------------------------------------------------------------------------------------------------
def load_prompts(path: Path | None, limit: int, packaged: str = MT_BENCH) -> list[Prompt]:
    """Rows with `prompt_ids` (list of ints), `prompt` (text) or `turns` (the first turn is the prompt); `path`
    None: the packaged set `packaged`."""
    if path is None:
        text, name = resources.files("specrt").joinpath(f"data/{packaged}").read_text(), packaged
    else:
        text, name = Path(path).read_text(), str(path)
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{name} line {n}: not valid JSON ({e.msg})") from None
        pid = str(row.get("id", n)) if isinstance(row, dict) else str(n)
        if isinstance(row, dict) and isinstance(row.get("prompt_ids"), list) and row["prompt_ids"] \
                and all(isinstance(i, int) for i in row["prompt_ids"]):
            prompts.append(Prompt(pid, ids=row["prompt_ids"]))
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(Prompt(pid, text=row["prompt"]))
        elif isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"] \
                and isinstance(row["turns"][0], str):
            prompts.append(Prompt(pid, text=row["turns"][0]))
        else:
            raise InputError(f"{name} line {n}: expected an object with 'turns' (list of strings, the first is "
                             "the prompt), 'prompt' (string) or 'prompt_ids' (list of token ids)")
        if len(prompts) == limit:
            break
    if not prompts:
        raise InputError(f"{name}: no prompts")
    return prompts


# ---- the machine --------------------------------------------------------------------------------------------
def read_bandwidth(megabytes: int = 512, reps: int = 5) -> float:
    """Bytes per second of a large float32 reduction on all the engine threads (a single-threaded one reads
    ~40% slower here and would put the floor too high), best of `reps`."""
    a = torch.ones(megabytes * 2**20 // 4)
    a.sum()
    best = min(_timed(a.sum) for _ in range(reps))
    return a.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _load() -> float | None:
    """1-minute load average: above the core count, other processes competed for the cores."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_info(threads: int) -> dict:
    import onnxruntime
    import transformers
    import specrt
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "cores": cores, "threads": threads, "load_average": _load(),
            "versions": {"specrt": specrt.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "onnxruntime": onnxruntime.__version__,
                         "numpy": np.__version__}}


# ---- one run of each system ---------------------------------------------------------------------------------
TREE_METHODS = {"draft-tree": "draft"}   # bench names of tree variants -> generate(method=..., tree=True)
MISSING = {   # what a method's drafter is, and how an engine set gets one: a method the set lacks is skipped
    "draft": "draft model (export with --draft SOURCE)", "medusa": "Medusa heads (export with --medusa PATH)",
    "eagle": "EAGLE drafter (export with --eagle PATH)", "mtp": "MTP module (its target checkpoint ships none)",
    "self": "self drafter (export with --self-layers auto)"}
TYPICAL = "+typical"   # the bench name of a method run with typical acceptance ends with it


def run_specrt(gen, ids: list[int], method: str, temperature: float, max_new: int, seed: int,
               gamma: int | None = None, acceptance: str = "exact") -> dict:
    t = time.perf_counter()
    out = gen.generate(prompt_ids=ids, max_new_tokens=max_new, temperature=temperature, seed=seed,
                       method=TREE_METHODS.get(method, method), gamma=gamma, tree=method in TREE_METHODS,
                       acceptance=acceptance)
    wall = time.perf_counter() - t
    s = out.stats
    name = method + TYPICAL if s["acceptance"] == "typical" else method
    return {"system": "specrt", "method": name, "temperature": temperature, "tokens": s["tokens"],
            "acceptance": s["acceptance"], "distribution_preserving": s["distribution_preserving"],
            "output_ids": out.token_ids[0], "prompt_tokens": len(ids), "prefill_s": s["prefill_time_s"],
            "time_s": wall, "tokens_per_s": s["tokens"] / wall, "decode_time_s": wall - s["prefill_time_s"],
            "rounds": s["rounds"], "loop_time_s": s["loop_time_s"], "alpha": s["acceptance_rate"],
            "mean_tokens_per_round": s["mean_tokens_per_round"],
            "acceptance_per_position": s["acceptance_per_position"], "gamma": s["gamma"],
            "gamma_mean": s.get("gamma_mean"), "stop_reason": s["stop_reason"], "tree_size": s.get("tree_size"),
            "plain_rounds": s.get("plain_rounds")}


PEERS = {  # name -> extra generate() keyword arguments (assistant filled in at run time)
    "hf-generate": {},
    "hf-assisted": {"assistant_model": None},
    "hf-prompt-lookup": {"prompt_lookup_num_tokens": PEER_LOOKUP_TOKENS},
}


def run_peer(model, ids: list[int], name: str, temperature: float, max_new: int, seed: int,
             eos: list[int], assistant=None) -> dict:
    extra = dict(PEERS[name])
    if "assistant_model" in extra:
        extra["assistant_model"] = assistant
    sampling = ({"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0
                else {"do_sample": False, "temperature": None, "top_k": None, "top_p": None})
    x = torch.tensor([ids], device=model.device)
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.inference_mode():
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, eos_token_id=eos or None,
                           pad_token_id=(eos or [0])[0], **sampling, **extra)
    wall = time.perf_counter() - t
    tokens = y.shape[1] - x.shape[1]
    return {"system": "transformers", "method": name, "temperature": temperature, "tokens": tokens,
            "time_s": wall, "tokens_per_s": tokens / wall}


def run_llamacpp(peer, ids: list[int], temperature: float, max_new: int, seed: int, eos: list[int]) -> dict:
    """Timed like the others: the call, prefill included, over the tokens it made; prefill: until the first."""
    t = time.perf_counter()
    out = peer.generate(ids, temperature, max_new, seed, eos)
    wall = time.perf_counter() - t
    return {"system": LLAMACPP[0], "method": LLAMACPP[1], "temperature": temperature, "tokens": len(out),
            "time_s": wall, "tokens_per_s": len(out) / wall, "output_ids": out, "prompt_tokens": len(ids),
            "prefill_s": peer.first_token_s, "decode_time_s": wall - peer.first_token_s}


# ---- the bench ----------------------------------------------------------------------------------------------
@dataclass
class _Setup:
    gen: object                  # specrt Generator
    target: torch.nn.Module      # the same target, in transformers
    assistant: torch.nn.Module | None
    eos: list[int]
    methods: list[str]
    peers: list[str]
    prompts: list[Prompt]
    ids: list[list[int]]
    llamacpp: object | None      # specrt.measurement.llamacpp.LlamaCpp
    others: list = field(default_factory=list)   # (system name, Generator, methods) per --compare engine set


def _setup(cfg: BenchConfig, bench: "Bench") -> _Setup:
    from specrt.export.sources import load_source
    from specrt.decoding.generate import Generator

    bad = [a for a in cfg.acceptance if a not in ("exact", "typical")]
    if bad or not cfg.acceptance:
        raise InputError(f"--acceptance {','.join(cfg.acceptance)}: choose exact, typical or exact,typical")
    prompts = load_prompts(cfg.prompts, cfg.num_prompts, LONG_PROMPTS if cfg.long_prompts else MT_BENCH)
    torch.set_num_threads(bench.info["threads"])
    gen = Generator.from_engines(cfg.engines, device=cfg.device, threads=bench.info["threads"],
                                 datastore=cfg.datastore)
    methods = [m for m in cfg.methods if _runnable(gen, m, bench.notes)]
    if "autoregressive" not in methods:
        methods.insert(0, "autoregressive")
        bench.notes.append("autoregressive added: it is the baseline of every speedup")
    if "typical" in cfg.acceptance:
        bench.notes.append(f"rows `METHOD{TYPICAL}`: typical acceptance (Medusa's; each speculative method again "
                           "right after its exact run, temperatures > 0 only: at 0 it is greedy, the exact rows), "
                           "which is NOT distribution-preserving: its output is not distributed as the target's")
    ids = [p.ids if p.ids is not None else gen.encode(p.text) for p in prompts]
    longest = max(map(len, ids))
    if longest + cfg.max_new_tokens > gen.max_len:
        raise InputError(f"a prompt of {longest} tokens and {cfg.max_new_tokens} new tokens do not fit {cfg.engines}'s "
                         f"maximum sequence length {gen.max_len}: export the engines with a larger --max-seq-len "
                         f"(e.g. {1 << (longest + cfg.max_new_tokens).bit_length()}) or pass fewer --max-new-tokens")
    models = gen.manifest["models"]
    peers = _peers(cfg, models, bench.notes)
    llama = _llamacpp(cfg, models["target"], bench, gen.target.device.type)
    target = load_source(models["target"]["source"]).model.to(gen.target.device)
    assistant = load_source(models["draft"]["source"]).model.to(gen.target.device) if "hf-assisted" in peers else None
    bench.info.update(_floor(target), engines=str(cfg.engines),
                      prompts=str(cfg.prompts or ("long_prompts" if cfg.long_prompts else "mt_bench")),
                      target=models["target"]["source"], draft=models.get("draft", {}).get("source"),
                      costs=_cost_entry(gen), compare=[],
                      datastore=gen.datastore.manifest | {"directory": str(cfg.datastore)} if gen.datastore else None)
    others = []
    for directory in cfg.compare:
        other = Generator.from_engines(directory, device=cfg.device, threads=bench.info["threads"],
                                       datastore=cfg.datastore)
        name = _system_name(other, [n for n, _, _ in others])
        if other.manifest["models"]["target"]["source"] != models["target"]["source"]:
            raise InputError(f"--compare {directory}: its target is {other.manifest['models']['target']['source']}, "
                             f"{cfg.engines}'s is {models['target']['source']}: compare engine sets of one target")
        runnable = [m for m in methods if _runnable(other, m, bench.notes)]
        others.append((name, other, runnable))
        bench.info["compare"].append({"system": name, "engines": str(directory), "costs": _cost_entry(other),
                                      "methods": runnable})
    return _Setup(gen, target, assistant, models["target"].get("eos_token_ids", []), methods, peers, prompts, ids,
                  llama, others)


def _cost_entry(gen) -> dict:
    costs = gen.costs()
    entry = {"draft_step_s": costs.draft_step, "verify_s": costs.verify, "c": costs.c}
    if gen.has("self"):   # the self drafter's step (the target over its kept layers), for self's c and prediction
        entry["self_step_s"] = gen.costs(draft="self").draft_step
    if gen.has("eagle") or gen.has("mtp"):   # one EAGLE drafter pass over a tree level, as the adaptive rounds time it
        from specrt.decoding.eagle import DynamicTree
        entry["eagle_level_s"] = gen.eagle_costs(1, DynamicTree(**gen.eagle.spec.get("dynamic_tree", {}))).draft_step
    return entry


def _system_name(gen, taken: list[str]) -> str:
    """"specrt int4" for an engine set with an int4 target, else "specrt <directory name>"."""
    name = f"specrt {gen.target.spec.get('engine', {}).get('weights', 'float32')}"
    return name if name not in taken and name != "specrt float32" else f"specrt {gen.directory.name}"


def run_bench(cfg: BenchConfig, progress=None) -> Bench:
    """Every prompt × temperature × (method, peer), interleaved per prompt; then the fixed-γ sweep."""
    from specrt.engines.base import default_threads

    bench = Bench(cfg, info=machine_info(cfg.threads or default_threads()))
    s = _setup(cfg, bench)
    for m in s.methods:   # warm-up: first calls pay for allocation and graph set-up
        run_specrt(s.gen, s.ids[0], m, 0.0, 4, cfg.seed)
    for p in s.peers:
        run_peer(s.target, s.ids[0], p, 0.0, 4, cfg.seed, s.eos, s.assistant)
    if s.llamacpp:
        run_llamacpp(s.llamacpp, s.ids[0], 0.0, 4, cfg.seed, s.eos)

    sweep_methods = [m for m in s.methods if m in ("draft", "ngram")]  # the methods γ applies to
    sweep_n = min(cfg.sweep_prompts, len(s.ids)) if cfg.gamma_sweep and sweep_methods else 0
    compared = s.others
    for _, other, methods in compared:
        for m in methods:
            run_specrt(other, s.ids[0], m, 0.0, 4, cfg.seed)
    systems = len(s.methods) + len(s.peers) + bool(s.llamacpp) + sum(len(m) for _, _, m in compared)
    memory = cfg.memory and _memory_available(bench.notes)
    typical = [m for m in s.methods if m != "autoregressive"] if "typical" in cfg.acceptance else []
    total = len(s.ids) * len(cfg.temperatures) * systems + sweep_n * (1 + len(sweep_methods) * len(cfg.gamma_sweep)) \
        + (systems if memory else 0) + len(s.ids) * sum(t > 0 for t in cfg.temperatures) * len(typical)
    task = progress.add_task("bench", total=total) if progress else None

    def record(rows: list, row: dict, i: int) -> None:
        rows.append({**{k: v for k, v in row.items() if k != "output_ids"}, "prompt": s.prompts[i].id})
        if progress:
            progress.update(task, advance=1, description=f"{row['system']} {row['method']} t={row['temperature']}")

    new = cfg.max_new_tokens
    for i, p in enumerate(s.ids):
        for temp in cfg.temperatures:
            reference = None   # specrt's greedy output, which llama.cpp's is compared with
            for m in s.methods:
                row = run_specrt(s.gen, p, m, temp, new, cfg.seed + i)
                reference = row["output_ids"] if m == "autoregressive" and temp == 0 else reference
                record(bench.runs, row, i)
                if m in typical and temp > 0:   # the same method and prompt, typical acceptance, back to back
                    record(bench.runs, run_specrt(s.gen, p, m, temp, new, cfg.seed + i, acceptance="typical"), i)
            for name, other, methods in compared:
                for m in methods:
                    record(bench.runs, {**run_specrt(other, p, m, temp, new, cfg.seed + i), "system": name}, i)
            for name in s.peers:
                record(bench.runs, run_peer(s.target, p, name, temp, new, cfg.seed + i, s.eos, s.assistant), i)
            if s.llamacpp:
                row = run_llamacpp(s.llamacpp, p, temp, new, cfg.seed + i, s.eos)
                if reference is not None:
                    row["first_divergence"] = llamacpp.first_divergence(row["output_ids"], reference)
                record(bench.runs, row, i)

    temp = cfg.temperatures[0]
    for i, p in enumerate(s.ids[:sweep_n]):
        record(bench.sweep, run_specrt(s.gen, p, "autoregressive", temp, new, cfg.seed + i), i)
        for m in sweep_methods:
            for g in cfg.gamma_sweep:
                record(bench.sweep, run_specrt(s.gen, p, m, temp, new, cfg.seed + i, gamma=g), i)
    bench.info["load_average_end"] = _load()
    if memory:
        for spec in _memory_specs(cfg, s, bench):
            try:
                bench.memory.append(measure_memory(spec))
            except BackendError as e:   # the timed runs stand: the report says which figure is missing and why
                lines = str(e).splitlines()
                bench.notes.append(lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}")
            if progress:
                progress.update(task, advance=1, description=f"memory {spec['system']} {spec['method']}")
    return bench


def _runnable(gen, method: str, notes: list[str]) -> bool:
    from specrt.decoding.generate import AUTO, METHODS
    if method not in METHODS and method not in TREE_METHODS and method != AUTO:
        raise InputError(f"--methods {method!r}: choose from {', '.join((AUTO, *METHODS, *TREE_METHODS))}")
    role = TREE_METHODS.get(method, method)
    if role in MISSING and not gen.has(role):
        notes.append(f"{method} skipped: {gen.directory} has no {MISSING[role]}")
        return False
    return True


def _peers(cfg: BenchConfig, models: dict, notes: list[str]) -> list[str]:
    if not cfg.peers:
        return []
    names = ["hf-generate", "hf-assisted", "hf-prompt-lookup"]
    if "draft" not in models:
        names.remove("hf-assisted")
        notes.append("hf-assisted skipped: the engine set has no draft model")
    return names


def _llamacpp(cfg: BenchConfig, target: dict, bench: Bench, device: str):
    """The llama.cpp peer; None with a note where it was not asked for and cannot run, an error where it was."""
    if not (cfg.peers if cfg.llamacpp is None else cfg.llamacpp):
        return None
    if cfg.llamacpp is None and not (llamacpp.installed() and "gguf" in target):
        why = "the target was not exported from a GGUF file" if llamacpp.installed() else \
            f"llama-cpp-python is not installed: {llamacpp.INSTALL}"
        bench.notes.append(f"llama.cpp skipped: {why}")
        return None
    if not llamacpp.installed():
        raise BackendError(f"--llamacpp: llama-cpp-python is not installed: {llamacpp.INSTALL}")
    peer = llamacpp.LlamaCpp(llamacpp.gguf_file(target), target["max_seq_len"], bench.info["threads"])
    bench.info["versions"]["llama_cpp_python"] = llamacpp.version()
    if device != "cpu":
        bench.notes.append("llama.cpp runs on the CPU (llama-cpp-python as pip builds it by default)")
    return peer


def _floor(model) -> dict:
    """Batch-1 decode reads every weight once per step: weight bytes / read bandwidth is a floor on step time."""
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())   # fp32; tied weights counted once
    bandwidth = read_bandwidth()
    return {"bandwidth_bytes_per_s": bandwidth, "weight_bytes": weight_bytes, "floor_step_s": weight_bytes / bandwidth}


# ---- peak memory --------------------------------------------------------------------------------------------
def _memory_available(notes: list[str]) -> bool:
    if not rss.available():
        notes.append("peak memory skipped: it is read from Linux's /proc/self/status")
    return rss.available()


def _memory_specs(cfg: BenchConfig, s: _Setup, bench: Bench) -> list[dict]:
    common = {"engines": str(cfg.engines), "device": cfg.device, "threads": bench.info["threads"], "ids": s.ids,
              "temperature": cfg.temperatures[0], "max_new": cfg.max_new_tokens, "seed": cfg.seed, "eos": s.eos,
              "datastore": str(cfg.datastore) if cfg.datastore else None}
    systems = [("specrt", m) for m in s.methods] + [("transformers", p) for p in s.peers]
    specs = [{**common, "system": system, "method": method}
             for system, method in systems + ([LLAMACPP] if s.llamacpp else [])]
    return specs + [{**common, "engines": entry["engines"], "system": entry["system"], "method": m}
                    for entry in bench.info["compare"] for m in entry["methods"]]


def measure_memory(spec: dict) -> dict:
    """Peak resident memory of one method or peer, in a fresh process (`python -m specrt.measurement.bench --memory-child`)
    that imports what every system's process imports, loads only this system and generates on the bench's
    prompts at the first temperature. The high-water mark is reset after loading (transient load-time
    allocations are not counted, what loading left resident is); GPU memory is not counted."""
    r = subprocess.run([sys.executable, "-m", "specrt.measurement.bench", "--memory-child"], input=json.dumps(spec),
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise BackendError(f"peak memory of {spec['system']} {spec['method']}: the measuring process failed "
                           f"(exit {r.returncode}): {r.stderr.strip()[-2000:]}; --no-memory skips the measurement")
    return {"system": spec["system"], "method": spec["method"], "temperature": spec["temperature"],
            "prompts": len(spec["ids"]), **json.loads(r.stdout.strip().splitlines()[-1])}


def _memory_child(spec: dict) -> dict:
    _import_code(spec)
    base = rss.rss_bytes(settled=True)
    run = _load_system(spec)
    loaded = rss.rss_bytes(settled=True)
    rss.reset_peak()
    tokens = sum(run(ids, spec["seed"] + i)["tokens"] for i, ids in enumerate(spec["ids"]))
    return {"tokens": tokens, "base_rss_bytes": base, "loaded_rss_bytes": loaded, "peak_rss_bytes": rss.peak_rss_bytes()}


def _import_code(spec: dict) -> None:
    """Import the code the system runs before the baseline is read, so that code is not counted: the common stack,
    and transformers' model class and generation code (150 MB resident in themselves) or llama-cpp-python."""
    import onnxruntime  # noqa: F401
    import transformers
    if spec["system"] == "transformers":
        import transformers.generation.utils  # noqa: F401
        from specrt.export.architectures import REGISTRY
        from specrt.engines.manifest import read_manifest
        getattr(transformers, REGISTRY[read_manifest(spec["engines"])["models"]["target"]["architecture"]].hf_class)
    elif spec["system"] == LLAMACPP[0]:
        import llama_cpp  # noqa: F401


def _load_system(spec: dict):
    """Load one system as the bench does; return run(ids, seed) -> its run row."""
    from specrt.engines.base import engine_set_device
    from specrt.export.sources import load_source
    from specrt.decoding.generate import Generator
    from specrt.engines.manifest import read_manifest

    temp, new, eos, threads = spec["temperature"], spec["max_new"], spec["eos"], spec["threads"]
    torch.set_num_threads(threads)
    if spec["system"].startswith("specrt"):
        gen = Generator.from_engines(spec["engines"], device=spec["device"], threads=threads,
                                     datastore=spec.get("datastore"))
        return lambda ids, seed: run_specrt(gen, ids, spec["method"], temp, new, seed)
    manifest = read_manifest(spec["engines"])
    models = manifest["models"]
    if spec["system"] == LLAMACPP[0]:
        peer = llamacpp.LlamaCpp(llamacpp.gguf_file(models["target"]), models["target"]["max_seq_len"], threads)
        return lambda ids, seed: run_llamacpp(peer, ids, temp, new, seed, eos)
    device = engine_set_device(manifest, spec["engines"], spec["device"])   # where the engines run, as in the bench
    target = load_source(models["target"]["source"]).model.to(device)
    assistant = load_source(models["draft"]["source"]).model.to(device) if spec["method"] == "hf-assisted" else None
    return lambda ids, seed: run_peer(target, ids, spec["method"], temp, new, seed, eos, assistant)


# ---- the command --------------------------------------------------------------------------------------------
def _csv(kind):
    def parse(ctx, param, value):
        try:
            return tuple(kind(v) for v in value.replace(" ", "").split(",") if v)
        except ValueError:
            raise click.BadParameter(f"{value!r}: expected comma-separated {kind.__name__} values") from None
    return parse


@click.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="JSONL with 'turns', 'prompt' or 'prompt_ids' per row (default: the packaged MT-Bench set).")
@click.option("--long-prompts", is_flag=True,
              help="The packaged long prompts instead of MT-Bench: 4 documents of 2.6k-6.6k tokens to summarise, "
                   "edit or answer from (engines exported with --max-seq-len 8192); the report gives each method's "
                   "prefill time, decode speed and peak memory.")
@click.option("--methods", default="autoregressive,draft,ngram", show_default=True, callback=_csv(str))
@click.option("--temperatures", default="0,0.7", show_default=True, callback=_csv(float))
@click.option("--acceptance", default="exact", show_default=True, callback=_csv(str),
              help="exact, or exact,typical: each speculative method also runs with typical acceptance (Medusa's; "
                   "NOT distribution-preserving) at the temperatures above 0, as rows METHOD+typical, back to back "
                   "with its exact run.")
@click.option("--max-new-tokens", default=128, show_default=True)
@click.option("--num-prompts", default=8, show_default=True)
@click.option("--gamma-sweep", default="1,2,3,4,6,8", show_default=True, callback=_csv(int),
              help="Fixed γ values for the speedup-vs-γ plot (empty to skip).")
@click.option("--sweep-prompts", default=2, show_default=True, help="Prompts used by the γ sweep.")
@click.option("--peers/--no-peers", default=True, show_default=True,
              help="Also run transformers generate, assisted generation and prompt lookup.")
@click.option("--llamacpp/--no-llamacpp", default=None,
              help="Also run llama.cpp on the target's GGUF file (the llamacpp extra). Default: with the peers, "
                   "where llama-cpp-python is installed.")
@click.option("--memory/--no-memory", default=True, show_default=True,
              help="Measure each method's and peer's peak resident memory, one fresh process each (after the "
                   "timed runs).")
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", default=None, type=int, help="Engine and torch threads (default: all cores).")
@click.option("--device", default="auto", show_default=True,
              help="auto (the device the engine set was built for), cpu or cuda; the peers run there too.")
@click.option("--compare", multiple=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Another engine set of the same target (e.g. built with --target-weights int4) whose methods run "
                   "beside ENGINES' in the same interleaved run, as system 'specrt int4' (repeatable). Speedups "
                   "stay against ENGINES' autoregressive.")
@click.option("--datastore", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="rest: the datastore drafts are looked up in (specrt datastore build), for ENGINES and --compare.")
@click.option("--out", default="bench-out", show_default=True, type=click.Path(file_okay=False, path_type=Path))
def bench(engines, prompts, long_prompts, methods, temperatures, acceptance, max_new_tokens, num_prompts, gamma_sweep,
          sweep_prompts, peers, llamacpp, memory, seed, threads, device, compare, datastore, out):
    """Benchmark specrt's methods (and transformers peers) on ENGINES; write results.json, report.md, plots."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specrt.measurement.report import terminal_table, write_outputs
    if prompts is not None and long_prompts:
        raise click.UsageError("--prompts and --long-prompts: give one prompt set")
    cfg = BenchConfig(engines, prompts, methods, temperatures, max_new_tokens, num_prompts, gamma_sweep,
                      sweep_prompts, peers, out, seed, threads, device, llamacpp, memory, tuple(compare),
                      long_prompts, acceptance, datastore)
    console = Console(stderr=True)
    try:
        if max_new_tokens < 1 or num_prompts < 1:
            raise InputError(f"--max-new-tokens {max_new_tokens} and --num-prompts {num_prompts} must be >= 1")
        with Progress(TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            result = run_bench(cfg, progress)
    except SpecrtError as e:
        raise click.ClickException(str(e)) from e
    for note in result.notes:
        console.print(f"note: {note}", markup=False)
    files = write_outputs(result)
    stdout = Console()
    (stdout if stdout.is_terminal else Console(width=132)).print(terminal_table(files["summary"]))
    console.print(f"wrote {', '.join(str(p) for p in files['paths'])}")


# ---- prefix cache: time to first token on repeated context ------------------------------------------------
FOLLOW_UPS = ("Summarise your answers so far in two sentences.", "Which of your points matters most, and why?")


def _first_token(gen, ids: list[int], method: str, max_new: int) -> dict:
    """One greedy request, streamed: seconds to its first token and to its end, and its prompt tokens that came
    from the prefix cache."""
    t, first, tokens = time.perf_counter(), None, []
    for chunk in gen.stream(prompt_ids=ids, max_new_tokens=max_new, method=method):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t
        tokens += chunk.token_ids
        stats = chunk.stats
    return {"ttft_s": first, "total_s": time.perf_counter() - t, "prompt_tokens": len(ids),
            "cached_tokens": stats["prefix_cache_tokens"], "ids": tokens}


def prefix_cache_runs(engines: Path, methods=("autoregressive", "eagle"), chats: int = 2, turns: int = 4,
                      requests: int = 4, system_tokens: int = 1900, max_new: int = 64, mb: float = 512,
                      threads: int | None = None, log=print, llama_server: Path | None = None) -> list[dict]:
    """Each request twice, back to back: without the prefix cache, then with it (one cache per conversation or
    request set). Multi-turn chats: MT-Bench's two turns carried on with FOLLOW_UPS to `turns` turns, each turn's
    prompt the chat so far (the answers are the run without the cache's); requests sharing a system prompt of
    about `system_tokens` tokens (the first packaged long prompt, cut) with MT-Bench questions.

    `llama_server` (the llama-server binary): right after specrt's two runs, the same prompt token ids go to
    llama.cpp's server on the GGUF file the target came from, the same threads, `cache_prompt` off then on (two
    servers, one slot each, so that the "on" slot holds only the "on" requests; emptied where specrt's cache is
    made anew): each arm's times, cached tokens and where its answer first differs from specrt's."""
    from specrt.decoding.generate import Generator
    gen = Generator.from_engines(engines, threads=threads)
    peers = _llama_servers(engines, llama_server, threads) if llama_server is not None else {}
    try:
        return _prefix_cache_rows(gen, peers, methods, chats, turns, requests, system_tokens, max_new, mb, log)
    finally:
        for peer in peers.values():
            peer.close()


# llama.cpp's threads wait for each other at every op through OpenMP, which spins first: on a machine whose cores other
# processes use too, a spinning thread holds a core the one it waits for needs, and a decode step took 180-1,700 ms
# instead of 8 in 4 of 16 requests (2 threads, 2 cores, load 2.5-3.3); passive waiting: 12-25 ms, none slower.
LLAMA_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def _llama_servers(engines: Path, path: Path, threads: int | None) -> dict:
    """The llama.cpp arms' servers, "off" and "on", over the target's GGUF file, its max_seq_len positions, with
    LLAMA_ENV."""
    from specrt.engines.base import default_threads
    from specrt.engines.manifest import read_manifest
    from specrt.measurement.llama_server import LlamaServer
    target = read_manifest(engines)["models"]["target"]
    gguf = llamacpp.gguf_file(target)
    peers = {}
    try:
        for arm in ("off", "on"):
            peers[arm] = LlamaServer(gguf, target["max_seq_len"], threads or default_threads(), path, env=LLAMA_ENV)
    except BaseException:
        for peer in peers.values():
            peer.close()
        raise
    return peers


def _llama_arms(peers: dict, ids: list[int], reference: list[int], max_new: int) -> dict:
    """The request through llama.cpp's server, cache_prompt off then on; each arm's answer against specrt's
    (`reference`): `same_as_specrt`, and `diverges_at` (its first differing token, None where identical)."""
    arms = {}
    for arm in ("off", "on"):
        got = peers[arm].complete(ids, max_new, cache_prompt=arm == "on")
        out = got.pop("ids")
        at = llamacpp.first_divergence(reference, out)
        arms[f"llama.cpp {arm}"] = {**got, "tokens": len(out), "same_as_specrt": at is None, "diverges_at": at}
    return arms


def _prefix_cache_rows(gen, peers: dict, methods, chats, turns, requests, system_tokens, max_new, mb, log):
    """prefix_cache_runs' requests on `gen` (and `peers`, the llama.cpp servers by arm, where given)."""
    from specrt.decoding.prefix_cache import PrefixCache
    tok = gen.tokenizer

    def encode(messages):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    rows = []

    def run(row: dict, ids: list[int], cache, method: str) -> list[int]:
        """The request without the cache, then with it, into `rows`; returns the answer without it."""
        arms = {}
        for arm, c in (("off", None), ("on", cache)):
            gen.prefix_cache = c
            arms[arm] = _first_token(gen, ids, method, max_new)
        gen.prefix_cache = None
        off, on = (arms[a].pop("ids") for a in ("off", "on"))
        if peers:
            arms.update(_llama_arms(peers, ids, off, max_new))
        rows.append({**row, **arms, "same_output": on == off})
        log(f"{row['scenario']} {method} {row['item']}: {len(ids)} tokens ({arms['on']['cached_tokens']} cached), "
            f"first token {arms['off']['ttft_s']:.2f} s -> {arms['on']['ttft_s']:.2f} s" + "".join(
                f"; llama.cpp {arms[k]['ttft_s']:.2f} s ({arms[k]['cached_tokens']} cached)"
                for k in ("llama.cpp off", "llama.cpp on") if k in arms))
        return off

    def fresh_cache():
        """A new specrt cache, and the llama.cpp "on" slot emptied: each conversation and request set starts cold."""
        if peers:
            peers["on"].erase()
        return PrefixCache.of_mb(mb)

    chat_rows = [json.loads(r) for r in resources.files("specrt").joinpath(f"data/{MT_BENCH}").read_text()
                 .splitlines()[:chats]]
    doc = json.loads(resources.files("specrt").joinpath(f"data/{LONG_PROMPTS}").read_text().splitlines()[0])
    system = tok.decode(tok(doc["prompt"])["input_ids"][:system_tokens])
    questions = [json.loads(r)["turns"][0] for r in resources.files("specrt").joinpath(f"data/{MT_BENCH}")
                 .read_text().splitlines()[chats:chats + requests]]
    for method in methods:
        for chat in chat_rows:
            cache, messages = fresh_cache(), []
            for t, text in enumerate((list(chat["turns"]) + list(FOLLOW_UPS))[:turns]):
                messages.append({"role": "user", "content": text})
                answer = run({"scenario": "chat", "method": method, "item": f"{chat['id']} turn {t + 1}"},
                             encode(messages), cache, method)
                messages.append({"role": "assistant", "content": tok.decode(answer, skip_special_tokens=True)})
        cache = fresh_cache()
        for i, q in enumerate(questions):
            run({"scenario": "shared system prompt", "method": method, "item": f"request {i + 1}"},
                encode([{"role": "system", "content": system}, {"role": "user", "content": q}]), cache, method)
    return rows


LLAMA_ARMS = ("llama.cpp off", "llama.cpp on")   # the rows' llama.cpp arms (prefix_cache_runs' llama_server)


def _agreement(r: dict) -> str:
    """llama.cpp's answers against specrt's: yes, or the first differing token of each arm."""
    off, on = (r[a]["diverges_at"] for a in LLAMA_ARMS)
    if off == on:
        return "yes" if off is None else f"from token {off}"
    return ", ".join(f"{arm}: {'yes' if at is None else f'from token {at}'}" for arm, at in (("off", off), ("on", on)))


def prefix_cache_table(rows: list[dict]) -> list[str]:
    """Markdown: each request's time to first token and total time without and with the cache, then per scenario
    and method the means over the requests that found a cached prefix; where the rows have llama.cpp's arms, its
    figures for the same requests beside specrt's, and how many of its answers are token-identical to specrt's."""
    peer = bool(rows) and all(a in r for r in rows for a in LLAMA_ARMS)
    extra = " llama.cpp cached | llama.cpp first token off s | on s | total off s | on s | llama.cpp = specrt |"
    lines = ["| scenario | method | request | prompt tokens | cached | first token off s | on s | total off s | on s "
             "| same output |" + (extra if peer else ""), "|---" * (10 + 6 * peer) + "|"]
    for r in rows:
        line = (f"| {r['scenario']} | {r['method']} | {r['item']} | {r['on']['prompt_tokens']} | "
                f"{r['on']['cached_tokens']} | {r['off']['ttft_s']:.2f} | {r['on']['ttft_s']:.2f} | "
                f"{r['off']['total_s']:.2f} | {r['on']['total_s']:.2f} | {'yes' if r['same_output'] else 'no'} |")
        if peer:
            off, on = (r[a] for a in LLAMA_ARMS)
            line += (f" {on['cached_tokens']} | {off['ttft_s']:.2f} | {on['ttft_s']:.2f} | {off['total_s']:.2f} | "
                     f"{on['total_s']:.2f} | {_agreement(r)} |")
        lines.append(line)
    extra = " llama.cpp first token off s | on s | speedup | total off s | on s |"
    lines += ["", "| scenario | method | requests with a hit | mean cached tokens | first token off s | on s | "
              "speedup | total off s | on s |" + (extra if peer else ""), "|---" * (9 + 5 * peer) + "|"]
    arms = ("off", "on") + (LLAMA_ARMS if peer else ())
    for key in dict.fromkeys((r["scenario"], r["method"]) for r in rows):
        hit = [r for r in rows if (r["scenario"], r["method"]) == key and r["on"]["cached_tokens"]]
        if not hit:
            continue
        mean = {(a, k): float(np.mean([r[a][k] for r in hit])) for a in arms for k in ("ttft_s", "total_s")}
        cached = np.mean([r["on"]["cached_tokens"] for r in hit])
        line = (f"| {key[0]} | {key[1]} | {len(hit)} | {cached:.0f} | {mean['off', 'ttft_s']:.2f} | "
                f"{mean['on', 'ttft_s']:.2f} | {mean['off', 'ttft_s'] / mean['on', 'ttft_s']:.1f}x | "
                f"{mean['off', 'total_s']:.2f} | {mean['on', 'total_s']:.2f} |")
        if peer:
            off, on = LLAMA_ARMS
            line += (f" {mean[off, 'ttft_s']:.2f} | {mean[on, 'ttft_s']:.2f} | "
                     f"{mean[off, 'ttft_s'] / mean[on, 'ttft_s']:.1f}x | {mean[off, 'total_s']:.2f} | "
                     f"{mean[on, 'total_s']:.2f} |")
        lines.append(line)
    if peer:
        same = {a: sum(r[a]["same_as_specrt"] for r in rows) for a in LLAMA_ARMS}
        lines += ["", f"llama.cpp's answers token-identical to specrt's (cache off): {same[LLAMA_ARMS[0]]} of "
                      f"{len(rows)} with cache_prompt off, {same[LLAMA_ARMS[1]]} of {len(rows)} with it on."]
    return lines


@click.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--methods", default="autoregressive,eagle", show_default=True, help="Comma-separated methods.")
@click.option("--chats", default=2, show_default=True, help="MT-Bench conversations, each carried on to --turns.")
@click.option("--turns", default=4, show_default=True)
@click.option("--requests", default=4, show_default=True, help="Requests sharing the long system prompt.")
@click.option("--system-tokens", default=1900, show_default=True)
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--prefix-cache", "mb", default=512.0, show_default=True, help="The cache's size in MB.")
@click.option("--threads", default=None, type=int, help="Engine threads (default: all cores); llama.cpp's too.")
@click.option("--llama-server", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="llama.cpp's server binary (make llama-server: build/llama.cpp/bin/llama-server): the same "
                   "requests' token ids, right after specrt's, to two of its servers on the target's GGUF file, "
                   "cache_prompt off and on, as columns beside specrt's.")
@click.option("--out", default="prefix-cache.json", show_default=True, type=click.Path(dir_okay=False, path_type=Path))
def prefix_cache_bench(engines, methods, chats, turns, requests, system_tokens, max_new_tokens, mb, threads,
                       llama_server, out):
    """Time to first token and total time with the prefix cache off and on, side by side (prefix_cache_runs)."""
    load = _load()
    try:
        rows = prefix_cache_runs(engines, tuple(methods.split(",")), chats, turns, requests, system_tokens,
                                 max_new_tokens, mb, threads, log=lambda line: click.echo(line, err=True),
                                 llama_server=llama_server)
    except SpecrtError as e:
        raise click.ClickException(str(e)) from e
    from specrt.engines.base import default_threads
    info = {**machine_info(threads or default_threads()), "load_average_start": load}
    if llama_server is not None:
        from specrt.measurement.llama_server import version
        info["versions"]["llama-server"] = version(llama_server)
        info["llama_server_env"] = LLAMA_ENV
    out.write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    click.echo("\n".join(prefix_cache_table(rows)))


if __name__ == "__main__" and sys.argv[1:] == ["--memory-child"]:
    print(json.dumps(_memory_child(json.load(sys.stdin))))
elif __name__ == "__main__" and sys.argv[1:2] == ["prefix-cache"]:
    prefix_cache_bench.main(sys.argv[2:], prog_name="python -m specrt.measurement.bench prefix-cache")
