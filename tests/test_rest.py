"""Drafting without a drafter: REST over a datastore, and suffix decoding over the server's own outputs."""
from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from conftest import export_tiny
from greedy_check import assert_same_or_tie
from specrt.cli import main
from specrt.decoding import datastore as ds, verification
from specrt.decoding.adaptive import TreePolicy
from specrt.decoding.datastore import (Datastore, DatastoreError, SuffixCache, TokenizerMismatchError, find_in)
from specrt.decoding.generate import Generator
from specrt.decoding.rest import RestDrafter, RestShape
from specrt.decoding.sampling import SamplingParams
from specrt.measurement.serve_bench import suffix_cache_figures
from test_serve import client, running_server
from test_speculative import P_MIN, V, chi_square_p, exact_joint, sample_first3


@pytest.fixture(scope="module")
def rest_pair(tmp_path_factory):
    """A tiny peaked target (vocabulary V) and a datastore of its own sampled text (so that the continuations found
    are often, not always, what it would say), built through the CLI."""
    tmp = tmp_path_factory.mktemp("rest")
    directory, model = export_tiny(tmp, "llama", seed=1, vocab=V, init=0.3, max_seq_len=48)
    gen = Generator.from_engines(directory)
    g = torch.Generator().manual_seed(0)
    rows = []
    for s in range(24):
        prompt = torch.randint(0, V, (4,), generator=g).tolist()
        out = gen.generate(prompt_ids=prompt, max_new_tokens=30, temperature=1.0, seed=s, method="autoregressive")
        rows.append({"ids": prompt + out.token_ids[0]})
    (tmp / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = CliRunner().invoke(main, ["datastore", "build", str(tmp / "corpus.jsonl"), "--engines", str(directory),
                                       "--out", str(tmp / "store")])
    assert result.exit_code == 0, result.output
    gen.use_datastore(tmp / "store")
    gen.rest_shape = RestShape(depth=3, nodes=8)
    return gen, model, tmp


def test_datastore_lookup_matches_a_scan(rest_pair):
    """The suffix array's answer (longest match and the tokens after it) is the brute-force scan's."""
    gen, _, _ = rest_pair
    store, rng = gen.datastore, np.random.default_rng(0)
    tokens = np.asarray(store.tokens, np.int64)
    tokens[tokens == store.separator] = -1
    assert store.manifest["tokens"] == int((tokens >= 0).sum()) and store.manifest["documents"] == 24
    for _ in range(40):
        context = rng.integers(0, V, rng.integers(1, 10))
        got = store.lookup(context, 6, 3, limit=10 ** 6)
        want = find_in(tokens, context, 6, 3, limit=10 ** 6)
        assert got.n == want.n > 0
        assert sorted(map(tuple, got.continuations.tolist())) == sorted(map(tuple, want.continuations.tolist()))


def test_greedy_rest_equals_target_greedy(rest_pair, monkeypatch):
    """Trees from the datastore and the context, one prompt at a time and a batch of three; every round grows a
    tree (the policy's choice of plain steps would hide them), and some of their drafts are accepted."""
    gen, model, _ = rest_pair
    monkeypatch.setattr(TreePolicy, "choose", lambda self: True)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (5,), generator=g).tolist() for _ in range(3)]
    refs = [gen.generate(prompt_ids=p, max_new_tokens=24, method="autoregressive").token_ids[0] for p in prompts]
    accepted = 0
    for p, ref in zip(prompts, refs):
        out = gen.generate(prompt_ids=p, max_new_tokens=24, method="rest")
        assert_same_or_tie(out.token_ids[0], ref, p, model)
        accepted += (out.stats["acceptance_rate"] or 0) > 0
    assert accepted >= 2
    batch = gen.generate(prompt_ids=prompts, max_new_tokens=24, method="rest", adaptive=False)
    for p, ref, row in zip(prompts, refs, batch.token_ids):
        assert_same_or_tie(row, ref, p, model)


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7)], ids=str)
def test_rest_distribution_is_the_target_distribution(rest_pair, kw):
    """Retrieval trees verified by the tree rule keep the target's law (every round verifies a whole tree)."""
    gen, model, _ = rest_pair
    prompt = [5, 1, 7]
    out = sample_first3(gen, prompt, "rest", None, seed=123, **kw)
    assert 0 < out.stats["acceptance_rate"] < 0.9   # acceptances and residuals both happened
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(**kw)))
    print(f"rest {kw}: chi-square p = {p:.4f}, acceptance {out.stats['acceptance_rate']:.3f}")
    assert p > P_MIN


