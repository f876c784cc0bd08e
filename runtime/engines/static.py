"""Engines built with `specrt build --device cuda`: a static-shape graph per width for the target (verify passes),
the draft model (draft steps) and the EAGLE drafter (catch-ups and tree levels, its `features` included), each
run over buffers bound once, so that ONNX Runtime's CUDA provider captures one CUDA graph per width.

A pass of S tokens on one row runs the smallest width W >= S: the S inputs are copied into the width's static
input buffers, the W - S pad nodes (whatever valid tokens and positions the buffers hold, a mask row that sees
only itself) are computed and ignored, and the outputs are views [:S] of the width's static output buffers (so
`KVCache.write` writes S entries). Real nodes never see pad nodes, so their outputs are the same as in a pass of
S. The one-row cache is the engine's own, at max_seq_len, so that its address never changes under the captured
graphs: `new_cache(1)` returns it reset, and its `past_len` is bound as every width's input. Other shapes
(prefill, several rows) run the dynamic graph of the same engine set. A width whose graph ONNX Runtime refused,
or whose pass failed (a capture that failed), is dropped with the reason logged and kept in `fallbacks`: its
passes run the next width or the dynamic graph.

One copy of the weights for all the sessions (the dynamic graph's and each width's): the graphs of a model keep
their weights in one external file, and each stored tensor becomes one OrtValue on the device that every session
is given in place of its own (`SessionOptions.add_initializer`; ONNX Runtime uses a supplied initializer as it is
when it lives on the device the session plans it for; on a GPU the values are made through DLPack, which needs
onnxruntime-gpu >= 1.26, and an older one is refused). One session per width rather than one session with a
graph id per width (`gpu_graph_id`): a captured graph needs every node on the GPU, and a graph with S dynamic
keeps shape arithmetic that ONNX Runtime places on the CPU.

On a GPU the widths' sessions run on a stream of the engine's (`user_compute_stream`) that waits for torch's
current stream, and the input copies run on it too: no host wait before a pass; ONNX Runtime synchronises the
stream when the pass ends (the one host wait per pass). On the CPU provider the same code runs without capture
(how the tests check the padding and the shared weights for real).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specrt.engines.base import OrtEngine, StepOutput, bind_tensor, check_providers, providers, session_options
from specrt.engines.kv_cache import KVCache
from specrt.engines.manifest import check_file, logits_width
from specrt.errors import BackendError

log = logging.getLogger(__name__)


@dataclass
class WidthBuffers:
    """The static inputs and outputs of one width's session, bound once."""
    ids: torch.Tensor        # (1, W) int64
    pos: torch.Tensor        # (1, W) int64
    mask: torch.Tensor       # (1, W, W) bool
    eye: torch.Tensor        # (1, W, W) bool: every pad row sees only itself
    out: StepOutput          # logits (1, W, V) float32, hidden (1, W, d) float32, new_kv (2L, 1, Hkv, W, D),
                             # a target's aux (1, W, n*d) float32 (EAGLE-3)
    extra: dict              # further inputs by name (an EAGLE drafter's features (1, W, d), EAGLE-3's aux
                             # (1, W, n*d), float32)
    rows: int = 0            # the mask rows the last pass wrote (past them the mask is the identity)


DLPACK_ORT = "1.26"   # the first onnxruntime whose public OrtValue has from_dlpack (earlier: only its private C class)
# TensorProto types -> numpy (bfloat16 as bits; uint8: a GatherBlockQuantized embedding's int8 blocks)
NUMPY_TYPES = {1: np.float32, 10: np.float16, 16: np.uint16, 7: np.int64, 6: np.int32, 9: np.bool_, 2: np.uint8,
               3: np.int8}


class SharedWeights:
    """One OrtValue per tensor of a model's external weights, on the engine's device, given to every session of
    the engine in place of the session's own copy. ONNX Runtime takes only values over memory it does not own: on
    the CPU a numpy array of the file's bytes, on a GPU a torch tensor (through DLPack: `OrtValue.from_dlpack`,
    onnxruntime >= 1.26; an older one is refused rather than left to load a copy per session)."""

    def __init__(self, directory: Path, device: torch.device):
        self.directory, self.device = Path(directory), device
        self.values: dict[tuple, object] = {}   # (file, offset, type, dims) -> its OrtValue
        self.memory: list = []                  # what the values point into (kept alive with them)
        if device.type == "cuda":
            check_dlpack()

    def add_to(self, options, graph: Path) -> None:
        """Give the session options of `graph` the shared value of each of its externally stored initializers."""
        import onnx
        for t in onnx.load(str(graph), load_external_data=False).graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                options.add_initializer(t.name, self._value(t))

    def _value(self, t):
        from onnxruntime import OrtValue
        where = {e.key: e.value for e in t.external_data}
        key = (where["location"], int(where.get("offset", 0)), t.data_type, tuple(t.dims))
        if key not in self.values:
            data = np.fromfile(self.directory / key[0], NUMPY_TYPES[t.data_type], int(np.prod(t.dims, dtype=np.int64)),
                               offset=key[1]).reshape(t.dims)
            if self.device.type == "cpu":
                memory, value = data, OrtValue.ortvalue_from_numpy_with_onnx_type(data, t.data_type)
            else:
                memory = torch.from_numpy(data).to(self.device)
                memory = memory.view(torch.bfloat16) if t.data_type == 16 else memory
                value = OrtValue.from_dlpack(memory)
            self.memory.append(memory)
            self.values[key] = value
        return self.values[key]


