"""Fewer, fused nodes for ONNX Runtime CPU engines: a build-time rewrite of an exported graph of the engine contract
(inputs, outputs and their meaning unchanged; the exported graph, which TensorRT reads, stays as it is).

- RMSNorm -> `SimplifiedLayerNormalization`; a residual Add before it -> `com.microsoft::SkipSimplifiedLayerNormalization`
  (which also gives the sum, the residual stream).
- RoPE (x*cos + rotate_half(x)*sin on [B,H,S,D]) -> `com.microsoft::RotaryEmbedding` on the projection's [B,S,H*D]
  output, with the position ids and the first half of the cos/sin tables (on x itself, in the op's 4D form, where
  x is normed per head first or is the rotated part of a partial rotary).
- Projections of one input (q/k/v, gate/up) -> one MatMul (or `MatMulNBits`) over their weights side by side and a
  Split: fewer, larger kernels (a 4-bit target's pass at one token: 15.7 -> 10.5 ms). A Q4_1 target's block offset
  terms (see `specrt.export.quantize`) merge with their MatMuls.
- `specrt::TreeAttention` -> its function body inlined with the head counts as constants: the mask bias is built
  once per graph (ONNX Runtime inlines the function once per layer), and the reshapes in and around it take
  constant shapes ([0, 0, heads, head_dim]: 0 keeps a dimension), so no per-layer shape arithmetic is left. Each
  row's new keys and values go at its own past_len in the layer's attention columns (not after the longest row's
  cache, as in the function body), so a row of a batch rounds as it does alone (see `_shared_nodes`). Layers with a
  sliding window share one more bias per window size (`_window_nodes`); a soft-cap adds its Div, Tanh, Mul.
- The cache is written in place, not copied: each layer scatters the pass's new keys and values into the cache
  itself. The written caches are graph outputs (`k_cache_<i>` + `_written`); bound to the cache inputs' own
  buffers, as `OrtEngine` binds them, ONNX Runtime's ScatterElements writes the S new entries and copies nothing.
  Attention then reads every slot of the cache where the cache is at most 3/2 of the window the pass needs
  (max(past_len) + S slots: `generate` sizes its caches to the request), else a copy of that window (a server's
  caches hold max_seq_len): an `If` per layer, the branches the same arithmetic over the columns of one mask bias.
  The contract holds either way: the runtime still writes the accepted entries from `k_new`/`v_new`, and slots
  past a row's past_len are scratch. They must hold finite values, as caches that start zeroed and are written only
  by the engines do: a masked column's probability is 0, and 0 · NaN is not 0 (batches already relied on this).
  Before, each layer copied the window twice (a Slice, then a ScatterElements into the copy). SmolLM2-135M, 2
  threads, 4 alternating runs, a pass over 1 / 8 / 16 tokens: after 1,900 cached positions 60 → 47, 101 → 82 and
  127 → 117 ms; after 1,024, 47 → 38, 72 → 67, 97 → 89; after 256, 37 → 33, 58 → 54, 75 → 69; after 64, no change;
  in a 2,048-slot cache (the window branch) after 64, 256 and 1,024 positions 0.87–0.91× at 1 token, 0.91–1.06× at 8.

The attention arithmetic is the function body's (the same MatMuls, scale, bias and Softmax), so a token's logits
do not depend on the pass width more than before; ONNX Runtime's fused RoPE and norm kernels round differently from
the unfused nodes by float32 ulps. A node whose neighbours do not have the exported form is left as it is (the
counts, recorded in the manifest, say what was fused). Measured on SmolLM2-135M: 2,252 nodes -> 800 once built
(and 4 or 6 in each branch of the layers' `If`s).
"""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specrt.engines.manifest import WRITTEN
from specrt.export.onnx_files import array
from specrt.plugins.tree_attention import DOMAIN, OP_TYPE

MS = "com.microsoft"


