"""Speculative decoding keeps the target's promise: greedy token-identical, sampled distribution identical."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import export_tiny, tiny_model
from greedy_check import assert_same_or_tie
from specrt.decoding import verification
from specrt.decoding.adaptive import Costs, GammaPolicy
from specrt.decoding.generate import Generator
from specrt.decoding.sampling import (SamplingParams, argmax, draw_host, probs, sample, softmax_host, top_k_ids,
                             top_k_in_place)
from specrt.decoding.tree import Tree
from specrt.errors import InputError

V = 24          # small enough to compute the exact joint distribution of the first 3 tokens
N = 20000       # samples per test: enough to catch a 2% error
P_MIN = 1e-3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target and a different tiny draft (most drafts rejected), peaked enough to give power."""
    draft = tiny_model("llama", seed=11, vocab=V, init=0.3)
    directory, target = export_tiny(tmp_path_factory.mktemp("pair"), "llama", seed=1, draft=draft, vocab=V,
                                    init=0.3, max_seq_len=24)
    return Generator.from_engines(directory), target


@pytest.fixture(scope="module")
def self_pair(tmp_path_factory):
    """Draft = target: every draft is accepted, so the bonus-token path runs every round."""
    target = tiny_model("qwen2", seed=2)
    directory, _ = export_tiny(tmp_path_factory.mktemp("self"), "qwen2", seed=2, draft=target)
    return Generator.from_engines(directory), target


# ---- greedy ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", range(1, 9))
def test_greedy_draft_equals_target_greedy(pair, self_pair, gamma):
    for gen, model in (pair, self_pair):
        vocab = model.config.vocab_size
        for seed in range(3):
            prompt = torch.randint(0, vocab, (4 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
            ref = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="autoregressive").token_ids[0]
            out = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="draft", gamma=gamma)
            assert_same_or_tie(out.token_ids[0], ref, prompt, model)
            assert out.stats["gamma"] == gamma


def test_self_draft_accepts_everything(self_pair):
    gen, _ = self_pair
    out = gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=21, method="draft", gamma=4)  # 1 + 4 rounds of 5
    assert out.stats["acceptance_rate"] == 1.0
    assert out.stats["mean_tokens_per_round"] == 5.0


def test_weak_draft_is_mostly_rejected_and_adaptive_gamma_reports(pair):
    gen, _ = pair
    out = gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=16, method="draft")
    s = out.stats
    assert s["acceptance_rate"] < 0.5
    assert 0 <= s["gamma"] <= 8 and s["cost_ratio_c"] > 0 and s["predicted_speedup"] > 0
    assert len(s["acceptance_per_position"]) >= 1


def test_draft_catches_up_after_plain_rounds(self_pair, monkeypatch):
    """Rounds where the policy picks γ = 0 are plain target steps the draft does not see; with draft = target,
    any gap in the draft's cache after them would show as a rejection."""
    gen, _ = self_pair
    choices = iter([0, 2, 0, 0, 3, 1, 0, 4] * 10)
    monkeypatch.setattr(GammaPolicy, "choose", lambda self: next(choices))
    ref = gen.generate(prompt_ids=[5, 1, 7], max_new_tokens=24, method="autoregressive").token_ids[0]
    out = gen.generate(prompt_ids=[5, 1, 7], max_new_tokens=24, method="draft")
    assert out.token_ids[0] == ref
    assert out.stats["acceptance_rate"] == 1.0


def test_policy_prefers_plain_steps_when_drafts_fail_and_keeps_probing():
    costs = Costs(draft_step=0.1, verify={k: 1.0 + 0.05 * k for k in range(1, 10)})
    policy = GammaPolicy(costs, max_gamma=8)
    assert policy.choose() >= 1                                   # the prior expects drafts to pay
    policy.update(0, 40)                                          # then nothing is accepted
    picks = [policy.choose() for _ in range(8 + 16 + 32 + 64 + 64)]
    # γ = 1 probes after 8 plain rounds, then 16, 32 and at most 64 while they do not pay
    assert [i for i, g in enumerate(picks) if g] == [7, 7 + 16, 7 + 16 + 32, 7 + 16 + 32 + 64, 7 + 16 + 32 + 64 * 2]
    policy.update(200, 200)                                       # the text turns predictable
    assert policy.choose() >= 3


