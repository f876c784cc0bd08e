"""Self-speculation (LayerSkip, Draft & Verify, SWIFT): the target drafts with a subset of its own layers.

An ONNX Runtime build puts the self drafter inside the target's engine (`skip_graph`): each layer but the last in an
ONNX `If` on its entry of a bool input `skip_layers` (one per layer), run by the target's own session
(specrt.engines.base.LayerSkipEngine) on the target's own cache (specrt.decoding.drafters.SelfDrafter): the weights,
ONNX Runtime's repacked copies of them and the keys and values are in memory once, and which layers a drafter keeps
is chosen per pass: `specrt tune` measures sets of them (docs/notes/2026-12-self-speculation.md). The engine set's
`self` model is also exported as a graph of its own, the target's over the kept layers (the draft model's contract,
its own small cache), whose initializers point at the tensors with the same bytes in the target graph's data file
(`share_weights`: no weight bytes of its own on disk); TensorRT and CUDA builds build it into an engine of its own,
run as a draft model.

Which layers at export: `--self-layers` a list ("0-14,29"), "half" (the first half and the last layer), or "auto"
(`search_layers`: layers dropped in the order of the top-1 agreement each one's absence keeps, while the estimated
speedup grows). The choice is in the manifest (`models.self.kept_layers`, and `search` with what was measured); a
tuned engine set runs tune's (`Tuning.self_layers`).
"""
from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import torch

from specrt.engines.manifest import SKIP_INPUT
from specrt.errors import InputError
from specrt.export.model import SpecModel

