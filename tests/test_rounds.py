"""What each round drafted, accepted and corrected (generate(rounds=True), the streaming extension `specrt.rounds`):
on the real default model, every method: the rounds' tokens are the output, their accepted prefixes are drafted
tokens, their sums are the stats' counts, and asking for them changes nothing else."""
from __future__ import annotations

import pytest

from test_serve import in_process, post, sse
from test_structured import CASES, PERSON

METHODS = ("autoregressive", "draft", "ngram", "medusa", "eagle")
PROMPT = "Write a short poem about the sea."

pytestmark = pytest.mark.slow


def check_rounds(rounds, tokens: list[int]) -> None:
    """A sequence's Rounds against its tokens: together they are the tokens; each round's accepted tokens are its
    drafts' prefix, then one token of the target's own (a correction only where a draft was refused)."""
    assert [t for r in rounds for t in r.tokens] == tokens
    for r in rounds:
        assert r.tokens[:r.accepted] == r.drafted[:r.accepted]
        assert len(r.tokens) <= r.accepted + r.forced + 1
        if r.accepted < len(r.drafted) and r.accepted < len(r.tokens):
            assert r.corrected == r.tokens[r.accepted] != r.drafted[r.accepted]
        else:
            assert r.corrected is None


@pytest.mark.parametrize("method", METHODS)
def test_rounds_are_the_output_and_change_nothing(default_generator, method):
    gen = default_generator
    plain = gen.generate(PROMPT, max_new_tokens=40, method=method)
    logged = gen.generate(PROMPT, max_new_tokens=40, method=method, rounds=True)
    assert plain.rounds is None
    assert logged.token_ids == plain.token_ids
    rounds = logged.rounds[0]
    check_rounds(rounds, logged.token_ids[0])
    assert rounds[0].drafted == [] and len(rounds[0].tokens) == 1   # the prefill's first token
    assert len(rounds) == logged.stats["rounds"] + 1
    if method not in ("autoregressive", "ngram"):   # (ngram finds little to copy in a poem)
        assert sum(r.accepted for r in rounds) > 0
    if method == "eagle":   # a stream's chunks carry the same rounds
        chunks = list(gen.stream(PROMPT, max_new_tokens=40, method=method, rounds=True))
        check_rounds([r for c in chunks for r in c.rounds], logged.token_ids[0])


def test_grammar_forced_tokens_are_their_own(default_generator):
    """Rounds without drafts in which the grammar forced tokens say how many (forced), none of them accepted."""
    got = default_generator.generate(CASES[0][0], max_new_tokens=64, method="autoregressive",
                                     grammar=("json_schema", PERSON), rounds=True)
    rounds = got.rounds[0]
    check_rounds(rounds, got.token_ids[0])
    assert sum(r.forced for r in rounds) == got.stats["forced_tokens"] > 0
    assert all(r.accepted == 0 and r.drafted == [] for r in rounds)


def stream_rounds(url: str, body: dict) -> tuple[str, list[dict], dict, list[dict]]:
    """A streamed chat's text, its rounds (specrt.rounds of its chunks), its last chunk's figures, and its chunks."""
    text, rounds, stats, chunks = "", [], None, []
    for chunk in sse(url + "/v1/chat/completions", body):
        if chunk == "[DONE]":
            continue
        chunks.append(chunk)
        choice = chunk["choices"][0]
        if choice["finish_reason"] is not None:
            stats = chunk["specrt"]
            continue
        text += choice["delta"].get("content") or ""
        rounds += chunk.get("specrt", {}).get("rounds", [])
    return text, rounds, stats, chunks


@pytest.fixture(scope="module")
def url(default_generator):
    from specrt.serving.server import create_app
    with in_process(create_app(default_generator, "smollm2")) as base:
        yield base


@pytest.mark.parametrize("method", ["eagle", "draft"])
def test_streamed_rounds_cover_the_answer(url, method):
    """Each chunk's rounds give its tokens and their texts; the accepted drafts they mark are the stats'
    accepted_tokens, also where the token limit cuts a round short (max_tokens 5 to 9)."""
    for max_tokens in (32, *range(5, 10)):
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0,
                "specrt": {"method": method, "rounds": True}}
        text, rounds, stats, chunks = stream_rounds(url, body)
        assert "".join(t for r in rounds for t in r["text"]) == text
        assert all(len(r["text"]) == len(r["tokens"]) for r in rounds)
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        assert [t for r in rounds for t in r["tokens"]] == ids and len(ids) == stats["tokens"]
        assert sum(r["accepted"] for r in rounds) == stats["accepted_tokens"]
        for r in rounds:
            assert r["tokens"][:r["accepted"]] == r["drafted"][:r["accepted"]]
        if max_tokens == 32:   # the same in a whole answer
            status, answer = post(url + "/v1/chat/completions", body)
            assert status == 200 and answer["choices"][0]["message"]["content"] == text
            log = answer["specrt"]["round_log"]
            assert [t for r in log for t in r["tokens"]] == ids
            assert sum(r["accepted"] for r in log) == answer["specrt"]["accepted_tokens"]


def test_rounds_are_off_unless_asked_for(url):
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0,
            "specrt": {"method": "eagle"}}
    _, rounds, stats, chunks = stream_rounds(url, body)
    # the figures without the rounds: each round commits its accepted drafts and one token of the target's (the last
    # may be cut at max_tokens), after the prefill's first token
    assert rounds == [] and stats["tokens"] == 8
    assert stats["tokens"] - stats["rounds"] - 1 <= stats["accepted_tokens"] <= stats["tokens"] - stats["rounds"]
    assert all("specrt" not in c for c in chunks if c["choices"][0]["finish_reason"] is None)
    status, answer = post(url + "/v1/chat/completions", body)
    assert status == 200 and "round_log" not in answer["specrt"]
    status, error = post(url + "/v1/chat/completions", {**body, "n": 2, "specrt": {"rounds": True}})
    assert status == 400 and error["error"]["param"] == "specrt.rounds"
