"""Target engines with quantized weights (`specrt build --target-weights int4|int8`).

int8: every MatMul with a constant weight (but a mixture's router, kept float32) becomes MatMulNBits with 8 bits
(blocks of 32, int8 activations per block and per token). int4: every MatMul with a constant weight becomes ONNX Runtime's `com.microsoft::MatMulNBits`
(blocks of 32 weights along K, a float scale and a uint8 zero point per block, int8 activations per block and per
token). A target exported from a GGUF file (the manifest's `gguf` entry) keeps the file's own quantized values
where its blocks map exactly:
  Q4_0  w = d*(q - 8)        -> 4 bits, zero point 8
  Q8_0  w = d*q              -> 8 bits, q + 128 with the default zero point 128 (an embedding Gather of
                                it: GatherBlockQuantized over the same blocks, shared with a tied LM head)
  Q4_1  w = d*q + m          -> 4 bits, zero point 0, plus the block sums of the input times m (float32)
  Q4_K  w = d*s_j*q - dmin*m_j in each block j of 32 of a 256-block: Q4_1's form, with the block's scale d*s_j
                                and offset -dmin*m_j (both exact in float32: an f16 times a 6-bit integer)
  Q5_0  w = d*(q - 16)       -> 8 bits, zero point 16 (5-bit values in 8-bit blocks: exact, at 8 bits' cost)
  Q5_1  w = d*q + m          -> 8 bits, zero point 0, plus the block sums times m
  Q5_K  Q4_K's form, 5 bits  -> 8 bits, zero point 0, plus the block sums times -dmin*m_j
  Q6_K  w = d*s_j*(q - 32) in blocks of 16 -> 8 bits, blocks of 16, zero point 32 (an f16 times an int8: exact)
MatMulNBits takes float zero points too, which would map Q4_1 as zp = -m/d, but ONNX Runtime's CPU kernel then
dequantizes the whole weight on every call (10x slower than float32 here); the block-sum term is exact and is how
llama.cpp computes Q4_1 itself. Anything else (F16, BF16, F32, Q2_K, Q3_K, the IQ types) gets the standard block
quantizer (MatMulNBitsQuantizer), and the manifest records its error against the file's own dequantized weights, per
type. Gemma 3 270M's Q4_K_M file, whose layers are mostly Q5_0, agreed with its float32 target on 11 of 256 greedy
tokens before the first difference with Q5_0 and Q6_K requantized to 4 bits (relative RMS error 8.8%), on 94 with
them kept as 8-bit blocks (docs/gguf.md).
"""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specrt.errors import BackendError
from specrt.engines.manifest import sha256_file
from specrt.export.architectures import REGISTRY
from specrt.export.gguf_files import read_header
from specrt.export.onnx_files import array

BLOCK = 32
# MatMulNBits compute: int8 activations, quantized per token and per block of 32 (accuracy_level 4), as llama.cpp
# computes its Q4/Q8 blocks. A token's logits do not depend on the other tokens of a pass. ORT 1.32's float32
# compute (level 0) is slower: 4-bit weights 17.9 ms a pass at one token against 15.7 ms, 36 ms at two tokens
# against 16 ms (SmolLM2-135M, 2 cores); 8-bit weights are dequantized whole on every call (50x slower).
ACCURACY_LEVEL = {4: 4, 8: 4}
MS = "com.microsoft"
# a mixture's router ([E, d], small) stays float32, as llama.cpp keeps ffn_gate_inp: 4-bit scores would move tokens
# to other experts than the float32 target's
ROUTER = "/mlp/gate/MatMul"


