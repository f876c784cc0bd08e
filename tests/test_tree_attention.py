"""The TreeAttention op's ONNX function (as ONNX Runtime runs it), and the inlined form the CPU engines' fused graph
gives it (specrt.export.fuse), against the float64 reference over random shapes, grouped-query layouts, trees and
per-row past_len."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specrt.export.fuse import fuse_graph
from specrt.engines.manifest import WRITTEN
from specrt.plugins.tree_attention import DOMAIN, INPUTS, OP_TYPE, attach_function, reference, tree_attention_torch


def op_model(scale: float, fused: dict | None = None, window: int = 0, softcap: float = 0.0,
             static: bool = False) -> bytes:
    """One TreeAttention node; `fused` (heads, kv_heads, head_dim): inlined by the engines' graph rewrite;
    `static`: the static body (the CUDA width graphs')."""
    f, i64, b = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    types = [f, f, f, f, f, i64, b]
    ins = [helper.make_tensor_value_info(n, t, None) for n, t in zip(INPUTS, types)]
    node = helper.make_node(OP_TYPE, INPUTS, ["out"], domain=DOMAIN, scale=scale, window=window, softcap=softcap)
    graph = helper.make_graph([node], "op", ins, [helper.make_tensor_value_info("out", f, None)])
    model = attach_function(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), static=static)
    if fused is not None:
        model, counts = fuse_graph(model, fused)
        assert counts == {"attention": 1} and not any(n.domain == DOMAIN for n in model.graph.node)
    return model.SerializeToString()


def random_tree(rng, S):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, S)]
    mask = np.zeros((S, S), bool)
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
    return mask


