"""Verification of a drafted chain against the target: the rules of Leviathan et al. / Chen et al.

P: target probabilities at the γ+1 positions (B, γ+1, V). Q: draft probabilities at the γ drafted positions
(B, γ, V), or None for a deterministic proposal (Q = δ_x). `valid` (B, γ) marks real drafts (rows may
propose fewer than γ). Returns the number of accepted drafts per row (B,) and the token that follows them
(B,): the target's correction at the first rejection, or the bonus token when all are accepted.
"""
from __future__ import annotations

import numpy as np
import torch

from specrt.decoding.sampling import argmax, draw_host, sample, softmax_host


def greedy(target_logits: torch.Tensor, draft: torch.Tensor, valid: torch.Tensor):
    best = argmax(target_logits)                                       # (B, γ+1)
    if draft.shape[1] == 0:                                            # a plain step: nothing to accept
        return torch.zeros_like(best[:, 0]), best[:, 0]
    match = (draft == best[:, :-1]) & valid                            # (B, γ)
    n = match.int().cumprod(1).sum(1)                                  # (B,)
    return n, best.gather(1, n[:, None])[:, 0]


def greedy_host(logits: np.ndarray, tokens: list[list[int]], width: list[int], pick=None) -> list[list[int]]:
    """greedy() on the host, in plain Python over the target's logits (B, γ+1, V) (a numpy view) and the pass's
    tokens (B lists: the root, then the drafts; row b has width[b] real drafts). Returns per row
    [n, next token, width, root, accepted drafts...] (the loop's commit). The CPU loop's: right after a pass
    each distinct torch or numpy operation costs tens of µs of cold code, the interpreter's own a few; and a
    position's argmax is taken only when the drafts before it were accepted. `pick(b, node)`: the target's token
    there instead of the argmax (a seeded batch's, _Run.host_picker)."""
    pick = pick or (lambda b, i: int(logits[b, i].argmax()))
    rows = []
    for b, (tt, w) in enumerate(zip(tokens, width)):
        n, best = 0, pick(b, 0)
        while n < w and tt[n + 1] == best:
            n += 1
            best = pick(b, n)
        rows.append([n, best, w] + tt[:n + 1])
    return rows


def sampled_host(logits: np.ndarray, tokens: list[list[int]], width: list[int], q: np.ndarray | None,
                 temperature: float, u: list[list[float]]) -> list[list[int]]:
    """sampled() on the host (top-k and top-p off), for the CPU loop (see greedy_host): target probabilities
    softmax(logits / T) only at the positions reached, Q (B, γ, V) as a numpy array (None: deterministic drafts),
    u[b] γ + 1 uniforms per row (acceptance at each position, then the draw). Returns the commit rows."""
    rows = []
    for b, (tt, w) in enumerate(zip(tokens, width)):
        n = 0
        while True:
            p = softmax_host(logits[b, n], temperature)
            if n == w:
                break
            x = tt[n + 1]
            if not u[b][n] < p[x] / (q[b, n, x] if q is not None else 1.0):   # u < min(1, P/Q)
                break
            n += 1
        weights = residual_host(p, None if q is None else q[b, n], tt[n + 1]) if n < w else p
        rows.append([n, draw_host(weights, u[b][-1]), w] + tt[:n + 1])
    return rows


def residual_host(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """residual() on the host, unnormalised (draw_host takes weights): max(0, P − Q), with Q = δx for a
    deterministic draft x; P itself where that is all zero."""
    r = np.maximum(p - q, 0) if q is not None else p.copy()
    if q is None:
        r[x] = 0.0
    return r if r.sum() > 0 else p


def residual(P_n: torch.Tensor, Q_n: torch.Tensor) -> torch.Tensor:
    """max(0, P − Q), normalised; P itself where the two are equal (rejection then has probability 0)."""
    r = torch.clamp(P_n - Q_n, min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), P_n)


