"""Drafters propose tokens for the target to verify. A chain is a tree with one child per node.

A drafter has five calls: prefill(run, row, prompt, start, hidden) after each of the target's prefill passes over
a joining request's prompt (prompt (1, m): its ids on the device; the pass covered positions start .. start+S−1 of
row `row`, which is not live yet; hidden (1, S, d): the target's features there), so that a drafter with a cache
prefills it in the same chunks; join(run, row, copies) when rows row .. row+copies−1 of the batch start the
request (its prompt prefilled in row `row`); propose(run, gamma) -> Proposal: tokens (B, γ),
draft probabilities Q (B, γ, V) or None when the proposal is deterministic (greedy drafting, n-gram lookup), and
`valid` (B, γ) for rows that propose fewer than γ; observe(run) after every round, proposed in or not (the
target's pass has just run: `run.path_hidden`, `run.path_start`); move(src, dst, count) when the batch compacts
its live rows (row dst takes row src's state for its first `count` positions).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from specrt.engines.base import chain_mask
from specrt.errors import InputError
from specrt.decoding import processors
from specrt.decoding.sampling import (argmax, draw_host, probs, sample, seeded_pick, softmax_host, top_k_ids,
                                     top_k_in_place)
from specrt.decoding.tree import Tree


@dataclass
class Proposal:
    tokens: torch.Tensor          # (B, γ) int64, or (B, N) tree nodes 1..N
    q: torch.Tensor | None        # (B, γ, V) or None (deterministic)
    valid: torch.Tensor           # (B, γ) bool, a prefix of each row
    tree: Tree | None = None      # set when the proposal is a tree (always deterministic)
    host: tuple | None = None     # (tokens as a numpy array, widths as a list) when the drafter made them on the host

    @classmethod
    def empty(cls, batch: int, device="cpu") -> "Proposal":
        return _empty_proposal(batch, torch.device(device))

    def on_host(self) -> tuple:
        """(tokens as a numpy array, each row's number of valid drafts as a list): the CPU loop's view."""
        if self.host is None:
            self.host = (self.tokens.numpy(), self.valid.numpy().sum(1).tolist())
        return self.host


@functools.lru_cache(maxsize=64)
def _empty_proposal(batch: int, device: torch.device) -> Proposal:
    """No drafts (a plain target step); made once per batch size and device (read only)."""
    return Proposal(torch.zeros(batch, 0, dtype=torch.int64, device=device), None,
                    torch.zeros(batch, 0, dtype=torch.bool, device=device))


@functools.lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """0..n-1 on a device, made once (read only)."""
    return torch.arange(n, device=device)



class PassInputs:
    """A pass's ids and positions for one shape (B, S): device tensors (2, B, S) that the engine keeps bound pass
    after pass, and the host array the loop fills (`host`, and its pinned tensor): on the CPU the same memory,
    elsewhere copied over once a pass (`send`). Also the shape's chain mask and empty proposal, so that a round
    looks nothing up on the device. Made once per shape by its user (the loop, a drafter)."""

    def __init__(self, B: int, S: int, device: torch.device):
        self.host_tensor = torch.zeros(2, B, S, dtype=torch.int64, device="cpu", pin_memory=device.type == "cuda")
        self.host = self.host_tensor.numpy()
        self.device = self.host_tensor.to(device)
        self.ids, self.positions = self.device.unbind(0)
        self.chain_mask = chain_mask(B, S, device)
        self.empty = Proposal.empty(B, device)

    def send(self) -> None:
        if self.device is not self.host_tensor:
            self.device.copy_(self.host_tensor, non_blocking=True)


class DraftMasks:
    """A chain drafter's logits masked by the live constrained rows' grammars as it drafts (steering.py says why):
    `apply(b, logits)` before a step's choice, `advance(b, token)` after it, `close()` puts every matcher back where
    it was (the committed tokens). A row whose draft leaves its grammar (its top-k past the allowed tokens, in a
    tree, never moves it) is masked no further."""

    def __init__(self, run):
        self.matchers = {b: row.matcher for b, row in enumerate(run.rows) if row.matcher is not None and run.active[b]}
        self.taken = dict.fromkeys(self.matchers, 0)   # tokens each matcher has consumed since
        self.live = set(self.matchers)                 # the rows still masked

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def apply(self, b: int, logits):
        """Row b's logits (V,) (numpy or torch) with what its grammar refuses at -inf: a copy (the row's own where
        it has no grammar). Where the drafter gives every allowed token -inf (ids outside its kept vocabulary), the
        allowed tokens get 0: it then drafts among them uniformly."""
        if b not in self.live:
            return logits
        allowed = self.matchers[b].allowed()
        masked = logits.copy() if isinstance(logits, np.ndarray) else logits.clone()
        processors.mask(masked, allowed)
        keep = allowed if isinstance(masked, np.ndarray) else torch.from_numpy(allowed).to(masked.device)
        if not masked[keep].max() > float("-inf"):
            masked[keep] = 0.0
        return masked

    def advance(self, b: int, token: int) -> None:
        if b in self.live:
            if self.matchers[b].advance([int(token)]) == 1:
                self.taken[b] += 1
            else:
                self.live.discard(b)

    def close(self) -> None:
        for b, m in self.matchers.items():
            m.rollback(self.taken[b])
        self.matchers, self.live = {}, set()


class RowlessDrafter:
    """A drafter that keeps nothing per row: a prompt, a row's copies or a row moved in the batch need no work, and
    (unless it overrides `observe`) neither does a round's outcome."""

    cache_needs = ()   # the parts of the prefix cache a hit must have for it (see Batch._restore): none

    def prefill(self, run, row: int, prompt: torch.Tensor, start: int, hidden: torch.Tensor,
                defer: bool = False) -> None:
        pass

    def restore(self, run, row: int, prompt: torch.Tensor, cache, hit, chunk: int, defer: bool = False) -> None:
        pass

    def cache_parts(self, row: int, m: int, finished: bool = False) -> dict:
        return {}

    def join(self, run, row: int, copies: int) -> None:
        pass

    def move(self, src: int, dst: int, count: int) -> None:
        pass

    def observe(self, run) -> None:
        pass


