"""`specrt export`: load the models, trace each to ONNX, save the tokenizer, write the manifest."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from specrt.errors import InputError, ManifestError
from specrt.export import acceptance, memory
from specrt.export.onnx_export import DTYPES, export_graph, model_entry
from specrt.export.acceptance import eagle_proposer, medusa_proposer
from specrt.export.eagle import export_eagle, load_eagle, layout as eagle_layout
from specrt.export.eagle3 import is_eagle3, load_eagle3, proposer as eagle3_proposer
from specrt.export.medusa import export_heads, load_heads, layout as medusa_layout, shipped_tree
from specrt.export.model import from_hf
from specrt.export.mtp import export_mtp, find_mtp, load_mtp
from specrt.export.self_spec import export_self
from specrt.export.sources import VOCAB_FILE, load_source
from specrt.decoding import vocab_map
from specrt.engines.manifest import FORMAT_VERSION, MANIFEST, file_entry, read_manifest, sha256_file, write_manifest
from specrt.files import StagingDir

DEFAULT_MAX_SEQ_LEN = 2048


def _max_len(model, requested: int, log=print) -> int:
    """The graph's max_seq_len: the request, capped at the positions the model was trained for, and for a
    longrope model (Phi-3) at its original context: past it transformers switches every position to the long
    factors once the sequence grows there, which no static rope table (nor cache) can follow."""
    limits = [("max_position_embeddings", getattr(model.config, "max_position_embeddings", None))]
    rope = getattr(model.config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        original = rope.get("original_max_position_embeddings") or \
            getattr(model.config, "original_max_position_embeddings", None)
        limits.append(("longrope original_max_position_embeddings", original))
    for name, limit in limits:
        if limit and limit < requested:
            log(f"--max-seq-len {requested} is more than the model's {name} ({limit}): using {limit}")
            requested = int(limit)
    return requested


def _check_replaceable(out: Path) -> None:
    """--force replaces an engine set (a directory whose manifest.json reads as specrt's: its format version, its
    models) or an empty directory, nothing else: a mistyped --out must not delete someone's folder, nor a web app's
    or an extension's, which have a manifest.json of their own."""
    if out.is_dir() and not any(out.iterdir()):
        return
    if out.is_dir() and (out / MANIFEST).is_file():
        try:
            models = read_manifest(out).get("models")
            why = None if isinstance(models, dict) and isinstance(models.get("target"), dict) else \
                f"its {MANIFEST} names no target model"
        except ManifestError as e:   # "<what is wrong>; <the fix for an engine set>": the what
            why = str(e).split("; ")[0]
        if why is None:
            return
        raise InputError(f"--out {out} is not a specrt engine set ({why}): --force replaces only an engine set. "
                         f"Choose another --out, or move {out} away yourself")
    if out.exists() or out.is_symlink():
        what = "a directory without manifest.json (not an engine set)" if out.is_dir() else "not a directory"
        raise InputError(f"--out {out} is {what}: --force replaces only an engine set. Choose another --out, or "
                         f"move {out} away yourself")


def _check_memory(target: str, draft: str | None, dtype: str, limit: float | None) -> None:
    """Refuse, before loading anything, an export that will not fit (the larger model's weights in `dtype`), or
    whose source specrt does not export (sizing a source checks it)."""
    sizes = [(n, s) for s in (target, draft) if s is not None and (n := memory.parameters(s))]
    if not sizes or limit == float("inf"):
        return
    params, source = max(sizes)
    smaller = "" if dtype != "float32" else \
        f"Export with --dtype bfloat16 (about {memory.export_need(params, 'bfloat16') / memory.GB:.1f} GB)"
    memory.check(f"exporting {source}", memory.export_need(params, dtype),
                 f"{params / 1e9:.2f} B parameters, {params * memory.BYTES[dtype] / memory.GB:.1f} GB in {dtype}",
                 limit, smaller or "Use a machine with more memory")


