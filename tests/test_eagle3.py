"""EAGLE-3: the target's aux output, published drafter checkpoints (each layout as its publishers ship it) against an
independent PyTorch implementation of the published architecture, d2t, the runtime's promise, bad drafters."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from conftest import tiny_model
from greedy_check import assert_same_or_tie
from specrt.decoding.drafters import chain_mask
from specrt.decoding.eagle import EagleDrafter
from specrt.decoding.generate import Generator
from specrt.errors import DrafterMismatchError, InputError

MAX_LEN = 64
V, K, LAYERS = 64, 40, 8   # target vocabulary, draft vocabulary, target layers (default aux layers 2, 4, 5)


# ---- checkpoints as published ---------------------------------------------------------------------------

# (name, target architecture, weight prefix, weights file, config extras, export's layer_ids, the layer inputs read)
LAYOUTS = {
    # the EAGLE authors (yuhuili/EAGLE3-*): `midlayer.*`, pytorch_model.bin, no layer ids (the default)
    "eagle-authors": ("llama", "midlayer.", "pytorch_model.bin", {}, None, (2, 4, 5)),
    # SpecForge / vLLM speculators: `layers.0.*`, model.safetensors, the embedding included, the ids in
    # eagle_config (SGLang's reading: layer outputs)
    "specforge": ("qwen2", "layers.0.", "model.safetensors",
                  {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6], "use_aux_hidden_state": True}},
                  "outputs", (2, 4, 7)),
}


def scattered_d2t(seed: int = 0, vocab: int = V, draft_vocab: int = K) -> torch.Tensor:
    """Draft ids -> distinct target ids spread over the vocabulary (sorted, as published maps are)."""
    target_ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    return target_ids - torch.arange(draft_vocab)


def write_published(directory, target, prefix: str, weights: str, extra: dict, hidden: int | None = None,
                    vocab: int = V, d2t: torch.Tensor | None = None, seed: int = 0, embed: bool = False,
                    draft_vocab: int = K):
    """An EAGLE-3 checkpoint with random weights, in the names, shapes, dtypes and config keys its publishers use."""
    c = target.config
    H = hidden or c.hidden_size
    heads, kv, inter = c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    hd = H // heads
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, s=0.3: torch.randn(*shape, generator=g) * s  # noqa: E731
    K = draft_vocab
    d2t = scattered_d2t(seed, vocab, K) if d2t is None else d2t
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[(torch.arange(K) + d2t).clamp(0, vocab - 1)] = True
    layer = {"self_attn.q_proj.weight": r(heads * hd, 2 * H), "self_attn.k_proj.weight": r(kv * hd, 2 * H),
             "self_attn.v_proj.weight": r(kv * hd, 2 * H), "self_attn.o_proj.weight": r(H, heads * hd),
             "mlp.gate_proj.weight": r(inter, H), "mlp.up_proj.weight": r(inter, H),
             "mlp.down_proj.weight": r(H, inter), "input_layernorm.weight": 1 + r(H),
             "hidden_norm.weight": 1 + r(H), "post_attention_layernorm.weight": 1 + r(H)}
    state = {**{prefix + k: v for k, v in layer.items()}, "fc.weight": r(H, 3 * H, s=0.1), "norm.weight": 1 + r(H),
             "lm_head.weight": r(K, H, s=1.0), "d2t": d2t.long(), "t2d": t2d}
    if embed:
        state["embed_tokens.weight"] = r(vocab, H)
    state = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}   # as they ship
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
              "max_position_embeddings": 2048, "vocab_size": vocab, "draft_vocab_size": K,
              "tie_word_embeddings": False, "torch_dtype": "float16", **extra}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if weights.endswith(".bin"):
        torch.save(state, directory / weights)
    else:
        from safetensors.torch import save_file
        save_file(state, str(directory / weights))
    return directory


# ---- the published architecture, written out independently -------------------------------------------------

def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_drafter(directory, prefix: str, weights: str):
    """(state, config, forward): forward(fused (S, d), ids (S,)) -> (logits (S, K), hidden (S, d)), causal over the
    S slots at positions 0 .. S-1 (transformers' Llama rotary embedding from the drafter's config)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    config = json.loads((directory / "config.json").read_text())
    if weights.endswith(".bin"):
        state = torch.load(directory / weights, weights_only=True)
    else:
        from safetensors.torch import load_file
        state = load_file(str(directory / weights))
    w = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    L = lambda name: w[prefix + name]  # noqa: E731
    eps, H = config["rms_norm_eps"], config["hidden_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = H // heads
    rotary = LlamaRotaryEmbedding(LlamaConfig(**config))

    def forward(fused, ids, embed):
        S = len(ids)
        x = torch.cat([_rms(embed[ids], L("input_layernorm.weight"), eps),
                       _rms(fused, L("hidden_norm.weight"), eps)], -1)                     # (S, 2d)
        q = (x @ L("self_attn.q_proj.weight").T).view(S, heads, hd).transpose(0, 1)     # (h, S, hd)
        k = (x @ L("self_attn.k_proj.weight").T).view(S, kv, hd).transpose(0, 1)
        v = (x @ L("self_attn.v_proj.weight").T).view(S, kv, hd).transpose(0, 1)
        cos, sin = rotary(x[None], torch.arange(S)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, v = k[0].repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        scores = q[0] @ k.transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
        att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(S, heads * hd)
        h = fused + att @ L("self_attn.o_proj.weight").T
        m = _rms(h, L("post_attention_layernorm.weight"), eps)
        h = h + (torch.nn.functional.silu(m @ L("mlp.gate_proj.weight").T) * (m @ L("mlp.up_proj.weight").T)) \
            @ L("mlp.down_proj.weight").T
        return _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T, h
    return w, config, forward


def target_aux(model, ids: list[int], layers) -> torch.Tensor:
    """(S, 3d) the hidden states entering `layers`, by transformers (hidden_states[i] enters layer i)."""
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[i][0] for i in layers], -1)


