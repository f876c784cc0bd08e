"""The measurement paths that `make` targets and `specrt bench-serve` run, each at the smallest size that takes it
end to end: bench-serve --long-prompt and --repeat-with-suffix-cache against real server processes of a tiny engine
set that speaks SmolLM2's tokenizer, measurement.fresh, measurement.large (the tiny preset), measurement.report
on runs whose figures are known, and make train-eagle3's command line against the CLI. (bench-serve --replicas:
tests/test_replicas.py, on that module's Ray instance.)"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from conftest import REPO, tiny_config
from specrt.cli import main

LONG_SEQ = 8192   # the packaged long prompts (2.5k-7k tokens) fit


@pytest.fixture(scope="module")
def talking(default_engines, tmp_path_factory):
    """A one-layer random Llama with SmolLM2's vocabulary and tokenizer (chat template included), exported and built
    with a cache of LONG_SEQ positions: text prompts, chat requests and long prompts in milliseconds a token. It has
    no end-of-sequence token: every request runs to its max_tokens."""
    import transformers

    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    tmp = tmp_path_factory.mktemp("talking")
    config = tiny_config("llama", vocab=49152, layers=1)
    config.max_position_embeddings = LONG_SEQ
    torch.manual_seed(0)
    src = tmp / "src"
    transformers.LlamaForCausalLM(config).eval().save_pretrained(src)
    for f in (default_engines / "tokenizer").iterdir():
        shutil.copy(f, src / f.name)
    export_engines(str(src), tmp / "talking", max_seq_len=LONG_SEQ, log=lambda *_: None)
    build(tmp / "talking", "onnxruntime", log=lambda *_: None)
    return tmp / "talking"


# ---- bench-serve ------------------------------------------------------------------------------------------------
def test_bench_serve_long_prompt(talking, tmp_path):
    """--long-prompt: two short streams run, the long prompt joins them; the report's figures are the run's (every
    stream ran to its max_tokens, the long request to its 32 tokens) and the table prints them."""
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["bench-serve", str(talking), "--long-prompt", "review-letter-answers",
                                       "--streams", "2", "--max-tokens", "6", "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads((out / "serve_bench.json").read_text())
    assert (report["method"], report["long_prompt"], report["max_tokens"]) == ("autoregressive",
                                                                                "review-letter-answers", 6)
    r = report["long_prompt_result"]
    assert (r["short_streams"], r["short_tokens"], r["long_tokens"], r["long_stats"]["tokens"]) == (2, 12, 32, 32)
    # each stream's longest wait between two of its chunks: a time, and at least the streams' mean token latency
    # (the long prompt's prefill came between two chunks of theirs)
    assert len(r["short_max_gaps_s"]) == 2 and min(r["short_max_gaps_s"]) > 0
    assert r["short_max_gap_s"] == max(r["short_max_gaps_s"]) >= r["short_itl_mean_s"]
    assert 0 < r["short_itl_mean_s"] and 0 < r["long_stats"]["ttft_s"] <= r["long_ttft_s"]
    assert 0 <= r["short_chunks_during_long_prefill"] <= 12
    table = (out / "serve_bench.md").read_text()
    assert f"| {r['short_max_gap_s']:.2f} | {r['short_itl_mean_s']:.3f} | {r['short_chunks_during_long_prefill']} | " \
           f"{r['long_ttft_s']:.1f} |" in table
    unknown = CliRunner().invoke(main, ["bench-serve", str(talking), "--long-prompt", "no-such-id",
                                        "--out", str(tmp_path / "none")])
    assert unknown.exit_code == 1 and "not an id of the packaged long prompts" in unknown.output


def test_bench_serve_repeat_with_suffix_cache(talking, tmp_path):
    """--repeat-with-suffix-cache: the same 3 requests twice against a server without the cache, then one with it;
    every pass generated what it asked for, the ratio is the second passes', and the cache holds exactly the run's
    outputs (the warm-up's 8 tokens and each request's, each after a separator)."""
    requests, tokens, mb = 3, 6, 0.5
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["bench-serve", str(talking), "--repeat-with-suffix-cache", str(mb),
                                       "--method", "rest", "--requests", str(requests), "--concurrency", "1,2",
                                       "--max-tokens", str(tokens), "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads((out / "serve_bench.json").read_text())
    assert (report["method"], report["concurrency"], report["max_tokens"]) == ("rest", 2, tokens)
    results = report["results"]
    assert [(r["suffix_cache_mb"], r["pass"]) for r in results] == [(None, 1), (None, 2), (mb, 1), (mb, 2)]
    for r in results:
        assert r["tokens"] == requests * tokens
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert 1 <= r["tokens_per_round"] <= tokens and r["server_rss_mb"] > 50
    assert report["second_pass_ratio"] == pytest.approx(results[3]["tokens_per_s"] / results[1]["tokens_per_s"])
    assert results[1]["suffix_cache"] is None
    assert results[3]["suffix_cache"] == {"outputs": 2 * requests + 1, "tokens": 2 * requests * (tokens + 1) + 8 + 1,
                                          "bytes": int(mb * 2**20) // 4 * 4}
    table = (out / "serve_bench.md").read_text()
    assert f"| {mb} MB | 2 | {results[3]['tokens_per_s']:.1f} |" in table and "| none | 1 |" in table
    assert f"{report['second_pass_ratio']:.2f}× the second pass without" in table
    assert (out / "server-plain.log").is_file() and (out / "server-cache.log").is_file()


def test_bench_serve_arms_loads_and_temperatures(talking, tmp_path):
    """The waves with two arms (autoregressive and auto, through one server), a closed loop of 2, Poisson
    arrivals at 50 a second, greedy and sampled, mixed prompts: a result for each arm, temperature and load, each
    from its requests (every one ran to its max_tokens), percentiles in order, greedy answers compared across arms;
    the table has the new columns and the plot is written."""
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["bench-serve", str(talking), "--method", "autoregressive,auto",
                                       "--concurrency", "2", "--rate", "50", "--temperature", "0,0.7",
                                       "--prompts", "mixed", "--requests", "4", "--max-tokens", "4",
                                       "--threads", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads((out / "serve_bench.json").read_text())
    assert (report["arms"], report["prompts"], report["max_tokens"]) == (["autoregressive", "auto"], "mixed", 4)
    results = report["results"]
    assert [(r["temperature"], r.get("concurrency", r.get("rate")), r["arm"]) for r in results] == [
        (t, load, arm) for t in (0.0, 0.7) for load in (2, 50.0) for arm in ("autoregressive", "auto")]
    for r in results:
        assert (r["requests"], r["tokens"]) == (4, 16)
        assert r["tokens_per_s"] == pytest.approx(16 / r["wall_s"]) and r["requests_per_s"] == pytest.approx(
            4 / r["wall_s"])
        ttft, itl, e2e = r["ttft_s"], r["itl_s"], r["e2e_s"]
        assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"] <= e2e["p99"] and e2e["p50"] <= e2e["p99"]
        assert 0 < itl["p50"] <= itl["p99"]
        # every token after a row's first (its prefill's) took a round of the server's batch
        assert sum(int(n) * k for n, k in r["batch_rounds"].items()) == 4 * 3
        assert 1 <= r["rows_per_round"] <= (2 if "concurrency" in r else 4)
        assert r["same_answers"] == (None if r["temperature"] or r["arm"] == "autoregressive" else 4)
    table = (out / "serve_bench.md").read_text()
    assert "| T | load | arm | tok/s | × autoregressive | req/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p99 (ms) |" \
           in table
    r = results[1]
    assert f"| 0 | c = 2 | auto | {r['tokens_per_s']:.1f} | {r['x_first_arm']:.2f} | {r['requests_per_s']:.2f} | " \
           f"{1e3 * r['ttft_s']['p50']:.0f} / " in table and "| 4/4 |" in table and "| 0.7 | 50/s | auto |" in table
    assert (out / "serve_bench.png").stat().st_size > 10_000
    bad = CliRunner().invoke(main, ["bench-serve", str(talking), "--method", "autoregressive,fast", "--out",
                                    str(tmp_path / "none")])
    assert bad.exit_code == 2 and "'autoregressive,fast'" in bad.output and "autoregressive,auto" in bad.output


def test_serving_figures_as_functions():
    """The percentiles are numpy's; Poisson arrivals have gaps of mean 1/rate, start at 0 and repeat for a seed;
    a turn's rounds are its requests' largest count, and after a turn of the same arm and temperature (the server
    kept its batch) they count from that turn's end, from zero after another kind's."""
    import numpy as np
    from specrt.measurement.serve_bench import _Rounds, percentile, poisson_arrivals
    values = [0.3, 5.0, 1.2, 0.7, 2.2, 9.1, 0.05]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    at = poisson_arrivals(2000, 4.0, seed=1)
    assert at[0] == 0 and at == sorted(at) and at == poisson_arrivals(2000, 4.0, seed=1) != poisson_arrivals(
        2000, 4.0, seed=2)
    assert at[-1] / (len(at) - 1) == pytest.approx(0.25, rel=0.08)

    def answered(*counts):
        return [{"stats": {"batch_rounds": {str(n): {"rounds": r, "speculative": 0} for n, r in c.items()}}}
                for c in counts]
    rounds = _Rounds()
    assert rounds.turn(("auto", 0.0), answered({1: 5})) == {1: 5}
    assert rounds.turn(("auto", 0.0), answered({1: 7, 2: 3}, {1: 6, 2: 3})) == {1: 2, 2: 3}
    assert rounds.turn(("autoregressive", 0.0), answered({1: 4})) == {1: 4}
    assert rounds.turn(("autoregressive", 0.7), answered({2: 6})) == {2: 6}


# ---- measurement.fresh ------------------------------------------------------------------------------------------
def test_fresh_processes_auto_against_autoregressive(talking, tmp_path, monkeypatch):
    """`python -m specrt.measurement.fresh` with --untuned: every prompt calls `specrt generate --json` once per arm,
    the arms' order rotating; the summary is the calls' own figures. (The calls run in this process through the CLI:
    a process each would cost seconds of imports, and its start is not what is tested.)"""
    from specrt.measurement import fresh
    calls = []

    def run(cmd, capture_output, text):   # `python -m specrt.cli generate ...`, here
        assert cmd[1:3] == ["-m", "specrt.cli"] and capture_output and text
        calls.append(cmd)
        done = CliRunner().invoke(main, cmd[3:])
        return subprocess.CompletedProcess(cmd, done.exit_code, done.stdout, "" if done.exit_code == 0 else
                                           done.output + repr(done.exception))

    monkeypatch.setattr(fresh, "subprocess", SimpleNamespace(run=run))   # fresh's calls only
    untuned = tmp_path / "untuned"
    shutil.copytree(talking, untuned)
    out = tmp_path / "fresh.json"
    result = CliRunner().invoke(fresh.main, [str(talking), "--prompts", "2", "--max-new-tokens", "5", "--untuned",
                                             str(untuned), "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    arms = [(c[4], c[c.index("--method") + 1] if "--method" in c else None) for c in calls]
    a, p, u = (str(talking), None), (str(talking), "autoregressive"), (str(untuned), None)
    assert arms == [a, p, u, p, u, a]   # prompt 0: auto first; prompt 1: the next arm first
    doc = json.loads(out.read_text())
    rows, s = doc["rows"], doc["summary"]
    assert s["prompts"] == len(rows) == 2
    for arm in (fresh.PLAIN, fresh.AUTO, fresh.COLD):
        runs = [row[arm] for row in rows]
        assert all(r["tokens"] == len(r["token_ids"]) == 5 for r in runs)
        assert s[arm]["tokens"] == 10
        assert s[arm]["tokens_per_s"] == pytest.approx(10 / sum(r["tokens"] / r["tokens_per_s"] for r in runs))
        assert s[arm]["wall_s"] == pytest.approx(sum(r["wall_s"] for r in runs))
        assert s[arm]["tokens_per_round"] == pytest.approx(8 / sum(r["rounds"] for r in runs))
        if arm != fresh.PLAIN:
            assert s[arm]["speedup"] == pytest.approx(s[arm]["tokens_per_s"] / s[fresh.PLAIN]["tokens_per_s"])
            assert s[arm]["identical"] == sum(row[arm]["token_ids"] == row[fresh.PLAIN]["token_ids"] for row in rows)
    assert s[fresh.PLAIN]["methods"] == ["autoregressive (request)"]
    assert "greedy output identical on" in result.output and "auto (untuned):" in result.output


# ---- measurement.large ------------------------------------------------------------------------------------------
def _in_process(args: list[str]) -> dict:
    """large.measured's stand-in: the step's command run in this process (`-m specrt.cli` through the CLI, `-m
    specrt.measurement.large --step` through its main), its output parsed as measured parses it."""
    from specrt.measurement import large
    assert args[0] == sys.executable and args[1] == "-m"
    out = StringIO()
    if args[2] == "specrt.cli":
        done = CliRunner().invoke(main, args[3:])
        assert done.exit_code == 0, done.output + repr(done.exception)
    else:
        assert args[2] == "specrt.measurement.large"
        with redirect_stdout(out):
            assert large.main(args[3:]) == 0
    text = out.getvalue()
    return {"wall_s": 0.1, "peak_rss_gb": 0.5, **({"output": json.loads(text)} if text.startswith("{") else {})}


def test_check_large_tiny_preset(tmp_path, monkeypatch):
    """make check-large's run at the tiny preset: the checkpoint, transformers' tokens, both exports, the float32
    and int4 builds and their tokens; the report (also written to WORK/large-tiny.json) has every step and says the
    engines' tokens are transformers' (int4: ngram's are autoregressive's), and the engine sets are removed after.
    Each step runs in this process (the check's processes would cost seconds of imports each); `measured` itself:
    the next test."""
    from specrt.measurement import large
    monkeypatch.setattr(large, "measured", _in_process)
    lines = []
    report = large.run_check("tiny", tmp_path, log=lines.append)
    assert report == json.loads((tmp_path / "large-tiny.json").read_text())
    shape = large.PRESETS["tiny"]
    d, f, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = d // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = d * (d + 2 * kv + d) + 3 * d * f + 2 * d
    assert report["parameters"] == 2 * v * d + layers * per_layer + d   # embeddings, lm_head, layers, final norm
    assert report["float32_weights_gb"] == pytest.approx(report["parameters"] * 4 / 1e9)
    assert set(report["steps"]) == {
        "reference (transformers)", "export float32", "build float32 export -> float32 engine",
        "generate float32 export, float32 engine", "build float32 export -> int4 engine", "generate int4 engine",
        "export bfloat16", "build bfloat16 export -> float32 engine", "generate bfloat16 export, float32 engine"}
    assert report["tokens"] == {"float32 export, float32 engine == transformers (float32 weights)": True,
                                "bfloat16 export, float32 engine == transformers (bfloat16 weights)": True,
                                "int4 engine: ngram == autoregressive": True}
    assert report["failures"] == []
    for name in ("load_float32", "load_bfloat16", "load_int4"):   # (loaded in this process: the figures are noise)
        assert set(report[name]) == {"engine_gb", "rss_added_by_load_gb", "ratio"}
    reference = json.loads((tmp_path / "reference-tiny.json").read_text())
    assert [len(row) for row in reference["float32"]] == [large.NEW_TOKENS] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["large-tiny.json", "llama-tiny", "reference-tiny.json"]
    assert "  float32 export, float32 engine == transformers (float32 weights): identical" in lines


def test_large_measured_child_peak_and_output():
    """large.measured: a child's wall time (it sleeps 0.5 s; rounded to 0.1 s), its own peak resident memory
    (ru_maxrss: 200 MB it wrote and freed) and its JSON output; a failing child is an error with its stderr."""
    from specrt.measurement import large
    code = "import json, time; b = b'x' * (200 << 20); del b; time.sleep(0.5); print(json.dumps({'done': 1}))"
    began = time.perf_counter()
    r = large.measured([sys.executable, "-c", code])
    assert 0.5 <= r["wall_s"] <= time.perf_counter() - began + 0.05   # (rounding adds at most 0.05)
    assert r["output"] == {"done": 1} and r["peak_rss_gb"] >= 0.2
    with pytest.raises(RuntimeError, match="failed \\(3\\):\n.*gone"):
        large.measured([sys.executable, "-c", "import sys; sys.stderr.write('gone'); sys.exit(3)"])


# ---- measurement.report -----------------------------------------------------------------------------------------
def _run(method: str, prompt: str, tokens: int, time_s: float, **kw) -> dict:
    return {"system": "specrt", "method": method, "temperature": 0.0, "prompt": prompt, "tokens": tokens,
            "time_s": time_s, "tokens_per_s": tokens / time_s, **kw}


def test_report_figures_from_known_runs(tmp_path):
    """report.write_outputs on runs whose totals are known: each summary row is its runs' sums and ratios, the
    prediction is the cost model's, the sweep's speedups are against its own autoregressive runs, llama.cpp's
    agreement is counted, and report.md prints those figures."""
    from specrt.decoding.adaptive import Costs
    from specrt.measurement.report import write_outputs
    verify = {k: 0.010 + 0.001 * (k - 1) for k in range(1, 10)}
    costs = {"draft_step_s": 0.002, "verify_s": verify, "c": 0.2}
    step = dict(rounds=10, loop_time_s=0.01, decode_time_s=0.9, prefill_s=0.1, prompt_tokens=6)
    runs = [_run("autoregressive", "a", 10, 1.0, **step), _run("autoregressive", "b", 10, 2.0, **step),
            _run("draft", "a", 10, 0.5, alpha=0.5, gamma_mean=3, mean_tokens_per_round=2.0, plain_rounds=0,
                 acceptance_per_position=[0.8, 0.4], **{**step, "rounds": 5}),
            _run("draft", "b", 10, 0.5, alpha=0.7, gamma_mean=3, mean_tokens_per_round=3.0, plain_rounds=1,
                 acceptance_per_position=[1.0], **{**step, "rounds": 5}),
            {**_run("generate", "a", 8, 1.0), "system": "llama.cpp", "first_divergence": None, "rounds": 8},
            {**_run("generate", "b", 8, 1.0), "system": "llama.cpp", "first_divergence": 3, "rounds": 8}]
    sweep = [_run("autoregressive", "a", 10, 1.0), _run("draft", "a", 10, 0.5, gamma=2, alpha=0.6),
             _run("draft", "a", 10, 0.25, gamma=4, alpha=0.8)]
    info = {"engines": "e", "target": "t", "draft": "d", "prompts": "p", "threads": 2, "cores": 2, "processor": "x",
            "platform": "y", "load_average": 1.0, "load_average_end": 1.5, "costs": costs, "weight_bytes": 4e8,
            "bandwidth_bytes_per_s": 1e10, "floor_step_s": 0.04}
    config = SimpleNamespace(methods=["autoregressive", "draft"], temperatures=[0.0], max_new_tokens=10,
                             gamma_sweep=[2, 4], peers=False, seed=0, acceptance=["exact"], out=tmp_path)
    done = write_outputs(SimpleNamespace(config=config, info=info, runs=runs, sweep=sweep, memory=[], notes=["n1"]))
    rows = {(r["system"], r["method"]): r for r in done["summary"]}
    ar, draft, cpp = rows[("specrt", "autoregressive")], rows[("specrt", "draft")], rows[("llama.cpp", "generate")]
    assert (ar["tokens"], ar["time_s"], ar["tokens_per_s"], ar["speedup"]) == (20, 3.0, pytest.approx(20 / 3), 1.0)
    assert ar["speedup_range"] == [1.0, 1.0] and ar["c"] is None and ar["predicted_speedup"] is None
    assert draft["tokens_per_s"] == 20.0 and draft["speedup"] == pytest.approx(3.0)
    assert draft["speedup_range"] == pytest.approx([20 / 10, 20 / 5])   # prompt a: 20 against 10, b: 20 against 5
    assert draft["alpha"] == pytest.approx(0.6) and draft["c"] == pytest.approx(0.2)
    assert draft["predicted_speedup"] == pytest.approx(Costs(0.002, verify).predicted_speedup(0.6, 3))
    assert draft["plain_share"] == pytest.approx(1 / 10) and draft["mean_tokens_per_round"] == 2.5
    assert draft["acceptance_per_position"] == pytest.approx([0.9, 0.4])
    assert draft["host_ms_per_round"] == pytest.approx(1e3 * 0.02 / 10)
    assert draft["decode_tokens_per_s"] == pytest.approx(18 / 0.8)
    assert cpp["speedup"] == pytest.approx(8 / (20 / 3)) and cpp["c"] is None
    r = done["results"]
    assert r["floor"]["autoregressive_step_s"] == pytest.approx(0.09) and r["floor"]["ratio"] == pytest.approx(2.25)
    assert r["llamacpp_agreement"] == {"prompts": 2, "identical": 1, "first_divergence": [None, 3]}
    assert [(s["gamma"], s["speedup"]) for s in r["sweep"]] == [(2, 2.0), (4, 4.0)]
    assert r["sweep"][0]["pooled_alpha"] == pytest.approx(0.7)
    md = (tmp_path / "report.md").read_text()
    assert "| specrt | draft | 0 | 20.0 | 3.00 | 2.00–4.00 | 0.60 | 0.200 |" in md
    assert "llama.cpp's greedy output equalled specrt autoregressive's on 1 of 2 prompts; the others first differ " \
           "at token 3" in md
    assert "**2.25×** the floor" in md and "- n1" in md and "## Speedup against γ" in md
    assert json.loads((tmp_path / "results.json").read_text())["summary"][0]["tokens"] == done["summary"][0]["tokens"]
    assert all(p.stat().st_size > 0 for p in done["paths"])


def test_report_sweep_beyond_the_measured_passes(tmp_path):
    """A γ of the sweep past the passes bench timed (1 .. MAX_GAMMA + 1) still gets a prediction from the cost model
    (--gamma-sweep takes any γ up to 64), instead of failing at the report, after the whole bench has run."""
    from specrt.decoding.adaptive import Costs
    from specrt.measurement.report import summarize_sweep
    costs = Costs(0.002, {k: 0.010 + 0.001 * (k - 1) for k in range(1, 10)})
    sweep = [_run("autoregressive", "a", 10, 1.0), _run("draft", "a", 10, 0.5, gamma=12, alpha=0.9)]
    (row,) = summarize_sweep(sweep, costs)
    assert row["gamma"] == 12 and row["speedup"] == 2.0
    from specrt.decoding.adaptive import expected_tokens
    assert row["predicted_costs"] == pytest.approx(expected_tokens(0.9, 12) * 0.010 / (12 * 0.002 + 0.022))


# ---- make train-eagle3 ------------------------------------------------------------------------------------------
def test_make_train_eagle3_recipe_parses_and_resolves():
    """`make -n train-eagle3` prints its recipe; the command, dry-run through the CLI, resolves to what the
    Makefile's comment says it trains: 900 steps at 5e-4, 120 minutes, on train-data's data, the three default
    feature layers of SmolLM2 (2, 15, 27) and its 12,288 most-written ids. A renamed flag fails here."""
    from specrt.export.eagle3 import default_layers
    text = subprocess.run(["make", "-n", "train-data", "train-eagle3", "SPECRT=specrt"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout.replace("\\\n", " ")
    calls = {c[2]: c for c in (shlex.split(line) for line in text.splitlines() if line.startswith("specrt train "))}
    assert set(calls) == {"data", "eagle3"}
    data_out = calls["data"][calls["data"].index("--out") + 1]
    result = CliRunner().invoke(main, [*calls["eagle3"][1:], "--dry-run"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output[result.output.index("{"):])
    s = plan["settings"]
    assert (s["steps"], s["lr"], s["max_minutes"], s["kept_vocab"]) == (900, 5e-4, 120.0, 12288)
    assert (s["data"], s["work"], plan["out"]) == (f"{data_out}/data.jsonl", "build/eagle3-train",
                                                    "build/eagle3-smollm2")
    assert s["layers"] == [] and default_layers(plan["target"]["num_layers"]) == (2, 15, 27)
