"""The EAGLE drafter: its graph, its cache invariant, and the target's promise with its dynamic trees."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_model
from greedy_check import assert_same_or_tie
from specrt.decoding import eagle, verification
from specrt.decoding.adaptive import Costs, TreePolicy
from specrt.decoding.drafters import chain_mask
from specrt.decoding.eagle import DynamicTree, EagleDrafter
from specrt.errors import InputError
from specrt.export.eagle import load_eagle, new_eagle, save_eagle
from specrt.export.model import from_hf
from specrt.decoding.generate import Batch, Generator
from specrt.decoding.sampling import SamplingParams
from test_speculative import N, P_MIN, V, chi_square_p, exact_joint, sample_first3

MAX_LEN = 48


def export_with_eagle(tmp, model, drafter_weights="float32", seed=3, layers=1):
    """Save `model`, a fresh random EAGLE drafter for it, export and build both; return the engine directory."""
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    model.save_pretrained(tmp / "src")
    save_eagle(new_eagle(from_hf(model, MAX_LEN), seed=seed, num_layers=layers), tmp / "eagle", dtype=torch.float32)
    export_engines(str(tmp / "src"), tmp / "engines", max_seq_len=MAX_LEN, log=lambda *_: None,
                   eagle=str(tmp / "eagle"))
    build(tmp / "engines", "onnxruntime", log=lambda *_: None, drafter_weights=drafter_weights)
    return tmp / "engines"


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory):
    """A tiny peaked target (vocabulary V, for the exact joint distribution) with a random EAGLE drafter."""
    tmp = tmp_path_factory.mktemp("eagle")
    model = tiny_model("llama", seed=1, vocab=V, init=0.3)
    return Generator.from_engines(export_with_eagle(tmp, model)), model, tmp


def shaped(gen, **shape):
    gen.eagle.spec["dynamic_tree"] = shape
    return gen


def test_graph_matches_eager(eagle_pair):
    gen, model, tmp = eagle_pair
    assert_graph_matches_eager(gen, load_eagle(tmp / "eagle", from_hf(model, MAX_LEN)))


def assert_graph_matches_eager(gen, eager):
    """The ONNX Runtime engine against the eager model: a prefix written to the cache, then a tree over it;
    and the training pass (SDPA, causal) against the graph's forward."""
    g = torch.Generator().manual_seed(0)
    d = eager.args.hidden_size
    feats, ids = torch.randn(1, 9, d, generator=g), torch.randint(0, V, (1, 9), generator=g)
    with torch.no_grad():
        whole = eager.train_forward(feats, ids)                                      # (1, 9, d)
        cache = gen.eagle.new_cache(1, MAX_LEN)
        out = gen.eagle.forward(ids[:, :6], torch.arange(6)[None], cache.past_len, chain_mask(1, 6), 6, cache,
                                features=feats[:, :6])
        assert torch.allclose(out.hidden, whole[:, :6], atol=1e-5)
        assert torch.allclose(out.logits, eager.logits(whole[:, :6]), atol=1e-4)
        cache.write(out.new_kv)
        cache.past_len += 6
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)[None]  # node 2 skips node 1
        out = gen.eagle.forward(ids[:, 6:], torch.tensor([[6, 7, 7]]), cache.past_len, mask, 3, cache,
                                features=feats[:, 6:])
        assert torch.allclose(out.hidden[:, :2], whole[:, 6:8], atol=1e-5)
        branch = eager.train_forward(feats[:, [*range(7), 8]], ids[:, [*range(7), 8]])
        assert torch.allclose(out.hidden[:, 2], branch[:, 7], atol=1e-5)


@pytest.mark.parametrize("shape", [dict(top_k=4, depth=5, nodes=16), dict(top_k=2, depth=3, nodes=4),
                                   dict(top_k=1, depth=4, nodes=4), dict(top_k=6, depth=4, nodes=8)], ids=str)
