"""The self drafter in the target's own session (specrt.export.self_spec.skip_graph) against the target alone:
the resident memory of each, loaded in a fresh process, and the pass times side by side in one process.

    python -m specrt.measurement.layer_skip ENGINES --plain PLAIN_ENGINES

ENGINES: a set exported with --self-layers and built (its target engine has the skip_layers input); PLAIN_ENGINES:
a set of the same target without it (the passes it must not be slower than). The times interleave the three kinds
of pass round by round, so that the load of a shared machine falls on each alike.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys


def _resident(directory: str, with_self: bool) -> int:
    """This process's resident bytes after loading the engine set's target (and the self drafter) and a pass each."""
    from specrt.decoding.generate import Generator
    from specrt.measurement.rss import rss_bytes
    before = rss_bytes(settled=True)
    gen = Generator.from_engines(directory, warm=False)
    engines = [gen.target, gen.self_draft] if with_self else [gen.target]
    for engine in engines:
        engine.time_pass(64, 4, reps=1)
    return rss_bytes(settled=True) - before


def resident_mb(directory: str, with_self: bool) -> float:
    out = subprocess.run([sys.executable, "-m", "specrt.measurement.layer_skip", directory, "--resident", str(int(with_self))],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])["bytes"] / 2 ** 20


def pass_times(directory: str, plain: str, reps: int, context: int = 256) -> dict:
    """Median and best milliseconds of a pass over 1 and 5 tokens: the plain target, the target of `directory`
    (skip_layers all false) and its self drafter (its skipped layers true), interleaved."""
    from specrt.decoding.generate import Generator
    gens = {"plain target": Generator.from_engines(plain, warm=False),
            "target, skip input": Generator.from_engines(directory, warm=False)}
    engines = {name: g.target for name, g in gens.items()} | {"self drafter": gens["target, skip input"].self_draft}
    out = {}
    for k in (1, 5):
        seconds = {name: [] for name in engines}
        for _ in range(reps):
            for name, engine in engines.items():
                seconds[name].append(engine.time_pass(context, k, reps=1))
        out[k] = {name: (statistics.median(s) * 1e3, min(s) * 1e3) for name, s in seconds.items()}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engines")
    ap.add_argument("--plain", help="an engine set of the same target without the self drafter")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--resident", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.resident is not None:
        print(json.dumps({"bytes": _resident(args.engines, bool(int(args.resident)))}))
        return
    if args.plain is None:
        ap.error("--plain PLAIN_ENGINES: the same target's engine set without --self-layers, to compare against")
    print("resident MB after loading and a pass (each in a fresh process):")
    print(f"  plain target alone ({args.plain}): {resident_mb(args.plain, False):.0f}")
    print(f"  target with the skip input, alone: {resident_mb(args.engines, False):.0f}")
    print(f"  the same with its self drafter in use: {resident_mb(args.engines, True):.0f}")
    for k, rows in pass_times(args.engines, args.plain, args.reps).items():
        print(f"pass over {k} token(s), median / best of {args.reps} interleaved, ms:")
        for name, (median, best) in rows.items():
            print(f"  {name}: {median:.1f} / {best:.1f}")


if __name__ == "__main__":
    main()
