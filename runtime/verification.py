"""Verification of a drafted chain against the target: the rules of Leviathan et al. / Chen et al.

P: target probabilities at the γ+1 positions (B, γ+1, V). Q: draft probabilities at the γ drafted positions
(B, γ, V), or None for a deterministic proposal (Q = δ_x). `valid` (B, γ) marks real drafts (rows may
propose fewer than γ). Returns the number of accepted drafts per row (B,) and the token that follows them
(B,): the target's correction at the first rejection, or the bonus token when all are accepted.
"""
from __future__ import annotations

import torch


def greedy(target_logits: torch.Tensor, draft: torch.Tensor, valid: torch.Tensor):
    best = target_logits.argmax(-1)                                    # (B, γ+1)
    match = (draft == best[:, :-1]) & valid                            # (B, γ)
    n = match.int().cumprod(1).sum(1)                                  # (B,)
    return n, best.gather(1, n[:, None])[:, 0]


def residual(P_n: torch.Tensor, Q_n: torch.Tensor) -> torch.Tensor:
    """max(0, P − Q), normalised; P itself where the two are equal (rejection then has probability 0)."""
    r = torch.clamp(P_n - Q_n, min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), P_n)


def sampled(P: torch.Tensor, Q: torch.Tensor | None, draft: torch.Tensor, valid: torch.Tensor,
            generator: torch.Generator):
    B, gamma = draft.shape
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
    nxt = torch.multinomial(residual(P_n, Q_n), 1, generator=generator)[:, 0]
    return n, nxt
