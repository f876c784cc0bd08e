"""Chunked prefill: a prompt prefilled in passes of `prefill_chunk` tokens gives what one pass over it gives (the
last position's logits, the caches, the greedy tokens), for every registered architecture and every drafter with
a cache, with chunk boundaries inside the prompt and a prompt shorter than a chunk; no pass is wider than a chunk."""
from __future__ import annotations

import pytest
import torch

from conftest import MATRIX, export_tiny_with_drafters
from greedy_check import assert_same_or_tie
from specrt.errors import InputError
from specrt.decoding.generate import Generator

TOL = 1e-4
CHUNK = 8
WHOLE = 64        # the tiny engines' max_seq_len: one pass over any prompt that fits
LONG, SHORT = 29, 5   # boundaries at 8, 16 and 24, then 5 tokens; shorter than one chunk
V = 64


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefilled(gen, prompt: list[int], chunk: int, method: str = "autoregressive"):
    """A one-row batch with `prompt` prefilled in chunks of `chunk` -> (the batch, the last position's logits)."""
    gen.prefill_chunk = chunk
    batch = gen.batch(1, len(prompt) + 8, method=method, gamma=3 if method in ("draft", "ngram") else None,
                      adaptive=False)
    joining = batch._reserve(prompt, 8, None, 1)
    out = None
    while out is None:
        out = batch._prefill(joining)
    return batch, out.logits[0, -1].clone()


def pass_widths(monkeypatch, engine) -> list[int]:
    """The widths S of the passes `engine` runs from now on (its real forward still runs)."""
    widths, forward = [], engine.forward
    monkeypatch.setattr(engine, "forward", lambda ids, *a, **kw: widths.append(ids.shape[1]) or forward(ids, *a, **kw))
    return widths


@pytest.mark.parametrize("arch", MATRIX)
@pytest.mark.parametrize("length", [LONG, SHORT])
def test_chunks_give_one_pass_logits_cache_and_tokens(tiny_engines, arch, length, monkeypatch):
    directory, model = tiny_engines[arch]
    gen = Generator.from_engines(directory)
    prompt = prompt_of(length, seed=length)
    whole, ref_logits = prefilled(gen, prompt, WHOLE)
    widths = pass_widths(monkeypatch, gen.target)
    chunked, logits = prefilled(gen, prompt, CHUNK)
    assert widths == ([length % CHUNK] if length % CHUNK else []) + [CHUNK] * (length // CHUNK)   # odd one first
    assert (logits - ref_logits).abs().max() < TOL
    a, b = (batch.run.pool.data[:, 0, :, :length] for batch in (chunked, whole))
    assert (a - b).abs().max() < TOL
    gen.prefill_chunk = CHUNK
    ours = gen.generate(prompt_ids=prompt, max_new_tokens=16).token_ids[0]
    gen.prefill_chunk = WHOLE
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=16).token_ids[0]
    assert_same_or_tie(ours, ref, prompt, model)


@pytest.fixture(scope="module")
def with_drafters(tmp_path_factory):
    """A tiny peaked llama target with a draft model and an EAGLE drafter, exported and built for the CPU."""
    directory, model = export_tiny_with_drafters(tmp_path_factory.mktemp("prefill"), V, WHOLE)
    return Generator.from_engines(directory), model


