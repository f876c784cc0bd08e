"""The target/draft graph of the engine contract, written once for the Llama family.

forward(input_ids, position_ids, past_len, tree_mask, num_logits, *caches)
    -> logits [B, num_logits, V], hidden [B, S, d], then per layer new keys and values [B, Hkv, S, D], then, where
    `aux_layers` names layers (an EAGLE-3 drafter's, see specrt.export.eagle3), `aux` [B, S, len(aux_layers) * d]:
    the hidden states entering those layers (the residual stream before each one's input norm; L: the last layer's
    output before the final norm), concatenated in the order given.
`caches` are the static buffers [B, Hkv, Smax, D], read only (k0, v0, k1, v1, ...).
`num_logits` [1] asks for the logits of the last positions only (prefill needs one).
A draft may keep a reduced output vocabulary (`vocab_subset`, K ids): its lm_head is [K, d] and the K logits are
scattered into a full row that is -inf elsewhere, so the output stays [B, n, V] and every other id has draft
probability exactly zero (the rejection rule stays exact).
A mixture of experts routes each token of its sparse layers to its top-k experts (specrt.export.moe).
LFM2's conv layers and Granite 4.0-H's Mamba-2 layers keep their inputs in cache pairs of their own
(specrt.export.hybrid): `caches` holds hybrid.cache_layers(args) pairs, layer i's from hybrid.cache_index(args)[i].
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from specrt.export.architectures import Architecture, architecture_of, layer_windows
from specrt.export.hybrid import (Mamba2, ShortConv, cache_index, conv_taps, granite_hybrid_weights, lfm2_ff_size,
                                  lfm2_weights, mamba_context)
from specrt.export.moe import SparseMoE, split_experts
from specrt.plugins.tree_attention import tree_attention


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_seq_len: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    act: str = "silu"
    qk_norm: bool = False          # RMSNorm over each head's q and k before RoPE
    sandwich_norms: bool = False   # post_attention_layernorm on the attention output, pre/post_feedforward_layernorm
    embed_scale: float = 1.0       # embeddings times this
    attn_scale: float = 0.0        # scores scale; 0: head_dim ** -0.5
    attn_softcap: float = 0.0      # scores -> c * tanh(scores / c); 0: none
    final_softcap: float = 0.0     # the same on the logits
    windows: tuple[int, ...] = ()  # per layer: attend to the last W positions (0: all); (): no layer has a window
    local_rope: tuple[bool, ...] = ()  # per layer: rotates by the local rope tables (Gemma 3's sliding layers)
    qk_norm_whole: bool = False    # the q/k norm over the whole projection, not per head (OLMoE)
    residual_scale: float = 1.0    # each block's output times this before its residual add (Granite)
    logits_scale: float = 1.0      # the logits divided by this (Granite)
    sparse_layers: tuple[bool, ...] = ()   # per layer: routed experts in place of the MLP; (): none
    num_experts: int = 0
    top_k: int = 0                 # experts per token
    expert_size: int = 0           # each expert's intermediate size
    norm_topk_prob: bool = True    # the top-k routing weights renormalised to sum to 1
    conv_layers: tuple[bool, ...] = ()   # per layer: LFM2's gated short convolution in place of attention
    conv_kernel: int = 0           # its kernel K (conv_L_cache)
    conv_bias: bool = False
    rope: bool = True              # attention rotates q and k (Granite 4.0-H's position_embedding_type may say not)
    shared_mlp: bool = False       # a dense MLP of intermediate_size beside the routed experts (Granite 4.0-H)
    mamba_layers: tuple[bool, ...] = ()   # per layer: a Mamba-2 mixer in place of attention (Granite 4.0-H)
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0           # N: the state's width per head and channel
    mamba_groups: int = 0          # B and C are shared by groups of mamba_heads / mamba_groups heads
    mamba_kernel: int = 0          # the conv's kernel K
    mamba_conv_bias: bool = False
    mamba_proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))   # dt clamped after softplus


def args_from_config(config, arch: Architecture, max_seq_len: int, weights: set[str]) -> ModelArgs:
    """The graph's options from a transformers config and the names of its weights (which biases exist)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer = "model.layers.0."
    if arch.mamba:   # layer 0 may be a Mamba-2 layer: the first attention layer's biases
        layer = f"model.layers.{config.layer_types.index('full_attention')}." \
            if "full_attention" in config.layer_types else layer
    windows = layer_windows(config, arch)
    L, E = config.num_hidden_layers, getattr(config, arch.experts_key, 0) if arch.experts_key else 0
    sparse = tuple(bool(E) and not (arch.sparse_step and (i in (config.mlp_only_layers or [])
                                                         or (i + 1) % config.decoder_sparse_step)) for i in range(L))
    norm_topk = arch.norm_topk_prob if isinstance(arch.norm_topk_prob, bool) else getattr(config, arch.norm_topk_prob)
    multipliers = arch.multipliers
    conv = tuple(t == "conv" for t in config.layer_types[:L]) if arch.conv else ()
    return ModelArgs(
        architecture=arch.name, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=lfm2_ff_size(config) if arch.conv else getattr(config, arch.shared_key) if arch.shared_key
        else config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim, rms_norm_eps=getattr(config, arch.eps_key), max_seq_len=max_seq_len,
        qkv_bias=layer + "self_attn.q_proj.bias" in weights or layer + "self_attn.qkv_proj.bias" in weights,
        o_bias=layer + "self_attn.o_proj.bias" in weights,
        mlp_bias=layer + "mlp.gate_proj.bias" in weights or layer + "mlp.gate_up_proj.bias" in weights,
        act=getattr(config, arch.act_key, "silu"), qk_norm=arch.qk_norm, sandwich_norms=arch.sandwich_norms,
        embed_scale=config.hidden_size ** 0.5 if arch.embed_scale else
        config.embedding_multiplier if multipliers else 1.0,
        attn_scale=getattr(config, arch.query_scale_key) ** -0.5 if arch.query_scale_key else
        config.attention_multiplier if multipliers else 0.0,
        attn_softcap=arch.softcap and getattr(config, "attn_logit_softcapping", None) or 0.0,
        final_softcap=arch.softcap and getattr(config, "final_logit_softcapping", None) or 0.0,
        windows=windows if any(windows) else (),
        local_rope=tuple(t == "sliding_attention" for t in config.layer_types[:config.num_hidden_layers])
        if arch.local_rope else (),
        qk_norm_whole=arch.qk_norm_whole, residual_scale=config.residual_multiplier if multipliers else 1.0,
        logits_scale=config.logits_scaling if multipliers else 1.0, sparse_layers=sparse if any(sparse) else (),
        num_experts=E, top_k=config.num_experts_per_tok if E else 0,
        expert_size=getattr(config, arch.moe_size_key) if E else 0, norm_topk_prob=bool(norm_topk),
        conv_layers=conv, conv_kernel=config.conv_L_cache if conv else 0, conv_bias=bool(conv) and config.conv_bias,
        rope=not arch.mamba or config.position_embedding_type == "rope", shared_mlp=bool(arch.shared_key) and bool(E),
        **(mamba_args(config) if arch.mamba else {}),
    )


