"""Multi-turn chats against two replicas, with and without prefix-aware routing, in one run:
`python -m specrt.measurement.replica_chat ENGINES --out DIR`.

Two servers run at once, `specrt serve ENGINES --replicas 2 --threads 1` with `--prefix-routing` and with
`--no-prefix-routing` (each its own local Ray instance and the default prefix cache in every replica). `--chats`
MT-Bench conversations, each carried on to `--turns` turns (its two questions, then bench.FOLLOW_UPS); each turn
sends the chat so far (every earlier user message and answer) and the new user message. Turn by turn, the chats'
requests go all at once (streamed, greedy) to one server, then to the other (the order alternating from turn to
turn), so both arms see the same load. Per request: time to first token, the prompt tokens that came from the
replica's prefix cache (usage.prompt_tokens_details.cached_tokens), the replica that answered; each arm's chat goes
on with its own answers, and the answers of the two arms are compared.
"""
from __future__ import annotations

import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

import click

from specrt.errors import InputError
from specrt.measurement.bench import FOLLOW_UPS, MT_BENCH
from specrt.measurement.serve_bench import server, stream_request
from specrt.serving.replicas import REPLICA_HEADER

ARMS = ("prefix routing", "Serve's default")
FLAGS = {"prefix routing": "--prefix-routing", "Serve's default": "--no-prefix-routing"}


def chat_request(url: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat completion: its answer, time to first token, cached and all prompt tokens, and the
    replica that answered."""
    r = stream_request(url, messages, max_tokens, extra={"stream_options": {"include_usage": True}})
    usage = r["usage"]
    return {"answer": r["text"], "ttft_s": r["first"] - r["start"], "replica": r["headers"][REPLICA_HEADER],
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def run(engines: Path, chats: int, turns: int, max_tokens: int, method: str, out: Path, log=print) -> dict:
    """The chats against both servers (module doc); replica_chat.json and .md in `out`."""
    rows = [json.loads(r) for r in resources.files("specrt").joinpath(f"data/{MT_BENCH}").read_text().splitlines()]
    if not 1 <= chats <= len(rows) or not 1 <= turns <= 2 + len(FOLLOW_UPS):
        raise InputError(f"--chats {chats}, --turns {turns}: at most {len(rows)} chats of at most "
                         f"{2 + len(FOLLOW_UPS)} turns (MT-Bench's two and the follow-ups)")
    users = [(list(row["turns"]) + list(FOLLOW_UPS))[:turns] for row in rows[:chats]]
    out.mkdir(parents=True, exist_ok=True)
    history = {arm: [[] for _ in users] for arm in ARMS}
    results = {arm: [] for arm in ARMS}   # per turn, per chat
    with ExitStack() as stack:
        urls = {arm: stack.enter_context(server(
            engines, out / f"server-{FLAGS[arm][2:]}.log", "--replicas", "2", "--threads", "1", "--method", method,
            FLAGS[arm]))[0] for arm in ARMS}
        for url in urls.values():
            chat_request(url, [{"role": "user", "content": "Say hello."}], 8)   # warm-up: first passes, costs
        with ThreadPoolExecutor(len(users)) as pool:
            for t in range(turns):
                for arm in (ARMS if t % 2 == 0 else ARMS[::-1]):
                    for chat, user in zip(history[arm], users):
                        chat.append({"role": "user", "content": user[t]})
                    done = list(pool.map(lambda chat: chat_request(urls[arm], chat, max_tokens), history[arm]))
                    for chat, d in zip(history[arm], done):
                        chat.append({"role": "assistant", "content": d["answer"]})
                    results[arm].append(done)
                    log(f"turn {t + 1}, {arm}: cached {[d['cached_tokens'] for d in done]} of "
                        f"{[d['prompt_tokens'] for d in done]}, first token "
                        f"{[round(d['ttft_s'], 2) for d in done]} s")
    report = {"engines": str(engines), "method": method, "chats": chats, "turns": turns, "max_tokens": max_tokens,
              "turn_rows": [_turn_row(t, {arm: results[arm][t] for arm in ARMS},
                                      {arm: [results[arm][t - 1][c]["replica"] if t else None
                                             for c in range(chats)] for arm in ARMS}) for t in range(turns)]}
    report["answers_identical"] = sum(a["answer"] == b["answer"] for turn in zip(*results.values())
                                      for a, b in zip(*turn))
    report["answers"] = chats * turns
    (out / "replica_chat.json").write_text(json.dumps({**report, "results": results}, indent=1))
    lines = table(report)
    (out / "replica_chat.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return report


def _turn_row(t: int, done: dict, before: dict) -> dict:
    """One turn's figures of both arms: mean prompt and cached tokens, time to first token, and how many chats the
    replica of their previous turn answered."""
    row = {"turn": t + 1, "prompt_tokens": statistics.mean(d["prompt_tokens"] for d in done[ARMS[0]])}
    for arm, key in zip(ARMS, ("on", "off")):
        row[f"cached_{key}"] = statistics.mean(d["cached_tokens"] for d in done[arm])
        row[f"ttft_{key}_s"] = statistics.mean(d["ttft_s"] for d in done[arm])
        row[f"same_replica_{key}"] = sum(d["replica"] == r for d, r in zip(done[arm], before[arm]))
    return row


def table(report: dict) -> list[str]:
    chats = report["chats"]
    lines = [f"# {chats} chats of {report['turns']} turns against 2 replicas, prefix routing on and off "
             f"({report['method']}, {report['max_tokens']} tokens an answer, greedy)", "",
             "| turn | prompt tokens | cached on | cached off | first token on (s) | off (s) | off / on | "
             "same replica as the last turn on | off |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["turn_rows"]:
        same = "— | —" if r["turn"] == 1 else f"{r['same_replica_on']}/{chats} | {r['same_replica_off']}/{chats}"
        lines.append(f"| {r['turn']} | {r['prompt_tokens']:.0f} | {r['cached_on']:.0f} | {r['cached_off']:.0f} | "
                     f"{r['ttft_on_s']:.2f} | {r['ttft_off_s']:.2f} | {r['ttft_off_s'] / r['ttft_on_s']:.2f}× | "
                     f"{same} |")
    lines += ["", f"Answers identical in both arms: {report['answers_identical']} of {report['answers']}."]
    return lines


@click.command()
@click.argument("engines", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--chats", default=4, show_default=True, help="MT-Bench conversations, sent at once each turn.")
@click.option("--turns", default=4, show_default=True)
@click.option("--max-tokens", default=48, show_default=True)
@click.option("--method", default="auto", show_default=True, help="The servers' --method.")
@click.option("--out", default="replica-chat-out", show_default=True, type=click.Path(file_okay=False, path_type=Path))
def main(engines, chats, turns, max_tokens, method, out):
    """Chats against 2 replicas with and without prefix-aware routing, side by side (module doc)."""
    try:
        run(engines, chats, turns, max_tokens, method, out, log=lambda line: click.echo(line, err=True))
    except InputError as e:
        raise click.ClickException(str(e)) from e


if __name__ == "__main__":
    main(sys.argv[1:], prog_name="python -m specrt.measurement.replica_chat")
