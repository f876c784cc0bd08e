"""The target/draft graph of the engine contract, written once for the Llama family.

forward(input_ids, position_ids, past_len, tree_mask, num_logits, *caches)
    -> logits [B, num_logits, V], hidden [B, S, d], then per layer new keys and values [B, Hkv, S, D].
`caches` are the static buffers [B, Hkv, Smax, D], read only (k0, v0, k1, v1, ...).
`num_logits` [1] asks for the logits of the last positions only (prefill needs one).
A draft may keep a reduced output vocabulary (`vocab_subset`, K ids): its lm_head is [K, d] and the K logits are
scattered into a full row that is -inf elsewhere, so the output stays [B, n, V] and every other id has draft
probability exactly zero (the rejection rule stays exact).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specrt.export.architectures import REGISTRY, Architecture
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


def args_from_config(config, arch: Architecture, max_seq_len: int) -> ModelArgs:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelArgs(
        architecture=arch.name, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim, rms_norm_eps=config.rms_norm_eps, max_seq_len=max_seq_len,
        qkv_bias=arch.qkv_bias or bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)) and arch.name == "llama",
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
    )


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


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)

    def forward(self, x, cos, sin, past_len, tree_mask, k_cache, v_cache):
        B, S, _ = x.shape
        a = self.a
        q = self.q_proj(x).view(B, S, a.num_heads, a.head_dim).transpose(1, 2)     # (B, H, S, D)
        k = self.k_proj(x).view(B, S, a.num_kv_heads, a.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        v = self.v_proj(x).view(B, S, a.num_kv_heads, a.head_dim).transpose(1, 2)  # (B, Hkv, S, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = tree_attention(q, k_cache, v_cache, k, v, past_len, tree_mask, a.head_dim ** -0.5)
        y = y.transpose(1, 2).reshape(B, S, a.num_heads * a.head_dim)               # (B, S, H*D)
        return self.o_proj(y), k, v


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin, past_len, tree_mask, k_cache, v_cache):
        h, k, v = self.self_attn(self.input_layernorm(x), cos, sin, past_len, tree_mask, k_cache, v_cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), k, v


class SpecModel(nn.Module):
    """Weights under the transformers names (`model.layers.N...`, `lm_head`), so `load_state_dict` maps 1:1."""

    def __init__(self, a: ModelArgs, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                 vocab_subset: torch.Tensor | None = None):
        super().__init__()
        self.args = a
        kept = a.vocab_size if vocab_subset is None else len(vocab_subset)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.model.layers = nn.ModuleList(Block(a) for _ in range(a.num_layers))
        self.model.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, kept, bias=False)
        # the kept output ids (K,), part of the weights (and of their hash); None: the whole vocabulary
        self.register_buffer("vocab_index", None if vocab_subset is None else vocab_subset.long())
        self.register_buffer("rope_cos", rope_cos, persistent=False)  # (Smax, D)
        self.register_buffer("rope_sin", rope_sin, persistent=False)  # (Smax, D)

    def forward(self, input_ids, position_ids, past_len, tree_mask, num_logits, *caches):
        x = self.model.embed_tokens(input_ids)                           # (B, S, d)
        cos = self.rope_cos[position_ids].unsqueeze(1)                   # (B, 1, S, D)
        sin = self.rope_sin[position_ids].unsqueeze(1)                   # (B, 1, S, D)
        new_kv = []
        for i, layer in enumerate(self.model.layers):
            x, k, v = layer(x, cos, sin, past_len, tree_mask, caches[2 * i], caches[2 * i + 1])
            new_kv += [k, v]
        hidden = self.model.norm(x)                                      # (B, S, d)
        S = hidden.shape[1]
        last = torch.arange(S - num_logits[0], S)                        # the positions whose logits we need
        logits = self.lm_head(hidden.index_select(1, last))              # (B, num_logits, K)
        if self.vocab_index is not None:
            logits = full_vocab(logits, self.vocab_index, self.args.vocab_size)  # (B, num_logits, V)
        return (logits, hidden, *new_kv)


def full_vocab(logits: torch.Tensor, index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over kept ids `index` (..., K) -> (..., vocab_size), -inf at every other id."""
    full = torch.full((*logits.shape[:-1], vocab_size), float("-inf"), dtype=logits.dtype)
    return full.scatter(-1, index.expand(*logits.shape), logits)


def rope_tables(hf_model, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [Smax, D] from the model's own rotary embedding (covers its rope scaling)."""
    rotary = hf_model.model.rotary_emb
    positions = torch.arange(max_seq_len)[None, :]
    probe = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(probe, positions)
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def from_hf(hf_model, max_seq_len: int, vocab_subset: list[int] | None = None) -> SpecModel:
    """`vocab_subset`: the output ids a draft keeps (its lm_head rows), or None for the whole vocabulary."""
    arch = REGISTRY[hf_model.config.model_type]
    args = args_from_config(hf_model.config, arch, max_seq_len)
    cos, sin = rope_tables(hf_model, max_seq_len)
    index = None if vocab_subset is None else torch.tensor(vocab_subset, dtype=torch.int64)
    with torch.device("meta"):   # no weights of its own: it takes the model's tensors (assign), no second copy
        model = SpecModel(args, cos, sin, index)
    state = hf_model.state_dict()
    if "lm_head.weight" not in state:  # tied embeddings
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if index is not None:
        state["lm_head.weight"] = state["lm_head.weight"].index_select(0, index)   # (K, d)
        state["vocab_index"] = index
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
