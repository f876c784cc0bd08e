"""ONNX Runtime engines for the CUDA provider, built from the exported graphs of the engine contract.

Per model: the exported graph in the engine dtype (float32, float16 or bfloat16; `logits` and `hidden` stay
float32, cast inside the graph, so verification and the Medusa heads read what they read on the CPU, and so
does an EAGLE drafter's `features` input, the target's float32 hidden states), with
ONNX Runtime's provider-independent optimisations applied; the rest (fusions for the provider) happens when
the session loads on the device. The target and the drafters with a cache (the draft model, the EAGLE drafter)
also get one graph per width W with every shape fixed (B = 1, S = W, caches [1, Hkv, max_seq_len, D],
num_logits = W) and TreeAttention's static body, so that no shape arithmetic is left once folded and ONNX
Runtime can capture a CUDA graph of each: a verify pass, a draft step, an EAGLE catch-up or tree level.
The graphs of one model keep their weights in one shared external file (each tensor stored once).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from specrt.engines.manifest import check_file, file_entry, logits_width
from specrt.plugins.tree_attention import attach_function

KEPT_FLOAT32 = ["logits", "hidden", "features", "aux"]   # an EAGLE(-3) drafter reads the target's float32 states
FLOAT32_OPS = ["Pow", "ReduceMean"]   # RMSNorm's mean of squares: x² of a residual stream overflows float16
NORM_TAIL = ("Add", "Sqrt", "Reciprocal", "Div", "Mul")   # after the mean: + eps, the root, x over it
MIN_EXTERNAL = 1024   # bytes: smaller tensors stay inside each graph
WIDTH_ROLES = ("target", "draft", "eagle")   # the models with a cache: static width graphs on CUDA


def build_cuda(directory: Path, manifest: dict, dtype: str, widths: tuple[int, ...], log) -> None:
    """Write every model's CUDA engine files (partial names first), then set each model's engine entry."""
    staged: list[tuple[Path, Path]] = []
    try:
        entries, target = {}, None
        for role, spec in sorted(manifest["models"].items(), key=lambda kv: kv[0] == "self"):   # self last
            graph = check_file(directory, spec["graph"], f"{role} graph")
            role_dtype = "float32" if role == "medusa" else dtype   # the heads are small: kept float32
            role_widths = widths if role in WIDTH_ROLES else ()
            # the self drafter's tensors are the target's: written once, into the target's weights file
            weights = target if role == "self" else _SharedWeights(directory, f"{role}.cuda.weights", staged)
            entries[role] = _build_model(directory, role, spec, graph, role_dtype, role_widths, weights)
            log(f"built {role} for CUDA ({role_dtype}"
                + (f", static widths {','.join(map(str, role_widths))})" if role_widths else ")")
                + (", its tensors in the target's weights file" if role == "self" else ""))
            if role == "target":
                target = weights
            elif weights is not target:
                weights.close()
        if target is not None:
            target.close()
        for partial, final in staged:
            os.replace(partial, final)
        for role, entry in entries.items():
            manifest["models"][role]["engine"] = _entry(directory, entry)
    finally:
        for partial, _ in staged:
            partial.unlink(missing_ok=True)


def _build_model(directory: Path, role: str, spec: dict, graph: Path, dtype: str, widths,
                 weights: "_SharedWeights") -> dict:
    """The graphs are read without their weights, which stay in their data file: each variant is optimised by
    ONNX Runtime from a file beside that data, so one variant's weights at a time are in memory. Their tensors go to
    `weights` (left open)."""
    from specrt.export.onnx_files import float32_file, load
    with tempfile.TemporaryDirectory(prefix=f".{role}.cuda-", dir=directory) as scratch:
        source = float32_file(graph, Path(scratch) / "float32.onnx")   # the graph itself if exported in float32
        dynamic = load(source, weights=False)
        files = {"engine": weights.save(_prepare(dynamic, dtype, source.parent), f"{role}.cuda.onnx")}
        for w in widths:
            files[str(w)] = weights.save(_prepare(static_graph(dynamic, w, spec), dtype, source.parent),
                                         f"{role}.w{w}.cuda.onnx")
    return {"files": files, "dtype": dtype, "widths": [str(w) for w in widths]}


def _entry(directory: Path, e: dict) -> dict:
    """The engine graph's entry lists the shared weights file ("data"), which the runtime checks when it loads the
    engine; the width graphs refer to the same file."""
    return {**file_entry(directory, e["files"]["engine"]), "weights": e["dtype"], "backend": "onnxruntime",
            "device": "cuda", "dtype": e["dtype"],
            "widths": {w: file_entry(directory, e["files"][w], data=False) for w in e["widths"]}}


def static_graph(model: onnx.ModelProto, width: int, spec: dict) -> onnx.ModelProto:
    """The contract graph with every shape fixed for one width: B = 1, S = `width`, caches of max_seq_len,
    num_logits = width (a constant), TreeAttention's static body. An EAGLE drafter's `features` are (1, S, d),
    its logits as wide as its kept ids; a target's `aux` and an EAGLE-3 drafter's are (1, S, n*d)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    kv = [1, spec["kv_heads"], spec["max_seq_len"], spec["head_dim"]]
    new = [1, spec["kv_heads"], width, spec["head_dim"]]
    shapes = {"input_ids": [1, width], "position_ids": [1, width], "past_len": [1],
              "tree_mask": [1, width, width], "logits": [1, width, logits_width(spec)],
              "hidden": [1, width, spec["hidden_size"]], "features": [1, width, spec["hidden_size"]]}
    aux = spec["aux"]["size"] if "aux" in spec else spec.get("aux_size")   # a target's output, EAGLE-3's input
    if aux:
        shapes["aux"] = [1, width, aux]
    for io in [*m.graph.input, *m.graph.output]:
        dims = shapes.get(io.name) or (kv if "_cache_" in io.name else new if "_new_" in io.name else None)
        if dims is not None:
            _set_dims(io, dims)
    keep = [i for i in m.graph.input if i.name != "num_logits"]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    m.graph.initializer.append(numpy_helper.from_array(np.array([width], np.int64), "num_logits"))
    del m.graph.value_info[:]
    return attach_function(m, static=True)


