"""Build engines from the exported ONNX graphs: ONNX Runtime (graph optimisation, saved) or TensorRT."""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from specrt.errors import BackendError
from specrt.engines.manifest import check_file, file_entry, read_manifest, write_manifest


def tensorrt_available() -> bool:
    if importlib.util.find_spec("tensorrt") is None:
        return False
    try:
        import tensorrt  # noqa: F401  (the PyPI stub raises on import without NVIDIA's index)
        return True
    except Exception:
        return False


def build_ort(graph: Path, engine: Path, threads: int | None = None) -> None:
    """ONNX Runtime's graph optimisations, saved: the graph `engine`, its weights in `engine`.data (see
    specrt.export.onnx_files)."""
    import onnxruntime as ort

    from specrt.export.onnx_files import MIN_EXTERNAL, data_path
    data_path(engine).unlink(missing_ok=True)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(engine)
    options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                     data_path(engine).name)
    options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                     str(MIN_EXTERNAL))
    options.add_session_config_entry("session.disable_prepacking", "1")   # it only writes the graph: no packed copy
    if threads:
        options.intra_op_num_threads = threads
    ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])


DRAFTER_ROLES = ("draft", "medusa", "eagle")
FUSED_ROLES = ("target", "self", "draft", "eagle")   # the graphs with decoder layers (TreeAttention, RoPE, RMSNorm)


