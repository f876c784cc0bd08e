"""Grammar libraries for structured output under speculation, measured on one engine set's tokenizer.

    python -m specrt.measurement.grammar_bench [ENGINES] [--repeat 5]

For each of llguidance, xgrammar and outlines-core that is installed (none of them is imported at module level;
only llguidance is a dependency of specrt): the time to adapt the tokenizer; for three grammars (any JSON object,
a nested JSON schema, a regex) the time to compile one and compute its first mask, then along a valid document,
token by token from a fresh matcher, the time per next-token bitmask (one bit per token of the vocabulary) and per
advance by one token; at the document's end the time to roll back 1 and 8 tokens and to copy the matcher.
Prints a Markdown table (docs/notes/2026-12-grammar.md). Medians over --repeat runs; the mask column is the mean
over the document's positions (its largest in brackets).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import numpy as np

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "role", "address", "tags", "scores"],
          "properties": {
              "name": {"type": "string"},
              "age": {"type": "integer"},
              "role": {"enum": ["admin", "user", "guest"]},
              "address": {"type": "object", "additionalProperties": False, "required": ["street", "zip"],
                          "properties": {"street": {"type": "string"}, "zip": {"type": "integer"}}},
              "tags": {"type": "array", "items": {"type": "string"}},
              "scores": {"type": "array", "items": {
                  "type": "object", "additionalProperties": False, "required": ["k", "v"],
                  "properties": {"k": {"enum": ["x", "y"]}, "v": {"type": "integer"}}}}}}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "role": "admin",
                  "address": {"street": "12 St James's Square", "zip": 10001},
                  "tags": ["math", "engines"], "scores": [{"k": "x", "v": 7}, {"k": "y", "v": -3}]})
REGEX = r"[A-Z][a-z]+ [0-9]{1,3} (apples|pears|plums)(, [A-Z][a-z]+ [0-9]{1,3} (apples|pears|plums))*\."
REGEX_DOC = "Anna 12 apples, Bob 7 pears, Carmen 130 plums."
CASES = {"json object": ("json_object", {"type": "object"}, DOC), "json schema": ("json_schema", SCHEMA, DOC),
         "regex": ("regex", REGEX, REGEX_DOC)}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance.hf
        self.lib, self.tok = llguidance, llguidance.hf.from_tokenizer(tokenizer)

    def compile(self, kind, spec):
        M = self.lib.LLMatcher
        g = M.grammar_from_regex(spec) if kind == "regex" else M.grammar_from_json_schema(spec)
        m = M(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def mask(self, m, bits):
        m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)

    def advance(self, m, token):
        return m.consume_token(token)

    def rollback(self, m, n):
        m.rollback(n)

    def fork(self, m):
        return m.deep_copy()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import torch
        import xgrammar
        self.lib, self.torch = xgrammar, torch
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))

    def compile(self, kind, spec):
        # a fresh compiler with its cache off: a cold compile each time; one thread as the others use
        c = self.lib.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return c.compile_regex(spec) if kind == "regex" else c.compile_json_schema(json.dumps(spec),
                                                                                    any_whitespace=False)

    def matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def mask(self, m, bits):
        m.fill_next_token_bitmask(self.torch.from_numpy(bits))

    def advance(self, m, token):
        return m.accept_token(token)

    def rollback(self, m, n):
        m.rollback(n)

    def fork(self, m):
        return m.fork()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer):
        import outlines_core
        self.lib = outlines_core
        # byte-level BPE: each token's string maps back to its bytes (GPT-2's printable stand-ins for bytes)
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        stand_in = dict(zip(printable, printable)) | {b: 256 + i for i, b in
                                                     enumerate(b for b in range(256) if b not in printable)}
        byte_of = {chr(c): b for b, c in stand_in.items()}
        special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        vocab = {}
        for text, i in tokenizer.get_vocab().items():
            if i not in special:
                vocab.setdefault(bytes(byte_of[c] for c in text), []).append(i)
        self.vocab = outlines_core.Vocabulary(tokenizer.eos_token_id, vocab)

    def compile(self, kind, spec):
        regex = spec if kind == "regex" else self.lib.json_schema.build_regex_from_schema(json.dumps(spec))
        return self.lib.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.lib.Guide(compiled, max_rollback=64)

    def mask(self, m, bits):
        m.write_mask_into(bits.ctypes.data, bits.size, 4)

    def advance(self, m, token):
        m.advance(token, return_tokens=False)
        return True

    def rollback(self, m, n):
        m.rollback_state(n)

    def fork(self, m):
        return copy.deepcopy(m)   # pickles through Guide.__reduce__ (no copy of its own)


def _us(f, *args) -> tuple[float, object]:
    t = time.perf_counter()
    out = f(*args)
    return (time.perf_counter() - t) * 1e6, out


def measure(lib, kind, spec, doc_ids, bits, repeat) -> dict:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        compiled = lib.compile(kind, spec)
        m = lib.matcher(compiled)
        lib.mask(m, bits)
        compile_ms = (time.perf_counter() - t) * 1e3
        masks, advances = [], []
        for tok in doc_ids:
            masks.append(_us(lib.mask, m, bits)[0])
            dt, ok = _us(lib.advance, m, tok)
            if not ok:
                raise ValueError(f"{lib.name} refused token {tok} of the document")
            advances.append(dt)
        rb1 = _us(lib.rollback, m, 1)[0]
        lib.advance(m, doc_ids[-1])
        rb8 = _us(lib.rollback, m, 8)[0]
        for tok in doc_ids[-8:]:
            lib.advance(m, tok)
        fork = _us(lib.fork, m)[0]
        runs.append(dict(compile_ms=compile_ms, mask_us=statistics.mean(masks), mask_max_us=max(masks),
                         advance_us=statistics.mean(advances), rollback1_us=rb1, rollback8_us=rb8, fork_us=fork))
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def wrapper(tokenizer, repeat: int) -> str:
    """specrt.decoding.grammar's own costs on the schema: allowed() (the (V,) bool mask), advance by one token
    then roll it back, and path_masks over a tree (a chain of 8 drafted tokens, every prefix of it, and a sibling
    leaf beside each chain node that has one), from a state inside the document."""
    from specrt.decoding.grammar import Matcher, compile_grammar, path_masks
    ids = tokenizer(DOC)["input_ids"]
    m = Matcher(compile_grammar(tokenizer, "json_schema", SCHEMA))
    m.advance(ids[:30])   # inside the street's string: `{"name": ... "street": "`
    chain = ids[30:38]
    paths = [chain[:d] for d in range(len(chain) + 1)]
    for d in range(len(chain)):
        m.advance(chain[:d])
        paths += [chain[:d] + [int(t)] for t in np.flatnonzero(m.allowed()) if t != chain[d]][:1]
        m.rollback(d)
    runs = []
    for _ in range(repeat):
        allowed = _us(m.allowed)[0]
        step = _us(lambda: (m.advance(chain[:1]), m.rollback(1)))[0]
        tree = _us(path_masks, m, paths)[0]
        runs.append((allowed, step, tree))
    allowed, step, tree = (statistics.median(r[i] for r in runs) for i in range(3))
    return (f"specrt.decoding.grammar (llguidance), nested schema: allowed() {allowed:.0f} us, advance + rollback of "
            f"one token {step:.0f} us, path_masks over {len(paths)} nodes {tree / 1e3:.2f} ms")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", nargs="?", default="engines/default")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(f"{args.engines}/tokenizer")
    V = len(tokenizer)
    bits = np.zeros((V + 31) // 32, np.int32)   # (V / 32,) the libraries' shared bitmask layout
    t = time.perf_counter()
    for _ in range(100):
        np.unpackbits(bits.view(np.uint8), bitorder="little")[:V].astype(bool)
    print(f"vocabulary {V:,}; bitmask -> bool (V,) in numpy: {(time.perf_counter() - t) * 1e4:.1f} us\n")
    print("| library | grammar | tokenizer setup s | compile + first mask ms | mask us (max) | advance us "
          "| rollback 1 / 8 us | copy us |")
    print("|---|---|---|---|---|---|---|---|")
    for cls in (Llguidance, Xgrammar, OutlinesCore):
        try:
            t = time.perf_counter()
            lib = cls(tokenizer)
            setup = time.perf_counter() - t
        except ImportError as e:
            print(f"| {cls.name} | not installed ({e}) |")
            continue
        for name, (kind, spec, doc) in CASES.items():
            ids = tokenizer(doc)["input_ids"]
            try:
                r = measure(lib, kind, spec, ids, bits, args.repeat)
            except Exception as e:   # a library that cannot compile or walk this grammar: say so in its row
                print(f"| {lib.name} | {name} | {setup:.2f} | fails: {str(e).splitlines()[0][:80]} |")
                continue
            print(f"| {lib.name} | {name} | {setup:.2f} | {r['compile_ms']:.1f} | {r['mask_us']:.0f} "
                  f"({r['mask_max_us']:.0f}) | {r['advance_us']:.1f} | {r['rollback1_us']:.1f} / "
                  f"{r['rollback8_us']:.1f} | {r['fork_us']:.1f} |")
    print("\n" + wrapper(tokenizer, args.repeat))


if __name__ == "__main__":
    main()
