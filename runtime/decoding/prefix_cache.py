"""The prefix cache: what a prompt's prefill left in its row, kept for the next prompt that starts the same way.

A prompt's positions are cut into blocks of `block` tokens (BLOCK = 32: a hit recomputes at most 31 tokens of the
cached prompt, which ride in the pass over the new prompt's own tokens at little cost, while 16 would double the
entries, hashes and copies per prefix and 64 would leave twice as much to recompute). A block is keyed by the hash
chain of the token ids up to its end (vLLM's automatic prefix caching): key_i = BLAKE2b(key_{i-1} ‖ tokens of block
i), so two prompts share the key of block i exactly when they share their first (i+1)·block tokens. The chain starts
from the request's *partition* (its tenant: the server's API key and the request's cache_salt; None for the shared
one): key_{-1} = BLAKE2b("partition" ‖ partition), or empty for None, so a request only ever finds the blocks that
requests of its own partition stored, and its hit counts only them (the cache is no side channel between tenants).
A block holds
*parts*, each its own entry: "target" (the target's keys and values, (2L, Hkv, block, D)) and what a method's
drafter keeps per row: "draft" (the draft model's keys and values), "hidden" or "aux" (the target's states that an
EAGLE or EAGLE-3 drafter reads). A request finds the longest run of whole blocks from the start of its prompt that
has every part it cannot do without (the target's; EAGLE's states, which only the target's pass gives), but never
its last token (whose logits give the first new token); its row takes copies of them and the rest of its prompt is
prefilled as before (Batch._restore; the drafters' `restore` say what each does).

The entries are bounded in bytes. They are kept in order of use, least recently used first, and a block is always
used more recently than any block after it in a chain (a chain's blocks are touched from its end to its start), so
the least recently used entry is always a leaf: eviction takes leaves first and never leaves a block that cannot
be reached. A prompt's blocks never evict the prompt's own prefix: where the bound cannot hold them all, its
leading blocks stay. The bound holds under any traffic.
"""
from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from specrt.errors import InputError

BLOCK = 32   # tokens per block (see the module doc)


@dataclass
class _Entry:
    data: torch.Tensor          # the part over the block's positions
    parent: tuple | None        # the entry of the block before it (same part), None for a prompt's first
    children: int = 0           # entries whose parent this is

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass
class Hit:
    """A request's cached prefix: `tokens` positions (whole blocks), the chain's keys over them."""
    tokens: int
    keys: list[bytes]


