"""Mixtures of experts (export/moe.py): a pass computes only the experts its tokens chose, counted in ONNX Runtime's
own profile of the real engine; the memory estimate counts every expert; `specrt export`, `build` and `generate`
run end to end on one; sampled decoding keeps the target's distribution. (Logits, greedy output and the methods
are the registry's matrix: test_graph_parity, test_generate, test_architectures.)"""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from conftest import check_int4_engine, export_tiny, tiny_model
from test_gguf_target import VOCAB, _tokens
from specrt.decoding.generate import Generator
from specrt.decoding.sampling import SamplingParams
from specrt.export.architectures import REGISTRY

MOE = sorted(name for name, arch in REGISTRY.items() if arch.experts_key)
EXPERT = re.compile(r"/layers\.(\d+)/mlp/experts\.(\d+)/gate_proj/MatMul.*_kernel_time$")   # an expert's first


def profiled_passes(directory: Path, passes, monkeypatch) -> list[dict]:
    """Run `passes` (functions of the engine) on the engine set's real target session with ONNX Runtime's profiler
    on; per pass, {(layer, expert): rows its first MatMul ran on}, from the profile's nodes inside that run."""
    from specrt.engines import base
    options = base.session_options
    with monkeypatch.context() as m:
        m.setattr(base, "session_options", lambda *a: _profiling(options(*a), directory))
        engine = Generator.from_engines(directory).target
    for run in passes:
        run(engine)
    events = json.loads(Path(engine.session.end_profiling()).read_text())
    runs = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run"]
    assert len(runs) == len(passes)
    rows = [Counter() for _ in runs]
    for e in events:
        found = EXPERT.search(e.get("name", ""))
        if found and e.get("cat") == "Node":
            i = next(i for i, (start, end) in enumerate(runs) if start <= e["ts"] <= end)
            shape = next(iter(e["args"]["input_type_shape"][0].values()))   # the gathered rows: (n, d)
            rows[i][tuple(map(int, found.groups()))] += shape[0]
    return rows


def _profiling(options, directory: Path):
    options.enable_profiling = True
    options.profile_file_prefix = str(directory.parent / f"{directory.name}-profile")
    return options


