"""Reading drafters as their authors publish them: a config.json and one weights file, safely.

A `.safetensors` file holds tensors only. A pickled file (`.bin`, `.pt`, `.pth`) is read with
`torch.load(..., weights_only=True)` only: a pickle that asks for anything but tensors and plain containers (code to
run on load) is refused, and so is one whose top level is not a flat name -> tensor map. Other file types are refused.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch

from specrt.errors import CheckpointError, DrafterMismatchError

PICKLES = (".bin", ".pt", ".pth")


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of `path` by name, on the CPU, as stored."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    if path.suffix not in PICKLES:
        raise CheckpointError(f"{path}: specrt reads weights from .safetensors or {'/'.join(PICKLES)} files only")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: refused: specrt loads pickled weights with weights_only=True, which this "
                              f"file does not pass ({str(e).splitlines()[0]}). Convert it to safetensors where "
                              "you trust it (safetensors.torch.save_file(torch.load(path), 'model.safetensors'))") \
            from e
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        what = type(state).__name__ if not isinstance(state, dict) else \
            next(f"{k!r}: {type(v).__name__}" for k, v in state.items()
                 if not isinstance(k, str) or not isinstance(v, torch.Tensor))
        raise CheckpointError(f"{path}: expected a flat map of weight names to tensors, found {what}")
    return state


def find_file(directory: Path, names: tuple[str, ...], flag: str) -> Path:
    """The first of `names` in `directory`."""
    for name in names:
        if (directory / name).is_file():
            return directory / name
    raise CheckpointError(f"{flag} {directory}: no weights file; expected one of {', '.join(names)}")


def read_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(config).__name__}")
    return config


def check_fit(flag: str, directory: Path, pairs: list[tuple[str, object, object]]) -> None:
    """Refuse a drafter that does not fit its target: `pairs` of (what, the drafter's value, the target's)."""
    wrong = [f"{what} {mine} vs the target's {theirs}" for what, mine, theirs in pairs if mine != theirs]
    if wrong:
        raise DrafterMismatchError(f"{flag} {directory} does not fit the target: {'; '.join(wrong)}. Use a drafter "
                                   "trained for this target")
