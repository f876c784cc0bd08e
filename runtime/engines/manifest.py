"""The engine directory's `manifest.json`: what each file is, with hashes the runtime checks."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specrt.errors import ManifestError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# a fused CPU graph's extra outputs: a cache input's name + this is that cache with the pass's new entries written
# at each row's past_len (bound to the input's own buffer, the engine writes them in place; see specrt.export.fuse)
WRITTEN = "_written"
# the bool scalar input of a target engine that holds the self drafter: true runs its kept layers only
# (specrt.export.self_spec.skip_graph)
SKIP_INPUT = "skip_layers"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def external_data(path: Path) -> list[str]:
    """The files an ONNX graph keeps its weights in (ONNX external data, relative to the graph's directory)."""
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    names = set()
    graphs = [model.graph]
    while graphs:
        g = graphs.pop()
        tensors = [*g.initializer, *(a.t for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR)]
        for t in tensors:
            names.update(e.value for e in t.external_data if e.key == "location")
        graphs += [a.g for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
    return sorted(names)


def file_entry(directory: Path, name: str, data: bool = True) -> dict:
    """{"file", "sha256"}, and for an ONNX graph with external data "data": the entries of its data files (`data`
    False: not listed, for graphs that share data files listed with another entry)."""
    directory = Path(directory)
    entry = {"file": name, "sha256": sha256_file(directory / name)}
    files = external_data(directory / name) if data and name.endswith(".onnx") else []
    if files:
        entry["data"] = [{"file": f, "sha256": sha256_file(directory / f)} for f in files]
    return entry


def logits_width(spec: dict) -> int:
    """Columns of a graph's logits: the vocabulary, or the kept ids of a drafter that outputs only theirs."""
    return spec["output_ids"]["count"] if "output_ids" in spec else spec["vocab_size"]


def write_manifest(directory: Path, manifest: dict) -> None:
    """Atomic: a reader sees the old manifest or the new one, never half of one."""
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, directory / MANIFEST)


def read_manifest(directory: str | os.PathLike) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{directory} has no {MANIFEST}: not an engine directory. "
                            f"Create one with `specrt export --out {directory}` then `specrt build {directory}`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path} is not valid JSON ({e}); re-run `specrt export`") from e
    if not isinstance(manifest, dict):
        raise ManifestError(f"{path} is not a JSON object; re-run `specrt export`")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path} has format_version {manifest.get('format_version')!r}, this specrt reads "
                            f"{FORMAT_VERSION}; re-export the engines with this version")
    return manifest


def check_file(directory: Path, entry: dict, what: str) -> Path:
    """The file an entry names, after checking that it and its data files (a graph's external weights) exist and
    that their sha256 match."""
    path = Path(directory) / entry["file"]
    for e, kind in [(entry, what), *((d, f"{what}'s weights") for d in entry.get("data", []))]:
        f = Path(directory) / e["file"]
        if not f.is_file():
            raise ManifestError(f"{kind}: {f} is listed in the manifest but missing; re-run `specrt build {directory}`")
        digest = sha256_file(f)
        if digest != e["sha256"]:
            raise ManifestError(f"{kind}: {f} has sha256 {digest[:12]}…, the manifest says {e['sha256'][:12]}…; "
                                f"the file was changed after it was built. Re-run `specrt export` and `specrt build`")
    return path
