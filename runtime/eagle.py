"""The EAGLE drafter (see specrt.export.eagle) and its dynamic trees (EAGLE-2).

Cache invariant: before a round the drafter's cache holds slots 0 .. n−2 of a row of n tokens, where slot t
was fed the target's feature at position t and token t + 1. The target's features are kept by position in a
per-request history: the prompt's from the prefill (`run.prompt_hidden`), then after every round those of the
accepted path (`run.path_hidden` from `run.path_start`, root first), plain steps included, so a round first
feeds the slots its cache lacks (catch-up: one pass over the accepted count + 1 per row, more after plain
steps) and reads the distribution of the first tree level from the last of them.

The tree grows from there: a frontier of the `top_k` nodes with the best cumulative draft log-probability per
depth, each expanded to its `top_k` most probable children, for `depth` levels; the `nodes` best of every
candidate by that score form the round's tree (scores fall along a path, so it contains its ancestors). Rows
of a batch share the tree's shape (rank paths chosen by the mean probability over the live rows; for one row
exactly EAGLE-2) and verify it with the loop's lossless tree rules. Each level is one pass over the frontiers
so far (an expansion node must see its ancestors, which are not in the cache), with its output features fed
to its children; the expansion passes write nothing to the cache.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

import torch

from specrt.drafters import Proposal, _arange, chain_mask
from specrt.errors import InputError
from specrt.sampling import top_k_scratch
from specrt.tree import Tree


@dataclass(frozen=True)
class DynamicTree:
    top_k: int = 4       # children expanded per frontier node, and frontier width
    depth: int = 5       # levels grown
    nodes: int = 16      # nodes verified per round (below the root)

    def __post_init__(self):
        if not (1 <= self.top_k <= 16 and 1 <= self.depth <= 16 and self.depth <= self.nodes <= 256):
            raise InputError(f"dynamic tree top_k {self.top_k}, depth {self.depth}, nodes {self.nodes}: need "
                             "1 <= top_k <= 16, 1 <= depth <= 16 and depth <= nodes <= 256")

    @property
    def envelope(self) -> Tree:
        """A tree of the largest size and depth a round may propose (the loop sizes its cache room by it)."""
        return Tree.from_paths([(0,) * d for d in range(1, self.depth + 1)] +
                               [(r,) for r in range(1, self.nodes - self.depth + 1)])


@functools.lru_cache(maxsize=4096)
def tree_of(paths: tuple[tuple[int, ...], ...]) -> Tree:
    """Trees recur from round to round: build each shape once."""
    return Tree.from_paths(paths)


class EagleDrafter:
    name = "eagle"

    def __init__(self, engine, timer, shape: DynamicTree = DynamicTree()):
        self.engine, self.timer, self.shape = engine, timer, shape
        self.tree = shape.envelope

    pool = None   # the cache's rows for the whole batch, made at the first join

    def join(self, run, row: int, copies: int) -> None:
        """The request's prompt features into the history, and its prompt but the last slot into the cache (one
        one-row pass: the first round's catch-up then feeds one slot, as in every later round)."""
        hidden = run.prompt_hidden                                                  # (1, m, d)
        if self.pool is None:
            self.pool = self.engine.new_cache(run.capacity, run.cache_len)
            self._history = torch.zeros(run.capacity, run.cache_len, hidden.shape[-1], dtype=hidden.dtype,
                                        device=run.device)
        m, dev = hidden.shape[1], run.device
        self._history[row:row + copies, :m] = hidden
        one = self.pool.row(row)
        one.truncate(0)
        if m > 1:
            out = self.timer(self.engine, one, run.tokens[row:row + 1, 1:m], _arange(m - 1, dev)[None],
                             chain_mask(1, m - 1, dev), 1, features=hidden[:, :m - 1])
            one.write(out.new_kv)
            one.past_len += m - 1
        for c in range(1, copies):
            self.pool.copy_row(row, row + c, m)

    def move(self, src: int, dst: int, count: int) -> None:
        self.pool.copy_row(src, dst, count)
        self._history[dst, :count] = self._history[src, :count]

    @property
    def history(self) -> torch.Tensor:
        return self._history[:self.batch]

    def observe(self, run) -> None:
        """The target's features along the round's path go to their positions (past the accepted ones: scratch
        that a later round overwrites before any catch-up reads it)."""
        self.batch = run.batch
        feats = run.path_hidden                                                     # (B, D+1, d)
        slots = (run.path_start[:, None] + _arange(feats.shape[1], run.device)).clamp(max=run.cache_len - 1)
        self.history.scatter_(1, slots[..., None].expand(-1, -1, feats.shape[-1]), feats.to(self.history.dtype))

    def propose(self, run, gamma: int) -> Proposal:
        self.batch, self.cache = run.batch, self.pool.prefix(run.batch)
        logits, feature = self._catch_up(run)
        tree, tokens = self._grow(run, logits, feature, min(self.shape.depth, gamma))
        return Proposal(tokens, None, torch.ones_like(tokens, dtype=torch.bool), tree)

    def _catch_up(self, run):
        """Feed slots past_len .. n−2 of each row (one pass, rows padded at the end) -> the first level's
        logits (B, V) and the predicted feature there (B, d)."""
        B, cache, dev = run.batch, self.cache, run.device
        count = (run.lengths - 1 - cache.past_len).clamp(min=0)                     # (B,) slots to feed
        S = max(1, int(count.max()))
        slots = (cache.past_len[:, None] + _arange(S, dev)).clamp(max=run.cache_len - 1)   # (B, S)
        x = self.history.gather(1, slots[..., None].expand(-1, -1, self.history.shape[-1]))  # (B, S, d)
        ids = run.tokens.gather(1, (slots + 1).clamp(max=run.max_len - 1))          # (B, S) the token after
        last = count.clamp(min=1) - 1                                               # (B,) each row's last slot
        num = S - int(last.min())
        out = self.timer(self.engine, cache, ids, slots, chain_mask(B, S, dev), num, features=x)
        cache.write(out.new_kv)
        cache.past_len += count
        rows = _arange(B, dev)
        return out.logits[rows, last - (S - num)], out.hidden[rows, last].clone()

    def _grow(self, run, logits, feature, depth: int) -> tuple[Tree, torch.Tensor]:
        """EAGLE-2 expansion from the root's logits (B, V) and feature (B, d) -> the tree, node tokens (B, N)."""
        k, dev = self.shape.top_k, logits.device
        live = torch.from_numpy(run.active).to(dev)
        score, tok = top_k_scratch(torch.log_softmax(logits.float(), -1), k)         # (B, k) each
        paths = [(r,) for r in range(k)]                                            # the frontier, shared
        feat = feature[:, None].expand(-1, k, -1)                                   # (B, k, d)
        cand_paths, cand_tok, cand_score = list(paths), [tok], [score]
        fed_tok, fed_feat, fed_paths = [], [], []
        for d in range(1, depth):
            fed_tok.append(tok)
            fed_feat.append(feat)
            fed_paths += paths
            out = self._expand(run, torch.cat(fed_tok, 1), torch.cat(fed_feat, 1), fed_paths, k)
            child, ctok = top_k_scratch(torch.log_softmax(out.logits.float(), -1), k)   # (B, k, k) each
            cscore = (score[..., None] + child).flatten(1)                         # (B, k*k)
            children = [p + (r,) for p in paths for r in range(k)]
            cand_paths += children
            cand_tok.append(ctok.flatten(1))
            cand_score.append(cscore)
            best = _mean_logp(cscore, live).topk(k).indices                          # (k,) the next frontier
            paths = [children[i] for i in best.tolist()]
            tok, score = ctok.flatten(1)[:, best], cscore[:, best]
            feat = out.hidden[:, -k:][:, best // k].clone()                          # (B, k, d) the parents'
        scores = torch.cat(cand_score, 1)                                           # (B, C)
        depth_of = torch.tensor([len(p) for p in cand_paths], device=dev)
        # shallower first among equals, so that a kept node's parent is kept too
        keep = (_mean_logp(scores, live).double().clamp(min=-1e6) - 1e-6 * depth_of).topk(
            min(self.shape.nodes, len(cand_paths)))
        chosen = {cand_paths[i]: i for i in keep.indices.tolist()}
        tree = tree_of(tuple(sorted(chosen, key=lambda p: (len(p), p))))
        cols = torch.tensor([chosen[p] for p in tree.paths], device=dev)
        return tree, torch.cat(cand_tok, 1)[:, cols]

    def _expand(self, run, tokens, feats, paths, k: int):
        """One pass over every frontier fed so far (B, S): each sees its own ancestors; logits of the last k."""
        B, S = tokens.shape
        index = {p: i for i, p in enumerate(paths)}
        mask = torch.zeros(S, S, dtype=torch.bool, device="cpu")
        for i, p in enumerate(paths):
            mask[i, [index[p[:j]] for j in range(1, len(p) + 1)]] = True
        mask = mask.to(tokens.device)
        depth = torch.tensor([len(p) - 1 for p in paths], device=tokens.device)
        pos = (self.cache.past_len[:, None] + depth).clamp(max=run.max_len - 1)     # (B, S)
        return self.timer(self.engine, self.cache, tokens, pos, mask.expand(B, -1, -1).contiguous(), k,
                          features=feats)


def _mean_logp(score: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """(B, C) cumulative log-probabilities -> (C,) the log of their mean probability over the live rows."""
    score = score[live] if bool(live.any()) else score
    return torch.logsumexp(score, 0) - math.log(score.shape[0])


# ---- per machine: the tree shape -------------------------------------------------------------------------
SHAPES = tuple(DynamicTree(k, d, n) for k, d, n in ((2, 3, 4), (2, 4, 6), (3, 4, 8), (4, 4, 12), (4, 5, 16),
                                                      (4, 6, 24), (6, 6, 32), (8, 6, 48)))


def tune(gen, prompts: list[list[int]], shapes=SHAPES, new_tokens: int = 48, log=print) -> DynamicTree:
    """The shape with the most tokens per second by the cost model: tokens per round at T = 0 on `prompts`
    (timing-free), over a round's cost measured here: the target's pass over N + 1 tokens (a least-squares line
    through measured passes: single passes jitter by more than a node costs), `depth` drafter passes, and the
    loop's own time per round."""
    import numpy as np

    from specrt.adaptive import measure
    from specrt.calibrate import verify_costs
    measured = verify_costs(gen, sorted({1, 2, 8} | {s.nodes + 1 for s in shapes}))
    slope, intercept = np.polyfit(list(measured), list(measured.values()), 1)
    draft = gen.eagle
    context = max(0, min(64, draft.spec["max_seq_len"] - 8))
    cache = draft.new_cache(1, context + 8)
    cache.truncate(context)
    dev = draft.device
    ids = torch.zeros(1, 8, dtype=torch.int64, device=dev)
    feats = torch.zeros(1, 8, draft.spec["hidden_size"], device=dev)
    pos, mask = torch.arange(context, context + 8, device=dev)[None], chain_mask(1, 8, dev)
    draft_pass = measure(lambda: draft.forward(ids, pos, cache.past_len, mask, 4, cache, features=feats), reps=5)
    saved, best = draft.spec.get("dynamic_tree"), (0.0, None)
    try:
        for shape in shapes:
            draft.spec["dynamic_tree"] = asdict(shape)
            outs = [gen.generate(prompt_ids=p, max_new_tokens=new_tokens, method="eagle", adaptive=False).stats for p in prompts]
            rounds = sum(s["rounds"] for s in outs)
            per_round = sum(s["tokens"] - 1 for s in outs) / max(1, rounds)
            loop = sum(s["loop_time_s"] for s in outs) / max(1, rounds)
            cost = intercept + max(slope, 0.0) * (shape.nodes + 1) + shape.depth * draft_pass + loop
            log(f"top_k {shape.top_k} depth {shape.depth} nodes {shape.nodes}: {per_round:.2f} tokens/round, "
                f"{1e3 * cost:.1f} ms/round -> {per_round / cost:.1f} tokens/s")
            best = max(best, (per_round / cost, shape), key=lambda b: b[0])
    finally:
        draft.spec["dynamic_tree"] = saved
    return best[1]


def save_shape(directory, shape: DynamicTree) -> None:
    """Record the shape in the engine set's manifest: generate uses it for --method eagle."""
    from specrt.manifest import read_manifest, write_manifest
    manifest = read_manifest(directory)
    manifest["models"]["eagle"]["dynamic_tree"] = asdict(shape)
    write_manifest(directory, manifest)