def test_next_request_expects_the_acceptance_the_last_one_measured(pair):
    """A weak draft's low acceptance becomes the next request's starting estimate (not the optimistic prior), so
    that it does not speculate at a loss again while it relearns."""
    gen, _ = pair
    first = gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=16, method="draft").stats
    measured = gen._gamma_policies[("draft", True)].alpha
    assert first["acceptance_rate"] < 0.5 and measured < GammaPolicy.prior_alpha
    batch = gen.batch(1, method="draft")
    assert batch.policy.alpha == pytest.approx(measured)


def test_prompt_lookup_is_not_charged_the_draft_models_step(pair):
    """Adaptive γ weighs a round's tokens against its cost: the draft model's rounds pay its steps, prompt
    lookup's (a host search) none, at every batch size; both pay the same target passes."""
    gen, _ = pair
    draft, ngram = gen.batch(2, method="draft"), gen.batch(2, method="ngram")
    assert draft.policy.costs.draft_step == gen.costs().draft_step > 0
    assert ngram.policy.costs.draft_step == 0 and ngram.policy.costs.verify == gen.costs().verify
    assert ngram._chain_costs(2).draft_step == 0 < draft._chain_costs(2).draft_step == gen.costs(2).draft_step
    stats = gen.generate(prompt_ids=[1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=8, method="ngram").stats
    assert stats["cost_ratio_c"] == 0.0

def test_ngram_greedy_equals_target_greedy(pair):
    gen, model = pair
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="autoregressive").token_ids[0]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="ngram", gamma=3)
    assert out.stats["acceptance_rate"] is not None  # proposals happened
    assert_same_or_tie(out.token_ids[0], ref, prompt, model)


# ---- temperature > 0: chi-square against the exact distribution of the first 3 tokens ----------------------
def exact_joint(model, prompt, params):
    """P(t1, t2, t3 | prompt) from transformers, with the same temperature/top-k/top-p transform."""
    with torch.no_grad():
        def next_probs(prefixes):
            return probs(model(torch.tensor(prefixes)).logits[:, -1].float(), params)
        p1 = next_probs([prompt])[0]                                                    # (V,)
        p2 = next_probs([prompt + [a] for a in range(V)])                               # (V, V)
        p3 = next_probs([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).double().numpy()


def chi_square_p(samples, joint):
    counts = np.zeros(joint.size)
    idx = np.ravel_multi_index(np.asarray(samples)[:, :3].T, joint.shape)
    np.add.at(counts, idx, 1)
    expected = joint.ravel() * len(samples)
    assert counts[expected == 0].sum() == 0, "sampled a sequence the target gives probability 0"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


CASES = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.0, top_k=5),
         dict(temperature=1.0, top_p=0.8)]


def sample_first3(gen, prompt, method, gamma, seed, **kw):
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=N, method=method,
                       gamma=gamma, seed=seed, adaptive=False, seeding="stream", **kw)
    assert all(len(t) == 3 for t in out.token_ids)
    return out


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_draft_distribution_is_the_target_distribution(pair, kw):
    gen, model = pair
    prompt = [5, 1, 7]
    out = sample_first3(gen, prompt, "draft", 2, seed=123, **kw)
    assert out.stats["acceptance_rate"] < 0.9  # rejections (and so the residual) really happened
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(**kw)))
    print(f"draft {kw}: chi-square p = {p:.4f}")
    assert p > P_MIN


@pytest.mark.parametrize("kw", CASES[:2], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_plain_sampling_is_the_target_distribution(pair, kw):
    """Plain steps sample on the host on the CPU (numpy over the engine's logits): the law of the target's."""
    gen, model = pair
    prompt = [5, 1, 7]
    out = sample_first3(gen, prompt, "autoregressive", None, seed=7, **kw)
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(**kw)))
    print(f"autoregressive {kw}: chi-square p = {p:.4f}")
    assert p > P_MIN


def test_broken_plain_sampling_is_caught(pair, monkeypatch):
    """Power: the host sampler at a wrong temperature fails the same test."""
    gen, model = pair
    real = verification.sampled_host
    monkeypatch.setattr(verification, "sampled_host", lambda x, tt, w, q, t, u: real(x, tt, w, q, 1.3 * t, u))
    out = sample_first3(gen, [5, 1, 7], "autoregressive", None, seed=7, temperature=1.0)
    assert chi_square_p(out.token_ids, exact_joint(model, [5, 1, 7], SamplingParams(temperature=1.0))) < P_MIN


