"""Typical acceptance (Medusa's): an explicit opt-in, more tokens a round at temperature > 0 and NOT the target's
distribution. The chi-square test that passes exact verification must catch it; every output says which ran."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from conftest import tiny_model
from greedy_check import assert_same_or_tie
from specrt.cli import main
from specrt.decoding import verification
from specrt.decoding.generate import Generator
from specrt.decoding.sampling import SamplingParams
from specrt.decoding.tree import Tree
from specrt.errors import InputError
from test_speculative import P_MIN, V, chi_square_p, exact_joint, repeat_prompt

MAX_LEN = 64
SAMPLES = 4000   # typical acceptance's departure shows at p < 1e-30 here (exact's own tests draw 20,000)
METHODS = [("draft", dict(gamma=2)), ("draft", dict(gamma=2, tree=True)), ("ngram", dict(gamma=2)),
           ("medusa", {}), ("eagle", {})]


@pytest.fixture(scope="module")
def every(tmp_path_factory):
    """A tiny peaked target (vocabulary V, for the exact joint distribution) with every drafter: a different tiny
    draft model, sequential Medusa heads and an EAGLE drafter, all random."""
    from specrt.export.build import build
    from specrt.export.eagle import new_eagle, save_eagle
    from specrt.export.medusa import MedusaHeads, save_heads
    from specrt.export.model import from_hf
    from specrt.export.pipeline import export_engines
    tmp = tmp_path_factory.mktemp("typical")
    target = tiny_model("llama", seed=1, vocab=V, init=0.3)
    target.save_pretrained(tmp / "target")
    tiny_model("llama", seed=11, vocab=V, init=0.3).save_pretrained(tmp / "draft")
    torch.manual_seed(5)
    save_heads(MedusaHeads(3, target.config.hidden_size, target.lm_head.weight, target.model.embed_tokens.weight,
                           sequential=True), tmp / "heads")
    save_eagle(new_eagle(from_hf(target, MAX_LEN), seed=3, num_layers=1), tmp / "eagle", dtype=torch.float32)
    export_engines(str(tmp / "target"), tmp / "engines", draft=str(tmp / "draft"), medusa=str(tmp / "heads"),
                   eagle=str(tmp / "eagle"), max_seq_len=MAX_LEN, log=lambda *_: None)
    build(tmp / "engines", "onnxruntime", log=lambda *_: None, drafter_weights="float32")
    return Generator.from_engines(tmp / "engines"), target


# ---- the rule --------------------------------------------------------------------------------------------------
def test_threshold_is_the_papers():
    """min(ε, δ·exp(−H)): ε = 0.09 where the target is sure of itself, δ/V for a uniform target."""
    uniform = torch.full((V,), 1 / V)
    assert float(verification.typical_threshold(uniform)) == pytest.approx(0.3 / V, rel=1e-5)
    sure = torch.tensor([0.95] + [0.05 / (V - 1)] * (V - 1))
    assert float(verification.typical_threshold(sure)) == pytest.approx(0.09)
    for p in (uniform, sure, torch.softmax(torch.randn(V), 0)):
        assert verification.typical_threshold_host(p.numpy()) == pytest.approx(
            float(verification.typical_threshold(p)), rel=1e-5)


def test_chain_accepts_what_the_target_finds_likely():
    """A sure target (0.95 on token 0, the rest below ε = 0.09): token 0 passes at every position, any other token
    stops the chain there; the next token comes from P where it stopped."""
    P = torch.full((4, 3, V), 0.05 / (V - 1))
    P[:, :, 0] = 0.95
    draft = torch.tensor([[0, 0], [0, 5], [5, 0], [0, 0]])
    valid = torch.tensor([[True, True], [True, True], [True, True], [True, False]])
    n, nxt = verification.typical(P, draft, valid, torch.Generator().manual_seed(0))
    assert n.tolist() == [2, 1, 0, 1]
    assert ((nxt >= 0) & (nxt < V)).all()
    none = torch.zeros(4, 0, dtype=torch.int64)   # a plain step: nothing to accept, a token sampled from P
    n, nxt = verification.typical(P[:, :1], none, none.bool(), torch.Generator().manual_seed(0))
    assert n.tolist() == [0] * 4 and ((nxt >= 0) & (nxt < V)).all()


def test_host_rules_match_the_device_rules():
    """Acceptance is deterministic given P: the CPU loop's plain-Python rules accept what the torch rules accept
    (counts and, for trees, paths: the deepest, the first in rank order among equally deep), over random logits
    at a temperature where several siblings often pass, rows of different widths."""
    g = torch.Generator().manual_seed(5)
    tree = Tree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0)])
    T, B = 1.5, 3
    u = [[0.5] * (tree.size + 1)] * B
    for _ in range(40):
        logits = torch.randn(B, 5, 7, generator=g) * 2
        draft = torch.randint(0, 7, (B, 4), generator=g)
        width = torch.randint(0, 5, (B,), generator=g)
        valid = torch.arange(4)[None] < width[:, None]
        n, _ = verification.typical(torch.softmax(logits / T, -1), draft, valid, g)
        tokens = torch.cat([torch.zeros(B, 1, dtype=torch.int64), draft], 1).tolist()
        rows = verification.typical_host(logits.numpy(), tokens, width.tolist(), T, u)
        assert [r[0] for r in rows] == n.tolist()
        assert [r[3:] for r in rows] == [t[:k + 1] for t, k in zip(tokens, n.tolist())]
        logits = torch.randn(B, tree.size, 7, generator=g) * 2
        nodes = torch.randint(0, 7, (B, tree.size), generator=g)
        n, nxt, path = verification.tree_typical(torch.softmax(logits / T, -1), nodes, tree, g)
        rows, paths = verification.tree_typical_host(logits.numpy(), nodes.tolist(), tree, T, u)
        assert [r[0] for r in rows] == n.tolist()
        for b, k in enumerate(n.tolist()):
            assert paths[b][:k + 1] == path[b, :k + 1].tolist()
            assert rows[b][3:] == nodes[b, path[b, :k + 1]].tolist()


def test_bad_acceptance_is_refused(every):
    gen, _ = every
    with pytest.raises(InputError, match="acceptance 'lossy': choose exact"):
        gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=4, temperature=0.7, acceptance="lossy")
    with pytest.raises(InputError, match="acceptance 'lossy'"):
        SamplingParams(0.7, acceptance="lossy")


# ---- the promise it breaks, and the one it keeps -------------------------------------------------------------
@pytest.mark.parametrize("method, sampling", [
    ("ngram", dict(temperature=1.0)),                 # a chain of deterministic drafts, the CPU loop's host rules
    ("medusa", dict(temperature=1.0, top_k=8)),       # a static tree, the torch rules
    ("eagle", dict(temperature=0.7)),                 # a dynamic tree, host rules
], ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items()))
def test_chi_square_catches_typical_and_passes_exact(every, method, sampling):
    """The first three tokens' joint distribution against the target's exact one: exact verification passes,
    typical acceptance on the same drafts, prompt and seed is caught. (Prompt lookup after a repeated pair proposes
    a token the target gives a middling probability: exact accepts it that often, typical nearly always.)"""
    gen, model = every
    prompt = repeat_prompt(model) if method == "ngram" else [5, 1, 7]
    joint = exact_joint(model, prompt, SamplingParams(**sampling))
    n = SAMPLES // 2 if method == "eagle" else SAMPLES   # its drafter's passes over a batch cost the most here
    exact, typical = (gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=n, method=method,
                                   gamma=2 if method == "ngram" else None, seed=123, adaptive=False,
                                   seeding="stream", acceptance=acceptance, **sampling)
                      for acceptance in ("exact", "typical"))
    p_exact, p_typical = chi_square_p(exact.token_ids, joint), chi_square_p(typical.token_ids, joint)
    print(f"{method} {sampling}: chi-square p = {p_exact:.4f} exact, {p_typical:.2e} typical "
          f"(acceptance {exact.stats['acceptance_rate']:.2f} / {typical.stats['acceptance_rate']:.2f})")
    assert p_exact > P_MIN and p_typical < P_MIN
    assert (exact.stats["acceptance"], exact.stats["distribution_preserving"]) == ("exact", True)
    assert (typical.stats["acceptance"], typical.stats["distribution_preserving"]) == ("typical", False)


def test_verify_machinery_fails_typical(every):
    """`specrt verify`'s own check (chi-square of the next token at the likeliest prefixes) fails typical
    acceptance where it passes exact: whatever checks losslessness, typical acceptance cannot pass as lossless."""
    from specrt.measurement.check import check_sampling
    gen, model = every
    for acceptance, passes in (("exact", True), ("typical", False)):
        params = SamplingParams(1.0, 0, 1.0, 0, acceptance)
        tests, _ = check_sampling(gen, repeat_prompt(model), "ngram", params, SAMPLES, 3, 3, 1e-3, gamma=2)
        assert tests and all(t["p_value"] > t["alpha"] for t in tests) == passes, (acceptance, tests)


@pytest.mark.parametrize("method, kw", METHODS, ids=lambda x: x if isinstance(x, str) else ",".join(x))
def test_typical_at_temperature_0_is_greedy(every, method, kw):
    """At temperature 0 typical acceptance is greedy decoding: the target's own tokens, a batch of prompts at
    once, and the stats say exact."""
    gen, model = every
    prompts = [[5, 1, 7], [2, 9, 2, 9, 2], [3, 4]]
    out = gen.generate(prompt_ids=prompts, max_new_tokens=12, method=method, acceptance="typical", **kw)
    for prompt, ids in zip(prompts, out.token_ids):
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="autoregressive").token_ids[0]
        assert_same_or_tie(ids, ref, prompt, model)
    assert (out.stats["acceptance"], out.stats["distribution_preserving"]) == ("exact", True)


@pytest.mark.parametrize("top_k", [0, 8], ids=["host-rules", "torch-rules"])
@pytest.mark.parametrize("method, kw", METHODS, ids=lambda x: x if isinstance(x, str) else ",".join(x))
def test_typical_runs_every_method_on_batches(every, method, kw, top_k):
    """Every drafter and tree shape, a batch of prompts with two sequences each, both rule sets: the rows get their
    tokens, drafts are accepted, and the stats say typical, not distribution-preserving. The default stays exact."""
    gen, _ = every
    prompts = [[5, 1, 7], [2, 9, 2, 9, 2], [3, 4]]
    out = gen.generate(prompt_ids=prompts, max_new_tokens=10, temperature=0.8, top_k=top_k, seed=3,
                       num_return_sequences=2, method=method, acceptance="typical", adaptive=False, **kw)
    assert len(out.token_ids) == 6 and all(len(ids) == 10 for ids in out.token_ids)
    assert out.stats["acceptance_rate"] > 0
    assert (out.stats["acceptance"], out.stats["distribution_preserving"]) == ("typical", False)
    out = gen.generate(prompt_ids=prompts[0], max_new_tokens=4, temperature=0.8, method=method, **kw)
    assert (out.stats["acceptance"], out.stats["distribution_preserving"]) == ("exact", True)


def test_typical_requests_keep_their_own_figures(every):
    """A typical request's measured acceptance seeds the next typical request, never an exact one's (nor the
    tuning that `measured` records)."""
    gen, _ = every
    gen.generate(prompt_ids=[5, 1, 7], max_new_tokens=12, temperature=0.8, method="draft")
    exact = gen._gamma_policies[("draft", False)]
    gen.generate(prompt_ids=[5, 1, 7], max_new_tokens=12, temperature=0.8, method="draft", acceptance="typical")
    assert gen._gamma_policies[("draft", False)] is exact and ("draft", "typical") in gen._gamma_policies
    assert gen.measured()["gamma"]["sampled"]["draft"] == exact.alpha


# ---- what the command line says --------------------------------------------------------------------------------
def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_generate_says_typical_is_not_the_targets_distribution(every):
    gen, _ = every
    common = ("generate", gen.directory, "--prompt-ids", "5,1,7", "--max-new-tokens", 8, "--method", "draft",
              "--temperature", 0.8)
    out = cli(*common, "--acceptance", "typical", "--json")
    assert out.exit_code == 0, out.output
    stats = json.loads(out.stdout)["stats"]
    assert (stats["acceptance"], stats["distribution_preserving"]) == ("typical", False)
    assert "warning: --acceptance typical is NOT distribution-preserving" in out.stderr
    out = cli(*common, "--acceptance", "typical")
    assert "typical acceptance: NOT the target's distribution" in out.stderr and "warning" in out.stderr
    out = cli(*common, "--json")   # the default: exact, no warning
    assert json.loads(out.stdout)["stats"]["distribution_preserving"] and "warning" not in out.stderr


def test_verify_refuses_typical(every):
    gen, _ = every
    out = cli("verify", gen.directory, "--method", "draft", "--acceptance", "typical", "--samples", 0)
    assert out.exit_code == 2 and "not distribution-preserving" in out.output and "PASS" not in out.output
