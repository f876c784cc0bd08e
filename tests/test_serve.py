"""specrt serve: a real server process, driven with the official openai client."""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import threading
import time
import types
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import hypothesis
import jsonschema
import openai
import pytest
import schemathesis
import torch

from conftest import export_tiny_with_heads, load_prompts
from greedy_check import assert_same_or_tie
from specrt.decoding.generate import Generator
from specrt.serving.completions import StopText
from specrt.serving.server import SHUTDOWN_GRACE_S
from specrt.measurement.serve_bench import server

VOCAB, MAX_LEN = 128, 256


def running_server(engines, log_path, *args):
    """`specrt serve ENGINES` on a free port until /health answers; yields (base url, the server's process id)."""
    return server(engines, log_path, *args, wait_s=120)


def post(url: str, body: bytes | dict, timeout: float = 60) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sse(url: str, body: dict, timeout: float = 60):
    """A streamed answer's events as they come: each chunk (or error) parsed, the last one "[DONE]"."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if line.startswith(b"data: "):
                data = line[len(b"data: "):].strip()
                yield "[DONE]" if data == b"[DONE]" else json.loads(data)


def wait_for(condition, what: str, timeout: float = 60):
    """Poll `condition` until it holds and return its value; fail, saying `what` did not happen, after `timeout`
    seconds (generous: a loaded machine is slow, not wrong)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"
        time.sleep(0.05)
    return value


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        return json.loads(r.read())