def test_broken_sibling_rule_is_caught_with_retrieval_trees(rest_pair, monkeypatch):
    """Power: a rejected sibling left in the residual fails the same test on the same retrieval trees."""
    gen, model, _ = rest_pair
    monkeypatch.setattr(verification, "without", lambda R, rows, x: R)
    monkeypatch.setattr(verification, "without_host", lambda R, x: R)
    out = sample_first3(gen, [5, 1, 7], "rest", None, seed=123, temperature=1.0)
    p = chi_square_p(out.token_ids, exact_joint(model, [5, 1, 7], SamplingParams(temperature=1.0)))
    print(f"broken sibling rule (rest): chi-square p = {p:.2e}")
    assert p < P_MIN


def test_suffix_cache_drafts_a_repeated_request(rest_pair, monkeypatch):
    """Without a datastore: a request's output goes into the suffix cache, and the same request again is drafted
    from it (long accepted runs) with the target's greedy output unchanged."""
    gen, model, _ = rest_pair
    monkeypatch.setattr(gen, "datastore", None)
    monkeypatch.setattr(gen, "suffix_cache", SuffixCache(1.0))
    monkeypatch.setattr(TreePolicy, "choose", lambda self: True)
    # lookups every round: on this tiny target a pass takes less time than a lookup, so that they would not pay
    monkeypatch.setattr(RestDrafter, "MAX_IDLE", 0)
    prompt = [3, 9, 14, 2, 20]
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="autoregressive").token_ids[0]
    assert gen.suffix_cache.outputs == 1   # generate() feeds it too
    again = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="rest")
    assert_same_or_tie(again.token_ids[0], ref, prompt, model)
    assert again.stats["mean_tokens_per_round"] > 2.5, again.stats
    monkeypatch.setattr(gen, "suffix_cache", None)
    alone = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="rest")
    assert alone.stats["mean_tokens_per_round"] < again.stats["mean_tokens_per_round"]


def test_server_suffix_cache(rest_pair, tmp_path):
    """`specrt serve --suffix-cache`: 80 requests through a cache of 0.002 MB (524 tokens) keep it at its size, the
    oldest outputs gone; answers stay the target's greedy ones, and a request repeated is drafted from its first
    answer (more tokens a round than a new one)."""
    gen, _, _ = rest_pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (4,), generator=g).tolist() for _ in range(80)]
    with running_server(gen.directory, tmp_path / "log", "--method", "rest", "--suffix-cache", "0.002",
                        "--model-name", "m", "--threads", "1") as (url, _):
        api = client(url)
        outs = [api.completions.create(model="m", prompt=p, max_tokens=20, temperature=0) for p in prompts]
        for p, out in zip(prompts[:4], outs):
            assert out.choices[0].token_ids == gen.generate(prompt_ids=p, max_new_tokens=20,
                                                             method="autoregressive").token_ids[0]
        # every round a whole tree (adaptive rounds would follow the tiny model's measured costs, and the batch's
        # policy what the 80 requests before measured): the repeat against a prompt never sent
        whole = {"specrt": {"adaptive": False}}
        again = api.completions.create(model="m", prompt=prompts[-1], max_tokens=20, temperature=0, extra_body=whole)
        new = api.completions.create(model="m", prompt=[1, 2, 3, 4, 5], max_tokens=20, temperature=0, extra_body=whole)
        cache = suffix_cache_figures(url)   # /metrics' gauges (the open /health says only whether it lives)
    print(f"suffix cache: repeated request {again.specrt['mean_tokens_per_round']:.2f} tokens a round, new "
          f"{new.specrt['mean_tokens_per_round']:.2f}; {cache}")
    assert again.choices[0].token_ids == outs[-1].choices[0].token_ids and again.specrt["method"] == "rest"
    assert again.specrt["mean_tokens_per_round"] > max(2.5, new.specrt["mean_tokens_per_round"]), \
        (again.specrt, new.specrt)
    assert cache["bytes"] == 524 * 4 and cache["tokens"] <= 524 and 20 <= cache["outputs"] < 81


