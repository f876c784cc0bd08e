"""A GGUF file as the target (`specrt export --target FILE.gguf`): for a tiny model of every registered architecture,
a file written here with the `gguf` package holding the tensor types the issue lists and more (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, BF16, F32, dealt in turn over its weights), exported and built, gives the logits
of transformers' own reading of the file (`from_pretrained(dir, gguf_file=...)`) within 1e-4 and its greedy output;
its int4 build keeps the file's quantized blocks exactly (4-bit types as 4-bit blocks, 5-, 6- and 8-bit ones as 8-bit
blocks; checked through ONNX Runtime's own kernel) and reports the error of what it requantizes (the float types). A
file of an architecture or a tensor type that specrt does not export is refused by name before anything is converted
or written.

The gguf package quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (and writes F16, BF16, F32) but not the K-quants: their
blocks are written here as random bytes with the scale fields set, which is a well-formed file all the same (the
model is whatever those blocks dequantize to, the same for transformers and specrt)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from conftest import check_int4_engine
from greedy_check import assert_same_or_tie
from specrt.decoding.generate import Generator
from specrt.errors import UnknownSourceError
from specrt.export.architectures import REGISTRY
from specrt.export.build import build
from specrt.export.pipeline import export_engines

QUIET = dict(log=lambda *_: None)
TOL = 1e-4
# the smallest shapes that K-quants allow: every weight's rows (its inputs) a multiple of 256
H, I, HEADS, KV_HEADS, D, LAYERS, VOCAB, CONTEXT = 256, 256, 4, 2, 64, 2, 128, 96
# a mixture's experts: transformers' GGUF loader reads no expert size, so its Qwen3-MoE config's default (768)
EXPERTS, TOP_K, EXPERT_I = 4, 2, 768
HEAD_DIM = {"qwen3": 128}   # transformers' GGUF loader reads no Qwen3 head size: its config's default, 128
# transformers' GGUF loader reads no Gemma 3 layer pattern: its config's, every sixth layer global (as in Gemma 3)
BLOCKS = {"gemma3": 6, "qwen3moe": 1}   # one layer of experts: the time of a test
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"]
OWN_BLOCKS = {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"}   # kept exactly (export/quantize.py)
# registered architecture -> (general.architecture, general.name): llama.cpp writes Mistral models as llama files,
# which transformers reads as llama models (but for a file named exactly "mistral": see test_refused_by_name)
GGUF_ARCH = {"llama": ("llama", "tiny"), "mistral": ("llama", "Mistral 7B Tiny"), "qwen2": ("qwen2", "tiny"),
             "qwen3": ("qwen3", "tiny"), "gemma2": ("gemma2", "tiny"), "gemma3_text": ("gemma3", "tiny"),
             "phi3": ("phi3", "tiny"), "qwen3_moe": ("qwen3moe", "tiny")}

# registered architectures without GGUF files here: the mixtures of experts but Qwen3-MoE (transformers' loader reads
# no other: specrt.export.gguf_moe reads Mixtral's, OLMoE's and Granite MoE's, tests/test_moe.py) and LFM2 (read
# from Hugging Face directories only)
NO_GGUF = {name for name, arch in REGISTRY.items() if arch.experts_key and name != "qwen3_moe" or arch.conv}


def test_every_architecture_has_a_gguf_file():
    from specrt.export.gguf_files import exported_architectures, model_type
    assert set(GGUF_ARCH) == set(REGISTRY) - NO_GGUF, "give each registered architecture its GGUF file in GGUF_ARCH"
    assert {model_type(a) for a, _ in GGUF_ARCH.values()} | {"mistral"} == set(REGISTRY) - NO_GGUF
    assert {a for a, _ in GGUF_ARCH.values()} <= set(exported_architectures())


# --- writing a file ----------------------------------------------------------------------------------------

def _tokens() -> tuple[list[str], list[str]]:
    """A byte-level vocabulary of VOCAB tokens (specials, printable ASCII, two-letter merges) and its merges."""
    chars = [chr(c) for c in range(33, 127)]
    pairs = [a + b for a in "abcdefg" for b in "aeiou"][:VOCAB - 4 - len(chars)]
    return ["<unk>", "<s>", "</s>", "<eot>"] + chars + pairs, [f"{p[0]} {p[1]}" for p in pairs]


def _blocks(kind: str, rows: int, k: int, rng) -> np.ndarray:
    """Well-formed K-quant blocks that the gguf package cannot make: random bytes with f16 scales that centre and
    size the weights (about 0.05)."""
    import gguf
    t = gguf.GGMLQuantizationType[kind]
    size = gguf.GGML_QUANT_SIZES[t][1]
    b = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)
    f16 = lambda x: np.full((rows, k // 256, 1), x, np.float16).view(np.uint8)   # noqa: E731
    if kind == "Q4_K":   # d, dmin, scales, nibbles: w = d*s*q - dmin*m, q in 0..15, s, m in 0..63
        b[..., 0:2], b[..., 2:4] = f16(2e-4), f16(7.5 * 2e-4)
    elif kind == "Q5_K":   # the same with 5-bit q
        b[..., 0:2], b[..., 2:4] = f16(1e-4), f16(15.5 * 1e-4)
    else:                # Q6_K: ql, qh, int8 scales, d: w = d*s*(q - 32)
        b[..., -2:] = f16(4e-5)
    return b.reshape(rows, -1)


def _tensor(writer, name: str, w: np.ndarray, kind: str, rng) -> None:
    import gguf
    if kind in ("Q4_K", "Q5_K", "Q6_K"):   # a mixture's stacked [E, N, K]: E * N rows
        data = _blocks(kind, int(np.prod(w.shape[:-1])), w.shape[-1], rng).reshape(*w.shape[:-1], -1)
    elif kind == "F32":
        data = w.astype(np.float32)
    elif kind == "F16":
        data = w.astype(np.float16)
    else:
        data = gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType[kind])
    raw = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
    writer.add_tensor(name, data, raw_dtype=raw)


def _weights(arch: str, D: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """The file's matrices (GGUF names, rows first), in the order the types are dealt to them."""
    names = [("token_embd.weight", (VOCAB, H))]
    if not arch.startswith("gemma"):   # gemma ties its output to the embedding
        names.append(("output.weight", (VOCAB, H)))
    for i in range(layers):
        if arch == "phi3":   # fused [q; k; v] and [gate; up]
            names += [(f"blk.{i}.attn_qkv.weight", ((HEADS + 2 * KV_HEADS) * D, H)),
                      (f"blk.{i}.attn_output.weight", (H, HEADS * D)), (f"blk.{i}.ffn_up.weight", (2 * I, H))]
        else:
            names += [(f"blk.{i}.attn_q.weight", (HEADS * D, H)), (f"blk.{i}.attn_k.weight", (KV_HEADS * D, H)),
                      (f"blk.{i}.attn_v.weight", (KV_HEADS * D, H)), (f"blk.{i}.attn_output.weight", (H, HEADS * D))]
        if arch == "qwen3moe":   # the router and the experts' stacked projections
            names += [(f"blk.{i}.ffn_gate_inp.weight", (EXPERTS, H)), (f"blk.{i}.ffn_gate_exps.weight",
                      (EXPERTS, EXPERT_I, H)), (f"blk.{i}.ffn_up_exps.weight", (EXPERTS, EXPERT_I, H)),
                      (f"blk.{i}.ffn_down_exps.weight", (EXPERTS, H, EXPERT_I))]
            continue
        if arch != "phi3":
            names += [(f"blk.{i}.ffn_gate.weight", (I, H)), (f"blk.{i}.ffn_up.weight", (I, H))]
        names.append((f"blk.{i}.ffn_down.weight", (H, I)))
    return names


