"""`specrt bench-serve`: a real `specrt serve` process under concurrent streaming requests.

For each concurrency c, the same requests (MT-Bench prompts, greedy, chat template) are sent with at most c in
flight; it reports generated tokens per second over the whole wave, time to first token and the speedup over
c = 1 (one request at a time, measured in the same run), then the server's own count of rounds by batch size
and how many of them speculated.

`--long-prompt`: a few short streams run, and once each has its first token one long prompt arrives (one of the
packaged long prompts); it reports the short streams' largest gap between two tokens (a prefill that is not
chunked stalls them for all of it) and the long request's time to first token.

`--shared-prefix TOKENS`: requests one at a time, each an MT-Bench question under one system prompt of about TOKENS
tokens (the first packaged long prompt, cut), against a server with its prefix cache off and one with it on, side
by side: each request's time to first token and total time, and its prompt tokens that came from the cache.

The other modes' servers run without a prefix cache unless `--prefix-cache MB` is given: the waves send the same
prompts at every concurrency, and later waves would find the blocks of earlier ones (an MT-Bench chat prompt holds a
block or two), so by default they measure decoding alone, as the published tables do.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from specrt.errors import InputError
from specrt.measurement.rss import process_rss_bytes


def suffix_cache_figures(url: str) -> dict:
    """The server's suffix cache now, from its /metrics (no API key: a server the bench started): its outputs,
    tokens and bytes."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return {key: int(values[f"specrt:suffix_cache_{key}"]) for key in ("outputs", "tokens", "bytes")}


@contextmanager
def server(engines: Path, log_path: Path, *args: str, wait_s: float = 300, stop_s: float = 10):
    """`specrt serve ENGINES *args` on a free port until /health answers (with --replicas, until its log says that
    every replica serves); yields (base URL, its process id). At the end SIGTERM, and SIGKILL if it has not exited
    stop_s seconds later."""
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
                    if "--replicas" not in args or _replicas_ready(log_path):
                        break
            except OSError:
                pass
            time.sleep(0.3)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _replicas_ready(log_path: Path) -> bool:
    from specrt.serving.replicas import READY
    return READY in Path(log_path).read_text(errors="replace")


def stream_request(url: str, prompt: str | list[dict], max_tokens: int, began: threading.Event | None = None) -> dict:
    """One streamed chat completion of `prompt` (a user message, or the messages): its start, first-token and end
    times, when each chunk of tokens came, token count and the server's figures. `began` is set at the first
    token."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    start, first, tokens, stats, arrivals = time.perf_counter(), None, 0, None, []
    with urllib.request.urlopen(req, timeout=1800) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise InputError(f"the server answered an error: {chunk['error']['message']}")
            n = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
            if n:
                arrivals.append(time.perf_counter())
                if first is None:
                    first = arrivals[0]
                    if began is not None:
                        began.set()
            tokens += n
            stats = chunk.get("specrt", stats)
    return {"start": start, "first": first or time.perf_counter(), "end": time.perf_counter(), "tokens": tokens,
            "stats": stats, "arrivals": arrivals}


def cache_args(prefix_cache_mb: float | None) -> list[str]:
    """The server's --prefix-cache: the one asked for, else none (None: decoding alone, see the module doc)."""
    return ["--prefix-cache", "0" if prefix_cache_mb is None else str(prefix_cache_mb)]


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


def long_prompt_wave(url: str, short: list[str], long: str, max_tokens: int, long_tokens: int) -> dict:
    """The short prompts streamed at once; when each has its first token, the long one arrives. Each short
    stream's largest gap between two token arrivals, and the long request's time to first token."""
    began = [threading.Event() for _ in short]
    with ThreadPoolExecutor(len(short) + 1) as pool:
        streams = [pool.submit(stream_request, url, p, max_tokens, b) for p, b in zip(short, began)]
        for b in began:
            b.wait(1800)
        late = pool.submit(stream_request, url, long, long_tokens)
        shorts, lone = [f.result() for f in streams], late.result()
    gaps = [max((b - a for a, b in zip(s["arrivals"], s["arrivals"][1:])), default=0.0) for s in shorts]
    during = sum(lone["start"] < t < lone["first"] for s in shorts for t in s["arrivals"])
    return {"short_streams": len(short), "short_tokens": sum(s["tokens"] for s in shorts),
            "short_max_gap_s": max(gaps), "short_max_gaps_s": gaps,
            "short_itl_mean_s": statistics.mean((s["end"] - s["first"]) / max(1, s["tokens"] - 1) for s in shorts),
            "short_chunks_during_long_prefill": during, "long_ttft_s": lone["first"] - lone["start"],
            "long_tokens": lone["tokens"], "long_stats": lone["stats"]}


