"""Engines built with `specrt build --device cuda`: a static-shape graph per width for the target (verify passes),
the draft model (draft steps) and the EAGLE drafter (catch-ups and tree levels, its `features` included), each
run over buffers bound once, so that ONNX Runtime's CUDA provider captures one CUDA graph per width.

A pass of S tokens on one row runs the smallest width W >= S: the S inputs are copied into the width's static
input buffers, the W - S pad nodes (token 0, position 0, a mask row that sees only itself) are computed and
ignored, and the outputs are views [:S] of the width's static output buffers (so `KVCache.write` writes S
entries). Real nodes never see pad nodes, so their outputs are the same as in a pass of S. The one-row cache is
the engine's own, at max_seq_len, so that its address never changes under the captured graphs: `new_cache(1)`
returns it reset. Other shapes (prefill, several rows) run the dynamic graph of the same engine set.
On the CPU provider the same code runs without capture (how the tests check the padding for real).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specrt.engines.base import OrtEngine, StepOutput, bind_tensor, providers, session_options
from specrt.engines.kv_cache import KVCache
from specrt.engines.manifest import check_file, logits_width


@dataclass
class WidthBuffers:
    """The static inputs and outputs of one width's session, bound once."""
    ids: torch.Tensor        # (1, W) int64
    pos: torch.Tensor        # (1, W) int64
    past_len: torch.Tensor   # (1,) int64
    mask: torch.Tensor       # (1, W, W) bool
    eye: torch.Tensor        # (1, W, W) bool: every pad row sees only itself
    out: StepOutput          # logits (1, W, V) float32, hidden (1, W, d) float32, new_kv (2L, 1, Hkv, W, D)
    extra: dict              # further inputs by name (an EAGLE drafter's features (1, W, d) float32)


class StaticWidthEngine:
    """Same interface as OrtEngine: new_cache, use_cache, forward, run_sequence, time_pass, spec, device, name."""

    name = "onnxruntime"

    def __init__(self, path: Path, spec: dict, device: str = "cpu", threads: int | None = None):
        self.dynamic = OrtEngine(path, spec, device, threads)
        self.spec, self.device, self.dtype = spec, self.dynamic.device, self.dynamic.dtype
        ort = self.dynamic.ort
        capture = {"enable_cuda_graph": "1"} if self.device.type == "cuda" else {}
        options = session_options(ort, spec, threads)
        self.sessions, self.buffers = {}, {}
        for w, entry in sorted(spec["engine"]["widths"].items(), key=lambda kv: int(kv[0])):
            graph = check_file(Path(path).parent, entry, f"width-{w} graph")
            self.sessions[int(w)] = ort.InferenceSession(str(graph), options,
                                                         providers=providers(self.device, spec, **capture))
            self.buffers[int(w)] = self._buffers(int(w))
        self.bindings = {w: s.io_binding() for w, s in self.sessions.items()}
        self.max_width = max(self.sessions)
        self.cache = KVCache(spec["layers"], 1, spec["kv_heads"], spec["max_seq_len"], spec["head_dim"],
                             self.device, self.dtype)
        for w in self.sessions:
            self._bind_all(w)

    def _buffers(self, W: int) -> WidthBuffers:
        s, dev = self.spec, self.device
        eye = torch.eye(W, dtype=torch.bool, device=dev)[None]
        out = StepOutput(torch.zeros(1, W, logits_width(s), device=dev),
                         torch.zeros(1, W, s["hidden_size"], device=dev),
                         torch.zeros(2 * s["layers"], 1, s["kv_heads"], W, s["head_dim"], device=dev, dtype=self.dtype))
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        extra = {"features": torch.zeros(1, W, s["hidden_size"], device=dev)} if self._reads("features") else {}
        return WidthBuffers(zeros(1, W), zeros(1, W), zeros(1), eye.clone(), eye, out, extra)

    def _reads(self, name: str) -> bool:
        return any(i.name == name for i in self.dynamic.session.get_inputs())

    def _bind_all(self, W: int) -> None:
        """Every input and output of width W's session, once: the addresses a captured graph replays."""
        b, buf, L = self.bindings[W], self.buffers[W], self.spec["layers"]
        names = {i.name for i in self.sessions[W].get_inputs()}
        feeds = {"input_ids": buf.ids, "position_ids": buf.pos, "past_len": buf.past_len, "tree_mask": buf.mask,
                 **buf.extra}
        feeds.update({f"{'kv'[i % 2]}_cache_{i // 2}": t for i, t in enumerate(self.cache.layer_buffers())})
        for name, t in feeds.items():
            if name in names:   # an input the graph does not read is pruned from it
                bind_tensor(b, "input", name, t, self.device)
        outs = {"logits": buf.out.logits, "hidden": buf.out.hidden}
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
        """As OrtEngine.forward. One row of at most max_width tokens over the static cache: a width graph."""
        B, S = input_ids.shape
        cache = self.cache if cache is None else cache
        W = min((w for w in self.sessions if w >= S), default=None)
        if B != 1 or W is None or cache is not self.cache or extra.keys() != self.buffers[W].extra.keys():
            return self.dynamic.forward(input_ids, position_ids, past_len, tree_mask, num_logits, cache, **extra)
        buf = self.buffers[W]
        for name, t in extra.items():
            buf.extra[name].zero_()
            buf.extra[name][:, :S].copy_(t)
        buf.ids.zero_()
        buf.ids[:, :S].copy_(input_ids)
        buf.pos.zero_()
        buf.pos[:, :S].copy_(position_ids)
        buf.past_len.copy_(past_len)
        buf.mask.copy_(buf.eye)
        buf.mask[:, :S, :S].copy_(tree_mask)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()   # the copies land before ONNX Runtime's stream reads
        self.sessions[W].run_with_iobinding(self.bindings[W])
        o = buf.out
        return StepOutput(o.logits[:, S - num_logits:S], o.hidden[:, :S], o.new_kv[:, :, :, :S])

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
