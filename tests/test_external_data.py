"""Every graph specrt writes keeps its weights as ONNX external data (one code path whatever the model's size: past
2 GiB a protobuf cannot hold them), the manifest hashes the data files and the runtime checks them when it loads;
exports in float16/bfloat16; the memory check before an export or a build. Real-size runs: `make check-large`."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from conftest import tiny_model
from greedy_check import assert_same_or_tie
from specrt.decoding.generate import Generator
from specrt.engines.manifest import read_manifest
from specrt.engines.static import StaticWidthEngine
from specrt.errors import ManifestError, MemoryLimitError
from specrt.export.build import build
from specrt.export.model import from_hf
from specrt.export.onnx_files import MIN_EXTERNAL
from specrt.export.pipeline import export_engines

V = 64
QUIET = dict(log=lambda *_: None)


def _export(tmp, name, dtype="float32", **kw):
    model = tiny_model("llama", seed=3, vocab=V, init=0.3)
    src = tmp / f"{name}-src"
    model.save_pretrained(src)
    draft = tiny_model("llama", seed=4, vocab=V, init=0.3)
    draft.save_pretrained(tmp / f"{name}-draft")
    out = tmp / name
    export_engines(str(src), out, draft=str(tmp / f"{name}-draft"), max_seq_len=64, dtype=dtype, **QUIET, **kw)
    return out, model


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """One tiny export (target and draft) built three ways: float32 and int4 CPU engines, CUDA float32 engines."""
    tmp = tmp_path_factory.mktemp("external")
    fp32, model = _export(tmp, "fp32")
    built = {}
    for name, kw in (("int4", dict(target_weights="int4")), ("cuda", dict(device="cuda", widths=(1, 2, 4)))):
        built[name] = tmp / name
        shutil.copytree(fp32, built[name])
        build(built[name], "onnxruntime", **QUIET, **kw)
    build(fp32, "onnxruntime", **QUIET)
    return {"float32": fp32, **built}, model


def graph_entries(manifest: dict):
    """(what, entry) of every ONNX graph the manifest lists: exported graphs, engines, width graphs."""
    for role, spec in manifest["models"].items():
        yield f"{role} graph", spec["graph"]
        engine = spec.get("engine", {})
        if engine.get("file", "").endswith(".onnx"):
            yield f"{role} engine", engine
        for w, entry in engine.get("widths", {}).items():
            yield f"{role} width {w}", entry


@pytest.mark.parametrize("kind", ["float32", "int4", "cuda"])
def test_every_graph_keeps_its_weights_outside(sets, kind):
    directory = sets[0][kind]
    manifest = read_manifest(directory)
    for what, entry in graph_entries(manifest):
        graph = onnx.load(str(directory / entry["file"]), load_external_data=False).graph
        inline = [t.name for t in graph.initializer if t.data_location != TensorProto.EXTERNAL
                  and len(t.raw_data) >= MIN_EXTERNAL]
        external = {e.value for t in graph.initializer for e in t.external_data if e.key == "location"}
        assert external and not inline, f"{what}: inline weights {inline[:3]}"
        if "width" in what:   # the width graphs share the engine's weights file, listed (and checked) with it
            assert external == {d["file"] for d in manifest["models"][what.split()[0]]["engine"]["data"]}
        else:
            assert external == {d["file"] for d in entry["data"]}, what


def test_float32_engines_match_transformers(sets):
    directory, model = sets[0]["float32"], sets[1]
    gen = Generator.from_engines(directory)
    for seed in range(3):
        prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, 6:].tolist()
        for method in ("autoregressive", "draft"):
            assert_same_or_tie(gen.generate(prompt_ids=prompt, max_new_tokens=20, method=method).token_ids[0],
                               want, prompt, model)


def test_cuda_width_graphs_match_transformers_on_the_cpu_provider(sets):
    gen = Generator.from_engines(sets[0]["cuda"], device="cpu")
    assert isinstance(gen.target, StaticWidthEngine)
    model = sets[1]
    for seed in range(2):
        prompt = torch.randint(0, V, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, 5:].tolist()
        assert_same_or_tie(gen.generate(prompt_ids=prompt, max_new_tokens=16, method="draft").token_ids[0],
                           want, prompt, model)


def test_int4_engine_loads_and_speculation_keeps_its_output(sets):
    gen = Generator.from_engines(sets[0]["int4"])
    assert read_manifest(sets[0]["int4"])["models"]["target"]["engine"]["weights"] == "int4"
    prompt = [5, 9, 5, 9, 12, 5, 9]
    own = gen.generate(prompt_ids=prompt, max_new_tokens=20).token_ids[0]
    for method in ("ngram", "draft"):
        assert gen.generate(prompt_ids=prompt, max_new_tokens=20, method=method).token_ids[0] == own


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind,file,opens", [
    ("float32", "target.ort.onnx.data", "generate"),      # an engine's weights
    ("float32", "target.onnx.data", "build"),             # an exported graph's weights
    ("cuda", "target.cuda.weights", "generate"),          # the CUDA engines' shared weights file
])
def test_a_changed_weights_file_is_refused(sets, tmp_path, kind, file, opens):
    copy = tmp_path / "set"
    shutil.copytree(sets[0][kind], copy)
    _flip_last_byte(copy / file)
    with pytest.raises(ManifestError, match=rf"{file} has sha256 .* the file was changed after it was built. Re-run"):
        if opens == "generate":
            Generator.from_engines(copy, device="cpu")
        else:
            build(copy, "onnxruntime", **QUIET)


def test_a_missing_weights_file_is_refused(sets, tmp_path):
    copy = tmp_path / "set"
    shutil.copytree(sets[0]["float32"], copy)
    (copy / "draft.ort.onnx.data").unlink()
    with pytest.raises(ManifestError, match="draft engine's weights: .*draft.ort.onnx.data is listed in the manifest "
                                            "but missing"):
        Generator.from_engines(copy)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_export(tmp_path, dtype):
    """The graph stores its weights in `dtype` (half the bytes) and reads them through Casts to float32; the CPU
    engine built from it gives transformers' tokens with the same rounded weights."""
    out, model = _export(tmp_path, dtype, dtype=dtype)
    spec = read_manifest(out)["models"]["target"]
    assert spec["dtype"] == dtype
    graph = onnx.load(str(out / "target.onnx"), load_external_data=False).graph
    code = {"bfloat16": TensorProto.BFLOAT16, "float16": TensorProto.FLOAT16}[dtype]
    stored = [t for t in graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert stored and {t.data_type for t in stored} == {code}
    build(out, "onnxruntime", **QUIET)
    assert read_manifest(out)["models"]["target"]["engine"]["weights"] == "float32"
    rounded = tiny_model("llama", seed=3, vocab=V, init=0.3)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(getattr(torch, dtype)).float())
    gen = Generator.from_engines(out)
    for seed in range(3):
        prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = rounded.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, 6:].tolist()
        assert_same_or_tie(gen.generate(prompt_ids=prompt, max_new_tokens=20).token_ids[0], want, prompt, rounded)