def mamba_args(config) -> dict:
    """Granite 4.0-H's Mamba-2 options (GraniteMoeHybridConfig)."""
    return dict(mamba_layers=tuple(t == "linear_attention" for t in config.layer_types[:config.num_hidden_layers]),
                mamba_heads=config.mamba_n_heads, mamba_head_dim=config.mamba_d_head, mamba_state=config.mamba_d_state,
                mamba_groups=config.mamba_n_groups, mamba_kernel=config.mamba_d_conv,
                mamba_conv_bias=config.mamba_conv_bias, mamba_proj_bias=config.mamba_proj_bias,
                dt_limit=tuple(map(float, config.time_step_limit or (0.0, float("inf")))))


def plain_layers(a: ModelArgs) -> ModelArgs:
    """`a`'s sizes and biases with the Llama layer's options (what a drafter's own layers are)."""
    return replace(a, act="silu", qk_norm=False, sandwich_norms=False, embed_scale=1.0, attn_scale=0.0,
                   attn_softcap=0.0, final_softcap=0.0, windows=(), local_rope=(), qk_norm_whole=False,
                   residual_scale=1.0, logits_scale=1.0, sparse_layers=(), num_experts=0, top_k=0, expert_size=0,
                   conv_layers=(), conv_kernel=0, conv_bias=False, rope=True, shared_mlp=False, mamba_layers=())


