"""The architecture registry's test matrix: every registered architecture has a tiny test configuration
(conftest.ARCH_TESTS; its parity with transformers is in test_graph_parity, its greedy output in test_generate),
the speculative methods stay lossless on each, past the attention window where it has one; what the graph does not
implement is refused by name, before anything is written."""
from __future__ import annotations

import pytest
import torch

from conftest import ARCH_TESTS, MATRIX, WINDOW, export_tiny, tiny_config, tiny_model
from greedy_check import assert_same_or_tie
from specrt.decoding.generate import Generator
from specrt.engines.manifest import read_manifest
from specrt.errors import UnknownSourceError
from specrt.export.architectures import REGISTRY
from specrt.export.model import from_hf
from specrt.export.pipeline import export_engines

NEW_TOKENS = 40
METHODS = {"draft": dict(method="draft", gamma=3), "draft-tree": dict(method="draft", tree=True),
           "ngram": dict(method="ngram")}


def test_every_architecture_has_a_test_config():
    assert set(ARCH_TESTS) == set(REGISTRY), "give each registered architecture its entry in conftest.ARCH_TESTS"


def test_the_activations_checked_are_the_ones_implemented():
    from specrt.export import architectures, model
    assert set(architectures.ACTIVATIONS) == set(model.ACTIVATIONS)


@pytest.fixture(scope="module", params=MATRIX)
def arch_set(request, tmp_path_factory):
    """A tiny target of the architecture with a draft of the same architecture: the target with noise on its
    weights, so that drafts are often accepted, not always."""
    arch = request.param
    draft = tiny_model(arch)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.std().clamp(min=0.02))
    directory, target = export_tiny(tmp_path_factory.mktemp(arch), arch, draft=draft)
    return Generator.from_engines(directory), target


@pytest.mark.parametrize("method", list(METHODS))
def test_methods_are_lossless(arch_set, method):
    """Greedy output of each method token-identical to the target's own, over prompts and generations longer than
    the window (verification passes of several tokens, trees included, run past it)."""
    gen, model = arch_set
    accepted = 0
    for seed in range(2):
        prompt = torch.randint(0, 64, (6 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS).token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=NEW_TOKENS, adaptive=False, **METHODS[method])
        assert len(prompt) + NEW_TOKENS > 2 * WINDOW
        assert_same_or_tie(out.token_ids[0], ref, prompt, model)
        accepted += out.stats["acceptance_rate"] or 0
    if method != "ngram":   # prompt lookup may find nothing to propose
        assert accepted > 0, "no draft accepted: the verification passes were single tokens"


@pytest.mark.parametrize("method", ["autoregressive", "draft-tree"])
def test_batched_rows_keep_their_own_windows(arch_set, method):
    """Rows of ragged lengths in one batch (each with its own past_len, hence its own positions and window) give
    the tokens of their lone runs."""
    gen, model = arch_set
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 9, 14)]
    lone = [gen.generate(prompt_ids=p, max_new_tokens=24).token_ids[0] for p in prompts]
    kw = METHODS.get(method, dict(method=method))
    out = gen.generate(prompt_ids=prompts, max_new_tokens=24, adaptive=False, **kw)
    for ours, ref, prompt in zip(out.token_ids, lone, prompts):
        assert_same_or_tie(ours, ref, prompt, model)


# ---- refused, by name ------------------------------------------------------------------------------------------
def save_config(tmp_path, config):
    src = tmp_path / "src"
    config.save_pretrained(src)
    return src


@pytest.mark.parametrize("name,kw,match", [
    ("Qwen2MoeConfig", dict(num_experts=4), r"'qwen2_moe' model \(a mixture of experts, num_experts = 4, shared "
                                            r"experts, shared_expert_intermediate_size = 5632: not implemented"),
    ("GPT2Config", dict(), r"'gpt2' model; supported architectures: " + ", ".join(sorted(REGISTRY))),
])
def test_unregistered_architectures_are_refused_by_name(tmp_path, name, kw, match):
    import transformers
    src = save_config(tmp_path, getattr(transformers, name)(**kw))
    with pytest.raises(UnknownSourceError, match=match):
        export_engines(str(src), tmp_path / "out", log=lambda *_: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch,kw,match", [
    ("llama", dict(hidden_act="relu"), r"MLP activation 'relu' \(hidden_act\) is not implemented"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention .* not implemented"),
    ("qwen3", dict(layer_types=["full_attention", "chunked_attention"]), "layer type 'chunked_attention'"),
    ("olmoe", dict(clip_qkv=8.0), r"clip_qkv = 8.0 \(q/k/v clipped\) is not implemented"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=16),
     r"'qwen3_moe' model with shared experts \(shared_expert_intermediate_size = 16\): not implemented"),
    ("granitemoehybrid", dict(layer_types=["linear_attention", "sliding_attention"]),
     r"layer type 'sliding_attention' is not implemented \(supported: full_attention, linear_attention\)"),
])
def test_what_the_graph_does_not_implement_is_refused(tmp_path, arch, kw, match):
    config = tiny_config(arch)
    for k, v in kw.items():
        setattr(config, k, v)
    src = save_config(tmp_path, config)
    with pytest.raises(UnknownSourceError, match=match):
        export_engines(str(src), tmp_path / "out", log=lambda *_: None)
    assert not (tmp_path / "out").exists()
    model = tiny_model(arch)
    for k, v in kw.items():
        setattr(model.config, k, v)
    with pytest.raises(UnknownSourceError, match=match):
        from_hf(model, 32)


def test_longrope_is_capped_at_its_original_context(tmp_path):
    """Past original_max_position_embeddings transformers rotates every position by the long factors once the
    sequence gets there: no static table follows that, so the graph stops at the original context, and says so."""
    lines = []
    model = tiny_model("phi3")
    model.save_pretrained(tmp_path / "src")
    original = ARCH_TESTS["phi3"]["original_max_position_embeddings"]
    export_engines(str(tmp_path / "src"), tmp_path / "out", max_seq_len=2 * original, log=lines.append)
    assert f"--max-seq-len {2 * original} is more than the model's longrope original_max_position_embeddings " \
           f"({original}): using {original}" in lines
    assert read_manifest(tmp_path / "out")["models"]["target"]["max_seq_len"] == original


def test_window_does_not_cap_the_sequence(tmp_path):
    """A model with a sliding window exports the whole requested length (the window masks, it does not cap)."""
    model = tiny_model("mistral")
    model.save_pretrained(tmp_path / "src")
    export_engines(str(tmp_path / "src"), tmp_path / "out", max_seq_len=4 * WINDOW, log=lambda *_: None)
    assert read_manifest(tmp_path / "out")["models"]["target"]["max_seq_len"] == 4 * WINDOW
