"""The shipped draft (export/drafters/smollm2-135m-draft) and the reduced output vocabulary of a draft graph.

- tiny: a draft exported with `specrt_vocab.json` gives the checkpoint's logits on the kept ids and -inf
  (probability exactly zero) everywhere else, and greedy speculation with it stays identical to the target.
- slow: with the trained draft, greedy speculative output on dev prompts is token-identical to the target's
  own greedy output, or the first difference is a near tie (top-2 logit gap < 1e-3, reported).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import REPO, tiny_model
from greedy_check import TIE_GAP, first_divergence, report_tie

DRAFT_DIR = REPO / "export" / "drafters" / "smollm2-135m-draft"
DEV_PROMPTS = [  # written for this test; not MT-Bench, not training prompts
    "Describe how a refrigerator keeps food cold.",
    "Give me four ideas for a rainy weekend at home.",
    "Write a haiku about autumn leaves.",
]


def test_vocab_subset_graph(tmp_path):
    from specrt import Generator
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines

    target, draft = tiny_model("llama", seed=0, vocab=64), tiny_model("llama", seed=1, vocab=64, layers=1)
    kept = [0, 3, 5, 8, 13, 21, 34, 55, 60, 63]
    target.save_pretrained(tmp_path / "t")
    draft.save_pretrained(tmp_path / "d")
    (tmp_path / "d" / "specrt_vocab.json").write_text(json.dumps({"kept_ids": kept}))
    out = export_engines(str(tmp_path / "t"), tmp_path / "e", draft=str(tmp_path / "d"), max_seq_len=64,
                         log=lambda *_: None)
    build(out, "onnxruntime", log=lambda *_: None, drafter_weights="float32")
    assert json.loads((out / "manifest.json").read_text())["models"]["draft"]["output_vocab"] == len(kept)

    gen = Generator.from_engines(out)
    ids = torch.tensor([[1, 7, 2, 9, 4]])
    cache = gen.draft.new_cache(1)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    logits = gen.draft.forward(ids, torch.arange(5)[None], cache.past_len, mask, 5).logits[0]   # (5, V)
    with torch.no_grad():
        ref = draft(ids).logits[0]                                                              # (5, V)
    dropped = torch.ones(64, dtype=torch.bool)
    dropped[kept] = False
    assert torch.isneginf(logits[:, dropped]).all()
    torch.testing.assert_close(logits[:, kept], ref[:, kept], atol=1e-4, rtol=1e-4)

    prompt = [3, 1, 4, 1, 5]
    plain = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="autoregressive").token_ids
    spec = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="draft", gamma=4).token_ids
    assert spec == plain
    sampled = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="draft", gamma=4, temperature=0.8, seed=0)
    assert all(0 <= t < 64 for t in sampled.token_ids[0])


def test_int8_drafter_engines(tmp_path):
    """The default build quantizes the draft's and the heads' weights to int8 and leaves the target alone:
    the draft's logits move a little, the kept-vocabulary structure stays, greedy output does not change."""
    import onnx

    from specrt import Generator
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines

    target, draft = tiny_model("llama", seed=0, vocab=64), tiny_model("llama", seed=1, vocab=64, layers=1)
    kept = list(range(0, 64, 2))
    target.save_pretrained(tmp_path / "t")
    draft.save_pretrained(tmp_path / "d")
    (tmp_path / "d" / "specrt_vocab.json").write_text(json.dumps({"kept_ids": kept}))
    out = export_engines(str(tmp_path / "t"), tmp_path / "e", draft=str(tmp_path / "d"), max_seq_len=64,
                         log=lambda *_: None)
    manifest = build(out, "onnxruntime", log=lambda *_: None)
    assert manifest["models"]["draft"]["engine"]["weights"] == "int8"
    assert manifest["models"]["target"]["engine"]["weights"] == "float32"
    graph = onnx.load(os.path.join(out, "draft.ort.onnx"), load_external_data=False).graph
    ops = {n.name: n.op_type for n in graph.node}
    assert ops["/layers.0/mlp/down_proj/MatMul"] == "MatMul"                     # kept float32
    assert ops["/layers.0/mlp/up_proj/MatMul_quant"] == "MatMulIntegerToFloat"   # int8 weights

    gen = Generator.from_engines(out)
    ids = torch.tensor([[1, 7, 2, 9, 4]])
    cache = gen.draft.new_cache(1)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    logits = gen.draft.forward(ids, torch.arange(5)[None], cache.past_len, mask, 5).logits[0]
    with torch.no_grad():
        ref = draft(ids).logits[0]
    assert torch.isneginf(logits[:, 1::2]).all() and torch.isfinite(logits[:, kept]).all()
    assert not torch.equal(logits[:, kept], ref[:, kept])                       # it is quantized...
    assert torch.corrcoef(torch.stack([logits[:, kept].flatten(), ref[:, kept].flatten()]))[0, 1] > 0.99

    prompt = [3, 1, 4, 1, 5]
    plain = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="autoregressive").token_ids
    for gamma in (1, 3, 6):                                                     # ...and the output is the same
        assert gen.generate(prompt_ids=prompt, max_new_tokens=24, method="draft", gamma=gamma).token_ids == plain


def test_unknown_vocab_file_is_refused(tmp_path):
    from specrt.errors import UnknownSourceError
    from specrt.export.sources import read_vocab_subset

    (tmp_path / "specrt_vocab.json").write_text(json.dumps({"kept_ids": [5, 3]}))
    with pytest.raises(UnknownSourceError, match="sorted list of unique ids"):
        read_vocab_subset(tmp_path, 64)


@pytest.fixture(scope="module")
def pair(default_engines):
    """`make engines` exports the default target with the shipped draft."""
    manifest = json.loads((default_engines / "manifest.json").read_text())
    source = manifest["models"].get("draft", {}).get("source")
    if source != "smollm2-135m-draft":
        pytest.fail(f"{default_engines} has draft {source!r}, not smollm2-135m-draft: run `make engines`")
    return default_engines


@pytest.mark.slow
def test_trained_draft_greedy_matches_target(pair, smollm2):
    from specrt import Generator

    gen = Generator.from_engines(pair)
    accepted = []
    for text in DEV_PROMPTS:
        ids = gen.encode(text)
        plain = gen.generate(prompt_ids=ids, max_new_tokens=64, method="autoregressive").token_ids[0]
        spec = gen.generate(prompt_ids=ids, max_new_tokens=64, method="draft", gamma=5)
        ours = spec.token_ids[0]
        accepted.append(spec.stats["acceptance_rate"])
        i = first_divergence(ours, plain)
        if i is None:
            continue
        assert i < min(len(ours), len(plain)), f"same tokens but lengths differ: {len(ours)} vs {len(plain)}"
        with torch.no_grad():
            logits = smollm2.model(torch.tensor([ids + plain[:i]])).logits[0, -1]
        top2 = logits.topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE_GAP, (f"{text!r}: diverged at new token {i} ({ours[i]} vs {plain[i]}) and the top-2 "
                               f"logit gap {gap:.3g} is not a tie")
        report_tie(f"{text[:40]!r}: near tie at new token {i}: top-2 logit gap {gap:.2e} (tokens {ours[i]} vs "
                   f"{plain[i]})")
    print(f"acceptance per prompt {accepted}")
    # a smoke check that the draft engine is wired to its cache (a broken one accepts nothing); the measured
    # acceptance of this draft is low (see its model card), so no higher floor is claimed here
    assert sum(a or 0.0 for a in accepted) > 0, f"no draft token was ever accepted: {accepted}"