def post_get(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, json.loads(r.read())


def test_suffix_cache_memory_is_bounded():
    """1,000 outputs of every length into a cache of 0.004 MB (1,048 tokens): its memory never grows, the oldest
    outputs leave first, the newest is always found, and one longer than the cache keeps its end."""
    cache = SuffixCache(0.004)
    size, rng = cache.nbytes, np.random.default_rng(0)
    assert size == 1048 * 4
    outputs = []
    for i in range(1000):
        ids = rng.integers(0, 1000, rng.integers(5, 300)).astype(np.int64)
        ids[0] = 1000 + i   # a token that names the output
        cache.add(ids)
        outputs.append(ids)
        assert cache.nbytes == size and cache.used <= 1048 and cache.buffer.nbytes == size
        kept = cache.buffer[:cache.used]
        assert (kept == -1).sum() == cache.outputs == len(cache.lengths)
        hit = cache.lookup(ids[:3], 3, 2, 8)
        assert hit.n == 3 and hit.continuations[-1].tolist() == ids[3:5].tolist()
    firsts = set(cache.buffer[:cache.used].tolist())
    assert 1000 not in firsts and 1999 in firsts   # the first output left, the last is there
    names = [t for t in cache.buffer[:cache.used].tolist() if t >= 1000]
    assert names == sorted(names) and names[-1] - names[0] + 1 == len(names)   # a run of the newest, in order
    cache.add(np.arange(5000) % 900)
    assert cache.outputs == 1 and cache.used == 1048 and cache.buffer[cache.used - 2] == 4999 % 900


def test_verify_command_checks_rest(rest_pair):
    """`specrt verify --method rest --datastore DIR`: greedy identity and the chi-square checks pass."""
    gen, _, tmp = rest_pair
    result = CliRunner().invoke(main, ["verify", str(gen.directory), "--method", "rest", "--datastore",
                                       str(tmp / "store"), "--samples", "1000", "--top-k", "0", "--temperature", "1"])
    assert result.exit_code == 0 and result.output.strip().endswith("PASS"), result.output


def test_datastore_errors(rest_pair, tmp_path):
    gen, _, tmp = rest_pair
    engines = str(gen.directory)
    other, _ = export_tiny(tmp_path, "llama", seed=2, vocab=32, max_seq_len=16)
    with pytest.raises(TokenizerMismatchError, match=r"vocabulary of 24 .*vocabulary of 32"):
        Generator.from_engines(other, datastore=tmp / "store")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatastoreError, match="no tokens"):
        ds.build([tmp_path / "empty.jsonl"], engines, tmp_path / "out", progress=False)
    with pytest.raises(DatastoreError, match="missing.txt: no such file"):
        ds.build([tmp_path / "missing.txt"], engines, tmp_path / "out", progress=False)
    with pytest.raises(DatastoreError, match="no tokenizer"):
        ds.build([tmp_path / "empty.txt"], engines, tmp_path / "out", progress=False)
    (tmp_path / "bad.jsonl").write_text('{"ids": [1, 2]}\n{"ids": [3, 99]}\n')
    with pytest.raises(DatastoreError, match="token id 99 is outside"):
        ds.build([tmp_path / "bad.jsonl"], engines, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))   # nothing half-written
    with pytest.raises(DatastoreError, match="exists: pass --force"):
        ds.build([tmp / "corpus.jsonl"], engines, tmp / "store", progress=False)
    with pytest.raises(DatastoreError, match="not a datastore"):
        Datastore.open(tmp_path)
    result = CliRunner().invoke(main, ["generate", engines, "--prompt-ids", "1,2", "--method", "rest",
                                       "--datastore", str(tmp_path)])
    assert result.exit_code == 1 and "not a datastore" in result.output


def test_candidates_are_the_most_frequent_continuations():
    """A row's candidates (the context's own matches and a suffix cache's) against a plain count: every path kept
    has its share (the larger of the two sources'), none left out is more frequent than one kept, and the rank
    paths name the token paths."""
    import collections

    rng = np.random.default_rng(3)
    cache = SuffixCache(0.05)
    for _ in range(60):
        cache.add(np.concatenate([[5, 6], rng.integers(0, 6, 8)]))   # many continuations of "5 6"
    drafter = RestDrafter([cache], RestShape(depth=4, nodes=10))
    context = np.concatenate([rng.integers(0, 9, 30), [5, 6, 2, 5, 6]])
    n, out = drafter.candidates(context, 4)
    share = collections.Counter()
    for m in (find_in(context, context, 16, 4, 256, exclude_last=True), cache.lookup(context, 16, 4, 256)):
        if m.n != n:
            continue
        counts = collections.Counter(tuple(r[:d + 1]) for r in m.continuations.tolist() for d in range(4)
                                     if min(r[:d + 1]) >= 0)
        for path, c in counts.items():
            share[path] = max(share[path], c / len(m.continuations))
    paths = {}
    for ranks in sorted(out, key=len):   # rank path -> token path
        paths[ranks] = paths.get(ranks[:-1], ()) + (out[ranks][0],)
    kept = {paths[r]: out[r][1] for r in out}
    assert n == 2 and len(kept) == 10 and all(share[p] == v for p, v in kept.items())
    assert max(v for p, v in share.items() if p not in kept) <= min(kept.values())


