"""Medusa heads: K residual blocks on the target's last hidden state, each feeding the target's own LM head.

Checkpoint directory: `medusa_config.json` ({"num_heads": K, "hidden_size": d}) and `medusa_heads.safetensors`
(`heads.{i}.weight` [d, d], `heads.{i}.bias` [d]). Head i predicts the token i+2 places after the position
whose hidden state it reads (the target's own LM head predicts the next one).
Graph: `hidden` [B, d] -> `medusa_logits` [B, K, V].
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from specrt.errors import InputError

CONFIG, WEIGHTS = "medusa_config.json", "medusa_heads.safetensors"


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int, lm_head: torch.Tensor):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        self.lm_head = nn.Linear(hidden_size, lm_head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_head.detach().clone(), requires_grad=False)

    def forward(self, hidden):                                                # (B, d)
        h = torch.stack([hidden + nn.functional.silu(head(hidden)) for head in self.heads], 1)  # (B, K, d)
        return self.lm_head(h)                                                # (B, K, V)


def save_heads(heads: MedusaHeads, directory: Path, dtype=torch.float16) -> None:
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items() if k.startswith("heads.")}
    save_file(state, str(directory / WEIGHTS))
    (directory / CONFIG).write_text(json.dumps({"num_heads": len(heads.heads),
                                                "hidden_size": heads.lm_head.in_features}) + "\n")


def load_heads(directory: str | Path, target) -> MedusaHeads:
    """Heads from a checkpoint directory, on the LM head of `target` (a SpecModel)."""
    from safetensors.torch import load_file
    directory = Path(directory)
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise InputError(f"--medusa {directory}: expected a directory with {CONFIG} and {WEIGHTS}")
    config = json.loads((directory / CONFIG).read_text())
    if config["hidden_size"] != target.args.hidden_size:
        raise InputError(f"--medusa {directory}: heads of hidden size {config['hidden_size']} do not fit the "
                         f"target's hidden size {target.args.hidden_size}")
    heads = MedusaHeads(config["num_heads"], config["hidden_size"], target.lm_head.weight)
    state = {k: v.float() for k, v in load_file(str(directory / WEIGHTS)).items()}
    heads.load_state_dict({**state, "lm_head.weight": heads.lm_head.weight}, strict=True)
    return heads.eval()


def export_heads(heads: MedusaHeads, path: Path) -> None:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(heads, (torch.zeros(1, heads.lm_head.in_features),), str(path), dynamo=False,
                          opset_version=17, input_names=["hidden"], output_names=["medusa_logits"],
                          dynamic_axes={"hidden": {0: "B"}, "medusa_logits": {0: "B"}})
