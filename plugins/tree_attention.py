"""The `TreeAttention` op (domain `specrt`): a float64 reference, a torch implementation and its ONNX functions
(a dynamic body that reads the valid cache prefix, and a static one for fixed-shape graphs).

Inputs: query [B,H,S,D], static cache keys/values [B,Hkv,Smax,D], new keys/values [B,Hkv,S,D],
`past_len` [B] (valid cached positions per row) and `tree_mask` [B,S,S] (node i may see node j).
Output: [B,H,S,D]. Query head h reads key/value head h // (H / Hkv) (grouped-query attention).
Each query attends to the row's valid cache prefix and to the new tokens its mask allows.

Attributes: `scale` (scores = q·k · scale); `window` W (0: none): a query sees only the keys of the last W positions,
itself included (sliding-window attention), positions read off the inputs: cache slot j is position j, new token i
of row b is at past_len[b] + depth_i, its depth being its ancestors' count (its mask row, ancestor-or-self, has
depth_i + 1 entries); `softcap` c (0: none): scores -> c · tanh(scores / c) before the mask (Gemma 2).
"""
from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

DOMAIN = "specrt"
OP_TYPE = "TreeAttention"
INPUTS = ["query", "k_cache", "v_cache", "k_new", "v_new", "past_len", "tree_mask"]


def reference(q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale, window=0, softcap=0.0):
    """Float64 reference, one row and one head at a time: the definition, not a fast path."""
    q, k_cache, v_cache, k_new, v_new = (np.asarray(a, np.float64) for a in (q, k_cache, v_cache, k_new, v_new))
    B, H, S, D = q.shape
    group = H // k_cache.shape[1]
    out = np.zeros_like(q)
    for b in range(B):
        L = int(past_len[b])
        mask = np.asarray(tree_mask[b], bool)
        q_pos = L + mask.sum(1) - 1                                        # (S,) past_len + depth
        k_pos = np.concatenate([np.arange(L), q_pos])                     # (L+S,)
        visible = np.concatenate([np.ones((S, L), bool), mask], axis=1)   # (S, L+S)
        if window:
            visible &= q_pos[:, None] - k_pos[None, :] < window
        for h in range(H):
            kv = h // group
            keys = np.concatenate([k_cache[b, kv, :L], k_new[b, kv]])      # (L+S, D)
            values = np.concatenate([v_cache[b, kv, :L], v_new[b, kv]])    # (L+S, D)
            scores = q[b, h] @ keys.T * scale
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            scores = np.where(visible, scores, -np.inf)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[b, h] = (weights / weights.sum(axis=1, keepdims=True)) @ values
    return out


def visibility(past_len, tree_mask, cache_len: int, window: int = 0):
    """(B, S, cache_len + S) bool: what each new token sees of `cache_len` cache slots and of the new tokens."""
    B, S, _ = tree_mask.shape
    slots = torch.arange(cache_len, device=tree_mask.device)
    visible = torch.cat([(slots[None, :] < past_len[:, None])[:, None, :].expand(B, S, cache_len), tree_mask], dim=2)
    if window:
        q_pos = past_len[:, None] + tree_mask.long().sum(2) - 1                     # (B, S): past_len + depth
        k_pos = torch.cat([slots[None, :].expand(B, cache_len), q_pos], dim=1)      # (B, cache_len+S)
        visible = visible & (q_pos[:, :, None] - k_pos[:, None, :] < window)
    return visible


def tree_attention_torch(q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale: float, window: int = 0,
                         softcap: float = 0.0):
    """The same computation in torch, in the shapes the ONNX function uses (eager runs and tracing)."""
    B, H, S, D = q.shape
    Hkv = k_cache.shape[1]
    L = int(past_len.max()) if past_len.numel() else 0
    keys = torch.cat([k_cache[:, :, :L], k_new], dim=2)                 # (B, Hkv, L+S, D)
    values = torch.cat([v_cache[:, :, :L], v_new], dim=2)               # (B, Hkv, L+S, D)
    visible = visibility(past_len, tree_mask, L, window)                # (B, S, L+S)
    bias = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
    qg = q.reshape(B, Hkv, -1, D)                                       # (B, Hkv, G*S, D)
    scores = (qg @ keys.transpose(2, 3)) * scale                        # (B, Hkv, G*S, L+S)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.reshape(B, Hkv, -1, S, L + S) + bias[:, None, None]  # (B, Hkv, G, S, L+S)
    probs = torch.softmax(scores, dim=-1).reshape(B, Hkv, -1, L + S)    # (B, Hkv, G*S, L+S)
    return (probs @ values).reshape(B, H, S, D)                         # (B, H, S, D)


