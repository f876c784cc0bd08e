"""`specrt train KIND --target SOURCE --out DIR`: a drafter for any target `specrt export` accepts, by
self-distillation.

`KINDS` is the table of what can be trained: each kind names its trainer module (a settings dataclass and a
`train` function that is resumable in its work directory and writes its output directory) and the settings it
sizes by the target. A run
  1. checks its input (the target, the device, the options, the data) before it writes anything;
  2. makes the data, unless --data names a directory made before (`specrt train data`): the target answers the
     seed tasks, its template and varied prompts and requests it writes itself, keeping its top-16 logits as the
     labels (`data.py`; resumable), in WORK/data;
  3. runs the kind's trainer: features (Medusa, EAGLE), then training with checkpoints in WORK (a rerun resumes);
  4. writes the result and its model card (README.md) into a staging directory beside OUT, then moves them into
     OUT (the files of that name are replaced, others stay).
Trainer flags map to the trainer dataclass's fields of the same names; a new kind is a row of `KINDS` (see `Kind`)
and takes every flag its dataclass has a field for.
"""
from __future__ import annotations

import datetime
import importlib
import json
import math
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

from specrt.errors import DeviceError, InputError


@dataclass
class Target:
    """What the settings are sized by."""
    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    parameters: int
    eos_token_ids: list[int]