def _vocab_map(target_tokenizer, src, target_vocab: int, target: str, log=print) -> dict | None:
    """None where the draft shares the target's vocabulary (same size, and the same tokens where both have a
    tokenizer); else the map of a drafter of another vocabulary (specrt.decoding.vocab_map)."""
    draft_vocab = src.model.config.vocab_size
    tokenizers = target_tokenizer is not None and src.tokenizer is not None
    if draft_vocab == target_vocab and (not tokenizers or target_tokenizer.get_vocab() == src.tokenizer.get_vocab()):
        return None
    if not tokenizers:
        missing = "the target" if target_tokenizer is None else f"the draft {src.name!r}"
        raise ManifestError(f"draft {src.name!r} has vocab size {draft_vocab}, target {target!r} has {target_vocab}, "
                            f"and {missing} has no tokenizer: a draft of another vocabulary is mapped through both "
                            "tokenizers. Add its tokenizer.json, or use a draft of the target's vocabulary")
    if src.vocab_subset:
        raise InputError(f"draft {src.name!r} keeps {len(src.vocab_subset)} output ids ({VOCAB_FILE}) and has "
                         f"another vocabulary than the target's: delete {VOCAB_FILE} to keep all its ids")
    mapped = vocab_map.build(target_tokenizer, src.tokenizer, target_vocab, draft_vocab)
    shared, expand = len(mapped["shared"]["draft"]), mapped["expand"]
    log(f"the draft's vocabulary ({draft_vocab}) is not the target's ({target_vocab}): it drafts the {shared} tokens "
        f"whose bytes are one target token ({shared / target_vocab:.1%} of the target's); a target token reads as "
        f"{len(expand['ids']) / target_vocab:.2f} draft tokens on average")
    return mapped


def check_acceptance(target, propose, prompts: list[list[int]], src, what: str, causes: str, log=print) -> dict:
    """The imported drafter's first-draft-token acceptance (see `specrt.export.acceptance`), for the manifest; a
    loud warning where it is near zero (`causes`: what breaks an import of this kind of drafter)."""
    measured = acceptance.measure(target, propose, prompts, eos=tuple(src.eos_token_ids))
    log(f"{what}: {measured.rate:.0%} of first draft tokens accepted (greedy, {measured.positions} positions)")
    warning = measured.warning(what, causes)
    if warning is None:
        return measured.entry()
    log(warning)
    return {**measured.entry(), "warning": warning}


def _export_eagle3(drafter, source: str, tmp: Path, eos: list[int], dtype: str, models: dict, log) -> None:
    """The EAGLE-3 drafter's graph and manifest entry: `kind` "eagle3", the width of the target states it reads
    (`aux_size`), and its draft ids' target ids (`output_ids`) where they are not the identity."""
    from specrt.export.eagle3 import export_eagle3
    log(f"tracing the EAGLE-3 drafter to ONNX (target layers {list(drafter.aux_layers)}, "
        f"{drafter.config.draft_vocab_size} draft ids)")
    export_eagle3(drafter, tmp / "eagle.onnx", dtype)
    entry = models["eagle"] = model_entry(drafter, source, "eagle.onnx", tmp, eos, dtype)
    entry.update(kind="eagle3", aux_size=drafter.fc.in_features, aux_layers=list(drafter.aux_layers))
    if drafter.draft_ids is not None:
        ids = drafter.draft_ids.tolist()
        (tmp / "eagle_vocab.json").write_text(json.dumps({"kept_ids": ids}) + "\n")
        entry["output_ids"] = {**file_entry(tmp, "eagle_vocab.json"), "count": len(ids)}


