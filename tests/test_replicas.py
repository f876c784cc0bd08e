"""specrt serve --replicas: the server's app in Ray Serve replicas (the scale extra), one local Ray instance for the
module, driven over HTTP like a single server."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import contextmanager

import pytest
from click.testing import CliRunner

from conftest import load_prompts
from greedy_check import assert_same_or_tie
from specrt.measurement import serve_bench
from specrt.measurement.serve_bench import server

pytest.importorskip("ray.serve", reason="the scale extra: pip install 'specrt[scale]' (make setup installs it)")
from specrt.serving.replicas import REPLICA_HEADER  # noqa: E402


MAX_WAITING = 8   # requests the ingress holds for a replica with room
MAX_BATCH = 8     # each replica's batch (serve's default --max-batch)
STORED = "Notes from the datastore test. The eight planets of the solar system, from the Sun outwards, are"
WAIT_S = 480      # the most any condition below is waited for (the start took 207 s beside the other test process
                  # and another job: a loaded machine is slow, never this slow)


@pytest.fixture(scope="module")
def stored(default_generator, tmp_path_factory):
    """A datastore for --method rest that holds STORED and the target's greedy continuation of it; (its directory,
    STORED's ids, the continuation)."""
    from specrt.decoding.datastore import build
    ids = default_generator.encode(STORED, chat=False)
    want = default_generator.generate(prompt_ids=ids, max_new_tokens=24, method="autoregressive").token_ids[0]
    tmp = tmp_path_factory.mktemp("datastore")
    (tmp / "corpus.jsonl").write_text(json.dumps({"ids": ids + want}) + "\n")
    build([str(tmp / "corpus.jsonl")], default_generator.directory, tmp / "store", log=lambda *_: None,
          progress=False)
    return tmp / "store", ids, want


@pytest.fixture(scope="module")
def replicas(default_engines, stored, tmp_path_factory):
    """`specrt serve --replicas 2`: two replicas of the default engines, one engine thread each, each with a suffix
    cache and the datastore of `stored`."""
    log = tmp_path_factory.mktemp("replicas") / "server.log"
    with server(default_engines, log, "--replicas", "2", "--threads", "1", "--method", "autoregressive",
                "--max-waiting", str(MAX_WAITING), "--suffix-cache", "4", "--datastore", str(stored[0]),
                wait_s=WAIT_S, stop_s=60) as (url, pid):   # Serve and Ray take seconds to stop
        yield url, log


def until(condition, what: str, every: float = 0.5):
    """Poll `condition` until it is true; fail, saying `what`, after WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} (waited {WAIT_S} s)"
        time.sleep(every)


def stream(url: str, body: dict, timeout: float = 120):
    """A streamed completion: (its events, each chunk parsed and the last "[DONE]"; the replica that answered)."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=timeout)
    events = (("[DONE]" if line.strip() == b"data: [DONE]" else json.loads(line[6:]))
              for line in r if line.startswith(b"data: "))
    return events, r.headers[REPLICA_HEADER]


def ids_of(events: list) -> list[int]:
    return [i for e in events if isinstance(e, dict) for c in e.get("choices", []) for i in c["token_ids"]]


@pytest.mark.slow
def test_sixteen_streams_over_two_replicas_equal_lone_runs(replicas, default_generator, smollm2):
    url, _ = replicas
    gen = default_generator
    prompts = load_prompts(16)

    refused = []

    def run(prompt):
        # 16 at once is every replica's batch full: where Serve's router counts a request as waiting before a
        # replica takes it, the ingress may refuse one with a 429 (the bound test_requests_beyond_max_waiting_get_429
        # checks); a client then sends it again, as the 429 says
        for _ in range(20):
            try:
                events, replica = stream(url, {"prompt": prompt, "max_tokens": 8, "temperature": 0})
                return list(events), replica
            except urllib.error.HTTPError as e:
                if e.code != 429:
                    raise
                refused.append(prompt)
                time.sleep(0.5)
        raise AssertionError(f"refused 20 times with 429: {prompt!r}")

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, prompts))
    print(f"16 streams over two replicas; {len(refused)} refused with 429 and sent again")
    ties = []
    for prompt, (events, _) in zip(prompts, results):
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        ids = gen.encode(prompt, chat=False)
        want = gen.generate(prompt_ids=ids, max_new_tokens=8, method="autoregressive").token_ids[0]
        assert_same_or_tie(ids_of(events), want, ids, smollm2.model, ties)
    assert len(ties) <= 1, f"too many near ties to be chance: {ties}"
    served = {replica for _, replica in results}
    assert len(served) == 2, f"one replica served all 16 requests: {served}"
    # one scrape counts both replicas (each sends its figures to the hub every second): the tokens each answered
    tokens = {r: sum(len(ids_of(events)) for events, by in results if by == r) for r in served}
    until(lambda: generated(url) == tokens, f"/metrics counts {generated(url)}, the replicas answered {tokens}")
    assert samples(url, "vllm:generation_tokens_total") == tokens   # vLLM's name too, each replica's sample
    outputs = samples(url, "specrt:suffix_cache_outputs")   # each replica keeps its outputs (/health says nothing)
    assert set(outputs) == served and all(outputs.values()), outputs