def test_greedy_eagle_equals_target_greedy(eagle_pair, shape):
    gen, model, _ = eagle_pair
    shaped(gen, **shape)
    accepted = 0
    for seed in range(3):
        prompt = torch.randint(0, V, (4 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        # runs into max_seq_len
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=40, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=40, method="eagle", adaptive=False)
        assert_same_or_tie(out.token_ids[0], ref, prompt, model)
        assert out.stats["tree_size"] == shape["nodes"] and out.stats["tree_depth"] == shape["depth"]
        accepted += out.stats["acceptance_rate"] * out.stats["rounds"]
    assert accepted > 0 or shape["top_k"] == 1   # accepted paths (and their cache compaction) ran


@pytest.mark.parametrize("plain_every", [0, 2, 3, "moved", "alone", "deferred"],
                         ids=["trees", "plain-every-2", "plain-every-3", "moved-row", "chains-alone", "deferred"])
def test_catch_up_feeds_the_target_features(eagle_pair, monkeypatch, request, plain_every):
    """The cache invariant: slot t holds what the drafter computes from the target's feature at position t
    and token t + 1 (checked against the eager drafter over the target's features of the final sequence),
    also when plain steps (the tree policy's fallback, here on a fixed pattern) come between tree rounds, for a
    request that joined a running batch and moved to a freed row when the one before it finished, when
    rounds of lookup chains alone (no drafter pass) come between the drafter's, and when a prompt's pass over the
    drafter's layer was left to its first proposal (Batch._defers, decided once for all the prompt's chunks), which
    feeds it in chunks (_fill)."""
    gen, model, tmp = eagle_pair
    shaped(gen, top_k=3, depth=3, nodes=8)
    prompt = [3, 9, 1, 4, 1]
    alone = count_lookup_nodes(monkeypatch)
    fills = []   # "deferred": how far the drafter's cache was at each proposal's fill
    if plain_every == "deferred":   # the answer asked at the prompt's first chunk holds for its others
        answers = iter([True] + [False] * 10)
        monkeypatch.setattr(Batch, "_defers", lambda self: next(answers))
        monkeypatch.setattr(gen, "prefill_chunk", 8)
        monkeypatch.setattr(eagle, "PREFILL_CHUNK", 8)
        fill = EagleDrafter._fill
        monkeypatch.setattr(EagleDrafter, "_fill", lambda self, run: (fills.append(int(self._past[0])),
                                                                      fill(self, run))[1])
        plain_every, prompt = 0, (prompt * 5)[:22]
    if plain_every != "alone":   # every tree round is the drafter's
        monkeypatch.setattr(EagleDrafter, "_lookup_only", lambda self, *args: None)
    else:                        # every other round, where the text allows, chains alone
        flip, real = iter(range(1000)), EagleDrafter._lookup_only
        monkeypatch.setattr(eagle.PromptLookup, "min_n", 1)
        monkeypatch.setattr(EagleDrafter, "_lookup_only",
                            lambda self, *args: real(self, *args) if next(flip) % 2 else None)
        monkeypatch.setattr(eagle.PromptLookup, "rate", lambda self, n: 0.99)
        plain_every, prompt = 0, [3, 9, 1, 4, 1, 3, 9, 1]
    if plain_every == "moved":
        batch = gen.batch(2, method="eagle", adaptive=False)
        batch.add([5, 2, 8], 4, owner="first")
        batch.add(prompt, 14, owner="second")
        done = {}
        while batch.run.batch:
            batch.step()
            for row, tokens in batch.retire():
                done[row.owner] = (row, tokens)
                assert row.owner == "second" or batch.run.rows[0].owner == "second"   # it moved to row 0
        drafter, new, rounds = batch.drafter, done["second"][1], done["second"][0].rounds
    else:
        seen, steps = [], iter(range(1000))
        join = EagleDrafter.join
        monkeypatch.setattr(EagleDrafter, "join", lambda self, *a: (seen.append(self), join(self, *a))[1])
        if plain_every:
            monkeypatch.setattr(TreePolicy, "choose", lambda self: next(steps) % plain_every == 0)
        out = gen.generate(prompt_ids=prompt, max_new_tokens=14, method="eagle", adaptive=bool(plain_every))
        assert out.stats.get("plain_rounds", 0) >= (3 if plain_every else 0)
        drafter, new, rounds = seen[0], out.token_ids[0], out.stats["rounds"]
    tokens = torch.tensor([prompt + new])
    P = int(drafter.pool.past_len[0])
    assert rounds >= 2 and P >= len(prompt) + rounds - 1 - alone[2]   # the drafter's rounds caught up
    assert (alone[2] > 0) == (request.node.callspec.id == "chains-alone")
    assert (fills[:1] == [0]) == (request.node.callspec.id == "deferred")   # its first proposal found it unfed
    eager = load_eagle(tmp / "eagle", from_hf(model, MAX_LEN))
    with torch.no_grad():
        feats = model.model(tokens).last_hidden_state                               # (1, n, d) after the norm
        empty = torch.zeros(1, eager.args.num_kv_heads, 1, eager.args.head_dim)
        _, _, k, v = eager(tokens[:, 1:P + 1], torch.arange(P)[None], torch.zeros(1, dtype=torch.int64),
                           chain_mask(1, P), torch.tensor([1]), feats[:, :P], empty, empty)
    assert torch.allclose(drafter.pool.data[0, 0, :, :P], k[0], atol=1e-4)
    assert torch.allclose(drafter.pool.data[1, 0, :, :P], v[0], atol=1e-4)


def test_speculation_counts_the_rows_queued_to_join(eagle_pair, monkeypatch):
    """A round's choice counts the rows of the prompts queued to join: where a tree does not pay at that size, the
    live row takes a plain step rather than delay their prefills, and their prompts' passes over the drafter's
    layer wait for their first proposal (Batch._defers); once the size pays again, those rows draft, and every row
    keeps the target's greedy output."""
    gen, model, _ = eagle_pair
    shaped(gen, top_k=2, depth=3, nodes=6)
    flat = Costs(0.0, {k: 1e-3 for k in range(1, 65)})              # a tree's verify pass costs a plain step's
    steep = Costs(0.0, {k: 1e-3 * k for k in range(1, 65)})         # each token costs a step: no tree pays
    monkeypatch.setattr(gen, "_batch_costs", {1: flat, 2: steep, 3: steep, 4: steep})
    monkeypatch.setattr(TreePolicy, "choose", lambda self: True)
    defers = []
    real = Batch._defers
    monkeypatch.setattr(Batch, "_defers", lambda self: (defers.append(real(self)), defers[-1])[1])
    prompts = [[2, 7, 7, 1], [5, 3, 9, 9, 2], [1, 4, 1, 5, 9, 2], [8, 6, 8, 6]]
    batch = gen.batch(4, method="eagle")
    batch.add(prompts[0], 12, owner=0)
    batch.step()
    for i, p in enumerate(prompts[1:], 1):
        batch.join(p, 12, owner=i)
    batch.step()                                        # one row live, three queued: a plain round
    assert batch.run.by_batch[1] == [2, 1], batch.run.by_batch
    while batch.joining:
        batch.prefill()
    assert defers == [False, True, True, True]          # the first prompt alone: its pass ran at its prefill
    gen._batch_costs.update({2: flat, 3: flat, 4: flat})
    done = {}
    while batch.run.batch:
        batch.step()
        done |= {row.owner: tokens for row, tokens in batch.retire()}
    assert batch.run.by_batch[4][1] > 0                 # the deferred rows drafted
    for i, p in enumerate(prompts):
        ref = gen.generate(prompt_ids=p, max_new_tokens=12, method="autoregressive").token_ids[0]
        assert_same_or_tie(done[i], ref, p, model)


def test_batch_rows_share_the_tree_shape(eagle_pair):
    gen, model, _ = eagle_pair
    shaped(gen, top_k=2, depth=3, nodes=6)
    prompt = [2, 7, 7, 1]
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=10, method="autoregressive").token_ids[0]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=10, method="eagle", num_return_sequences=3)
    for row in out.token_ids:
        assert_same_or_tie(row, ref, prompt, model)