def waiting_requests(url: str, key: str | None = None) -> int:
    """The requests waiting for a row: /metrics' gauge (the open /health says only whether the server lives)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers), timeout=30) as r:
        line = next(line for line in r.read().decode().splitlines() if line.startswith("specrt:num_requests_waiting"))
    return int(float(line.rsplit(" ", 1)[1]))


def chunk_ids(events: list) -> list[int]:
    return [i for e in events if isinstance(e, dict) for c in e.get("choices", []) for i in c["token_ids"]]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def stream_ids(stream) -> tuple[list[int], str | None, object]:
    """Token ids, the finish reason and the usage of a streamed completion."""
    ids, reason, usage = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            ids += choice.token_ids
            reason = choice.finish_reason or reason
    return ids, reason, usage


# ---- a tiny engine set (target, draft, Medusa heads; no tokenizer): token ids in, token ids out ------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    directory, _ = export_tiny_with_heads(tmp, VOCAB, num_heads=3, max_seq_len=MAX_LEN)
    log = tmp / "server.log"
    args = "--model-name", "tiny", "--threads", "1", "--prefix-cache", "1"   # a 1 MB prefix cache
    with running_server(directory, log, *args) as (url, pid):
        yield Generator.from_engines(directory, threads=1), url, log, pid


def test_models_and_completion(tiny):
    gen, url, *_ = tiny
    api = client(url)
    assert [m.id for m in api.models.list().data] == ["tiny"]
    out = api.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=12, temperature=0)
    want = gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=12, method="autoregressive")
    assert out.choices[0].token_ids == want.token_ids[0]
    assert out.choices[0].finish_reason == "length" and out.choices[0].text == ""
    # the server's default method is auto: no tuning here, so the rule's (a draft model, no EAGLE drafter)
    assert (out.specrt["method"], out.specrt["method_from"]) == ("draft", "rule")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 12, 15)
    # n choices, sampled with a seed: the generator's own rows for that seed (a fixed gamma: the adaptive one
    # follows timings, and with it the random draws)
    out = api.completions.create(model="tiny", prompt=[5, 6], max_tokens=6, n=3, temperature=0.8, seed=4,
                                 extra_body={"specrt": {"method": "draft", "gamma": 2}})
    want = gen.generate(prompt_ids=[5, 6], max_new_tokens=6, num_return_sequences=3, temperature=0.8, seed=4,
                        method="draft", gamma=2)
    assert [c.token_ids for c in out.choices] == want.token_ids
    assert out.usage.completion_tokens == 18 and out.specrt["method"] == "draft"


def test_typical_acceptance_is_asked_for_and_labelled(tiny):
    """`specrt.acceptance` "typical": the request runs with typical acceptance (a seeded request: the generator's own
    tokens for that seed) and every answer says it is not the target's distribution: the completion's `specrt`
    field, n choices' fields, a stream's last chunk. The default stays exact."""
    gen, url, *_ = tiny
    api = client(url)
    typical = {"specrt": {"method": "draft", "gamma": 2, "acceptance": "typical"}}
    out = api.completions.create(model="tiny", prompt=[5, 6], max_tokens=8, temperature=0.8, seed=4,
                                 extra_body=typical)
    want = gen.generate(prompt_ids=[5, 6], max_new_tokens=8, temperature=0.8, seed=4, method="draft", gamma=2,
                        acceptance="typical")
    assert out.choices[0].token_ids == want.token_ids[0]
    assert (out.specrt["acceptance"], out.specrt["distribution_preserving"]) == ("typical", False)
    out = api.completions.create(model="tiny", prompt=[5, 6], max_tokens=8, n=2, temperature=0.8, extra_body=typical)
    assert (out.specrt["acceptance"], out.specrt["distribution_preserving"]) == ("typical", False)
    assert all(not c["distribution_preserving"] for c in out.specrt["choices"])
    stream = api.completions.create(model="tiny", prompt=[5, 6], max_tokens=8, temperature=0.8, stream=True,
                                    extra_body=typical)
    stats = [s for s in (getattr(chunk, "specrt", None) for chunk in stream) if s]
    assert len(stats) == 1 and stats[0]["acceptance"] == "typical" and not stats[0]["distribution_preserving"]
    out = api.completions.create(model="tiny", prompt=[5, 6], max_tokens=8, temperature=0.8,
                                 extra_body={"specrt": {"method": "draft"}})
    assert (out.specrt["acceptance"], out.specrt["distribution_preserving"]) == ("exact", True)


def test_logprobs_of_n_choices_without_a_tokenizer(tiny):
    """Legacy completions' logprobs on an engine set without a tokenizer: tokens spelled token_id:N, each of n
    choices with its own, equal to the generator's for the same seed: the chosen token's log-probability, and the
    top N with the chosen one (OpenAI: up to N + 1)."""
    gen, url, *_ = tiny
    out = client(url).completions.create(model="tiny", prompt=[5, 6], max_tokens=6, n=2, temperature=0.8, seed=4,
                                         logprobs=2, extra_body={"specrt": {"method": "draft", "gamma": 2}})
    want = gen.generate(prompt_ids=[5, 6], max_new_tokens=6, num_return_sequences=2, temperature=0.8, seed=4,
                        method="draft", gamma=2, logprobs=2)
    for choice, ids, lps in zip(out.choices, want.token_ids, want.logprobs):
        got = choice.logprobs
        assert choice.token_ids == ids and got.tokens == [f"token_id:{t}" for t in ids]
        assert got.token_logprobs == pytest.approx([lp.logprob for lp in lps], abs=1e-6)
        assert got.top_logprobs == [pytest.approx({f"token_id:{t}": v for t, v in lp.top} |
                                                  {f"token_id:{lp.token}": lp.logprob}, abs=1e-6) for lp in lps]
        assert got.text_offset == [0] * 6   # no text


def test_stop_token_ids_end_the_sequence_there(tiny):
    """stop_token_ids (vLLM's extension): the sequence ends at the first of them, which is its last token, though the
    round that made it accepted drafts beyond it (dropped); finish_reason stop, streamed and not."""
    gen, url, *_ = tiny
    api = client(url)
    body = dict(model="tiny", prompt=[1, 2, 3] * 3, max_tokens=16, temperature=0,
                extra_body={"specrt": {"method": "medusa", "adaptive": False}})
    rounds = [[i for c in chunk.choices for i in c.token_ids] for chunk in api.completions.create(**body, stream=True)]
    ids = [i for r in rounds for i in r]
    # a token that a round made with more after it, and that the output has not had before
    stop, at = next((t, len(sum(rounds[:k], [])) + j) for k, r in enumerate(rounds) for j, t in enumerate(r[:-1])
                    if t not in sum(rounds[:k], []) + r[:j])
    body["extra_body"]["stop_token_ids"] = [stop, 127]
    out = api.completions.create(**body)
    assert (out.choices[0].token_ids, out.choices[0].finish_reason) == (ids[:at + 1], "stop")
    assert out.specrt["stop_reason"] == "stop_token" and out.specrt["tokens"] == at + 1 == out.usage.completion_tokens
    assert stream_ids(api.completions.create(**body, stream=True))[:2] == (ids[:at + 1], "stop")


def test_concurrent_streams_join_one_batch(tiny):
    """Eight streams at once with different prompts: they are decoded together (the server's figures show rounds
    of several rows), each is the greedy output of a lone generate."""
    gen, url, *_ = tiny
    api = client(url)
    prompts = [[1 + i, 2 * i + 3, 5, i, 7 + i][: 2 + i % 4] for i in range(8)]

    def run(prompt):
        stream = api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"specrt": {"method": "draft"}})
        ids, reason, usage, stats = [], None, None, None
        for chunk in stream:
            usage, stats = chunk.usage or usage, getattr(chunk, "specrt", None) or stats
            for choice in chunk.choices:
                ids += choice.token_ids
                reason = choice.finish_reason or reason
        return ids, reason, usage, stats

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, prompts))
    for prompt, (ids, reason, usage, stats) in zip(prompts, results):
        assert ids == gen.generate(prompt_ids=prompt, max_new_tokens=24, method="draft").token_ids[0], prompt
        assert reason == "length" and usage.completion_tokens == 24 and usage.prompt_tokens == len(prompt)
        assert usage.prompt_tokens_details.cached_tokens == stats["prefix_cache_tokens"] == 0   # prompts < a block
        assert stats["method"] == "draft" and stats["tokens"] == 24
        assert stats["ttft_s"] > 0 and 0 < stats["itl_mean_s"] <= stats["itl_max_s"]   # the scheduler's timing
    sizes = {int(n) for r in results for n in r[3]["batch_rounds"]}
    assert max(sizes) >= 2, f"the streams were never decoded together: rounds by batch size {sizes}"


def test_requests_of_other_methods_wait_their_turn(tiny):
    gen, url, *_ = tiny
    api = client(url)
    jobs = [([1, 2, 3, 1, 2, 3], "autoregressive"), ([7, 8, 9, 10], "draft"), ([4, 5, 4, 5, 4], "ngram"),
            ([11, 12], "medusa")]

    def run(job):
        prompt, method = job
        return stream_ids(api.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"specrt": {"method": method}}))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, jobs))
    for (prompt, method), (ids, reason, usage) in zip(jobs, results):
        assert ids == gen.generate(prompt_ids=prompt, max_new_tokens=24, method=method).token_ids[0], method
        assert reason == "length" and usage.completion_tokens == 24 and usage.prompt_tokens == len(prompt)


def scrape(url: str) -> dict:
    """GET /metrics, parsed: {(sample name, ((label, value), ...)): value}."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), r.headers["Content-Type"]
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


RUNNING = ("specrt:num_requests_running", (("model_name", "tiny"),))   # the gauge's key in scrape()'s answer


def test_metrics_count_what_the_answers_say(tiny):
    """/metrics after Medusa requests (streamed, not streamed, n = 2 sampled): the speculative-decoding counters and
    the token counts grew by the sums of the answers' own figures, each sequence is in the latency histograms and
    its finish reason counted; the gauges come back to 0. Several servers in one process count apart."""
    from specrt.serving.metrics import VLLM_NAMES, Metrics
    gen, url, *_ = tiny
    api = client(url)
    medusa = {"specrt": {"method": "medusa"}}
    before = scrape(url)

    def run(prompt):
        stream = api.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                        extra_body=medusa)
        return [s for s in (getattr(chunk, "specrt", None) for chunk in stream) if s][0]

    prompts = [[1, 2, 3], [4, 5], [9, 8, 7, 6]]
    with ThreadPoolExecutor(3) as pool:
        stats = list(pool.map(run, prompts))
    stats.append(api.completions.create(model="tiny", prompt=[7, 7], max_tokens=9, temperature=0,
                                        extra_body=medusa).specrt)
    out = api.completions.create(model="tiny", prompt=[3, 1], max_tokens=7, n=2, temperature=0.9, extra_body=medusa)
    stats += out.specrt["choices"]
    prompt_tokens = sum(map(len, prompts)) + 2 + 2
    after = wait_for(lambda: (m := scrape(url))[RUNNING] == 0 and m, "the running gauge came back to 0")

    def grew(name, **labels):
        key = (name, tuple(sorted({"model_name": "tiny", "method": "medusa", **labels}.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("specrt:spec_decode_num_drafts_total") == sum(s["drafts"] for s in stats) > 0
    assert grew("specrt:spec_decode_num_draft_tokens_total") == sum(s["draft_tokens"] for s in stats) > 0
    accepted = sum(s["accepted_tokens"] for s in stats)
    assert grew("specrt:spec_decode_num_accepted_tokens_total") == accepted
    depth = max(len(s["accepted_per_position"]) for s in stats)
    per_pos = [sum(s["accepted_per_position"][i] for s in stats if i < len(s["accepted_per_position"]))
               for i in range(depth)]
    assert [grew("specrt:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(depth)] \
        == per_pos and sum(per_pos) == accepted
    assert grew("specrt:generation_tokens_total") == sum(s["tokens"] for s in stats) == 3 * 20 + 9 + 2 * 7
    assert grew("specrt:prompt_tokens_total") == prompt_tokens
    assert grew("specrt:request_success_total", finished_reason="length") == len(stats)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert grew(f"specrt:{name}_count") == len(stats), name
    assert grew("specrt:request_queue_time_seconds_count") == 5                 # requests, not sequences
    assert grew("specrt:inter_token_latency_seconds_count") > 0
    assert after[("specrt:num_requests_waiting", (("model_name", "tiny"),))] == 0
    for ours, theirs in VLLM_NAMES.items():   # vLLM's names: the same samples, labels and values
        for (name, labels), value in after.items():
            if name.removeprefix("specrt:").removesuffix("_total").removesuffix("_count") == ours:
                assert all(after[(f"vllm:{n}" + name[len("specrt:" + ours):], labels)] == value for n in theirs)
    assert grew("vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert [grew("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(depth)] \
        == per_pos
    assert grew("vllm:request_success_total", finished_reason="length") == len(stats)
    assert grew("vllm:time_to_first_token_seconds_count") == grew("vllm:e2e_request_latency_seconds_count") \
        == len(stats)
    assert grew("vllm:inter_token_latency_seconds_count") == grew("vllm:time_per_output_token_seconds_count") > 0
    tiny_only = (("model_name", "tiny"),)
    assert after[("vllm:kv_cache_usage_perc", tiny_only)] == after[("vllm:gpu_cache_usage_perc", tiny_only)] == 0
    stream = api.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=MAX_LEN - 4, temperature=0,
                                    stream=True)
    next(iter(stream))   # one row live: 1 of the batch's 8 rows, its prompt and tokens in its positions (read
    # from the batch at the scrape; the running gauge is set at the top of the next round, so not asked here)
    during = scrape(url)
    stream.close()
    assert during[("vllm:kv_cache_usage_perc", tiny_only)] == during[("specrt:kv_cache_usage_perc", tiny_only)] \
        == 1 / 8
    assert 4 / (8 * MAX_LEN) <= during[("specrt:kv_cache_positions_perc", tiny_only)] <= 1 / 8
    one, two = Metrics("a", lambda: 0), Metrics("b", lambda: 0)                 # a registry each: no collision
    one.finish("draft", "stop")
    assert b'finished_reason="stop"' in one.exposition() and b'finished_reason="stop"' not in two.exposition()


def prefix_cache_figures(url: str) -> dict:
    """/metrics' prefix-cache counters and gauges of the model "tiny", by name without the prefix and _total."""
    return {name[len("specrt:prefix_cache_"):].removesuffix("_total"): value
            for (name, labels), value in scrape(url).items()
            if name.startswith("specrt:prefix_cache") and labels == (("model_name", "tiny"),)}


SHARED = 100   # a shared prefix's tokens: three whole blocks of 32 cached, the rest prefilled


def shared_prefix_pairs(seed: int) -> list[tuple[str, list[int], list[int]]]:
    """For each method of the tiny set: two prompts that share SHARED random tokens (another prefix per method)."""
    rng = random.Random(seed)
    pairs = []
    for method in ("autoregressive", "draft", "medusa"):
        prefix = [rng.randrange(1, VOCAB) for _ in range(SHARED)]
        pairs.append((method, prefix + [5], prefix + [6, 7]))
    return pairs


def test_a_shared_prefix_comes_from_the_prefix_cache(tiny):
    """The server's 1 MB prefix cache (--prefix-cache 1): of two requests sharing a 100-token prefix, the second's
    `specrt` stats say 96 prompt tokens (three whole blocks) came from the cache, for each method; /metrics'
    prefix-cache counters grew by the answers' figures and the cache holds within its bound; every answer equals
    the lone generator's (no cache) greedy tokens."""
    gen, url, *_ = tiny
    assert gen.prefix_cache is None
    api = client(url)
    before = prefix_cache_figures(url)
    queried = 0
    for method, first, second in shared_prefix_pairs(57):
        cached = []
        for prompt in (first, second):
            out = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"specrt": {"method": method}})
            want = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="autoregressive")
            assert out.choices[0].token_ids == want.token_ids[0], method
            cached.append(out.specrt["prefix_cache_tokens"])
            assert out.usage.prompt_tokens_details.cached_tokens == cached[-1]   # OpenAI's field says it too
            queried += len(prompt)
        assert cached == [0, SHARED // 32 * 32], method
    after = prefix_cache_figures(url)
    grew = {k: after[k] - before.get(k, 0) for k in ("queries", "hits", "requests", "request_hits")}
    assert grew == {"queries": queried, "hits": 3 * 96, "requests": 6, "request_hits": 3}
    assert 0 < after["bytes"] <= after["max_bytes"] == 2**20
    assert health(url) == {"status": "ok"}   # open to anyone: no figures of others' requests


def test_prefix_cache_0_serves_without_one(tiny):
    """`load(prefix_cache_mb=0)` (--prefix-cache 0) serves the same requests with no cache: no cached tokens, no
    lookups counted, a bound of 0, the same greedy tokens; without a size a server gets the default rule's."""
    from specrt.serving.server import PREFIX_CACHE_MB, create_app, default_prefix_cache_mb, load
    lone, *_ = tiny
    gen = load(lone.directory, threads=1, prefix_cache_mb=0)
    assert gen.prefix_cache is None and 0 < default_prefix_cache_mb("cpu") <= PREFIX_CACHE_MB
    with in_process(create_app(gen, "tiny")) as url:
        api = client(url)
        for method, first, second in shared_prefix_pairs(57)[:2]:
            for prompt in (first, second):
                out = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                             extra_body={"specrt": {"method": method}})
                want = lone.generate(prompt_ids=prompt, max_new_tokens=12, method="autoregressive")
                assert out.choices[0].token_ids == want.token_ids[0] and out.specrt["prefix_cache_tokens"] == 0
        assert set(prefix_cache_figures(url).values()) == {0}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_memory_flat_over_500_requests(tiny):
    """500 requests, 8 at a time, half of them streamed and a tenth closed early: the server's resident memory
    after them is within a few MB of what it was after the first 100."""
    gen, url, _, pid = tiny
    api = client(url)

    def run(i):
        prompt = [1 + i % 50, 2 + i % 7, 3]
        if i % 2:
            stream = api.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, stream=True)
            for n, _ in enumerate(stream):
                if i % 10 == 1 and n == 1:
                    stream.close()
                    break
        else:
            api.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                   extra_body={"specrt": {"method": ("draft", "ngram")[i % 4 // 2]}})

    def idle_rss() -> float:   # once the rows of the streams closed early have been freed too
        wait_for(lambda: scrape(url)[RUNNING] == 0, "the running gauge came back to 0")
        return rss_mb(pid)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(run, range(100)))
        warm = idle_rss()
        list(pool.map(run, range(100, 500)))
    grown = idle_rss() - warm
    print(f"server memory after 100 requests {warm:.1f} MB, after 500 {warm + grown:.1f} MB")
    assert grown < 16, f"the server's memory grew by {grown:.1f} MB over 400 requests"


BAD = [  # (body, status, the field the message must name)
    (b'{"prompt": [1, 2', 400, "JSON"),
    ({"model": "gpt-4", "prompt": [1]}, 404, "model"),
    ({"prompt": [1], "specrt": {"method": "beam"}}, 400, "specrt.method"),
    ({"prompt": [1], "specrt": {"method": "eagle"}}, 400, "specrt.method"),   # not in this engine set
    ({"prompt": [1], "specrt": {"acceptance": "lossy"}}, 400, "specrt.acceptance"),
    ({"prompt": [1], "temperature": -0.5}, 400, "temperature"),
    ({"prompt": [1], "temperature": 1e-39}, 400, "temperature"),            # overflows float32
    ({"prompt": [1], "top_p": 0}, 400, "top_p"),
    ({"prompt": [1], "top_p": 1.5}, 400, "top_p"),
    ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [1], "n": 0}, 400, "n"),
    ({"prompt": [1], "n": 2, "stream": True}, 400, "n"),
    ({"prompt": list(range(3)) * 90}, 400, "prompt"),                        # 270 tokens > 256
    ({"prompt": [VOCAB]}, 400, "prompt"),
    ({"prompt": "text needs a tokenizer"}, 400, "prompt"),
    ({"prompt": [1], "stop": [""]}, 400, "stop"),
]