class _Graph:
    """Producers, consumers and constant values of a graph's tensors."""

    def __init__(self, model: onnx.ModelProto, base=None):
        self.g, self.base = model.graph, base   # base: the directory of the weights not loaded (see onnx_files)
        self.producer = {o: n for n in self.g.node for o in n.output}
        self.consumers = defaultdict(list)
        for n in self.g.node:
            for i in n.input:
                self.consumers[i].append(n)
        self.values = {i.name: i for i in self.g.initializer}
        for n in self.g.node:
            if n.op_type == "Constant" and n.attribute[0].name == "value":
                self.values[n.output[0]] = n.attribute[0].t

    def const(self, name: str) -> np.ndarray | None:
        identity = self.op(name, "Identity")   # the exporter shares equal weights through Identity nodes
        t = self.values.get(identity.input[0] if identity is not None else name)
        return None if t is None else array(t, self.base)

    def op(self, name: str, op_type: str):
        """The node that produces `name` if it is an `op_type`, else None."""
        n = self.producer.get(name)
        return n if n is not None and n.op_type == op_type else None


def fuse_graph(model: onnx.ModelProto, spec: dict, base=None) -> tuple[onnx.ModelProto, dict]:
    """Rewrite `model` (an exported contract graph; its MatMuls may be quantized already) in place; return it and
    the count of each fusion. `base`: the directory of its data file, if it was loaded without its weights (each is
    read when a rewrite needs it)."""
    counts = Counter()
    for rewrite in (_merge_nbits, _merge_matmuls, _fuse_rope, _inline_attention, _fuse_norms):
        new_nodes, dead = [], set()
        rewrite(_Graph(model, base), spec, new_nodes, dead, counts)
        _apply(model, new_nodes, dead)
    _prune(model)
    if counts["attention"]:
        used = {(n.domain, n.op_type) for n in model.graph.node}
        kept = [f for f in model.functions if (f.domain, f.name) in used]
        del model.functions[:]
        model.functions.extend(kept)
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    return model, dict(counts)


def _apply(model, new_nodes, dead):
    """Drop the `dead` nodes (named by their outputs), add `new_nodes`, in topological order."""
    nodes = [_copy(n) for n in model.graph.node if tuple(n.output) not in dead] + new_nodes
    model.graph.ClearField("node")
    model.graph.node.extend(_topological(nodes, {i.name for i in model.graph.input}
                                         | {i.name for i in model.graph.initializer}))


def _copy(node):
    out = onnx.NodeProto()
    out.CopyFrom(node)
    return out


def _inputs(node) -> list[str]:
    """A node's inputs, with the outer-scope values its subgraphs (an If's branches) read."""
    names = list(node.input)
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            inner = {o for m in a.g.node for o in m.output} | {i.name for i in a.g.initializer}
            names += [i for m in a.g.node for i in _inputs(m) if i not in inner]
    return names


def _topological(nodes, known):
    known, out, pending = set(known) | {""}, [], list(nodes)
    while pending:
        rest = []
        for n in pending:
            if all(i in known for i in _inputs(n)):
                out.append(n)
                known.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise ValueError(f"graph has a cycle or a missing input at {rest[0].name or rest[0].op_type}")
        pending = rest
    return out


def _prune(model):
    """Remove the nodes no graph output depends on (the shape arithmetic the rewrites left unused)."""
    needed = {o.name for o in model.graph.output}
    keep = []
    for n in reversed(model.graph.node):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(_inputs(n))
    keep = [_copy(n) for n in reversed(keep)]
    model.graph.ClearField("node")
    model.graph.node.extend(keep)
    unused = [i for i in model.graph.initializer if i.name not in needed]
    for init in unused:
        model.graph.initializer.remove(init)


def _ints(name, vals):
    return numpy_helper.from_array(np.array(vals, np.int64), name)


# ---- projections of one input ---------------------------------------------------------------------------------

