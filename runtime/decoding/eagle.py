"""The EAGLE drafter (see specrt.export.eagle) and its dynamic trees (EAGLE-2).

Cache invariant: before a round the drafter's cache holds slots 0 .. n−2 of a row of n tokens, where slot t
was fed the target's feature at position t and token t + 1. The target's features are kept by position in a
per-request history: the prompt's from the target's prefill passes, then after every round those of the
accepted path (`run.path_hidden` from `run.path_start`, root first), plain steps included, so a round first
feeds the slots its cache lacks (catch-up: one pass over the accepted count + 1 per row, more after plain
steps) and reads the distribution of the first tree level from the last of them.

The tree grows from there: a frontier of the `top_k` nodes with the best cumulative draft log-probability per
depth, each expanded to its `top_k` most probable children, for `depth` levels; the `nodes` best of every
candidate by that score form the round's tree (scores fall along a path, so it contains its ancestors). Rows
of a batch share the tree's shape (rank paths chosen by the mean probability over the live rows; for one row
exactly EAGLE-2) and verify it with the loop's lossless tree rules. Each level is one pass over the frontier and
its ancestors (an expansion node must see them, and they are not in the cache), with its output features fed
to its children; the expansion passes write nothing to the cache.

An EAGLE-3 drafter (specrt.export.eagle3: the engine's spec has `aux_size`) reads the target's `aux` states (the
inputs of three of its layers) where EAGLE reads its `hidden`: the history keeps those, a catch-up feeds them as
the graph's `aux` input (its `features` zero), and a tree level feeds the drafter's own features (its `aux` zero).
Its logits are over its draft ids, mapped to the target's through the engine set's output ids (d2t).

A target's MTP module (specrt.export.mtp, `--method mtp`) runs here unchanged: its graph has the EAGLE drafter's
contract, and a tree level feeds it its own `hidden` output (its block's, before its final norm), as MTP is chained.

Prompt lookup's continuation joins the candidates as a chain (see PromptLookup), weighed like them; where the
target verifies chains only (int8 activations), it takes the place of the drafter's chain in the rows where it
promises more accepted tokens.

Adaptive rounds (the default) size the tree by the machine's measured costs, the shape being an envelope:
growth stops where another level cannot pay for its drafter pass, and the round verifies the number of nodes
with the most expected tokens per second (a node's cumulative probability is the drafter's estimate of the
chance that the target accepts it; the estimates are scaled by how well they have predicted acceptance).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from specrt.decoding.datastore import best_chain
from specrt.decoding.drafters import NgramDrafter, PassInputs, Proposal, _arange, chain_mask
from specrt.decoding.run import PREFILL_CHUNK
from specrt.errors import InputError
from specrt.decoding.sampling import top_k_in_place
from specrt.decoding.tree import Tree


@dataclass(frozen=True)
class DynamicTree:
    """An EAGLE-2 tree shape; with adaptive rounds, the largest tree a round may grow. The default (6, 6, 32)
    suits both kinds of machine: on a GPU, whose verify pass costs about the same up to 64 tokens, adaptive rounds
    keep the whole shape; on a CPU they shrink each tree to what pays, and there side-by-side runs measured the
    same speed as with (4, 5, 16). `specrt tune-tree --method eagle` picks one for the machine."""
    top_k: int = 6       # children expanded per frontier node, and frontier width
    depth: int = 6       # levels grown
    nodes: int = 32      # nodes verified per round (below the root)

    def __post_init__(self):
        if not (1 <= self.top_k <= 16 and 1 <= self.depth <= 16 and self.depth <= self.nodes <= 256):
            raise InputError(f"dynamic tree top_k {self.top_k}, depth {self.depth}, nodes {self.nodes}: need "
                             "1 <= top_k <= 16, 1 <= depth <= 16 and depth <= nodes <= 256")

    @property
    def span(self) -> int:
        """Cache slots a round writes from the pending token's on: the verified tree's (root and nodes), or the
        widest expansion pass's (top_k nodes per level below the last, written while they are read)."""
        return max(self.nodes + 1, self.top_k * (self.depth - 1))

    @property
    def envelope(self) -> Tree:
        """A tree of the largest size and depth a round may propose."""
        return Tree.from_paths([(0,) * d for d in range(1, self.depth + 1)] +
                               [(r,) for r in range(1, self.nodes - self.depth + 1)])


@functools.lru_cache(maxsize=4096)
def tree_of(paths: tuple[tuple[int, ...], ...]) -> Tree:
    """Trees recur from round to round: build each shape once."""
    return Tree.from_paths(paths)


