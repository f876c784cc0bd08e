"""Adaptive speculation length: choose γ to maximise expected tokens per unit of measured time."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specrt.engines.base import measure  # noqa: F401  (the policies' callers time passes with it)


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[N] = (1 − α^(γ+1)) / (1 − α): tokens per round with i.i.d. acceptance α."""
    if alpha >= 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


@dataclass
class Costs:
    """Measured seconds: one draft step, and one target pass over k tokens (k = 1..)."""
    draft_step: float
    verify: dict[int, float]
    _curves: dict = field(default_factory=dict, repr=False, compare=False)   # see pass_curve

    @property
    def c(self) -> float:
        return self.draft_step / self.verify[1]

    def pass_time(self, k: int) -> float:
        """A target pass over k tokens per row: measured, else between the measured sizes around k, else on the
        line through the first and last measured."""
        if k in self.verify:
            return self.verify[k]
        sizes = sorted(self.verify)
        lo, hi = sizes[0], sizes[-1]
        if lo < k < hi:
            lo = max(s for s in sizes if s < k)
            hi = min(s for s in sizes if s > k)
        return self.verify[lo] + (self.verify[hi] - self.verify[lo]) * (k - lo) / max(1, hi - lo)

    def pass_curve(self, n: int) -> np.ndarray:
        """Passes over 2 .. n + 1 tokens (trees of 1 .. n nodes and their root), a larger one never counted as
        cheaper than a smaller (measured passes jitter); made once per n while the measured sizes stay."""
        key = (n, len(self.verify))
        curve = self._curves.get(key)
        if curve is None:
            curve = self._curves[key] = np.maximum.accumulate([self.pass_time(k + 1) for k in range(1, n + 1)])
        return curve

    def round_time(self, gamma: int) -> float:
        return gamma * self.draft_step + self.verify[gamma + 1]

    def predicted_speedup(self, alpha: float, gamma: int) -> float:
        """E[N] / (γc + verify(γ+1)/verify(1)): the speedup over plain decoding that α and the costs predict."""
        return expected_tokens(alpha, gamma) * self.verify[1] / self.round_time(gamma)



@dataclass
class GammaPolicy:
    """γ for the next round from the running acceptance α and the measured costs, maximising expected tokens
    per second. γ = 0 (a plain target step) wins when the drafter does not pay for itself; then a round still
    speculates with γ = 1 after `probe_every` plain ones, so that α keeps being measured and speculation resumes
    when the text turns predictable; after twice as many each time a probe leaves plain steps winning (up to 8 ×
    `probe_every`), back to `probe_every` once drafts pay, as TreePolicy's probes. (A probe of the draft model at 8
    rows, its catch-up over the skipped tokens, a step and a wider pass, cost about two plain rounds on 2 cores: one
    every 8 rounds cost a server's sampled `auto` 8–12 %.)"""
    costs: Costs
    max_gamma: int
    prior_alpha: float = 0.6
    prior_weight: float = 4.0
    probe_every: int = 8
    accepted: float = 0.0
    proposed: float = 0.0
    idle: int = 0
    backoff: int = 1
    chosen: list[int] = field(default_factory=list)

    @property
    def alpha(self) -> float:
        """Running acceptance estimate, shrunk toward the prior while little has been seen."""
        return (self.accepted + self.prior_alpha * self.prior_weight) / (self.proposed + self.prior_weight)

    def update(self, accepted: int, proposed: int) -> None:
        self.accepted += accepted
        self.proposed += proposed

    def rate(self, gamma: int) -> float:
        """Expected tokens per second of a round of γ drafts (γ = 0: a plain step)."""
        if gamma == 0:
            return 1.0 / self.costs.verify[1]
        return expected_tokens(min(self.alpha, 0.999), gamma) / self.costs.round_time(gamma)

    def choose(self) -> int:
        best = max(range(self.max_gamma + 1), key=self.rate)
        if best == 0:
            best = int(self._probe())
        else:
            self.idle, self.backoff = 0, 1
        self.chosen.append(best)
        return best

    def _probe(self) -> bool:
        """A round where plain steps win: whether it probes (see the class)."""
        self.idle += 1
        if self.idle < self.probe_every * self.backoff:
            return False
        self.idle, self.backoff = 0, min(self.backoff * 2, 8)
        return True

    def saturated(self) -> bool:
        """Whether no acceptance pays for a draft at these costs: γ + 1 tokens, each draft accepted, in a round that
        costs more than γ + 1 plain steps (a large batch on a CPU). Then no round drafts, not even a probe."""
        step = self.costs.verify[1]
        return all((g + 1) * step <= self.costs.round_time(g) for g in range(1, self.max_gamma + 1))

    def choose_rows(self, alphas: list[float | None], probing: list[bool]) -> tuple[int, list[bool]]:
        """Per-row budgets: γ for the round and which rows draft, from each row's own acceptance α_r (None: the row
        takes no part). A row drafts where its γ drafts pay for the round they widen at the batch's costs,
        E[N](α_r, γ) · verify(1) ≥ round_time(γ), or where it probes (`probing`: its acceptance is measured anew);
        the others take a plain step in the same pass. γ maximises the batch's expected tokens per second: E[N] of
        each drafting row, 1 of each other. No γ where a row drafts: a plain round, probing as choose() does."""
        costs, step, live = self.costs, self.costs.verify[1], [a is not None for a in alphas]
        best, best_rate, best_rows = 0, live.count(True) / step, [False] * len(alphas)
        for g in range(1, self.max_gamma + 1):
            t = costs.round_time(g)
            gains = [expected_tokens(min(a, 0.999), g) if a is not None else 0.0 for a in alphas]
            rows = [e * step >= t for e in gains]
            rate = sum(e if r else float(a) for e, r, a in zip(gains, rows, live)) / t
            if any(rows) and rate > best_rate:
                best, best_rate, best_rows = g, rate, rows
        if best == 0:
            if self._probe():
                best, best_rows = 1, live
        else:
            self.idle, self.backoff = 0, 1
            best_rows = [r or (p and a) for r, p, a in zip(best_rows, probing, live)]
        self.chosen.append(best)
        return best, best_rows


