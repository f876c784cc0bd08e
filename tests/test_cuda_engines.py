"""Engines built with `--device cuda`: the static TreeAttention body, the static width graphs, and their padding
and bucket logic, run for real on the CPU provider (graph capture itself needs a GPU: not checked here)."""
from __future__ import annotations

import logging
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from conftest import MATRIX, export_tiny_with_heads, tiny_model
from greedy_check import assert_same_or_tie
from specrt.engines.base import OrtEngine, OrtHeads, bind_tensor, built_for, cuda_missing, engine_set_device, pick_device
from specrt.decoding.drafters import chain_mask
from specrt.errors import BackendError, DeviceError
from specrt.export.build import build
from specrt.decoding.eagle import DynamicTree
from specrt.decoding.generate import METHODS, Generator
from specrt.engines.manifest import file_entry, read_manifest, sha256_file, write_manifest
from specrt.plugins.tree_attention import DOMAIN, INPUTS, OP_TYPE, attach_function, reference
from specrt.engines.static import StaticWidthEngine
from test_tree_attention import random_tree

V = 48
SHAPE_NODES = {"Shape", "Range", "ConstantOfShape", "Size", "NonZero"}


def static_op(scale: float, B, H, Hkv, S, Smax, D, window: int = 0, softcap: float = 0.0) -> bytes:
    """One TreeAttention node with every shape fixed and the static body."""
    f, i64, b = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
    shapes = [(B, H, S, D), (B, Hkv, Smax, D), (B, Hkv, Smax, D), (B, Hkv, S, D), (B, Hkv, S, D), (B,), (B, S, S)]
    ins = [helper.make_tensor_value_info(n, t, s) for n, t, s in zip(INPUTS, [f] * 5 + [i64, b], shapes)]
    node = helper.make_node(OP_TYPE, INPUTS, ["out"], domain=DOMAIN, scale=scale, window=window, softcap=softcap)
    graph = helper.make_graph([node], "op", ins, [helper.make_tensor_value_info("out", f, (B, H, S, D))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return attach_function(model, static=True).SerializeToString()


@pytest.mark.parametrize("seed", range(16))
def test_static_body_matches_float64_reference(seed):
    """Also with a sliding window and a soft-cap of the scores."""
    rng = np.random.default_rng(seed)
    B, Hkv = int(rng.integers(1, 4)), int(rng.choice([1, 2, 3]))
    H, D, S, Smax = Hkv * int(rng.choice([1, 2, 4])), int(rng.choice([4, 8, 16])), int(rng.integers(1, 9)), 24
    past = rng.integers(0, Smax - S + 1, size=B)
    window, softcap = [0, 1, 3, 6][seed % 4], [0.0, 0.7][seed // 4 % 2]
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    inputs = dict(query=r(B, H, S, D), k_cache=r(B, Hkv, Smax, D), v_cache=r(B, Hkv, Smax, D),
                  k_new=r(B, Hkv, S, D), v_new=r(B, Hkv, S, D), past_len=past.astype(np.int64),
                  tree_mask=np.stack([random_tree(rng, S) for _ in range(B)]))
    session = ort.InferenceSession(static_op(D ** -0.5, B, H, Hkv, S, Smax, D, window, softcap),
                                   providers=["CPUExecutionProvider"])
    got = session.run(None, inputs)[0]
    np.testing.assert_allclose(got, reference(*inputs.values(), D ** -0.5, window, softcap), atol=2e-5, rtol=1e-5)
    inputs["k_cache"][:, :, past.max():] = 1e4   # whatever the slots past past_len hold (finite) is ignored
    np.testing.assert_allclose(session.run(None, inputs)[0], got, atol=1e-6)


# ---- engine sets ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_sets(tmp_path_factory):
    """One tiny export (target, draft, Medusa heads) built twice: CPU engines, and CUDA float32 engines."""
    tmp = tmp_path_factory.mktemp("cuda")
    cpu, model = export_tiny_with_heads(tmp, V, num_heads=3, max_seq_len=96)
    cuda = tmp / "cuda-float32"
    shutil.copytree(cpu, cuda)
    build(cuda, "onnxruntime", log=lambda *_: None, device="cuda", dtype="float32", widths=(1, 2, 4, 8))
    return cpu, cuda, model


def test_manifest_records_widths_and_hashes(engine_sets):
    _, cuda, _ = engine_sets
    entry = read_manifest(cuda)["models"]["target"]["engine"]
    assert (entry["device"], entry["dtype"], sorted(entry["widths"], key=int)) == ("cuda", "float32", ["1", "2", "4", "8"])
    [weights] = entry["data"]   # the shared weights file, checked with the engine graph when it loads
    assert weights["file"] == "target.cuda.weights"
    for f in [entry, weights, *entry["widths"].values()]:
        assert sha256_file(cuda / f["file"]) == f["sha256"]
    referenced = 0   # bytes the graphs read from the shared file, counted once per graph
    for f in [entry, *entry["widths"].values()]:
        graph = onnx.load(str(cuda / f["file"]), load_external_data=False).graph
        external = [{e.key: e.value for e in t.external_data} for t in graph.initializer
                    if t.data_location == TensorProto.EXTERNAL]
        assert external and {e["location"] for e in external} == {weights["file"]}
        referenced += sum(int(e["length"]) for e in external)
    size = (cuda / weights["file"]).stat().st_size
    assert size * 4 < referenced, f"{size} bytes of weights for {referenced} referenced: each tensor stored once"


def test_width_graphs_have_no_shape_arithmetic_once_optimised(engine_sets, tmp_path):
    """The CPU-checkable proxy for `every node on the GPU`: nothing left that computes on shapes."""
    _, cuda, _ = engine_sets
    for w, f in read_manifest(cuda)["models"]["target"]["engine"]["widths"].items():
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(cuda / f".check-w{w}.onnx")   # beside its external weights
        try:
            ort.InferenceSession(str(cuda / f["file"]), options, providers=["CPUExecutionProvider"])
            graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
        finally:
            (cuda / f".check-w{w}.onnx").unlink(missing_ok=True)
        constants = {t.name for t in graph.initializer}
        assert not [n.op_type for n in graph.node if n.op_type in SHAPE_NODES], f"width {w}"
        dynamic_slices = [n.name for n in graph.node if n.op_type in ("Slice", "Split")
                          and not set(n.input[1:]) <= constants]
        assert not dynamic_slices, f"width {w}: slices with computed bounds {dynamic_slices}"
        caches = {f"{kv}_cache_{i}" for kv in "kv" for i in range(read_manifest(cuda)["models"]["target"]["layers"])}
        copies = [(n.op_type, n.name) for n in graph.node if set(n.input) & caches
                  and n.op_type not in ("MatMul", "FusedMatMul")]
        assert not copies, f"width {w}: the static cache is copied or rearranged, not read in place: {copies}"


def engines(cpu, cuda):
    spec_cpu, spec_cuda = (read_manifest(d)["models"]["target"] for d in (cpu, cuda))
    return (OrtEngine(cpu / spec_cpu["engine"]["file"], spec_cpu),
            StaticWidthEngine(cuda / spec_cuda["engine"]["file"], spec_cuda))


@pytest.mark.parametrize("k,tree", [(1, False), (3, False), (8, False), (6, True)])
def test_width_engine_matches_plain_engine(engine_sets, k, tree):
    cpu, cuda, _ = engine_sets
    plain, static = engines(cpu, cuda)
    prompt = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(k))
    mask = torch.tensor(random_tree(np.random.default_rng(k), k))[None] if tree else chain_mask(1, k)
    ids = torch.randint(0, V, (1, k), generator=torch.Generator().manual_seed(100 + k))
    outs = []
    for engine in (plain, static):
        cache = engine.new_cache(1, 96)
        pre = engine.forward(prompt, torch.arange(11)[None], cache.past_len, chain_mask(1, 11), 1, cache)
        cache.write(pre.new_kv)
        cache.past_len += 11
        pos = 11 + mask[0].sum(1)[None] - 1                                    # depth of each node
        out = engine.forward(ids, pos, cache.past_len, mask, k, cache)
        outs.append((out.logits.clone(), out.hidden.clone(), out.new_kv.clone()))
    assert static.max_width == 8 and outs[1][0].shape == (1, k, V)
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", MATRIX)
def test_width_engines_of_every_architecture_match_transformers(tiny_engines, tmp_path, arch):
    """Each architecture's CUDA engines (the dynamic graph for the prefill, width graphs for the decode steps and a
    padded tree) against transformers, past the window where the test model has one (conftest.ARCH_TESTS)."""
    from test_graph_parity import check_parity
    directory, model = tiny_engines[arch]
    cuda = tmp_path / "cuda"
    shutil.copytree(directory, cuda)
    build(cuda, "onnxruntime", log=lambda *_: None, device="cuda", dtype="float32", widths=(1, 8))
    target = Generator.from_engines(cuda, device="cpu").target
    assert isinstance(target, StaticWidthEngine)
    check_parity(target, model, model.config.vocab_size)


def test_width_engine_runs_the_smallest_width(engine_sets, monkeypatch):
    _, cuda, _ = engine_sets
    static = engines(engine_sets[0], cuda)[1]
    ran = []
    for w, session in static.sessions.items():
        monkeypatch.setattr(session, "run_with_iobinding", lambda b, w=w, run=session.run_with_iobinding: (ran.append(w), run(b)))
    cache = static.new_cache(1)
    for k in (1, 2, 3, 5, 8):
        static.forward(torch.zeros(1, k, dtype=torch.int64), torch.arange(k)[None], cache.past_len, chain_mask(1, k), 1)
    assert ran == [1, 2, 4, 8, 8]
    assert static.new_cache(1) is cache and static.new_cache(2) is not cache   # one static one-row cache


def test_sessions_share_one_copy_of_the_weights(engine_sets):
    """The dynamic graph's session and every width's read one OrtValue per stored tensor: zeroing the embedding
    table there zeroes the hidden states of them all (a session with its own copy would keep its values)."""
    _, cuda, _ = engine_sets
    static = engines(*engine_sets[:2])[1]
    entry = read_manifest(cuda)["models"]["target"]["engine"]
    stored = set()
    for f in [entry, *entry["widths"].values()]:
        for t in onnx.load(str(cuda / f["file"]), load_external_data=False).graph.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                stored.add(next(e.value for e in t.external_data if e.key == "offset"))
    assert len(static.weights.values) == len(stored) and None not in static.weights.values.values()
    spec = static.spec
    table = next(m for key, m in zip(static.weights.values, static.weights.memory)
                 if key[3] == (spec["vocab_size"], spec["hidden_size"]))

    def hidden_states():   # each width's session (1, 2, 4, 8 tokens) and the dynamic one (11)
        out = []
        for k in (1, 2, 3, 8, 11):
            cache = static.new_cache(1)
            out.append(static.forward(torch.arange(1, k + 1)[None], torch.arange(k)[None], cache.past_len,
                                      chain_mask(1, k), 1, cache).hidden.clone())
        return out

    before, kept = hidden_states(), table.copy()
    table[:] = 0
    try:
        after = hidden_states()
    finally:
        table[:] = kept
    assert all(h.abs().max() > 0 for h in before) and all(h.abs().max() == 0 for h in after)
    torch.testing.assert_close(hidden_states()[2], before[2], rtol=0, atol=0)


def test_cuda_weights_without_from_dlpack_are_refused(engine_sets, monkeypatch):
    """An onnxruntime whose OrtValue has no public from_dlpack cannot hand the sessions one copy of the weights on
    a GPU: a CUDA engine refuses it, naming the version and the upgrade, instead of loading a copy per session. The
    CPU path (values over numpy arrays) does not need it."""
    _, cuda, _ = engine_sets
    spec = read_manifest(cuda)["models"]["target"]
    monkeypatch.delattr(ort.OrtValue, "from_dlpack")   # the real class, as onnxruntime < 1.26 has it
    with pytest.raises(BackendError, match=r"onnxruntime \S+ has no OrtValue\.from_dlpack.*"
                                           r'pip install -U "onnxruntime-gpu>=1\.26"'):
        StaticWidthEngine(cuda / spec["engine"]["file"], spec, device="cuda")
    on_cpu = StaticWidthEngine(cuda / spec["engine"]["file"], spec)
    assert on_cpu.weights.values and None not in on_cpu.weights.values.values()


def _rewire_logits(directory, width: int, node_of) -> None:
    """Width `width`'s target graph with one node put before its `logits` output (node_of(input, output) makes
    it); the manifest's hash follows, so the engine set still loads."""
    manifest = read_manifest(directory)
    entry = manifest["models"]["target"]["engine"]["widths"]
    path = directory / entry[str(width)]["file"]
    model = onnx.load(str(path), load_external_data=False)
    producer = next(n for n in model.graph.node if "logits" in n.output)
    producer.output[list(producer.output).index("logits")] = "logits_before"
    model.graph.node.extend(node_of("logits_before", "logits"))
    onnx.save(model, str(path))
    entry[str(width)] = file_entry(directory, path.name)
    write_manifest(directory, manifest)


def test_width_graphs_that_fail_fall_back_to_the_dynamic_graph(engine_sets, tmp_path, caplog):
    """A width graph ONNX Runtime refuses (here an op it does not know: on a GPU, a graph it cannot capture) and
    one whose pass fails (here an index out of bounds: on a GPU, a failed capture) are dropped with the reason
    logged; their passes run the next width or the dynamic graph, with the same outputs."""
    cpu, cuda, _ = engine_sets
    broken = tmp_path / "broken"
    shutil.copytree(cuda, broken)
    _rewire_logits(broken, 8, lambda x, y: [helper.make_node("NoSuchOp", [x], [y], domain="specrt.nowhere")])
    W, V_ = 4, read_manifest(cuda)["models"]["target"]["vocab_size"]
    index = helper.make_tensor("bad_index", TensorProto.INT64, [W], [0, 1, 2, 10 ** 6])
    _rewire_logits(broken, W, lambda x, y: [helper.make_node("Constant", [], ["bad_index"], value=index),
                                            helper.make_node("Gather", [x, "bad_index"], [y], axis=1)])
    plain, _ = engines(cpu, cuda)
    spec = read_manifest(broken)["models"]["target"]
    with caplog.at_level(logging.WARNING, logger="specrt.engines.static"):
        static = StaticWidthEngine(broken / spec["engine"]["file"], spec)
        assert set(static.sessions) == {1, 2, 4} and "NoSuchOp" in static.fallbacks[8]
        for k in (3, 6, 1):
            outs = []
            for engine in (plain, static):
                cache = engine.new_cache(1, 96)
                ids = torch.arange(2, k + 2)[None] % V_
                outs.append(engine.forward(ids, torch.arange(k)[None], cache.past_len, chain_mask(1, k), k,
                                           cache).logits.clone())
            torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    assert set(static.sessions) == {1, 2} and "pass failed" in static.fallbacks[4]
    logged = [r.getMessage() for r in caplog.records]
    assert any("width-8" in m and "NoSuchOp" in m for m in logged)
    assert any("width-4" in m and "pass failed" in m for m in logged)


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("eagle", "mtp", "self")])   # own sets, own tests
def test_greedy_identical_on_width_engines(engine_sets, method):
    cpu, cuda, model = engine_sets
    a, b = Generator.from_engines(cpu, device="cpu"), Generator.from_engines(cuda, device="cpu")
    assert isinstance(b.target, StaticWidthEngine)
    for seed in range(3):
        prompt = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        kw = dict(max_new_tokens=24, method=method, gamma=None if method == "autoregressive" else 4)
        ref = a.generate(prompt_ids=prompt, **kw).token_ids[0]
        ours = b.generate(prompt_ids=prompt, **kw).token_ids[0]
        assert_same_or_tie(ours, ref, prompt, model)