def sampled(P: torch.Tensor, Q: torch.Tensor | None, draft: torch.Tensor, valid: torch.Tensor,
            generator: torch.Generator):
    B, gamma = draft.shape
    if gamma == 0:                                                     # a plain step: sample from P
        return torch.zeros(B, dtype=torch.int64, device=P.device), sample(P[:, 0], generator)
    p = P[:, :gamma].gather(-1, draft[..., None])[..., 0]              # (B, γ)  P(x_i)
    q = Q.gather(-1, draft[..., None])[..., 0] if Q is not None else torch.ones_like(p)
    u = torch.rand(p.shape, generator=generator, device=p.device)
    accept = (u < p / q) & valid                                       # u < min(1, P/Q)
    n = accept.int().cumprod(1).sum(1)                                 # (B,)
    rows = torch.arange(B, device=P.device)
    P_n = P[rows, n]                                                   # (B, V)
    # Q at the stopping position: zero past the last real draft (bonus token or nothing proposed there)
    proposed = n < valid.sum(1)
    if Q is not None:
        Q_n = Q[rows, n.clamp(max=gamma - 1)] if gamma else torch.zeros_like(P_n)
    else:                                                              # deterministic: Q = δ_x
        Q_n = torch.zeros_like(P_n)
        if gamma:
            Q_n.scatter_(1, draft[rows, n.clamp(max=gamma - 1)][:, None], 1.0)
    Q_n = Q_n * proposed[:, None]
    nxt = sample(residual(P_n, Q_n), generator)
    return n, nxt


# ---- trees -----------------------------------------------------------------------------------------------
# tokens: (B, N+1) with the root (the last committed token) at node 0. Both functions return the number of
# accepted nodes below the root (B,), the next token (B,), and the accepted root-to-node path (B, max_depth+1)
# as node ids (root first; entries past the accepted length are padding).

def tree_greedy(target_logits: torch.Tensor, tokens: torch.Tensor, tree):
    """The deepest path on which every node is its parent's target argmax."""
    tree = tree.on(tokens.device)
    best = argmax(target_logits)                                       # (B, N+1)
    ok = tokens == best[:, tree.parent_ids]                            # node i is its parent's argmax
    ok[:, 0] = True
    leaves = tree.leaves                                               # (L, D+1)
    on_path = ok[:, leaves.clamp(min=0)] & (leaves >= 0)               # (B, L, D+1)
    reach = on_path.int().cumprod(-1).sum(-1)                          # (B, L) nodes accepted, root included
    leaf = reach.argmax(-1)                                            # (B,) the deepest
    path = leaves[leaf]                                                # (B, D+1)
    n = reach.gather(1, leaf[:, None])[:, 0] - 1
    last = path.gather(1, n[:, None])[:, 0]
    return n, best.gather(1, last[:, None])[:, 0], path


def tree_greedy_host(logits: np.ndarray, tokens: list[list[int]], tree, pick=None) -> tuple[list[list[int]], list]:
    """tree_greedy() on the host, in plain Python (see greedy_host, `pick` too): the deepest root-to-node path on
    which every node is its parent's argmax (the first found in rank order on a tie), taking the argmax only at
    the nodes reached. Returns the commit rows (width: the tree's depth) and each row's path as node ids, root
    first, padded with its last node to max_depth + 1."""
    pick = pick or (lambda b, i: int(logits[b, i].argmax()))
    rows, paths = [], []
    D = tree.max_depth
    for b, tt in enumerate(tokens):
        best = {}
        path, stack = [0], [[0]]
        while stack:   # depth-first in rank order
            here = stack.pop()
            if len(here) > len(path):
                path = here
            node = here[-1]
            best[node] = pick(b, node)
            stack.extend(here + [c] for c in reversed(tree.children[node]) if tt[c] == best[node])
        n = len(path) - 1
        rows.append([n, best[path[-1]], D] + [tt[i] for i in path])
        paths.append(path + [path[-1]] * (D - n))
    return rows, paths


def without_host(R: np.ndarray, x: int) -> np.ndarray:
    """without() on the host, for one row's residual weights R (V,): (R − δx)+, in place."""
    R[x] = 0.0
    return R


