"""`make check-large`: a random-weight Llama past ONNX's 2 GiB protobuf limit exported, built and run, with the peak
resident memory and the time of every step (docs/large-models.md has the measured table).

1. checkpoint: a Llama of the preset's shape with random weights (normal, std 0.02; unit norms), saved by
   transformers once under WORK (the default, 1.1b: 22 layers, hidden 2,048, 1.10 B parameters, 4.4 GB in float32);
2. reference: transformers' greedy tokens for 3 prompts x 32 tokens, with the float32 weights and with the same
   weights rounded to bfloat16 (computed in float32: what a CPU engine built from a bfloat16 export computes);
3. `specrt export` in float32 and in bfloat16, `specrt build` of each (float32 CPU engines) and an int4 build of
   the float32 export's graphs (`--cuda`: a CUDA float16 build too, which runs on any machine);
4. each engine set generates the prompts: float32 engines must give transformers' tokens, the int4 engine's ngram
   (prompt lookup, no drafter) its own autoregressive tokens; the resident memory after `Generator.from_engines`.
Every step runs in its own process: its peak resident memory is the kernel's high-water mark of that process
(ru_maxrss). Exits non-zero if tokens differ or, for a model of 4 GB of float32 weights or more, a peak of an export
or a build passes 2.5x those weights.

    python -m specrt.measurement.large [--preset 135m|584m|1.1b|tiny] [--work build/check-large] [--cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

PRESETS = {   # transformers LlamaConfig fields
    "135m": dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),   # SmolLM2-135M's shape
    "584m": dict(num_hidden_layers=46, hidden_size=1024, intermediate_size=2304, num_attention_heads=16,
                 num_key_value_heads=16, vocab_size=32000, tie_word_embeddings=False),
    "1.1b": dict(num_hidden_layers=22, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),   # TinyLlama-1.1B's shape
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),   # every step in seconds (tests)
}
NEW_TOKENS, MAX_SEQ_LEN = 32, 256
PEAK_LIMIT = 2.5   # x the float32 weights, for export and build, checked from LIMIT_FROM_GB of weights on (below,
LIMIT_FROM_GB = 4.0   # the interpreter and libraries, about 0.5 GB, are a large part of a small model's peak)


def prompts(vocab: int) -> list[list[int]]:
    """Token ids with repeats in them (something for prompt lookup to find)."""
    import random
    rng = random.Random(0)
    out = []
    for n in (12, 20, 28):
        words = [rng.randrange(3, vocab) for _ in range(5)]
        out.append([rng.choice(words) if rng.random() < 0.6 else rng.randrange(3, vocab) for _ in range(n)])
    return out


def make_checkpoint(path: Path, preset: str) -> int:
    """The random-weight checkpoint (kept: written once per preset); returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**PRESETS[preset], max_position_embeddings=2048, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())
    if (path / "config.json").is_file():
        return count
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen) * 0.02)
    model.generation_config.eos_token_id = None
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tmp.rename(path)
    return count


def reference(checkpoint: Path) -> dict:
    """transformers' greedy tokens: float32 weights, then the same weights rounded to bfloat16 (float32 compute)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = {}
    for name in ("float32", "bfloat16"):
        if name == "bfloat16":
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(torch.bfloat16).float())
        rows = []
        for ids in prompts(model.config.vocab_size):
            with torch.no_grad():
                seq = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False, pad_token_id=0)
            rows.append(seq[0, len(ids):].tolist())
        out[name] = rows
    return out


def generate(engines: Path, methods: list[str]) -> dict:
    """Each method's greedy tokens on the prompts, and the resident memory after loading the engine set."""
    from specrt import Generator
    from specrt.measurement.rss import rss_bytes
    before = rss_bytes()
    gen = Generator.from_engines(engines)
    loaded = rss_bytes()
    out = {"rss_before_load": before, "rss_after_load": loaded}
    for method in methods:
        out[method] = [gen.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS, method=method).token_ids[0]
                       for ids in prompts(gen.manifest["models"]["target"]["vocab_size"])]
    return out