def test_draft_tree_identical_on_width_engines(engine_sets):
    cpu, cuda, model = engine_sets
    a, b = Generator.from_engines(cpu, device="cpu"), Generator.from_engines(cuda, device="cpu")
    prompt = [3, 1, 4, 1, 5, 9, 2]
    ref = a.generate(prompt_ids=prompt, max_new_tokens=24, method="draft", tree=True).token_ids[0]
    assert_same_or_tie(b.generate(prompt_ids=prompt, max_new_tokens=24, method="draft", tree=True).token_ids[0],
                       ref, prompt, model)


def test_float16_engines_run_on_the_cpu_provider(engine_sets, tmp_path):
    """float16 graphs load on the CPU provider (ONNX Runtime casts around the ops it lacks in float16); the
    caches are float16, logits float32 and close to the float32 engine's."""
    cpu, _, _ = engine_sets
    half = tmp_path / "half"
    shutil.copytree(cpu, half)
    build(half, "onnxruntime", log=lambda *_: None, device="cuda", dtype="float16", widths=(1, 4))
    spec = read_manifest(half)["models"]["target"]
    static = StaticWidthEngine(half / spec["engine"]["file"], spec)
    plain = engines(cpu, engine_sets[1])[0]
    ids = torch.tensor([[5, 7, 11]])
    got, want = static.run_sequence(ids[0].tolist(), 3), plain.run_sequence(ids[0].tolist(), 3)
    assert static.cache.data.dtype == torch.float16 and got.logits.dtype == torch.float32
    assert (got.logits - want.logits).abs().max() < 0.05 * want.logits.abs().max()


