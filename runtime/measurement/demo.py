"""`specrt demo ENGINES`: a task of the kind users run, decoded greedily by the target alone and by `--method auto`
in one process, runs alternating; both texts (identical, or the demo fails), both speeds and their ratio."""
from __future__ import annotations

import time
from dataclasses import dataclass

from specrt.decoding.generate import AUTO, Generator

# written for this demo (a made-up town and library: nothing for the model to have memorised)
PASSAGE = """\
The town council of Millbrook voted on Tuesday to approve a two-year renovation of the Harwell Street Library, \
the town's oldest public building. The library opened in 1911 with money raised by the local weavers' union, and \
its reading room still has the original oak shelves and a stained-glass window showing the river that runs \
through the town. Over the past decade, however, the building has struggled. The roof leaks in heavy rain, the \
heating system fails most winters, and the upper floor has been closed since 2019 because it has no lift and \
cannot be reached by visitors who use wheelchairs.

The approved plan will cost 4.2 million pounds. About half of the money comes from a national heritage grant, a \
third from the town's own budget, and the rest from a public fundraising campaign that has already collected \
more than 600,000 pounds from residents and local businesses. The work will replace the roof, install a lift and \
a new heating system that uses heat pumps, and turn the closed upper floor into a study area with forty desks and \
a room for children's reading groups. The oak shelves and the stained-glass window will be restored and kept in \
place.

During the renovation, the library will move to a temporary home in the former post office on Market Square, \
which will offer a smaller collection, computers and the weekly homework club. The mobile library van will also \
visit the three outlying villages twice a week instead of once.

Not everyone supported the decision. Two councillors argued that the money would be better spent on a new building \
at the edge of town, where parking is easier and the land is cheaper. Supporters replied that the Harwell Street \
site is within walking distance of both secondary schools and the main bus station, and that a historic building \
in the centre of town is worth keeping. The head librarian, Ruth Okafor, said she was delighted: "People have \
waited a long time for this. When we reopen, everyone will be able to use the whole building for the first time \
in years." Work is expected to begin in March, and the library should reopen in the spring of the following year.\
"""
TASK = "Summarise the following news article in three sentences.\n\n" + PASSAGE


@dataclass
class Run:
    method: str              # the method that ran (auto: the one it chose)
    tokens: list[int]
    text: str
    seconds: float
    tokens_per_round: float | None


def demo(engines: str, max_new_tokens: int = 96, repeats: int = 2, device: str = "auto",
         threads: int | None = None, echo=print) -> bool:
    """Prints the task, each run, the text and the measured speeds; returns whether the texts were identical."""
    gen = Generator.from_engines(engines, device=device, threads=threads)
    prompt = gen.encode(TASK)
    chosen, source = gen.method_for(AUTO, greedy=True)
    how = "this machine's tuning" if source == "tuning" else f"the rule, no tuning: {gen.untuned}"
    echo(f"task: a summary (three sentences) of a {len(prompt)}-token news article written for this demo; greedy, "
         f"up to {max_new_tokens} new tokens; {gen.target.spec.get('source', 'target')} on {gen.target.device}")
    echo(f"auto runs {chosen} ({how})")
    for method in ("autoregressive", AUTO):   # warm-up: engine sessions, a drafter's first load
        gen.generate(prompt_ids=prompt, max_new_tokens=8, method=method)
    runs: dict[str, list[Run]] = {"autoregressive": [], AUTO: []}
    for i in range(repeats):
        for method in ("autoregressive", AUTO) if i % 2 == 0 else (AUTO, "autoregressive"):
            began = time.perf_counter()
            out = gen.generate(prompt_ids=prompt, max_new_tokens=max_new_tokens, method=method)
            run = Run(out.stats["method"], out.token_ids[0], out.text[0] if out.text else "",
                      time.perf_counter() - began, out.stats["mean_tokens_per_round"])
            runs[method].append(run)
            per_round = f", {run.tokens_per_round:.2f} tokens/round" if method == AUTO else ""
            echo(f"  run {i + 1} {method if method != AUTO else f'auto ({run.method})'}: {len(run.tokens)} tokens "
                 f"in {run.seconds:.2f} s, {len(run.tokens) / run.seconds:.1f} tokens/s{per_round}")
    plain, spec = runs["autoregressive"][0], runs[AUTO][0]
    same = all(r.tokens == plain.tokens for r in runs["autoregressive"] + runs[AUTO])
    echo(f"\n--- the summary ({len(plain.tokens)} tokens; autoregressive and auto "
         f"{'identical' if same else 'DIFFERENT'}) ---\n{plain.text.strip()}\n")
    if not same:
        first = next(i for i, (a, b) in enumerate(zip(plain.tokens + [None], spec.tokens + [None])) if a != b)
        echo(f"--- auto's text (differs from token {first} on) ---\n{spec.text.strip()}\n")
    speed = {m: sum(len(r.tokens) for r in rs) / sum(r.seconds for r in rs) for m, rs in runs.items()}
    echo(f"autoregressive {speed['autoregressive']:.1f} tokens/s, auto ({spec.method}) {speed[AUTO]:.1f} tokens/s: "
         f"{speed[AUTO] / speed['autoregressive']:.2f}x ({repeats} run{'s' * (repeats > 1)} each, alternating, in one "
         "process; the times include the prompt's prefill)")
    return same
