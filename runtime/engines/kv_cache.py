"""Static KV cache: one preallocated buffer for all layers, written by position, truncated by moving `past_len`.

On the CPU the cache's small bookkeeping goes through numpy views of the same memory: right after a target pass
(which streams all the weights through the caches) the first use of each distinct torch operation costs 40–120 µs
of cold code, numpy's basic slicing a few."""
from __future__ import annotations

import numpy as np
import torch


class KVCache:
    """`data` is (2L, B, Hkv, Smax, D) with Smax = `length`: keys of layer i at 2i, values at 2i+1. Row b holds
    `past_len[b]` valid positions; everything at or beyond it is scratch. Nothing here allocates after
    construction."""

    def __init__(self, layers: int, batch: int, kv_heads: int, length: int, head_dim: int, device="cpu",
                 dtype: torch.dtype = torch.float32):
        self.data = torch.zeros(2 * layers, batch, kv_heads, length, head_dim, device=device, dtype=dtype)
        self.past_len = torch.zeros(batch, dtype=torch.int64, device=device)
        self.length = length
        self.index: list[int] | None = None   # the entries of `data` it reads and writes (alias): all
        self._host_views()

    def _host_views(self) -> None:
        """On the CPU: numpy views of the data and of past_len (None elsewhere; data also for bfloat16, which numpy
        lacks)."""
        cpu = self.data.device.type == "cpu"
        self.host_data = self.data.numpy() if cpu and self.data.dtype != torch.bfloat16 else None
        self.host_past = self.past_len.numpy() if cpu else None

    def layer_buffers(self) -> list[torch.Tensor]:
        """Each layer's keys, then its values: (B, Hkv, Smax, D) contiguous views (of the aliased layers only)."""
        return list(self.data.unbind(0)) if self.index is None else [self.data[i] for i in self.index]

    def write(self, new_kv: torch.Tensor | np.ndarray, start: torch.Tensor | list[int] | None = None,
              nodes: list | None = None) -> None:
        """Write the S new entries (2L, B, Hkv, S, D) of each row at `start[b]` (default `past_len`). On the CPU
        `new_kv` may be a numpy view (StepOutput.host_kv), `start` a list, and `nodes` picks per row the entries
        to keep, written to consecutive slots: a count (the first ones) or a list of entries (a verify pass's
        accepted path; the rest would be scratch)."""
        entries = slice(None) if self.index is None else self.index
        if self.host_data is not None:   # the CPU: a slice or a take per row, in plain Python (see the module doc)
            new = new_kv if isinstance(new_kv, np.ndarray) else new_kv.numpy()
            start = self.host_past.tolist() if start is None else start.tolist() if hasattr(start, "tolist") else start
            for b, p in enumerate(start):
                keep = new.shape[3] if nodes is None else nodes[b]
                if isinstance(keep, int):
                    fit = max(0, min(keep, self.length - p))   # entries past the end are scratch: dropped
                    self.host_data[entries, b, :, p:p + fit] = new[:, b, :, :fit]
                else:
                    fit = max(0, min(len(keep), self.length - p))
                    self.host_data[entries, b, :, p:p + fit] = new[:, b].take(keep[:fit], 2)
            return
        assert nodes is None, "nodes: the CPU's host path only"
        S = new_kv.shape[3]
        start = self.past_len if start is None else start
        slots = (start[:, None] + torch.arange(S, device=start.device)).clamp_(max=self.length - 1)  # (B, S)
        rows = torch.arange(new_kv.shape[1], device=start.device)[:, None]                                 # (B, 1)
        by_row = self.data.permute(1, 3, 0, 2, 4)                         # (B, Smax, 2L, Hkv, D), a view
        if self.index is None:
            by_row[rows, slots] = new_kv.permute(1, 3, 0, 2, 4)           # (B, S, 2L, Hkv, D)
        else:   # (B, S, 2K, Hkv, D) into the aliased entries
            index = torch.tensor(self.index, device=start.device)
            by_row[rows[..., None], slots[..., None], index] = new_kv.permute(1, 3, 0, 2, 4)

    def compact(self, offsets) -> None:
        """Move each row's entries at `past_len[b] + offsets[b]` (B, n) to consecutive slots from `past_len[b]`
        (accepted tree paths), all rows at once on the cache's device (on the CPU `offsets` may be host data)."""
        if self.host_data is not None:   # the CPU: offsets on the host, a take per row
            offsets = offsets.numpy() if isinstance(offsets, torch.Tensor) else np.asarray(offsets)
            src = np.minimum(self.host_past[:, None] + offsets, self.length - 1)
            for b, p in enumerate(self.host_past.tolist()):
                fit = max(0, min(offsets.shape[1], self.length - p))
                self.host_data[:, b, :, p:p + fit] = self.host_data[:, b].take(src[b, :fit], 2)   # take copies
            return
        n = offsets.shape[1]
        base = self.past_len[:, None]                                     # (B, 1)
        src = (base + offsets).clamp_(0, self.length - 1)                 # (B, n)
        dst = (base + torch.arange(n, device=base.device)).clamp_(max=self.length - 1)
        rows = torch.arange(offsets.shape[0], device=base.device)[:, None]
        by_row = self.data.permute(1, 3, 0, 2, 4)                         # (B, Smax, 2L, Hkv, D), a view
        by_row[rows, dst] = by_row[rows, src]                             # the right side is a copy

    @property
    def batch(self) -> int:
        return self.data.shape[1]

    def prefix(self, n: int) -> "KVCache":
        """A cache over rows 0..n−1 that shares this one's buffers (the live rows of a batch; the cache itself when
        n is all of them). Made once per n: an engine rebinds a cache only when it gets another object."""
        if n == self.batch:
            return self
        views = self.__dict__.setdefault("_views", {})
        if n not in views:
            views[n] = self._view(slice(0, n))
        return views[n]

    def alias(self, layers: list[int] | None = None) -> "KVCache":
        """A cache over this one's buffers with lengths of its own (a drafter writing past the rows' ends);
        `layers`: over those of its layers only, in that order (a drafter that runs some of the target's layers:
        its passes bind and write those; compact and copy_row still move every layer)."""
        view = self._view(slice(None))
        view.past_len = self.past_len.clone()
        view.index = None if layers is None else [2 * i + kv for i in layers for kv in (0, 1)]
        view._host_views()
        return view

    def row(self, r: int) -> "KVCache":
        """Row r alone, sharing this cache's buffers (a request's prefill); the cache itself when it has one row."""
        return self if self.batch == 1 else self._view(slice(r, r + 1))

    def _view(self, rows: slice) -> "KVCache":
        view = KVCache.__new__(KVCache)
        view.data, view.past_len, view.length = self.data[:, rows], self.past_len[rows], self.length
        view.index = self.index
        view._host_views()
        return view

    def copy_row(self, src: int, dst: int, count: int) -> None:
        """Row dst takes row src's first `count` slots and its past_len (a batch compacting its rows, or a
        prompt prefilled once for several sequences)."""
        count = min(count, self.length)
        self.data[:, dst, :, :count] = self.data[:, src, :, :count]
        self.past_len[dst] = self.past_len[src]

    def truncate(self, length: int | list[int] | np.ndarray | torch.Tensor) -> None:
        """O(1) rollback: only the index moves. `length`: one for all rows, or one per row (a host array or a
        tensor on the cache's device)."""
        if self.host_past is not None and not isinstance(length, torch.Tensor):
            self.host_past[:] = length
        elif isinstance(length, (np.ndarray, list)):
            self.past_len.copy_(torch.as_tensor(length, device="cpu"), non_blocking=True)
        else:
            self.past_len[:] = length
