"""Sampling parameters and the one transform applied to target (P) and draft (Q) logits alike."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specrt.errors import InputError

SEEDING = ("position", "stream")    # what a seed fixes (SamplingParams.seeding)
ACCEPTANCE = ("exact", "typical")   # the verification rules: exact (the target's distribution) or Medusa's typical
# Below it, logits / temperature can overflow float32 (1e-39 does: NaN probabilities, an id out of the vocabulary);
# sampling there is greedy decoding but for exact ties.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 100.0   # above it: an InputError (SamplingParams); the server takes 0 to 2, as OpenAI does


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0   # 0: greedy
    top_k: int = 0             # 0: off
    top_p: float = 1.0         # 1: off
    seed: int | None = None
    acceptance: str = "exact"  # "typical": Medusa's typical acceptance (lossy, see verification.typical)
    min_p: float = 0.0         # 0: off; else tokens below min_p × the most likely token's probability are dropped
    seeding: str = "position"  # what a seed fixes: "position", each position's draw (`seeded`), or "stream", the
    #                            rejection rules' random stream (the same tokens only with the same method and choices)

    def __post_init__(self):
        if not self.temperature >= 0:
            raise InputError(f"temperature {self.temperature}: must be >= 0 (0 means greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InputError(f"temperature {self.temperature:g}: between 0 and {MIN_TEMPERATURE:g} the logits divided "
                             "by it overflow float32, and sampling at it is greedy decoding: send 0 for greedy")
        if not self.temperature <= MAX_TEMPERATURE:   # (nan and inf too)
            raise InputError(f"temperature {self.temperature:g}: at most {MAX_TEMPERATURE:g} (1 / T rounds to 0 in "
                             "float32 past 3e38, and a masked logit, -inf, times 0 is NaN; at 100 the distribution is "
                             "all but uniform already): send a temperature of 0 to 2, as OpenAI's API takes")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p {self.top_p}: must be in (0, 1] (1 turns it off)")
        if self.top_k < 0:
            raise InputError(f"top_k {self.top_k}: must be >= 0 (0 turns it off)")
        if not 0 <= self.min_p <= 1:
            raise InputError(f"min_p {self.min_p}: must be in [0, 1] (0 turns it off)")
        if self.seeding not in SEEDING:
            raise InputError(f"seeding {self.seeding!r}: choose position (the default: a seed gives the same tokens "
                             "with every method) or stream (it seeds the rejection rules' random draws)")
        if self.acceptance not in ACCEPTANCE:
            raise InputError(f"acceptance {self.acceptance!r}: choose exact (the default: the target's distribution) "
                             "or typical (Medusa's typical acceptance: faster at temperature > 0, not the target's "
                             "distribution)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def seeded(self) -> bool:
        """Each row's tokens are a function of its seed (see `seeded_pick`): exact sampling at temperature > 0 with
        a seed. Verification then takes the greedy rules over the seeded picks, whatever the method drafted."""
        return self.seed is not None and self.temperature > 0 and self.acceptance == "exact" and \
            self.seeding == "position"

    @property
    def typical(self) -> bool:
        """Typical acceptance applies: asked for, at temperature > 0 (at 0 it is greedy decoding, exact)."""
        return self.acceptance == "typical" and self.temperature > 0

    @property
    def plain(self) -> bool:
        """Sampling from the temperature alone (top-k, top-p and min-p off): the CPU loop's host rules."""
        return self.temperature > 0 and not self.top_k and self.top_p == 1 and not self.min_p

    def generator(self, device="cpu") -> torch.Generator:
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then min-p, over the last axis; returns normalised probabilities
    (float32)."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(p, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p          # mass strictly above each token
        drop = before >= params.top_p                    # keep the smallest prefix reaching top_p
        drop[..., 0] = False                             # top-1 always (a top_p that float32 rounds to 0 too)
        p = p.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        p = p / p.sum(-1, keepdim=True)
    if params.min_p:
        p = p.masked_fill(p < params.min_p * p.amax(-1, keepdim=True), 0.0)   # the most likely always stays
        p = p / p.sum(-1, keepdim=True)
    return p


def argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last axis (first of equal maxima, as torch's). On the CPU through numpy: its vectorised
    argmax takes ~0.03 ms for a few 49,152-wide rows where torch's takes ~0.7 ms, once or twice a round."""
    if x.device.type != "cpu":
        return x.argmax(-1)
    return torch.from_numpy(np.asarray(x.detach().numpy().argmax(-1)))


def top_k_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries over the last axis, largest first (the drafters' candidates). On the CPU,
    k numpy argmaxes: ~0.2 ms for four 49,152-wide rows where torch.topk takes ~0.6 ms."""
    if x.device.type != "cpu" or k > 8:
        return torch.topk(x, k, dim=-1).indices
    a = x.detach().numpy()
    ids = [a.argmax(-1)]
    if k > 1:
        a = a.copy()
        for _ in range(k - 1):
            np.put_along_axis(a, ids[-1][..., None], -np.inf, -1)
            ids.append(a.argmax(-1))
    out = np.stack(ids, -1)
    if k > 1 and np.isneginf(np.take_along_axis(a, out[..., -1:], -1)).any():
        return torch.topk(x, k, dim=-1).indices  # a row with fewer than k finite entries: keep the ids distinct
    return torch.from_numpy(out)


def top_k_in_place(row: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    """The k largest entries of a 1-D array, largest first (the first of equal maxima first): their indices and
    values, each set to -inf in the row once taken (k vectorised argmaxes, no copy of the row)."""
    ids, values = [], []
    for _ in range(k):
        ids.append(int(row.argmax()))
        values.append(row[ids[-1]])
        row[ids[-1]] = -np.inf
    return ids, values


def softmax_host(row: np.ndarray, temperature: float, normalise: bool = True) -> np.ndarray:
    """softmax(row / temperature) of one row of logits (a numpy view on the CPU) as a new float32 array; with
    normalise=False the weights exp((row − max) / temperature), as draw_host takes them."""
    e = row - row.max()
    e *= np.float32(1 / temperature)
    np.exp(e, out=e)
    if normalise:
        e /= e.sum()
    return e


def draw_host(weights: np.ndarray, u: float, block: int = 128) -> int:
    """The inverse CDF of nonnegative weights (not necessarily normalised) at a uniform u in [0, 1): sample()'s
    law; a weight of 0 is never drawn. The CDF is walked by blocks of `block` entries (numpy's cumsum over a whole
    49,152-wide row takes ~160 µs, a block's sums ~20)."""
    starts = np.arange(0, len(weights), block)
    ends = np.cumsum(np.add.reduceat(weights, starts))                 # the CDF at each block's end
    x = min(u * ends[-1], np.nextafter(ends[-1], 0))                   # strictly below the total
    b = int(np.searchsorted(ends, x, side="right"))                    # the block where the CDF passes x
    part = weights[starts[b]:starts[b] + block]
    i = min(int(np.searchsorted(np.cumsum(part) + (ends[b - 1] if b else 0), x, side="right")), len(part) - 1)
    while part[i] == 0:   # only where rounding pushed x to the block's end: its last entry of nonzero weight
        i -= 1
    return int(starts[b]) + i


def noise(key: tuple[int, int], index: int, size: int) -> np.ndarray:
    """Exp(1) draws E, one per token of the vocabulary, for the token at sequence position `index` of the row
    whose seed key is `key` (its request's seed, its copy): Philox counter-based streams (the key is the seed, the
    position a word of the counter of its own), so the draws depend on nothing but the seed and the position: not
    on the method, the drafts, the round or the batch. ~0.3 ms for 49,152 tokens."""
    seed, copy = key
    g = np.random.Generator(np.random.Philox(key=(seed % 2 ** 64) + (copy << 64), counter=index << 64))
    return np.maximum(g.standard_exponential(size, dtype=np.float32), np.float32(1e-30))   # never 0: w / E


def seeded_pick(weights, e) -> int:
    """The exponential race argmax(w / E) (the Gumbel-max rule: argmax(log w − log E)) of one row of nonnegative
    weights w (numpy, not necessarily normalised) and noise E: a token drawn with probability w / Σw when E is
    fresh Exp(1), a deterministic function of the two otherwise. A weight of 0 is never picked."""
    return int((weights / e).argmax())


def sample(p: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of p (..., V), which need not be normalised -> (...). Inverse CDF with one uniform per
    row: a token of probability 0 is never drawn (torch.multinomial, the same law, takes ~1.2 ms for one
    49,152-wide row here; this ~0.07 ms)."""
    flat = p.reshape(-1, p.shape[-1])
    cdf = flat.cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=generator, device=p.device, dtype=cdf.dtype) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # strictly below the total
    return torch.searchsorted(cdf, u, right=True).view(p.shape[:-1])


MAX_LOGPROBS = 20   # the most alternatives a token's logprobs list (OpenAI's bound)


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the distribution it was drawn from (the target's, after the
    temperature, top-k and top-p: OpenAI's; at temperature 0 the target's plain softmax), and the `top` most likely
    tokens there as (id, log-probability), most likely first."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_logprobs(n: int | None) -> None:
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise InputError(f"logprobs {n}: the number of alternatives per token must be in [0, {MAX_LOGPROBS}] "
                         "(None turns logprobs off)")


def token_logprobs(logits, tokens: list[int], params: SamplingParams, top: int) -> list[TokenLogprob]:
    """The TokenLogprobs of `tokens`, token i emitted from the target's logits row i (K, V) (a tensor or a numpy
    view of the engine's buffer, read now)."""
    x = torch.as_tensor(logits).float()                                                     # (K, V)
    lp = torch.log_softmax(x, -1) if params.greedy else torch.log(probs(x, params))
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if top:
        best = torch.topk(lp, top, dim=-1)
        pairs = [tuple(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
    else:
        pairs = [()] * len(tokens)
    return [TokenLogprob(t, c, p) for t, c, p in zip(tokens, chosen, pairs)]