def test_expansions_feed_only_the_lineage(eagle_pair, monkeypatch):
    """An expansion pass over the frontier and its ancestors drafts the same trees as one over every frontier
    fed so far, in fewer tokens."""
    gen, _, _ = eagle_pair
    shaped(gen, top_k=4, depth=5, nodes=16)
    expand, grow = EagleDrafter._expand, EagleDrafter._grow
    fed, trees = [], []

    def counted_expand(self, run, tokens, feats, paths, k):
        fed.append(len(paths))
        return expand(self, run, tokens, feats, paths, k)

    def recorded_grow(self, *args):
        tree, tokens = grow(self, *args)
        trees.append((tree.paths, tokens.tolist()))
        return tree, tokens

    monkeypatch.setattr(EagleDrafter, "_expand", counted_expand)
    monkeypatch.setattr(EagleDrafter, "_grow", recorded_grow)
    prompt = [5, 1, 6, 2, 9, 3]
    lean = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="eagle", adaptive=False).token_ids
    lean_fed, lean_trees = fed[:], trees[:]
    fed.clear()
    trees.clear()
    monkeypatch.setattr(eagle, "_lineage", lambda frontiers: ([f[1] for f in frontiers], [f[2] for f in frontiers],
                                                              tuple(p for f in frontiers for p in f[0])))
    assert gen.generate(prompt_ids=prompt, max_new_tokens=24, method="eagle", adaptive=False).token_ids == lean
    assert trees == lean_trees and len(trees) >= 3
    assert sum(lean_fed) < sum(fed) and all(a <= b for a, b in zip(lean_fed, fed))


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7)], ids=str)
def test_eagle_distribution_is_the_target_distribution(eagle_pair, kw):
    gen, model, _ = eagle_pair
    shaped(gen, top_k=3, depth=3, nodes=8)
    prompt = [5, 1, 7]
    out = sample_first3(gen, prompt, "eagle", None, seed=123, **kw)
    assert 0 < out.stats["acceptance_rate"] < 0.9   # acceptances and residuals both happened
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(**kw)))
    print(f"eagle {kw}: chi-square p = {p:.4f}")
    assert p > P_MIN


@pytest.mark.parametrize("kw,alone", [(dict(temperature=1.0), False), (dict(temperature=0.7), False),
                                      (dict(temperature=1.0), True)], ids=["T=1", "T=0.7", "T=1-chains-alone"])
