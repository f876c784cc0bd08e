"""Logprobs in OpenAI's shapes: the chat's `choices[i].logprobs.content` (each token's text, log-probability, UTF-8
bytes and top alternatives) and the legacy completions' `choices[i].logprobs` (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`). The figures are the decoding loop's (decoding.sampling.TokenLogprob: the target's
log-probabilities under the distribution each token was drawn from, drafted tokens included); here they only get
their tokens' texts."""
from __future__ import annotations

import functools
import json
import re

from specrt.decoding.sampling import TokenLogprob

FLOOR = -9999.0   # OpenAI's logprob of a token that cannot come (one that top-p or top-k cut): JSON has no -inf
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")   # SentencePiece's byte fallback tokens


def _value(logprob: float) -> float:
    return logprob if logprob > FLOOR else FLOOR   # -inf (and a NaN, which cannot come, would not compare) to FLOOR


class TokenTexts:
    """Each token's bytes and text as OpenAI's logprobs show them: the text its bytes spell, or `bytes:\\xNN...` where
    the bytes are not whole UTF-8 characters (a character split across tokens); `token_id:N` without a tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer, self.known = tokenizer, {}
        self.byte_level = False
        if tokenizer is not None:
            backend = getattr(tokenizer, "backend_tokenizer", None)   # a fast tokenizer's: how it decodes
            decoder = (json.loads(backend.to_str()).get("decoder") or {}) if backend is not None else {}
            kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]   # a Sequence's, or the one
            self.byte_level = "ByteLevel" in kinds
            self.added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
            self.byte_of = {c: b for b, c in _bytes_to_unicode().items()}

    def __call__(self, token: int) -> tuple[str, list[int] | None]:
        """(text, bytes) of one token."""
        if token not in self.known:
            self.known[token] = self._spell(token)
        return self.known[token]

    def _spell(self, token: int) -> tuple[str, list[int] | None]:
        if self.tokenizer is None:
            return f"token_id:{token}", None
        if token in self.added:   # special and added tokens are stored as their text
            raw = self.added[token].encode()
        else:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if self.byte_level:   # GPT-2's byte-level BPE (Llama 3, Qwen2, SmolLM2): one character per byte
                raw = bytes(self.byte_of[c] for c in piece)
            elif m := BYTE_PIECE.fullmatch(piece):
                raw = bytes([int(m.group(1), 16)])
            else:   # SentencePiece: ▁ is a space
                raw = piece.replace("\u2581", " ").encode()
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (the byte-level BPE's alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def chat_logprobs(texts: TokenTexts, logprobs: list[TokenLogprob]) -> dict:
    """The chat's `logprobs` of some tokens: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    def entry(token: int, logprob: float) -> dict:
        text, raw = texts(token)
        return {"token": text, "logprob": _value(logprob), "bytes": raw}

    return {"content": [entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}


class CompletionLogprobs:
    """The legacy completions' `logprobs` of one sequence, piece by piece (a stream's chunks): `top_logprobs` holds
    the top N and the chosen token (OpenAI: up to N + 1), `text_offset` where each token's text begins in the
    completion's text (in characters, as decoding the tokens before it gives)."""

    def __init__(self, texts: TokenTexts):
        self.texts, self.ids = texts, []

    def offset(self) -> int:
        tokenizer = self.texts.tokenizer
        if tokenizer is None or not self.ids:
            return 0
        text = tokenizer.decode(self.ids, skip_special_tokens=True)
        return len(text.rstrip("\ufffd"))   # a character still incomplete begins where it will stand

    def piece(self, logprobs: list[TokenLogprob]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in logprobs:
            text = self.texts(lp.token)[0]
            out["text_offset"].append(self.offset())
            out["tokens"].append(text)
            out["token_logprobs"].append(_value(lp.logprob))
            top = {self.texts(t)[0]: _value(v) for t, v in lp.top}
            top.setdefault(text, _value(lp.logprob))
            out["top_logprobs"].append(top)
            self.ids.append(lp.token)
        return out