def quantize_int8(graph: Path, out: Path) -> int:
    """Weights of the MatMuls with a constant weight as int8 (symmetric, one scale per output channel),
    activations quantized on the fly (ONNX Runtime dynamic quantization): about a quarter of the bytes to read
    per step. The MLPs' down projections stay float32: their input, the gated activation, has the outliers
    that one activation scale per tensor handles worst (quantizing them cost the default draft 3 points of
    agreement with the target on MT-Bench, 0.297 against 0.328; per-tensor weight scales 1 more). Only drafters
    get this: what they propose is verified by the float32 target, so outputs do not change. Weights take 7 bits
    (`reduce_range`): on a CPU with AVX2 but no VNNI, ONNX Runtime's u8 x s8 kernel sums pairs of products in
    int16, which full-range weights overflow (saturating: a drafter equal to a tiny target agreed with it on 84 %
    of greedy tokens instead of over 95 %). A Gather of a table that int8 blocks hold exactly (a copy of the default
    target's GGUF Q8_0 embedding) becomes a GatherBlockQuantized of those blocks, the same values in a quarter of
    the bytes (`exact_block_gathers`); returns how many."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    from specrt.export import onnx_files
    nodes = onnx_files.load(graph, weights=False).graph.node
    keep = [n.name for n in nodes if n.op_type == "MatMul" and "down_proj" in n.name]
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer's advice to pre-process does not apply to these graphs
    try:
        quantize_dynamic(graph, out, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                         per_channel=True, reduce_range=True, nodes_to_exclude=keep,
                         extra_options={"MatMulConstBOnly": True}, use_external_data_format=True)
    finally:
        root.setLevel(level)
    return exact_gathers_file(out, out)


def exact_gathers_file(graph: Path, out: Path) -> int:
    """`exact_block_gathers` on a graph file, written to `out` where it rewrote any Gather; returns how many."""
    from specrt.export import onnx_files
    from specrt.export.quantize import exact_block_gathers
    model = onnx_files.load(graph, weights=False)
    gathers = exact_block_gathers(model, graph.parent)
    if gathers:
        onnx_files.save(model, out, graph.parent)
    return gathers


TENSORRT_WEIGHTS = "float16"   # TensorRT engines are built with its FP16 flag (inputs, outputs, caches float32)


def build_tensorrt(graph: Path, engine: Path, max_len: int) -> None:  # pragma: no cover - needs TensorRT
    """Parse the graph with the TreeAttention plugin registered (not verified: no TensorRT here)."""
    from specrt.plugins.tensorrt_plugin import build_engine
    build_engine(graph, engine, max_len, fp16=TENSORRT_WEIGHTS == "float16")


def resolve_backend(requested: str) -> str:
    """"auto" is ONNX Runtime, wherever TensorRT imports too: the TensorRT backend is not verified (no TensorRT
    on the machines specrt is tested on), so it is built only when asked for by name."""
    if requested == "auto":
        return "onnxruntime"
    if requested == "tensorrt" and not tensorrt_available():
        raise BackendError("--backend tensorrt: TensorRT is not installed here (pip install 'specrt[gpu]' on an "
                           "NVIDIA machine); use --backend onnxruntime")
    return requested


DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "float16", "bfloat16")
WIDTHS = (1, 2, 4, 8, 16, 32, 64)   # verification widths that get a static-shape target graph on CUDA


def resolve_dtype(device: str, dtype: str | None) -> str:
    if device not in DEVICES:
        raise BackendError(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    dtype = dtype or ("float16" if device == "cuda" else "float32")
    if dtype not in DTYPES:
        raise BackendError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if device == "cpu" and dtype != "float32":
        raise BackendError(f"--dtype {dtype} is for CUDA engines: add --device cuda, or use --dtype float32")
    return dtype


TARGET_WEIGHTS = ("float32", "int8", "int4")


def build(directory: str | os.PathLike, backend: str = "auto", log=print, drafter_weights: str = "int8",
          device: str = "cpu", dtype: str | None = None, widths: tuple[int, ...] = WIDTHS,
          target_weights: str = "float32", fuse: bool = True, memory_limit: float | None = None) -> dict:
    """Build every model of the engine set; each engine file is written beside its final name and renamed
    only when complete, and the manifest is updated atomically at the end. `drafter_weights` "int8" quantizes
    the draft model's and the Medusa heads' ONNX Runtime engines (see `quantize_int8`). `target_weights`
    "int8" or "int4" gives the target 8- or 4-bit block weights (see `specrt.export.quantize`);
    the target verifies every token, so the output is the quantized target's own. `device` "cuda" builds ONNX
    Runtime engines for the CUDA provider instead (see `specrt.export.cuda_build`: `dtype` weights and compute,
    static-shape target graphs for `widths`). `fuse` rewrites the ONNX Runtime CPU engines of the target and the
    drafters with a decoder graph (draft, eagle) into fewer, fused nodes (see `specrt.export.fuse`). A build that
    would not fit in `memory_limit` bytes (default: what the machine has available; inf: no check) is refused
    before it starts."""
    if drafter_weights not in ("int8", "float32"):
        raise BackendError(f"drafter weights {drafter_weights!r}: expected 'int8' or 'float32'")
    if target_weights not in TARGET_WEIGHTS:
        raise BackendError(f"target weights {target_weights!r}: expected one of {', '.join(TARGET_WEIGHTS)}")
    if target_weights != "float32" and (device != "cpu" or backend == "tensorrt"):
        raise BackendError(f"--target-weights {target_weights} is for ONNX Runtime CPU engines: drop --device "
                           "and --backend tensorrt, or use --target-weights float32")
    dtype = resolve_dtype(device, dtype)
    directory = Path(directory)
    manifest = read_manifest(directory)
    if memory_limit != float("inf"):
        _check_memory(directory, manifest, "cuda" if device == "cuda" else target_weights, memory_limit)
    if device == "cuda":
        if backend == "tensorrt":
            raise BackendError("--device cuda builds ONNX Runtime engines; TensorRT engines are built without "
                               "--device (use --backend onnxruntime, or drop --device)")
        from specrt.export.cuda_build import build_cuda
        backend = "onnxruntime"
        build_cuda(directory, manifest, dtype, widths, log)
    else:
        if backend == "auto" and tensorrt_available():
            log("TensorRT is installed but its backend is not verified: building ONNX Runtime engines "
                "(--backend tensorrt builds TensorRT ones)")
        backend = resolve_backend(backend)
        if target_weights != "float32":
            backend = "onnxruntime"
        for role, spec in sorted(manifest["models"].items(), key=lambda kv: kv[0] == "self"):   # self last
            if role == "self" and backend == "onnxruntime":   # it runs in the target's engine (self_spec.skip_graph)
                spec["engine"] = {**manifest["models"]["target"]["engine"], "layer_skip": "target",
                                  "own_weight_bytes": 0}
                from specrt.export.onnx_files import remove
                from specrt.export.self_spec import layer_ranges
                remove(directory / "self.ort.onnx")   # an engine of its own, from an earlier build
                log(f"built self: the target's engine on its skip_layers input, layers "
                    f"{layer_ranges(spec['kept_layers'])} (`specrt tune` measures other sets)")
                continue
            spec["engine"] = _build_role(directory, role, spec, backend, drafter_weights, target_weights, fuse,
                                         manifest["models"].get("self", {}).get("kept_layers"))
            log(f"built {role} ({spec['engine']['weights']} weights): {directory / spec['engine']['file']}")
            for kind, e in spec["engine"].get("quantized", {}).get("requantized", {}).items():
                log(f"  {e['tensors']} {kind} weights of the GGUF file requantized to {target_weights} (no exact "
                    f"mapping): relative RMS error {e['relative_rms_error']:.2%}, largest {e['max_abs_error']:.3g}")
    manifest["backend"] = backend
    manifest.setdefault("tool_versions", {}).update(_versions(backend))
    write_manifest(directory, manifest)
    return manifest


def _check_memory(directory: Path, manifest: dict, kind: str, limit: float | None) -> None:
    """Refuse, before any work, a build whose largest model will not fit (the models are built one at a time)."""
    from specrt.export import memory
    sizes = [(memory.graph_float32_bytes(directory / spec["graph"]["file"]), role)   # checked when built
             for role, spec in manifest["models"].items()]
    size, role = max(sizes)
    kind = kind if role == "target" else "float32"
    advice = "Build with --target-weights int4 (about " \
        f"{memory.build_need(size, 'int4') / memory.GB:.1f} GB)" if kind == "float32" and role == "target" \
        else "Use a machine with more memory"
    memory.check(f"building the {role} of {directory}", memory.build_need(size, kind),
                 f"{size / memory.GB:.1f} GB of float32 weights, {kind} engine", limit, advice)


def _build_role(directory: Path, role: str, spec: dict, backend: str, drafter_weights: str,
                target_weights: str = "float32", fuse: bool = False, self_layers: list[int] | None = None) -> dict:
    """Build one model's engine in a scratch directory beside the set (every step writes a graph and its data file
    there), then move the engine and its data file into place. `self_layers`: the self drafter's kept layers (the
    set has one): the target's ONNX Runtime engine gets the `skip_layers` input (specrt.export.self_spec.skip_graph)
    that runs it, on any set of layers."""
    from specrt.export.onnx_files import data_path, float32_file, remove
    graph = check_file(directory, spec["graph"], f"{role} graph")
    suffix = ".plan" if backend == "tensorrt" and role != "medusa" else ".ort.onnx"
    engine = directory / f"{role}{suffix}"
    weights, extra = "float32", {}
    for stale in directory.glob(f".{role}.build-*"):   # left by a killed build
        shutil.rmtree(stale, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix=f".{role}.build-", dir=directory) as scratch:
        work = Path(scratch)
        built = work / engine.name
        if backend == "tensorrt" and role != "medusa":
            build_tensorrt(graph, built, spec["max_seq_len"])
            weights = TENSORRT_WEIGHTS
        else:
            source = float32_file(graph, work / "float32.onnx")   # the graph itself if exported in float32
            as_target = role in ("target", "self")   # the self drafter: the target over some of its layers
            if as_target and target_weights != "float32":
                from specrt.export.quantize import quantize_target
                extra["quantized"] = quantize_target(source, work / "quantized.onnx", spec, target_weights)
                extra["activations"] = "int8"   # per token and block: trees verify as chains (see Generator)
                source, weights = work / "quantized.onnx", target_weights
            elif role in DRAFTER_ROLES and drafter_weights == "int8":
                if quantize_int8(source, work / "quantized.onnx"):
                    extra["embedding"] = "int8 blocks (exact)"
                source, weights = work / "quantized.onnx", "int8"
            elif as_target and exact_gathers_file(source, work / "gathers.onnx"):   # a GGUF Q8_0 embedding
                extra["embedding"] = "int8 blocks (exact)"
                source = work / "gathers.onnx"
            if role in FUSED_ROLES and fuse:
                extra["fused"] = fuse_file(source, work / "fused.onnx", spec)
                source = work / "fused.onnx"
            build_ort(source, built)
            if role == "target" and self_layers:
                import onnx

                from specrt.export.self_spec import skip_graph
                graph_only = onnx.load(str(built), load_external_data=False)
                onnx.save_model(skip_graph(graph_only, spec["layers"]), str(built))
                extra["layer_skip"] = "per layer"   # SKIP_INPUT: one entry per layer
        remove(engine)   # the old engine and its data file
        for f in (built, data_path(built)):
            if f.exists():
                os.replace(f, directory / f.name)
    return {**file_entry(directory, engine.name), "weights": weights,
            "backend": "onnxruntime" if suffix == ".ort.onnx" else backend, **extra}


def fuse_file(graph: Path, out: Path, spec: dict) -> dict:
    """Write `graph` rewritten into fewer, fused ONNX Runtime nodes to `out`; return what was fused."""
    from specrt.export import onnx_files
    from specrt.export.fuse import fuse_graph
    model, counts = fuse_graph(onnx_files.load(graph, weights=False), spec, graph.parent)
    onnx_files.save(model, out, graph.parent)   # what was not rewritten is copied from graph's data file
    return counts


def _versions(backend: str) -> dict:
    import onnxruntime
    out = {"onnxruntime": onnxruntime.__version__}
    if backend == "tensorrt":  # pragma: no cover
        import tensorrt
        out["tensorrt"] = tensorrt.__version__
    return out