def repeat_prompt(model):
    """[a, b, a, b, a, b, a]: the lookup proposes from the repeats. Of all pairs, the one where a wrong residual
    would move the most probability (P(b) · P(a | b) · (1 − P(a | b))), so that the test has power."""
    with torch.no_grad():
        pairs = [(a, b) for a in range(V) for b in range(V) if a != b]
        prompts = [[a, b] * 3 + [a] for a, b in pairs]
        rows = torch.arange(len(pairs))
        p1 = torch.softmax(model(torch.tensor(prompts)).logits[:, -1], -1)[rows, [b for _, b in pairs]]
        p2 = torch.softmax(model(torch.tensor([q + [q[1]] for q in prompts])).logits[:, -1], -1)
        p2 = p2[rows, [a for a, _ in pairs]]
    return prompts[int((p1 * p2 * (1 - p2)).argmax())]


@pytest.mark.parametrize("kw", CASES[:2], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_ngram_distribution_is_the_target_distribution(pair, kw):
    gen, model = pair
    prompt = repeat_prompt(model)
    out = sample_first3(gen, prompt, "ngram", 2, seed=321, **kw)
    assert out.stats["acceptance_rate"] is not None and out.stats["rounds"] >= 1
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(**kw)))
    print(f"ngram {kw}: chi-square p = {p:.4f}")
    assert p > P_MIN


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_broken_rule_is_caught(pair, monkeypatch, method):
    """Power: skipping the residual (sampling from P after a rejection) must fail the same test."""
    gen, model = pair
    prompt = [5, 1, 7] if method == "draft" else repeat_prompt(model)
    monkeypatch.setattr(verification, "residual", lambda P_n, Q_n: P_n)
    monkeypatch.setattr(verification, "residual_host", lambda p, q, x: p)   # the CPU loop's
    out = sample_first3(gen, prompt, method, 2, seed=99, temperature=1.0)
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(temperature=1.0)))
    print(f"broken rule ({method}): chi-square p = {p:.2e}")
    assert p < P_MIN