def export_set(tmp, name: str, drafter_weights="float32", init: float = 0.3, **write):
    """A tiny target of the layout's architecture (weights of std `init`) with a random published checkpoint, exported
    and built."""
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    arch, prefix, weights, extra, layer_ids, _ = LAYOUTS[name]
    model = tiny_model(arch, seed=1, vocab=V, layers=LAYERS, init=init)
    model.save_pretrained(tmp / "src")
    ckpt = write_published(tmp / "eagle3", model, prefix, weights, extra, embed=name == "specforge", **write)
    export_engines(str(tmp / "src"), tmp / "engines", max_seq_len=MAX_LEN, log=lambda *_: None, eagle=str(ckpt),
                   eagle_layer_ids=layer_ids)
    build(tmp / "engines", "onnxruntime", log=lambda *_: None, drafter_weights=drafter_weights)
    return tmp / "engines", model, ckpt


@pytest.fixture(scope="module", params=list(LAYOUTS))
def published(request, tmp_path_factory):
    engines, model, ckpt = export_set(tmp_path_factory.mktemp(request.param), request.param)
    return request.param, Generator.from_engines(engines), model, ckpt


def test_target_outputs_the_inputs_of_the_drafters_layers(published):
    name, gen, model, _ = published
    layers = LAYOUTS[name][5]
    assert gen.manifest["models"]["target"]["aux"] == {"layers": list(layers), "size": 3 * 32}
    assert gen.manifest["models"]["eagle"]["acceptance"]["positions"] > 0   # measured after import
    ids = [3, 9, 1, 40, 22, 7, 5]
    out = gen.target.run_sequence(ids, num_logits=len(ids))
    assert torch.allclose(out.aux[0], target_aux(model, ids, layers), atol=1e-4)


def test_drafter_logits_match_the_published_architecture(published):
    """Slots fed the target's aux states (a catch-up), then one fed the drafter's own output (a tree level)."""
    name, gen, model, ckpt = published
    _, prefix, weights, _, _, layers = LAYOUTS[name]
    w, _, forward = reference_drafter(ckpt, prefix, weights)
    embed = w["embed_tokens.weight"] if "embed_tokens.weight" in w else model.model.embed_tokens.weight.detach()
    prompt = [3, 9, 1, 40, 22, 7, 5, 12]
    S = len(prompt) - 1
    aux = target_aux(model, prompt, layers)[:S]                                     # (S, 3d)
    fused = aux @ w["fc.weight"].T
    slot_ids = torch.tensor(prompt[1:])
    with torch.no_grad():
        ref_logits, ref_h = forward(fused, slot_ids, embed)
    e = gen.eagle
    cache = e.new_cache(1, MAX_LEN)
    out = e.forward(slot_ids[None], torch.arange(S)[None], cache.past_len, chain_mask(1, S), S, cache,
                    features=torch.zeros(1, S, 32), aux=aux[None].contiguous())
    assert out.logits.shape == (1, S, K)
    assert torch.allclose(out.logits[0], ref_logits, atol=1e-4), (out.logits[0] - ref_logits).abs().max()
    assert torch.allclose(out.hidden[0], ref_h, atol=1e-4)
    from specrt.export.eagle3 import load_eagle3
    from specrt.export.model import from_hf
    eager = load_eagle3(ckpt, from_hf(model, MAX_LEN), LAYOUTS[name][4])   # the training pass (SDPA) agrees too
    with torch.no_grad():
        assert torch.allclose(eager.train_forward(fused[None], slot_ids[None])[0], ref_h, atol=1e-4)
    cache.write(out.new_kv)
    cache.past_len += S
    own, token = out.hidden[:, -1:].clone(), 17
    out = e.forward(torch.tensor([[token]]), torch.tensor([[S]]), cache.past_len, chain_mask(1, 1), 1, cache,
                    features=own, aux=torch.zeros(1, 1, 96))
    with torch.no_grad():
        ref_next, _ = forward(torch.cat([fused, ref_h[-1:]]), torch.cat([slot_ids, torch.tensor([token])]), embed)
    assert torch.allclose(out.logits[0, -1], ref_next[-1], atol=1e-4)