@pytest.mark.parametrize("length", [LONG, SHORT])
def test_drafters_prefill_in_the_same_chunks(with_drafters, length, monkeypatch):
    """The draft model's cache and the EAGLE drafter's cache and features after a chunked prefill are those of one
    pass, and their passes are no wider than a chunk."""
    gen, _ = with_drafters
    prompt = prompt_of(length, seed=length)
    for method, engine in (("draft", gen.draft), ("eagle", gen.eagle)):
        states = []   # copies: the second batch reuses the first one's buffers (Generator.reused)
        for chunk in (WHOLE, CHUNK):
            widths = pass_widths(monkeypatch, engine)
            batch, _ = prefilled(gen, prompt, chunk, method)
            states.append([batch.drafter.pool.data[:, 0, :, :length - 1].clone()] +
                          ([batch.drafter._history[0, :length].clone()] if method == "eagle" else []))
        target = ([length % CHUNK] if length % CHUNK else []) + [CHUNK] * (length // CHUNK)
        assert widths == target[:-1] + [target[-1] - 1], method   # the prompt but its last token
        for a, b in zip(*states):
            assert (a - b).abs().max() < TOL, method


@pytest.mark.parametrize("method", ["draft", "ngram", "eagle"])
def test_methods_unchanged_by_chunks(with_drafters, method):
    """Greedy tokens, rounds and accepted drafts of each method with a chunked prefill are those with one pass
    (fixed speculation, so that the rounds follow the drafts alone)."""
    gen, model = with_drafters
    for seed, length in ((0, LONG), (1, SHORT), (2, 2 * CHUNK)):
        prompt = prompt_of(length, seed)
        runs = []
        for chunk in (CHUNK, WHOLE):
            gen.prefill_chunk = chunk
            out = gen.generate(prompt_ids=prompt, max_new_tokens=24, method=method, adaptive=False,
                               gamma=3 if method != "eagle" else None)
            runs.append((out.token_ids[0], out.stats["rounds"], out.stats["acceptance_rate"]))
        (ours, *rest), (ref, *ref_rest) = runs
        assert_same_or_tie(ours, ref, prompt, model)
        if ours == ref:
            assert rest == ref_rest, (method, length)


def test_prefill_chunk_must_be_positive(tiny_engines):
    with pytest.raises(InputError, match="prefill chunk 0"):
        Generator.from_engines(tiny_engines["llama"][0], prefill_chunk=0)


@pytest.mark.parametrize("method", ["autoregressive", "draft", "eagle"])
def test_a_joining_prompt_prefills_between_rounds(with_drafters, method):
    """Two rows run; a long prompt joins in chunks, one prefill pass between two rounds, and the first row finishes
    meanwhile (the joining request's row moves down to the live ones when it joins). Each sequence is its lone
    greedy run, and the running rows went on while the prompt was prefilled."""
    gen, model = with_drafters
    gen.prefill_chunk = CHUNK
    options = dict(method=method, adaptive=False, gamma=3 if method == "draft" else None)
    requests = {"a": (prompt_of(5, 10), 3), "b": (prompt_of(6, 11), 24), "c": (prompt_of(LONG, 12), 12)}
    lone = {k: gen.generate(prompt_ids=p, max_new_tokens=n, **options).token_ids[0] for k, (p, n) in requests.items()}
    batch = gen.batch(3, **options)
    for k in "ab":
        batch.add(*requests[k], owner=k)
    batch.join(*requests["c"], owner="c")
    assert batch.taken == 3 and batch.run.batch == 2
    outputs, rounds_while_joining, moved = {}, 0, False
    while batch.run.batch or batch.joining:
        joining = list(batch.joining)
        if joining and joining[0].done + CHUNK == LONG:   # its last pass: rows below it have been freed
            moved = joining[0].row != batch.run.batch
        if batch.prefill() is None and joining:
            batch.step()
            rounds_while_joining += 1
        elif not joining:
            batch.step()
        for row, tokens in batch.retire():
            outputs[row.owner] = tokens
    assert moved and rounds_while_joining == -(-LONG // CHUNK) - 1
    for k, (p, _) in requests.items():
        assert_same_or_tie(outputs[k], lone[k], p, model)


def test_a_cancelled_joining_request_frees_its_rows(with_drafters):
    gen, _ = with_drafters
    gen.prefill_chunk = CHUNK
    batch = gen.batch(2, method="eagle")
    batch.add(prompt_of(5), 8, owner="a")
    batch.join(prompt_of(LONG), 8, owner="b")
    batch.prefill()
    assert batch.taken == 2 and batch.joining[0].done == LONG % CHUNK
    batch.cancel(lambda owner: owner == "b")
    assert not batch.joining and batch.taken == 1
    batch.join(prompt_of(LONG, 1), 8, owner="c")   # its row again
    while batch.joining:
        batch.prefill()
    assert [row.owner for row in batch.run.rows] == ["a", "c"]


def test_the_server_streams_on_while_a_long_prompt_is_prefilled(with_drafters):
    """The scheduler (its real thread) runs a stream; a long prompt arrives: its prefill passes alternate with the
    stream's rounds, so the stream gets tokens while the prompt is prefilled; each sequence's end reports its time
    to first token and inter-token latency."""
    import queue
    import threading

    from specrt.serving.server import Job, Scheduler
    gen, _ = with_drafters
    gen.prefill_chunk = 2
    events, lock = queue.Queue(), threading.Lock()
    options = dict(method="autoregressive", temperature=0.0, top_k=0, top_p=1.0, seed=None, gamma=None, tree=False,
                   adaptive=True, acceptance="exact")
    scheduler = Scheduler(gen, 2)
    try:
        def job(name, ids, n):
            return Job(ids, {**options, "max_new_tokens": n}, 1, lambda e: events.put((name, e)))
        scheduler.submit(job("short", prompt_of(4), WHOLE - 8))
        assert events.get(timeout=60)[1][0] == "tokens"
        scheduler.submit(job("long", prompt_of(40, 3), 4))
        short_tokens_before_long, long_began, ends = 0, False, {}
        while len(ends) < 2:
            name, event = events.get(timeout=60)
            long_began |= name == "long"
            if event[0] == "end":
                ends[name] = event[4]
            elif not long_began:
                short_tokens_before_long += len(event[2])
    finally:
        scheduler.close()
    # 20 passes of 2 tokens, a round of the stream after each but the last (one token each)
    assert short_tokens_before_long >= 15
    for stats in ends.values():
        assert stats["ttft_s"] > 0 and 0 < stats["itl_mean_s"] <= stats["itl_max_s"], stats
