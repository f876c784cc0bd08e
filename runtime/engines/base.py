"""Engine backends. Every buffer is a torch tensor on the engine's device, bound to the session by pointer."""
from __future__ import annotations

import ctypes
import functools
import math
import os
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specrt.errors import BackendError, DeviceError, InputError, ManifestError
from specrt.engines.kv_cache import KVCache
from specrt.engines.manifest import SKIP_INPUT, WRITTEN, logits_width


ONNX_TYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16, torch.int64: 7, torch.bool: 9}  # TensorProto
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StepOutput:
    logits: torch.Tensor   # (B, num_logits, V)
    hidden: torch.Tensor   # (B, S, d)
    new_kv: torch.Tensor   # (2L, B, Hkv, S, D)
    host: tuple | None = None   # on the CPU: numpy views (logits, new_kv, hidden, aux) of the same buffers, made once
    aux: torch.Tensor | None = None   # (B, S, n*d) a target graph's `aux` output (EAGLE-3), None where it has none

    def host_logits(self):
        """The logits as a numpy array (CPU outputs only): the loop's host rules read them without a torch call,
        which right after a pass costs tens of µs of cold code."""
        return self.host[0] if self.host is not None else self.logits.numpy()

    def host_kv(self):
        """new_kv as a numpy array (CPU outputs only), see host_logits."""
        return self.host[1] if self.host is not None else self.new_kv.numpy()

    def host_hidden(self):
        """hidden as a numpy array (CPU outputs only), see host_logits."""
        return self.host[2] if self.host is not None else self.hidden.numpy()

    def host_aux(self):
        """aux as a numpy array (CPU outputs only), see host_logits."""
        return self.host[3] if self.host is not None else self.aux.numpy()


def engine_dtype(spec: dict) -> torch.dtype:
    """The dtype of an engine's caches and new keys/values (logits and hidden are float32 in every engine)."""
    return DTYPES[spec.get("engine", {}).get("dtype", "float32")]


