"""Device discipline, checked on the CPU: with torch's default device set to `meta`, every tensor the loop creates
without naming a device lands on `meta`, which no engine accepts and no CPU tensor mixes with. A generation that
still runs, token-identical, creates every tensor on the engines' device (on a GPU: nothing bound from the host)."""
from __future__ import annotations

import pytest
import torch

CASES = [("autoregressive", {}), ("draft", {}), ("draft", {"tree": True}), ("ngram", {}), ("medusa", {}),
         ("eagle", {})]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method,extra", CASES, ids=[m + ("-tree" if e else "") for m, e in CASES])
def test_no_tensor_on_the_default_device(default_generator, method, extra, temperature):
    gen = default_generator
    ids = gen.encode("Name three rivers in Europe.")
    kw = dict(prompt_ids=ids, max_new_tokens=12, method=method, temperature=temperature, seed=3, adaptive=False,
              **extra)  # the same rounds in both runs: trees not chosen by the clock
    free = gen.generate(**kw)
    with torch.device("meta"):
        guarded = gen.generate(**kw)
    assert guarded.token_ids == free.token_ids
    assert guarded.stats["rounds"] == free.stats["rounds"]


def test_the_guard_catches_a_host_tensor(default_generator):
    """The guard itself: a tensor made without a device inside the guarded block is refused by the engine."""
    engine = default_generator.target
    cache = engine.new_cache(1, 8)
    with torch.device("meta"), pytest.raises(Exception, match="meta"):
        engine.forward(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64), cache.past_len,
                       torch.ones(1, 1, 1, dtype=torch.bool), 1, cache)
