"""Drafters as their authors publish them (EAGLE-1/2 of SafeAILab/EAGLE, Medusa heads of FasterDecoding): each
checkpoint is written here in exactly that layout (file names, weight names and shapes, config keys), imported by
`specrt export`, built, and its engine checked against the published architecture written out below in plain torch
from the papers and reference code (not from specrt's modules)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_model
from greedy_check import assert_same_or_tie
from specrt.decoding.drafters import chain_mask
from specrt.decoding.generate import Generator
from specrt.errors import CheckpointError, DrafterMismatchError
from specrt.export.eagle import load_eagle
from specrt.export.medusa import load_heads
from specrt.export.model import from_hf

V, MAX_LEN = 64, 48


# ---- the published architectures, written out --------------------------------------------------------------------

def rms_norm(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotate(x, positions, theta):
    """RoPE over the last dim of x (..., S, D): pairs (i, i + D/2) rotated by position * theta^(-2i/D)."""
    D = x.shape[-1]
    angles = positions[:, None].double() * theta ** (-torch.arange(0, D, 2).double() / D)   # (S, D/2)
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


def eagle1_reference(w: dict, config: dict, embed, lm_head, features, tokens):
    """SafeAILab/EAGLE `cnets1.Model` (EAGLE-1/2): slot t reads the target's feature f_t and the embedding of token
    t + 1, fused by fc over [embedding; feature]; one Llama decoder layer without the input layernorm, causal over the
    slots at positions 0.. S-1; no final norm; the target's LM head. features (S, d), tokens (S,) -> logits (S, V)."""
    S, d = features.shape
    H, Hkv = config["num_attention_heads"], config["num_key_value_heads"]
    D = d // H
    x = torch.cat([embed[tokens], features], -1) @ w["fc.weight"].T
    if config.get("bias", True):
        x = x + w["fc.bias"]
    p = "layers.0."

    def proj(name, v):
        y = v @ w[p + f"self_attn.{name}.weight"].T
        return y + w[p + f"self_attn.{name}.bias"] if config.get("qkv_bias") else y

    pos = torch.arange(S)
    q = rotate(proj("q_proj", x).view(S, H, D).transpose(0, 1), pos, config["rope_theta"])        # (H, S, D)
    k = rotate(proj("k_proj", x).view(S, Hkv, D).transpose(0, 1), pos, config["rope_theta"])      # (Hkv, S, D)
    v = proj("v_proj", x).view(S, Hkv, D).transpose(0, 1)                                         # (Hkv, S, D)
    k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)                    # (H, S, D)
    scores = (q @ k.transpose(1, 2)) / D ** 0.5
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(0, 1).reshape(S, d)
    h = x + att @ w[p + "self_attn.o_proj.weight"].T
    m = rms_norm(h, w[p + "post_attention_layernorm.weight"], config["rms_norm_eps"])
    silu = torch.nn.functional.silu
    h = h + (silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ \
        w[p + "mlp.down_proj.weight"].T
    return h @ lm_head.T


def medusa_reference(w: dict, lm_head, hidden):
    """FasterDecoding `medusa_model.py`: head h is ResBlocks x + SiLU(W x + b) on the target's last hidden state,
    then its own LM head `{h}.{L}.weight` (the legacy heads: the target's). hidden (M, d) -> (M, K, V)."""
    out, h = [], 0
    while f"{h}.0.linear.weight" in w:
        x, layer = hidden, 0
        while f"{h}.{layer}.linear.weight" in w:
            x = x + torch.nn.functional.silu(x @ w[f"{h}.{layer}.linear.weight"].T + w[f"{h}.{layer}.linear.bias"])
            layer += 1
        out.append(x @ w.get(f"{h}.{layer}.weight", lm_head).T)
        h += 1
    return torch.stack(out, 1)


# ---- checkpoints in the published layouts ------------------------------------------------------------------------

def eagle1_config(target, **over) -> dict:
    """config.json as the EAGLE authors ship it (their Llama-3 drafter's keys, with the target's sizes)."""
    c = target.config
    return {"architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": c.hidden_size, "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
            "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "pad_token_id": 0,
            "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16",
            "transformers_version": "4.28.1", "use_cache": True, "vocab_size": c.vocab_size,
            "rope_theta": c.rope_parameters["rope_theta"], **over}


def eagle1_weights(config: dict, seed: int, embed=None) -> dict:
    """Random weights under the published names and shapes: fc [d, 2d] (+ bias), layer 0 without input_layernorm."""
    g = torch.Generator().manual_seed(seed)
    d, i = config["hidden_size"], config["intermediate_size"]
    D = d // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * D, config["num_key_value_heads"] * D
    shapes = {"fc.weight": (d, 2 * d), "layers.0.self_attn.q_proj.weight": (q, d),
              "layers.0.self_attn.k_proj.weight": (kv, d), "layers.0.self_attn.v_proj.weight": (kv, d),
              "layers.0.self_attn.o_proj.weight": (d, q), "layers.0.mlp.gate_proj.weight": (i, d),
              "layers.0.mlp.up_proj.weight": (i, d), "layers.0.mlp.down_proj.weight": (d, i)}
    if config.get("bias", True):
        shapes["fc.bias"] = (d,)
    if config.get("qkv_bias"):
        shapes.update({"layers.0.self_attn.q_proj.bias": (q,), "layers.0.self_attn.k_proj.bias": (kv,),
                       "layers.0.self_attn.v_proj.bias": (kv,)})
    w = {k: torch.randn(s, generator=g) * 0.2 for k, s in shapes.items()}
    w["layers.0.post_attention_layernorm.weight"] = 1 + 0.3 * torch.randn(d, generator=g)
    if embed is not None:
        w["embed_tokens.weight"] = embed.detach().clone()
    return w


def write_eagle1(directory, config: dict, weights: dict, pickled: bool = False):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if pickled:
        torch.save(weights, directory / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "model.safetensors"))
    return directory


