"""`specrt verify`: check the losslessness promise on the user's own engines.

1. Greedy: the method's output is token-identical to the target's own greedy output on a few prompts; a
   difference is reported with the target's logit gap at that step (a near tie between kernels, or a bug).
2. Sampling: many sequences of a few tokens are drawn with the method; for the most frequent prefixes the
   next token's counts are compared (chi-square) with the exact target distribution at that prefix. A sequence
   that ends at an end-of-sequence token keeps it as the outcome at its position (nothing follows it).

The verdict is PASS only where both checks ran: a check that did not run (no prompt, no samples asked for, or no
prefix whose next token has two outcomes likely enough to count) is reported as not tested, never as passed.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.stats import chisquare

from specrt.decoding.sampling import SamplingParams, probs

TIE_GAP = 1e-3
END = -1   # no token: the sequence ended (at an end-of-sequence token) before this position


@dataclass
class Report:
    greedy: list[dict] = field(default_factory=list)
    tests: list[dict] = field(default_factory=list)       # the chi-square tests that ran
    untested: list[str] = field(default_factory=list)     # what could not be tested, and why

    @property
    def verdict(self) -> str:
        """FAIL where a check found a difference; NOT TESTED where either check did not run, whatever the reason
        (none asked for, or none could run); else PASS."""
        if not all(g["ok"] for g in self.greedy) or any(t["p_value"] <= t["alpha"] for t in self.tests):
            return "FAIL"
        if not self.greedy or not self.tests:
            return "NOT TESTED"
        return "PASS"

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"


def next_token_logits(gen, ids: list[int]) -> torch.Tensor:
    """The target's logits after `ids`, from a fresh one-row pass of its engine."""
    return gen.target.run_sequence(ids).logits[0, -1].to("cpu", copy=True)  # the engine reuses its buffer


def check_greedy(gen, prompts: list[list[int]], method: str, max_new_tokens: int, **kw) -> list[dict]:
    rows = []
    for ids in prompts:
        ref = gen.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, method=method, adaptive=False,
                           **kw).token_ids[0]
        diverge = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
        row = {"prompt_tokens": len(ids), "tokens": len(ref), "identical": out == ref, "ok": out == ref}
        if diverge is not None:
            logits = next_token_logits(gen, ids + ref[:diverge])
            gap = abs(float(logits[out[diverge]] - logits[ref[diverge]]))
            row.update(diverged_at=diverge, logit_gap=gap, ok=gap < TIE_GAP)
        elif len(out) != len(ref):
            row["ok"] = False
        rows.append(row)
    return rows


def chunk_for(vocab: int) -> int:
    """Sequences a sampling check draws in one batch: 256, fewer for a large vocabulary, so that a round's logits
    and their copies (rows × the proposal's positions × vocabulary) stay within a few GB: Gemma 3's 262,144 ids
    in batches of 256 took 22 GB with rest's trees."""
    return max(8, min(256, 2**24 // vocab))


def draw(gen, ids: list[int], method: str, params: SamplingParams, samples: int, depth: int,
         chunk: int | None = None, **kw) -> list[tuple[int, ...]]:
    """`samples` sequences of `depth` new tokens after `ids`, in batches of `chunk` (default: chunk_for the
    target's vocabulary); one that ends early (at an end-of-sequence token, which stays as its last token) is padded
    with END."""
    chunk = chunk or chunk_for(gen.target.spec["vocab_size"])
    seqs = []
    for start in range(0, samples, chunk):
        n = min(chunk, samples - start)
        seed = None if params.seed is None else params.seed + start
        out = gen.generate(prompt_ids=ids, max_new_tokens=depth, temperature=params.temperature,
                           top_k=params.top_k, top_p=params.top_p, seed=seed, num_return_sequences=n,
                           method=method, adaptive=False, acceptance=params.acceptance, **kw)
        seqs += [tuple(t) + (END,) * (depth - len(t)) for t in out.token_ids]
    return seqs


def check_sampling(gen, ids: list[int], method: str, params: SamplingParams, samples: int, depth: int,
                   prefixes: int, alpha: float, chunk: int | None = None, **kw) -> tuple[list[dict], list[str]]:
    """Chi-square of the next-token counts at the most frequent prefixes against the exact target
    distribution there (bins expected below 5 are pooled; the end-of-sequence token is an outcome like any
    other). -> (the tests, what could not be tested and why)."""
    seqs = draw(gen, ids, method, params, samples, depth, chunk, **kw)
    tests, untested = [], []
    if depth < 2:
        untested.append(f"--depth {depth}: the first token comes from the prefill, not from a drafter; the test "
                        "needs a depth of at least 2")
    for d in range(1, depth):  # position 0 comes from the prefill, not from a drafter
        counts = Counter(s[:d] for s in seqs if END not in s[:d + 1])
        if not counts:
            untested.append(f"position {d}: every sequence ended before it")
        for prefix, total in counts.most_common(prefixes):
            observed = Counter(s[d] for s in seqs if s[:d] == prefix and s[d] != END)
            P = probs(next_token_logits(gen, ids + list(prefix)), params).double().numpy()
            expected = P * total
            big = expected >= 5
            obs = np.array([observed.get(int(t), 0) for t in np.flatnonzero(big)] +
                           [total - sum(observed.get(int(t), 0) for t in np.flatnonzero(big))], float)
            exp = np.append(expected[big], expected[~big].sum())
            if exp[-1] < 1e-9:
                obs, exp = obs[:-1], exp[:-1]
            if len(exp) < 2:
                untested.append(f"position {d} after {list(prefix)}: {total} samples, the next token has one outcome "
                                "expected 5 times or more (nothing to compare)")
                continue
            p = float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
            impossible = sum(c for t, c in observed.items() if P[t] == 0)
            tests.append({"position": d, "prefix": list(prefix), "samples": total, "bins": len(exp),
                          "p_value": 0.0 if impossible else p, "alpha": alpha})
    return tests, untested


def compare_engines(gen, other, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """Greedy output of two engine sets' targets (e.g. int4 and float32 weights) on the same prompts: where
    they first differ, and each target's logit gap there (its own token's logit minus the other's token's).
    Speculation is lossless with respect to the target it runs, so this is the whole cost of quantizing it."""
    rows = []
    for ids in prompts:
        a = gen.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, method="autoregressive").token_ids[0]
        b = other.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, method="autoregressive").token_ids[0]
        diverge = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        row = {"prompt_tokens": len(ids), "tokens": min(len(a), len(b)), "identical": a == b,
               "diverged_at": diverge}
        if diverge is not None:
            prefix = ids + a[:diverge]
            la, lb = next_token_logits(gen, prefix), next_token_logits(other, prefix)
            row["logit_gap"] = float(la[a[diverge]] - la[b[diverge]])
            row["other_logit_gap"] = float(lb[b[diverge]] - lb[a[diverge]])
        rows.append(row)
    return rows
