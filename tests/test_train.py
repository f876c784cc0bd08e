"""`specrt train`: a drafter of every kind for a tiny Qwen2 target with its own tokenizer and chat template, trained
end to end on the CPU in a few steps (enough to learn it: held out, each agrees with the target far more often than
untrained), exported, built and run losslessly; reruns resume; bad input writes nothing; the Makefile's SmolLM2
recipes are thin calls of it with the shipped drafters' settings."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess

import pytest
import torch
from click.testing import CliRunner

from conftest import REPO, tiny_model
from greedy_check import assert_same_or_tie
from specrt.cli import main

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DATA = ["--data-batch", "8", "--data-calls", "2", "--max-new-tokens", "12", "--num-template", "8"]
# 64 rows: 5 of their prompts (1 in 16, by name) are held out, 60 answer tokens to measure the drafters on
LEARN_DATA = ["--data-batch", "32", "--data-calls", "2", "--max-new-tokens", "12", "--num-template", "8"]


def tiny_tokenizer(vocab: int):
    """A byte-level BPE of `vocab` ids learnt from the seed tasks, with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = (REPO / "export" / "train" / "data" / "seed_tasks.jsonl").read_text().splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def train(*args) -> str:
    result = CliRunner().invoke(main, ["train", *map(str, args)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Qwen2 checkpoint directory (untied embeddings, q/k/v biases) with its tokenizer; its model. Its
    embeddings are scaled up (x50) over what its layers add, so that its next token hangs mostly on the last one
    (the layers still bring in the context): a pattern that drafters learn in a few steps, where a tiny random
    model's next token would take thousands."""
    path = tmp_path_factory.mktemp("train") / "qwen2"
    tok = tiny_tokenizer(384)
    model = tiny_model("qwen2", seed=4, vocab=len(tok), init=0.3, eos=tok.convert_tokens_to_ids("<|im_end|>"))
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(50)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model


def test_every_kind_trains_exports_and_keeps_the_target_output(target):
    """Each kind learns the target: its held-out agreement with the target's greedy tokens rises well above the
    untrained drafter's (the same command at --lr 0) and its loss falls; then export, build and lossless runs."""
    from specrt import Generator
    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    from specrt.export.train.train_draft import load_rows

    path, model = target
    tmp = path.parent
    eagle = ["--batch-tokens", 512, "--lr", 1e-2, "--warmup", 1, "--eval-every", 5, "--save-every", 5]
    # EAGLE makes its own data (in OUT.work/data), then the draft and the heads train on that data
    train("eagle", "--target", path, "--out", tmp / "eagle", "--steps", 10, *eagle, *LEARN_DATA)
    data = tmp / "eagle.work" / "data"
    rows = load_rows(str(data / "data.jsonl"))
    assert len(rows) == 64 and all(r["mode"] == "greedy" for r in rows)   # 2 calls of 32 greedy answers
    for r in rows:   # the prompt through the target's chat template, then its answer
        assert tokenizer_text(path, r["ids"][:r["prompt_len"]]).endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert r["prompt_len"] < len(r["ids"]) <= r["prompt_len"] + 12
    record = json.loads((tmp / "eagle" / "training.json").read_text())
    assert (record["steps_done"], record["sessions"]) == (10, [[0, 10]])

    # a rerun resumes: with a larger --steps it trains on from the checkpoint (no new data), else it does nothing
    train("eagle", "--target", path, "--out", tmp / "eagle", "--steps", 20, *eagle, *LEARN_DATA)
    train("eagle", "--target", path, "--out", tmp / "eagle", "--steps", 20, *eagle, *LEARN_DATA)
    record = json.loads((tmp / "eagle" / "training.json").read_text())
    assert (record["steps_done"], record["sessions"]) == (20, [[0, 10], [10, 20], [20, 20]])
    assert load_rows(str(data / "data.jsonl")) == rows

    train("draft", "--target", path, "--data", data, "--out", tmp / "draft", "--steps", 20, "--batch-tokens", 512,
          "--lr", 2e-2, "--warmup", 1, "--eval-every", 5)
    train("medusa", "--target", path, "--data", data, "--out", tmp / "medusa", "--heads", 2, "--epochs", 10,
          "--lr", 2e-2)
    for kind in ("eagle", "draft", "medusa"):
        card = (tmp / kind / "README.md").read_text()
        assert str(path) in card and "64 rows" in card and "training.json" in card
    assert json.loads((tmp / "draft" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    assert not list(tmp.glob(".*.partial"))
    assert_learned(path, tmp, data)

    out = export_engines(str(path), tmp / "engines", draft=str(tmp / "draft"), medusa=str(tmp / "medusa"),
                         eagle=str(tmp / "eagle"), max_seq_len=64, log=lambda *_: None)
    build(out, "onnxruntime", log=lambda *_: None, drafter_weights="float32")
    gen = Generator.from_engines(out)
    for seed in range(2):
        prompt = torch.randint(0, 384, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = gen.generate(prompt_ids=prompt, max_new_tokens=24, method="autoregressive").token_ids[0]
        for method in ("eagle", "draft", "medusa"):
            ours = gen.generate(prompt_ids=prompt, max_new_tokens=24, method=method, adaptive=False)
            assert ours.stats["method"] == method
            assert_same_or_tie(ours.token_ids[0], plain, prompt, model)


def assert_learned(path, tmp, data) -> None:
    """Held out (5 prompts of the 64 rows): the trained drafters' agreement with the target's greedy tokens against
    the untrained ones' (the draft's step 0; EAGLE and the heads run for a step at --lr 0, which changes no
    weight; the trained runs' features copied into their work directories, not computed again), and the training
    loss, first to last."""
    for kind in ("eagle", "medusa"):
        (tmp / f"{kind}-untrained.work").mkdir()
        shutil.copy(tmp / f"{kind}.work" / "features.pt", tmp / f"{kind}-untrained.work")
    train("eagle", "--target", path, "--data", data, "--out", tmp / "eagle-untrained", "--steps", 1,
          "--batch-tokens", 512, "--lr", 0)
    train("medusa", "--target", path, "--data", data, "--out", tmp / "medusa-untrained", "--heads", 2, "--epochs", 1,
          "--lr", 0)
    history = {kind: json.loads((tmp / kind / "training.json").read_text())["history"]
               for kind in ("eagle", "eagle-untrained", "draft", "medusa", "medusa-untrained")}
    untrained, trained = history["eagle-untrained"][-1], history["eagle"][-1]
    print(f"held-out agreement: EAGLE {untrained['agreement']:.3f} -> {trained['agreement']:.3f}, draft "
          f"{history['draft'][0]['agreement']:.3f} -> {history['draft'][-1]['agreement']:.3f}, Medusa top-5 "
          f"{history['medusa-untrained'][-1]['held_out']['top5']} -> {history['medusa'][-1]['held_out']['top5']}")
    assert untrained["agreement"] < 0.1 and trained["agreement"] > 0.4 and trained["own_agreement"] > 0.4
    assert trained["train_loss"] < history["eagle"][0]["train_loss"] < untrained["train_loss"]
    first, last = history["draft"][0], history["draft"][-1]   # step 0: the target's first layer, as it starts
    assert (first["step"], last["step"]) == (0, 20) and first["positions"] == last["positions"] == 60
    assert last["agreement"] > first["agreement"] + 0.15 and last["loss"] < first["loss"] - 0.2
    untrained, trained = history["medusa-untrained"][-1], history["medusa"][-1]
    for head in range(2):   # head k guesses token t + k + 2; untrained, each is the target's LM head (token t + 1)
        assert untrained["held_out"]["top1"][head] == untrained["held_out"]["top5"][head] == 0
        assert trained["held_out"]["top1"][head] > 0.1 and trained["held_out"]["top5"][head] > 0.3
    assert trained["train_loss"] < min(untrained["train_loss"], history["medusa"][0]["train_loss"]) - 1


def tokenizer_text(path, ids) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path).decode(ids)


def test_bad_input_is_refused_before_anything_is_written(target, tmp_path):
    path, _ = target
    out, files = tmp_path / "out", sorted(path.iterdir())
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "notes.txt").write_text("hello")
    no_tokenizer = tmp_path / "no-tokenizer"
    tiny_model("qwen2").save_pretrained(no_tokenizer)
    cases = [
        (["eagle3x", "--target", path], "'eagle3x' is not one of"),
        (["eagle", "--target", tmp_path / "not-a-model"], "unknown model source"),
        (["eagle", "--target", no_tokenizer], "has no tokenizer"),
        (["eagle", "--target", path, "--heads", 3], "--heads: not options of `specrt train eagle`"),
        (["draft", "--target", path, "--data", tmp_path / "nothing"], "holds no data.jsonl"),
        (["data", "--target", path, "--steps", 3, "--out", out], "--steps: not options of `specrt train data`"),
        (["draft", "--target", path, "--layers", "0,2"], "--layers 0,2: the target has layers 0 to 1"),
        (["draft", "--target", path, "--out", path], "holds other files"),   # never over the target's own files
    ]
    if not torch.cuda.is_available():
        cases.append((["eagle", "--target", path, "--device", "cuda"], "--device cuda: torch"))
    for args, message in cases:
        args = args if "--out" in args else [*args, "--out", out]
        args += [] if "--data" in args else DATA   # should a case run, a small one
        result = CliRunner().invoke(main, ["train", *map(str, args)])
        assert result.exit_code != 0 and message in result.output, (args, result.output)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["no-tokenizer", "not-a-model"], args
        assert sorted(path.iterdir()) == files and not list(path.parent.glob(".*.partial"))


def test_makefile_recipes_are_specrt_train_with_the_shipped_settings():
    """`make -n` prints the recipes; each, dry-run, resolves to the settings the shipped drafters were trained
    with (the recipes of the Makefile before `specrt train`)."""
    text = subprocess.run(["make", "-n", "train-draft", "train-medusa", "train-eagle", "SPECRT=specrt"], cwd=REPO,
                          capture_output=True, text=True, check=True).stdout.replace("\\\n", " ")
    calls = [shlex.split(line) for line in text.splitlines() if line.startswith("specrt train ")]
    assert [c[2] for c in calls] == ["data", "draft", "medusa", "eagle"]
    settings = {}
    for call in calls:
        result = CliRunner().invoke(main, [*call[1:], "--dry-run"])
        assert result.exit_code == 0, result.output
        settings[call[2]] = json.loads(result.output[result.output.index("{"):])
    data = settings["data"]["data"]
    assert (data["batch"], data["max_new_tokens"], data["num_template"], data["calls"], data["temperature"]) == \
        (128, 160, 600, 0, 0.7)
    from specrt.export.train.data import STAGES
    assert [(s.calls, s.samples, s.greedy, s.num_varied, s.num_self) for s in STAGES] == [
        (7, 0, True, 0, 0), (8, 16, False, 0, 0), (18, 4, False, 0, 0), (31, 0, True, 1600, 0),
        (44, 0, True, 3200, 0), (52, 0, True, 3200, 1024)]
    draft = settings["draft"]["settings"]
    assert {k: draft[k] for k in ("layers", "kept_vocab", "steps", "batch_tokens", "lr", "warmup", "weight_decay",
                                  "eval_every", "save_every", "max_minutes", "data", "work")} == dict(
        layers=[0, 1, 2], kept_vocab=12288, steps=800, batch_tokens=8192, lr=1e-3, warmup=20, weight_decay=0.05,
        eval_every=40, save_every=20, max_minutes=120, data="build/distill/data.jsonl", work="build/draft-train")
    medusa = settings["medusa"]["settings"]
    assert {k: medusa[k] for k in ("heads", "epochs", "max_positions", "batch", "lr", "root_token", "sequential",
                                   "vocab")} == dict(heads=4, epochs=1, max_positions=400000, batch=256, lr=1e-3,
                                                     root_token=True, sequential=False,
                                                     vocab="export/drafters/smollm2-135m-draft")
    from dataclasses import asdict

    from specrt.export.train.train_eagle import EagleTrainConfig
    old = asdict(EagleTrainConfig(max_minutes=120, feature_minutes=120))   # the recipe: defaults, 120 minutes
    same = [k for k in old if k not in ("out", "threads", "kept_vocab")]   # kept_vocab: --vocab-from decides
    assert {k: settings["eagle"]["settings"][k] for k in same} == {k: old[k] for k in same}
    assert all(re.fullmatch(r"export/drafters/smollm2-135m-\w+", settings[k]["out"]) for k in settings if k != "data")
