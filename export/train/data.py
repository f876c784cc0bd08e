"""Self-distillation data: the target answers training prompts, and its answers become the drafter's labels.

Prompts come from three places, each row records which:
  seed       the 175 Self-Instruct seed tasks (instruction + input), `data/seed_tasks.jsonl`, Apache-2.0
  template   prompts this module composes from its own templates and topic lists (seeded, reproducible)
  varied     longer, more varied requests composed by `prompts.py` (writing, role play, reasoning, math, code,
             extraction, science, humanities; constraints and follow-ups), seeded
  self       requests the target writes itself (--num-self): given its chat template's user-turn prefix (none
             without a template) and the first word or two of a request (writing, QA, translation,
             summarisation, maths, code, extraction, role play, advice), it samples the rest of the request; kept
             in `<out dir>/self_prompts.jsonl`
The MT-Bench prompts are the benchmark set and are never used here. A prompt reaches the target through its chat
template (the user turn and the generation prompt), or as plain text where its tokenizer has none.

Each prompt is answered greedily once (unless --no-greedy) and sampled `samples` times (temperature 0.7, the
full distribution).
Output: JSON lines {prompt_id, source, prompt, mode, temperature, seed, ids, prompt_len}; rerunning the command
skips the prompts already in the file, so an interrupted run resumes.

Two generators:
  --batched B   (the recipe of the shipped drafters) the target's transformers model in bf16, B answers per call,
                prompts of similar length together; the target's top-16 logits at every answer position are
                saved beside the file (`<out>.teacher/`) as the soft labels, so no second scoring pass is needed
  default       the target's ORT engine, one prompt per call; `train_draft` scores its rows afterwards
`--human` adds, without generating, the seed tasks' own human-written answers in the chat format (mode "human").
`make_data` runs the stages of a plan (`STAGES`, the recipe of the shipped drafters) one after the other; it is
what `specrt train` calls.

    python -m specrt.export.train.data --out build/distill/data.jsonl --batched 128 --samples 16 --max-calls 60
"""
from __future__ import annotations

import argparse
import json
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from specrt.export.sources import DEFAULT_TARGET

SEED_TASKS = Path(__file__).parent / "data" / "seed_tasks.jsonl"

TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning",
    "climate change", "the human immune system", "volcanoes", "the stock market", "renewable energy",
    "the Roman Empire", "quantum computing", "honey bees", "the Internet", "plate tectonics", "vaccines",
    "inflation", "the printing press", "coral reefs", "electric cars", "the Moon landing", "DNA",
    "sleep", "coffee", "chess", "jazz music", "the Great Wall of China", "recycling", "gravity",
    "the Olympic Games", "social media", "bicycles", "rainforests", "time zones", "the human heart",
    "operating systems", "compound interest", "earthquakes", "the Renaissance", "public libraries",
    "solar panels", "antibiotics", "the Silk Road", "password security", "bread baking", "marathon training",
    "the periodic table", "migratory birds", "remote work", "urban gardening",
]
TEMPLATES = [
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "What are three interesting facts about {t}?",
    "Give me a brief history of {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Write a short poem about {t}.",
    "Summarize the key ideas behind {t} in a few sentences.",
    "Write a tweet about {t}.",
    "Create a quiz with three questions about {t}.",
    "How would you teach a beginner about {t}?",
    "Write the opening of a blog post about {t}.",
    "List five words related to {t} and define each one.",
    "Why is {t} important?",
    "Describe a common misconception about {t}.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a sentence", "finds the largest element of a list", "sorts a list of words by length",
    "removes duplicates from a list", "converts Celsius to Fahrenheit", "checks whether a word is a palindrome",
    "computes the factorial of a number", "merges two sorted lists", "counts word frequencies in a text",
    "finds the greatest common divisor of two numbers", "flattens a nested list", "validates an email address",
]
LANGUAGES = ["Python", "JavaScript", "C", "Java", "Rust"]
NAMES = ["Alice", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas"]
ITEMS = ["apples", "pencils", "books", "marbles", "cookies", "stamps", "tickets", "shells"]
WRITING = [
    "Write a polite email to a {r} asking to reschedule a meeting.",
    "Write a short thank-you note to a {r}.",
    "Write a two-sentence story about a {r} who finds a lost key.",
    "Write a job advertisement for a {r}.",
    "Pretend you are a {r}. Introduce yourself in a few sentences.",
    "Give three tips for becoming a good {r}.",
]
ROLES = ["teacher", "neighbour", "nurse", "software engineer", "chef", "librarian", "pilot", "gardener",
         "journalist", "museum guide"]


def seed_prompts(path: Path = SEED_TASKS) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        task = json.loads(line)
        text = task["instruction"]
        extra = task["instances"][0]["input"] if task["instances"] else ""
        if extra.strip():
            text = f"{text}\n\n{extra}"
        rows.append({"prompt_id": task["id"], "source": "seed", "prompt": text})
    return rows


def _math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(3, 40), rng.randint(2, 12), rng.randint(1, 9)
    name, other, item = *rng.sample(NAMES, 2), rng.choice(ITEMS)
    return rng.choice([
        f"{name} has {a} {item}. {other} gives {name} {b} more, then {name} gives away {c}. How many {item} "
        f"does {name} have now? Explain step by step.",
        f"A box holds {b} {item}. How many {item} are in {a} boxes? Show your work.",
        f"What is {a} times {b} plus {c}?",
        f"Solve for x: {b}x + {c} = {b * a + c}.",
        f"{name} reads {b} pages a day. How many days does it take to read a book of {a * b} pages?",
    ])


def template_prompts(n: int, seed: int = 0) -> list[dict]:
    """`n` prompts composed from this module's templates (topics, code, arithmetic, writing), seeded."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.55:
            text = rng.choice(TEMPLATES).format(t=rng.choice(TOPICS))
        elif kind < 0.7:
            text = f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODE_TASKS)}."
        elif kind < 0.85:
            text = _math_prompt(rng)
        else:
            text = rng.choice(WRITING).format(r=rng.choice(ROLES))
        out.append({"prompt_id": f"template_{len(out)}", "source": "template", "prompt": text})
    return out


# how a self-written request begins: the target writes the rest (source "self")
STARTERS = {
    "writing": ["Write", "Compose", "Draft", "Write a short story about", "Write a poem about"],
    "qa": ["What is", "Why do", "How does", "Who was", "What are the main differences between"],
    "translation": ["Translate the following sentence into French:", "Translate into Spanish:",
                    "Translate this text into German:", "How do you say"],
    "summarisation": ["Summarize the following text:", "Give a short summary of", "Summarize this article:"],
    "maths": ["Solve", "Calculate", "A store sells", "If a train travels", "What is the probability that"],
    "code": ["Write a Python function", "Write a SQL query", "Explain what this code does:", "Fix the bug in",
             "Write a JavaScript function"],
    "extraction": ["Extract", "From the text below, list", "Identify the names and dates in"],
    "role play": ["Imagine you are", "Pretend to be", "Act as"],
    "advice": ["Give me tips on", "How can I", "What should I consider when"],
}


def self_prompts(out: Path, n: int, seed: int, batch: int = 128, max_new_tokens: int = 96,
                 deadline: float = float("inf"), src=None) -> list[dict]:
    """`n` requests the target writes itself (sampled at T = 0.8, top-p 0.95, from a starter of each kind in turn),
    written to `self_prompts.jsonl` beside `out` and read from there on later calls (resumable; past `deadline`,
    a time.time(), it writes no more and returns those written). A request that does not end within
    `max_new_tokens` or has fewer than four words is dropped (its slot stays empty). `src`: the target
    (`bf16_target`; the default model if not given)."""
    path = out.parent / "self_prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if len(rows) >= n or not n:
        return [r for r in rows if r["prompt"] is not None][:n]
    src = src or bf16_target(DEFAULT_TARGET)
    tok, eos, device = src.tokenizer, set(src.eos_token_ids), src.model.device
    prefix = user_prefix(tok)
    pad = pad_id(src)
    kinds = [(kind, s) for kind, starters in STARTERS.items() for s in starters]
    rng = random.Random(f"self-{seed}")
    with path.open("a") as f:
        while len(rows) < n and time.time() < deadline:
            chunk = [(len(rows) + j, *kinds[(len(rows) + j) % len(kinds)]) for j in range(min(batch, n - len(rows)))]
            ids = [_ids(tok(prefix + starter, add_special_tokens=not tok.chat_template)["input_ids"])
                   for _, _, starter in chunk]
            width = max(map(len, ids))
            torch.manual_seed(rng.randrange(1 << 31))
            with torch.no_grad():
                seqs = src.model.generate(
                    input_ids=torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device),
                    attention_mask=torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device),
                    max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_p=0.95, top_k=0,
                    pad_token_id=pad, eos_token_id=sorted(eos))[:, width:].tolist()
            new = []
            for (i, kind, starter), seq in zip(chunk, seqs):
                end = next((j for j, t in enumerate(seq) if t in eos), None)
                text = (starter + tok.decode(seq[:end])).strip() if end is not None else None
                if text is not None and len(text.split()) < 4:
                    text = None
                new.append({"prompt_id": f"self_{i}", "source": "self", "kind": kind, "prompt": text})
            f.writelines(json.dumps(r) + "\n" for r in new)
            f.flush()
            rows += new
    return [r for r in rows if r["prompt"] is not None]


def all_prompts(num_template: int, seed: int, num_varied: int = 0, self_written: list[dict] = ()) -> list[dict]:
    """Seed tasks, templated, varied and self-written prompts interleaved, so a run cut short by its time budget
    sees all."""
    from specrt.export.train.prompts import varied_prompts
    sources = (seed_prompts(), template_prompts(num_template, seed), varied_prompts(num_varied, seed),
               list(self_written))
    rows = []
    for i in range(max(map(len, sources))):
        rows += [r[i] for r in sources if i < len(r)]
    return rows


DATA_FILE, PLAN_FILE = "data.jsonl", "data.json"


@dataclass(frozen=True)
class Stage:
    """One step of a data plan: batched generation calls until there are `calls` in all, answering the prompts
    it names (seed tasks and `num_template` templates always, then `num_varied` varied ones and `num_self`
    requests the target writes itself); a stage also ends when its prompts are all answered."""
    calls: int
    samples: int = 0          # sampled answers per prompt (the full distribution at the plan's temperature)
    greedy: bool = True       # and one greedy answer
    num_varied: int = 0
    num_self: int = 0


# The shipped drafters' plan (at 128 answers a call): greedy answers to the seed tasks and templates, sampled ones
# (16, then 4 a prompt), then greedy answers to more and more varied prompts and, last, to requests the target
# writes itself.
STAGES = (Stage(7), Stage(8, samples=16, greedy=False), Stage(18, samples=4, greedy=False),
          Stage(31, num_varied=1600), Stage(44, num_varied=3200), Stage(52, num_varied=3200, num_self=1024))


@dataclass
class DataConfig:
    target: str = DEFAULT_TARGET
    out: str = "build/distill"        # the data directory: data.jsonl, data.teacher/, self_prompts.jsonl, data.json
    batch: int = 128                  # answers per generation call
    max_new_tokens: int = 160
    num_template: int = 600
    calls: int = 0                    # generation calls in all at most (0: the plan's)
    temperature: float = 0.7
    seed: int = 0
    device: str = "cpu"
    max_minutes: float = 0.0          # this call's budget (0: none); rerun to continue


def make_data(cfg: DataConfig, vocab_size: int, stages: tuple[Stage, ...] = STAGES) -> Path:
    """The plan's stages in turn, each resumable (a stage whose calls are made, or whose prompts are all
    answered, is skipped without loading the target); returns the data file. `data.json` records the target's
    vocabulary size (data made for another target is refused) and the stages whose prompts ran out."""
    directory = Path(cfg.out)
    check_data_dir(directory, cfg.target, vocab_size)
    directory.mkdir(parents=True, exist_ok=True)
    plan_file, out = directory / PLAN_FILE, directory / DATA_FILE
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else {"exhausted": []}
    plan.update(target=cfg.target, vocab_size=vocab_size)
    plan_file.write_text(json.dumps(plan) + "\n")
    deadline = time.time() + 60 * cfg.max_minutes if cfg.max_minutes else float("inf")
    src = None
    for i, stage in enumerate(stages):
        calls = min(stage.calls, cfg.calls) if cfg.calls else stage.calls
        if i in plan["exhausted"] or row_calls(out.with_suffix(".teacher")) >= calls:
            continue
        if time.time() > deadline:
            print("the data's time budget is spent; rerun to continue")
            break
        src = src or bf16_target(cfg.target, cfg.device)
        left = generate_batched(out, cfg.max_new_tokens, stage.samples, cfg.temperature,
                                (deadline - time.time()) / 60, cfg.num_template, cfg.seed, cfg.batch, stage.greedy,
                                max_calls=calls, num_varied=stage.num_varied, num_self=stage.num_self, src=src)
        if not left:
            plan["exhausted"].append(i)
            plan_file.write_text(json.dumps(plan) + "\n")
    return out


def check_data_dir(directory: Path, target: str, vocab_size: int) -> None:
    """Refuses data made for a target of another vocabulary (its labels are that target's ids)."""
    from specrt.errors import InputError
    plan_file = Path(directory) / PLAN_FILE
    if plan_file.is_file():
        made = json.loads(plan_file.read_text())
        if made.get("vocab_size") != vocab_size:
            raise InputError(f"{directory} holds data made for {made.get('target')!r} (vocabulary "
                             f"{made.get('vocab_size')}), not for {target!r} (vocabulary {vocab_size}): pass "
                             "another data directory")


def generate(engines: str, out: Path, max_new_tokens: int, samples: int, temperature: float,
             max_minutes: float, num_template: int, seed: int, greedy: bool = True, num_varied: int = 0) -> None:
    from rich.progress import Progress

    from specrt import Generator

    gen = Generator.from_engines(engines)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        done = {json.loads(line)["prompt_id"] for line in out.read_text().splitlines() if line.strip()}
    todo = [p for p in all_prompts(num_template, seed, num_varied) if p["prompt_id"] not in done]
    deadline = time.time() + 60 * max_minutes
    tokens = 0
    with out.open("a") as f, Progress() as bar:
        task = bar.add_task("distilling", total=len(todo))
        for i, p in enumerate(todo):
            if time.time() > deadline:
                bar.console.print(f"time budget reached after {i} prompts")
                break
            ids = gen.encode(p["prompt"])
            runs = [("greedy", 0.0, 1, None)] if greedy else []
            if samples:
                runs.append(("sampled", temperature, samples, seed + i))
            rows = []
            for mode, temp, n, s in runs:
                r = gen.generate(prompt_ids=ids, max_new_tokens=max_new_tokens, temperature=temp, seed=s,
                                 num_return_sequences=n, method="autoregressive")
                rows += [{**p, "mode": mode, "temperature": temp, "seed": s, "ids": ids + new,
                          "prompt_len": len(ids)} for new in r.token_ids]
                tokens += r.stats["tokens"]
            f.writelines(json.dumps(r) + "\n" for r in rows)
            f.flush()
            bar.update(task, advance=1, description=f"distilling ({tokens} tokens)")


def bf16_target(name: str, device: str = "cpu"):
    """The target `name` (a model source) in bfloat16 on `device`, with a tokenizer (the prompts are text)."""
    from specrt.errors import InputError
    from specrt.export.sources import load_source
    src = load_source(name)
    if src.tokenizer is None:
        raise InputError(f"target {name!r} has no tokenizer: the training prompts are text; put the tokenizer's "
                         "files (tokenizer.json, tokenizer_config.json) in its checkpoint directory")
    src.model.to(device=device, dtype=torch.bfloat16)
    return src


def pad_id(src) -> int:
    tok = src.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else (src.eos_token_ids or [0])[0]


def padded(rows: list[dict], batch: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's rows padded at the end: token ids (b, S) and the attention mask (b, S), S = the longest row."""
    lengths = [len(rows[i]["ids"]) for i in batch]
    ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (i, n) in enumerate(zip(batch, lengths)):
        ids[b, :n], mask[b, :n] = torch.tensor(rows[i]["ids"]), 1
    return ids, mask


def user_prefix(tok) -> str:
    """What precedes a user's request: the chat template's user-turn prefix ("" without a template)."""
    if not tok.chat_template:
        return ""
    marker = "\x00"
    return tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False).split(marker)[0]


def encode_prompt(tok, text: str) -> list[int]:
    """A request as the target reads it, as `Generator.encode` writes it: the chat template's user turn and
    generation prompt, or the plain text (with the tokenizer's special tokens) where there is no template."""
    if tok.chat_template:
        return _ids(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True))
    return _ids(tok(text)["input_ids"])


