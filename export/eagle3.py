"""EAGLE-3 drafter: one decoder layer over [input_layernorm(embedding of token t + 1); hidden_norm(feature t)].

The feature at slot t is `fc` (3d -> d, no bias) over the target's hidden states at position t entering three of
its layers (by default 2, L // 2 and L − 3, concatenated low -> high: the target graph's `aux` output, see
specrt.export.model); below the first tree level it is the drafter's own output at the parent slot (its
pre-norm hidden state). The layer's q/k/v projections take the 2d-wide concatenation; its residual is the
feature (un-normed; `norm_before_residual` configs take the normed one), then post_attention_layernorm and the
MLP as usual. Its own final `norm` and `lm_head` [draft vocab, d] give logits over a reduced draft vocabulary;
`d2t` maps them to the target's: target id = draft id + d2t[draft id].

Layer ids. specrt names a layer's *input* (the residual stream entering layer i; i = L is the last layer's output
before the final norm), as the EAGLE authors' code and vLLM do. `eagle_config.eagle_aux_hidden_state_layer_ids`
in SpecForge-style configs is read as layer inputs by vLLM and as layer *outputs* by SGLang (id i there is the
input of layer i + 1): a checkpoint that carries these ids says nothing of which, so export asks
(`layer_ids="inputs"` or `"outputs"`, `specrt export --eagle-layer-ids`). A config without them gets the
default; specrt's own drafters record theirs as inputs under `specrt_aux_layer_inputs`.

Checkpoint (as the EAGLE authors, SpecForge and vLLM publish them): `config.json` (Llama-style: hidden_size,
intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, rope parameters, vocab_size
(the target's), draft_vocab_size, optional eagle_config) and `model.safetensors` or `pytorch_model.bin` (read with
`torch.load(weights_only=True)`), keys `midlayer.*` (the EAGLE authors') or `layers.0.*` (SpecForge, vLLM),
`fc.weight` [d, 3d], `norm.weight`, `lm_head.weight` [draft vocab, d], `d2t` [draft vocab] (int64), `t2d`
[vocab] (bool), optionally `embed_tokens.weight` (else the target's).

Graph (the EAGLE engine contract plus one input): input_ids, position_ids, past_len, tree_mask, num_logits,
`features` [B, S, d], `aux` [B, S, 3d], k_cache_0, v_cache_0 -> logits [B, num_logits, K draft ids], hidden [B, S,
d] (the layer's output, pre-norm), k_new_0, v_new_0. The feature is `features + fc(aux)`: a catch-up pass feeds
the target's aux states and zero features, a tree level the drafter's own features and zero aux states (both
exact: x + 0 = x). `fc` runs as one MatMul per target layer, so that an int8 engine quantizes each layer's states
with its own scale. The draft ids' target ids are the engine set's `output_ids` (eagle_vocab.json), which the
runtime maps the logits' columns through.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specrt.errors import CheckpointError, DrafterMismatchError, InputError
from specrt.export.eagle import causal_attention
from specrt.export.model import MLP, Attention, ModelArgs, RMSNorm, SpecModel

CONFIG = "config.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
LAYER_IDS = ("inputs", "outputs")
OWN_IDS = "specrt_aux_layer_inputs"   # the config key of specrt's own drafters: layer inputs, no ambiguity
TRAINED = ("fc.", "midlayer.", "norm.", "lm_head.")


def default_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose inputs EAGLE-3 reads by default (the EAGLE authors' and vLLM's choice)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int               # the target's
    draft_vocab_size: int
    aux_layers: tuple[int, ...]   # layer inputs (see the module docstring)
    attention_bias: bool = False
    norm_before_residual: bool = False


class Eagle3Layer(nn.Module):
    """The midlayer: attention over [input_layernorm(embedding); hidden_norm(feature)] (2d wide)."""

    def __init__(self, a: ModelArgs, norm_before_residual: bool = False):
        super().__init__()
        d, bias = a.hidden_size, a.qkv_bias
        self.norm_before_residual = norm_before_residual
        self.self_attn = Attention(a)
        self.self_attn.q_proj = nn.Linear(2 * d, a.num_heads * a.head_dim, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * d, a.num_kv_heads * a.head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * d, a.num_kv_heads * a.head_dim, bias=bias)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(d, a.rms_norm_eps)
        self.hidden_norm = RMSNorm(d, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, a.rms_norm_eps)

    def attention_input(self, emb, feature):
        """-> ([e; f] (B, S, 2d), the residual (B, S, d))."""
        normed = self.hidden_norm(feature)
        return torch.cat([self.input_layernorm(emb), normed], -1), normed if self.norm_before_residual else feature

    def forward(self, emb, feature, cos, sin, past_len, tree_mask, k_cache, v_cache):
        x, residual = self.attention_input(emb, feature)
        h, k, v = self.self_attn(x, cos, sin, past_len, tree_mask, k_cache, v_cache)
        x = residual + h
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class Eagle3Model(nn.Module):
    """`fc`, `midlayer`, `norm`, `lm_head` (the trained part, under the published names), the embedding (the
    checkpoint's or the target's, frozen) and the drafter's own rope tables. `draft_ids`: the target id of each draft
    id (K,), None where they are the same."""

    def __init__(self, c: Eagle3Config, embed: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                 max_seq_len: int, draft_ids: torch.Tensor | None = None):
        super().__init__()
        self.config = c
        self.args = ModelArgs("llama", c.vocab_size, c.hidden_size, c.intermediate_size, 1, c.num_heads,
                              c.num_kv_heads, c.head_dim, c.rms_norm_eps, max_seq_len, qkv_bias=c.attention_bias,
                              o_bias=c.attention_bias)
        d = c.hidden_size
        self.aux_layers = tuple(c.aux_layers)
        self.fc = nn.Linear(len(self.aux_layers) * d, d, bias=False)
        self.midlayer = Eagle3Layer(self.args, c.norm_before_residual)
        self.norm = RMSNorm(d, c.rms_norm_eps)
        self.lm_head = nn.Linear(d, c.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding.from_pretrained(embed.detach().float().clone())
        self.register_buffer("draft_ids", draft_ids)
        self.register_buffer("rope_cos", rope_cos, persistent=False)  # (Smax, D)
        self.register_buffer("rope_sin", rope_sin, persistent=False)  # (Smax, D)
        self.fc_t = None   # at export: fc's blocks, one per target layer, transposed (see export_eagle3)

    def fuse(self, features, aux):
        """features (B, S, d) + fc(aux (B, S, n*d)) -> the layer's feature (B, S, d)."""
        d = self.config.hidden_size
        blocks = self.fc_t if self.fc_t is not None else \
            [self.fc.weight[:, i * d:(i + 1) * d].T for i in range(len(self.aux_layers))]   # (d, d) each
        for i, w in enumerate(blocks):
            features = features + aux[..., i * d:(i + 1) * d] @ w
        return features

    def forward(self, input_ids, position_ids, past_len, tree_mask, num_logits, features, aux, k_cache, v_cache):
        x = self.fuse(features, aux)                                            # (B, S, d)
        cos = self.rope_cos[position_ids].unsqueeze(1)                          # (B, 1, S, D)
        sin = self.rope_sin[position_ids].unsqueeze(1)                          # (B, 1, S, D)
        hidden, k, v = self.midlayer(self.embed_tokens(input_ids), x, cos, sin, past_len, tree_mask, k_cache, v_cache)
        S = hidden.shape[1]
        last = torch.arange(S - num_logits[0], S)
        return self.lm_head(self.norm(hidden.index_select(1, last))), hidden, k, v   # logits over the draft ids

    def train_forward(self, feature, input_ids):
        """Teacher-forced pass over whole sequences: feature (B, S, d) (fused already), ids (B, S) -> the layer's
        outputs (B, S, d), causal attention through SDPA (differentiable; `forward`'s attention op is not)."""
        layer, S = self.midlayer, feature.shape[1]
        x, residual = layer.attention_input(self.embed_tokens(input_ids), feature)   # (B, S, 2d), (B, S, d)
        x = residual + causal_attention(layer.self_attn, x, self.rope_cos[:S], self.rope_sin[:S], self.args)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def trained_state(self) -> dict:
        return {k: v for k, v in self.state_dict().items() if k.startswith(TRAINED)}


