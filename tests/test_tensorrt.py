"""The TensorRT backend: its kernel against the float64 reference (runs anywhere), its errors without TensorRT,
and an engine built from a tiny export against the ONNX Runtime engine (skipped where TensorRT is missing)."""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from specrt.engines.base import OrtEngine
from specrt.engines.tensorrt import TensorRTEngine
from specrt.errors import BackendError
from specrt.export.build import tensorrt_available
from specrt.plugins.tensorrt_plugin import load_tensorrt, tree_attention_static
from specrt.plugins.tree_attention import reference
from specrt.engines.static import StaticWidthEngine

MISSING = "TensorRT not installed (cannot be installed on these machines)"
needs_tensorrt = pytest.mark.skipif(not (tensorrt_available() and torch.cuda.is_available()), reason=MISSING)


@pytest.mark.parametrize("B,H,Hkv,S,Smax,D", [(1, 4, 2, 1, 8, 8), (2, 6, 3, 5, 12, 16), (3, 2, 2, 7, 7, 4)])
def test_static_kernel_matches_reference(B, H, Hkv, S, Smax, D):
    """The plugin's kernel attends over the whole static cache with a mask from past_len; the float64
    reference reads only the valid prefix. Stale values past past_len must not leak in."""
    g = torch.Generator().manual_seed(B * 100 + S)
    q, k_new, v_new = (torch.randn(B, n, S, D, generator=g, dtype=torch.float64) for n in (H, Hkv, Hkv))
    k_cache, v_cache = (torch.randn(B, Hkv, Smax, D, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    past_len = torch.randint(0, Smax + 1, (B,), generator=g)
    past_len[0] = 0                                                # a row with an empty cache
    tree_mask = torch.rand(B, S, S, generator=g) < 0.5
    tree_mask |= torch.eye(S, dtype=torch.bool)                     # every node sees itself
    args = (q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, D ** -0.5)
    got = tree_attention_static(*args)
    want = reference(*(a.numpy() if torch.is_tensor(a) else a for a in args))
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (4, 0.0), (3, 0.6)])
def test_static_kernel_window_and_softcap(window, softcap):
    """The plugin's kernel with the op's `window` and `softcap` attributes (tree masks are ancestor-or-self: a
    node's depth is its ancestors' count), against the float64 reference."""
    from test_tree_attention import random_tree
    rng = np.random.default_rng(window)
    B, H, Hkv, S, Smax, D = 2, 4, 2, 6, 10, 8
    q, k_new, v_new = (torch.from_numpy(rng.standard_normal((B, n, S, D))) for n in (H, Hkv, Hkv))
    k_cache, v_cache = (torch.from_numpy(rng.standard_normal((B, Hkv, Smax, D)) * 3) for _ in range(2))
    past_len = torch.tensor([0, 7])
    tree_mask = torch.from_numpy(np.stack([random_tree(rng, S) for _ in range(B)]))
    args = (q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, D ** -0.5, window, softcap)
    want = reference(*(a.numpy() if torch.is_tensor(a) else a for a in args))
    np.testing.assert_allclose(tree_attention_static(*args).numpy(), want, rtol=1e-10, atol=1e-10)


def test_static_kernel_float32_and_bool_mask_types():
    q = torch.randn(1, 2, 3, 4)
    cache = torch.randn(1, 1, 5, 4)
    out = tree_attention_static(q, cache, cache, q[:, :1], q[:, :1], torch.tensor([2]), torch.ones(1, 3, 3).tril(),
                                0.5)
    assert out.shape == q.shape and out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.skipif(tensorrt_available(), reason="TensorRT is installed here")
def test_without_tensorrt_the_engine_says_how_to_fix(tmp_path):
    with pytest.raises(BackendError, match=r"TensorRT is not installed.*specrt\[gpu\].*--backend onnxruntime"):
        TensorRTEngine(tmp_path / "target.plan", {"layers": 2})
    with pytest.raises(BackendError, match="TensorRT is not installed"):
        load_tensorrt()


