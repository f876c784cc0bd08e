"""End-to-end generation: greedy equals transformers `generate`, the API and CLI contracts, sampling."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from greedy_check import assert_greedy_under, assert_same_or_tie
from conftest import MATRIX, load_prompts
from specrt.errors import InputError
from specrt.decoding.generate import Generator


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", MATRIX)
def test_tiny_greedy_matches_transformers(tiny_engines, arch):
    """40 new tokens after prompts of 5-8: past the window (conftest.WINDOW) of the architectures that have one."""
    directory, model = tiny_engines[arch]
    gen = Generator.from_engines(directory)
    for seed in range(4):
        prompt = torch.randint(0, 64, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ours = gen.generate(prompt_ids=prompt, max_new_tokens=40, method="autoregressive").token_ids[0]
        assert len(ours) == 40
        assert_same_or_tie(ours, hf_greedy(model, prompt, 40), prompt, model)


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(default_generator, smollm2):
    """Teacher-forced through transformers' model (one pass per prompt; the tiny models above go through
    `generate` itself)."""
    ties = []
    for prompt in load_prompts(8):
        ids = default_generator.encode(prompt)
        ours = default_generator.generate(prompt_ids=ids, max_new_tokens=64, method="autoregressive").token_ids[0]
        assert_greedy_under(smollm2.model, ids, ours, 64, smollm2.eos_token_ids, ties)
    assert len(ties) <= 2, f"too many near ties to be chance: {ties}"


@pytest.mark.slow
def test_cached_gguf_conversion_loads_as_the_same_model(smollm2, tmp_path):
    """The source cache's checkpoint directory gives back the converted model: weights, config, eos ids, tokenizer
    and chat template, logits bit for bit."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from specrt.export.sources import _eos_ids, _save_conversion
    _save_conversion(smollm2.model, smollm2.tokenizer, tmp_path / "conversion")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "conversion", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "conversion")
    a, b = smollm2.model.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()   # still tied
    ours, theirs = model.config.to_dict(), smollm2.model.config.to_dict()
    assert {k for k in theirs if ours.get(k) != theirs[k]} <= {"_name_or_path", "quantization_config"}
    assert _eos_ids(model) == smollm2.eos_token_ids
    chat = [{"role": "user", "content": "Name three rivers, ça va?"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) == \
        smollm2.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = torch.tensor([smollm2.tokenizer("Hello world, 12345 <|im_start|>user")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, smollm2.model(ids).logits)


def test_same_seed_same_output(tiny_engines):
    gen = Generator.from_engines(tiny_engines["llama"][0])
    kw = dict(prompt_ids=[1, 2, 3], max_new_tokens=20, temperature=0.9, top_k=20, top_p=0.9,
              num_return_sequences=3, method="autoregressive")
    a, b = gen.generate(seed=7, **kw), gen.generate(seed=7, **kw)
    assert a.token_ids == b.token_ids
    assert len(a.token_ids) == 3 and all(len(t) == 20 for t in a.token_ids)
    assert gen.generate(seed=8, **kw).token_ids != a.token_ids


def test_stats_keys(tiny_engines):
    gen = Generator.from_engines(tiny_engines["llama"][0])
    stats = gen.generate(prompt_ids=[1, 2], max_new_tokens=5, method="autoregressive").stats
    for key in ("tokens", "rounds", "acceptance_rate", "mean_tokens_per_round", "acceptance_per_position",
                "tokens_per_s", "engine_time_s", "loop_time_s", "stop_reason"):
        assert key in stats
    assert stats["tokens"] == 5 and stats["stop_reason"] == "max_new_tokens"


def test_cli_json(tiny_engines):
    out = subprocess.run([sys.executable, "-m", "specrt.cli", "generate", str(tiny_engines["qwen2"][0]),
                          "--prompt-ids", "3,4,5", "--max-new-tokens", "6", "--num-return-sequences", "2",
                          "--temperature", "0.8", "--seed", "1", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc) == {"text", "token_ids", "stats"}
    assert [len(t) for t in doc["token_ids"]] == [6, 6]


@pytest.mark.slow
def test_chat_prompt_cli(default_engines):
    out = subprocess.run([sys.executable, "-m", "specrt.cli", "generate", str(default_engines), "--prompt",
                          "What is the capital of France?", "--max-new-tokens", "12", "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert "Paris" in doc["text"]


# ---- streaming ----------------------------------------------------------------------------------------------
def test_stream_gives_generate_output_round_by_round(tiny_engines):
    gen = Generator.from_engines(tiny_engines["llama"][0])
    for method in ("autoregressive", "ngram"):
        kw = dict(prompt_ids=[1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=24, method=method)
        whole, chunks = gen.generate(**kw), list(gen.stream(**kw))
        assert [t for c in chunks for t in c.token_ids] == whole.token_ids[0]
        assert all(c.stats is None for c in chunks[:-1]) and chunks[-1].stats["tokens"] == 24
        assert len(chunks) <= whole.stats["rounds"] + 2       # the prefill's token, then one chunk a round
        assert all(c.text is None for c in chunks)            # no tokenizer: ids only
    with pytest.raises(InputError, match="num_return_sequences 2"):
        next(gen.stream(prompt_ids=[1, 2], num_return_sequences=2, method="autoregressive"))
    # a refused stream left no state
    assert gen.generate(prompt_ids=[1, 2], max_new_tokens=3, method="autoregressive").stats["tokens"] == 3


@pytest.mark.slow
def test_stream_holds_back_split_characters(default_generator):
    """An emoji is several byte tokens: no chunk shows half of one, and the chunks add up to generate's text."""
    prompt = "Reply with three emojis: fire, water, earth."
    whole = default_generator.generate(prompt, max_new_tokens=30, method="medusa")
    chunks = list(default_generator.stream(prompt, max_new_tokens=30, method="medusa"))
    assert "".join(c.text for c in chunks) == whole.text[0]
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids[0]
    assert not any("\ufffd" in c.text for c in chunks[:-1])
    assert any(c.token_ids and not c.text for c in chunks), "expected a character split across tokens"


def test_cli_stream(tiny_engines):
    base = [sys.executable, "-m", "specrt.cli", "generate", str(tiny_engines["qwen2"][0]), "--prompt-ids", "3,4,5",
            "--max-new-tokens", "7"]
    streamed = subprocess.run(base + ["--stream"], capture_output=True, text=True)
    whole = subprocess.run(base + ["--json"], capture_output=True, text=True)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.strip() == ",".join(map(str, json.loads(whole.stdout)["token_ids"][0]))
    assert "7 tokens" in streamed.stderr
    refused = subprocess.run(base + ["--stream", "--json"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--stream prints one sequence" in refused.stderr


def test_drafters_load_when_a_request_needs_them(default_engines):
    """A process holds the engines of the methods it ran: the set's drafters load at their first request (not
    warm: a tuning's recorded draft step spares the draft model's load below)."""
    gen = Generator.from_engines(default_engines, warm=False)
    loaded = lambda: set(gen._drafters)   # noqa: E731
    assert all(gen.has(role) for role in ("draft", "medusa", "eagle")) and loaded() == set()
    ref = gen.generate(prompt_ids=[1, 2, 3, 4], max_new_tokens=8, method="autoregressive").token_ids
    assert gen.generate(prompt_ids=[1, 2, 3, 4], max_new_tokens=8, method="ngram").token_ids == ref
    assert loaded() == set()
    assert gen.generate(prompt_ids=[1, 2, 3, 4], max_new_tokens=8, method="eagle").token_ids == ref
    assert loaded() == {"eagle"}
    assert gen.costs().draft_step > 0 and loaded() == {"eagle", "draft"}   # the bench's c: the draft's step
