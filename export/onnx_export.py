"""Trace a model to the ONNX graph of the engine contract (the engine directory is staged by specrt.files)."""
from __future__ import annotations

import contextlib
import hashlib
import warnings
from pathlib import Path

import onnx
import torch

from specrt.export.hybrid import cache_layers
from specrt.export.model import SpecModel
from specrt.plugins.tree_attention import DOMAIN, attach_function


def cache_names(num_layers: int) -> tuple[list[str], list[str]]:
    inputs = [f"{kind}_cache_{i}" for i in range(num_layers) for kind in ("k", "v")]
    outputs = [f"{kind}_new_{i}" for i in range(num_layers) for kind in ("k", "v")]
    return inputs, outputs


def weights_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())  # any dtype
    return h.hexdigest()


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _MatMulLinear(torch.nn.Module):
    """nn.Linear as the graph computes it, x @ W^T + b, with W^T a parameter of its own (a view of the weight):
    the MatMul reads it directly, where the exporter would fold a transpose of the weight into a copy."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight_t = torch.nn.Parameter(linear.weight.detach().t(), requires_grad=False)   # (in, out)
        self.bias = linear.bias

    def forward(self, x):
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


@contextlib.contextmanager
def _placeholders(model: torch.nn.Module):
    """Within the block, each nn.Linear of `model` is a `_MatMulLinear` and every parameter a float32 placeholder of
    its shape that takes no memory (one element, expanded); yields the real tensors by parameter name (buffers
    too). Everything is put back at the end."""
    swapped = []
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is torch.nn.Linear:
                swapped.append((module, name, child))
                setattr(module, name, _MatMulLinear(child))
    real = {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}
    params = [(m, n, p) for m in model.modules() for n, p in m.named_parameters(recurse=False)]
    try:
        for m, n, p in params:
            setattr(m, n, torch.nn.Parameter(torch.zeros((), dtype=torch.float32).expand(p.shape), requires_grad=False))
        yield real
    finally:
        for m, n, p in params:
            setattr(m, n, p)
        for module, name, child in swapped:
            setattr(module, name, child)


def export_module(model: torch.nn.Module, args: tuple, path: Path, dtype: str, input_names: list[str],
                  output_names: list[str], dynamic_axes: dict) -> None:
    """Trace `model` with torch.onnx (TorchScript: `TreeAttention` stays one custom node) to the graph `path`, its
    function attached, its weights in `dtype` as external data in `path`.data (see specrt.export.onnx_files).

    The trace runs over placeholder weights and writes no parameters; the real ones are then streamed into the
    data file one at a time, so that the export holds no second copy of the model (a 7 B target exports in about
    its own size of memory). A float16 or bfloat16 weight is read through a Cast to float32: the graph computes in
    float32 whatever dtype it stores its weights in."""
    from specrt.export.onnx_files import STORED, WeightWriter, data_path
    path = Path(path)
    with _placeholders(model) as real, warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, input_names=input_names,
                          output_names=output_names, dynamic_axes=dynamic_axes, do_constant_folding=True,
                          custom_opsets={"specrt": 1}, export_params=False, keep_initializers_as_inputs=True)
    graph = onnx.load(str(path))   # the structure: every weight is still a graph input
    weights = [i for i in graph.graph.input if i.name not in input_names]
    unknown = [i.name for i in weights if i.name not in real]
    if unknown:   # a weight the exporter computed from parameters (folded): it must read them directly
        raise ValueError(f"the traced graph reads {unknown[:3]}, which are not parameters of the model: read "
                         "each weight directly (no slicing or transposing of parameters in forward)")
    writer, casts = WeightWriter(data_path(path)), []
    for i in weights:
        t = real[i.name].detach()
        if t.is_floating_point() and dtype != "float32":
            t = t.to(DTYPES[dtype]).contiguous()
            stored = f"{i.name}.{dtype}"
            bits = t.view(torch.int16).numpy()
            graph.graph.initializer.append(writer.add(stored, bits, STORED[dtype]))
            casts.append(onnx.helper.make_node("Cast", [stored], [i.name], name=f"{i.name}/Cast",
                                               to=onnx.TensorProto.FLOAT))
        else:
            values = t.float().numpy() if t.is_floating_point() else t.numpy()
            graph.graph.initializer.append(writer.add(i.name, values))
        del t
    kept = [i for i in graph.graph.input if i.name in input_names]
    del graph.graph.input[:]
    graph.graph.input.extend(kept)
    nodes = [*casts, *graph.graph.node]
    del graph.graph.node[:]
    graph.graph.node.extend(nodes)
    if any(n.domain == DOMAIN for n in graph.graph.node):
        attach_function(graph)
    onnx.save_model(graph, str(path))   # the structure: the weights are in the data file already


def export_graph(model: SpecModel, path: Path, dtype: str = "float32") -> None:
    """The target or draft graph of the engine contract (see `export_module`); with `model.aux_layers`, the `aux`
    output too (see specrt.export.model)."""
    a = model.args
    B, S = 1, 3
    caches = [torch.zeros(B, a.num_kv_heads, a.max_seq_len, a.head_dim) for _ in range(2 * cache_layers(a))]
    args = (torch.zeros(B, S, dtype=torch.int64), torch.arange(S)[None].expand(B, S).contiguous(),
            torch.zeros(B, dtype=torch.int64),
            torch.ones(S, S, dtype=torch.bool).tril()[None].expand(B, S, S).contiguous(),
            torch.tensor([S], dtype=torch.int64), *caches)
    cache_in, cache_out = cache_names(cache_layers(a))
    inputs = ["input_ids", "position_ids", "past_len", "tree_mask", "num_logits", *cache_in]
    outputs = ["logits", "hidden", *cache_out, *(["aux"] if model.aux_layers else [])]
    dyn = {"input_ids": {0: "B", 1: "S"}, "position_ids": {0: "B", 1: "S"}, "past_len": {0: "B"},
           "tree_mask": {0: "B", 1: "S", 2: "S"}, "logits": {0: "B", 1: "num_logits"}, "hidden": {0: "B", 1: "S"},
           **({"aux": {0: "B", 1: "S"}} if model.aux_layers else {})}
    dyn.update({n: {0: "B", 2: "cache_len"} for n in cache_in})  # the runtime sizes caches per request
    dyn.update({n: {0: "B", 2: "S"} for n in cache_out})
    export_module(model, args, path, dtype, inputs, outputs, dyn)


def model_entry(model: SpecModel, source: str, graph_file: str, directory: Path, eos: list[int],
                dtype: str = "float32") -> dict:
    from specrt.engines.manifest import file_entry
    a = model.args
    return {
        "source": source, "architecture": a.architecture, "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size, "layers": cache_layers(a), "heads": a.num_heads,
        "kv_heads": a.num_kv_heads, "head_dim": a.head_dim, "max_seq_len": a.max_seq_len,
        "dtype": dtype, "weights_sha256": weights_sha256(model), "eos_token_ids": eos,
        "graph": file_entry(directory, graph_file),
    }