def _merge_nbits(g: _Graph, spec: dict, new, dead, counts):
    """`MatMulNBits` nodes of one input and equal K, bits, block size and accuracy -> one over their blocks, scales
    and zero points stacked along N, then a Split. Where each has a Q4_1 offset term, Add(y, MatMul(block sums,
    offsets)), and all of one group read the same block sums, the offsets merge too (one MatMul, one Add)."""
    for x in list(g.consumers):
        groups = defaultdict(list)
        for node in g.consumers[x]:
            key = _nbits_key(g, node)
            if key is not None and node.input[0] == x:
                groups[key].append(node)
        for (_, _, _, _, with_zp, block_sums), nodes in groups.items():
            if len(nodes) < 2:
                continue
            attrs = {a.name: helper.get_attribute_value(a) for a in nodes[0].attribute}
            sizes = [_attr(node, "N") for node in nodes]
            p = f"{nodes[0].name or nodes[0].output[0]}/merged/"
            stacked = [np.concatenate([g.const(node.input[i]) for node in nodes]) for i in range(1, 3 + with_zp)]
            names = [p + part for part in ("B", "scales", "zero_points")[:len(stacked)]]
            g.g.initializer.extend(numpy_helper.from_array(a, name) for a, name in zip(stacked, names))
            g.g.initializer.append(_ints(p + "sizes", sizes))
            new.append(helper.make_node("MatMulNBits", [x, *names], [p + "y"], name=p + "MatMulNBits", domain=MS,
                                        **{**attrs, "N": sum(sizes)}))
            y, outputs = p + "y", [node.output[0] for node in nodes]
            if block_sums is not None:
                adds = [g.consumers[o][0] for o in outputs]
                offsets = [g.producer[next(i for i in add.input if i != o)] for add, o in zip(adds, outputs)]
                g.g.initializer.append(numpy_helper.from_array(
                    np.concatenate([g.const(m.input[1]) for m in offsets], axis=1), p + "offsets"))
                new += [helper.make_node("MatMul", [block_sums, p + "offsets"], [p + "y_offsets"]),
                        helper.make_node("Add", [y, p + "y_offsets"], [p + "y_sum"])]
                y, outputs = p + "y_sum", [add.output[0] for add in adds]
                dead.update(tuple(node.output) for node in adds + offsets)
            new.append(helper.make_node("Split", [y, p + "sizes"], outputs, axis=-1))
            dead.update(tuple(node.output) for node in nodes)
            counts["projections"] += len(nodes)


def _attr(node, name):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def _nbits_key(g: _Graph, node):
    """What a MatMulNBits must share with its siblings to merge (None: it cannot): K, bits, block size, accuracy,
    whether it has zero points, and the block sums of its Q4_1 offset term (None if it has none)."""
    if node.op_type != "MatMulNBits" or len(node.input) > 4 or any(g.const(i) is None for i in node.input[1:]):
        return None
    users = g.consumers[node.output[0]]
    block_sums = None
    if len(users) == 1 and users[0].op_type == "Add":
        other = next((i for i in users[0].input if i != node.output[0]), None)
        offsets = g.op(other, "MatMul")
        if offsets is not None and g.const(offsets.input[1]) is not None \
                and len(g.consumers[offsets.output[0]]) == 1:
            block_sums = offsets.input[0]
    return (_attr(node, "K"), _attr(node, "bits"), _attr(node, "block_size"), _attr(node, "accuracy_level"),
            len(node.input) == 4, block_sums)


def _merge_matmuls(g: _Graph, spec: dict, new, dead, counts):
    """MatMuls of one input by constant [K, N] weights -> one MatMul over the weights side by side, then a Split."""
    for x in list(g.consumers):
        found = [(node, g.const(node.input[1])) for node in g.consumers[x]
                 if node.op_type == "MatMul" and node.input[0] == x]
        found = [(node, w) for node, w in found if w is not None and w.ndim == 2]
        if len(found) < 2:
            continue
        nodes, weights = [node for node, _ in found], [w for _, w in found]
        p = f"{nodes[0].name or nodes[0].output[0]}/merged/"
        g.g.initializer.extend([numpy_helper.from_array(np.concatenate(weights, axis=1), p + "weight"),
                                _ints(p + "sizes", [w.shape[1] for w in weights])])
        new += [helper.make_node("MatMul", [x, p + "weight"], [p + "y"], name=p + "MatMul"),
                helper.make_node("Split", [p + "y", p + "sizes"], [node.output[0] for node in nodes], axis=-1)]
        dead.update(tuple(node.output) for node in nodes)
        counts["projections"] += len(nodes)