def test_bad_input_answered_and_server_keeps_serving(tiny):
    gen, url, *_ = tiny
    for body, status, field in BAD:
        code, doc = post(url + "/v1/completions", body)
        assert code == status, (body, doc)
        error = doc["error"]
        assert set(error) == {"message", "type", "param", "code"} and field in error["message"], (body, error)
        if field != "JSON":
            assert error["param"] == field, (body, error)
    code, doc = post(url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert code == 400 and doc["error"]["param"] == "messages"            # no chat template without a tokenizer
    code, doc = post(url + "/v1/chat/completions", {"messages": []})
    assert code == 400 and doc["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client(url).completions.create(model="tiny", prompt=[1], temperature=-1)
    out = client(url).completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert out.choices[0].token_ids == \
        gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=4, method="autoregressive").token_ids[0]


def test_closed_stream_stops_its_generation(tiny):
    gen, url, log, _ = tiny
    api = client(url)
    stream = api.completions.create(model="tiny", prompt=[1, 2], max_tokens=MAX_LEN - 3, temperature=0,
                                    stream=True)
    next(iter(stream))
    stream.close()
    out = api.completions.create(model="tiny", prompt=[3, 2, 1], max_tokens=8, temperature=0)
    assert out.choices[0].token_ids == \
        gen.generate(prompt_ids=[3, 2, 1], max_new_tokens=8, method="autoregressive").token_ids[0]
    stopped = wait_for(lambda: re.findall(r"generation stopped after (\d+) tokens", log.read_text()),
                       "the server logged no stopped generation")
    assert int(stopped[-1]) < MAX_LEN - 3


# ---- failures inside the engines: an in-process server over an engine that fails where a test says --------------

POISON = VOCAB - 1   # a prompt with this token fails its prefill pass
DRAFT_POISON = VOCAB - 2   # (test_failed_drafting_is_a_plain_step) a row with this token fails prompt lookup


class EngineFault(RuntimeError):
    pass


@contextlib.contextmanager
def in_process(app):
    """`app` under uvicorn on a thread of this process, on a free port, until the block ends; yields its URL."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def faulty(tiny):
    """`create_app` of the tiny engines under uvicorn in this process, its target's passes 5 ms slower (the streams
    are still running when the next request comes) and failing where the test says: a prefill pass over a prompt
    that holds POISON, or the next decode pass over at least `fail_rows[0]` rows once a test has put a count there.
    Yields the lone generator, the URL, fail_rows and the app's Server."""
    from specrt.serving.server import create_app
    lone = tiny[0]
    gen = Generator.from_engines(lone.directory, threads=1)
    forward, fail_rows = gen.target.forward, []

    def failing(ids, *args, **kw):   # ids (B, S): S = 1 in a decode pass, the prompt's length in its prefill
        if ids.shape[1] > 1 and bool((ids == POISON).any()):
            raise EngineFault("a prefill pass failed (the test's engine fault)")
        if ids.shape[1] == 1 and fail_rows and ids.shape[0] >= fail_rows[0]:
            fail_rows.clear()
            raise EngineFault("a decode pass failed (the test's engine fault)")
        time.sleep(0.005)
        return forward(ids, *args, **kw)

    gen.target.forward = failing
    app = create_app(gen, "tiny", method="autoregressive")
    with in_process(app) as url:
        yield lone, url, fail_rows, app.state.server