def _vectors(arch: str, D: int, layers: int) -> list[tuple[str, int]]:
    names = [("output_norm.weight", H)]
    for i in range(layers):
        names += [(f"blk.{i}.attn_norm.weight", H), (f"blk.{i}.ffn_norm.weight", H)]
        if arch.startswith("gemma"):
            names += [(f"blk.{i}.post_attention_norm.weight", H), (f"blk.{i}.post_ffw_norm.weight", H)]
        if arch in ("qwen3", "gemma3", "qwen3moe"):
            names += [(f"blk.{i}.attn_q_norm.weight", D), (f"blk.{i}.attn_k_norm.weight", D)]
        if arch == "qwen2":
            names += [(f"blk.{i}.attn_q.bias", HEADS * D), (f"blk.{i}.attn_k.bias", KV_HEADS * D),
                      (f"blk.{i}.attn_v.bias", KV_HEADS * D)]
    return names


def write_gguf(path, arch: str, seed: int = 0, types: list[str] | None = None, chat_template: str | None = None,
               eot: int | None = None, metadata: dict | None = None, extra=None, name: str | None = None):
    """A tiny model of the registered architecture `arch` as a GGUF file; the weights' types dealt in turn from
    `types` (default: every type of TYPES, from a place that depends on the architecture, so that each type lands
    on other weights in other files). `metadata`: further {key: value} (ints and strings); `extra`: a function of
    the writer that adds tensors; `name`: general.name, if not the architecture's."""
    import gguf
    gguf_arch, default_name = GGUF_ARCH.get(arch, (arch, "tiny"))
    name = name or default_name
    rng = np.random.default_rng(seed)
    D, layers = HEAD_DIM.get(gguf_arch, globals()["D"]), BLOCKS.get(gguf_arch, LAYERS)
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_name(name)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(H)
    w.add_block_count(layers)
    w.add_feed_forward_length(I)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(D)
    w.add_key_length(D)
    w.add_value_length(D)
    if gguf_arch.startswith("gemma"):
        w.add_sliding_window(8)   # shorter than the tests' prompt and generation
    if gguf_arch == "qwen3moe":
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(TOP_K)
        w.add_expert_feed_forward_length(EXPERT_I)
    for key, value in (metadata or {}).items():
        (w.add_string if isinstance(value, str) else w.add_uint32)(key, value)
    tokens, merges = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * 4 + [1] * (len(tokens) - 4))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    if eot is not None:
        w.add_eot_token_id(eot)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    start = 3 * sorted(GGUF_ARCH).index(arch) if arch in GGUF_ARCH else 0
    types = types or TYPES[start:] + TYPES[:start]
    for i, (tensor, shape) in enumerate(_weights(gguf_arch, D, layers)):
        _tensor(w, tensor, rng.normal(0, 0.12, shape), types[i % len(types)], rng)
    for tensor, n in _vectors(gguf_arch, D, layers):
        value = rng.normal(0, 0.3, n) if tensor.endswith("bias") else rng.normal(1, 0.3, n)
        w.add_tensor(tensor, value.astype(np.float32))
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- every architecture: exported, built, against transformers' reading of the file -------------------------

