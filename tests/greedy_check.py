"""Greedy comparison that tells a real divergence from a near tie (DESIGN.md § Testing). Every near tie is
reported with its logit gap in the test session's summary (conftest.py), which `pytest -q` shows."""
from __future__ import annotations

import os

import torch

TIE_GAP = 1e-3  # logits of the two competing tokens closer than this are a tie between kernels
NEAR_TIES: list[str] = []   # "test id: what" for each near tie of the session
COMPARED = [0]              # greedy comparisons made


def report_tie(what: str) -> None:
    """Record a near tie for the session's summary, under the test that found it."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    NEAR_TIES.append(f"{test}: {what}")


def first_divergence(a: list[int], b: list[int]) -> int | None:
    COMPARED[0] += 1
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
    report_tie(f"near tie at new token {i}: logit gap {gap:.2e} (tokens {ours[i]} vs {ref[i]})")


def assert_greedy_under(model, prompt: list[int], ours: list[int], max_new: int, stop_ids, report: list | None = None):
    """`ours` is the reference model's greedy continuation of `prompt`, checked in one teacher-forced pass: each token
    is the model's argmax after the tokens before it, or a near tie (reported; the check goes on from our token).
    By induction this is what `generate` would give, at the cost of one forward pass instead of one per token. The
    length too: `max_new` tokens, or fewer ending at the first stop id."""
    COMPARED[0] += 1
    stops = [i for i, t in enumerate(ours) if t in stop_ids]
    assert len(ours) == max_new if not stops else stops[0] == len(ours) - 1, \
        f"{len(ours)} tokens of {max_new}, stop ids at {stops}: not where generation should end"
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ours[:-1]])).logits[0, len(prompt) - 1:].float()   # (len(ours), V)
    best = logits.argmax(-1)
    for i in (best != torch.tensor(ours)).nonzero().flatten().tolist():
        gap = float(logits[i, best[i]] - logits[i, ours[i]])
        assert gap < TIE_GAP, f"new token {i}: ours {ours[i]}, the model's argmax {int(best[i])}, logit gap {gap:.3g}"
        if report is not None:
            report.append((i, gap))
        report_tie(f"near tie at new token {i}: logit gap {gap:.2e} (tokens {ours[i]} vs {int(best[i])})")