def started_streams(url: str, prompts: list[list[int]], max_tokens: int) -> list:
    """Streams of greedy completions, each past its first chunk."""
    streams = [sse(url + "/v1/completions", {"prompt": p, "max_tokens": max_tokens, "temperature": 0})
               for p in prompts]
    return [[next(stream)] + [stream] for stream in streams]


def test_failed_prefill_answers_its_own_request_alone(faulty):
    """Three streams run; a request whose prefill pass fails gets a 500 that names the failure (streamed: the
    same, before its stream begins); the three streams go on to their ends, each a lone generate's tokens."""
    lone, url, *_ = faulty
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    running = started_streams(url, prompts, 60)
    for stream in (False, True):
        code, doc = post(url + "/v1/completions", {"prompt": [3, POISON, 4], "max_tokens": 4, "temperature": 0,
                                                   "stream": stream})   # greedy: it joins the streams' batch
        assert code == 500 and doc["error"]["type"] == "server_error" and "EngineFault" in doc["error"]["message"]
    for prompt, (first, stream) in zip(prompts, running):
        events = [first, *stream]
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-2:]
        assert chunk_ids(events) == lone.generate(prompt_ids=prompt, max_new_tokens=60,
                                                  method="autoregressive").token_ids[0]


def test_failed_round_leaves_the_server_serving(faulty):
    """A decode pass that fails: the streams of its round end with an error chunk and [DONE], a request not streamed
    in it gets an OpenAI error object; then requests of other options (seeded, sampled, another method) all
    complete (in the old scheduler they waited for ever)."""
    lone, url, fail_rows, _ = faulty
    fail_rows.append(3)   # the first decode pass over the two streams and the request below fails
    running = started_streams(url, [[1, 2, 3], [4, 5]], 200)
    with ThreadPoolExecutor(1) as pool:
        plain = pool.submit(post, url + "/v1/completions", {"prompt": [6, 7], "max_tokens": 60, "temperature": 0})
        for first, stream in running:
            events = [first, *stream]
            assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error", events[-2:]
            assert "EngineFault" in events[-2]["error"]["message"] and len(chunk_ids(events)) < 200
        code, doc = plain.result()
    assert code == 500 and "EngineFault" in doc["error"]["message"], doc
    assert not fail_rows
    # seeded: the same draws as generate() only by the same method with no timing-driven choices
    others = [{"temperature": 0.8, "seed": 3}, {"temperature": 0.8}, {"temperature": 0},
              {"temperature": 0, "specrt": {"method": "ngram"}}]
    with ThreadPoolExecutor(len(others)) as pool:   # one that waits for ever times out
        answers = list(pool.map(lambda o: post(url + "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 8, **o},
                                               timeout=60), others))
    for options, (code, doc) in zip(others, answers):
        assert code == 200 and doc["usage"]["completion_tokens"] == 8, (options, doc)
    assert answers[0][1]["choices"][0]["token_ids"] == lone.generate(
        prompt_ids=[5, 6, 7], max_new_tokens=8, temperature=0.8, seed=3, method="autoregressive").token_ids[0]
    assert answers[2][1]["choices"][0]["token_ids"] == lone.generate(
        prompt_ids=[5, 6, 7], max_new_tokens=8, method="autoregressive").token_ids[0]


def test_failed_drafting_is_a_plain_step(faulty, monkeypatch):
    """Prompt lookup that fails in every round where a row holds DRAFT_POISON, with both requests in the batch:
    those rounds are plain steps for the whole batch (the batch counts them in its draft_failures), no request
    fails, and both streams are the target's greedy tokens."""
    from specrt.decoding.drafters import NgramDrafter
    lone, url, _, server = faulty
    scheduler, propose, fired = server.scheduler, NgramDrafter.propose, []

    def failing(self, run, gamma):
        deadline = time.monotonic() + 60
        while scheduler.taken + len(scheduler.waiting) < 2:   # the first round waits until both requests have come
            assert time.monotonic() < deadline, "the second request never reached the scheduler"
            time.sleep(0.01)
        if any(DRAFT_POISON in run.host_tokens[b, :run.host_lengths[b]] for b in range(run.batch)):
            fired.append(run.batch)
            raise EngineFault("drafting failed (the test's drafter fault)")
        return propose(self, run, gamma)

    monkeypatch.setattr(NgramDrafter, "propose", failing)
    before = scheduler.batch, scheduler.batch.draft_failures if scheduler.batch is not None else 0
    prompts = [[1, 2, 3, 1, 2], [4, DRAFT_POISON, 4, 5]]
    body = {"max_tokens": 30, "temperature": 0, "specrt": {"method": "ngram", "gamma": 3}}   # drafts every round
    with ThreadPoolExecutor(2) as pool:   # both sent at once, each stream read on its own thread
        answers = list(pool.map(lambda p: list(sse(url + "/v1/completions", {"prompt": p, **body})), prompts))
    for prompt, events in zip(prompts, answers):
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-2:]
        assert chunk_ids(events) == lone.generate(prompt_ids=prompt, max_new_tokens=30,
                                                  method="autoregressive").token_ids[0]
    assert 2 in fired, f"drafting never failed with both rows in the batch: rows at each failure {fired}"
    batch = scheduler.batch
    failures = batch.stats()["draft_failures"] - (before[1] if batch is before[0] else 0)
    assert failures == len(fired), (failures, fired)


def test_failed_hand_out_answers_its_own_request_alone(faulty, monkeypatch):
    """Turning one stream's tokens into text fails (at a token only its output holds): that stream ends with an
    error event, the other one, in the same batch, runs to its end with the target's tokens."""
    from specrt.decoding.batch import Detokenizer
    lone, url, *_ = faulty
    prompts = [[1, 2, 3], [4, 5]]
    want = [lone.generate(prompt_ids=p, max_new_tokens=40, method="autoregressive").token_ids[0] for p in prompts]
    bad = next(t for t in want[0][5:] if t not in want[1])
    feed = Detokenizer.feed

    def failing(self, ids, *args, **kw):
        if bad in ids:
            raise EngineFault("detokenizing failed (the test's fault)")
        return feed(self, ids, *args, **kw)

    monkeypatch.setattr(Detokenizer, "feed", failing)
    running = started_streams(url, prompts, 40)
    (first, stream), (other_first, other) = running
    events = [first, *stream]
    assert events[-1] == "[DONE]" and "EngineFault" in events[-2]["error"]["message"], events[-2:]
    assert bad not in chunk_ids(events)
    events = [other_first, *other]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and chunk_ids(events) == want[1], events[-2:]


