"""Medusa heads: K residual blocks on the target's last hidden state, each feeding the target's own LM head.

Checkpoint directory: `medusa_config.json` ({"num_heads": K, "hidden_size": d, "root_token": bool,
"sequential": bool}) and `medusa_heads.safetensors` (`heads.{i}.weight` [d, w_i], `heads.{i}.bias` [d]); optionally
`tree.json`, the candidate tree that export records as the engine set's default, and `specrt_vocab.json`, the
output ids the heads propose from (the draft's format; the LM head keeps those rows, every other id gets logit
-inf: proposals are verified, so this only changes speed). Head i predicts the token i+2 places after the
position whose hidden state it reads (the target's own LM head predicts the next one).
- plain: head i is h + SiLU(W_i h + b_i).
- `root_token`: each head also reads the target's embedding of that next token, which is known when the heads
  propose (it is the root of the candidate tree): h + SiLU(W_i [h; e(root)] + b_i).
- `sequential` (Hydra): head i also reads the tokens of the candidate path above it, the root and the
  candidates at depths 1..i: h + SiLU(W_i [h; e(root); e(c_1); ..; e(c_i)] + b_i). The heads then run once per
  tree level, each level on the candidates the one above chose.
Graph, plain or root_token: `hidden` [B, d] (and `token` [B]) -> `medusa_logits` [B, K, V]. Sequential: `hidden`
[M, d], `tokens` [M, K] (root and path; slots past the head's depth are ignored), `head` [M] -> `logits` [M, V].
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specrt.errors import CheckpointError, DrafterMismatchError, InputError
from specrt.export.model import full_vocab

CONFIG, WEIGHTS, TREE = "medusa_config.json", "medusa_heads.safetensors", "tree.json"
PUBLISHED_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int, lm_head: torch.Tensor, embed: torch.Tensor | None = None,
                 sequential: bool = False, vocab_subset: list[int] | None = None):
        """`embed` (V, d): the target's input embeddings; given, the heads read the root token, and with
        `sequential` the candidate path too (see above). `vocab_subset`: the ids the heads may propose."""
        super().__init__()
        if sequential and embed is None:
            raise ValueError("sequential heads read token embeddings: pass embed")
        tokens = [i + 1 if sequential else int(embed is not None) for i in range(num_heads)]  # tokens head i reads
        self.heads = nn.ModuleList(nn.Linear((1 + n) * hidden_size, hidden_size) for n in tokens)
        self.vocab_size = lm_head.shape[0]
        index = None if vocab_subset is None else torch.tensor(vocab_subset, dtype=torch.int64)
        kept = lm_head.detach() if index is None else lm_head.detach().index_select(0, index)
        self.lm_head = nn.Linear(hidden_size, kept.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(kept.clone(), requires_grad=False)
        self.register_buffer("vocab_index", index, persistent=False)
        self.embed = None if embed is None else nn.Embedding.from_pretrained(embed.detach().clone(), freeze=True)
        self.sequential = sequential

    @property
    def root_token(self) -> bool:
        return self.embed is not None

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    def logits(self, hidden, tokens, head):
        """Row m of head[m] (M,) on hidden (M, d) and tokens (M, K) -> (M, V): the engine's sequential interface."""
        return self(hidden, tokens)[torch.arange(len(head)), head]

    def forward(self, hidden, tokens=None):
        """hidden (B, d); tokens (B, K): the root, then the path below it that sequential heads read (the true
        tokens, in training and calibration; root-token heads read only the root) -> logits (B, K, V)."""
        if self.embed is None:
            xs = [hidden] * len(self.heads)
        elif not self.sequential:
            xs = [torch.cat([hidden, self.embed(tokens[:, 0])], -1)] * len(self.heads)
        else:
            e = self.embed(tokens)                                                   # (B, K, d)
            xs = [torch.cat([hidden, e[:, :i + 1].flatten(1)], -1) for i in range(len(self.heads))]
        h = torch.stack([hidden + nn.functional.silu(head(x)) for head, x in zip(self.heads, xs)], 1)  # (B, K, d)
        return self.full_vocab(self.lm_head(h))                               # (B, K, V)

    def full_vocab(self, logits):
        """Logits over the kept ids (..., V') -> (..., V), -inf at the ids the heads do not propose."""
        return logits if self.vocab_index is None else full_vocab(logits, self.vocab_index, self.vocab_size)


