"""ONNX graph files as specrt writes them: the graph in NAME, its weights as ONNX external data in one file NAME.data
beside it. A protobuf message is limited to 2 GiB, so every graph keeps its weights outside, whatever the model's
size: a tiny test model takes the same path as a 70 B one (only tensors under 1 KiB stay inside the graph). ONNX
Runtime opens a graph by its path and reads the data next to it; the manifest hashes both files (see
`specrt.engines.manifest.file_entry`).

A graph exported in float16 or bfloat16 (`specrt export --dtype`) stores each floating-point weight in that dtype and
reads it through a Cast to float32, so that the graph itself computes in float32 as a float32 export does;
`float32_file` folds those Casts for the builds (CPU engines in float32 or quantized, and the CUDA build's input).

Graphs are rewritten (fusion, quantization) from their structure, each weight read from its data file when a step
needs it and the rest copied over when the result is saved: a build holds what it changes, not the whole model.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, external_data_helper, numpy_helper

DATA = ".data"
MIN_EXTERNAL = 1024   # bytes: smaller tensors (shapes, scalars) stay inside the graph
STORED = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def data_path(path: Path) -> Path:
    return path.with_name(path.name + DATA)


def _tensors(graph: onnx.GraphProto):
    """(tensor, is_initializer) for the initializers and the tensor attributes (Constant nodes) of a graph and of its
    subgraphs (an If's branches)."""
    yield from ((t, True) for t in graph.initializer)
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t, False
            elif a.type == onnx.AttributeProto.GRAPH:
                yield from _tensors(a.g)


def _write(t: onnx.TensorProto, data: Path) -> None:
    """Append a tensor's bytes to the data file `data` (if it has MIN_EXTERNAL of them) and point it there."""
    if t.HasField("raw_data") and len(t.raw_data) >= MIN_EXTERNAL:
        external_data_helper.set_external_data(t, data.name)
        external_data_helper.save_external_data(t, str(data.parent))   # appends; sets offset and length
        t.ClearField("raw_data")


def _in_memory(t: onnx.TensorProto, base: Path | None) -> None:
    """Give `t` its bytes: read from its data file under `base`, or its typed fields turned into raw bytes."""
    if external_data_helper.uses_external_data(t) and not t.HasField("raw_data"):
        if base is None:
            raise ValueError(f"{t.name}: its weights are not loaded; pass the directory of its data file")
        external_data_helper.load_external_data_for_tensor(t, str(base))
    elif not t.HasField("raw_data") and t.data_type not in (TensorProto.STRING, TensorProto.UNDEFINED):
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t), t.name))


def _location(t: onnx.TensorProto) -> str | None:
    return next((e.value for e in t.external_data if e.key == "location"), None)


def save(model: onnx.ModelProto, path: Path, base: Path | None = None) -> None:
    """Write `model` to `path`, its tensors of MIN_EXTERNAL bytes or more to `path`.data (replaced), one tensor at a
    time: tensors that are still in a data file (a graph loaded without its weights) are read from `base`, that
    file's directory, as they are written. The bytes move out of `model`, which then refers to the new file."""
    path = Path(path)
    data = data_path(path)
    tensors = list(_tensors(model.graph))
    if base is not None and any(not t.HasField("raw_data") and _location(t) is not None
                                and (Path(base) / _location(t)).resolve() == data.resolve() for t, _ in tensors):
        for t, _ in tensors:   # rewriting a graph over its own data file: read it all first
            _in_memory(t, base)
    data.unlink(missing_ok=True)
    data.touch()
    for t, initializer in tensors:
        if initializer:
            _move(t, base, data)
        else:   # a Constant node's value stays in the graph
            _in_memory(t, base)
    onnx.save_model(model, str(path))   # the structure: every large tensor is in `data` already


def _move(t: onnx.TensorProto, base: Path | None, data: Path) -> None:
    """An initializer's bytes into `data`: from its data file under `base`, or from memory."""
    if external_data_helper.uses_external_data(t) and not t.HasField("raw_data"):
        _copy_over(t, base, data)
    else:
        _in_memory(t, base)
        _write(t, data)


