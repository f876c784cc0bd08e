"""LFM2's gated short convolution (`layer_types` "conv") and Granite 4.0-H's Mamba-2 mixer (below), in the graph
of the engine contract.

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
    """Per layer, its first cache pair (attention layers take one, conv layers `conv_pairs`, Mamba-2 layers
    `mamba_pairs`); then the total."""
    starts, n = [], 0
    for i in range(a.num_layers):
        starts.append(n)
        n += conv_pairs(a) if a.conv_layers and a.conv_layers[i] else \
            mamba_pairs(a) if a.mamba_layers and a.mamba_layers[i] else 1
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


# Granite 4.0-H's Mamba-2 mixer (`layer_types` "linear_attention"): h_p = exp(a_p) h_{p-1} + dt_p x_p B_p^T and
# y_p = C_p . h_p + D x_p per head (a_p = A dt_p < 0), after a causal depthwise conv of kernel K over [x; B; C].
# Its state h is a recurrence over the whole past, which a rejected draft cannot roll back by an index; so the
# layer keeps, like LFM2's conv, its inputs of every position in cache pairs (the conv's input [x; B; C] and dt:
# `mamba_width` floats) and a pass recomputes what it needs from them in Mamba-2's dual, attention-like form:
# y_i = sum_j exp(L_ij) (C_i . B_j) dt_j x_j + D x_i, L_ij the sum of a_k over the positions after j up to i along
# i's path (a cached j: the cached positions after it, then i's ancestors-or-self in the pass; a pass node j: the
# nodes between them on i's path), j over the cached positions and i's ancestors-or-self. Chains and trees alike,
# rolled back, compacted and copied with the keys and values. The cost is not Mamba's O(1) a token: a pass reads
# and recomputes from every cached position (on the CPU 3.3-5.6x a Llama pass after 1,024 positions, no slower after
# 64), and the cache grows with the context. See docs/notes/2026-12-hybrid.md.

def mamba_width(a) -> int:
    """Floats a Mamba-2 layer keeps a position: its conv input [x; B; C] and its dt (before bias and softplus)."""
    return a.mamba_heads * a.mamba_head_dim + 2 * a.mamba_groups * a.mamba_state + a.mamba_heads


def mamba_pairs(a) -> int:
    """Cache pairs (k, v buffers [B, Hkv, Smax, D]) that a Mamba-2 layer's `mamba_width` floats take a position."""
    return math.ceil(mamba_width(a) / (2 * a.num_kv_heads * a.head_dim))


def mamba_context(position_ids, past_len, tree_mask, cache, a) -> tuple:
    """Once per graph: (valid, picks, tree_mask). valid (B, T): the cache slots below past_len; picks, for each conv
    tap t = K - 1 .. 1: q (B, S) the cache slot p - t (clamped), j (B, S) the pass's node at p - t that the token
    sees, in_pass (B, S, 1) whether there is one, before (B, S, 1) p - t < 0 (zero, as transformers' zero state)."""
    valid = torch.arange(cache.shape[2])[None, :] < past_len[:, None]                # (B, T)
    picks = []
    for t in range(a.mamba_kernel - 1, 0, -1):
        q = position_ids - t                                                        # (B, S)
        seen = (tree_mask & (position_ids.unsqueeze(1) == q.unsqueeze(2))).to(torch.float32)   # (B, S, S)
        slot = torch.minimum(q, past_len[:, None] - 1).clamp(min=0)
        picks.append((slot, seen.argmax(-1), (seen.amax(-1) > 0).unsqueeze(-1), (q < 0).unsqueeze(-1)))
    return valid, picks, tree_mask


class GatedNorm(nn.Module):
    """transformers' GraniteMoeHybridRMSNormGated: y * silu(z), RMS-normed per group of I / G channels."""

    def __init__(self, size: int, groups: int, eps: float):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, y, z):                                            # (B, S, I) each
        y = y * nn.functional.silu(z)
        g = y.unflatten(-1, (self.groups, -1))                          # (B, S, G, I/G)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2)


