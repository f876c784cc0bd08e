"""The TreeAttention op as a TensorRT plugin, and the TensorRT engine build from the same ONNX graph.

NOT VERIFIED: TensorRT cannot be installed on the machines this project is built and tested on. This module
is imported only when TensorRT is present; it uses TensorRT 10's quickly deployable plugin API. The kernel is
the torch implementation of the op (`tree_attention_torch`) on TensorRT's CUDA stream; its numerics are the
ones `tests/test_tree_attention.py` checks against the float64 reference.
"""
from __future__ import annotations

from pathlib import Path

import onnx
import tensorrt as trt
import tensorrt.plugin as trtp
import torch

from specrt.plugins.tree_attention import DOMAIN, OP_TYPE, tree_attention_torch

PLUGIN_ID = f"{DOMAIN}::{OP_TYPE}"
MAX_VERIFY = 64   # widest verification block (S) in the optimisation profile


@trtp.register(PLUGIN_ID)
def tree_attention_desc(query: trtp.TensorDesc, k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc,
                        k_new: trtp.TensorDesc, v_new: trtp.TensorDesc, past_len: trtp.TensorDesc,
                        tree_mask: trtp.TensorDesc, scale: float) -> trtp.TensorDesc:
    """Shape rule: the output is shaped and typed like the query (B, H, S, D)."""
    return query.like()


@trtp.impl(PLUGIN_ID)
def tree_attention_impl(query: trtp.Tensor, k_cache: trtp.Tensor, v_cache: trtp.Tensor, k_new: trtp.Tensor,
                        v_new: trtp.Tensor, past_len: trtp.Tensor, tree_mask: trtp.Tensor, scale: float,
                        outputs: tuple[trtp.Tensor], stream: int) -> None:
    args = [torch.as_tensor(t, device="cuda") for t in (query, k_cache, v_cache, k_new, v_new, past_len, tree_mask)]
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        out = torch.as_tensor(outputs[0], device="cuda")
        out.copy_(tree_attention_torch(*args, scale).to(out.dtype))


def strip_function(graph: Path) -> bytes:
    """TensorRT maps the node to the plugin: drop the ONNX function body, name the plugin namespace."""
    model = onnx.load(str(graph))
    del model.functions[:]
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type == OP_TYPE:
            node.attribute.append(onnx.helper.make_attribute("plugin_namespace", DOMAIN))
    return model.SerializeToString()


def build_engine(graph: Path, engine: Path, max_len: int, max_batch: int = 8, fp16: bool = True) -> None:
    """Optimisation profile: batch 1..max_batch, S 1..max_len (decode at 1, verification around 8, prefill up
    to max_len), cache length 1..max_len."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(strip_function(graph)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {graph}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for k in range(network.num_inputs):
        t = network.get_input(k)
        shape = list(t.shape)
        lo, opt, hi = [], [], []
        for axis, dim in enumerate(shape):
            if dim >= 0:
                lo.append(dim), opt.append(dim), hi.append(dim)
            elif axis == 0:                                    # batch
                lo.append(1), opt.append(1), hi.append(max_batch)
            elif t.name.startswith(("k_cache", "v_cache")):    # cache length
                lo.append(1), opt.append(512), hi.append(max_len)
            else:                                              # S: decode, verification and prefill
                lo.append(1), opt.append(8), hi.append(max_len)
        if t.name == "num_logits":                             # a shape-value input
            profile.set_shape_input(t.name, [1], [8], [MAX_VERIFY])
        else:
            profile.set_shape(t.name, lo, opt, hi)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build {graph}")
    engine.write_bytes(bytes(plan))