TEMPLATE = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
EOT = 3


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The source cache of this module's exports (not the user's)."""
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("cache")
        mp.setenv("SPECRT_CACHE", str(root))
        yield root


@pytest.fixture(scope="module", params=sorted(GGUF_ARCH))
def gguf_set(request, cache, tmp_path_factory):
    """(the file, its engine set, transformers' model of it) for a tiny model of each architecture."""
    from transformers import AutoModelForCausalLM
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"gguf-{arch}")
    path = write_gguf(tmp / f"tiny-{arch}.gguf", arch, chat_template=TEMPLATE, eot=EOT)
    out = export_engines(str(path), tmp / "engines", max_seq_len=128, **QUIET)
    build(out, "onnxruntime", **QUIET)
    model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32).eval()
    return path, out, model


def test_logits_equal_transformers(gguf_set):
    """Prefill (every position's logits) and decode steps through the runtime's engine and cache, against
    transformers' model of the same file."""
    _, directory, model = gguf_set
    engine = Generator.from_engines(directory).target
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(4, VOCAB, (12,), generator=g).tolist()
    cache = engine.new_cache(1)
    S = len(seq)
    out = engine.forward(torch.tensor([seq]), torch.arange(S)[None], cache.past_len,
                         torch.ones(S, S, dtype=torch.bool).tril()[None], S)
    with torch.no_grad():
        ref = model(torch.tensor([seq])).logits[0]
    assert (out.logits[0] - ref).abs().max() < TOL
    cache.write(out.new_kv)
    cache.past_len += S
    for tok in torch.randint(4, VOCAB, (3,), generator=g).tolist():
        out = engine.forward(torch.tensor([[tok]]), cache.past_len[:, None].clone(), cache.past_len,
                             torch.ones(1, 1, 1, dtype=torch.bool), 1)
        seq.append(tok)
        with torch.no_grad():
            ref = model(torch.tensor([seq])).logits[0, -1]
        assert (out.logits[0, -1] - ref).abs().max() < TOL
        cache.write(out.new_kv)
        cache.past_len += 1