def test_lookup_chains_keep_the_target_distribution(eagle_pair, monkeypatch, kw, alone):
    """Prompt lookup's chains in the trees are proposals like the drafter's: the sibling rule keeps the target's law.
    The prompt holds every token once and 1-token matches count, so that every row has a chain in every round.
    `alone`: chains measured as nearly always accepted, so that rounds verify them alone, without the drafter."""
    gen, model, _ = eagle_pair
    shaped(gen, top_k=3, depth=3, nodes=8)
    monkeypatch.setattr(eagle.PromptLookup, "min_n", 1)
    if alone:   # and the drafter's rounds promise little from the first round on
        monkeypatch.setattr(eagle.PromptLookup, "rate", lambda self, n: 0.95)
        init = eagle.EagleDrafter.__init__

        def modest(self, *args, **kw):
            init(self, *args, **kw)
            self.figures.promise = [0.5, 1.0]
        monkeypatch.setattr(eagle.EagleDrafter, "__init__", modest)
    added = count_lookup_nodes(monkeypatch)
    prompt = torch.randperm(V, generator=torch.Generator().manual_seed(2)).tolist()
    out = sample_first3(gen, prompt, "eagle", None, seed=321, **kw)
    assert added[0] > 1000 and added[1] > 0   # new nodes in many rounds, some of them accepted
    assert (added[2] > 0) == alone            # rounds of chains alone (a batch of every sample's rows)
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(**kw)))
    print(f"eagle with lookup {kw}: chi-square p = {p:.4f}, {added[0]} lookup nodes, {added[1]} accepted, "
          f"{added[2]} rounds of chains alone")
    assert p > P_MIN


def count_lookup_nodes(monkeypatch) -> list[int]:
    """[nodes of prompt lookup's chains in the verified trees, those the target accepted, rounds of chains alone
    (no drafter pass)], counted as it runs."""
    counts, offered, update = [0, 0, 0], eagle.PromptLookup.offered, eagle.PromptLookup.update
    alone = eagle.EagleDrafter._lookup_only

    def counted_alone(self, *args):
        got = alone(self, *args)
        counts[2] += got is not None
        return got

    def counted_offered(self, tree):
        offered(self, tree)
        counts[0] += sum(len(ids) for _, ids in self._round.values())

    def counted_update(self, path, accepted):
        before = {n: v[0] for n, v in self.sums.items()}
        update(self, path, accepted)
        counts[1] += round(sum(self.sums[n][0] - eagle.DECAY * before[n] for n in before))

    monkeypatch.setattr(eagle.PromptLookup, "offered", counted_offered)
    monkeypatch.setattr(eagle.PromptLookup, "update", counted_update)
    monkeypatch.setattr(eagle.EagleDrafter, "_lookup_only", counted_alone)
    return counts


# a CPU-like machine: a target pass of 1 ms and 5 % more per token, a drafter pass (a tree level) of 0.2 ms
CPU_LIKE = Costs(2e-4, {k: 1e-3 * (1 + 0.05 * (k - 1)) for k in range(1, 66)})


@pytest.mark.parametrize("adaptive", [False, True], ids=["full-trees", "sized-trees"])
def test_lookup_keeps_greedy_output(eagle_pair, monkeypatch, adaptive):
    """The chains join the trees (one prompt, and a batch of two whose rows share the tree's shape; prompts that
    hold every token and 1-token matches, so that every round has a chain) and the output stays the target's; some
    chain nodes are accepted, and some rounds verify chains alone. Adaptive rounds size their trees by the given
    costs (the measured ones, and the measured choice between trees and plain steps, would change from run to
    run); they speculate every round, as the policy does while trees pay."""
    gen, model, _ = eagle_pair
    shaped(gen, top_k=2, depth=4, nodes=8)
    monkeypatch.setattr(eagle.PromptLookup, "min_n", 1)
    if adaptive:
        monkeypatch.setattr(gen, "eagle_costs", lambda batch, shape: CPU_LIKE)
        monkeypatch.setattr(gen, "costs", lambda batch=1, upto=None, draft=True: CPU_LIKE)
        monkeypatch.setattr(TreePolicy, "choose", lambda self: True)
    added = count_lookup_nodes(monkeypatch)
    prompts = [torch.randperm(V, generator=torch.Generator().manual_seed(s)).tolist() for s in (4, 5)]
    refs = [gen.generate(prompt_ids=p, max_new_tokens=20, method="autoregressive").token_ids[0] for p in prompts]
    for p, ref in zip(prompts, refs):
        out = gen.generate(prompt_ids=p, max_new_tokens=20, method="eagle", adaptive=adaptive)
        assert_same_or_tie(out.token_ids[0], ref, p, model)
    both = gen.generate(prompt_ids=prompts, max_new_tokens=20, method="eagle", adaptive=adaptive)
    for p, ref, row in zip(prompts, refs, both.token_ids):
        assert_same_or_tie(row, ref, p, model)
    print(f"{added[0]} lookup nodes verified, {added[1]} accepted, {added[2]} rounds of chains alone")
    assert added[0] > 0 and added[1] > 0   # chain nodes verified, and some accepted
    assert added[2] > 0                    # some rounds verified chains alone


