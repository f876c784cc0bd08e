"""Shared fixtures: tiny random models of every registered architecture, exported and built for real."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)   # make test: two processes, a core each

from specrt.export.architectures import REGISTRY  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ENGINES = REPO / "engines" / "default"


WINDOW = 8   # the attention window of the test configs that have one: shorter than the tests' prompt + generation

# One tiny test configuration per registered architecture (transformers config fields over `tiny_config`'s
# sizes): what each must exercise. tests/test_architectures.py fails when an architecture has none.
ARCH_TESTS = {
    "llama": {},
    "qwen2": {},                                                 # q/k/v biases (given values in `tiny_model`)
    "mistral": dict(sliding_window=WINDOW),                      # every layer windowed
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),   # layer 1 windowed
    "gemma2": dict(head_dim=8, query_pre_attn_scalar=12, sliding_window=WINDOW, attn_logit_softcapping=0.02,
                   final_logit_softcapping=0.1),                 # layer 0 windowed; caps that bite at this scale
    "gemma3_text": dict(head_dim=8, query_pre_attn_scalar=12, sliding_window=WINDOW,
                        layer_types=["sliding_attention", "full_attention"]),   # local rope on layer 0
    "phi3": dict(sliding_window=WINDOW, partial_rotary_factor=0.5, original_max_position_embeddings=64,
                 rope_scaling=dict(rope_type="longrope", short_factor=[1.0, 1.7], long_factor=[3.0, 9.0])),
    # mixtures of experts: 4 experts, 2 a token (export/moe.py)
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False,
                      mlp_only_layers=[0]),                      # layer 0 a dense MLP; weights not renormalised
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),   # q/k norms over the projection
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0,
                       attention_multiplier=0.3, residual_multiplier=0.7, logits_scaling=0.5),
    # a hybrid: a gated short convolution (export/hybrid.py) beside attention; the rest in tests/test_hybrid.py
    "lfm2": dict(layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False),
    # Mamba-2 beside attention (export/hybrid.py), routed experts beside the shared MLP, with rope; the dense, no-rope
    # form (Granite 4.0-H-Micro's) in tests/test_hybrid.py
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                             mamba_n_groups=2, mamba_chunk_size=4, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=48, position_embedding_type="rope", embedding_multiplier=2.0,
                             residual_multiplier=0.7),
}

# architectures whose tiny model is checked by graph parity alone (test_graph_parity's fused engine against
# transformers), not by the whole matrix (greedy, methods, prefill, unfused and width engines): the suite's time
# budget; their routed block is the one Qwen3-MoE and Mixtral run through all of it
PARITY_ONLY = {"olmoe", "granitemoe", "lfm2", "granitemoehybrid"}
MATRIX = sorted(set(REGISTRY) - PARITY_ONLY)


def tiny_config(arch: str, vocab: int = 64, layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2,
                init: float = 0.02):
    import transformers
    cls = getattr(transformers, config_class(arch))
    extra = dict(ARCH_TESTS.get(arch, {}))
    if "layer_types" in extra:   # repeated over more layers
        extra["layer_types"] = [extra["layer_types"][i % len(extra["layer_types"])] for i in range(layers)]
    return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
               initializer_range=init, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
               pad_token_id=None, **extra)


def config_class(arch: str) -> str:
    """The transformers config class of a registered architecture (Gemma3ForCausalLM: Gemma3TextConfig)."""
    name = REGISTRY[arch].hf_class.replace("ForCausalLM", "Config")
    return "Gemma3TextConfig" if name == "Gemma3Config" else name


def tiny_model(arch: str, seed: int = 0, eos: int | None = None, **kw):
    """A random model; `eos`: its end-of-sequence token (none by default: sequences run to their length)."""
    import transformers
    torch.manual_seed(seed)
    cls = getattr(transformers, REGISTRY[arch].hf_class)
    model = cls(tiny_config(arch, **kw)).eval()
    model.config.eos_token_id = eos
    with torch.no_grad():
        if arch == "qwen2":  # give the q/k/v biases values, so that they are tested
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        if REGISTRY[arch].norm_offset or REGISTRY[arch].qk_norm:   # norm weights other than their start
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.5)
    model.generation_config.eos_token_id = eos
    return model


def export_tiny(tmp: Path, arch: str, seed: int = 0, draft=None, max_seq_len: int = 64, name="engines",
                medusa=None, **kw):
    """Save a tiny checkpoint (and optional draft checkpoint), export and build it; return (dir, hf_model)."""
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    model = tiny_model(arch, seed, **kw)
    src = tmp / f"{name}-{arch}-{seed}-src"
    model.save_pretrained(src)
    draft_src = None
    if draft is not None:
        draft_src = tmp / f"{name}-{arch}-{seed}-draft"
        draft.save_pretrained(draft_src)
    out = tmp / f"{name}-{arch}-{seed}"
    export_engines(str(src), out, draft=str(draft_src) if draft_src else None, max_seq_len=max_seq_len,
                   log=lambda *_: None, medusa=str(medusa) if medusa else None)
    build(out, "onnxruntime", log=lambda *_: None)
    return out, model


def export_tiny_with_heads(tmp: Path, vocab: int, num_heads: int, max_seq_len: int):
    """A tiny llama target with a tiny draft and sequential Medusa heads, exported and built for the CPU."""
    from specrt.export.medusa import MedusaHeads, save_heads
    target = tiny_model("llama", seed=1, vocab=vocab, init=0.3)
    torch.manual_seed(5)
    heads = MedusaHeads(num_heads, target.config.hidden_size, target.lm_head.weight,
                        target.model.embed_tokens.weight, sequential=True)
    save_heads(heads, tmp / "heads")
    draft = tiny_model("llama", seed=11, vocab=vocab, init=0.3)
    return export_tiny(tmp, "llama", seed=1, draft=draft, vocab=vocab, init=0.3, max_seq_len=max_seq_len,
                       medusa=tmp / "heads")


def export_tiny_with_drafters(tmp: Path, vocab: int, max_seq_len: int, medusa_heads: int = 0):
    """A tiny peaked llama target with a different draft model, an EAGLE drafter and (`medusa_heads` > 0) sequential
    Medusa heads, exported and built for the CPU (float32 drafters); returns (directory, hf_model)."""
    from specrt.export.build import build
    from specrt.export.eagle import new_eagle, save_eagle
    from specrt.export.medusa import MedusaHeads, save_heads
    from specrt.export.model import from_hf
    from specrt.export.pipeline import export_engines
    model = tiny_model("llama", seed=1, vocab=vocab, init=0.3)
    model.save_pretrained(tmp / "src")
    tiny_model("llama", seed=11, vocab=vocab, init=0.3).save_pretrained(tmp / "draft")
    save_eagle(new_eagle(from_hf(model, max_seq_len), seed=3, num_layers=1), tmp / "eagle", dtype=torch.float32)
    medusa = None
    if medusa_heads:
        torch.manual_seed(5)
        save_heads(MedusaHeads(medusa_heads, model.config.hidden_size, model.lm_head.weight,
                               model.model.embed_tokens.weight, sequential=True), tmp / "heads")
        medusa = str(tmp / "heads")
    export_engines(str(tmp / "src"), tmp / "engines", draft=str(tmp / "draft"), eagle=str(tmp / "eagle"),
                   medusa=medusa, max_seq_len=max_seq_len, log=lambda *_: None)
    build(tmp / "engines", "onnxruntime", log=lambda *_: None, drafter_weights="float32")
    return tmp / "engines", model


class _OnFirstUse(dict):
    """arch -> what `make(arch)` gives, made the first time a test asks for it."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, arch):
        self[arch] = made = self.make(arch)
        return made


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory):
    """One exported + built engine set per registered architecture (session-wide), each made when a test of this
    process first asks for it (a test worker builds only the architectures of its modules)."""
    tmp = tmp_path_factory.mktemp("tiny")
    return _OnFirstUse(lambda arch: export_tiny(tmp, arch))


