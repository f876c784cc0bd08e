"""The child process that compiles an untrusted grammar before the server does (decoding/grammar.py, `Sandbox`).

A grammar can crash its compiler (llguidance 1.9.1 overflows its stack on 3,000 chained Lark rules and takes the
process with it) or take minutes: a server compiles a request's grammar here first, where a crash, a runaway or
its memory ends this process only, and compiles it itself once this one has, within its time budget. Run as a
script (`python grammar_child.py`): it imports llguidance and the standard library only, never specrt (whose
package imports torch), so that it starts in a fraction of a second.

The protocol, on stdin and stdout, is frames of a 4-byte big-endian length and a JSON value:
    ["tokenizer", key, tokenizer_json, n_vocab, eos_ids]   no answer: the tokenizer later requests name by key
    ["compile", key, source, limits, stack]                answer: "" (it compiles) or the library's error
"""
import json
import os
import resource
import struct
import sys
import threading

MEMORY_BYTES = 4 << 30    # this process's address space: what one grammar may take to compile


def on_stack(stack: int, fn, *args):
    """fn(*args) on a new thread with a stack of `stack` bytes, its result or its exception."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:   # noqa: BLE001 -- handed to the caller
            out["error"] = e

    old = threading.stack_size(stack)
    try:
        thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
        thread.start()
    finally:
        threading.stack_size(old)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def compile_source(lltok, source: str, limits: dict, stack: int):
    """An llguidance matcher of `source` (its grammar text) at the start, compiled under `limits` (LLParserLimits'
    keyword arguments) on a thread whose stack has `stack` bytes (llguidance's grammar passes recurse on nested
    rules: 8 MiB, a thread's default, overflows on 3,000 chained rules)."""
    from llguidance import LLMatcher, LLParserLimits
    return on_stack(stack, lambda: LLMatcher(lltok, source, log_level=0, limits=LLParserLimits(**limits)))


def _read(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError
    return data


def main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    from llguidance import LLTokenizer
    tokenizers = {}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            message = json.loads(_read(stdin, struct.unpack(">I", _read(stdin, 4))[0]))
        except EOFError:
            return
        if message[0] == "tokenizer":
            _, key, text, n_vocab, eos = message
            tokenizers[key] = LLTokenizer(text, n_vocab=n_vocab, eos_token=eos)
            continue
        _, key, source, limits, stack = message
        try:
            matcher = compile_source(tokenizers[key], source, limits, stack)
            answer = matcher.get_error().strip() if matcher.is_error() else ""
        except MemoryError:
            answer = f"compiling it took more than {MEMORY_BYTES >> 30} GiB of memory"
        except Exception as e:   # noqa: BLE001 -- the server answers the request with it
            answer = f"{type(e).__name__}: {e}"
        frame = json.dumps(answer).encode()
        stdout.write(struct.pack(">I", len(frame)) + frame)
        stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("RUST_BACKTRACE", "0")
    main()