@pytest.mark.slow
def test_rest_drafts_from_the_replicas_datastore(replicas, stored, default_generator, smollm2):
    """--datastore reaches the replicas: rest drafts STORED's continuation from it (at least half of the 24 tokens
    accepted drafts) where ngram, from the prompt and its own output, gets less than half; both give the target's
    greedy tokens. (rest first: the replica's suffix cache then holds no output of this prompt.) How many rounds
    rest takes is its trees' sizes, which follow the pass times the replica measured: speed, not checked here
    (a replica started on a loaded machine took 12 rounds where 8 were asserted before)."""
    url, _ = replicas
    _, ids, want = stored
    stats = {}
    for method in ("rest", "ngram"):
        code, doc, _ = post(url, {"prompt": STORED, "max_tokens": len(want), "temperature": 0,
                                  "specrt": {"method": method}})
        assert code == 200, doc
        assert_same_or_tie(doc["choices"][0]["token_ids"], want, ids, smollm2.model)
        stats[method] = doc["specrt"]
    rest, ngram = stats["rest"], stats["ngram"]
    assert rest["method"] == "rest" and rest["tokens"] == len(want)
    assert rest["accepted_tokens"] >= len(want) // 2 > ngram["accepted_tokens"]


@pytest.mark.slow
def test_bench_serve_over_replicas(replicas, default_engines, tmp_path, monkeypatch):
    """`specrt bench-serve --replicas 2` (on this module's server: Ray starts once): the server it asks for is
    `specrt serve --replicas 2` with the threads given (flags that `specrt serve` parses), and each wave's figures
    are its requests' (2 of 4 tokens each), in a table with a replicas column."""
    from specrt.cli import main, serve
    url, _ = replicas
    asked = []

    @contextmanager
    def this_server(engines, log_path, *args, wait_s=300, stop_s=10):
        serve.make_context("serve", [str(engines), *args])   # what `specrt serve` would parse
        asked.append((log_path.name, args))
        yield url, None

    monkeypatch.setattr(serve_bench, "server", this_server)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["bench-serve", str(default_engines), "--replicas", "2", "--threads", "1",
                                       "--concurrency", "1,2", "--requests", "2", "--max-tokens", "4",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert asked == [("server-2.log", ("--max-batch", "2", "--method", "autoregressive", "--prefix-cache", "0",
                                       "--replicas", "2", "--threads", "1"))]
    report = json.loads((out / "serve_bench.json").read_text())
    results = report["results"]
    assert [(r["replicas"], r["concurrency"], r["requests"], r["tokens"]) for r in results] == [(2, 1, 2, 8),
                                                                                              (2, 2, 2, 8)]
    for r in results:
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] < r["wall_s"]
    assert any(r["batch_rounds"] for r in results)   # a replica's own count
    table = (out / "serve_bench.md").read_text()
    assert "| replicas | T | load | arm | tok/s |" in table
    assert f"| 2 | 0 | c = 2 | autoregressive | {results[1]['tokens_per_s']:.1f} | 1.00 |" in table