def test_training_passes_attend_as_tree_levels_do(published):
    """train_eagle3's training-time test: pass k at slot t is the engine's tree level k there (a cache made from the
    target's aux states up to slot t − k, then a chain of the drafter's own outputs); pass 0 is the causal pass."""
    from specrt.export.eagle3 import load_eagle3
    from specrt.export.model import from_hf
    from specrt.export.train.train_eagle3 import ttt_passes
    name, gen, model, ckpt = published
    eager = load_eagle3(ckpt, from_hf(model, MAX_LEN), LAYOUTS[name][4])
    prompt = [3, 9, 1, 40, 22, 7, 5, 12, 30, 2]
    S, e = len(prompt) - 1, gen.eagle
    aux, ids = target_aux(model, prompt, LAYOUTS[name][5])[:S][None], torch.tensor(prompt[1:])[None]
    with torch.no_grad():
        fused = eager.fuse(torch.zeros(1, S, 32), aux)
        passes = ttt_passes(eager, fused, ids, 3)
        assert torch.allclose(passes[0], eager.train_forward(fused, ids), atol=1e-5)
    for k in (1, 2):
        c = S - 1 - k                                     # the last committed slot; level k sits at slot S − 1
        cache = e.new_cache(1, MAX_LEN)
        out = e.forward(ids[:, :c + 1], torch.arange(c + 1)[None], cache.past_len, chain_mask(1, c + 1), c + 1,
                        cache, features=torch.zeros(1, c + 1, 32), aux=aux[:, :c + 1].contiguous())
        for j in range(1, k + 1):
            cache.write(out.new_kv)
            cache.past_len += out.hidden.shape[1]
            out = e.forward(ids[:, c + j:c + j + 1], torch.tensor([[c + j]]), cache.past_len, chain_mask(1, 1), 1,
                            cache, features=out.hidden[:, -1:].clone(), aux=torch.zeros(1, 1, 96))
            assert torch.allclose(out.hidden[0, 0], passes[j][0, c + j], atol=1e-4), (k, j)


def test_draft_ids_map_through_d2t(published, monkeypatch):
    """The first tree level is the drafter's top draft ids, each mapped to target id draft id + d2t[draft id]: the
    scattered map sends them all over the vocabulary (an unmapped id would be the draft id itself)."""
    name, gen, model, ckpt = published
    _, prefix, weights, _, _, layers = LAYOUTS[name]
    w, _, forward = reference_drafter(ckpt, prefix, weights)
    kept = json.loads((gen.directory / "eagle_vocab.json").read_text())["kept_ids"]
    assert kept == (torch.arange(K) + w["d2t"]).tolist() and max(kept) >= K
    proposed = []
    real = EagleDrafter.propose
    monkeypatch.setattr(EagleDrafter, "propose", lambda self, run, gamma: proposed.append(
        (run.host_tokens[0, :run.host_lengths[0]].tolist(), real(self, run, gamma))) or proposed[-1][1])
    gen.eagle.spec["dynamic_tree"] = {"top_k": 3, "depth": 1, "nodes": 3}
    prompt = [3, 9, 1, 40, 22, 7, 5, 12]
    gen.generate(prompt_ids=prompt, max_new_tokens=2, method="eagle", adaptive=False)
    text, proposal = proposed[0]
    embed = w["embed_tokens.weight"] if "embed_tokens.weight" in w else model.model.embed_tokens.weight.detach()
    with torch.no_grad():
        logits, _ = forward(target_aux(model, text, layers)[:-1] @ w["fc.weight"].T, torch.tensor(text[1:]), embed)
    top = logits[-1].topk(3).indices
    assert sorted(proposal.tokens[0].tolist()) == sorted((top + w["d2t"][top]).tolist())


