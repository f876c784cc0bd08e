"""The ONNX target graph (through the runtime's engine and KV cache) against transformers, in fp32:
prefill, decode steps, and a verification block with a tree mask. Generated from the architecture registry.
The CPU engines are built fused (specrt.export.fuse); the exported graph as it is (--no-fuse) is checked too."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import MATRIX
from specrt.export.architectures import REGISTRY
from specrt.export.model import from_hf
from specrt.decoding.generate import Generator

TOL = 1e-4
# a tree over 7 nodes: node 0 is the root, parents given per node; siblings at depths 1 and 2
PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def tree_mask(parents):
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = []
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
        depth.append(0 if p < 0 else depth[p] + 1)
    return mask, torch.tensor(depth)


def path(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_tree_logits(model, seq, nodes, parents):
    """Each tree node's logits from transformers: its root-to-node path run after `seq` as a plain sequence (one
    pass per leaf: a node's logits are those at its place on any path through it)."""
    out = [None] * len(parents)
    for leaf in sorted(set(range(len(parents))) - set(parents)):
        on_path = path(parents, leaf)
        for i, row in zip(on_path, hf_logits(model, seq + nodes[on_path].tolist())[-len(on_path):]):
            out[i] = row
    return torch.stack(out)


def check_parity(engine, model, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (12,), generator=g).tolist()
    steps = [int(torch.randint(0, vocab, (1,), generator=g)) for _ in range(3)]
    seq = prompt + steps
    ref = hf_logits(model, seq)   # the prompt's and each decode step's
    cache = engine.new_cache(1)
    # prefill, all positions' logits
    S = len(prompt)
    out = engine.forward(torch.tensor([prompt]), torch.arange(S)[None], cache.past_len,
                         torch.ones(S, S, dtype=torch.bool).tril()[None], S)
    assert (out.logits[0] - ref[:S]).abs().max() < TOL
    cache.write(out.new_kv)
    cache.past_len += S
    # decode steps
    for step, tok in enumerate(steps):
        out = engine.forward(torch.tensor([[tok]]), cache.past_len[:, None].clone(), cache.past_len,
                             torch.ones(1, 1, 1, dtype=torch.bool), 1)
        assert (out.logits[0, -1] - ref[S + step]).abs().max() < TOL
        cache.write(out.new_kv)
        cache.past_len += 1
    # tree verification: each node's logits equal those of its root-to-node path run as a plain sequence
    mask, depth = tree_mask(PARENTS)
    nodes = torch.randint(0, vocab, (len(PARENTS),), generator=g)
    pos = cache.past_len[:, None] + depth[None]
    out = engine.forward(nodes[None], pos, cache.past_len, mask[None], len(PARENTS))
    expected = hf_tree_logits(model, seq, nodes, PARENTS)
    for i in range(len(PARENTS)):
        assert (out.logits[0, i] - expected[i]).abs().max() < TOL, f"tree node {i}"


@pytest.mark.parametrize("arch", sorted(REGISTRY))
def test_tiny_parity(tiny_engines, arch):
    directory, model = tiny_engines[arch]
    gen = Generator.from_engines(directory)
    check_parity(gen.target, model, model.config.vocab_size)


@pytest.mark.parametrize("arch", sorted(REGISTRY))
def test_tiny_engines_are_fused(tiny_engines, arch):
    directory, model = tiny_engines[arch]
    engine = json.loads((directory / "manifest.json").read_text())["models"]["target"]["engine"]
    layers, arch = model.config.num_hidden_layers, REGISTRY[arch]
    # per layer: RoPE of q and k, attention inlined, both norms with the residual add before them; the first
    # norm (after the embedding) has no residual add, the final one has; norms on q and k per head (Qwen3,
    # Gemma 3) and on the attention's and the MLP's outputs (Gemma) have none
    a = from_hf(model, 8).args
    attn = layers - sum(a.conv_layers) - sum(a.mamba_layers)   # conv and Mamba-2 layers: no RoPE, attention, q/k norms
    norms = 1 + 2 * attn * arch.qk_norm + 2 * layers * arch.sandwich_norms
    mlps = sum(a.num_experts if sparse else 1 for sparse in a.sparse_layers or [False] * layers)   # each expert's
    mlps += layers * a.shared_mlp   # a shared MLP beside the experts (Granite 4.0-H)
    assert engine["fused"] == {"rotary": 2 * attn * a.rope, "attention": attn, "norm": norms, "skip_norm": 2 * layers,
                               "projections": 3 * layers + 2 * mlps}   # q/k/v (B/C/x, z/xBC/dt) and gate/up


@pytest.mark.parametrize("arch", MATRIX)
def test_unfused_parity(tiny_engines, arch, tmp_path):
    from specrt.export.build import build
    directory, model = tiny_engines[arch]
    plain = tmp_path / "plain"
    shutil.copytree(directory, plain)
    build(plain, "onnxruntime", log=lambda *_: None, fuse=False)
    assert "fused" not in json.loads((plain / "manifest.json").read_text())["models"]["target"]["engine"]
    check_parity(Generator.from_engines(plain).target, model, model.config.vocab_size)


def test_every_architecture_has_a_tiny_model(tiny_engines):
    assert set(tiny_engines) == set(REGISTRY)


@pytest.mark.slow
def test_smollm2_parity(default_generator, smollm2):
    check_parity(default_generator.target, smollm2.model, smollm2.model.config.vocab_size)