class DraftModelDrafter:
    """A small causal LM with its own static cache. Invariant between rounds: its cache is valid for at
    least the first n−2−s tokens of a row of length n, where s counts the tokens of the rounds it did not propose
    in since its last proposal (plain target steps, one token each, or a grammar's forced runs: run.skipped), so a
    round feeds the last 2+s tokens, then γ−1 more. A drafter of another vocabulary (`vocab_map`, see
    vocab_map.py) reads each target token as the drafter tokens of its bytes, its cache in its own positions (a
    row's position of target token k: the drafter tokens of the k before it), and drafts target tokens from its
    logits over the shared ones."""

    name = "draft"

    def __init__(self, engine, timer, tree: Tree | None = None, vocab_map=None, part: str = "draft"):
        """`part`: the name its keys and values have in the prefix cache ("self" for the target over some of its
        layers, specrt.export.self_spec)."""
        self.engine, self.timer, self.tree, self.vocab_map, self.part = engine, timer, tree, vocab_map, part
        self.inputs: dict[tuple[int, int], PassInputs] = {}   # the host path's, per shape
        self.valid: dict[tuple[int, int], torch.Tensor] = {}

    pool = None   # the cache's rows for the whole batch, made at the first prefill
    cache_needs = ()   # its keys and values ride in the prefix cache, but a hit without them prefills them (restore)

    def _make_pool(self, run) -> None:
        if self.pool is None:   # another vocabulary's tokens: up to twice the target's (its graph's max_seq_len)
            size = (run.capacity, run.cache_len * (1 if self.vocab_map is None else 2))
            self.pool = run.reused(self.part, size, lambda: self.engine.new_cache(*size))
            self.skip_mark = run.skipped   # run.skipped when the cache was last ready for a proposal

    def prefill(self, run, row: int, prompt: torch.Tensor, start: int, hidden: torch.Tensor,
                defer: bool = False) -> None:
        """The prompt minus its last token, in the target's chunks: positions start .. start+S−1 (but m−1). (Its
        pass never waits: `defer` is EAGLE's, Batch._defers.)"""
        self._prefill(run, row, prompt, start, hidden.shape[1])

    def _prefill(self, run, row: int, prompt: torch.Tensor, start: int, S: int) -> None:
        self._make_pool(run)
        one, dev = self.pool.row(row), run.device
        if start == 0:
            one.truncate(0)
        S = min(S, prompt.shape[1] - 1 - start)
        if S > 0 and self.vocab_map is not None:
            tokens = prompt[0, :start + S].tolist()
            self.past = [self.vocab_map.length(tokens[:start])]
            if self.past[0] + self.vocab_map.length(tokens[start:]) <= one.length:   # else it never drafts here
                self._foreign_pass(one, [tokens[start:]])
        elif S > 0:
            out = self.timer(self.engine, one, prompt[:, start:start + S], (start + _arange(S, dev))[None],
                             chain_mask(1, S, dev), 1)
            one.write(out.new_kv)
            one.past_len += S

    def restore(self, run, row: int, prompt: torch.Tensor, cache, hit, chunk: int, defer: bool = False) -> None:
        """A prompt's first `hit.tokens` positions from the prefix cache `cache` (a PrefixCache): its keys and values
        where they are cached (copied), the rest (blocks that a request of another method cached) prefilled in
        `chunk`s."""
        self._make_pool(run)
        done = 0 if self.vocab_map is not None else cache.copy(hit, self.part, self.pool.data[:, row], 2)
        self.pool.row(row).truncate(done)
        for start in range(done, hit.tokens, chunk):
            self._prefill(run, row, prompt, start, min(chunk, hit.tokens - start))

    def cache_parts(self, row: int, m: int, finished: bool = False) -> dict:
        """What the prefix cache keeps of a row after its prompt's prefill (m: the prompt's length): its keys and
        values over the prompt but its last token (PrefixCache.store's (tensor, position axis, positions held)).
        Of a `finished` row, nothing: its cache lags the row's tokens by a round (a later hit prefills it)."""
        if finished or self.vocab_map is not None:   # another vocabulary's positions: not the target's blocks
            return {}
        return {self.part: (self.pool.data[:, row], 2, m - 1)}                     # (2L, Hkv, Smax, D)

    def join(self, run, row: int, copies: int) -> None:
        """The prefilled row to the request's other rows."""
        for c in range(1, copies):
            self.pool.copy_row(row, row + c, self._slots(run.rows[row].prompt_len - 1))

    def move(self, src: int, dst: int, count: int) -> None:
        self.pool.copy_row(src, dst, self._slots(count))

    def _slots(self, count: int) -> int:
        """The cache slots that hold a row's first `count` tokens: a drafter of another vocabulary copies them all."""
        return count if self.vocab_map is None else self.pool.length

    def observe(self, run) -> None:
        pass

    def _width(self, run) -> int:
        """The tokens a proposal feeds first: the last 2 + s (see the class). A row that joined after the last
        proposal may be shorter: it is fed from its start (one round of poor drafts for it, its cache right again
        after); the width never exceeds the longest row."""
        return min(2 + run.skipped - self.skip_mark, max(run.host_lengths.tolist()))

    def propose(self, run, gamma: int) -> Proposal:
        B, smax, dev = run.batch, run.max_len, run.device
        w = self._width(run)
        self.cache = self.pool.prefix(B)
        if self.vocab_map is not None:   # each row's target tokens from its cache's end, then γ−1 single tokens
            first = [run.host_tokens[b, max(n - w, 0):n].tolist() for b, n in enumerate(run.host_lengths.tolist())]
            self.past = [self.vocab_map.length(run.host_tokens[b, :max(n - w, 0)])
                         for b, n in enumerate(run.host_lengths.tolist())]
            if max(p + len(self.vocab_map.expand(f)) for p, f in zip(self.past, first)) + gamma > self.cache.length:
                return Proposal.empty(B, dev)   # past the end of its cache: plain steps from here
        self.skip_mark = run.skipped
        on_host = self.vocab_map is None and self.cache.host_data is not None and self.tree is None
        if on_host and (run.params.greedy or run.params.plain):
            return self._propose_on_host(run, gamma, w)
        start = (run.lengths - w).clamp(min=0)
        self.cache.truncate(start)
        feed = start[:, None] + torch.arange(w, device=dev)
        ids = run.tokens.gather(1, feed)                                                # (B, w)
        pos = feed.clamp(max=smax - 1)
        mask = chain_mask(B, w, dev)
        tokens, qs, tops = [], [], []
        grammars = DraftMasks(run)   # constrained rows draft inside their grammars
        try:
            # another vocabulary's greedy chains and trees pick from the shared tokens' logits alone (B, K), not
            # from a row of the target's width: their ids map back (VocabMap.shared)
            compact = self.vocab_map is not None and not grammars and (self.tree is not None or run.params.greedy)
            for i in range(gamma):
                if self.vocab_map is not None:
                    logits = self._foreign_pass(self.cache, first if i == 0 else ids.tolist())   # (B, V draft)
                    logits = self.vocab_map.shared(logits) if compact else self.vocab_map.to_target(logits)
                else:
                    out = self.timer(self.engine, self.cache, ids, pos, mask, 1)
                    self.cache.write(out.new_kv)
                    self.cache.past_len += ids.shape[1]
                    logits = out.logits[:, -1]                                          # (B, V)
                if grammars:
                    logits = torch.stack([grammars.apply(b, logits[b]) for b in range(B)])
                if self.tree is not None:     # a tree: the top-k at each step of the top-1 chain
                    top = top_k_ids(logits, self.tree.max_rank)
                    tops.append(self.vocab_map.shared_ids(top) if compact else top)
                    tok = tops[-1][:, 0]
                elif run.params.greedy:
                    tok = self.vocab_map.shared_ids(argmax(logits)) if compact else argmax(logits)
                elif run.params.seeded:   # each row's own seeded pick from Q: the target's where Q = P
                    tok = run.seeded_scores(logits[:, None], [i])[:, 0].argmax(-1)
                else:
                    q = probs(logits, run.params)
                    tok = sample(q, run.generator)
                    qs.append(q)
                tokens.append(tok)
                for b, t in enumerate(tok.tolist() if grammars else ()):
                    grammars.advance(b, t)
                ids, pos = tok[:, None], (pos[:, -1:] + 1).clamp(max=smax - 1)
                mask = chain_mask(B, 1, dev)
        finally:
            grammars.close()
        if self.tree is not None:
            nodes = self.tree.node_tokens(torch.stack(tops, 1))                        # (B, N)
            return Proposal(nodes, None, torch.ones_like(nodes, dtype=torch.bool), self.tree)
        toks = torch.stack(tokens, 1) if tokens else torch.zeros(B, 0, dtype=torch.int64, device=dev)
        q = torch.stack(qs, 1) if qs else None
        return Proposal(toks, q, torch.ones(B, gamma, dtype=torch.bool, device=dev))

    def _foreign_pass(self, cache, rows: list[list[int]]) -> torch.Tensor:
        """One pass over each row's target tokens read as drafter tokens, after its drafter positions `self.past`
        (rows of fewer drafter tokens padded at their end: scratch the next pass overwrites); the drafter's logits
        (B, V draft) at each row's last one."""
        feeds = [self.vocab_map.expand(r) for r in rows]
        B, S, dev = len(feeds), max(map(len, feeds)), cache.data.device
        host = np.zeros((2, B, S), np.int64)                                            # ids, positions
        for b, f in enumerate(feeds):
            host[0, b, :len(f)] = f
            host[1, b] = np.minimum(self.past[b] + np.arange(S), cache.length - 1)
        ids, pos = torch.from_numpy(host).to(dev)
        cache.truncate(self.past)
        out = self.timer(self.engine, cache, ids, pos, chain_mask(B, S, dev), S)
        cache.write(out.new_kv)
        self.past = [p + len(f) for p, f in zip(self.past, feeds)]
        cache.truncate(self.past)
        last = [len(f) - 1 for f in feeds]
        if out.host is not None:   # numpy: torch's indexing of a wide row costs ms on a busy CPU
            return torch.from_numpy(out.host_logits()[np.arange(B), last])
        return out.logits[torch.arange(B, device=dev), torch.tensor(last, device=dev)]

    def _inputs(self, B: int, S: int) -> PassInputs:
        if (B, S) not in self.inputs:
            self.inputs[(B, S)] = PassInputs(B, S, self.pool.data.device)
        return self.inputs[(B, S)]

    def _propose_on_host(self, run, gamma: int, w: int) -> Proposal:
        """The chain on the CPU (greedy, or sampled from the temperature alone), its bookkeeping in plain Python
        and numpy views of the engine's buffers (see Generator._verify): the draft model's steps are short, so
        their host work counts twice over."""
        B, top, cache, params = run.batch, run.max_len - 1, self.cache, run.params
        sampled = not params.greedy and not params.seeded   # seeded rows draft their seeded picks (see propose)
        V, lengths = self.engine.spec["vocab_size"], run.host_lengths.tolist()
        if sampled:   # the draft probabilities Q (B, γ, V), and a uniform per draft
            q = np.empty((B, gamma, V), np.float32)
            u = torch.rand(B, gamma, generator=run.generator, device="cpu", dtype=torch.float64).tolist()
        inputs, past = self._inputs(B, w), []
        for b, n in enumerate(run.host_lengths.tolist()):
            past.append(max(n - w, 0))
            inputs.host[0, b] = run.host_tokens[b, past[b]:past[b] + w]
            inputs.host[1, b] = [min(past[b] + j, top) for j in range(w)]
        cache.truncate(past)
        drafts = np.zeros((B, gamma), np.int64)
        grammars = DraftMasks(run)   # constrained rows draft inside their grammars
        try:
            for i in range(gamma):
                out = self.timer(self.engine, cache, inputs.ids, inputs.positions, inputs.chain_mask, 1)
                cache.write(out.host_kv(), past)
                past = [p + inputs.host.shape[2] for p in past]
                cache.truncate(past)
                inputs, logits = self._inputs(B, 1), out.host_logits()
                for b, p in enumerate(past):
                    row = grammars.apply(b, logits[b, -1]) if grammars else logits[b, -1]
                    if params.greedy:
                        drafts[b, i] = row.argmax()
                    elif not sampled:
                        weights = softmax_host(row, params.temperature, normalise=False)
                        drafts[b, i] = seeded_pick(weights, run.noise(b, lengths[b] + i, V))
                    else:
                        q[b, i] = softmax_host(row, params.temperature)
                        drafts[b, i] = draw_host(q[b, i], u[b][i])
                    grammars.advance(b, drafts[b, i])
                    inputs.host[0, b, 0], inputs.host[1, b, 0] = drafts[b, i], min(p, top)
        finally:
            grammars.close()
        if (B, gamma) not in self.valid:
            self.valid[(B, gamma)] = torch.ones(B, gamma, dtype=torch.bool, device="cpu")
        return Proposal(torch.from_numpy(drafts), torch.from_numpy(q) if sampled else None,
                        self.valid[(B, gamma)], host=(drafts, [gamma] * B))