@pytest.mark.parametrize("shape", [dict(top_k=4, depth=4, nodes=12), dict(top_k=1, depth=4, nodes=4),
                                   dict(top_k=6, depth=6, nodes=32)], ids=str)
def test_greedy_equals_autoregressive(published, shape, monkeypatch):
    """With drafts accepted as well as rejected: the random drafter's own proposals are rarely the target's, so each
    run drafts with a suffix cache that holds the first 20 tokens of the target's answer (its chains join the
    drafter's tree, as prompt lookup's do); past them, the drafter catches up over the accepted positions' aux
    states and drafts alone."""
    from specrt.decoding.datastore import SuffixCache
    name, gen, model, _ = published
    gen.eagle.spec["dynamic_tree"] = shape
    for seed in range(2):
        prompt = torch.randint(0, V, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="autoregressive").token_ids[0]
        for adaptive in (False, True):
            monkeypatch.setattr(gen, "suffix_cache", SuffixCache(0.001))
            gen.suffix_cache.add(ref[:20])
            out = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="eagle", adaptive=adaptive)
            assert_same_or_tie(out.token_ids[0], ref, prompt, model)
            assert out.stats["acceptance_rate"] > 0, (adaptive, out.stats)


def test_batch_of_prompts_and_lookup_chains(published):
    """Rows of different prompts decoded together, with prompt lookup's chains (a repeating prompt)."""
    name, gen, model, _ = published
    gen.eagle.spec["dynamic_tree"] = {"top_k": 3, "depth": 4, "nodes": 8}
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3], [9, 30, 9, 30, 9]]
    refs = [gen.generate(prompt_ids=p, max_new_tokens=20, method="autoregressive").token_ids[0] for p in prompts]
    for adaptive in (False, True):
        out = gen.generate(prompt_ids=prompts, max_new_tokens=20, method="eagle", adaptive=adaptive)
        for got, ref, p in zip(out.token_ids, refs, prompts):
            assert_same_or_tie(got, ref, p, model)
        assert adaptive or out.stats["batch_rounds"][3]["speculative"] > 0   # trees over the three rows


def test_distribution_is_the_target_distribution(tmp_path):
    """Sampled with an EAGLE-3 drafter of a reduced draft vocabulary (the rest of the target's ids are never
    proposed): the first three tokens' joint distribution is the target's (chi-square over N samples); top-p runs
    the drafter's device path (the aux states gathered along the accepted path by torch)."""
    from specrt.decoding.sampling import SamplingParams
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    from test_speculative import P_MIN, V as SV, chi_square_p, exact_joint, sample_first3
    model = tiny_model("llama", seed=1, vocab=SV, layers=LAYERS, init=0.3)
    model.save_pretrained(tmp_path / "src")
    ckpt = write_published(tmp_path / "e3", model, "midlayer.", "model.safetensors", {}, vocab=SV, draft_vocab=16)
    export_engines(str(tmp_path / "src"), tmp_path / "engines", max_seq_len=MAX_LEN, log=lambda *_: None,
                   eagle=str(ckpt))
    build(tmp_path / "engines", "onnxruntime", log=lambda *_: None)
    gen = Generator.from_engines(tmp_path / "engines")
    gen.eagle.spec["dynamic_tree"] = {"top_k": 3, "depth": 3, "nodes": 8}
    prompt, kw = [5, 1, 7], dict(temperature=0.7, top_p=0.9)
    out = sample_first3(gen, prompt, "eagle", None, seed=123, **kw)
    assert 0 < out.stats["acceptance_rate"] < 0.9   # acceptances and residuals both happened
    assert chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(**kw))) > P_MIN


