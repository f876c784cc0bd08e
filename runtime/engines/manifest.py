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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def file_entry(directory: Path, name: str) -> dict:
    return {"file": name, "sha256": sha256_file(directory / name)}


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
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestError(f"{path} has format_version {manifest.get('format_version')!r}, this specrt reads "
                            f"{FORMAT_VERSION}; re-export the engines with this version")
    return manifest


def check_file(directory: Path, entry: dict, what: str) -> Path:
    """The file an entry names, after checking it exists and its sha256 matches."""
    path = Path(directory) / entry["file"]
    if not path.is_file():
        raise ManifestError(f"{what}: {path} is listed in the manifest but missing; re-run `specrt build {directory}`")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        raise ManifestError(f"{what}: {path} has sha256 {digest[:12]}…, the manifest says {entry['sha256'][:12]}…; "
                            f"the file was changed after it was built. Re-run `specrt export` and `specrt build`")
    return path
