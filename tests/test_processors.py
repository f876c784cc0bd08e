"""Penalties, logit_bias and min-p under speculation: the output is the processed target's with every method (greedy
token-identical to a reference decoded step by step; sampled: the chi-square test against the exact processed
joint distribution), and a rule that leaves the target's verified positions unprocessed fails the same tests."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import export_tiny, load_prompts, tiny_model
from test_speculative import P_MIN, chi_square_p
from specrt.decoding.generate import Generator
from specrt.decoding.processors import Penalties, node_paths
from specrt.decoding.sampling import SamplingParams, probs
from specrt.decoding.tree import Tree
from specrt.errors import InputError

V = 24   # the exact joint distribution of the first 3 tokens is V³ sequences
N = 20000
PENALTIES = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0), dict(repetition_penalty=3.0),
             dict(logit_bias={3: 4.0, 7: -100.0}),
             dict(frequency_penalty=0.8, presence_penalty=-0.5, repetition_penalty=1.5, logit_bias={5: 2.0})]
METHODS = ["autoregressive", "draft", "ngram", "medusa"]


def ids(kw):
    return ",".join(f"{k}={v}" for k, v in kw.items())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target over V tokens, a draft model that differs from it (drafts rejected and accepted) and Medusa
    heads; peaked enough that penalties change its greedy output."""
    from specrt.export.medusa import MedusaHeads, save_heads
    tmp = tmp_path_factory.mktemp("processors")
    target = tiny_model("llama", seed=1, vocab=V, init=0.3)
    torch.manual_seed(5)
    save_heads(MedusaHeads(2, target.config.hidden_size, target.lm_head.weight, target.model.embed_tokens.weight,
                           sequential=True), tmp / "heads")
    draft = tiny_model("llama", seed=1, vocab=V, init=0.3)
    with torch.no_grad():   # the target, a little disturbed: most drafts accepted, some rejected
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    directory, model = export_tiny(tmp, "llama", seed=1, draft=draft, vocab=V, init=0.3, max_seq_len=48,
                                   medusa=tmp / "heads")
    return Generator.from_engines(directory), model


def processed(logits: torch.Tensor, prompt: list[int], out: list[int], kw: dict) -> torch.Tensor:
    """The reference: OpenAI's penalties on the output so far, transformers' repetition penalty over prompt and
    output, the bias; written out here, apart from specrt's processors."""
    x = logits.double().clone()
    for t, b in kw.get("logit_bias", {}).items():
        x[t] += b
    r = kw.get("repetition_penalty", 1.0)
    for t in set(prompt + out):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, c in Counter(out).items():
        x[t] -= kw.get("frequency_penalty", 0.0) * c + kw.get("presence_penalty", 0.0)
    return x


def reference_greedy(model, prompt: list[int], n: int, kw: dict) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(processed(logits, prompt, out, kw).argmax()))
    return out


@pytest.mark.parametrize("kw", PENALTIES, ids=ids)
def test_greedy_with_penalties_equals_the_processed_target(tiny, kw):
    gen, model = tiny
    changed = 0
    for seed in range(3):
        prompt = torch.randint(0, V, (5,), generator=torch.Generator().manual_seed(seed)).tolist() * 2
        ref = reference_greedy(model, prompt, 20, kw)
        plain = gen.generate(prompt_ids=prompt, max_new_tokens=20, method="autoregressive").token_ids[0]
        changed += plain != ref
        for method in METHODS:
            out = gen.generate(prompt_ids=prompt, max_new_tokens=20, method=method, adaptive=False, **kw)
            assert out.token_ids[0] == ref, f"{method}, prompt {prompt}"
    assert changed, "the penalties changed no output: the test would pass without them"


def test_repetition_penalty_equals_transformers_generate(tiny):
    gen, model = tiny
    prompt = [4, 9, 1, 4, 9, 1, 4]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=20, do_sample=False, repetition_penalty=2.0,
                              pad_token_id=0)[0, len(prompt):].tolist()
    for method in METHODS:
        assert gen.generate(prompt_ids=prompt, max_new_tokens=20, method=method,
                            repetition_penalty=2.0).token_ids[0] == want, method


def test_tree_node_contexts():
    """A tree node's context is its ancestors' tokens below the root and its own, not its siblings'."""
    assert node_paths([9, 1, 2, 3], None) == [[], [1], [1, 2], [1, 2, 3]]
    #        root ── 1 ── 3
    #             └─ 2 ── 4
    assert node_paths([9, 11, 12, 13, 14], (-1, 0, 0, 1, 2)) == [[], [11], [12], [11, 13], [12, 14]]