@dataclass
class TreePolicy:
    """A tree round or a plain step, whichever gives more tokens per second as measured in this loop: wall time of
    whole rounds (drafter, target pass and host work) and tokens per row, as running means that forget at
    `decay` per round (a few dozen rounds: a tree's tokens per round vary too much from round to round for a
    shorter memory), so that the choice follows the text. The first `warmup` rounds grow trees, then one plain
    step is timed. Trees stop when their rate falls below `margin` times the plain rate (a near tie keeps
    speculating: the rates are noisy); while plain steps win, a probe round still grows a tree to keep the tree's
    figures current: after `probe_every` plain steps, then after twice as many each time a probe does not pay
    (up to 8 × `probe_every`), back to `probe_every` once trees pay again. A round's first pass of a new shape
    pays one-time costs: the first tree round is not timed.

    A request starts from the last one's figures (`following`), each worth at most `memory` rounds, and still warms
    up: its first rounds are judged together with what came before, not alone (from nothing, 3 warm-up rounds of one
    token each sent whole answers to plain steps, on prompts where trees then paid 1.2–1.5×), while its own rounds
    soon outweigh a figure that a slow spell of the last request dragged down (carried over whole, such a figure
    kept one bench run's EAGLE in plain steps for 98 % of its rounds)."""
    warmup: int = 3
    probe_every: int = 8
    decay: float = 0.97
    margin: float = 0.95
    memory: float = 4.0
    tree_rounds: int = 0
    plain_rounds: int = 0
    idle: int = 0
    backoff: int = 1
    sums: dict = field(default_factory=lambda: {"tokens": [0.0, 0.0], "tree": [0.0, 0.0], "plain": [0.0, 0.0]})

    def following(self) -> "TreePolicy":
        """The next request's policy: this one's figures, each worth at most `memory` rounds."""
        sums = {k: [t * min(1.0, self.memory / w), min(w, self.memory)] if w else [t, w]
                for k, (t, w) in self.sums.items()}
        return TreePolicy(self.warmup, self.probe_every, self.decay, self.margin, self.memory, sums=sums)

    def mean(self, name: str) -> float:
        """The decayed mean (Σ decay^age · x) / (Σ decay^age): no bias toward the first rounds."""
        total, weight = self.sums[name]
        return total / weight

    def _add(self, name: str, x: float) -> None:
        total, weight = self.sums[name]
        self.sums[name] = [self.decay * total + x, self.decay * weight + 1.0]

    def choose(self) -> bool:
        """True: grow a tree this round; False: a plain step."""
        if self.tree_rounds <= max(1, self.warmup):
            return True
        if self.plain_rounds == 0:
            return False
        gain = self.mean("tokens") / self.mean("tree") * self.mean("plain")      # tree rate / plain rate
        if gain >= (self.margin if self.idle == 0 else 1.0):
            self.idle, self.backoff = 0, 1
            return True
        self.idle += 1
        if self.idle < self.probe_every * self.backoff:
            return False
        self.idle, self.backoff = 1, min(self.backoff * 2, 8)   # each failed probe waits twice as long (to 64)
        return True

    def update(self, tree: bool, tokens: float, seconds: float) -> None:
        """A finished round: tokens per live row (accepted drafts + 1) and its wall time."""
        if tree:
            if self.tree_rounds:
                self._add("tokens", tokens)
                self._add("tree", seconds)
            self.tree_rounds += 1
        else:
            self._add("plain", seconds)
            self.plain_rounds += 1
