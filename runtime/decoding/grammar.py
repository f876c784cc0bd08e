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

import hashlib
import json
import os
import re
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from copy import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specrt.decoding.grammar_child import compile_source
from specrt.errors import InputError

KINDS = ("json_object", "json_schema", "regex", "grammar")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORCED_MAX = 256     # forced() stops after this many tokens (a grammar may force without end)


@dataclass(frozen=True)
class Limits:
    """What one grammar may cost (docs/serving.md, "Untrusted grammars", says why each is what it is). A grammar is
    refused before it is compiled when its text is longer than `max_chars` (a JSON schema: as compact JSON) or a
    Lark/GBNF grammar has more than `max_rules` rules; an isolated compilation (`compile_grammar(isolated=True)`)
    that takes longer than `compile_s` is refused. The rest are llguidance's own limits (LLParserLimits), set here
    rather than left to the library's defaults: a matcher that meets one fails with the library's account of it.
    A row's masks may take `mask_burst_s` of CPU time plus `mask_per_token_s` for each token it has committed;
    past that its matcher fails (a grammar whose masks cost 0.3 s a token would stall every row of the batch)."""
    max_chars: int = 128 << 10
    max_rules: int = 1000
    compile_s: float = 10.0
    stack_bytes: int = 64 << 20          # the compiling thread's stack (grammar_child.compile_source)
    cache_chars: int = 1 << 20           # the compiled grammars kept: the sum of their texts' lengths...
    cache_entries: int = 256             # ...and their number, least recently used dropped first
    mask_burst_s: float = 0.5
    mask_per_token_s: float = 0.02
    max_items_in_row: int = 2000         # llguidance's, each its default but verbose_errors
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_lexer_states: int = 250_000
    max_grammar_size: int = 500_000
    verbose_errors: bool = False         # an error names the limit, not the parser's state and the grammar's text

    def library(self) -> dict:
        """LLParserLimits' keyword arguments."""
        names = ("max_items_in_row", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items", "max_lexer_states",
                 "max_grammar_size", "verbose_errors")
        return {k: v for k, v in asdict(self).items() if k in names}


LIMITS = Limits()
RULE = re.compile(r"(?m)^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:\.[ \t]*-?\d+[ \t]*)?(?::|::=)")   # a Lark/GBNF rule's head


@dataclass(frozen=True, eq=False)
class Grammar:
    """A grammar compiled for one tokenizer. `start` is an llguidance matcher at the grammar's start, never
    advanced: each Matcher starts from a copy of it. `vocab_size` is the tokenizer's (len(tokenizer)); `eos_ids`
    the tokenizer's end-of-sequence ids, the library's own idea of the end; `limits` what its matchers may cost."""
    kind: str
    spec: object
    start: object
    vocab_size: int
    eos_ids: tuple[int, ...]
    limits: Limits = LIMITS


_lock = threading.Lock()
_by_tokenizer: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # tokenizer -> _Library


@dataclass
class _Library:
    """A tokenizer's llguidance twin (about 0.3 s to build, once per tokenizer), the JSON it was built from (what a
    Sandbox builds its own from), its size and the grammars compiled for it."""
    lltok: object
    text: str
    vocab_size: int
    eos: list[int]
    key: str
    cache: OrderedDict
    chars: int = 0     # the cached grammars' text lengths, summed


def library(tokenizer) -> _Library:
    """The tokenizer's llguidance twin and compiled grammars, made at the first call: on the thread that owns the
    tokenizer (a Hugging Face tokenizer used by two threads at once may fail with "Already borrowed"); a grammar
    can then be compiled on any thread."""
    with _lock:
        entry = _by_tokenizer.get(tokenizer)
    if entry is None:
        from llguidance import LLTokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InputError(f"grammars need a fast (Rust) Hugging Face tokenizer, got {type(tokenizer).__name__}")
        backend = copy(backend)   # as llguidance.hf.from_tokenizer: its added tokens, no padding or truncation
        backend.no_padding()
        backend.no_truncation()
        text, eos = backend.to_str(), tokenizer.eos_token_id
        eos = [] if eos is None else [int(eos)]
        try:
            lltok = LLTokenizer(text, n_vocab=len(tokenizer), eos_token=eos or None)
        except ValueError as e:
            raise InputError(f"llguidance cannot read this tokenizer ({type(tokenizer).__name__}): {e}") from None
        key = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()   # the Sandbox's name for it
        with _lock:
            entry = _by_tokenizer.setdefault(tokenizer, _Library(lltok, text, len(tokenizer), eos, key, OrderedDict()))
    return entry


