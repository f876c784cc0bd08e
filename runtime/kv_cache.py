"""Static KV cache: one preallocated buffer for all layers, written by position, truncated by moving `past_len`."""
from __future__ import annotations

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

    def layer_buffers(self) -> list[torch.Tensor]:
        return list(self.data.unbind(0))  # each (B, Hkv, Smax, D), contiguous views

    def write(self, new_kv: torch.Tensor, start: torch.Tensor | None = None) -> None:
        """Write the S new entries (2L, B, Hkv, S, D) of each row at `start[b]` (default `past_len`)."""
        start = self.past_len if start is None else start
        S = new_kv.shape[3]
        if new_kv.shape[1] == 1 and start.device.type == "cpu":   # one row on the host: a plain slice is cheapest
            p = int(start[0])
            self.data[:, 0, :, p:p + S] = new_kv[:, 0]
            return
        slots = (start[:, None] + torch.arange(S, device=start.device)).clamp_(max=self.length - 1)  # (B, S)
        rows = torch.arange(new_kv.shape[1], device=start.device)[:, None]                                 # (B, 1)
        by_row = self.data.permute(1, 3, 0, 2, 4)                         # (B, Smax, 2L, Hkv, D), a view
        by_row[rows, slots] = new_kv.permute(1, 3, 0, 2, 4)               # (B, S, 2L, Hkv, D)

    def compact(self, offsets: torch.Tensor) -> None:
        """Move each row's entries at `past_len[b] + offsets[b]` (B, n) to consecutive slots from `past_len[b]`
        (accepted tree paths), all rows at once on the cache's device."""
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

    def row(self, r: int) -> "KVCache":
        """Row r alone, sharing this cache's buffers (a request's prefill); the cache itself when it has one row."""
        return self if self.batch == 1 else self._view(slice(r, r + 1))

    def _view(self, rows: slice) -> "KVCache":
        view = KVCache.__new__(KVCache)
        view.data, view.past_len, view.length = self.data[:, rows], self.past_len[rows], self.length
        return view

    def copy_row(self, src: int, dst: int, count: int) -> None:
        """Row dst takes row src's first `count` slots and its past_len (a batch compacting its rows, or a
        prompt prefilled once for several sequences)."""
        count = min(count, self.length)
        self.data[:, dst, :, :count] = self.data[:, src, :, :count]
        self.past_len[dst] = self.past_len[src]

    def truncate(self, length: int | torch.Tensor) -> None:
        """O(1) rollback: only the index moves."""
        self.past_len[:] = length