def medusa_weights(d: int, heads: int, layers: int, vocab: int | None, seed: int, lm_head=None,
                   scale: float = 0.3) -> dict:
    """`{h}.{l}.linear.weight/bias` (random, `scale`) and, unless `vocab` is None (the legacy heads),
    `{h}.{layers}.weight`: random, or `lm_head` (the target's) plus noise, as Medusa's training starts them."""
    g = torch.Generator().manual_seed(seed)
    w = {}
    for h in range(heads):
        for layer in range(layers):
            w[f"{h}.{layer}.linear.weight"] = torch.randn(d, d, generator=g) * scale
            w[f"{h}.{layer}.linear.bias"] = torch.randn(d, generator=g) * scale
        if vocab is not None:
            noise = torch.randn(vocab, d, generator=g)
            w[f"{h}.{layers}.weight"] = noise * 0.5 if lm_head is None else lm_head.detach() + noise * 0.05
    return w


def write_medusa(directory, weights: dict, config_heads: int, layers: int, pt: bool = False):
    """medusa_lm_head.safetensors (or .pt) and the config.json that `MedusaConfig.save_pretrained` writes."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "base_model_name_or_path": "lmsys/vicuna-7b-v1.3", "medusa_num_heads": config_heads,
        "medusa_num_layers": layers, "transformers_version": "4.34.0"}, indent=2))
    if pt:
        torch.save(weights, directory / "medusa_lm_head.pt")
    else:
        save_file(weights, str(directory / "medusa_lm_head.safetensors"))
    return directory


def export_built(tmp, model, name: str, log=None, **drafters):
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    model.save_pretrained(tmp / f"{name}-src")
    out = tmp / name
    export_engines(str(tmp / f"{name}-src"), out, max_seq_len=MAX_LEN, log=log or (lambda *_: None),
                   **{k: str(v) for k, v in drafters.items()})
    build(out, "onnxruntime", log=lambda *_: None, drafter_weights="float32")
    return Generator.from_engines(out)


# ---- EAGLE-1/2 ---------------------------------------------------------------------------------------------------

EAGLE_CASES = {   # the Llama drafter ships its embed_tokens copy in safetensors; the Qwen2 one is pickled
    "llama": dict(over={}, pickled=False, embed=True),
    "qwen2": dict(over={"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "qkv_bias": True,
                        "bias": False}, pickled=True, embed=False),
}


@pytest.fixture(scope="module", params=sorted(EAGLE_CASES))
def eagle1(request, tmp_path_factory):
    arch, case = request.param, EAGLE_CASES[request.param]
    tmp = tmp_path_factory.mktemp(f"eagle1-{arch}")
    model = tiny_model(arch, seed=1, vocab=V, init=0.3, layers=2)
    config = eagle1_config(model, **case["over"])
    weights = eagle1_weights(config, seed=7, embed=model.model.embed_tokens.weight if case["embed"] else None)
    src = write_eagle1(tmp / "drafter", config, weights, case["pickled"])
    return export_built(tmp, model, "engines", eagle=src), model, config, weights


def test_eagle1_engine_matches_the_published_architecture(eagle1):
    gen, model, config, w = eagle1
    assert gen.manifest["models"]["eagle"]["layout"] == "eagle"
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (1, 10), generator=g)
    with torch.no_grad():
        feats = model.model(tokens).last_hidden_state                         # (1, 10, d): after the final norm
        want = eagle1_reference(w, config, model.model.embed_tokens.weight, model.lm_head.weight, feats[0, :9],
                                tokens[0, 1:])                                  # (9, V)
        cache = gen.eagle.new_cache(1, MAX_LEN)
        first = gen.eagle.forward(tokens[:, 1:7], torch.arange(6)[None], cache.past_len, chain_mask(1, 6), 6, cache,
                                  features=feats[:, :6])
        first_logits = first.logits[0].clone()   # the engine's output buffer is reused by the next pass
        cache.write(first.new_kv)
        cache.past_len += 6
        then = gen.eagle.forward(tokens[:, 7:], torch.arange(6, 9)[None], cache.past_len, chain_mask(1, 3), 3,
                                 cache, features=feats[:, 6:9])
    got = torch.cat([first_logits, then.logits[0]])
    assert (got - want).abs().max() < 1e-4


def test_eagle1_greedy_equals_autoregressive(eagle1):
    gen, model, _, _ = eagle1
    for seed in range(2):
        prompt = torch.randint(0, V, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="eagle", adaptive=False)
        assert_same_or_tie(out.token_ids[0], ref, prompt, model)


def test_eagle1_that_does_not_fit_is_refused(tmp_path):
    model = tiny_model("llama", seed=1, vocab=V)
    target = from_hf(model, MAX_LEN)
    wide = tiny_model("llama", seed=1, vocab=V, hidden=64)
    with pytest.raises(DrafterMismatchError, match="hidden size 64 vs the target's 32"):
        load_eagle(write_eagle1(tmp_path / "wide", eagle1_config(wide), eagle1_weights(eagle1_config(wide), 0)),
                   target)
    config = eagle1_config(model, vocab_size=2 * V)
    with pytest.raises(DrafterMismatchError, match=f"vocabulary size {2 * V} vs the target's {V}"):
        load_eagle(write_eagle1(tmp_path / "vocab", config, eagle1_weights(config, 0)), target)
    from specrt.export.pipeline import export_engines
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(DrafterMismatchError, match=f"vocabulary size {2 * V}"):   # and the export leaves nothing
        export_engines(str(tmp_path / "src"), tmp_path / "out", max_seq_len=MAX_LEN, log=lambda *_: None,
                       eagle=str(tmp_path / "vocab"))
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    config = eagle1_config(model)
    with pytest.raises(DrafterMismatchError, match=rf"embed_tokens \({2 * V}, 32\) vs the target's \({V}, 32\)"):
        load_eagle(write_eagle1(tmp_path / "embed", config, eagle1_weights(config, 0, torch.zeros(2 * V, 32))),
                   target)
    config = eagle1_config(model, qkv_bias=True)   # a Qwen2 drafter for a Llama target
    with pytest.raises(DrafterMismatchError, match="qkv_bias True vs the target's False"):
        load_eagle(write_eagle1(tmp_path / "qwen", config, eagle1_weights(config, 0)), target)
    config = eagle1_config(model)
    weights = eagle1_weights(config, 0)
    del weights["layers.0.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match="missing .*up_proj"):
        load_eagle(write_eagle1(tmp_path / "missing", config, weights), target)


class _RunsCode:
    """A pickle that would call open() on load (what weights_only=True exists to refuse)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_pickles_that_hold_more_than_tensors_are_refused(tmp_path):
    model = tiny_model("llama", seed=1, vocab=V)
    target = from_hf(model, MAX_LEN)
    config = eagle1_config(model)
    marker = tmp_path / "ran"
    weights = {**eagle1_weights(config, 0), "extra": _RunsCode(marker)}
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_eagle(write_eagle1(tmp_path / "code", config, weights, pickled=True), target)
    assert not marker.exists()
    weights = {**eagle1_weights(config, 0), "step": 3}   # loads under weights_only, but is not a weight
    with pytest.raises(CheckpointError, match="expected a flat map of weight names to tensors, found 'step': int"):
        load_eagle(write_eagle1(tmp_path / "int", config, weights, pickled=True), target)
    heads = write_medusa(tmp_path / "medusa", {}, 2, 1, pt=True)
    torch.save({"0.0.linear.weight": _RunsCode(marker)}, heads / "medusa_lm_head.pt")
    with pytest.raises(CheckpointError, match="medusa_lm_head.pt: refused"):
        load_heads(heads, target)
    assert not marker.exists()


