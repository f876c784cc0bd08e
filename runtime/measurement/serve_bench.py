"""`specrt bench-serve`: a real `specrt serve` process under concurrent streaming requests.

For each concurrency c, the same requests (MT-Bench prompts, greedy, chat template) are sent with at most c in
flight; it reports generated tokens per second over the whole wave, time to first token and the speedup over
c = 1 (one request at a time, measured in the same run), then the server's own count of rounds by batch size
and how many of them speculated.
"""
from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from specrt.errors import InputError


@contextmanager
def server(engines: Path, log_path: Path, *args: str, wait_s: float = 300):
    """`specrt serve ENGINES *args` on a free port until /health answers; yields (base URL, its process id)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specrt.cli", "serve", str(engines), "--port", str(port),
                                 *args], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            if proc.poll() is not None:
                raise InputError(f"the server exited: {Path(log_path).read_text()[-1500:]}")
            if time.monotonic() > deadline:
                raise InputError(f"the server gave no /health in {wait_s:.0f} s: {Path(log_path).read_text()[-1500:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.3)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stream_request(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat completion: its start, first-token and end times, token count and the server's figures."""
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    start, first, tokens, stats = time.perf_counter(), None, 0, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise InputError(f"the server answered an error: {chunk['error']['message']}")
            n = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
            if n and first is None:
                first = time.perf_counter()
            tokens += n
            stats = chunk.get("specrt", stats)
    return {"start": start, "first": first or time.perf_counter(), "end": time.perf_counter(), "tokens": tokens,
            "stats": stats}


def wave(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    """All prompts, at most `concurrency` in flight."""
    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda p: stream_request(url, p, max_tokens), prompts))
    wall = time.perf_counter() - began
    ttft = [d["first"] - d["start"] for d in done]
    tokens = sum(d["tokens"] for d in done)
    return {"concurrency": concurrency, "requests": len(done), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_mean_s": statistics.mean(ttft), "ttft_max_s": max(ttft),
            "batch_rounds": done[-1]["stats"].get("batch_rounds") if done[-1]["stats"] else None}


def bench_serve(engines: Path, concurrency: list[int], method: str, requests: int, max_tokens: int,
                threads: int | None, out: Path, log=print) -> dict:
    from specrt.measurement.bench import load_prompts
    if not concurrency or min(concurrency) < 1:
        raise InputError(f"--concurrency {concurrency}: give positive numbers, e.g. 1,4,8")
    prompts = [p.text for p in load_prompts(None, requests) if p.text]
    prompts = (prompts * (requests // len(prompts) + 1))[:requests]
    out.mkdir(parents=True, exist_ok=True)
    results = []
    args = ["--max-batch", str(max(concurrency)), "--method", method] + (["--threads", str(threads)] if threads else [])
    with server(engines, out / "server.log", *args) as (url, _):
        stream_request(url, prompts[0], 8)   # warm-up: first passes, cost measurements
        for c in sorted(set(concurrency)):
            log(f"concurrency {c}: {requests} requests of {max_tokens} tokens ({method}) ...")
            results.append(wave(url, prompts, c, max_tokens))
            r = results[-1]
            log(f"  {r['tokens_per_s']:.1f} tok/s, time to first token mean {1e3 * r['ttft_mean_s']:.0f} ms "
                f"(max {1e3 * r['ttft_max_s']:.0f} ms), {r['wall_s']:.1f} s")
    base = next((r["tokens_per_s"] for r in results if r["concurrency"] == 1), None)
    for r in results:
        r["speedup_vs_one_at_a_time"] = r["tokens_per_s"] / base if base else None
    report = {"engines": str(engines), "method": method, "max_tokens": max_tokens, "results": results}
    (out / "serve_bench.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Serving: {method}, {requests} requests of {max_tokens} tokens (greedy, MT-Bench chat prompts)", "",
             "| concurrency | tok/s | × one at a time | TTFT mean (ms) | TTFT max (ms) |", "|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['speedup_vs_one_at_a_time']:.2f}" if r["speedup_vs_one_at_a_time"] else "-"
        lines.append(f"| {r['concurrency']} | {r['tokens_per_s']:.1f} | {ratio} | {1e3 * r['ttft_mean_s']:.0f} | "
                     f"{1e3 * r['ttft_max_s']:.0f} |")
    rounds = results[-1]["batch_rounds"] if results else None
    if rounds:
        lines += ["", "Rounds of the server's batch by live rows (cumulative over the run):", "",
                  "| rows | rounds | speculative |", "|---|---|---|"]
        lines += [f"| {n} | {v['rounds']} | {v['speculative']} |" for n, v in rounds.items()]
    (out / "serve_bench.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return report
