"""The `TreeAttention` op (domain `specrt`): a float64 reference, a torch implementation and its ONNX functions
(a dynamic body that reads the valid cache prefix, and a static one for fixed-shape graphs).

Inputs: query [B,H,S,D], static cache keys/values [B,Hkv,Smax,D], new keys/values [B,Hkv,S,D],
`past_len` [B] (valid cached positions per row) and `tree_mask` [B,S,S] (node i may see node j).
Output: [B,H,S,D]. Query head h reads key/value head h // (H / Hkv) (grouped-query attention).
Each query attends to the row's valid cache prefix and to the new tokens its mask allows.
"""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

DOMAIN = "specrt"
OP_TYPE = "TreeAttention"
INPUTS = ["query", "k_cache", "v_cache", "k_new", "v_new", "past_len", "tree_mask"]


def reference(q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale):
    """Float64 reference, one row and one head at a time: the definition, not a fast path."""
    q, k_cache, v_cache, k_new, v_new = (np.asarray(a, np.float64) for a in (q, k_cache, v_cache, k_new, v_new))
    B, H, S, D = q.shape
    group = H // k_cache.shape[1]
    out = np.zeros_like(q)
    for b in range(B):
        L = int(past_len[b])
        for h in range(H):
            kv = h // group
            keys = np.concatenate([k_cache[b, kv, :L], k_new[b, kv]])      # (L+S, D)
            values = np.concatenate([v_cache[b, kv, :L], v_new[b, kv]])    # (L+S, D)
            visible = np.concatenate([np.ones((S, L), bool), np.asarray(tree_mask[b], bool)], axis=1)  # (S, L+S)
            scores = np.where(visible, q[b, h] @ keys.T * scale, -np.inf)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[b, h] = (weights / weights.sum(axis=1, keepdims=True)) @ values
    return out


def tree_attention_torch(q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale: float):
    """The same computation in torch, in the shapes the ONNX function uses (eager runs and tracing)."""
    B, H, S, D = q.shape
    Hkv = k_cache.shape[1]
    L = int(past_len.max()) if past_len.numel() else 0
    keys = torch.cat([k_cache[:, :, :L], k_new], dim=2)                 # (B, Hkv, L+S, D)
    values = torch.cat([v_cache[:, :, :L], v_new], dim=2)               # (B, Hkv, L+S, D)
    cache_ok = torch.arange(L)[None, :] < past_len[:, None]             # (B, L)
    visible = torch.cat([cache_ok[:, None, :].expand(B, S, L), tree_mask], dim=2)  # (B, S, L+S)
    bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
    qg = q.reshape(B, Hkv, -1, D)                                       # (B, Hkv, G*S, D)
    scores = (qg @ keys.transpose(2, 3)) * scale                        # (B, Hkv, G*S, L+S)
    scores = scores.reshape(B, Hkv, -1, S, L + S) + bias[:, None, None]  # (B, Hkv, G, S, L+S)
    probs = torch.softmax(scores, dim=-1).reshape(B, Hkv, -1, L + S)    # (B, Hkv, G*S, L+S)
    return (probs @ values).reshape(B, H, S, D)                         # (B, H, S, D)