def _copy_over(t: onnx.TensorProto, base: Path | None, data: Path) -> None:
    """Move a tensor that is in a data file under `base` to `data`, through a copy of its own: a protobuf message
    keeps the memory of a field it once held until the whole message goes, so the model never holds the bytes."""
    if base is None:
        raise ValueError(f"{t.name}: its weights are not loaded; pass the directory of its data file")
    one = onnx.TensorProto()
    one.CopyFrom(t)
    external_data_helper.load_external_data_for_tensor(one, str(base))
    _write(one, data)
    t.data_location = TensorProto.EXTERNAL
    del t.external_data[:]
    t.external_data.extend(one.external_data)


def load(path: Path, weights: bool = True) -> onnx.ModelProto:
    """A graph with its external data (`weights`), or only its structure, the tensors referring to their files."""
    model = onnx.load(str(path), load_external_data=False)
    if weights:
        external_data_helper.load_external_data_for_model(model, str(Path(path).parent))
    return model


def array(t: onnx.TensorProto, base: Path | None) -> np.ndarray:
    """A tensor's values, read from its data file under `base` if not in memory (the proto stays as it is)."""
    return numpy_helper.to_array(t, str(base) if base is not None else "")


def remove(path: Path) -> None:
    """A graph file and its data file, where they exist."""
    Path(path).unlink(missing_ok=True)
    data_path(Path(path)).unlink(missing_ok=True)


class WeightWriter:
    """Streams tensors into one external-data file, one at a time, and gives back the graph initializers that refer
    to them: a model's weights are written without a second copy of them in memory."""

    def __init__(self, data: Path):
        self.data = Path(data)
        self.data.unlink(missing_ok=True)
        self.data.touch()

    def add(self, name: str, values: np.ndarray, elem_type: int | None = None) -> onnx.TensorProto:
        """The initializer `name` holding `values` (raw bytes of `elem_type` if given, e.g. bfloat16 as int16)."""
        t = numpy_helper.from_array(np.ascontiguousarray(values), name)
        if elem_type is not None:
            t.data_type = elem_type
        _write(t, self.data)
        return t


def stored_weights(model: onnx.ModelProto) -> str:
    """The dtype a graph stores its weights in: "float32", or "float16"/"bfloat16" read through Casts."""
    stored = {t.data_type for t in model.graph.initializer}
    return next((name for name, code in STORED.items() if code in stored), "float32")


def float32_file(graph: Path, out: Path) -> Path:
    """`graph` where it stores its weights in float32; else its float32 form written to `out`: each weight read
    through a Cast becomes a float32 initializer under the Cast's output name (exact: float16 and bfloat16 values
    are float32 values) and the Casts go. One weight at a time is in memory."""
    graph, out = Path(graph), Path(out)
    model = load(graph, weights=False)
    if stored_weights(model) == "float32":
        return graph
    g = model.graph
    stored = {t.name: t for t in g.initializer if t.data_type in STORED.values()}
    casts = {n.input[0]: n for n in g.node if n.op_type == "Cast" and n.input[0] in stored
             and next(a.i for a in n.attribute if a.name == "to") == TensorProto.FLOAT}
    writer, tensors = WeightWriter(data_path(out)), []
    for t in g.initializer:
        if t.name in casts:
            tensors.append(writer.add(casts[t.name].output[0], array(t, graph.parent).astype(np.float32)))
        else:
            _move(t, graph.parent, writer.data)
            tensors.append(t)
    for t, initializer in _tensors(g):
        if not initializer:
            _in_memory(t, graph.parent)
    g.ClearField("initializer")
    g.initializer.extend(tensors)
    nodes = [n for n in g.node if not (n.op_type == "Cast" and n.input[0] in casts)]
    g.ClearField("node")
    g.node.extend(nodes)
    onnx.save_model(model, str(out))
    return out


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference on a graph of any size: run on its structure, the weights' bytes set aside (a graph
    with its weights in memory may be past the 2 GiB that shape inference serializes). Returns the inferred
    structure (its large initializers without their bytes)."""
    stash = {}
    for t in model.graph.initializer:
        if t.HasField("raw_data") and len(t.raw_data) >= MIN_EXTERNAL:   # shapes and small constants stay
            stash[t.name] = t.raw_data
            t.ClearField("raw_data")
    try:
        return onnx.shape_inference.infer_shapes(model)
    finally:
        for t in model.graph.initializer:
            if t.name in stash:
                t.raw_data = stash[t.name]