def tree_sampled_host(logits: np.ndarray, tokens: list[list[int]], tree, temperature: float,
                      u: list[list[float]]) -> tuple[list[list[int]], list]:
    """tree_sampled() on the host (top-k and top-p off), in plain Python over the target's logits (B, N+1, V) (see
    greedy_host): the residual is softmax(logits / T) as unnormalised weights, made only at the nodes reached;
    u[b] holds N + 1 uniforms per row (one per child tried, in rank order, then the draw). Returns the commit
    rows (width: the tree's depth) and each row's path as node ids, root first, padded with its last node to
    max_depth + 1, as tree_greedy_host."""
    rows, paths = [], []
    D = tree.max_depth
    for b, tt in enumerate(tokens):
        node, path, tried = 0, [0], 0
        R = softmax_host(logits[b, 0], temperature, normalise=False)   # a new array: removals stay in it
        while True:
            for c in tree.children[node]:
                x, uc = tt[c], u[b][tried]
                tried += 1
                if uc * float(R.sum()) < R[x]:                         # accept x with probability R(x) / ΣR
                    node = c
                    break
                R = without_host(R, x)
            else:
                break                                                  # every child failed (or a leaf)
            path.append(node)
            R = softmax_host(logits[b, node], temperature, normalise=False)
        n = len(path) - 1
        rows.append([n, draw_host(R, u[b][-1]), D] + [tt[i] for i in path])
        paths.append(path + [path[-1]] * (D - n))
    return rows, paths