def test_float16_norm_keeps_activations_past_256(tmp_path):
    """RMSNorm over a residual stream whose RMS is over 256 (a mean of squares past float16's 65,504): the float16
    engine's logits stay finite and close to the float32 engine's, its statistics being float32 from the
    squares to the normalised values."""
    from specrt.export.pipeline import export_engines
    model = tiny_model("llama", seed=1, vocab=V, init=0.3)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(2000)                      # token embeddings of RMS ~600
    model.save_pretrained(tmp_path / "src")
    cpu = tmp_path / "cpu"
    export_engines(str(tmp_path / "src"), cpu, max_seq_len=16, log=lambda *_: None)
    build(cpu, "onnxruntime", log=lambda *_: None)
    half = tmp_path / "half"
    shutil.copytree(cpu, half)
    build(half, "onnxruntime", log=lambda *_: None, device="cuda", dtype="float16", widths=(4,))
    g = onnx.load(str(half / "target.w4.cuda.onnx"), load_external_data=False).graph
    users = {i: n for n in g.node for i in n.input}
    node = next(n for n in g.node if n.op_type == "ReduceMean")
    chain = []
    while node.op_type != "Div":
        node = users[node.output[0]]
        chain.append(node.op_type)
    assert chain == ["Add", "Sqrt", "Div"]                               # no cast to float16 on the way
    ids = [5, 7, 11]
    want = engines(cpu, half)[0].run_sequence(ids, 3).logits
    spec = read_manifest(half)["models"]["target"]
    got = StaticWidthEngine(half / spec["engine"]["file"], spec).run_sequence(ids, 3).logits
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_bfloat16_build_writes_bfloat16_graphs(engine_sets, tmp_path):
    """bfloat16 has no CPU kernels in ONNX Runtime: only the graphs are checked here."""
    cpu, _, _ = engine_sets
    bf = tmp_path / "bf16"
    shutil.copytree(cpu, bf)
    build(bf, "onnxruntime", log=lambda *_: None, device="cuda", dtype="bfloat16", widths=(2,))
    g = onnx.load(str(bf / "target.w2.cuda.onnx"), load_external_data=False).graph
    assert {t.data_type for t in g.initializer if t.data_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16)} \
        == {TensorProto.BFLOAT16}
    assert {o.name: o.type.tensor_type.elem_type for o in g.output}["logits"] == TensorProto.FLOAT
    assert {i.name: i.type.tensor_type.elem_type for i in g.input}["k_cache_0"] == TensorProto.BFLOAT16
    with pytest.raises(DeviceError, match=r"--device cpu: .*bf16 holds bfloat16 engines.*CUDA only"):
        Generator.from_engines(bf, device="cpu")   # refused by name, not a failed session load