def session_options(ort, spec: dict, threads: int | None):
    """Engines built for CUDA carry only provider-independent optimisations: the session adds the rest (the
    fusions for its provider) when it loads. CPU engines were optimised when built. No memory patterns on the CPU:
    the fused attention's width follows past_len's values, not the input shapes, so a prefill's passes (one
    shape, a growing context) each planned a block that went unused (EAGLE over a 5,743-token prompt in 128-token
    chunks: 1,568 MB resident at the end of the prefill with them, 1,476 without); decode steps measured the same
    with them or without."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or default_threads()
    built_for_cuda = spec.get("engine", {}).get("device") == "cuda"
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED if built_for_cuda \
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.enable_mem_pattern = built_for_cuda
    return options


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). A CPU session frees
    each MatMul weight once its kernel has repacked it, but glibc keeps freed blocks of that size resident (the
    SmolLM2 target: 765 MB resident after loading, 561 MB after a trim)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):   # not glibc
        return
    trim(0)


def providers(device: torch.device, spec: dict, **cuda_options: str) -> list:
    """CUDA: TF32 off for float32 engines (the provider's default uses it), so that they agree with the CPU."""
    if device.type != "cuda":
        return ["CPUExecutionProvider"]
    if engine_dtype(spec) == torch.float32:
        cuda_options["use_tf32"] = "0"
    return [("CUDAExecutionProvider", {"device_id": str(device.index or 0), **cuda_options})]


CUDA_REQUIREMENTS = "https://onnxruntime.ai/docs/execution-providers/CUDA-ExecutionProvider.html#requirements"


def check_providers(session, device: torch.device) -> None:
    """ONNX Runtime falls back to the CPU when its CUDA provider cannot load (cuDNN or cuBLAS missing, another CUDA
    major version than onnxruntime-gpu's, the CPU wheel installed): it only warns. A session meant for a GPU
    that did not get it is refused here, before CUDA pointers are bound to a CPU session."""
    if device.type == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise BackendError(cuda_fallback(session.get_providers()))


def cuda_fallback(got: list[str]) -> str:
    import onnxruntime as ort
    return (f"ONNX Runtime {ort.__version__} did not start its CUDA provider and fell back to {', '.join(got)} "
            "(its warning above names the cause: usually a CUDA or cuDNN library it could not load, or of another "
            "major version than the one onnxruntime-gpu was built for, or the CPU wheel 'onnxruntime' installed "
            f"instead of 'onnxruntime-gpu'): install the CUDA and cuDNN versions listed at {CUDA_REQUIREMENTS}, "
            "or use --device cpu")


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


MAX_SHAPES = 64   # pass shapes an engine keeps bound


@dataclass
class _Shape:
    """One pass shape's IOBinding: outputs bound once to views of the engine's buffers, inputs as last bound."""
    io: object
    outputs: StepOutput
    inputs: dict = field(default_factory=dict)   # name -> (tensor, (address, shape, device)) bound now
    cache: weakref.ref | None = None             # the cache whose buffers are bound (weakly: a binding does
                                                 # not keep a finished request's cache alive)


class OrtEngine:
    """One ONNX Runtime session over a graph of the engine contract, with IOBinding to preallocated buffers."""

    name = "onnxruntime"

    def __init__(self, path: Path, spec: dict, device: str = "cpu", threads: int | None = None, weights=None):
        """`weights`: a SharedWeights (see specrt.engines.static) whose values stand for the graph's stored
        weights, shared with other sessions."""
        try:
            import onnxruntime as ort
        except ImportError as e:
            raise BackendError("onnxruntime is not installed: pip install 'specrt[cpu]' "
                               "(or 'specrt[gpu]' on an NVIDIA machine)") from e
        self.ort, self.spec, self.device = ort, spec, torch.device(device)
        self.dtype = engine_dtype(spec)
        options = session_options(ort, spec, threads)
        self.weights = weights   # the values the session reads: alive as long as it is
        if weights is not None:
            weights.add_to(options, Path(path))
        self.session = ort.InferenceSession(str(path), options, providers=providers(self.device, spec))
        check_providers(self.session, self.device)
        trim_heap()
        self._start(spec)
        # MatMulNBits with int8 activations rounds a lone row (one token, one row) differently from a row of a
        # larger pass on some CPUs (the M = 1 kernel; every M >= 2 agrees): there such passes run as two tokens,
        # the second a copy whose entry lands in a spare slot, so that a plain step equals a verify pass's row
        if spec.get("engine", {}).get("activations") == "int8" and self.device.type == "cpu":
            self.pad_single = not self._lone_rows_agree()

    def _start(self, spec: dict) -> None:
        """What a session's passes need besides the session."""
        self.layers = spec["layers"]
        inputs = {i.name: i.shape for i in self.session.get_inputs()}
        # a target engine with a self drafter (specrt.export.self_spec.skip_graph): the target runs every layer
        # (an engine built before the input had an entry per layer takes one bool)
        self._fixed = {SKIP_INPUT: torch.zeros(tuple(inputs[SKIP_INPUT]), dtype=torch.bool, device=self.device)} \
            if SKIP_INPUT in inputs else {}
        self._buffers: dict[str | tuple, torch.Tensor] = {}   # by name
        self.skipped: set[int] = set()   # layers a LayerSkipEngine skips
        self._cache: KVCache | None = None
        self._shapes: dict[tuple[int, int, int], _Shape] = {}   # (B, S, num_logits) -> its binding
        self._num: dict[int, torch.Tensor] = {}  # num_logits -> its one-element input
        # a fused CPU graph outputs each cache with the pass's new entries scattered in: bound to the cache's own
        # buffer, ONNX Runtime writes them in place (see specrt.export.fuse)
        self.writes_cache = f"k_cache_0{WRITTEN}" in {o.name for o in self.session.get_outputs()}
        self.pad_single = False
        self._single: dict[int, tuple] = {}   # num_logits -> the padded pass's inputs and output views

    def new_cache(self, batch: int, length: int | None = None) -> KVCache:
        """A cache of `length` slots per row (default and at most the engine's max_seq_len), and a spare one where
        one-token passes run as two (`pad_single`)."""
        s = self.spec
        length = min(length or s["max_seq_len"], s["max_seq_len"]) + self.pad_single   # the spare slot
        cache = KVCache(s["layers"], batch, s["kv_heads"], length, s["head_dim"], self.device, self.dtype)
        self.use_cache(cache)
        return cache

    def use_cache(self, cache: KVCache) -> None:
        """Make `cache` the one passes read by default (each shape's binding binds its buffers at its next pass)."""
        self._cache = cache

    def _buffer(self, name: str, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A flat output buffer that only grows (no allocation in steady state)."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[name] = torch.empty(numel, device=self.device, dtype=dtype)
        return buf

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past_len: torch.Tensor,
                tree_mask: torch.Tensor, num_logits: int, cache: KVCache | None = None,
                **extra: torch.Tensor) -> StepOutput:
        """Run one pass over S new tokens per row against `cache` (default: the last one created or used).
        The cache is read, not written: see KVCache.write. `extra`: further graph inputs by name (an EAGLE
        drafter's `features`)."""
        cache = self._cache = cache if cache is not None else self._cache
        assert cache is not None, "call new_cache() first"
        B, S = input_ids.shape
        if self.pad_single and B * S == 1 and not extra:
            return self._padded(input_ids, position_ids, past_len, num_logits, cache)
        shape = self._shapes.get((B, S, num_logits)) or self._bind_shape(B, S, num_logits)
        if shape.cache is None or shape.cache() is not cache:   # the cache's buffers, once per shape and cache
            buffers = cache.layer_buffers()
            names = [(f"{kv}_cache_{layer}", layer) for layer in range(self.layers) for kv in "kv"]
            for (name, layer), buf in zip(names, buffers):
                bind_tensor(shape.io, "input", name, buf, self.device)
                if self.writes_cache and layer in self.skipped:   # an empty tensor (self_spec.skip_graph)
                    shape.io.bind_output(name + WRITTEN, self.device.type, self.device.index or 0)
                elif self.writes_cache:
                    bind_tensor(shape.io, "output", name + WRITTEN, buf, self.device)
            shape.cache = weakref.ref(cache)
        num = self._num.get(num_logits)
        if num is None:
            num = self._num[num_logits] = torch.tensor([num_logits], dtype=torch.int64, device=self.device)
        feeds = {"input_ids": input_ids, "position_ids": position_ids, "past_len": past_len,
                 "tree_mask": tree_mask, "num_logits": num, **self._fixed, **extra}
        for name, t in feeds.items():
            bound = shape.inputs.get(name)
            if bound is not None and bound[0] is t:   # the loop's persistent inputs: the same tensor as bound
                continue
            t = t.contiguous()
            key = (t.data_ptr(), t.shape, t.device)
            if bound is None or bound[1] != key:
                bind_tensor(shape.io, "input", name, t, self.device)
            shape.inputs[name] = (t, key)   # keeps the bound tensor alive while it is bound
        sync_torch(self.device)
        self.session.run_with_iobinding(shape.io)
        return shape.outputs

    def _lone_rows_agree(self) -> bool:
        """Whether a one-token pass gives the logits that the same token gets as the first row of a two-token
        pass, bit for bit (four passes over a few tokens, at load)."""
        outputs = []
        for ids in ([3], [3, 5]):
            cache = self.new_cache(1, 6)
            out = self.forward(torch.tensor([[1, 2]]), torch.arange(2)[None], cache.past_len, chain_mask(1, 2, "cpu"),
                               1, cache)
            cache.write(out.new_kv)
            cache.past_len += 2
            S = len(ids)
            out = self.forward(torch.tensor([ids]), (2 + torch.arange(S))[None], cache.past_len,
                               chain_mask(1, S, "cpu"), S, cache)
            outputs.append(out.logits[0, 0].clone())
        self._cache, self._shapes = None, {}
        return torch.equal(*outputs)

    def _padded(self, input_ids, position_ids, past_len, num_logits, cache) -> StepOutput:
        """A one-token, one-row pass as two tokens: the token again at the same position, seeing only itself, its
        entry written after the real one (the cache's spare slot at the end). Returns the real token's outputs."""
        got = self._single.get(num_logits)
        if got is None:
            ids, pos = torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.int64)
            got = self._single[num_logits] = (ids, pos, torch.eye(2, dtype=torch.bool)[None])
        ids, pos, mask = got
        ids[0, :] = input_ids[0, 0]
        pos[0, :] = position_ids[0, 0]
        out = self.forward(ids, pos, past_len, mask, 2, cache)
        aux = None if out.aux is None else out.aux[:, :1]
        host = None if out.host is None else (out.host[0][:, :num_logits], out.host[1][..., :1, :],
                                              out.host[2][:, :1], None if aux is None else out.host[3][:, :1])
        return StepOutput(out.logits[:, :num_logits], out.hidden[:, :1], out.new_kv[..., :1, :], host, aux)

    def _bind_shape(self, B: int, S: int, num_logits: int) -> "_Shape":
        """A binding of its own for a pass shape, its outputs bound to views of the output buffers: passes of
        the shapes seen before rebind nothing (rebinding the 2L cache outputs costs ~1 ms, and trees, adaptive
        chains and the drafters' catch-ups change shape from round to round). All shapes share the buffers; the
        bindings are dropped when a buffer grows, and the oldest when there are MAX_SHAPES."""
        s = self.spec
        sizes = {"logits": B * num_logits * logits_width(s), "hidden": B * S * s["hidden_size"],
                 "new_kv": 2 * self.layers * B * s["kv_heads"] * S * s["head_dim"]}
        if "aux" in s:   # a target that outputs the states an EAGLE-3 drafter reads
            sizes["aux"] = B * S * s["aux"]["size"]
        if any(name not in self._buffers or self._buffers[name].numel() < n for name, n in sizes.items()):
            self._shapes.clear()   # their views would keep the old buffers alive
        if len(self._shapes) >= MAX_SHAPES:
            del self._shapes[next(iter(self._shapes))]
        logits = self._buffer("logits", sizes["logits"]).narrow(0, 0, sizes["logits"]).view(B, num_logits, -1)
        hidden = self._buffer("hidden", sizes["hidden"]).narrow(0, 0, sizes["hidden"]).view(B, S, -1)
        new_kv = self._buffer("new_kv", sizes["new_kv"], self.dtype).narrow(0, 0, sizes["new_kv"])
        new_kv = new_kv.view(2 * self.layers, B, s["kv_heads"], S, s["head_dim"])
        io = self.session.io_binding()
        bind_tensor(io, "output", "logits", logits, self.device)
        bind_tensor(io, "output", "hidden", hidden, self.device)
        for i in range(2 * self.layers):
            bind_tensor(io, "output", f"{'kv'[i % 2]}_new_{i // 2}", new_kv[i], self.device)
        aux = None
        if "aux" in sizes:
            aux = self._buffer("aux", sizes["aux"]).narrow(0, 0, sizes["aux"]).view(B, S, -1)
            bind_tensor(io, "output", "aux", aux, self.device)
        host = (logits.numpy(), new_kv.numpy(), hidden.numpy(), None if aux is None else aux.numpy()) \
            if self.device.type == "cpu" and self.dtype != torch.bfloat16 else None
        shape = self._shapes[(B, S, num_logits)] = _Shape(io, StepOutput(logits, hidden, new_kv, host, aux))
        return shape

    def run_sequence(self, ids: list[int], num_logits: int = 1) -> StepOutput:
        """One pass over a whole token sequence in a fresh one-row cache (scoring, calibration, checks)."""
        cache = self.new_cache(1, len(ids) + 1)
        S, dev = len(ids), self.device
        return self.forward(torch.tensor([ids], device=dev), torch.arange(S, device=dev)[None], cache.past_len,
                            chain_mask(1, S, dev), num_logits, cache)

    def time_pass(self, context: int, k: int, reps: int = 3, batch: int = 1, **extra: torch.Tensor) -> float:
        """Best-of-`reps` seconds of one pass over k tokens per row, `batch` rows, after `context` cached
        positions; `extra`: further inputs (an EAGLE drafter's features)."""
        cache = self.new_cache(batch, context + k)
        cache.truncate(max(context, 0))
        dev = self.device
        ids = torch.zeros(batch, k, dtype=torch.int64, device=dev)
        pos = (cache.past_len[:, None] + torch.arange(k, device=dev)).contiguous()
        mask = chain_mask(batch, k, dev)
        return measure(lambda: self.forward(ids, pos, cache.past_len, mask, k, cache, **extra), reps)


