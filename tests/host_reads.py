"""Operations that read a tensor's values back to the host: on a GPU each one waits for the device (a stream
synchronisation). Counted on any device, the CPU included, through torch's dispatcher: an `int()`, `float()` or
`.item()` of a tensor, `nonzero`, and indexing by a boolean mask (its result's size is the mask's count)."""
from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READS = {"_local_scalar_dense", "nonzero", "masked_select"}


class HostReads(TorchDispatchMode):
    """Inside it, `reads` lists the reading operations that ran."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masks = name.startswith("index") and len(args) > 1 and isinstance(args[1], (list, tuple)) and \
            any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1])
        if name in READS or masks:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def counted(name: str, fn, reads: list, calls: list):
    """`fn` run inside HostReads: its reads go to `reads` and each call to `calls`, under `name`."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        calls.append(name)
        with HostReads() as mode:
            out = fn(*args, **kwargs)
        reads.extend(f"{name}: {r}" for r in mode.reads)
        return out
    return run