def samples(url: str, name: str, **labels) -> dict[str, float]:
    """/metrics: sample `name` with these labels, summed by replica (its label; the replicas' whole left out)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for s in (s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name):
        if "replica" in s.labels and labels.items() <= s.labels.items():
            found[s.labels["replica"]] = found.get(s.labels["replica"], 0) + s.value
    return found


def generated(url: str) -> dict[str, float]:
    """The generated tokens counted by each replica, of the replicas that generated any."""
    return {r: n for r, n in samples(url, "specrt:generation_tokens_total").items() if n}


@pytest.mark.slow
def test_client_that_leaves_frees_its_row(replicas):
    """A client that closes its stream after two chunks: the replica stops generating for it, frees its row (its
    running gauge, through the metrics hub, comes back to 0) and counts the sequence as aborted."""
    url, _ = replicas
    aborted = sum(samples(url, "specrt:request_success_total", finished_reason="abort").values())
    req = urllib.request.Request(url + "/v1/completions", json.dumps(
        {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 1000, "temperature": 0, "stream": True}).encode(),
        {"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=120)
    replica = r.headers[REPLICA_HEADER]
    r.readline(), r.readline(), r.readline()
    r.close()
    until(lambda: samples(url, "specrt:num_requests_running").get(replica) == 0 and sum(
        samples(url, "specrt:request_success_total", finished_reason="abort").values()) == aborted + 1,
        "the replica still runs the request of a client that has gone")
    assert samples(url, "specrt:generation_tokens_total")[replica] < 1000


def post(url: str, body: dict) -> tuple[int, dict, str | None]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            return r.status, json.loads(r.read()), r.headers[REPLICA_HEADER]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), None


def hold(url: str):
    """A long stream that has its first tokens (a replica runs it): the open response; closing it ends the request."""
    req = urllib.request.Request(url + "/v1/completions", json.dumps(
        {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 1000, "temperature": 0, "stream": True}).encode(),
        {"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=WAIT_S)
    while not r.readline().startswith(b"data: "):
        pass
    return r


def chat(url: str, messages: list[dict], max_tokens: int = 4) -> tuple[str, int, str]:
    """A greedy chat completion: (its answer, its prompt tokens from the prefix cache, the replica that answered)."""
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(
        {"messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode(),
        {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=WAIT_S) as r:
        doc = json.loads(r.read())
        return (doc["choices"][0]["message"]["content"], doc["usage"]["prompt_tokens_details"]["cached_tokens"],
                r.headers[REPLICA_HEADER])


def scrape(url: str) -> list:
    """Every sample of the ingress's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return [s for family in text_string_to_metric_families(r.read().decode()) for s in family.samples]


def whole(samples: list, name: str) -> float:
    """The ingress's whole of `name` (its samples without a replica label), over its other labels."""
    return sum(s.value for s in samples if s.name == name and "replica" not in s.labels)


@pytest.mark.slow
def test_chat_turns_go_to_the_replica_that_holds_their_prefix(replicas):
    """Prefix routing (on: the replicas have their default prefix caches): two chats, one request at a time, four
    turns each (each turn the last prompt, its answer and a new user message); every later turn is answered by the
    replica that answered the chat's first turn, from its cache. (Serve's default router picks either replica for a
    lone request: a turn would leave its chat's replica half the time.) The prefix-cache hits in the ingress's /metrics
    (the replicas' sum) grow by the cached tokens the answers report."""
    url, _ = replicas
    hits = whole(scrape(url), "specrt:prefix_cache_hits_total")
    openers = ["Tell me about the rivers of Europe, the longest first, and which seas they flow into.",
               "Write a short poem about a lighthouse keeper who counts the ships passing in the night."]
    chats = [[{"role": "user", "content": text}] for text in openers]
    served: list[list[str]] = [[], []]
    cached = []
    for turn in range(4):
        for c, messages in enumerate(chats):
            answer, tokens, replica = chat(url, messages)
            served[c].append(replica)
            cached.append(tokens)
            assert turn == 0 or tokens >= 32, (c, turn, tokens)   # at least the last turn's first block
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And turn {turn + 2}?"}]
    assert all(len(set(replicas)) == 1 for replicas in served), served
    until(lambda: whole(scrape(url), "specrt:prefix_cache_hits_total") == hits + sum(cached),
          f"/metrics' prefix-cache hits: {whole(scrape(url), 'specrt:prefix_cache_hits_total')}, "
          f"want {hits} + {sum(cached)}")


