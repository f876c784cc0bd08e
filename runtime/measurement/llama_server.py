"""llama.cpp's own server (`llama-server`, built by `make llama-server`) as a peer of the prefix-cache measurement:
the GGUF file the target was exported from, one slot, fed the same prompt token ids as specrt through its native
`/completion` endpoint, greedy, streamed so that the first token can be timed.

`cache_prompt` is llama.cpp's prefix cache: on, the slot keeps the tokens of its last request (prompt and answer)
and a request that starts like them prefills only the rest; off, every request is prefilled from its first token.
The server's host-memory prompt cache (`--cache-ram`) is off, so that the slot's tokens are the whole cache and
`erase()` empties it (it needs `--slot-save-path`, which is why one is given)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable, Iterator

from specrt.errors import BackendError, InputError

ENV = "SPECRT_LLAMA_SERVER"                        # where the tests look for the binary first
BUILT = Path("build/llama.cpp/bin/llama-server")   # where `make llama-server` puts it


def binary(path: str | os.PathLike | None = None) -> Path:
    """The llama-server binary: `path`, else $SPECRT_LLAMA_SERVER, else build/llama.cpp/bin/llama-server."""
    found = Path(path or os.environ.get(ENV) or BUILT)
    if not (found.is_file() and os.access(found, os.X_OK)):
        raise BackendError(f"llama-server: {found} is not an executable file: run `make llama-server` (builds "
                           f"llama.cpp's server into {BUILT.parent}, about 20 minutes on 2 cores) or give its path")
    return found


def version(path: str | os.PathLike | None = None) -> str:
    """What `llama-server --version` says (llama.cpp's build number and commit, and the compiler)."""
    out = subprocess.run([str(binary(path)), "--version"], capture_output=True, text=True, timeout=60)
    return " ".join((out.stdout + out.stderr).split())


def parse_stream(lines: Iterable[bytes | str]) -> Iterator[dict]:
    """The JSON events of a server-sent event stream: each `data: {...}` line once; blank lines, other fields
    (`event:`, comments) and `data: [DONE]` are skipped. An event that carries an error raises BackendError with the
    server's message."""
    for line in lines:
        text = (line.decode() if isinstance(line, bytes) else line).strip()
        if not text.startswith("data:") or text == "data: [DONE]":
            continue
        event = json.loads(text[5:])
        if "error" in event:
            error = event["error"]
            raise BackendError(f"llama-server answered an error: {error.get('message', error)}")
        yield event


def read_completion(events: Iterable[dict], started: float, clock=time.perf_counter) -> dict:
    """A streamed /completion's answer: its token ids (each partial event carries the token it sampled, the
    end-of-generation token included), seconds from `started` to the first event with a token and to the last
    event, and the final event's figures: `cached_tokens` (prompt tokens the slot served, timings.cache_n),
    `prefilled_tokens` (timings.prompt_n) and the server's own prompt and generation milliseconds.
    `complete_ids` is False when the server counted more tokens than the stream carried (a token that ended inside
    a UTF-8 character is not streamed on its own)."""
    ids, first, final = [], None, None
    for event in events:
        if event.get("tokens"):
            if first is None:
                first = clock() - started
            ids += event["tokens"]
        if event.get("stop"):
            final = event
    total = clock() - started
    if final is None:
        raise BackendError("llama-server's stream ended without its final event (stop: true)")
    timings = final.get("timings", {})
    return {"ttft_s": first if first is not None else total, "total_s": total, "ids": ids,
            "prompt_tokens": final.get("tokens_evaluated"), "cached_tokens": timings.get("cache_n", 0),
            "prefilled_tokens": timings.get("prompt_n"), "server_prompt_ms": timings.get("prompt_ms"),
            "server_predicted_ms": timings.get("predicted_ms"),
            "complete_ids": len(ids) == final.get("tokens_predicted", len(ids))}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One `llama-server` process over `gguf`: `parallel` slots (-np) sharing `n_ctx` positions (the engine's
    max_seq_len a slot, the same KV capacity as specrt's), `threads` threads for prefill and decode, on a free local
    port, its output in `log_path` (a temporary file when None), `extra` arguments after those, `env` variables added to its
    environment. A context manager; `close()` ends it."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int, path: str | os.PathLike | None = None,
                 log_path: Path | None = None, wait_s: float = 120, extra: tuple[str, ...] = (),
                 env: dict | None = None, parallel: int = 1):
        self.binary = binary(path)
        self._tmp = tempfile.TemporaryDirectory(prefix="llama-server-")
        self.log_path = Path(log_path or Path(self._tmp.name) / "server.log")
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        args = [str(self.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(n_ctx),
                "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel), "--cache-ram", "0",
                "--slot-save-path", self._tmp.name, "--no-webui", *extra]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        try:
            self._wait(wait_s)
        except BaseException:
            self.close()
            raise

    def _wait(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            if self.proc.poll() is not None:
                raise BackendError(f"llama-server exited ({self.proc.returncode}): {self._log_tail()}")
            if time.monotonic() > deadline:
                raise BackendError(f"llama-server gave no /health in {wait_s:.0f} s: {self._log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:   # refused while it starts, 503 while it loads the model
                time.sleep(0.2)

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-1500:]

    def _post(self, path: str, body: dict, timeout: float = 1800):
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            raise BackendError(f"llama-server {path}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") \
                from None

    def complete(self, ids: list[int], max_new: int, cache_prompt: bool) -> dict:
        """One greedy request of the prompt token ids `ids` as they are (no BOS added), at most `max_new` new
        tokens, streamed; `read_completion`'s answer."""
        if not ids:
            raise InputError("llama-server: an empty prompt")
        body = {"prompt": ids, "n_predict": max_new, "temperature": 0, "cache_prompt": cache_prompt,
                "stream": True, "id_slot": 0, "seed": 0}
        started = time.perf_counter()
        with self._post("/completion", body) as r:
            return read_completion(parse_stream(r), started)

    def erase(self) -> int:
        """Empty the slot's cache (the tokens it kept); returns how many it held."""
        with self._post("/slots/0?action=erase", {}, timeout=60) as r:
            return json.load(r).get("n_erased", 0)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._tmp.cleanup()

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