@pytest.fixture(scope="session")
def default_engines():
    if not (DEFAULT_ENGINES / "manifest.json").is_file():
        pytest.fail(f"{DEFAULT_ENGINES} is missing: run `make engines` (make test does it)")
    return DEFAULT_ENGINES


@pytest.fixture(scope="session")
def smollm2():
    from specrt.export.sources import load_source
    return load_source("smollm2-135m")


@pytest.fixture(scope="session")
def default_generator(default_engines):
    from specrt import Generator
    return Generator.from_engines(default_engines)


def check_int4_engine(gen, model, seq: list[int], new_tokens: int) -> None:
    """A 4-bit target engine: its logits over `seq` near the float model's (relative error below 0.5), and prompt
    lookup on text that repeats gives its own autoregressive tokens."""
    n = len(seq)
    out = gen.target.forward(torch.tensor([seq]), torch.arange(n)[None], gen.target.new_cache(1).past_len,
                             torch.ones(n, n, dtype=torch.bool).tril()[None], n)
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0]
    assert (out.logits[0] - ref).norm() / ref.norm() < 0.5
    prompt = seq[:4] * 3   # text that repeats: prompt lookup proposes
    ar = gen.generate(prompt_ids=prompt, max_new_tokens=new_tokens, method="autoregressive").token_ids[0]
    assert gen.generate(prompt_ids=prompt, max_new_tokens=new_tokens, method="ngram").token_ids[0] == ar


def pytest_sessionfinish(session):
    """A test worker (pytest-xdist: make test runs two) hands its greedy comparisons to the controller."""
    import greedy_check
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["greedy"] = (greedy_check.COMPARED[0], greedy_check.NEAR_TIES)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller adds up its workers' greedy comparisons for the summary below."""
    import greedy_check
    compared, ties = node.workeroutput.get("greedy", (0, []))
    greedy_check.COMPARED[0] += compared
    greedy_check.NEAR_TIES.extend(ties)


def pytest_terminal_summary(terminalreporter):
    """The near ties that greedy comparisons accepted, each with its logit gap (greedy_check.report_tie)."""
    import greedy_check
    if not greedy_check.COMPARED[0] and not greedy_check.NEAR_TIES:
        return
    terminalreporter.section("near ties")
    terminalreporter.line(f"{len(greedy_check.NEAR_TIES)} near ties in {greedy_check.COMPARED[0]} greedy comparisons "
                          f"(first differences with a logit gap below {greedy_check.TIE_GAP})")
    for line in greedy_check.NEAR_TIES:
        terminalreporter.line(line)


def load_prompts(n: int) -> list[str]:
    import json
    rows = (REPO / "runtime" / "data" / "mt_bench.jsonl").read_text().splitlines()
    return [json.loads(r)["turns"][0] for r in rows[:n]]