def kept_ids(t: Target) -> int:
    """Output ids a drafter keeps: all of a small vocabulary, else the 12,288 most frequent (at least 1/8)."""
    return 0 if t.vocab_size <= 16384 else max(12288, t.vocab_size // 8)


def draft_layers(t: Target) -> str:
    """The draft model: the target's first tenth of layers (3 of SmolLM2-135M's 30), at least one."""
    return ",".join(map(str, range(max(1, round(t.num_layers / 10)))))


def data_batch(t: Target) -> int:
    """Answers per generation call: 128 up to ~200 M parameters, fewer for larger targets (memory), at least 8."""
    return int(min(128, max(8, 2 ** round(math.log2(128 * 2e8 / t.parameters)))))


@dataclass(frozen=True)
class Kind:
    """A row of `KINDS`. Its trainer is a module of specrt.export.train with a settings dataclass (the fields of
    `COMMON`, and those of the trainer flags it takes, by the same names) and `train(settings)`: resumable in
    settings.work, writing settings.out with its weights and a training.json (steps_done, sessions: each call's
    first and last step, history: the evaluations, train_loss, val_rows)."""
    produces: str                       # what OUT holds, for --help and the model card
    export_option: str                  # the `specrt export` option that takes OUT ("": none)
    module: str                         # the trainer's module
    config: str                         # its settings dataclass
    defaults: dict = field(default_factory=dict)      # settings where they differ from the dataclass's defaults
    sized: Callable[[Target], dict] = lambda t: {}    # settings sized by the target

    def settings_class(self):
        return getattr(importlib.import_module(f"specrt.export.train.{self.module}"), self.config)

    def train(self, settings) -> None:
        importlib.import_module(f"specrt.export.train.{self.module}").train(settings)


# The defaults are the Makefile's SmolLM2 recipes (the shipped drafters' settings).
KINDS = {
    "data": Kind("the self-distillation data alone (data.jsonl, the target's top-16 labels in data.teacher/, "
                 "self_prompts.jsonl, data.json), for the other kinds' --data", "", "data", "DataConfig"),
    "draft": Kind("a small draft model of the target's own architecture, initialised from its first layers "
                  "(config.json, model.safetensors, specrt_vocab.json: the output ids it keeps)", "--draft",
                  "train_draft", "TrainConfig",
                  dict(steps=800, batch_tokens=8192, lr=1e-3, warmup=20, weight_decay=0.05, eval_every=40,
                       save_every=20),
                  lambda t: {"layers": draft_layers(t), "kept_vocab": kept_ids(t)}),
    "medusa": Kind("Medusa heads on the target's last hidden state (medusa_config.json, medusa_heads.safetensors, "
                   "specrt_vocab.json where ids are kept)", "--medusa", "train_medusa", "MedusaConfig",
                   dict(epochs=1, max_positions=400000, batch=256, lr=1e-3), lambda t: {"kept_vocab": kept_ids(t)}),
    "eagle": Kind("an EAGLE drafter: one decoder layer of the target's shape over its features "
                  "(eagle_config.json, eagle.safetensors, specrt_vocab.json where ids are kept)", "--eagle",
                  "train_eagle", "EagleTrainConfig", dict(vocab=""), lambda t: {"kept_vocab": kept_ids(t)}),
    "eagle3": Kind("an EAGLE-3 drafter: one decoder layer over [embedding; fc(the hidden states entering three target "
                   "layers)] with its own LM head over a reduced draft vocabulary (config.json, model.safetensors: "
                   "the published layout)", "--eagle", "train_eagle3", "Eagle3TrainConfig",
                   dict(steps=1000, batch_tokens=4096, lr=3e-4, warmup=30, save_every=50),
                   lambda t: {"kept_vocab": kept_ids(t)}),
}

# The settings `specrt train` gives every trainer (those its dataclass has).
COMMON = ("data", "target", "work", "out", "device", "threads", "max_minutes", "feature_minutes", "seed")


@dataclass
class TrainOptions:
    """`specrt train`'s flags, one to one. None: the kind's default (some sized by the target)."""
    target: str
    out: str
    work: str | None = None        # checkpoints, features and (without --data) the data; default OUT.work
    data: str | None = None        # a data directory made before (`specrt train data`)
    device: str = "cpu"
    threads: int | None = None     # default: torch's (all cores)
    max_minutes: float = 0.0       # each phase's budget in this call: data, features, training (0: none)
    seed: int = 0
    dry_run: bool = False
    # the data, where the run makes it
    data_batch: int | None = None
    data_calls: int | None = None
    max_new_tokens: int | None = None
    num_template: int | None = None
    # training
    steps: int | None = None
    epochs: int | None = None
    lr: float | None = None
    warmup: int | None = None
    weight_decay: float | None = None
    batch_tokens: int | None = None
    layers: str | None = None
    heads: int | None = None
    kept_vocab: int | None = None
    vocab_from: str | None = None
    max_positions: int | None = None
    eval_every: int | None = None
    save_every: int | None = None
    init: str | None = None


DATA_OPTIONS = {"data_batch": "batch", "data_calls": "calls", "max_new_tokens": "max_new_tokens",
                "num_template": "num_template"}          # flag -> DataConfig field
TRAINER_OPTIONS = {"steps": "steps", "epochs": "epochs", "lr": "lr", "warmup": "warmup", "weight_decay": "weight_decay",
                   "batch_tokens": "batch_tokens", "layers": "layers", "heads": "heads", "kept_vocab": "kept_vocab",
                   "vocab_from": "vocab", "max_positions": "max_positions", "eval_every": "eval_every",
                   "save_every": "save_every", "init": "init"}   # flag -> trainer field


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class Plan:
    """A run, resolved: where everything goes and every setting."""
    kind: str
    target: Target
    out: Path
    work: Path | None
    data_dir: Path
    data: object | None            # DataConfig: the data this run makes (None: --data)
    settings: object | None        # the trainer's dataclass (None: the data kind)

    def summary(self) -> dict:
        return {"kind": self.kind, "target": asdict(self.target), "out": str(self.out),
                "work": str(self.work) if self.work else None, "data_dir": str(self.data_dir),
                "data": asdict(self.data) if self.data else None,
                "settings": asdict(self.settings) if self.settings else None}


def plan(kind: str, o: TrainOptions) -> Plan:
    """Checks the input and resolves every setting; writes nothing."""
    import torch

    from specrt.export.train.data import DATA_FILE, check_data_dir
    if kind not in KINDS:
        raise InputError(f"unknown kind {kind!r}: expected one of {', '.join(KINDS)}")
    if o.device == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"--device cuda: torch {torch.__version__} sees no CUDA device here; train with "
                          "--device cpu, or on a machine with an NVIDIA GPU and a CUDA build of torch")
    if o.device not in ("cpu", "cuda"):
        raise InputError(f"--device {o.device}: expected cpu or cuda")
    target = probe(o.target)
    out = Path(o.out)
    check_out(out, DATA_FILE if kind == "data" else "training.json")
    given = {k: getattr(o, k) for k in (*DATA_OPTIONS, *TRAINER_OPTIONS) if getattr(o, k) is not None}
    if kind == "data":
        wrong = [k for k in given if k not in DATA_OPTIONS] + [k for k in ("work", "data") if getattr(o, k)]
        if wrong:
            raise InputError(f"{', '.join(map(flag, wrong))}: not options of `specrt train data` (it takes the "
                             f"data options {', '.join(map(flag, DATA_OPTIONS))})")
        return Plan(kind, target, out, None, out, data_config(o, target, out), None)
    work = Path(o.work) if o.work else out.with_name(out.name + ".work")
    settings = trainer_settings(kind, o, target, given)
    if not o.data:
        data_dir = work / "data"
        return Plan(kind, target, out, work, data_dir, data_config(o, target, data_dir), settings(work, data_dir))
    data_dir = Path(o.data)
    if given.keys() & DATA_OPTIONS.keys():
        raise InputError(f"{', '.join(flag(k) for k in given if k in DATA_OPTIONS)}: the data of --data {o.data} is "
                         "made already; these options apply where the run makes its data")
    if not (data_dir / DATA_FILE).is_file() and not o.dry_run:   # a dry run shows the settings before
        raise InputError(f"--data {data_dir}: holds no {DATA_FILE}; make it with `specrt train data --target "
                         f"{o.target} --out {data_dir}`, or leave --data out to make the data in --work")
    check_data_dir(data_dir, o.target, target.vocab_size)
    return Plan(kind, target, out, work, data_dir, None, settings(work, data_dir))


