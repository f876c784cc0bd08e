"""A draft model of another vocabulary (token-level intersection, decoding/vocab_map.py), on a tiny pair of our own
making: a SentencePiece-style target tokenizer (`▁`, byte fallback `<0xNN>`, specials <unk> <s> </s>) and a
byte-level BPE drafter tokenizer (GPT-2's byte alphabet, specials <|endoftext|> ...), their merges disjoint. The
drafter is the target's own network read through its tokens: the rows of its embedding and LM head of the tokens
whose bytes are one target token are the target's rows of that token, the others random; the target's LM head gives
the tokens it does not share logit 0 (less likely). Where the target's text is made of shared tokens it drafts as the
target; elsewhere it reads the target's tokens spelled in its own (several tokens, shifted positions) and guesses
poorly."""
from __future__ import annotations

import inspect
import json
import shutil

import numpy as np
import pytest
import torch

from conftest import tiny_model
from greedy_check import assert_same_or_tie
from test_speculative import chi_square_p, exact_joint
from specrt.decoding.generate import Generator
from specrt.decoding.sampling import SamplingParams
from specrt.decoding.vocab_map import byte_decoder
from specrt.errors import ManifestError

SPECIALS_T = ["<unk>", "<s>", "</s>"]
FALLBACK_T = [0x0A, 0x21, 0x2C, 0x2E, 0x3F, 0xC3, 0xA9, 0x27]   # "\n ! , . ? é '" as <0xNN> tokens
MERGES_T = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("▁", "a"),
            ("r", "e"), ("a", "t"), ("▁", "s"), ("e", "n"), ("o", "r"), ("▁", "w"), ("i", "s"), ("▁", "c"),
            ("e", "s"), ("▁t", "o"), ("▁", "o"), ("i", "t"), ("in", "g"), ("a", "r"), ("▁", "b"), ("l", "l"),
            ("▁", "i"), ("▁", "m")]
SPECIALS_D = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES_D = [("n", "g"), ("i", "ng"), ("t", "h"), ("Ġ", "th"), ("Ġth", "e"), ("o", "u"), ("e", "d"), ("l", "e"),
            ("s", "t"), ("Ġ", "a"), ("Ġ", "s"), ("Ġ", "w"), ("Ġ", "o"), ("Ġ", "i"), ("Ġ", "b"), ("Ġ", "c"),
            ("o", "w")]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def target_tokenizer():
    """(tokenizer, each id's bytes or None for a special): 64 tokens, Llama's SentencePiece layout."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    tokens = SPECIALS_T + [f"<0x{b:02X}>" for b in FALLBACK_T] + ["▁", *LETTERS] + [a + b for a, b in MERGES_T]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, MERGES_T, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(SPECIALS_T)
    spelled = [None] * 3 + [bytes([b]) for b in FALLBACK_T] + [t.replace("▁", " ").encode() for t in tokens[11:]]
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"), spelled


def draft_tokenizer():
    """(tokenizer, each id's bytes or None): GPT-2's 256 byte tokens, 3 specials, 17 merges of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = {b: c for c, b in byte_decoder().items()}
    tokens = [chars[b] for b in range(256)] + SPECIALS_D + [a + b for a, b in MERGES_D]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, MERGES_D))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS_D)
    spelled = [bytes([b]) for b in range(256)] + [None] * 3 + \
        [bytes(byte_decoder()[c] for c in t) for t in tokens[259:]]
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>"), spelled


