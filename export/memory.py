"""Whether an export or a build fits this machine's memory, said before the work starts (in seconds, not after
minutes of it). Peak resident memory is estimated from the model's size with factors measured by `make check-large`
(docs/large-models.md): an export holds the weights once, in the export dtype (streamed into the graph's data file
one tensor at a time); a float32 CPU build less than the float32 weights (the projections it fuses); an int4/int8
build one float32 weight at a time and the blocks; a CUDA build a variant's float32 weights with their float16
copies. The factors below cover the peaks measured from 0.54 to 4.4 GB of float32 weights (the table in the docs)."""
from __future__ import annotations

import os
from pathlib import Path

from specrt.errors import MemoryLimitError

GB = 1e9
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
OVERHEAD = 1.0 * GB   # the interpreter, torch, onnx and ONNX Runtime themselves, and the largest tensors in flight
EXPORT_FACTOR = 1.2   # x the weights in the export dtype
BUILD_FACTOR = {"float32": 0.8, "int8": 0.4, "int4": 0.4, "cuda": 3.0}   # x the float32 weights


def available_bytes() -> int:
    """What this process may still take: the kernel's MemAvailable, capped by its cgroup's limit if it has one."""
    room = _meminfo("MemAvailable")
    for limit, usage, stat, cache in (("memory.max", "memory.current", "memory.stat", "file"),
                                      ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                       "memory/memory.stat", "total_cache")):
        cgroup = Path("/sys/fs/cgroup")
        try:
            cap = (cgroup / limit).read_text().strip()
            if cap == "max" or int(cap) >= 1 << 60:
                continue
            used = int((cgroup / usage).read_text()) - _stat(cgroup / stat, cache)   # page cache is reclaimable
            room = min(room, int(cap) - used)
        except (OSError, ValueError):
            continue
    return room


def _meminfo(field: str) -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62   # not Linux: no estimate of what is available, so no refusal


def _stat(path: Path, field: str) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(field + " "):
            return int(line.split()[1])
    return 0


def parameters(source: str) -> int | None:
    """The parameter count of a checkpoint directory (from its config, no weights read; a mixture of experts counts
    every expert, since the export writes them all, not the k a token uses) or of a GGUF file (from its header, which
    is checked: what specrt does not export is refused by name), None for other sources."""
    path = Path(source)
    if source.lower().endswith(".gguf"):
        from specrt.export.gguf_files import check_gguf
        from specrt.export.sources import gguf_path
        return check_gguf(gguf_path(source), repr(source)).parameters
    if not (path / "config.json").is_file():
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from specrt.export.architectures import architecture_of
    config = AutoConfig.from_pretrained(path)
    architecture_of(config, repr(source))   # what the graph does not implement is refused by name before any sizing
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def check(what: str, need: float, weights: str, limit: float | None, advice: str) -> None:
    """Raise MemoryLimitError if `need` bytes are more than `limit` (default: what is available now)."""
    room = available_bytes() if limit is None else limit
    if need > room:
        raise MemoryLimitError(f"{what} ({weights}) needs about {need / GB:.1f} GB of memory; "
                               f"{'this machine has' if limit is None else 'the limit is'} {room / GB:.1f} GB "
                               f"available. {advice}, or pass --no-memory-check to try anyway")


def export_need(params: int, dtype: str) -> float:
    return EXPORT_FACTOR * params * BYTES[dtype] + OVERHEAD


def build_need(float32_bytes: float, kind: str) -> float:
    return BUILD_FACTOR[kind] * float32_bytes + OVERHEAD


def graph_float32_bytes(graph: Path) -> float:
    """The float32 size of a graph's weights, from its data files (a float16/bfloat16 export counts twice)."""
    from specrt.export.onnx_files import data_path, load, stored_weights
    if not graph.is_file():
        return 0.0   # the build says what is missing
    data = data_path(graph)
    size = data.stat().st_size if data.is_file() else graph.stat().st_size
    return size * 4 / BYTES[stored_weights(load(graph, weights=False))]
