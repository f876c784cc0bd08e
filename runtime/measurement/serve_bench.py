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
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

from specrt.errors import InputError
from specrt.measurement.llama_server import version
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


def stream_request(url: str, prompt: str | list[dict], max_tokens: int, began: threading.Event | None = None,
                   temperature: float = 0.0, seed: int | None = None, extra: dict | None = None) -> dict:
    """One streamed chat completion of `prompt` (a user message, or the messages), `extra` added to the body (a
    method, another server's own fields): its start, first-token and end times, when each chunk of tokens came and
    how many it carried (specrt's `token_ids`, else llama.cpp's running `timings.predicted_n`, else one), its text,
    token count, the server's figures, its last usage object and the answer's headers. `began` is set at the first
    token."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            **({} if seed is None else {"seed": seed}), **(extra or {})}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start, first, tokens, stats, arrivals, sizes, text = time.perf_counter(), None, 0, None, [], [], []
    usage = None
    with urllib.request.urlopen(req, timeout=1800) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise InputError(f"the server answered an error: {chunk['error']['message']}")
            text += [(c.get("delta") or {}).get("content") or "" for c in chunk["choices"]]
            if "specrt" in chunk or any("token_ids" in c for c in chunk["choices"]):
                n = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
            elif "predicted_n" in chunk.get("timings", {}):
                n = chunk["timings"]["predicted_n"] - tokens
            else:
                n = int(any(text[-len(chunk["choices"]):])) if chunk["choices"] else 0
            if n:
                arrivals.append(time.perf_counter())
                sizes.append(n)
                if first is None:
                    first = arrivals[0]
                    if began is not None:
                        began.set()
            tokens += n
            stats = chunk.get("specrt", stats)
            usage = chunk.get("usage") or usage
    return {"start": start, "first": first or time.perf_counter(), "end": time.perf_counter(), "tokens": tokens,
            "stats": stats, "arrivals": arrivals, "sizes": sizes, "text": "".join(text), "usage": usage,
            "headers": r.headers}


def cache_args(prefix_cache_mb: float | None) -> list[str]:
    """The server's --prefix-cache: the one asked for, else none (None: decoding alone, see the module doc)."""
    return ["--prefix-cache", "0" if prefix_cache_mb is None else str(prefix_cache_mb)]


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