# ---- RoPE ------------------------------------------------------------------------------------------------------

def _fuse_rope(g: _Graph, spec: dict, new, dead, counts):
    """x*cos + rotate_half(x)*sin, x = Transpose(Reshape(p)) [B,n,S,D] -> RotaryEmbedding(p) [B,S,n*D], back to
    [B,n,S,D] under the Add's name; any other x [B,n,S,D] (normed per head first: Qwen3, Gemma 3) ->
    RotaryEmbedding(x) in its 4D form. Each pair of tables (Gemma 3 has two) becomes one pair of constants."""
    n = helper.make_node
    tables, used = {}, {}
    for add in [a for a in g.g.node if a.op_type == "Add"]:
        found = _rope_source(g, add.output[0], tables)
        if found is None:
            continue
        p, x, cos, sin = found
        if (cos, sin) not in used:
            k = used[cos, sin] = f"fused/cos{len(used) or ''}", f"fused/sin{len(used) or ''}"
            g.g.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(tables[cos]), k[0]),
                                    numpy_helper.from_array(np.ascontiguousarray(tables[sin]), k[1])])
            if len(used) == 1:
                g.g.initializer.append(_ints("fused/split_heads", [0, 0, -1, spec["head_dim"]]))
        out, q = add.output[0], f"{add.name or add.output[0]}/fused/"
        dead.add(tuple(add.output))
        if p is None:
            new.append(n("RotaryEmbedding", [x, "position_ids", *used[cos, sin]], [out], domain=MS))  # (B, n, S, D)
        else:
            new += [
                n("RotaryEmbedding", [p, "position_ids", *used[cos, sin]], [q + "rot"], domain=MS),   # (B, S, n*D)
                n("Reshape", [q + "rot", "fused/split_heads"], [q + "bshd"]),                        # (B, S, n, D)
                n("Transpose", [q + "bshd"], [out], perm=[0, 2, 1, 3]),                              # (B, n, S, D)
            ]
        counts["rotary"] += 1


def _rope_source(g: _Graph, name: str, tables: dict):
    """`name` = x*cos + rotate_half(x)*sin, cos and sin gathered by position_ids from constant tables whose two
    halves are equal -> (p where x = Transpose(Reshape(p)) else None, x, cos table, sin table), else None."""
    add = g.op(name, "Add")
    muls = [g.op(i, "Mul") for i in add.input] if add is not None else [None]
    if None in muls:
        return None
    by_table = []   # per Mul: (the table it gathers by position, its other input)
    for mul in muls:
        for j in (0, 1):
            unsqueeze = g.op(mul.input[j], "Unsqueeze")
            gather = unsqueeze and g.op(unsqueeze.input[0], "Gather")
            if gather is not None and gather.input[1] == "position_ids" and g.const(gather.input[0]) is not None:
                by_table.append((gather.input[0], mul.input[1 - j]))
                break
    if len(by_table) != 2:
        return None
    (cos, x), (sin, rotated) = by_table if g.op(by_table[1][1], "Concat") else by_table[::-1]
    concat = g.op(rotated, "Concat")
    if concat is None or len(concat.input) != 2:
        return None
    neg, first_half = g.op(concat.input[0], "Neg"), g.op(concat.input[1], "Slice")
    second_half = neg and g.op(neg.input[0], "Slice")
    if None in (second_half, first_half) or second_half.input[0] != x or first_half.input[0] != x:
        return None
    for table in (cos, sin):
        if table not in tables:
            t = g.const(table)
            half = t.shape[-1] // 2
            tables[table] = t[:, :half] if t.ndim == 2 and np.array_equal(t[:, :half], t[:, half:]) else None
        if tables[table] is None:
            return None   # not the rotate_half layout
    reshape = _head_reshape(g, x)
    return (None if reshape is None else reshape.input[0]), x, cos, sin


def _head_reshape(g: _Graph, name: str):
    """`name` = Transpose(Reshape(p), perm [0,2,1,3]) -> that Reshape, else None."""
    transpose = g.op(name, "Transpose")
    reshape = transpose and g.op(transpose.input[0], "Reshape")
    if reshape is None or list(transpose.attribute[0].ints) != [0, 2, 1, 3]:
        return None
    return reshape


