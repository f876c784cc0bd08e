"""Untrusted requests, unit by unit (the server's repros are test_hostile.py): stop strings matched incrementally,
the prefix cache partitioned by tenant, the API key file."""
from __future__ import annotations

import random
import time

import pytest
import torch

from specrt.decoding.prefix_cache import PrefixCache
from specrt.errors import InputError
from specrt.serving.completions import StopText
from specrt.serving.server import Limits, read_api_keys


def cut_at_stops(stops: list[str], pieces: list[str]) -> tuple[list[str], bool]:
    """What a client must get, piece by piece, by brute force: after each piece, the text up to the first stop
    string found so far (and the end), else all of it but the longest tail that begins a stop string."""
    text, sent, out = "", 0, []
    for piece in pieces:
        text += piece
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            out.append(text[sent:min(found)])
            return out, True
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        end = max(sent, len(text) - hold)
        out.append(text[sent:end])
        sent = end
    return out + [text[sent:]], False


def test_stop_text_cuts_as_brute_force_does():
    rng = random.Random(0)
    for trial in range(5000):
        alphabet = "ab" if trial % 2 else "abc"
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        got, stopped = [], False
        stop_text = StopText(stops)
        for piece in pieces:
            out, stopped = stop_text.feed(piece)
            got.append(out)
            if stopped:
                break
        if not stopped:
            got.append(stop_text.flush())
        assert (got, stopped) == cut_at_stops(stops, pieces), (stops, pieces)


def test_stop_text_costs_the_piece_not_the_stop_strings():
    """A piece is checked in O(its length x stops): eight stop strings of 20,000 characters that the text keeps
    beginning (the tail held back grows to 19,999) cost no more a piece than short ones. Checking every prefix of
    every stop string against the text's end, as before, took seconds here."""
    stops = ["a" * 19999 + "b"] * 8
    text = StopText(stops)
    start = time.perf_counter()
    sent = "".join(text.feed("a" * 3)[0] for _ in range(40))
    took = time.perf_counter() - start
    assert sent == "" and text.flush() == "a" * 120
    assert took < 0.5, f"40 pieces took {took:.2f} s"


def test_prefix_cache_partitions_never_meet():
    """A block is found only by requests of the partition that stored it; the shared one (None) is a partition too."""
    cache = PrefixCache(1 << 20, block=4)
    ids = list(range(1, 14))
    kv = torch.randn(2, 1, 16, 8)                                                  # (2L, Hkv, S, D)
    cache.store(ids, {"target": (kv, 2, len(ids))}, partition="tenant-a")
    assert cache.match(ids, ("target",), partition="tenant-b").tokens == 0
    assert cache.match(ids, ("target",)).tokens == 0
    assert cache.match(ids, ("target",), partition="tenant-a").tokens == 12
    cache.store(ids, {"target": (kv, 2, len(ids))})
    assert cache.match(ids, ("target",)).tokens == 12
    assert cache.keys(ids, 3, "a") != cache.keys(ids, 3, "b") != cache.keys(ids, 3)


def test_api_key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-one\n\n  sk-two  \nsk-one\n")
    assert read_api_keys(path) == ("sk-one", "sk-two")
    assert Limits("sk-zero", api_keys=read_api_keys(path)).keys == ("sk-zero", "sk-one", "sk-two")
    path.write_text("\n \n")
    with pytest.raises(InputError, match="no key in it; write one key a line"):
        read_api_keys(path)
    with pytest.raises(InputError, match="cannot be read"):
        read_api_keys(tmp_path / "gone")
