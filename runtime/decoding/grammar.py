"""Grammar masks for structured output: a thin seam over llguidance (docs/notes/2026-12-grammar.md says why).

A grammar is a logits processor (DESIGN.md, "Request fields under speculation"): the mask at a node is a function
of the tokens above it, the committed ones and the drafted path, so P and Q are masked alike at every node. Under
speculation a row's `Matcher` sits at the committed state; `path_masks` advances it along each drafted path, takes
the mask there and rolls it back; after verification `advance(accepted)` moves the committed state on.

    grammar = compile_grammar(tokenizer, "json_schema", {"type": "object", ...})   # cached
    matcher = Matcher(grammar, vocab_size=V, eos_ids=stop_ids)                     # one per row
    masks, ok = path_masks(matcher, [[], [t1], [t1, t2]])                          # (K, V) bool, K bools

Token-level semantics are llguidance's: where the grammar forces bytes (a fixed key, the rest of an enum value)
the mask allows only their canonical tokenization (after `{"` in a schema whose first key is "name", the token
`name`, not `n` or `na`), which keeps the model on tokenizations it was trained on and makes forced tokens common.
JSON is laid out as `json.dumps` writes it (", " and ": ", no other whitespace): flexible whitespace lets a small
model write newlines until max_tokens. A schema's own "x-guidance" options override that layout.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from specrt.errors import InputError

KINDS = ("json_object", "json_schema", "regex", "grammar")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256     # compiled grammars kept per tokenizer, least recently used dropped first
FORCED_MAX = 256     # forced() stops after this many tokens (a grammar may force without end)


@dataclass(frozen=True, eq=False)
class Grammar:
    """A grammar compiled for one tokenizer. `start` is an llguidance matcher at the grammar's start, never
    advanced: each Matcher starts from a copy of it. `vocab_size` is the tokenizer's (len(tokenizer)); `eos_ids`
    the tokenizer's end-of-sequence ids, the library's own idea of the end."""
    kind: str
    spec: object
    start: object
    vocab_size: int
    eos_ids: tuple[int, ...]


_lock = threading.Lock()
_by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # tokenizer -> (LLTokenizer, OrderedDict)


def _library(tokenizer):
    """The tokenizer's llguidance twin (about 0.3 s to build, once per tokenizer) and its compiled grammars."""
    with _lock:
        entry = _by_tokenizer.get(tokenizer)
    if entry is None:
        import llguidance.hf
        try:
            lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
        except ValueError as e:
            raise InputError(f"grammars need a fast (Rust) Hugging Face tokenizer, got {type(tokenizer).__name__}: "
                             f"{e}") from None
        with _lock:
            entry = _by_tokenizer.setdefault(tokenizer, (lltok, OrderedDict()))
    return entry


def _key(kind: str, spec) -> str | None:
    """The spec's cache key; a kind or a spec of the wrong type is refused by name."""
    if kind not in KINDS:
        raise InputError(f"grammar kind {kind!r}: expected one of {', '.join(KINDS)}")
    if kind == "json_object":
        return None
    if kind == "json_schema":
        if not isinstance(spec, dict):
            raise InputError(f"json_schema: expected a JSON schema as a dict, got {type(spec).__name__}")
        try:
            return json.dumps(spec, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise InputError(f"json_schema is not JSON: {e}") from None
    if not isinstance(spec, str):
        raise InputError(f"{kind}: expected a string, got {type(spec).__name__}")
    return spec


def _source(kind: str, spec) -> str:
    """The spec as llguidance's grammar text."""
    from llguidance import LLMatcher, grammar_from
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "json_schema":
        try:
            return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_LAYOUT)
        except (TypeError, ValueError) as e:
            raise InputError(f"json_schema is not valid: {e}") from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    try:
        return grammar_from("grammar", spec)   # Lark as it is; GBNF converted to Lark
    except ValueError as e:
        raise InputError(f"grammar is not valid: {e}") from None


def compile_grammar(tokenizer, kind: str, spec=None) -> Grammar:
    """The grammar `spec` of `kind` compiled for `tokenizer` (a fast Hugging Face tokenizer), cached per
    (tokenizer object, kind, spec):
      "json_object"  any JSON object (spec unused);
      "json_schema"  a JSON schema, as a dict (llguidance's JSON Schema subset; a keyword it does not implement is
                     an error, not ignored);
      "regex"        a regular expression (Rust `regex` syntax) that the whole output must match;
      "grammar"      a context-free grammar in llguidance's Lark dialect (`start: ...`; regexes, `%json {...}`
                     for a schema inside a rule), or llama.cpp's GBNF (`root ::= ...`), converted to Lark.
    A spec that is not valid raises InputError with the library's account of what is wrong and where."""
    key = (kind, _key(kind, spec))
    lltok, cache = _library(tokenizer)
    with _lock:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
    from llguidance import LLMatcher
    start = LLMatcher(lltok, _source(kind, spec), log_level=0)
    if start.is_error():
        raise InputError(f"{kind} is not valid: {start.get_error().strip()}")
    grammar = Grammar(kind, spec, start, len(tokenizer), tuple(lltok.eos_tokens))
    with _lock:
        cache[key] = grammar
        while len(cache) > CACHE_SIZE:
            cache.popitem(last=False)
    return grammar


