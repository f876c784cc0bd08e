"""Self-speculation (`--method self`, specrt.export.self_spec): the target drafts with some of its own layers, on its
own weights: the graph against transformers with those layers removed, greedy and sampled output the target's, the
weights not doubled on disk, the layer choice recorded and refused by name."""
from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
import torch

from conftest import tiny_model
from greedy_check import assert_same_or_tie
from test_speculative import chi_square_p, exact_joint
from specrt.decoding.generate import Generator
from specrt.decoding.sampling import SamplingParams
from specrt.errors import InputError
from specrt.export.self_spec import parse_layers, search_layers

V, KEPT = 24, [0, 1, 3]   # a vocabulary small enough for the exact joint; layer 2 of 4 skipped


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny peaked llama of 4 layers with its self drafter over KEPT, exported and built: (generator, model, dir)."""
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    tmp = tmp_path_factory.mktemp("self")
    model = tiny_model("llama", seed=3, vocab=V, layers=4, init=0.3)
    model.save_pretrained(tmp / "src")
    export_engines(str(tmp / "src"), tmp / "engines", max_seq_len=32, log=lambda *_: None, self_layers="0-1,3")
    build(tmp / "engines", "onnxruntime", log=lambda *_: None)
    return Generator.from_engines(tmp / "engines"), model, tmp / "engines"


def without_layers(model, kept):
    """The transformers model with only the `kept` layers (renumbered)."""
    small = copy.deepcopy(model)
    small.model.layers = torch.nn.ModuleList(small.model.layers[i] for i in kept)
    for j, layer in enumerate(small.model.layers):
        layer.self_attn.layer_idx = j
    per_layer = {"layer_types": [small.config.layer_types[i] for i in kept]} if \
        getattr(small.config, "layer_types", None) else {}
    small.config.__dict__.update(num_hidden_layers=len(kept), **per_layer)   # (set together: validated together)
    return small


@pytest.fixture
def layers(tiny, request):
    """The self drafter on the layers `request.param` for a test (the engine's skip_layers input), KEPT again after."""
    gen = tiny[0]
    gen.self_draft.use_layers(request.param)
    yield request.param
    gen.self_draft.use_layers(KEPT)


@pytest.mark.parametrize("layers", [KEPT, [0, 3], [2, 3]], indirect=True)
def test_the_graph_is_the_target_without_the_skipped_layers(tiny, layers):
    gen, model, _ = tiny
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = gen.self_draft.run_sequence(ids, num_logits=len(ids)).logits[0]                     # (S, V)
    with torch.no_grad():
        ref = without_layers(model, layers)(torch.tensor([ids]), use_cache=False).logits[0]
        full = model(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, ref, atol=1e-4), float((ours - ref).abs().max())
    assert not torch.allclose(ours, full, atol=1e-2)   # not the whole target
    target = gen.target.run_sequence(ids, num_logits=len(ids)).logits[0]   # the target's passes skip nothing
    assert torch.allclose(target, full, atol=1e-4), float((target - full).abs().max())


def test_a_skipped_layer_is_wholly_inside_its_if(tiny):
    """Attention too: in a fused graph a layer's attention reads the input norm that the node ending the layer
    before takes, not the residual stream; left outside its `If` it ran for skipped layers (its projections and a
    pass over the whole cache: a self drafter over half the layers cost 0.72 of a target pass, not 0.6)."""
    from specrt.export.self_spec import _reads
    graph = onnx.load(str(tiny[2] / "target.ort.onnx"), load_external_data=False).graph
    for i in range(3):
        readers = [n.name for n in graph.node if {f"k_cache_{i}", f"v_cache_{i}"} & _reads(n) and
                   n.op_type != "Shape"]   # (the cache's length, for the mask)
        assert readers == [f"/layers.{i}/skip_if"], (i, readers)


@pytest.mark.parametrize("arch,fuse", [("gemma3_text", True), ("qwen3_moe", True), ("llama", False)],
                         ids=["gemma3_text", "qwen3_moe", "llama-unfused"])
def test_other_architectures_skip_their_layers(tmp_path, arch, fuse):
    """Sandwich norms and sliding windows (Gemma 3), experts (Qwen3-MoE), an unfused build (`--no-fuse`: each
    layer's input norm in its own nodes, the caches written by the runtime): the target's engine with the skip input
    is the target, and the self drafter the target without its skipped layers."""
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    model = tiny_model(arch, seed=1, vocab=V, layers=4)
    model.save_pretrained(tmp_path / "src")
    export_engines(str(tmp_path / "src"), tmp_path / "engines", max_seq_len=32, log=lambda *_: None,
                   self_layers="0,2-3")
    build(tmp_path / "engines", "onnxruntime", log=lambda *_: None, fuse=fuse)
    gen = Generator.from_engines(tmp_path / "engines")
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        full = model(torch.tensor([ids])).logits[0]
        ref = without_layers(model, [0, 2, 3])(torch.tensor([ids]), use_cache=False).logits[0]
    for engine, want in ((gen.target, full), (gen.self_draft, ref)):
        got = engine.run_sequence(ids, num_logits=len(ids)).logits[0]
        assert torch.allclose(got, want, atol=1e-4), float((got - want).abs().max())
    prompt = ids[:4]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="self", gamma=3, adaptive=False).token_ids[0]
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="autoregressive").token_ids[0]
    assert_same_or_tie(out, ref, prompt, model)


