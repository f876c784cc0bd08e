"""Adaptive speculation length: choose γ to maximise expected tokens per unit of measured time."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


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

    @property
    def c(self) -> float:
        return self.draft_step / self.verify[1]

    def round_time(self, gamma: int) -> float:
        return gamma * self.draft_step + self.verify[gamma + 1]

    def predicted_speedup(self, alpha: float, gamma: int) -> float:
        """E[N] / (γc + verify(γ+1)/verify(1)): the speedup over plain decoding that α and the costs predict."""
        return expected_tokens(alpha, gamma) * self.verify[1] / self.round_time(gamma)


def measure(fn, reps: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@dataclass
class GammaPolicy:
    """γ for the next round from the running acceptance α and the measured costs, maximising expected tokens
    per second. γ = 0 (a plain target step) wins when the drafter does not pay for itself; then every
    `probe_every`-th round still speculates with γ = 1, so that α keeps being measured and speculation resumes
    when the text turns predictable."""
    costs: Costs
    max_gamma: int
    prior_alpha: float = 0.6
    prior_weight: float = 4.0
    probe_every: int = 8
    accepted: float = 0.0
    proposed: float = 0.0
    idle: int = 0
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
            self.idle += 1
            if self.idle % self.probe_every == 0:
                best = 1
        else:
            self.idle = 0
        self.chosen.append(best)
        return best