def test_bad_build_options_are_clear(engine_sets):
    cpu, _, _ = engine_sets
    with pytest.raises(BackendError, match="--dtype float16 is for CUDA engines"):
        build(cpu, "onnxruntime", log=lambda *_: None, dtype="float16")
    with pytest.raises(BackendError, match="--device 'tpu'"):
        build(cpu, "onnxruntime", log=lambda *_: None, device="tpu")


def test_failed_build_keeps_previous_engines(engine_sets, tmp_path, monkeypatch):
    cpu, cuda, _ = engine_sets
    again = tmp_path / "again"
    shutil.copytree(cuda, again)
    before = {p.name: sha256_file(p) for p in again.iterdir()}
    import specrt.export.cuda_build as cb
    monkeypatch.setattr(cb, "static_graph", lambda *a: (_ for _ in ()).throw(RuntimeError("interrupted")))
    with pytest.raises(RuntimeError, match="interrupted"):
        build(again, "onnxruntime", log=lambda *_: None, device="cuda", dtype="float32", widths=(1, 2))
    assert {p.name: sha256_file(p) for p in again.iterdir()} == before


# ---- the drafters' width graphs --------------------------------------------------------------------------
def test_draft_model_runs_its_width_graphs(engine_sets, monkeypatch):
    cpu, cuda, model = engine_sets
    gen = Generator.from_engines(cuda, device="cpu")
    assert isinstance(gen.draft, StaticWidthEngine)
    assert not read_manifest(cuda)["models"]["medusa"]["engine"].get("widths")   # the heads have no cache
    ran = _count_width_runs(gen.draft, monkeypatch)
    prompt = [3, 1, 4, 1, 5, 9, 2]
    ref = Generator.from_engines(cpu, device="cpu").generate(prompt_ids=prompt, max_new_tokens=16, method="draft")
    assert_same_or_tie(gen.generate(prompt_ids=prompt, max_new_tokens=16, method="draft").token_ids[0],
                       ref.token_ids[0], prompt, model)
    assert ran.get(1, 0) > 0   # draft steps of one token ran the width-1 graph