class Matcher:
    """One row's place in a grammar: the tokens consumed so far, with rollback.

    `vocab_size` V is the model's (default: the tokenizer's); it may exceed the tokenizer's, and ids from the
    tokenizer's size up are never allowed. `eos_ids` are the model's stop tokens (default: the tokenizer's end of
    sequence); they are allowed exactly when the grammar is complete (the library's own end-of-sequence token is
    masked out when it is not one of them). Once a stop token is consumed the row has ended: `done` is True,
    `allowed()` is the stop tokens only (a mask is never empty), another stop token is consumed, anything else is
    refused; rolling back past the stop token reopens the grammar.

    `advance` consumes exactly the tokens `allowed()` allows: llguidance alone would also take a tokenization of
    forced bytes that its mask leaves out (`u` where the mask says `ums`). The mask of the current state is kept
    until the state moves, so checking the token after `allowed()` costs nothing more."""

    def __init__(self, grammar: Grammar, vocab_size: int | None = None, eos_ids=None):
        V = grammar.vocab_size if vocab_size is None else int(vocab_size)
        if V < grammar.vocab_size:
            raise InputError(f"vocab_size {V} is smaller than the tokenizer's {grammar.vocab_size}: the grammar's "
                             f"tokens would not fit the model's logits")
        self.grammar, self.vocab_size = grammar, V
        self.eos_ids = tuple(int(t) for t in (grammar.eos_ids if eos_ids is None else eos_ids))
        if not self.eos_ids or not all(0 <= t < V for t in self.eos_ids):
            raise InputError(f"eos_ids {list(self.eos_ids)}: need at least one stop token id below {V}")
        self._m = grammar.start.deep_copy()
        self._bits = np.zeros((grammar.vocab_size + 31) // 32, np.int32)   # (ceil(tokenizer size / 32),)
        self._fresh = False    # _bits holds the library's mask of the current state
        self._lib_eos = [t for t in grammar.eos_ids if t not in self.eos_ids]
        self._depth = 0        # tokens the library has consumed
        self._ended = 0        # stop tokens consumed at the end (the first ends the row)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows only the end of sequence now (or the row has already ended)."""
        return self._ended > 0 or self._m.is_stopped()

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens allowed next."""
        mask = np.zeros(self.vocab_size, bool)
        if not self._ended:
            n = self.grammar.vocab_size
            mask[:n] = np.unpackbits(self._library_mask().view(np.uint8), bitorder="little")[:n]
            mask[self._lib_eos] = False
            if not self._m.is_accepting():
                mask[list(self.eos_ids)] = False
                return mask
        mask[list(self.eos_ids)] = True
        return mask

    def advance(self, tokens) -> int:
        """Consume `tokens` in order while each is allowed; returns how many were consumed. A refused token leaves
        the matcher where it was before that token."""
        n = 0
        for t in map(int, tokens):
            if t in self.eos_ids and (self._ended or self._m.is_accepting()):
                self._ended += 1
            elif self._ended or t in self.eos_ids or not 0 <= t < self.grammar.vocab_size:
                break
            elif self._library_mask()[t >> 5] >> (t & 31) & 1 and self._m.try_consume_tokens([t]) == 1:
                self._depth, self._fresh = self._depth + 1, False
            else:
                self._check()
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        """Undo the last `n` consumed tokens (stop tokens included)."""
        if not 0 <= n <= self._depth + self._ended:
            raise ValueError(f"rollback({n}): {self._depth + self._ended} tokens consumed")
        ended = min(n, self._ended)
        self._ended -= ended
        if n > ended:
            self._m.rollback(n - ended)
            self._depth, self._fresh = self._depth - (n - ended), False
            self._check()

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here: each the only token its mask allows (a stop token ends the
        list), so taking them without a pass changes no output. Possibly empty; the matcher does not move."""
        out = []
        while len(out) < FORCED_MAX and not self._ended:
            allowed = np.flatnonzero(self.allowed())
            if len(allowed) != 1 or self.advance(allowed.tolist()) != 1:
                break
            out.append(int(allowed[0]))
        self.rollback(len(out))
        return out

    def _library_mask(self) -> np.ndarray:
        """The library's bitmask of the current state, (ceil(tokenizer size / 32),) int32: bit i of word j is token
        32 j + i. Computed once per state."""
        if not self._fresh:
            self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            self._check()
            self._fresh = True
        return self._bits

    def _check(self) -> None:
        if self._m.is_error():   # a resource limit of the library mid-way (the grammar itself was checked)
            raise InputError(f"{self.grammar.kind}: the grammar matcher failed: {self._m.get_error().strip()}")


def path_masks(matcher: Matcher, paths) -> tuple[np.ndarray, list[bool]]:
    """For each path (the drafted tokens from the committed state to a node, [] for the committed state itself):
    the mask after consuming it, (K, V) bool, and whether the whole path stays in the grammar. The row of a path
    that leaves the grammar is all False (its node is unreachable: its parent's mask refuses its token). The
    matcher ends where it started. Paths sharing a prefix (a tree in depth-first order) share the work."""
    masks = np.zeros((len(paths), matcher.vocab_size), bool)   # (K, V)
    ok, here = [], []    # here: the tokens consumed beyond the committed state
    try:
        for i, path in enumerate(paths):
            path = [int(t) for t in path]
            common = 0
            while common < min(len(here), len(path)) and here[common] == path[common]:
                common += 1
            matcher.rollback(len(here) - common)
            here = path[:common] + path[common:common + matcher.advance(path[common:])]
            ok.append(len(here) == len(path))
            if ok[-1]:
                masks[i] = matcher.allowed()
    finally:
        matcher.rollback(len(here))
    return masks, ok
