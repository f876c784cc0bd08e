"""Batches of different prompts: ragged prompt lengths and acceptance, rows that finish on their own and free
their row, requests that join a running batch (continuous batching), every method. Each row's greedy output is
the one a lone run of its prompt gives (near ties reported with their logit gap, never silently accepted)."""
from __future__ import annotations

import pytest

from conftest import load_prompts
from greedy_check import assert_same_or_tie
from specrt.errors import InputError

pytestmark = pytest.mark.slow
METHODS = [("autoregressive", {}), ("draft", {}), ("draft", {"tree": True}), ("ngram", {}), ("medusa", {}),
           ("eagle", {})]
NEW = (20, 32, 12)          # each request's max_new_tokens: they finish in different rounds


@pytest.fixture(scope="module")
def prompts(default_generator):
    ids = [default_generator.encode(p) for p in load_prompts(3)]
    assert len({len(p) for p in ids}) == 3, "the test needs ragged prompt lengths"
    return ids


@pytest.fixture(scope="module")
def lone(default_generator, prompts):
    """Each prompt alone, autoregressive: the reference of every method."""
    return [default_generator.generate(prompt_ids=p, max_new_tokens=n, method="autoregressive").token_ids[0]
            for p, n in zip(prompts, NEW)]


def check(outputs, lone, prompts, model):
    ties = []
    for ours, ref, ids in zip(outputs, lone, prompts):
        assert_same_or_tie(ours[:len(ref)], ref, ids, model, ties)   # ours may run longer
    assert len(ties) <= 1, f"too many near ties to be chance: {ties}"


