"""EAGLE's projected speedup (specrt.measurement.projection): the trace records what the target accepted, the replay follows
the costs it is given, and the shipped drafter's traces load."""
from __future__ import annotations

import pytest

from specrt.measurement import projection
from specrt.decoding.adaptive import Costs
from specrt.errors import InputError
from test_eagle import eagle_pair  # noqa: F401  (the fixture)


def test_trace_records_the_rounds_the_loop_ran(eagle_pair, tmp_path):  # noqa: F811
    gen = eagle_pair[0]
    gen.eagle.spec["dynamic_tree"] = {"top_k": 2, "depth": 3, "nodes": 6}   # room for a tree in every round
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1]]
    trace = projection.record(gen, prompts, max_new_tokens=12)
    runs = [gen.generate(prompt_ids=ids, max_new_tokens=12, method="eagle", adaptive=False) for ids in prompts]
    assert trace["prompts"] == [r.stats["rounds"] for r in runs] and sum(trace["prompts"]) == len(trace["rounds"])
    assert trace["shape"] == [2, 3, 6]
    # every round's tokens (its accepted drafts and the target's own) make each answer after its first token
    assert sum(1 + len(accepted) for *_, accepted in trace["rounds"]) >= sum(len(r.token_ids[0]) - 1 for r in runs)
    assert_rounds_are_well_formed(trace)
    projection.save(trace, tmp_path / "t.json.gz")
    assert projection.load(tmp_path / "t.json.gz") == trace


def assert_rounds_are_well_formed(trace: dict) -> None:
    """Each round: its nodes' scores most probable first, their depths, and the accepted ones a path from the root;
    the rounds of every prompt; tokens per round (1 + the accepted drafts) recomputed from the rounds."""
    assert sum(trace["prompts"]) == len(trace["rounds"])
    for kind, scores, depths, accepted in trace["rounds"]:
        assert kind in ("tree", "lookup") and len(scores) == len(depths) > 0
        assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
        assert accepted == sorted(accepted) and all(0 <= r < len(scores) for r in accepted)
        assert [depths[r] for r in accepted] == list(range(1, len(accepted) + 1))   # a path from the root
    made = [1 + len(accepted) for *_, accepted in trace["rounds"]]
    assert trace["tokens_per_round"] == pytest.approx(sum(made) / len(made), rel=1e-12)


# two rounds of a prompt: four nodes (the first two a path), the target accepting both of the path, then one node
TRACE = {"format": projection.FORMAT, "prompts": [2], "shape": [2, 3, 4],
         "rounds": [["tree", [0.9, 0.8, 0.1, 0.05], [1, 2, 1, 3], [0, 1]],
                    ["tree", [0.5, 0.2, 0.1, 0.1], [1, 2, 2, 1], [0]]]}


def costs(per_token: float) -> Costs:
    """Target passes of 1 ms and `per_token` ms more per token."""
    return Costs(0.0, {k: 1e-3 * (1 + per_token * (k - 1)) for k in (1, 2, 8)})


def test_a_flat_pass_curve_verifies_whole_trees():
    got = projection.project(TRACE, costs(0.0), 0.0, 0.0, 0.0)
    assert got == {"speedup": 2.5, "tokens_per_round": 2.5, "tree_rounds": 1.0}   # (3 + 2) tokens in 2 passes


def test_expensive_nodes_give_plain_steps_and_full_trees_lose():
    full = projection.project(TRACE, costs(1.5), 0.0, 0.0, 0.0, adaptive=False)
    assert full["speedup"] == pytest.approx(5 / (2 * 7), abs=1e-4) and full["tree_rounds"] == 1.0
    # a node costs 1.5 passes: after its warm-up rounds the policy takes plain steps, probing trees now and then
    many = dict(TRACE, prompts=[40, 40], rounds=TRACE["rounds"] * 40)
    got = projection.project(many, costs(1.5), 0.0, 0.0, 0.0)
    assert got["tree_rounds"] < 0.2 and 0.9 < got["speedup"] < 1.0


def test_drafting_and_host_time_are_charged():
    # a flat curve, 1 ms a drafter pass: full trees grow all 3 levels (the catch-up pass and 2 expansions)
    got = projection.project(TRACE, costs(0.0), 1e-3, 0.0, 0.0, adaptive=False)
    assert got["speedup"] == pytest.approx(5 / (4 + 4), abs=1e-4)
    # adaptive rounds grow a level only where it can pay; here (a level costs a verify pass) neither grows past
    # the catch-up's level: both verify their two depth-1 nodes and make 2 tokens in 2 ms
    sized = projection.project(TRACE, costs(0.0), 1e-3, 0.0, 0.0)
    assert sized == {"speedup": 1.0, "tokens_per_round": 2.0, "tree_rounds": 1.0}
    cheap = projection.project(TRACE, costs(0.0), 1e-5, 0.0, 0.0)   # cheap levels: round 1 grows to its path
    assert cheap["tokens_per_round"] == 2.5
    host = projection.project(TRACE, costs(0.0), 0.0, 1e-3, 1e-3, adaptive=False)
    assert host["speedup"] == pytest.approx(5 * 2 / 4, abs=1e-4)   # a plain step 2 ms, a round 2 ms


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_shipped_traces_load(temperature):
    """The shipped traces are what `make eagle-traces` records (80 MT-Bench dev prompts x 96 tokens, full trees of
    the (6, 6, 32) shape), their figures agree with their rounds, and the replay of full trees on a flat pass curve
    with free drafting gives back the recorded tokens per round."""
    trace = projection.load(projection.shipped_trace(temperature))
    assert (trace["temperature"], trace["shape"], trace["max_new_tokens"]) == (temperature, [6, 6, 32], 96)
    assert len(trace["prompts"]) == 80
    assert_rounds_are_well_formed(trace)
    replay = projection.project(trace, costs(0.0), 0.0, 0.0, 0.0, adaptive=False)
    assert replay["tokens_per_round"] == pytest.approx(trace["tokens_per_round"], abs=1e-4)
    assert replay["speedup"] == replay["tokens_per_round"] and replay["tree_rounds"] == 1.0


def test_a_file_that_is_not_a_trace_is_refused(tmp_path):
    bad = tmp_path / "bad.json.gz"
    bad.write_text("{}")
    with pytest.raises(InputError, match="not an EAGLE trace"):
        projection.load(bad)