def _set_dims(io: onnx.ValueInfoProto, dims: list[int]) -> None:
    shape = io.type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        shape.dim.add().dim_value = d


def _prepare(model: onnx.ModelProto, dtype: str, base: Path) -> onnx.ModelProto:
    """Fold what the shapes allow (float32, provider-independent), then convert to `dtype`. `base`: the directory
    of the external data `model` refers to."""
    return to_dtype(_optimize_basic(model, base), dtype)


def _optimize_basic(model: onnx.ModelProto, base: Path) -> onnx.ModelProto:
    """ONNX Runtime's basic level (constant folding, shapes included where static; provider-independent) on
    the inlined graph, read from a file in `base` (where its weights are) and written with external data (any
    size). The result, weights loaded, has no functions left: the dtype conversion sees every node."""
    import onnxruntime as ort

    from specrt.export.onnx_files import MIN_EXTERNAL, load
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.log_severity_level = 3
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                     str(MIN_EXTERNAL))
    with tempfile.TemporaryDirectory(dir=base, prefix=".optimize-") as tmp:
        graph = Path(base) / f"{Path(tmp).name}.onnx"   # beside the data its tensors refer to
        try:
            onnx.save(model, str(graph))
            options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
            ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        finally:
            graph.unlink(missing_ok=True)
        return load(Path(options.optimized_model_filepath))


def to_dtype(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    """float16: ONNX Runtime's converter (Cast nodes where an op must stay float32: RMSNorm's statistics, from
    the squares to the normalised values, computed in float32 as transformers does); `logits` and `hidden` stay
    float32 outputs. bfloat16: the same graph with every float16 tensor re-typed as bfloat16."""
    if dtype == "float32":
        return model
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    from specrt.export.onnx_files import infer_shapes
    originals = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
                 if t.data_type == TensorProto.FLOAT} if dtype == "bfloat16" else {}
    ops, names = [*DEFAULT_OP_BLOCK_LIST, *FLOAT32_OPS], _norm_tails(model)
    shapes = infer_shapes(model).graph.value_info   # on the structure: the converter's own serializes the weights
    del model.graph.value_info[:]
    model.graph.value_info.extend(shapes)
    model = convert_float_to_float16(model, keep_io_types=KEPT_FLOAT32, disable_shape_infer=True, op_block_list=ops,
                                     node_block_list=names)
    _no_round_trips(model, set(ops), set(names))
    if dtype == "bfloat16":
        _float16_to_bfloat16(model, originals)
    return model