class SelfDrafter(RowlessDrafter, DraftModelDrafter):   # nothing kept per row: RowlessDrafter's calls
    """The target over some of its layers drafting on the target's own cache (LayerSkip's and SWIFT's sharing): in
    the target's session (specrt.engines.base.LayerSkipEngine, every layer's cache bound, the skipped ones untouched)
    or an engine of its own over the kept layers (CUDA, TensorRT: bound to those layers of the target's cache, a
    KVCache.alias). Its kept layers read the target's keys and values at the committed positions
    and write theirs at the row's cache end and after, which the round's verify pass writes again before it reads
    them (a row of n tokens: the target holds n − 1, the pending token and the γ − 1 drafts fed after it are the
    verify pass's first γ); the skipped layers' entries pass through untouched. Nothing to prefill, restore, copy or
    catch up, and no cache of its own. (Past a skipped layer the committed entries are the target's, not what the
    skipping model would have written: they only shape the drafts.)"""

    name = "self"

    def _make_pool(self, run) -> None:
        if self.pool is None or self._target is not run.pool:   # the target's buffers, its own lengths
            layers = None if hasattr(self.engine, "use_layers") else self.engine.spec["kept_layers"]
            self.pool, self._target = run.pool.alias(layers), run.pool

    def propose(self, run, gamma: int) -> Proposal:
        self._make_pool(run)
        return super().propose(run, gamma)

    def _width(self, run) -> int:
        return 1   # the pending token, at the target's cache end