@needs_tensorrt
def test_cpu_device_is_refused(tmp_path):
    with pytest.raises(BackendError, match="NVIDIA GPU"):
        TensorRTEngine(tmp_path / "target.plan", {"layers": 2}, device="cpu")


@needs_tensorrt
def test_engine_matches_onnxruntime(tmp_path):
    """A TensorRT engine built (float32) from a tiny export gives the ONNX Runtime engine's logits, hidden
    states and new cache entries, for a prefill and for a tree pass over the cache."""
    import json

    from conftest import export_tiny
    from specrt.plugins.tensorrt_plugin import build_engine
    directory, _ = export_tiny(tmp_path, "llama", max_seq_len=32)
    spec = json.loads((directory / "manifest.json").read_text())["models"]["target"]
    build_engine(directory / "target.onnx", tmp_path / "target.plan", spec["max_seq_len"], fp16=False)
    trt_engine = TensorRTEngine(tmp_path / "target.plan", spec, device="cuda")
    ort_engine = OrtEngine(directory / "target.ort.onnx", spec)
    ids = [3, 9, 4, 1, 7, 7, 2]
    a, b = trt_engine.run_sequence(ids, len(ids)), ort_engine.run_sequence(ids, len(ids))
    for x, y in ((a.logits, b.logits), (a.hidden, b.hidden), (a.new_kv, b.new_kv)):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-4, atol=1e-4)
    engines, caches = (trt_engine, ort_engine), []
    for engine in engines:  # the 7 tokens cached, then a 3-node tree (a root and two children)
        new_kv = engine.run_sequence(ids).new_kv.clone()
        cache = engine.new_cache(1, 16)
        cache.write(new_kv)
        cache.truncate(len(ids))
        caches.append(cache)
    tree = torch.tensor([[5, 6, 8]]), torch.tensor([[7, 8, 8]])
    mask = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    outs = [e.forward(*tree, c.past_len, mask, 3, c).logits.cpu().clone() for e, c in zip(engines, caches)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", [StaticWidthEngine, TensorRTEngine])
def test_backends_take_what_the_onnxruntime_engine_takes(backend):
    """The loop and gpu-check call every backend alike (an EAGLE drafter's features go to forward and time_pass
    as keywords): each backend's methods take OrtEngine's parameters, of the same kinds."""
    for name in ("new_cache", "use_cache", "forward", "run_sequence", "time_pass"):
        want = [(p.name, p.kind) for p in inspect.signature(getattr(OrtEngine, name)).parameters.values()]
        got = [(p.name, p.kind) for p in inspect.signature(getattr(backend, name)).parameters.values()]
        assert got == want, f"{backend.__name__}.{name}"


def test_auto_builds_onnxruntime_engines_where_tensorrt_imports(monkeypatch):
    """The TensorRT backend is not verified: `specrt build` picks it only when asked for by name."""
    import specrt.export.build as build_module
    monkeypatch.setattr(build_module, "tensorrt_available", lambda: True)
    assert build_module.resolve_backend("auto") == "onnxruntime"
    assert build_module.resolve_backend("tensorrt") == "tensorrt"


def test_tensorrt_engine_entry_records_float16(tmp_path, monkeypatch):
    """A TensorRT engine is built with the FP16 flag: its manifest entry says float16 weights. (TensorRT cannot be
    installed here: its builder is replaced by one that writes a placeholder plan; the entry is what is checked.)"""
    import json

    import specrt.export.build as build_module
    from conftest import export_tiny
    directory, _ = export_tiny(tmp_path, "llama", max_seq_len=16)
    spec = json.loads((directory / "manifest.json").read_text())["models"]["target"]
    monkeypatch.setattr(build_module, "build_tensorrt", lambda graph, engine, max_len: engine.write_bytes(b"plan"))
    entry = build_module._build_role(directory, "target", spec, "tensorrt", "float32")
    assert (entry["file"], entry["backend"], entry["weights"]) == ("target.plan", "tensorrt", "float16")