# ---- reading a checkpoint ----------------------------------------------------------------------------------

def _weights_file(directory: Path) -> Path | None:
    return next((directory / n for n in WEIGHTS if (directory / n).is_file()), None)


def read_weights(path: Path) -> dict:
    """safetensors, or a pickle read with torch.load(weights_only=True) only (anything else is refused)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # not plain tensors: weights_only refuses code
        raise CheckpointError(f"--eagle {path}: not a plain state dict of tensors ({type(e).__name__}: {e}); "
                              "convert it to safetensors") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"--eagle {path}: expected a dict of tensors")
    return state


def _weight_names(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            return list(f.keys())
    return list(read_weights(path))


def is_eagle3(directory: str | Path) -> bool:
    """Whether `directory` holds an EAGLE-3 checkpoint (config.json and weights with the midlayer's hidden_norm)."""
    directory = Path(directory)
    weights = _weights_file(directory)
    if not (directory / CONFIG).is_file() or weights is None:
        return False
    return any(k.endswith("hidden_norm.weight") for k in _weight_names(weights))


def _layer_ids(config: dict, num_layers: int, layer_ids: str | None, where: str) -> tuple[int, ...]:
    """The target layers whose inputs the drafter reads (see the module docstring)."""
    if layer_ids is not None and layer_ids not in LAYER_IDS:
        raise InputError(f"--eagle-layer-ids {layer_ids!r}: expected one of {', '.join(LAYER_IDS)}")
    ids = config.get(OWN_IDS)
    published = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None and published is not None:
        if layer_ids is None:
            shifted = [i + 1 for i in published]
            raise InputError(f"{where}: its config names target layers {list(published)} "
                             "(eagle_aux_hidden_state_layer_ids), which vLLM reads as layer inputs and SGLang as "
                             f"layer outputs (the inputs of {shifted}): say which with --eagle-layer-ids inputs "
                             "(vLLM, the EAGLE authors) or outputs (SGLang, SpecForge)")
        ids = [i + (layer_ids == "outputs") for i in published]
    ids = tuple(int(i) for i in (ids if ids is not None else default_layers(num_layers)))
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad or not ids:
        raise DrafterMismatchError(f"{where}: it reads the inputs of target layers {list(ids)}, the target has "
                                   f"{num_layers} layers (inputs 0 .. {num_layers}): {bad or 'none'} out of range; "
                                   "use a drafter trained for this target")
    return ids


def _config(raw: dict, target: SpecModel, layer_ids: str | None, where: str) -> Eagle3Config:
    a = target.args
    d = raw.get("hidden_size")
    heads = raw.get("num_attention_heads", a.num_heads)
    if d != a.hidden_size:
        raise DrafterMismatchError(f"{where}: hidden size {d}, the target's is {a.hidden_size}; use a drafter "
                                   "trained for this target")
    vocab = raw.get("vocab_size", a.vocab_size)
    if vocab != a.vocab_size:
        raise DrafterMismatchError(f"{where}: vocabulary of {vocab} ids (config vocab_size), the target's has "
                                   f"{a.vocab_size}; use a drafter trained for this target's tokenizer")
    return Eagle3Config(
        hidden_size=d, intermediate_size=raw["intermediate_size"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=raw.get("head_dim") or d // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6), vocab_size=vocab,
        draft_vocab_size=raw.get("draft_vocab_size") or vocab,
        aux_layers=_layer_ids(raw, a.num_layers, layer_ids, where),
        attention_bias=bool(raw.get("attention_bias", False)),
        norm_before_residual=bool(raw.get("norm_before_residual", False)))


def _rope_tables(raw: dict, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [Smax, D] from the drafter's own rope parameters (rope_theta, rope_scaling), as transformers'
    Llama computes them."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    keys = ("hidden_size", "num_attention_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters",
            "max_position_embeddings", "partial_rotary_factor")
    config = LlamaConfig(**{k: raw[k] for k in keys if raw.get(k) is not None})
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1), torch.arange(max_seq_len)[None])
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def _renamed(state: dict) -> dict:
    """The published names -> Eagle3Model's: `layers.0.` -> `midlayer.`, a leading `model.` dropped."""
    out = {}
    for k, v in state.items():
        k = k.removeprefix("model.")
        out["midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k] = v
    return out


def _draft_ids(state: dict, c: Eagle3Config, where: str) -> torch.Tensor | None:
    """The target id of each draft id (draft id + d2t[draft id]); None where every id maps to itself."""
    K, V = c.draft_vocab_size, c.vocab_size
    d2t = state.get("d2t")
    if d2t is None:
        if K != V:
            raise InputError(f"{where}: a draft vocabulary of {K} ids and no d2t map to the target's {V}")
        return None
    if d2t.shape != (K,):
        raise DrafterMismatchError(f"{where}: d2t has shape {tuple(d2t.shape)}, draft_vocab_size is {K}")
    ids = torch.arange(K) + d2t.long()
    bad = ids[(ids < 0) | (ids >= V)]
    if len(bad):
        worst = int(bad.max()) if bad.max() >= V else int(bad.min())
        raise DrafterMismatchError(f"{where}: d2t maps draft ids to target id {worst}, the target's "
                                   f"vocabulary has {V} ids; use a drafter made for this target's tokenizer")
    if len(torch.unique(ids)) != K:
        raise InputError(f"{where}: d2t maps two draft ids to one target id; the map must be one to one")
    return None if K == V and bool((ids == torch.arange(K)).all()) else ids


def load_eagle3(directory: str | Path, target: SpecModel, layer_ids: str | None = None) -> Eagle3Model:
    """The drafter of an EAGLE-3 checkpoint directory for `target` (see the module docstring); a drafter that does
    not fit the target raises DrafterMismatchError naming both values."""
    directory = Path(directory)
    where = f"--eagle {directory}"
    weights = _weights_file(directory)
    if not (directory / CONFIG).is_file() or weights is None:
        raise InputError(f"{where}: expected {CONFIG} and {' or '.join(WEIGHTS)}")
    if target.vocab_index is not None:
        raise InputError("the EAGLE-3 drafter maps its ids into the target's whole vocabulary; export the target "
                         "without a specrt_vocab.json")
    raw = json.loads((directory / CONFIG).read_text())
    c = _config(raw, target, layer_ids, where)
    state = _renamed(read_weights(weights))
    fc = state.get("fc.weight")
    need = len(c.aux_layers) * c.hidden_size
    if fc is not None and tuple(fc.shape) != (c.hidden_size, need):
        raise DrafterMismatchError(f"{where}: fc.weight has shape {tuple(fc.shape)}, reading {len(c.aux_layers)} "
                                   f"target layers of hidden size {c.hidden_size} needs ({c.hidden_size}, {need})")
    head = state.get("lm_head.weight")
    if head is not None and head.shape[0] != c.draft_vocab_size:
        raise DrafterMismatchError(f"{where}: lm_head.weight has {head.shape[0]} rows, draft_vocab_size is "
                                   f"{c.draft_vocab_size}")
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != (c.vocab_size, c.hidden_size):
        raise DrafterMismatchError(f"{where}: embed_tokens.weight has shape {tuple(embed.shape)}, the target's "
                                   f"embedding is ({c.vocab_size}, {c.hidden_size})")
    ids = _draft_ids(state, c, where)
    cos, sin = _rope_tables(raw, target.args.max_seq_len)
    model = Eagle3Model(c, target.model.embed_tokens.weight if embed is None else embed, cos, sin,
                        target.args.max_seq_len, ids)
    trained = {k: v.float() for k, v in state.items() if k.startswith(TRAINED)}
    missing = sorted(k for k in model.trained_state() if k not in trained)
    unknown = sorted(k for k in state if not k.startswith(TRAINED) and k not in ("d2t", "t2d"))
    if missing or unknown:
        raise CheckpointError(f"{where}: the weights do not have the EAGLE-3 layout (missing {missing[:4]}, "
                              f"unknown {unknown[:4]})")
    try:
        model.load_state_dict(trained, strict=False)
    except RuntimeError as e:
        raise DrafterMismatchError(f"{where}: the weights do not match {CONFIG} ({e})") from e
    return model.eval()


# ---- writing ---------------------------------------------------------------------------------------------

def new_eagle3(target: SpecModel, aux_layers: tuple[int, ...] | None = None, draft_ids: list[int] | None = None,
               seed: int = 0, rope_config: dict | None = None) -> Eagle3Model:
    """A freshly initialised drafter (std 0.02 weights, unit norms) of the target's shape for `target`;
    `draft_ids`: the target ids of its draft vocabulary (None: the whole vocabulary). `rope_config`: the target's
    rope parameters (rope_theta, rope_scaling), recorded in the config that `save_eagle3` writes."""
    a = target.args
    ids = None if draft_ids is None else torch.tensor(draft_ids, dtype=torch.int64)
    c = Eagle3Config(a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps,
                     a.vocab_size, a.vocab_size if ids is None else len(ids),
                     tuple(aux_layers) if aux_layers is not None else default_layers(a.num_layers))
    _layer_ids({OWN_IDS: list(c.aux_layers)}, a.num_layers, None, "new EAGLE-3 drafter")
    model = Eagle3Model(c, target.model.embed_tokens.weight, target.rope_cos, target.rope_sin, a.max_seq_len, ids)
    model.rope_config = dict(rope_config or {})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(TRAINED):
                p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.02)
    return model.eval()