def quantize_target(graph: Path, out: Path, spec: dict, weights: str) -> dict:
    """Write the `weights` ("int4" or "int8") target graph of `graph` to `out`; return what was quantized how
    (for the manifest). int8 is MatMulNBits with 8 bits, not the drafters' dynamic quantization: that takes one
    activation scale per tensor, so a token's logits would depend on the other tokens of a verify pass, and
    speculation would no longer reproduce the target's own greedy output (measured: ngram diverged)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from specrt.export import onnx_files
    bits = 4 if weights == "int4" else 8
    gguf = "gguf" in spec and bits == 4
    model = onnx_files.load(graph, weights=gguf)   # else its structure: each weight is read when it is quantized
    counts, added, tensors = Counter(), set(), None
    if "gguf" in spec:
        tensors = gguf_tensors(_gguf_file(spec["gguf"]), spec)
    if gguf:
        counts, added = gguf_blocks(model, tensors, spec)
    inits = {t.name: t for t in model.graph.initializer}
    routers = [n.name for n in model.graph.node if n.name.endswith(ROUTER)]
    standard = [n.name for n in model.graph.node
                if n.op_type == "MatMul" and n.name not in added and n.name not in routers and n.input[1] in inits]
    origin = {n.output[0]: (n.input[1], tensors.kind(_module(n.name)) if tensors else None)   # y -> (w, GGUF type)
              for n in model.graph.node if n.name in standard}
    if standard:   # MatMuls only: its int4 Gather needs opset 21, these graphs are opset 17
        q = MatMulNBitsQuantizer(model, bits=bits, block_size=BLOCK, is_symmetric=False,
                                 accuracy_level=ACCURACY_LEVEL[bits], nodes_to_exclude=sorted(added | set(routers)),
                                 op_types_to_quantize=("MatMul",))
        q.node_quantizer.quantize = _one_weight_at_a_time(q.node_quantizer.quantize, inits, graph.parent)
        quiet = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
        level = quiet.level
        quiet.setLevel(logging.WARNING)   # it logs every node it visits
        try:
            q.process()
        finally:
            quiet.setLevel(level)
        model = q.model.model
        counts[f"standard {weights}"] += len(standard)
    result = dict(counts)
    if tensors is not None and standard:   # a GGUF source: how far the requantized weights are from the file's
        result["requantized"] = requantization_error(model, origin, inits, graph.parent)
    onnx_files.save(model, out, graph.parent)   # the weights not quantized are copied from graph's data file
    return result


def requantization_error(model: onnx.ModelProto, origin: dict, inits: dict, base: Path) -> dict:
    """Per GGUF type, the error of the MatMulNBits weights that the standard quantizer made against the float32
    weights they replace (transformers' dequantization of the file): {type: {tensors, relative_rms_error (the
    error's norm over the weights' norm), max_abs_error}}. `origin`: each replaced MatMul's output -> (its weight's
    initializer, its GGUF type)."""
    blocks = {i.name: i for i in model.graph.initializer}
    sums: dict[str, list] = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or node.output[0] not in origin:
            continue
        name, kind = origin[node.output[0]]
        attrs = {a.name: a.i for a in node.attribute}
        zp = numpy_helper.to_array(blocks[node.input[3]]) if len(node.input) > 3 else None
        w = nbits_weight(numpy_helper.to_array(blocks[node.input[1]]), numpy_helper.to_array(blocks[node.input[2]]),
                         zp, attrs["bits"], attrs["N"], attrs["K"], attrs["block_size"])
        ref = array(inits[name], base).T                                        # (N, K)
        err = (w - ref).astype(np.float64)
        s = sums.setdefault(kind or "float", [0, 0.0, 0.0, 0.0])
        s[0] += 1
        s[1] += float((err ** 2).sum())
        s[2] += float((ref.astype(np.float64) ** 2).sum())
        s[3] = max(s[3], float(np.abs(err).max()))
    return {kind: {"tensors": n, "relative_rms_error": round((sse / ssw) ** 0.5 if ssw else 0.0, 6),
                   "max_abs_error": round(worst, 6)} for kind, (n, sse, ssw, worst) in sorted(sums.items())}


def nbits_weight(b: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, bits: int, N: int, K: int,
                 block: int) -> np.ndarray:
    """The weight (N, K) that a MatMulNBits computes with: scale * (q - zero point) per block along K."""
    nb = -(-K // block)
    b = b.reshape(N, nb, -1)
    q = b if bits == 8 else np.stack([b & 0x0F, b >> 4], axis=-1).reshape(N, nb, block)   # (N, nb, block)
    if zp is None:
        z = np.full((N, nb), 1 << (bits - 1), np.float32)
    elif bits == 8:
        z = zp.reshape(N, nb).astype(np.float32)
    else:
        z = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(N, -1)[:, :nb].astype(np.float32)
    w = scales.reshape(N, nb, 1).astype(np.float32) * (q.astype(np.float32) - z[..., None])
    return w.reshape(N, nb * block)[:, :K]


def _one_weight_at_a_time(quantize, inits: dict, base: Path):
    """The quantizer's step for one node, with the node's float32 weight read from the data file into a graph of
    its own that goes once the node is done (a protobuf message keeps the memory of what it once held): the
    model's float32 weights are never all in memory, only their blocks, which move into the model."""
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    def step(node, graph_stack):
        w = inits.get(node.input[1]) if node.op_type == "MatMul" else None
        if w is None or not uses_external_data(w) or w.HasField("raw_data"):
            return quantize(node, graph_stack)
        own = onnx.GraphProto()
        own.initializer.add().CopyFrom(w)
        load_external_data_for_tensor(own.initializer[0], str(base))
        out = quantize(node, [*graph_stack, own])
        graph_stack[-1].initializer.extend(t for t in own.initializer if t.name != w.name)   # the blocks
        return out
    return step