def test_datastore_chains_keep_greedy_output_and_the_target_distribution(eagle_pair, monkeypatch, tmp_path):
    """A datastore of the target's own text (rest's) gives EAGLE's trees a chain where the text has no match: some of
    its nodes are verified and accepted, greedy output stays the target's, and sampling keeps the target's law."""
    import json
    from specrt.decoding import datastore as ds
    gen, model, _ = eagle_pair
    shaped(gen, top_k=2, depth=3, nodes=6)
    rows = [{"ids": gen.generate(prompt_ids=[s, (3 * s) % V], max_new_tokens=30, temperature=1.0, seed=s,
                                 method="autoregressive").token_ids[0]} for s in range(V)]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds.build([tmp_path / "corpus.jsonl"], gen.directory, tmp_path / "store", progress=False)
    monkeypatch.setattr(gen, "datastore", None)
    gen.use_datastore(tmp_path / "store")
    monkeypatch.setattr(eagle.PromptLookup, "max_n", 0)   # no match in the text: every chain is the datastore's
    added = count_lookup_nodes(monkeypatch)
    prompts = [[5, 1, 7, 2], [11, 3, 9, 4]]
    for p in prompts:
        ref = gen.generate(prompt_ids=p, max_new_tokens=20, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=p, max_new_tokens=20, method="eagle", adaptive=False)
        assert_same_or_tie(out.token_ids[0], ref, p, model)
    assert added[0] > 0 and added[1] > 0
    out = sample_first3(gen, [5, 1, 7], "eagle", None, seed=5, temperature=1.0)
    p = chi_square_p(out.token_ids, exact_joint(model, [5, 1, 7], SamplingParams(temperature=1.0)))
    print(f"eagle with datastore chains: chi-square p = {p:.4f}, {added[0]} chain nodes, {added[1]} accepted")
    assert p > P_MIN


def test_lookup_chain_follows_the_candidates():
    """The chain walks the drafter's candidates while its tokens are there (raising their scores to its own where
    higher), then adds nodes as the last siblings; a row without a match adds nothing, and the other rows get a
    filler token of probability 0 at the nodes a row added."""
    from types import SimpleNamespace
    text = np.array([[1, 2, 3, 4, 9, 1, 7, 1, 2], [5, 6, 5, 7, 5, 6, 5, 6, 5]])
    run = SimpleNamespace(host_tokens=text, host_lengths=np.array([9, 4]))   # row 1's text: 5 6 5 7, no match
    paths = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 1, 0)]
    tokens = np.array([[3, 5, 7, 4, 3, 8]] * 2)
    scores = np.log(np.array([[0.6, 0.3, 0.3, 0.05, 0.2, 0.04]] * 2, np.float32))
    lookup = eagle.PromptLookup()
    new_tok, new_score = lookup.add(run, paths, tokens, scores, np.array([True, True]), 4, 8)
    # row 0: "1 2" occurred at the start, followed by 3 4 9 1: along (0,) and (0, 1), then new nodes
    assert paths[6:] == [(0, 1, 1), (0, 1, 1, 0)]
    assert new_tok.tolist() == [[9, 1], [eagle.PromptLookup.FILLER] * 2]
    half = np.log(0.5)   # the rate before any round
    assert scores[0, 0] == pytest.approx(np.log(0.6)) and scores[0, 3] == pytest.approx(np.log(0.6) + half)
    assert new_score[0] == pytest.approx(np.log(0.6) + half * np.array([2, 3]))
    assert np.isneginf(new_score[1]).all() and scores[1, 3] == pytest.approx(np.log(0.05))
    # the verified tree kept the chain's first three nodes; the target accepted two of them
    from specrt.decoding.tree import Tree
    tree = Tree.from_paths([(0,), (1,), (0, 1), (0, 1, 1)])
    lookup.offered(tree)
    lookup.update([[0, 1, 3, 4]], [2])
    assert lookup.rate(2) == pytest.approx((eagle.DECAY + 2) / (2 * eagle.DECAY + 3))


def test_lookup_chain_replaces_the_drafters_where_it_promises_more():
    """Chains only (targets with int8 activations): a row's lookup chain takes the place of the drafter's chain
    where its expected accepted length is larger, its nodes past the chain a filler of probability 0; the chain
    may run deeper than the drafter's (the other rows' nodes there are fillers); else the row keeps the drafter's."""
    from types import SimpleNamespace
    text = np.array([[1, 2, 3, 4, 9, 1, 7, 1, 2], [5, 6, 1, 5, 6, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0, 0, 0]])
    run = SimpleNamespace(host_tokens=text, host_lengths=np.array([9, 5, 2]))   # row 2: no match
    paths = [(0,), (0, 0)]
    tokens = np.array([[3, 5], [7, 8], [4, 4]])
    scores = np.log(np.array([[0.1, 0.05], [0.95, 0.9], [0.1, 0.05]], np.float32))
    lookup = eagle.PromptLookup()
    lookup.sums[2] = [3.0, 4.0]   # chains of 2-token matches: 3/4 accepted so far
    new_tok, new_score = lookup.replace(run, paths, tokens, scores, np.array([True, True, True]), 3, 1.0)
    # row 0: "1 2" occurred at the start, followed by 3 4 9: 0.75 + 0.56 + 0.42 beats 0.1 + 0.05
    assert paths == [(0,), (0, 0), (0, 0, 0)]
    assert tokens[0].tolist() + new_tok[0].tolist() == [3, 4, 9]
    assert scores[0].tolist() + new_score[0].tolist() == pytest.approx(np.log(0.75) * np.arange(1, 4))
    # row 1: "5 6" was followed by 1 5 6 (0.75 + 0.56 + 0.42 = 1.73), but the drafter promises 0.95 + 0.9 at scale 1
    assert tokens[1].tolist() == [7, 8] and scores[1].tolist() == pytest.approx(np.log([0.95, 0.9]))
    assert new_tok[1:, 0].tolist() == [eagle.PromptLookup.FILLER] * 2 and np.isneginf(new_score[1:]).all()
    assert list(lookup._chains) == [0]
    # at a scale that says the drafter's probabilities overstate its acceptance, row 1 takes its chain too
    paths = [(0,), (0, 0)]
    lookup.replace(run, paths, tokens, scores, np.array([True, True, True]), 2, 0.5)
    assert tokens[1].tolist() == [1, 5] and list(lookup._chains) == [0, 1]