def trainer_settings(kind: str, o: TrainOptions, target: Target, given: dict) -> Callable:
    """(work, data directory) -> the kind's trainer settings: its dataclass's defaults, the recipe's, those sized
    by the target, then the flags given; the flags it has no field for are refused."""
    import torch

    from specrt.export.train.data import DATA_FILE
    cls = KINDS[kind].settings_class()
    own = {f.name for f in fields(cls)}
    wrong = [k for k in given if k in TRAINER_OPTIONS and TRAINER_OPTIONS[k] not in own]
    if wrong:
        raise InputError(f"{', '.join(map(flag, wrong))}: not options of `specrt train {kind}` (its options: "
                         f"{', '.join(flag(k) for k, v in TRAINER_OPTIONS.items() if v in own)})")
    values = {**KINDS[kind].defaults, **KINDS[kind].sized(target),
              **{TRAINER_OPTIONS[k]: v for k, v in given.items() if k in TRAINER_OPTIONS}}
    if isinstance(values.get("layers"), str):   # draft: the target's layer ids; eagle: a count
        ids = parse_ids(values["layers"])
        if not isinstance(cls.__dataclass_fields__["layers"].default, tuple):
            if len(ids) != 1:
                raise InputError(f"--layers {values['layers']}: `specrt train {kind}` takes a number of layers")
            ids = ids[0]
        elif not ids or not all(0 <= i < target.num_layers for i in ids):
            raise InputError(f"--layers {values['layers']}: the target has layers 0 to {target.num_layers - 1}; "
                             "name at least one of them")
        values["layers"] = ids
    values.update(target=o.target, out=str(staging(Path(o.out))), device=o.device, seed=o.seed,
                  threads=o.threads or torch.get_num_threads(), max_minutes=o.max_minutes,
                  feature_minutes=o.max_minutes)   # the features' pass: the same budget as the training's

    def settings(work: Path, data_dir: Path):
        return cls(**{k: v for k, v in {**values, "work": str(work), "data": str(data_dir / DATA_FILE)}.items()
                      if k in own})
    return settings