def test_greedy_output_equals_generate(gguf_set):
    """Past the Gemma files' attention window (8), stopping where the file's end-of-sequence ids say."""
    _, directory, model = gguf_set
    gen = Generator.from_engines(directory)
    for seed in range(2):
        prompt = torch.randint(4, VOCAB, (7 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ours = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="autoregressive").token_ids[0]
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=[2, EOT],
                                 pad_token_id=0)[0, len(prompt):].tolist()
        assert_same_or_tie(ours, ref, prompt, model)


def test_the_file_gives_tokenizer_template_eos_and_context(gguf_set, cache):
    """What the manifest and the saved tokenizer take from the file: its end-of-sequence and end-of-turn ids, its
    context length (which caps --max-seq-len), its chat template; the conversion is in the source cache."""
    from transformers import AutoTokenizer
    path, directory, _ = gguf_set
    target = json.loads((directory / "manifest.json").read_text())["models"]["target"]
    assert target["eos_token_ids"] == [2, EOT] and target["max_seq_len"] == CONTEXT
    assert target["gguf"]["path"] == str(path.resolve())
    tok = AutoTokenizer.from_pretrained(directory / "tokenizer")
    assert tok.chat_template == TEMPLATE and len(tok) >= VOCAB
    assert [p for p in (cache / "sources").glob(f"{path.stem}-*") if (p / "config.json").is_file()]