class _TopK(LogitsProcessor):
    """Keeps the top-k of the target's raw logits at every step (it runs before the sampling warpers) and passes
    them on unchanged: the labels, without holding every step's full logits (B x steps x V floats, 4 GB at B = 128
    and 160 steps, which `output_logits` keeps)."""

    def __init__(self, k: int):
        self.k, self.values, self.index = k, [], []

    def __call__(self, input_ids, scores):
        top = scores.float().topk(self.k, dim=-1)
        self.values.append(top.values.half().cpu())
        self.index.append(top.indices.int().cpu())
        return scores


def generate_batched(out: Path, max_new_tokens: int, samples: int, temperature: float, max_minutes: float,
                     num_template: int, seed: int, batch: int, greedy: bool = True, topk: int = 16,
                     max_calls: int = 0, num_varied: int = 0, num_self: int = 0, target: str = DEFAULT_TARGET,
                     device: str = "cpu", src=None) -> int:
    """The same rows as `generate`, produced by the target's transformers model in bfloat16, `batch` answers
    per call (greedy: `batch` prompts; sampled: batch // samples prompts x `samples` answers). On a CPU with
    bf16 matrix units this is about ten times the tokens per second of B=1 decoding. The target's top-k logits
    at every answer position come with it, as the soft labels of the draft (`<out>.teacher/`, one file per
    call, keyed by row number; a prompt position's label is its next token). The answers and labels are the
    target's up to bf16 rounding. `target`: the model source (`src`: it already loaded by `bf16_target`).
    Returns the prompt jobs left (0: every prompt answered)."""
    from rich.progress import Progress

    deadline = time.time() + 60 * max_minutes   # the whole run's budget, the self-written requests included
    src = src or bf16_target(target, device)
    model, tok, eos = src.model, src.tokenizer, set(src.eos_token_ids)
    pad = pad_id(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    shards = out.with_suffix(".teacher")
    shards.mkdir(exist_ok=True)
    lines = out.read_text().splitlines() if out.exists() else []
    for stale in shards.glob("*.pt"):  # written for rows that never reached the file (interrupted)
        if int(stale.stem) >= len(lines):
            stale.unlink()
    done = {(r["prompt_id"], r["mode"]) for r in map(json.loads, lines)}
    prompts = all_prompts(num_template, seed, num_varied,
                          self_prompts(out, num_self, seed, batch, deadline=deadline, src=src))
    encoded = {p["prompt_id"]: encode_prompt(tok, p["prompt"]) for p in prompts}
    # prompts of similar length share a call (little padding); short ones first, so a cut run has the most rows
    jobs = [(mode, p) for mode in (["greedy"] if greedy else []) + (["sampled"] if samples else [])
            for p in sorted(prompts, key=lambda p: len(encoded[p["prompt_id"]]))
            if (p["prompt_id"], mode) not in done]
    deadline = time.time() + 60 * max_minutes
    tokens, row = 0, len(lines)
    with out.open("a") as f, Progress() as bar:
        task = bar.add_task("distilling", total=len(jobs))
        while jobs:
            if max_calls and row_calls(shards) >= max_calls:
                bar.console.print(f"{max_calls} calls done; {len(jobs)} prompt jobs left")
                return len(jobs)
            if time.time() > deadline:
                bar.console.print(f"time budget reached; {len(jobs)} prompt jobs left (rerun to continue)")
                return len(jobs)
            mode = jobs[0][0]
            n = samples if mode == "sampled" else 1
            chunk = [p for m, p in jobs[:max(1, batch // n)] if m == mode]
            jobs = jobs[len(chunk):]
            ids = [encoded[p["prompt_id"]] for p in chunk]
            width = max(map(len, ids))
            inputs = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=model.device)
            attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=model.device)
            batch_seed = seed + zlib.crc32(chunk[0]["prompt_id"].encode())
            torch.manual_seed(batch_seed)
            sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if mode == "sampled" \
                else dict(do_sample=False)
            top = _TopK(topk)
            with torch.no_grad():
                seqs = model.generate(input_ids=inputs, attention_mask=attn, max_new_tokens=max_new_tokens,
                                      num_return_sequences=n, pad_token_id=pad, eos_token_id=sorted(eos),
                                      logits_processor=LogitsProcessorList([top]), **sampling)
            values, index = torch.stack(top.values, 1), torch.stack(top.index, 1)    # (B, steps, k)
            rows, labels = [], {}
            for j, seq in enumerate(seqs[:, width:].tolist()):
                p, prompt = chunk[j // n], ids[j // n]
                answer = []
                for t in seq:
                    answer.append(t)
                    if t in eos:
                        break
                full = prompt + answer
                v = torch.full((len(full) - 1, topk), float("-inf"), dtype=torch.half)
                i = torch.zeros(len(full) - 1, topk, dtype=torch.int)
                v[:len(prompt) - 1, 0] = 0
                i[:len(prompt) - 1, 0] = torch.tensor(prompt[1:], dtype=torch.int)
                v[len(prompt) - 1:], i[len(prompt) - 1:] = values[j, :len(answer)], index[j, :len(answer)]
                labels[row + len(rows)] = (v, i)
                rows.append({**p, "mode": mode, "temperature": temperature if mode == "sampled" else 0.0,
                             "seed": batch_seed if mode == "sampled" else None, "dtype": "bfloat16",
                             "ids": full, "prompt_len": len(prompt)})
                tokens += len(answer)
            torch.save(labels, shards / f"{row:07d}.pt")
            f.writelines(json.dumps(r) + "\n" for r in rows)
            f.flush()
            row += len(rows)
            bar.update(task, advance=len(chunk), description=f"distilling ({tokens} tokens)")
    return 0


def row_calls(shards: Path) -> int:
    """Generation calls completed so far (one label file each)."""
    return len(list(shards.glob("*.pt")))


def human_rows(engines: str) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(Path(engines) / "tokenizer")
    rows = []
    tasks = {json.loads(line)["id"]: json.loads(line) for line in SEED_TASKS.read_text().splitlines()}
    for p in seed_prompts():
        answer = tasks[p["prompt_id"]]["instances"][0]["output"]
        user = [{"role": "user", "content": p["prompt"]}]
        prompt = _ids(tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True))
        full = _ids(tok.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=True))
        if full[:len(prompt)] == prompt and len(full) > len(prompt):
            rows.append({**p, "prompt_id": p["prompt_id"] + "/human", "mode": "human", "temperature": None,
                         "seed": None, "ids": full, "prompt_len": len(prompt)})
    return rows


def _ids(x) -> list[int]:
    return list(x if isinstance(x, list) else x["input_ids"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=DEFAULT_TARGET, help="with --batched: the model source that answers")
    ap.add_argument("--engines", default="engines/default")
    ap.add_argument("--out", type=Path, default=Path("build/distill/data.jsonl"))
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--samples", type=int, default=3, help="sampled answers per prompt, besides the greedy one")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-minutes", type=float, default=22.0,
                    help="time budget of the run (with --num-self, writing the requests counts); rerun to continue")
    ap.add_argument("--num-template", type=int, default=400)
    ap.add_argument("--num-varied", type=int, default=0, help="prompts from prompts.py (source 'varied')")
    ap.add_argument("--num-self", type=int, default=0,
                    help="with --batched: requests the target writes itself (source 'self'), then answers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--greedy", action=argparse.BooleanOptionalAction, default=True,
                    help="also answer each prompt greedily (one row, B=1: slow on a CPU; the sampled rows share "
                         "one batched call, so --samples 16 costs little more than one answer)")
    ap.add_argument("--batched", type=int, default=0, metavar="B",
                    help="generate with the target's transformers model in bf16, B answers per call, and keep "
                         "its top-16 logits as labels; 0: the ORT engine, one prompt per call")
    ap.add_argument("--max-calls", type=int, default=0,
                    help="with --batched: stop after this many generation calls in all (0: only the time budget)")
    ap.add_argument("--human", action="store_true", help="append the seed tasks' human answers, then stop")
    a = ap.parse_args(argv)
    if a.human:
        done = {json.loads(x)["prompt_id"] for x in a.out.read_text().splitlines()} if a.out.exists() else set()
        rows = [r for r in human_rows(a.engines) if r["prompt_id"] not in done]
        with a.out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"appended {len(rows)} human-answer rows to {a.out}")
        return
    if a.batched:
        generate_batched(a.out, a.max_new_tokens, a.samples, a.temperature, a.max_minutes, a.num_template, a.seed,
                         a.batched, a.greedy, max_calls=a.max_calls, num_varied=a.num_varied, num_self=a.num_self,
                         target=a.target)
        return
    generate(a.engines, a.out, a.max_new_tokens, a.samples, a.temperature, a.max_minutes, a.num_template, a.seed,
             a.greedy, a.num_varied)


if __name__ == "__main__":
    main()