def test_lookups_that_do_not_pay_back_off():
    """Rounds whose lookups found nothing (they cost 1 ms, a pass 10 ms): 1, 2, 4, 8, 8 rounds go without them,
    each a plain step that counts one down; one round with 5 accepted drafts brings lookups back to every round: the
    next round that finds nothing does not stop them (the average saving stays above 0)."""
    from types import SimpleNamespace

    from specrt.decoding.adaptive import Costs
    drafter = RestDrafter([], RestShape(), costs=lambda rows: Costs(0.0, {1: 0.010, 25: 0.012}))
    idles = []
    for _ in range(5):
        drafter._saved(0.001, 1, 0, 0)
        idles.append(drafter.idle)
    assert idles == [1, 2, 4, 8, 8]
    assert drafter.saving == pytest.approx(-0.001 * (1 - 0.9 ** 5))   # the average of -1 ms a round
    plain = object()   # a round without lookups: the run's inputs of a plain step
    run = SimpleNamespace(batch=1, inputs=lambda batch, width: SimpleNamespace(empty=plain))
    assert [drafter.propose(run, 6) for _ in range(8)] == [plain] * 8 and drafter.idle == 0
    drafter._saved(0.001, 1, 24, 5)   # 50 ms of tokens for 2 ms more pass and 1 ms of lookups
    assert drafter.saving == pytest.approx(0.9 * -0.001 * (1 - 0.9 ** 5) + 0.1 * 0.047)
    assert drafter.idle == 0 and drafter.backoff == 1
    drafter._saved(0.001, 1, 0, 0)
    assert drafter.saving > 0 and drafter.idle == 0 and drafter.backoff == 1


def test_lookups_back_off_on_new_text_and_resume(rest_pair, monkeypatch):
    """Adaptive rounds with the idle back-off as shipped (RestDrafter.MAX_IDLE): the row's own context the only
    source (no datastore, no suffix cache). The target's answer is new text for 14 tokens, then repeats itself
    (10 17 10 17 ...): lookups that find nothing worth a tree are skipped for 1, 2, 4, then 8 rounds (plain steps,
    one token each), and come back after each; once the text repeats, their trees are accepted, they pay, and they
    run every round. The output is the target's greedy one throughout. Pass times are fixed (10 ms a pass, as a
    large target's) so that what a lookup saves does not hang on how fast this machine runs a tiny model."""
    from specrt.decoding.adaptive import Costs
    gen, model, _ = rest_pair
    monkeypatch.setattr(gen, "datastore", None)
    costs = Costs(0.0, {1: 0.010, 25: 0.012})
    monkeypatch.setattr(gen, "costs", lambda *_, **__: costs)
    prompt = [3, 9, 14, 2, 20]
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=40, method="autoregressive").token_ids[0]
    assert ref[14:18] == [10, 17, 10, 17] and len(set(ref[:14])) > 8
    rounds = []   # per round: "L" where it looked up, "." where it went without
    propose, look_up = RestDrafter.propose, RestDrafter._propose

    def counted(self, run, gamma):
        rounds.append(".")
        return propose(self, run, gamma)

    def looked_up(self, run, gamma):
        rounds[-1] = "L"
        return look_up(self, run, gamma)
    monkeypatch.setattr(RestDrafter, "propose", counted)
    monkeypatch.setattr(RestDrafter, "_propose", looked_up)
    out = gen.generate(prompt_ids=prompt, max_new_tokens=40, method="rest")
    assert_same_or_tie(out.token_ids[0], ref, prompt, model)
    pattern = "".join(rounds)
    print(f"rounds: {pattern} (L: looked up), acceptance {out.stats['acceptance_rate']}")
    assert pattern.startswith("L.L..L....L........L"), pattern   # 1, 2, 4, 8 rounds without lookups
    assert set(pattern[20:]) == {"L"} and out.stats["acceptance_rate"] > 0.5, pattern   # back every round