# the MLP activations by their transformers names (architectures.ACTIVATIONS lists them)
ACTIVATIONS = {"silu": nn.functional.silu, "swish": nn.functional.silu, "gelu": nn.functional.gelu,
               "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x, cos, sin):
    """x (B, n, S, D) rotated by the tables' first R dims (R = D but for partial rotary: the rest passes)."""
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated = x[..., :R] * cos + rotate_half(x[..., :R]) * sin
    return torch.cat((rotated, x[..., R:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, window: int = 0):
        super().__init__()
        self.a, self.window = a, window
        self.scale = a.attn_scale or a.head_dim ** -0.5
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        if a.qk_norm:   # per head, or over the whole projection (OLMoE)
            self.q_norm = RMSNorm(a.head_dim * (a.num_heads if a.qk_norm_whole else 1), a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim * (a.num_kv_heads if a.qk_norm_whole else 1), a.rms_norm_eps)

    def forward(self, x, cos, sin, past_len, tree_mask, k_cache, v_cache):
        B, S, _ = x.shape
        a = self.a
        q, k = self.q_proj(x), self.k_proj(x)                                      # (B, S, H*D), (B, S, Hkv*D)
        if a.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, a.num_heads, a.head_dim)                                  # (B, S, H, D)
        k = k.view(B, S, a.num_kv_heads, a.head_dim)                               # (B, S, Hkv, D)
        v = self.v_proj(x).view(B, S, a.num_kv_heads, a.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        if a.qk_norm and not a.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)                                # (B, H, S, D), (B, Hkv, S, D)
        if a.rope:
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = tree_attention(q, k_cache, v_cache, k, v, past_len, tree_mask, self.scale, self.window, a.attn_softcap)
        y = y.transpose(1, 2).reshape(B, S, a.num_heads * a.head_dim)               # (B, S, H*D)
        return self.o_proj(y), k, v


class MLP(nn.Module):
    def __init__(self, a: ModelArgs, size: int = 0):
        super().__init__()
        self.act = ACTIVATIONS[a.act]
        size = size or a.intermediate_size
        self.gate_proj = nn.Linear(a.hidden_size, size, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden_size, size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(size, a.hidden_size, bias=a.mlp_bias)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs, index: int = 0):
        super().__init__()
        self.sandwich, self.residual_scale = a.sandwich_norms, a.residual_scale
        if a.conv_layers and a.conv_layers[index]:   # LFM2's conv layer (specrt.export.hybrid)
            self.conv = ShortConv(a)
        elif a.mamba_layers and a.mamba_layers[index]:   # Granite 4.0-H's Mamba-2 mixer (specrt.export.hybrid)
            self.mamba = Mamba2(a, ACTIVATIONS[a.act])
        else:
            self.self_attn = Attention(a, a.windows[index] if a.windows else 0)
        if a.sparse_layers and a.sparse_layers[index]:
            self.mlp = SparseMoE(a.hidden_size, a.num_experts, a.top_k, a.norm_topk_prob,
                                 lambda: MLP(a, a.expert_size))
        else:
            self.mlp = MLP(a)
        if a.shared_mlp:
            self.shared_mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin, past_len, tree_mask, *caches, taps=None):
        """-> x and the new cache entries: keys and values, or a conv or Mamba-2 layer's inputs (`taps`:
        hybrid.conv_taps or hybrid.mamba_context)."""
        if taps is not None:
            mixer = self.conv if hasattr(self, "conv") else self.mamba
            h, *new = mixer(self.input_layernorm(x), taps, caches)
        else:
            h, *new = self.self_attn(self.input_layernorm(x), cos, sin, past_len, tree_mask, *caches)
        if not self.sandwich:
            r = self.residual_scale   # Granite's residual multiplier; 1: none
            x = x + (h if r == 1.0 else h * r)
            h = self.post_attention_layernorm(x)
            y = self.mlp(h) + self.shared_mlp(h) if hasattr(self, "shared_mlp") else self.mlp(h)
            return x + (y if r == 1.0 else y * r), *new
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), *new


