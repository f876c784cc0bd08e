"""Logprobs: every new token's log-probability under the target's distribution it was drawn from, accepted drafts
included, equal to the target's own (transformers' teacher-forced pass, with the processors and the temperature
applied in plain torch here, and the autoregressive run) for every method; the same in streams and in batches where
only some rows ask for them."""
from __future__ import annotations

import pytest
import torch

from conftest import export_tiny, load_prompts, tiny_model
from test_processors import processed
from specrt.decoding.generate import Generator
from specrt.decoding.sampling import SamplingParams, probs
from specrt.errors import InputError

TOL = 1e-4
TOP = 3
# the processors of each prompt of the tiny test (seed 0 none): each changes the first token's distribution too
# (the bias, and the repetition penalty over the prompt), so logprobs taken before them are caught at every position
PROCESSORS = [{}, dict(repetition_penalty=1.5, logit_bias={3: 2.0, 11: -1.5}),
              dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target whose draft model is a copy of it (its drafts are accepted) and Medusa heads."""
    from specrt.export.medusa import MedusaHeads, save_heads
    tmp = tmp_path_factory.mktemp("logprobs")
    target = tiny_model("llama", seed=1, vocab=64, init=0.3)
    torch.manual_seed(5)
    save_heads(MedusaHeads(2, target.config.hidden_size, target.lm_head.weight, target.model.embed_tokens.weight,
                           sequential=True), tmp / "heads")
    directory, model = export_tiny(tmp, "llama", seed=1, draft=target, vocab=64, init=0.3, max_seq_len=96,
                                   medusa=tmp / "heads")
    return Generator.from_engines(directory), model


def reference(model, prompt: list[int], tokens: list[int], params: SamplingParams, kw: dict) -> torch.Tensor:
    """log P of the distribution each new token was drawn from, teacher-forced through transformers (K, V). With
    processors (`kw`, generate's keywords): each position's logits processed in its context by the test's own
    reference (test_processors.processed), then the temperature, in plain torch (no top-k then)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    if kw:
        assert params.top_k == 0
        x = torch.stack([processed(row, prompt, tokens[:i], kw) for i, row in enumerate(logits)])
        return torch.log_softmax(x / (1.0 if params.greedy else params.temperature), -1).float()
    return torch.log_softmax(logits, -1) if params.greedy else torch.log(probs(logits, params))


def assert_logprobs(got, tokens: list[int], ref: torch.Tensor, top: int):
    assert [t.token for t in got] == tokens
    assert len(got) == len(ref)
    for i, (t, row) in enumerate(zip(got, ref)):
        assert abs(t.logprob - float(row[t.token])) < TOL, f"token {i}: {t.logprob} vs {float(row[t.token])}"
        assert len(t.top) == top
        best = torch.topk(row, top)
        assert [v for _, v in t.top] == pytest.approx(best.values.tolist(), abs=TOL)
        assert all(abs(v - float(row[i])) < TOL for i, v in t.top)   # each alternative's own log-probability


@pytest.mark.parametrize("method", ["autoregressive", "draft", "ngram", "medusa"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tiny_logprobs_equal_transformers(tiny, method, temperature):
    """Seed 0 with top-k at T > 0; seeds 1 and 2 with penalties and a bias (PROCESSORS)."""
    gen, model = tiny
    accepted = 0
    for seed, kw in enumerate(PROCESSORS):
        params = SamplingParams(temperature, top_k=20 if temperature and not kw else 0)
        prompt = torch.randint(0, 64, (6 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        prompt += prompt   # a repeat: prompt lookup has something to propose
        out = gen.generate(prompt_ids=prompt, max_new_tokens=24, method=method, temperature=temperature,
                           top_k=params.top_k, seed=seed, seeding="stream", logprobs=TOP, adaptive=False, **kw)
        ref = reference(model, prompt, out.token_ids[0], params, kw)
        assert_logprobs(out.logprobs[0], out.token_ids[0], ref, TOP)
        accepted += sum(out.stats["acceptance_per_position"]) > 0
    if method != "autoregressive":   # accepted drafts' logprobs were checked, not only the targets' own tokens
        assert accepted > 0, f"{method}: no draft accepted, the drafts' logprobs went untested"


def test_logprobs_refused_out_of_range(tiny):
    gen, _ = tiny
    for bad in (-1, 21):
        with pytest.raises(InputError, match=f"logprobs {bad}"):
            gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=4, logprobs=bad)


def test_off_unless_asked(tiny):
    gen, _ = tiny
    out = gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=4)
    assert out.logprobs is None
    assert all(c.logprobs is None for c in gen.stream(prompt_ids=[1, 2, 3], max_new_tokens=4))


def test_stream_chunks_carry_their_tokens_logprobs(tiny):
    gen, _ = tiny
    prompt = [5, 9, 2, 7, 5, 9, 2, 7]
    whole = gen.generate(prompt_ids=prompt, max_new_tokens=20, method="ngram", logprobs=1)
    chunks = list(gen.stream(prompt_ids=prompt, max_new_tokens=20, method="ngram", logprobs=1))
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [t for c in chunks for t in c.logprobs] == whole.logprobs[0]


def test_batch_rows_ask_for_their_own(tiny):
    """Rows with and without logprobs in one batch: each row's as it is alone."""
    gen, _ = tiny
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    alone = gen.generate(prompt_ids=prompts[0], max_new_tokens=16, method="draft", logprobs=2, adaptive=False)
    batch = gen.batch(2, method="draft", adaptive=False)
    batch.add(prompts[0], 16, owner="with", logprobs=2)
    batch.add(prompts[1], 16, owner="without")
    done = {}
    while len(done) < 2:
        batch.step()
        done.update({row.owner: (row, tokens) for row, tokens in batch.retire()})
    row, tokens = done["with"]
    assert tokens == alone.token_ids[0]
    assert [t.token for t in row.logprobs] == tokens
    assert [t.logprob for t in row.logprobs] == pytest.approx([t.logprob for t in alone.logprobs[0]], abs=TOL)
    assert done["without"][0].logprobs == []


@pytest.mark.slow
def test_smollm2_every_method_reports_the_targets_logprobs(default_generator):
    """Greedy on the real model: each method's logprobs (its accepted drafts' included) equal the autoregressive
    run's within 1e-4, alternatives too."""
    gen = default_generator
    methods = [m for m in ("draft", "ngram", "medusa", "eagle", "rest") if m in ("ngram", "rest") or gen.has(m)]
    assert len(methods) == 5, f"the default engine set lacks a drafter: {methods}"
    for prompt in load_prompts(1):
        ref = gen.generate(prompt, max_new_tokens=32, method="autoregressive", logprobs=TOP)
        for method in methods:
            out = gen.generate(prompt, max_new_tokens=32, method=method, logprobs=TOP)
            assert out.token_ids == ref.token_ids, method
            assert out.stats["method"] == method
            got, want = out.logprobs[0], ref.logprobs[0]
            assert [t.token for t in got] == out.token_ids[0]
            for a, b in zip(got, want):
                assert abs(a.logprob - b.logprob) < TOL, method
                assert [i for i, _ in a.top] == [i for i, _ in b.top], method
                assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=TOL), method
