"""EAGLE-style feature drafter: decoder layers of the target's shape (one by default) over [feature; next-token
embedding].

Slot t reads the target's feature f_t (its last hidden state at position t, after the final norm: the `hidden`
output of the target graph) and the embedding of token t + 1, fused by a linear layer 2d -> d, and predicts
the feature at t + 1; the target's own LM head (restricted to the drafter's kept ids, if it has a
`specrt_vocab.json`) turns it into the distribution of token t + 2. At draft time the drafter reads its own
predicted features below the first tree level. A target checkpoint's MTP module (specrt.export.mtp) is this drafter
with an RMSNorm on each input of `fc` and one before the LM head (`mtp=True`).

Checkpoint directory: `eagle_config.json` (the layers' shape: hidden_size, intermediate_size, num_heads,
num_kv_heads, head_dim, which must equal the target's, and num_layers, 1 if absent), `eagle.safetensors` (`fc.*`,
`layers.N.*`; the embeddings and the LM head are not stored, they come from the target at export) and optionally
`specrt_vocab.json`.

Graph (the engine contract, L layers): input_ids, position_ids, past_len, tree_mask, num_logits, `features`
[B, S, d], k_cache_0, v_cache_0, ... -> logits [B, num_logits, V], hidden [B, S, d] (the predicted features),
k_new_0, v_new_0, ... A drafter with kept ids outputs their K logits only ([B, num_logits, K]); the engine set
records the ids (`output_ids` in the manifest, a JSON file beside the graph), and the runtime maps the columns
back. Filling a -inf row of the whole vocabulary and scattering into it took a quarter of a drafter pass here.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from specrt.errors import CheckpointError, DrafterMismatchError, InputError
from specrt.export.model import Block, RMSNorm, SpecModel, full_vocab, plain_layers, rope

CONFIG, WEIGHTS = "eagle_config.json", "eagle.safetensors"
PUBLISHED_CONFIG, PUBLISHED_WEIGHTS = "config.json", ("model.safetensors", "pytorch_model.bin")
SHAPE = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")
TRAINED = ("fc.", "layers.", "enorm.", "hnorm.", "norm.")


class EagleModel(nn.Module):
    """The trained part (`fc`, `layers`) on the target's frozen embeddings, LM head and rope tables."""

    def __init__(self, target: SpecModel, vocab_subset: list[int] | None = None, num_layers: int = 1,
                 input_norm: bool = True, mtp: bool = False, **layer):
        """`input_norm` False: layer 0 reads the fused input as it is (the EAGLE-1/2 drafters' layer has no input
        layernorm); `mtp`: a target's MTP module (see specrt.export.mtp): an RMSNorm on each input of `fc`
        (`hnorm` on the feature, `enorm` on the embedding) and one (`norm`) between the layers and the LM head,
        the `hidden` output staying before it; `layer`: ModelArgs fields of the layers that differ from the
        target's (rms_norm_eps, biases)."""
        super().__init__()
        a = self.args = replace(plain_layers(target.args), num_layers=num_layers, **layer)
        self.fc = nn.Linear(2 * a.hidden_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(num_layers))
        norm = (lambda: RMSNorm(a.hidden_size, a.rms_norm_eps)) if mtp else nn.Identity
        self.hnorm, self.enorm, self.norm = norm(), norm(), norm()
        if not input_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.embed_tokens = nn.Embedding.from_pretrained(target.model.embed_tokens.weight.detach().clone())
        head = target.lm_head.weight.detach()
        if target.vocab_index is not None:   # a target that keeps a subset: back to the full rows is impossible
            raise InputError("the EAGLE drafter reads the target's full LM head; export the target without a "
                             "specrt_vocab.json")
        index = None if vocab_subset is None else torch.tensor(vocab_subset, dtype=torch.int64)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size if index is None else len(index), bias=False)
        self.lm_head.weight = nn.Parameter(head.clone() if index is None else head.index_select(0, index),
                                           requires_grad=False)
        self.register_buffer("vocab_index", index)
        self.register_buffer("rope_cos", target.rope_cos, persistent=False)  # (Smax, D)
        self.register_buffer("rope_sin", target.rope_sin, persistent=False)  # (Smax, D)
        self.fc_t = None   # at export: fc's two halves transposed, each a parameter (see export_eagle)

    def fuse(self, features, input_ids):
        """[f; e(x)] -> d, as two MatMuls (an int8 engine quantizes each input with its own scale: the features'
        outliers would otherwise leave the embeddings a few levels, as with the Medusa heads)."""
        d = self.args.hidden_size
        if self.fc_t is None:
            w = self.fc.weight                                                  # (d, 2d)
            w_features, w_tokens = w[:, :d].T, w[:, d:].T                       # (d, d) each
        else:                                                                   # at export (see export_eagle)
            w_features, w_tokens = self.fc_t
        return self.hnorm(features) @ w_features + self.enorm(self.embed_tokens(input_ids)) @ w_tokens + \
            self.fc.bias                                                        # (B, S, d)

    def forward(self, input_ids, position_ids, past_len, tree_mask, num_logits, features, *caches):
        hidden = self.fuse(features, input_ids)                                 # (B, S, d)
        cos = self.rope_cos[position_ids].unsqueeze(1)                          # (B, 1, S, D)
        sin = self.rope_sin[position_ids].unsqueeze(1)                          # (B, 1, S, D)
        new_kv = []
        for i, layer in enumerate(self.layers):
            hidden, k, v = layer(hidden, cos, sin, past_len, tree_mask, caches[2 * i], caches[2 * i + 1])
            new_kv += [k, v]
        S = hidden.shape[1]
        last = torch.arange(S - num_logits[0], S)
        return (self.lm_head(self.norm(hidden.index_select(1, last))), hidden, *new_kv)   # over the kept ids

    def logits(self, hidden):
        """Predicted features (..., d) -> logits (..., V), -inf outside the kept ids."""
        logits = self.lm_head(self.norm(hidden))
        return logits if self.vocab_index is None else full_vocab(logits, self.vocab_index, self.args.vocab_size)

    def train_forward(self, features, input_ids):
        """Teacher-forced pass over whole sequences (B, S, d), (B, S) -> predicted features (B, S, d): the same
        layers as `forward` with causal attention through SDPA (differentiable; `forward`'s attention op is not)."""
        x = self.fuse(features, input_ids)
        S = x.shape[1]
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]                         # (S, D)
        for layer in self.layers:
            x = x + causal_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, self.args)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def trained_state(self) -> dict:
        return {k: v for k, v in self.state_dict().items() if k.startswith(TRAINED)}

    def grow_from(self, smaller: "EagleModel") -> None:
        """Start as `smaller` (fewer layers): its weights in the first layers, and each added layer's output
        projections (attention and MLP) zeroed, so that it adds nothing to the residual stream until trained."""
        self.load_state_dict(smaller.trained_state(), strict=False)
        with torch.no_grad():
            for layer in self.layers[len(smaller.layers):]:
                for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                    proj.weight.zero_()
                    if proj.bias is not None:
                        proj.bias.zero_()