def _key(kind: str, spec, limits: Limits) -> str | None:
    """The spec's cache key, its text; a kind or a spec of the wrong type, or one past the limits' bounds on size
    and rules, is refused by name."""
    if kind not in KINDS:
        raise InputError(f"grammar kind {kind!r}: expected one of {', '.join(KINDS)}")
    if kind == "json_object":
        return None
    if kind == "json_schema":
        if not isinstance(spec, dict):
            raise InputError(f"json_schema: expected a JSON schema as a dict, got {type(spec).__name__}")
        try:
            key = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError, RecursionError) as e:
            raise InputError(f"json_schema is not JSON: {e}") from None
    elif not isinstance(spec, str):
        raise InputError(f"{kind}: expected a string, got {type(spec).__name__}")
    else:
        key = spec
    if len(key) > limits.max_chars:
        raise InputError(f"{kind} of {len(key):,} characters{' (as compact JSON)' if kind == 'json_schema' else ''}: "
                         f"the most this server compiles is {limits.max_chars:,}: shorten it")
    if kind == "grammar" and (rules := len(RULE.findall(key))) > limits.max_rules:
        raise InputError(f"grammar of {rules:,} rules: the most this server compiles is {limits.max_rules:,}: "
                         "merge or shorten rules")
    return key


def _source(kind: str, spec) -> str:
    """The spec as llguidance's grammar text."""
    from llguidance import LLMatcher, grammar_from
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    try:
        if kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_LAYOUT)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        return grammar_from("grammar", spec)   # Lark as it is; GBNF converted to Lark
    except (TypeError, ValueError, RecursionError) as e:
        raise InputError(f"{kind} is not valid: {_short(str(e))}") from None


def compile_grammar(tokenizer, kind: str, spec=None, *, isolated: bool = False, limits: Limits = LIMITS) -> Grammar:
    """The grammar `spec` of `kind` compiled for `tokenizer` (a fast Hugging Face tokenizer), cached per
    (tokenizer object, kind, spec, limits):
      "json_object"  any JSON object (spec unused);
      "json_schema"  a JSON schema, as a dict (llguidance's JSON Schema subset; a keyword it does not implement is
                     an error, not ignored);
      "regex"        a regular expression (Rust `regex` syntax) that the whole output must match;
      "grammar"      a context-free grammar in llguidance's Lark dialect (`start: ...`; regexes, `%json {...}`
                     for a schema inside a rule), or llama.cpp's GBNF (`root ::= ...`), converted to Lark.
    A spec that is not valid, or past `limits`, raises InputError with the library's account of what is wrong and
    where. `isolated` (a server's requests): the grammar is compiled first in a child process (`Sandbox`), within
    `limits.compile_s`, so that one that crashes the compiler or runs away costs that process only; it is
    compiled here once it has compiled there. Compilation runs on a thread of its own with a large stack."""
    key = (kind, _key(kind, spec, limits), limits)
    lib = library(tokenizer)
    with _lock:
        if key in lib.cache:
            lib.cache.move_to_end(key)
            return lib.cache[key]
    source = _source(kind, spec)
    if isolated:
        error = SANDBOX.check(lib, source, limits)
        if error:
            raise InputError(f"{kind} is not valid: {_short(error)}")
    start = compile_source(lib.lltok, source, limits.library(), limits.stack_bytes)
    if start.is_error():
        raise InputError(f"{kind} is not valid: {_short(start.get_error())}")
    grammar = Grammar(kind, spec, start, lib.vocab_size, tuple(lib.lltok.eos_tokens), limits)
    chars = len(key[1] or "")
    with _lock:
        if key in lib.cache:   # compiled meanwhile on another thread
            return lib.cache[key]
        lib.cache[key] = grammar
        lib.chars += chars
        while len(lib.cache) > limits.cache_entries or lib.chars > limits.cache_chars and len(lib.cache) > 1:
            (_, old, _), _ = lib.cache.popitem(last=False)
            lib.chars -= len(old or "")
    return grammar


def _short(error: str, most: int = 400) -> str:
    """The library's account of an error, cut to `most` characters (it may quote the whole grammar)."""
    error = error.strip()
    return error if len(error) <= most else error[:most] + f"... ({len(error) - most:,} more characters)"


class Sandbox:
    """Child processes (grammar_child.py) that compile a grammar before the server does: a crash, a compilation
    past the time budget or the child's memory bound ends the child, and the request is refused; the next check
    starts a new child. One check at a time (the lock): compilation takes one core at most, and requests queue for
    it, never for the threads that serve the rest."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._known: set[str] = set()   # the tokenizers the running child has

    def check(self, lib: _Library, source: str, limits: Limits) -> str:
        """"" when `source` compiles in the child within limits.compile_s, else why not."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                if lib.key not in self._known:
                    self._send(["tokenizer", lib.key, lib.text, lib.lltok.vocab_size, lib.eos])
                    self._known.add(lib.key)
                self._send(["compile", lib.key, source, limits.library(), limits.stack_bytes])
                return json.loads(self._receive(time.monotonic() + limits.compile_s))
            except TimeoutError:
                self._stop()
                return (f"compiling it took longer than {limits.compile_s:g} s, the most this server spends on a "
                        "grammar: simplify it")
            except (EOFError, OSError):
                code = self._stop()
                return f"it crashed the grammar compiler (exit code {code}): simplify it"

    def _start(self) -> None:
        script = Path(__file__).with_name("grammar_child.py")
        self._proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, env={**os.environ, "RUST_BACKTRACE": "0"})
        self._known = set()

    def _stop(self) -> int | None:
        proc, self._proc = self._proc, None
        proc.kill()
        return proc.wait()

    def _send(self, message) -> None:
        frame = json.dumps(message).encode()
        self._proc.stdin.write(struct.pack(">I", len(frame)) + frame)
        self._proc.stdin.flush()

    def _receive(self, deadline: float):
        size = struct.unpack(">I", self._read(4, deadline))[0]
        return self._read(size, deadline)

    def _read(self, n: int, deadline: float) -> bytes:
        out, fd = b"", self._proc.stdout.fileno()
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
        return out

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._stop()


