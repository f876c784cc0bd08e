"""ONNX graph files as specrt writes them: the graph in NAME, its weights as ONNX external data in one file NAME.data
beside it. A protobuf message is limited to 2 GiB, so every graph keeps its weights outside, whatever the model's
size: a tiny test model takes the same path as a 70 B one (only tensors under 1 KiB stay inside the graph). ONNX
Runtime opens a graph by its path and reads the data next to it; the manifest hashes both files (see
`specrt.engines.manifest.file_entry`).

A graph exported in float16 or bfloat16 (`specrt export --dtype`) stores each floating-point weight in that dtype and
reads it through a Cast to float32, so that the graph itself computes in float32 as a float32 export does;
`float32_graph` folds those Casts for the CPU builds (float32 or quantized engines).
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


def _initializers(graph: onnx.GraphProto):
    """The initializers of a graph and of its subgraphs (an If's branches)."""
    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _initializers(a.g)


def save(model: onnx.ModelProto, path: Path) -> None:
    """Write `model` to `path`, its tensors of MIN_EXTERNAL bytes or more to `path`.data (replaced). The tensors'
    bytes move out of `model`, which then refers to the file. Every tensor must be in memory (load with weights)."""
    path = Path(path)
    data = data_path(path)
    data.unlink(missing_ok=True)   # onnx appends to an existing data file
    for t in _initializers(model.graph):
        if t.data_location == TensorProto.EXTERNAL and not t.HasField("raw_data"):
            raise ValueError(f"{t.name}: its weights are not loaded (onnx.load with load_external_data)")
        if not t.HasField("raw_data") and t.data_type not in (TensorProto.STRING, TensorProto.UNDEFINED):
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t), t.name))   # typed fields -> raw bytes
        if t.HasField("raw_data") and len(t.raw_data) >= MIN_EXTERNAL:
            external_data_helper.set_external_data(t, data.name)
    onnx.save_model(model, str(path))   # writes the marked tensors to `data`, then the graph


def load(path: Path, weights: bool = True) -> onnx.ModelProto:
    """A graph with its external data (`weights`), or only its structure, the tensors referring to their files."""
    model = onnx.load(str(path), load_external_data=False)
    if weights:
        external_data_helper.load_external_data_for_model(model, str(Path(path).parent))
    return model


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
        """The initializer `name` holding `values` (raw bytes of `elem_type` if given, e.g. bfloat16 as uint16)."""
        t = numpy_helper.from_array(np.ascontiguousarray(values), name)
        if elem_type is not None:
            t.data_type = elem_type
        if len(t.raw_data) >= MIN_EXTERNAL:
            external_data_helper.set_external_data(t, self.data.name)
            external_data_helper.save_external_data(t, str(self.data.parent))   # appends, sets offset and length
            t.ClearField("raw_data")
        return t


def stored_weights(model: onnx.ModelProto) -> str:
    """The dtype a graph stores its weights in: "float32", or "float16"/"bfloat16" read through Casts."""
    stored = {t.data_type for t in model.graph.initializer}
    return next((name for name, code in STORED.items() if code in stored), "float32")


def float32_graph(model: onnx.ModelProto) -> int:
    """Fold, in place, the Casts through which a graph exported in float16 or bfloat16 reads its weights: each
    weight becomes a float32 initializer under the Cast's output name (the values are exact: both dtypes are
    subsets of float32). Returns how many weights were widened."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers = {}
    for node in g.node:
        for i in node.input:
            readers[i] = readers.get(i, 0) + 1
    nodes, widened = [], {}
    for node in g.node:
        src = inits.get(node.input[0]) if node.op_type == "Cast" else None
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if src is None or src.data_type not in STORED.values() or to != TensorProto.FLOAT or readers[src.name] > 1:
            nodes.append(node)
            continue
        widened[src.name] = numpy_helper.from_array(numpy_helper.to_array(src).astype(np.float32), node.output[0])
    if widened:
        kept = [t for t in g.initializer if t.name not in widened]
        g.ClearField("initializer")
        g.initializer.extend([*kept, *widened.values()])
        g.ClearField("node")
        g.node.extend(nodes)
    return len(widened)


def float32_file(graph: Path, out: Path) -> Path:
    """`graph` where it stores its weights in float32, else its float32 form (`float32_graph`) written to `out`."""
    if stored_weights(load(graph, weights=False)) == "float32":
        return Path(graph)
    model = load(graph)
    float32_graph(model)
    save(model, out)
    return Path(out)


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference on a graph of any size: run on its structure, the initializers' bytes set aside (a
    graph with its weights inline may be over the 2 GiB that shape inference can serialize)."""
    stash = {}
    for t in model.graph.initializer:
        if t.HasField("raw_data"):
            stash[t.name] = t.raw_data
            t.ClearField("raw_data")
    try:
        return onnx.shape_inference.infer_shapes(model)
    finally:
        for t in model.graph.initializer:
            if t.name in stash:
                t.raw_data = stash[t.name]