def _gguf_file(entry: dict) -> Path:
    path = Path(entry["path"])
    if not path.is_file() or sha256_file(path) != entry["sha256"]:
        raise BackendError(f"the target was exported from {path}, which is missing or changed since: re-run "
                           "`specrt export`, or build with --target-weights float32")
    return path


def _weight(model, node) -> np.ndarray | None:
    """The constant weight of a MatMul ([K, N]) or a Gather (the table), None if it has none."""
    name = node.input[1] if node.op_type == "MatMul" else node.input[0]
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    return None


def gguf_blocks(model: onnx.ModelProto, tensors: "gguf_tensors", spec: dict) -> tuple[Counter, set[str]]:
    """Rewrite, in place, the MatMuls of `model` whose GGUF tensor is of a type in KINDS, and its embedding Gather
    where that is Q8_0, to carry the file's blocks; each is checked against the graph's float32 weight (what
    transformers' GGUF loader dequantized) first. A tied embedding and LM head share one copy of the blocks.
    Returns the count per GGUF type and the names of the MatMuls added (the block offsets' terms, float32)."""
    graph = model.graph
    path = tensors.header.path
    axes = numpy_helper.from_array(np.array([-1], np.int64), "gguf_axes")
    new_nodes, new_inits, counts, added, done, block_sums, ranks = [], [axes], Counter(), set(), set(), {}, None
    for node in graph.node:
        quantized = node.op_type in ("MatMul", "Gather") and not node.name.endswith(ROUTER)
        t, part = tensors.find(_module(node.name)) if quantized else (None, None)
        w = _weight(model, node) if t is not None else None
        if w is None or t.tensor_type.name not in KINDS or (node.op_type == "Gather" and t.tensor_type.name != "Q8_0"):
            new_nodes.append(node)
            continue
        kind, bits = t.tensor_type.name, BITS[t.tensor_type.name]
        p = t.name if part is None else f"{t.name}.rows{part.start}"      # a fused tensor's part: its own blocks
        b, scales, zp, m = KINDS[kind](tensors.rows(t, part))  # (N, n_blocks, bytes), (N, n_blocks) x2, offsets
        N, n_blocks = scales.shape
        block = b.shape[-1] * 8 // bits
        expected = w if node.op_type == "Gather" else w.T                  # (N, K)
        if expected.shape != (N, n_blocks * block):
            raise BackendError(f"{path}: {p} is [{N}, {n_blocks * block}], the graph's {node.name} weight is "
                               f"{list(expected.shape)}: re-export the target")
        if not _blocks_equal(b, scales, zp, m, kind, expected):
            raise BackendError(f"{path}: {p} does not match the graph's {node.name} weight: the engine directory "
                               "was exported from another file; re-run `specrt export`")
        if p not in done:   # scales and zero points (N, n_blocks) as the standard quantizer's (fuse stacks them)
            done.add(p)
            new_inits += [numpy_helper.from_array(b, f"{p}_B"), numpy_helper.from_array(scales, f"{p}_scales")]
            if zp is not None:   # none: the default zero point (8 bits: 128)
                new_inits.append(numpy_helper.from_array(zp, f"{p}_zero_points"))
            if m is not None:
                new_inits.append(numpy_helper.from_array(np.ascontiguousarray(m.T), f"{p}_offsets"))  # (nb, N)
        counts[kind] += 1
        x, y = node.input[0], node.output[0]
        if node.op_type == "Gather":   # rows of blocks: (V, n_blocks, 32) gathered, then (B, S, d)
            new_inits += [numpy_helper.from_array(scales[..., None], f"{p}_row_scales"),
                          numpy_helper.from_array(np.array([0, 0, n_blocks * block], np.int64), f"{p}_row_shape")]
            new_nodes += _block_gather(node, f"{p}_B", f"{p}_row_scales", f"{p}_row_shape")
            continue
        inputs = [x, f"{p}_B", f"{p}_scales"] + ([f"{p}_zero_points"] if zp is not None else [])
        out = f"{y}_nbits" if m is not None else y
        new_nodes.append(helper.make_node("MatMulNBits", inputs, [out], name=node.name, domain=MS,
                                          K=n_blocks * block, N=N, bits=bits, block_size=block,
                                          accuracy_level=ACCURACY_LEVEL[bits]))
        if m is not None:              # y += block_sums(x) @ m.T: the blocks' offsets, exactly
            if (x, block) not in block_sums:
                if ranks is None:   # x is (B, S, K), or (n, K): the rows a mixture's expert gathered
                    from specrt.export.onnx_files import infer_shapes
                    ranks = _ranks(graph.input, infer_shapes(model).graph.value_info)
                lead = [0] * (ranks.get(x, 3) - 1)                                 # x's leading dimensions
                sums = block_sums[x, block] = f"{x}_block_sums{block}"
                shape = numpy_helper.from_array(np.array(lead + [n_blocks, block], np.int64), f"{sums}_shape")
                new_inits.append(shape)
                new_nodes += [helper.make_node("Reshape", [x, shape.name], [f"{sums}_blocks"]),  # (..., nb, 32)
                              helper.make_node("ReduceSum", [f"{sums}_blocks", axes.name], [sums],
                                               keepdims=0)]                                      # (..., nb)
            added.add(f"{node.name}_offsets")
            new_nodes += [helper.make_node("MatMul", [block_sums[x, block], f"{p}_offsets"], [f"{y}_offsets"],
                                           name=f"{node.name}_offsets"),                    # (..., N)
                          helper.make_node("Add", [out, f"{y}_offsets"], [y])]
    graph.initializer.extend(new_inits)
    _set_nodes(model, new_nodes)
    return counts, added


