"""measurement.structured: its 20 schemas are JSON schemas that llguidance compiles and that cover what the issue
asks for, and its figures come from its runs (a small run: 2 schemas, 2 methods, a few tokens)."""
from __future__ import annotations

import jsonschema

from specrt.measurement.structured import SCHEMAS, check, measure, summarize, tables

TINY = {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}


def _walk(schema):
    yield schema
    for sub in schema.get("properties", {}).values():
        yield from _walk(sub)
    if "items" in schema:
        yield from _walk(schema["items"])


def test_schemas_are_valid_and_cover_the_issue(default_generator):
    assert len(SCHEMAS) == 20
    seen = set()
    for name, (prompt, schema) in SCHEMAS.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        default_generator.grammar("json_schema", schema)   # llguidance compiles it
        assert prompt.strip(), name
        for s in _walk(schema):
            types = s.get("type") if isinstance(s.get("type"), list) else [s.get("type")]
            seen.update(t for t in types if t)
            seen.update({"enum"} if "enum" in s else set())
            seen.update({"maxItems"} if "maxItems" in s else set())
            seen.update({"maxLength"} if "maxLength" in s else set())
            if s is not schema and s.get("type") == "object":
                seen.add("nested")
            if set(s.get("properties", {})) - set(s.get("required", [])):
                seen.add("optional")
    assert {"object", "nested", "enum", "array", "maxItems", "number", "integer", "boolean", "string", "maxLength",
            "optional", "null"} <= seen


def test_the_figures_come_from_the_runs(default_generator):
    schemas = {"tiny": ("Answer with JSON: is the sky blue?", TINY), "person": SCHEMAS["person"]}
    runs = measure(default_generator, schemas, ["autoregressive", "ngram"], max_new_tokens=8, speed_prompts=2,
                   sampled_methods=["ngram"], sampled_prompts=1, log=lambda *_: None)
    assert len(runs) == 2 * 2 * 2 + 1
    for r in runs:
        if r["arm"] == "grammar":
            assert (r["parses"], r["valid"]) == check(r["text"], schemas[r["schema"]][1])[:2]
    tiny = next(r for r in runs if r["schema"] == "tiny" and r["arm"] == "grammar")
    assert tiny["stop_reason"] == "eos" and tiny["valid"]        # finishes in 8 tokens
    person = next(r for r in runs if r["schema"] == "person" and r["arm"] == "grammar")
    assert person["stop_reason"] == "max_new_tokens" and not person["parses"]   # runs long: counted, not invalid

    summary = summarize(runs)
    for m in ("autoregressive", "ngram"):
        v = summary["greedy"][m]
        assert v["answers"] == 2 and v["finished"] + v["ran_long"] == 2 and v["valid"] <= v["parse"] <= 2
        assert v["finished"] == 1 and v["valid_of_finished"] == 1 and v["unfinished"] == ["person"]
        mine = [r for r in runs if r["method"] == m and r["temperature"] == 0]
        assert summary["identical"][m] == {"compared": 2, "identical": 2, "differ": []}   # greedy: the same tokens
        s = summary["speed"][m]
        with_g = [r for r in mine if r["arm"] == "grammar"]
        without = [r for r in mine if r["arm"] == "none"]
        assert s["grammar"]["tokens"] == sum(r["tokens"] for r in with_g)
        assert s["none"]["tokens"] == sum(r["tokens"] for r in without)
        assert s["forced"] == sum(r["forced"] for r in with_g) and 0 < s["forced"] <= s["grammar"]["tokens"]
        assert abs(s["ratio_tokens_per_s"] - s["grammar"]["tokens_per_s"] / s["none"]["tokens_per_s"]) < 1e-12
        assert s["grammar"]["runs"] == s["none"]["runs"] == 2
    assert summary["identical"]["autoregressive"]["identical"] == 2
    sampled = summary["sampled"]["ngram"]
    assert sampled["answers"] == 1 and sampled["temperature"] == 0.7
    agree = summary["agreement"]
    assert agree["grammar"]["answers"] == agree["none"]["answers"] == 2
    assert agree["none"]["target"] == agree["none"]["positions"]   # unconstrained greedy is the target's argmax
    assert agree["grammar"]["target"] <= agree["grammar"]["positions"]
    text = tables(summary)
    assert "| ngram | 2 | 1 | 1 | 1 | 1 | 2/2 |" in text
    rate = summary["greedy"]["ngram"]["rate"]
    greedy = [r for r in runs if r["method"] == "ngram" and r["arm"] == "grammar" and r["temperature"] == 0]
    assert rate["tokens"] == sum(r["tokens"] for r in greedy) and rate["runs"] == 2
    assert summary["greedy"]["ngram"]["forced"] == sum(r["forced"] for r in greedy)
