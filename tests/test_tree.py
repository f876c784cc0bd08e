"""Tree speculation: the tree as data, Medusa heads and draft trees verified losslessly."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import export_tiny, export_tiny_with_heads, tiny_model
from greedy_check import assert_same_or_tie
from specrt.decoding import verification
from specrt.decoding.adaptive import TreePolicy
from specrt.decoding.calibrate import calibrate, choose_tree, rank_accuracy, save_tree
from specrt.decoding.drafters import MedusaDrafter
from specrt.errors import InputError
from specrt.export.medusa import MedusaHeads, load_heads, save_heads
from specrt.export.model import from_hf
from specrt.decoding.generate import Generator
from specrt.decoding.sampling import SamplingParams
from specrt.decoding.tree import Tree
from test_speculative import N, P_MIN, V, chi_square_p, exact_joint

# siblings at depths 1, 2 and 3
PATHS = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]


@pytest.fixture(scope="module")
def medusa_set(tmp_path_factory):
    directory, model = export_tiny_with_heads(tmp_path_factory.mktemp("medusa"), V, num_heads=4, max_seq_len=48)
    return Generator.from_engines(directory), model


KINDS = {"sequential": dict(root_token=True, sequential=True), "root-token": dict(root_token=True),
         "hidden-only": dict(root_token=False)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_medusa_heads_engine(tmp_path, kind):
    """The heads' engine computes what the heads compute; root-token heads read the root, sequential heads the
    path below it too."""
    target = tiny_model("llama", seed=1, vocab=V, init=0.3)
    torch.manual_seed(5)
    d, kw = target.config.hidden_size, KINDS[kind]
    heads = MedusaHeads(3, d, target.lm_head.weight, target.model.embed_tokens.weight if kw["root_token"] else None,
                        kw.get("sequential", False))
    save_heads(heads, tmp_path / "heads")
    kept = sorted(torch.randperm(V, generator=torch.Generator().manual_seed(0))[:V // 2].tolist())
    (tmp_path / "heads" / "specrt_vocab.json").write_text(json.dumps({"kept_ids": kept}))   # the ids they propose
    (tmp_path / "heads" / "tree.json").write_text(json.dumps({"paths": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]}))
    with pytest.raises(InputError, match="tree.json has depth 4, the heads are 3"):
        export_tiny(tmp_path, "llama", seed=1, vocab=V, init=0.3, max_seq_len=48, medusa=tmp_path / "heads")
    Tree.from_paths(PATHS).save(tmp_path / "heads" / "tree.json")   # the heads' own tree: the engines' default
    directory, model = export_tiny(tmp_path, "llama", seed=1, vocab=V, init=0.3, max_seq_len=48,
                                   medusa=tmp_path / "heads")
    gen = Generator.from_engines(directory)
    assert gen.medusa.root_token == kw["root_token"] and gen.medusa.num_heads == 3
    assert gen.medusa.sequential == kw.get("sequential", False)
    assert gen.tree_for("medusa").paths == Tree.from_paths(PATHS).paths
    hidden, tokens = torch.randn(6, d), torch.tensor([[0, 1, 2], [3, 1, 2], [7, 4, 4], [7, 4, 4], [5, 1, 2],
                                                      [7, 4, 9]])
    hidden[3], hidden[4], hidden[5] = hidden[2], hidden[1], hidden[2]
    got = gen.medusa.forward(hidden, tokens)                                            # (6, 3, V), int8 weights
    with torch.no_grad():
        want = load_heads(tmp_path / "heads", from_hf(model, 48))(hidden, tokens)
    assert got.shape == want.shape == (6, 3, V)
    dropped = torch.ones(V, dtype=torch.bool)
    dropped[kept] = False
    assert torch.isneginf(got[..., dropped]).all() and torch.isfinite(got[..., kept]).all()
    assert torch.equal(torch.isneginf(want), torch.isneginf(got))
    got, want = got[..., kept], want[..., kept]
    assert torch.corrcoef(torch.stack([got.flatten(), want.flatten()]))[0, 1] > 0.99
    assert torch.equal(got[2], got[3])
    assert torch.equal(got[1], got[4]) != kw["root_token"]                      # only the root differs
    assert torch.equal(got[2, :2], got[5, :2]) and torch.equal(got[2, 2], got[5, 2]) != kw.get("sequential", False)
    ref = gen.generate(prompt_ids=[2, 4, 6], max_new_tokens=20, method="autoregressive").token_ids[0]
    out = gen.generate(prompt_ids=[2, 4, 6], max_new_tokens=20, method="medusa")
    assert_same_or_tie(out.token_ids[0], ref, [2, 4, 6], model)
    run = SimpleNamespace(batch=6, hidden=hidden, last_tokens=lambda: tokens[:, 0],
                          host_last_tokens=lambda: tokens[:, 0].tolist())
    proposed = MedusaDrafter(gen.medusa, gen.tree_for("medusa")).propose(run, 3).tokens
    assert set(proposed.flatten().tolist()) <= set(kept)


def test_sequential_heads_fill_each_node_from_its_own_path():
    """Below each node, the sequential heads' top-k on that node's path (root, then its ancestors' tokens)."""
    torch.manual_seed(3)
    d, K = 16, 3
    heads = MedusaHeads(K, d, torch.randn(V, d), torch.randn(V, d), sequential=True).eval()
    tree = Tree.from_paths(PATHS)
    run = SimpleNamespace(batch=2, hidden=torch.randn(2, d), last_tokens=lambda: torch.tensor([4, 9]))
    with torch.no_grad():
        nodes = MedusaDrafter(heads, tree).propose(run, tree.max_depth).tokens                # (2, N)
        for b in range(2):
            tokens = [int(run.last_tokens()[b])] + nodes[b].tolist()                    # node id -> token
            for node in range(1, tree.size):
                parent, path = tree.parent[node], []
                while parent >= 0:
                    path.insert(0, tokens[parent])
                    parent = tree.parent[parent]
                depth = len(path) - 1
                logits = heads(run.hidden[b:b + 1], torch.tensor([path + [0] * (K - len(path))]))[0, depth]
                assert tokens[node] == int(logits.topk(tree.max_rank).indices[int(tree.rank[node])]), node


def test_tree_from_paths():
    tree = Tree.from_paths(PATHS)
    assert tree.size == 9 and tree.max_depth == 3 and tree.max_rank == 3
    assert tree.parent == (-1, 0, 0, 0, 1, 1, 2, 4, 4)
    assert tree.mask[7].tolist() == [True, True, False, False, True, False, False, True, False]
    assert tree.children[0] == (1, 2, 3)
    with pytest.raises(InputError, match=r"no parent path \[1\]"):
        Tree.from_paths([(0,), (1, 0)])


def test_node_tokens_follow_depth_and_rank():
    tree = Tree.from_paths(PATHS)
    cand = torch.arange(3 * 3).view(1, 3, 3)  # depth d rank r -> 3d + r
    assert tree.node_tokens(cand)[0].tolist() == [0, 1, 2, 3, 4, 3, 6, 7]


@pytest.mark.parametrize("kw", [dict(method="medusa"), dict(method="medusa", tree_choices="FILE"),
                                dict(method="draft", tree=True), dict(method="draft", tree=True, gamma=3)])
def test_tree_greedy_equals_target_greedy(medusa_set, tmp_path, kw):
    gen, model = medusa_set
    if kw.get("tree_choices") == "FILE":
        (tmp_path / "t.json").write_text(json.dumps([list(p) for p in PATHS]))
        kw = dict(kw, tree_choices=tmp_path / "t.json")
    for seed in range(3):
        prompt = torch.randint(0, V, (3 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=30, adaptive=False, **kw)
        assert out.stats["tree_size"] >= 1
        assert_same_or_tie(out.token_ids[0], ref, prompt, model)


@pytest.mark.parametrize("kw", [dict(method="medusa"), dict(method="draft", tree=True)], ids=str)
def test_plain_steps_between_tree_rounds_keep_greedy_output(medusa_set, monkeypatch, kw):
    """The tree policy's fallback: plain steps (on a fixed pattern here) between tree rounds change nothing."""
    gen, model = medusa_set
    rounds = iter(range(1000))
    monkeypatch.setattr(TreePolicy, "choose", lambda self: next(rounds) % 3 == 1)
    prompt = [4, 1, 4, 1, 4]
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="autoregressive").token_ids[0]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=30, **kw)
    assert out.stats["plain_rounds"] >= 2 * out.stats["tree_rounds"] - 1 and out.stats["tree_rounds"] >= 3
    assert_same_or_tie(out.token_ids[0], ref, prompt, model)