def attention_qkv(att: nn.Module, x, cos, sin, a) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A drafter layer's queries (B, H, S, D), keys and values (B, Hkv, S, D) of x (B, S, w), rotary applied."""
    B, S, _ = x.shape
    q = att.q_proj(x).view(B, S, a.num_heads, a.head_dim).transpose(1, 2)
    k = att.k_proj(x).view(B, S, a.num_kv_heads, a.head_dim).transpose(1, 2)
    v = att.v_proj(x).view(B, S, a.num_kv_heads, a.head_dim).transpose(1, 2)
    return rope(q, cos, sin), rope(k, cos, sin), v


def causal_attention(att: nn.Module, x, cos, sin, a) -> torch.Tensor:
    """A drafter layer's attention over whole sequences, differentiable: x (B, S, w) -> o_proj's output (B, S, d)."""
    y = nn.functional.scaled_dot_product_attention(*attention_qkv(att, x, cos, sin, a), is_causal=True,
                                                   enable_gqa=True)
    return att.o_proj(y.transpose(1, 2).flatten(2))


def new_eagle(target: SpecModel, vocab_subset: list[int] | None = None, seed: int = 0,
              num_layers: int = 1) -> EagleModel:
    """A freshly initialised drafter (std 0.02 weights, zero biases, unit norms) for `target`."""
    gen = torch.Generator().manual_seed(seed)
    model = EagleModel(target, vocab_subset, num_layers)
    for name, p in model.named_parameters():
        if name.startswith(TRAINED):
            with torch.no_grad():
                p.copy_(torch.ones_like(p) if "norm" in name else torch.zeros_like(p) if name.endswith("bias")
                        else torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def save_eagle(model: EagleModel, directory: Path, dtype=torch.float16) -> None:
    from safetensors.torch import save_file
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(dtype).contiguous() for k, v in model.trained_state().items()},
              str(directory / WEIGHTS))
    (directory / CONFIG).write_text(json.dumps({k: getattr(model.args, k) for k in (*SHAPE, "num_layers")}) + "\n")
    if model.vocab_index is not None:
        from specrt.export.sources import VOCAB_FILE
        (directory / VOCAB_FILE).write_text(json.dumps({"kept_ids": model.vocab_index.tolist()}) + "\n")