class LayerSkipEngine(OrtEngine):
    """The self drafter (specrt.export.self_spec) on the target engine's own session: the same weights, in memory
    once, the session's `skip_layers` input true for the layers it skips. Its passes read and write a cache of all
    the target's layers (SelfDrafter gives it the target's own: the skipped layers' entries pass through untouched);
    its bindings are its own. `kept`: the layers it runs (default the manifest's, `specrt tune`'s where tuned)."""

    def __init__(self, target: OrtEngine, spec: dict, kept: list[int] | None = None):
        if SKIP_INPUT not in target._fixed or target._fixed[SKIP_INPUT].dim() != 1:
            raise ManifestError("the target engine has no per-layer skip_layers input (built by an older specrt): "
                                "run `specrt build` on the engine set again")
        self.ort, self.device, self.dtype = target.ort, target.device, target.dtype
        self.session, self.weights = target.session, target.weights
        self.spec = {**spec, "layers": target.spec["layers"]}   # its caches are the target's shape
        self._start(self.spec)
        self.pad_single = target.pad_single   # the same kernels as the target's passes
        self.use_layers(kept or spec["kept_layers"])

    def use_layers(self, kept: list[int]) -> None:
        """Run the layers `kept` (sorted; the last layer among them), skip the others, from the next pass on."""
        L = self.layers
        if not kept or kept != sorted(set(kept)) or kept[-1] != L - 1 or kept[0] < 0 or len(kept) == L:
            raise InputError(f"self layers {kept}: keep some of the layers 0-{L - 1}, sorted, the last among them, "
                             "not all")
        mask = self._fixed[SKIP_INPUT]
        mask.fill_(True)
        mask[kept] = False   # in place: the bindings read the same tensor
        self.kept, self.skipped = list(kept), set(range(L)) - set(kept)
        self._shapes.clear()   # bound again at their next pass: the skipped layers' written caches are not bound