def bench_long_prompt(engines: Path, method: str, streams: int, max_tokens: int, threads: int | None,
                      prefill_chunk: int | None, out: Path, long_id: str = "review-letter-answers",
                      log=print, prefix_cache_mb: float | None = None) -> dict:
    """`streams` short streams (MT-Bench prompts, `max_tokens` each) and one long prompt (the packaged long prompt
    `long_id`, 32 tokens) arriving while they run, against one server; serve_bench.json and .md in `out`."""
    from specrt.measurement.bench import LONG_PROMPTS, load_prompts
    short = [p.text for p in load_prompts(None, streams)]
    long = next((p.text for p in load_prompts(None, 100, LONG_PROMPTS) if p.id == long_id), None)
    if long is None:
        raise InputError(f"--long-prompt {long_id!r}: not an id of the packaged long prompts")
    out.mkdir(parents=True, exist_ok=True)
    args = ["--max-batch", str(streams + 1), "--method", method] + (["--threads", str(threads)] if threads else []) \
        + (["--prefill-chunk", str(prefill_chunk)] if prefill_chunk else []) + cache_args(prefix_cache_mb)
    with server(engines, out / "server.log", *args) as (url, _):
        stream_request(url, short[0], 8)   # warm-up: first passes, cost measurements
        log(f"{streams} streams of {max_tokens} tokens ({method}), then a long prompt ({long_id}) ...")
        r = long_prompt_wave(url, short, long, max_tokens, 32)
    report = {"engines": str(engines), "method": method, "max_tokens": max_tokens, "long_prompt": long_id,
              "prefill_chunk": prefill_chunk, "long_prompt_result": r}
    (out / "serve_bench.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Serving: a long prompt ({long_id}) joins {streams} running streams ({method}, greedy)", "",
             "| short streams' largest gap (s) | their mean inter-token (s) | their tokens while the long prompt was "
             "prefilled | long request's time to first token (s) |", "|---|---|---|---|",
             f"| {r['short_max_gap_s']:.2f} | {r['short_itl_mean_s']:.3f} | {r['short_chunks_during_long_prefill']} | "
             f"{r['long_ttft_s']:.1f} |"]
    (out / "serve_bench.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return report


def bench_repeated(engines: Path, concurrency: int, method: str, requests: int, max_tokens: int,
                   threads: int | None, suffix_cache_mb: float, out: Path, log=print,
                   prefix_cache_mb: float | None = None) -> dict:
    """Repeated traffic (agents and retries send the same requests again): one wave of `requests`, then the same
    wave again, against a server without a suffix cache and one with `suffix_cache_mb`, side by side in one run;
    the second pass's tokens/s and tokens a round with the cache against without, and the cache's size after."""
    from specrt.measurement.bench import load_prompts
    prompts = [p.text for p in load_prompts(None, requests) if p.text]
    prompts = (prompts * (requests // len(prompts) + 1))[:requests]
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for cache in (None, suffix_cache_mb):
        args = ["--max-batch", str(concurrency), "--method", method] + (["--threads", str(threads)] if threads else []) \
            + ([] if cache is None else ["--suffix-cache", str(cache)]) + cache_args(prefix_cache_mb)
        with server(engines, out / f"server-{'cache' if cache else 'plain'}.log", *args) as (url, pid):
            stream_request(url, "Say hello.", 8)   # warm-up: first passes, cost measurements
            for n in (1, 2):
                log(f"{'suffix cache ' + str(cache) + ' MB' if cache else 'no suffix cache'}, pass {n}: {requests} "
                    f"requests of {max_tokens} tokens ({method}, concurrency {concurrency}) ...")
                began = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    done = list(pool.map(lambda q: stream_request(url, q, max_tokens), prompts))
                wall = time.perf_counter() - began
                tokens = sum(d["tokens"] for d in done)
                rounds = sum(d["stats"]["rounds"] for d in done if d["stats"] and d["stats"].get("rounds"))
                results.append({"suffix_cache_mb": cache, "pass": n, "tokens": tokens, "wall_s": wall,
                                "tokens_per_s": tokens / wall, "tokens_per_round": tokens / rounds if rounds else None,
                                "server_rss_mb": process_rss_bytes(pid) / 2**20})
                log(f"  {tokens / wall:.1f} tok/s, {results[-1]['tokens_per_round'] or 0:.2f} tokens a round, server "
                    f"{results[-1]['server_rss_mb']:.0f} MB resident")
            results[-1]["suffix_cache"] = suffix_cache_figures(url) if cache else None
    plain, cached = results[1], results[3]
    ratio = cached["tokens_per_s"] / plain["tokens_per_s"]
    report = {"engines": str(engines), "method": method, "concurrency": concurrency, "max_tokens": max_tokens,
              "results": results, "second_pass_ratio": ratio}
    (out / "serve_bench.json").write_text(json.dumps(report, indent=2))
    size = cached["suffix_cache"]
    lines = [f"# Serving repeated traffic: {method}, {requests} requests of {max_tokens} tokens sent twice "
             f"(greedy, MT-Bench chat prompts, concurrency {concurrency})", "",
             "| suffix cache | pass | tok/s | tokens a round | server resident after (MB) |", "|---|---|---|---|---|"]
    lines += [f"| {r['suffix_cache_mb'] or 'none'}{' MB' if r['suffix_cache_mb'] else ''} | {r['pass']} | "
              f"{r['tokens_per_s']:.1f} | {r['tokens_per_round'] or 0:.2f} | {r['server_rss_mb']:.0f} |"
              for r in results]
    lines += ["", f"Second pass with the cache: {ratio:.2f}× the second pass without. The cache after both passes: "
              f"{size.get('outputs')} outputs, {size.get('tokens')} tokens, {size.get('bytes')} bytes "
              f"(its bound: {suffix_cache_mb} MB)."]
    (out / "serve_bench.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return report


def bench_serve(engines: Path, concurrency: list[int], method: str, requests: int, max_tokens: int,
                threads: int | None, out: Path, log=print, replicas: list[int] | None = None,
                prefix_cache_mb: float | None = None) -> dict:
    """The waves against one server; with `replicas`, against `specrt serve --replicas R` for each R in turn (each
    replica --threads threads, default the cores divided among them), side by side."""
    from specrt.measurement.bench import load_prompts
    if not concurrency or min(concurrency) < 1:
        raise InputError(f"--concurrency {concurrency}: give positive numbers, e.g. 1,4,8")
    if replicas is not None and (not replicas or min(replicas) < 1):
        raise InputError(f"--replicas {replicas}: give positive numbers, e.g. 1,2")
    prompts = [p.text for p in load_prompts(None, requests) if p.text]
    prompts = (prompts * (requests // len(prompts) + 1))[:requests]
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for count in replicas or [None]:
        args = ["--max-batch", str(max(concurrency)), "--method", method, *cache_args(prefix_cache_mb)]
        if count is not None:
            args += ["--replicas", str(count), "--threads", str(threads or max(1, (os.cpu_count() or 1) // count))]
        elif threads:
            args += ["--threads", str(threads)]
        with server(engines, out / f"server{'' if count is None else f'-{count}'}.log", *args, stop_s=60) as (url, _):
            for _ in range(count or 1):   # warm-up of each replica: first passes, cost measurements
                stream_request(url, prompts[0], 8)
            for c in sorted(set(concurrency)):
                label = "" if count is None else f"{count} replica{'s' if count > 1 else ''}, "
                log(f"{label}concurrency {c}: {requests} requests of {max_tokens} tokens ({method}) ...")
                results.append({**({} if count is None else {"replicas": count}), **wave(url, prompts, c, max_tokens)})
                r = results[-1]
                log(f"  {r['tokens_per_s']:.1f} tok/s, time to first token mean {1e3 * r['ttft_mean_s']:.0f} ms "
                    f"(max {1e3 * r['ttft_max_s']:.0f} ms), {r['wall_s']:.1f} s")
    base = next((r["tokens_per_s"] for r in results if r["concurrency"] == 1), None)
    for r in results:
        r["speedup_vs_one_at_a_time"] = r["tokens_per_s"] / base if base else None
    report = {"engines": str(engines), "method": method, "max_tokens": max_tokens, "results": results}
    (out / "serve_bench.json").write_text(json.dumps(report, indent=2))
    head = "| replicas " if replicas else ""
    lines = [f"# Serving: {method}, {requests} requests of {max_tokens} tokens (greedy, MT-Bench chat prompts)", "",
             f"{head}| concurrency | tok/s | × one at a time | TTFT mean (ms) | TTFT max (ms) |",
             "|---" * (6 if replicas else 5) + "|"]
    for r in results:
        ratio = f"{r['speedup_vs_one_at_a_time']:.2f}" if r["speedup_vs_one_at_a_time"] else "-"
        first = f"| {r['replicas']} " if replicas else ""
        lines.append(f"{first}| {r['concurrency']} | {r['tokens_per_s']:.1f} | {ratio} | {1e3 * r['ttft_mean_s']:.0f} | "
                     f"{1e3 * r['ttft_max_s']:.0f} |")
    rounds = results[-1]["batch_rounds"] if results else None
    if rounds:
        lines += ["", "Rounds of the server's batch by live rows (cumulative over the run):", "",
                  "| rows | rounds | speculative |", "|---|---|---|"]
        lines += [f"| {n} | {v['rounds']} | {v['speculative']} |" for n, v in rounds.items()]
    (out / "serve_bench.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return report


def bench_shared_prefix(engines: Path, method: str, requests: int, max_tokens: int, threads: int | None,
                        system_tokens: int, prefix_cache_mb: float, out: Path, log=print) -> dict:
    """`requests` MT-Bench questions, one at a time, under one system prompt of about `system_tokens` tokens, against
    a server with `--prefix-cache 0` and one with `--prefix-cache prefix_cache_mb`, side by side (the "on" arm's
    first request fills the cache); serve_bench.json and .md in `out`."""
    from importlib import resources
    from transformers import AutoTokenizer
    from specrt.measurement.bench import LONG_PROMPTS, load_prompts
    if not prefix_cache_mb > 0:
        raise InputError(f"--prefix-cache {prefix_cache_mb}: --shared-prefix compares a cache of more than 0 MB "
                         "with none")
    tok = AutoTokenizer.from_pretrained(engines / "tokenizer")
    doc = json.loads(resources.files("specrt").joinpath(f"data/{LONG_PROMPTS}").read_text().splitlines()[0])
    system = tok.decode(tok(doc["prompt"])["input_ids"][:system_tokens])
    questions = [p.text for p in load_prompts(None, requests) if p.text]
    out.mkdir(parents=True, exist_ok=True)
    arms = {}
    for mb in (0, prefix_cache_mb):
        args = ["--method", method, "--prefix-cache", str(mb)] + (["--threads", str(threads)] if threads else [])
        with server(engines, out / f"server-cache-{mb}.log", *args) as (url, _):
            stream_request(url, "Say hello.", 8)   # warm-up: first passes, cost measurements
            log(f"prefix cache {mb} MB: {len(questions)} requests under a {system_tokens}-token system prompt ...")
            arms[mb] = [stream_request(url, [{"role": "system", "content": system}, {"role": "user", "content": q}],
                                       max_tokens) for q in questions]
    rows = [{"request": i + 1, "cached_tokens": (on["stats"] or {}).get("prefix_cache_tokens"),
             "ttft_off_s": off["first"] - off["start"], "ttft_on_s": on["first"] - on["start"],
             "total_off_s": off["end"] - off["start"], "total_on_s": on["end"] - on["start"]}
            for i, (off, on) in enumerate(zip(arms[0], arms[prefix_cache_mb]))]
    report = {"engines": str(engines), "method": method, "max_tokens": max_tokens, "system_tokens": system_tokens,
              "prefix_cache_mb": prefix_cache_mb, "requests": rows}
    (out / "serve_bench.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Serving a shared system prompt ({system_tokens} tokens): {method}, {len(rows)} MT-Bench questions "
             f"of {max_tokens} tokens one at a time, prefix cache off and {prefix_cache_mb} MB", "",
             "| request | cached tokens | first token off (s) | on (s) | total off (s) | on (s) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['request']} | {r['cached_tokens']} | {r['ttft_off_s']:.2f} | {r['ttft_on_s']:.2f} | "
              f"{r['total_off_s']:.2f} | {r['total_on_s']:.2f} |" for r in rows]
    (out / "serve_bench.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return report
