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
    prompts = [default_generator.encode(p) for p in load_prompts(4)]
    return [(ids, default_generator.generate(prompt_ids=ids, max_new_tokens=NEW, method="autoregressive").token_ids[0])
            for ids in prompts]


def check_method(gen, model, references, **kw):
    ties = []
    for ids, ref in references:
        out = gen.generate(prompt_ids=ids, max_new_tokens=NEW, **kw)
        assert_same_or_tie(out.token_ids[0], ref, ids, model, ties)
    assert len(ties) <= 1, f"too many near ties to be chance: {ties}"


def test_ngram(default_generator, smollm2, references):
    check_method(default_generator, smollm2.model, references, method="ngram")


def test_draft_tree(default_generator, smollm2, references):  # the chain: tests/test_trained_draft.py
    assert default_generator.draft is not None, "engines/default has no draft: run `make engines`"
    check_method(default_generator, smollm2.model, references, method="draft", tree=True)


def test_medusa(default_generator, smollm2, references):
    assert default_generator.medusa is not None, "engines/default has no Medusa heads: run `make engines`"
    check_method(default_generator, smollm2.model, references, method="medusa")


def test_medusa_automatic_tree(default_generator, smollm2, references, tmp_path):
    """The automatically chosen tree (calibrated on project prompts, never the dev set), used as choices."""
    from specrt.decoding.calibrate import CALIBRATION_PROMPTS, calibrate
    prompts = [default_generator.encode(p) for p in CALIBRATION_PROMPTS[:2]]
    tree = calibrate(default_generator, "medusa", prompts, max_nodes=32, width=4, log=lambda *_: None)
    check_method(default_generator, smollm2.model, references[:2], method="medusa", tree_choices=tree)