def test_int8_fused_drafter_keeps_greedy_output(tmp_path):
    """The default build: the target fused (aux carried through its fused norms), the drafter int8."""
    engines, model, _ = export_set(tmp_path, "eagle-authors", drafter_weights="int8")
    gen = Generator.from_engines(engines)
    assert gen.target.spec["engine"]["fused"]["skip_norm"] > 0
    prompt = [3, 9, 1, 40, 22]
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="autoregressive").token_ids[0]
    assert_same_or_tie(gen.generate(prompt_ids=prompt, max_new_tokens=24, method="eagle").token_ids[0], ref, prompt,
                       model)
    aux = gen.target.run_sequence(prompt, num_logits=1).aux[0]
    assert torch.allclose(aux, target_aux(model, prompt, (2, 4, 5)), atol=1e-4)


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_quantized_target_carries_aux(tmp_path, bits):
    """A quantized target build keeps the aux output: the quantized target's own states at the drafter's layers,
    near the float model's (cosine 0.98 and more with 4-bit weights, 0.999 with 8-bit, where the states entering
    the neighbouring layers reach 0.91 at most), not equal to them; and the output its own. The target's
    weights are smaller than the other tests' (std 0.08): through 8 layers of std 0.3, 4-bit rounding leaves the
    states little of the float model's (cosine 0.34)."""
    from specrt.export.build import build
    engines, model, _ = export_set(tmp_path, "eagle-authors", init=0.08)
    build(engines, "onnxruntime", log=lambda *_: None, target_weights=bits)
    gen = Generator.from_engines(engines)
    prompt = [3, 9, 1, 40, 22]
    aux = gen.target.run_sequence(prompt, num_logits=1).aux[0]
    ref = target_aux(model, prompt, (2, 4, 5))
    cos = torch.nn.functional.cosine_similarity(aux.view(5, 3, 32), ref.view(5, 3, 32), dim=-1)   # (5, 3): layers
    print(f"{bits} aux, cosine with the float model's states entering layers 2, 4, 5: {cos.min(0).values}")
    assert aux.shape == (5, 96) and cos.min() > (0.95 if bits == "int4" else 0.99), cos
    assert (aux - ref).abs().max() > 1e-3   # its own states, not the float model's
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=20, method="autoregressive").token_ids[0]
    assert gen.generate(prompt_ids=prompt, max_new_tokens=20, method="eagle").token_ids[0] == ref


def test_width_graphs_on_the_cpu_provider(published, tmp_path, monkeypatch):
    """CUDA width graphs (built here, run on the CPU provider): the target's aux and the drafter's aux input are
    static buffers of their own; the output is the target's."""
    from specrt.engines.static import StaticWidthEngine
    from specrt.export.build import build
    name, gen, model, _ = published
    cuda = tmp_path / "cuda"
    shutil.copytree(gen.directory, cuda)
    build(cuda, "onnxruntime", log=lambda *_: None, device="cuda", dtype="float32", widths=(1, 2, 4, 8))
    wide = Generator.from_engines(cuda, device="cpu")
    wide.eagle.spec["dynamic_tree"] = {"top_k": 2, "depth": 3, "nodes": 6}
    assert isinstance(wide.eagle, StaticWidthEngine) and isinstance(wide.target, StaticWidthEngine)
    ran = {}
    for w, session in wide.eagle.sessions.items():
        def counted(b, w=w, run=session.run_with_iobinding):
            ran[w] = ran.get(w, 0) + 1
            return run(b)
        monkeypatch.setattr(session, "run_with_iobinding", counted)
    prompt = [3, 9, 1, 40, 22, 7]
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="autoregressive").token_ids[0]
    assert_same_or_tie(wide.generate(prompt_ids=prompt, max_new_tokens=16, method="eagle", adaptive=False)
                       .token_ids[0], ref, prompt, model)
    assert sum(ran.values()) > 0


# ---- what does not fit -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_src(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e3-target")
    model = tiny_model("llama", seed=1, vocab=V, layers=LAYERS)
    model.save_pretrained(tmp / "src")
    return tmp, model


def _export(tmp, src, ckpt, layer_ids=None):
    from specrt.export.pipeline import export_engines
    export_engines(str(src), tmp / "out", max_seq_len=MAX_LEN, log=lambda *_: None, eagle=str(ckpt),
                   eagle_layer_ids=layer_ids)


def test_wrong_hidden_size_is_named(target_src):
    tmp, model = target_src
    ckpt = write_published(tmp / "h48", model, "midlayer.", "model.safetensors", {}, hidden=48)
    with pytest.raises(DrafterMismatchError, match="hidden size 48, the target's is 32"):
        _export(tmp, tmp / "src", ckpt)
    assert not (tmp / "out").exists()


