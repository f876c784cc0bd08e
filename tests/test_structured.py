"""Structured output under speculation: a grammar masks the target's distribution at every verified node, so
greedy output equals constrained autoregressive decoding (and a step-by-step reference through transformers) with
every method, answers parse and validate, rows with different grammars or none share a batch, a sampled answer
under a schema is still a valid one, no draft outside the grammar is verified, and on a tiny model with a tokenizer
of its own the chi-square test against the exact masked distribution passes."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from conftest import export_tiny, tiny_model
from test_speculative import P_MIN, chi_square_p
from specrt.decoding.generate import Generator
from specrt.decoding.grammar import Matcher, compile_grammar
from specrt.errors import InputError

METHODS = ["autoregressive", "draft", "ngram", "medusa", "eagle", "rest"]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "city": {"enum": ["Paris", "Rome", "Oslo"]}}}
ORDER = {"type": "object", "additionalProperties": False, "required": ["items", "total"],
         "properties": {"items": {"type": "array", "maxItems": 3, "items": {
             "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
             "properties": {"sku": {"type": "string", "maxLength": 8}, "qty": {"type": "integer"}}}},
             "total": {"type": "number"}}}
CASES = [("Give a JSON record of a person with name, age and city.", PERSON),
         ("Write a small shop order as JSON.", ORDER)]


@pytest.mark.slow
@pytest.mark.parametrize("prompt, schema", CASES, ids=["person", "order"])
def test_every_method_equals_constrained_autoregressive(default_generator, prompt, schema):
    gen = default_generator
    ref = gen.generate(prompt, max_new_tokens=96, method="autoregressive", grammar=("json_schema", schema))
    assert ref.stats["stop_reason"] == "eos", ref.text
    jsonschema.validate(json.loads(ref.text[0]), schema)
    for method in METHODS[1:] if schema is PERSON else ["draft", "eagle"]:   # the longer answer: two drafters
        out = gen.generate(prompt, max_new_tokens=96, method=method, grammar=("json_schema", schema))
        assert out.token_ids == ref.token_ids, method
        assert out.stats["method"] == method


@pytest.mark.slow
def test_constrained_greedy_equals_a_reference_through_transformers(default_generator, smollm2):
    """The reference: transformers' model one step at a time, its logits masked by the grammar's own matcher."""
    gen = default_generator
    grammar = gen.grammar("json_schema", PERSON)
    ids = gen.encode(CASES[0][0])
    ours = gen.generate(prompt_ids=ids, max_new_tokens=40, method="eagle", grammar=grammar).token_ids[0]
    matcher, ref = Matcher(grammar, gen.target.spec["vocab_size"], smollm2.eos_token_ids), []
    with torch.no_grad():
        out = smollm2.model(torch.tensor([ids]), use_cache=True)
        while len(ref) < len(ours):
            logits = out.logits[0, -1].clone()
            logits[~torch.from_numpy(matcher.allowed())] = float("-inf")
            ref.append(int(logits.argmax()))
            assert matcher.advance(ref[-1:]) == 1
            out = smollm2.model(torch.tensor([ref[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    assert ours == ref


@pytest.mark.slow
def test_rows_with_different_grammars_share_a_batch(default_generator):
    gen = default_generator
    grammars = [gen.grammar("json_schema", PERSON), gen.grammar("regex", r"(yes|no)\."), None]
    prompt = gen.encode(CASES[0][0])
    alone = [gen.generate(prompt_ids=prompt, max_new_tokens=48, method="draft", grammar=g).token_ids[0]
             for g in grammars]
    batch = gen.batch(3, method="draft")
    for i, g in enumerate(grammars):
        batch.add(prompt, 48, owner=i, grammar=g)
    done = {}
    while len(done) < 3:
        batch.step()
        done.update({row.owner: tokens for row, tokens in batch.retire()})
    assert [done[i] for i in range(3)] == alone
    jsonschema.validate(json.loads(gen.tokenizer.decode(done[0], skip_special_tokens=True)), PERSON)
    assert gen.tokenizer.decode(done[1], skip_special_tokens=True) in ("yes.", "no.")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_sampled_answers_validate(default_generator, method):
    gen = default_generator
    out = gen.generate(CASES[0][0], max_new_tokens=96, method=method, temperature=1.0, seed=5,
                       num_return_sequences=4, grammar=("json_schema", PERSON))
    for text, reason in zip(out.text, out.stats["stop_reasons"]):
        assert reason == "eos", text
        jsonschema.validate(json.loads(text), PERSON)


def test_a_grammar_that_does_not_compile_is_named(default_generator):
    with pytest.raises(InputError, match="json_schema"):
        default_generator.generate("hi", max_new_tokens=4, grammar=("json_schema", {"type": "objekt"}))
    with pytest.raises(InputError, match="regex"):
        default_generator.generate("hi", max_new_tokens=4, grammar=("regex", "(unclosed"))


@pytest.mark.slow
def test_forced_tokens_ride_in_the_rounds_passes(default_generator, monkeypatch):
    """What the grammar forces (a schema's keys, its punctuation) is taken in the pass of the round before it:
    autoregressive decoding under a schema takes fewer passes than tokens, with the same output as one pass a
    token; a drafted chain carries forced tokens as certain drafts."""
    from specrt.decoding.batch import Batch
    gen = default_generator
    prompt = CASES[0][0]
    fast = gen.generate(prompt, max_new_tokens=64, method="autoregressive", grammar=("json_schema", PERSON))
    assert fast.stats["forced_tokens"] > 0 and fast.stats["rounds"] < len(fast.token_ids[0]) - 1
    drafted = gen.generate(prompt, max_new_tokens=64, method="ngram", grammar=("json_schema", PERSON))
    monkeypatch.setattr(Batch, "_forced", lambda self, every=0: None)
    monkeypatch.setattr(Batch, "_steer", lambda self, proposal, g: proposal)
    slow = gen.generate(prompt, max_new_tokens=64, method="autoregressive", grammar=("json_schema", PERSON))
    assert slow.stats["rounds"] == len(slow.token_ids[0]) - 1 and slow.stats["forced_tokens"] == 0
    assert fast.token_ids == slow.token_ids == drafted.token_ids
    plain = gen.generate(prompt, max_new_tokens=64, method="ngram", grammar=("json_schema", PERSON))
    assert plain.token_ids == drafted.token_ids
    assert drafted.stats["rounds"] < plain.stats["rounds"]


def outside_grammar(grammar, vocab: int, rounds) -> tuple[int, int]:
    """(drafts verified outside the grammar, drafts verified) over one sequence's Rounds: each round's drafts
    walked from the output before it by a matcher of the row's grammar."""
    matcher, outside, drafted = Matcher(grammar, vocab), 0, 0
    for r in rounds:
        inside = matcher.advance(r.drafted)
        outside, drafted = outside + len(r.drafted) - inside, drafted + len(r.drafted)
        matcher.rollback(inside)
        assert matcher.advance(r.tokens) == len(r.tokens)
    return outside, drafted


# ---- a tiny model with a tokenizer of its own: drafts under a grammar, and the law of sampling under it -----------
TINY_V = 24   # the model's vocabulary: the tokenizer's 16 tokens, then 8 the grammar never allows
TINY_TOKENS = ["<eos>", "a", "b", "c", "d", "ab", "ba", "aa", "bb", "cd", "dc", "=", "x", "y", "cc", "dd"]
TINY_REGEX = "[ab]{2}=[cd]+"   # two letters, then `=` (forced: no token has it with more), then c and d
N = 20000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama target over TINY_V tokens, its draft model the target a little disturbed (drafts accepted and
    refused), five random Medusa heads, a byte-level BPE tokenizer of TINY_TOKENS and TINY_REGEX compiled for it.
    -> (gen, model, tok, g)"""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    merges = [("a", "b"), ("b", "a"), ("a", "a"), ("b", "b"), ("c", "d"), ("d", "c"), ("c", "c"), ("d", "d")]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(TINY_TOKENS)}, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    from specrt.export.medusa import MedusaHeads, save_heads
    draft = tiny_model("llama", seed=1, vocab=TINY_V, init=0.3)
    torch.manual_seed(5)
    tmp = tmp_path_factory.mktemp("grammar")
    save_heads(MedusaHeads(5, draft.config.hidden_size, draft.lm_head.weight), tmp / "heads")   # random: a tree
    with torch.no_grad():                                                                      # drafter blind to it
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    directory, model = export_tiny(tmp, "llama", seed=1, draft=draft, vocab=TINY_V, init=0.3, max_seq_len=48,
                                   medusa=tmp / "heads")
    return Generator.from_engines(directory), model, tok, compile_grammar(tok, "regex", TINY_REGEX)


def test_the_draft_model_catches_up_after_forced_rounds(tiny, tmp_path_factory, monkeypatch):
    """A plain round takes what the grammar forces (`=xyxy`) with the token after it: six tokens the draft model did
    not see. With draft = target its chain is accepted in full only if its cache caught up on all of them
    (run.skipped counts tokens, not rounds)."""
    from specrt.decoding.adaptive import GammaPolicy
    _, model, tok, _ = tiny
    g = compile_grammar(tok, "regex", "[ab]{2}=xyxy[cd]{10}")
    directory, _ = export_tiny(tmp_path_factory.mktemp("self"), "llama", seed=1, draft=model, vocab=TINY_V, init=0.3,
                               max_seq_len=48)
    gen = Generator.from_engines(directory)
    choices = iter([0] + [2] * 20)
    monkeypatch.setattr(GammaPolicy, "choose", lambda self: next(choices))
    prompt = tok("ab=cdxba=dcy")["input_ids"]
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="autoregressive", grammar=g)
    out = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="draft", grammar=g)
    assert out.token_ids == ref.token_ids and out.stats["forced_tokens"] >= 5
    assert out.stats["acceptance_rate"] == 1.0


def test_chains_stop_at_the_first_draft_the_grammar_refuses(tiny):
    """Deterministic drafts (prompt lookup, a greedy draft model) are cut at the first one the grammar refuses: no
    draft outside the grammar is verified. The prompt offers lookups that leave it (`x` after every `=`); the draft
    model drafts inside the grammar (its logits masked), so prompt lookup is the one that meets the cut."""
    gen, _, tok, g = tiny
    prompt = tok("ab=xab=xba=x")["input_ids"]
    for method, temperature in (("ngram", 0.0), ("draft", 0.0), ("ngram", 1.0)):
        out = gen.generate(prompt_ids=[prompt] * 4, max_new_tokens=12, method=method, temperature=temperature,
                           seed=3, adaptive=False, gamma=3, grammar=g, rounds=True)
        counts = [outside_grammar(g, TINY_V, rounds) for rounds in out.rounds]
        assert sum(n for n, _ in counts) == 0, (method, temperature, counts)
        assert all(drafted for _, drafted in counts), (method, temperature, counts)


def exact_masked_joint(model, g, prompt: list[int], temperature: float) -> np.ndarray:
    """P(t1, t2, t3 | prompt) of the target masked by the grammar at each step (transformers, the grammar's own
    matcher), temperature applied in plain torch."""
    def step(out):
        m = Matcher(g, TINY_V)
        assert m.advance(out) == len(out)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        logits[~torch.from_numpy(m.allowed())] = float("-inf")
        return torch.softmax(logits / temperature, -1)
    joint = np.zeros((TINY_V,) * 3)
    p1 = step([])
    for a in torch.nonzero(p1)[:, 0].tolist():
        p2 = step([a])
        for b in torch.nonzero(p2)[:, 0].tolist():
            joint[a, b] = (p1[a] * p2[b] * step([a, b])).numpy()
    return joint


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_under_a_grammar_is_the_masked_target(tiny, method):
    """Chi-square over the first three tokens of 20,000 sequences under TINY_REGEX at T = 1 (a forced `=` among
    them), against the exact masked distribution: sampled drafts the grammar refuses (the draft model's) and
    steered lookup chains (forced tokens as certain drafts) keep the law."""
    gen, model, tok, g = tiny
    prompt = tok("ab=cdxba=dcy")["input_ids"]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=N, method=method, seed=13,
                       seeding="stream", adaptive=False, temperature=1.0, grammar=g)
    rate = out.stats["acceptance_rate"]
    assert 0 < rate and (rate < 1 or method == "ngram")   # drafts accepted (and the draft model's refused too)
    p = chi_square_p(out.token_ids, exact_masked_joint(model, g, prompt, 1.0))
    print(f"{method} under a grammar: chi-square p = {p:.4f}, acceptance {rate:.3f}")
    assert p > P_MIN


def verify_passes(gen, monkeypatch, prompt_len: int) -> list:
    """The target's verify passes from now on, recorded as (ids, positions, mask) (B, S), (B, S), (B, S, S): the
    engine's own call, watched (prefill passes start before the prompt's last token and are not recorded)."""
    passes, forward = [], gen.target.forward

    def watched(ids, pos, past_len, mask, *args, **kw):
        if ids.shape[1] > 1 and int(pos[:, 0].min()) >= prompt_len - 1:
            passes.append((ids.clone(), pos.clone(), mask.clone()))
        return forward(ids, pos, past_len, mask, *args, **kw)
    monkeypatch.setattr(gen.target, "forward", watched)
    return passes


def nodes_outside(g, passes, sequences: list[list[int]], prompt_len: int) -> tuple[int, int]:
    """(nodes verified outside the grammar, nodes verified) over recorded verify passes of one batch whose rows
    never finish apart (they keep their places): each row's committed output before the pass is its sequence up to
    the pass's first position, each node's path is read from the mask (its ancestors), and a matcher of the grammar
    walks it from there."""
    outside = total = 0
    for ids, pos, mask in passes:
        for b, sequence in enumerate(sequences):
            committed = sequence[prompt_len:int(pos[b, 0]) + 1]
            for i in range(1, ids.shape[1]):
                path = [int(ids[b, j]) for j in torch.nonzero(mask[b, i])[:, 0].tolist() if j > 0]
                m = Matcher(g, TINY_V)
                assert m.advance(committed) == len(committed)
                outside, total = outside + (m.advance(path) != len(path)), total + 1
    return outside, total


@pytest.mark.parametrize("method, temperature", [("draft", 0.0), ("medusa", 0.0), ("medusa", 1.0)])
def test_trees_verify_no_node_outside_the_grammar(tiny, monkeypatch, method, temperature):
    """Trees under TINY_REGEX: the draft model's (top-k along its chain) drafts inside the grammar; random Medusa
    heads draft blind, and the grammar prunes the nodes it refuses before the pass (counted in the stats) and puts
    the forced `=` where it was drafted, so no node outside the grammar reaches the target; greedy, the output is
    constrained autoregressive decoding's."""
    gen, _, tok, g = tiny
    prompt = tok("ab=cdxab=cxab=ddy")["input_ids"]
    kw = dict(max_new_tokens=10, temperature=temperature, seed=5, grammar=g)
    passes = verify_passes(gen, monkeypatch, len(prompt))
    out = gen.generate(prompt_ids=prompt, method=method, tree=True, adaptive=False, **kw)
    outside, total = nodes_outside(g, passes, [prompt + out.token_ids[0]], len(prompt))
    assert outside == 0 and total > 0, (outside, total, out.stats)
    assert (out.stats["grammar_refused_nodes"] > 0) == (method == "medusa"), out.stats
    if temperature == 0:
        assert out.token_ids == gen.generate(prompt_ids=prompt, method="autoregressive", **kw).token_ids


def test_sampled_trees_under_a_grammar_are_the_masked_target(tiny):
    """The chi-square test of test_sampled_under_a_grammar_is_the_masked_target for Medusa's trees, steered and
    pruned by the grammar."""
    gen, model, tok, g = tiny
    prompt = tok("ab=cdxba=dcy")["input_ids"]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=N, method="medusa", seed=17,
                       seeding="stream", adaptive=False, temperature=1.0, grammar=g)
    assert out.stats["grammar_refused_nodes"] > 0 and 0 < out.stats["acceptance_rate"] < 1, out.stats
    p = chi_square_p(out.token_ids, exact_masked_joint(model, g, prompt, 1.0))
    print(f"Medusa trees under a grammar: chi-square p = {p:.4f}, acceptance {out.stats['acceptance_rate']:.3f}")
    assert p > P_MIN
