"""Hybrid targets (export/hybrid.py): LFM2's gated short convolutions and Granite 4.0-H's Mamba-2 mixers beside
attention, their inputs kept in the cache. A tiny random model of each, of its own config (LFM2: conv, attention,
conv, one kv head, so that a conv layer's input takes two cache pairs; Granite 4.0-H: Mamba-2, attention, Mamba-2
with two groups, the shared MLP alone, no rope, as Granite 4.0-H-Micro; its MoE, rope form is conftest's),
exported and built for real, against transformers: logits over a prompt, a later chain and a tree, a rolled-back
cache, greedy output, each method token-identical, the sampled law; Qwen3-Next and a Granite 4.0-H GGUF file
refused by name."""
from __future__ import annotations

import pytest
import torch
import transformers

from greedy_check import assert_same_or_tie
from specrt.decoding.generate import Generator
from specrt.decoding.sampling import SamplingParams
from specrt.errors import UnknownSourceError
from specrt.export.architectures import architecture_of
from specrt.export.gguf_files import check_gguf
from specrt.export.acceptance import greedy
from specrt.export.build import build
from specrt.export.model import from_hf
from specrt.export.pipeline import export_engines
from test_graph_parity import PARENTS, hf_logits, hf_tree_logits, tree_mask
from test_speculative import N, P_MIN, V, chi_square_p, exact_joint

TOL = 1e-4


def lfm2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.Lfm2Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
        block_auto_adjust_ff_dim=False, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.3,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = transformers.Lfm2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1, 0.5)
    model.generation_config.eos_token_id = None
    return model


def granite(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=V, hidden_size=32, intermediate_size=16, shared_intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4,
        mamba_d_head=16, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=4, num_local_experts=0,
        embedding_multiplier=2.0, attention_multiplier=0.3, residual_multiplier=0.7,
        logits_scaling=0.5, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.3,
        eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = transformers.GraniteMoeHybridForCausalLM(config).eval()
    with torch.no_grad():   # Mamba-2's own parameters away from their start (A_log = log(1..n), D = dt_bias = 1)
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias", "D", "conv1d.bias")):
                p.normal_(1 if name.endswith("norm.weight") else 0, 0.5)
    model.generation_config.eos_token_id = None
    return model


def export_pair(tmp, make):
    """(Generator, target): the target with a draft of its own architecture, the target with noise on its weights."""
    target, draft = make(), make()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.std().clamp(min=0.02))
    target.save_pretrained(tmp / "target")
    draft.save_pretrained(tmp / "draft")
    export_engines(str(tmp / "target"), tmp / "engines", draft=str(tmp / "draft"), max_seq_len=48,
                   log=lambda *_: None)
    build(tmp / "engines", "onnxruntime", log=lambda *_: None, drafter_weights="float32")
    return Generator.from_engines(tmp / "engines"), target


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return export_pair(tmp_path_factory.mktemp("lfm2"), lfm2)


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    return export_pair(tmp_path_factory.mktemp("granite"), granite)


BOTH = pytest.mark.parametrize("name", ["hybrid", "mamba"], ids=["lfm2", "granite"])


def run(engine, cache, ids, positions, mask):
    """One pass over `ids` on `cache` at its past_len; every position's logits."""
    return engine.forward(torch.tensor([ids]), positions, cache.past_len, mask[None], len(ids), cache)


def chain(cache, n):
    return cache.past_len[:, None] + torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril()


def test_a_conv_layer_keeps_its_inputs_in_two_cache_pairs(hybrid):
    gen, _ = hybrid
    assert gen.target.spec["layers"] == 2 + 1 + 2   # d = 32 inputs a position, 2 * Hkv * D = 16 a pair


def test_a_mamba_layer_keeps_its_inputs_in_seven_cache_pairs(mamba):
    gen, _ = mamba   # [x; B; C] = 64 + 2 * 16 conv inputs and 4 dt a position, 2 * Hkv * D = 16 a pair
    assert gen.target.spec["layers"] == 7 + 1 + 7


@BOTH
def test_logits_match_transformers(name, request):
    """A prompt, then a chain of 4 and a tree of 7 on the filled cache: each token's logits within 1e-4."""
    gen, model = request.getfixturevalue(name)
    engine, g = gen.target, torch.Generator().manual_seed(3)
    seq = torch.randint(0, V, (9,), generator=g).tolist()
    more = torch.randint(0, V, (4,), generator=g).tolist()
    ref = hf_logits(model, seq + more)
    cache = engine.new_cache(1)
    out = run(engine, cache, seq, *chain(cache, len(seq)))
    assert (out.logits[0] - ref[:len(seq)]).abs().max() < TOL
    cache.write(out.new_kv)
    cache.past_len += len(seq)
    out = run(engine, cache, more, *chain(cache, 4))
    assert (out.logits[0] - ref[-4:]).abs().max() < TOL
    mask, depth = tree_mask(PARENTS)
    nodes = torch.randint(0, V, (len(PARENTS),), generator=g)
    out = run(engine, cache, nodes.tolist(), cache.past_len[:, None] + depth[None], mask)
    expected = hf_tree_logits(model, seq, nodes, PARENTS)
    for i in range(len(PARENTS)):   # each node sees its own ancestors' conv inputs and states, not its siblings'
        assert (out.logits[0, i] - expected[i]).abs().max() < TOL, f"tree node {i}"