# ---- acceptance after import -------------------------------------------------------------------------------------

def agreeing_drafter(model):
    """An EAGLE-1/2 drafter built to agree with a one-layer target `model` whose embeddings have unit RMS (its
    input layernorm then changes nothing, its norms being at weight 1): the drafter's layer 0 is the target's layer 0,
    and fc passes the embedding half through and drops the feature half. Slot t then computes what the target
    computes at position t + 1, but for the first token, which only the target sees: it guesses token t + 2 as the
    target does. Returns (config, weights, the same weights with fc's halves in the other order)."""
    d = model.config.hidden_size
    layer = {f"layers.0.{k}": v.detach().clone() for k, v in model.model.layers[0].state_dict().items()
             if not k.startswith("input_layernorm")}
    right = {"fc.weight": torch.cat([torch.eye(d), torch.zeros(d, d)], 1), **layer}      # [embedding; feature]
    swapped = {"fc.weight": torch.cat([torch.zeros(d, d), torch.eye(d)], 1), **layer}
    return eagle1_config(model, bias=False), right, swapped


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agreeing")
    model = tiny_model("llama", seed=3, vocab=V, layers=1, init=0.3)
    with torch.no_grad():
        e = model.model.embed_tokens.weight
        e.mul_(torch.rsqrt(e.pow(2).mean(-1, keepdim=True)))
    config, right, swapped = agreeing_drafter(model)
    logged = []
    gen = export_built(tmp, model, "engines", log=logged.append, eagle=write_eagle1(tmp / "right", config, right))
    return gen, model, logged, write_eagle1(tmp / "swapped", config, swapped), tmp