def _norm_tails(model: onnx.ModelProto) -> list[str]:
    """The nodes of each RMSNorm between its mean of squares and the normalised values (x / sqrt(mean + eps)):
    a mean over 65,504 (an RMS over 256) is infinite in float16. Unnamed ones are named here."""
    users: dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    tails = []
    for i, node in enumerate(list(model.graph.node)):
        if node.op_type != "ReduceMean":
            continue
        while len(users.get(node.output[0], [])) == 1 and users[node.output[0]][0].op_type in NORM_TAIL:
            node = users[node.output[0]][0]
            node.name = node.name or f"rms_norm_{i}_{len(tails)}"
            tails.append(node.name)
            if node.op_type in ("Div", "Mul"):   # the normalised values (times the weight: float16)
                break
    return tails


def _no_round_trips(model: onnx.ModelProto, ops: set, names: set) -> None:
    """The converter casts each float32 node's output to float16 and back for the next float32 node: the next
    one reads the float32 value itself (x² of a residual stream stays finite on its way to the mean)."""
    g = model.graph
    made = {o: n for n in g.node for o in n.output}
    to = lambda n: next((a.i for a in n.attribute if a.name == "to"), None)  # noqa: E731
    kept = {o.name for o in g.output}
    direct = {}
    for node in g.node:
        first = made.get(node.input[0]) if node.op_type == "Cast" and to(node) == TensorProto.FLOAT else None
        source = made.get(first.input[0]) if first is not None and first.op_type == "Cast" and \
            to(first) == TensorProto.FLOAT16 else None
        if source is not None and (source.op_type in ops or source.name in names) and node.output[0] not in kept:
            direct[node.output[0]] = first.input[0]
    for node in [n for n in g.node if n.output[0] in direct]:
        g.node.remove(node)   # the casts back
    for node in g.node:
        node.input[:] = [direct.get(name, name) for name in node.input]
    read = {name for n in g.node for name in n.input} | kept
    for node in [n for n in g.node if n.op_type == "Cast" and n.output[0] not in read]:
        g.node.remove(node)   # the casts to float16 that nothing reads any more


def _float16_to_bfloat16(model: onnx.ModelProto, originals: dict) -> None:
    g = model.graph
    for i, t in enumerate(g.initializer):
        if t.data_type == TensorProto.FLOAT16:
            src = originals.get(t.name)
            src = numpy_helper.to_array(t).astype(np.float32) if src is None else src
            g.initializer[i].CopyFrom(_bfloat16(src, t.name))
    for node in g.node:
        for a in node.attribute:
            if a.name == "to" and a.i == TensorProto.FLOAT16:
                a.i = TensorProto.BFLOAT16
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT16:
                a.t.CopyFrom(_bfloat16(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
    for v in [*g.input, *g.output, *g.value_info]:
        if v.type.tensor_type.elem_type == TensorProto.FLOAT16:
            v.type.tensor_type.elem_type = TensorProto.BFLOAT16


def _bfloat16(x: np.ndarray, name: str) -> onnx.TensorProto:
    """float32 -> a BFLOAT16 tensor, rounded to nearest even (infinities kept)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    rounded = np.where(np.isnan(x), np.uint16(0x7FC0), rounded)
    return onnx.helper.make_tensor(name, TensorProto.BFLOAT16, x.shape, rounded.tobytes(), raw=True)


class _SharedWeights:
    """One external-data file for the graphs of one model: each distinct large tensor is written once and
    every graph that holds it points at the same bytes."""

    def __init__(self, directory: Path, name: str, staged: list):
        self.directory, self.name, self.staged = directory, name, staged
        self.partial = directory / f".{name}.partial"
        staged.append((self.partial, directory / name))
        self.file = open(self.partial, "wb")
        self.offsets: dict[str, tuple[int, int]] = {}

    def save(self, model: onnx.ModelProto, name: str) -> str:
        for t in model.graph.initializer:
            if not t.HasField("raw_data"):
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t), t.name))
            if len(t.raw_data) < MIN_EXTERNAL:
                continue
            digest = hashlib.sha256(t.raw_data).hexdigest()
            if digest not in self.offsets:
                self.offsets[digest] = (self.file.tell(), len(t.raw_data))
                self.file.write(t.raw_data)
            offset, length = self.offsets[digest]
            t.ClearField("raw_data")
            t.data_location = TensorProto.EXTERNAL
            del t.external_data[:]
            for k, v in (("location", self.name), ("offset", str(offset)), ("length", str(length))):
                t.external_data.add(key=k, value=v)
        partial = self.directory / f".{name}.partial"
        self.staged.append((partial, self.directory / name))
        onnx.save(model, str(partial))
        return name

    def close(self) -> None:
        self.file.close()