class EagleDrafter:
    """`costs` (live rows -> Costs: the target's measured pass times, and one drafter pass as `draft_step`, see
    Generator.eagle_costs) sizes each round's tree: the shape becomes an envelope, growth stops at the depth
    where another level cannot pay for its pass, and the round verifies the number of nodes that gives the most
    expected tokens per second (the drafter's own probabilities, scaled by how well they have predicted
    acceptance so far). Without it (`adaptive=False`, and tune-tree) every round grows and verifies the full
    shape, as EAGLE-2 does."""
    name = "eagle"

    def __init__(self, engine, timer, shape: DynamicTree = DynamicTree(), costs=None, output_ids=None,
                 lookup: bool = True, chains: bool = False, figures: "Figures | None" = None, sources=()):
        self.engine, self.timer, self.shape, self.costs = engine, timer, shape, costs
        # what the rounds measure and the next request starts from (see Figures)
        self.figures = figures if figures is not None else Figures()
        # prompt lookup's chains; where the text has no match, the stores' (`sources`: rest's datastore, suffix cache)
        self.lookup = PromptLookup(self.figures.lookup, sources) if lookup else None
        self.chains = chains   # a chain per round (shape top_k 1): a row's lookup chain replaces the drafter's
        self.tree, self.span = shape.envelope, shape.span
        # the drafter's output ids: its logits' columns (`output_ids`, an engine that outputs only its kept ids),
        # or else learnt from its first row of whole-vocabulary logits (the finite ones)
        self.kept, self.narrow = output_ids, output_ids is not None
        self.aux = getattr(engine, "spec", {}).get("aux_size")   # EAGLE-3: the width of the target states it reads
        # the target's states it reads ride in the prefix cache, a hit needs them (restore); its own cache is
        # prefilled from them
        self.cache_needs = ("aux",) if self.aux else ("hidden",)
        self._zeros: dict[tuple, torch.Tensor] = {}   # (B, S, width) -> the zero input a pass does not use
        self._pending = None              # (run.accepted before the round, live rows, predicted) of the last tree
        self._feeds: dict[tuple, tuple] = {}   # the CPU's host path: per pass shape and width, bound inputs
        self.trace: list | None = None    # a list: each verified round of row 0 is appended (specrt.measurement.projection)
        self._traced = None               # (kind, the round's paths, their scores) until observe

    pool = None   # the cache's rows for the whole batch, made at the first prefill
    _past = None  # the host's copy of the pool's past_len (a round's pass shape, without reading the device)

    defers = True   # a prompt's pass over the drafter's layer can wait for its first proposal (Batch._defers)

    def prefill(self, run, row: int, prompt: torch.Tensor, start: int, hidden: torch.Tensor,
                defer: bool = False) -> None:
        """A chunk of the request's prompt features (1, S, d) into the history, and its slots into the cache, in
        the target's chunks: slots start .. start+S−1 but the prompt's last (slot t: feature t, token t+1), so
        that the first round's catch-up feeds one slot, as in every later round. `defer`: the features alone; the
        slots are fed at the row's first proposal (_fill)."""
        if self.pool is None:
            size = (run.capacity, run.cache_len)
            self.pool = run.reused("eagle", size, lambda: self.engine.new_cache(*size))
            self._history = run.reused("eagle history", (*size, hidden.shape[-1], hidden.dtype), lambda: torch.zeros(
                *size, hidden.shape[-1], dtype=hidden.dtype, device=run.device))
            # the CPU's host path (see Generator._verify): the round's bookkeeping in numpy over these views
            self._host_history = self._history.numpy() if self.pool.host_data is not None and \
                hidden.dtype == torch.float32 else None
        if self._past is None:
            self._past = np.zeros(run.capacity, np.int64)
        self._history[row, start:start + hidden.shape[1]] = hidden[0]
        if start == 0:
            self.pool.row(row).truncate(0)
            self._past[row] = 0
        if not defer:
            self._slots(run, row, prompt, start, hidden)

    def _slots(self, run, row: int, prompt: torch.Tensor, start: int, hidden: torch.Tensor) -> None:
        """One row's slots from `start` on (its cache's end) from the features `hidden` (1, S, d) there and the
        prompt's tokens after them, but the prompt's last."""
        one, dev = self.pool.row(row), run.device
        n = min(hidden.shape[1], prompt.shape[1] - 1 - start)
        if n > 0:
            out = self.timer(self.engine, one, prompt[:, start + 1:start + 1 + n], (start + _arange(n, dev))[None],
                             chain_mask(1, n, dev), 1, **self._target_states(hidden[:, :n]))
            one.write(out.new_kv)
            one.past_len += n
            self._past[row] += n

    def restore(self, run, row: int, prompt: torch.Tensor, cache, hit, chunk: int, defer: bool = False) -> None:
        """A prompt's first `hit.tokens` positions from the prefix cache `cache` (a PrefixCache): the target's states
        there are cached, the drafter's own layer is not (its slot t reads token t+1, past the block that holds
        position t), so it is prefilled from them in `chunk`s (`defer`: at the row's first proposal)."""
        states = cache.read(hit, self.cache_needs[0])[None]                     # (1, length, d)
        for start in range(0, hit.tokens, chunk):
            self.prefill(run, row, prompt, start, states[:, start:start + chunk], defer)

    def cache_parts(self, row: int, m: int, finished: bool = False) -> dict:
        """What the prefix cache keeps of a row after its prompt's prefill, or of a `finished` row: the target's
        states at its first m positions (PrefixCache.store's (tensor, position axis, positions held)); a finished
        row has them for all its tokens but the last (each round's pass gave those of its path, see observe)."""
        return {self.cache_needs[0]: (self._history[row], 0, m)}             # (Smax, d)

    def join(self, run, row: int, copies: int) -> None:
        """The prefilled row (history and cache) to the request's other rows."""
        m = run.rows[row].prompt_len
        for c in range(1, copies):
            self._history[row + c, :m] = self._history[row, :m]
            self.pool.copy_row(row, row + c, m)
        self._past[row:row + copies] = self._past[row]

    def move(self, src: int, dst: int, count: int) -> None:
        self.pool.copy_row(src, dst, count)
        self._history[dst, :count] = self._history[src, :count]
        self._past[dst] = self._past[src]

    @property
    def history(self) -> torch.Tensor:
        return self._history[:self.batch]

    def observe(self, run) -> None:
        """The target's features along the round's path go to their positions (past the accepted ones: scratch
        that a later round overwrites before any catch-up reads it); a tree round's accepted drafts update the
        calibration of the scores."""
        self.batch = run.batch
        out, path, n = run.last_pass
        if self._host_history is not None and isinstance(n, list) and out.host is not None:
            feats = out.host_aux() if self.aux else out.host_hidden()               # (B, S, d)
            width = feats.shape[1] if path is None else len(path[0])
            for b, start in enumerate(run.cache.host_past.tolist()):
                fit = max(0, min(width, run.cache_len - start))
                self._host_history[b, start:start + fit] = feats[b, :fit] if path is None else \
                    feats[b].take(path[b][:fit], 0)
        else:
            feats = self._path_aux(run) if self.aux else run.path_hidden            # (B, D+1, d)
            slots = (run.path_start[:, None] + _arange(feats.shape[1], run.device)).clamp(max=run.cache_len - 1)
            self.history.scatter_(1, slots[..., None].expand(-1, -1, feats.shape[-1]), feats.to(self.history.dtype))
        if self.lookup is not None:
            self.lookup.update(*run.host_pass)
        if self.trace is not None and self._traced is not None:
            self.trace.append(_traced_round(*self._traced, *run.host_pass))
            self._traced = None
        if self._pending is not None:
            before, live, predicted = self._pending
            accepted, forecast = self.figures.calibration
            self.figures.calibration = [DECAY * accepted + (run.accepted - before) / live,
                                        DECAY * forecast + predicted]
            self._pending = None

    def propose(self, run, gamma: int) -> Proposal:
        self.batch, self.cache = run.batch, self.pool.prefix(run.batch)
        host = self._host_history is not None and (run.params.greedy or run.params.plain)
        depth, live = min(self.shape.depth, gamma), run.active if run.active.any() else np.ones(run.batch, bool)
        hits = self.lookup.matches(run, live, depth) if self.lookup is not None else None   # once a round
        self._traced = None
        quick = self._lookup_only(run, live, hits)
        if quick is not None:
            tree, tokens = quick
        else:
            self._fill(run)
            logits, feature = self._catch_up_host(run) if host else self._catch_up(run)
            tree, tokens = self._grow(run, logits, feature, depth, hits)
        nodes = torch.from_numpy(tokens).to(run.device)
        return Proposal(nodes, None, torch.ones_like(nodes, dtype=torch.bool), tree,
                        host=(tokens, None) if host else None)

    def _fill(self, run) -> None:
        """Rows far behind (a prompt whose slots were left to its first proposal, or many plain rounds) are fed on
        their own, in the prefill's chunks, up to their last slot: the round's catch-up pass pads every row to the
        longest backlog."""
        for b, n in enumerate(run.host_lengths[:run.batch].tolist()):
            p = int(self._past[b])
            if n - 2 - p > FILL:
                prompt = run.prompt(b, n - 1)   # slots p .. n−3 read tokens p+1 .. n−2
                for start in range(p, n - 2, PREFILL_CHUNK):
                    self._slots(run, b, prompt, start, self._history[b:b + 1, start:start + PREFILL_CHUNK])

    def _catch_up(self, run):
        """Feed slots past_len .. n−2 of each row (one pass, rows padded at the end) -> the first level's
        logits (B, V) and the predicted feature there (B, d). The pass's shape comes from the host's copies of
        the lengths (no read of the device)."""
        B, cache, dev = run.batch, self.cache, run.device
        past = self._past[:B].copy()
        fed = np.maximum(run.host_lengths - 1 - past, 0)                            # (B,) slots to feed
        S = max(1, int(fed.max()))
        num = S - (max(int(fed.min()), 1) - 1)                                      # logits from the earliest last slot
        count = (run.lengths - 1 - cache.past_len).clamp(min=0)                     # (B,) fed, on the device
        slots = (cache.past_len[:, None] + _arange(S, dev)).clamp(max=run.cache_len - 1)   # (B, S)
        x = self.history.gather(1, slots[..., None].expand(-1, -1, self.history.shape[-1]))  # (B, S, d)
        ids = run.tokens.gather(1, (slots + 1).clamp(max=run.max_len - 1))          # (B, S) the token after
        last = count.clamp(min=1) - 1                                               # (B,) each row's last slot
        out = self.timer(self.engine, cache, ids, slots, chain_mask(B, S, dev), num, **self._target_states(x))
        cache.write(out.new_kv)
        cache.past_len += count
        self._past[:B] = past + fed
        rows = _arange(B, dev)
        return out.logits[rows, last - (S - num)], out.hidden[rows, last].clone()

    def _feed(self, B: int, S: int, width: int | None = None) -> tuple:
        """The host path's inputs for a pass of shape (B, S), made once and kept bound: ids and positions
        (PassInputs) and the features (a tensor and its numpy view) of `width` (default: the history's)."""
        width = width or self._history.shape[-1]
        got = self._feeds.get((B, S, width))
        if got is None:
            feats = torch.zeros(B, S, width, device=self._history.device)
            got = self._feeds[(B, S, width)] = (PassInputs(B, S, feats.device), feats, feats.numpy())
        return got

    def _zero(self, B: int, S: int, width: int, device) -> torch.Tensor:
        got = self._zeros.get((B, S, width))
        if got is None:
            got = self._zeros[(B, S, width)] = torch.zeros(B, S, width, device=device)
        return got

    def _target_states(self, x: torch.Tensor) -> dict:
        """The drafter's inputs for the target's states x (B, S, ·) from the history: EAGLE's `features`, or
        EAGLE-3's `aux` (its `features` zero)."""
        if not self.aux:
            return {"features": x}
        B, S, _ = x.shape
        return {"features": self._zero(B, S, self.engine.spec["hidden_size"], x.device), "aux": x}

    def _own_states(self, x: torch.Tensor) -> dict:
        """The drafter's inputs for its own features x (B, S, d) (a tree level): EAGLE-3's `aux` zero."""
        B, S, _ = x.shape
        return {"features": x, **({"aux": self._zero(B, S, self.aux, x.device)} if self.aux else {})}

    def _path_aux(self, run) -> torch.Tensor:
        """(B, D+1, n*d) the target's aux states along the last accepted path, root first (run.path_hidden's)."""
        out, path, _ = run.last_pass
        if path is None:
            return out.aux
        index = run._device(path)
        return out.aux.gather(1, index[..., None].expand(-1, -1, out.aux.shape[-1]))

    def _catch_up_host(self, run) -> tuple[np.ndarray, np.ndarray]:
        """_catch_up on the CPU in numpy over the engine's buffers (see Generator._verify) -> the first level's
        logits (B, V) and the predicted feature there (B, d), numpy arrays."""
        B, cache, top = run.batch, self.cache, run.cache_len - 1
        past = cache.host_past.tolist()
        count = [max(0, n - 1 - p) for n, p in zip(run.host_lengths.tolist(), past)]
        S = max(1, max(count))
        inputs, feats, host_feats = self._feed(B, S)
        for b, p in enumerate(past):
            slots = [min(p + j, top) for j in range(S)]
            inputs.host[1, b] = slots
            inputs.host[0, b] = run.host_tokens[b].take([min(t + 1, run.max_len - 1) for t in slots])
            self._host_history[b].take(slots, 0, out=host_feats[b])
        last = [max(c, 1) - 1 for c in count]                                       # each row's last slot
        num = S - min(last)
        out = self.timer(self.engine, cache, inputs.ids, inputs.positions, inputs.chain_mask, num,
                         **self._target_states(feats))
        cache.write(out.host_kv(), past)
        cache.truncate([p + c for p, c in zip(past, count)])
        self._past[:B] = cache.host_past
        logits, hidden = out.host_logits(), out.host_hidden()
        return (np.stack([logits[b, j - (S - num)] for b, j in enumerate(last)]),
                np.stack([hidden[b, j] for b, j in enumerate(last)]))

    def _top(self, logits: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drafter logits (B, R, V), or (B, R, K) over its output ids -> the top_k log-probabilities and their ids
        per row, (B, R, k) numpy arrays, largest first. On the CPU in numpy over the drafter's kept ids only (its
        other logits are −inf, their probability 0): a torch log_softmax over 49,152 entries costs ~0.15 ms a
        level right after a pass."""
        k = self.shape.top_k
        if isinstance(logits, np.ndarray) and k > 8:
            logits = torch.from_numpy(logits)
        if isinstance(logits, torch.Tensor):
            if logits.device.type != "cpu" or logits.dtype != torch.float32 or k > 8:
                lp, ids = torch.log_softmax(logits.float(), -1).topk(k, -1)
                lp, ids = lp.cpu().numpy(), ids.cpu().numpy()
                return lp, self.kept[ids] if self.narrow else ids
            logits = logits.detach().numpy()
        rows = logits.reshape(-1, logits.shape[-1])
        if self.kept is None:
            finite = np.flatnonzero(np.isfinite(rows[0]))
            self.kept = finite if len(finite) < rows.shape[1] else None
        lp, ids = np.empty((len(rows), k), np.float32), np.empty((len(rows), k), np.int64)
        for r, row in enumerate(rows):
            # the pass's own buffer as scratch, or a copy of the kept columns
            x = row if self.narrow or self.kept is None else row[self.kept]
            top = x.max()
            lse = top + np.log(np.exp(x - top).sum())
            taken, values = top_k_in_place(x, k)
            ids[r] = self.kept[taken] if self.kept is not None else taken
            lp[r] = np.asarray(values) - lse
        return lp.reshape(*logits.shape[:-1], k), ids.reshape(*logits.shape[:-1], k)

    def _grow(self, run, logits, feature, depth: int, hits: dict | None = None) -> tuple[Tree, np.ndarray]:
        """EAGLE-2 expansion from the root's logits (B, V) and feature (B, d) -> the tree, node tokens (B, N).
        numpy arrays (the CPU's host path: the expansions' inputs filled in place) or device tensors. `hits`: the
        live rows' lookup matches (PromptLookup.matches), when already found this round."""
        k, B, host = self.shape.top_k, run.batch, isinstance(feature, np.ndarray)
        live = run.active if run.active.any() else np.ones(B, bool)
        costs = self.costs(int(live.sum())) if self.costs is not None else None
        score, tok = (a[:, 0] for a in self._top(logits[:, None]))                 # (B, k) each
        paths = [(r,) for r in range(k)]                                            # the frontier, shared
        feat = feature[:, None].repeat(k, 1) if host else feature[:, None].expand(-1, k, -1)   # (B, k, d)
        cand_paths, cand_tok, cand_score = list(paths), [tok], [score]
        fed, passes = [], 1                   # the frontiers fed: (paths, tokens, features); the catch-up was one
        for _ in range(1, depth):
            if costs is not None and not self._deeper(costs, np.concatenate(cand_score, 1)[live], score[live],
                                                      passes):
                break
            passes += 1
            fed.append((paths, tok, feat))
            out = self._expand(run, *_lineage(fed), k)
            child, ctok = self._top(out.host_logits() if host else out.logits)     # (B, k, k) each
            cscore = (score[..., None] + child).reshape(B, -1)                      # (B, k*k)
            children = [p + (r,) for p in paths for r in range(k)]
            cand_paths += children
            cand_tok.append(ctok.reshape(B, -1))
            cand_score.append(cscore)
            best = np.argsort(-_mean_prob(cscore[live]), kind="stable")[:k]        # the next frontier
            paths = [children[i] for i in best]
            tok, score = ctok.reshape(B, -1)[:, best], cscore[:, best]
            parents = best // k                                                     # (k,) among the last k fed
            feat = out.host_hidden()[:, -k:][:, parents] if host else \
                out.hidden[:, -k:][:, torch.from_numpy(parents).to(out.hidden.device)].clone()
        cand_tok, cand_score = np.concatenate(cand_tok, 1), np.concatenate(cand_score, 1)   # (B, C) each
        if self.lookup is not None:
            merge = self.lookup.replace if self.chains else self.lookup.add
            more = merge(run, cand_paths, cand_tok, cand_score, live, depth, self.scale if self.chains else
                         self.shape.nodes, hits=hits)
            cand_tok, cand_score = (np.concatenate(pair, 1) for pair in zip((cand_tok, cand_score), more))
        m = _mean_prob(cand_score[live])                                            # (C,)
        # most probable first, shallower first among equals (a node's parent is never less probable)
        order = np.lexsort((np.array([len(p) for p in cand_paths]), -m))[:self.shape.nodes]
        n = len(order) if costs is None else _best_size(costs, self.scale * m[order], costs.draft_step * passes)
        chosen = {cand_paths[i]: i for i in order[:n].tolist()}
        tree = tree_of(tuple(sorted(chosen, key=lambda p: (len(p), p))))
        if self.lookup is not None:
            self.lookup.offered(tree)
        self._pending = (run.accepted, int(live.sum()), float(m[order[:n]].sum()))
        if self.trace is not None:
            self._traced = ("tree", tree.paths, [float(m[chosen[p]]) for p in tree.paths])
        promise = self.figures.promise
        self.figures.promise = [DECAY * promise[0] + self.scale * self._pending[2], DECAY * promise[1] + 1]
        return tree, cand_tok[:, [chosen[p] for p in tree.paths]]

    def _lookup_only(self, run, live: np.ndarray, hits: dict | None) -> tuple[Tree, np.ndarray] | None:
        """A round without the drafter: where every live row's lookup chain (`hits`, PromptLookup.matches)
        promises at least the drafts that the drafter's rounds have been expected to give of late, the round
        verifies those chains alone (as many nodes as pay, with adaptive rounds), and skips the drafter's passes
        (its cache catches up in a later round, as after plain steps). -> (the chain, its tokens (B, n)), else
        None."""
        promise = self.figures.promise
        if hits is None or not promise[1]:
            return None
        if not all(len(hit) for _, hit in hits.values()):
            return None
        probs = {b: self.lookup.rate(n) ** np.arange(1, len(hit) + 1) for b, (n, hit) in hits.items()}
        if min(p.sum() for p in probs.values()) < promise[0] / promise[1]:
            return None
        L = max(len(hit) for _, hit in hits.values())
        tokens = np.full((run.batch, L), PromptLookup.FILLER, np.int64)
        p = np.zeros((run.batch, L))
        for b, (_, hit) in hits.items():
            tokens[b, :len(hit)], p[b, :len(hit)] = hit, probs[b]
        costs = self.costs(len(hits)) if self.costs is not None else None
        L = L if costs is None else _best_size(costs, p[live].mean(0), 0.0)
        tree = tree_of(tuple((0,) * j for j in range(1, L + 1)))
        self.lookup.chains_of({b: (n, tree.paths[:len(hit)]) for b, (n, hit) in hits.items()}, tree)
        self._pending = None
        if self.trace is not None:
            self._traced = ("lookup", tree.paths, p[0, :L].tolist())
        return tree, tokens[:, :L].copy()

    @property
    def scale(self) -> float:
        """How many drafts were accepted per draft the scores predicted (decayed over the recent rounds)."""
        return self.figures.calibration[0] / self.figures.calibration[1]

    def _deeper(self, costs, scores: np.ndarray, frontier: np.ndarray, passes: int) -> bool:
        """level_pays for this round's candidates (`scores`) and frontier, after `passes` drafter passes."""
        p = np.minimum(self.scale * np.sort(_mean_prob(scores))[::-1][:self.shape.nodes], 1.0)
        return level_pays(costs, p, np.minimum(self.scale * _mean_prob(frontier), 1.0), costs.draft_step * passes,
                          costs.draft_step, self.shape.top_k)

    def _expand(self, run, tokens: list[np.ndarray], feats: list, paths: tuple, k: int):
        """One pass over the frontier and its ancestors (B, S): each sees its own ancestors; logits of the last k.
        `tokens` and `feats`: per level, (B, n) tokens and (B, n, d) features (numpy on the host path)."""
        B, S = len(tokens[0]), len(paths)
        if isinstance(feats[0], np.ndarray):
            inputs, x, host_x = self._feed(B, S, feats[0].shape[-1])
            mask, depth = _expansion(paths, B, x.device, host=True)
            np.concatenate(tokens, 1, out=inputs.host[0])
            np.add(self.cache.host_past[:, None], depth, out=inputs.host[1])
            np.minimum(inputs.host[1], run.max_len - 1, out=inputs.host[1])
            np.concatenate(feats, 1, out=host_x)
            return self.timer(self.engine, self.cache, inputs.ids, inputs.positions, mask, k, **self._own_states(x))
        mask, depth = _expansion(paths, B, feats[0].device)
        pos = (self.cache.past_len[:, None] + depth).clamp(max=run.max_len - 1)     # (B, S)
        return self.timer(self.engine, self.cache, torch.from_numpy(np.concatenate(tokens, 1)).to(pos.device), pos,
                          mask, k, **self._own_states(torch.cat(feats, 1)))