@pytest.mark.parametrize("where", ["start-up", "loop"])
def test_dead_scheduler_fails_health_and_answers_503(tiny, where, caplog):
    """The scheduler thread fails outside any request's work: timing the target's passes at start-up (a CUDA
    out-of-memory at batch 8, say: here the first timing, once a request waits), or at the top of its loop (here
    the running gauge, once a request runs). /health is then a 503, the request that waited or ran and every new
    one (streamed or not) get a 503 error object that names the cause, and the log has the traceback: a supervisor
    restarts the process (in the old server /health said ok and every request waited for ever)."""
    from specrt.serving.server import create_app
    gen = Generator.from_engines(tiny[0].directory, threads=1)
    waits = threading.Event()

    def costs(*args, **kw):
        waits.wait(60)
        raise EngineFault("CUDA out of memory while timing batch 1 (the test's fault)")

    if where == "start-up":
        gen.costs = costs   # a speculative default method: the scheduler times the target's passes first
    app = create_app(gen, "tiny", method="draft" if where == "start-up" else "autoregressive")
    if where == "loop":
        running, fault = app.state.server.metrics.running, EngineFault("the running gauge failed (the test's fault)")

        class Gauge:   # set at the top of every round of the loop
            def set(self, value):
                if value > 0:
                    raise fault
                running.set(value)

        app.state.server.metrics.running = Gauge()
    try:   # Ray Serve's health check of a replica (the scale extra) reads the same state as /health
        from specrt.serving.replicas import Engine
        replica = types.SimpleNamespace(app=app)   # what the check reads of its replica
    except ImportError:
        Engine = None
    cause = "EngineFault: CUDA out of memory" if where == "start-up" else "EngineFault: the running gauge failed"
    request = {"prompt": [1, 2, 3], "max_tokens": 60, "temperature": 0}
    with in_process(app) as url, ThreadPoolExecutor(1) as pool:
        assert call(url, "/health", key=None)[0] == 200
        if Engine is not None:
            Engine.check_health(replica)
        first = pool.submit(post, url + "/v1/completions", request, timeout=90)
        if where == "start-up":
            wait_for(lambda: waiting_requests(url) == 1, "the request reached the scheduler")
            waits.set()
        code, doc, _ = wait_for(lambda: (a := call(url, "/health", key=None))[0] != 200 and a,
                                "the scheduler's death showed in /health")
        assert code == 503 and is_error(doc, "scheduler_died") and cause in doc["error"]["message"], doc
        for answer in (first.result(), post(url + "/v1/completions", request),
                       post(url + "/v1/completions", {**request, "stream": True})):
            code, doc = answer
            assert code == 503 and is_error(doc, "scheduler_died") and cause in doc["error"]["message"], doc
        if Engine is not None:
            with pytest.raises(RuntimeError, match=cause):
                Engine.check_health(replica)
    died = [r for r in caplog.records if "scheduler has died" in r.getMessage()]
    assert died and died[0].exc_info is not None and isinstance(died[0].exc_info[1], EngineFault), caplog.text[-2000:]


def test_stop_text():
    text = StopText(["</s>", "END"])
    assert text.feed("Hello <") == ("Hello ", False)     # "<" may begin "</s>": held back
    assert text.feed("b> and E") == ("<b> and ", False)
    assert text.feed("ND more") == ("", True)
    text = StopText(["\n\n"])
    assert text.feed("a\n") == ("a", False) and text.feed("b") == ("\nb", False) and text.flush() == ""


# ---- the default engines, a server of their own: bad prompts, a failed round, n, shutdown -----------------------

PROMPT = "The three largest cities in Europe are"


@pytest.fixture(scope="module")
def fresh(default_engines, tmp_path_factory):
    """`specrt serve` of the default engines (--max-batch 8) for the tests below; the last of them stops it."""
    log = tmp_path_factory.mktemp("serve-fresh") / "server.log"
    with running_server(default_engines, log) as (url, pid):
        yield url, pid


@pytest.mark.slow
def test_empty_or_oversized_prompt_is_a_400_while_a_stream_runs(fresh, default_generator):
    url, _ = fresh
    gen = default_generator
    stream = sse(url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 32, "temperature": 0})
    events = [next(stream)]   # it runs while the bad requests come
    limit = gen.max_len * max(map(len, gen.tokenizer.get_vocab()))   # the tokenizer's longest token: 81 characters
    bad = [("/v1/completions", {"prompt": ""}, "prompt", "empty"),
           ("/v1/completions", {"prompt": "x" * (limit + 1)}, "prompt", str(limit)),
           ("/v1/completions", {"prompt": "hello " * 2100}, "prompt", "2101 tokens"),   # within the characters
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * limit}]}, "messages", str(limit))]
    for path, body, param, said in bad:
        code, doc = post(url + path, body)
        assert code == 400 and doc["error"]["param"] == param and said in doc["error"]["message"], (param, doc)
    events += list(stream)
    want = gen.generate(prompt_ids=gen.encode(PROMPT, chat=False), max_new_tokens=32).token_ids[0]
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length"), events[-2:]
    assert chunk_ids(events) == want


@pytest.mark.slow
def test_n_above_the_batch_is_refused(fresh):
    """n asks for that many sequences decoded at once: more than --max-batch rows is a 400, not a bigger batch."""
    url, _ = fresh
    code, doc = post(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 9})
    assert code == 400 and doc["error"]["param"] == "n" and "--max-batch 8" in doc["error"]["message"], doc
    code, doc = post(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 8, "temperature": 0.8})
    assert code == 200 and len(doc["choices"]) == 8


def exited(pid: int) -> bool:
    """Whether process pid has ended (a zombie that its parent has not reaped yet has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_sigterm_stops_the_server(fresh):
    """SIGTERM with a long stream running and a request waiting for its batch: both are given SHUTDOWN_GRACE_S,
    then end with an error (the stream with an error chunk and [DONE]), and the process exits."""
    url, pid = fresh
    stream = sse(url + "/v1/completions", {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 1500, "temperature": 0})
    events = [next(stream)]
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(post, url + "/v1/completions", {"prompt": "Hi", "max_tokens": 8, "temperature": 0.8,
                                                              "seed": 1})   # a batch of its own: it waits
        wait_for(lambda: waiting_requests(url) >= 1, "the second request reached the scheduler")
        start = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        events += list(stream)
        while not exited(pid) and time.monotonic() - start < SHUTDOWN_GRACE_S + 10:
            time.sleep(0.1)
        took = time.monotonic() - start
        assert exited(pid) and took < SHUTDOWN_GRACE_S + 10, f"the server still ran {took:.0f} s after SIGTERM"
        code, doc = waiting.result()
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "server_shutting_down", events[-3:]
    assert len(chunk_ids(events)) < 1500
    assert code == 503 and doc["error"]["code"] == "server_shutting_down", doc


# ---- the default engines behind an API key, a waiting bound, a time limit and a body limit ----------------------

KEY, TIME_LIMIT_S, BODY_LIMIT = "sk-test-7d1f", 3.0, 65536


@pytest.fixture(scope="module")
def limited(default_engines, tmp_path_factory):
    """One row (--max-batch 1), one request may wait, 3 s a request, 8-token prefill passes (a long prompt's
    prefill outlasts the time limit), a key and a body limit."""
    log = tmp_path_factory.mktemp("serve-limited") / "server.log"
    with running_server(default_engines, log, "--method", "autoregressive", "--max-batch", "1", "--max-waiting",
                        "1", "--request-timeout", str(TIME_LIMIT_S), "--prefill-chunk", "8", "--api-key", KEY,
                        "--max-body-bytes", str(BODY_LIMIT)) as (url, _):
        yield url


def call(url: str, path: str, body: dict | bytes | None = None, key: str | None = KEY) -> tuple[int, dict, dict]:
    """GET (no body) or POST; (status, JSON answer, headers)."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data, headers), timeout=60) as r:
            return r.status, json.loads(r.read()) if path != "/metrics" else {}, dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def is_error(doc: dict, code: str | None = None) -> bool:
    error = doc["error"]
    return set(error) == {"message", "type", "param", "code"} and (code is None or error["code"] == code)