def _blocks_equal(b, scales, zp, m, kind: str, expected: np.ndarray, rows: int = 4096) -> bool:
    """Whether the blocks give the float32 weight `expected` (N, K), checked `rows` rows at a time (an embedding
    table of 262,144 rows would otherwise take several copies of its float32 size)."""
    z = zp_values(zp, kind, scales.shape[1])                 # (N, n_blocks), or (1, n_blocks): Q8_0's 128
    for r in range(0, expected.shape[0], rows):
        zr = z if len(z) == 1 else z[r:r + rows]
        w = scales[r:r + rows, :, None] * (b_values(b[r:r + rows], kind) - zr[..., None])   # (rows, n_blocks, 32)
        if m is not None:
            w = w + m[r:r + rows, :, None]
        if not np.allclose(w.reshape(-1, expected.shape[1]), expected[r:r + rows], rtol=1e-6, atol=1e-7):
            return False
    return True


def _ranks(*values) -> dict[str, int]:
    """Tensor name -> rank, for the value infos (graph inputs, inferred shapes) whose shape is known."""
    return {v.name: len(v.type.tensor_type.shape.dim) for vs in values for v in vs
            if v.type.tensor_type.HasField("shape")}


def _block_gather(node: onnx.NodeProto, blocks: str, scales: str, shape: str) -> list[onnx.NodeProto]:
    """`node`, a Gather of table rows, as GatherBlockQuantized of the rows' 8-bit blocks (V, n_blocks, 32) with
    their scales (V, n_blocks, 1) and the default zero point 128, reshaped to the Gather's output (`shape`)."""
    y = node.output[0]
    return [helper.make_node("GatherBlockQuantized", [blocks, node.input[1], scales], [f"{y}_blocks"],
                             name=node.name, domain=MS, gather_axis=0, quantize_axis=2, block_size=BLOCK, bits=8),
            helper.make_node("Reshape", [f"{y}_blocks", shape], [y])]