def test_broken_sibling_rule_is_caught(eagle_pair, monkeypatch):
    """Power: a rejected sibling left in the residual must fail the same test."""
    gen, model, _ = eagle_pair
    shaped(gen, top_k=3, depth=3, nodes=8)
    monkeypatch.setattr(verification, "without", lambda R, rows, x: R)
    monkeypatch.setattr(verification, "without_host", lambda R, x: R)
    prompt = [5, 1, 7]
    out = sample_first3(gen, prompt, "eagle", None, seed=99, temperature=1.0)
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(temperature=1.0)))
    print(f"broken sibling rule (eagle): chi-square p = {p:.2e}")
    assert p < P_MIN


def test_int8_engine_keeps_greedy_output(tmp_path):
    model = tiny_model("qwen2", seed=4)
    gen = Generator.from_engines(export_with_eagle(tmp_path, model, drafter_weights="int8"))
    assert gen.manifest["models"]["eagle"]["engine"]["weights"] == "int8"
    ref = gen.generate(prompt_ids=[1, 2, 3, 4], max_new_tokens=12, method="autoregressive").token_ids[0]
    out = gen.generate(prompt_ids=[1, 2, 3, 4], max_new_tokens=12, method="eagle")
    assert_same_or_tie(out.token_ids[0], ref, [1, 2, 3, 4], model)


def test_drafter_with_kept_ids_outputs_only_theirs(tmp_path):
    """A drafter that keeps a subset of the vocabulary: its engine outputs the kept ids' logits only (the
    manifest records the ids), equal to the eager model's there; the top-k maps the columns back to token ids, and
    the target's greedy output is kept."""
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    model = tiny_model("llama", seed=6, vocab=V, init=0.3)
    model.save_pretrained(tmp_path / "src")
    target, kept = from_hf(model, MAX_LEN), list(range(1, V, 2))
    save_eagle(new_eagle(target, kept, seed=3), tmp_path / "eagle", dtype=torch.float32)
    export_engines(str(tmp_path / "src"), tmp_path / "engines", max_seq_len=MAX_LEN, log=lambda *_: None,
                   eagle=str(tmp_path / "eagle"))
    build(tmp_path / "engines", "onnxruntime", log=lambda *_: None, drafter_weights="float32")
    gen = Generator.from_engines(tmp_path / "engines")
    assert gen.manifest["models"]["eagle"]["output_ids"]["count"] == len(kept) and gen.eagle_ids.tolist() == kept
    eager = load_eagle(tmp_path / "eagle", target)
    g = torch.Generator().manual_seed(1)
    feats, ids = torch.randn(1, 5, target.args.hidden_size, generator=g), torch.randint(0, V, (1, 5), generator=g)
    cache = gen.eagle.new_cache(1, MAX_LEN)
    out = gen.eagle.forward(ids, torch.arange(5)[None], cache.past_len, chain_mask(1, 5), 5, cache, features=feats)
    with torch.no_grad():
        full = eager.logits(eager.train_forward(feats, ids))                        # (1, 5, V), -inf elsewhere
    assert out.logits.shape[-1] == len(kept) and torch.allclose(out.logits, full[..., kept], atol=1e-4)
    for k in (3, 9):                                                 # the host's numpy top-k, torch's past 8
        want_lp, want_ids = torch.log_softmax(full, -1).topk(k, -1)
        lp, top = EagleDrafter(None, None, DynamicTree(k, 3, 9), output_ids=gen.eagle_ids)._top(out.logits.clone())
        assert top.tolist() == want_ids.tolist() and np.allclose(lp, want_lp.numpy(), atol=1e-4)
    prompt = [1, 2, 3, 4, 5]
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=20, method="autoregressive").token_ids[0]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=20, method="eagle", adaptive=False)
    assert_same_or_tie(out.token_ids[0], ref, prompt, model)