def _count_width_runs(engine, monkeypatch) -> dict:
    ran = {}
    for w, session in engine.sessions.items():
        def counted(b, w=w, run=session.run_with_iobinding):
            ran[w] = ran.get(w, 0) + 1
            return run(b)
        monkeypatch.setattr(session, "run_with_iobinding", counted)
    return ran


@pytest.fixture(scope="module")
def eagle_sets(tmp_path_factory):
    """A tiny target with a random EAGLE drafter: CPU engines, and CUDA float32 and float16 engines."""
    from conftest import tiny_model
    from test_eagle import V as EV, export_with_eagle
    tmp = tmp_path_factory.mktemp("cuda-eagle")
    model = tiny_model("llama", seed=1, vocab=EV, init=0.3)
    cpu = export_with_eagle(tmp, model)
    sets = {}
    for dtype in ("float32", "float16"):
        sets[dtype] = tmp / f"cuda-{dtype}"
        shutil.copytree(cpu, sets[dtype])
        build(sets[dtype], "onnxruntime", log=lambda *_: None, device="cuda", dtype=dtype, widths=(1, 2, 4, 8))
    return cpu, sets, model


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_eagle_on_width_engines_keeps_greedy_output(eagle_sets, dtype, monkeypatch):
    """The drafter's catch-ups and tree levels run its width graphs (features bound with them; kept float32 in a
    float16 engine, as the target's hidden states it reads are); the output is the target's own."""
    cpu, sets, model = eagle_sets
    gen = Generator.from_engines(sets[dtype], device="cpu")
    gen.eagle.spec["dynamic_tree"] = {"top_k": 2, "depth": 3, "nodes": 6}   # levels of at most 6 tokens
    assert isinstance(gen.eagle, StaticWidthEngine)
    ran = _count_width_runs(gen.eagle, monkeypatch)
    ref = Generator.from_engines(cpu, device="cpu")
    for seed in range(2):
        prompt = torch.randint(0, 16, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = ref.generate(prompt_ids=prompt, max_new_tokens=16, method="autoregressive").token_ids[0]
        got = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="eagle", adaptive=False).token_ids[0]
        if dtype == "float32":
            assert_same_or_tie(got, want, prompt, model)
        else:   # a float16 target's own greedy output
            assert got == gen.generate(prompt_ids=prompt, max_new_tokens=16, method="autoregressive").token_ids[0]
    assert sum(ran.values()) > 0 and set(ran) <= {1, 2, 4, 8}
    costs = gen.eagle_costs(1, DynamicTree(2, 3, 6))   # the drafter's pass timed on its width graphs too
    assert costs.draft_step > 0