def test_eagle1_accepted_drafts_keep_greedy_output(agreeing):
    gen, model, _, _, _ = agreeing
    accepted = 0
    for seed in range(2):
        prompt = torch.randint(0, V, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="eagle", adaptive=False)
        assert_same_or_tie(out.token_ids[0], ref, prompt, model)
        accepted += out.stats["acceptance_rate"] * out.stats["rounds"]
    assert accepted > 10   # accepted paths (and their cache compaction) ran


def test_acceptance_warns_on_swapped_fc_halves(agreeing):
    from specrt.export.pipeline import export_engines
    gen, _, logged, swapped, tmp = agreeing
    rates = {"right": gen.manifest["models"]["eagle"]["acceptance"]["first_draft_token"]}
    assert not any(line.startswith("WARNING") for line in logged) and "warning" not in \
        gen.manifest["models"]["eagle"]["acceptance"]
    logged = []
    export_engines(str(tmp / "engines-src"), tmp / "swapped-engines", max_seq_len=MAX_LEN, log=logged.append,
                   eagle=str(swapped))
    entry = json.loads((tmp / "swapped-engines" / "manifest.json").read_text())["models"]["eagle"]["acceptance"]
    rates["swapped"] = entry["first_draft_token"]
    assert [line for line in logged if line.startswith("WARNING")] == [entry["warning"]]
    assert "fc's halves in the wrong order" in entry["warning"]
    print(f"first-draft-token acceptance: {rates}")
    assert rates["right"] > 0.6 and rates["swapped"] < 0.1


# ---- Medusa ------------------------------------------------------------------------------------------------------

MEDUSA_CASES = {   # published heads (own LM heads; config.json says 2 of the 3 heads), legacy heads (.pt, 2 layers)
    "medusa_lm_head.safetensors": dict(heads=3, config_heads=2, layers=1, own=True, pt=False),
    "legacy .pt": dict(heads=2, config_heads=2, layers=2, own=False, pt=True),
}


@pytest.fixture(scope="module", params=sorted(MEDUSA_CASES))
def medusa(request, tmp_path_factory):
    """Heads near where Medusa's training starts them: small random residual blocks, each own LM head the target's
    plus noise (so that an engine that read the target's in its place would show). They guess token t + 1 again
    for token t + 2, which this target's greedy text often repeats: some of their drafts are accepted."""
    case = MEDUSA_CASES[request.param]
    tmp = tmp_path_factory.mktemp("medusa")
    model = tiny_model("llama", seed=1, vocab=V, init=0.3)
    w = medusa_weights(model.config.hidden_size, case["heads"], case["layers"], V if case["own"] else None, seed=4,
                       lm_head=model.lm_head.weight, scale=0.1)
    src = write_medusa(tmp / "heads", w, case["config_heads"], case["layers"], case["pt"])
    logged = []
    return export_built(tmp, model, "engines", log=logged.append, medusa=src), model, w, case, logged