def shared_pairs(t_bytes, d_bytes) -> list[tuple[int, int]]:
    """(draft id, target id) of the tokens spelling the same bytes, from the construction above."""
    where = {b: i for i, b in enumerate(t_bytes) if b is not None}
    return sorted((d, where[b]) for d, b in enumerate(d_bytes) if b in where)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    """The tiny pair exported and built through the real pipeline: (generator, target model, tokenizers' bytes)."""
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    tmp = tmp_path_factory.mktemp("foreign")
    (t_tok, t_bytes), (d_tok, d_bytes) = target_tokenizer(), draft_tokenizer()
    target = tiny_model("llama", seed=1, vocab=len(t_bytes), init=0.3)
    draft = tiny_model("llama", seed=1, vocab=len(d_bytes), init=0.3)
    with torch.no_grad():   # the target prefers the shared tokens (0 logits elsewhere): mostly drafted as it
        shared = [t for _, t in shared_pairs(t_bytes, d_bytes)]
        target.lm_head.weight[[t for t in range(len(t_bytes)) if t not in shared]] = 0.0
        state = {k: v for k, v in target.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
        draft.load_state_dict(state, strict=False)
        for d, t in shared_pairs(t_bytes, d_bytes):
            draft.model.embed_tokens.weight[d] = target.model.embed_tokens.weight[t]
            draft.lm_head.weight[d] = target.lm_head.weight[t]
    for model, tok, name in ((target, t_tok, "target"), (draft, d_tok, "draft")):
        model.save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
    export_engines(str(tmp / "target"), tmp / "engines", draft=str(tmp / "draft"), max_seq_len=160,
                   log=lambda *_: None)
    build(tmp / "engines", "onnxruntime", log=lambda *_: None, drafter_weights="float32")
    return Generator.from_engines(tmp / "engines"), target, t_bytes, d_bytes, draft


def test_map_is_the_tokens_bytes(foreign):
    """The stored map against the construction: the drafter proposes exactly the tokens of the same bytes, and
    every target token reads as drafter tokens that spell its bytes (a special by its text)."""
    gen, _, t_bytes, d_bytes, _ = foreign
    vm = gen.draft_map
    assert sorted(zip(vm.shared_draft.tolist(), vm.shared_target.tolist())) == shared_pairs(t_bytes, d_bytes)
    for t, want in enumerate(t_bytes):
        want = want if want is not None else SPECIALS_T[t].encode()
        assert b"".join(d_bytes[d] for d in vm.expand([t])) == want, t
    assert gen.manifest["models"]["draft"]["vocab_map"]["shared"] == len(vm.shared_draft)


def test_a_pass_reads_each_row_in_drafter_tokens(foreign):
    """The drafter's pass over two rows whose target tokens read as different numbers of drafter tokens (the shorter
    row padded), then one token each from where each row ended: each row's target logits are those transformers'
    drafter gives at the row's last drafter token, over the shared tokens (-inf elsewhere)."""
    from specrt.decoding.drafters import DraftModelDrafter
    gen, *_, draft = foreign
    vm, tok = gen.draft_map, gen.tokenizer
    rows = [tok.encode(text, add_special_tokens=False) for text in ("the wing", "later, re-entering")]
    drafter = DraftModelDrafter(gen.draft, gen._timed, vocab_map=vm)
    cache = gen.draft.new_cache(2, 64)
    drafter.past = [0, 0]
    for step in (rows, [[40], [58]]):
        got = vm.to_target(drafter._foreign_pass(cache, step))                         # (2, V target)
        for b, r in enumerate(rows):
            r += step[b] if step is not rows else []
            with torch.no_grad():
                want = vm.to_target(draft(torch.from_numpy(vm.expand(r))[None]).logits[:, -1])
            assert torch.equal(torch.isinf(got[b]), torch.isinf(want[0]))
            torch.testing.assert_close(got[b][~torch.isinf(got[b])], want[0][~torch.isinf(want[0])], atol=1e-4,
                                       rtol=1e-4)


def prompts(gen):
    """A prompt of shared tokens (the drafter is the target there) and one of target-only tokens."""
    tok = gen.tokenizer
    return [tok.encode("the bow the wing", add_special_tokens=False),
            tok.encode("later, re-entering!", add_special_tokens=False)]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_greedy_is_the_targets(foreign, tree):
    gen, target, *_ = foreign
    accepted = []
    for prompt in prompts(gen):
        ref = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="autoregressive").token_ids[0]
        out = gen.generate(prompt_ids=prompt, max_new_tokens=16, method="draft", gamma=3, tree=tree,
                           adaptive=False)
        assert_same_or_tie(out.token_ids[0], ref, prompt, target)
        accepted.append(out.stats["acceptance_rate"])
    print(f"greedy acceptance ({'tree' if tree else 'chain'}): {accepted}")
    assert accepted[0] > 0.3   # the shared text: an off-by-one map drafts the wrong tokens (measured 0.0 then)


