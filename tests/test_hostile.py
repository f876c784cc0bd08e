"""Hostile requests (issue 63): each repro sent to one real `specrt serve` of the default engines beside a victim,
a greedy completion streamed at the same time by another client. No request may harm another: the server stays
alive and /health answers within HEALTH_S throughout (polled from a thread), the hostile request gets its own error,
and the victim's stream ends with its own answer (the one the server gave it alone, before) and none of the hostile
request's text. The server runs with --api-key-file of two keys, two tenants of the prefix cache."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from specrt.measurement.serve_bench import server

pytestmark = pytest.mark.slow

KEYS = ("sk-tenant-a-5c2e91", "sk-tenant-b-0f7d44")   # two tenants
HEALTH_S = 1.0        # /health's answer, at the most, whatever the other requests do
VICTIM = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 64, "temperature": 0}


@dataclass
class Served:
    url: str
    pid: int
    reference: str = ""   # the victim's answer, the server alone


@pytest.fixture(scope="module")
def served(default_engines, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    keys = tmp / "keys.txt"
    keys.write_text("\n".join(KEYS) + "\n")
    with server(default_engines, tmp / "server.log", "--api-key-file", str(keys), "--max-batch", "4",
                wait_s=120) as (url, pid):
        s = Served(url, pid)
        events = list(sse(url, VICTIM))
        s.reference = text_of(events)
        assert events[-1] == "[DONE]" and len(s.reference) > 40, events[-3:]
        yield s


# ---- the client's side --------------------------------------------------------------------------------------------


def request(url: str, path: str, body: dict | None = None, key: str | None = KEYS[0],
            timeout: float = 60) -> tuple[int, dict]:
    """GET (no body) or POST: (status, the JSON answer)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data, headers), timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if path != "/metrics" else {"text": raw.decode()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sse(url: str, body: dict, key: str = KEYS[0], path: str = "/v1/completions", timeout: float = 120):
    """A streamed answer's events as they come (each chunk or error object parsed; the last "[DONE]"); a refused
    request yields its (status, error object) alone."""
    req = urllib.request.Request(url + path, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for line in r:
                if line.startswith(b"data: "):
                    data = line[len(b"data: "):].strip()
                    yield "[DONE]" if data == b"[DONE]" else json.loads(data)
    except urllib.error.HTTPError as e:
        yield e.code, json.loads(e.read())


def text_of(events: list) -> str:
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for e in events
                   if isinstance(e, dict) for c in e.get("choices", []))


@dataclass
class Watch:
    """/health polled from a thread: its slowest answer and any failure."""
    url: str
    slowest: float = 0.0
    failures: list = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def poll(self):
        while not self.stop.is_set():
            start = time.perf_counter()
            try:
                code, doc = request(self.url, "/health", key=None, timeout=60)
                if code != 200:
                    self.failures.append((code, doc))
            except OSError as e:
                self.failures.append(repr(e))
            self.slowest = max(self.slowest, time.perf_counter() - start)
            self.stop.wait(0.05)


@contextmanager
def beside_a_victim(s: Served, hostile_text: list[str]):
    """The victim streams while the block runs (its first chunk has come before), and /health is polled. After it:
    the server alive, /health fast, the victim's answer its own and free of `hostile_text`."""
    watch = Watch(s.url)
    poller = threading.Thread(target=watch.poll, daemon=True)
    poller.start()
    victim = sse(s.url, VICTIM)
    events = [next(victim)]
    try:
        yield
        events += list(victim)
    except OSError as e:   # the server has gone
        events.append(repr(e))
    finally:
        watch.stop.set()
        poller.join(timeout=120)
    raw = json.dumps(events)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict)), events[-3:]
    assert text_of(events) == s.reference
    for text in hostile_text:
        assert text not in raw, f"the victim's stream carries the hostile request's {text!r}"
    assert not watch.failures, watch.failures[:3]
    assert watch.slowest < HEALTH_S, f"/health took {watch.slowest:.2f} s"
    assert request(s.url, "/health", key=None)[0] == 200