def test_wrong_vocabulary_is_named(target_src):
    tmp, model = target_src
    ckpt = write_published(tmp / "v100", model, "midlayer.", "model.safetensors", {}, vocab=100)
    with pytest.raises(DrafterMismatchError, match="vocabulary of 100 ids .* has 64"):
        _export(tmp, tmp / "src", ckpt)
    far = write_published(tmp / "far", model, "midlayer.", "model.safetensors", {},
                          d2t=torch.full((K,), 60))   # draft id 39 -> target id 99
    with pytest.raises(DrafterMismatchError, match="target id 99, the target's vocabulary has 64"):
        _export(tmp, tmp / "src", far)


def test_layer_ids_out_of_range_and_ambiguous(target_src):
    tmp, model = target_src
    ids = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 20]}}
    ckpt = write_published(tmp / "ids", model, "layers.0.", "model.safetensors", ids)
    with pytest.raises(InputError, match=r"vLLM reads as layer inputs and SGLang as layer outputs .*--eagle-layer-ids"):
        _export(tmp, tmp / "src", ckpt)
    with pytest.raises(DrafterMismatchError, match=r"target layers \[2, 4, 21\], the target has 8 layers"):
        _export(tmp, tmp / "src", ckpt, "outputs")
    with pytest.raises(InputError, match="'sideways'"):
        _export(tmp, tmp / "src", ckpt, "sideways")


def test_pickles_beyond_tensors_are_refused(target_src):
    tmp, model = target_src
    ckpt = write_published(tmp / "pickle", model, "midlayer.", "pytorch_model.bin", {})
    state = torch.load(ckpt / "pytorch_model.bin", weights_only=True)
    state["extra"] = np.arange(3)   # a numpy array: weights_only refuses to build it
    torch.save(state, ckpt / "pytorch_model.bin")
    with pytest.raises(InputError, match="not a plain state dict of tensors"):
        _export(tmp, tmp / "src", ckpt)


def test_engine_sets_without_aux_still_load(tmp_path):
    """A target exported without an EAGLE-3 drafter has no aux output (engine sets made before it, too)."""
    import onnx
    from conftest import export_tiny
    out, model = export_tiny(tmp_path, "llama")
    graph = onnx.load(str(out / "target.onnx"), load_external_data=False).graph
    assert "aux" not in {o.name for o in graph.output}
    gen = Generator.from_engines(out)
    assert gen.target.run_sequence([1, 2, 3]).aux is None
    assert len(gen.generate(prompt_ids=[1, 2, 3], max_new_tokens=5, method="autoregressive").token_ids[0]) == 5


@pytest.fixture(scope="module")
def authors(tmp_path_factory):
    engines, model, _ = export_set(tmp_path_factory.mktemp("authors"), "eagle-authors")
    return Generator.from_engines(engines), model


def test_tune_and_serve(authors, tmp_path, monkeypatch):
    """`specrt tune`'s tree shapes time the drafter with its aux input, and it picks the shape with the most tokens
    a second by its cost model; `specrt serve` decodes concurrent EAGLE-3 streams together, each the target's greedy
    output."""
    from concurrent.futures import ThreadPoolExecutor

    from specrt.decoding import calibrate
    from specrt.decoding.datastore import SuffixCache
    from specrt.decoding.eagle import DynamicTree, tune
    from test_serve import client, running_server
    gen, model = authors
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    monkeypatch.setattr(gen, "suffix_cache", SuffixCache(0.001))
    for p in prompts:   # the target's answers go into the suffix cache: lookup chains fill deep trees
        gen.generate(prompt_ids=p, max_new_tokens=8, method="autoregressive")
    shapes = (DynamicTree(2, 4, 8), DynamicTree(1, 1, 1))
    for costs, best in (({1: 1.0, 9: 1.0}, shapes[0]), ({1: 1.0, 9: 9.0}, shapes[1])):
        # the target's passes timed (seconds) at 1 s whatever their size, then at 1 s a token: the deep tree gives
        # more tokens a round, fewer a second where each node costs a pass (the drafter's passes, timed here, and
        # the loop's time take milliseconds)
        monkeypatch.setattr(calibrate, "verify_costs", lambda gen, sizes: costs)
        lines = []
        assert tune(gen, prompts, shapes, new_tokens=8, log=lines.append) == best, lines
    prompts = [[1 + i, 2 * i + 3, 5, i, 7 + i][: 2 + i % 4] for i in range(4)]
    with running_server(gen.directory, tmp_path / "server.log", "--model-name", "x", "--threads", "1") as (url, _):
        api = client(url)

        def run(prompt):
            return api.completions.create(model="x", prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"specrt": {"method": "eagle"}})
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(run, prompts))
    for prompt, out in zip(prompts, outs):
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="autoregressive").token_ids[0]
        assert out.specrt["method"] == "eagle"
        assert_same_or_tie(out.choices[0].token_ids, ref, prompt, model)


