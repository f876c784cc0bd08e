"""The TreeAttention op as a TensorRT plugin, and the TensorRT engine build from the same ONNX graph.

NOT VERIFIED: TensorRT cannot be installed on the machines this project is built and tested on. The plugin
uses TensorRT 10's quickly deployable plugin API (`tensorrt.plugin`); `register()` adds `specrt::TreeAttention`
to TensorRT's plugin registry and must run before an ONNX graph is parsed or an engine deserialised. The
kernel, `tree_attention_static`, is plain torch on TensorRT's CUDA stream: static shapes, no host read of
`past_len`; tests/test_tensorrt.py checks it against the float64 reference on the CPU.

No `from __future__ import annotations` here: `tensorrt.plugin` reads the plugin functions' annotations as
classes (TensorDesc, Tensor, float), and postponed annotations would hand it strings.
"""
import functools
from pathlib import Path

import torch

from specrt.errors import BackendError
from specrt.plugins.tree_attention import DOMAIN, OP_TYPE, visibility

PLUGIN_ID = f"{DOMAIN}::{OP_TYPE}"


def tree_attention_static(q, k_cache, v_cache, k_new, v_new, past_len, tree_mask, scale: float, window: int = 0,
                          softcap: float = 0.0):
    """The op over the whole static cache: slots at or past `past_len[b]` get weight zero through the mask, so
    no shape depends on a value on the device (nothing to read back, nothing to re-plan per pass)."""
    B, H, S, D = q.shape
    Hkv, Smax = k_cache.shape[1], k_cache.shape[2]
    keys = torch.cat([k_cache, k_new], dim=2)                                    # (B, Hkv, Smax+S, D)
    values = torch.cat([v_cache, v_new], dim=2)                                  # (B, Hkv, Smax+S, D)
    visible = visibility(past_len, tree_mask.bool(), Smax, window)               # (B, S, Smax+S)
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    qg = q.reshape(B, Hkv, -1, D)                                                # (B, Hkv, G*S, D)
    scores = (qg @ keys.transpose(2, 3)) * scale                                 # (B, Hkv, G*S, Smax+S)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.reshape(B, Hkv, -1, S, Smax + S) + bias[:, None, None]       # (B, Hkv, G, S, Smax+S)
    probs = torch.softmax(scores, dim=-1).reshape(B, Hkv, -1, Smax + S)          # (B, Hkv, G*S, Smax+S)
    return (probs @ values).reshape(B, H, S, D)                                  # (B, H, S, D)


def load_tensorrt():
    """The `tensorrt` module, or a BackendError that says how to get it."""
    try:
        import tensorrt
        return tensorrt
    except Exception as e:  # the PyPI stub raises on import without NVIDIA's package index
        raise BackendError(f"TensorRT is not installed ({type(e).__name__}: {e}): pip install 'specrt[gpu]' on "
                           "an NVIDIA machine (TensorRT 10), or rebuild the engine set with "
                           "`specrt build DIR --backend onnxruntime`") from e


@functools.cache
def register() -> None:
    """Register `specrt::TreeAttention` with TensorRT (once per process)."""
    load_tensorrt()
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN_ID)
    def tree_attention_desc(query: trtp.TensorDesc, k_cache: trtp.TensorDesc, v_cache: trtp.TensorDesc,
                            k_new: trtp.TensorDesc, v_new: trtp.TensorDesc, past_len: trtp.TensorDesc,
                            tree_mask: trtp.TensorDesc, scale: float, window: int, softcap: float) -> trtp.TensorDesc:
        """Shape rule: the output is shaped and typed like the query (B, H, S, D)."""
        return query.like()

    @trtp.impl(PLUGIN_ID)
    def tree_attention_impl(query: trtp.Tensor, k_cache: trtp.Tensor, v_cache: trtp.Tensor, k_new: trtp.Tensor,
                            v_new: trtp.Tensor, past_len: trtp.Tensor, tree_mask: trtp.Tensor, scale: float,
                            window: int, softcap: float, outputs: tuple[trtp.Tensor], stream: int) -> None:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            args = [torch.as_tensor(t, device="cuda") for t in (query, k_cache, v_cache, k_new, v_new, past_len,
                                                                 tree_mask)]
            out = torch.as_tensor(outputs[0], device="cuda")
            out.copy_(tree_attention_static(*args, scale, window, softcap))


def strip_function(graph: Path) -> bytes:
    """TensorRT maps the node to the plugin: drop the ONNX function body, name the plugin namespace. The weights
    stay in the graph's external data file (the parser reads them from beside `graph`)."""
    import onnx
    model = onnx.load(str(graph), load_external_data=False)
    del model.functions[:]
    for node in model.graph.node:
        if node.domain == DOMAIN and node.op_type == OP_TYPE:
            node.attribute.append(onnx.helper.make_attribute("plugin_namespace", DOMAIN))
    return model.SerializeToString()


def _profile_range(name: str, axis: int, max_len: int, max_batch: int) -> tuple[int, int, int]:
    """(min, opt, max) of a dynamic axis: batch, cache length, or S (decode, verification and prefill)."""
    if axis == 0:
        return 1, 1, max_batch
    if name.startswith(("k_cache", "v_cache")):
        return 1, min(512, max_len), max_len
    return 1, min(8, max_len), max_len


def build_engine(graph: Path, engine: Path, max_len: int, max_batch: int = 8, fp16: bool = True) -> None:
    """Parse `graph` with the plugin registered and write a serialised engine. One optimisation profile:
    batch 1..max_batch, S 1..max_len, cache length 1..max_len, `num_logits` (a shape tensor) 1..max_len."""
    trt = load_tensorrt()
    register()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(strip_function(graph), path=str(graph)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BackendError(f"TensorRT could not parse {graph}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        t = network.get_input(i)
        if t.is_shape_tensor:                                   # num_logits: its value shapes the logits
            profile.set_shape_input(t.name, [1], [min(8, max_len)], [max_len])
            continue
        ranges = [(d, d, d) if d >= 0 else _profile_range(t.name, axis, max_len, max_batch)
                  for axis, d in enumerate(t.shape)]
        profile.set_shape(t.name, *(tuple(r[j] for r in ranges) for j in range(3)))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BackendError(f"TensorRT failed to build {graph} (see its log above)")
    engine.write_bytes(bytes(plan))