@pytest.mark.slow
def test_api_key_guards_all_but_health(limited, default_generator):
    url, gen = limited, default_generator
    assert call(url, "/health", key=None)[0] == 200
    for path, body in [("/v1/completions", {"prompt": "Hi", "max_tokens": 2}), ("/v1/models", None),
                       ("/metrics", None)]:
        for key in (None, KEY + "x", KEY[:-1]):
            code, doc, headers = call(url, path, body, key=key)
            assert code == 401 and is_error(doc, "invalid_api_key") and headers["www-authenticate"] == "Bearer", \
                (path, key, doc)
    assert call(url, "/metrics")[0] == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    api = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    out = api.completions.create(model="default", prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].token_ids == gen.generate(prompt_ids=gen.encode(PROMPT, chat=False), max_new_tokens=4,
                                                    method="autoregressive").token_ids[0]


@pytest.mark.slow
def test_oversized_body_is_a_413(limited):
    import http.client
    url = limited
    code, doc, _ = call(url, "/v1/completions", {"prompt": "x" * BODY_LIMIT})
    assert code == 413 and is_error(doc) and "--max-body-bytes" in doc["error"]["message"], doc
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)   # no Content-Length: counted as it comes
    body = (b'{"prompt": "' + b"x" * 4096 * 20 + b'"}')
    conn.request("POST", "/v1/completions", (body[i:i + 4096] for i in range(0, len(body), 4096)),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}, encode_chunked=True)
    answer = conn.getresponse()
    doc = json.loads(answer.read())
    conn.close()
    assert answer.status == 413 and is_error(doc) and "--max-body-bytes" in doc["error"]["message"], doc
    assert call(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200


@pytest.mark.slow
def test_waiting_bound_and_time_limit(limited):
    """A stream holds the one row: a second request waits, a third is a 429 (sent once /health shows the second
    waiting); the stream's client leaves and the waiting one completes. A stream that holds the row past the time
    limit ends with finish_reason length; a prompt whose prefill outlasts the time limit gets a 503. The server
    serves on."""
    url = limited
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 1000, "temperature": 0, "stream": True}

    def streamed():
        return urllib.request.urlopen(urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}), timeout=60)

    with streamed() as stream, ThreadPoolExecutor(1) as pool:
        next(stream)
        waiting = pool.submit(call, url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0.8,
                                                             "seed": 1})
        wait_for(lambda: waiting_requests(url, KEY) >= 1, "the second request reached the scheduler")
        code, doc, _ = call(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        assert code == 429 and is_error(doc, "too_many_requests") and "--max-waiting 1" in doc["error"]["message"]
        stream.close()   # its row is freed at the next round: the waiting request joins
        code, doc, _ = waiting.result()
    assert code == 200 and doc["usage"]["completion_tokens"] == 4, doc
    began = time.monotonic()
    with streamed() as stream:
        lines = list(stream)
    took = time.monotonic() - began
    events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
    assert lines[-2].strip() == b"data: [DONE]" or lines[-1].strip() == b"data: [DONE]", lines[-3:]
    assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["specrt"]["stop_reason"] == \
        "time_limit", events[-1]
    assert 0 < len(chunk_ids(events)) < 1000 and TIME_LIMIT_S <= took < TIME_LIMIT_S + 10, (len(chunk_ids(events)),
                                                                                           took)
    began = time.monotonic()
    code, doc, _ = call(url, "/v1/completions", {"prompt": "hello " * 2000, "max_tokens": 4})   # 251 passes
    assert code == 503 and is_error(doc, "timeout") and "--request-timeout" in doc["error"]["message"], doc
    assert TIME_LIMIT_S <= time.monotonic() - began < TIME_LIMIT_S + 10
    assert call(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200


FUZZ_EXAMPLES = 20   # per operation and mode (valid requests, invalid ones)


@pytest.mark.slow
def test_fuzzed_requests_get_documented_answers(limited):
    """schemathesis against the server's own OpenAPI document, every operation, requests made from the schema,
    valid and not: never a 5xx, every status and content type documented, every body as the document says. The
    examples are the same at every run (derandomized): a failure is reproducible, and the suite's verdict does not
    depend on the draw (a wider random search: raise FUZZ_EXAMPLES and drop derandomize)."""
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)
    def not_a_server_error_but_the_time_limit(ctx, response, case):
        """The time limit's 503 (code "timeout") is this server's documented answer to a long valid prompt (a chat
        with tool calls, say) whose 8-token prefill passes outlast 3 s on a busy machine; any other 5xx fails."""
        if response.status_code == 503 and response.json()["error"]["code"] == "timeout":
            return None
        return not_a_server_error(ctx, response, case)

    key = {"Authorization": f"Bearer {KEY}"}
    schema = schemathesis.openapi.from_url(limited + "/openapi.json", headers=key)
    checks = [not_a_server_error_but_the_time_limit, status_code_conformance, content_type_conformance, response_schema_conformance]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"GET /health", "GET /metrics", "GET /v1/models",
                                               "POST /v1/completions", "POST /v1/chat/completions"}
    for operation in operations:
        invalid = [GenerationMode.NEGATIVE] if operation.method.upper() == "POST" else []   # the GETs take nothing
        for mode in [GenerationMode.POSITIVE, *invalid]:
            @hypothesis.given(operation.as_strategy(generation_mode=mode))
            @hypothesis.settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                                 suppress_health_check=list(hypothesis.HealthCheck))
            def fuzz(case):
                case.call_and_validate(headers=key, timeout=60, checks=checks)

            fuzz()


# ---- the default engines (SmolLM2 with its tokenizer): chat, text, stop strings --------------------------------


@pytest.fixture(scope="module")
def smol(default_engines, default_generator, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-default") / "server.log"
    with running_server(default_engines, log, "--method", "medusa") as (url, _):
        yield default_generator, url


CHATS = [
    [{"role": "user", "content": "Name three rivers."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2, 3, 4, 5."},
     {"role": "user", "content": "Now backwards."}],
    [{"role": "user", "content": [{"type": "text", "text": "Write a haiku about the sea."}]}],
]


def chat_ids(gen, messages):
    turns = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else
              "".join(p["text"] for p in m["content"])} for m in messages]
    ids = gen.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.mark.slow
def test_chat_streams_and_completion(smol):
    gen, url = smol
    api = client(url)
    methods = ["medusa", "autoregressive", "ngram", "draft"]

    def run(i):
        extra = {} if i == 0 else {"specrt": {"method": methods[i]}}   # the server's --method medusa
        stream = api.chat.completions.create(model="default", messages=CHATS[i], max_tokens=8, temperature=0,
                                             stream=True, extra_body=extra)
        text, ids, reason = "", [], None
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                ids += choice.token_ids or []
                reason = choice.finish_reason or reason
        return text, ids, reason

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(4)))
    for messages, method, (text, ids, reason) in zip(CHATS, methods, results):
        want = gen.generate(prompt_ids=chat_ids(gen, messages), max_new_tokens=8, method=method)
        assert ids == want.token_ids[0] and text == want.text[0], method
        assert reason == ("stop" if want.stats["stop_reason"] == "eos" else "length")
    out = api.chat.completions.create(model="default", messages=CHATS[0], max_completion_tokens=8, temperature=0)
    assert out.choices[0].message.content == results[0][0] and out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(chat_ids(gen, CHATS[0])) and out.usage.completion_tokens == 8

    # plain text completions (no chat template), cut at a stop string, streamed and not
    prompt = "The three largest cities in Europe are"
    want = gen.generate(prompt_ids=gen.encode(prompt, chat=False), max_new_tokens=12, method="medusa")
    out = api.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == want.text[0] and out.choices[0].token_ids == want.token_ids[0]
    stop = want.text[0][len(want.text[0]) // 2:][:3]
    cut = want.text[0][:want.text[0].index(stop)]
    out = api.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert (out.choices[0].text, out.choices[0].finish_reason) == (cut, "stop")
    chunks = list(api.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0,
                                         stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_eight_concurrent_chats_equal_lone_runs(smol, smollm2):
    """Eight different chat prompts streamed at once through the server's batch (Medusa): each the output of a
    lone generate of the same prompt and method (near ties reported with their logit gap)."""
    gen, url = smol
    api = client(url)
    prompts = load_prompts(8)

    def run(prompt):
        stream = api.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                             max_tokens=24, temperature=0, stream=True)
        ids, stats = [], None
        for chunk in stream:
            stats = getattr(chunk, "specrt", None) or stats
            for choice in chunk.choices:
                ids += choice.token_ids or []
        return ids, stats

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, prompts))
    ties = []
    for prompt, (ids, stats) in zip(prompts, results):
        want = gen.generate(prompt_ids=gen.encode(prompt), max_new_tokens=24, method="medusa").token_ids[0]
        assert_same_or_tie(ids, want, gen.encode(prompt), smollm2.model, ties)
        assert stats["method"] == "medusa"
    assert len(ties) <= 1, f"too many near ties to be chance: {ties}"
    assert max(int(n) for _, stats in results for n in stats["batch_rounds"]) >= 2