def check_out(out: Path, mark: str) -> None:
    """OUT must be new, empty, or what an earlier run wrote (it holds `mark`): never a model's own directory."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: exists and is not a directory; name a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / mark).is_file():
        raise InputError(f"--out {out}: a directory that holds other files (no {mark}, so not written by "
                         "`specrt train`); name a new or empty directory")


def data_config(o: TrainOptions, target: Target, directory: Path):
    from specrt.export.train.data import DataConfig
    given = {DATA_OPTIONS[k]: getattr(o, k) for k in DATA_OPTIONS if getattr(o, k) is not None}
    return DataConfig(**{"batch": data_batch(target), **given, "target": o.target, "out": str(directory),
                         "seed": o.seed, "device": o.device, "max_minutes": o.max_minutes})


def parse_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"--layers {text}: expected integers, comma-separated, like 0,1,2") from None


def probe(name: str) -> Target:
    """The target's shape, from its configuration (weights not read); refuses what is not a model source, or a
    model without a tokenizer (the training prompts are text)."""
    from specrt.export.sources import source_info
    info = source_info(name)
    c = info.config
    if info.tokenizer is None:
        raise InputError(f"--target {name}: has no tokenizer, and the training prompts are text; put the "
                         "tokenizer's files (tokenizer.json, tokenizer_config.json) in its checkpoint directory")
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    per_layer = c.hidden_size * head_dim * 2 * (heads + kv) + 3 * c.hidden_size * c.intermediate_size
    embeddings = c.vocab_size * c.hidden_size * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return Target(name, type(c).__name__.removesuffix("Config"), c.vocab_size, c.hidden_size, c.num_hidden_layers,
                  c.num_hidden_layers * per_layer + embeddings, info.eos_token_ids)


def staging(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial")


def train(kind: str, options: TrainOptions, command: str = "", log: Callable[[str], None] = print) -> Plan:
    """Runs `specrt train KIND` (see the module's docstring); returns its plan. A dry run only resolves it."""
    p = plan(kind, options)
    if options.dry_run:
        return p
    if options.threads:
        import torch
        torch.set_num_threads(options.threads)
    from specrt.export.train.data import make_data
    if p.data is not None:
        log(f"data: {p.data_dir} (the target answers prompts; resumable)")
        make_data(p.data, p.target.vocab_size)
    if p.settings is None:
        return p
    stage = Path(p.settings.out)
    shutil.rmtree(stage, ignore_errors=True)
    try:
        KINDS[kind].train(p.settings)
        (stage / "README.md").write_text(model_card(p, command))
        publish(stage, p.out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    log(f"wrote {p.out} (model card: {p.out / 'README.md'}); checkpoints stay in {p.work}")
    return p


def publish(stage: Path, out: Path) -> None:
    """The staged files into OUT: the directory renamed into place, or each file moved over its namesake."""
    if not out.exists():
        stage.rename(out)
        return
    for f in stage.iterdir():
        f.replace(out / f.name)


def model_card(p: Plan, command: str) -> str:
    """README.md beside the weights: target, data, training, held-out agreement, date, command."""
    from specrt.export.train.train_draft import is_val, load_rows
    record = json.loads((Path(p.settings.out) / "training.json").read_text())
    rows = load_rows(p.settings.data)
    sources: dict = {}
    for r in rows:
        sources[r["source"]] = sources.get(r["source"], 0) + 1
    modes: dict = {}
    for r in rows:
        modes[r["mode"]] = modes.get(r["mode"], 0) + 1
    answers = sum(len(r["ids"]) - r["prompt_len"] for r in rows)
    held_out = sum(is_val(r["prompt_id"]) for r in rows)
    last = {k: v for k, v in (record.get("history") or [{}])[-1].items() if k not in ("step", "epoch", "train_loss")}
    evaluated = record.get("val_rows", record.get("val_positions", 0)) and last
    t, spec = p.target, KINDS[p.kind]
    steps = f"{record.get('steps_done')} of {record.get('steps', getattr(p.settings, 'steps', None))}"
    sessions = ", ".join(f"{a}→{b}" for a, b in record.get("sessions", []))
    use = f"`specrt export --target {t.name} {spec.export_option} {p.out}`, then `specrt build`"
    lines = [
        f"# {p.kind} drafter for {t.name}", "",
        f"Trained by `specrt train {p.kind}` on {datetime.date.today().isoformat()}: {spec.produces}.", "",
        "| | |", "|---|---|",
        f"| target | `{t.name}` ({t.architecture}, about {count(t.parameters)} parameters, {t.num_layers} "
        f"layers, hidden size {t.hidden_size}, vocabulary {t.vocab_size:,}) |",
        f"| use | {use} |",
        f"| data | {len(rows):,} rows ({', '.join(f'{n:,} {m}' for m, n in sorted(modes.items()))}) over prompts "
        f"from {', '.join(f'{s} {n:,}' for s, n in sorted(sources.items()))}; {answers:,} answer tokens; the "
        f"target's own answers with its top-16 logits as labels; held out: 1 prompt in 16 by name ({held_out:,} "
        f"rows); never MT-Bench (`{p.data_dir}`) |",
        f"| training | {steps} steps (this directory's calls: {sessions or 'none'}), {record.get('wall_s', 0):,.0f} s "
        f"on {p.settings.device} |",
        f"| loss | last training step: {fmt(record.get('train_loss'))} |",
        f"| held-out agreement | {fmt(last) if evaluated else 'not evaluated (no held-out rows)'} "
        "(top-1 agreement with the target on held-out answers, teacher-forced: a proxy of greedy acceptance; "
        "tokens per round are measured by `specrt bench ENGINES` after export) |",
        f"| settings | `{json.dumps({k: v for k, v in asdict(p.settings).items() if k not in COMMON})}` |",
        f"| command | `{command or 'specrt train ' + p.kind}` |",
        "", "Training record: `training.json`. Whatever a drafter proposes, the target verifies: a weak drafter "
        "costs speed, never correctness.", ""]
    return "\n".join(lines)


def count(n: int) -> str:
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.0f} M" if n >= 1e6 else f"{n:,}"


def fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, dict):
        return ", ".join(f"{k} {fmt(v)}" for k, v in x.items())
    if isinstance(x, list):
        return "[" + ", ".join(fmt(v) for v in x) + "]"
    return "n/a" if x is None else str(x)