def chosen_experts(model, ids: list[int], last: int) -> Counter:
    """{(layer, expert): tokens of the last `last` positions of `ids` that transformers' own router sends there}."""
    arch = REGISTRY[model.config.model_type]
    counts, hooks = Counter(), []
    for i, layer in enumerate(model.model.layers):
        block = getattr(layer, arch.moe_block)
        if hasattr(block, "experts"):
            hook = lambda _m, _in, out, i=i: counts.update((i, int(e)) for e in out[2][-last:].flatten())  # noqa: E731
            hooks.append(getattr(block, arch.router).register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return counts


@pytest.mark.parametrize("arch", MOE)
def test_a_pass_runs_only_the_chosen_experts(tiny_engines, arch, monkeypatch):
    """A prefill of 6 tokens and a decode step: each expert's MatMuls run on exactly the rows of the tokens that
    transformers' router sends to it (S * k rows in all per sparse layer); an expert no token chose runs on none."""
    directory, model = tiny_engines[arch]
    prompt, tok = [3, 14, 15, 9, 26, 5], 35
    S, k = len(prompt), model.config.num_experts_per_tok
    caches = [None]

    def prefill(engine):
        cache = caches[0] = engine.new_cache(1)
        out = engine.forward(torch.tensor([prompt]), torch.arange(S)[None], cache.past_len,
                             torch.ones(S, S, dtype=torch.bool).tril()[None], 1)
        cache.write(out.new_kv)
        cache.past_len += S

    def decode(engine):   # after the prompt, in the prefill's cache
        cache = caches[0]
        engine.forward(torch.tensor([[tok]]), cache.past_len[:, None].clone(), cache.past_len,
                       torch.ones(1, 1, 1, dtype=torch.bool), 1)

    ran = profiled_passes(directory, [prefill, decode], monkeypatch)
    expected = [chosen_experts(model, prompt, S), chosen_experts(model, prompt + [tok], 1)]
    layers = {layer for layer, _ in expected[0]}
    for rows, chosen, n in zip(ran, expected, (S, 1)):
        assert +rows == chosen   # (+: without the experts that ran on 0 rows)
        assert sum(rows.values()) == n * k * len(layers)
    E = getattr(model.config, REGISTRY[arch].experts_key)
    assert len(+ran[1]) == k * len(layers) < E * len(layers)   # one token: k experts a layer ran, E - k did not


def test_the_memory_estimate_counts_every_expert(tmp_path):
    from specrt.export import memory
    model = tiny_model("qwen3_moe")
    model.save_pretrained(tmp_path / "src")
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == model.config.num_experts * 3 * model.config.hidden_size * model.config.moe_intermediate_size
    assert memory.parameters(str(tmp_path / "src")) == sum(p.numel() for p in model.parameters())


def test_int4_quantizes_every_expert_and_keeps_the_router_float(tiny_engines, tmp_path):
    """An int4 build: each expert's MatMuls in 4-bit blocks, the routers' in float32 (as llama.cpp keeps them)."""
    import shutil
    import onnx
    from specrt.export.build import build
    directory, model = tiny_engines["mixtral"]
    shutil.copytree(directory, tmp_path / "int4", ignore=shutil.ignore_patterns("*.ort.onnx*"))
    build(tmp_path / "int4", "onnxruntime", target_weights="int4", log=lambda *_: None)
    nodes = onnx.load(str(tmp_path / "int4" / "target.ort.onnx"), load_external_data=False).graph.node
    ops = Counter((n.op_type, "experts" in n.name) for n in nodes if "/mlp/" in n.name and "MatMul" in n.op_type)
    E, L = model.config.num_local_experts, model.config.num_hidden_layers
    assert ops == {("MatMul", False): L, ("MatMulNBits", True): 2 * E * L}   # gate/up merged, down


def test_cli_exports_builds_and_generates_a_mixture(tmp_path):
    """`specrt export` of a Mixtral checkpoint directory, `specrt build`, `specrt generate`: transformers' greedy."""
    from specrt.cli import main
    from test_generate import hf_greedy
    model = tiny_model("mixtral", seed=3)
    model.save_pretrained(tmp_path / "src")
    runner = CliRunner()
    for args in (["export", "--target", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--max-seq-len", "64"],
                 ["build", str(tmp_path / "out")]):
        result = runner.invoke(main, args)
        assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["generate", str(tmp_path / "out"), "--prompt-ids", "3,4,5", "--max-new-tokens", "12",
                                  "--method", "autoregressive", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.splitlines()[-1])["token_ids"][0] == hf_greedy(model, [3, 4, 5], 12)


def test_sampled_draft_keeps_the_mixtures_distribution(tmp_path):
    """Chi-square over the first 3 tokens (test_speculative's test, on a peaked Mixtral target and another draft)."""
    from test_speculative import P_MIN, V, chi_square_p, exact_joint, sample_first3
    draft = tiny_model("mixtral", seed=11, vocab=V, init=0.3)
    directory, model = export_tiny(tmp_path, "mixtral", seed=1, draft=draft, vocab=V, init=0.3, max_seq_len=24)
    gen, prompt = Generator.from_engines(directory), [5, 1, 7]
    out = sample_first3(gen, prompt, "draft", 2, seed=123, temperature=1.0)
    assert out.stats["acceptance_rate"] < 0.9
    assert chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(temperature=1.0))) > P_MIN


# --- GGUF files of the mixtures that transformers' GGUF loader does not read (specrt.export.gguf_moe) -----------

# registered architecture -> the file's general.architecture (llama.cpp writes Mixtral as a llama file with experts)
GGUF_MOE = {"mixtral": "llama", "olmoe": "olmoe", "granitemoe": "granitemoe"}
# what a file can say: llama.cpp's llama graph has no window; it computes OLMoE without renormalising the top-k
GGUF_CONFIG = {"mixtral": dict(sliding_window=None), "olmoe": dict(norm_topk_prob=False)}
# the file's types: each expert projection its own block type (a swap of them shows), the rest Q8_0 or float
EXPERT_TYPES = {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q4_1"}
MOE_VOCAB = VOCAB   # test_gguf_target's byte-level vocabulary


def _permute(w, heads: int, kv_heads: int):
    """llama.cpp's LlamaModel.permute (q and k rows for its rotary layout), on rows of weights or of their blocks."""
    n = kv_heads
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_mixture_model(arch: str):
    """A tiny random model of `arch` with what a GGUF file can say (GGUF_CONFIG), norms unlike each other."""
    import transformers
    from conftest import tiny_config
    config = tiny_config(arch, vocab=MOE_VOCAB, init=0.2)
    for key, value in GGUF_CONFIG.get(arch, {}).items():
        setattr(config, key, value)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 5000.0}   # no architecture's default: the file's
    torch.manual_seed(7)
    model = getattr(transformers, REGISTRY[arch].hf_class)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    return model