def test_the_choice_is_recorded_and_the_weights_are_the_targets(tiny):
    gen, _, directory = tiny
    entry = json.loads((directory / "manifest.json").read_text())["models"]["self"]
    assert entry["kept_layers"] == KEPT and entry["layers"] == 3
    assert entry["own_weight_bytes"] == 0 and entry["engine"]["layer_skip"] == "target"
    stored = [t for t in onnx.load(str(directory / "self.onnx"), load_external_data=False).graph.initializer
              if t.data_location == onnx.TensorProto.EXTERNAL]
    assert stored and {e.value for t in stored for e in t.external_data if e.key == "location"} == {"target.onnx.data"}
    assert not (directory / "self.onnx.data").exists() and not (directory / "self.ort.onnx").exists()
    # in memory: the target's own session, on its skip_layers input (one copy of the weights, packed once)
    assert gen.self_draft.session is gen.target.session and gen.self_draft.kept == KEPT


@pytest.mark.parametrize("tree,layers", [(False, KEPT), (True, KEPT), (False, [0, 3])], ids=["chain", "tree", "0,3"],
                         indirect=["layers"])
def test_greedy_is_the_targets(tiny, tree, layers):
    """On the target's own cache (SelfDrafter): fails when the drafter writes a committed position (its kept layers
    past a skipped one would leave their entries there, not the target's)."""
    gen, model, _ = tiny
    rates = []
    for seed in range(3):
        prompt = torch.randint(0, V, (4 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="self", gamma=3, tree=tree, adaptive=False)
        assert_same_or_tie(out.token_ids[0], ref, prompt, model)
        rates.append(out.stats["acceptance_rate"])
    assert max(rates) > (0.3 if layers == KEPT else 0.05), rates   # the target's own layers draft
    assert "self" not in gen._buffers   # no cache of its own: the target's


def test_greedy_is_the_targets_in_a_batch(tiny):
    """Rows of other lengths in one batch: each drafts from its own end of the target's cache."""
    gen, model, _ = tiny
    prompts = [[5, 1, 9], [2, 8, 3, 3, 7, 1, 4], [11]]
    out = gen.generate(prompt_ids=prompts, max_new_tokens=14, method="self", gamma=3, adaptive=False)
    for prompt, got in zip(prompts, out.token_ids):
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=14, method="autoregressive").token_ids[0]
        assert_same_or_tie(got, ref, prompt, model)
    assert out.stats["acceptance_rate"] > 0.1
    # a server's batch: rows join after 2 and 4 rounds and leave at their own lengths (rows move), a tree each round
    batch, outputs, rounds, new = gen.batch(3, method="self", adaptive=False, tree=True), {}, 0, [20, 14, 8]
    batch.add(prompts[0], new[0], owner=0)
    while batch.run.batch or len(outputs) < 3:
        if rounds in (2, 4):
            batch.add(prompts[rounds // 2], new[rounds // 2], owner=rounds // 2)
        outputs.update((row.owner, tokens) for row, tokens in batch.retire())
        batch.step()
        rounds += 1
    for i, prompt in enumerate(prompts):
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=new[i], method="autoregressive").token_ids[0]
        assert_same_or_tie(outputs[i], ref, prompt, model)
    assert max(batch.stats()["batch_rounds"]) == 3 and batch.stats()["acceptance_rate"] > 0.1


def test_sampled_is_the_targets_distribution(tiny):
    gen, model, _ = tiny
    prompt = [3, 7, 1]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=12000, method="self", gamma=2,
                       seed=5, adaptive=False, temperature=1.0, seeding="stream")
    assert 0 < out.stats["acceptance_rate"] < 0.98   # drafts accepted and rejected (the residual drawn)
    p = chi_square_p(np.array(out.token_ids), exact_joint(model, prompt, SamplingParams(temperature=1.0)))
    print(f"self T=1: acceptance {out.stats['acceptance_rate']:.2f}, chi-square p = {p:.4f}")
    assert p > 1e-3


def test_layers_refused_by_name(tiny):
    assert parse_layers("0-1,3", 4) == KEPT and parse_layers("half", 30) == [*range(15), 29]
    for bad, says in (("0-4", "layer 4 is out of range"), ("0-3", "every layer"), ("x", "'x'")):
        with pytest.raises(InputError, match=says):
            parse_layers(bad, 4)
    gen, *_ = tiny
    other = Generator(gen.directory, {"models": {"target": {}}}, gen.target, None, gen.tokenizer)
    with pytest.raises(InputError, match="no self drafter; export with --self-layers"):
        other.generate(prompt_ids=[1, 2], max_new_tokens=2, method="self")