def test_eagle_features_stay_float32_in_reduced_precision_graphs(eagle_sets):
    _, sets, _ = eagle_sets
    for f in ("eagle.cuda.onnx", "eagle.w4.cuda.onnx"):
        g = onnx.load(str(sets["float16"] / f), load_external_data=False).graph
        types = {i.name: i.type.tensor_type.elem_type for i in g.input}
        assert types["features"] == TensorProto.FLOAT and types["k_cache_0"] == TensorProto.FLOAT16, f


# ---- device discipline ------------------------------------------------------------------------------------
def test_binding_a_tensor_on_another_device_is_refused(engine_sets):
    cpu, _, _ = engine_sets
    plain = engines(cpu, engine_sets[1])[0]
    with pytest.raises(BackendError, match=r"input 'past_len' is on meta, the engine runs on cpu"):
        bind_tensor(plain.session.io_binding(), "input", "past_len", torch.zeros(1, dtype=torch.int64, device="meta"),
                    plain.device)
    cache = plain.new_cache(1)
    with pytest.raises(BackendError, match="input_ids"):
        plain.forward(torch.zeros(1, 1, dtype=torch.int64, device="meta"), torch.zeros(1, 1, dtype=torch.int64),
                      cache.past_len, chain_mask(1, 1), 1, cache)


