"""TensorRT engines behind the interface `OrtEngine` has (new_cache, use_cache, forward, run_sequence, time_pass).

NOT VERIFIED: TensorRT cannot be installed on the machines this project is built and tested on; this is
written against the TensorRT 10 Python API and kept thin. Every tensor the engine reads or writes lives in a
static torch buffer on the GPU whose address is bound once (`set_tensor_address`) and rebound only when a
buffer has to grow; `num_logits` is a shape tensor, so TensorRT reads it from host memory; passes run with
`execute_async_v3` on torch's current stream, so they are ordered with the loop's own torch work.
"""
from __future__ import annotations

from pathlib import Path

import torch

from specrt.errors import BackendError
from specrt.engines.kv_cache import KVCache
from specrt.engines.manifest import logits_width

TORCH_TYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT64": torch.int64,
               "INT32": torch.int32, "BOOL": torch.bool}
FEEDS = ("input_ids", "position_ids", "past_len", "tree_mask")


def _kv_name(kind: str, i: int) -> str:
    """Tensor i of the 2L cache tensors (keys of layer l at 2l, values at 2l+1): `k_cache_0`, `v_new_3`..."""
    return f"{'kv'[i % 2]}_{kind}_{i // 2}"


class TensorRTEngine:
    """One deserialised TensorRT engine of the engine contract and one execution context over it."""

    name = "tensorrt"

    def __init__(self, path: Path, spec: dict, device: str = "cuda", threads: int | None = None):
        from specrt.plugins.tensorrt_plugin import load_tensorrt, register
        trt = load_tensorrt()
        self.device = torch.device(device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise BackendError(f"TensorRT engines run on an NVIDIA GPU, not on {device!r}: pass --device cuda on a "
                               "machine with one, or rebuild with `specrt build DIR --backend onnxruntime`")
        register()  # the plugin must be in TensorRT's registry before the engine that uses it is deserialised
        self.trt, self.spec, self.layers = trt, spec, spec["layers"]
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(Path(path).read_bytes())
        if self.engine is None:
            raise BackendError(f"TensorRT could not deserialise {path} (built by another TensorRT version or for "
                               "another GPU?): rebuild it here with `specrt build DIR --backend tensorrt`")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.dtypes = {n: TORCH_TYPES.get(self.engine.get_tensor_dtype(n).name) for n in names}
        self._check_io(names)
        host = self.dtypes["num_logits"]
        self._num_logits = torch.zeros(1, dtype=host).pin_memory()   # host memory: a shape tensor's value
        self._buffers: dict[str, torch.Tensor] = {}
        self._cache: KVCache | None = None
        self._outputs = None
        self._outputs_for: tuple[int, int, int] | None = None        # (B, S, num_logits) the context is set for

    def _check_io(self, names: list[str]) -> None:
        trt = self.trt
        inputs = {n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        expected = {*FEEDS, "num_logits", *(_kv_name("cache", i) for i in range(2 * self.layers))}
        if not expected <= inputs:
            raise BackendError(f"the TensorRT engine lacks the engine contract's inputs {sorted(expected - inputs)}: "
                               "re-export and rebuild the engine set")
        if self.engine.get_tensor_location("num_logits") != trt.TensorLocation.HOST:
            raise BackendError("num_logits is not a shape tensor in this TensorRT engine: rebuild it with "
                               "`specrt build DIR --backend tensorrt`")
        unknown = sorted(n for n, t in self.dtypes.items() if t is None)
        if unknown:
            raise BackendError(f"TensorRT engine tensors {unknown} have types specrt does not bind "
                               f"({', '.join(TORCH_TYPES)} only): rebuild the engine from the exported graph")
        odd = {n: self.dtypes[n] for n in expected if n.startswith(("k_cache", "v_cache"))
               and self.dtypes[n] != torch.float32}
        if odd:
            raise BackendError(f"cache inputs {odd} of the TensorRT engine must be float32 (the KV cache's type): "
                               "rebuild it from the exported graph")

    # ---- caches -----------------------------------------------------------------------------------------
    def new_cache(self, batch: int, length: int | None = None) -> KVCache:
        """A cache of `length` slots per row (default and at most the engine's max_seq_len)."""
        s = self.spec
        length = min(length or s["max_seq_len"], s["max_seq_len"])
        cache = KVCache(s["layers"], batch, s["kv_heads"], length, s["head_dim"], self.device)
        self.use_cache(cache)
        return cache

    def use_cache(self, cache: KVCache) -> None:
        """Bind a cache's buffers as the cache inputs; they stay bound until another cache is used."""
        for i, buf in enumerate(cache.layer_buffers()):                  # each (B, Hkv, Smax, D)
            self._set(_kv_name("cache", i), buf)
        self._cache, self._outputs_for = cache, None

    # ---- one pass ---------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past_len: torch.Tensor,
                tree_mask: torch.Tensor, num_logits: int, cache: KVCache | None = None, **extra: torch.Tensor):
        """Run one pass over S new tokens per row against `cache` (default: the last one created or used).
        The cache is read, not written: see KVCache.write. `extra`: further graph inputs by name (an EAGLE
        drafter's `features`). Returns views of the static output buffers."""
        if cache is not None and cache is not self._cache:
            self.use_cache(cache)
        assert self._cache is not None, "call new_cache() first"
        B, S = input_ids.shape
        if not 1 <= num_logits <= S:
            raise BackendError(f"num_logits {num_logits}: a pass over S = {S} tokens returns the logits of 1..{S}")
        unknown = sorted(set(extra) - set(self.dtypes))
        if unknown:
            raise BackendError(f"inputs {unknown} are not inputs of this TensorRT engine (it has "
                               f"{', '.join(sorted(self.dtypes))})")
        feeds = {**dict(zip(FEEDS, (input_ids, position_ids, past_len, tree_mask))), **extra}
        for name, t in feeds.items():
            self._static(name, t.shape).copy_(t, non_blocking=True)
        self._num_logits[0] = num_logits
        if self._outputs_for != (B, S, num_logits):
            self._bind(B, S, num_logits, {name: t.shape for name, t in feeds.items()})
        if not self.context.execute_async_v3(torch.cuda.current_stream(self.device).cuda_stream):
            raise BackendError("TensorRT failed to run the pass (see its log above)")
        return self._outputs

    def _static(self, name: str, shape: torch.Size) -> torch.Tensor:
        """A view of `name`'s static buffer in `shape`; the buffer only grows (then its address is rebound)."""
        numel = shape.numel()
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[name] = torch.empty(numel, dtype=self.dtypes[name], device=self.device)
            self._outputs_for = None
        return buf.narrow(0, 0, numel).view(shape)

    def _set(self, name: str, t: torch.Tensor) -> None:
        if t.dtype != self.dtypes[name]:
            raise BackendError(f"{name}: a {t.dtype} buffer for a {self.dtypes[name]} TensorRT tensor")
        if self.engine.get_tensor_mode(name) == self.trt.TensorIOMode.INPUT:
            self.context.set_input_shape(name, tuple(t.shape))
        self.context.set_tensor_address(name, t.data_ptr())

    def _bind(self, B: int, S: int, num_logits: int, feeds: dict[str, torch.Size]) -> None:
        """Shapes and addresses for this (B, S, num_logits); they stay set while it repeats."""
        from specrt.engines.base import StepOutput
        s = self.spec
        for name, shape in feeds.items():
            self._set(name, self._static(name, shape))
        self.context.set_tensor_address("num_logits", self._num_logits.data_ptr())
        logits = self._static("logits", torch.Size((B, num_logits, logits_width(s))))
        hidden = self._static("hidden", torch.Size((B, S, s["hidden_size"])))
        new_kv = self._static("new_kv", torch.Size((2 * self.layers, B, s["kv_heads"], S, s["head_dim"])))
        outputs = {"logits": logits, "hidden": hidden,
                   **{_kv_name("new", i): new_kv[i] for i in range(2 * self.layers)}}
        aux = self._static("aux", torch.Size((B, S, s["aux"]["size"]))) if "aux" in s else None   # EAGLE-3's
        if aux is not None:
            outputs["aux"] = aux
        for name, t in outputs.items():
            got = tuple(self.context.get_tensor_shape(name))
            if got != tuple(t.shape):
                raise BackendError(f"TensorRT plans {name} as {got}, the engine contract says {tuple(t.shape)}: "
                                   "re-export and rebuild the engine set")
            self._set(name, t)
        self._outputs, self._outputs_for = StepOutput(logits, hidden, new_kv, aux=aux), (B, S, num_logits)

    # ---- helpers shared with OrtEngine's interface ------------------------------------------------------
    def run_sequence(self, ids: list[int], num_logits: int = 1):
        """One pass over a whole token sequence in a fresh one-row cache (scoring, calibration, checks)."""
        from specrt.engines.base import chain_mask
        cache = self.new_cache(1, len(ids) + 1)
        S = len(ids)
        ids_t = torch.tensor([ids], device=self.device)
        pos = torch.arange(S, device=self.device)[None]
        out = self.forward(ids_t, pos, cache.past_len, chain_mask(1, S, self.device), num_logits, cache)
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def time_pass(self, context: int, k: int, reps: int = 3, batch: int = 1, **extra: torch.Tensor) -> float:
        """Best-of-`reps` seconds of one pass over k tokens per row, `batch` rows, after `context` cached positions
        (synchronised); `extra`: further inputs (an EAGLE drafter's features)."""
        from specrt.engines.base import chain_mask, measure
        cache = self.new_cache(batch, context + k)
        cache.truncate(max(context, 0))
        ids = torch.zeros(batch, k, dtype=torch.int64, device=self.device)
        pos = (cache.past_len[:, None] + torch.arange(k, device=self.device)).contiguous()
        mask = chain_mask(batch, k, self.device)
        stream = torch.cuda.current_stream(self.device)

        def one_pass():
            self.forward(ids, pos, cache.past_len, mask, k, cache, **extra)
            stream.synchronize()
        return measure(one_pass, reps)