def test_train_eagle3_end_to_end(tmp_path):
    """train_eagle3 on a tiny Qwen2 target (no tokenizer: seeded prompts; a draft vocabulary smaller than the
    target's), a few steps on the CPU that learn it, then export, build and lossless generation; a rerun resumes.
    The target's embeddings are scaled up (x300) over what its 8 layers add, so that its next token hangs mostly on
    the last one (its greedy answers fall into short loops, with variations): 20 steps take the held-out agreement
    with its greedy tokens from the untrained drafter's (the same run at lr 0) to most of them."""
    from safetensors.torch import load_file
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    from specrt.export.train.train_eagle3 import train_eagle3
    model = tiny_model("qwen2", seed=2, vocab=V, layers=LAYERS, init=0.3)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(300)
    model.save_pretrained(tmp_path / "src")
    opts = dict(prompts=12, max_new_tokens=16, kept_vocab=48, batch_tokens=256, save_every=10, max_len=MAX_LEN,
                lr=1e-2, warmup=1)
    lines = []
    out = train_eagle3(str(tmp_path / "src"), tmp_path / "drafter", steps=20, log=lines.append, **opts)
    record = json.loads((out / "training.json").read_text())
    assert record["steps_done"] == 20 and [h["step"] for h in record["history"]] == [10, 20]
    assert "labels: the target's top-16, computed with the features" in lines   # no --data: no teacher files
    assert "EAGLE-3 drafter" in (out / "README.md").read_text()
    again = []
    train_eagle3(str(tmp_path / "src"), tmp_path / "drafter", steps=20, log=again.append, **opts)
    assert again[0] == "resumed at step 20"

    def same_data(name):   # another run's work directory: this one's data and features, not its checkpoint
        shutil.copytree(tmp_path / "drafter-work", tmp_path / f"{name}-work", ignore=shutil.ignore_patterns("ckpt*"))
        return tmp_path / name
    untrained = train_eagle3(str(tmp_path / "src"), same_data("untrained"), steps=1, log=lambda *_: None,
                             **{**opts, "lr": 0.0})
    before = json.loads((untrained / "training.json").read_text())["history"][-1]
    first, last = record["history"]
    print(f"held-out agreement {before['agreement']:.3f} untrained, {last['agreement']:.3f} after 20 steps")
    assert before["agreement"] < 0.15 and last["agreement"] > 0.5   # 1 held-out row of 12: 16 tokens
    assert before["train_loss"] > first["train_loss"] > last["train_loss"]
    # --init: a warm start from those weights (lr 0 keeps them)
    warm = train_eagle3(str(tmp_path / "src"), same_data("warm"), steps=1, log=lambda *_: None,
                        **{**opts, "lr": 0.0, "init": str(out)})
    before, after = load_file(out / "model.safetensors"), load_file(warm / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(InputError, match="draft vocabulary differ"):
        train_eagle3(str(tmp_path / "src"), same_data("other"), steps=1, log=lambda *_: None,
                     **{**opts, "kept_vocab": 40, "init": str(out)})
    export_engines(str(tmp_path / "src"), tmp_path / "engines", max_seq_len=MAX_LEN, log=lambda *_: None,
                   eagle=str(out))
    build(tmp_path / "engines", "onnxruntime", log=lambda *_: None)
    gen = Generator.from_engines(tmp_path / "engines")
    assert gen.manifest["models"]["eagle"]["output_ids"]["count"] == 48
    for seed in range(2):
        prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=20, method="autoregressive").token_ids[0]
        out_ids = gen.generate(prompt_ids=prompt, max_new_tokens=20, method="eagle", adaptive=False).token_ids[0]
        assert_same_or_tie(out_ids, ref, prompt, model)


def test_prompt_chunks_fill_the_history_with_aux_states(authors):
    """A prompt prefilled in chunks: the drafter's history holds the target's aux states of every position."""
    from specrt.decoding.batch import Batch
    gen, model = authors
    chunked = Generator.from_engines(gen.directory, prefill_chunk=4)
    prompt = [(7 * i + 3) % V for i in range(19)]
    batch = Batch(chunked, 1, method="eagle")
    batch.add(prompt, 8)
    assert torch.allclose(batch.drafter._history[0, :19], target_aux(model, prompt, (2, 4, 5)), atol=1e-4)
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="autoregressive").token_ids[0]
    assert_same_or_tie(chunked.generate(prompt_ids=prompt, max_new_tokens=16, method="eagle").token_ids[0], ref,
                       prompt, model)