# ---- request fields: logprobs, penalties, logit_bias, min_p and top_k, the fields refused or without effect -------


def served_methods(api) -> list[str]:
    return [m for m in api.models.list().data[0].specrt["methods"] if m != "auto"]


def tied_prefix(ids: list[int], ref: list[int], prompt: list[int], model) -> int:
    """How many leading tokens `ids` shares with `ref`, all of them but for a near tie at the first difference."""
    assert_same_or_tie(ids, ref, prompt, model)
    return next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), len(ref))


@pytest.mark.slow
def test_logprobs_are_the_targets_for_every_method(smol, smollm2):
    """logprobs with every method, accepted drafts included, equal the target's own within 1e-4. Greedy: the chat's
    logprobs with top_logprobs (not streamed) and the legacy completions' logprobs (streamed, chunk by chunk) against
    an autoregressive generate of the same engines in this process. Sampled at T = 0.7 (streamed, 16 tokens): the
    log-softmax of the target's logits / T over the same tokens (transformers, one teacher-forced pass), and the same
    seed gives the same tokens and logprobs again (not streamed): `seed` works with every method, its speculation
    fixed (specrt.adaptive false: adaptive speculation follows the measured pass times, and with them where the
    random draws fall)."""
    gen, url = smol
    api = client(url)
    prompt = chat_ids(gen, CHATS[0])
    want = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="autoregressive", logprobs=3)
    ref, ref_lps = want.token_ids[0], want.logprobs[0]

    def chat(method, adaptive=True, max_tokens=24, **fields):
        return api.chat.completions.create(model="default", messages=CHATS[0], max_tokens=max_tokens, logprobs=True,
                                           extra_body={"specrt": {"method": method, "adaptive": adaptive}}, **fields)

    def streamed_completion(method):   # the chat's prompt as token ids: the same reference
        ids, lps = [], {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in api.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=0, logprobs=3,
                                            stream=True, extra_body={"specrt": {"method": method}}):
            for c in chunk.choices:
                ids += c.token_ids
                assert (c.logprobs is None) == (not c.token_ids), chunk   # each chunk the logprobs of its tokens
                for key in lps if c.logprobs else []:
                    lps[key] += getattr(c.logprobs, key)
        return ids, lps

    for method in served_methods(api):
        with ThreadPoolExecutor(2) as pool:   # one batch
            streamed = pool.submit(streamed_completion, method)
            out = chat(method, temperature=0, top_logprobs=3).choices[0]
            ids, lps = streamed.result()
        n = min(tied_prefix(out.token_ids, ref, prompt, smollm2.model), tied_prefix(ids, ref, prompt, smollm2.model))
        content = out.logprobs.content
        assert len(content) == len(out.token_ids) and len(lps["token_logprobs"]) == len(ids), method
        assert b"".join(bytes(e.bytes) for e in content).decode().startswith(out.message.content), method
        for i in range(n):
            assert content[i].logprob == pytest.approx(ref_lps[i].logprob, abs=1e-4), (method, i)
            assert [t.logprob for t in content[i].top_logprobs] == \
                pytest.approx([v for _, v in ref_lps[i].top], abs=1e-4), (method, i)
            assert lps["token_logprobs"][i] == pytest.approx(ref_lps[i].logprob, abs=1e-4), (method, i)
            assert sorted(lps["top_logprobs"][i].values(), reverse=True)[:3] == \
                pytest.approx([v for _, v in ref_lps[i].top], abs=1e-4), (method, i)
        assert lps["tokens"][:n] == [e.token for e in content[:n]], method
        assert lps["text_offset"] == sorted(lps["text_offset"]) and lps["text_offset"][0] == 0, method

        sampled = chat(method, False, 16, temperature=0.7, seed=7, stream=True)   # fixed speculation: see above
        ids, values = [], []
        for chunk in sampled:
            for c in chunk.choices:
                ids += c.token_ids
                values += [e.logprob for e in (c.logprobs.content if c.logprobs else [])]
        with torch.no_grad():
            logits = smollm2.model(torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1:].double()
        target = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        assert values == pytest.approx(target.tolist(), abs=1e-4), method
        again = chat(method, False, 16, temperature=0.7, seed=7).choices[0]
        assert again.token_ids == ids and [e.logprob for e in again.logprobs.content] == values, method


@pytest.mark.slow
def test_penalties_and_logit_bias_equal_autoregressive_with_them(smol):
    """Greedy output with each of presence_penalty, frequency_penalty, repetition_penalty (vLLM's extension) and
    logit_bias, with every method (the four requests sharing one batch), equals an autoregressive generate with the
    same field in this process, which differs from the output without it. top_k 1 or min_p 1 (top level, vLLM's
    way) at temperature 1 sample the most likely token alone: the greedy output."""
    gen, url = smol
    api = client(url)
    prompt = "one two one two one two one two"
    ids = gen.encode(prompt, chat=False)
    plain = gen.generate(prompt_ids=ids, max_new_tokens=24, method="autoregressive").token_ids[0]
    fields = [{"presence_penalty": 1.5}, {"frequency_penalty": 1.0}, {"repetition_penalty": 1.3},
              {"logit_bias": {str(plain[0]): -100, str(plain[5]): 3.5}}]
    wants = []
    for f in fields:
        kw = {"logit_bias": {int(t): v for t, v in f["logit_bias"].items()}} if "logit_bias" in f else f
        wants.append(gen.generate(prompt_ids=ids, max_new_tokens=24, method="autoregressive", **kw).token_ids[0])
        assert wants[-1] != plain, f"{f} changes nothing here: the test would show nothing"

    def run(method, f, temperature=0):
        return api.completions.create(model="default", prompt=prompt, max_tokens=24, temperature=temperature,
                                      extra_body={**f, "specrt": {"method": method}}).choices[0].token_ids

    for method in served_methods(api):
        with ThreadPoolExecutor(len(fields)) as pool:
            got = list(pool.map(lambda f: run(method, f), fields))
        for f, ours, want in zip(fields, got, wants):
            assert ours == want, (method, f)
    for f in ({"top_k": 1}, {"min_p": 1.0}):
        assert run("medusa", f, temperature=1.0) == plain, f


NO_EFFECT_CHAT = {"user": "u-1", "metadata": {"team": "a"}, "store": False, "service_tier": "auto",
                  "parallel_tool_calls": False, "safety_identifier": "s-1", "prompt_cache_key": "k",
                  "prompt_cache_retention": "24h", "response_format": {"type": "text"}, "modalities": ["text"]}
REFUSED_CHAT = {"functions": [{"name": "f"}], "function_call": "auto",
                "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
                "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
                "web_search_options": {}, "moderation": {"model": "m"}}