def write_gguf_mixture(model, path) -> None:
    """`model` as llama.cpp's converter writes it (convert_hf_to_gguf.py: LlamaModel for Mixtral, OlmoeModel,
    GraniteMoeModel): q/k rows permuted by the llama and Granite converters, each layer's experts stacked per
    projection; quantized to the types of EXPERT_TYPES and Q8_0 (the rest float32). The model's weights become, in
    place, what the file's blocks hold (blocks are rows: quantizing commutes with the permutation and the stacking)."""
    import gguf
    c, arch = model.config, model.config.model_type
    a = REGISTRY[arch]
    w = gguf.GGUFWriter(str(path), GGUF_MOE[arch])
    w.add_name("tiny")
    for add, value in ((w.add_context_length, 64), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps),
                       (w.add_rope_freq_base, c.rope_parameters["rope_theta"]),
                       (w.add_expert_count, getattr(c, a.experts_key)),
                       (w.add_expert_used_count, c.num_experts_per_tok)):
        add(value)
    if arch == "granitemoe":
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    tokens, merges = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3] * 4 + [1] * (len(tokens) - 4))
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    permute = GGUF_MOE[arch] in ("llama", "granitemoe")

    def put(name: str, t: torch.Tensor, kind: str, rows=None) -> torch.Tensor:
        """Write `t` (rows reordered by `rows`, if given) as `kind`; return what the file holds, in t's order."""
        x = t.detach().float().numpy()
        if kind == "F32":
            w.add_tensor(name, rows(x) if rows else x)
            return t
        blocks = gguf.quants.quantize(x, gguf.GGMLQuantizationType[kind])       # (..., N, bytes)
        w.add_tensor(name, rows(blocks) if rows else blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
        return torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]))

    held = {"model.embed_tokens.weight": put("token_embd.weight", model.model.embed_tokens.weight, "Q8_0"),
            "lm_head.weight": put("output.weight", model.lm_head.weight, "Q8_0"),
            "model.norm.weight": put("output_norm.weight", model.model.norm.weight, "F32")}
    for i, layer in enumerate(model.model.layers):
        p, b, att = f"model.layers.{i}.", f"blk.{i}.", layer.self_attn
        q_rows = (lambda r: _permute(r, heads, heads)) if permute else None
        k_rows = (lambda r: _permute(r, heads, kv)) if permute else None
        for hf, mine, kind, rows in (("self_attn.q_proj", "attn_q", "Q8_0", q_rows),
                                     ("self_attn.k_proj", "attn_k", "Q8_0", k_rows),
                                     ("self_attn.v_proj", "attn_v", "Q8_0", None),
                                     ("self_attn.o_proj", "attn_output", "Q8_0", None),
                                     ("input_layernorm", "attn_norm", "F32", None),
                                     ("post_attention_layernorm", "ffn_norm", "F32", None)):
            held[f"{p}{hf}.weight"] = put(f"{b}{mine}.weight", layer.get_submodule(hf).weight, kind, rows)
        if arch == "olmoe":   # norms over the whole projection, not permuted (OlmoeModel does not permute)
            held[p + "self_attn.q_norm.weight"] = put(b + "attn_q_norm.weight", att.q_norm.weight, "F32")
            held[p + "self_attn.k_norm.weight"] = put(b + "attn_k_norm.weight", att.k_norm.weight, "F32")
        moe = getattr(layer, a.moe_block)
        held[f"{p}{a.moe_block}.{a.router}.weight"] = put(b + "ffn_gate_inp.weight",
                                                          getattr(moe, a.router).weight, "F32")
        gate, up = moe.experts.gate_up_proj.chunk(2, dim=1)                       # (E, I, d) each
        held[f"{p}{a.moe_block}.experts.gate_up_proj"] = torch.cat(
            [put(b + "ffn_gate_exps.weight", gate, EXPERT_TYPES["ffn_gate_exps"]),
             put(b + "ffn_up_exps.weight", up, EXPERT_TYPES["ffn_up_exps"])], dim=1)
        held[f"{p}{a.moe_block}.experts.down_proj"] = put(b + "ffn_down_exps.weight", moe.experts.down_proj,
                                                          EXPERT_TYPES["ffn_down_exps"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.load_state_dict(held, strict=False)
    assert set(held) == set(model.state_dict())


@pytest.fixture(scope="module")
def gguf_mixtures(tmp_path_factory):
    """{architecture: (its file, the transformers model the file holds)} for a tiny model of each mixture."""
    tmp = tmp_path_factory.mktemp("gguf-moe")
    files = {}
    for arch in GGUF_MOE:
        model = gguf_mixture_model(arch)
        write_gguf_mixture(model, tmp / f"tiny-{arch}.gguf")
        files[arch] = tmp / f"tiny-{arch}.gguf", model
    return files


@pytest.fixture(scope="module")
def gguf_engines(gguf_mixtures, tmp_path_factory):
    """Granite MoE's file (q/k permuted by its converter, the multipliers in its metadata) exported and built: the
    whole path of one file (each architecture's graph against transformers is the registry's matrix)."""
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    path, model = gguf_mixtures["granitemoe"]
    out = tmp_path_factory.mktemp("gguf-moe-engines") / "engines"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECRT_CACHE", "off")
        export_engines(str(path), out, max_seq_len=48, log=lambda *_: None)
    build(out, "onnxruntime", log=lambda *_: None)
    return out, model


@pytest.mark.parametrize("arch", sorted(GGUF_MOE))
def test_gguf_mixture_reads_as_the_model_it_holds(gguf_mixtures, arch, monkeypatch):
    """specrt's reading of the file (`load_source`, what `specrt export` exports): the transformers model of the
    architecture, its logits within 1e-5 of the model the file was written from."""
    from specrt.export.sources import load_source
    monkeypatch.setenv("SPECRT_CACHE", "off")
    path, model = gguf_mixtures[arch]
    source = load_source(str(path))
    assert type(source.model) is type(model) and source.eos_token_ids == [2]
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8, 9, 7]])
    with torch.no_grad():
        assert (source.model(ids).logits - model(ids).logits).abs().max() < 1e-5