def without(R: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The residual after a deterministic proposal x is rejected, in the given rows (a (B,) mask): (R − δx)+, in
    place. R is kept unnormalised (acceptance divides by its total). A scatter over every row, not an index by
    the mask (which reads the mask's count back to the host)."""
    x = x[:, None]                                                     # (B, 1)
    return R.scatter_(1, x, R.gather(1, x).masked_fill_(rows[:, None], 0.0))


def tree_sampled(P: torch.Tensor, tokens: torch.Tensor, tree, generator: torch.Generator):
    """Recursive rejection over siblings (deterministic proposals, Q = δx): at each node try the children in
    rank order, accepting child x with probability R(x) / ΣR of the current residual R; a rejection removes x
    from R. When every child fails, the next token is sampled from what remains of R."""
    B, D = P.shape[0], tree.max_depth
    rows = torch.arange(B, device=P.device)
    table = tree.on(P.device).child_table                              # (N+1, width) children in rank order
    width = table.shape[1]
    node = torch.zeros(B, dtype=torch.int64, device=P.device)
    path = torch.zeros(B, D + 1, dtype=torch.int64, device=P.device)
    n = torch.zeros(B, dtype=torch.int64, device=P.device)
    R = P[:, 0].clone()                                                # residual at the current node (a copy)
    searching = torch.ones(B, dtype=torch.bool, device=P.device)
    for d in range(D):
        moved = torch.zeros(B, dtype=torch.bool, device=P.device)
        for j in range(width):
            child = table[node, j]                                     # (B,)
            trying = searching & ~moved & (child >= 0)
            x = tokens[rows, child.clamp(min=0)]
            u = torch.rand(B, generator=generator, device=P.device)
            accept = trying & (u < R[rows, x] / R.sum(-1))
            R = without(R, trying & ~accept, x)
            node = torch.where(accept, child, node)
            moved |= accept
        searching &= moved
        n += moved
        path[:, d + 1] = node
        R = torch.where(moved[:, None], P[rows, node], R)
    nxt = sample(R, generator)
    return n, nxt, path


# ---- typical acceptance (Medusa, Cai et al. 2024): lossy, an explicit opt-in --------------------------------------
# A drafted token x is accepted where the target finds it plausible: P(x) > min(ε, δ·exp(−H(P))), H the entropy of
# P at its parent. The longest accepted path wins (the first in rank order among equally long ones) and the next
# token is sampled from P at its end, with no residual: likely tokens are over-represented, so the output is NOT
# distributed as the target's. The loop applies it at temperature > 0 only (at 0 the greedy rules run).
TYPICAL_EPSILON = 0.09   # the hard threshold (Medusa's posterior_threshold)
TYPICAL_DELTA = 0.3      # the entropy-scaled one's factor, √ε (Medusa's posterior_alpha)


def typical_threshold(P: torch.Tensor) -> torch.Tensor:
    """min(ε, δ·exp(−H(P))) of probabilities P (..., V) -> (...)."""
    H = torch.special.entr(P).sum(-1)                                  # −Σ P log P, 0 log 0 = 0
    return torch.clamp(TYPICAL_DELTA * torch.exp(-H), max=TYPICAL_EPSILON)


def typical_threshold_host(p: np.ndarray) -> float:
    """typical_threshold() of one row of normalised probabilities on the host."""
    H = -float(np.dot(p, np.log(np.maximum(p, np.finfo(p.dtype).tiny))))
    return min(TYPICAL_EPSILON, TYPICAL_DELTA * float(np.exp(-H)))


def typical(P: torch.Tensor, draft: torch.Tensor, valid: torch.Tensor, generator: torch.Generator):
    """A chain (Q is not read): accept while P(x_i) passes the threshold at its position; the next token is sampled
    from P where the chain stops (the bonus token's position when all pass)."""
    gamma = draft.shape[1]
    p = P[:, :gamma].gather(-1, draft[..., None])[..., 0]              # (B, γ)  P(x_i)
    accept = (p > typical_threshold(P[:, :gamma])) & valid
    n = accept.int().cumprod(1).sum(1)                                 # (B,)
    return n, sample(P[torch.arange(len(n), device=P.device), n], generator)


def typical_host(logits: np.ndarray, tokens: list[list[int]], width: list[int], temperature: float,
                 u: list[list[float]]) -> list[list[int]]:
    """typical() on the host (top-k and top-p off), for the CPU loop (see sampled_host; u[b][-1] is the draw)."""
    rows = []
    for b, (tt, w) in enumerate(zip(tokens, width)):
        n, p = 0, softmax_host(logits[b, 0], temperature)
        while n < w and p[tt[n + 1]] > typical_threshold_host(p):
            n += 1
            p = softmax_host(logits[b, n], temperature)
        rows.append([n, draw_host(p, u[b][-1]), w] + tt[:n + 1])
    return rows


def tree_typical(P: torch.Tensor, tokens: torch.Tensor, tree, generator: torch.Generator):
    """A tree: the deepest node whose every node from the root passes (its token against its parent's P and
    threshold), the lowest node id (the first in rank order) among equally deep ones; the next token is sampled
    from P there. Returns as tree_greedy, the path padded with the root."""
    tree = tree.on(P.device)
    B, size, V = P.shape
    nodes = torch.arange(size, device=P.device)
    p = P.reshape(B, -1).gather(1, tree.parent_ids * V + tokens)       # (B, N+1)  P_parent(x_i)
    ok = p > typical_threshold(P)[:, tree.parent_ids]
    ok[:, 0] = True
    passed = (ok[:, None, :] | ~tree.mask).all(-1)                     # (B, N+1) the node and its ancestors pass
    last = torch.where(passed, tree.depth * size - nodes, -1).argmax(-1)   # (B,) the deepest, then the first
    depths = torch.arange(tree.max_depth + 1, device=P.device)
    path = (tree.mask[last][:, None, :] & (tree.depth == depths[:, None])).int().argmax(-1)   # (B, D+1)
    return tree.depth[last], sample(P[torch.arange(B, device=P.device), last], generator), path


def tree_typical_host(logits: np.ndarray, tokens: list[list[int]], tree, temperature: float,
                      u: list[list[float]]) -> tuple[list[list[int]], list]:
    """tree_typical() on the host (top-k and top-p off), depth-first in rank order over the nodes that pass (see
    tree_greedy_host): the first of the deepest; u[b][-1] is the draw."""
    rows, paths = [], []
    D = tree.max_depth
    for b, tt in enumerate(tokens):
        p, path, stack = {}, [0], [[0]]
        while stack:
            here = stack.pop()
            if len(here) > len(path):
                path = here
            node = here[-1]
            p[node] = softmax_host(logits[b, node], temperature)
            bar = typical_threshold_host(p[node])
            stack.extend(here + [c] for c in reversed(tree.children[node]) if p[node][tt[c]] > bar)
        n = len(path) - 1
        rows.append([n, draw_host(p[path[-1]], u[b][-1]), D] + [tt[i] for i in path])
        paths.append(path + [path[-1]] * (D - n))
    return rows, paths