@pytest.mark.slow
def test_every_field_is_served_refused_or_without_effect(smol):
    """Nothing is silently ignored: an unknown field, at the top or nested, is a 400 naming it; OpenAI's fields that
    specrt does not serve (the deprecated functions, audio, ...) are a 400 naming each; the
    fields accepted with no effect give the same answer as without them; the OpenAPI document lists the served and
    the no-effect fields, not the refused ones."""
    gen, url = smol
    api = client(url)
    chat = dict(model="default", messages=CHATS[1], max_tokens=4, temperature=0)
    text = dict(model="default", prompt=PROMPT, max_tokens=4, temperature=0)

    def refused(create, body, extra, param, code):
        with pytest.raises(openai.BadRequestError) as e:
            create(**body, extra_body=extra)
        assert (e.value.param, e.value.code) == (param, code) and param in e.value.message, (extra, e.value.body)

    for create, body in ((api.chat.completions.create, chat), (api.completions.create, text)):
        refused(create, body, {"frobnicate": 1}, "frobnicate", "unknown_parameter")
        refused(create, body, {"stream_options": {"frobnicate": 1}}, "stream_options.frobnicate", "unknown_parameter")
        refused(create, body, {"specrt": {"frobnicate": 1}}, "specrt.frobnicate", "unknown_parameter")
    refused(api.chat.completions.create, {**chat, "messages": [{"role": "user", "content": "Hi", "frob": 1}]}, {},
            "messages[0].frob", "unknown_parameter")
    for field, value in REFUSED_CHAT.items():
        refused(api.chat.completions.create, chat, {field: value}, field, "unsupported_parameter")
    refused(api.chat.completions.create, {**chat, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]}, {},
        "messages[0].content[0].type", "unsupported_parameter")
    refused(api.chat.completions.create, {**chat, "messages": [
        {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]}, {},
        "messages[0].function_call", "unsupported_parameter")
    for field, value in {"echo": True, "suffix": "x"}.items():
        refused(api.completions.create, text, {field: value}, field, "unsupported_parameter")
    refused(api.completions.create, text, {"best_of": 3}, "best_of", "unsupported_value")
    refused(api.chat.completions.create, chat, {"top_logprobs": 2}, "top_logprobs", None)   # without logprobs

    plain = api.chat.completions.create(**chat).choices[0].token_ids
    assert api.chat.completions.create(**chat, extra_body=NO_EFFECT_CHAT).choices[0].token_ids == plain
    assert stream_ids(api.chat.completions.create(**chat, stream=True, stream_options={"include_obfuscation": True},
                                                  extra_body=NO_EFFECT_CHAT))[0] == plain
    plain = api.completions.create(**text).choices[0].token_ids
    assert api.completions.create(**text, user="u-1", echo=False, best_of=1).choices[0].token_ids == plain

    with urllib.request.urlopen(url + "/openapi.json", timeout=30) as r:
        schemas = json.loads(r.read())["components"]["schemas"]
    fields = schemas["ChatRequest"]["properties"]
    assert {"logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "repetition_penalty",
            "min_p", "top_k", "stop_token_ids", *NO_EFFECT_CHAT} <= set(fields)
    assert all("no effect" in fields[f]["description"] for f in NO_EFFECT_CHAT if f not in ("response_format",
                                                                                           "modalities"))
    assert not (set(REFUSED_CHAT) - {"modalities"}) & set(fields)
    assert {"response_format", "guided_regex", "guided_grammar", "tools", "tool_choice"} <= set(fields)
    assert {"logprobs", "echo", "best_of", "user"} <= set(schemas["CompletionRequest"]["properties"])
    assert "suffix" not in schemas["CompletionRequest"]["properties"]


# ---- structured output and tool calls ------------------------------------------------------------------------------

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "size": {"enum": ["big", "small"]}, "rivers": {"type": "integer"}},
        "required": ["city", "size", "rivers"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 24},
                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                                               "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"type": "string", "maxLength": 24}},
                                               "required": ["zone"], "additionalProperties": False}}}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
TIME = [{"role": "user", "content": "What time is it now in Tokyo? Give me the time in the Asia/Tokyo time zone."}]


def parameters(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.slow
def test_response_format_follows_its_schema_as_constrained_autoregressive(smol):
    """A json_schema answer parses, validates and is greedy equal to the in-process constrained autoregressive
    answer, with two methods; json_object parses; guided_regex matches; a spec that does not compile is a 400 naming
    its field."""
    gen, url = smol
    api = client(url)
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    want = gen.generate(prompt_ids=chat_ids(gen, messages), max_new_tokens=48, temperature=0,
                        method="autoregressive", grammar=("json_schema", CITY)).token_ids[0]
    for method in ("medusa", "draft"):
        choice = api.chat.completions.create(model="default", messages=messages, max_tokens=48, temperature=0,
                                             response_format=fmt, extra_body={"specrt": {"method": method}}).choices[0]
        jsonschema.validate(json.loads(choice.message.content), CITY)
        assert (choice.finish_reason, choice.token_ids) == ("stop", want), method
    choice = api.chat.completions.create(model="default", messages=messages, max_tokens=64, temperature=0,
                                         response_format={"type": "json_object"}).choices[0]
    assert isinstance(json.loads(choice.message.content), dict), choice
    text = api.completions.create(model="default", prompt="The year is", max_tokens=8, temperature=0,
                                  extra_body={"guided_regex": " [0-9]{4}"}).choices[0].text
    assert re.fullmatch(" [0-9]{4}", text), text
    bad = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
           "guided_regex": "([0-9]", "guided_grammar": "start: nothing_defined"}
    for field, value in bad.items():
        with pytest.raises(openai.BadRequestError) as e:
            api.chat.completions.create(model="default", messages=messages, max_tokens=4, extra_body={field: value})
        assert e.value.param == field and field in e.value.message, e.value.body


@pytest.mark.slow
def test_tool_calls_round_trip_through_the_client(smol):
    """tool_choice required (two tools, a question for the second) and a named function answer tool_calls whose
    arguments validate against the tool's parameters, the same streamed (reassembled from the deltas); a follow-up
    turn with the tool's result is accepted; none answers what the request without tools answers (the tools not
    shown), auto another answer (they are); an unknown named function is a 400."""
    gen, url = smol
    api = client(url)
    ask = dict(model="default", messages=TIME, tools=TOOLS, max_tokens=48, temperature=0)
    for choice_, want in (("required", "get_time"), ({"type": "function", "function": {"name": "get_weather"}},
                                                     "get_weather")):
        choice = api.chat.completions.create(**ask, tool_choice=choice_).choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None), choice
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == want and call.id, (choice_, call)
        jsonschema.validate(json.loads(call.function.arguments), parameters(call.function.name))
        if choice_ == "required":
            required = call
    call = required

    streamed, reason = {}, None
    for chunk in api.chat.completions.create(**ask, tool_choice="required", stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            got = streamed.setdefault(delta_call.index, {"name": "", "arguments": ""})
            got["name"] += delta_call.function.name or ""
            got["arguments"] += delta_call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls" and streamed == {0: {"name": call.function.name,
                                                       "arguments": call.function.arguments}}, streamed

    turns = TIME + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "14:05"}]
    answer = api.chat.completions.create(**{**ask, "messages": turns}, tool_choice="auto").choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls"), answer
    short = dict(model="default", messages=WEATHER, max_tokens=16, temperature=0)
    without = api.chat.completions.create(**short).choices[0]
    plain = api.chat.completions.create(**short, tools=TOOLS, tool_choice="none").choices[0]
    assert isinstance(plain.message.content, str) and not plain.message.tool_calls, plain
    assert plain.token_ids == without.token_ids, "tool_choice none: the tools reached the prompt"
    auto = api.chat.completions.create(**short, tools=TOOLS, tool_choice="auto").choices[0]
    assert auto.token_ids != without.token_ids, "tool_choice auto: the answer is the one without tools"
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "get_news"}})
    assert e.value.param == "tool_choice", e.value.body