class SpecModel(nn.Module):
    """Weights under the transformers names (`model.layers.N...`, `lm_head`), so `load_state_dict` maps 1:1.
    `local_rope`: the (cos, sin) tables of the layers that `a.local_rope` marks (Gemma 3's sliding layers)."""

    def __init__(self, a: ModelArgs, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                 vocab_subset: torch.Tensor | None = None, local_rope: tuple | None = None):
        super().__init__()
        self.args = a
        kept = a.vocab_size if vocab_subset is None else len(vocab_subset)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.model.layers = nn.ModuleList(Block(a, i) for i in range(a.num_layers))
        self.model.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, kept, bias=False)
        # the kept output ids (K,), part of the weights (and of their hash); None: the whole vocabulary
        self.register_buffer("vocab_index", None if vocab_subset is None else vocab_subset.long())
        self.register_buffer("rope_cos", rope_cos, persistent=False)  # (Smax, R)
        self.register_buffer("rope_sin", rope_sin, persistent=False)  # (Smax, R)
        local_cos, local_sin = local_rope if any(a.local_rope) else (None, None)
        self.register_buffer("local_cos", local_cos, persistent=False)  # (Smax, R)
        self.register_buffer("local_sin", local_sin, persistent=False)  # (Smax, R)
        self.aux_layers: tuple[int, ...] = ()   # the layers whose inputs the graph also outputs (`aux`)

    def forward(self, input_ids, position_ids, past_len, tree_mask, num_logits, *caches):
        x = self.model.embed_tokens(input_ids)                           # (B, S, d)
        if self.args.embed_scale != 1.0:
            x = x * self.args.embed_scale
        rotations = [(self.rope_cos[position_ids].unsqueeze(1),           # (B, 1, S, R)
                      self.rope_sin[position_ids].unsqueeze(1))]
        if self.local_cos is not None:
            rotations.append((self.local_cos[position_ids].unsqueeze(1), self.local_sin[position_ids].unsqueeze(1)))
        new_kv, aux, conv = [], {}, self.args.conv_layers
        taps = conv_taps(position_ids, past_len, tree_mask, self.args) if any(conv) else None
        start, mamba = cache_index(self.args), self.args.mamba_layers
        if any(mamba):
            first = 2 * start[mamba.index(True)]
            taps = mamba_context(position_ids, past_len, tree_mask, caches[first], self.args)
        for i, layer in enumerate(self.model.layers):
            if i in self.aux_layers:
                aux[i] = x
            cos, sin = rotations[bool(self.args.local_rope) and self.args.local_rope[i]]
            x, *new = layer(x, cos, sin, past_len, tree_mask, *caches[2 * start[i]:2 * start[i + 1]],
                            taps=taps if (conv and conv[i]) or (mamba and mamba[i]) else None)
            new_kv += new
        aux[len(self.model.layers)] = x
        hidden = self.model.norm(x)                                      # (B, S, d)
        S = hidden.shape[1]
        last = torch.arange(S - num_logits[0], S)                        # the positions whose logits we need
        logits = self.lm_head(hidden.index_select(1, last))              # (B, num_logits, K)
        if self.args.final_softcap:
            logits = torch.tanh(logits / self.args.final_softcap) * self.args.final_softcap
        if self.args.logits_scale != 1.0:
            logits = logits / self.args.logits_scale
        if self.vocab_index is not None:
            logits = full_vocab(logits, self.vocab_index, self.args.vocab_size)  # (B, num_logits, V)
        if self.aux_layers:
            return (logits, hidden, *new_kv, torch.cat([aux[i] for i in self.aux_layers], -1))  # (B, S, n*d)
        return (logits, hidden, *new_kv)


