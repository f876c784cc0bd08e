"""specrt.decoding.grammar against the real SmolLM2 tokenizer: each kind compiles, masks follow the grammar,
advance/rollback and path_masks leave the matcher where it was, forced tokens, refusals by name, and uniformly
random sampling under the mask always gives text the schema accepts."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from specrt.decoding.grammar import Matcher, compile_grammar, path_masks
from specrt.errors import InputError

EOS = 2   # <|im_end|>, SmolLM2-Instruct's end of sequence (the manifest's eos_token_ids)
SMALL = {"type": "object", "additionalProperties": False, "required": ["name", "age", "kind", "tags"],
         "properties": {"name": {"type": "string", "maxLength": 12},
                        "age": {"type": "integer", "minimum": 0, "maximum": 120},
                        "kind": {"enum": ["cat", "dog", "bird"]},
                        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}
FIXED = {"type": "object", "additionalProperties": False, "required": ["name", "count"],
         "properties": {"name": {"type": "string"}, "count": {"const": 3}}}


@pytest.fixture(scope="module")
def tok(default_engines):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_engines / "tokenizer")


def texts(tok, mask) -> list[str]:
    return [tok.decode([int(t)]) for t in np.flatnonzero(mask)]


def at(tok, grammar, text: str, **kw) -> Matcher:
    m = Matcher(grammar, **kw)
    ids = tok(text)["input_ids"]
    assert m.advance(ids) == len(ids), text
    return m


def test_each_kind_compiles_and_is_cached(tok):
    specs = {"json_object": None, "json_schema": SMALL, "regex": r"[0-9]{3}-[a-z]+",
             "grammar": 'start: "yes" | "no"'}
    for kind, spec in specs.items():
        g = compile_grammar(tok, kind, spec)
        assert compile_grammar(tok, kind, spec) is g
        assert Matcher(g).allowed().any(), kind
    assert compile_grammar(tok, "json_schema", dict(reversed(SMALL.items()))) is compile_grammar(tok, "json_schema",
                                                                                                SMALL)
    assert compile_grammar(tok, "regex", "[0-9]+") is not compile_grammar(tok, "regex", "[0-9]*")
    gbnf = Matcher(compile_grammar(tok, "grammar", 'root ::= "yes" | "no"'))
    assert {t.strip() for t in texts(tok, gbnf.allowed())} <= {"y", "ye", "yes", "n", "no"}


def test_masks_follow_the_schema(tok):
    g = compile_grammar(tok, "json_schema", SMALL)
    first = texts(tok, Matcher(g).allowed())
    assert first and all(t.startswith("{") for t in first)
    name = texts(tok, at(tok, g, '{"name": ').allowed())          # a string starts: only quotes
    assert '"' in name and all(t.startswith('"') for t in name)
    age = texts(tok, at(tok, g, '{"name": "Bo", "age": ').allowed())
    assert "7" in age and all(re.fullmatch(r"-?[0-9]+", t) for t in age)
    kind = texts(tok, at(tok, g, '{"name": "Bo", "age": 7, "kind": "').allowed())
    assert kind and all(any(v.startswith(t) for v in ("cat", "dog", "bird")) for t in kind)
    wrong = Matcher(g)
    assert wrong.advance(tok('{"age": 7')["input_ids"]) == 1   # `{"` then "age" where "name" must come first


def test_advance_takes_only_what_the_mask_allows(tok):
    """Where bytes are forced the mask allows their canonical tokenization only; advance agrees with the mask
    (llguidance's own consume would also take `u` here)."""
    m = at(tok, compile_grammar(tok, "regex", "(apples|plums)!"), "pl")
    assert texts(tok, m.allowed()) == ["ums"]
    assert m.advance(tok.convert_tokens_to_ids(["u"])) == 0 and m.advance(tok("ums")["input_ids"]) == 1


def test_vocab_padding_and_the_end_of_sequence(tok):
    g = compile_grammar(tok, "regex", "[0-9]+")
    V = len(tok) + 64
    m = at(tok, g, "12", vocab_size=V, eos_ids=[EOS])
    mask = m.allowed()
    assert mask.shape == (V,) and not mask[len(tok):].any() and mask[EOS] and not m.done
    assert m.advance([len(tok) + 1]) == 0
    start = Matcher(g, vocab_size=V)
    assert not start.allowed()[EOS]                       # not complete yet: no end of sequence
    assert m.advance([EOS, EOS]) == 2 and m.done           # ended; a stop token again is consumed
    assert np.flatnonzero(m.allowed()).tolist() == [EOS]
    assert m.advance(tok("3")["input_ids"]) == 0
    m.rollback(2)
    assert not m.done and np.array_equal(m.allowed(), mask)
    done = at(tok, compile_grammar(tok, "json_object"), '{"a": 1}')
    assert done.done and np.flatnonzero(done.allowed()).tolist() == [EOS] and done.forced() == [EOS]
    with pytest.raises(InputError, match="vocab_size"):
        Matcher(g, vocab_size=len(tok) - 1)


def test_advance_and_rollback_return_to_the_same_mask(tok):
    g = compile_grammar(tok, "json_schema", SMALL)
    ids = tok('{"name": "Ann", "age": 41, "kind": "dog", "tags": [true, false]}')["input_ids"]
    m, masks = Matcher(g), []
    for t in ids:
        masks.append(m.allowed())
        assert m.advance([t]) == 1
    assert m.done
    for k in (1, 5, len(ids) - 3):
        m.rollback(k)
        assert np.array_equal(m.allowed(), masks[len(ids) - k])
        assert m.advance(ids[len(ids) - k:]) == k
    m.rollback(len(ids))
    assert np.array_equal(m.allowed(), masks[0])
    assert m.advance(ids[:3] + tok("{")["input_ids"] + ids[3:]) == 3   # `{"name":` then `{`: stops there
    assert np.array_equal(m.allowed(), masks[3])
    with pytest.raises(ValueError, match="rollback"):
        m.rollback(5)


def test_path_masks(tok):
    g = compile_grammar(tok, "json_schema", SMALL)
    m = at(tok, g, '{"name": "')
    before = m.allowed()
    a, b = tok("Zed")["input_ids"], tok('Zed", "age": 3')["input_ids"]
    bad = a + tok('", "kind"')["input_ids"]                  # "kind" before "age": leaves the grammar
    paths = [[], a, b, bad, bad + [EOS], a[:1]]
    masks, ok = path_masks(m, paths)
    assert masks.shape == (len(paths), len(tok)) and ok == [True, True, True, False, False, True]
    for path, mask, good in zip(paths, masks, ok):
        if good:
            fresh = at(tok, g, '{"name": "')
            assert fresh.advance(path) == len(path) and np.array_equal(mask, fresh.allowed())
        else:
            assert not mask.any()
    assert np.array_equal(m.allowed(), before)               # back at the committed state
    assert m.advance(b) == len(b)


def test_forced_tokens_of_a_fixed_key(tok):
    g = compile_grammar(tok, "json_schema", FIXED)
    m = Matcher(g, eos_ids=[EOS])
    start = m.allowed()
    assert tok.decode(m.forced()) == '{"name":'                # the key is fixed; the value is the model's
    assert np.array_equal(m.allowed(), start)                   # forced() did not move the matcher
    m = at(tok, g, '{"name": "Bob"')
    forced = m.forced()
    assert forced[-1] == EOS and tok.decode(forced[:-1]) == ', "count": 3}'
    assert not m.done and m.advance(forced) == len(forced) and m.done
    assert at(tok, g, '{"name": "B').forced() == []            # inside a string nothing is forced


def test_bad_specs_are_refused_by_name(tok):
    with pytest.raises(InputError, match="objekt"):
        compile_grammar(tok, "json_schema", {"type": "objekt"})
    with pytest.raises(InputError, match="minimum"):
        compile_grammar(tok, "json_schema", {"type": "integer", "minimum": 5, "maximum": 1})
    with pytest.raises(InputError, match="unclosed character class"):
        compile_grammar(tok, "regex", "[a-")
    with pytest.raises(InputError, match="foo"):
        compile_grammar(tok, "grammar", "start: foo")
    with pytest.raises(InputError, match="expected a JSON schema as a dict"):
        compile_grammar(tok, "json_schema", '{"type": "object"}')
    with pytest.raises(InputError, match="'xml'"):
        compile_grammar(tok, "xml", "<a/>")


def valid(doc) -> bool:
    """SMALL, checked by hand."""
    return (isinstance(doc, dict) and set(doc) == {"name", "age", "kind", "tags"}
            and isinstance(doc["name"], str) and len(doc["name"]) <= 12
            and type(doc["age"]) is int and 0 <= doc["age"] <= 120 and doc["kind"] in ("cat", "dog", "bird")
            and isinstance(doc["tags"], list) and len(doc["tags"]) <= 3 and all(type(t) is bool for t in doc["tags"]))


def test_random_sampling_under_the_mask_gives_valid_json(tok):
    """20 sequences, each token drawn uniformly from what allowed() permits, until the grammar is done or the end
    of sequence is drawn: each decodes to JSON that the schema accepts."""
    g, rng = compile_grammar(tok, "json_schema", SMALL), np.random.default_rng(0)
    for _ in range(20):
        m, out = Matcher(g, eos_ids=[EOS]), []
        while not m.done and len(out) < 200:
            t = int(rng.choice(np.flatnonzero(m.allowed())))
            assert m.advance([t]) == 1, (tok.decode(out), t)
            out.append(t)
        text = tok.decode([t for t in out if t != EOS])
        assert valid(json.loads(text)), text