def test_auto_follows_the_device_the_set_was_built_for(engine_sets):
    cpu, cuda, _ = engine_sets
    assert (built_for(read_manifest(cpu)), built_for(read_manifest(cuda))) == ("cpu", "cuda")
    assert engine_set_device(read_manifest(cpu), cpu, "auto") == "cpu"   # on a GPU machine too
    assert Generator.from_engines(cpu).target.device.type == "cpu"
    with pytest.raises(DeviceError, match=r"--device cuda: .*built for the CPU.*--device cuda`\), or use --device cpu"):
        Generator.from_engines(cpu, device="cuda")   # whether or not this machine has CUDA


def test_the_cuda_probe_is_asked_about_the_device_asked_for(engine_sets, monkeypatch):
    """--device cuda:1 probes GPU 1 (its torch device and ONNX Runtime's provider on it), not GPU 0: the probe is
    replaced by a recorder of the index it is asked about, the callers are real."""
    import specrt.engines.base as base
    _, cuda, _ = engine_sets
    asked = []
    monkeypatch.setattr(base, "cuda_missing", lambda index=0: asked.append(index) or "no such GPU here")
    for requested in ("cuda", "cuda:1", "cuda:3"):
        with pytest.raises(BackendError, match=f"--device {requested}: no such GPU here"):
            pick_device(requested)
    with pytest.raises(BackendError, match="--device cuda:2: no such GPU here"):
        Generator.from_engines(cuda, device="cuda:2")
    with pytest.raises(DeviceError, match="built for CUDA, and no such GPU here"):
        Generator.from_engines(cuda)   # auto: the default GPU
    assert asked == [0, 1, 3, 2, 0]
    with pytest.raises(BackendError, match=r"--device 'cuda:x': expected cuda or cuda:N"):
        pick_device("cuda:x")


@pytest.mark.skipif(cuda_missing() is None, reason="this machine can run CUDA engines")
def test_a_cuda_set_on_a_machine_without_cuda_is_a_named_error(engine_sets):
    """--device auto on a set built for CUDA, where there is none: a DeviceError that says what is missing and the
    fixes (the CPU provider would run float32 width graphs, far from what the set was built for, and fail on
    bfloat16 ones); the command line prints it as one line."""
    from click.testing import CliRunner
    from specrt.cli import main
    _, cuda, _ = engine_sets
    with pytest.raises(DeviceError, match=r"built for CUDA, and torch has no CUDA here.*specrt\[gpu\].*specrt build"):
        Generator.from_engines(cuda)
    out = CliRunner().invoke(main, ["generate", str(cuda), "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    assert out.exit_code == 1 and "built for CUDA" in out.output and "Traceback" not in out.output


@pytest.mark.skipif(cuda_missing() is None, reason="this machine can run CUDA engines")
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider'")
def test_a_session_that_fell_back_to_the_cpu_is_refused(engine_sets):
    """ONNX Runtime only warns when its CUDA provider does not start (here: not in this wheel) and runs the session
    on the CPU; an engine meant for the GPU refuses that session, naming the cause and the fix."""
    _, cuda, _ = engine_sets
    models = read_manifest(cuda)["models"]
    target, heads = models["target"], models["medusa"]
    refused = r"did not start its CUDA provider and fell back to CPUExecutionProvider.*--device cpu"
    with pytest.raises(BackendError, match=refused):
        OrtEngine(cuda / target["engine"]["file"], target, device="cuda")
    with pytest.raises(BackendError, match=refused):
        OrtHeads(cuda / heads["engine"]["file"], heads, device="cuda")


@pytest.mark.skipif(cuda_missing() is None, reason="this machine can run CUDA engines")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(BackendError, match=r"--device cuda: .*pip install 'specrt\[gpu\]'.*--device cpu"):
        pick_device("cuda")
    assert pick_device("auto") == "cpu"
