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

from conftest import export_tiny, tiny_model
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