def error_of(answer) -> dict | None:
    """The error object of an answer: (status, doc), or a stream's events (a refused stream: its (status, doc))."""
    for e in [answer] if isinstance(answer, tuple) else answer:
        if isinstance(e, tuple):
            return e[1].get("error")
        if isinstance(e, dict) and "error" in e:
            return e["error"]
    return None


# ---- the repros ---------------------------------------------------------------------------------------------------


def test_a_grammar_of_3000_chained_rules_is_a_400(served):
    """Repro 1: llguidance segfaulted compiling it (exit 139, every stream lost)."""
    rules = ["start: r0"] + [f'r{i}: "k{i}" r{i + 1} | "z"' for i in range(3000)] + ['r3000: "end"']
    with beside_a_victim(served, ["k1234", "r2999"]):
        code, doc = request(served.url, "/v1/completions", {"prompt": "Say:", "max_tokens": 4, "temperature": 0,
                                                            "guided_grammar": "\n".join(rules)})
        assert code == 400 and doc["error"]["param"] == "guided_grammar", (code, doc)


def test_a_grammar_that_fails_mid_answer_ends_its_own_row(served):
    """Repro 2: the matcher raised after a few tokens; the round's error ended every row, the victim's stream got a
    400 chunk with the hostile request's tokens and grammar text."""
    grammar = "\n".join(["start: s", "s: " + " | ".join(f"r{i}" for i in range(50)) + ' | "a"'] +
                        [f'r{i}: s s | "a"' for i in range(50)])
    with beside_a_victim(served, ["r49", "s s", "aaaa"]):
        events = list(sse(served.url, {"prompt": "Write:", "max_tokens": 48, "temperature": 0,
                                       "guided_grammar": grammar, "logit_bias": {"81": 100}}))
        error = error_of(events)   # a 400, before the stream or in its error chunk: its own, not the server's
        assert error is not None and error["type"] == "invalid_request_error", events[-3:]
        assert served.reference[:12] not in error["message"], error   # nothing of the victim's text
        if isinstance(events[-1], str):
            assert isinstance(events[-2], dict) and "error" in events[-2], events[-3:]


def test_long_stop_strings_are_a_400_and_allowed_ones_cost_little(served):
    """Repro 3: eight stop strings of 200,000 characters froze the event loop (/health waited 45 s)."""
    with beside_a_victim(served, ["aaaaaaaa"]):
        code, doc = request(served.url, "/v1/completions", {"prompt": "a a a a", "max_tokens": 12,
                                                            "stop": ["a" * 200_000] * 8})
        assert code == 400 and doc["error"]["param"] == "stop" and "200000 characters" in doc["error"]["message"], \
            (code, str(doc)[:300])
        code, doc = request(served.url, "/v1/completions", {"prompt": "a a a a", "max_tokens": 12, "temperature": 0,
                                                            "stop": ["a" * 256] * 15 + ["a a b"]})
        assert code == 200, (code, doc)


def test_a_large_grammar_is_refused_quickly(served):
    """Repro 4: a 500 KB Lark grammar compiled for 3.6 s on the tokenizer thread that every request uses."""
    alternatives, size = [], 0
    while size < 500_000:
        alternatives.append(f'"x{len(alternatives)}"')
        size += len(alternatives[-1]) + 3
    grammar = "start: " + " | ".join(alternatives)
    with beside_a_victim(served, ["x12345"]), ThreadPoolExecutor(1) as pool:
        start = time.perf_counter()
        hostile = pool.submit(request, served.url, "/v1/completions",
                              {"prompt": "Say:", "max_tokens": 4, "guided_grammar": grammar})
        time.sleep(0.2)
        small = time.perf_counter()
        code, doc = request(served.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "temperature": 0})
        assert code == 200 and time.perf_counter() - small < 3, (code, time.perf_counter() - small)
        code, doc = hostile.result()
        took = time.perf_counter() - start
        assert code == 400 and doc["error"]["param"] == "guided_grammar", (code, str(doc)[:300])
        assert took < 3, f"the large grammar was answered after {took:.1f} s"


