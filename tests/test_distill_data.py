"""The drafters' training data (`export/train/data.py --batched`): the target's own answers, with its top-k
logits as labels at every answer position, read back in row order by `train_draft.load_labels`."""
from __future__ import annotations

import json

import pytest
import torch

from specrt.export.train.data import generate_batched
from specrt.export.train.train_draft import load_labels, load_rows


@pytest.mark.slow
def test_batched_rows_carry_the_targets_labels(tmp_path):
    greedy, sampled = tmp_path / "greedy.jsonl", tmp_path / "sampled.jsonl"
    common = dict(max_new_tokens=12, temperature=0.7, max_minutes=10, num_template=4, seed=0, max_calls=1)
    generate_batched(greedy, samples=0, batch=3, **common)
    generate_batched(sampled, samples=2, batch=4, greedy=False, **common)
    generate_batched(sampled, samples=2, batch=4, greedy=False, **common)   # a rerun adds nothing

    rows, labels = load_rows(f"{greedy},{sampled}"), load_labels(f"{greedy},{sampled}")
    assert [r["mode"] for r in rows] == ["greedy"] * 3 + ["sampled"] * 4
    assert sorted(labels) == list(range(7))
    assert {r["prompt_id"] for r in rows[3:5]} == {rows[3]["prompt_id"]}      # 2 answers per prompt
    for row, (values, index) in zip(rows, (labels[i] for i in range(7))):
        ids, start = row["ids"], row["prompt_len"]
        assert values.shape == index.shape == (len(ids) - 1, 16)
        # prompt positions: the next prompt token as a hard label
        assert index[:start - 1, 0].tolist() == ids[1:start]
        answer, top = torch.tensor(ids[start:]), index[start - 1:].long()
        assert torch.isfinite(values[start - 1:].float()).all()
        if row["mode"] == "greedy":  # the argmax is the token taken, unless bf16 rounding made a tie
            tie = values[start - 1:, 0] == values[start - 1:, 1]
            assert ((top[:, 0] == answer) | tie).all()
        else:                        # a sampled token is usually among the top 16
            assert (top == answer[:, None]).any(-1).float().mean() > 0.8
    assert json.loads(greedy.read_text().splitlines()[0])["dtype"] == "bfloat16"
    # the labels are the raw logits, before the sampling temperature: a sampled row's top values are the target's own
    from specrt.export.train.data import bf16_target
    row, (values, _) = rows[3], labels[3]
    with torch.no_grad():
        logits = bf16_target("smollm2-135m").model(torch.tensor([row["ids"]])).logits[0].float()
    start = row["prompt_len"]
    own = logits[start - 1:-1].topk(16, dim=-1).values
    assert torch.allclose(values[start - 1:].float(), own, rtol=0.05, atol=0.5)

    # The Medusa heads' features: the root of position t is token t + 1, head 0's label is token t + 2; a cache
    # made for the first rows is extended when rows are appended, and cut back by --max-rows
    from specrt.export.train.train_medusa import MedusaConfig, features
    first = features(MedusaConfig(data=str(greedy), work=str(tmp_path / "m"), max_rows=2))
    grown = features(MedusaConfig(data=str(greedy), work=str(tmp_path / "m")))
    fresh = features(MedusaConfig(data=str(greedy), work=str(tmp_path / "fresh")))
    again = features(MedusaConfig(data=str(greedy), work=str(tmp_path / "m"), max_rows=2))
    assert (first["rows"], grown["rows"], again["rows"]) == (2, 3, 2)
    assert torch.equal(again["hidden"], first["hidden"]) and torch.equal(again["root"], first["root"])
    for i, row in enumerate(rows[:3]):
        answer = row["ids"][row["prompt_len"]:]
        mine, ref = grown["row"] == i, fresh["row"] == i
        assert grown["root"][mine].tolist() == fresh["root"][ref].tolist() == answer
        assert grown["labels"][mine, 0].tolist() == answer[1:] + [-100]
        assert torch.nn.functional.cosine_similarity(grown["hidden"][mine], fresh["hidden"][ref]).min() > 0.99


@pytest.mark.slow
def test_self_written_requests_are_kept_and_join_the_prompts(tmp_path):
    """Source "self": the target writes requests from the starters (kept in a file, so a rerun reuses them), and
    they join the prompts the batched generator answers, interleaved with the other sources."""
    from specrt.export.train.data import STARTERS, all_prompts, self_prompts
    out = tmp_path / "data.jsonl"
    written = self_prompts(out, 6, seed=0, batch=6, max_new_tokens=48)
    kept = (tmp_path / "self_prompts.jsonl").read_text()
    assert [json.loads(x)["prompt_id"] for x in kept.splitlines()] == [f"self_{i}" for i in range(6)]
    starters = [s for kind in STARTERS.values() for s in kind]
    assert written and all(any(r["prompt"].startswith(s) for s in starters) for r in written)
    assert self_prompts(out, 6, seed=0) == written and (tmp_path / "self_prompts.jsonl").read_text() == kept
    assert self_prompts(out, 12, seed=0, deadline=0.0) == written      # past the run's budget: no more written
    assert (tmp_path / "self_prompts.jsonl").read_text() == kept
    prompts = all_prompts(num_template=0, seed=0, self_written=written)     # what generate_batched answers
    assert [p for p in prompts if p["source"] == "self"] == written and prompts.index(written[0]) < 4