def export_engines(target: str, out: str | os.PathLike, draft: str | None = None,
                   max_seq_len: int = DEFAULT_MAX_SEQ_LEN, force: bool = False, log=print,
                   medusa: str | None = None, eagle: str | None = None, dtype: str = "float32",
                   memory_limit: float | None = None, eagle_layer_ids: str | None = None,
                   check_drafters: bool = True, self_layers: str | None = None) -> Path:
    """Trace the models to the ONNX graphs of an engine directory `out`, their weights in `dtype` ("float32",
    "float16" or "bfloat16": checkpoints are read in it, so that a model takes its size in that dtype in memory, once;
    CUDA engines run it as it is, CPU engines are built from it as float32 or quantized). An export that would not
    fit in `memory_limit` bytes (default: what the machine has available; inf: no check) is refused first.
    An EAGLE-3 checkpoint as `eagle` (see specrt.export.eagle3; `eagle_layer_ids` "inputs" or "outputs" says how to
    read the layer ids its config names) gives the target graph the `aux` output it reads. `self_layers` ("auto",
    "half" or a list such as "0-14,29") adds the `self` drafter: the target over those layers, on its weights (see
    specrt.export.self_spec)."""
    out = Path(out)
    # check_drafters False (`--no-acceptance-check`): each imported drafter's acceptance is not measured (about 16
    # target passes per prompt), and the manifest says so
    checked = check_acceptance if check_drafters else lambda *_, **__: {"skipped": "--no-acceptance-check"}
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if max_seq_len < 2:
        raise InputError(f"--max-seq-len {max_seq_len}: must be at least 2")
    if out.exists() and not force:
        raise InputError(f"{out} already exists; pass --force to replace it (it is replaced only once the new "
                         "export is complete)")
    _check_replaceable(out)
    _check_memory(target, draft, dtype, memory_limit)
    import torch
    import onnx
    import transformers
    started = time.time()
    models, trees = {}, {}
    with StagingDir(out, force) as tmp:
        tokenizer = None
        for role, source in (("target", target), ("draft", draft)):
            if source is None:
                continue
            log(f"loading {role} {source}")
            src = load_source(source, DTYPES[dtype])
            mapped = _vocab_map(tokenizer, src, models["target"]["vocab_size"], target, log) \
                if role == "draft" else None
            tokenizer = tokenizer or src.tokenizer
            # a draft of another vocabulary may read a text as more tokens than the target: room for twice as many
            length = max_seq_len * (1 if mapped is None else 2)
            model = from_hf(src.model, _max_len(src.model, length, log), src.vocab_subset)
            src.model = None   # the graph's model holds the weights now (the same tensors)
            prompts = acceptance.prompt_ids(src.tokenizer, model.args.vocab_size)
            kept = f", {len(src.vocab_subset)} output ids kept" if src.vocab_subset else ""
            eagle3 = load_eagle3(eagle, model, eagle_layer_ids) if role == "target" and eagle is not None and \
                is_eagle3(eagle) else None
            if eagle3 is not None:
                model.aux_layers = eagle3.aux_layers
            log(f"tracing {role} to ONNX ({model.args.num_layers} layers, vocab {model.args.vocab_size}{kept}, "
                f"max_seq_len {model.args.max_seq_len}, {dtype} weights)")
            export_graph(model, tmp / f"{role}.onnx", dtype)
            models[role] = model_entry(model, source, f"{role}.onnx", tmp, src.eos_token_ids, dtype)
            if eagle3 is not None:
                models[role]["aux"] = {"layers": list(eagle3.aux_layers),
                                       "size": len(eagle3.aux_layers) * model.args.hidden_size}
                _export_eagle3(eagle3, str(eagle), tmp, src.eos_token_ids, dtype, models, log)
                models["eagle"]["acceptance"] = checked(
                    model, eagle3_proposer(eagle3), prompts, src, f"the EAGLE-3 drafter {eagle}",
                    "a missing or wrong d2t, or layer ids read in the other convention: --eagle-layer-ids", log)
            if role == "target" and self_layers is not None:   # the target's own layers as its drafter
                models["self"] = export_self(model, self_layers, source, tmp, src.eos_token_ids, dtype, prompts, log)
            if src.vocab_subset:
                models[role]["output_vocab"] = len(src.vocab_subset)
            if mapped is not None:   # a draft of another vocabulary: its map, checked at load like every file
                (tmp / vocab_map.FILE).write_text(json.dumps(mapped, separators=(",", ":")) + "\n")
                models[role]["vocab_map"] = {**file_entry(tmp, vocab_map.FILE),
                                             "shared": len(mapped["shared"]["draft"])}
            if src.gguf_file is not None and dtype == "float32":   # `--target-weights int4` reuses the file's blocks
                models[role]["gguf"] = {"path": str(src.gguf_file.resolve()),
                                        "sha256": sha256_file(src.gguf_file)}
            if role == "target" and medusa is not None:
                heads = load_heads(medusa, model, log)
                tree = shipped_tree(medusa, heads.num_heads)
                log(f"tracing {heads.num_heads} Medusa heads ({medusa_layout(medusa)} layout) to ONNX")
                export_heads(heads, tmp / "medusa.onnx", dtype)
                models["medusa"] = {"source": str(medusa), "layout": medusa_layout(medusa),
                                    "num_heads": heads.num_heads,
                                    "root_token": heads.root_token, "sequential": heads.sequential,
                                    "hidden_size": model.args.hidden_size, "vocab_size": model.args.vocab_size,
                                    "dtype": dtype, "graph": file_entry(tmp, "medusa.onnx"),
                                    "acceptance": checked(model, medusa_proposer(heads), prompts, src,
                                                          f"the Medusa heads {medusa}",
                                                          "heads or layers read in the wrong order", log)}
                if tree is not None:   # the heads' own tree; `specrt tune-tree` replaces it for this machine
                    tree.save(tmp / "tree_medusa.json")
                    trees["medusa"] = file_entry(tmp, "tree_medusa.json")
            if role == "target" and eagle is not None and eagle3 is None:
                drafter = load_eagle(eagle, model)
                log(f"tracing the EAGLE drafter ({eagle_layout(eagle)} layout) to ONNX")
                export_eagle(drafter, tmp / "eagle.onnx", dtype)
                models["eagle"] = model_entry(drafter, str(eagle), "eagle.onnx", tmp, src.eos_token_ids, dtype)
                models["eagle"]["layout"] = eagle_layout(eagle)
                models["eagle"]["acceptance"] = checked(model, eagle_proposer(drafter), prompts, src,
                                                        f"the EAGLE drafter {eagle}",
                                                        "fc's halves in the wrong order", log)
                if drafter.vocab_index is not None:   # its logits are over these ids (see specrt.export.eagle)
                    ids = drafter.vocab_index.tolist()
                    (tmp / "eagle_vocab.json").write_text(json.dumps({"kept_ids": ids}) + "\n")
                    models["eagle"]["output_ids"] = {**file_entry(tmp, "eagle_vocab.json"), "count": len(ids)}
            if role == "target" and eagle is not None and find_mtp(source):
                log(f"the MTP module of {source} is not exported: --eagle takes the feature drafter's place")
            mtp = load_mtp(source, model) if role == "target" and eagle is None else None
            if mtp is not None:   # the checkpoint's own MTP module as the feature drafter (see specrt.export.mtp)
                log(f"tracing the target's MTP module ({mtp[1]}) to ONNX (--method mtp)")
                models["eagle"] = export_mtp(*mtp, source, tmp, src.eos_token_ids, dtype)
                models["eagle"]["acceptance"] = checked(model, eagle_proposer(mtp[0]), prompts, src,
                                                        f"the MTP module of {source}",
                                                        "enorm and hnorm, or eh_proj's halves, swapped", log)
        manifest = {"format_version": FORMAT_VERSION, "models": models, "backend": None,
                    "tool_versions": {"torch": torch.__version__, "onnx": onnx.__version__,
                                      "transformers": transformers.__version__}}
        if trees:
            manifest["trees"] = trees
        if tokenizer is not None:
            saved = tokenizer.save_pretrained(tmp / "tokenizer")
            manifest["tokenizer"] = [file_entry(tmp, str(Path(p).relative_to(tmp))) for p in saved
                                     if Path(p).is_file()]
        write_manifest(tmp, manifest)
    log(f"exported {out} in {time.time() - started:.0f}s")
    return out