def save_eagle3(model: Eagle3Model, directory: str | Path, dtype=torch.float16, layout: str = "midlayer") -> None:
    """The published layout (config.json + model.safetensors, `midlayer.*` or `layers.0.*` keys, d2t and t2d),
    with the layer ids as inputs under `specrt_aux_layer_inputs`."""
    from safetensors.torch import save_file
    c, directory = model.config, Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.trained_state().items()}
    if layout == "layers.0":
        state = {("layers.0." + k[9:] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    ids = model.draft_ids if model.draft_ids is not None else torch.arange(c.draft_vocab_size)
    state["d2t"] = (ids - torch.arange(c.draft_vocab_size)).contiguous()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    state["t2d"] = t2d
    save_file(state, str(directory / WEIGHTS[0]))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
              "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
              "hidden_act": "silu", "max_position_embeddings": model.args.max_seq_len,
              OWN_IDS: list(c.aux_layers), **getattr(model, "rope_config", {})}
    (directory / CONFIG).write_text(json.dumps(config, indent=1) + "\n")


def proposer(drafter: Eagle3Model):
    """For specrt.export.acceptance: slot t reads fc(the target's aux states at t) and token t + 1; its top draft
    id, mapped to a target id, guesses token t + 2. The target's forward returns its aux states last."""
    def propose(tokens, outputs):
        S, a = tokens.shape[1] - 1, drafter.args
        caches = [torch.zeros(1, a.num_kv_heads, 1, a.head_dim) for _ in range(2)]
        logits, *_ = drafter(tokens[:, 1:], torch.arange(S)[None], torch.zeros(1, dtype=torch.int64),
                             torch.ones(S, S, dtype=torch.bool).tril()[None], torch.tensor([S]),
                             torch.zeros(1, S, a.hidden_size), outputs[-1][:, :S], *caches)
        ids = logits[0].argmax(-1)                                                      # (S,) draft ids
        return ids if drafter.draft_ids is None else drafter.draft_ids[ids]
    return propose


def export_eagle3(model: Eagle3Model, path: Path, dtype: str = "float32") -> None:
    """The drafter's graph (see `specrt.export.onnx_export.export_module`: one TreeAttention node, the weights as
    external data in `dtype`)."""
    from specrt.export.onnx_export import cache_names, export_module
    a, d = model.args, model.config.hidden_size
    B, S, n = 1, 3, len(model.aux_layers)
    caches = [torch.zeros(B, a.num_kv_heads, a.max_seq_len, a.head_dim) for _ in range(2)]
    args = (torch.zeros(B, S, dtype=torch.int64), torch.arange(S)[None], torch.zeros(B, dtype=torch.int64),
            torch.ones(S, S, dtype=torch.bool).tril()[None], torch.tensor([S], dtype=torch.int64),
            torch.zeros(B, S, d), torch.zeros(B, S, n * d), *caches)
    cache_in, cache_out = cache_names(1)
    inputs = ["input_ids", "position_ids", "past_len", "tree_mask", "num_logits", "features", "aux", *cache_in]
    dyn = {"input_ids": {0: "B", 1: "S"}, "position_ids": {0: "B", 1: "S"}, "past_len": {0: "B"},
           "tree_mask": {0: "B", 1: "S", 2: "S"}, "features": {0: "B", 1: "S"}, "aux": {0: "B", 1: "S"},
           "logits": {0: "B", 1: "num_logits"}, "hidden": {0: "B", 1: "S"}}
    dyn.update({n: {0: "B", 2: "cache_len"} for n in cache_in})
    dyn.update({n: {0: "B", 2: "S"} for n in cache_out})
    w = model.fc.weight.detach()
    model.fc_t = nn.ParameterList([w[:, i * d:(i + 1) * d].T for i in range(n)])   # read directly by the MatMuls
    try:
        export_module(model, args, path, dtype, inputs, ["logits", "hidden", *cache_out], dyn)
    finally:
        model.fc_t = None
