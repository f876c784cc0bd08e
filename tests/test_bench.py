"""`specrt bench` end to end on tiny random Llama engines: files written, numbers consistent with each other."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import REPO, export_tiny, tiny_model
from specrt.measurement import llamacpp, rss
from specrt.measurement.bench import bench, load_prompts
from specrt.errors import InputError

VOCAB, NEW = 256, 8


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    draft = tiny_model("llama", seed=1, vocab=VOCAB, layers=1)
    directory, _ = export_tiny(tmp, "llama", draft=draft, vocab=VOCAB, name="bench")
    return directory


def write_prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bench_results_are_consistent(engines, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": [5, 6, 7, 8, 5, 6]},
                                                   {"prompt_ids": [9, 10, 11, 9, 10, 11, 9]}])
    out = tmp_path / "out"
    result = CliRunner().invoke(bench, [str(engines), "--prompts", str(prompts), "--temperatures", "0,0.7",
                                        "--max-new-tokens", str(NEW), "--num-prompts", "2", "--gamma-sweep", "1,2",
                                        "--sweep-prompts", "1", "--peers", "--no-memory",
                                        "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    for name in ("results.json", "report.md", "tokens_per_s.png", "speedup_vs_gamma.png",
                 "acceptance_per_position.png"):
        assert (out / name).stat().st_size > 0, name
    r = json.loads((out / "results.json").read_text())

    systems = {(s["system"], s["method"], s["temperature"]) for s in r["summary"]}
    for t in (0.0, 0.7):
        for m in ("autoregressive", "draft", "ngram"):
            assert ("specrt", m, t) in systems
        for m in ("hf-generate", "hf-assisted", "hf-prompt-lookup"):
            assert ("transformers", m, t) in systems
    assert len(r["runs"]) == 2 * 2 * 6   # prompts x temperatures x (3 methods + 3 peers)
    for run in r["runs"]:
        assert run["tokens"] == NEW      # the tiny models have no EOS
        assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["time_s"])

    base = {s["temperature"]: s for s in r["summary"] if s["system"] == "specrt" and s["method"] == "autoregressive"}
    assert all(b["speedup_range"] == [1.0, 1.0] for b in base.values())
    assert "| per prompt |" in (out / "report.md").read_text()
    for s in r["summary"]:
        runs = [x for x in r["runs"] if (x["system"], x["method"], x["temperature"]) ==
                (s["system"], s["method"], s["temperature"])]
        assert s["tokens"] == sum(x["tokens"] for x in runs)
        assert s["time_s"] == pytest.approx(sum(x["time_s"] for x in runs))
        assert s["speedup"] == pytest.approx(s["tokens_per_s"] / base[s["temperature"]]["tokens_per_s"])
        ar = {x["prompt"]: x["tokens_per_s"] for x in r["runs"] if (x["system"], x["method"], x["temperature"]) ==
              ("specrt", "autoregressive", s["temperature"])}
        ratios = [x["tokens_per_s"] / ar[x["prompt"]] for x in runs]   # each prompt against its own baseline
        assert s["speedup_range"] == pytest.approx([min(ratios), max(ratios)])
        if s["system"] == "specrt":      # prefill and decode: each run's time split at its first token
            assert 0 < s["prefill_s"] == pytest.approx(np.mean([x["prefill_s"] for x in runs]))
            assert s["decode_tokens_per_s"] == pytest.approx(
                sum(x["tokens"] - 1 for x in runs) / sum(x["time_s"] - x["prefill_s"] for x in runs))
            assert s["prompt_tokens"] == 6.5
        else:
            assert s["prefill_s"] is None and s["decode_tokens_per_s"] is None
        if s["system"] == "specrt":      # the loop's own time per round, below each run's wall time per round
            assert 0 < s["host_ms_per_round"] == pytest.approx(
                1e3 * sum(x["loop_time_s"] for x in runs) / sum(x["rounds"] for x in runs))
            assert s["host_ms_per_round"] < 1e3 * s["time_s"] / sum(x["rounds"] for x in runs)
        else:
            assert s["host_ms_per_round"] is None
        if s["system"] == "specrt" and s["method"] == "draft":   # n-gram may find nothing to propose
            assert s["c"] > 0
            assert 1 <= s["mean_tokens_per_round"] <= 9
            if s["alpha"] is not None:  # None: adaptive γ found drafting too dear here and took plain steps only
                assert 0 <= s["alpha"] <= 1 and s["predicted_speedup"] > 0
                assert s["acceptance_per_position"] and all(0 <= a <= 1 for a in s["acceptance_per_position"])
    assert {(s["method"], s["gamma"]) for s in r["sweep"]} == {(m, g) for m in ("draft", "ngram") for g in (1, 2)}
    assert all(s["speedup"] > 0 and s["predicted_costs"] > 0 for s in r["sweep"])

    floor = r["floor"]
    assert floor["weight_bytes"] > 0 and floor["bandwidth_bytes_per_s"] > 1e8
    assert floor["floor_step_s"] == pytest.approx(floor["weight_bytes"] / floor["bandwidth_bytes_per_s"])
    assert floor["ratio"] == pytest.approx(floor["autoregressive_step_s"] / floor["floor_step_s"])
    assert r["info"]["threads"] >= 1 and r["info"]["versions"]["onnxruntime"]
    report = (out / "report.md").read_text()
    assert "| specrt | ngram | 0 |" in report and "Memory-bandwidth floor" in report
    assert "## Prefill and decode" in report and "| specrt | draft | 0.7 | 6 |" in report
    assert "hf-prompt-lookup" in result.output   # the table printed at the end


def test_bench_runs_typical_acceptance_beside_exact(engines, tmp_path):
    """--acceptance exact,typical: each speculative method again with typical acceptance right after its exact run,
    at the temperatures above 0 only, as rows METHOD+typical that say they are not distribution-preserving."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": [5, 6, 7, 8, 5, 6]}])
    out = tmp_path / "out"
    args = [str(engines), "--prompts", str(prompts), "--methods", "draft,ngram", "--temperatures", "0,0.7",
            "--max-new-tokens", str(NEW), "--gamma-sweep", "", "--no-peers", "--no-memory", "--out", str(out)]
    result = CliRunner().invoke(bench, args + ["--acceptance", "exact,typical"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    r = json.loads((out / "results.json").read_text())
    rows = {(s["method"], s["temperature"]): s for s in r["summary"]}
    assert set(rows) == {(m, t) for m in ("autoregressive", "draft", "ngram") for t in (0.0, 0.7)} | {
        ("draft+typical", 0.7), ("ngram+typical", 0.7)}
    assert [x["method"] for x in r["runs"] if x["temperature"] == 0.7] == [
        "autoregressive", "draft", "draft+typical", "ngram", "ngram+typical"]
    for (method, _), s in rows.items():
        assert s["distribution_preserving"] == (not method.endswith("+typical"))
    assert rows[("draft+typical", 0.7)]["c"] == rows[("draft", 0.7)]["c"] > 0
    assert r["config"]["acceptance"] == ["exact", "typical"] and "NOT distribution-preserving" in result.output
    assert "| specrt | draft+typical | 0.7 |" in (out / "report.md").read_text()
    result = CliRunner().invoke(bench, args + ["--acceptance", "lossy"])
    assert result.exit_code == 1 and "--acceptance lossy" in result.output


def test_bench_skips_draft_without_draft_model(tmp_path):
    directory, _ = export_tiny(tmp_path, "llama", vocab=VOCAB, name="nodraft")
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": [3, 4, 5]}])
    out = tmp_path / "out"
    result = CliRunner().invoke(bench, [str(directory), "--prompts", str(prompts), "--methods", "draft,ngram",
                                        "--temperatures", "0", "--max-new-tokens", "4", "--gamma-sweep", "",
                                        "--no-peers", "--no-memory", "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    r = json.loads((out / "results.json").read_text())
    assert {s["method"] for s in r["summary"]} == {"autoregressive", "ngram"}
    assert any("draft skipped" in n for n in r["notes"]) and "draft skipped" in result.output
    assert not r["sweep"] and not (out / "speedup_vs_gamma.png").exists()


def test_prompt_files(tmp_path):
    good = write_prompts(tmp_path / "good.jsonl", [{"turns": ["first", "second"]}, {"prompt": "p"},
                                                   {"prompt_ids": [1, 2]}])
    prompts = load_prompts(good, 10)
    assert [(p.text, p.ids) for p in prompts] == [("first", None), ("p", None), (None, [1, 2])]
    assert len(load_prompts(None, 3)) == 3   # the packaged MT-Bench set
    bad = write_prompts(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"question": "no"}])
    with pytest.raises(InputError, match=r"bad.jsonl line 2: expected .*'turns'"):
        load_prompts(bad, 10)
    (tmp_path / "broken.jsonl").write_text('{"prompt": "ok"}\n{not json\n')
    with pytest.raises(InputError, match="broken.jsonl line 2: not valid JSON"):
        load_prompts(tmp_path / "broken.jsonl", 10)


def test_bench_peak_memory(engines, tmp_path):
    """Each method's peak resident memory, measured in a fresh process of its own, in the results and the report."""
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": [5, 6, 7, 8, 5, 6]}])
    out = tmp_path / "out"
    result = CliRunner().invoke(bench, [str(engines), "--prompts", str(prompts), "--methods", "autoregressive,ngram",
                                        "--temperatures", "0", "--max-new-tokens", str(NEW), "--gamma-sweep", "",
                                        "--no-peers", "--memory", "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    r = json.loads((out / "results.json").read_text())
    assert [(m["system"], m["method"]) for m in r["memory"]] == [("specrt", "autoregressive"), ("specrt", "ngram")]
    for m in r["memory"]:
        assert m["tokens"] == NEW and m["prompts"] == 1
        assert 0 < m["base_rss_bytes"] < m["loaded_rss_bytes"] and m["peak_rss_bytes"] >= m["base_rss_bytes"]
    for s in r["summary"]:
        m = next(m for m in r["memory"] if m["method"] == s["method"])
        assert s["peak_memory_mb"] == pytest.approx((m["peak_rss_bytes"] - m["base_rss_bytes"]) / 1e6)
    report = (out / "report.md").read_text()
    assert "## Peak memory" in report and "peak MB" in report


def test_peak_rss_sees_a_freed_allocation():
    """The high-water mark keeps a peak that is gone by the time it is read (a sampler could miss it). In a fresh
    process: in one that ran other tests, the C heap may serve the block from pages it already holds and keep them."""
    check = ("import numpy as np; from specrt.measurement import rss; rss.reset_peak(); before = rss.rss_bytes(); "
             "a = np.ones(64 * 2**20 // 8); del a; "   # 64 MiB, touched, freed
             "print(rss.peak_rss_bytes() - before, rss.rss_bytes() - before)")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True).stdout
    peak, now = map(int, out.split())
    assert peak >= 60 * 2**20 > now, (peak, now)


def test_self_rows_take_the_self_drafters_step():
    """A `self` row's c and prediction come from the self drafter's step (the target over its kept layers), which
    bench records beside the draft model's; an engine set without one (or results from before) gives neither."""
    from specrt.decoding.adaptive import Costs, expected_tokens
    from specrt.measurement.report import summarize
    runs = [dict(system="specrt", method=m, temperature=0, prompt=0, tokens=10, time_s=1.0, tokens_per_s=10.0,
                 alpha=a, gamma=g, rounds=5) for m, a, g in (("autoregressive", None, None), ("self", 0.5, 2))]
    verify = {1: 0.1, 2: 0.11, 3: 0.12}
    costs = {"specrt": Costs(0.0, verify)}   # no draft model: its step 0
    row = {r["method"]: r for r in summarize(runs, costs, None, {"specrt": Costs(0.05, verify)})}["self"]
    assert row["c"] == pytest.approx(0.5)
    assert row["predicted_speedup"] == pytest.approx(expected_tokens(0.5, 2) * 0.1 / (2 * 0.05 + 0.12))
    row = {r["method"]: r for r in summarize(runs, costs)}["self"]
    assert row["c"] == 0.0 and row["predicted_speedup"] is None


def test_bench_llamacpp_asked_for_but_missing(engines, tmp_path, monkeypatch):
    monkeypatch.setattr(llamacpp, "installed", lambda: False)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": [3, 4, 5]}])
    result = CliRunner().invoke(bench, [str(engines), "--prompts", str(prompts), "--methods", "autoregressive",
                                        "--temperatures", "0", "--max-new-tokens", "2", "--gamma-sweep", "",
                                        "--no-peers", "--llamacpp", "--out", str(tmp_path / "out")])
    assert result.exit_code != 0 and "pip install -e '.[llamacpp]'" in result.output


@pytest.mark.slow
def test_bench_llamacpp_row(default_engines, tmp_path):
    """llama.cpp beside specrt on the default engines' GGUF file: its row and its agreement (peak memory: the test
    above; the llama.cpp process is measured the same way)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the optional llamacpp extra) is not installed")
    out = tmp_path / "out"
    result = CliRunner().invoke(bench, [str(default_engines), "--methods", "autoregressive", "--temperatures", "0",
                                        "--max-new-tokens", "4", "--num-prompts", "1", "--gamma-sweep", "",
                                        "--no-peers", "--llamacpp", "--no-memory", "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    r = json.loads((out / "results.json").read_text())
    rows = [x for x in r["runs"] if x["system"] == "llama.cpp"]
    assert len(rows) == 1 and 0 < rows[0]["tokens"] <= 4 and "first_divergence" in rows[0]
    assert r["llamacpp_agreement"]["prompts"] == 1
    row = next(s for s in r["summary"] if s["system"] == "llama.cpp")
    assert row["tokens_per_s"] > 0 and row["speedup"] > 0
    assert r["info"]["versions"]["llama_cpp_python"]
    report = (out / "report.md").read_text()
    assert "| llama.cpp | generate | 0 |" in report and "llama.cpp's greedy output equalled" in report


def test_bench_compares_an_int4_engine_set(engines, tmp_path):
    """--compare: the int4 build of the same export runs its methods in the same loop, as `specrt int4`, with its
    own pass times; speedups stay against ENGINES' autoregressive; its peak memory is measured from its own set."""
    import shutil
    from specrt.export.build import build
    int4 = tmp_path / "int4"
    shutil.copytree(engines, int4, ignore=shutil.ignore_patterns("*.ort.onnx*"))
    build(int4, "onnxruntime", log=lambda *_: None, target_weights="int4")
    prompts = write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": [5, 6, 7, 8, 5, 6]}])
    out = tmp_path / "out"
    result = CliRunner().invoke(bench, [str(engines), "--compare", str(int4), "--prompts", str(prompts),
                                        "--temperatures", "0", "--max-new-tokens", str(NEW), "--num-prompts", "1",
                                        "--gamma-sweep", "", "--no-peers", "--methods", "autoregressive,draft",
                                        "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    r = json.loads((out / "results.json").read_text())
    rows = {(s["system"], s["method"]): s for s in r["summary"]}
    assert set(rows) == {(system, m) for system in ("specrt", "specrt int4") for m in ("autoregressive", "draft")}
    base = rows[("specrt", "autoregressive")]["tokens_per_s"]
    assert rows[("specrt int4", "autoregressive")]["speedup"] == pytest.approx(
        rows[("specrt int4", "autoregressive")]["tokens_per_s"] / base)
    assert r["info"]["compare"][0]["system"] == "specrt int4" and r["info"]["compare"][0]["costs"]["c"] > 0
    assert rows[("specrt int4", "draft")]["c"] == pytest.approx(r["info"]["compare"][0]["costs"]["c"])
    if rss.available():
        assert {(m["system"], m["method"]) for m in r["memory"]} == set(rows)
    assert "`specrt int4`: engines" in (out / "report.md").read_text()


def test_long_prompts_are_long_and_need_engines_that_hold_them(default_engines, tmp_path):
    """The packaged long-prompt set: 4 documents of 2.5k-7k tokens; engines too short for them are refused before
    any run, with the fix."""
    from specrt.decoding.generate import Generator
    prompts = load_prompts(None, 10, "long_prompts.jsonl")
    gen = Generator.from_engines(default_engines)
    lengths = [len(gen.encode(p.text)) for p in prompts]
    assert len(prompts) == 4 and all(2500 <= n <= 7000 for n in lengths), lengths
    result = CliRunner().invoke(bench, [str(default_engines), "--long-prompts", "--no-peers", "--no-memory",
                                        "--out", str(tmp_path / "out")])
    assert result.exit_code == 1 and "--max-seq-len" in result.output and "(e.g. 8192)" in result.output
    assert CliRunner().invoke(bench, [str(default_engines), "--long-prompts", "--prompts", str(
        write_prompts(tmp_path / "p.jsonl", [{"prompt_ids": [1]}]))]).exit_code == 2


# ---- the prefix-cache measurement with llama.cpp's server beside specrt -----------------------------------------
# A stream llama-server (llama.cpp 0.5.0-dev, build 1, commit 0c1e570) wrote for a 70-token prompt whose first 53
# tokens its slot held, 3 new tokens (the final event's generation_settings and prompt left out), then an end of
# generation and a keep-alive comment as the server can send them.
LLAMA_STREAM = [
    b'data: {"index":0,"content":" al","tokens":[360],"stop":false,"id_slot":-1,"tokens_predicted":1,'
    b'"tokens_evaluated":70}\n', b'\n',
    b'data: {"index":0,"content":"s","tokens":[99],"stop":false,"id_slot":-1,"tokens_predicted":2,'
    b'"tokens_evaluated":70}\n', b'\n', b': ping\n', b'\n',
    b'data: {"index":0,"content":" al","tokens":[360],"stop":false,"id_slot":-1,"tokens_predicted":3,'
    b'"tokens_evaluated":70}\n', b'\n',
    b'data: {"index":0,"content":"","tokens":[],"id_slot":0,"stop":true,"tokens_predicted":3,"tokens_evaluated":70,'
    b'"has_new_line":false,"truncated":false,"stop_type":"limit","stopping_word":"","tokens_cached":72,"timings":'
    b'{"cache_n":53,"prompt_n":17,"prompt_ms":2482.138,"prompt_per_token_ms":146.0081176470588,"prompt_per_second":'
    b'6.848934265540433,"predicted_n":3,"predicted_ms":1711.954,"predicted_per_token_ms":855.977,'
    b'"predicted_per_second":1.1682556891131421}}\n', b'\n',
]


def test_llama_server_stream_is_read_token_by_token():
    """A /completion stream as llama-server writes it: each partial event's token in order, the first token timed at
    its event, the final event's cached and prefilled tokens; a token the stream did not carry, an error event and a
    stream cut before its final event are all reported."""
    from specrt.measurement.llama_server import parse_stream, read_completion
    from specrt.errors import BackendError
    times = iter([1.5, 3.0])   # the first token, the end
    events = list(parse_stream(LLAMA_STREAM))
    assert len(events) == 4
    got = read_completion(events, started=1.0, clock=lambda: next(times))
    assert got["ids"] == [360, 99, 360] and got["ttft_s"] == 0.5 and got["total_s"] == 2.0
    assert (got["cached_tokens"], got["prefilled_tokens"], got["prompt_tokens"]) == (53, 17, 70)
    assert got["complete_ids"] and got["server_prompt_ms"] == pytest.approx(2482.138)
    assert not read_completion(events[1:], started=0.0)["complete_ids"]
    with pytest.raises(BackendError, match="exceeds the available context"):
        list(parse_stream([b'data: {"error":{"code":400,"message":"request (2100 tokens) exceeds the available '
                           b'context size (2048 tokens)","type":"exceed_context_size_error"}}\n']))
    with pytest.raises(BackendError, match="without its final event"):
        read_completion(events[:-1], started=0.0)


def test_prefix_cache_table_puts_llama_cpp_beside_specrt():
    """The prefix-cache table with llama.cpp's arms: every line as wide as its header, llama.cpp's means over the
    requests where specrt's cache hit, its first differing token, and how many of its answers equal specrt's."""
    from specrt.measurement.bench import prefix_cache_table

    def arm(ttft, total, cached, at="same"):
        extra = {} if at == "same" else {"same_as_specrt": at is None, "diverges_at": at}
        return {"ttft_s": ttft, "total_s": total, "prompt_tokens": 100, "cached_tokens": cached, **extra}
    rows = [{"scenario": "chat", "method": "autoregressive", "item": f"81 turn {t}", "same_output": True,
             "off": arm(1.0, 2.0, 0), "on": arm(0.5, 1.5, 64 * (t - 1)),
             "llama.cpp off": arm(0.8, 1.0, 0, None), "llama.cpp on": arm(0.2, 0.4, 70 * (t - 1), at)}
            for t, at in ((1, None), (2, 5))]
    lines = prefix_cache_table(rows)
    tables = [[line for line in block.split("\n") if line] for block in "\n".join(lines).split("\n\n")]
    for table in tables[:2]:
        assert len({line.count("|") for line in table}) == 1, table
    assert tables[0][2].endswith("| 0 | 0.80 | 0.20 | 1.00 | 0.40 | yes |")
    assert tables[0][3].endswith("| 70 | 0.80 | 0.20 | 1.00 | 0.40 | off: yes, on: from token 5 |")
    assert tables[1][2] == ("| chat | autoregressive | 1 | 64 | 1.00 | 0.50 | 2.0x | 2.00 | 1.50 | 0.80 | 0.20 | 4.0x "
                            "| 1.00 | 0.40 |")
    assert tables[2] == ["llama.cpp's answers token-identical to specrt's (cache off): 2 of 2 with cache_prompt off, "
                         "1 of 2 with it on."]
    assert "llama.cpp" not in "\n".join(prefix_cache_table([{k: v for k, v in r.items() if "llama" not in k}
                                                            for r in rows]))


@pytest.mark.slow
def test_prefix_cache_runs_beside_llama_server(default_engines, tmp_path):
    """`bench prefix-cache --llama-server`: a two-turn chat and two requests under one system prompt go to specrt
    and to llama.cpp's server, cache_prompt off and on; llama.cpp's "on" arm serves the second turn and the second
    request from its slot, its "off" arm never, and its slot is emptied where specrt's cache is made anew (the
    first request under the system prompt shares the chat's first tokens, and finds none). Runs where the binary is
    (make llama-server, or $SPECRT_LLAMA_SERVER)."""
    from specrt.measurement.bench import prefix_cache_bench
    from specrt.measurement.llama_server import BUILT, ENV, binary
    from specrt.errors import BackendError
    try:
        path = binary(os.environ.get(ENV) or REPO / BUILT)
    except BackendError:
        pytest.skip(f"no llama-server binary ({BUILT} or ${ENV}): make llama-server")
    out = tmp_path / "prefix-cache.json"
    result = CliRunner().invoke(prefix_cache_bench, [
        str(default_engines), "--methods", "autoregressive", "--chats", "1", "--turns", "2", "--requests", "2",
        "--system-tokens", "160", "--max-new-tokens", "8", "--threads", "2", "--llama-server", str(path),
        "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    r = json.loads(out.read_text())
    rows = r["rows"]
    assert [x["item"] for x in rows] == ["81 turn 1", "81 turn 2", "request 1", "request 2"]
    for x in rows:
        off, on = x["llama.cpp off"], x["llama.cpp on"]
        assert off["prompt_tokens"] == on["prompt_tokens"] == x["on"]["prompt_tokens"]
        assert off["cached_tokens"] == 0 and 0 < off["tokens"] <= 8 and 0 < on["tokens"] <= 8
        assert off["ttft_s"] <= off["total_s"] and on["ttft_s"] <= on["total_s"]
        assert off["same_as_specrt"] == (off["diverges_at"] is None)
    cached = [x["llama.cpp on"]["cached_tokens"] for x in rows]
    assert cached[0] == cached[2] == 0, cached
    assert cached[1] >= rows[1]["on"]["cached_tokens"] > 0 and cached[3] >= rows[3]["on"]["cached_tokens"] > 0
    assert "llama.cpp first token off s" in result.output and "llama.cpp's answers token-identical" in result.output
    assert "llama-server" in r["machine"]["versions"]