def _set_nodes(model: onnx.ModelProto, nodes: list[onnx.NodeProto]) -> None:
    """The graph's nodes become `nodes`; initializers that no node reads any more go; com.microsoft is declared."""
    graph = model.graph
    graph.ClearField("node")
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    kept = [i for i in graph.initializer if i.name in used]
    graph.ClearField("initializer")
    graph.initializer.extend(kept)
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))


def _module(node_name: str) -> str:
    """'/layers.0/self_attn/q_proj/MatMul' -> 'model.layers.0.self_attn.q_proj' (the transformers name)."""
    module = node_name.strip("/").rsplit("/", 1)[0].replace("/", ".")
    return module if module == "lm_head" else f"model.{module}"


class gguf_tensors:
    """A GGUF file's tensors by transformers module name, rows in transformers' order (its loader's permutation of
    q/k for rotary, where it applies one: llama files, and Granite MoE files as specrt.export.gguf_moe reads them),
    the tied output falling back to the token embedding; a projection that the file keeps fused (Phi-3's attn_qkv
    [q; k; v] and ffn_up [gate; up]) as its rows of it."""

    FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}

    def __init__(self, path: Path, spec: dict):
        import gguf
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor, TensorProcessor
        from specrt.export.gguf_moe import QK_PERMUTED
        self.header = read_header(path)
        arch = self.header.architecture
        ids = [k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch]
        if not ids:
            raise BackendError(f"{path}: the gguf package does not know architecture {arch!r}")
        self.by_name = {t.name: _Tensor(t.name, getattr(gguf.GGMLQuantizationType, t.type, None), t, self.header)
                        for t in self.header.tensors}
        self.names = gguf.get_tensor_name_map(ids[0], spec["layers"])
        processor = TENSOR_PROCESSORS.get(arch, LlamaTensorProcessor if arch in QK_PERMUTED else TensorProcessor)
        self.processor = processor({"num_attention_heads": spec["heads"], "num_key_value_heads": spec["kv_heads"]})
        self.spec = spec

    def get(self, module: str):
        key = self.names.get_name(module)
        t = self.by_name.get(f"{key}.weight")
        if t is None and module == "lm_head":
            t = self.by_name.get("token_embd.weight")   # tied embeddings
        return t

    def find(self, module: str) -> tuple[object | None, slice | None]:
        """(the tensor of `module`, the rows of it that are the module's where the file fuses it with others, or
        stacks a mixture's experts: `mlp.experts.{e}.gate_proj` is expert e's rows of `ffn_gate_exps` [E, N, K])."""
        head, _, last = module.rpartition(".")
        experts, _, e = head.rpartition(".")
        if experts.endswith(".mlp.experts") and e.isdigit():
            t = self.get(f"{experts}.{last}")
            if t is None:
                return None, None
            n = t.shape[-2]   # each expert's rows
            return t, slice(int(e) * n, (int(e) + 1) * n)
        if last not in self.FUSED or not REGISTRY[self.spec["architecture"]].fused_projections:
            return self.get(module), None
        t = self.get(f"{head}.{self.FUSED[last]}")
        if t is None:
            return None, None
        n, q, kv = t.shape[0], self.spec["heads"] * self.spec["head_dim"], self.spec["kv_heads"] * self.spec["head_dim"]
        parts = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, n), "gate_proj": (0, n // 2),
                 "up_proj": (n // 2, n)}
        return t, slice(*parts[last])

    def kind(self, module: str) -> str | None:
        t, _ = self.find(module)
        return None if t is None else t.info.type

    def rows(self, t, part: slice | None = None) -> np.ndarray:
        import gguf
        block, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        rows = np.asarray(t.data).reshape(t.data.shape[0], -1, size)       # (N, n_blocks, bytes per block)
        rows = self.processor.process(rows, t.name).weights                # q/k rows un-permuted
        return rows if part is None else rows[part]


class _Tensor:
    """One tensor of a GGUF file as gguf.GGUFReader gives it (name, tensor_type, data: its stored bytes per row),
    from the header (specrt.export.gguf_files), without reading the vocabulary as the reader does."""

    def __init__(self, name: str, tensor_type, info, header):
        self.name, self.tensor_type, self.info, self._header = name, tensor_type, info, header
        self.shape = info.shape

    @property
    def data(self) -> np.ndarray:
        return self._header.rows(self.info)


def _q4_k(rows):
    """Q4_K super-blocks (N, n, 144): d, dmin (f16), 12 bytes of eight 6-bit scales and minimums, 128 bytes of
    nibbles (in each 32 bytes, block 2i in the low nibbles and 2i + 1 in the high ones) -> blocks of 32."""
    import gguf
    N, n = rows.shape[:2]
    d, dmin = _f16(rows[..., 0:2]), _f16(rows[..., 2:4])                   # (N, n)
    sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(rows[..., 4:16]).reshape(-1, 12))
    scales = (d[..., None] * sc.reshape(N, n, 8).astype(np.float32)).reshape(N, n * 8)
    offsets = -(dmin[..., None] * mn.reshape(N, n, 8).astype(np.float32)).reshape(N, n * 8)
    qs = rows[..., 16:].reshape(N, n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    q = (qs & 0x0F).reshape(N, n * 8, 32)                                  # (N, n_blocks, 32)
    b = np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4))           # (N, n_blocks, 16)
    return b, scales, np.zeros((N, (n * 8 + 1) // 2), np.uint8), offsets


def _q4_0(rows):
    d, qs = rows[..., :2], rows[..., 2:]
    return _nibbles(qs), _f16(d), np.full((rows.shape[0], (rows.shape[1] + 1) // 2), 0x88, np.uint8), None


def _q4_1(rows):
    d, m, qs = rows[..., :2], rows[..., 2:4], rows[..., 4:]
    return _nibbles(qs), _f16(d), np.zeros((rows.shape[0], (rows.shape[1] + 1) // 2), np.uint8), _f16(m)


def _q8_0(rows):
    d, qs = rows[..., :2], rows[..., 2:]
    return np.ascontiguousarray(qs ^ 0x80), _f16(d), None, None


def _q5(rows, offset: bool):
    """Q5_0 (d, 32 high bits, 16 bytes of nibbles: w = d*(q - 16)) and Q5_1 (d, m, ...: w = d*q + m), blocks of
    32 -> 8-bit blocks of q, zero point 16 (Q5_0) or 0 plus the offsets m (Q5_1)."""
    N, n = rows.shape[:2]
    start = 4 if offset else 2
    qh = np.ascontiguousarray(rows[..., start:start + 4]).view(np.uint32)          # (N, n, 1)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)           # (N, n, 32)
    q = np.concatenate([rows[..., start + 4:] & 0x0F, rows[..., start + 4:] >> 4], axis=-1) | (high << 4)
    zp = np.full((N, n), 0 if offset else 16, np.uint8)
    return np.ascontiguousarray(q), _f16(rows[..., 0:2]), zp, _f16(rows[..., 2:4]) if offset else None


def _q5_k(rows):
    """Q5_K: Q4_K's scales and minimums with a fifth bit (32 bytes of high bits) -> 8-bit blocks of 32."""
    import gguf
    N, n = rows.shape[:2]
    d, dmin = _f16(rows[..., 0:2]), _f16(rows[..., 2:4])
    sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(rows[..., 4:16]).reshape(-1, 12))
    qh = rows[..., 16:48].reshape(N, n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    ql = rows[..., 48:].reshape(N, n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    q = (ql & 0x0F).reshape(N, n * 8, 32) | ((qh & 1).reshape(N, n * 8, 32) << 4)
    scales = (d[..., None] * sc.reshape(N, n, 8).astype(np.float32)).reshape(N, n * 8)
    offsets = -(dmin[..., None] * mn.reshape(N, n, 8).astype(np.float32)).reshape(N, n * 8)
    return np.ascontiguousarray(q), scales, np.zeros((N, n * 8), np.uint8), offsets


def _q6_k(rows):
    """Q6_K super-blocks of 256 (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d): w =
    d*s_j*(q - 32) in 16 blocks of 16 -> 8-bit blocks of 16, scale d*s_j (exact: an f16 times an int8), zero
    point 32."""
    N, n = rows.shape[:2]
    ql = rows[..., :128].reshape(N, n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    qh = rows[..., 128:192].reshape(N, n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    q = (ql & 0x0F).reshape(N, n, 8, 32) | ((qh & 3).reshape(N, n, 8, 32) << 4)
    sc = np.ascontiguousarray(rows[..., 192:208]).view(np.int8).astype(np.float32)  # (N, n, 16)
    scales = (_f16(rows[..., 208:210])[..., None] * sc).reshape(N, n * 16)
    return np.ascontiguousarray(q.reshape(N, n * 16, 16)), scales, np.full((N, n * 16), 32, np.uint8), None


# rows -> (B, scales, zero points or None, offsets or None), and the bits of B; the 8-bit kinds other than Q8_0 are
# the 5- and 6-bit ones, whose values fit 8-bit blocks exactly
KINDS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q8_0": _q8_0, "Q5_0": lambda r: _q5(r, False),
         "Q5_1": lambda r: _q5(r, True), "Q5_K": _q5_k, "Q6_K": _q6_k}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q8_0": 8, "Q5_0": 8, "Q5_1": 8, "Q5_K": 8, "Q6_K": 8}


def _f16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.float16)[..., 0].astype(np.float32)   # (N, n_blocks)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF keeps q[j] in the low and q[j + 16] in the high nibble of byte j; MatMulNBits wants q[2i] low and
    q[2i + 1] high."""
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)                     # (N, n_blocks, 32)
    return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4))       # (N, n_blocks, 16)


def b_values(b: np.ndarray, kind: str) -> np.ndarray:
    """The quantized values q of a MatMulNBits B input, (N, n_blocks, block), as float32."""
    if BITS[kind] == 8:
        return b.astype(np.float32)
    q = np.stack([b & 0x0F, b >> 4], axis=-1)                              # (N, n_blocks, 16, 2)
    return q.reshape(*b.shape[:-1], -1).astype(np.float32)


def zp_values(zp: np.ndarray | None, kind: str, n_blocks: int) -> np.ndarray:
    """The zero point of each block, (N, n_blocks), as float32 (4 bits: two blocks a byte, low nibble first; 8 bits:
    one a byte; none: the default, 128, as (1, n_blocks))."""
    if zp is None:
        return np.full((1, n_blocks), 128, np.float32)
    if BITS[kind] == 8:
        return zp.astype(np.float32)
    z = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(zp.shape[0], -1)
    return z[:, :n_blocks].astype(np.float32)


def exact_block_gathers(model: onnx.ModelProto, base: Path | None = None) -> int:
    """Rewrite, in place, each Gather of a constant float32 table (V, d) whose every block of 32 along d is
    exactly q * s (q int8 in [-127, 127], s = the block's largest magnitude / 127) as GatherBlockQuantized over
    those blocks, which gives back the very same float32 values at a quarter of the bytes. A table dequantized
    from GGUF Q8_0 blocks is such a table (the drafters' copies of the default target's embedding, 108 MB each
    in float32); a trained one is not, and stays as it was. Returns how many Gathers were rewritten. `base`: the
    directory of the model's data file, if it was loaded without its weights (each table is read when checked)."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    ranks = _ranks(graph.input, graph.value_info)
    new_nodes, done, inferred = [], 0, False
    for node in graph.node:
        table = inits.get(node.input[0]) if node.op_type == "Gather" else None
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if table is not None and node.input[1] not in ranks and not inferred:   # indices computed in the graph
            from specrt.export.onnx_files import infer_shapes
            ranks.update(_ranks(infer_shapes(model).graph.value_info))
            inferred = True
        rank = ranks.get(node.input[1]) if table is not None else None
        if rank is None or axis != 0 or table.data_type != onnx.TensorProto.FLOAT or len(table.dims) != 2 \
                or table.dims[1] % BLOCK:
            new_nodes.append(node)
            continue
        w = array(table, base)
        blocks = w.reshape(w.shape[0], -1, BLOCK)                                     # (V, nb, 32)
        scale = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
        q = np.rint(np.divide(blocks, scale, out=np.zeros_like(blocks), where=scale > 0))
        if not np.array_equal(q.astype(np.float32) * scale, blocks) or np.abs(q).max() > 127:
            new_nodes.append(node)
            continue
        p = node.input[0]
        graph.initializer.extend([
            numpy_helper.from_array((q + 128).astype(np.uint8), f"{p}_blocks"),      # default zero point 128
            numpy_helper.from_array(scale, f"{p}_block_scales"),
            numpy_helper.from_array(np.array([0] * rank + [w.shape[1]], np.int64), f"{p}_row_shape")])
        new_nodes += _block_gather(node, f"{p}_blocks", f"{p}_block_scales", f"{p}_row_shape")
        done += 1
    if done:
        _set_nodes(model, new_nodes)
    return done
