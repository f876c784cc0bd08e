"""llama.cpp as a peer of `specrt bench`, through llama-cpp-python (the optional `llamacpp` extra): the GGUF file
the target was exported from, fed the same prompt token ids, greedy (or sampled with top-k, top-p and min-p off),
the same max new tokens and end-of-sequence ids."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from specrt.errors import BackendError, InputError
from specrt.engines.manifest import sha256_file

INSTALL = "pip install -e '.[llamacpp]' (llama-cpp-python, which compiles llama.cpp: several minutes)"


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def version() -> str:
    import llama_cpp
    return llama_cpp.__version__


def gguf_file(target: dict) -> Path:
    """The GGUF file the manifest's target was exported from, checked against its recorded sha256."""
    if "gguf" not in target:
        raise InputError(f"the target ({target.get('source')}) was not exported from a GGUF file, and llama.cpp "
                         "runs the file the target came from: bench a GGUF-exported engine set, or --no-llamacpp")
    path = Path(target["gguf"]["path"])
    if not path.is_file() or sha256_file(path) != target["gguf"]["sha256"]:
        raise BackendError(f"the target was exported from {path}, which is missing or changed since: re-run "
                           "`specrt export`, or --no-llamacpp")
    return path


class LlamaCpp:
    """One llama.cpp context over the GGUF file, `n_ctx` positions (the engine's max_seq_len: the same KV
    capacity as specrt's static cache), `threads` threads for prefill and decode."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int):
        if not installed():
            raise BackendError(f"llama.cpp peer: llama-cpp-python is not installed: {INSTALL}")
        from llama_cpp import Llama
        self.n_ctx = n_ctx
        self.first_token_s = None   # the last generate() call's seconds until its first token (the prefill)
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         verbose=False)

    def generate(self, ids: list[int], temperature: float, max_new: int, seed: int, eos: list[int]) -> list[int]:
        """New token ids (the end-of-sequence token included, as specrt and transformers count it)."""
        self.llm.reset()   # no KV reuse from the previous call's prompt: every call pays its prefill
        self.llm.set_seed(seed)
        out = []
        started = time.perf_counter()
        tokens = self.llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                                   repeat_penalty=1.0)
        for tok in tokens:
            if not out:
                self.first_token_s = time.perf_counter() - started
            out.append(tok)
            if tok in eos or len(out) == max_new or len(ids) + len(out) >= self.n_ctx:
                break
        tokens.close()
        return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (one ending before the other counts), None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
