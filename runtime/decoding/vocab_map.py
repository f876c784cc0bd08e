"""A draft model of another vocabulary: token-level intersection (Timor et al., ICML 2025; vLLM's vocab mapping).

At export every token of both tokenizers becomes its byte string (byte-level BPE tokens through GPT-2's
bytes_to_unicode table, SentencePiece's `▁` as a space and `<0xNN>` byte-fallback tokens as their byte, special
tokens by their text, apart from ordinary text). The map, stored in the engine set (`vocab_map.json`), has two
tables:
- shared: the drafter ids whose bytes are exactly one target token, and that token. The drafter proposes only
  these (its logits elsewhere are -inf), so its proposal is a token of the target and its Q a distribution over the
  target's ids: verification (greedy, rejection sampling, trees) is the same-vocabulary one, exact.
- expand: for each target token, the drafter tokens of its bytes (the one drafter token with those bytes where
  there is one, else a greedy longest match over the drafter's tokens). The drafter reads the context one target
  token at a time, so its cache grows append-only per target token and rolls back by index; it sees the text split
  at the target's token boundaries, not as its own tokenizer would split it (the acceptance cost, docs/drafters.md).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from specrt.errors import InputError, ManifestError

FILE = "vocab_map.json"
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# decoders whose effect on one token's bytes is known (Fuse and Strip only join tokens or cut a text's first space)
_DECODERS = {"ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace", "Sequence"}


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table, reversed: the character a byte-level BPE token spells each byte with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoders(tokenizer, what: str) -> list[dict]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise InputError(f"{what}'s tokenizer ({type(tokenizer).__name__}) is not a fast (tokenizers) tokenizer: "
                         "a drafter of another vocabulary needs tokenizer.json for both models")
    decoders, stack = [], [json.loads(backend.to_str()).get("decoder") or {}]
    while stack:
        d = stack.pop()
        if d:
            decoders.append(d)
            stack += d.get("decoders", [])
    unknown = sorted({d.get("type") for d in decoders} - _DECODERS)
    if unknown:
        raise InputError(f"{what}'s tokenizer decodes with {', '.join(map(str, unknown))}: the vocabulary map reads "
                         "byte-level BPE and SentencePiece-style tokenizers only; use a drafter of the target's "
                         "vocabulary")
    return decoders


def token_keys(tokenizer, vocab_size: int, what: str) -> tuple[list, list[bool]]:
    """Each id's key, its bytes (a special token: ("special", text), apart from ordinary text; an id without a
    token: None), and whether it is a byte-fallback token `<0xNN>`."""
    decoders = _decoders(tokenizer, what)
    byte_level = any(d["type"] == "ByteLevel" for d in decoders)
    replace = [(d["pattern"]["String"], d["content"]) for d in decoders
               if d["type"] == "Replace" and "String" in d.get("pattern", {})]
    replace += [(d["replacement"], " ") for d in decoders if d["type"] == "Metaspace"]
    fallback = any(d["type"] == "ByteFallback" for d in decoders)
    added = tokenizer.added_tokens_decoder   # id -> AddedToken: written as text, not in the model's spelling
    table = byte_decoder()
    keys, is_byte = [], []
    tokens = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    for i, tok in enumerate(tokens + [None] * (vocab_size - len(tokens))):
        byte = fallback and tok is not None and i not in added and _BYTE_TOKEN.fullmatch(tok) is not None
        if tok is None:
            key = None
        elif i in added:
            key = ("special", tok) if added[i].special else tok.encode()
        elif byte:
            key = bytes([int(tok[3:5], 16)])
        elif byte_level and all(c in table for c in tok):
            key = bytes(table[c] for c in tok)
        else:
            for old, new in replace:
                tok = tok.replace(old, new)
            key = tok.encode()
        keys.append(key)
        is_byte.append(byte)
    return keys, is_byte


def _index(keys: list, is_byte: list[bool]) -> dict:
    """key -> the id that spells it: an ordinary token before a byte-fallback one, else the lowest id."""
    index = {}
    for i in sorted(range(len(keys)), key=lambda i: is_byte[i]):
        if keys[i] is not None and keys[i] != b"":
            index.setdefault(keys[i], i)
    return index


def build(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> dict:
    """The map of `vocab_map.json` (see the module doc), refused where the vocabularies share no token."""
    t_keys, t_byte = token_keys(target_tokenizer, target_vocab, "the target")
    d_keys, d_byte = token_keys(draft_tokenizer, draft_vocab, "the draft")
    t_index, d_index = _index(t_keys, t_byte), _index(d_keys, d_byte)
    shared = sorted((d, t_index[k]) for k, d in d_index.items() if k in t_index)
    if not shared:
        raise InputError("the draft's vocabulary and the target's share no token (compared by their bytes): such a "
                         "drafter can propose nothing; use a drafter whose tokenizer spells text as the target's does")
    text = {k: d for k, d in d_index.items() if isinstance(k, bytes)}
    longest = max(map(len, text))
    unknown = getattr(draft_tokenizer, "unk_token_id", None)
    filler = unknown if unknown is not None and unknown < draft_vocab else 0
    offsets, ids = [0], []
    for key in t_keys:
        if key in d_index:
            ids.append(d_index[key])
        else:
            raw = key[1].encode() if isinstance(key, tuple) else key or b""
            found = _greedy(raw, text, longest)
            ids += found or [filler]   # bytes the drafter cannot spell: a placeholder, every token reads as >= 1
        offsets.append(len(ids))
    return {"target_vocab": target_vocab, "draft_vocab": draft_vocab,
            "shared": {"draft": [d for d, _ in shared], "target": [t for _, t in shared]},
            "expand": {"offsets": offsets, "ids": ids}}


def _greedy(raw: bytes, text: dict, longest: int) -> list[int]:
    """The drafter ids spelling `raw`, longest token first at each position (bytes it has no token for skipped)."""
    out, i = [], 0
    while i < len(raw):
        for n in range(min(longest, len(raw) - i), 0, -1):
            if raw[i:i + n] in text:
                out.append(text[raw[i:i + n]])
                i += n
                break
        else:
            i += 1
    return out


@dataclass
class VocabMap:
    """The loaded map: a drafter's logits to the target's ids, and target tokens to the drafter's."""
    target_vocab: int
    draft_vocab: int
    shared_draft: np.ndarray    # (K,) drafter ids whose bytes are one target token
    shared_target: np.ndarray   # (K,) that token
    offsets: np.ndarray         # (V_target + 1,) target token t reads as ids[offsets[t]:offsets[t + 1]]
    ids: np.ndarray

    def __post_init__(self):
        self.lengths = np.diff(self.offsets)   # (V_target,) drafter tokens per target token
        self._index = {}                       # device -> the shared ids there

    @classmethod
    def load(cls, path: Path, target_vocab: int, draft_vocab: int) -> "VocabMap":
        """The map of `path`, checked against the engine set's vocabulary sizes (ManifestError names the fault)."""
        try:
            m = json.loads(Path(path).read_text())
            vm = cls(m["target_vocab"], m["draft_vocab"], *(np.array(x, dtype=np.int64) for x in (
                m["shared"]["draft"], m["shared"]["target"], m["expand"]["offsets"], m["expand"]["ids"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"{path} is not a vocabulary map ({e!r}); re-run `specrt export`") from e
        faults = [f"sizes {vm.target_vocab}/{vm.draft_vocab} vs the engines' {target_vocab}/{draft_vocab}"
                  if (vm.target_vocab, vm.draft_vocab) != (target_vocab, draft_vocab) else None,
                  "shared ids out of range or repeated" if not (
                      len(vm.shared_draft) == len(vm.shared_target) > 0
                      and _ids_ok(vm.shared_draft, draft_vocab) and _ids_ok(vm.shared_target, target_vocab)) else None,
                  "expansions not one or more drafter ids per target token" if not (
                      len(vm.offsets) == target_vocab + 1 and vm.offsets[0] == 0 and vm.offsets[-1] == len(vm.ids)
                      and (np.diff(vm.offsets) >= 1).all() and _ids_ok(vm.ids, draft_vocab, unique=False)) else None]
        faults = [f for f in faults if f]
        if faults:
            raise ManifestError(f"{path}: {'; '.join(faults)}; re-run `specrt export` with this draft and target")
        return vm

    def length(self, tokens: np.ndarray) -> int:
        """How many drafter tokens the target tokens read as."""
        return int(self.lengths[tokens].sum())

    def expand(self, tokens) -> np.ndarray:
        """The drafter tokens that the target tokens read as, in order."""
        return np.concatenate([self.ids[self.offsets[t]:self.offsets[t + 1]] for t in np.asarray(tokens).tolist()]
                              or [self.ids[:0]])

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V_draft) drafter logits -> (B, V_target) over the target's ids: the shared tokens' logits, -inf
        elsewhere (every transform of Q, temperature to grammar, then applies as it does to P)."""
        if logits.device.type == "cpu":   # numpy: torch's indexing of wide rows costs ms on a busy CPU
            out = np.full((logits.shape[0], self.target_vocab), -np.inf, logits.numpy().dtype)
            out[:, self.shared_target] = self.shared(logits).numpy()
            return torch.from_numpy(out)
        draft, target = self._on(logits.device)
        out = torch.full((logits.shape[0], self.target_vocab), float("-inf"), dtype=logits.dtype,
                         device=logits.device)
        out[:, target] = logits[:, draft]
        return out

    def shared(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V_draft) drafter logits -> (B, K) the shared tokens' only, in `shared_draft`'s order: a greedy pick
        or a top-k over them, mapped back by `shared_ids`, is the one over `to_target`'s row (ties aside)."""
        if logits.device.type == "cpu":
            return torch.from_numpy(logits.numpy().take(self.shared_draft, axis=1))
        return logits.index_select(1, self._on(logits.device)[0])

    def shared_ids(self, picks: torch.Tensor) -> torch.Tensor:
        """Positions in `shared`'s row -> the target's ids."""
        if picks.device.type == "cpu":
            return torch.from_numpy(self.shared_target[picks.numpy()])
        return self._on(picks.device)[1][picks]

    def _on(self, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared ids (drafter's, target's) on `dev`, made once."""
        if dev not in self._index:
            self._index[dev] = tuple(torch.from_numpy(a).to(dev) for a in (self.shared_draft, self.shared_target))
        return self._index[dev]


def _ids_ok(ids: np.ndarray, vocab: int, unique: bool = True) -> bool:
    return bool(((ids >= 0) & (ids < vocab)).all()) and (not unique or len(np.unique(ids)) == len(ids))