class OrtHeads:
    """The Medusa heads graph (see specrt.export.medusa). Plain or root-token heads: `hidden` (B, d), and `token`
    (B,) -> `medusa_logits` (B, K, V). Sequential heads: `hidden` (M, d), `tokens` (M, K), `head` (M,) ->
    `logits` (M, V), one row per candidate path. Inputs and outputs are device tensors bound by pointer."""

    def __init__(self, path: Path, spec: dict, device: str = "cpu", threads: int | None = None):
        import onnxruntime as ort
        self.spec, self.device, self.num_heads = spec, torch.device(device), spec["num_heads"]
        options = session_options(ort, spec, threads)
        self.session = ort.InferenceSession(str(path), options, providers=providers(self.device, spec))
        check_providers(self.session, self.device)
        trim_heap()
        self.binding = self.session.io_binding()
        self.root_token = bool(spec.get("root_token"))
        self.sequential = bool(spec.get("sequential"))
        self.vocab_size = spec.get("vocab_size") or self.session.get_outputs()[0].shape[-1]
        self._out = torch.empty(0, device=self.device)
        self._views: dict[tuple, torch.Tensor] = {}   # shape -> the output buffer's view, made once
        self._bound: dict[str, torch.Tensor] = {}      # name -> the tensor bound now

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """Every head at once -> (B, K, V). `tokens` (B, K): the token that follows `hidden`'s position (the root),
        then the path below it that sequential heads read (each head i the first i + 1; the others use at most
        the root). copy=False: the output buffer itself, valid (and the caller's to overwrite) until the next run."""
        if self.sequential:
            B, K = tokens.shape[0], self.num_heads
            heads = torch.arange(K, device=tokens.device).repeat(B)
            rows = self.logits(hidden.repeat_interleave(K, 0), tokens.repeat_interleave(K, 0), heads)
            return rows.view(B, K, -1)
        feeds = {"hidden": hidden}
        if self.root_token:
            feeds["token"] = tokens[:, 0]
        return self._run(feeds, "medusa_logits", (hidden.shape[0], self.num_heads, self.vocab_size), copy)

    def logits(self, hidden: torch.Tensor, tokens: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """Sequential heads: row m runs head[m] on hidden[m] and its path tokens[m] (M, K) -> (M, V)."""
        return self._run({"hidden": hidden, "tokens": tokens, "head": head}, "logits",
                         (hidden.shape[0], self.vocab_size))

    def _run(self, feeds: dict, output: str, shape: tuple, copy: bool = True) -> torch.Tensor:
        out = self._views.get(shape)
        if out is None:
            numel = math.prod(shape)
            if self._out.numel() < numel:
                self._out, self._views = torch.empty(numel, device=self.device), {}
            out = self._views[shape] = self._out[:numel].view(shape)
        for kind, name, t in [("input", name, t) for name, t in feeds.items()] + [("output", output, out)]:
            if self._bound.get(name) is not t:   # persistent inputs (the CPU loop's) and the view stay bound
                t = self._bound[name] = t.contiguous()   # kept alive while bound
                bind_tensor(self.binding, kind, name, t, self.device)
        sync_torch(self.device)
        self.session.run_with_iobinding(self.binding)
        return out.clone() if copy else out   # the buffer is reused by the next run


def sync_torch(device: torch.device) -> None:
    """On a GPU: wait for the work queued on torch's stream (the loop's input copies and small kernels) before a
    session runs on ONNX Runtime's own stream (which it synchronises before returning). Nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def bind_tensor(binding, kind: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    """Bind `t` by pointer. A tensor on another device than the engine's is refused: its address means
    nothing to the session (a host pointer bound as a CUDA one reads garbage or faults)."""
    if t.device.type != device.type or (device.type == "cuda" and t.device.index not in (None, device.index or 0)):
        raise BackendError(f"{kind} {name!r} is on {t.device}, the engine runs on {device}: create it on the "
                           f"engine's device (engine.device)")
    if t.dtype not in ONNX_TYPES:
        raise BackendError(f"{kind} {name!r} has dtype {t.dtype}; engines take {', '.join(map(str, ONNX_TYPES))}")
    bind = binding.bind_input if kind == "input" else binding.bind_output
    bind(name, device.type, device.index or 0, ONNX_TYPES[t.dtype], list(t.shape), t.data_ptr())


def pick_device(requested: str = "auto") -> str:
    """"auto": cuda where torch and ONNX Runtime can both use a GPU, else cpu. "cuda" or "cuda:N" where they cannot
    use that GPU is an error that says what is missing and the fix."""
    if requested == "auto":
        return "cuda" if cuda_missing() is None else "cpu"
    if requested.split(":")[0] == "cuda":
        missing = cuda_missing(cuda_index(requested))
        if missing:
            raise BackendError(f"--device {requested}: {missing}")
        return requested
    if requested != "cpu":
        raise BackendError(f"--device {requested!r}: expected auto, cpu or cuda")
    return requested


def built_for(manifest: dict) -> str:
    """The device an engine set was built for: "cuda" (`specrt build --device cuda`, or TensorRT engines), else
    "cpu"."""
    entries = [spec.get("engine", {}) for spec in manifest["models"].values()]
    return "cuda" if any(e.get("device") == "cuda" or e.get("backend") == "tensorrt" for e in entries) else "cpu"


def _cuda_only(manifest: dict) -> str | None:
    """Which of an engine set's engines cannot run on the CPU provider, or None."""
    entries = [spec.get("engine", {}) for spec in manifest["models"].values()]
    if any(e.get("backend") == "tensorrt" for e in entries):
        return "TensorRT engines"
    if any(e.get("dtype") == "bfloat16" for e in entries):
        return "bfloat16 engines (ONNX Runtime has no bfloat16 CPU kernels)"
    return None


def engine_set_device(manifest: dict, directory, requested: str = "auto") -> str:
    """The device to run an engine set on. "auto": the one it was built for, which must be here. An explicit
    device must suit the set: CPU engines do not run on CUDA; CUDA-built ONNX Runtime engines run on the CPU
    provider (float32 and float16: how their graphs are checked without a GPU), except bfloat16 ones and TensorRT
    engines."""
    built = built_for(manifest)
    if requested == "auto":
        missing = cuda_missing() if built == "cuda" else None
        if missing:
            raise DeviceError(f"{directory} was built for CUDA, and {missing.removesuffix(INSTALL_GPU)}: run it on a machine with an NVIDIA "
                              "GPU and the GPU extra (pip install 'specrt[gpu]'), or build it for the CPU "
                              f"(`specrt build {directory}`)")
        return built
    kind = requested.split(":")[0]
    if kind == "cuda" and built == "cpu":
        raise DeviceError(f"--device {requested}: {directory} was built for the CPU: build it for CUDA (`specrt "
                          f"build {directory} --device cuda`), or use --device cpu (or auto)")
    cuda_only = _cuda_only(manifest) if kind == "cpu" else None
    if cuda_only:
        raise DeviceError(f"--device cpu: {directory} holds {cuda_only}, which run on CUDA only: use --device cuda "
                          f"(or auto) on a GPU machine, or build the set for the CPU (`specrt build {directory}`)")
    return pick_device(requested)


INSTALL_GPU = ": install the GPU extra (pip install 'specrt[gpu]') on a machine with an NVIDIA GPU, or use --device cpu"


def cuda_index(device: str) -> int:
    """The GPU a device string names: 0 for "cuda", N for "cuda:N"."""
    index = device.partition(":")[2]
    if index and not index.isdigit():
        raise BackendError(f"--device {device!r}: expected cuda or cuda:N (N the index of a GPU)")
    return int(index or 0)


@functools.cache
def cuda_missing(index: int = 0) -> str | None:
    """What keeps engines off GPU `index` here and its fix, or None. ONNX Runtime's CUDA provider is started once
    per GPU in a one-node session: being listed among the available providers does not mean that it loads."""
    if not torch.cuda.is_available():
        return "torch has no CUDA here (a CPU-only build, or no NVIDIA GPU/driver)" + INSTALL_GPU
    if index >= torch.cuda.device_count():
        return (f"torch sees {torch.cuda.device_count()} GPU(s) here, so there is no cuda:{index}: use an index below "
                "that (CUDA_VISIBLE_DEVICES renumbers them from 0)")
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed" + INSTALL_GPU
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return ("onnxruntime has no CUDAExecutionProvider (the CPU wheel 'onnxruntime' is installed, not "
                "'onnxruntime-gpu')" + INSTALL_GPU)
    return cuda_provider_problem(ort, index)


def cuda_provider_problem(ort, device_id: int = 0) -> str | None:
    """Start the CUDA provider in a one-node session: None when it runs there, else the cause and fix."""
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)   # any onnxruntime reads it
    try:
        session = ort.InferenceSession(model.SerializeToString(),
                                       providers=[("CUDAExecutionProvider", {"device_id": str(device_id)})])
    except Exception as e:  # with CUDA_PATH set, ONNX Runtime raises instead of falling back
        return (f"ONNX Runtime's CUDA provider failed to start ({type(e).__name__}: {e}): install the CUDA and "
                f"cuDNN versions listed at {CUDA_REQUIREMENTS}, or use --device cpu")
    if "CUDAExecutionProvider" not in session.get_providers():
        return cuda_fallback(session.get_providers())
    return None


def chain_mask(batch: int, size: int, device="cpu") -> torch.Tensor:
    """Lower-triangular (B, S, S) mask; the small ones of the decode loop are built once per shape (read only:
    they are bound as engine inputs)."""
    build = _cached_chain_mask if batch * size * size <= 1 << 16 else _chain_mask
    return build(batch, size, device)


def _chain_mask(batch: int, size: int, device) -> torch.Tensor:
    return torch.from_numpy(np.broadcast_to(np.tri(size, dtype=bool), (batch, size, size)).copy()).to(device)


_cached_chain_mask = functools.lru_cache(maxsize=256)(_chain_mask)


def measure(fn, reps: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
