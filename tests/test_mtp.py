"""A target's MTP module as its drafter (specrt.export.mtp): a tiny Llama target whose checkpoint holds a DeepSeek-V3
style MTP module, written here from the DeepSeek-V3 technical report (section 2.2) and self-distilled on the target's
own outputs; its export, its logits, chaining, and the target's promise under --method mtp."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import tiny_model
from greedy_check import assert_same_or_tie
from specrt.decoding.drafters import chain_mask
from specrt.decoding.generate import Generator
from specrt.decoding.sampling import SamplingParams
from specrt.errors import CheckpointError, InputError
from test_gguf_target import nothing_converted  # noqa: F401 (a fixture)
from test_speculative import P_MIN, V, chi_square_p, exact_joint, sample_first3

MAX_LEN = 48


class PaperMTP(nn.Module):
    """One MTP module as the report describes it: h' = M [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)] (the embedding's
    half first, as DeepSeek-V3's checkpoints order eh_proj), one Transformer block of the main model's kind (its
    transformers decoder layer class), and the shared output head over RMSNorm of the block's output. `forward`
    returns the block's output (what the next depth reads) and the logits."""

    def __init__(self, target):
        super().__init__()
        c, norm = target.config, type(target.model.norm)
        d = c.hidden_size
        self.enorm, self.hnorm = norm(d, c.rms_norm_eps), norm(d, c.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = type(target.model.layers[0])(c, layer_idx=0)   # its index: a cache slot, unused
        self.head_norm = norm(d, c.rms_norm_eps)
        self.rotary = type(target.model.rotary_emb)(c)
        self.embed, self.head = target.model.embed_tokens, target.lm_head   # shared with the main model
        with torch.no_grad():
            for norm in (self.enorm, self.hnorm, self.head_norm):   # unlike each other: an order mix-up shows
                norm.weight.normal_(1.0, 0.3)

    def forward(self, hidden, tokens, positions):
        """hidden (B, S, d): the previous depth's representation at i; tokens (B, S): token i + 1; positions (B, S)."""
        x = self.eh_proj(torch.cat([self.enorm(self.embed(tokens)), self.hnorm(hidden)], -1))   # (B, S, d)
        S = x.shape[1]
        mask = torch.full((S, S), float("-inf")).triu(1)[None, None]                           # (1, 1, S, S)
        out = self.block(x, attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rotary(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        return out, self.head(self.head_norm(out))

    def checkpoint_keys(self, layer: int, layout: str = "deepseek") -> dict:
        """The module's weights as DeepSeek-V3's checkpoints hold them, after the target's own layers (`layer`), or
        as MiMo's do (`model.mtp_layers.0.`: other names, input_proj over [hidden; embedding])."""
        d = self.eh_proj.weight.shape[0]
        if layout == "deepseek":
            p = f"model.layers.{layer}."
            keys = {p + "enorm.weight": self.enorm.weight, p + "hnorm.weight": self.hnorm.weight,
                    p + "eh_proj.weight": self.eh_proj.weight, p + "shared_head.norm.weight": self.head_norm.weight,
                    p + "shared_head.head.weight": self.head.weight, p + "embed_tokens.weight": self.embed.weight}
        else:
            p, w = "model.mtp_layers.0.", self.eh_proj.weight
            keys = {p + "token_layernorm.weight": self.enorm.weight, p + "hidden_layernorm.weight": self.hnorm.weight,
                    p + "input_proj.weight": torch.cat([w[:, d:], w[:, :d]], 1),
                    p + "final_layernorm.weight": self.head_norm.weight}
        keys.update({p + k: v for k, v in self.block.state_dict().items()})
        return {k: v.detach().clone().contiguous() for k, v in keys.items()}


def self_distill(mtp: PaperMTP, target, steps: int = 60, rows: int = 32, length: int = 20, seed: int = 0) -> None:
    """Train the module on the target's own samples: slot t reads the target's last hidden state at t and token
    t + 1 and learns the target's distribution of token t + 2 (soft cross-entropy)."""
    g, threads = torch.Generator().manual_seed(seed), torch.get_num_threads()
    torch.set_num_threads(1)   # tiny matrices: a second thread only waits (15 ms a step against 100 here)
    with torch.no_grad():
        seqs = torch.randint(0, V, (rows, 2), generator=g)
        while seqs.shape[1] < length:                                                    # sampled at T = 1
            probs = target(seqs).logits[:, -1].softmax(-1)
            seqs = torch.cat([seqs, torch.multinomial(probs, 1, generator=g)], 1)        # (rows, length)
        feats = target.model(seqs).last_hidden_state                                     # (rows, length, d)
        probs = target.lm_head(feats).softmax(-1)                                        # (rows, length, V)
    trained = [p for n, p in mtp.named_parameters() if not n.startswith(("embed", "head."))]
    opt = torch.optim.Adam(trained, lr=1e-2)
    S = seqs.shape[1] - 2
    positions = torch.arange(S)[None].expand(seqs.shape[0], S)
    for _ in range(steps):
        _, logits = mtp(feats[:, :S], seqs[:, 1:S + 1], positions)
        loss = -(probs[:, 1:S + 1] * logits.log_softmax(-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    mtp.eval()


def save_with_mtp(target, mtp: PaperMTP, directory, layout: str = "deepseek") -> None:
    """`target`'s checkpoint with the module's weights in its safetensors, as a DeepSeek-V3 (or MiMo) checkpoint
    holds them."""
    from safetensors.torch import load_file, save_file
    target.save_pretrained(directory)
    state = load_file(str(directory / "model.safetensors"))
    state.update(mtp.checkpoint_keys(target.config.num_hidden_layers, layout))
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


@pytest.fixture(scope="module")
def mtp_set(tmp_path_factory):
    """A tiny peaked target (vocabulary V, for the exact joint distribution) with a self-distilled MTP module in its
    checkpoint, exported (the module found by `specrt export` itself) and built for the CPU."""
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    tmp = tmp_path_factory.mktemp("mtp")
    model = tiny_model("llama", seed=1, vocab=V, init=0.3)
    torch.manual_seed(4)
    mtp = PaperMTP(model)
    self_distill(mtp, model)
    save_with_mtp(model, mtp, tmp / "src")
    logs = []
    export_engines(str(tmp / "src"), tmp / "engines", max_seq_len=MAX_LEN, log=logs.append)
    build(tmp / "engines", "onnxruntime", log=lambda *_: None, drafter_weights="float32")
    return Generator.from_engines(tmp / "engines"), model, mtp, logs


def test_export_finds_the_module(mtp_set):
    gen, _, _, logs = mtp_set
    spec = gen.manifest["models"]["eagle"]
    assert spec["kind"] == "mtp" and spec["layout"] == "deepseek model.layers.2."
    assert gen.has("mtp") and not gen.has("eagle")
    assert gen.method_for("auto", greedy=True) == ("mtp", "rule")   # no tuning for this machine: the rule's choice
    assert any("MTP module" in line for line in logs)


def test_logits_match_the_papers_module(mtp_set):
    """The engine against PaperMTP: six slots over the target's features (depth 1), then a slot that reads the
    engine's own output at the last of them (depth 2, chained as the runtime chains it)."""
    gen, model, mtp, _ = mtp_set
    ids = torch.tensor([[3, 9, 1, 4, 1, 5, 9, 2]])
    with torch.no_grad():
        feats = model.model(ids).last_hidden_state                                      # (1, 8, d)
        ref_hidden, ref_logits = mtp(feats[:, :6], ids[:, 1:7], torch.arange(6)[None])
        cache = gen.eagle.new_cache(1, MAX_LEN)
        out = gen.eagle.forward(ids[:, 1:7], torch.arange(6)[None], cache.past_len, chain_mask(1, 6), 6, cache,
                                features=feats[:, :6])
        assert (out.logits - ref_logits).abs().max() < 1e-4
        cache.write(out.new_kv)
        cache.past_len += 6
        chained = torch.cat([feats[:, :6], ref_hidden[:, 5:6]], 1)                      # depth 2 at slot 6
        _, ref_deeper = mtp(chained, ids[:, 1:8], torch.arange(7)[None])
        deeper = gen.eagle.forward(ids[:, 7:8], torch.tensor([[6]]), cache.past_len, chain_mask(1, 1), 1, cache,
                                   features=out.hidden[:, 5:6])
        assert (deeper.logits[0, 0] - ref_deeper[0, 6]).abs().max() < 1e-4


def test_greedy_equals_the_target_alone(mtp_set):
    gen, model, _, _ = mtp_set
    accepted = proposed = 0
    for seed in range(3):
        prompt = torch.randint(0, V, (4 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="autoregressive").token_ids[0]
        for shape in (dict(top_k=1, depth=4, nodes=4), dict(top_k=3, depth=3, nodes=8)):   # a chain, a tree
            gen.eagle.spec["dynamic_tree"] = shape
            out = gen.generate(prompt_ids=prompt, max_new_tokens=30, method="mtp", adaptive=False)
            assert_same_or_tie(out.token_ids[0], ref, prompt, model)
            accepted += out.stats["acceptance_rate"] * out.stats["rounds"]
            proposed += out.stats["rounds"]
    print(f"mtp greedy: acceptance {accepted / proposed:.2f}")
    assert accepted > 0


def test_distribution_is_the_target_distribution(mtp_set):
    gen, model, _, _ = mtp_set
    gen.eagle.spec["dynamic_tree"] = dict(top_k=2, depth=2, nodes=3)
    prompt = [5, 1, 7]
    out = sample_first3(gen, prompt, "mtp", None, seed=123, temperature=1.0)
    assert 0 < out.stats["acceptance_rate"] < 0.95
    p = chi_square_p(out.token_ids, exact_joint(model, prompt, SamplingParams(temperature=1.0)))
    print(f"mtp: chi-square p = {p:.4f}, acceptance {out.stats['acceptance_rate']:.2f}")
    assert p > P_MIN


def test_mimo_layout_on_a_qwen2_target(tmp_path):
    """MiMo's names and its projection order ([hidden; embedding]) read into the same drafter: its eager pass
    against PaperMTP (the graph is the one the DeepSeek layout's test runs), over the target's features."""
    from specrt.export.model import from_hf
    from specrt.export.mtp import load_mtp
    model = tiny_model("qwen2", seed=2, vocab=V)
    torch.manual_seed(5)
    mtp = PaperMTP(model).eval()
    save_with_mtp(model, mtp, tmp_path / "src", "mimo")
    drafter, where = load_mtp(str(tmp_path / "src"), from_hf(model, MAX_LEN))
    assert where == "mimo model.mtp_layers.0."
    ids = torch.tensor([[3, 9, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        feats = model.model(ids).last_hidden_state[:, :6]                               # (1, 6, d)
        _, ref = mtp(feats, ids[:, 1:], torch.arange(6)[None])
        assert (drafter.logits(drafter.train_forward(feats, ids[:, 1:])) - ref).abs().max() < 1e-4


def test_refusals_name_the_problem(mtp_set, tmp_path):
    """--method eagle on an MTP set and --method mtp without one; a module that does not fit its target."""
    from specrt.export.model import from_hf
    from specrt.export.mtp import load_mtp
    gen, model, mtp, _ = mtp_set
    with pytest.raises(InputError, match="MTP module: --method mtp"):
        gen.generate(prompt_ids=[1, 2], max_new_tokens=2, method="eagle")
    spec = gen.manifest["models"]["eagle"]
    spec["kind"] = None   # the same engine as an EAGLE drafter's
    try:
        with pytest.raises(InputError, match="--method mtp: .* has no MTP module"):
            gen.generate(prompt_ids=[1, 2], max_new_tokens=2, method="mtp")
    finally:
        spec["kind"] = "mtp"
    save_with_mtp(model, mtp, tmp_path / "src")
    from safetensors.torch import load_file, save_file
    state = load_file(str(tmp_path / "src" / "model.safetensors"))
    state["model.layers.2.eh_proj.weight"] = state["model.layers.2.eh_proj.weight"][:, :40].contiguous()
    save_file(state, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.layers.2.\* does not fit.*shapes.*fc.weight \(32, 40\)"):
        load_mtp(str(tmp_path / "src"), from_hf(model, MAX_LEN))


@pytest.mark.parametrize("arch", ["glm4moe", "llama"])
def test_a_gguf_nextn_layer_is_refused_by_name(nothing_converted, arch):
    """llama.cpp keeps GLM-4.5's MTP layer as the last block's `nextn` tensors (its DeepSeek-V3 converter drops the
    layer). specrt exports no GLM target and does not read the layer: a file with one is refused by name before
    anything is converted, a GLM file and one of a registered architecture alike (whose layer would be lost)."""
    import numpy as np
    from specrt.errors import UnknownSourceError
    from specrt.export.pipeline import export_engines
    from test_gguf_target import write_gguf

    def nextn(writer):   # gguf's tensor names (MODEL_TENSOR.NEXTN_*), after the file's 2 blocks
        for name, shape in (("eh_proj", (256, 512)), ("enorm", (256,)), ("hnorm", (256,)),
                            ("shared_head_norm", (256,))):
            writer.add_tensor(f"blk.2.nextn.{name}.weight", np.ones(shape, np.float32))
    path = write_gguf(nothing_converted / "model.gguf", arch, types=["F32"], extra=nextn,
                      metadata={f"{arch}.nextn_predict_layers": 1})
    with pytest.raises(UnknownSourceError, match=rf"'{arch}' GGUF file with an MTP layer \(blk\.2\.nextn\.\*\).*"
                                                 r"--method mtp, export a checkpoint directory"):
        export_engines(str(path), nothing_converted / "out", log=lambda *_: None)
    assert sorted(p.name for p in nothing_converted.iterdir()) == ["model.gguf"]
