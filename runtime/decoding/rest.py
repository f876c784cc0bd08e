"""REST (retrieval-based speculative decoding, He et al. 2023) and suffix decoding: drafts without a drafter.

Each round, per live row: the longest suffix of the row's text (up to `max_n` tokens) is looked up in every source
— the row's own context (as prompt lookup does), a datastore (specrt.decoding.datastore: a corpus and its suffix
array) and the server's suffix cache (the outputs of earlier requests). The sources with the longest match give
the tokens that followed its occurrences (at most `limit` of each), counted into a trie: a node's estimate is the
share of the occurrences whose continuation starts with its path (REST's frequencies; where two sources tie,
the larger share). A row's candidates are its `nodes` most frequent paths, named by rank among their siblings,
so that the rows of a batch share one tree shape (as EAGLE's rows do): a path that only another row has holds a
filler token here, a proposal like any other. The round verifies the most probable nodes (the mean estimate over
the live rows, scaled by how well the estimates have predicted acceptance), as many as pay by the target's
measured pass times, with the loop's lossless tree rules. How well the estimates predict acceptance depends on
how long the match was (a one-token match in a corpus of code says little about a chat answer), so they are
scaled per match length by what the rows' trees of that length accepted so far (drifting back to 1 while no tree
is tried). Rounds without a match, or whose best tree is expected to give fewer tokens per second than a plain
step, are plain steps (Batch's TreePolicy is not used: the calibration per match length is what turns trees off
where they stop paying). The lookups take host time every round (about a millisecond over a large datastore): while
what they save stays below what they cost (a text the sources know nothing of), rounds go without them, up to
MAX_IDLE in a row (RestDrafter._saved). A target that verifies chains only (int8 activations) gets each row's chain
of most frequent tokens.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import numpy as np
import torch

from specrt.decoding.datastore import find_in
from specrt.decoding.drafters import Proposal, RowlessDrafter
from specrt.decoding.eagle import DECAY, _best_size, tree_of
from specrt.decoding.tree import Tree
from specrt.errors import InputError


@dataclass(frozen=True)
class RestShape:
    depth: int = 6     # tokens of a continuation at most (the tree's depth)
    nodes: int = 24    # candidates per row, and nodes a round verifies at most
    max_n: int = 16    # the longest context suffix looked up
    limit: int = 256   # occurrences counted per source

    def __post_init__(self):
        if not (1 <= self.depth <= 16 and self.depth <= self.nodes <= 256 and self.max_n >= 1 and self.limit >= 1):
            raise InputError(f"REST shape depth {self.depth}, nodes {self.nodes}, max_n {self.max_n}, limit "
                             f"{self.limit}: need 1 <= depth <= 16, depth <= nodes <= 256, max_n >= 1, limit >= 1")

    @property
    def envelope(self) -> Tree:
        """A tree of the largest size and depth a round may propose."""
        return Tree.from_paths([(0,) * d for d in range(1, self.depth + 1)] +
                               [(r,) for r in range(1, self.nodes - self.depth + 1)])


class RestDrafter(RowlessDrafter):
    """`sources`: stores with lookup(context, max_n, depth, limit) -> Match (a Datastore, a SuffixCache), beside the
    row's own context. `costs` (live rows -> Costs) sizes each round's tree; None verifies every candidate."""
    name = "rest"
    FILLER = 0
    sizes_itself = True   # each round's tree from the costs and the calibration, plain steps where none pays

    def __init__(self, sources=(), shape: RestShape = RestShape(), costs=None, chains: bool = False):
        self.sources, self.shape, self.costs, self.chains = list(sources), shape, costs, chains
        self.tree, self.span = shape.envelope, shape.nodes + 1
        # per match length (up to LONG): decayed drafts accepted by the rows, and what their estimates predicted
        self.calibration = {n: [1.0, 1.0] for n in range(1, self.LONG + 1)}
        self._pending = None            # per row of the last tree: (its match length, its estimates' sum)
        self._round = None              # the last looked-up round: (lookup seconds, rows, tree size)
        self.saving, self.idle, self.backoff = 0.0, 0, 1   # see _saved

    LONG = 8   # match lengths from here on share one calibration

    LOOKUP_DECAY = 0.9   # per looked-up round, the memory of what lookups saved (about a dozen rounds)
    MAX_IDLE = 8         # rounds without lookups at most, while they do not pay

    def observe(self, run) -> None:
        """The rows' accepted drafts (the round's host read) against what their estimates predicted; what the
        round's lookups saved against a plain step."""
        accepted = run.host_pass[1] if run.host_pass is not None else None
        if self._pending is not None and accepted is not None:
            for b, (n, predicted) in self._pending.items():
                total = self.calibration[n]
                self.calibration[n] = [DECAY * total[0] + accepted[b], DECAY * total[1] + predicted]
        if self._round is not None:
            spent, count, size = self._round
            gained = sum(accepted[b] for b in self._pending) if size and accepted is not None and self._pending else 0
            self._saved(spent, count, size, gained)
        self._pending = self._round = None

    def _saved(self, spent: float, count: int, size: int, accepted: int) -> None:
        """Seconds a looked-up round saved over a plain step (its rows' accepted drafts at a plain step's time,
        less the larger pass and the lookups' own time), averaged; while the average is below 0 the next rounds
        are plain steps without lookups, 1 after the first such round, twice as many after each next (up to
        MAX_IDLE), so that text without matches costs the lookups of a round in MAX_IDLE + 1 at most."""
        costs = self.costs(count)
        t1 = costs.pass_time(1)
        saved = accepted / count * t1 - (costs.pass_time(size + 1) - t1) - spent
        self.saving = self.LOOKUP_DECAY * self.saving + (1 - self.LOOKUP_DECAY) * saved
        if self.saving < 0:
            self.idle, self.backoff = min(self.backoff, self.MAX_IDLE), min(2 * self.backoff, self.MAX_IDLE)
        else:
            self.backoff = 1

    def scale(self, n: int) -> float:
        """Drafts accepted per draft predicted, after matches of length n."""
        accepted, predicted = self.calibration[min(n, self.LONG)]
        return accepted / predicted

    def candidates(self, context: np.ndarray, depth: int) -> tuple[int, dict[tuple, tuple[int, float]]]:
        """A row's match length and candidates: rank path -> (token, estimated probability), every path's prefixes
        included."""
        s = self.shape
        matches = [find_in(context, context, s.max_n, depth, s.limit, exclude_last=True)]
        matches += [source.lookup(context, s.max_n, depth, s.limit) for source in self.sources]
        n = max(m.n for m in matches)
        share: dict[tuple, float] = {}   # token path -> its share of the occurrences
        for m in matches:
            if m.n != n or not n or not len(m.continuations):
                continue
            rows, total = m.continuations, len(m.continuations)
            group = np.zeros(total, np.int64)   # each row's path so far, numbered
            levels = []                         # per depth: its distinct paths and their shares
            for d in range(depth):
                rows, group = rows[rows[:, d] >= 0], group[rows[:, d] >= 0]
                if not len(rows):
                    break
                _, first, group, counts = np.unique(group << 32 | rows[:, d], return_index=True,
                                                    return_inverse=True, return_counts=True)
                levels.append((rows[first, :d + 1], counts / total))
            shares = np.concatenate([v for _, v in levels]) if levels else np.zeros(0)
            # a path that nodes others of this source outnumber is in no row's candidates
            cut = np.partition(shares, -s.nodes)[-s.nodes] if len(shares) > s.nodes else 0.0
            for paths, v in levels:
                keep = v >= cut
                for path, x in zip(map(tuple, paths[keep].tolist()), v[keep].tolist()):
                    share[path] = max(share.get(path, 0.0), x)
        # the most frequent first, shorter first among equals: a path's prefixes come before it
        kept = sorted(share, key=lambda p: (-share[p], len(p), p))[:s.nodes]
        children = collections.defaultdict(list)
        for p in kept:
            children[p[:-1]].append(p)
        out, stack = {}, [((), ())]
        while stack:
            path, ranks = stack.pop()
            for r, child in enumerate(children.get(path, ())):
                if self.chains and r:
                    break
                out[ranks + (r,)] = (child[-1], share[child])
                stack.append((child, ranks + (r,)))
        return n, out

    def propose(self, run, gamma: int) -> Proposal:
        if self.costs is None:
            return self._propose(run, gamma)
        if self.idle:   # lookups have not paid lately: a plain step without them
            self.idle -= 1
            return run.inputs(run.batch, 1).empty
        began = time.perf_counter()
        proposal = self._propose(run, gamma)
        count = int(np.count_nonzero(run.active)) or run.batch
        self._round = (time.perf_counter() - began, count, 0 if proposal.tree is None else proposal.tree.size - 1)
        return proposal

    def _propose(self, run, gamma: int) -> Proposal:
        B, depth = run.batch, min(self.shape.depth, gamma)
        live = run.active if run.active.any() else np.ones(B, bool)
        rows, memo = {}, {}
        for b in np.flatnonzero(live).tolist():   # rows with the same text (a request's copies) look up once
            context = run.host_tokens[b, :run.host_lengths[b]]
            key = context.tobytes()
            if key not in memo:
                memo[key] = self.candidates(context, depth)
            rows[b] = memo[key]
        count = len(rows)
        mean = collections.Counter()   # the rows' calibrated estimates, averaged
        for n, cands in rows.values():
            scale = self.scale(n) if n else 0.0
            for path, (_, p) in cands.items():
                mean[path] += min(p * scale, 1.0) / count
        order = sorted(mean, key=lambda p: (-mean[p], len(p), p))[:self.shape.nodes]
        if self.costs is not None and order:   # as many nodes as pay, if a tree pays at all
            costs, probs = self.costs(count), np.array([mean[p] for p in order])
            size = _best_size(costs, probs, 0.0)
            if (1 + probs[:size].sum()) / costs.pass_time(size + 1) <= 1 / costs.pass_time(1):
                size = 0
                for n in {min(n, self.LONG) for n, _ in rows.values() if n}:   # untried, a scale drifts back
                    self.calibration[n] = [DECAY * v + (1 - DECAY) for v in self.calibration[n]]
            order = order[:size]
        if not order:   # nothing matched, or nothing that pays: a plain step
            self._pending = None
            return run.inputs(B, 1).empty
        tree = tree_of(tuple(sorted(order, key=lambda p: (len(p), p))))
        tokens = np.full((B, tree.size - 1), self.FILLER, np.int64)
        for b, (_, cands) in rows.items():
            tokens[b] = [cands[p][0] if p in cands else self.FILLER for p in tree.paths]
        self._pending = {b: (min(n, self.LONG), sum(cands[p][1] for p in tree.paths if p in cands))
                         for b, (n, cands) in rows.items() if n}
        nodes = torch.from_numpy(tokens)
        host = run.device.type == "cpu"
        return Proposal(nodes.to(run.device), None, torch.ones(nodes.shape, dtype=torch.bool, device=run.device),
                        tree, host=(tokens, None) if host else None)