def test_gguf_mixture_engine_equals_transformers(gguf_engines):
    """The engine's logits (a prefill, a decode step) within 1e-4 of the transformers model the file was written
    from, and its greedy output that model's `generate`."""
    from greedy_check import assert_same_or_tie
    from test_generate import hf_greedy
    directory, model = gguf_engines
    gen = Generator.from_engines(directory)
    seq = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    S = len(seq)
    cache = gen.target.new_cache(1)
    out = gen.target.forward(torch.tensor([seq]), torch.arange(S)[None], cache.past_len,
                             torch.ones(S, S, dtype=torch.bool).tril()[None], S)
    with torch.no_grad():
        ref = model(torch.tensor([seq + [11]])).logits[0]
    assert (out.logits[0] - ref[:S]).abs().max() < 1e-4
    cache.write(out.new_kv)
    cache.past_len += S
    step = gen.target.forward(torch.tensor([[11]]), torch.tensor([[S]]), cache.past_len,
                              torch.ones(1, 1, 1, dtype=torch.bool), 1)
    assert (step.logits[0, -1] - ref[S]).abs().max() < 1e-4
    prompt = [9, 1, 20, 7]
    ours = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="autoregressive").token_ids[0]
    assert_same_or_tie(ours, hf_greedy(model, prompt, 12), prompt, model)


def test_gguf_mixture_int4_keeps_the_experts_blocks(gguf_engines, tmp_path):
    """`specrt build --target-weights int4`: every expert's three MatMuls from the file's own blocks (Q4_0 as 4-bit
    blocks, Q8_0 and Q4_1 as they are, the Q4_1 offsets' block sums over the expert's gathered rows; each block
    checked against the float32 weight, the q/k rows in the order the file's converter permuted), attention, head
    and embedding from their Q8_0 blocks, the routers float32; the engine runs near the float32 model (int8
    activations) and prompt lookup gives its own autoregressive tokens."""
    import json
    import shutil
    from specrt.export.build import build
    directory, model = gguf_engines
    int4 = tmp_path / "int4"
    shutil.copytree(directory, int4, ignore=shutil.ignore_patterns("*.ort.onnx*"))
    build(int4, "onnxruntime", target_weights="int4", log=lambda *_: None)
    counts = json.loads((int4 / "manifest.json").read_text())["models"]["target"]["engine"]["quantized"]
    E, L = model.config.num_local_experts, model.config.num_hidden_layers
    assert counts == {"Q4_0": E * L, "Q4_1": E * L, "Q8_0": E * L + 4 * L + 2}
    gen = Generator.from_engines(int4)
    check_int4_engine(gen, model, [3, 14, 15, 9, 26, 5, 35, 8], 16)