FILE = "self.onnx"


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """`--self-layers` as the sorted kept layer indices: "half", or comma-separated indices and ranges ("0-14,29").
    ("auto" is `search`'s.) Out of range, empty or all layers is an InputError naming the value."""
    if spec == "half":
        return sorted({*range(num_layers // 2), num_layers - 1})
    kept = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            kept.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise InputError(f"--self-layers {spec!r}: expected 'auto', 'half' or layer indices and ranges such as "
                         "'0-14,29'") from None
    bad = sorted(i for i in kept if not 0 <= i < num_layers)
    if bad or not kept or len(kept) == num_layers:
        why = f"layer {bad[0]} is out of range" if bad else "that keeps no layer" if not kept else \
            "that keeps every layer (the target itself)"
        raise InputError(f"--self-layers {spec!r}: {why}; the target has layers 0-{num_layers - 1}: keep some of "
                         "them, not all")
    return sorted(kept)


def self_model(target: SpecModel, layers: list[int]) -> SpecModel:
    """The target over `layers` only: its own tensors (no copy), its layers renumbered 0..K-1."""
    a = target.args
    pick = lambda per_layer: tuple(per_layer[i] for i in layers) if per_layer else ()   # noqa: E731
    args = replace(a, num_layers=len(layers), windows=pick(a.windows), local_rope=pick(a.local_rope),
                   sparse_layers=pick(a.sparse_layers))
    local = (target.local_cos, target.local_sin) if target.local_cos is not None else None
    with torch.device("meta"):
        model = SpecModel(args, target.rope_cos, target.rope_sin, target.vocab_index, local)
    state = {}
    for key, t in target.state_dict(keep_vars=True).items():
        if key.startswith("model.layers."):
            i, rest = key[len("model.layers."):].split(".", 1)
            if int(i) in layers:
                state[f"model.layers.{layers.index(int(i))}.{rest}"] = t
        else:
            state[key] = t
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _key(t: onnx.TensorProto, data: np.memmap) -> tuple:
    where = {e.key: e.value for e in t.external_data}
    offset, length = int(where.get("offset", 0)), int(where["length"])
    return t.data_type, tuple(t.dims), hashlib.sha256(data[offset:offset + length]).hexdigest()


def _external(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]


def share_weights(graph: Path, target_graph: Path) -> int:
    """Point each external initializer of `graph` at the tensor of the same type, shape and bytes in
    `target_graph`'s data file, and delete `graph`'s own data file. Returns the bytes that had no equal in the
    target's (kept in `graph`'s own data file; 0 for a graph over the target's layers)."""
    from specrt.export import onnx_files
    graph, target_graph = Path(graph), Path(target_graph)
    target = onnx.load(str(target_graph), load_external_data=False)
    tdata = np.memmap(onnx_files.data_path(target_graph), np.uint8, mode="r")
    index = {_key(t, tdata): t.external_data for t in _external(target)}
    model = onnx.load(str(graph), load_external_data=False)
    own = onnx_files.data_path(graph)
    data = np.memmap(own, np.uint8, mode="r") if own.exists() and own.stat().st_size else None
    left = []
    for t in _external(model):
        where = index.get(_key(t, data))
        if where is None:
            left.append(t)
            continue
        del t.external_data[:]
        t.external_data.extend(where)
    for t in left:   # into memory: the own data file is rewritten with these only
        onnx.external_data_helper.load_external_data_for_tensor(t, str(graph.parent))
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]
    left_bytes = sum(len(t.raw_data) for t in left)
    del data
    own.unlink(missing_ok=True)
    for t in left:
        onnx_files._write(t, own)
    onnx.save_model(model, str(graph))
    return left_bytes


def export_self(target: SpecModel, layers: str, source: str, directory: Path, eos: list[int], dtype: str,
                prompts: list[list[int]], log=print) -> dict:
    """The self graph `FILE` beside the target's `target.onnx` in `directory`, over its data file; its manifest
    entry (`kept_layers`, and the search's figures where `layers` is "auto")."""
    from specrt.export.onnx_export import export_graph, model_entry
    L, search = target.args.num_layers, None
    if layers == "auto":
        kept, search = search_layers(target, prompts, log)
        best = max(search["steps"], key=lambda x: x["estimated_speedup"])["estimated_speedup"]
        if best < 1:
            log(f"warning: the best layer choice is estimated at {best:.2f}× autoregressive decoding (from the "
                "agreement of a drafter with a cache of its own; on the target's cache, as it runs, it drafts "
                "better): `specrt tune` measures layer sets and keeps the best; `auto` runs self only where the "
                "tuning measured it fastest")
    else:
        kept = parse_layers(layers, L)
    model = self_model(target, kept)
    log(f"tracing the self drafter to ONNX: target layers {layer_ranges(kept)} ({len(kept)} of {L}), the target's "
        "weights")
    export_graph(model, directory / FILE, dtype)
    own = share_weights(directory / FILE, directory / "target.onnx")
    entry = model_entry(model, source, FILE, directory, eos, dtype)
    entry.update(kind="self", kept_layers=kept, own_weight_bytes=own)
    if search is not None:
        entry["search"] = search
    return entry


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (what --self-layers reads)."""
    parts, start = [], layers[0]
    for a, b in zip(layers, [*layers[1:], None]):
        if b != a + 1:
            parts.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ",".join(parts)


SEARCH_TOKENS = 24   # the target's greedy continuation of each calibration prompt that the search scores on


def _all_logits(model: SpecModel, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (S, V) at every position of `tokens` (1, S), nothing cached."""
    from specrt.export.acceptance import causal, empty_caches
    S = tokens.shape[1]
    return model(tokens, torch.arange(S)[None], torch.zeros(1, dtype=torch.int64), causal(S), torch.tensor([S]),
                 *empty_caches(model.args))[0][0]


def estimated_speedup(alpha: float, c: float, max_gamma: int = 8) -> tuple[float, int]:
    """The best chain's speedup E[N] / (1 + γc) over γ = 1..max_gamma (a verify pass taken as one step), and γ."""
    from specrt.decoding.adaptive import expected_tokens
    return max((expected_tokens(alpha, g) / (1 + g * c), g) for g in range(1, max_gamma + 1))


def search_layers(target: SpecModel, prompts: list[list[int]], log=print) -> tuple[list[int], dict]:
    """A layer-skip search in at most 2L evaluations, not the L²/2 of a greedy one (which had not ended after 40
    minutes on SmolLM2-135M's 30 layers on 2 cores): first each layer but the last (the self drafter keeps it) is
    scored by the top-1 agreement with the target's own greedy tokens over `prompts` (the target continues each by
    SEARCH_TOKENS) with that layer alone dropped; then the layers are dropped in that order, the least missed
    first, while the estimated speedup (`estimated_speedup`, c from the weights a step reads: the kept layers and
    the LM head) grows, three steps past the best at most. Returns the kept layers and what was measured."""
    from specrt.export.acceptance import greedy
    a, L = target.args, target.args.num_layers
    per_layer = sum(p.numel() for p in target.model.layers[0].parameters())
    head = target.lm_head.weight.numel()
    with torch.no_grad():
        seqs = [torch.tensor([greedy(target, p[-(a.max_seq_len - SEARCH_TOKENS):], SEARCH_TOKENS)]) for p in prompts]
        starts = [len(p[-(a.max_seq_len - SEARCH_TOKENS):]) - 1 for p in prompts]
        want = [_all_logits(target, s).argmax(-1) for s in seqs]

        def agreement(layers: list[int]) -> float:
            model = self_model(target, layers)
            hits = sum(int((_all_logits(model, s).argmax(-1)[t:] == w[t:]).sum())
                       for s, t, w in zip(seqs, starts, want))
            return hits / sum(s.shape[1] - t for s, t in zip(seqs, starts))

        alone = {d: agreement([k for k in range(L) if k != d]) for d in range(L - 1)}
        order = sorted(alone, key=lambda d: (-alone[d], d))
        log(f"  self layers: each layer dropped alone, agreement {min(alone.values()):.3f} to "
            f"{max(alone.values()):.3f}; dropping in the order {', '.join(map(str, order))}")
        kept, steps, best = list(range(L)), [], None
        for drop in order:
            kept = [k for k in kept if k != drop]
            alpha = alone[drop] if not steps else agreement(kept)
            c = (len(kept) * per_layer + head) / (L * per_layer + head)
            speedup, gamma = estimated_speedup(alpha, c)
            steps.append({"dropped": drop, "layers": len(kept), "agreement": round(alpha, 4), "c": round(c, 4),
                          "estimated_speedup": round(speedup, 4), "gamma": gamma})
            log(f"  self layers: {len(kept)} of {L} (dropped {drop}): agreement {alpha:.3f}, c {c:.2f}, "
                f"estimated speedup {speedup:.2f} at γ {gamma}")
            if best is None or speedup > best[0]:
                best = (speedup, list(kept))
            elif len(steps) - 1 - next(i for i, s in enumerate(steps) if s["layers"] == len(best[1])) >= 3:
                break
    return best[1], {"alone": {str(d): round(x, 4) for d, x in alone.items()}, "steps": steps,
                     "positions": sum(s.shape[1] - t for s, t in zip(seqs, starts)), "prompts": len(prompts)}


def skip_graph(model: onnx.ModelProto, num_layers: int) -> onnx.ModelProto:
    """The target graph with its self drafters inside it: each layer but the last in an ONNX `If` on its entry of
    the bool input SKIP_INPUT (num_layers,), so that the layers a drafter keeps are chosen per pass (`specrt tune`
    measures several sets on the one engine). All false: the target. Layer i skipped: the hidden state passes it
    unchanged (the next layer's input norm is taken of the state that entered it), its cache is untouched and its
    written cache output an empty tensor (LayerSkipEngine leaves that output to ONNX Runtime: an If copies what its
    branch returns, and the cache itself, returned, was copied whole) and its new keys and values are scratch (the
    cache's first S positions). One session, one copy of the weights (and of ONNX Runtime's repacked ones): each
    layer is a subgraph over the outer graph's initializers. Made for the graphs that `specrt build` writes (checked on its
    fused ones, the default): the residual stream between layers i and i+1 is the tensor `/layers.i/Add_1_output_0`,
    and the one entering layer a is the first input of the node that writes `/layers.a/Add_output_0`."""
    from onnx import helper
    g = model.graph
    producer = {o: n for n in g.node for o in n.output if o}
    outputs = {o.name: o for o in g.output}
    # a fused graph takes layer a's input norm in the node that ends layer a − 1 (SkipSimplifiedLayerNormalization):
    # its attention reads that output, not the stream, and belongs to the layer as much as its MLP
    normed = {a + 1: n.output[0] for a in range(num_layers - 1)
              if (n := producer[f"/layers.{a}/Add_1_output_0"]).op_type == "SkipSimplifiedLayerNormalization"}
    for a in range(num_layers - 1):
        enter = producer[f"/layers.{a}/Add_output_0"].input[0]              # the residual stream entering layer a
        boundary = producer[f"/layers.{a}/Add_1_output_0"]                  # writes the stream leaving it
        inside = _between(g, {enter, normed.get(a, enter)}, boundary)
        moved = {id(n) for n in inside}   # (a NodeProto's == compares its contents)
        names = [o for n in inside for o in n.output if o]
        read_after = set().union(*(_reads(n) for n in g.node if id(n) not in moved))
        needed = [o for o in names if o in outputs or o in read_after]
        then_nodes, then_out = [], []
        for name in needed:
            out = f"{name}/skipped"
            if name == f"/layers.{a}/Add_1_output_0":
                then_nodes.append(helper.make_node("Identity", [enter], [out]))
            elif boundary.op_type == "SkipSimplifiedLayerNormalization" and name == boundary.output[0]:
                eps = next((x.f for x in boundary.attribute if x.name == "epsilon"), 1e-5)
                then_nodes.append(helper.make_node("SimplifiedLayerNormalization", [enter, boundary.input[2]],
                                                   [out], epsilon=eps, axis=-1))
            elif name.endswith("_written"):   # a cache, untouched: an empty tensor (B, Hkv, 0, D) stands for it
                cache = name[:-len("_written")]   # (the If copies a branch's outputs: the whole cache, 0.3 ms a
                then_nodes += [                    # layer at 1,900 positions on SmolLM2)
                    helper.make_node("Constant", [], [f"{out}/zero"], value_ints=[0]),
                    helper.make_node("Constant", [], [f"{out}/axis"], value_ints=[2]),
                    helper.make_node("Slice", [cache, f"{out}/zero", f"{out}/zero", f"{out}/axis"], [out])]
            elif name.startswith(("k_new_", "v_new_")):                      # (B, Hkv, S, D) of scratch
                cache = f"{name[0]}_cache_{name.split('_')[-1]}"
                then_nodes += [helper.make_node("Shape", ["input_ids"], [f"{out}/shape"], start=1, end=2),
                               helper.make_node("Constant", [], [f"{out}/zero"], value_ints=[0]),
                               helper.make_node("Constant", [], [f"{out}/axis"], value_ints=[2]),
                               helper.make_node("Slice", [cache, f"{out}/zero", f"{out}/shape", f"{out}/axis"],
                                                [out])]
            else:
                raise InputError(f"layer {a} of the target graph: {name!r} is read after it, and the self "
                                 "drafter has nothing to give for it")
            then_out.append(out)
        elem = outputs["hidden"].type.tensor_type.elem_type
        typed = lambda n: helper.make_tensor_value_info(                    # noqa: E731
            n, outputs[n].type.tensor_type.elem_type if n in outputs else elem, None)
        then = helper.make_graph(then_nodes, f"skip_{a}", [], [helper.make_tensor_value_info(
            o, typed(n).type.tensor_type.elem_type, None) for o, n in zip(then_out, needed)])
        run = helper.make_graph(inside, f"layer_{a}", [], [typed(n) for n in needed])
        cond = f"/layers.{a}/skip"
        nodes = [helper.make_node("Constant", [], [f"{cond}/index"], value=helper.make_tensor(
                     f"{cond}/index", onnx.TensorProto.INT64, [], [a])),
                 helper.make_node("Gather", [SKIP_INPUT, f"{cond}/index"], [cond], axis=0),
                 helper.make_node("If", [cond], needed, name=f"/layers.{a}/skip_if", then_branch=then,
                                  else_branch=run)]
        at = min(i for i, n in enumerate(g.node) if id(n) in moved)
        rest = [n for n in g.node if id(n) not in moved]
        del g.node[:]
        g.node.extend(rest[:at] + nodes + rest[at:])
        producer = {o: n for n in g.node for o in n.output if o}
    g.input.append(helper.make_tensor_value_info(SKIP_INPUT, onnx.TensorProto.BOOL, [num_layers]))
    return model


def _reads(node: onnx.NodeProto) -> set[str]:
    """The tensors a node reads, its subgraphs' reads of the outer scope included."""
    names = set(node.input)
    for attr in node.attribute:
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            names.update(*(_reads(n) for n in sub.node))
    return names


def _between(g: onnx.GraphProto, enter: set[str], boundary: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The nodes that depend on the tensors `enter`, up to and including `boundary` (none that depend on what
    `boundary` writes), in graph order."""
    reached, after, inside = set(enter), set(boundary.output), []
    for n in g.node:
        reads = _reads(n)
        if reads & after:
            after.update(n.output)
        elif reads & reached:
            inside.append(n)
            reached.update(n.output)
    assert any(n is boundary for n in inside), boundary.name
    return inside

