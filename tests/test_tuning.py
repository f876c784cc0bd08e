"""`--method auto` and `specrt tune`: auto runs what the engine set's tuning recorded for this machine, else the
rule; a new process starts from the tuning's pass times and policy figures; a stale tuning is ignored."""
from __future__ import annotations

import json
import time
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

from conftest import tiny_model
from specrt.cli import main
from specrt.decoding import tuning
from specrt.decoding.adaptive import TreePolicy
from specrt.decoding.eagle import Figures
from specrt.decoding.generate import Generator
from specrt.errors import ManifestError
from specrt.export.build import build
from specrt.export.eagle import new_eagle, save_eagle
from specrt.export.model import from_hf
from specrt.export.pipeline import export_engines
from specrt.measurement.demo import demo
from specrt.measurement.tune import GRAMMAR_PROMPTS, GRAMMAR_SCHEMA, TuneConfig, tune
from specrt.serving.scheduler import Job

V, MAX_LEN = 64, 128
PROMPT = [3, 9, 4, 3, 9, 4, 3]


def export_set(tmp, name: str = "engines"):
    """A tiny float32 target with a draft model and an EAGLE drafter, exported and built."""
    model = tiny_model("llama", seed=1, vocab=V, init=0.3)
    model.save_pretrained(tmp / "src")
    tiny_model("llama", seed=11, vocab=V, init=0.3).save_pretrained(tmp / "draft")
    save_eagle(new_eagle(from_hf(model, MAX_LEN), seed=3), tmp / "eagle", dtype=torch.float32)
    export_engines(str(tmp / "src"), tmp / name, draft=str(tmp / "draft"), eagle=str(tmp / "eagle"),
                   max_seq_len=MAX_LEN, log=lambda *_: None)
    build(tmp / name, "onnxruntime", log=lambda *_: None)
    return tmp / name


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The set before and after `tune` (a copy each)."""
    tmp = tmp_path_factory.mktemp("tuning")
    plain = export_set(tmp)
    done = tmp / "tuned"
    shutil.copytree(plain, done)
    result = tune(done, TuneConfig(prompts=2, new_tokens=8, batches=(1, 2, 4)), log=lambda *_: None)
    return plain, done, result


def recorded(directory) -> tuning.Tuning:
    return tuning.Tuning.from_json(json.loads((directory / tuning.FILE).read_text()))


def test_without_a_tuning_auto_follows_the_rule(tuned):
    plain, _, _ = tuned
    gen = Generator.from_engines(plain)
    assert gen.tuning is None and "not tuned" in gen.untuned
    ref = gen.generate(prompt_ids=PROMPT, max_new_tokens=12, method="autoregressive")
    out = gen.generate(prompt_ids=PROMPT, max_new_tokens=12)
    assert (out.stats["method"], out.stats["method_from"]) == ("eagle", "rule")   # float32 target with EAGLE
    assert out.token_ids == ref.token_ids and ref.stats["method_from"] == "request"
    sampled = gen.generate(prompt_ids=PROMPT, max_new_tokens=4, temperature=0.8, seed=1)
    assert (sampled.stats["method"], sampled.stats["method_from"]) == ("eagle", "rule")


def test_tune_records_the_fastest_per_regime_with_the_engines(tuned):
    _, done, result = tuned
    manifest = json.loads((done / "manifest.json").read_text())
    assert manifest["tuning"]["file"] == tuning.FILE                                # listed with its hash
    assert "dynamic_tree" in manifest["models"]["eagle"]                            # the tree shape, as tune-tree
    assert recorded(done) == result
    for regime in tuning.REGIMES:
        speeds = result.speeds[regime]
        assert set(speeds) == {"autoregressive", "draft", "ngram", "eagle"}         # every method the set runs
        best = max(speeds, key=speeds.get)
        assert result.methods[regime] in (best, tuning.rule(Generator.from_engines(done)))
        assert speeds[result.methods[regime]] * 1.03 >= speeds[best]
    assert set(result.passes) == {1, 2, 4} and max(result.passes[1]) == 64
    assert result.draft_step > 0 and set(result.eagle_level["seconds"]) == {1, 2, 4}
    assert {"draft", "ngram"} <= set(result.gamma["greedy"]) and "eagle" in result.trees["greedy"]
    assert set(result.eagle) == {"greedy", "sampled"}


def test_auto_runs_what_the_tuning_recorded(tuned, tmp_path):
    done = tmp_path / "engines"
    shutil.copytree(tuned[1], done)
    chosen = recorded(done)
    chosen.methods = {"greedy": "ngram", "sampled": "draft"}   # neither is the rule's (eagle)
    tuning.save(done, chosen)
    gen = Generator.from_engines(done)
    ref = gen.generate(prompt_ids=PROMPT, max_new_tokens=12, method="autoregressive").token_ids
    out = gen.generate(prompt_ids=PROMPT, max_new_tokens=12)
    assert (out.stats["method"], out.stats["method_from"]) == ("ngram", "tuning") and out.token_ids == ref
    sampled = gen.generate(prompt_ids=PROMPT, max_new_tokens=4, temperature=0.8, seed=1).stats
    assert (sampled["method"], sampled["method_from"]) == ("draft", "tuning")
    assert gen.generate(prompt_ids=PROMPT, max_new_tokens=4, method="eagle").stats["method_from"] == "request"
    result = CliRunner().invoke(main, ["generate", str(done), "--prompt-ids", "3,9,4", "--max-new-tokens", "4",
                                       "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output.splitlines()[-1])["stats"]
    assert (stats["method"], stats["method_from"]) == ("ngram", "tuning")


def test_a_new_process_starts_warm_from_the_tuning(tuned, monkeypatch):
    """No pass is timed again, and the policies and EAGLE's calibration start from what the tuning recorded."""
    _, done, _ = tuned
    record = recorded(done)
    gen = Generator.from_engines(done)

    def timed(*_, **__):
        raise AssertionError("a pass was timed again")
    monkeypatch.setattr(gen.target, "time_pass", timed)
    monkeypatch.setattr(gen.eagle, "time_pass", timed)
    monkeypatch.setattr(gen.draft, "time_pass", timed)
    assert gen.costs(1).verify == record.passes[1] and gen.costs(2, draft=False).verify == record.passes[2]
    # a size between two measured ones (rows joining a server's batch) is on their line, not timed in the round
    between = gen.costs(3, upto=17, draft=False).verify
    assert between == pytest.approx({k: (record.passes[2][k] + record.passes[4][k]) / 2 for k in record.passes[2]})
    assert 3 not in gen.measured()["passes"]   # what the next tuning records is measured
    batch = gen.batch(1, method="eagle")
    figures = Figures.from_json(record.eagle["greedy"]).following()
    assert batch.drafter.figures == figures and batch.drafter.scale == pytest.approx(
        figures.calibration[0] / figures.calibration[1])
    assert batch.trees.sums == TreePolicy(sums=record.trees["greedy"]["eagle"]).following().sums
    chain = gen.batch(1, method="draft")
    assert chain.policy.prior_alpha == pytest.approx(record.gamma["greedy"]["draft"])
    for method in ("eagle", "draft", "ngram"):
        for temperature in (0.0, 0.8):
            gen.generate(prompt_ids=PROMPT, max_new_tokens=10, method=method, temperature=temperature, seed=2)


