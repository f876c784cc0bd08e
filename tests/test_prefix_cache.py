"""The prefix cache: a prompt that starts like an earlier one copies that prefix's state instead of computing it,
and nothing else changes. Greedy output with the cache on is the output with it off for every method (a near tie
at most, reported with its logit gap: a cached prefix changes where the chunks of a prefill fall), on multi-turn
conversations and on requests sharing a prefix in one batch; the drafters' state after a hit is the state after a
full prefill; the sampled distribution is the target's; the bound holds after 1,000 requests; the counters say what
was served."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import export_tiny_with_drafters, tiny_model
from greedy_check import assert_same_or_tie
from test_speculative import P_MIN, chi_square_p, exact_joint, pair, sample_first3  # noqa: F401 (pair: a fixture)
from specrt.decoding.generate import Batch, Generator
from specrt.decoding.prefix_cache import BLOCK, PrefixCache
from specrt.decoding.sampling import SamplingParams
from specrt.errors import InputError

V = 64
B = 8          # the tests' block: several blocks in a short prompt
MAX_LEN = 128
TOL = 1e-4
METHODS = ["autoregressive", "draft", "ngram", "medusa", "eagle", "rest"]


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def options(method: str) -> dict:
    """Fixed speculation, so that rounds and acceptance follow the drafts alone."""
    return dict(method=method, adaptive=False, gamma=3 if method in ("draft", "ngram") else None)


# ---- the cache alone ------------------------------------------------------------------------------------------
def rows(n: int = 64, width: int = 3):
    """A row's tensor per part, its positions on axis 1 (a target) and axis 0 (a drafter's states)."""
    torch.manual_seed(0)
    return torch.randn(2, n, width), torch.randn(n, width)


def store(cache, ids, target, feats=None, held=None):
    parts = {"target": (target, 1, len(ids))}
    if feats is not None:
        parts["hidden"] = (feats, 0, held if held is not None else len(ids))
    cache.store(ids, parts)


def check_structure(cache: PrefixCache) -> None:
    """Every entry's parent is cached, the children counts and bytes add up, no block was ever orphaned."""
    entries = cache._entries
    children = dict.fromkeys(entries, 0)
    for entry in entries.values():
        assert entry.parent is None or entry.parent in entries, "an entry whose parent was evicted"
        if entry.parent is not None:
            children[entry.parent] += 1
    assert all(entries[k].children == c for k, c in children.items())
    assert cache.bytes == sum(e.nbytes for e in entries.values()) <= cache.max_bytes


def test_keys_are_a_chain_of_the_tokens_up_to_each_block():
    cache = PrefixCache(1 << 20, block=4)
    a = list(range(12))
    assert cache.keys(a, 3) == cache.keys(a + [7, 7], 3)                 # later tokens do not matter
    b = a[:5] + [99] + a[6:]
    assert cache.keys(b, 3)[0] == cache.keys(a, 3)[0]
    assert not set(cache.keys(b, 3)[1:]) & set(cache.keys(a, 3))         # a block and every block after it
    assert cache.keys(a[4:8], 1) != cache.keys(a, 2)[1:]                 # a block's key depends on what precedes it


def test_longest_whole_block_prefix_but_the_last_token():
    cache = PrefixCache(1 << 20, block=B)
    target, feats = rows()
    prompt = ids_of(40, 1)
    store(cache, prompt, target)
    assert cache.match(prompt, ("target",)).tokens == 32                 # 5 blocks cached; the last token stays out
    assert cache.match(prompt + [3], ("target",)).tokens == 40
    assert cache.match(prompt[:20] + [(prompt[20] + 1) % V] + prompt[21:], ("target",)).tokens == 16
    assert cache.match(prompt[:8], ("target",)).tokens == 0              # a prompt of one block keeps it to prefill
    assert cache.match(prompt + [3], ("target", "hidden")).tokens == 0   # a part nobody stored
    hit = cache.match(prompt + [3], ("target",))
    into = torch.zeros(2, 64, 3)
    assert cache.copy(hit, "target", into, axis=1) == 40
    assert torch.equal(into[:, :40], target[:, :40]) and not into[:, 40:].any()
    assert cache.stats() == dict(queries=6, hits=4, query_tokens=40 + 41 + 40 + 8 + 41 + 41,
                                 hit_tokens=32 + 40 + 16 + 40, bytes=5 * 2 * B * 3 * 4, max_bytes=1 << 20, blocks=5,
                                 block_tokens=B, evictions=0)


