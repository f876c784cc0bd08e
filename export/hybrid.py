"""LFM2's gated short convolution (`layer_types` "conv"), in the graph of the engine contract.

A conv layer computes B, C, x = in_proj(h) split in three; u = B * x; y = C * conv(u); out_proj(y), where conv is
a causal depthwise convolution of kernel K (`conv_L_cache`): each token's output reads u at its own position and
at the K - 1 positions before it. Its state is those K - 1 inputs, so the layer keeps u of every position in the
cache, beside the keys and values, written at past_len by the runtime like them: a conv layer takes
n = ceil(d / (2 * Hkv * D)) cache pairs of the attention layers' shape [B, Hkv, Smax, D] (u padded to
2n * Hkv * D, split over the 2n buffers). Truncating the cache (moving past_len), compacting an accepted tree
path and copying a prefix all move u with the keys and values: the conv state is rolled back exactly, for free,
and the runtime knows nothing of conv layers.

A pass over S tokens finds each token's K - 1 earlier inputs by position (`conv_taps`, once per graph): the input
at position p - t is the pass's own node j when the tree mask lets the token see j and j sits at p - t (in a
chain the token t before it, in a tree its ancestor t levels up), else the cache's slot p - t (p - t < past_len),
else zero (before the sequence's start, as transformers' zero conv state). Chains and trees alike.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def conv_pairs(a) -> int:
    """Cache pairs (k, v buffers [B, Hkv, Smax, D]) that a conv layer's input u [d] takes per position."""
    return math.ceil(a.hidden_size / (2 * a.num_kv_heads * a.head_dim))


def cache_index(a) -> list[int]:
    """Per layer, its first cache pair (attention layers take one, conv layers `conv_pairs`); then the total."""
    starts, n = [], 0
    for i in range(a.num_layers):
        starts.append(n)
        n += conv_pairs(a) if a.conv_layers and a.conv_layers[i] else 1
    return starts + [n]


def cache_layers(a) -> int:
    """The cache pairs of a model: the manifest's `layers`, what the runtime sizes its KVCache by."""
    return cache_index(a)[-1]


def conv_taps(position_ids, past_len, tree_mask, a) -> tuple:
    """Once per graph, where each new token's K - 1 earlier conv inputs are: (at, picks). at (B, Hkv, (K-1)*S, D):
    the cache slots to read (p - t, below past_len; tap-major). picks, for t = K - 1 .. 1: j (B, S, d) the pass's
    node at p - t that the token sees, in_pass (B, S, 1) whether there is one, before (B, S, 1) p - t < 0."""
    B, S = position_ids.shape
    qs, picks = [], []
    for t in range(a.conv_kernel - 1, 0, -1):
        q = position_ids - t                                                        # (B, S)
        seen = tree_mask & (position_ids.unsqueeze(1) == q.unsqueeze(2))           # (B, S, S): j at q, visible
        seen = seen.to(torch.float32)
        j = seen.argmax(-1).unsqueeze(-1).expand(B, S, a.hidden_size)               # (B, S, d)
        picks.append((j, (seen.amax(-1) > 0).unsqueeze(-1), (q < 0).unsqueeze(-1)))
        qs.append(q)
    at = torch.minimum(torch.cat(qs, 1), past_len[:, None] - 1).clamp(min=0)       # (B, M): the others unused
    return at[:, None, :, None].expand(B, a.num_kv_heads, len(qs) * S, a.head_dim), picks


class ShortConv(nn.Module):
    """LFM2's conv layer (transformers' Lfm2ShortConv): its in_proj [B; C; x] as three projections of one input
    (merged into one MatMul by the CPU build); `taps` (K, d) holds the depthwise kernel, tap k reading the input
    K - 1 - k positions back."""

    def __init__(self, a):
        super().__init__()
        d, self.pairs, self.heads = a.hidden_size, conv_pairs(a), (a.num_kv_heads, a.head_dim)
        self.b_proj, self.c_proj, self.x_proj = (nn.Linear(d, d, bias=a.conv_bias) for _ in range(3))
        self.out_proj = nn.Linear(d, d, bias=a.conv_bias)
        self.taps = nn.Parameter(torch.zeros(a.conv_kernel, d))
        self.bias = nn.Parameter(torch.zeros(d)) if a.conv_bias else None

    def forward(self, x, taps, caches):                                 # x (B, S, d); caches: 2n (B, Hkv, T, D)
        B, S, d = x.shape
        at, picks = taps
        u = self.b_proj(x) * self.x_proj(x)                             # (B, S, d): the conv's input
        (Hkv, D), n = self.heads, 2 * self.pairs
        stored = torch.cat([cache.gather(2, at) for cache in caches], 1)   # (B, 2n*Hkv, M, D)
        stored = stored.transpose(1, 2).reshape(B, len(picks), S, -1)[..., :d]   # (B, K-1, S, d)
        window = [torch.where(in_pass, u.gather(1, j), stored[:, k].masked_fill(before, 0.0))
                  for k, (j, in_pass, before) in enumerate(picks)]     # each (B, S, d)
        y = (torch.stack(window + [u], 2) * self.taps).sum(2)          # (B, S, K, d) -> (B, S, d)
        if self.bias is not None:
            y = y + self.bias
        new = u if n * Hkv * D == d else nn.functional.pad(u, (0, n * Hkv * D - d))   # (B, S, 2n*Hkv*D)
        new = new.view(B, S, n, Hkv, D).permute(2, 0, 3, 1, 4)         # (2n, B, Hkv, S, D)
        return (self.out_proj(self.c_proj(x) * y), *new.unbind(0))


RENAMES = {".operator_norm.": ".input_layernorm.", ".ffn_norm.": ".post_attention_layernorm.",
           ".self_attn.out_proj.": ".self_attn.o_proj.", ".q_layernorm.": ".q_norm.", ".k_layernorm.": ".k_norm.",
           ".feed_forward.w1.": ".mlp.gate_proj.", ".feed_forward.w3.": ".mlp.up_proj.",
           ".feed_forward.w2.": ".mlp.down_proj.", "model.embedding_norm.": "model.norm.",
           ".conv.conv.bias": ".conv.bias"}


def lfm2_weights(state: dict) -> dict:
    """An LFM2 state dict under SpecModel's names; the conv's in_proj split in three, its kernel [d, 1, K] as
    `conv.taps` [K, d]."""
    out = {}
    for key, value in state.items():
        if key.endswith(".conv.conv.weight"):
            out[key.replace(".conv.conv.weight", ".conv.taps")] = value[:, 0, :].t().contiguous()
            continue
        if ".conv.in_proj." in key:   # rows [B; C; x]
            for name, part in zip(("b_proj", "c_proj", "x_proj"), value.chunk(3, dim=0)):
                out[key.replace("in_proj", name)] = part
            continue
        for old, new in RENAMES.items():
            key = key.replace(old, new)
        out[key] = value
    return out


def lfm2_ff_size(config) -> int:
    """The MLP's width as transformers' Lfm2MLP computes it from the config (block_auto_adjust_ff_dim)."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            size = config.block_multiple_of * ((size + config.block_multiple_of - 1) // config.block_multiple_of)
    return size
