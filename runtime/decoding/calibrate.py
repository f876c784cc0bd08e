"""Choose a candidate tree automatically: per-depth, per-rank accuracy of the drafter measured on calibration
prompts, then the tree that maximises expected tokens per round per unit of measured verification cost."""
from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np
import torch

from specrt.errors import InputError
from specrt.engines.manifest import file_entry, read_manifest, write_manifest
from specrt.decoding.tree import Tree

# project-written calibration prompts (never the benchmark set)
CALIBRATION_PROMPTS = [
    "Describe how a bicycle works, step by step.",
    "Write a short email asking a colleague to review a document.",
    "List five tips for learning a new language and explain each briefly.",
    "Explain the difference between weather and climate to a child.",
    "Write a Python function that returns the squares of a list of numbers.",
    "Summarise the water cycle in a paragraph.",
]


def _hidden_and_truth(gen, ids: list[int], new_tokens: int):
    """The target's greedy continuation and its hidden states / draft logits along it (teacher forcing)."""
    out = gen.generate(prompt_ids=ids, max_new_tokens=new_tokens, method="autoregressive")
    seq = ids + out.token_ids[0]
    return seq, len(ids)


def rank_accuracy(gen, method: str, prompts: list[list[int]], depth: int, width: int, new_tokens: int = 48):
    """acc[d, r]: how often the rank-r candidate at depth d+1 is the target's (greedy) token there."""
    if method == "draft" and gen.draft_map is not None:
        raise InputError("tune-tree --method draft: the engine set's draft has another vocabulary (it reads the "
                         "target's tokens through its vocabulary map, which rank accuracy does not); use its default "
                         "tree or --tree-choices")
    hits = np.zeros((depth, width))
    total = np.zeros(depth)
    for ids in prompts:
        seq, start = _hidden_and_truth(gen, ids, new_tokens)
        truth = torch.tensor(seq, device=gen.target.device)
        if method == "medusa":
            hidden = gen.target.run_sequence(seq, len(seq)).hidden[0]                                # (S, d)
            # position t's root is token t + 1; sequential heads also read the true tokens after it, which is what
            # they read on an accepted path (so their accuracy is given the path above them)
            path = torch.stack([truth.roll(-1 - i) for i in range(gen.medusa.num_heads)], 1)          # (S, K)
            top = torch.topk(gen.medusa.forward(hidden, path)[:, :depth], width, dim=-1).indices    # (S, D, k)
            offset = 2                          # head i at position t predicts token t + i + 2
        else:
            logits = gen.draft.run_sequence(seq, len(seq)).logits[0]                                  # (S, V)
            ranks = torch.topk(logits, width, dim=-1).indices                   # position s predicts token s + 1
            # on an accepted path the draft proposes depth d at position t + d, having seen the true prefix
            top = torch.stack([ranks.roll(-d, 0) for d in range(depth)], 1)                     # (S, D, k)
            offset = 1
        top, truth = top.cpu(), truth.cpu()  # one read: the counting below is host work
        for t in range(start - 1, len(seq) - 1):
            for d in range(depth):
                target = t + d + offset
                if target < len(seq):
                    total[d] += 1
                    hits[d] += (top[t, d] == truth[target]).numpy()
    return hits / np.maximum(total, 1)[:, None]


def verify_costs(gen, sizes) -> dict[int, float]:
    """Seconds of a target pass over each size measured up to the largest of `sizes` (the generator's pass times,
    measured once per process: Generator.costs)."""
    verify = gen.costs(upto=max(sizes), draft=False).verify
    return {k: t for k, t in verify.items() if k <= max(sizes)}


def heads_time(gen) -> float:
    """Seconds of one pass of the Medusa heads (best of 5): a cost every round pays whatever the tree, once per
    tree level for sequential heads (timed on one path)."""
    from specrt.decoding.adaptive import measure
    heads, K = gen.medusa, gen.medusa.num_heads
    hidden = torch.zeros(1, gen.target.spec["hidden_size"], device=heads.device)
    tokens = torch.zeros(1, K, dtype=torch.int64, device=heads.device)
    if heads.sequential:
        head = torch.zeros(1, dtype=torch.int64, device=heads.device)
        return measure(lambda: heads.logits(hidden, tokens, head), reps=5)
    return measure(lambda: heads.forward(hidden, tokens), reps=5)


def choose_tree(acc: np.ndarray, cost, max_nodes: int, chain_only: bool, fixed_cost: float = 0.0,
                level_cost: float = 0.0) -> Tree:
    """Grow the tree by the node most likely to be on the accepted path (product of accuracies along it);
    keep the size whose (1 + expected accepted length) / (verification cost + fixed cost + level cost × depth)
    is best."""
    depth, width = acc.shape
    heap = [(-acc[0, r], (r,)) for r in range(width)]
    heapq.heapify(heap)
    paths, expected, best, deepest = [], 0.0, (0.0, 1), 0
    while heap and len(paths) < max_nodes:
        neg, path = heapq.heappop(heap)
        paths.append(path)
        expected += -neg
        deepest = max(deepest, len(path))
        score = (1 + expected) / (cost(len(paths) + 1) + fixed_cost + level_cost * deepest)
        if score > best[0]:
            best = (score, len(paths))
        if len(path) < depth and (not chain_only or path[-1] == 0):
            for r in range(width):
                heapq.heappush(heap, (neg * acc[len(path), r], path + (r,)))
    return Tree.from_paths(paths[:best[1]])


def calibrate(gen, method: str, prompts: list[list[int]], max_nodes: int = 48, width: int = 8,
              depth: int | None = None, log=print) -> Tree:
    depth = depth or (gen.medusa.num_heads if method == "medusa" else 6)
    acc = rank_accuracy(gen, method, prompts, depth, width)
    log("accuracy by depth (rows) and rank (columns):\n" + np.array2string(acc, precision=2))
    sizes = sorted({1, 2, 4, 8, 12, 16, 24, 32, 48, 64, max_nodes + 1})
    measured = verify_costs(gen, [s for s in sizes if s <= max_nodes + 1])
    # a least-squares line through the measured passes: single passes jitter by more than the cost of a node,
    # which made the chosen tree move from run to run
    xs = sorted(measured)
    slope, intercept = np.polyfit(xs, [measured[x] for x in xs], 1)
    cost = lambda n: float(intercept + max(slope, 0.0) * n)  # noqa: E731
    if method == "draft":      # drafting, once a round
        fixed, level = depth * gen.costs().draft_step, 0.0
    else:                      # sequential heads run once per level of the tree
        fixed, level = (0.0, heads_time(gen)) if gen.medusa.sequential else (heads_time(gen), 0.0)
    tree = choose_tree(acc, cost, max_nodes, chain_only=(method == "draft"), fixed_cost=fixed, level_cost=level)
    log(f"chosen tree: {tree.size - 1} nodes, depth {tree.max_depth}")
    return tree


def save_tree(directory: Path, method: str, tree: Tree) -> Path:
    """Write the tree beside the engines and record it (with its hash) in the manifest."""
    directory = Path(directory)
    name = f"tree_{method}.json"
    tree.save(directory / name)
    manifest = read_manifest(directory)
    manifest.setdefault("trees", {})[method] = file_entry(directory, name)
    write_manifest(directory, manifest)
    return directory / name