@pytest.mark.slow
def test_ingress_metrics_give_the_replicas_sum(replicas):
    """/metrics at the ingress: the whole (samples without a replica label) of counters, histograms and gauges is the
    sum of the replicas' samples with the same other labels, of the shares (`_perc`) their mean; timestamps
    (`_created`) have none. Scraped after this module's requests, while one long stream runs (its replica's rows
    1/8 taken)."""
    url, _ = replicas
    got = []

    def one_running() -> bool:   # in this very scrape (the replicas' figures come a second apart)
        got[:] = scrape(url)
        return sum(s.value for s in got if s.name == "specrt:num_requests_running" and "replica" in s.labels) == 1

    held = hold(url)
    try:
        until(one_running, "the held stream runs")
    finally:
        held.close()
    until(lambda: sum(samples(url, "specrt:num_requests_running").values()) == 0, "the held stream's row is freed")
    per = {}
    for s in got:
        if "replica" in s.labels:
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "replica")))
            per.setdefault(key, []).append(s.value)
    checked = set()
    for s in got:
        if "replica" not in s.labels:
            values = per.pop((s.name, tuple(sorted(s.labels.items()))))
            want = sum(values) / len(values) if s.name.endswith("_perc") else sum(values)
            assert s.value == pytest.approx(want), (s, values)
            checked.add(s.name)
    assert {"specrt:prompt_tokens_total", "vllm:generation_tokens_total", "specrt:prefix_cache_hits_total",
            "specrt:time_to_first_token_seconds_bucket", "vllm:num_requests_running", "specrt:num_requests_waiting",
            "specrt:kv_cache_usage_perc", "specrt:prefix_cache_bytes"} <= checked, checked
    assert all(name.endswith("_created") for name, _ in per), sorted(per)   # only timestamps have no whole
    assert len({s.labels["replica"] for s in got if "replica" in s.labels}) == 2
    assert whole(got, "vllm:num_requests_running") == 1
    # the held stream's row is in its replica's share, and the whole is the replicas' mean (checked above too); the
    # other replica's share is not asserted to be 0: in one run the shares averaged 1/8 while the running counts
    # summed to 1 (a replica's running count is set at its loop's turn, its rows taken are read at its push)
    shares = [s.value for s in got if s.name == "vllm:kv_cache_usage_perc" and "replica" in s.labels]
    assert max(shares) >= 1 / MAX_BATCH and whole(got, "vllm:kv_cache_usage_perc") == pytest.approx(sum(shares) / 2)


@pytest.mark.slow
def test_requests_beyond_max_waiting_get_429(replicas):
    """Both replicas' batches full (long streams that run): of a burst of requests, those beyond --max-waiting get a
    429 in OpenAI's format at once, the --max-waiting others wait; once the long streams leave, they are answered."""
    url, _ = replicas
    burst = 3 * MAX_WAITING
    held = []
    for _ in range(2 * MAX_BATCH):   # one after another, each running before the next: a burst of them could itself
        held.append(hold(url))       # meet the ingress's bound while the router assigns them
    with ThreadPoolExecutor(burst) as pool:
        try:
            sent = [pool.submit(post, url, {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0})
                    for _ in range(burst)]
            deadline = time.monotonic() + WAIT_S   # the ones beyond the bound are answered while the batches are full
            while len(done := [f for f in sent if f.done()]) < burst - MAX_WAITING:
                assert time.monotonic() < deadline, f"{len(done)} of {burst} answered while the batches were full"
                wait([f for f in sent if not f.done()], timeout=deadline - time.monotonic(),
                     return_when=FIRST_COMPLETED)
            early = [f.result()[0] for f in done]
            assert set(early) == {429}, early
        finally:
            for r in held:   # the long streams leave: their rows take the waiting requests
                r.close()
        answers = [f.result() for f in sent]
    codes = sorted(code for code, *_ in answers)
    assert codes.count(200) == MAX_WAITING and codes.count(429) == burst - MAX_WAITING, codes
    assert {doc["error"]["code"] for code, doc, _ in answers if code == 429} == {"too_many_requests"}