def test_tree_policy_falls_back_when_trees_do_not_pay_and_keeps_probing():
    policy = TreePolicy(warmup=3, probe_every=8)
    picks = []
    for _ in range(60):
        tree = policy.choose()
        picks.append(tree)
        # a tree round: 1.2 tokens in 2 ms; a plain step: 1 token in 1 ms
        policy.update(tree, 1.2 if tree else 1.0, 0.002 if tree else 0.001)
    assert picks[:4] == [True] * 4 and picks[4] is False          # warm-up trees, then one timed plain step
    # then plain steps, with probes after 8, 15 and 31 of them: a probe that does not pay doubles the wait
    assert [i for i in range(5, 60) if picks[i]] == [12, 27, 58]
    for _ in range(30):                                            # the text turns predictable: 3 tokens a tree
        policy.update(True, 3.0, 0.002)
    assert policy.choose()


def test_tree_policy_starts_a_request_from_the_last_ones_figures():
    def run(policy, tree_tokens, rounds):   # trees: `tree_tokens` in 2 ms; plain steps: 1 token in 1 ms
        picks = []
        for _ in range(rounds):
            picks.append(policy.choose())
            policy.update(picks[-1], tree_tokens if picks[-1] else 1.0, 0.002 if picks[-1] else 0.001)
        return picks

    paid, lost = TreePolicy(), TreePolicy()
    run(paid, 3.0, 40)
    run(lost, 1.2, 40)
    nxt = paid.following()
    assert nxt.tree_rounds == nxt.plain_rounds == 0                                 # the request's own counts
    assert all(w <= nxt.memory for _, w in nxt.sums.values())                       # worth at most `memory` rounds
    assert nxt.mean("tokens") == pytest.approx(paid.mean("tokens"))
    # the next answer's warm-up rounds give one token each: judged with what came before, trees go on; alone,
    # the same rounds send the request to plain steps
    assert run(nxt, 1.0, 6) == [True] * 4 + [False, True]
    assert run(TreePolicy(), 1.0, 6) == [True] * 4 + [False, False]
    # after a request where trees lost, the next one still warms up, and its own good rounds soon outweigh the past
    assert run(lost.following(), 3.0, 6) == [True] * 4 + [False, True]