def renamed(state: dict) -> dict:
    """Weights saved before the drafter could have several layers named its one layer `layer.*`."""
    return {"layers.0." + k[6:] if k.startswith("layer.") else k: v for k, v in state.items()}


def layout(directory: str | Path) -> str:
    """Which layout a drafter directory holds: "specrt" (eagle_config.json) or "eagle" (the EAGLE authors'
    config.json; see `load_published`)."""
    directory = Path(directory)
    if (directory / CONFIG).is_file():
        return "specrt"
    if (directory / PUBLISHED_CONFIG).is_file():
        return "eagle"
    raise InputError(f"--eagle {directory}: expected specrt's {CONFIG} and {WEIGHTS}, or a published drafter's "
                     f"{PUBLISHED_CONFIG} and {' or '.join(PUBLISHED_WEIGHTS)}")


def load_eagle(directory: str | Path, target: SpecModel) -> EagleModel:
    """The drafter of a checkpoint directory, in specrt's layout or the EAGLE authors' (EAGLE-1/2), on the
    embeddings and LM head of `target`."""
    if layout(directory) == "eagle":
        return load_published(directory, target)
    from safetensors.torch import load_file

    from specrt.export.sources import read_vocab_subset
    directory = Path(directory)
    if not (directory / WEIGHTS).is_file():
        raise InputError(f"--eagle {directory}: expected a directory with {CONFIG} and {WEIGHTS}")
    config = json.loads((directory / CONFIG).read_text())
    wrong = {k: (config.get(k), getattr(target.args, k)) for k in SHAPE if config.get(k) != getattr(target.args, k)}
    if wrong:
        raise DrafterMismatchError(f"--eagle {directory}: its layer does not have the target's shape "
                                   f"({', '.join(f'{k} {a} vs {b}' for k, (a, b) in wrong.items())}); train it for "
                                   "this target")
    model = EagleModel(target, read_vocab_subset(directory, target.args.vocab_size), config.get("num_layers", 1))
    frozen = {k: v for k, v in model.state_dict().items() if not k.startswith(TRAINED)}
    weights = {k: v.float() for k, v in renamed(load_file(str(directory / WEIGHTS))).items()}
    try:
        model.load_state_dict({**weights, **frozen})
    except RuntimeError as e:
        raise InputError(f"--eagle {directory}: the weights do not match {CONFIG} ({e})") from e
    return model.eval()