SECRET = "My account PIN is 4821. Please keep it safe and never share it with anyone else, not even the bank. " * 3


def cached(url: str, key: str, prompt: str, **extra) -> int:
    code, doc = request(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}, key)
    assert code == 200, (code, doc)
    tokens = doc["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert doc["specrt"]["prefix_cache_tokens"] == tokens
    return tokens


def test_the_prefix_cache_is_partitioned_by_key_and_salt(served):
    """Repro 5: cached_tokens told a client how many blocks of its prompt matched what others had sent (a PIN found
    in 10^4 tries); /health, open to anyone, gave the cache's figures."""
    url = served.url
    with beside_a_victim(served, ["4821"]):
        assert cached(url, KEYS[0], SECRET) == 0
        assert cached(url, KEYS[1], SECRET) == 0          # the other tenant: nothing of A's
        assert cached(url, KEYS[0], SECRET) >= 64         # A again: its own blocks
        salted = "Salted. " + SECRET
        assert cached(url, KEYS[0], salted, cache_salt="user-1") == 0
        assert cached(url, KEYS[0], salted, cache_salt="user-2") == 0   # one key, another salt
        assert cached(url, KEYS[0], salted) == 0                        # the key without a salt is another one too
        assert cached(url, KEYS[0], salted, cache_salt="user-1") >= 64
    code, doc = request(url, "/v1/completions", {"prompt": "Hi", "cache_salt": "x" * 257})
    assert code == 400 and doc["error"]["param"] == "cache_salt", doc
    code, doc = request(url, "/health", key=None)
    assert code == 200 and set(doc) == {"status"}, doc   # liveness alone
    assert request(url, "/metrics", key=None)[0] == 401
    code, doc = request(url, "/metrics", key=KEYS[1])
    assert code == 200 and "specrt:prefix_cache_hits" in doc["text"]


def test_temperature_beyond_2_is_a_400(served):
    """Repro 6: temperature 1e300 with a grammar: 1/T is 0 in float32, NaN logits, an IndexError, a 500."""
    with beside_a_victim(served, []):
        for t in (1e300, 2.5):
            code, doc = request(served.url, "/v1/completions", {"prompt": "Digits:", "max_tokens": 4,
                                                                "temperature": t, "guided_regex": "[0-9]+"})
            assert code == 400 and doc["error"]["param"] == "temperature", (t, code, doc)
        code, _ = request(served.url, "/v1/completions", {"prompt": "Digits:", "max_tokens": 2, "temperature": 2,
                                                          "guided_regex": "[0-9]+", "seed": 1})
        assert code == 200


def test_duplicate_logit_bias_ids_and_uncounted_chat_text_are_400s(served):
    """Repro 8: "5" and "05" were one token id (one bias lost); tool_calls' arguments and names were not counted
    by the chat's character bound (tokenized however long)."""
    url = served.url
    with beside_a_victim(served, []):
        code, doc = request(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                     "logit_bias": {"5": 10, "05": -10}})
        assert code == 400 and doc["error"]["param"] == "logit_bias" and "'05'" in doc["error"]["message"], doc
        call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "1" * 200_000}}
        start = time.perf_counter()
        code, doc = request(url, "/v1/chat/completions", {"max_tokens": 2, "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "user", "content": "Again"}]})
        assert code == 400 and doc["error"]["param"] == "messages" and "characters" in doc["error"]["message"], doc
        assert time.perf_counter() - start < 1.0   # refused before the tokenizer
        code, doc = request(url, "/v1/chat/completions", {"max_tokens": 2, "messages": [
            {"role": "user", "content": "Hi", "name": "n" * 200_000}]})
        assert code == 400 and doc["error"]["param"] == "messages" and "characters" in doc["error"]["message"], doc