def measured(args: list[str]) -> dict:
    """Run `args` as a child process: its wall time, its peak resident memory (ru_maxrss, from os.wait4) and its
    output (parsed if JSON)."""
    import tempfile
    started = time.time()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.time() - started
        out.seek(0)
        err.seek(0)
        text, errors = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))} failed ({proc.returncode}):\n{errors[-3000:]}")
    result = {"wall_s": round(wall, 1), "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2)}
    if text.strip().startswith("{"):
        result["output"] = json.loads(text)
    return result


def _copy_graphs(src: Path, dst: Path) -> None:
    """dst: the engine set src without its engines (copies: onnx refuses a data file with several hard links)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.ort.onnx*"))


def run_check(preset: str, work: Path, cuda: bool = False, keep: bool = False, log=print) -> dict:
    """Steps 1-4 of the module's docstring; returns the report (also written to WORK/large-PRESET.json)."""
    work.mkdir(parents=True, exist_ok=True)
    py, me = sys.executable, "specrt.measurement.large"
    specrt = [py, "-m", "specrt.cli"]
    checkpoint = work / f"llama-{preset}"
    if (checkpoint / "config.json").is_file():
        params = make_checkpoint(checkpoint, preset)   # counted on the meta device, the weights are not read
    else:   # in a process of its own: writing it takes the model's memory
        made = measured([py, "-m", me, "--step", "checkpoint", "--preset", preset, "--work", str(work)])
        params = made["output"]["parameters"]
    weights_gb = params * 4 / 1e9
    log(f"{preset}: {params / 1e9:.3f} B parameters, {weights_gb:.2f} GB in float32 ({checkpoint})")
    report = {"preset": preset, "shape": PRESETS[preset], "parameters": params, "float32_weights_gb": weights_gb,
              "steps": {}, "tokens": {}, "failures": []}
    steps, fails = report["steps"], report["failures"]

    def step(name: str, args: list[str]) -> dict:
        log(f"{name} ...")
        r = measured([str(a) for a in args])
        r["peak_over_float32_weights"] = round(r["peak_rss_gb"] / weights_gb, 2)
        steps[name] = {k: v for k, v in r.items() if k != "output"}
        log(f"  {r['wall_s']} s, peak {r['peak_rss_gb']} GB ({r['peak_over_float32_weights']}x the float32 weights)")
        if name.split()[0] in ("export", "build") and weights_gb >= LIMIT_FROM_GB \
                and r["peak_over_float32_weights"] > PEAK_LIMIT:
            fails.append(f"{name}: peak {r['peak_rss_gb']} GB is over {PEAK_LIMIT}x the float32 weights")
        return r.get("output")

    def same(what: str, got: list, want: list) -> None:
        report["tokens"][what] = got == want
        if got != want:
            fails.append(f"{what}: tokens differ ({got} vs {want})")
        log(f"  {what}: {'identical' if got == want else 'DIFFERENT'}")

    saved = work / f"reference-{preset}.json"   # transformers' tokens, computed once per checkpoint
    if not saved.is_file():
        saved.write_text(json.dumps(step("reference (transformers)", [py, "-m", me, "--step", "reference",
                                                                      "--checkpoint", checkpoint])))
    ref = json.loads(saved.read_text())
    for dtype in ("float32", "bfloat16"):
        out = work / f"{preset}-{dtype}"
        step(f"export {dtype}", [*specrt, "export", "--target", checkpoint, "--out", out, "--dtype", dtype,
                                 "--max-seq-len", MAX_SEQ_LEN, "--force"])
        step(f"build {dtype} export -> float32 engine", [*specrt, "build", out])
        got = step(f"generate {dtype} export, float32 engine", [py, "-m", me, "--step", "generate", "--engines", out,
                                                               "--methods", "autoregressive"])
        report[f"load_{dtype}"] = _load_report(got, out)
        same(f"{dtype} export, float32 engine == transformers ({dtype} weights)", got["autoregressive"], ref[dtype])
        if dtype == "float32":
            int4 = work / f"{preset}-int4"
            _copy_graphs(out, int4)
            step("build float32 export -> int4 engine", [*specrt, "build", int4, "--target-weights", "int4"])
            got = step("generate int4 engine", [py, "-m", me, "--step", "generate", "--engines", int4,
                                                "--methods", "autoregressive,ngram"])
            report["load_int4"] = _load_report(got, int4)
            same("int4 engine: ngram == autoregressive", got["ngram"], got["autoregressive"])
            if cuda:
                gpu = work / f"{preset}-cuda"
                _copy_graphs(out, gpu)
                step("build float32 export -> CUDA float16 engines", [*specrt, "build", gpu, "--device", "cuda",
                                                                      "--dtype", "float16"])
                if not keep:
                    shutil.rmtree(gpu, ignore_errors=True)
            if not keep:
                shutil.rmtree(int4, ignore_errors=True)
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
    (work / f"large-{preset}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def _load_report(got: dict, engines: Path) -> dict:
    """Resident memory added by Generator.from_engines against the target engine's weights on disk."""
    data = sum(f.stat().st_size for f in engines.glob("target.ort.onnx*"))
    added = got["rss_after_load"] - got["rss_before_load"]
    return {"engine_gb": round(data / 1e9, 2), "rss_added_by_load_gb": round(added / 1e9, 2),
            "ratio": round(added / data, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1.1b")
    p.add_argument("--work", type=Path, default=Path("build/check-large"))
    p.add_argument("--cuda", action="store_true", help="also a CUDA float16 build (runs on the CPU)")
    p.add_argument("--keep", action="store_true", help="keep the engine sets (default: removed, disk space)")
    p.add_argument("--step", choices=["checkpoint", "reference", "generate"], help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--engines", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--methods", default="autoregressive", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.step == "checkpoint":
        print(json.dumps({"parameters": make_checkpoint(a.work / f"llama-{a.preset}", a.preset)}))
    elif a.step == "reference":
        print(json.dumps(reference(a.checkpoint)))
    elif a.step == "generate":
        print(json.dumps(generate(a.engines, a.methods.split(","))))
    else:
        report = run_check(a.preset, a.work, a.cuda, a.keep, log=lambda m: print(m, flush=True))
        print("PASS" if not report["failures"] else "FAIL:\n  " + "\n  ".join(report["failures"]))
        return 1 if report["failures"] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