@torch.library.custom_op("specrt::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                   v_new: torch.Tensor, past_len: torch.Tensor, tree_mask: torch.Tensor, scale: float,
                   window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Eager: `tree_attention_torch`. Traced by the TorchScript exporter: one `specrt::TreeAttention` node."""
    return tree_attention_torch(q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale, window, softcap)


@tree_attention.register_fake
def _(q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale, window=0, softcap=0.0):
    return torch.empty_like(q)


def _symbolic(g, q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale, window, softcap):
    from torch.onnx import symbolic_helper
    scale = symbolic_helper._maybe_get_const(scale, "f")
    window = symbolic_helper._maybe_get_const(window, "i")
    softcap = symbolic_helper._maybe_get_const(softcap, "f")
    out = g.op(f"{DOMAIN}::{OP_TYPE}", q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale_f=scale,
               window_i=window, softcap_f=softcap)
    out.setType(q.type())
    return out


torch.onnx.register_custom_op_symbolic("specrt::tree_attention", _symbolic, 1)


def _attr_constant(name: str, attr: str, kind: str) -> onnx.NodeProto:
    """A Constant whose value is the node attribute `attr` (kind: "value_float" or "value_int")."""
    node = helper.make_node("Constant", [], [name])
    node.attribute.append(onnx.AttributeProto(name=kind, ref_attr_name=attr,
                                              type=onnx.AttributeProto.FLOAT if kind == "value_float"
                                              else onnx.AttributeProto.INT))
    return node


def _window_nodes(slots_row: str) -> list:
    """visible (B, S, T+S) -> visible_near: also key position > query position - window, where window > 0.
    `slots_row` (1, T): the cache slots' positions; new token i of row b is at past_len[b] + depth_i."""
    n = helper.make_node
    big = helper.make_tensor("big", TensorProto.INT64, [], [2 ** 62])
    return [
        _attr_constant("window", "window", "value_int"),
        n("Constant", [], ["far"], value=big),
        n("Greater", ["window", "zero"], ["windowed"]),
        n("Where", ["windowed", "window", "far"], ["span"]),             # no window: nothing is that far
        n("Cast", ["tree_mask"], ["mask_int"], to=TensorProto.INT64),
        n("ReduceSum", ["mask_int", "i2"], ["ancestors"], keepdims=0),    # (B, S): depth + 1
        n("Add", ["past_col", "ancestors"], ["q_pos1"]),
        n("Sub", ["q_pos1", "one"], ["q_pos"]),                          # (B, S): past_len + depth
        n("Unsqueeze", ["q_pos", "i2"], ["q_col"]),                      # (B, S, 1)
        n("Unsqueeze", [slots_row, "i0"], ["slots3"]),                   # (1, 1, T)
        n("Unsqueeze", ["q_pos", "i1"], ["new_row"]),                    # (B, 1, S)
        n("Sub", ["q_col", "slots3"], ["cache_dist"]),                   # (B, S, T)
        n("Sub", ["q_col", "new_row"], ["new_dist"]),                    # (B, S, S)
        n("Concat", ["cache_dist", "new_dist"], ["dist"], axis=2),       # (B, S, T+S)
        n("Less", ["dist", "span"], ["near"]),
        n("And", ["visible", "near"], ["visible_near"]),
    ]


def _softcap_nodes(scores: str, like: str | None = None) -> list:
    """scores -> capped = softcap * tanh(scores / softcap) (`like`: cast the cap to that tensor's type)."""
    n = helper.make_node
    nodes = [_attr_constant("softcap_f" if like else "softcap", "softcap", "value_float")]
    if like:
        nodes.append(n("CastLike", ["softcap_f", like], ["softcap"]))
    return nodes + [n("Div", [scores, "softcap"], ["scores_c"]), n("Tanh", ["scores_c"], ["tanh_c"]),
                    n("Mul", ["tanh_c", "softcap"], ["capped"])]


def _attributes(window: bool, softcap: bool) -> list[str]:
    return ["scale"] + ["window"] * window + ["softcap"] * softcap


def function_proto(opset: int = 17, window: bool = False, softcap: bool = False) -> onnx.FunctionProto:
    """The op's ONNX function body, so that ONNX Runtime (which inlines it) runs the op unchanged. `window` and
    `softcap`: a body that reads those attributes (the graph's nodes have them; see `attach_function`)."""
    n = helper.make_node

    def ints(name, vals):
        return n("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(vals)], vals))

    def scalar(name, val, dtype):
        return n("Constant", [], [name], value=helper.make_tensor(name, dtype, [], [val]))

    mask = "visible_near" if window else "visible"
    scores = "capped" if softcap else "scores"
    nodes = [
        ints("i0", [0]), ints("i1", [1]), ints("i2", [2]), ints("i3", [3]), ints("i4", [4]), ints("im1", [-1]),
        scalar("zero", 0, TensorProto.INT64), scalar("one", 1, TensorProto.INT64),
        scalar("fzero", 0.0, TensorProto.FLOAT), scalar("ninf", float("-inf"), TensorProto.FLOAT),
        _attr_constant("scale", "scale", "value_float"),
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
        *(_window_nodes("slots_row") if window else []),
        n("Where", [mask, "fzero", "ninf"], ["bias3"]),
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
        *(_softcap_nodes("scores") if softcap else []),
        n("Shape", ["raw"], ["raw_shape"]),
        n("Slice", ["raw_shape", "i3", "i4", "i0"], ["LS"]),
        n("Concat", ["i0", "i0", "im1", "S1", "LS"], ["s5_shape"], axis=0),
        n("Reshape", [scores, "s5_shape"], ["scores5"]),                 # (B, Hkv, G, S, L+S)
        n("Add", ["scores5", "bias"], ["masked"]),
        n("Softmax", ["masked"], ["probs5"], axis=-1),
        n("Reshape", ["probs5", "raw_shape"], ["probs"]),                # (B, Hkv, G*S, L+S)
        n("MatMul", ["probs", "values"], ["context"]),                   # (B, Hkv, G*S, D)
        n("Reshape", ["context", "q_shape"], ["output"]),                # (B, H, S, D)
    ]
    return helper.make_function(DOMAIN, OP_TYPE, INPUTS, ["output"], nodes,
                                opset_imports=[helper.make_opsetid("", opset)],
                                attributes=_attributes(window, softcap))


def static_function_proto(opset: int = 17, window: bool = False, softcap: bool = False) -> onnx.FunctionProto:
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

    mask = "visible_near" if window else "visible"
    scores = "capped" if softcap else "scores"
    nodes = [
        ints("i0", [0]), ints("i1", [1]), ints("i2", [2]), ints("i3", [3]), ints("i4", [4]), ints("im1", [-1]),
        scalar("zero", 0, TensorProto.INT64), scalar("one", 1, TensorProto.INT64),
        scalar("fzero", 0.0, TensorProto.FLOAT), scalar("ninf", float("-inf"), TensorProto.FLOAT),
        _attr_constant("scale_f", "scale", "value_float"),
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
        *(_window_nodes("slots_row") if window else []),
        n("Where", [mask, "fzero", "ninf"], ["bias_f"]),
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
        *(_softcap_nodes("scores", like="query") if softcap else []),
        n("Shape", ["raw"], ["raw_shape"]),
        n("Slice", ["raw_shape", "i3", "i4", "i0"], ["LS"]),
        n("Concat", ["i0", "i0", "im1", "S1", "LS"], ["s5_shape"], axis=0),
        n("Reshape", [scores, "s5_shape"], ["scores5"]),                 # (B, Hkv, G, S, Smax+S)
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
                                opset_imports=[helper.make_opsetid("", opset)],
                                attributes=_attributes(window, softcap))


def node_options(model: onnx.ModelProto) -> tuple[bool, bool]:
    """(any layer has a window, the layers' soft-cap is set) over a graph's TreeAttention nodes. One soft-cap per
    graph: the function body is shared by every node."""
    found = [{a.name: helper.get_attribute_value(a) for a in node.attribute} for node in model.graph.node
             if node.domain == DOMAIN and node.op_type == OP_TYPE]
    caps = {a.get("softcap", 0.0) for a in found}
    if len(caps) > 1:
        raise ValueError(f"TreeAttention nodes with different soft-caps {sorted(caps)}: one per graph")
    return any(a.get("window", 0) for a in found), bool(caps and caps.pop())


def attach_function(model: onnx.ModelProto, static: bool = False) -> onnx.ModelProto:
    """Give a graph that uses `specrt::TreeAttention` the op's function body and opset import. `static`
    replaces any body it has with `static_function_proto` (graphs with every shape fixed). The body reads the
    `window` and `softcap` attributes where the graph's nodes set them (`node_options`)."""
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    window, softcap = node_options(model)
    if static:
        kept = [f for f in model.functions if not (f.domain == DOMAIN and f.name == OP_TYPE)]
        del model.functions[:]
        model.functions.extend(kept + [static_function_proto(opset, window, softcap)])
    elif not any(f.domain == DOMAIN and f.name == OP_TYPE for f in model.functions):
        model.functions.append(function_proto(opset, window, softcap))
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return model