def test_search_drops_the_layer_that_costs_least(tiny):
    from specrt.export.model import from_hf
    _, model, _ = tiny
    target, threads = from_hf(model, 64), torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matrices: a busy thread pool costs seconds here
    try:
        kept, search = search_layers(target, [[1, 2, 3], [5, 6, 7, 8]], log=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    alone, steps = {int(d): x for d, x in search["alone"].items()}, search["steps"]
    assert set(alone) == {0, 1, 2}   # the last layer is the self drafter's always
    order = sorted(alone, key=lambda d: (-alone[d], d))   # the least missed layer first
    assert [x["dropped"] for x in steps] == order[:len(steps)] and steps[0]["layers"] == 3
    assert steps[0]["agreement"] == round(alone[order[0]], 4)
    best = max(steps, key=lambda s: s["estimated_speedup"])
    assert kept == [k for k in range(4) if k not in order[:4 - best["layers"]]]


def test_tune_chooses_the_layers_from_what_they_measure(tiny, tmp_path):
    """`specrt tune` measures layer sets on the one engine and records the best estimate; a warm process runs it."""
    import shutil
    from specrt.measurement.tune import TuneConfig, tune
    from specrt.engines.manifest import read_manifest, write_manifest
    directory = shutil.copytree(tiny[2], tmp_path / "engines")
    manifest = read_manifest(directory)
    manifest["models"]["self"]["kept_layers"] = [3]   # the export's choice: one tune will not keep (acceptance ~0)
    write_manifest(directory, manifest)
    result = tune(directory, TuneConfig(prompts=2, new_tokens=12, batches=(1,), trees=False), log=lambda *_: None)
    steps = result.self_search
    assert steps and [len(s["layers"]) for s in steps] == list(range(3, 3 - len(steps), -1))
    assert all(set(b["layers"]) < set(a["layers"]) for a, b in zip(steps, steps[1:]))   # one more dropped each
    assert [s["agreement_alone"] for s in steps] == sorted((s["agreement_alone"] for s in steps), reverse=True)
    assert all(s["step_s"] > 0 and 0 <= s["alpha"] <= 1 and s["layers"][-1] == 3 for s in steps)
    best = max(steps, key=lambda s: s["estimated_speedup"])
    assert result.self_layers == best["layers"] and len(best["layers"]) > 1
    stop = steps[-1]["alpha"] <= 0.1, len(steps) - steps.index(best) == 4, len(steps) == 3   # (alpha rounded)
    assert any(stop) and not any(s["alpha"] < 0.1 for s in steps[:-1])   # where the search stops
    warm = Generator.from_engines(directory)
    assert warm.self_draft.kept == best["layers"]
    # its step as timed beside the recorded passes: a warm process does not time it alone
    assert result.self_step > 0 and warm.costs(draft="self").draft_step == result.self_step
    assert Generator.from_engines(directory, warm=False).self_draft.kept == [3]   # the export's, untuned


def test_a_cuda_build_keeps_one_copy_of_the_weights(tiny, tmp_path):
    """`--device cuda` (run here on the CPU provider): the self drafter stays an engine of its own (ONNX Runtime's
    CUDA graph capture takes no `If`), its tensors written once, into the target's weights file, its session given
    the target's values, and its passes the target's cache."""
    import shutil
    from specrt.export.build import build
    gen, model, source = tiny
    directory = shutil.copytree(source, tmp_path / "cuda", ignore=shutil.ignore_patterns("*.ort.onnx*", "tuning*"))
    build(directory, "onnxruntime", log=lambda *_: None, device="cuda", dtype="float32", widths=(1, 4))
    entry = json.loads((directory / "manifest.json").read_text())["models"]["self"]["engine"]
    graph = onnx.load(str(directory / entry["file"]), load_external_data=False)
    places = {e.value for t in graph.graph.initializer for e in t.external_data if e.key == "location"}
    assert places == {"target.cuda.weights"} and not (directory / "self.cuda.weights").exists()
    cuda = Generator.from_engines(directory, device="cpu")
    assert cuda.self_draft.weights is cuda.target.weights
    prompt = [2, 8, 3, 3, 7, 1, 4]
    ref = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="autoregressive").token_ids[0]
    out = cuda.generate(prompt_ids=prompt, max_new_tokens=12, method="self", gamma=3, adaptive=False)
    assert_same_or_tie(out.token_ids[0], ref, prompt, model)
    # on the target's cache too, its layers bound to the kept layers' buffers: the drafts of the one-session drafter
    # (a cache of its own, or the layers bound to others, draft otherwise)
    one = gen.generate(prompt_ids=prompt, max_new_tokens=12, method="self", gamma=3, adaptive=False)
    assert out.stats["acceptance_rate"] == one.stats["acceptance_rate"] > 0.3 and "self" not in cuda._buffers
