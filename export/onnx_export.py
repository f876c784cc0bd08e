"""Trace a model to the ONNX graph of the engine contract and write the engine directory atomically."""
from __future__ import annotations

import contextlib
import hashlib
import shutil
import signal
import tempfile
import threading
import warnings
from pathlib import Path

import onnx
import torch

from specrt.export.model import SpecModel
from specrt.plugins.tree_attention import attach_function


def cache_names(num_layers: int) -> tuple[list[str], list[str]]:
    inputs = [f"{kind}_cache_{i}" for i in range(num_layers) for kind in ("k", "v")]
    outputs = [f"{kind}_new_{i}" for i in range(num_layers) for kind in ("k", "v")]
    return inputs, outputs


def weights_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def export_graph(model: SpecModel, path: Path) -> None:
    """torch.onnx (TorchScript tracer: it keeps `TreeAttention` as one custom node), then attach its function."""
    a = model.args
    B, S = 1, 3
    caches = [torch.zeros(B, a.num_kv_heads, a.max_seq_len, a.head_dim) for _ in range(2 * a.num_layers)]
    args = (torch.zeros(B, S, dtype=torch.int64), torch.arange(S)[None].expand(B, S).contiguous(),
            torch.zeros(B, dtype=torch.int64),
            torch.ones(S, S, dtype=torch.bool).tril()[None].expand(B, S, S).contiguous(),
            torch.tensor([S], dtype=torch.int64), *caches)
    cache_in, cache_out = cache_names(a.num_layers)
    inputs = ["input_ids", "position_ids", "past_len", "tree_mask", "num_logits", *cache_in]
    outputs = ["logits", "hidden", *cache_out]
    dyn = {"input_ids": {0: "B", 1: "S"}, "position_ids": {0: "B", 1: "S"}, "past_len": {0: "B"},
           "tree_mask": {0: "B", 1: "S", 2: "S"}, "logits": {0: "B", 1: "num_logits"}, "hidden": {0: "B", 1: "S"}}
    dyn.update({n: {0: "B", 2: "cache_len"} for n in cache_in})  # the runtime sizes caches per request
    dyn.update({n: {0: "B", 2: "S"} for n in cache_out})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), dynamo=False, opset_version=17, input_names=inputs,
                          output_names=outputs, dynamic_axes=dyn, do_constant_folding=True,
                          custom_opsets={"specrt": 1})
    graph = onnx.load(str(path))
    onnx.save(attach_function(graph), str(path))


def model_entry(model: SpecModel, source: str, graph_file: str, directory: Path, eos: list[int]) -> dict:
    from specrt.engines.manifest import file_entry
    a = model.args
    return {
        "source": source, "architecture": a.architecture, "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size, "layers": a.num_layers, "heads": a.num_heads,
        "kv_heads": a.num_kv_heads, "head_dim": a.head_dim, "max_seq_len": a.max_seq_len,
        "dtype": "float32", "weights_sha256": weights_sha256(model), "eos_token_ids": eos,
        "graph": file_entry(directory, graph_file),
    }


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM wait until the block ends (main thread, POSIX; elsewhere a no-op)."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    can = hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs) if can else None
    try:
        yield
    finally:
        if can:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class StagingDir:
    """Write an engine directory beside its final place and move it there only when complete.
    An interrupted or failed export leaves nothing at `out` (and removes its staging directory)."""

    def __init__(self, out: Path, force: bool):
        self.out, self.force = Path(out), force

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.out.parent.glob(f".{self.out.name}.partial-*"):  # left by a killed export
            shutil.rmtree(stale, ignore_errors=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            with signals_deferred():  # a second Ctrl-C must not cut the clean-up short
                shutil.rmtree(self.tmp, ignore_errors=True)
            return False
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            self.out.rename(old)
            self.tmp.rename(self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            self.tmp.rename(self.out)
        return False