def test_two_layer_drafter(tmp_path):
    """A drafter of two layers: its engine (two caches) equals its eager model and keeps the target's greedy
    output; grown from a one-layer drafter, it starts with that drafter's outputs (the added layer a no-op)."""
    model = tiny_model("llama", seed=5, vocab=V, init=0.3)
    gen = Generator.from_engines(export_with_eagle(tmp_path, model, layers=2))
    assert gen.eagle.spec["layers"] == 2
    target = from_hf(model, MAX_LEN)
    two = load_eagle(tmp_path / "eagle", target)
    assert len(two.layers) == 2
    assert_graph_matches_eager(gen, two)
    for seed in range(2):
        prompt = torch.randint(0, V, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="eagle", adaptive=False)
        assert_same_or_tie(out.token_ids[0], ref, prompt, model)
    one = new_eagle(target, seed=7)
    two.grow_from(one)
    feats, ids = torch.randn(1, 9, target.args.hidden_size), torch.randint(0, V, (1, 9))
    with torch.no_grad():
        assert torch.equal(two.train_forward(feats, ids), one.train_forward(feats, ids))


def test_loads_checkpoints_named_before_layers(eagle_pair, tmp_path):
    """A one-layer checkpoint saved before the drafter could have several layers (`layer.*`) loads the same."""
    import shutil

    from safetensors.torch import load_file, save_file
    _, model, tmp = eagle_pair
    saved = load_file(str(tmp / "eagle" / "eagle.safetensors"))
    old = {k.replace("layers.0.", "layer.", 1): v for k, v in saved.items()}
    save_file(old, str(tmp_path / "eagle.safetensors"))
    shutil.copy(tmp / "eagle" / "eagle_config.json", tmp_path)
    target = from_hf(model, MAX_LEN)
    now, before = load_eagle(tmp / "eagle", target).state_dict(), load_eagle(tmp_path, target).state_dict()
    assert now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in now)


def test_bad_inputs(eagle_pair, tmp_path):
    gen, model, tmp = eagle_pair
    with pytest.raises(InputError, match="depth <= nodes"):
        DynamicTree(top_k=2, depth=5, nodes=3)
    with pytest.raises(InputError, match="eagle_config.json"):
        load_eagle(tmp_path, from_hf(model, MAX_LEN))
    other = tiny_model("llama", seed=1, vocab=V, hidden=64)
    with pytest.raises(InputError, match="hidden_size 32 vs 64"):
        load_eagle(tmp / "eagle", from_hf(other, MAX_LEN))
    no_eagle = Generator(gen.directory, gen.manifest, gen.target, None, None)
    with pytest.raises(InputError, match="export with --eagle"):
        no_eagle.generate(prompt_ids=[1, 2], method="eagle")


def test_tune_records_a_shape(eagle_pair):
    from specrt.decoding.eagle import save_shape, tune
    gen, _, _ = eagle_pair
    shapes = (DynamicTree(2, 3, 4), DynamicTree(3, 3, 8))
    lines = []
    shape = tune(gen, [[1, 2, 3], [4, 5, 6, 7]], shapes, new_tokens=8, log=lines.append)
    assert shape in shapes and len(lines) == 2 and "tokens/round" in lines[0]
    save_shape(gen.directory, shape)
    again = Generator.from_engines(gen.directory)
    assert again.eagle.spec["dynamic_tree"] == shape.__dict__
    assert again.generate(prompt_ids=[1, 2, 3], max_new_tokens=6, method="eagle").stats["tree_size"] == shape.nodes


