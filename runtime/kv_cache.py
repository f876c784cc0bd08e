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

    def broadcast_row(self, src: "KVCache") -> None:
        """Fill every row from row 0 of a one-row cache (a prompt prefilled once for B sequences)."""
        n = int(src.past_len[0])
        self.data[:, :, :, :n] = src.data[:, :1, :, :n]
        self.past_len[:] = n

    def truncate(self, length: int | torch.Tensor) -> None:
        """O(1) rollback: only the index moves."""
        self.past_len[:] = length