def exact_processed_joint(model, prompt: list[int], params: SamplingParams, kw: dict):
    """P(t1, t2, t3 | prompt) of the processed target, from transformers step by step."""
    with torch.no_grad():
        def step(out):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            return probs(processed(logits, prompt, out, kw).float()[None], params)[0]
        p1 = step([])
        p2 = torch.stack([step([a]) for a in range(V)])
        p3 = torch.stack([step([a, b]) for a in range(V) for b in range(V)]).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).double().numpy()


# the first token's distribution is processed too (the repetition penalty over the prompt, the bias), and differs
SAMPLED = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=2.0, logit_bias={3: 4.0})


@pytest.mark.parametrize("method, temperature", [("draft", 1.0), ("draft", 0.7), ("medusa", 1.0)])   # (medusa at 0.7:
# the same rule, 19 s a temperature: the suite's time budget)
def test_sampled_with_penalties_is_the_processed_target(tiny, method, temperature):
    """The chain rule (a sampled draft model) and the tree rule (Medusa's deterministic tree, siblings tried in
    turn) with penalties, a bias and min-p."""
    gen, model = tiny
    prompt, params = [5, 1, 7], SamplingParams(temperature=temperature, min_p=0.02)
    # three tokens: the first from the prefill, then at most two a round: drafts past depth 2 are never kept
    shape = dict(gamma=2) if method == "draft" else dict(tree_choices=Tree.from_paths([[0], [1], [2], [0, 0],
                                                                                        [0, 1], [1, 0]]))
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=N, method=method, seed=11,
                       seeding="stream", adaptive=False, temperature=temperature, min_p=0.02, **shape, **SAMPLED)
    assert 0 < out.stats["acceptance_rate"] < 0.95   # drafts accepted, and rejections (the residual) too
    joint = exact_processed_joint(model, prompt, params, SAMPLED)
    raw = exact_processed_joint(model, prompt, params, {}).sum((1, 2))
    assert abs(joint.sum((1, 2)) - raw).sum() / 2 > 0.2   # the first token's processing moves its distribution
    p = chi_square_p(out.token_ids, joint)
    print(f"{method} at T = {temperature} with penalties: chi-square p = {p:.4f}")
    assert p > P_MIN


def test_unprocessed_verification_is_caught(tiny, monkeypatch):
    """Power: the penalties applied to the first token only (verified positions left as the target's raw
    distribution, as a rule that processed only the drafts' Q would) fail the same test."""
    gen, model = tiny
    monkeypatch.setattr(Generator, "_processed", staticmethod(lambda run, logits, *a, **k: logits))
    prompt, params = [5, 1, 7], SamplingParams(temperature=1.0)
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=N, method="draft", seed=11,
                       seeding="stream", adaptive=False, temperature=1.0, **SAMPLED)
    p = chi_square_p(out.token_ids, exact_processed_joint(model, prompt, params, SAMPLED))
    print(f"unprocessed verification: chi-square p = {p:.2e}")
    assert p < P_MIN


def test_min_p_drops_the_unlikely():
    logits = torch.tensor([[0.0, 2.0, 1.0, -3.0]])
    p = probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    full = torch.softmax(logits, -1)
    kept = full[0] >= 0.3 * full.max()
    assert p[0].tolist() == pytest.approx((full[0] * kept / (full[0] * kept).sum()).tolist())
    assert p[0, 3] == 0 and p[0, 0] == 0 and p[0, 1] > 0


@pytest.mark.parametrize("kw, match", [(dict(presence_penalty=2.5), "presence_penalty 2.5"),
                                       (dict(frequency_penalty=-3), "frequency_penalty -3"),
                                       (dict(repetition_penalty=0), "repetition_penalty 0"),
                                       (dict(logit_bias={1: 101}), "logit_bias 101"),
                                       (dict(logit_bias={V: 1.0}), f"logit_bias token ids \\[{V}\\]"),
                                       (dict(min_p=1.5, temperature=1.0), "min_p 1.5")])
def test_bad_values_refused_by_name(tiny, kw, match):
    gen, _ = tiny
    with pytest.raises(InputError, match=match):
        gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=4, **kw)


@pytest.mark.slow
def test_smollm2_every_method_with_penalties(default_generator):
    """The real model, greedy, each method with a penalty equal to the autoregressive run with it."""
    gen = default_generator
    prompt = load_prompts(1)[0]
    for kw in (dict(frequency_penalty=1.0, presence_penalty=0.5), dict(repetition_penalty=1.3)):
        ref = gen.generate(prompt, max_new_tokens=32, method="autoregressive", **kw)
        assert ref.token_ids != gen.generate(prompt, max_new_tokens=32, method="autoregressive").token_ids
        for method in ("draft", "ngram", "medusa", "eagle", "rest"):
            out = gen.generate(prompt, max_new_tokens=32, method=method, **kw)
            assert out.token_ids == ref.token_ids, (method, kw)
