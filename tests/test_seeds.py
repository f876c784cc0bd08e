"""A seed fixes the tokens, whatever the method (issue: seeds that reproduce): each position is sampled by the
exponential race (the Gumbel-max rule) with noise keyed by the seed and the position (sampling.seeded_pick), drafts
are checked against that pick, and drafters that sample draft with the same noise. The same tokens for every method,
γ, tree and batch neighbours; over seeds, the target's distribution (chi-square) for every method."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import export_tiny_with_drafters
from specrt.decoding import sampling
from specrt.decoding.generate import Generator
from specrt.decoding.sampling import SamplingParams
from test_speculative import N, P_MIN, chi_square_p, exact_joint

V = 24
SEEDED = dict(temperature=0.8, seed=7)
METHODS = {"autoregressive": {}, "draft": dict(gamma=3), "draft-tree": dict(method="draft", tree=True),
           "ngram": {}, "medusa": {}, "eagle": {}, "rest": {}, "auto": {}}


def method_options(name: str) -> dict:
    kw = dict(METHODS[name])
    kw.setdefault("method", name)
    return kw


def test_noise_depends_on_the_seed_and_the_position_only():
    """Exp(1) draws, distinct per seed, copy and position, the same on every call."""
    a = sampling.noise((7, 0), 5, 1000)
    assert np.array_equal(a, sampling.noise((7, 0), 5, 1000)) and a.dtype == np.float32 and (a > 0).all()
    for other in (sampling.noise((8, 0), 5, 1000), sampling.noise((7, 1), 5, 1000), sampling.noise((7, 0), 6, 1000)):
        assert np.abs(np.corrcoef(a, other)[0, 1]) < 0.1
    assert abs(a.mean() - 1) < 0.1 and abs(a.var() - 1) < 0.2


def test_a_seed_gives_the_same_tokens_with_every_method(default_generator):
    """The default engine set, T = 0.8: every method (adaptive, so γ and trees follow the clock) and a chain at a
    fixed γ = 1 give the autoregressive tokens of the seed; another seed other tokens."""
    gen = default_generator
    prompt = gen.encode("Write a short story about a lighthouse keeper.")
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="autoregressive", **SEEDED).token_ids[0]
    accepted = {}
    for name in METHODS:
        out = gen.generate(prompt_ids=prompt, max_new_tokens=12, **method_options(name), **SEEDED)
        assert out.token_ids[0] == ref, name
        accepted[name] = out.stats["acceptance_rate"]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="draft", gamma=1, adaptive=False, **SEEDED)
    assert out.token_ids[0] == ref
    assert accepted["draft"] > 0 and accepted["eagle"] > 0   # drafts were accepted: verification really ran
    other = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="autoregressive", temperature=0.8, seed=8)
    assert other.token_ids[0] != ref


@pytest.mark.parametrize("neighbours", [1, 4, 8])
def test_a_seed_gives_the_same_tokens_beside_any_neighbours(default_generator, neighbours):
    """A seeded request in a batch with 1, 4 or 8 other seeded requests (other prompts, other seeds, shorter, in the
    rows before it: it moves into a lower row as they finish) gives its tokens alone."""
    gen = default_generator
    prompt = gen.encode("Name three rivers in Europe.")
    alone = gen.generate(prompt_ids=prompt, max_new_tokens=8, method="draft", **SEEDED).token_ids[0]
    batch = gen.batch(neighbours + 1, 96, method="draft", **SEEDED)
    for i in range(neighbours):
        batch.add(gen.encode(f"Count to {i + 3}."), 3 + i, owner=i, seed=100 + i)
    batch.step()
    batch.add(prompt, 8, owner="subject")
    out = {}
    while batch.run.batch:
        batch.step()
        out.update({row.owner: tokens for row, tokens in batch.retire()})
    assert out["subject"] == alone and len(out) == neighbours + 1


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    directory, model = export_tiny_with_drafters(tmp_path_factory.mktemp("seeds"), V, 64, medusa_heads=3)
    return Generator.from_engines(directory), model


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)], ids=str)
def test_seeded_sampling_is_the_target_distribution(drafters, kw):
    """Over seeds (one per returned sequence: its key is (seed, copy)), the first three tokens follow the target's
    joint distribution: at T = 1 by the host's rules, at T = 0.7 with top-p 0.9 by the tensor rules."""
    gen, model = drafters
    prompt = [5, 1, 7]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=N // 2, seed=11,
                       method="autoregressive", **kw)
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(**kw)))
    print(f"seeded {kw}: chi-square p = {p:.4f}")
    assert p > P_MIN


@pytest.mark.parametrize("method", ["draft", "draft-tree", "medusa", "eagle"])
def test_every_method_samples_the_same_tokens_for_each_seed(drafters, method):
    """On the tiny set, 300 seeded sequences of 8 tokens per method, fixed speculation, at T = 1 and at T = 0.7
    with top-p 0.9: token for token those of autoregressive decoding with the same keys (so each method's samples
    are the ones the chi-square above passes), and drafts were accepted (the draft model is another random model:
    few of its drafts are)."""
    gen, _ = drafters
    for kw in (dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)):
        options = dict(prompt_ids=[5, 1, 7], max_new_tokens=8, num_return_sequences=300, seed=11, **kw)
        ref = gen.generate(method="autoregressive", **options).token_ids
        out = gen.generate(adaptive=False, **method_options(method), **options)
        assert out.token_ids == ref, (method, kw)
        assert out.stats["acceptance_rate"] > 0, (method, kw)