def test_export_shares_the_checkpoint_tensors():
    """The traced model takes the loaded checkpoint's tensors: no second copy of the weights while exporting."""
    hf = tiny_model("llama", seed=3, vocab=V)
    spec = from_hf(hf, 32)
    for name, tensor in hf.state_dict().items():
        if not name.endswith("inv_freq"):
            assert spec.state_dict()[name].data_ptr() == tensor.data_ptr(), name


def test_memory_check_refuses_before_any_work(tmp_path):
    model = tiny_model("llama", seed=3, vocab=V)
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(MemoryLimitError, match=r"exporting .*src \(0\.00 B parameters, 0\.0 GB in float32\) needs "
                                               r"about 1\.0 GB of memory; the limit is 0\.5 GB available.*--dtype "
                                               r"bfloat16.*--no-memory-check"):
        export_engines(str(tmp_path / "src"), tmp_path / "out", memory_limit=0.5e9, **QUIET)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    export_engines(str(tmp_path / "src"), tmp_path / "out", max_seq_len=32, **QUIET)
    before = json.loads((tmp_path / "out" / "manifest.json").read_text())
    with pytest.raises(MemoryLimitError, match=r"building the target of .*needs about 1\.0 GB.*--target-weights int4"):
        build(tmp_path / "out", "onnxruntime", memory_limit=0.5e9, **QUIET)
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == before   # nothing built
    assert not list((tmp_path / "out").glob("*.ort.onnx*"))


def test_exported_half_graph_runs_as_exported(tmp_path):
    """The bfloat16 export is a valid float32-compute graph as it stands (ONNX Runtime widens its weights)."""
    import onnxruntime as ort
    out, _ = _export(tmp_path, "bf", dtype="bfloat16")
    fp, _ = _export(tmp_path, "fp")
    feeds = {"input_ids": np.array([[1, 2, 3]]), "position_ids": np.array([[0, 1, 2]]), "past_len": np.array([0]),
             "tree_mask": np.tril(np.ones((3, 3), bool))[None], "num_logits": np.array([3])}
    feeds.update({f"{k}_cache_{i}": np.zeros((1, 2, 4, 8), np.float32) for i in range(2) for k in "kv"})
    got = ort.InferenceSession(str(out / "target.onnx")).run(["logits"], feeds)[0]
    want = ort.InferenceSession(str(fp / "target.onnx")).run(["logits"], feeds)[0]
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_a_graph_rewritten_over_its_own_data_file(tmp_path):
    """ONNX Runtime's quantizer stores Constant nodes' values as external data too; rewriting such a graph over its
    own file (the int8 drafters' exact-gather step) keeps every value."""
    from onnx import helper, numpy_helper

    from specrt.export import onnx_files
    w, c = np.arange(512, dtype=np.float32).reshape(16, 32), np.full((16, 32), 0.5, np.float32)
    nodes = [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(c, "c")),
             helper.make_node("MatMul", ["x", "w"], ["y0"]), helper.make_node("Add", ["y0", "c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 32])],
                              [numpy_helper.from_array(w, "w")])
    path = tmp_path / "g.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
                    save_as_external_data=True, location="g.onnx.data", convert_attribute=True, size_threshold=0)
    model = onnx_files.load(path, weights=False)
    onnx_files.save(model, path, tmp_path)
    import onnxruntime as ort
    x = np.eye(16, dtype=np.float32)
    np.testing.assert_array_equal(ort.InferenceSession(str(path)).run(None, {"x": x})[0], w + c)