def _nbits_weight(model, node, base) -> np.ndarray:
    """The weight (N, K) that ONNX Runtime's MatMulNBits kernel computes with for `node` (it multiplies the
    identity), plus the blocks' offsets where the rewrite adds them (Q4_1, Q4_K)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper
    from specrt.export.onnx_files import array
    attrs = {a.name: a.i for a in node.attribute}
    K, N = attrs["K"], attrs["N"]
    inits = {i.name: i for i in model.graph.initializer}
    used = [inits[n] for n in node.input[1:]]
    one = helper.make_node("MatMulNBits", ["A", *node.input[1:]], ["Y"], domain="com.microsoft", K=K, N=N,
                           bits=attrs["bits"], block_size=attrs["block_size"])
    graph = helper.make_graph([one], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", K])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", N])], used)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    w = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"A": np.eye(K, dtype=np.float32)})[0].T                                       # (N, K)
    offsets = next((n for n in model.graph.node if n.name == f"{node.name}_offsets"), None)
    if offsets is not None:
        w = w + np.repeat(array(inits[offsets.input[1]], base).T, 32, axis=1)            # (nb, N) -> (N, K)
    return w


def test_int4_keeps_the_files_blocks(gguf_set, tmp_path):
    """The int4 target of a GGUF file: each weight stored in a quantized type is the file's own blocks,
    equal through ONNX Runtime's kernel to what transformers dequantized (a fused Phi-3 projection's rows, a tied
    Gemma head included); every other type is requantized and the manifest gives its error per type."""
    import onnx
    from specrt.export.gguf_files import read_header
    from specrt.export.onnx_files import array
    from specrt.export.quantize import quantize_target
    path, directory, _ = gguf_set
    spec = json.loads((directory / "manifest.json").read_text())["models"]["target"]
    counts = quantize_target(directory / "target.onnx", tmp_path / "q.onnx", spec, "int4")
    tensors = [t for t in read_header(path).tensors if len(t.shape) >= 2]
    tied = all(t.name != "output.weight" for t in tensors)
    own, requantized, matmuls_own = {}, {}, 0
    for t in tensors:   # the graph's MatMuls of each tensor (one an expert), the embedding's Gather (blocks if Q8_0)
        n = 3 if "attn_qkv" in t.name else 2 if "ffn_up" in t.name and spec["architecture"] == "phi3" else \
            int(tied) if t.name == "token_embd.weight" else t.shape[0] if len(t.shape) == 3 else \
            0 if "ffn_gate_inp" in t.name else 1   # a mixture's router stays float32
        gather = t.name == "token_embd.weight" and t.type == "Q8_0"
        if t.type in OWN_BLOCKS and n + gather:
            own[t.type] = own.get(t.type, 0) + n + gather
            matmuls_own += n
        elif n:
            requantized[t.type] = requantized.get(t.type, 0) + n
    errors = counts.pop("requantized")
    assert counts.pop("standard int4") == sum(requantized.values())
    assert counts == own and {k: e["tensors"] for k, e in errors.items()} == requantized
    for kind, e in errors.items():
        assert 0 < e["relative_rms_error"] < 0.2 and e["max_abs_error"] < 0.2, kind
    float_graph = onnx.load(str(directory / "target.onnx"), load_external_data=False)
    weights = {n.name: n.input[1] for n in float_graph.graph.node if n.op_type == "MatMul"}
    inits = {i.name: i for i in float_graph.graph.initializer}
    q = onnx.load(str(tmp_path / "q.onnx"))
    checked = 0
    for node in q.graph.node:
        if node.op_type == "MatMulNBits" and any(i.endswith("_B") for i in node.input):   # the file's blocks
            ref = array(inits[weights[node.name]], directory).T
            np.testing.assert_allclose(_nbits_weight(q, node, tmp_path), ref, rtol=1e-6, atol=1e-6,
                                       err_msg=node.name)
            checked += 1
    assert checked == matmuls_own


INT4_BUILT = ["llama", "phi3", "gemma3_text"]   # q/k permuted; fused projections split; a tied Q8_0 head


@pytest.mark.parametrize("gguf_set", INT4_BUILT, indirect=True)
def test_int4_build_keeps_its_own_greedy_output(gguf_set, tmp_path):
    """`specrt build --target-weights int4` of the set (the file's blocks, the rest requantized, int8 activations)
    runs end to end: its logits near the float32 target's (random weights requantized to 4 bits and int8
    activations: 10-35% of the logits' norm here; a wrong packing gives more than 100%), and prompt lookup gives
    its own autoregressive tokens. Built for the files that differ most (the others' blocks are checked above)."""
    path, directory, model = gguf_set
    int4 = tmp_path / "int4"
    shutil.copytree(directory, int4, ignore=shutil.ignore_patterns("*.ort.onnx*"))
    build(int4, "onnxruntime", target_weights="int4", **QUIET)
    gen = Generator.from_engines(int4)
    seq = torch.randint(4, VOCAB, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    check_int4_engine(gen, model, seq, 24)


# --- what is refused, by name, before anything is converted or written -------------------------------------

@pytest.fixture
def nothing_converted(tmp_path, monkeypatch):
    """A source cache of the test's own, and a conversion that must not start."""
    from specrt.export import sources
    monkeypatch.setenv("SPECRT_CACHE", str(tmp_path / "cache"))

    def refuse(*_):
        raise AssertionError("the GGUF file was converted before it was checked")
    monkeypatch.setattr(sources, "_load_gguf", refuse)
    return tmp_path


def _f64(writer):
    writer.add_tensor("blk.0.attn_q_scale.weight", np.ones((4, 32), np.float64))


def _per_expert(writer):   # Mixtral as older llama.cpp converters wrote it
    writer.add_tensor("blk.0.ffn_gate.0.weight", np.ones((4, 32), np.float32))


def _i32(writer):
    writer.add_tensor("blk.1.attn_k_scale.weight", np.ones((4, 32), np.int32))


@pytest.mark.parametrize("arch,kw,match", [
    ("starcoder2", {}, r"architecture 'starcoder2'.*exports: .*gemma3.*llama.*phi3"),
    ("llama", dict(metadata={"llama.expert_count": 4}, extra=_per_expert),
     r"one tensor per expert \(blk\.0\.ffn_gate\.0\.weight, \.\.\.\).*current llama\.cpp"),
    ("llama", dict(extra=lambda w: (_f64(w), _i32(w))), r"does not dequantize \(F64: blk\.0\.attn_q_scale\.weight "
                                                       r"\(1 tensors\); I32: blk\.1\.attn_k_scale\.weight"),
    ("llama", dict(name="mistral"), r"general.name is exactly 'mistral'"),
], ids=["architecture", "experts", "tensor-types", "named-mistral"])
def test_refused_by_name(nothing_converted, arch, kw, match):
    """With or without the memory check (--no-memory-check skips the sizing, not the check)."""
    tmp = nothing_converted
    path = write_gguf(tmp / "model.gguf", arch, types=["F32"], **kw)
    for limit in (None, float("inf")):
        with pytest.raises(UnknownSourceError, match=match):
            export_engines(str(path), tmp / "out", memory_limit=limit, **QUIET)
    assert sorted(p.name for p in tmp.iterdir()) == ["model.gguf"]   # no engine set, no staging folder, no cache


def test_cli_refuses_a_file_and_names_a_missing_one(nothing_converted):
    from specrt.cli import main
    tmp = nothing_converted
    path = write_gguf(tmp / "model.gguf", "llama", types=["F32"], extra=_f64)
    result = CliRunner().invoke(main, ["export", "--target", str(path), "--out", str(tmp / "out")])
    assert result.exit_code == 1 and "F64: blk.0.attn_q_scale.weight" in result.output
    good = write_gguf(tmp / "good.gguf", "llama", types=["F32"])
    result = CliRunner().invoke(main, ["export", "--target", str(good), "--draft", str(tmp / "gone.gguf"),
                                       "--out", str(tmp / "out")])
    assert result.exit_code == 1 and "gone.gguf' does not exist" in result.output
    assert sorted(p.name for p in tmp.iterdir()) == ["good.gguf", "model.gguf"]


# --- the real file: Gemma 3 270M (make check-gemma3; not in make test) -------------------------------------

GEMMA3 = os.environ.get("SPECRT_GEMMA3")   # an engine set of `make engines-gemma3`
GEMMA3_PROMPTS = int(os.environ.get("SPECRT_GEMMA3_PROMPTS", 8))   # MT-Bench dev prompts the real checks run
GEMMA3_TOKENS = int(os.environ.get("SPECRT_GEMMA3_TOKENS", 32))     # new tokens each


@pytest.mark.skipif(not GEMMA3, reason="the real Gemma 3 270M runs in make check-gemma3 (SPECRT_GEMMA3=ENGINES)")
def test_gemma3_270m_greedy_equals_transformers():
    """The float32 engines' greedy tokens on MT-Bench dev prompts, teacher-forced through transformers'
    from_pretrained(gguf_file=...) of the file they were exported from (near ties reported in the summary)."""
    from transformers import AutoModelForCausalLM
    from conftest import load_prompts
    from greedy_check import assert_greedy_under
    gen = Generator.from_engines(GEMMA3)
    target = json.loads((Path(GEMMA3) / "manifest.json").read_text())["models"]["target"]
    path = Path(target["gguf"]["path"])
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    n, tokens, ties = GEMMA3_PROMPTS, GEMMA3_TOKENS, []
    compared = 0
    for prompt in load_prompts(n):
        ids = gen.encode(prompt)
        ours = gen.generate(prompt_ids=ids, max_new_tokens=tokens, method="autoregressive").token_ids[0]
        assert_greedy_under(model, ids, ours, tokens, target["eos_token_ids"], ties)
        compared += len(ours)
    print(f"{n} prompts x {tokens} tokens: {compared} tokens compared, {len(ties)} near ties {ties}")


@pytest.mark.skipif(not GEMMA3, reason="the real Gemma 3 270M runs in make check-gemma3 (SPECRT_GEMMA3=ENGINES)")
def test_gemma3_270m_eagle_equals_autoregressive():
    """The shipped EAGLE drafter on the real engines (make engines-gemma3 exports it in): greedy EAGLE decoding,
    with trees every round and with adaptive rounds, is the engines' own autoregressive output."""
    from conftest import load_prompts
    models = json.loads((Path(GEMMA3) / "manifest.json").read_text())["models"]
    assert "eagle" in models, f"{GEMMA3} has no EAGLE drafter: export it with --eagle export/drafters/gemma3-270m-eagle"
    gen = Generator.from_engines(GEMMA3)
    n, tokens = GEMMA3_PROMPTS, GEMMA3_TOKENS
    made = rounds = 0
    for prompt in load_prompts(n):
        ids = gen.encode(prompt)
        plain = gen.generate(prompt_ids=ids, max_new_tokens=tokens, method="autoregressive").token_ids[0]
        for adaptive in (False, True):
            out = gen.generate(prompt_ids=ids, max_new_tokens=tokens, method="eagle", adaptive=adaptive)
            assert out.token_ids[0] == plain, (prompt, adaptive)
            made, rounds = made + len(plain) - 1, rounds + out.stats["rounds"]
    print(f"{n} prompts x {tokens} tokens: EAGLE greedy equal to autoregressive with trees every round and adaptive "
          f"rounds; {made / rounds:.2f} tokens a round over both")