FILL = 16     # slots behind: a row fed on its own before the round's catch-up (_fill)
DECAY = 0.97   # per round, the calibration's memory (a few dozen rounds: it follows the text)


@dataclass
class Figures:
    """What an EAGLE drafter's rounds measure, as decayed sums: `calibration` (drafts accepted per row, and what
    the scores predicted: their ratio scales the scores), `promise` (the drafter's rounds' expected drafts, scaled,
    and their count) and prompt lookup's `lookup` (per match length: chain nodes accepted, offered). A request
    starts from the last one's (`following`, see Generator), a new process from the engine set's tuning. From
    nothing, an answer's first few rounds set the scale alone: a few rejected drafts shrank the trees to a node or
    two for the rest of it (in fresh processes on 16 MT-Bench prompts, 1.56 tokens a round against 1.95 from the
    tuning's figures)."""
    calibration: list[float] = field(default_factory=lambda: [1.0, 1.0])
    promise: list[float] = field(default_factory=lambda: [0.0, 0.0])
    lookup: dict[int, list[float]] = field(
        default_factory=lambda: {n: [1.0, 2.0] for n in range(PromptLookup.min_n, PromptLookup.max_n + 1)})

    def following(self, memory: float = 8.0) -> "Figures":
        """The next request's: these figures, each worth at most `memory` rounds (the calibration's weight is the
        promise's count of rounds; a lookup rate's, its offered nodes)."""
        rounds = self.promise[1]
        keep = min(1.0, memory / rounds) if rounds else 1.0
        lookup = {n: [a * min(1.0, memory / o), min(o, memory)] if o else [a, o] for n, (a, o) in self.lookup.items()}
        return Figures([v * keep for v in self.calibration], [v * keep for v in self.promise], lookup)

    def to_json(self) -> dict:
        return {"calibration": self.calibration, "promise": self.promise,
                "lookup": {str(n): v for n, v in self.lookup.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "Figures":
        return cls(list(data["calibration"]), list(data["promise"]),
                   {int(n): list(v) for n, v in data["lookup"].items()})


class PromptLookup:
    """Prompt lookup inside the tree: per row, the tokens that followed the last earlier occurrence of the text's
    newest n tokens (n from `max_n` down to `min_n`, see NgramDrafter) join the candidates as a chain from the
    root. Where the chain's next token is already a candidate the chain follows it, else it adds a node (the
    last sibling, tried after the drafter's). A chain node scores its parent's score times the measured rate at
    which chain nodes of that n were accepted when their parent was, so the round's usual choice of nodes (the
    most probable, as many as pay) weighs them against the drafter's. Rows share the tree's shape: a node one
    row's chain adds holds a filler token with probability 0 in the other rows. Text that repeats its context
    (summaries, answers quoting a document, code edits) is what the drafter predicts worst and lookup best."""
    max_n, min_n = 3, 2
    FILLER = 0   # the token of a node another row's chain added (a proposal like any other: verified, lossless)
    RETRIEVED = 0   # the rate key of the chains from `sources`

    def __init__(self, sums: dict[int, list[float]] | None = None, sources=()):
        self.finder = NgramDrafter(self.max_n, self.min_n)
        self.sources = list(sources)   # stores with lookup() (specrt.decoding.datastore), asked where the text fails
        # decayed accepted, offered per n (a Figures' lookup: updated in place)
        self.sums = sums if sums is not None else {}
        for n in range(self.min_n, self.max_n + 1):
            self.sums.setdefault(n, [1.0, 2.0])
        if self.sources:
            self.sums.setdefault(self.RETRIEVED, [1.0, 2.0])
        self._round: dict[int, tuple] = {}   # row -> (n, its chain's node ids in the tree)
        self._chains: dict[int, tuple] = {}  # row -> (n, its chain's paths), between add and offered

    def rate(self, n: int) -> float:
        accepted, offered = self.sums[n]
        return accepted / offered

    def matches(self, run, live: np.ndarray, depth: int) -> dict[int, tuple[int, np.ndarray]]:
        """Each live row's match: the suffix length n and at most `depth` tokens that followed (none: no match); where
        the text has none, the sources' most frequent continuation (n = RETRIEVED)."""
        out = {}
        for b in np.flatnonzero(live).tolist():
            context = run.host_tokens[b, :run.host_lengths[b]]
            out[b] = self.finder.match(context, depth)
            if self.sources and not len(out[b][1]):
                hit = best_chain(self.sources, context, depth)
                out[b] = (self.RETRIEVED, hit) if len(hit) else out[b]
        return out

    def add(self, run, paths: list, tokens: np.ndarray, scores: np.ndarray, live: np.ndarray, depth: int,
            limit: int, hits: dict | None = None):
        """Merge each live row's chain (at most `depth` tokens) into the candidates (`paths`, and `tokens` and
        `scores` (B, C)): `paths` gains the new nodes (at most `limit`: a batch's rows could add many), `scores`
        the chains' scores where higher. Returns the new nodes' tokens and scores, (B, c) each (c may be 0).
        `hits`: the rows' matches if found already (`matches`)."""
        B, self._chains = tokens.shape[0], {}
        hits = self.matches(run, live, depth) if hits is None else hits
        hits = {b: hit for b, hit in hits.items() if len(hit[1])}
        if not hits:   # most rounds of most text: no index to build
            return np.zeros((B, 0), np.int64), np.zeros((B, 0), scores.dtype)
        index = {p: i for i, p in enumerate(paths)}
        kids: dict[tuple, list] = {}
        for p in paths:
            kids.setdefault(p[:-1], []).append(p)
        added: dict[tuple, int] = {}                     # new path -> its column
        new_tok: list[np.ndarray] = []
        new_score: list[np.ndarray] = []

        def token(b, p):   # a node another row added holds no token of this row's
            return tokens[b, index[p]] if p in index else \
                new_tok[added[p]][b] if np.isfinite(new_score[added[p]][b]) else -1

        for b, (n, hit) in hits.items():
            step, here, score, chain = np.log(self.rate(n)), (), 0.0, []
            for t in hit.tolist():
                found = next((p for p in kids.get(here, ()) if token(b, p) == t), None)
                score += step
                if found is None:
                    if len(added) == limit:   # rows beyond: their chains stop where they would add a node
                        break
                    found = here + (max((p[-1] for p in kids.get(here, ())), default=-1) + 1,)
                    kids.setdefault(here, []).append(found)
                    paths.append(found)
                    added[found] = len(new_tok)
                    new_tok.append(np.full(B, self.FILLER, np.int64))
                    new_score.append(np.full(B, -np.inf, scores.dtype))
                    new_tok[-1][b] = t
                if found in index:
                    scores[b, index[found]] = score = max(scores[b, index[found]], score)
                else:
                    new_score[added[found]][b] = score
                here = found
                chain.append(here)
            if chain:
                self._chains[b] = (n, chain)
        shape = (B, len(new_tok))
        return (np.stack(new_tok, 1) if new_tok else np.zeros(shape, np.int64),
                np.stack(new_score, 1) if new_score else np.zeros(shape, scores.dtype))

    def replace(self, run, paths: list, tokens: np.ndarray, scores: np.ndarray, live: np.ndarray, depth: int,
                scale: float, hits: dict | None = None):
        """Chains only (`paths` the chain (0,), (0, 0), ...): a live row's chain (at most `depth` tokens) takes the
        place of the drafter's where it promises more accepted tokens (Σ of its nodes' scores as probabilities,
        the drafter's scaled by `scale`, see EagleDrafter.scale). The row's nodes past its chain get the filler
        token with score −inf. `paths` gains the depths past the drafter's chain; returns their tokens and
        scores (B, c), as `add` (`hits` too)."""
        B, self._chains = tokens.shape[0], {}
        extra = []
        for b, (n, hit) in (self.matches(run, live, depth) if hits is None else hits).items():
            if not len(hit):
                continue
            chain = np.log(self.rate(n)) * np.arange(1, len(hit) + 1)
            if np.exp(chain).sum() <= scale * np.exp(scores[b].astype(np.float64)).sum():
                continue   # the drafter's chain is the better bet
            while len(paths) < len(hit):
                paths.append((0,) * (len(paths) + 1))
                extra.append((np.full(B, self.FILLER, np.int64), np.full(B, -np.inf, scores.dtype)))
            C = tokens.shape[1]
            for j, (t, lp) in enumerate(zip(hit.tolist(), chain.tolist())):
                column = (tokens[:, j], scores[:, j]) if j < C else extra[j - C]
                column[0][b], column[1][b] = t, lp
            tokens[b, len(hit):], scores[b, len(hit):] = self.FILLER, -np.inf
            for t, lp in extra[max(0, len(hit) - C):]:
                t[b], lp[b] = self.FILLER, -np.inf
            self._chains[b] = (n, paths[:len(hit)])
        shape = (B, len(extra))
        return (np.stack([t for t, _ in extra], 1) if extra else np.zeros(shape, np.int64),
                np.stack([lp for _, lp in extra], 1) if extra else np.zeros(shape, scores.dtype))

    def chains_of(self, chains: dict, tree: Tree) -> None:
        """A round of chains alone (EagleDrafter._lookup_only): row -> (n, its chain's paths), then `offered`."""
        self._chains = chains
        self.offered(tree)

    def offered(self, tree: Tree) -> None:
        """The round verifies `tree`: each chain's nodes in it (a prefix of the chain: scores fall along it)."""
        index = {p: i for i, p in enumerate(tree.paths, 1)}
        self._round = {}
        for b, (n, chain) in self._chains.items():
            ids = [index[p] for p in chain if p in index]
            if ids:
                self._round[b] = (n, ids)

    def update(self, path: list[list[int]] | None, accepted: list[int]) -> None:
        """After the verify pass (`path` the accepted paths' node ids per row, root first; `accepted` their counts:
        host lists, from the round's read): a chain's nodes whose parent was accepted count as offered, the
        accepted ones as accepted."""
        chains, self._round = self._round, {}
        if not chains or path is None:
            return
        for key in self.sums:
            self.sums[key] = [DECAY * v for v in self.sums[key]]
        for b, (n, ids) in chains.items():
            taken = path[b][1:accepted[b] + 1]
            k = 0
            while k < min(len(ids), len(taken)) and ids[k] == taken[k]:
                k += 1
            total = self.sums[n]
            self.sums[n] = [total[0] + k, total[1] + min(len(ids), k + 1)]


@functools.lru_cache(maxsize=1024)
def _expansion(paths: tuple, batch: int, device: torch.device, host: bool = False) -> tuple[torch.Tensor, object]:
    """An expansion pass's mask (B, S, S) (each fed node sees its ancestors) and depth offsets (S,) (a numpy
    array for the host path); frontiers recur, so each is made once."""
    index = {p: i for i, p in enumerate(paths)}
    mask = np.zeros((len(paths), len(paths)), bool)
    for i, p in enumerate(paths):
        mask[i, [index[p[:j]] for j in range(1, len(p) + 1)]] = True
    depth = np.array([len(p) - 1 for p in paths]) if host else \
        torch.tensor([len(p) - 1 for p in paths], device=device)
    return torch.from_numpy(np.broadcast_to(mask, (batch, *mask.shape)).copy()).to(device), depth


def _lineage(fed: list[tuple]) -> tuple[list, list, tuple]:
    """The frontiers fed so far, (paths, tokens (B, k), features (B, k, d)) per level -> the last one and its
    ancestors, shallowest first, as _expand takes them: tokens and features per level, and the paths. An
    expansion reads only the last frontier's outputs, which see only their ancestors: the other nodes of earlier
    frontiers would cost pass time for nothing."""
    need = {p[:j] for p in fed[-1][0] for j in range(1, len(p))}
    tokens, feats, paths = [], [], []
    for level, (ps, tok, feat) in enumerate(fed):
        keep = [i for i, p in enumerate(ps) if p in need]
        if level < len(fed) - 1 and len(keep) < len(ps):
            ps, tok = [ps[i] for i in keep], tok[:, keep]
            feat = feat[:, keep if isinstance(feat, np.ndarray) else torch.tensor(keep, device=feat.device)]
        paths += ps
        tokens.append(tok)
        feats.append(feat)
    return tokens, feats, tuple(paths)


def _traced_round(kind: str, paths: tuple, scores: list, path, n) -> tuple:
    """A verified round of row 0 for specrt.measurement.projection: (kind, the nodes' scores, most probable first, their
    depths, and the ranks in that order of the accepted nodes, root's child first)."""
    order = sorted(range(len(paths)), key=lambda i: (-scores[i], len(paths[i])))
    rank = {paths[i]: r for r, i in enumerate(order)}
    count = n[0]
    row = list(range(count + 1)) if path is None else path[0]   # a chain: the pass's own order
    return (kind, [scores[i] for i in order], [len(paths[i]) for i in order],
            [rank[paths[pos - 1]] for pos in row[1:count + 1]])


def _mean_prob(score: np.ndarray) -> np.ndarray:
    """(B, C) cumulative log-probabilities of the live rows -> (C,) their mean probability."""
    return np.exp(score.astype(np.float64)).mean(0)


def level_pays(costs, probs: np.ndarray, frontier: np.ndarray, spent: float, level: float, k: int) -> bool:
    """Whether another tree level can pay for itself: its k nodes together add at most the frontier's probability
    of tokens (`frontier`, scaled), for one more drafter pass (`level` seconds) and k more nodes to verify; grow
    while that bound beats the best tree of the candidates so far (`probs`, scaled, most probable first; `spent`:
    the round's drafting so far). EagleDrafter's rounds and specrt.measurement.projection's replay both decide by it."""
    n = _best_size(costs, probs, spent)
    gain = 1 + probs[:n].sum()
    bound = gain + frontier.sum()
    return bound / (spent + level + costs.pass_time(n + k + 1)) > gain / (spent + costs.pass_time(n + 1))


def _best_size(costs, probs: np.ndarray, spent: float) -> int:
    """The number of nodes (the most probable first, `probs` their scaled probabilities) with the most expected
    tokens per second: (1 + their probabilities) / (seconds spent drafting + the verify pass over them)."""
    gain = 1 + np.cumsum(np.minimum(probs, 1.0))
    return int(np.argmax(gain / (spent + costs.pass_curve(len(probs))))) + 1


# ---- per machine: the tree shape -------------------------------------------------------------------------
SHAPES = tuple(DynamicTree(k, d, n) for k, d, n in ((2, 3, 4), (2, 4, 6), (3, 4, 8), (4, 4, 12), (4, 5, 16),
                                                      (4, 6, 24), (6, 6, 32), (8, 6, 48)))


def tune(gen, prompts: list[list[int]], shapes=SHAPES, new_tokens: int = 48, log=print,
         patience: int = 2, method: str = "eagle") -> DynamicTree:
    """The shape (the envelope of adaptive rounds) with the most tokens per second by the cost model, its trees
    grown in full every round: tokens per round at T = 0 on `prompts`
    (timing-free), over a round's cost measured here: the target's pass over N + 1 tokens (a least-squares line
    through measured passes: single passes jitter by more than a node costs), `depth` drafter passes, and the
    loop's own time per round. The shapes go from small to large; once `patience` shapes in a row fall short of
    the best, the larger ones are not tried (their cost grows faster than their tokens per round). `method`:
    "mtp" for a target's MTP module (the same drafter)."""
    from specrt.decoding.calibrate import verify_costs
    measured = verify_costs(gen, [max(s.nodes for s in shapes) + 1])
    slope, intercept = np.polyfit(list(measured), list(measured.values()), 1)
    draft = gen.eagle
    draft_pass = draft.time_pass(max(0, min(64, draft.spec["max_seq_len"] - 8)), 8, reps=5,
                                 **pass_inputs(draft.spec, 1, 8, draft.device))
    saved, best, behind = draft.spec.get("dynamic_tree"), (0.0, None), 0
    try:
        for shape in shapes:
            draft.spec["dynamic_tree"] = asdict(shape)
            outs = [gen.generate(prompt_ids=p, max_new_tokens=new_tokens, method=method, adaptive=False).stats
                    for p in prompts]
            rounds = sum(s["rounds"] for s in outs)
            per_round = sum(s["tokens"] - 1 for s in outs) / max(1, rounds)
            loop = sum(s["loop_time_s"] for s in outs) / max(1, rounds)
            cost = intercept + max(slope, 0.0) * (shape.nodes + 1) + shape.depth * draft_pass + loop
            log(f"top_k {shape.top_k} depth {shape.depth} nodes {shape.nodes}: {per_round:.2f} tokens/round, "
                f"{1e3 * cost:.1f} ms/round -> {per_round / cost:.1f} tokens/s")
            best, behind = ((per_round / cost, shape), 0) if per_round / cost > best[0] else (best, behind + 1)
            if behind == patience:
                break
    finally:
        draft.spec["dynamic_tree"] = saved
    return best[1]


def pass_inputs(spec: dict, batch: int, S: int, device) -> dict:
    """Zero feature inputs of a drafter pass of (batch, S) (timing): `features`, and EAGLE-3's `aux`."""
    out = {"features": torch.zeros(batch, S, spec["hidden_size"], device=device)}
    if spec.get("aux_size"):
        out["aux"] = torch.zeros(batch, S, spec["aux_size"], device=device)
    return out


def save_shape(directory, shape: DynamicTree) -> None:
    """Record the shape in the engine set's manifest: generate uses it for --method eagle."""
    from specrt.engines.manifest import read_manifest, write_manifest
    manifest = read_manifest(directory)
    manifest["models"]["eagle"]["dynamic_tree"] = asdict(shape)
    write_manifest(directory, manifest)
