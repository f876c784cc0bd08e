"""Logits processors that depend on a position's context: OpenAI's presence and frequency penalties, the
repetition penalty, logit_bias, and a grammar's mask (structured output, decoding/grammar.py).

Speculation stays exact under them when the target's logits at every verified position are processed with the
context that position has under autoregressive decoding: the committed tokens, then the drafted path above it (a
chain's drafts before it, a tree node's ancestors and itself). The rejection rule is then the processed target's,
whatever the drafter proposed from: a draft's Q is the distribution it was really drawn from, so leaving Q
unprocessed costs acceptance, never exactness.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from specrt.errors import InputError

MAX_BIAS = 100.0   # OpenAI's bound on a logit_bias value


@dataclass(frozen=True)
class Penalties:
    """In the order they apply: `logit_bias` added to its tokens' logits; `repetition` (transformers' and vLLM's):
    the logit of every token of the prompt or the output so far divided by it where positive, multiplied where
    negative; then OpenAI's `presence` (once per token that the output so far holds) and `frequency` (per
    occurrence there) subtracted."""
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        for name in ("presence", "frequency"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise InputError(f"{name}_penalty {value}: must be in [-2, 2] (0 turns it off)")
        if not self.repetition > 0:
            raise InputError(f"repetition_penalty {self.repetition}: must be > 0 (1 turns it off)")
        for token, bias in self.logit_bias:
            if not -MAX_BIAS <= bias <= MAX_BIAS:
                raise InputError(f"logit_bias {bias} for token {token}: must be in [-100, 100]")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1 or self.logit_bias)

    def check_vocab(self, vocab: int) -> None:
        bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab]
        if bad:
            raise InputError(f"logit_bias token ids {bad[:5]}: each must be in [0, {vocab})")


class Context:
    """A row's tokens as the penalties see them: the prompt's and the output's (a set), the output's counts."""

    def __init__(self, prompt: list[int]):
        self.seen, self.counts = set(prompt), Counter()

    def add(self, tokens: list[int]) -> None:
        self.seen.update(tokens)
        self.counts.update(tokens)


def apply(logits, penalties: Penalties, context: Context, path: list[int] = ()) -> None:
    """Process one position's logits (V,) in place (a numpy array on the CPU's host path, else a tensor), its
    context being `context` then the drafted `path`."""
    if isinstance(logits, np.ndarray):
        ids = functools.partial(np.asarray, dtype=np.int64)
        values, where = functools.partial(np.asarray, dtype=logits.dtype), np.where
    else:
        ids = functools.partial(torch.tensor, dtype=torch.int64, device=logits.device)
        values, where = functools.partial(torch.tensor, dtype=logits.dtype, device=logits.device), torch.where
    if penalties.logit_bias:
        tokens, bias = zip(*penalties.logit_bias)
        logits[ids(tokens)] += values(bias)
    if penalties.repetition != 1:
        seen = ids(sorted(context.seen.union(path)))
        x = logits[seen]
        logits[seen] = where(x > 0, x / penalties.repetition, x * penalties.repetition)
    if penalties.presence or penalties.frequency:
        counts = context.counts + Counter(path) if path else context.counts
        if counts:
            logits[ids(list(counts))] -= penalties.frequency * values(list(counts.values())) + penalties.presence


def mask(logits, allowed: np.ndarray) -> None:
    """Tokens a grammar does not allow get logit −inf, in place (logits (V,), allowed (V,) bool)."""
    if isinstance(logits, np.ndarray):
        logits[~allowed] = -np.inf
    else:
        logits.masked_fill_(~torch.from_numpy(allowed).to(logits.device), float("-inf"))


def node_paths(tokens: list[int], parent: tuple[int, ...] | None) -> list[list[int]]:
    """The drafted path of each node of a pass (tokens: the root, then the drafts): a chain's (parent None) the
    drafts up to the node, a tree's its ancestors' tokens below the root and its own, root first."""
    if parent is None:
        return [tokens[1:i + 1] for i in range(len(tokens))]
    paths = [[]]
    for i in range(1, len(tokens)):
        paths.append(paths[parent[i]] + [tokens[i]])
    return paths