@pytest.mark.parametrize("fused", [False, True], ids=["function", "fused"])
@pytest.mark.parametrize("seed", range(16))
def test_op_matches_float64_reference(seed, fused):
    """Also with a sliding window (a query sees the keys of its last W positions, the tree's ancestors by depth) and
    a soft-cap of the scores."""
    rng = np.random.default_rng(seed)
    B = int(rng.integers(1, 4))
    Hkv = int(rng.choice([1, 2, 3]))
    H = Hkv * int(rng.choice([1, 2, 4]))
    D = int(rng.choice([4, 8, 16]))
    S = int(rng.integers(1, 9))
    Smax = 24
    past = rng.integers(0, Smax - S + 1, size=B)
    scale = float(D) ** -0.5
    window = [0, 1, 3, 6][seed % 4]
    softcap = [0.0, 0.7][seed // 4 % 2]
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    inputs = dict(query=r(B, H, S, D), k_cache=r(B, Hkv, Smax, D), v_cache=r(B, Hkv, Smax, D),
                  k_new=r(B, Hkv, S, D), v_new=r(B, Hkv, S, D), past_len=past.astype(np.int64),
                  tree_mask=np.stack([random_tree(rng, S) for _ in range(B)]))
    heads = dict(heads=H, kv_heads=Hkv, head_dim=D) if fused else None
    session = ort.InferenceSession(op_model(scale, heads, window, softcap), providers=["CPUExecutionProvider"])
    got = session.run(None, inputs)[0]
    want = reference(*inputs.values(), scale, window, softcap)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("body", ["reference", "torch", "function", "fused", "static"])
def test_window_sees_the_last_w_positions(body):
    """Sliding-window attention by its definition: with equal scores (zero queries) and each key's value its
    position, a query's output is the mean position it sees: with window W, the query at position p sees its path's
    positions p - W + 1 .. p (cache slots, then its tree ancestors), and nothing else."""
    L, W, Smax = 9, 4, 16
    parents = [-1, 0, 0, 1, 3, 4, 2]                     # depths 0, 1, 1, 2, 3, 4, 2
    mask = np.zeros((len(parents), len(parents)), bool)
    for i, p in enumerate(parents):
        mask[i] = mask[p] if p >= 0 else False
        mask[i, i] = True
    S, depth = len(parents), mask.sum(1) - 1
    pos = L + depth
    v_cache = np.zeros((1, 1, Smax, 2), np.float32)
    v_cache[0, 0, :, 0] = np.arange(Smax)
    v_cache[0, 0, L:, 0] = 1e3                               # past past_len: never seen
    v_new = np.zeros((1, 1, S, 2), np.float32)
    v_new[0, 0, :, 0] = pos
    inputs = dict(query=np.zeros((1, 2, S, 2), np.float32), k_cache=np.zeros_like(v_cache), v_cache=v_cache,
                  k_new=np.zeros_like(v_new), v_new=v_new, past_len=np.array([L]), tree_mask=mask[None])
    if body == "reference":
        got = reference(*inputs.values(), 1.0, W)
    elif body == "torch":
        import torch
        got = tree_attention_torch(*(torch.from_numpy(x) for x in inputs.values()), 1.0, W).numpy()
    else:
        fused = dict(heads=2, kv_heads=1, head_dim=2) if body == "fused" else None
        session = ort.InferenceSession(op_model(1.0, fused, window=W, static=body == "static"),
                                       providers=["CPUExecutionProvider"])
        got = session.run(None, inputs)[0]
    want = [np.mean(np.arange(p - W + 1, p + 1)) for p in pos]
    np.testing.assert_allclose(got[0, :, :, 0], np.array([want, want]), rtol=1e-6)


@pytest.mark.parametrize("fused", [None, dict(heads=2, kv_heads=1, head_dim=4)], ids=["function", "fused"])
def test_cache_beyond_past_len_is_ignored(fused):
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(s).astype(np.float32) for s in [(1, 2, 3, 4), (1, 1, 8, 4), (1, 1, 8, 4),
                                                                (1, 1, 3, 4), (1, 1, 3, 4)]]
    past, mask = np.array([5]), np.tril(np.ones((3, 3), bool))[None]
    session = ort.InferenceSession(op_model(0.5, fused), providers=["CPUExecutionProvider"])
    a = session.run(None, dict(zip(INPUTS, args + [past, mask])))[0]
    args[1][:, :, 5:] = 1e4  # garbage past the valid prefix
    # the fused graph reads every slot of the cache (masked past the prefix: probability 0), so its garbage must be
    # finite, as the runtime's caches are (zeroed, then written only by the engines); the function reads a copy
    # of the prefix only
    args[2][:, :, 5:] = -3e4 if fused else np.nan
    b = session.run(None, dict(zip(INPUTS, args + [past, mask])))[0]
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("length", [9, 32], ids=["whole-cache", "window"])
def test_fused_attention_writes_the_cache_in_place(length):
    """Bound to the cache inputs' own buffers, the fused graph's written caches are the inputs themselves: the new
    keys and values land at each row's past_len (the rest untouched), and the attention is the reference's, both
    where it reads the whole cache and where it reads a copy of the window the pass needs (a cache over 3/2 of
    it)."""
    rng = np.random.default_rng(1)
    B, H, Hkv, D, S = 2, 4, 2, 8, 3
    past = np.array([2, 6])
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    inputs = dict(query=r(B, H, S, D), k_cache=r(B, Hkv, length, D), v_cache=r(B, Hkv, length, D),
                  k_new=r(B, Hkv, S, D), v_new=r(B, Hkv, S, D), past_len=past,
                  tree_mask=np.stack([random_tree(rng, S) for _ in range(B)]))
    want = reference(*inputs.values(), 0.5)
    k_before, v_before = inputs["k_cache"].copy(), inputs["v_cache"].copy()
    session = ort.InferenceSession(op_model(0.5, dict(heads=H, kv_heads=Hkv, head_dim=D)),
                                   providers=["CPUExecutionProvider"])
    io = session.io_binding()
    for name, x in inputs.items():
        io.bind_cpu_input(name, x)
    io.bind_output("out")
    for name in ("k_cache", "v_cache"):   # the runtime binds the written caches to the caches' own buffers
        x = inputs[name]
        io.bind_output(name + WRITTEN, "cpu", 0, x.dtype, x.shape, x.ctypes.data)
    session.run_with_iobinding(io)
    np.testing.assert_allclose(io.copy_outputs_to_cpu()[0], want, atol=2e-5, rtol=1e-5)
    for cache, before, new in ((inputs["k_cache"], k_before, inputs["k_new"]),
                               (inputs["v_cache"], v_before, inputs["v_new"])):
        expected = before.copy()
        for b, p in enumerate(past):
            expected[b, :, p:p + S] = new[b]
        np.testing.assert_array_equal(cache, expected)


def test_function_attached_once():
    model = onnx.load_from_string(op_model(1.0))
    again = attach_function(model)
    assert sum(f.name == OP_TYPE for f in again.functions) == 1