def load_published(directory: str | Path, target: SpecModel) -> EagleModel:
    """An EAGLE-1/2 drafter as its authors publish it (SafeAILab/EAGLE, `cnets1.py`), converted to `EagleModel`.

    `config.json`: the target's Llama-style config with `num_hidden_layers` 1, `bias` (fc's bias; true when absent),
    `qkv_bias` (Qwen2 targets). Weights (`model.safetensors` or `pytorch_model.bin`): `fc.weight` [d, 2d] over
    [embedding; feature] (specrt's order is [feature; embedding]: the halves are swapped here), `fc.bias`,
    `layers.N.*` where layer 0 has no input layernorm, optionally `embed_tokens.weight` (a copy of the target's,
    not used). No final norm, no LM head: the drafter's output goes to the target's LM head. The feature is the
    target's last hidden state after its final norm, as specrt's. The layer rotates by the drafter's own rope
    settings (`rope_theta`, `rope_scaling`), which are the target's in every published drafter."""
    from specrt.export.model import ACTIVATIONS
    from specrt.export.published import check_fit, find_file, read_config, read_weights
    directory, a = Path(directory), target.args
    config = read_config(directory / PUBLISHED_CONFIG)
    path = find_file(directory, PUBLISHED_WEIGHTS, "--eagle")
    state = {k: v for k, v in read_weights(path).items() if not k.endswith("rotary_emb.inv_freq")}
    d = config.get("hidden_size")
    fc = state.get("fc.weight", torch.zeros(0, 0))
    if fc.shape[-1] == 3 * fc.shape[0] > 0 or any(k.startswith("midlayer.") for k in state) or "d2t" in state or \
            "draft_vocab_size" in config:
        raise CheckpointError(f"--eagle {directory}: an EAGLE-3 drafter (fc over three target layers, or midlayer.*, "
                              "d2t, draft_vocab_size); this loader reads EAGLE-1/2 drafters")
    heads = config.get("num_attention_heads")
    check_fit("--eagle", directory, [
        ("hidden size", d, a.hidden_size), ("vocabulary size", config.get("vocab_size"), a.vocab_size),
        ("intermediate size", config.get("intermediate_size"), a.intermediate_size),
        ("attention heads", heads, a.num_heads),
        ("key/value heads", config.get("num_key_value_heads", heads), a.num_kv_heads),
        ("head dim", config.get("head_dim") or d // (heads or 1), a.head_dim),
        ("qkv_bias", bool(config.get("qkv_bias", False)), a.qkv_bias)])
    if "embed_tokens.weight" in state:
        check_fit("--eagle", directory, [("embed_tokens", tuple(state.pop("embed_tokens.weight").shape),
                                          (a.vocab_size, a.hidden_size))])
    act = config.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise DrafterMismatchError(f"--eagle {directory}: hidden_act {act!r} is not implemented (supported: "
                                   f"{', '.join(ACTIVATIONS)})")
    model = EagleModel(target, None, config.get("num_hidden_layers", 1), input_norm=False, act=act,
                       rms_norm_eps=config.get("rms_norm_eps", 1e-6), o_bias=False, mlp_bias=False)
    w = state.pop("fc.weight", None)
    if w is not None:
        state["fc.weight"] = torch.cat([w[:, d:], w[:, :d]], dim=1)   # [embedding; feature] -> [feature; embedding]
    if not config.get("bias", True):   # fc has no bias: a zero one computes the same
        state["fc.bias"] = torch.zeros(d)
    mine = model.trained_state()
    missing, unknown = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(mine[k].shape)}" for k in sorted(set(mine) & set(state))
             if state[k].shape != mine[k].shape]
    if missing or unknown or wrong:
        raise CheckpointError(f"--eagle {directory}: {path.name} is not an EAGLE-1/2 drafter of {PUBLISHED_CONFIG}'s "
                              f"shape (missing {missing[:4]}, unexpected {unknown[:4]}, shapes {wrong[:4]})")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    model.rope_cos, model.rope_sin = _rope_tables(config, a.head_dim, a.max_seq_len)
    return model.eval()


def _rope_tables(config: dict, head_dim: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (length, head_dim) of a Llama-style config's rope settings (transformers' own rotation)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    rope = {k: config[k] for k in ("rope_theta", "rope_scaling", "max_position_embeddings") if config.get(k)}
    rotary = LlamaRotaryEmbedding(config=LlamaConfig(head_dim=head_dim, **rope))
    cos, sin = rotary(torch.zeros(1), torch.arange(length)[None])
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def export_eagle(model: EagleModel, path: Path, dtype: str = "float32") -> None:
    """The drafter's graph (see `specrt.export.onnx_export.export_module`: one TreeAttention node, the weights as
    external data in `dtype`)."""
    from specrt.export.onnx_export import cache_names, export_module
    a = model.args
    B, S = 1, 3
    caches = [torch.zeros(B, a.num_kv_heads, a.max_seq_len, a.head_dim) for _ in range(2 * a.num_layers)]
    args = (torch.zeros(B, S, dtype=torch.int64), torch.arange(S)[None], torch.zeros(B, dtype=torch.int64),
            torch.ones(S, S, dtype=torch.bool).tril()[None], torch.tensor([S], dtype=torch.int64),
            torch.zeros(B, S, a.hidden_size), *caches)
    cache_in, cache_out = cache_names(a.num_layers)
    inputs = ["input_ids", "position_ids", "past_len", "tree_mask", "num_logits", "features", *cache_in]
    dyn = {"input_ids": {0: "B", 1: "S"}, "position_ids": {0: "B", 1: "S"}, "past_len": {0: "B"},
           "tree_mask": {0: "B", 1: "S", 2: "S"}, "features": {0: "B", 1: "S"}, "logits": {0: "B", 1: "num_logits"},
           "hidden": {0: "B", 1: "S"}}
    dyn.update({n: {0: "B", 2: "cache_len"} for n in cache_in})
    dyn.update({n: {0: "B", 2: "S"} for n in cache_out})
    d = a.hidden_size
    w = model.fc.weight.detach()
    model.fc_t = nn.ParameterList([w[:, :d].T, w[:, d:].T])   # fc's halves, read directly by their MatMuls
    try:
        export_module(model, args, path, dtype, inputs, ["logits", "hidden", *cache_out], dyn)
    finally:
        model.fc_t = None