class ResBlock(nn.Module):
    """x + SiLU(W x + b): one layer of a published Medusa head."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class PublishedHeads(nn.Module):
    """Medusa heads as FasterDecoding publishes them (`medusa/model/medusa_model.py`): head i is L residual blocks
    on the target's last hidden state (after its final norm), then the head's own LM head, or the target's where the
    checkpoint has none (the legacy heads). hidden (M, d) -> logits (M, K, V), the same graph contract as plain
    `MedusaHeads`."""
    root_token = sequential = False
    vocab_index = None

    def __init__(self, num_heads: int, num_layers: int, hidden_size: int, lm_head: torch.Tensor,
                 own_lm_heads: bool):
        super().__init__()
        V = self.vocab_size = lm_head.shape[0]
        self.hidden_size = hidden_size
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)))
                                    for _ in range(num_heads))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, V, bias=False) for _ in range(num_heads)) \
            if own_lm_heads else None
        self.lm_head = None if own_lm_heads else nn.Linear(hidden_size, V, bias=False)
        if self.lm_head is not None:
            self.lm_head.weight = nn.Parameter(lm_head.detach().clone(), requires_grad=False)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden, tokens=None):
        """hidden (M, d) -> (M, K, V); `tokens` is not read (the signature of `MedusaHeads.forward`)."""
        if self.lm_heads is None:
            return self.lm_head(torch.stack([blocks(hidden) for blocks in self.blocks], 1))      # (M, K, V)
        return torch.stack([head(blocks(hidden)) for blocks, head in zip(self.blocks, self.lm_heads)], 1)


class _HeadsGraph(nn.Module):
    """The heads as the engine runs them, every head at once in one matrix per input. The hidden state and the
    token embeddings have MatMuls of their own: an int8 engine quantizes each MatMul's input with one scale, and
    the hidden state's outliers would leave the embeddings a handful of levels (MT-Bench, whole sequences in one
    call as tune-tree scores them: head 0's top-1 0.34 with one MatMul, 0.38 with two).
    Plain and root-token heads: (B, d), (B,) -> (B, K, V).
    Sequential heads: (M, d), (M, K), (M,) -> (M, V); row m runs head[m] on its own path, weights zero-padded to
    K tokens (every head runs on every row: small matrices; the LM head, which dominates, runs once per row)."""

    def __init__(self, heads: MedusaHeads):
        super().__init__()
        K, d = len(heads.heads), heads.lm_head.in_features
        width = K + 1 if heads.sequential else 2 if heads.root_token else 1     # in units of d
        weight = torch.zeros(K, d, width * d)
        for i, head in enumerate(heads.heads):
            weight[i, :, :head.in_features] = head.weight
        weight = weight.flatten(0, 1).T                                                # (width d, K d)
        self.hidden_weight = nn.Parameter(weight[:d].contiguous(), requires_grad=False)
        self.token_weight = nn.Parameter(weight[d:].contiguous(), requires_grad=False) if width > 1 else None
        self.bias = nn.Parameter(torch.stack([head.bias for head in heads.heads]), requires_grad=False)  # (K, d)
        self.embed, self.lm_head, self.full_vocab = heads.embed, heads.lm_head, heads.full_vocab
        self.sequential = heads.sequential

    def forward(self, hidden, tokens=None, head=None):
        y = torch.matmul(hidden, self.hidden_weight)                                   # (M, K d)
        if self.token_weight is not None:
            y = y + torch.matmul(self.embed(tokens).flatten(1), self.token_weight)
        y = y.view(-1, *self.bias.shape) + self.bias                                 # (M, K, d)
        if self.sequential:
            y = torch.gather(y, 1, head[:, None, None].expand(-1, 1, y.shape[-1]))[:, 0]  # (M, d)
            return self.full_vocab(self.lm_head(hidden + nn.functional.silu(y)))    # (M, V)
        return self.full_vocab(self.lm_head(hidden[:, None] + nn.functional.silu(y)))  # (B, K, V)


def save_heads(heads: MedusaHeads, directory: Path, dtype=torch.float16) -> None:
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in heads.state_dict().items() if k.startswith("heads.")}
    save_file(state, str(directory / WEIGHTS))
    (directory / CONFIG).write_text(json.dumps({"num_heads": len(heads.heads),
                                                "hidden_size": heads.lm_head.in_features,
                                                "root_token": heads.root_token,
                                                "sequential": heads.sequential}) + "\n")


def layout(directory: str | Path) -> str:
    """"specrt" (medusa_config.json) or "medusa" (FasterDecoding's medusa_lm_head file; see `load_published`)."""
    directory = Path(directory)
    if (directory / CONFIG).is_file():
        return "specrt"
    if any((directory / name).is_file() for name in PUBLISHED_WEIGHTS):
        return "medusa"
    raise InputError(f"--medusa {directory}: expected specrt's {CONFIG} and {WEIGHTS}, or published heads' "
                     f"{' or '.join(PUBLISHED_WEIGHTS)}")


def load_heads(directory: str | Path, target, log=lambda *_: None) -> MedusaHeads | PublishedHeads:
    """Heads from a checkpoint directory (specrt's layout or FasterDecoding's), on the LM head (and embeddings) of
    `target` (a SpecModel)."""
    if layout(directory) == "medusa":
        return load_published(directory, target, log)
    from safetensors.torch import load_file

    from specrt.export.sources import read_vocab_subset
    directory = Path(directory)
    if not (directory / WEIGHTS).is_file():
        raise InputError(f"--medusa {directory}: expected a directory with {CONFIG} and {WEIGHTS}")
    config = json.loads((directory / CONFIG).read_text())
    if config["hidden_size"] != target.args.hidden_size:
        raise DrafterMismatchError(f"--medusa {directory}: heads of hidden size {config['hidden_size']} do not fit "
                                   f"the target's hidden size {target.args.hidden_size}")
    sequential = bool(config.get("sequential"))
    embed = target.model.embed_tokens.weight if config.get("root_token") or sequential else None
    kept = read_vocab_subset(directory, target.args.vocab_size)
    heads = MedusaHeads(config["num_heads"], config["hidden_size"], target.lm_head.weight, embed, sequential, kept)
    state = {k: v.float() for k, v in load_file(str(directory / WEIGHTS)).items()}
    frozen = {k: v for k, v in heads.state_dict().items() if not k.startswith("heads.")}
    try:
        heads.load_state_dict({**state, **frozen}, strict=True)
    except RuntimeError as e:
        raise InputError(f"--medusa {directory}: the weights do not match {CONFIG} ({e})") from e
    return heads.eval()


def load_published(directory: str | Path, target, log=lambda *_: None) -> PublishedHeads:
    """FasterDecoding's Medusa heads: `medusa_lm_head.safetensors` or `.pt` with keys `{h}.{l}.linear.weight/bias`
    (the residual blocks) and `{h}.{L}.weight` (head h's LM head, L = medusa_num_layers; absent in the legacy heads,
    which use the target's), beside a `config.json` with `medusa_num_heads` and `medusa_num_layers`. The heads and
    layers are counted from the weights: published configs understate them (the reference code replaces the
    head count of its Vicuna heads' config, 2, by 5)."""
    import re

    from specrt.export.published import check_fit, find_file, read_config, read_weights
    directory, a = Path(directory), target.args
    path = find_file(directory, PUBLISHED_WEIGHTS, "--medusa")
    state = read_weights(path)
    keys = {k: re.fullmatch(r"(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)", k) for k in state}
    if not state or not all(keys.values()):
        other = sorted(k for k, m in keys.items() if not m)[:4]
        raise CheckpointError(f"--medusa {directory}: {path.name} holds {other or 'nothing'}, not Medusa heads' "
                              "{head}.{layer}.linear.weight/bias and {head}.{layers}.weight")
    heads = 1 + max(int(m[1]) for m in keys.values())
    layers = 1 + max((int(m[2]) for k, m in keys.items() if ".linear." in k), default=-1)
    own = f"0.{layers}.weight" in state
    expected = {f"{h}.{i}.linear.{p}" for h in range(heads) for i in range(layers) for p in ("weight", "bias")}
    expected |= {f"{h}.{layers}.weight" for h in range(heads)} if own else set()
    if set(state) != expected:
        raise CheckpointError(f"--medusa {directory}: {path.name} is not {heads} heads of {layers} layers each "
                              f"(missing {sorted(expected - set(state))[:4]}, unexpected "
                              f"{sorted(set(state) - expected)[:4]})")
    check_fit("--medusa", directory, [("hidden size", state[min(state)].shape[-1], a.hidden_size)] +
              ([("vocabulary size", state[f"0.{layers}.weight"].shape[0], a.vocab_size)] if own else []))
    config = read_config(directory / "config.json") if (directory / "config.json").is_file() else {}
    check_fit("--medusa", directory, [(k.replace("_", " "), config[k], getattr(a, k)) for k in
                                      ("hidden_size", "vocab_size") if k in config])
    said = (config.get("medusa_num_heads"), config.get("medusa_num_layers"))
    if config and said != (heads, layers):
        log(f"{directory}/config.json says medusa_num_heads {said[0]}, medusa_num_layers {said[1]}; the weights "
            f"hold {heads} heads, {layers} layer(s) each: using the weights")
    model = PublishedHeads(heads, layers, a.hidden_size, target.lm_head.weight, own)
    names = {f"{h}.{i}.linear.{p}": f"blocks.{h}.{i}.linear.{p}" for h in range(heads) for i in range(layers)
             for p in ("weight", "bias")} | {f"{h}.{layers}.weight": f"lm_heads.{h}.weight" for h in range(heads)}
    try:
        model.load_state_dict({names[k]: v.float() for k, v in state.items()}, strict=False)
    except RuntimeError as e:   # a shape that does not match the target's hidden size
        raise CheckpointError(f"--medusa {directory}: {path.name} does not hold heads of one shape ({e})") from e
    return model.eval()


def shipped_tree(directory: str | Path, num_heads: int):
    """The heads directory's tree.json (a Tree), or None."""
    from specrt.decoding.tree import Tree
    path = Path(directory) / TREE
    if not path.is_file():
        return None
    tree = Tree.load(path)
    if tree.max_depth > num_heads:
        raise InputError(f"--medusa {directory}: {TREE} has depth {tree.max_depth}, the heads are {num_heads}")
    return tree


def export_heads(heads: MedusaHeads | PublishedHeads, path: Path, dtype: str = "float32") -> None:
    """The heads' graph (see `specrt.export.onnx_export.export_module`: weights as external data in `dtype`)."""
    from specrt.export.onnx_export import export_module
    if isinstance(heads, PublishedHeads):
        export_module(heads, (torch.zeros(1, heads.hidden_size),), path, dtype, ["hidden"], ["medusa_logits"],
                      {"hidden": {0: "M"}, "medusa_logits": {0: "M"}})
        return
    d, K = heads.lm_head.in_features, len(heads.heads)
    hidden, token = torch.zeros(1, d), torch.zeros(1, dtype=torch.int64)
    if heads.sequential:
        args, names, out = (hidden, torch.zeros(1, K, dtype=torch.int64), token), ["hidden", "tokens", "head"], "logits"
    elif heads.root_token:
        args, names, out = (hidden, token), ["hidden", "token"], "medusa_logits"
    else:
        args, names, out = (hidden,), ["hidden"], "medusa_logits"
    export_module(_HeadsGraph(heads), args, path, dtype, names, [out], {name: {0: "M"} for name in (*names, out)})