@torch.library.custom_op("specrt::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor, past_len: torch.Tensor, tree_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Eager: `tree_attention_torch`. Traced by the TorchScript exporter: one `specrt::TreeAttention` node."""
    return tree_attention_torch(q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale)


@tree_attention.register_fake
def _(q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale):
    return torch.empty_like(q)


def _symbolic(g, q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale):
    from torch.onnx import symbolic_helper
    scale = symbolic_helper._maybe_get_const(scale, "f")
    out = g.op(f"{DOMAIN}::{OP_TYPE}", q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale_f=scale)
    out.setType(q.type())
    return out


torch.onnx.register_custom_op_symbolic("specrt::tree_attention", _symbolic, 1)


def function_proto(opset: int = 17) -> onnx.FunctionProto:
    """The op's ONNX function body, so that ONNX Runtime (which inlines it) runs the op unchanged."""
    n = helper.make_node

    def ints(name, vals):
        return n("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals))

    def scalar(name, val, dtype):
        return n("Constant", [], [name], value=helper.make_tensor(name, dtype, [], [val]))

    scale = n("Constant", [], ["scale"])
    ref = onnx.AttributeProto(name="value_float", ref_attr_name="scale", type=onnx.AttributeProto.FLOAT)
    scale.attribute.append(ref)
    nodes = [
        ints("i0", [0]), ints("i1", [1]), ints("i2", [2]), ints("i3", [3]), ints("i4", [4]), ints("im1", [-1]),
        scalar("zero", 0, TensorProto.INT64), scalar("one", 1, TensorProto.INT64),
        scalar("fzero", 0.0, TensorProto.FLOAT), scalar("ninf", float("-inf"), TensorProto.FLOAT), scale,
        # L = max(past_len): read only the valid prefix of the static cache
        n("ReduceMax", ["past_len"], ["L"], keepdims=0),
        n("Unsqueeze", ["L", "i0"], ["L1"]),
        n("Slice", ["k_cache", "i0", "L1", "i2"], ["k_valid"]),          # (B, Hkv, L, D)
        n("Slice", ["v_cache", "i0", "L1", "i2"], ["v_valid"]),
        n("Concat", ["k_valid", "k_new"], ["keys"], axis=2),             # (B, Hkv, L+S, D)
        n("Concat", ["v_valid", "v_new"], ["values"], axis=2),
        # visibility (B, S, L+S): cache slot j iff j < past_len[b]; new token j iff tree_mask[b, i, j]
        n("Range", ["zero", "L", "one"], ["slots"]),
        n("Unsqueeze", ["slots", "i0"], ["slots_row"]),                  # (1, L)
        n("Unsqueeze", ["past_len", "i1"], ["past_col"]),                # (B, 1)
        n("Less", ["slots_row", "past_col"], ["cache_ok"]),              # (B, L)
        n("Unsqueeze", ["cache_ok", "i1"], ["cache_ok3"]),               # (B, 1, L)
        n("Shape", ["tree_mask"], ["mask_shape"]),                       # [B, S, S]
        n("Slice", ["mask_shape", "i0", "i2", "i0"], ["BS"]),
        n("Slice", ["mask_shape", "i1", "i2", "i0"], ["S1"]),
        n("Concat", ["BS", "L1"], ["BSL"], axis=0),
        n("Expand", ["cache_ok3", "BSL"], ["cache_ok_s"]),               # (B, S, L)
        n("Concat", ["cache_ok_s", "tree_mask"], ["visible"], axis=2),   # (B, S, L+S)
        n("Where", ["visible", "fzero", "ninf"], ["bias3"]),
        n("Unsqueeze", ["bias3", "i1"], ["bias4"]),                      # (B, 1, S, L+S)
        n("Unsqueeze", ["bias4", "i1"], ["bias"]),                       # (B, 1, 1, S, L+S)
        # grouped-query attention without repeating the cache: (B, H, S, D) -> (B, Hkv, G*S, D)
        n("Shape", ["query"], ["q_shape"]),
        n("Shape", ["k_cache"], ["kv_shape"]),
        n("Slice", ["kv_shape", "i1", "i2", "i0"], ["Hkv"]),
        n("Slice", ["q_shape", "i3", "i4", "i0"], ["D"]),
        n("Concat", ["i0", "Hkv", "im1", "D"], ["qg_shape"], axis=0),
        n("Reshape", ["query", "qg_shape"], ["qg"]),                     # (B, Hkv, G*S, D)
        n("Transpose", ["keys"], ["keys_t"], perm=[0, 1, 3, 2]),         # (B, Hkv, D, L+S)
        n("MatMul", ["qg", "keys_t"], ["raw"]),                          # (B, Hkv, G*S, L+S)
        n("Mul", ["raw", "scale"], ["scores"]),
        n("Shape", ["raw"], ["raw_shape"]),
        n("Slice", ["raw_shape", "i3", "i4", "i0"], ["LS"]),
        n("Concat", ["i0", "i0", "im1", "S1", "LS"], ["s5_shape"], axis=0),
        n("Reshape", ["scores", "s5_shape"], ["scores5"]),               # (B, Hkv, G, S, L+S)
        n("Add", ["scores5", "bias"], ["masked"]),
        n("Softmax", ["masked"], ["probs5"], axis=-1),
        n("Reshape", ["probs5", "raw_shape"], ["probs"]),                # (B, Hkv, G*S, L+S)
        n("MatMul", ["probs", "values"], ["context"]),                   # (B, Hkv, G*S, D)
        n("Reshape", ["context", "q_shape"], ["output"]),                # (B, H, S, D)
    ]
    return helper.make_function(DOMAIN, OP_TYPE, INPUTS, ["output"], nodes,
                                opset_imports=[helper.make_opsetid("", opset)], attributes=["scale"])


def static_function_proto(opset: int = 17) -> onnx.FunctionProto:
    """A second body for the same op, for graphs whose shapes are all fixed (CUDA graph capture): attention over
    the whole static cache [B,Hkv,Smax,D], slots at or past `past_len` masked out, no slice to max(past_len).
    The cache is read where it is, never copied: the scores against the cache and against the new tokens are
    two products joined along the key axis (G*S rows, not Smax×D), and the context is the sum of the two
    probability-weighted halves. Its Shape nodes read static shapes only, so ONNX Runtime folds them to
    constants. Constants follow the query's dtype (CastLike), so float16 and bfloat16 graphs use it unchanged.
    The cache past `past_len` must hold finite values (zero weight times NaN is NaN); the static caches only ever
    hold written entries or zeros."""
    n = helper.make_node

    def ints(name, vals):
        return n("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals))

    def scalar(name, val, dtype):
        return n("Constant", [], [name], value=helper.make_tensor(name, dtype, [], [val]))

    scale = n("Constant", [], ["scale_f"])
    scale.attribute.append(onnx.AttributeProto(name="value_float", ref_attr_name="scale",
                                               type=onnx.AttributeProto.FLOAT))
    nodes = [
        ints("i0", [0]), ints("i1", [1]), ints("i2", [2]), ints("i3", [3]), ints("i4", [4]), ints("im1", [-1]),
        scalar("zero", 0, TensorProto.INT64), scalar("one", 1, TensorProto.INT64),
        scalar("fzero", 0.0, TensorProto.FLOAT), scalar("ninf", float("-inf"), TensorProto.FLOAT), scale,
        n("CastLike", ["scale_f", "query"], ["scale"]),
        # visibility (B, S, Smax+S): cache slot j iff j < past_len[b]; new token j iff tree_mask[b, i, j]
        n("Shape", ["k_cache"], ["kv_shape"]),                           # [B, Hkv, Smax, D], static
        n("Slice", ["kv_shape", "i2", "i3", "i0"], ["Smax1"]),
        n("Squeeze", ["Smax1", "i0"], ["Smax"]),
        n("Range", ["zero", "Smax", "one"], ["slots"]),                  # (Smax,), a constant once folded
        n("Unsqueeze", ["slots", "i0"], ["slots_row"]),                  # (1, Smax)
        n("Unsqueeze", ["past_len", "i1"], ["past_col"]),                # (B, 1)
        n("Less", ["slots_row", "past_col"], ["cache_ok"]),              # (B, Smax)
        n("Unsqueeze", ["cache_ok", "i1"], ["cache_ok3"]),               # (B, 1, Smax)
        n("Shape", ["tree_mask"], ["mask_shape"]),                       # [B, S, S]
        n("Slice", ["mask_shape", "i0", "i2", "i0"], ["BS"]),
        n("Slice", ["mask_shape", "i1", "i2", "i0"], ["S1"]),
        n("Concat", ["BS", "Smax1"], ["BSL"], axis=0),
        n("Expand", ["cache_ok3", "BSL"], ["cache_ok_s"]),               # (B, S, Smax)
        n("Concat", ["cache_ok_s", "tree_mask"], ["visible"], axis=2),   # (B, S, Smax+S)
        n("Where", ["visible", "fzero", "ninf"], ["bias_f"]),
        n("CastLike", ["bias_f", "query"], ["bias3"]),
        n("Unsqueeze", ["bias3", "i1"], ["bias4"]),                      # (B, 1, S, Smax+S)
        n("Unsqueeze", ["bias4", "i1"], ["bias"]),                       # (B, 1, 1, S, Smax+S)
        # grouped-query attention without repeating the cache: (B, H, S, D) -> (B, Hkv, G*S, D)
        n("Shape", ["query"], ["q_shape"]),
        n("Slice", ["kv_shape", "i1", "i2", "i0"], ["Hkv"]),
        n("Slice", ["q_shape", "i3", "i4", "i0"], ["D"]),
        n("Concat", ["i0", "Hkv", "im1", "D"], ["qg_shape"], axis=0),
        n("Reshape", ["query", "qg_shape"], ["qg"]),                     # (B, Hkv, G*S, D)
        n("Transpose", ["k_cache"], ["k_cache_t"], perm=[0, 1, 3, 2]),   # (B, Hkv, D, Smax), fused into the MatMul
        n("Transpose", ["k_new"], ["k_new_t"], perm=[0, 1, 3, 2]),       # (B, Hkv, D, S)
        n("MatMul", ["qg", "k_cache_t"], ["raw_cache"]),                 # (B, Hkv, G*S, Smax)
        n("MatMul", ["qg", "k_new_t"], ["raw_new"]),                     # (B, Hkv, G*S, S)
        n("Concat", ["raw_cache", "raw_new"], ["raw"], axis=3),          # (B, Hkv, G*S, Smax+S)
        n("Mul", ["raw", "scale"], ["scores"]),
        n("Shape", ["raw"], ["raw_shape"]),
        n("Slice", ["raw_shape", "i3", "i4", "i0"], ["LS"]),
        n("Concat", ["i0", "i0", "im1", "S1", "LS"], ["s5_shape"], axis=0),
        n("Reshape", ["scores", "s5_shape"], ["scores5"]),               # (B, Hkv, G, S, Smax+S)
        n("Add", ["scores5", "bias"], ["masked"]),
        n("Softmax", ["masked"], ["probs5"], axis=-1),
        n("Reshape", ["probs5", "raw_shape"], ["probs"]),                # (B, Hkv, G*S, Smax+S)
        n("Concat", ["Smax1", "S1"], ["halves"], axis=0),                # [Smax, S]
        n("Split", ["probs", "halves"], ["p_cache", "p_new"], axis=3),   # (B, Hkv, G*S, Smax), (B, Hkv, G*S, S)
        n("MatMul", ["p_cache", "v_cache"], ["ctx_cache"]),              # (B, Hkv, G*S, D)
        n("MatMul", ["p_new", "v_new"], ["ctx_new"]),
        n("Add", ["ctx_cache", "ctx_new"], ["context"]),                 # (B, Hkv, G*S, D)
        n("Reshape", ["context", "q_shape"], ["output"]),                # (B, H, S, D)
    ]
    return helper.make_function(DOMAIN, OP_TYPE, INPUTS, ["output"], nodes,
                                opset_imports=[helper.make_opsetid("", opset)], attributes=["scale"])


def attach_function(model: onnx.ModelProto, static: bool = False) -> onnx.ModelProto:
    """Give a graph that uses `specrt::TreeAttention` the op's function body and opset import. `static`
    replaces any body it has with `static_function_proto` (graphs with every shape fixed)."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if static:
        kept = [f for f in model.functions if not (f.domain == DOMAIN and f.name == OP_TYPE)]
        del model.functions[:]
        model.functions.extend(kept + [static_function_proto(opset)])
    elif not any(f.domain == DOMAIN and f.name == OP_TYPE for f in model.functions):
        model.functions.append(function_proto(opset))
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model