SANDBOX = Sandbox()


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
    until the state moves, so checking the token after `allowed()` costs nothing more.

    A matcher that fails (a limit of the library met mid-way, or its masks past the grammar's CPU budget: Limits)
    raises nothing: `error` says why, and from then on it allows only the stop tokens, like a row that has ended,
    so that the round of the batch it is in goes on; the caller ends its row with that error (Batch.step).
    `commit(tokens)` is `advance` for the tokens a row keeps: each adds to its mask budget."""

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
        self.error: InputError | None = None   # why it failed (None: it has not)
        self.mask_s = 0.0      # CPU time its masks have taken
        self._committed = 0    # tokens committed (commit): each adds mask_per_token_s to the budget

    @property
    def done(self) -> bool:
        """The grammar is complete and allows only the end of sequence now (or the row has ended or failed)."""
        return self._ended > 0 or self.error is not None or self._m.is_stopped()

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens allowed next."""
        mask = np.zeros(self.vocab_size, bool)
        if not self._ended and self.error is None:
            n = self.grammar.vocab_size
            bits = self._library_mask()
            if self.error is None:
                mask[:n] = np.unpackbits(bits.view(np.uint8), bitorder="little")[:n]
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
            if t in self.eos_ids and (self._ended or self.error is not None or self._m.is_accepting()):
                self._ended += 1
            elif self._ended or self.error is not None or t in self.eos_ids or not 0 <= t < self.grammar.vocab_size:
                break
            elif (self._library_mask()[t >> 5] >> (t & 31) & 1 and self.error is None
                  and self._m.try_consume_tokens([t]) == 1):
                self._depth, self._fresh = self._depth + 1, False
            else:
                self._check()
                break
            n += 1
        return n

    def commit(self, tokens) -> int:
        """`advance` for tokens the row keeps (its committed state moves on): each raises its mask budget."""
        n = self.advance(tokens)
        self._committed += n
        return n

    def rollback(self, n: int) -> None:
        """Undo the last `n` consumed tokens (stop tokens included)."""
        if not 0 <= n <= self._depth + self._ended:
            raise ValueError(f"rollback({n}): {self._depth + self._ended} tokens consumed")
        ended = min(n, self._ended)
        self._ended -= ended
        if n > ended:
            self._depth, self._fresh = self._depth - (n - ended), False
            if self.error is None:
                self._m.rollback(n - ended)
                self._check()

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here: each the only token its mask allows (a stop token ends the
        list), so taking them without a pass changes no output. Possibly empty; the matcher does not move."""
        out = []
        while len(out) < FORCED_MAX and not self._ended and self.error is None:
            allowed = np.flatnonzero(self.allowed())
            if len(allowed) != 1 or self.advance(allowed.tolist()) != 1:
                break
            out.append(int(allowed[0]))
        self.rollback(len(out))
        return out

    def _library_mask(self) -> np.ndarray:
        """The library's bitmask of the current state, (ceil(tokenizer size / 32),) int32: bit i of word j is token
        32 j + i. Computed once per state, its CPU time counted against the budget."""
        if not self._fresh and self.error is None:
            began = time.thread_time()
            self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            self.mask_s += time.thread_time() - began
            self._check()
            self._fresh = True
            limits = self.grammar.limits
            budget = limits.mask_burst_s + limits.mask_per_token_s * self._committed
            if self.error is None and self.mask_s > budget:
                self._fail(f"its masks took {self.mask_s:.2f} s of CPU time for {self._committed} tokens, past this "
                           f"server's budget of {limits.mask_burst_s:g} s and {limits.mask_per_token_s * 1e3:g} ms "
                           "a token: simplify the grammar")
        return self._bits

    def _check(self) -> None:
        if self.error is None and self._m.is_error():   # a resource limit of the library mid-way
            self._fail(f"the grammar matcher failed: {_short(self._m.get_error())}")

    def _fail(self, why: str) -> None:
        self.error = InputError(f"{self.grammar.kind}: {why}")
        self._fresh = False


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