def test_automatic_tree_is_saved_and_used(medusa_set):
    gen, model = medusa_set
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9, 9, 2]]
    for method in ("medusa", "draft"):
        tree = calibrate(gen, method, prompts, max_nodes=16, width=3, log=lambda *_: None)
        save_tree(gen.directory, method, tree)
        fresh = Generator.from_engines(gen.directory)   # the manifest now lists the tree with its hash
        assert fresh.tree_for(method).paths == tree.paths
        ref = fresh.generate(prompt_ids=[2, 4, 6], max_new_tokens=24, method="autoregressive").token_ids[0]
        out = fresh.generate(prompt_ids=[2, 4, 6], max_new_tokens=24, method=method, tree=True)
        assert out.stats["tree_size"] == tree.size - 1
        assert_same_or_tie(out.token_ids[0], ref, [2, 4, 6], model)


def test_choose_tree_trades_acceptance_for_cost():
    acc = np.array([[0.8, 0.1], [0.8, 0.1], [0.8, 0.1]])
    assert choose_tree(acc, lambda n: 1.0, max_nodes=6, chain_only=False).size == 7   # free nodes: all of them
    steep = lambda n: 1.0 + 0.7 * (n - 1)  # noqa: E731
    assert [tuple(p) for p in choose_tree(acc, steep, max_nodes=6, chain_only=False).paths] == [(0,)]
    # a per-round cost that does not grow with the tree (drafting) makes more nodes worth their price
    assert choose_tree(acc, steep, max_nodes=6, chain_only=True, fixed_cost=10.0).size == 4
    # sequential heads pay a pass per level: a dear one keeps the tree shallow even when nodes are free
    assert choose_tree(acc, lambda n: 1.0, max_nodes=6, chain_only=False, level_cost=10.0).max_depth == 1


def test_draft_accuracy_by_depth(tmp_path):
    """A draft equal to the target proposes the target's greedy token at every depth of an accepted path."""
    same = tiny_model("llama", seed=1, vocab=V, init=0.3)
    directory, _ = export_tiny(tmp_path, "llama", seed=1, draft=same, vocab=V, init=0.3, max_seq_len=48)
    acc = rank_accuracy(Generator.from_engines(directory), "draft", [[1, 2, 3], [4, 5, 6, 7]], depth=4, width=2)
    assert (acc[:, 0] > 0.95).all(), acc


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=6)],
                         ids=["t1", "t0.7-topk"])
def test_medusa_distribution_is_the_target_distribution(medusa_set, kw):
    gen, model = medusa_set
    prompt = [5, 1, 7]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=N, method="medusa",
                       tree_choices=Tree.from_paths(PATHS), seed=2024, adaptive=False, seeding="stream", **kw)
    assert out.stats["acceptance_rate"] > 0.05  # siblings were accepted and rejected
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(**kw)))
    print(f"medusa {kw}: chi-square p = {p:.4f}")
    assert p > P_MIN


# top_k = V keeps the law of T = 1 but takes the torch rules (the CPU loop's host rules need top-k off)
@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=1.0, top_k=V)], ids=["host", "torch"])
def test_broken_sibling_rule_is_caught(medusa_set, monkeypatch, kw):
    """Power: not removing a rejected sibling from the residual must fail the same test."""
    gen, model = medusa_set
    monkeypatch.setattr(verification, "without", lambda R, rows, x: R)
    monkeypatch.setattr(verification, "without_host", lambda R, x: R)
    prompt = [5, 1, 7]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=N, method="medusa",
                       tree_choices=Tree.from_paths(PATHS), seed=2024, adaptive=False, seeding="stream", **kw)
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(**kw)))
    print(f"broken sibling rule ({kw}): chi-square p = {p:.2e}")
    assert p < P_MIN