def test_a_hit_needs_every_part():
    cache = PrefixCache(1 << 20, block=B)
    target, feats = rows()
    prompt = ids_of(40, 2)
    store(cache, prompt, target, feats, held=20)                          # features of 2 blocks only
    assert cache.match(prompt + [1], ("target", "hidden")).tokens == 16
    assert torch.equal(cache.read(cache.match(prompt + [1], ("hidden",)), "hidden"), feats[:16])
    hit, into = cache.match(prompt + [1], ("target",)), torch.zeros(64, 3)
    assert hit.tokens == 40 and cache.copy(hit, "hidden", into, 0) == 16   # the leading blocks a part has
    assert torch.equal(into[:16], feats[:16]) and not into[16:].any()


def test_least_recently_used_leaves_go_first_and_a_prompt_keeps_its_own_prefix():
    block_bytes = 2 * B * 3 * 4
    cache = PrefixCache(6 * block_bytes, block=B)
    target, _ = rows()
    system = ids_of(16, 3)
    a, b = system + ids_of(16, 4), system + ids_of(16, 5)
    store(cache, a, target)                                              # 4 blocks
    store(cache, b, target)                                              # 2 shared + 2 new: 6, full
    cache.match(a + [0], ("target",))                                    # a is used again: b's leaves are older
    store(cache, system + ids_of(8, 6), target)                          # 1 new block: b's last goes
    check_structure(cache)
    assert cache.match(a + [0], ("target",)).tokens == 32
    assert cache.match(b + [0], ("target",)).tokens == 24
    assert cache.evictions == 1
    long = ids_of(64, 7)                                                 # 8 blocks > the bound: its first 6 stay
    store(cache, long, target.repeat(1, 2, 1)[:, :64])
    check_structure(cache)
    assert cache.match(long, ("target",)).tokens == 48
    assert cache.match(a + [0], ("target",)).tokens == 0


def test_sizes():
    assert PrefixCache.of_mb(0) is None
    cache = PrefixCache.of_mb(1.5)
    assert cache.max_bytes == 3 << 19 and cache.block == BLOCK
    with pytest.raises(InputError, match="prefix cache of -1 MB"):
        PrefixCache.of_mb(-1)
    with pytest.raises(InputError, match="blocks of 0 tokens"):
        PrefixCache(100, block=0)


# ---- every method, on a tiny engine set ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A tiny peaked llama target with a draft model, sequential Medusa heads and an EAGLE drafter."""
    directory, model = export_tiny_with_drafters(tmp_path_factory.mktemp("prefix"), V, MAX_LEN, medusa_heads=3)
    gen = Generator.from_engines(directory, prefix_cache_mb=1)
    assert gen.prefix_cache.max_bytes == 1 << 20
    gen.prefill_chunk = 8
    return gen, model