def test_aux_stays_float32_in_float16_cuda_graphs(authors, tmp_path):
    """CUDA float16 engines: the target's aux output and the drafter's aux input stay float32 (as hidden does)."""
    import onnx
    from onnx import TensorProto
    from specrt.export.build import build
    gen, _ = authors
    cuda = tmp_path / "cuda16"
    shutil.copytree(gen.directory, cuda)
    build(cuda, "onnxruntime", log=lambda *_: None, device="cuda", dtype="float16", widths=(2,))
    for f, kind in (("target.cuda.onnx", "output"), ("target.w2.cuda.onnx", "output"), ("eagle.cuda.onnx", "input"),
                    ("eagle.w2.cuda.onnx", "input")):
        g = onnx.load(str(cuda / f), load_external_data=False).graph
        types = {i.name: i.type.tensor_type.elem_type for i in getattr(g, kind)}
        assert types["aux"] == TensorProto.FLOAT, f


def test_specrt_train_eagle3(tmp_path):
    """`specrt train eagle3 --target` a tiny Qwen2 checkpoint with its tokenizer: data, a few steps on the CPU, the
    model card; then export, build and the target's greedy output."""
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    from test_train import DATA, tiny_tokenizer, train
    tok = tiny_tokenizer(384)
    model = tiny_model("qwen2", seed=4, vocab=len(tok), layers=LAYERS, init=0.3,
                       eos=tok.convert_tokens_to_ids("<|im_end|>"))
    model.save_pretrained(tmp_path / "qwen2")
    tok.save_pretrained(tmp_path / "qwen2")
    output = train("eagle3", "--target", tmp_path / "qwen2", "--out", tmp_path / "e3", "--steps", 2,
                   "--batch-tokens", 512, "--save-every", 1, "--kept-vocab", 300, "--layers", "1,3,6", *DATA)
    assert "labels: the target's top-16 in" in output   # the data kind's teacher files, not computed again
    record = json.loads((tmp_path / "e3" / "training.json").read_text())
    assert (record["steps_done"], record["sessions"]) == (2, [[0, 2]])
    assert "eagle3 drafter" in (tmp_path / "e3" / "README.md").read_text()
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["specrt_aux_layer_inputs"] == [1, 3, 6] and config["draft_vocab_size"] == 300
    out = export_engines(str(tmp_path / "qwen2"), tmp_path / "engines", eagle=str(tmp_path / "e3"), max_seq_len=64,
                         log=lambda *_: None)
    build(out, "onnxruntime", log=lambda *_: None)
    gen = Generator.from_engines(out)
    assert gen.manifest["models"]["target"]["aux"]["layers"] == [1, 3, 6]
    prompt = [5, 17, 90, 200, 3]
    plain = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="autoregressive").token_ids[0]
    assert_same_or_tie(gen.generate(prompt_ids=prompt, max_new_tokens=24, method="eagle", adaptive=False)
                       .token_ids[0], plain, prompt, model)


def test_acceptance_check_reads_target_ids(published):
    """The acceptance measured after import guesses with target ids (draft id + d2t), as the runtime proposes."""
    from specrt.export.acceptance import whole_pass
    from specrt.export.eagle3 import load_eagle3, proposer
    from specrt.export.model import from_hf
    name, _, model, ckpt = published
    _, prefix, weights, _, layer_ids, layers = LAYOUTS[name]
    target = from_hf(model, MAX_LEN)
    drafter = load_eagle3(ckpt, target, layer_ids)
    target.aux_layers = drafter.aux_layers
    tokens = torch.tensor([[3, 9, 1, 40, 22, 7, 5, 12]])
    with torch.no_grad():
        guesses = proposer(drafter)(tokens, whole_pass(target, tokens))
    w, _, forward = reference_drafter(ckpt, prefix, weights)
    embed = w["embed_tokens.weight"] if "embed_tokens.weight" in w else model.model.embed_tokens.weight.detach()
    with torch.no_grad():
        logits, _ = forward(target_aux(model, tokens[0].tolist(), layers)[:-1] @ w["fc.weight"].T, tokens[0, 1:], embed)
    ids = logits.argmax(-1)
    assert guesses.tolist() == (ids + w["d2t"][ids]).tolist()