@BOTH
def test_rollback_reads_the_accepted_positions(name, request):
    """A verify pass writes 4 entries, 2 are accepted (past_len moves by 2): the next pass reads the conv (and
    Mamba-2) state of the accepted positions, not the rejected ones that still sit in the cache's next slots."""
    gen, model = request.getfixturevalue(name)
    engine, g = gen.target, torch.Generator().manual_seed(4)
    seq = torch.randint(0, V, (6,), generator=g).tolist()
    cache = engine.new_cache(1)
    out = run(engine, cache, seq, *chain(cache, 6))
    cache.write(out.new_kv)
    cache.past_len += 6
    drafts = torch.randint(0, V, (4,), generator=g).tolist()
    out = run(engine, cache, drafts, *chain(cache, 4))
    cache.write(out.new_kv)
    cache.truncate(cache.past_len + 2)   # drafts[2:] rejected: their entries stay, as scratch
    nxt = [(drafts[2] + 1) % V, (drafts[3] + 5) % V]
    out = run(engine, cache, nxt, *chain(cache, 2))
    assert (out.logits[0] - hf_logits(model, seq + drafts[:2] + nxt)[-2:]).abs().max() < TOL


@BOTH
def test_greedy_equals_transformers_generate(name, request):
    gen, model = request.getfixturevalue(name)
    for seed in range(2 if name == "hybrid" else 1):   # transformers' Mamba-2 runs its slow reference scans
        prompt = torch.randint(0, V, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ours = gen.generate(prompt_ids=prompt, max_new_tokens=20, method="autoregressive").token_ids[0]
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
        assert_same_or_tie(ours, ref.tolist(), prompt, model)


def test_the_export_checks_run_the_model_eagerly(hybrid):
    """The export's acceptance check (EAGLE, Medusa) decodes with the eager graph over caches of its own sizing."""
    _, model = hybrid
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
    assert greedy(from_hf(model, 16), prompt, 8) == ref


@pytest.mark.parametrize("kw", [dict(method="draft", gamma=3), dict(method="draft", tree=True),
                                dict(method="ngram")], ids=["draft", "draft-tree", "ngram"])
@BOTH
def test_methods_are_token_identical(name, request, kw):
    gen, model = request.getfixturevalue(name)
    accepted = 0
    for seed in range(2):
        prompt = torch.randint(0, V, (6 + seed,), generator=torch.Generator().manual_seed(10 + seed)).tolist()
        prompt = prompt + prompt[:4]   # something for prompt lookup to find
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=24, adaptive=False, **kw)
        assert_same_or_tie(out.token_ids[0], ref, prompt, model)
        accepted += out.stats["acceptance_rate"] or 0
    if kw["method"] == "draft":
        assert accepted > 0, "no draft accepted: the verification passes were single tokens"


@BOTH
def test_sampled_drafts_keep_the_target_distribution(name, request):
    """Chi-square of the first 3 sampled tokens (draft, gamma 2) against the law transformers gives (Granite 4.0-H:
    a quarter of the samples, for the suite's time: a 4 % error, not 2 %)."""
    gen, model = request.getfixturevalue(name)
    prompt, params = [5, 1, 7], dict(temperature=1.0)
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=N if name == "hybrid" else N // 4,
                       method="draft", gamma=2, seed=123, adaptive=False, seeding="stream", **params)
    assert out.stats["acceptance_rate"] < 0.95   # rejections (and so rollbacks) really happened
    assert chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(**params))) > P_MIN


def test_qwen3_next_is_refused_with_its_reason():
    config = transformers.Qwen3NextConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=1)
    with pytest.raises(UnknownSourceError, match="'qwen3_next'.*gated DeltaNet.*not implemented"):
        architecture_of(config)


def test_a_granite_hybrid_gguf_file_is_refused_by_name(tmp_path):
    """llama.cpp's GGUF architecture of Granite 4.0-H, which transformers' GGUF loader does not read."""
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "h.gguf"), "granitehybrid")
    w.add_block_count(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnknownSourceError, match="architecture 'granitehybrid', which specrt does not export"):
        check_gguf(tmp_path / "h.gguf")