@pytest.mark.slow
def test_killed_replica_ends_its_stream_and_is_replaced(replicas):
    """SIGKILL to the replica in the middle of a long stream: the stream ends with an error event and [DONE] (a
    stream left hanging fails the read at urlopen's timeout; one the kill missed runs to its 1,000 tokens), requests
    go on being answered (by the other replica), and the replica Serve starts in its place serves."""
    url, _ = replicas
    events, replica = stream(url, {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 1000, "temperature": 0})
    got = [next(events), next(events)]
    os.kill(int(replica.rsplit(":", 1)[1]), signal.SIGKILL)
    got += list(events)
    assert got[-1] == "[DONE]", got[-3:]
    assert got[-2]["error"]["code"] == "replica_failed" and len(ids_of(got)) < 1000, got[-2:]
    answered, deadline = set(), time.monotonic() + WAIT_S
    while len(answered) < 2:   # the other replica, and the new one (the killed one answers nothing)
        assert time.monotonic() < deadline, f"no new replica served within {WAIT_S} s: {answered}"
        code, doc, by = post(url, {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        if code == 200:
            answered.add(by)
        else:
            assert code == 503 and doc["error"]["code"] == "replica_failed", doc
            time.sleep(0.5)
    assert replica not in answered


def test_replica_options_follow_the_batch():
    """Each Engine replica takes --max-batch requests at once (Serve's default of 5 would starve the batcher) and
    reserves its engine threads as CPUs; --autoscale aims at a full batch a replica; the ingress only relays; the
    Engine deployment routes with PrefixRouter where the replicas cache prefixes, unless told not to."""
    from specrt.errors import InputError
    from specrt.serving.replicas import ReplicaConfig, application, build

    def engine_of(app):
        ingress = app._bound_deployment
        assert ingress.ray_actor_options["num_cpus"] == 0
        return ingress.init_args[0]._bound_deployment

    engine = engine_of(build(ReplicaConfig("engines/default", threads=2, max_batch=6), replicas=3))
    assert (engine.num_replicas, engine.max_ongoing_requests, engine.ray_actor_options["num_cpus"]) == (3, 6, 2)
    scaling = engine_of(build(ReplicaConfig("engines/default", max_batch=6), autoscale=(1, 4)))._deployment_config
    auto = scaling.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 4, 6)
    # prefix routing where the replicas cache prefixes, unless turned off; asked for without a cache: refused
    for cache_mb, routing, router in ((None, None, "PrefixRouter"), (0, None, "PowerOfTwoChoicesRequestRouter"),
                                      (64, False, "PowerOfTwoChoicesRequestRouter")):
        config = engine_of(build(ReplicaConfig("engines/default", prefix_cache_mb=cache_mb, prefix_routing=routing),
                                 replicas=2))._deployment_config
        assert config.request_router_config.request_router_class.endswith(router)
    with pytest.raises(InputError, match="--prefix-cache 0 turns the caches off"):
        ReplicaConfig("engines/default", prefix_cache_mb=0, prefix_routing=True)
    off = engine_of(application({"engines": "engines/default", "prefix_routing": "false"}))._deployment_config
    assert off.request_router_config.request_router_class.endswith("PowerOfTwoChoicesRequestRouter")
    with pytest.raises(InputError, match="prefix_routing 'no': true or false"):
        application({"engines": "engines/default", "prefix_routing": "no"})


def test_prefix_pieces_chain_a_chats_turns_within_its_partition():
    """The router's prefix of a request: a chat's next turn extends its last turn's chain by a piece a message; a
    completion's prompt goes by whole 64-character blocks; another API key or cache_salt starts another chain (as the
    replicas' cache partitions do); a request without a prompt has none."""
    from specrt.serving.router import prefix_pieces

    def chain(path, headers=(), **body):
        return prefix_pieces(path, list(headers), json.dumps(body).encode())

    turn = [{"role": "user", "content": "Name three rivers."}]
    later = turn + [{"role": "assistant", "content": "Nile, Amazon, Rhine."}, {"role": "user", "content": "Longest?"}]
    first, second = chain("/v1/chat/completions", messages=turn), chain("/v1/chat/completions", messages=later)
    assert len(first) == 1 and len(second) == 3 and second[:1] == first
    assert chain("/v1/chat/completions", [("authorization", "Bearer other")], messages=later)[0] != first[0]
    assert chain("/v1/chat/completions", messages=later, cache_salt="user-2")[0] != first[0]
    text = "The quick brown fox jumps over the lazy dog. " * 3   # 135 characters: two whole blocks
    assert len(chain("/v1/completions", prompt=text)) == 2
    assert chain("/v1/completions", prompt=text + "And then?")[:2] == chain("/v1/completions", prompt=text)
    assert chain("/v1/models") == [] and prefix_pieces("/v1/completions", [], b"not json") == []