@pytest.mark.parametrize("method,kw", METHODS, ids=[m + ("-tree" if kw else "") for m, kw in METHODS])
def test_requests_join_a_running_batch(default_generator, smollm2, prompts, lone, method, kw):
    """Request 0 starts alone, 1 joins after two rounds, 2 after four; each finishes at its own length and leaves
    (the rows behind it move into its row). Trees every round (adaptive=False) so that each method speculates
    whatever the batch size."""
    batch = default_generator.batch(3, method=method, adaptive=False, **kw)
    outputs, rounds = {}, 0
    batch.add(prompts[0], NEW[0], owner=0)
    while batch.run.batch or len(outputs) < 3:
        if rounds in (2, 4):
            batch.add(prompts[rounds // 2], NEW[rounds // 2], owner=rounds // 2)
        for row, tokens in batch.retire():
            outputs[row.owner] = tokens
            assert row.stop_reason in ("eos", "max_new_tokens")
        batch.step()
        rounds += 1
    assert [len(outputs[i]) for i in range(3)] == [len(t) for t in lone]
    check([outputs[i] for i in range(3)], lone, prompts, smollm2.model)
    stats = batch.stats()
    assert max(stats["batch_rounds"]) == 3 and stats["rounds"] == rounds - 1
    if method != "autoregressive":
        assert stats["acceptance_rate"] is not None and stats["batch_rounds"][3]["speculative"] > 0


@pytest.mark.parametrize("method", ["autoregressive", "eagle"])
def test_generate_a_list_of_prompts(default_generator, smollm2, prompts, lone, method):
    out = default_generator.generate(prompt_ids=prompts, max_new_tokens=max(NEW), method=method)
    assert len(out.token_ids) == len(out.text) == 3
    check(out.token_ids, lone, prompts, smollm2.model)
    assert len(out.stats["stop_reasons"]) == 3 and out.stats["tokens"] == sum(map(len, out.token_ids))
    texts = default_generator.generate(prompt=load_prompts(3), max_new_tokens=4, method="autoregressive").text
    assert [default_generator.tokenizer.decode(t, skip_special_tokens=True) for t in
            (default_generator.generate(prompt_ids=p, max_new_tokens=4, method="autoregressive").token_ids[0]
             for p in prompts)] == texts


def test_cancelled_row_frees_its_row(default_generator, prompts):
    batch = default_generator.batch(2, method="autoregressive")
    batch.add(prompts[0], 40, owner="a")
    batch.add(prompts[1], 8, owner="b")
    batch.step()
    batch.cancel(lambda owner: owner == "a")
    (row, tokens), = batch.retire()
    assert (row.owner, row.stop_reason, len(tokens)) == ("a", "cancelled", 2)
    assert batch.run.batch == 1 and batch.run.rows[0].owner == "b"
    while batch.run.batch:
        batch.step()
        done = batch.retire()
    alone = default_generator.generate(prompt_ids=prompts[1], max_new_tokens=8, method="autoregressive").token_ids[0]
    assert done[0][1] == alone


def test_a_full_batch_refuses_more(default_generator, prompts):
    batch = default_generator.batch(1, method="autoregressive")
    batch.add(prompts[0], 4)
    with pytest.raises(InputError, match="do not fit the batch"):
        batch.add(prompts[1], 4)
    with pytest.raises(InputError, match="empty list"):
        default_generator.generate(prompt=[], max_new_tokens=4, method="autoregressive")
    with pytest.raises(InputError, match="prompt ids"):
        default_generator.generate(prompt_ids=[[1, 2], []], max_new_tokens=4, method="autoregressive")


def test_a_queued_request_moved_down_starts_from_an_empty_row(default_generator, prompts):
    """A request queued (not yet prefilled) behind the live rows is moved down when rows free below it and the
    batch's last row is wanted: its new row held a retired request's cache, which its prefill must not read."""
    batch = default_generator.batch(3, method="autoregressive")
    batch.add(prompts[0], 2, owner="a")
    batch.add(prompts[1], 40, owner="b")
    for _ in range(2):
        batch.step()
    batch.join(prompts[2], 8, owner="c")        # row 2, queued
    (row, _), = batch.retire()                  # a leaves: b moves to row 0, row 1 keeps a's cache length
    assert row.owner == "a"
    batch.join(prompts[0], 8, owner="d")        # no room after c: c moves down into row 1
    while batch.joining:
        batch.prefill()
    outputs = {}
    while batch.run.batch:
        batch.step()
        outputs.update((row.owner, tokens) for row, tokens in batch.retire())
    for owner, ids in (("c", prompts[2]), ("d", prompts[0])):
        alone = default_generator.generate(prompt_ids=ids, max_new_tokens=8, method="autoregressive").token_ids[0]
        assert outputs[owner] == alone, owner




def test_a_row_without_acceptance_takes_plain_steps_beside_a_drafting_row(default_generator, smollm2, monkeypatch):
    """Per-row budgets (prompt lookup): one prompt asks to copy a text, the other to explain something. In one batch,
    in every round where one row drafts and the other does not, the one sitting out had all its drafts refused so
    far and has none in that round's proposal (rounds like that happen at least twice); each row's greedy output
    is its lone autoregressive one. The batch's cost surface is fixed (a pass 15 % dearer a token per row),
    so that the choice follows the rows' acceptance, not this machine's measured pass times."""
    from specrt.decoding.adaptive import Costs
    from specrt.decoding.batch import Batch
    costs = Costs(0.0, {k: 1.0 + 0.15 * (k - 1) for k in range(1, 10)})
    monkeypatch.setattr(Batch, "_chain_costs", lambda self, n: costs)
    # and the policy's prior, not what this engine set's tuning (or an earlier test) last measured for ngram
    monkeypatch.delitem(default_generator._gamma_policies, ("ngram", True), raising=False)
    prompts = [default_generator.encode(p) for p in (
        "Copy this text exactly: Alice was beginning to get very tired of sitting by her sister on the bank, and of "
        "having nothing to do: once or twice she had peeped into the book her sister was reading, but it had no "
        "pictures or conversations in it.",
        "Scrambled words: moon the of and sea a is in to it the of and. Put them aside and explain in one paragraph "
        "why the sky is blue.")]
    new = (64, 20)   # the copy runs on beside the other till its end
    batch = default_generator.batch(2, method="ngram")
    for i, ids in enumerate(prompts):
        batch.join(ids, new[i], owner=i, rounds=True)
    while batch.joining:
        batch.prefill()
    rows = list(batch.run.rows)   # which prompt's lookups fail first depends on the engines' answers: either row
    outputs, apart = {}, []
    while len(batch.run.rows) == 2 and all(batch.run.active):
        refused = [r.proposed > 0 and r.accepted == 0 for r in rows]
        batch.step()
        if batch.drafting is not None and batch.drafting.count(True) == 1:   # one row drafts, the other sits out
            off = batch.drafting.index(False)
            apart.append((refused[off], rows[off].round_log[-1].drafted, rows[1 - off].round_log[-1].drafted))
        outputs.update((row.owner, tokens) for row, tokens in batch.retire())
    batch.cancel(lambda owner: True)   # the copy's tokens so far are enough
    outputs.update((row.owner, tokens) for row, tokens in batch.retire())
    assert len(apart) >= 2 and all(refused and not mine for refused, mine, _ in apart), apart
    assert any(theirs for *_, theirs in apart)
    lone = [default_generator.generate(prompt_ids=p, max_new_tokens=len(outputs[i]), method="autoregressive")
            .token_ids[0] for i, p in enumerate(prompts)]
    check([outputs[0], outputs[1]], lone, prompts, smollm2.model)
