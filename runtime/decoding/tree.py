"""Candidate trees as data, built once from a list of paths (Medusa "choices").

A path is a tuple of ranks, one per depth: (0,) is the top candidate at depth 1, (0, 2) the third candidate at
depth 2 below it. Node 0 is the root (the last committed token); node i > 0 is paths[i - 1] after sorting.
The token of a node is candidates[depth - 1][rank], so Medusa heads (one top-k list per depth) and a draft
model (top-k at each step of its top-1 chain) fill the same tree.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from specrt.errors import InputError


@dataclass(frozen=True)
class Tree:
    paths: tuple[tuple[int, ...], ...]
    parent: tuple[int, ...]          # parent node of each node (-1 for the root)
    depth: torch.Tensor              # (N+1,) int64, root 0
    rank: torch.Tensor               # (N+1,) int64, candidate rank at its depth (root 0)
    mask: torch.Tensor               # (N+1, N+1) bool, ancestor-or-self
    children: tuple[tuple[int, ...], ...]  # per node, children in rank order
    leaves: torch.Tensor             # (L, max_depth+1) node ids of each root-to-leaf path, -1 padded
    parent_ids: torch.Tensor         # (N+1,) int64, parent node (the root is its own parent)
    child_table: torch.Tensor        # (N+1, max children) children in rank order, -1 padded
    _copies: dict = field(default_factory=dict, compare=False, repr=False)  # device -> the tensors there; masks

    @property
    def size(self) -> int:
        return len(self.parent)      # nodes including the root

    @functools.cached_property
    def max_depth(self) -> int:
        return max(map(len, self.paths))   # from the paths: no tensor read (its tensors may be a device's copies)

    @functools.cached_property
    def max_rank(self) -> int:
        return max(p[-1] for p in self.paths) + 1

    @classmethod
    def from_paths(cls, paths) -> "Tree":
        paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        if not paths or any(len(p) == 0 or min(p) < 0 for p in paths):
            raise InputError(f"tree paths {paths[:4]}…: need non-empty paths of ranks >= 0")
        index = {(): 0}
        parent = [-1]
        for i, p in enumerate(paths, 1):
            if p[:-1] not in index:
                raise InputError(f"tree path {list(p)} has no parent path {list(p[:-1])}: list every prefix")
            index[p] = i
            parent.append(index[p[:-1]])
        n = len(parent)
        depth = np.array([0] + [len(p) for p in paths], np.int64)
        rank = np.array([0] + [p[-1] for p in paths], np.int64)
        mask = np.zeros((n, n), bool)
        for i in range(n):   # a node's row: its parent's (nodes come after their parents) and itself
            if parent[i] >= 0:
                mask[i] = mask[parent[i]]
            mask[i, i] = True
        children = [[] for _ in range(n)]
        for j in range(1, n):
            children[parent[j]].append(j)
        children = tuple(tuple(sorted(ch, key=lambda j: rank[j])) for ch in children)
        leaf_ids = [i for i in range(n) if not children[i]]
        leaves = np.full((len(leaf_ids), int(depth.max()) + 1), -1, np.int64)
        for row, leaf in enumerate(leaf_ids):
            chain = np.flatnonzero(mask[leaf])   # the leaf's ancestors and itself, root first
            leaves[row, :len(chain)] = chain
        parent_ids = np.maximum(np.array(parent, np.int64), 0)
        child_table = np.full((n, max(map(len, children))), -1, np.int64)
        for i, ch in enumerate(children):
            child_table[i, :len(ch)] = ch
        depth, rank, mask, leaves, parent_ids, child_table = map(
            torch.from_numpy, (depth, rank, mask, leaves, parent_ids, child_table))
        return cls(tuple(paths), tuple(parent), depth, rank, mask, children, leaves, parent_ids, child_table)

    def on(self, device) -> "Tree":
        """This tree with its tensors on `device` (made once per device; the loop indexes device tensors with them)."""
        device = torch.device(device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, 0)
        if device == self.depth.device:
            return self
        if device not in self._copies:
            moved = {k: getattr(self, k).to(device) for k in
                     ("depth", "rank", "mask", "leaves", "parent_ids", "child_table")}
            self._copies[device] = replace(self, **moved, _copies={})
        return self._copies[device]

    @functools.cached_property
    def depth_list(self) -> list[int]:
        """depth as a list (the CPU loop's)."""
        return self.depth.tolist()

    def batch_mask(self, batch: int, device) -> torch.Tensor:
        """The mask for `batch` rows (B, N+1, N+1) on `device`, made once per size (an engine keeps it bound)."""
        key = ("mask", batch, str(device))
        if key not in self._copies:
            self._copies[key] = self.on(device).mask.expand(batch, -1, -1).contiguous()
        return self._copies[key]

    @classmethod
    def chain(cls, depth: int) -> "Tree":
        """One node per depth, the top candidate each: verified in the same layout as a chain of drafts."""
        return cls.from_paths((0,) * d for d in range(1, depth + 1))

    @classmethod
    def chain_with_siblings(cls, depth: int, width: int) -> "Tree":
        """The tree a draft model proposes by top-k branching along its top-1 chain."""
        return cls.from_paths((0,) * d + (r,) for d in range(depth) for r in range(width))

    def node_tokens(self, candidates: torch.Tensor) -> torch.Tensor:
        """candidates (B, max_depth, k) -> tokens of nodes 1..N (B, N)."""
        t = self.on(candidates.device)
        return candidates[:, t.depth[1:] - 1, t.rank[1:]]

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"paths": [list(p) for p in self.paths]}) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Tree":
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"tree choices {path}: cannot read ({e}); expected JSON like "
                             '{"paths": [[0], [1], [0, 0]]} or a plain list of paths') from None
        return cls.from_paths(doc["paths"] if isinstance(doc, dict) else doc)


# A sparse default for Medusa-style heads: wide near the root, narrow deeper (27 nodes + root).
DEFAULT_MEDUSA_PATHS = (
    [(r,) for r in range(5)] + [(0, r) for r in range(4)] + [(1, r) for r in range(3)] + [(2, r) for r in range(2)]
    + [(3, 0), (4, 0)] + [(0, 0, r) for r in range(3)] + [(0, 1, r) for r in range(2)] + [(1, 0, 0), (0, 0, 0, 0),
                                                                                        (0, 0, 0, 1), (0, 0, 1, 0)]
    + [(0, 0, 0, 0, 0)]
)