def _merge_reshape(g: _Graph, name: str):
    """The Reshape of Transpose(`name`, perm [0,2,1,3]) that merges the heads, else None."""
    users = g.consumers[name]
    if len(users) != 1 or users[0].op_type != "Transpose" or list(users[0].attribute[0].ints) != [0, 2, 1, 3]:
        return None
    after = g.consumers[users[0].output[0]]
    return after[0] if len(after) == 1 and after[0].op_type == "Reshape" else None


# ---- attention -------------------------------------------------------------------------------------------------

def _inline_attention(g: _Graph, spec: dict, new, dead, counts):
    """Each `specrt::TreeAttention` -> its body with constant head counts and the mask bias shared (one per window
    size); the reshapes of the values and of the merged heads around it ([B,S,n,D] <-> [B,S,n*D]) take constant
    shapes."""
    H, Hkv, D = spec["heads"], spec["kv_heads"], spec["head_dim"]
    n = helper.make_node
    shared, biases = None, {0: "fused/bias"}
    types = {i.name: i.type.tensor_type.elem_type for i in g.g.input}
    for t in [t for t in g.g.node if t.domain == DOMAIN and t.op_type == OP_TYPE]:
        q, k_cache, v_cache, k_new, v_new, past_len, tree_mask = t.input
        attrs = {a.name: helper.get_attribute_value(a) for a in t.attribute}
        window, softcap = attrs.get("window", 0), attrs.get("softcap", 0.0)
        if shared is None:
            shared = (past_len, tree_mask)
            new.extend(_shared_nodes(H // Hkv, Hkv, D, past_len, tree_mask, k_cache))
            g.g.initializer.extend([_ints("fused/q_groups", [0, Hkv, -1, D]), _ints("fused/heads", [0, H, -1, D]),
                                    _ints("fused/kv_heads", [0, 0, Hkv, D]), _ints("fused/merged", [0, 0, H * D])])
        elif (past_len, tree_mask) != shared:   # the bias is built once, from the first node's inputs
            continue
        if window not in biases:
            new.extend(_window_nodes(tree_mask, window, first=len(biases) == 1))
            biases[window] = f"fused/bias_w{window}"
        v_reshape, out_reshape = _head_reshape(g, v_new), _merge_reshape(g, t.output[0])
        if v_reshape is not None:
            v_reshape.input[1] = "fused/kv_heads"
        if out_reshape is not None:
            out_reshape.input[1] = "fused/merged"
        p = f"{t.name or t.output[0]}/fused/"
        dead.add(tuple(t.output))
        keys, values = k_cache + WRITTEN, v_cache + WRITTEN   # (B, Hkv, T, D): graph outputs, see the docstring
        dtype = types.get(k_cache, TensorProto.FLOAT)
        g.g.output.extend(helper.make_tensor_value_info(name, dtype, None) for name in (keys, values))
        scores = dict(scale=attrs["scale"], softcap=softcap, bias=biases[window], dtype=dtype)
        new += [
            n("ScatterElements", [k_cache, "fused/slots", k_new], [keys], axis=2),      # new at past_len
            n("ScatterElements", [v_cache, "fused/slots", v_new], [values], axis=2),
            n("Reshape", [q, "fused/q_groups"], [p + "qg"]),                               # (B, Hkv, G*S, D)
            n("If", ["fused/whole"], [p + "context"],                                      # (B, Hkv, G*S, D)
              then_branch=_attention(p + "whole/", p + "qg", keys, values, **scores),
              else_branch=_attention(p + "window/", p + "qg", keys, values, **scores, window=True)),
            n("Reshape", [p + "context", "fused/heads"], [t.output[0]]),                   # (B, H, S, D)
        ]
        counts["attention"] += 1
    # the caches no attention reads (LFM2's conv inputs, see specrt.export.hybrid) are written in place too
    written = {o.name for o in g.g.output}
    for i in g.g.input if shared is not None else ():
        if i.name.startswith(("k_cache_", "v_cache_")) and i.name + WRITTEN not in written:
            new.append(n("ScatterElements", [i.name, "fused/slots", i.name.replace("_cache_", "_new_")],
                         [i.name + WRITTEN], axis=2))
            g.g.output.append(helper.make_tensor_value_info(i.name + WRITTEN, types[i.name], None))


def _attention(p: str, qg: str, keys: str, values: str, scale: float, softcap: float, bias: str, dtype: int,
               window: bool = False) -> onnx.GraphProto:
    """One branch of a layer's attention over the T columns of its mask bias: all of the written cache's slots,
    or (`window`) a copy of its first T."""
    n = helper.make_node

    def const(name, val):
        return n("Constant", [], [p + name], value=helper.make_tensor(p + name, TensorProto.FLOAT, [], [val]))

    nodes = [const("scale", scale)]
    if window:
        nodes += [n("Slice", [keys, "fused/i0", "fused/T1", "fused/i2"], [p + "keys"]),
                  n("Slice", [values, "fused/i0", "fused/T1", "fused/i2"], [p + "values"])]
        keys, values = p + "keys", p + "values"
    nodes += [
        n("Transpose", [keys], [p + "keys_t"], perm=[0, 1, 3, 2]),                         # (B, Hkv, D, T)
        n("MatMul", [qg, p + "keys_t"], [p + "raw"]),                                      # (B, Hkv, G*S, T)
        n("Mul", [p + "raw", p + "scale"], [p + "scores"]),
    ]
    scores = p + "scores"
    if softcap:   # scores -> c * tanh(scores / c)
        nodes += [const("softcap", softcap), n("Div", [scores, p + "softcap"], [p + "scaled"]),
                  n("Tanh", [p + "scaled"], [p + "tanh"]), n("Mul", [p + "tanh", p + "softcap"], [p + "capped"])]
        scores = p + "capped"
    nodes += [
        n("Add", [scores, bias], [p + "masked"]),
        n("Softmax", [p + "masked"], [p + "probs"], axis=-1),
        n("MatMul", [p + "probs", values], [p + "context"]),                               # (B, Hkv, G*S, D)
    ]
    return helper.make_graph(nodes, p.rstrip("/"), [], [helper.make_tensor_value_info(p + "context", dtype, None)])


def _window_nodes(tree_mask: str, window: int, first: bool) -> list:
    """The mask bias of the layers with a `window` (`fused/bias_w<window>`): `fused/visible` and key position >
    query position - window. Query i of row b is at past_len[b] + depth_i (depth: its mask row's count - 1);
    column c at c in the cache, at past_len[b] + depth_j for new token j = c - past_len[b]. `first`: also the
    positions (`fused/dist`, shared by every window size)."""
    n = helper.make_node
    w = f"fused/w{window}/"
    nodes = [
        n("Cast", [tree_mask], ["fused/mask_int"], to=TensorProto.INT64),
        n("ReduceSum", ["fused/mask_int", "fused/i2"], ["fused/ancestors"], keepdims=0),  # (B, S): depth + 1
        n("Sub", ["fused/ancestors", "fused/one"], ["fused/depth"]),
        n("Add", ["fused/past_col", "fused/depth"], ["fused/q_pos"]),                  # (B, S)
        n("GatherElements", ["fused/depth", "fused/j"], ["fused/col_depth"], axis=1),  # (B, T) depth of c - past_len
        n("Add", ["fused/past_col", "fused/col_depth"], ["fused/new_pos"]),
        n("Where", ["fused/is_new", "fused/new_pos", "fused/cols"], ["fused/k_pos"]),  # (B, T)
        n("Unsqueeze", ["fused/q_pos", "fused/i2"], ["fused/q_col"]),                  # (B, S, 1)
        n("Unsqueeze", ["fused/k_pos", "fused/i1"], ["fused/k_row"]),                  # (B, 1, T)
        n("Sub", ["fused/q_col", "fused/k_row"], ["fused/dist"]),                      # (B, S, T)
    ] if first else []
    return nodes + [
        n("Constant", [], [w + "span"], value=helper.make_tensor(w + "span", TensorProto.INT64, [], [window])),
        n("Less", ["fused/dist", w + "span"], [w + "near"]),
        n("And", ["fused/visible", w + "near"], [w + "visible"]),
        n("Where", [w + "visible", "fused/fzero", "fused/ninf"], [w + "bias3"]),
        n("Unsqueeze", [w + "bias3", "fused/i1"], [w + "bias4"]),                       # (B, 1, S, T)
        n("Tile", [w + "bias4", "fused/tile"], [f"fused/bias_w{window}"]),              # (B, 1, G*S, T)
    ]


def _shared_nodes(G: int, Hkv: int, D: int, past_len: str, tree_mask: str, k_cache: str) -> list:
    """Built once per graph: the attention columns and their additive mask bias (B, 1, G*S, T).

    Each layer attends over all T slots of the cache (its length as bound) with row b's S new keys and values
    written at its own past_len[b]: every row sees its cache and its new tokens in the columns it would have alone,
    so its softmax and P·V sums round as they do when it runs alone (only masked columns follow, each adding an
    exact zero). Column c is visible to new token i of row b iff c < past_len[b], or c = past_len[b] + j with
    tree_mask[b, i, j] (as in TreeAttention's body, which puts the new tokens after max(past_len) instead).
    `fused/slots` (B, Hkv, S, D): where each new entry goes."""
    n = helper.make_node

    def c(name, val, dtype=TensorProto.INT64, dims=()):
        return n("Constant", [], [name], value=helper.make_tensor(name, dtype, list(dims), val if dims else [val]))

    return [
        c("fused/i0", [0], dims=[1]), c("fused/i1", [1], dims=[1]), c("fused/i2", [2], dims=[1]),
        c("fused/i13", [1, 3], dims=[2]), c("fused/zero", 0), c("fused/one", 1),
        c("fused/tile", [1, 1, G, 1], dims=[4]), c("fused/heads_dim", [1, Hkv, 1, D], dims=[4]),
        c("fused/fzero", 0.0, TensorProto.FLOAT), c("fused/ninf", float("-inf"), TensorProto.FLOAT),
        n("Shape", [tree_mask], ["fused/mask_shape"]),                             # [B, S, S]
        n("Slice", ["fused/mask_shape", "fused/i0", "fused/i2", "fused/i0"], ["fused/BS"]),
        n("Slice", ["fused/mask_shape", "fused/i1", "fused/i2", "fused/i0"], ["fused/S1"]),
        n("Squeeze", ["fused/S1", "fused/i0"], ["fused/S"]),
        # T: all the cache's slots where the cache is at most 3/2 of the window a pass needs (max(past_len) + S
        # slots), else that window (copied out of the cache, which costs more per slot than reading it)
        n("Shape", [k_cache], ["fused/L1"], start=2, end=3),
        n("Squeeze", ["fused/L1", "fused/i0"], ["fused/L"]),
        n("ReduceMax", [past_len], ["fused/longest"], keepdims=0),
        n("Add", ["fused/longest", "fused/S"], ["fused/need"]),
        c("fused/two", 2), c("fused/three", 3),
        n("Mul", ["fused/L", "fused/two"], ["fused/L2"]),
        n("Mul", ["fused/need", "fused/three"], ["fused/need3"]),
        n("Less", ["fused/need3", "fused/L2"], ["fused/wide"]),
        n("Not", ["fused/wide"], ["fused/whole"]),
        n("Where", ["fused/whole", "fused/L", "fused/need"], ["fused/T"]),
        n("Unsqueeze", ["fused/T", "fused/i0"], ["fused/T1"]),
        n("Unsqueeze", [past_len, "fused/i1"], ["fused/past_col"]),                # (B, 1)
        # where the new entries go: past_len[b] + j, broadcast over heads and head_dim
        n("Range", ["fused/zero", "fused/S", "fused/one"], ["fused/new_j"]),        # (S,)
        n("Add", ["fused/past_col", "fused/new_j"], ["fused/new_cols"]),           # (B, S)
        n("Unsqueeze", ["fused/new_cols", "fused/i13"], ["fused/new_cols4"]),      # (B, 1, S, 1)
        n("Expand", ["fused/new_cols4", "fused/heads_dim"], ["fused/slots"]),      # (B, Hkv, S, D)
        # what each new token sees
        n("Range", ["fused/zero", "fused/T", "fused/one"], ["fused/cols"]),         # (T,)
        n("Sub", ["fused/cols", "fused/past_col"], ["fused/rel"]),                 # (B, T): c - past_len[b]
        n("Less", ["fused/rel", "fused/zero"], ["fused/cache_ok"]),                # (B, T)
        n("Less", ["fused/rel", "fused/S"], ["fused/before_end"]),
        n("Not", ["fused/cache_ok"], ["fused/after_cache"]),
        n("And", ["fused/after_cache", "fused/before_end"], ["fused/is_new"]),     # (B, T)
        n("Sub", ["fused/S", "fused/one"], ["fused/last"]),
        n("Max", ["fused/rel", "fused/zero"], ["fused/rel_lo"]),
        n("Min", ["fused/rel_lo", "fused/last"], ["fused/j"]),                     # (B, T) clipped to [0, S)
        n("Unsqueeze", ["fused/j", "fused/i1"], ["fused/j3"]),                     # (B, 1, T)
        n("Concat", ["fused/BS", "fused/T1"], ["fused/BST"], axis=0),
        n("Expand", ["fused/j3", "fused/BST"], ["fused/j_s"]),                       # (B, S, T)
        n("GatherElements", [tree_mask, "fused/j_s"], ["fused/tree_ok"], axis=2),  # tree_mask[b, i, c - past_len]
        n("Unsqueeze", ["fused/is_new", "fused/i1"], ["fused/is_new3"]),
        n("And", ["fused/tree_ok", "fused/is_new3"], ["fused/new_ok"]),
        n("Unsqueeze", ["fused/cache_ok", "fused/i1"], ["fused/cache_ok3"]),       # (B, 1, T)
        n("Or", ["fused/new_ok", "fused/cache_ok3"], ["fused/visible"]),           # (B, S, T)
        n("Where", ["fused/visible", "fused/fzero", "fused/ninf"], ["fused/bias3"]),
        n("Unsqueeze", ["fused/bias3", "fused/i1"], ["fused/bias4"]),                # (B, 1, S, T)
        n("Tile", ["fused/bias4", "fused/tile"], ["fused/bias"]),                    # (B, 1, G*S, T)
    ]


# ---- RMSNorm and the residual Add before it ---------------------------------------------------------------------

def _fuse_norms(g: _Graph, spec: dict, new, dead, counts):
    """w * (x * 1/sqrt(mean(x^2) + eps)) -> SimplifiedLayerNormalization(x, w); x = a + b -> SkipSimplified..."""
    n = helper.make_node
    for pow_ in [p for p in g.g.node if p.op_type == "Pow"]:
        x = pow_.input[0]
        chain = [pow_]
        for op in ("ReduceMean", "Add", "Sqrt", "Div", "Mul", "Mul"):
            users = g.consumers[chain[-1].output[0]]
            if len(users) != 1 or users[0].op_type != op:
                break
            chain.append(users[0])
        if len(chain) != 7 or not np.array_equal(g.const(pow_.input[1]), 2.0):
            continue
        mean, add, _, div, mul, scale = chain[1:]
        eps = g.const(next(i for i in add.input if i != mean.output[0]))
        weight = next(i for i in scale.input if i != mul.output[0])
        if eps is None or g.const(weight) is None or x not in mul.input or g.const(div.input[0]) != 1.0 \
                or [list(a.ints) for a in mean.attribute if a.name == "axes"] != [[-1]]:
            continue
        dead.update(tuple(c.output) for c in chain)
        residual = g.op(x, "Add")
        if residual is not None and all(g.const(i) is None for i in residual.input):
            dead.add(tuple(residual.output))
            new.append(n("SkipSimplifiedLayerNormalization", [*residual.input, weight], [scale.output[0], "", "", x],
                         domain=MS, epsilon=float(eps)))
            counts["skip_norm"] += 1
        else:
            new.append(n("SimplifiedLayerNormalization", [x, weight], [scale.output[0]], axis=-1,
                         epsilon=float(eps), stash_type=1))
            counts["norm"] += 1
