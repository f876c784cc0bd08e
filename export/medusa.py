"""Medusa heads: K residual blocks on the target's last hidden state, each feeding the target's own LM head.

Checkpoint directory: `medusa_config.json` ({"num_heads": K, "hidden_size": d, "root_token": bool}) and
`medusa_heads.safetensors` (`heads.{i}.weight` [d, d] or [d, 2d], `heads.{i}.bias` [d]), and optionally
`tree.json`, the candidate tree that export records as the engine set's default. Head i predicts the
token i+2 places after the position whose hidden state it reads (the target's own LM head predicts the next one).
With `root_token`, each head also reads the target's embedding of that next token, which is known when the
heads propose (it is the root of the candidate tree): head i is h + SiLU(W_i [h; embed(root)] + b_i).
Graph: `hidden` [B, d] (and `token` [B] with `root_token`) -> `medusa_logits` [B, K, V].
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from specrt.errors import InputError

CONFIG, WEIGHTS, TREE = "medusa_config.json", "medusa_heads.safetensors", "tree.json"


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int, lm_head: torch.Tensor, embed: torch.Tensor | None = None):
        """`embed` (V, d): the target's input embeddings; given, the heads read the root token (see above)."""
        super().__init__()
        width = hidden_size if embed is None else 2 * hidden_size
        self.heads = nn.ModuleList(nn.Linear(width, hidden_size) for _ in range(num_heads))
        self.lm_head = nn.Linear(hidden_size, lm_head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_head.detach().clone(), requires_grad=False)
        self.embed = None if embed is None else nn.Embedding.from_pretrained(embed.detach().clone(), freeze=True)

    @property
    def root_token(self) -> bool:
        return self.embed is not None

    def forward(self, hidden, token=None):                                    # (B, d), (B,)
        x = hidden if self.embed is None else torch.cat([hidden, self.embed(token)], -1)
        h = torch.stack([hidden + nn.functional.silu(head(x)) for head in self.heads], 1)  # (B, K, d)
        return self.lm_head(h)                                                # (B, K, V)


def save_heads(heads: MedusaHeads, directory: Path, dtype=torch.float16) -> None:
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items() if k.startswith("heads.")}
    save_file(state, str(directory / WEIGHTS))
    (directory / CONFIG).write_text(json.dumps({"num_heads": len(heads.heads),
                                                "hidden_size": heads.lm_head.in_features,
                                                "root_token": heads.root_token}) + "\n")


def load_heads(directory: str | Path, target) -> MedusaHeads:
    """Heads from a checkpoint directory, on the LM head (and embeddings) of `target` (a SpecModel)."""
    from safetensors.torch import load_file
    directory = Path(directory)
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise InputError(f"--medusa {directory}: expected a directory with {CONFIG} and {WEIGHTS}")
    config = json.loads((directory / CONFIG).read_text())
    if config["hidden_size"] != target.args.hidden_size:
        raise InputError(f"--medusa {directory}: heads of hidden size {config['hidden_size']} do not fit the "
                         f"target's hidden size {target.args.hidden_size}")
    embed = target.model.embed_tokens.weight if config.get("root_token") else None
    heads = MedusaHeads(config["num_heads"], config["hidden_size"], target.lm_head.weight, embed)
    state = {k: v.float() for k, v in load_file(str(directory / WEIGHTS)).items()}
    frozen = {k: v for k, v in heads.state_dict().items() if not k.startswith("heads.")}
    try:
        heads.load_state_dict({**state, **frozen}, strict=True)
    except RuntimeError as e:
        raise InputError(f"--medusa {directory}: the weights do not match {CONFIG} ({e})") from e
    return heads.eval()


def shipped_tree(directory: str | Path, num_heads: int):
    """The heads directory's tree.json (a Tree), or None."""
    from specrt.tree import Tree
    path = Path(directory) / TREE
    if not path.is_file():
        return None
    tree = Tree.load(path)
    if tree.max_depth > num_heads:
        raise InputError(f"--medusa {directory}: {TREE} has depth {tree.max_depth}, the heads are {num_heads}")
    return tree


def export_heads(heads: MedusaHeads, path: Path) -> None:
    d = heads.lm_head.in_features
    args, names, dyn = (torch.zeros(1, d),), ["hidden"], {"hidden": {0: "B"}, "medusa_logits": {0: "B"}}
    if heads.root_token:
        args, names = (*args, torch.zeros(1, dtype=torch.int64)), [*names, "token"]
        dyn["token"] = {0: "B"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(heads, args, str(path), dynamo=False, opset_version=17, input_names=names,
                          output_names=["medusa_logits"], dynamic_axes=dyn)
