"""The multi-token-prediction (MTP) modules that a target checkpoint ships, as the engine set's feature drafter.

DeepSeek-V3's technical report (section 2.2): MTP module k combines the representation of token i at depth k − 1
with the embedding of token i + k, h' = M [RMSNorm(h); RMSNorm(Emb(t_{i+k}))], runs one Transformer block over h',
and the output head, shared with the main model, predicts token i + k + 1 from RMSNorm of the block's output. That
is specrt's EAGLE drafter (specrt.export.eagle) with a norm on each input of its projection and one before the
LM head: `EagleModel(mtp=True)`, the same graph, runtime and cache. The engine set records it as its `eagle` model
with `kind` "mtp", and `--method mtp` runs it (`--method eagle` names a drafter trained for EAGLE).

Layouts read (keys of the target's own safetensors, beside its layers; L = num_hidden_layers):
- DeepSeek-V3 and GLM-4.5: `model.layers.{L + k}.` enorm, hnorm, eh_proj [d, 2d] over [enorm(embedding);
  hnorm(hidden)] (the checkpoints' order: the report writes the halves the other way round), the decoder block
  (self_attn, mlp, input_layernorm, post_attention_layernorm), shared_head.norm, and optionally
  shared_head.head and embed_tokens (copies of the target's; used where present).
- MiMo: `model.mtp_layers.{k}.` token_layernorm, hidden_layernorm, input_proj [d, 2d] over [hidden_layernorm(hidden);
  token_layernorm(embedding)], the block's keys, final_layernorm; the target's embeddings and LM head.

Chaining, as vLLM and SGLang chain a checkpoint's single module: module 0, trained for depth 1, drafts every depth.
Depth 1 reads the target's `hidden` output (its last hidden state after the final norm) at position i and token
i + 1; depth k > 1 reads the module's own block output at depth k − 1 (before `shared_head.norm`, the graph's
`hidden` output) and the token drafted there. Modules k > 0 of a checkpoint that ships several are not read.
The block must be the target's own layer type without per-architecture options (Llama, Qwen2, Mistral layers).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from specrt.errors import CheckpointError
from specrt.export.eagle import EagleModel
from specrt.export.model import SpecModel, plain_layers

BLOCK = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
# layout -> (the module's own keys -> EagleModel's), the key that marks a module, whether the projection reads
# [embedding; hidden] (specrt's order is [feature; embedding])
LAYOUTS = {
    "deepseek": ({"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "fc.weight",
                  "shared_head.norm.weight": "norm.weight", "shared_head.head.weight": "lm_head.weight",
                  "embed_tokens.weight": "embed_tokens.weight"}, "eh_proj.weight", True),
    "mimo": ({"token_layernorm.weight": "enorm.weight", "hidden_layernorm.weight": "hnorm.weight",
              "input_proj.weight": "fc.weight", "final_layernorm.weight": "norm.weight"}, "input_proj.weight", False),
}
OPTIONAL = ("lm_head.weight", "embed_tokens.weight")


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    return sorted(directory.glob("*.safetensors"))


def find_mtp(source: str) -> tuple[str, str] | None:
    """(layout, key prefix) of the first MTP module in the checkpoint directory `source`'s safetensors, or None
    (no module, or not a directory: a GGUF file's `nextn` tensors are not read)."""
    from safetensors import safe_open
    directory = Path(source)
    if not (directory / "config.json").is_file():
        return None
    layers = json.loads((directory / "config.json").read_text()).get("num_hidden_layers", 0)
    found = []
    for path in _weight_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                m = re.fullmatch(r"model\.(layers|mtp_layers)\.(\d+)\.(eh_proj|input_proj)\.weight", key)
                if m and (m[1] == "mtp_layers" or int(m[2]) >= layers):
                    found.append((int(m[2]), "deepseek" if m[3] == "eh_proj" else "mimo", f"model.{m[1]}.{m[2]}."))
    return min(found)[1:] if found else None


def load_mtp(source: str, target: SpecModel) -> tuple[EagleModel, str] | None:
    """The first MTP module of the checkpoint directory `source` (see find_mtp) on `target` and where it was
    found ("deepseek model.layers.30."), or None."""
    from safetensors import safe_open
    found = find_mtp(source)
    if found is None:
        return None
    layout, prefix = found
    names, _, embedding_first = LAYOUTS[layout]
    a = target.args
    if a != plain_layers(a):
        raise CheckpointError(f"{source}: its MTP module ({prefix}*) is a {a.architecture} layer, whose options "
                              "(qk norms, sandwich norms, windows, scales) the MTP drafter does not implement yet; "
                              "to export the target alone, copy the checkpoint without the module's keys")
    state = {}
    for path in _weight_files(Path(source)):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    name = key[len(prefix):]
                    mine = names.get(name, "layers.0." + name if name.startswith(BLOCK) else None)
                    if mine is None:
                        raise CheckpointError(f"{source}: {key} is not part of a {layout} MTP module (expected "
                                              f"{', '.join(names)} and the decoder block's {', '.join(BLOCK)})")
                    state[mine] = f.get_tensor(key).float()
    d = a.hidden_size
    if "fc.weight" in state and embedding_first and state["fc.weight"].shape == (d, 2 * d):
        w = state["fc.weight"]
        state["fc.weight"] = torch.cat([w[:, d:], w[:, :d]], dim=1)   # [embedding; hidden] -> [feature; embedding]
    model = EagleModel(target, mtp=True)
    state["fc.bias"] = torch.zeros(d)   # the projection has none: a zero one computes the same
    mine = {**model.trained_state(), **{k: v for k, v in model.state_dict().items() if k in OPTIONAL}}
    missing, unknown = sorted(set(mine) - set(state) - set(OPTIONAL)), sorted(set(state) - set(mine))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(mine[k].shape)}" for k in sorted(set(mine) & set(state))
             if state[k].shape != mine[k].shape]
    if missing or unknown or wrong:   # e.g. a mixture of experts as the block's MLP (DeepSeek-V3's own)
        raise CheckpointError(f"{source}: its MTP module {prefix}* does not fit the target (missing {missing[:4]}, "
                              f"unexpected {unknown[:4]}, shapes {wrong[:4]}); the module must be one decoder layer "
                              "of the target's shape")
    model.load_state_dict(state, strict=False)
    return model.eval(), f"{layout} {prefix}"


def export_mtp(drafter: EagleModel, where: str, source: str, directory: Path, eos: list[int], dtype: str) -> dict:
    """The module's graph (`eagle.onnx`, EAGLE's contract) and its manifest entry: `kind` "mtp" and its `layout`."""
    from specrt.export.eagle import export_eagle
    from specrt.export.onnx_export import model_entry
    export_eagle(drafter, directory / "eagle.onnx", dtype)
    entry = model_entry(drafter, source, "eagle.onnx", directory, eos, dtype)
    entry.update(kind="mtp", layout=where)
    return entry