def test_medusa_engine_matches_the_published_architecture(medusa):
    gen, model, w, case, logged = medusa
    entry = gen.manifest["models"]["medusa"]
    assert entry["layout"] == "medusa" and entry["num_heads"] == gen.medusa.num_heads == case["heads"]
    assert any("medusa_num_heads 2" in line and f"hold {case['heads']} heads" in line for line in logged) == \
        (case["heads"] != case["config_heads"])
    rate, positions = first_draft_acceptance(model, w)
    measured = entry["acceptance"]
    assert rate > 0 and {k: measured[k] for k in ("first_draft_token", "positions", "prompts")} == {
        "first_draft_token": round(rate, 4), "positions": positions, "prompts": 4}
    assert ("warning" in measured) == (rate < 0.1)   # a rate this low is worth a warning
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    got = gen.medusa.forward(hidden, torch.zeros(5, case["heads"], dtype=torch.int64))
    with torch.no_grad():
        want = medusa_reference(w, model.lm_head.weight, hidden)
    assert got.shape == want.shape == (5, case["heads"], V)
    assert (got - want).abs().max() < 1e-4


def first_draft_acceptance(model, w: dict) -> tuple[float, int]:
    """What `specrt export` measures after import, computed here with transformers and the reference above: the
    export's prompts (8 seeded random ids each, the target having no tokenizer) continued greedily for 12 tokens; at
    every generated position t, whether head 0's top guess on the hidden state at t is token t + 2. -> (share,
    positions)."""
    g = torch.Generator().manual_seed(0)
    hits = positions = 0
    for _ in range(4):
        ids = torch.randint(0, V, (8,), generator=g).tolist()
        with torch.no_grad():
            for _ in range(12):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]              # (20, d)
            guesses = medusa_reference(w, model.lm_head.weight, hidden)[:, 0].argmax(-1)   # (20,)
        t = torch.arange(7, len(ids) - 2)
        hits += int((guesses[t] == torch.tensor(ids)[t + 2]).sum())
        positions += len(t)
    return hits / positions, positions


def test_medusa_greedy_equals_autoregressive(medusa):
    """With drafts accepted (the heads guess the target's repeats) and rejected."""
    gen, model, _, _, _ = medusa
    for seed in range(2):
        prompt = torch.randint(0, V, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="medusa")
        assert_same_or_tie(out.token_ids[0], ref, prompt, model)
        assert 0 < out.stats["acceptance_rate"] < 1, out.stats


def test_medusa_heads_that_do_not_fit_are_refused(tmp_path):
    target = from_hf(tiny_model("llama", seed=1, vocab=V), MAX_LEN)
    with pytest.raises(DrafterMismatchError, match="hidden size 64 vs the target's 32"):
        load_heads(write_medusa(tmp_path / "wide", medusa_weights(64, 2, 1, V, 0), 2, 1), target)
    with pytest.raises(DrafterMismatchError, match=f"vocabulary size {2 * V} vs the target's {V}"):
        load_heads(write_medusa(tmp_path / "vocab", medusa_weights(32, 2, 1, 2 * V, 0), 2, 1), target)
    w = medusa_weights(32, 2, 1, V, 0)
    del w["1.0.linear.bias"]
    with pytest.raises(CheckpointError, match=r"missing \['1.0.linear.bias'\]"):
        load_heads(write_medusa(tmp_path / "missing", w, 2, 1), target)


def test_no_acceptance_check_records_that_it_was_skipped(tmp_path):
    """`--no-acceptance-check`: the drafter is exported unmeasured, and the manifest says so (no rate made up)."""
    from specrt.export.pipeline import export_engines
    model = tiny_model("llama", seed=1, vocab=V, init=0.3)
    w = medusa_weights(model.config.hidden_size, 2, 1, V, seed=4)
    src = write_medusa(tmp_path / "heads", w, 2, 1, False)
    model.save_pretrained(tmp_path / "t")
    logged = []
    export_engines(str(tmp_path / "t"), tmp_path / "e", max_seq_len=MAX_LEN, log=logged.append, medusa=str(src),
                   check_drafters=False)
    entry = json.loads((tmp_path / "e" / "manifest.json").read_text())["models"]["medusa"]
    assert entry["acceptance"] == {"skipped": "--no-acceptance-check"}
    assert not any("first draft tokens accepted" in line for line in logged)