class PrefixCache:
    """Blocks of prompt state shared by every request of one Generator (see the module doc). `max_bytes` bounds
    the blocks' tensors; `stats()` counts the lookups and what they found."""

    def __init__(self, max_bytes: int, block: int = BLOCK):
        if max_bytes < 0 or block < 1:
            raise InputError(f"prefix cache of {max_bytes} bytes in blocks of {block} tokens: need a size of at "
                             "least 0 bytes (0: no cache) and blocks of at least 1 token")
        self.max_bytes, self.block = int(max_bytes), int(block)
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()   # (part, key) -> entry
        self.bytes = 0
        self.queries = self.hits = self.query_tokens = self.hit_tokens = self.evictions = 0

    @classmethod
    def of_mb(cls, mb: float, block: int = BLOCK) -> "PrefixCache | None":
        """A cache of `mb` MiB, None for 0 (no cache)."""
        if mb < 0:
            raise InputError(f"prefix cache of {mb} MB: give a size in MB, or 0 for none")
        return cls(int(mb * 2**20), block) if mb else None

    def keys(self, ids: list[int], blocks: int, partition: str | None = None) -> list[bytes]:
        """The chain's keys of the first `blocks` whole blocks of `ids`, in `partition`'s chain (see the module doc)."""
        tokens = np.asarray(ids[:blocks * self.block], dtype=np.int64)
        keys, key = [], b"" if partition is None else \
            hashlib.blake2b(b"partition\0" + partition.encode(), digest_size=32).digest()
        for i in range(blocks):
            key = hashlib.blake2b(key + tokens[i * self.block:(i + 1) * self.block].tobytes(), digest_size=32).digest()
            keys.append(key)
        return keys

    # ---- lookup ---------------------------------------------------------------------------------------------
    def match(self, ids: list[int], parts: tuple[str, ...], partition: str | None = None) -> Hit:
        """The longest run of whole blocks from the start of `ids`, but its last token, whose every part in `parts`
        is cached by requests of `partition`; its entries become the most recently used. Counted in stats()."""
        keys = self.keys(ids, (len(ids) - 1) // self.block, partition)
        n = 0
        while n < len(keys) and all((p, keys[n]) in self._entries for p in parts):
            n += 1
        for p in parts:
            self._touch([(p, k) for k in keys[:n]])
        self.queries, self.query_tokens = self.queries + 1, self.query_tokens + len(ids)
        self.hits += n > 0
        self.hit_tokens += n * self.block
        return Hit(n * self.block, keys[:n])

    def read(self, hit: Hit, part: str, axis: int = 0) -> torch.Tensor:
        """The hit's positions of `part` (one the match required), its blocks concatenated along `axis`."""
        return torch.cat([self._entries[(part, k)].data for k in hit.keys], axis)

    def copy(self, hit: Hit, part: str, into: torch.Tensor, axis: int) -> int:
        """The hit's leading positions that `part` has cached (all of them for a part the match required) copied
        into `into`, a row's tensor whose axis `axis` runs over positions; they become the most recently used.
        Returns how many positions were copied."""
        chain = []
        for k in hit.keys:
            entry = self._entries.get((part, k))
            if entry is None:
                break
            into.narrow(axis, len(chain) * self.block, self.block).copy_(entry.data)
            chain.append((part, k))
        self._touch(chain)
        return len(chain) * self.block

    # ---- storing --------------------------------------------------------------------------------------------
    def store(self, ids: list[int], parts: dict[str, tuple[torch.Tensor, int, int]],
              partition: str | None = None) -> None:
        """A prompt's whole blocks after its prefill, for each part: (its row's tensor, the axis over positions,
        how many of the prompt's positions it holds), found later only by requests of `partition`. Blocks already
        cached are only touched."""
        if not self.max_bytes:
            return
        valid = max((n for _, _, n in parts.values()), default=0)
        keys = self.keys(ids, min(valid, len(ids)) // self.block, partition)
        for part, (row, axis, count) in parts.items():
            chain = [(part, k) for k in keys[:count // self.block]]
            have = 0
            while have < len(chain) and chain[have] in self._entries:
                have += 1
            self._touch(chain[:have])
            for i in range(have, len(chain)):
                data = row.narrow(axis, i * self.block, self.block)
                if not self._make_room(data.numel() * data.element_size(), set(chain[:i])):
                    chain = chain[:i]
                    break
                parent = chain[i - 1] if i else None
                self._entries[chain[i]] = entry = _Entry(data.clone(), parent)
                self.bytes += entry.nbytes
                if parent is not None:
                    self._entries[parent].children += 1
            self._touch(chain)

    def _touch(self, chain: list[tuple]) -> None:
        """The chain's entries become the most recently used, its first the most recent of all."""
        for key in reversed(chain):
            self._entries.move_to_end(key)

    def _make_room(self, nbytes: int, keep: set) -> bool:
        """Evict least recently used leaves (none in `keep`) until `nbytes` more fit; False if they cannot."""
        if nbytes > self.max_bytes:
            return False
        while self.bytes + nbytes > self.max_bytes:
            victim = next((k for k, e in self._entries.items() if not e.children), None)   # the first, see the doc
            if victim is None or victim in keep:
                return False
            entry = self._entries.pop(victim)
            self.bytes -= entry.nbytes
            self.evictions += 1
            if entry.parent is not None:
                self._entries[entry.parent].children -= 1
        return True

    # ---- figures --------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Lookups since the cache was made and what it holds: `queries` (requests looked up), `hits` (those that
        found at least one block), `query_tokens` and `hit_tokens` (their prompt tokens, and those served from the
        cache: vLLM's prefix_cache_queries and prefix_cache_hits), `bytes` held of `max_bytes`, `blocks` (entries
        of every part), `evictions`."""
        return {"queries": self.queries, "hits": self.hits, "query_tokens": self.query_tokens,
                "hit_tokens": self.hit_tokens, "bytes": self.bytes, "max_bytes": self.max_bytes,
                "blocks": len(self._entries), "block_tokens": self.block, "evictions": self.evictions}

    def clear(self) -> None:
        """Drop every block (the counters stay)."""
        self._entries.clear()
        self.bytes = 0
