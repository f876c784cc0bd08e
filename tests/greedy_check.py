"""Greedy comparison that tells a real divergence from a near tie (DESIGN.md § Testing)."""
from __future__ import annotations

import torch

TIE_GAP = 1e-3  # logits of the two competing tokens closer than this are a tie between kernels


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_tie(ours: list[int], ref: list[int], prompt: list[int], model, report: list | None = None):
    """Token-identical, or the first difference is a near tie under the reference model (the gap is
    reported); a difference in length alone (one stopped earlier) is never accepted."""
    i = first_divergence(ours, ref)
    if i is None:
        return
    assert i < min(len(ours), len(ref)), f"same tokens but lengths differ: {len(ours)} vs {len(ref)}"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:i]])).logits[0, -1].float()
    gap = abs(float(logits[ours[i]] - logits[ref[i]]))
    assert gap < TIE_GAP, (f"diverged at new token {i}: ours {ours[i]}, reference {ref[i]}, logit gap {gap:.3g} "
                           f"is not a tie")
    if report is not None:
        report.append((i, gap))
    print(f"near tie at new token {i}: logit gap {gap:.2e} (tokens {ours[i]} vs {ref[i]})")
