"""The engine set's tuning for this machine: the method `auto` runs, and what lets a new process start warm.

`specrt tune ENGINES` (specrt.measurement.tune) measures each method the set can run on calibration prompts and
writes `tuning.json` beside the engines, recorded with its hash in the manifest like the trees: per temperature
regime (greedy, sampled), without and with a grammar, the fastest method, and the figures a process would otherwise
measure again or learn in its first requests: the target's pass times by batch size and width, the draft model's
step, the EAGLE drafter's pass over a tree level, the layers the self drafter keeps, and what the tuning's last
request of each method left its adaptive policies (a chain's acceptance, a tree's tokens and seconds per round,
EAGLE's calibration and prompt lookup's rates). A Generator starts from those as the next request of a warm
process would. A tuning belongs to the engines and the machine it measured: for other engines (a rebuild changes
their hashes), another CPU or device, or another thread count it is ignored, and `auto` follows `rule`.
"""
from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specrt.engines.base import default_threads
from specrt.engines.manifest import check_file, file_entry, read_manifest, write_manifest
from specrt.errors import ManifestError

AUTO = "auto"
FILE = "tuning.json"
FORMAT = 1
REGIMES = ("greedy", "sampled")
GRAMMAR = "+grammar"   # a regime's requests with a grammar (structured output): "greedy+grammar", "sampled+grammar"


def regime(greedy: bool, constrained: bool = False) -> str:
    """The key of a request's regime in a tuning's `methods` and `speeds`."""
    return ("greedy" if greedy else "sampled") + (GRAMMAR if constrained else "")


@dataclass
class Tuning:
    machine: dict                       # where it was measured (see machine())
    engines: dict[str, str]             # role -> sha256 of the engine measured
    methods: dict[str, str]             # regime (and regime+grammar, see regime()) -> the method `auto` runs
    speeds: dict[str, dict[str, float]]  # the same keys -> method -> tokens/s measured
    passes: dict[int, dict[int, float]]  # batch size -> width -> seconds of a target pass
    draft_step: float = 0.0             # seconds of a draft-model step (0: none measured)
    self_step: float = 0.0              # seconds of a self drafter's step, on self_layers (0: none measured)
    eagle_level: dict = field(default_factory=dict)   # {"top_k": k, "seconds": {batch: s}}: a level over 2k nodes
    gamma: dict[str, dict[str, float]] = field(default_factory=dict)   # regime -> chain method -> acceptance
    trees: dict[str, dict[str, dict]] = field(default_factory=dict)    # regime -> tree method -> TreePolicy sums
    eagle: dict[str, dict] = field(default_factory=dict)               # regime -> eagle.Figures (to_json)
    acceptance: dict[str, dict[str, list]] = field(default_factory=dict)  # regime -> method -> per draft position
    self_layers: list[int] = field(default_factory=list)   # the layers the self drafter keeps (tune's choice)
    self_search: list[dict] = field(default_factory=list)  # the sets tune measured for it (measurement.tune)
    measured: str = ""                  # when (UTC, ISO 8601)

    def to_json(self) -> dict:
        data = asdict(self)
        data["passes"] = {str(b): {str(k): t for k, t in v.items()} for b, v in self.passes.items()}
        if self.eagle_level:
            data["eagle_level"] = {"top_k": self.eagle_level["top_k"],
                                   "seconds": {str(b): t for b, t in self.eagle_level["seconds"].items()}}
        return {"format": FORMAT, **data}

    @classmethod
    def from_json(cls, data: dict) -> "Tuning":
        data = {k: v for k, v in data.items() if k != "format"}
        data["passes"] = {int(b): {int(k): float(t) for k, t in v.items()} for b, v in data["passes"].items()}
        level = data.get("eagle_level") or {}
        if level:
            data["eagle_level"] = {"top_k": int(level["top_k"]),
                                   "seconds": {int(b): float(t) for b, t in level["seconds"].items()}}
        return cls(**data)


def rule(gen) -> str:
    """`auto` without a tuning: what was fastest on the machines measured so far (the README's "which method":
    2-core CPUs, MT-Bench prompts). EAGLE where the set has its drafter and the target verifies trees; prompt lookup
    on targets with int8 activations (int4/int8 weights), whose cheap passes the drafters' own passes do not pay
    for; else the draft model (of the target's vocabulary or another's); else prompt lookup, which needs no drafter.
    Never the self drafter: untrained, it ran level with autoregressive decoding at best (SmolLM2-135M, Gemma 3
    270M: docs/notes/2026-12-self-speculation.md) where prompt lookup gained 3-69 %; a tuning measures it."""
    if gen.chains_only:
        return "ngram"
    if gen.has("eagle") or gen.has("mtp"):   # the feature drafter: trained for EAGLE, or the target's MTP module
        return "eagle" if gen.has("eagle") else "mtp"
    return "draft" if gen.has("draft") else "ngram"


def machine(device: str, threads: int | None) -> dict:
    """What a tuning's timings depend on besides the engines: the processor, its cores, the device, the engine
    threads (None: the default, all the cores this process may use)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    about = {"cpu": cpu, "cores": os.cpu_count(), "device": device, "threads": threads or default_threads()}
    if device.startswith("cuda"):
        import torch
        about["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return about


def engine_hashes(manifest: dict) -> dict[str, str]:
    return {role: spec["engine"]["sha256"] for role, spec in manifest["models"].items() if "engine" in spec}


def load(directory: Path, manifest: dict, here: dict) -> tuple[Tuning | None, str]:
    """The engine set's tuning if it is for these engines on this machine (`here`, see machine()), else None; and
    why not."""
    entry = manifest.get("tuning")
    if entry is None:
        return None, f"{directory} is not tuned (run `specrt tune {directory}`)"
    path = check_file(directory, entry, "tuning")
    try:
        tuning = Tuning.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"{path} is not a tuning this specrt reads ({e}): run `specrt tune {directory}` "
                            "again") from e
    if tuning.engines != engine_hashes(manifest):
        return None, f"the tuning in {directory} measured other engines (rebuilt since): run `specrt tune` again"
    if tuning.machine != here:
        return None, (f"the tuning in {directory} measured another machine or thread count ({tuning.machine}, "
                      f"here {here}): run `specrt tune` again")
    return tuning, ""


def save(directory: Path, tuning: Tuning) -> Path:
    """Write the tuning beside the engines (atomically) and record it, with its hash, in the manifest."""
    directory = Path(directory)
    tmp = directory / (FILE + ".tmp")
    tmp.write_text(json.dumps(tuning.to_json(), indent=1) + "\n")
    os.replace(tmp, directory / FILE)
    manifest = read_manifest(directory)
    manifest["tuning"] = file_entry(directory, FILE)
    write_manifest(directory, manifest)
    return directory / FILE
