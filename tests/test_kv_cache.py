"""Static KV cache: write, compact a tree path, truncate, continue — logits as a fresh run's."""
from __future__ import annotations

import torch

from specrt.decoding.generate import Generator
from test_graph_parity import PARENTS, path, tree_mask

TOL = 1e-5


def fresh_last_logits(engine, ids):
    cache = engine.new_cache(1)
    S = len(ids)
    out = engine.forward(torch.tensor([ids]), torch.arange(S)[None], cache.past_len,
                         torch.ones(S, S, dtype=torch.bool).tril()[None], 1)
    return out.logits[0, -1].clone()


def step(engine, cache, tok):
    out = engine.forward(torch.tensor([[tok]]), cache.past_len[:, None].clone(), cache.past_len,
                         torch.ones(1, 1, 1, dtype=torch.bool), 1, cache)
    cache.write(out.new_kv)
    cache.past_len += 1
    return out.logits[0, -1].clone()


def test_write_compact_truncate_continue(tiny_engines):
    directory, model = tiny_engines["llama"]
    engine = Generator.from_engines(directory).target
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 64, (8,), generator=g).tolist()
    cache = engine.new_cache(1)
    data_ptr = cache.data.data_ptr()
    S = len(prompt)
    out = engine.forward(torch.tensor([prompt]), torch.arange(S)[None], cache.past_len,
                         torch.ones(S, S, dtype=torch.bool).tril()[None], 1)
    cache.write(out.new_kv)
    cache.past_len += S
    # verify a tree, accept the path to node 6 (0 -> 1 -> 4 -> 6), compact its entries, continue decoding
    mask, depth = tree_mask(PARENTS)
    nodes = torch.randint(0, 64, (len(PARENTS),), generator=g)
    out = engine.forward(nodes[None], cache.past_len[:, None] + depth[None], cache.past_len, mask[None], 7, cache)
    cache.write(out.new_kv)
    accepted = path(PARENTS, 6)
    cache.compact(torch.tensor([accepted]))                        # (B, n) offsets, one row here
    cache.past_len += len(accepted)
    seq = prompt + nodes[accepted].tolist()
    x = 11
    got = step(engine, cache, x)
    assert (got - fresh_last_logits(engine, seq + [x])).abs().max() < TOL
    # roll back to the prompt in O(1) and take another branch
    cache.truncate(len(prompt))
    y = 5
    got = step(engine, cache, y)
    assert (got - fresh_last_logits(engine, prompt + [y])).abs().max() < TOL
    for tok in (1, 2, 3):
        step(engine, cache, tok)
    # one buffer throughout: written, compacted and truncated in place, never reallocated
    assert cache.data.data_ptr() == data_ptr and int(cache.past_len[0]) == len(prompt) + 4


def test_batched_rows_write_at_their_own_past_len(tiny_engines):
    directory, _ = tiny_engines["qwen2"]
    engine = Generator.from_engines(directory).target
    a, b = [1, 2, 3, 4, 5], [9, 8, 7]
    cache = engine.new_cache(2)
    ids = torch.tensor([a, b + [0, 0]])
    out = engine.forward(ids, torch.arange(5).expand(2, 5).contiguous(), cache.past_len,
                         torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5).contiguous(), 1)
    cache.write(out.new_kv)
    cache.past_len[:] = torch.tensor([5, 3])  # row 1's two pad entries are scratch
    out = engine.forward(torch.tensor([[6], [6]]), cache.past_len[:, None].clone(), cache.past_len,
                         torch.ones(2, 1, 1, dtype=torch.bool), 1)
    row0, row1 = out.logits[0, -1].clone(), out.logits[1, -1].clone()
    assert (row0 - fresh_last_logits(engine, a + [6])).abs().max() < TOL
    assert (row1 - fresh_last_logits(engine, b + [6])).abs().max() < TOL


def test_host_writes_match_write_then_compact(tiny_engines):
    """The CPU loop's writes (numpy views; only the accepted entries, by count or by node list) leave the cache as
    the device path does: write every entry, then compact the accepted path."""
    directory, _ = tiny_engines["llama"]
    engine = Generator.from_engines(directory).target
    g = torch.Generator().manual_seed(4)
    host, device = engine.new_cache(2, 32), engine.new_cache(2, 32)
    assert host.host_data is not None
    device.host_data = device.host_past = None          # the torch path, as on a GPU
    for cache in (host, device):
        cache.data.copy_(torch.randn(cache.data.shape, generator=g.manual_seed(4)))
        cache.truncate(torch.tensor([5, 29]))            # row 1 near the end: entries past it are dropped
    new_kv = torch.randn(host.data.shape[0], 2, host.data.shape[2], 4, host.data.shape[4], generator=g)
    paths = [[0, 2, 3], [0, 1, 3, 3]]
    host.write(new_kv.numpy(), [5, 29], paths)
    device.write(new_kv)
    device.compact(torch.tensor([p + [p[-1]] * (4 - len(p)) for p in paths]))
    assert torch.equal(host.data[:, 0, :, :8], device.data[:, 0, :, :8])
    assert torch.equal(host.data[:, 1, :, :32], device.data[:, 1, :, :32])
    host.write(new_kv.numpy(), [10, 10], [2, 0])         # counts: the first entries of each row
    assert torch.equal(host.data[:, 0, :, 10:12], new_kv[:, 0, :, :2])


def test_an_alias_over_some_layers_writes_only_those():
    """KVCache.alias(layers): a drafter over some of the target's layers (specrt.decoding.drafters.SelfDrafter) binds
    and writes those layers of the target's cache, at lengths of its own; on the host path and the device one."""
    from specrt.engines.kv_cache import KVCache
    new = torch.arange(4 * 2 * 1 * 2 * 2, dtype=torch.float32).view(4, 2, 1, 2, 2) + 1   # (2K, B, Hkv, S, D)
    for host in (True, False):
        cache = KVCache(3, 2, 1, 8, 2)
        view = cache.alias([0, 2])
        if not host:
            view.host_data = None   # the indexing a GPU's cache takes, here on the CPU
        view.truncate([1, 3])
        view.write(new)
        assert cache.data[2:4].abs().sum() == 0 and cache.past_len.tolist() == [0, 0]   # layer 1, its lengths
        kept = cache.data[[0, 1, 4, 5]]
        assert torch.equal(kept[:, 0, :, 1:3], new[:, 0]) and torch.equal(kept[:, 1, :, 3:5], new[:, 1])
        assert [b.data_ptr() for b in view.layer_buffers()] == [cache.data[i].data_ptr() for i in (0, 1, 4, 5)]
        assert [b.data_ptr() for b in view.prefix(1).layer_buffers()] == [b.data_ptr() for b in view.layer_buffers()]