def test_a_server_times_a_batch_larger_than_the_tunings_at_its_start(tuned):
    """A server of 6 rows over a tuning of 1, 2 and 4: the 6 rows' passes are timed before the first request, not
    in the round where the batch first reaches them, and 5 rows take the line between 4 and 6."""
    from specrt.serving.server import Scheduler
    _, done, _ = tuned
    gen = Generator.from_engines(done)
    scheduler = Scheduler(gen, 6)
    try:
        deadline = time.monotonic() + 60
        while not gen.timed(6) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        scheduler.close()
    assert gen.timed(6) and not gen.timed(5)
    four, six = gen.costs(4, draft=False).verify, gen.costs(6, draft=False).verify
    assert gen.costs(5, draft=False).verify == pytest.approx({k: (four[k] + six[k]) / 2 for k in four})


def test_a_stale_tuning_is_ignored(tuned, tmp_path):
    """Measured on other engines (a rebuild: here the int4 target built from the same graphs) or on another
    machine: the rule again (prompt lookup on a target with int8 activations)."""
    done, int4 = tmp_path / "engines", tmp_path / "int4"
    shutil.copytree(tuned[1], done)
    shutil.copytree(done, int4, ignore=shutil.ignore_patterns("*.ort.onnx"))
    build(int4, "onnxruntime", log=lambda *_: None, target_weights="int4")
    gen = Generator.from_engines(int4)
    assert gen.tuning is None and "other engines" in gen.untuned
    assert gen.generate(prompt_ids=PROMPT, max_new_tokens=4).stats["method"] == "ngram"
    elsewhere = recorded(done)
    elsewhere.machine = dict(elsewhere.machine, cores=elsewhere.machine["cores"] + 1)
    tuning.save(done, elsewhere)
    gen = Generator.from_engines(done)
    assert gen.tuning is None and "another machine" in gen.untuned
    assert gen.generate(prompt_ids=PROMPT, max_new_tokens=4).stats["method_from"] == "rule"
    threads = gen.machine["threads"]
    assert Generator.from_engines(done, threads=threads + 1).tuning is None          # other threads: other timings
    (done / tuning.FILE).unlink()
    with pytest.raises(ManifestError, match="tuning"):                              # listed but gone
        Generator.from_engines(done)


