"""Build engines from the exported ONNX graphs: ONNX Runtime (graph optimisation, saved) or TensorRT."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from specrt.errors import BackendError
from specrt.manifest import check_file, file_entry, read_manifest, write_manifest


def tensorrt_available() -> bool:
    if importlib.util.find_spec("tensorrt") is None:
        return False
    try:
        import tensorrt  # noqa: F401  (the PyPI stub raises on import without NVIDIA's index)
        return True
    except Exception:
        return False


def build_ort(graph: Path, engine: Path, threads: int | None = None) -> None:
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(engine)
    if threads:
        options.intra_op_num_threads = threads
    ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])


def build_tensorrt(graph: Path, engine: Path, max_len: int) -> None:  # pragma: no cover - needs TensorRT
    """Parse the graph with the TreeAttention plugin registered (not verified: no TensorRT here)."""
    from specrt.plugins.tensorrt_plugin import build_engine
    build_engine(graph, engine, max_len)


def resolve_backend(requested: str) -> str:
    if requested == "auto":
        return "tensorrt" if tensorrt_available() else "onnxruntime"
    if requested == "tensorrt" and not tensorrt_available():
        raise BackendError("--backend tensorrt: TensorRT is not installed here (pip install 'specrt[gpu]' on an "
                           "NVIDIA machine); use --backend onnxruntime")
    return requested


def build(directory: str | os.PathLike, backend: str = "auto", log=print) -> dict:
    """Build every model of the engine set; each engine file is written beside its final name and renamed
    only when complete, and the manifest is updated atomically at the end."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    backend = resolve_backend(backend)
    if backend == "onnxruntime" and not tensorrt_available():
        log("TensorRT not installed: building ONNX Runtime engines")
    for role, spec in manifest["models"].items():
        graph = check_file(directory, spec["graph"], f"{role} graph")
        suffix = ".plan" if backend == "tensorrt" and role != "medusa" else ".ort.onnx"
        engine = directory / f"{role}{suffix}"
        partial = directory / f".{role}{suffix}.partial"
        try:
            if backend == "tensorrt" and role != "medusa":
                build_tensorrt(graph, partial, spec["max_seq_len"])
            else:
                build_ort(graph, partial)
            os.replace(partial, engine)
        finally:
            partial.unlink(missing_ok=True)
        spec["engine"] = {**file_entry(directory, engine.name),
                          "backend": "onnxruntime" if suffix == ".ort.onnx" else backend}
        log(f"built {role}: {engine}")
    manifest["backend"] = backend
    manifest.setdefault("tool_versions", {}).update(_versions(backend))
    write_manifest(directory, manifest)
    return manifest


def _versions(backend: str) -> dict:
    import onnxruntime
    out = {"onnxruntime": onnxruntime.__version__}
    if backend == "tensorrt":  # pragma: no cover
        import tensorrt
        out["tensorrt"] = tensorrt.__version__
    return out
