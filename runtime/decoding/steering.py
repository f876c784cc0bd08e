"""Trees drafted inside the rows' grammars (structured output at speculative speed).

A tree method's drafter proposes from its own model, which knows no grammar: under a JSON schema, EAGLE's nodes at
a forced key were often another token, and every node below a refused one was verified for nothing (its parent's
mask refuses it, so no rule ever accepts it). `steer_tree` walks each constrained row's tree depth-first with the
row's matcher (advance into a node, roll back out of it: the matcher's own rollback, as path_masks does), before the
pass:
- where the grammar forces a token at a node's parent (the only token its mask allows), each child becomes that
  token: a certain node, whose masked P is one-hot, so the round carries the forced run as deep as the tree goes
  and the drafts below it;
- a child the grammar refuses, and its subtree, is dropped (as is what a row would draft past its end of
  sequence); the round's tree is the nodes some live row keeps, so a node no row's grammar allows is never
  verified, and a batch of one constrained row verifies only nodes inside its grammar.
A draft model drafts inside the grammar itself (drafters.DraftMasks): each step's logits masked by the row's matcher
along the chain drafted so far, so its chain (and the top-k along it, in a tree) has no token the grammar refuses,
and a sampled draft's Q is the masked distribution it was drawn from. Every node stays a deterministic proposal (a
function of the drafter's output, the grammar and the path), so the recursive rejection rule over siblings keeps the
masked target's distribution, greedy and sampled: a dropped node has masked P = 0, its rejection was certain and
changed no residual.
Walking before the pass, rather than masking each level as it is drafted, serves every tree drafter (Medusa's heads,
the draft model's top-k, EAGLE's dynamic tree, rest's retrieval trees) in one place, at the cost of a drafter
spending a node on a token the grammar then drops.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from specrt.decoding.drafters import Proposal
from specrt.decoding.tree import Tree


@functools.lru_cache(maxsize=4096)
def _tree(paths: tuple[tuple[int, ...], ...]) -> Tree:
    return Tree.from_paths(paths)


def steer_tree(proposal: Proposal, rows, active) -> tuple[Proposal | None, np.ndarray | None, int]:
    """The tree proposal along the live rows' grammars (the module doc): -> (the proposal to verify, None when no
    node is left: a plain step; the original node id of each of its nodes, root first, None when the tree kept its
    shape; the nodes dropped, summed over the constrained rows)."""
    tree = proposal.tree
    tokens = (proposal.host[0] if proposal.host is not None else proposal.tokens.cpu().numpy()).copy()   # (B, N)
    B, N = tokens.shape
    alive = np.zeros((B, N + 1), bool)
    dropped = 0
    for b, row in enumerate(rows):
        if not active[b]:
            continue
        if row.matcher is None:
            alive[b] = True
            continue
        _walk(row.matcher, tree, tokens[b], alive[b])
        dropped += N + 1 - int(alive[b].sum())
    keep = alive.any(0)
    keep[0] = True
    dev = proposal.tokens.device
    if keep.all():
        steered = Proposal(torch.from_numpy(tokens).to(dev), None, proposal.valid, tree,
                           host=(tokens, None) if proposal.host else None)
        return steered, None, dropped
    kept = np.flatnonzero(keep)                                                     # (K + 1,) root first
    if len(kept) == 1:
        return None, None, dropped
    pruned = _tree(tuple(tree.paths[i - 1] for i in kept[1:]))
    nodes = np.ascontiguousarray(tokens[:, kept[1:] - 1])                           # (B, K)
    return (Proposal(torch.from_numpy(nodes).to(dev), None, torch.ones(nodes.shape, dtype=torch.bool, device=dev),
                     pruned, host=(nodes, None) if proposal.host else None), kept, dropped)


def _walk(matcher, tree: Tree, tokens: np.ndarray, alive: np.ndarray, node: int = 0) -> None:
    """One row's subtree below `node`, depth first in rank order, the matcher at `node`'s path (the committed
    tokens for the root) and back there at the end: forced tokens written into `tokens` (the row's nodes 1..N), the
    nodes inside the grammar marked in `alive` (N + 1,)."""
    alive[node] = True
    if node and tokens[node - 1] in matcher.eos_ids:
        return                                             # nothing is drafted past the end
    allowed = matcher.allowed()
    forced = int(allowed.argmax()) if np.count_nonzero(allowed) == 1 else None
    for child in tree.children[node]:
        if forced is not None:
            tokens[child - 1] = forced
        if allowed[tokens[child - 1]] and matcher.advance([int(tokens[child - 1])]) == 1:
            _walk(matcher, tree, tokens, alive, child)
            matcher.rollback(1)


def original_ids(host_pass: tuple, kept: np.ndarray) -> tuple:
    """The round's host read (run.host_pass: the accepted paths' node ids per row, and their counts) in the ids of
    the tree the drafter proposed, for its bookkeeping (Drafter.observe)."""
    paths, counts = host_pass
    return ([[int(kept[i]) for i in p] for p in paths] if paths is not None else None), counts