def test_the_rule_without_eagle_or_drafters(tuned, tiny_engines, tmp_path):
    plain, _, _ = tuned
    no_eagle = tmp_path / "no-eagle"
    shutil.copytree(plain, no_eagle)
    manifest = json.loads((no_eagle / "manifest.json").read_text())
    del manifest["models"]["eagle"]
    (no_eagle / "manifest.json").write_text(json.dumps(manifest))
    assert Generator.from_engines(no_eagle).generate(prompt_ids=PROMPT, max_new_tokens=4).stats["method"] == "draft"
    alone = Generator.from_engines(tiny_engines["llama"][0])
    assert alone.generate(prompt_ids=PROMPT, max_new_tokens=4).stats["method"] == "ngram"


@pytest.mark.slow
def test_auto_under_a_grammar_runs_what_the_tuning_measured_with_one(default_generator, monkeypatch):
    """The default set's tuning (make engines) raced every method under a JSON schema too; `auto` runs that regime's
    choice for a request with a grammar and the plain regime's for one without, and the server batches the two
    apart under `auto` only."""
    gen = default_generator
    speeds = gen.tuning.speeds
    for regime in ("greedy", "sampled"):
        assert set(speeds[regime + tuning.GRAMMAR]) == set(speeds[regime]), speeds   # every method, both ways
    monkeypatch.setitem(gen.tuning.methods, "greedy", "eagle")
    monkeypatch.setitem(gen.tuning.methods, "greedy+grammar", "ngram")
    schema = gen.grammar("json_schema", GRAMMAR_SCHEMA)
    ids = gen.encode(GRAMMAR_PROMPTS[0])
    constrained = gen.generate(prompt_ids=ids, max_new_tokens=6, grammar=schema).stats
    free = gen.generate(prompt_ids=ids, max_new_tokens=6).stats
    assert (constrained["method"], constrained["method_from"]) == ("ngram", "tuning")
    assert (free["method"], free["method_from"]) == ("eagle", "tuning")
    options = dict(method="auto", gamma=None, tree=False, adaptive=True, temperature=0.0, seed=None)
    key = lambda **o: Job(ids, {**options, **o}, 1, print).key   # noqa: E731
    assert key(grammar=schema) != key() and key(method="ngram", grammar=schema) == key(method="ngram")


@pytest.mark.slow
def test_demo_prints_both_runs_equal_texts_and_the_ratio(default_engines):
    lines = []
    assert demo(str(default_engines), max_new_tokens=24, repeats=1, echo=lines.append)
    text = "\n".join(lines)
    assert "news article" in text and "autoregressive and auto identical" in text
    assert re.search(r"autoregressive [\d.]+ tokens/s, auto \(\w+\) [\d.]+ tokens/s: [\d.]+x", text), text


def test_eagle_figures_carry_to_the_next_request_at_most_memory_rounds():
    figures = Figures([30.0, 40.0], [50.0, 25.0], {2: [10.0, 20.0], 3: [1.0, 2.0]})
    nxt = figures.following(memory=8.0)
    assert nxt.calibration == pytest.approx([30 * 8 / 25, 40 * 8 / 25])    # the same scale, worth 8 rounds
    assert nxt.promise == pytest.approx([50 * 8 / 25, 8.0])
    assert nxt.lookup == {2: pytest.approx([4.0, 8.0]), 3: [1.0, 2.0]}      # a rate's weight: its offered nodes
    assert Figures.from_json(json.loads(json.dumps(figures.to_json()))) == figures
    assert Figures().following() == Figures()                                # nothing measured: the priors