OPEN_TURN = 16       # requests of one open-loop turn (arms take turns; a turn's arrival times are the same for each)
LONG_TOKENS = 1024   # the packaged long prompts are cut to this many tokens (their instruction comes first)
PROMPT_SETS = ("mt-bench", "code", "long", "mixed")   # mixed: MT-Bench, code, MT-Bench, long, over and over
LLAMA_CPP = "llama.cpp"   # the arm of --llama-server
# llama.cpp's request fields: no prompt cache (specrt's is off), plain temperature sampling as specrt's (its
# defaults are top-k 40, top-p 0.95, min-p 0.05), each chunk's running token count
LLAMA_FIELDS = {"cache_prompt": False, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "timings_per_token": True}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 to 100) of `values`, linear between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    v = sorted(values)
    at = (len(v) - 1) * q / 100
    lo = int(at)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (at - lo)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from a turn's start at which its `n` requests arrive: exponential gaps of mean 1/rate (a Poisson
    process of `rate` requests a second), the first at 0; the same for the same seed."""
    rng = random.Random(seed)
    times = [0.0]
    while len(times) < n:
        times.append(times[-1] + rng.expovariate(rate))
    return times[:n]


def serving_prompts(kind: str, requests: int, engines: Path) -> list[str]:
    """`requests` prompts of the packaged sets: MT-Bench questions, code completions, the long prompts cut to
    LONG_TOKENS tokens (at most half the engines' positions), or the three mixed; or of a JSONL file of one's own
    (bench's prompt files: rows with `prompt` or `turns`), repeated in turn if it holds fewer."""
    from specrt.measurement.bench import LONG_PROMPTS, load_prompts
    if kind not in PROMPT_SETS:
        if not Path(kind).is_file():
            raise InputError(f"--prompts {kind!r}: one of {', '.join(PROMPT_SETS)}, or a JSONL file of prompts")
        own = [p.text for p in load_prompts(Path(kind), 10000)]
        if not own or any(t is None for t in own):
            raise InputError(f"--prompts {kind!r}: expected rows with 'prompt' or 'turns' (text: the requests are "
                             "chat messages)")
        return [own[i % len(own)] for i in range(requests)]
    sets = {"mt-bench": [p.text for p in load_prompts(None, 1000)],
            "code": [p.text for p in load_prompts(None, 1000, "code_prompts.jsonl")]}
    if kind in ("long", "mixed"):
        from transformers import AutoTokenizer
        from specrt.engines.manifest import read_manifest
        tok = AutoTokenizer.from_pretrained(engines / "tokenizer")
        cut = min(LONG_TOKENS, read_manifest(engines)["models"]["target"]["max_seq_len"] // 2)
        sets["long"] = [tok.decode(tok(p.text)["input_ids"][:cut]) for p in load_prompts(None, 100, LONG_PROMPTS)]
    order = ("mt-bench", "code", "mt-bench", "long") if kind == "mixed" else (kind,)
    taken, out = dict.fromkeys(order, 0), []
    for i in range(requests):
        k = order[i % len(order)]
        out.append(sets[k][taken[k] % len(sets[k])])
        taken[k] += 1
    return out


def latency_figures(done: list[dict]) -> dict:
    """Percentiles of the requests' time to first token (from its send), end-to-end time, and inter-token latency:
    each gap between two chunks of a stream divided among the tokens of the later chunk, once per token (a chunk
    of k tokens after a gap g is k tokens at g / k)."""
    itl = [(b - a) / n for d in done for a, b, n in zip(d["arrivals"], d["arrivals"][1:], d["sizes"][1:])
           for _ in range(n)]
    ttft, e2e = [d["first"] - d["start"] for d in done], [d["end"] - d["start"] for d in done]
    return {"ttft_s": {f"p{q}": percentile(ttft, q) for q in (50, 90, 99)},
            "itl_s": {f"p{q}": percentile(itl, q) for q in (50, 99)} if itl else None,
            "e2e_s": {f"p{q}": percentile(e2e, q) for q in (50, 99)}}


def _turn(url: str, prompts: list[str], at: list[float], max_tokens: int, temperature: float, seeds: list[int],
          extra: dict) -> tuple[float, list[dict]]:
    """One arm's turn: request i sent `at[i]` seconds after the turn starts (closed loop: all at 0), at most all in
    flight; the turn's wall time (to its last answer) and the answers."""
    began = time.perf_counter()

    def one(i: int) -> dict:
        time.sleep(max(0.0, began + at[i] - time.perf_counter()))
        return stream_request(url, prompts[i], max_tokens, temperature=temperature,
                              seed=seeds[i] if temperature > 0 else None, extra=extra)
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(one, range(len(prompts))))
    return time.perf_counter() - began, done


def _llama_rows(url: str) -> tuple[float, float]:
    """llama-server's llama_decode() calls so far, and the busy slots summed over them (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        values = {s.name: s.value for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
    decodes = values["llamacpp:n_decode_total"]
    return decodes, values["llamacpp:n_busy_slots_per_decode"] * decodes


class _Rounds:
    """The rounds a server's batch ran by live rows during each turn. A request's figures carry its batch's count
    since that batch began (the turn's largest is its last); the scheduler keeps its batch while the next requests
    have the same options (arm and temperature), so a turn that follows one of its own kind counts from that
    turn's end."""

    def __init__(self):
        self.kind, self.seen = None, {}

    def turn(self, kind: tuple, done: list[dict]) -> dict:
        now = max(({int(n): v["rounds"] for n, v in ((d["stats"] or {}).get("batch_rounds") or {}).items()}
                   for d in done), key=lambda counts: sum(counts.values()))
        before = self.seen if kind == self.kind else {}
        self.kind, self.seen = kind, now
        return {n: r - before.get(n, 0) for n, r in now.items() if r > before.get(n, 0)}


def bench_serve(engines: Path, concurrency: list[int], method: str | list[str], requests: int, max_tokens: int,
                threads: int | None, out: Path, log=print, replicas: list[int] | None = None,
                prefix_cache_mb: float | None = None, rates: list[float] = (), temperatures: list[float] = (0.0,),
                prompts: str = "mt-bench", llama_server: Path | None = None) -> dict:
    """Arms (the methods, each request asking for its own through one server, and llama.cpp's server with
    `llama_server`) under closed-loop waves (c requests sent at once, the next c once all have answered) and
    open-loop Poisson arrivals at `rates` (turns of OPEN_TURN requests), at each temperature (sampled requests
    seeded by their index). At each load the arms take turns, so that each sees the same drift of a shared
    machine's load. With `replicas`, against `specrt serve --replicas R` for each R in turn (each replica --threads
    threads, default the cores divided among them). serve_bench.json, .md and .png in `out`."""
    from specrt.engines.base import default_threads
    methods = [method] if isinstance(method, str) else list(method)
    if not concurrency and not rates or concurrency and min(concurrency) < 1:
        raise InputError(f"--concurrency {concurrency}: give positive numbers, e.g. 1,4,8 (or --rate)")
    if rates and min(rates) <= 0:
        raise InputError(f"--rate {rates}: give request rates above 0 a second, e.g. 0.5,1")
    if not temperatures or min(temperatures) < 0:
        raise InputError(f"--temperature {temperatures}: give temperatures of 0 (greedy) or more, e.g. 0,0.7")
    if replicas is not None and (not replicas or min(replicas) < 1):
        raise InputError(f"--replicas {replicas}: give positive numbers, e.g. 1,2")
    if replicas and llama_server:
        raise InputError("--llama-server with --replicas: llama.cpp's server has no replicas; run them apart")
    texts = serving_prompts(prompts, requests, engines)
    slots = max([*concurrency, *([min(OPEN_TURN, requests)] if rates else [])])
    loads = [("concurrency", c) for c in sorted(set(concurrency))] + [("rate", r) for r in sorted(set(rates))]
    out.mkdir(parents=True, exist_ok=True)
    results, versions = [], {}
    head = {"engines": str(engines), "prompts": prompts, "max_tokens": max_tokens, "requests": requests,
            "threads": threads or default_threads(), "open_turn": OPEN_TURN}
    for count in replicas or [None]:
        args = ["--max-batch", str(slots), "--method", methods[0], *cache_args(prefix_cache_mb)]
        if count is not None:
            args += ["--replicas", str(count), "--threads", str(threads or max(1, (os.cpu_count() or 1) // count))]
        elif threads:
            args += ["--threads", str(threads)]
        with ExitStack() as stack:
            url, _ = stack.enter_context(server(engines, out / f"server{'' if count is None else f'-{count}'}.log",
                                                *args, stop_s=60))
            arms = {m: (url, {"specrt": {"method": m}}) for m in methods}
            if llama_server is not None:
                peer = stack.enter_context(_llama_server(engines, llama_server, slots, threads, out))
                arms[LLAMA_CPP] = (peer.url, LLAMA_FIELDS)
                versions[LLAMA_CPP] = version(llama_server)
            rounds = _Rounds()
            for arm, (where, extra) in arms.items():   # warm-up of each arm and replica: first passes, costs
                for _ in range(count or 1):
                    d = stream_request(where, texts[0], 8, extra=extra)
                    if where == url:
                        rounds.turn((arm, 0.0), [d])
            for t in temperatures:
                for kind, level in loads:
                    label = f"{'' if count is None else f'{count} replicas, '}T = {t}, {kind} {level}"
                    log(f"{label}: {requests} requests of {max_tokens} tokens, arms {', '.join(arms)} in turns ...")
                    results += _load(arms, rounds, texts, kind, level, t, max_tokens, count)
                    report = _write(out, {**head, "arms": list(arms), "versions": versions, "results": results},
                                    replicas is not None)
                    for r in results[-len(arms):]:
                        log(f"  {r['arm']}: {r['tokens_per_s']:.1f} tok/s, TTFT p50 {1e3 * r['ttft_s']['p50']:.0f} ms"
                            f", {r['wall_s']:.1f} s" + ("" if r["same_answers"] is None else
                                                      f", {r['same_answers']}/{r['requests']} answers as "
                                                      f"{methods[0]}'s"))
    plot(report, out / "serve_bench.png")
    log((out / "serve_bench.md").read_text())
    return report


def _write(out: Path, report: dict, replicas: bool) -> dict:
    """serve_bench.json and .md of the results so far (after each load: a run cut short keeps what it measured)."""
    (out / "serve_bench.json").write_text(json.dumps(report, indent=2))
    (out / "serve_bench.md").write_text("\n".join(_table(report, replicas)) + "\n")
    return report


def _llama_server(engines: Path, path: Path, slots: int, threads: int | None, out: Path):
    """llama-server over the GGUF file the target came from: `slots` slots (-np) of the engines' positions each,
    continuous batching (its default), the chat template of the file (--jinja), /metrics on."""
    from specrt.engines.base import default_threads
    from specrt.engines.manifest import read_manifest
    from specrt.measurement.bench import LLAMA_ENV
    from specrt.measurement.llama_server import LlamaServer
    from specrt.measurement.llamacpp import gguf_file
    target = read_manifest(engines)["models"]["target"]
    return LlamaServer(gguf_file(target), slots * target["max_seq_len"], threads or default_threads(), path,
                       out / "llama-server.log", parallel=slots, extra=("--metrics", "--jinja"), env=LLAMA_ENV)


def _load(arms: dict, rounds: _Rounds, texts: list[str], kind: str, level: float, temperature: float,
          max_tokens: int, count: int | None) -> list[dict]:
    """One load (a concurrency or a rate) at one temperature, the arms in turns; a result for each arm."""
    size = int(level) if kind == "concurrency" else OPEN_TURN
    runs = {arm: {"wall": 0.0, "done": [], "rounds": Counter(), "decodes": (0.0, 0.0)} for arm in arms}
    for k in range(0, len(texts), size):
        chunk = list(range(k, min(k + size, len(texts))))
        at = [0.0] * len(chunk) if kind == "concurrency" else poisson_arrivals(len(chunk), level, seed=k)
        for arm, (url, extra) in arms.items():
            run = runs[arm]
            before = _llama_rows(url) if arm == LLAMA_CPP else None
            wall, done = _turn(url, [texts[i] for i in chunk], at, max_tokens, temperature, chunk, extra)
            run["wall"] += wall
            run["done"] += done
            if before:
                run["decodes"] = tuple(s + b - a for s, a, b in zip(run["decodes"], before, _llama_rows(url)))
            else:
                run["rounds"].update(rounds.turn((arm, temperature), done))
    first = runs[next(iter(arms))]
    results = []
    for arm, run in runs.items():
        done, batch = run["done"], dict(sorted(run["rounds"].items()))
        decodes, busy = run["decodes"]
        tokens = sum(d["tokens"] for d in done)
        results.append({
            **({} if count is None else {"replicas": count}), "arm": arm, "temperature": temperature, kind: level,
            "requests": len(done), "tokens": tokens, "wall_s": run["wall"], "tokens_per_s": tokens / run["wall"],
            "requests_per_s": len(done) / run["wall"], **latency_figures(done),
            "rows_per_round": sum(n * r for n, r in batch.items()) / sum(batch.values()) if batch else
            busy / decodes if decodes else None, "batch_rounds": batch or None,
            "same_answers": None if temperature > 0 or run is first else
            sum(a["text"] == b["text"] for a, b in zip(done, first["done"]))})
    for r in results:
        r["x_first_arm"] = r["tokens_per_s"] / results[0]["tokens_per_s"]
    return results


def _table(report: dict, replicas: bool) -> list[str]:
    arms = report["arms"]
    lines = [f"# Serving: {', '.join(arms)}; {report['requests']} requests of {report['max_tokens']} tokens a load "
             f"({report['prompts']} chat prompts), {report['threads']} threads", "",
             "Closed loop c: c requests sent at once, the next c when all have answered. Poisson: arrivals at that "
             f"rate in turns of {report['open_turn']} requests. The arms take turns at each load. Rows a round: the "
             "server's batch (llama.cpp: busy slots per llama_decode call, prefill's included). Same answers: "
             f"greedy answers identical to {arms[0]}'s.", "",
             f"{'| replicas ' if replicas else ''}| T | load | arm | tok/s | × {arms[0]} | req/s | TTFT p50 / p90 / "
             "p99 (ms) | ITL p50 / p99 (ms) | E2E p50 / p99 (s) | rows a round | same answers |",
             "|---" * (12 if replicas else 11) + "|"]
    for r in report["results"]:
        ttft, itl, e2e = r["ttft_s"], r["itl_s"], r["e2e_s"]
        load = f"c = {r['concurrency']}" if "concurrency" in r else f"{r['rate']:g}/s"
        lines.append(
            f"{'| %s ' % r['replicas'] if replicas else ''}| {r['temperature']:g} | {load} | {r['arm']} | "
            f"{r['tokens_per_s']:.1f} | {r['x_first_arm']:.2f} | {r['requests_per_s']:.2f} | "
            f"{1e3 * ttft['p50']:.0f} / {1e3 * ttft['p90']:.0f} / {1e3 * ttft['p99']:.0f} | "
            + (f"{1e3 * itl['p50']:.0f} / {1e3 * itl['p99']:.0f}" if itl else "-") +
            f" | {e2e['p50']:.1f} / {e2e['p99']:.1f} | "
            + (f"{r['rows_per_round']:.1f}" if r["rows_per_round"] else "-") +
            f" | {'-' if r['same_answers'] is None else '%d/%d' % (r['same_answers'], r['requests'])} |")
    return lines


def plot(report: dict, path: Path) -> None:
    """Output tokens/s, time to first token and inter-token latency (p50 solid, p99 dashed) against the load, a
    column for each temperature and kind of load, a line for each arm (and replica count)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = report["results"]
    cols = [(t, k) for t in sorted({r["temperature"] for r in results}) for k in ("concurrency", "rate")
            if any(k in r and r["temperature"] == t for r in results)]
    fig, axes = plt.subplots(3, len(cols), figsize=(3.4 * len(cols), 7.5), squeeze=False)
    names = list(dict.fromkeys((r.get("replicas"), r["arm"]) for r in results))
    for j, (t, kind) in enumerate(cols):
        for replicas, arm in names:
            rs = [r for r in results if (r.get("replicas"), r["arm"]) == (replicas, arm) and r["temperature"] == t
                  and kind in r]
            x = [r[kind] for r in rs]
            label = arm if replicas is None else f"{arm}, {replicas} replicas"
            line, = axes[0][j].plot(x, [r["tokens_per_s"] for r in rs], marker="o", label=label)
            for row, key in ((1, "ttft_s"), (2, "itl_s")):
                for q, style in (("p50", "-"), ("p99", "--")):
                    axes[row][j].plot(x, [1e3 * r[key][q] if r[key] else float("nan") for r in rs], style,
                                      marker=".", color=line.get_color())
        axes[0][j].set_title(f"T = {t:g}, {'closed loop' if kind == 'concurrency' else 'Poisson arrivals'}",
                             fontsize=9)
        axes[2][j].set_xlabel("concurrent requests" if kind == "concurrency" else "requests a second")
        for row in range(3):
            if kind == "concurrency":
                axes[row][j].set_xscale("log", base=2)
                axes[row][j].xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            if row:
                axes[row][j].set_yscale("log")
            axes[row][j].grid(alpha=0.3)
    for row, label in enumerate(("output tokens / s", "TTFT (ms): p50 —, p99 --", "ITL (ms): p50 —, p99 --")):
        axes[row][0].set_ylabel(label)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


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