class NgramDrafter(RowlessDrafter):
    """Prompt lookup: the continuation that followed the most recent earlier occurrence of the last n tokens
    (n from `max_n` down to `min_n`). No model; the proposal is deterministic."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def lookup(self, context: np.ndarray, gamma: int) -> np.ndarray:
        return self.match(context, gamma)[1]

    def match(self, context: np.ndarray, gamma: int) -> tuple[int, np.ndarray]:
        """The length n of the longest suffix found earlier in the context, and at most gamma tokens that followed
        its last occurrence (0 and none when nothing matches)."""
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)        # (len-n, n)
            hits = np.flatnonzero((windows == context[-n:]).all(1))
            if len(hits):
                begin = hits[-1] + n
                return n, context[begin:begin + gamma]
        return 0, context[:0]

    def propose(self, run, gamma: int) -> Proposal:
        """Looks up the host mirror of the tokens (no device read); one copy of the proposal to the device."""
        B = run.batch
        tokens = np.zeros((B, gamma), np.int64)
        found = np.zeros(B, np.int64)
        for b in np.flatnonzero(run.active):
            hit = self.lookup(run.host_tokens[b, :run.host_lengths[b]], gamma)
            tokens[b, :len(hit)], found[b] = hit, len(hit)
        width = int(found.max(initial=0))
        valid = np.arange(width) < found[:, None]                                       # (B, width)
        return Proposal(torch.from_numpy(tokens[:, :width].copy()).to(run.device),
                        None, torch.from_numpy(valid).to(run.device))


class MedusaDrafter(RowlessDrafter):
    """Medusa heads on the target's hidden state at the last accepted position (and on the token the target
    chose there, the tree's root): head i's top-k are the candidates at depth i+1 of a fixed tree
    (deterministic proposals). Sequential heads run once per level: below each node that has children, head i
    reads that node's path (root, then the candidates above it) and its top-k are the node's children."""

    name = "medusa"

    def __init__(self, heads, tree: Tree, timer=None):
        if tree.max_depth > heads.num_heads:
            raise InputError(f"tree of depth {tree.max_depth} needs {tree.max_depth} Medusa heads; the engine set "
                             f"has {heads.num_heads}")
        self.heads, self.tree = heads, tree
        self.timer = timer or (lambda fn, *args: fn(*args))   # counts the heads' passes as engine time
        self.levels = _levels(tree, heads.num_heads) if heads.sequential else None
        depth, rank = tree.depth.tolist(), tree.rank.tolist()
        self.slots = list(zip(depth[1:], rank[1:]))   # each node's (depth, rank)
        self.ranks = [max(r for d, r in self.slots if d == level) + 1 for level in range(1, tree.max_depth + 1)]
        self.buffers: dict[int, tuple] = {}   # the host path's, per batch size: roots, their numpy view, valid
        self.logits = self.host_logits = None  # the heads' output buffer and its numpy view

    def propose(self, run, gamma: int) -> Proposal:
        tree, k = self.tree, self.tree.max_rank
        if self.levels is None and run.hidden.device.type == "cpu":
            return self._propose_on_host(run)
        if self.levels is None:
            tokens = run.last_tokens()[:, None].expand(-1, self.heads.num_heads)
            logits = self.timer(self.heads.forward, run.hidden, tokens)[:, :tree.max_depth]          # (B, D, V)
            nodes = tree.node_tokens(top_k_ids(logits, k))                                # (B, N)
            return Proposal(nodes, None, torch.ones_like(nodes, dtype=torch.bool), tree)
        B, dev = run.batch, run.hidden.device
        if self.levels[0][0].device != dev:   # the index tensors move to the heads' device once
            self.levels = [tuple(t.to(dev) for t in level) for level in self.levels]
        nodes = torch.zeros(B, tree.size, dtype=torch.int64, device=dev)
        nodes[:, 0] = run.last_tokens()
        for depth, (paths, children, slot, rank) in enumerate(self.levels):
            P = len(paths)
            logits = self.timer(self.heads.logits, run.hidden.repeat_interleave(P, 0), nodes[:, paths].flatten(0, 1),
                                torch.full((B * P,), depth, dtype=torch.int64, device=dev))         # (B P, V)
            top = top_k_ids(logits, k).view(B, P, k)
            nodes[:, children] = top[:, slot, rank]
        return Proposal(nodes[:, 1:], None, torch.ones(B, tree.size - 1, dtype=torch.bool, device=dev), tree)

    def _propose_on_host(self, run) -> Proposal:
        """The tree on the CPU: the roots from the host mirrors, each depth's top-k by argmaxes over the heads'
        own output buffer (taken candidates set to -inf in place), the bookkeeping in plain Python (see
        Generator._verify)."""
        B, K, N = run.batch, self.heads.num_heads, self.tree.size - 1
        if B not in self.buffers:
            roots, nodes = (torch.zeros(B, n, dtype=torch.int64, device="cpu") for n in (K, N))
            self.buffers[B] = (roots, roots.numpy(), nodes, nodes.numpy(), torch.ones(B, N, dtype=torch.bool,
                                                                                      device="cpu"))
        roots, host_roots, nodes, host_nodes, valid = self.buffers[B]
        for b, token in enumerate(run.host_last_tokens()):
            host_roots[b] = token
        logits = self.timer(self.heads.forward, run.hidden, roots, False)             # (B, K, V), the heads' buffer
        if self.logits is not logits:
            self.logits, self.host_logits = logits, logits.numpy()
        for b in range(B):
            top = [top_k_in_place(self.host_logits[b, d], k)[0] for d, k in enumerate(self.ranks)]
            host_nodes[b] = [top[d - 1][r] for d, r in self.slots]
        return Proposal(nodes, None, valid, self.tree, host=(host_nodes, None))


def _levels(tree: Tree, num_heads: int) -> list[tuple[torch.Tensor, ...]]:
    """Per depth d: the paths (P, K) of the nodes at depth d that have children (node ids from the root, padded
    with the root: the heads ignore slots past their depth), and for the nodes at depth d + 1 their ids, the
    index of their parent among those P, and their rank."""
    ancestry = [[0]]
    for i in range(1, tree.size):
        ancestry.append(ancestry[tree.parent[i]] + [i])
    levels = []
    for d in range(tree.max_depth):
        children = [i for i in range(1, tree.size) if int(tree.depth[i]) == d + 1]
        parents = sorted({tree.parent[i] for i in children})
        paths = torch.tensor([ancestry[p] + [0] * (num_heads - len(ancestry[p])) for p in parents], device="cpu")
        slot = torch.tensor([parents.index(tree.parent[i]) for i in children], device="cpu")
        levels.append((paths, torch.tensor(children, device="cpu"), slot, tree.rank[children]))
    return levels