def full_vocab(logits: torch.Tensor, index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over kept ids `index` (..., K) -> (..., vocab_size), -inf at every other id."""
    full = torch.full((*logits.shape[:-1], vocab_size), float("-inf"), dtype=logits.dtype)
    return full.scatter(-1, index.expand(*logits.shape), logits)


def rope_tables(hf_model, max_seq_len: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [Smax, R] from the model's own rotary embedding (covers its rope scaling; R < head_dim for a
    partial rotary). `layer_type`: the tables of that layer type, where the model rotates each type its own way."""
    rotary = hf_model.model.rotary_emb
    positions = torch.arange(max_seq_len)[None, :]
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(probe, positions) if layer_type is None else rotary(probe, positions, layer_type)
    return cos[0].float().contiguous(), sin[0].float().contiguous()


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}   # Phi-3's


def hf_weights(state: dict, arch: Architecture, a: ModelArgs) -> dict:
    """A transformers state dict under the names and conventions of `SpecModel`: fused projections split, the
    norms' offset folded into their weights, the LM head of tied embeddings, no rotary buffers."""
    state = {k: v for k, v in state.items() if not k.endswith("inv_freq")}
    if "lm_head.weight" not in state:  # tied embeddings
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if arch.fused_projections:   # output rows [q; k; v] and [gate; up]
        sizes = {"qkv_proj": [a.num_heads * a.head_dim] + [a.num_kv_heads * a.head_dim] * 2,
                 "gate_up_proj": [a.intermediate_size] * 2}
        for key in list(state):
            fused = next((f for f in FUSED if f".{f}." in key), None)
            if fused is not None:
                parts = state.pop(key).split(sizes[fused], dim=0)
                state.update({key.replace(fused, name): part for name, part in zip(FUSED[fused], parts)})
    if arch.norm_offset:
        state = {k: v + arch.norm_offset if k.endswith("norm.weight") else v for k, v in state.items()}
    if arch.experts_key:   # the stacked expert tensors as each expert's own weights
        state = split_experts(state, arch.moe_block, arch.router)
    if arch.conv:
        state = lfm2_weights(state)
    if arch.mamba:
        state = granite_hybrid_weights(state, a)
    return state


def from_hf(hf_model, max_seq_len: int, vocab_subset: list[int] | None = None) -> SpecModel:
    """`vocab_subset`: the output ids a draft keeps (its lm_head rows), or None for the whole vocabulary."""
    config = hf_model.config
    arch = architecture_of(config, f"{config.model_type!r} checkpoint")
    state = hf_model.state_dict()
    args = args_from_config(config, arch, max_seq_len, set(state))
    cos, sin = rope_tables(hf_model, max_seq_len, "full_attention" if arch.local_rope else None) if args.rope \
        else (torch.zeros(max_seq_len, 0),) * 2   # no rotation (Granite 4.0-H without rope)
    local = rope_tables(hf_model, max_seq_len, "sliding_attention") if any(args.local_rope) else None
    index = None if vocab_subset is None else torch.tensor(vocab_subset, dtype=torch.int64)
    with torch.device("meta"):   # no weights of its own: it takes the model's tensors (assign), no second copy
        model = SpecModel(args, cos, sin, index, local)
    state = hf_weights(state, arch, args)
    if index is not None:
        state["lm_head.weight"] = state["lm_head.weight"].index_select(0, index)   # (K, d)
        state["vocab_index"] = index
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