def conversation(gen, method: str, cache: PrefixCache | None, turns: int = 4, reference=None):
    """A chat of `turns` turns: the second asks the first prompt again (an answer regenerated: the whole prompt is
    cached, all of it but its last token is served), each later prompt is the last one, its answer and new user
    text. Every prompt is a whole number of blocks (24, 24, 40, 56 tokens). Later prompts extend the reference's
    answers (where given), so that both runs see the same prompts. -> [(prompt, answer, stats, each round's
    drafts)]"""
    gen.prefix_cache = cache
    prompt, out = ids_of(3 * B, 0), []
    for t in range(turns):
        got = gen.generate(prompt_ids=prompt, max_new_tokens=10, rounds=True, **options(method))
        out.append((prompt, got.token_ids[0], got.stats, [r.drafted for r in got.rounds[0]]))
        if t == 0:
            continue
        answer = reference[t][1] if reference is not None else got.token_ids[0]
        prompt = prompt + answer + ids_of(6, 10 + t)
    return out


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def hit_tokens(turns: list[tuple[list[int], list[int]]]) -> list[int]:
    """What each turn (prompt, answer) finds: the whole blocks it shares with an earlier prompt, or with an
    earlier prompt and answer but the answer's last token (finished rows are kept too), but its own last token."""
    kept = [seq for prompt, answer in turns for seq in (prompt, (prompt + answer)[:-1])]
    return [max((min(common(seq, prompt), len(prompt) - 1) // B * B for seq in kept[:2 * t]), default=0)
            for t, (prompt, _) in enumerate(turns)]


@pytest.mark.parametrize("method", METHODS)
def test_multi_turn_output_is_the_output_without_the_cache(engines, method):
    gen, model = engines
    try:
        off = conversation(gen, method, None)
        cache = PrefixCache(1 << 20, block=B)
        on = conversation(gen, method, cache, reference=off)
    finally:
        gen.prefix_cache = None
    for (prompt, ours, stats, drafts), (_, ref, ref_stats, ref_drafts) in zip(on, off):
        assert_same_or_tie(ours, ref, prompt, model)
        if ours == ref:   # the drafters' state after a hit is theirs after a full prefill: the same drafts
            assert drafts == ref_drafts
            assert (stats["rounds"], stats["acceptance_rate"]) == (ref_stats["rounds"], ref_stats["acceptance_rate"])
    expected = hit_tokens([(p, a) for p, a, *_ in on])
    assert [s["prefix_cache_tokens"] for _, _, s, _ in on] == expected and all(expected[1:])
    assert expected[1] == len(on[1][0]) - B   # the regenerated prompt: its blocks but the one of its last token
    assert any(e > len(p) for e, (p, *_) in zip(expected[2:], on[1:]))   # answers' blocks served
    assert [s["prompt_tokens"] for _, _, s, _ in on] == [len(p) for p, *_ in on]
    assert [s["prefix_cache_tokens"] for _, _, s, _ in off] == [0] * 4
    stats = cache.stats()
    assert (stats["queries"], stats["hits"], stats["hit_tokens"]) == (4, 3, sum(expected))
    assert stats["query_tokens"] == sum(len(p) for p, *_ in on)
    check_structure(cache)


@pytest.mark.parametrize("method,first_by", [("draft", "draft"), ("draft", "autoregressive"), ("eagle", "eagle")])
def test_drafter_state_after_a_hit_is_the_state_after_a_full_prefill(engines, method, first_by):
    """The draft model's cache is copied from the blocks (or, where a request of another method cached them,
    prefilled); EAGLE's features are copied and its layer prefilled from them."""
    gen, _ = engines
    first, prompt = ids_of(30, 1), ids_of(30, 1) + ids_of(9, 2)
    states, m = [], len(prompt)
    for cache in (None, PrefixCache(1 << 20, block=B)):
        gen.prefix_cache = cache
        try:
            if cache is not None:
                gen.generate(prompt_ids=first, max_new_tokens=1, **options(first_by))
            batch = gen.batch(1, len(prompt) + 8, **options(method))
            batch.add(prompt, 8)
        finally:
            gen.prefix_cache = None
        # copies: the next batch of these sizes reuses the buffers (Generator.reused)
        states.append({"cached": batch.cached_tokens, "pool": batch.drafter.pool.data[:, 0, :, :m - 1].clone(),
                       "target": batch.run.pool.data[:, 0, :, :m - 1].clone(),
                       "history": batch.drafter._history[0, :m].clone() if method == "eagle" else None})
    assert [s["cached"] for s in states] == [0, 24]
    for part in ("pool", "target") + (("history",) if method == "eagle" else ()):
        a, b = (s[part] for s in states)
        assert (a - b).abs().max() < TOL, part


def test_eagle_layer_left_to_the_first_proposal_after_a_hit(engines, monkeypatch):
    """A hit whose EAGLE layer pass waits for the row's first proposal (Batch._defers): the row is fed then from
    the restored features and the prompt's own (EagleDrafter._fill), into the cache a full prefill gives."""
    gen, _ = engines
    first, prompt = ids_of(30, 1), ids_of(30, 1) + ids_of(9, 2)
    m, pools = len(prompt), []
    for cache, defer in ((None, False), (PrefixCache(1 << 20, block=B), True)):
        monkeypatch.setattr(Batch, "_defers", lambda self, defer=defer: defer)
        gen.prefix_cache = cache
        try:
            if cache is not None:
                gen.generate(prompt_ids=first, max_new_tokens=1, **options("eagle"))
            batch = gen.batch(1, m + 8, **options("eagle"))
            batch.add(prompt, 8)
        finally:
            gen.prefix_cache = None
        drafter = batch.drafter
        assert int(drafter._past[0]) == (0 if defer else m - 1) and batch.cached_tokens == (24 if defer else 0)
        drafter._fill(batch.run)   # what the row's first proposal does
        assert int(drafter._past[0]) == m - 1 == int(drafter.pool.past_len[0])
        pools.append(drafter.pool.data[:, 0, :, :m - 1].clone())
    assert (pools[0] - pools[1]).abs().max() < TOL


@pytest.mark.parametrize("method", METHODS)
def test_requests_sharing_a_prefix_in_one_batch(engines, method):
    gen, model = engines
    system = ids_of(27, 3)
    prompts = [system + ids_of(5 + i, 20 + i) for i in range(3)]
    try:
        off = gen.generate(prompt_ids=prompts, max_new_tokens=12, **options(method))
        gen._buffers.clear()   # new caches, not the rows the run without a hit left (the same prefixes)
        gen.prefix_cache = cache = PrefixCache(1 << 20, block=B)
        on = gen.generate(prompt_ids=prompts, max_new_tokens=12, **options(method))
    finally:
        gen.prefix_cache = None
    for prompt, ours, ref in zip(prompts, on.token_ids, off.token_ids):
        assert_same_or_tie(ours, ref, prompt, model)
    assert on.stats["prefix_cache_tokens"] == 2 * 24 and cache.stats()["hits"] == 2


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_a_hit_joins_a_running_batch(engines, method):
    """Requests join a running batch between rounds, chunk by chunk, one after the other with hits (its restored
    row and drafter state moved down when rows below it finish); each output is its lone run's without a cache."""
    gen, model = engines
    system = ids_of(35, 4)
    requests = {"a": (system + ids_of(4, 30), 3), "b": (ids_of(6, 31), 30), "c": (system + ids_of(9, 32), 12),
                "d": (system + ids_of(12, 33), 12)}
    lone = {k: gen.generate(prompt_ids=p, max_new_tokens=n, **options(method)).token_ids[0]
            for k, (p, n) in requests.items()}
    gen.prefix_cache = cache = PrefixCache(1 << 20, block=B)
    try:
        batch = gen.batch(3, **options(method))
        for k in "ab":
            batch.add(*requests[k], owner=k)
        outputs, waiting = {}, ["c", "d"]
        while batch.run.batch or batch.joining or waiting:
            if waiting and batch.taken < 3:   # c at once, d once a finishes
                k = waiting.pop(0)
                batch.join(*requests[k], owner=k)
            if batch.prefill() is None:
                batch.step()
            for row, tokens in batch.retire():
                outputs[row.owner] = (tokens, batch.row_stats(row, len(tokens))["prefix_cache_tokens"])
    finally:
        gen.prefix_cache = None
    for k, (p, _) in requests.items():
        assert_same_or_tie(outputs[k][0], lone[k], p, model)
    assert {k: outputs[k][1] for k in requests} == {"a": 0, "b": 0, "c": 32, "d": 32}
    assert cache.stats()["hits"] == 2


def test_the_bound_holds_after_1000_requests(engines):
    """1,000 requests whose prompts branch off a few shared prefixes at random points: the blocks never take more
    than the bound, every cached block can be reached, and hits keep coming (the used prefixes stay)."""
    gen, _ = engines
    block_bytes = gen.target.spec["layers"] * 2 * gen.target.spec["kv_heads"] * B * gen.target.spec["head_dim"] * 4
    gen.prefix_cache = cache = PrefixCache(40 * block_bytes + block_bytes // 2, block=B)
    rng = np.random.default_rng(0)
    roots = [ids_of(40, 100 + r) for r in range(4)]
    try:
        for _ in range(50):
            prompts = []
            for _ in range(20):
                root = roots[rng.integers(4)]
                cut = int(rng.integers(0, 41))
                prompts.append(root[:cut] + rng.integers(0, V, int(rng.integers(1, 20))).tolist())
            gen.generate(prompt_ids=prompts, max_new_tokens=1, method="autoregressive")
            check_structure(cache)
    finally:
        gen.prefix_cache = None
    stats = cache.stats()
    assert stats["queries"] == 1000 and stats["blocks"] == 40 and stats["evictions"] > 500
    assert stats["bytes"] <= stats["max_bytes"] and stats["hits"] > 500


def test_sampled_output_has_the_targets_distribution(pair):
    """Chi-square over the first three tokens of 20,000 sampled sequences of the draft method whose prompt's first
    block came from the cache (test_speculative's test, the cache on)."""
    gen, model = pair
    prompt = [5, 1, 7]
    gen.prefix_cache = PrefixCache(1 << 20, block=2)
    try:
        gen.generate(prompt_ids=prompt, max_new_tokens=1, method="draft")
        out = sample_first3(gen, prompt, "draft", 2, seed=123, temperature=1.0)
    finally:
        gen.prefix_cache = None
    assert out.stats["prefix_cache_tokens"] == 2
    assert out.stats["acceptance_rate"] < 0.9   # rejections (and so the residual) really happened
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(temperature=1.0)))
    print(f"draft, prefix cache on: chi-square p = {p:.4f}")
    assert p > P_MIN


def test_generator_refuses_a_negative_size(engines):
    gen, _ = engines
    with pytest.raises(InputError, match="prefix cache of -2 MB"):
        Generator.from_engines(gen.directory, prefix_cache_mb=-2)


def test_eagle3_restores_from_the_cached_aux_states(tmp_path):
    """An EAGLE-3 drafter reads the target's aux states (three layers' inputs): those are cached, and its output
    over a conversation is the one without the cache."""
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    from test_eagle3 import LAYERS, LAYOUTS, V as V3, write_published
    arch, prefix, weights, extra, layer_ids, _ = LAYOUTS["eagle-authors"]
    assert V3 == V
    model = tiny_model(arch, seed=1, vocab=V, layers=LAYERS, init=0.3)
    model.save_pretrained(tmp_path / "src")
    ckpt = write_published(tmp_path / "eagle3", model, prefix, weights, extra)
    export_engines(str(tmp_path / "src"), tmp_path / "engines", max_seq_len=MAX_LEN, log=lambda *_: None,
                   eagle=str(ckpt), eagle_layer_ids=layer_ids, check_drafters=False)
    build(tmp_path / "engines", "onnxruntime", log=lambda *_: None, drafter_weights="float32")
    gen = Generator.from_engines(tmp_path / "engines")
    gen.prefill_chunk = 8
    off = conversation(gen, "eagle", None, turns=3)
    cache = PrefixCache(1 << 20, block=B)
    on = conversation(gen, "eagle", cache, turns=3, reference=off)
    for (prompt, ours, stats, drafts), (_, ref, ref_stats, ref_drafts) in zip(on, off):
        assert_same_or_tie(ours, ref, prompt, model)
        if ours == ref:   # its state after a hit is its state after a full prefill: the same drafts
            assert drafts == ref_drafts
            assert (stats["rounds"], stats["acceptance_rate"]) == (ref_stats["rounds"], ref_stats["acceptance_rate"])
    assert [s["prefix_cache_tokens"] for _, _, s, _ in on] == hit_tokens([(p, a) for p, a, *_ in on])
    assert {part for part, _ in cache._entries} == {"target", "aux"}


def test_logprobs_and_penalties_with_a_hit(engines):
    """A request's processors and logprobs see the whole prompt whether its prefix came from the cache or not."""
    gen, model = engines
    first, prompt = ids_of(30, 6), ids_of(30, 6) + ids_of(7, 7)
    kw = dict(max_new_tokens=12, logprobs=2, repetition_penalty=1.3, presence_penalty=0.5, **options("draft"))
    try:
        off = gen.generate(prompt_ids=prompt, **kw)
        gen.prefix_cache = PrefixCache(1 << 20, block=B)
        gen.generate(prompt_ids=first, max_new_tokens=1, method="autoregressive")   # no draft model's blocks
        on = gen.generate(prompt_ids=prompt, **kw)
    finally:
        gen.prefix_cache = None
    assert on.stats["prefix_cache_tokens"] == 24
    assert on.token_ids == off.token_ids   # no near tie here: a difference is the processors'
    for a, b in zip(on.logprobs[0], off.logprobs[0]):
        assert a.token == b.token and abs(a.logprob - b.logprob) < TOL


@pytest.mark.slow
def test_a_real_chat_with_eagle(default_generator, request):
    """SmolLM2 and its EAGLE drafter over a three-turn chat: each turn's prompt (the chat template over the turns so
    far) starts with the last one's, whose blocks it finds; the answers are those without the cache."""
    gen = default_generator
    users = ["Name three primary colors.", "Which of them is in the sky?", "And in grass?"]

    def chat(cache, reference=None):
        gen.prefix_cache, messages, out = cache, [], []
        try:
            for t, text in enumerate(users):
                messages.append({"role": "user", "content": text})
                prompt = gen.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])
                got = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="eagle")
                out.append((prompt, got.token_ids[0], got.stats["prefix_cache_tokens"]))
                answer = reference[t][1] if reference is not None else got.token_ids[0]
                text = gen.tokenizer.decode(answer, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
        finally:
            gen.prefix_cache = None
        return out

    class Lazy:   # the transformers model, loaded only if a comparison needs its logits
        def __call__(self, ids):
            return request.getfixturevalue("smollm2")(ids)

    off = chat(None)
    on = chat(PrefixCache(64 << 20), reference=off)
    for (prompt, ours, cached), (_, ref, _), last in zip(on, off, [None] + on[:-1]):
        assert_same_or_tie(ours, ref, prompt, Lazy())
        if last is not None:
            assert prompt[:len(last[0])] == last[0] and cached == len(last[0]) // BLOCK * BLOCK > 0