def check_dlpack() -> None:
    """Refuse an onnxruntime that cannot make an OrtValue over a torch tensor on the GPU (its sessions would each
    load their own copy of the weights: eight for a target with seven widths)."""
    import onnxruntime as ort
    if not hasattr(ort.OrtValue, "from_dlpack"):
        raise BackendError(f"onnxruntime {ort.__version__} has no OrtValue.from_dlpack (public from {DLPACK_ORT} on), "
                           "which CUDA engines need to give all their sessions one copy of the weights: upgrade it "
                           f'(pip install -U "onnxruntime-gpu>={DLPACK_ORT}"), or use --device cpu')


class StaticWidthEngine:
    """Same interface as OrtEngine: new_cache, use_cache, forward, run_sequence, time_pass, spec, device, name."""

    name = "onnxruntime"

    def __init__(self, path: Path, spec: dict, device: str = "cpu", threads: int | None = None):
        directory = Path(path).parent
        self.weights = SharedWeights(directory, torch.device(device))
        self.dynamic = OrtEngine(path, spec, device, threads, weights=self.weights)
        self.spec, self.device, self.dtype = spec, self.dynamic.device, self.dynamic.dtype
        self.label = Path(path).name
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        capture = {"enable_cuda_graph": "1", "user_compute_stream": str(self.stream.cuda_stream)} if cuda else {}
        self.sessions, self.buffers, self.fallbacks = {}, {}, {}
        for w, entry in sorted(spec["engine"]["widths"].items(), key=lambda kv: int(kv[0])):
            graph = check_file(directory, entry, f"width-{w} graph")
            options = session_options(self.dynamic.ort, spec, threads)
            self.weights.add_to(options, graph)
            try:
                session = self.dynamic.ort.InferenceSession(str(graph), options,
                                                            providers=providers(self.device, spec, **capture))
            except Exception as e:  # e.g. not every node on the CUDA provider: no capture for this width
                self._fall_back(int(w), f"ONNX Runtime refused {graph.name} ({type(e).__name__}: {e})")
                continue
            check_providers(session, self.device)
            self.sessions[int(w)] = session
            self.buffers[int(w)] = self._buffers(int(w))
        self.bindings = {w: s.io_binding() for w, s in self.sessions.items()}
        self.max_width = max(self.sessions, default=0)
        self.cache = KVCache(spec["layers"], 1, spec["kv_heads"], spec["max_seq_len"], spec["head_dim"],
                             self.device, self.dtype)
        for w in self.sessions:
            self._bind_all(w)

    def _fall_back(self, W: int, reason: str) -> None:
        """Width W's passes run the dynamic graph from now on (slower, same outputs); the reason is logged."""
        self.fallbacks[W] = reason
        for table in (self.sessions, self.buffers, getattr(self, "bindings", {})):
            table.pop(W, None)
        self.max_width = max(self.sessions, default=0)
        log.warning("width-%d passes of %s run the dynamic graph: %s", W, self.label, reason)

    def _buffers(self, W: int) -> WidthBuffers:
        s, dev = self.spec, self.device
        eye = torch.eye(W, dtype=torch.bool, device=dev)[None]
        out = StepOutput(torch.zeros(1, W, logits_width(s), device=dev),
                         torch.zeros(1, W, s["hidden_size"], device=dev),
                         torch.zeros(2 * s["layers"], 1, s["kv_heads"], W, s["head_dim"], device=dev, dtype=self.dtype),
                         aux=torch.zeros(1, W, s["aux"]["size"], device=dev) if "aux" in s else None)
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        widths = {"features": s["hidden_size"], "aux": s.get("aux_size")}   # an EAGLE(-3) drafter's inputs
        extra = {name: torch.zeros(1, W, n, device=dev) for name, n in widths.items() if self._reads(name)}
        return WidthBuffers(zeros(1, W), zeros(1, W), eye.clone(), eye, out, extra)

    def _reads(self, name: str) -> bool:
        return any(i.name == name for i in self.dynamic.session.get_inputs())

    def _bind_all(self, W: int) -> None:
        """Every input and output of width W's session, once: the addresses a captured graph replays."""
        b, buf, L = self.bindings[W], self.buffers[W], self.spec["layers"]
        names = {i.name for i in self.sessions[W].get_inputs()}
        feeds = {"input_ids": buf.ids, "position_ids": buf.pos, "past_len": self.cache.past_len,
                 "tree_mask": buf.mask, **buf.extra}
        feeds.update({f"{'kv'[i % 2]}_cache_{i // 2}": t for i, t in enumerate(self.cache.layer_buffers())})
        for name, t in feeds.items():
            if name in names:   # an input the graph does not read is pruned from it
                bind_tensor(b, "input", name, t, self.device)
        outs = {"logits": buf.out.logits, "hidden": buf.out.hidden,
                **({"aux": buf.out.aux} if buf.out.aux is not None else {})}
        outs.update({f"{'kv'[i % 2]}_new_{i // 2}": buf.out.new_kv[i] for i in range(2 * L)})
        for name, t in outs.items():
            bind_tensor(b, "output", name, t, self.device)

    def new_cache(self, batch: int, length: int | None = None) -> KVCache:
        """One row: the engine's static cache (max_seq_len slots), emptied. Several rows: a dynamic-graph cache."""
        if batch != 1:
            return self.dynamic.new_cache(batch, length)
        self.cache.truncate(0)
        return self.cache

    def use_cache(self, cache: KVCache) -> None:
        if cache is not self.cache:
            self.dynamic.use_cache(cache)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past_len: torch.Tensor,
                tree_mask: torch.Tensor, num_logits: int, cache: KVCache | None = None,
                **extra: torch.Tensor) -> StepOutput:
        """As OrtEngine.forward. One row of at most max_width tokens over the static cache and its own past_len:
        a width graph."""
        B, S = input_ids.shape
        cache = self.cache if cache is None else cache
        W = next((w for w in self.sessions if w >= S), None)   # the widths in increasing order
        if B != 1 or W is None or cache is not self.cache or past_len is not cache.past_len \
                or extra.keys() != self.buffers[W].extra.keys():
            return self.dynamic.forward(input_ids, position_ids, past_len, tree_mask, num_logits, cache, **extra)
        buf = self.buffers[W]
        with self._on_stream():
            self._fill(buf, S, input_ids, position_ids, tree_mask, extra)
        try:
            self.sessions[W].run_with_iobinding(self.bindings[W])   # returns once its stream is done
        except Exception as e:  # a graph ONNX Runtime could not capture or run: the dynamic graph from now on
            self._fall_back(W, f"its pass failed ({type(e).__name__}: {e})")
            return self.forward(input_ids, position_ids, past_len, tree_mask, num_logits, cache, **extra)
        o = buf.out
        return StepOutput(o.logits[:, S - num_logits:S], o.hidden[:, :S], o.new_kv[:, :, :, :S],
                          aux=None if o.aux is None else o.aux[:, :S])

    def _on_stream(self):
        """On a GPU: the engine's stream, after the work queued on torch's (an event, no host wait)."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    @staticmethod
    def _fill(buf: WidthBuffers, S: int, input_ids, position_ids, tree_mask, extra: dict) -> None:
        """The pass's S inputs into the width's buffers. Pad nodes keep the valid tokens, positions and features the
        buffers hold (their outputs are never read, no real node sees them); the mask goes back to the identity
        only where a wider pass left rows."""
        buf.ids[:, :S].copy_(input_ids)
        buf.pos[:, :S].copy_(position_ids)
        for name, t in extra.items():
            buf.extra[name][:, :S].copy_(t)
        if buf.rows > S:
            buf.mask.copy_(buf.eye)
        buf.mask[:, :S, :S].copy_(tree_mask)
        buf.rows = S

    def run_sequence(self, ids: list[int], num_logits: int = 1) -> StepOutput:
        return OrtEngine.run_sequence(self, ids, num_logits)

    def time_pass(self, context: int, k: int, reps: int = 3, batch: int = 1, **extra: torch.Tensor) -> float:
        """As OrtEngine.time_pass, on the static cache; a run that holds it keeps its past_len."""
        if batch > 1:
            return self.dynamic.time_pass(context, k, reps, batch, **extra)
        kept = self.cache.past_len.clone()
        try:
            return OrtEngine.time_pass(self, context, k, reps, **extra)
        finally:
            self.cache.past_len.copy_(kept)
