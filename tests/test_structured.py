"""Structured output under speculation: a grammar masks the target's distribution at every verified node, so
greedy output equals constrained autoregressive decoding (and a step-by-step reference through transformers) with
every method, answers parse and validate, rows with different grammars or none share a batch, and a sampled
answer under a schema is still a valid one."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from specrt.decoding.grammar import Matcher
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
    monkeypatch.setattr(Batch, "_forced", lambda self: None)
    monkeypatch.setattr(Batch, "_steer", lambda self, proposal, g: proposal)
    slow = gen.generate(prompt, max_new_tokens=64, method="autoregressive", grammar=("json_schema", PERSON))
    assert slow.stats["rounds"] == len(slow.token_ids[0]) - 1 and slow.stats["forced_tokens"] == 0
    assert fast.token_ids == slow.token_ids == drafted.token_ids
    plain = gen.generate(prompt, max_new_tokens=64, method="ngram", grammar=("json_schema", PERSON))
    assert plain.token_ids == drafted.token_ids
    assert drafted.stats["rounds"] < plain.stats["rounds"]