def test_prompt_lookup_and_a_batch_beside_it(foreign):
    """ngram on the same engine set, and the draft model over a batch of rows of different lengths."""
    gen, target, *_ = foreign
    batch = prompts(gen)
    refs = [gen.generate(prompt_ids=p, max_new_tokens=12, method="autoregressive").token_ids[0] for p in batch]
    for method in ("ngram", "draft"):
        out = gen.generate(prompt_ids=batch, max_new_tokens=12, method=method, gamma=2, adaptive=False)
        for got, ref, p in zip(out.token_ids, refs, batch):
            assert_same_or_tie(got, ref, p, target)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sampled_is_the_targets_distribution(foreign, tree):
    gen, target, *_ = foreign
    prompt = prompts(gen)[0]
    out = gen.generate(prompt_ids=prompt, max_new_tokens=3, num_return_sequences=12000, method="draft", gamma=2,
                       seed=5, adaptive=False, temperature=1.0, tree=tree, **STREAM)
    assert 0 < out.stats["acceptance_rate"] < 0.95   # drafts accepted and rejected (the residual drawn)
    p = chi_square_p(np.array(out.token_ids), exact_joint_v(target, prompt))
    print(f"foreign draft T=1 ({'tree' if tree else 'chain'}): acceptance {out.stats['acceptance_rate']:.2f}, "
          f"chi-square p = {p:.4f}")
    assert p > 1e-3


# the seed starts the rejection rule's random stream (where generate has per-position seeding, its default)
STREAM = {"seeding": "stream"} if "seeding" in inspect.signature(Generator.generate).parameters else {}


def exact_joint_v(model, prompt):
    """exact_joint of test_speculative over this target's vocabulary."""
    import test_speculative
    V = test_speculative.V
    test_speculative.V = model.config.vocab_size
    try:
        return exact_joint(model, prompt, SamplingParams(temperature=1.0))
    finally:
        test_speculative.V = V


def test_the_map_is_checked_at_load(foreign, tmp_path):
    gen, *_ = foreign
    bad = tmp_path / "engines"
    shutil.copytree(gen.directory, bad)
    m = json.loads((bad / "vocab_map.json").read_text())
    m["shared"]["target"][0] += 1
    (bad / "vocab_map.json").write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="draft vocabulary map: .*vocab_map.json has sha256"):
        Generator.from_engines(bad)


def test_verify_command(foreign):
    """`specrt verify` on the engine set: greedy identity on its prompts and the sampled check, PASS."""
    from click.testing import CliRunner
    from specrt.cli import main
    gen, *_ = foreign
    out = CliRunner().invoke(main, ["verify", str(gen.directory), "--method", "draft", "--prompts", "1",
                                    "--max-new-tokens", "8", "--samples", "1500", "--temperature", "1.0"])
    assert out.exit_code == 0, out.output
    assert "p = " in out.output and out.output.strip().endswith("PASS")


def test_a_tokenizer_the_map_cannot_read_is_refused_by_name():
    """A WordPiece tokenizer (its `##` pieces are not bytes the map knows how to spell) is refused, naming its
    decoder and the fix; so is a pair with no token in common."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    from specrt.decoding.vocab_map import build
    from specrt.errors import InputError
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    wordpiece.decoder = decoders.WordPiece()
    t_tok, _ = target_tokenizer()
    with pytest.raises(InputError, match="the draft's tokenizer decodes with WordPiece: .* use a drafter of the "
                                         "target's vocabulary"):
        build(t_tok, PreTrainedTokenizerFast(tokenizer_object=wordpiece), 64, 3)
    disjoint = Tokenizer(models.BPE({"<0x01>": 0}, [], byte_fallback=True))
    disjoint.decoder = decoders.ByteFallback()
    with pytest.raises(InputError, match="share no token"):
        build(t_tok, PreTrainedTokenizerFast(tokenizer_object=disjoint), 64, 1)


def test_the_shared_row_picks_what_the_targets_row_picks():
    """A greedy pick and a top-k over the shared tokens' logits alone (VocabMap.shared), mapped back, are those
    over the target-wide row (to_target)."""
    from specrt.decoding.sampling import argmax, top_k_ids
    from specrt.decoding.vocab_map import VocabMap
    rng = np.random.default_rng(0)
    draft, target = rng.choice(40, 25, replace=False), rng.choice(60, 25, replace=False)
    vm = VocabMap(60, 40, draft, target, np.arange(61), np.arange(60) % 40)
    logits = torch.from_numpy(rng.standard_normal((3, 40)).astype(np.float32))
    full, shared = vm.to_target(logits), vm.shared(logits)
    assert torch.equal(vm.shared_ids(argmax(shared)), argmax(full))
    assert torch.equal(vm.shared_ids(top_k_ids(shared, 4)), top_k_ids(full, 4))
