"""End-to-end on the default model: every speculative method is token-identical to the target's own greedy
output on the dev prompts (near ties reported with their logit gap, never silently accepted)."""
from __future__ import annotations

import pytest

from conftest import load_prompts
from greedy_check import assert_same_or_tie

pytestmark = pytest.mark.slow
NEW = 64


@pytest.fixture(scope="module")
def references(default_generator):
    prompts = [default_generator.encode(p) for p in load_prompts(8)]
    return [(ids, default_generator.generate(prompt_ids=ids, max_new_tokens=NEW).token_ids[0]) for ids in prompts]


def check_method(gen, model, references, **kw):
    ties = []
    for ids, ref in references:
        out = gen.generate(prompt_ids=ids, max_new_tokens=NEW, **kw)
        assert_same_or_tie(out.token_ids[0], ref, ids, model, ties)
    assert len(ties) <= 2, f"too many near ties to be chance: {ties}"


def test_ngram(default_generator, smollm2, references):
    check_method(default_generator, smollm2.model, references, method="ngram")