def test_host_top_k_matches_torch():
    """The drafter's top-k log-probabilities in numpy over its kept ids (the rest −inf) equal torch's."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 500, generator=g) * 3
    kept = torch.randperm(500, generator=g)[:120].sort().values
    logits[..., [i for i in range(500) if i not in set(kept.tolist())]] = -torch.inf
    want_lp, want_ids = torch.log_softmax(logits, -1).topk(4, -1)
    drafter = EagleDrafter(None, None, DynamicTree(4, 3, 8))
    lp, ids = drafter._top(logits.clone())
    assert drafter.kept.tolist() == kept.tolist()
    assert ids.tolist() == want_ids.tolist() and np.allclose(lp, want_lp.numpy(), atol=1e-5)
    full = torch.randn(1, 1, 300, generator=g)
    lp, ids = EagleDrafter(None, None, DynamicTree(3, 3, 8))._top(full.clone())
    want_lp, want_ids = torch.log_softmax(full, -1).topk(3, -1)
    assert ids.tolist() == want_ids.tolist() and np.allclose(lp, want_lp.numpy(), atol=1e-5)


def test_tree_size_follows_the_costs():
    """A round verifies the node count with the most expected tokens per second: every node where passes cost
    the same, the single best where each node costs a plain step; another level grows only while its best case
    pays for its drafter pass."""
    from specrt.decoding.adaptive import Costs
    from specrt.decoding.eagle import _best_size
    flat, steep = Costs(0.0, {1: 1.0, 17: 1.0}), Costs(0.0, {1: 1.0, 17: 17.0})
    probs = np.array([0.9, 0.5, 0.3, 0.1, 0.05])
    assert _best_size(flat, probs, 0.1) == 5 and _best_size(steep, probs, 0.1) == 1
    middle = Costs(0.0, {1: 1.0, 17: 2.6})   # 0.1 a node: nodes more probable than about a tenth pay
    assert _best_size(middle, probs, 0.0) == 3
    drafter = EagleDrafter(None, None, DynamicTree(2, 4, 8))
    scores = np.log([[0.8, 0.1]])
    cheap, dear = Costs(0.01, flat.verify), Costs(0.1, flat.verify)   # a drafter pass: 1 % or 10 % of a step
    assert drafter._deeper(cheap, scores, np.log([[0.7, 0.2]]), passes=1)
    assert not drafter._deeper(dear, scores, np.log([[0.01, 0.005]]), passes=1)
    assert drafter._deeper(dear, scores, np.log([[0.3, 0.2]]), passes=3)


@pytest.mark.parametrize("costs", ["flat", "steep"])
def test_sized_trees_keep_the_target_output(eagle_pair, monkeypatch, costs):
    """Trees sized round by round (adaptive) give the target's greedy tokens, and at T = 1 its distribution;
    the sizes really vary (and with free nodes the depths: the random drafter's guesses are rarely worth a
    second level)."""
    from specrt.decoding.adaptive import Costs
    gen, model, _ = eagle_pair
    shaped(gen, top_k=3, depth=4, nodes=10)
    verify = {1: 1.0, 11: 1.0 if costs == "flat" else 1.5}
    monkeypatch.setattr(Generator, "eagle_costs", lambda self, batch, shape: Costs(0.02, verify))
    monkeypatch.setattr(TreePolicy, "choose", lambda self: True)    # trees every round, whatever they gain
    monkeypatch.setattr(Batch, "_tree_pays", lambda self, n: True)  # at any batch size
    shapes = []
    tree_of = eagle.tree_of
    monkeypatch.setattr(eagle, "tree_of", lambda paths: (shapes.append(paths), tree_of(paths))[1])
    for seed in range(3):
        prompt = torch.randint(0, V, (4 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="eagle")
        assert_same_or_tie(out.token_ids[0], ref, prompt, model)
    sizes, depths = {len(p) for p in shapes}, {max(map(len, p)) for p in shapes}
    print(costs, "sizes", sorted(sizes), "depths", sorted(depths))
    assert len(sizes) > 1 and (len(depths) > 1 or costs == "steep")
    prompt, shapes[:] = [5, 1, 7], []
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=N, method="eagle", seed=7,
                       temperature=1.0, seeding="stream")
    print(costs, "T = 1 trees", [(len(p), max(map(len, p))) for p in shapes])
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(temperature=1.0)))
    print(f"eagle sized trees ({costs}): chi-square p = {p:.4f}")
    assert p > P_MIN


def test_bench_reports_the_drafter_cost(eagle_pair, tmp_path):
    """The bench's eagle rows carry c, the drafter's pass over a tree level against the target's step."""
    import json

    from click.testing import CliRunner

    from specrt.measurement.bench import bench
    gen, _, tmp = eagle_pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [1, 2, 3, 1, 2]}) + "\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(bench, [str(gen.directory), "--prompts", str(prompts), "--methods", "eagle",
                                        "--temperatures", "0", "--max-new-tokens", "6", "--num-prompts", "1",
                                        "--gamma-sweep", "", "--no-peers", "--no-memory", "--no-llamacpp",
                                        "--out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    r = json.loads((out / "results.json").read_text())
    row = next(s for s in r["summary"] if s["method"] == "eagle")
    level, one = r["info"]["costs"]["eagle_level_s"], r["info"]["costs"]["verify_s"]["1"]
    assert level > 0 and row["c"] == pytest.approx(level / one)


def test_device_path_reads_nothing_back(eagle_pair, monkeypatch):
    """The rounds a GPU runs (here sampling with top-p, which takes the same device path on the CPU): the drafter's
    catch-up, prompt lookup's bookkeeping and the tree's recursive rejection read no tensor back to the host
    (the round's one read excepted; a pass shape comes from the host's copies), and the host's copy of the
    drafter's cache lengths follows the cache through joins, a row's move and the rounds."""
    from host_reads import counted
    gen, _, _ = eagle_pair
    shaped(gen, top_k=2, depth=3, nodes=6)
    monkeypatch.setattr(eagle.PromptLookup, "min_n", 1)            # lookup chains in most rounds
    lookups = count_lookup_nodes(monkeypatch)
    reads, calls = [], []
    for owner, name in ((EagleDrafter, "_catch_up"), (eagle.PromptLookup, "update"), (verification, "tree_sampled")):
        monkeypatch.setattr(owner, name, counted(name, getattr(owner, name), reads, calls))
    batch = gen.batch(2, method="eagle", adaptive=False, temperature=0.9, top_p=0.95, seed=1,
                      seeding="stream")
    batch.add([5, 2, 8], 3, owner="first")
    batch.add([3, 9, 1, 4, 1, 3, 9, 1], 14, owner="second")
    moved = False
    while batch.run.batch:
        batch.step()
        moved |= bool(batch.retire()) and batch.run.batch == 1
        drafter, B = batch.drafter, batch.run.batch
        assert drafter._past[:B].tolist() == drafter.pool.past_len[:B].tolist()
    assert moved and lookups[0] > 0
    assert {"_catch_up", "update", "tree_sampled"} <= set(calls) and not reads, reads