# ---- the rule's edge cases -------------------------------------------------------------------------------
def run_rule(P, Q, draft, rows=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.tensor(P, dtype=torch.float32).expand(rows, -1, -1)
    Q = None if Q is None else torch.tensor(Q, dtype=torch.float32).expand(rows, -1, -1)
    d = torch.tensor(draft).expand(rows, -1)
    return verification.sampled(P, Q, d, torch.ones_like(d, dtype=torch.bool), g)


def test_rule_p_equals_q_accepts_all():
    n, nxt = run_rule([[0.2, 0.8], [0.5, 0.5], [0.9, 0.1]], [[0.2, 0.8], [0.5, 0.5]], [1, 0])
    assert (n == 2).all()
    assert abs((nxt == 0).float().mean() - 0.9) < 0.01  # bonus token from P at the last position


def test_rule_q_zero_where_p_is_not():
    # Q puts everything on token 0; P is 50/50: token 0 is accepted half the time, the residual is token 1
    n, nxt = run_rule([[0.5, 0.5], [1.0, 0.0]], [[1.0, 0.0]], [0])
    assert abs(n.float().mean() - 0.5) < 0.02
    assert (nxt[n == 0] == 1).all()
    emitted = torch.where(n == 1, torch.zeros_like(nxt), nxt)
    assert abs((emitted == 0).float().mean() - 0.5) < 0.02  # the first token is distributed as P


def test_rule_p_one_hot():
    n, nxt = run_rule([[0.0, 1.0, 0.0], [0, 0, 1.0]], [[1 / 3, 1 / 3, 1 / 3]], [0])
    assert (n == 0).all() and (nxt == 1).all()
    n, nxt = run_rule([[0.0, 1.0, 0.0], [0, 0, 1.0]], [[1 / 3, 1 / 3, 1 / 3]], [1])
    assert (n == 1).all() and (nxt == 2).all()


def test_rule_none_accepted_and_deterministic_proposals():
    n, nxt = run_rule([[0.0, 1.0], [0.5, 0.5]], None, [0])   # deterministic draft of a P = 0 token
    assert (n == 0).all() and (nxt == 1).all()
    n, nxt = run_rule([[0.3, 0.7], [0.5, 0.5]], None, [1])   # accepted with probability P(x) = 0.7
    assert abs(n.float().mean() - 0.7) < 0.02
    assert (nxt[n == 0] == 0).all()                           # residual: P with x removed


def test_greedy_rule():
    logits = torch.tensor([[[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]]])
    n, nxt = verification.greedy(logits, torch.tensor([[1, 0]]), torch.ones(1, 2, dtype=torch.bool))
    assert n.item() == 2 and nxt.item() == 1                   # all accepted, bonus argmax
    n, nxt = verification.greedy(logits, torch.tensor([[0, 0]]), torch.ones(1, 2, dtype=torch.bool))
    assert n.item() == 0 and nxt.item() == 1                   # first rejected, target's token


def test_extreme_sampling_options():
    """A top_p that float32 rounds to 0 keeps the top token (it gave NaN probabilities); a temperature so small that
    logits / temperature overflow float32 is refused, naming greedy decoding."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    for top_p in (5e-324, 1e-40, 1e-3):
        assert probs(logits, SamplingParams(temperature=0.7, top_p=top_p)).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    for temperature in (1e-39, 5e-324, 1e-7):
        with pytest.raises(InputError, match="send 0 for greedy"):
            SamplingParams(temperature=temperature)
    assert probs(logits, SamplingParams(temperature=1e-6)).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_fast_argmax_and_top_k_match_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 1000, generator=g)
    x[0, 0, 7] = x[0, 0, 9] = 50.0                             # a tie: the first index, as torch
    x[1, 2, 500:] = float("-inf")
    assert torch.equal(argmax(x), x.argmax(-1)) and torch.equal(argmax(x[:, -1]), x[:, -1].argmax(-1))
    for k in (1, 2, 4):                                         # the same values, largest first (ties in any order)
        ids = top_k_ids(x, k)
        assert torch.equal(x.gather(-1, ids), torch.topk(x, k, dim=-1).values)
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all()
    short = torch.full((1, 6), float("-inf"))
    short[0, 2], short[0, 4] = 1.0, 2.0                        # fewer finite entries than k: ids stay distinct
    assert top_k_ids(short, 3)[0].unique().numel() == 3 and top_k_ids(short, 3)[0, :2].tolist() == [4, 2]


def test_sample_draws_the_given_law():
    w = torch.tensor([0.0, 3.0, 0.0, 1.0, 6.0, 0.0])              # unnormalised, zeros at both ends
    g = torch.Generator().manual_seed(1)
    draws = sample(w.expand(20000, -1), g)
    counts = torch.bincount(draws, minlength=6)
    assert counts[w == 0].sum() == 0                            # probability 0 is never drawn
    assert chisquare(counts[w > 0].numpy(), (w[w > 0] / w.sum() * 20000).numpy()).pvalue > 1e-3
    assert sample(torch.tensor([[0.0, 0.0, 1e-30]]), g).item() == 2


def test_verify_command(pair):
    import subprocess
    import sys
    gen, _ = pair
    out = subprocess.run([sys.executable, "-m", "specrt.cli", "verify", str(gen.directory), "--method", "draft",
                          "--prompts", "2", "--max-new-tokens", "12", "--samples", "1500", "--temperature", "1.0",
                          "--top-k", "0"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "p = " in out.stdout and out.stdout.strip().endswith("PASS")


def verify(directory, *args):
    from click.testing import CliRunner
    from specrt.cli import main
    return CliRunner().invoke(main, ["verify", str(directory), "--method", "draft", "--prompts", "1",
                                     "--max-new-tokens", "8", *args])


@pytest.mark.parametrize("args, untested", [
    (["--top-k", "1"], "one outcome"),                  # a certain next token: nothing to compare
    (["--depth", "1"], "--depth 1"),                    # only the prefill's token
    (["--prompts", "0", "--samples", "0"], "greedy"),  # no check at all
])
def test_verify_without_a_test_says_so(pair, args, untested):
    """A check that was asked for and could not run is NOT TESTED (exit status 3), with the reason; never PASS."""
    gen, _ = pair
    out = verify(gen.directory, "--samples", "600", "--temperature", "1.0", *args)
    assert out.exit_code == 3, out.output
    assert "NOT TESTED" in out.output and "PASS" not in out.output
    assert "could not test" in out.output and untested in out.output


EOS = 10   # likely at the second position after the prompt [1, 2, 3, 1, 2] (p = 0.34 after its likeliest token)


@pytest.fixture(scope="module")
def eos_pair(tmp_path_factory):
    """The pair with an end-of-sequence token that the target often samples."""
    draft = tiny_model("llama", seed=11, vocab=V, init=0.3)
    directory, target = export_tiny(tmp_path_factory.mktemp("eos"), "llama", seed=1, draft=draft, vocab=V, init=0.3,
                                    max_seq_len=24, eos=EOS)
    return Generator.from_engines(directory), target


def test_verify_counts_sequences_that_end_at_eos(eos_pair):
    """A sequence that ends at EOS counts with EOS as its outcome: the counts at the prefix it ends after keep
    their law (dropping such sequences removes EOS from the outcomes and fails a lossless method)."""
    from specrt.measurement.check import END, check_sampling, draw
    gen, _ = eos_pair
    prompt, params = [1, 2, 3, 1, 2], SamplingParams(1.0, 0, 1.0, 0)
    seqs = draw(gen, prompt, "draft", params, 64, 3, gamma=2)
    assert any(s[0] == EOS and s[1:] == (END, END) for s in seqs)   # ended at once, padded
    assert all(END not in s[:s.index(EOS) + 1] for s in seqs if EOS in s)
    tests, untested = check_sampling(gen, prompt, "draft", params, 2000, 3, 3, 1e-3, gamma=2)
    after = [t for t in tests if t["prefix"] == [18]]   # the likeliest first token; EOS is likely after it
    assert after and after[0]["position"] == 1 and after[0]["samples"] > 300
    assert all(t["p_value"] > t["alpha"] for t in tests), tests
    out = verify(gen.directory, "--samples", "2000", "--temperature", "1.0", "--top-k", "0")
    assert out.exit_code == 0 and out.output.strip().endswith("PASS"), out.output


def test_host_rules_match_the_device_rules():
    """The CPU loop's plain-Python greedy rules (chain and tree) give the torch rules' counts, next tokens and
    paths, on random logits with drafts that often match and rows of different widths."""
    g = torch.Generator().manual_seed(5)
    tree = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)])
    for _ in range(40):
        B, gamma = 3, 4
        logits = torch.randn(B, gamma + 1, 7, generator=g)
        best = logits.argmax(-1)
        draft = torch.where(torch.rand(B, gamma, generator=g) < 0.7, best[:, :-1], torch.randint(0, 7, (B, gamma)))
        width = torch.randint(0, gamma + 1, (B,), generator=g)
        valid = torch.arange(gamma)[None] < width[:, None]
        n, nxt = verification.greedy(logits, draft, valid)
        tokens = torch.cat([torch.zeros(B, 1, dtype=torch.int64), draft], 1).tolist()
        rows = verification.greedy_host(logits.numpy(), tokens, width.tolist())
        assert [r[:3] for r in rows] == [[a, b, w] for a, b, w in zip(n.tolist(), nxt.tolist(), width.tolist())]
        assert [r[3:] for r in rows] == [t[:a + 1] for t, a in zip(tokens, n.tolist())]
        # a tree whose siblings are distinct tokens (as top-k candidates are), its nodes often their parent's argmax
        logits = torch.randn(B, tree.size, 9, generator=g)
        best = logits.argmax(-1)
        nodes = torch.zeros(B, tree.size, dtype=torch.int64)
        for i in range(1, tree.size):
            p, r = tree.parent[i], int(tree.rank[i])
            nodes[:, i] = (best[:, p] + r) % 9 if torch.rand(1, generator=g) < 0.8 else (best[:, p] + r + 1) % 9
        n, nxt, path = verification.tree_greedy(logits, nodes, tree)
        rows, paths = verification.tree_greedy_host(logits.numpy(), nodes.tolist(), tree)
        assert [r[0] for r in rows] == n.tolist() and [r[1] for r in rows] == nxt.tolist()
        for b, k in enumerate(n.tolist()):
            assert paths[b][:k + 1] == path[b, :k + 1].tolist() and len(paths[b]) == tree.max_depth + 1
            assert rows[b][3:] == nodes[b, path[b, :k + 1]].tolist()


def test_top_k_in_place_matches_torch():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    row = x.numpy().copy()
    ids, values = top_k_in_place(row, 5)
    assert ids == torch.topk(x, 5).indices.tolist() and values == torch.topk(x, 5).values.tolist()
    assert np.isneginf(row).sum() == 5


def test_host_sampler_draws_the_given_law():
    """draw_host walks the CDF by blocks (here ragged: 37 = 4 × 8 + 5): the law of softmax(x / T), and a token of
    probability 0 is never drawn."""
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(1, 37)) * 2).astype(np.float32)
    logits[0, 5] = -1e30
    p = np.exp((logits[0].astype(np.float64) - logits[0].max()) / 0.8)
    weights = softmax_host(logits[0], 0.8, normalise=False)
    draws = [draw_host(weights, u, block=8) for u in rng.random(20000)]
    counts = np.bincount(draws, minlength=37)
    assert counts[5] == 0
    keep = p > 0
    assert chisquare(counts[keep], p[keep] / p[keep].sum() * counts.sum()).pvalue > P_MIN
