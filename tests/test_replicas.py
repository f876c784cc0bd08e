"""specrt serve --replicas: the server's app in Ray Serve replicas (the scale extra), one local Ray instance for the
module, driven over HTTP like a single server."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import load_prompts
from greedy_check import assert_same_or_tie
from specrt.measurement.serve_bench import server

pytest.importorskip("ray.serve", reason="the scale extra: pip install 'specrt[scale]' (make setup installs it)")
from specrt.serving.replicas import REPLICA_HEADER  # noqa: E402


MAX_WAITING = 8   # requests the ingress holds for a replica with room


@pytest.fixture(scope="module")
def replicas(default_engines, tmp_path_factory):
    """`specrt serve --replicas 2`: two replicas of the default engines, one engine thread each, each with a suffix
    cache."""
    log = tmp_path_factory.mktemp("replicas") / "server.log"
    with server(default_engines, log, "--replicas", "2", "--threads", "1", "--method", "autoregressive",
                "--max-waiting", str(MAX_WAITING), "--suffix-cache", "4",
                wait_s=300, stop_s=60) as (url, pid):   # Serve and Ray take seconds to stop
        yield url, log


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

    def run(prompt):
        events, replica = stream(url, {"prompt": prompt, "max_tokens": 8, "temperature": 0})
        return list(events), replica

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, prompts))
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
    deadline = time.monotonic() + 20
    while (counted := generated(url)) != tokens:
        assert time.monotonic() < deadline, f"/metrics counts {counted}, the replicas answered {tokens}"
        time.sleep(0.5)
    with urllib.request.urlopen(url + "/health", timeout=30) as r:   # the replica that answers keeps its outputs
        assert json.loads(r.read())["suffix_cache"]["outputs"] > 0


def samples(url: str, name: str, **labels) -> dict[str, float]:
    """/metrics: sample `name` with these labels, summed by replica (its label)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for s in (s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name):
        if labels.items() <= s.labels.items():
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
    deadline = time.monotonic() + 20
    while samples(url, "specrt:num_requests_running").get(replica) != 0 or sum(
            samples(url, "specrt:request_success_total", finished_reason="abort").values()) != aborted + 1:
        assert time.monotonic() < deadline, "the replica still runs the request of a client that has gone"
        time.sleep(0.5)
    assert samples(url, "specrt:generation_tokens_total")[replica] < 1000


def post(url: str, body: dict) -> tuple[int, dict, str | None]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read()), r.headers[REPLICA_HEADER]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), None


@pytest.mark.slow
def test_requests_beyond_max_waiting_get_429(replicas):
    """More requests at once than both replicas' batches and --max-waiting hold: the ones beyond get a 429 in
    OpenAI's format at once, every other one is answered. (Serve counts a request as queued until a replica has
    taken it, so in a burst fewer than both batches and MAX_WAITING may get through: at least MAX_WAITING do.)"""
    url, _ = replicas
    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(lambda _: post(url, {"prompt": "1, 2, 3,", "max_tokens": 24, "temperature": 0}),
                                range(40)))
    codes = sorted(code for code, *_ in answers)
    assert set(codes) == {200, 429} and codes.count(200) >= MAX_WAITING, codes
    assert {doc["error"]["code"] for code, doc, _ in answers if code == 429} == {"too_many_requests"}


@pytest.mark.slow
def test_killed_replica_ends_its_stream_and_is_replaced(replicas):
    """SIGKILL to the replica in the middle of a long stream: the stream ends with an error event and [DONE] within
    seconds, requests go on being answered (by the other replica), and the replica Serve starts in its place
    serves."""
    url, _ = replicas
    events, replica = stream(url, {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 1000, "temperature": 0})
    got = [next(events), next(events)]
    os.kill(int(replica.rsplit(":", 1)[1]), signal.SIGKILL)
    killed = time.monotonic()
    got += list(events)
    assert time.monotonic() - killed < 10 and got[-1] == "[DONE]", got[-3:]
    assert got[-2]["error"]["code"] == "replica_failed" and len(ids_of(got)) < 1000, got[-2:]
    answered, deadline = set(), time.monotonic() + 120
    while len(answered) < 2:   # the other replica, and the new one (the killed one answers nothing)
        assert time.monotonic() < deadline, f"no new replica served within 120 s: {answered}"
        code, doc, by = post(url, {"prompt": "Hi", "max_tokens": 2, "temperature": 0})
        if code == 200:
            answered.add(by)
        else:
            assert code == 503 and doc["error"]["code"] == "replica_failed", doc
            time.sleep(0.5)
    assert replica not in answered


def test_replica_options_follow_the_batch():
    """Each Engine replica takes --max-batch requests at once (Serve's default of 5 would starve the batcher) and
    reserves its engine threads as CPUs; --autoscale aims at a full batch a replica; the ingress only relays."""
    from specrt.serving.replicas import ReplicaConfig, build

    def engine_of(app):
        ingress = app._bound_deployment
        assert ingress.ray_actor_options["num_cpus"] == 0
        return ingress.init_args[0]._bound_deployment

    engine = engine_of(build(ReplicaConfig("engines/default", threads=2, max_batch=6), replicas=3))
    assert (engine.num_replicas, engine.max_ongoing_requests, engine.ray_actor_options["num_cpus"]) == (3, 6, 2)
    scaling = engine_of(build(ReplicaConfig("engines/default", max_batch=6), autoscale=(1, 4)))._deployment_config
    auto = scaling.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests) == (1, 4, 6)