class Mamba2(nn.Module):
    """transformers' GraniteMoeHybridMambaLayer: its in_proj [z; xBC; dt] as three projections of one input (merged
    into one MatMul by the CPU build); `taps` the depthwise conv kernel, K vectors (C,), tap k reading K - 1 - k back
    (one parameter each: a pass multiplies whole shifted inputs by them, with no (B, T, K, C) stack)."""

    def __init__(self, a, act):
        super().__init__()
        d, nh, hd, N, G = a.hidden_size, a.mamba_heads, a.mamba_head_dim, a.mamba_state, a.mamba_groups
        inner, bias = nh * hd, a.mamba_proj_bias
        self.sizes, self.shape, self.act, self.limit = (inner, G * N, G * N), (nh, hd, N, G), act, a.dt_limit
        self.pairs, self.heads = mamba_pairs(a), (a.num_kv_heads, a.head_dim)
        self.z_proj, self.dt_proj = nn.Linear(d, inner, bias=bias), nn.Linear(d, nh, bias=bias)
        self.xbc_proj = nn.Linear(d, inner + 2 * G * N, bias=bias)
        self.taps = nn.ParameterList(torch.zeros(inner + 2 * G * N) for _ in range(a.mamba_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(inner + 2 * G * N)) if a.mamba_conv_bias else None
        self.dt_bias, self.A, self.D = (nn.Parameter(torch.zeros(nh)) for _ in range(3))   # A = -exp(A_log)
        self.norm = GatedNorm(inner, G, a.rms_norm_eps)
        self.out_proj = nn.Linear(inner, d, bias=bias)

    def conv(self, x):
        x = x if self.conv_bias is None else x + self.conv_bias
        return self.act(x).split(self.sizes, -1)                        # x, B, C

    def step(self, dt):
        """dt (before bias and softplus) -> (dt, a = A dt: the log of the state's decay over the step)."""
        dt = nn.functional.softplus(dt + self.dt_bias)
        if self.limit != (0.0, float("inf")):
            dt = dt.clamp(*self.limit)
        return dt, dt * self.A

    def forward(self, x, context, caches):                              # x (B, S, d); caches: 2n (B, Hkv, T, D)
        B, S, _ = x.shape
        (nh, hd, N, G), K, C = self.shape, len(self.taps), sum(self.sizes)
        valid, picks, tree_mask = context
        z, xbc, dt = self.z_proj(x), self.xbc_proj(x), self.dt_proj(x)  # (B, S, I), (B, S, C), (B, S, nh)
        stored = torch.cat([c.transpose(1, 2).flatten(2) for c in caches], -1)   # (B, T, 2n*Hkv*D)
        old_xbc, old_dt = stored[..., :C], stored[..., C:C + nh]        # (B, T, C), (B, T, nh)
        # the conv of the pass's tokens: each reads its K - 1 earlier inputs (pass node, cache slot or zero)
        window = [torch.where(in_pass, xbc.gather(1, j.unsqueeze(-1).expand(B, S, C)),
                              old_xbc.gather(1, q.unsqueeze(-1).expand(B, S, C)).masked_fill(before, 0.0))
                  for q, j, in_pass, before in picks]                   # each (B, S, C)
        x_new, b_new, c_new = self.conv(sum(w * tap for w, tap in zip(window + [xbc], self.taps)))
        # the conv of the cached positions (slot = position; zero before the first)
        padded = nn.functional.pad(old_xbc, (0, 0, K - 1, 0))           # (B, K-1+T, C)
        x_old, b_old, _ = self.conv(sum(padded[:, k:(k - K + 1) or None] * tap for k, tap in enumerate(self.taps)))
        (dt_old, a_old), (dt_new, a_new) = self.step(old_dt), self.step(dt)   # (B, T, nh), (B, S, nh)
        a_old = a_old * valid.unsqueeze(-1)                             # slots at or past past_len: no step
        after = a_old.flip(1).cumsum(1).flip(1) - a_old                 # (B, T, nh): cached steps after j
        path = (tree_mask.to(torch.float32) @ a_new).transpose(1, 2)    # (B, nh, S): i's ancestors-or-self
        to_old = (after.transpose(1, 2).unsqueeze(2) + path.unsqueeze(-1)).masked_fill(
            ~valid[:, None, None, :], float("-inf"))                    # (B, nh, S, T)
        to_new = (path.unsqueeze(-1) - path.unsqueeze(-2)).masked_fill(~tree_mask.unsqueeze(1), float("-inf"))
        query = c_new.unflatten(-1, (G, N)).transpose(1, 2)             # (B, G, S, N)

        def mix(decay, b, x, dt):   # the cached positions' or the pass's part of the sum over j
            scores = query @ b.unflatten(-1, (G, N)).permute(0, 2, 3, 1)                   # (B, G, S, M)
            scores = scores.unsqueeze(2).expand(-1, -1, nh // G, -1, -1).flatten(1, 2)     # (B, nh, S, M)
            values = (x.unflatten(-1, (nh, hd)) * dt.unsqueeze(-1)).transpose(1, 2)       # (B, nh, M, hd)
            return (decay.exp() * scores) @ values                                         # (B, nh, S, hd)
        skip = (x_new.unflatten(-1, (nh, hd)).transpose(-1, -2) * self.D).transpose(-1, -2)   # (B, S, nh, hd)
        y = (mix(to_old, b_old, x_old, dt_old) + mix(to_new, b_new, x_new, dt_new)).transpose(1, 2) + skip
        y = self.out_proj(self.norm(y.flatten(2), z))                   # (B, S, d)
        (Hkv, D), n = self.heads, 2 * self.pairs
        new = nn.functional.pad(torch.cat([xbc, dt], -1), (0, n * Hkv * D - C - nh))   # (B, S, 2n*Hkv*D)
        new = new.view(B, S, n, Hkv, D).permute(2, 0, 3, 1, 4)         # (2n, B, Hkv, S, D)
        return (y, *new.unbind(0))


def granite_hybrid_weights(state: dict, a) -> dict:
    """A GraniteMoeHybrid state dict under SpecModel's names: each Mamba layer's in_proj split in three, its conv
    kernel [C, 1, K] as K `taps` [C], A_log as A = -exp(A_log); the shared MLP's input_linear [gate; up] split
    (`mlp` in a dense model, `shared_mlp` beside the experts)."""
    inner, C = a.mamba_heads * a.mamba_head_dim, a.mamba_heads * a.mamba_head_dim + 2 * a.mamba_groups * a.mamba_state
    shared = "shared_mlp" if a.shared_mlp else "mlp"
    out = {}
    for key, value in state.items():
        if ".mamba.in_proj." in key:   # rows [z; xBC; dt]
            for name, part in zip(("z_proj", "xbc_proj", "dt_proj"), value.split([inner, C, a.mamba_heads])):
                out[key.replace("in_proj", name)] = part
        elif key.endswith(".mamba.conv1d.weight"):
            for k, tap in enumerate(value[:, 0, :].t()):
                out[key.replace("conv1d.weight", f"taps.{k}")] = tap.contiguous()
        elif key.endswith(".mamba.A_log"):
            out[key.replace("A_log", "A")] = -torch.exp(value.float())
        elif key.endswith(".mamba.conv1d.bias"):
            out[key.replace("conv1d.bias", "conv_bias")] = value
        elif ".shared_mlp.input_linear." in key:
            gate, up = value.chunk(2, dim=0)
            out[key.replace("shared_mlp.input_linear", f"{shared}.gate_proj")] = gate
            out[key.replace("shared_mlp.input_linear", f"{shared}.up_proj")] = up
        elif ".shared_mlp.output_linear." in key:
            out[key.replace("shared_mlp.output_linear", f"{shared}.down_proj")] = value
        else:
            out[key] = value
    return out
