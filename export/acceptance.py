"""After export: how often an imported drafter's first proposal is the target's own greedy choice.

The target (its PyTorch module, the one just exported) continues a few short prompts greedily; one pass of it over
each whole sequence then gives what a drafter reads, and the drafter guesses, at every generated position t, token
t + 2 (token t + 1 is the target's own choice, the root that every drafter proposes below). The share of guesses
that equal the target's greedy tokens is the first draft token's acceptance at temperature 0, the number that a
chain or tree of any shape starts from. A drafter trained for the target agrees often; a rate near zero is a broken
import: fc halves in the wrong order, a missing or wrong `d2t`, a drafter of another model that has the same shape.

`measure` takes the drafter as a callable, so that any drafter reads what it needs of the target's pass:
`propose(tokens (1, n), outputs) -> (n - 1,)` guesses, outputs being what the target module's forward returned over
the whole sequence (logits of the last position, `hidden` (1, n, d), ...).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from specrt.export.hybrid import cache_layers

LOW = 0.1            # below this, the export warns
NEW_TOKENS = 12      # per prompt
PROMPTS = (          # short, of the kinds chat drafters are trained on
    "Write a short poem about the sea.",
    "Explain why the sky is blue in two sentences.",
    "Give three tips for staying focused while studying.",
    "What is the capital of France, and what is it known for?",
)

Propose = Callable[[torch.Tensor, tuple], torch.Tensor]


@dataclass(frozen=True)
class Acceptance:
    rate: float          # guesses equal to the target's greedy token / positions
    positions: int
    prompts: int

    def entry(self) -> dict:
        rate = round(self.rate, 4) if self.positions else None
        return {"first_draft_token": rate, "positions": self.positions, "prompts": self.prompts}

    def warning(self, what: str, causes: str) -> str | None:
        """None, or a loud line for a rate below LOW; `causes`: what breaks an import of this kind of drafter."""
        if self.rate >= LOW or not self.positions:
            return None
        return (f"WARNING: {what} agrees with the target on {self.rate:.0%} of first draft tokens ({self.positions} "
                f"positions over {self.prompts} prompts, greedy): speculating with it will gain nothing. An import "
                f"gone wrong ({causes}) or a drafter trained for another model does this; use one trained for this "
                "target")


def prompt_ids(tokenizer, vocab_size: int) -> list[list[int]]:
    """`PROMPTS` as the target reads them (its chat template where it has one); without a tokenizer, fixed random
    ids."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (8,), generator=g).tolist() for _ in PROMPTS]
    out = []
    for text in PROMPTS:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def measure(target, propose: Propose, prompts: list[list[int]], new_tokens: int = NEW_TOKENS,
            eos: tuple[int, ...] = ()) -> Acceptance:
    """The first draft token's greedy acceptance of `propose` with `target` (a SpecModel) over `prompts`."""
    hits = positions = 0
    new_tokens = min(new_tokens, target.args.max_seq_len // 2)
    dtype = target.lm_head.weight.dtype   # float16/bfloat16 weights: eager layers mix them with float32 rope tables
    mixed = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with torch.no_grad(), mixed:
        for prompt in prompts:
            prompt = prompt[-(target.args.max_seq_len - new_tokens):]
            tokens = torch.tensor([greedy(target, prompt, new_tokens, eos)])            # (1, n)
            guesses = propose(tokens, whole_pass(target, tokens))                        # (n - 1,)
            t = torch.arange(len(prompt) - 1, tokens.shape[1] - 2)   # positions whose token t + 2 was generated
            hits += int((guesses[t] == tokens[0, t + 2]).sum())
            positions += len(t)
    return Acceptance(hits / max(positions, 1), positions, len(prompts))


def empty_caches(a) -> list[torch.Tensor]:
    return [torch.zeros(1, a.num_kv_heads, 1, a.head_dim) for _ in range(2 * cache_layers(a))]


def causal(S: int) -> torch.Tensor:
    return torch.ones(S, S, dtype=torch.bool).tril()[None]                               # (1, S, S)


def whole_pass(target, tokens: torch.Tensor) -> tuple:
    """The target's forward over a whole sequence (1, n), nothing cached."""
    S = tokens.shape[1]
    return target(tokens, torch.arange(S)[None], torch.zeros(1, dtype=torch.int64), causal(S),
                  torch.tensor([1]), *empty_caches(target.args))


def greedy(target, prompt: list[int], new_tokens: int, eos: tuple[int, ...] = ()) -> list[int]:
    """`prompt` and the target's greedy continuation, through static caches written at `past_len`."""
    a = target.args
    length = len(prompt) + new_tokens
    caches = [torch.zeros(1, a.num_kv_heads, length, a.head_dim) for _ in range(2 * cache_layers(a))]
    ids, step, past = list(prompt), list(prompt), 0
    while len(ids) < length:
        S = len(step)
        logits, _, *new_kv = target(torch.tensor([step]), torch.arange(past, past + S)[None],
                                    torch.tensor([past]), causal(S), torch.tensor([1]), *caches)
        for cache, new in zip(caches, new_kv):
            cache[:, :, past:past + S] = new                                             # (1, Hkv, S, D)
        past += S
        step = [int(logits[0, -1].argmax())]
        ids += step
        if step[0] in eos:
            break
    return ids


def eagle_proposer(drafter) -> Propose:
    """An EAGLE drafter (`specrt.export.eagle.EagleModel`): slot t reads the target's feature at t and token t + 1,
    and its predicted feature gives token t + 2."""
    def propose(tokens, outputs):
        S = tokens.shape[1] - 1
        features = outputs[1][:, :S]                                                     # (1, S, d)
        _, hidden, *_ = drafter(tokens[:, 1:], torch.arange(S)[None], torch.zeros(1, dtype=torch.int64), causal(S),
                                torch.tensor([1]), features, *empty_caches(drafter.args))
        return drafter.logits(hidden)[0].argmax(-1)                                      # (S,)
    return propose


def medusa_proposer(heads) -> Propose:
    """Medusa heads: head 0 on the target's hidden state at t guesses token t + 2 (heads that read tokens read
    the root, token t + 1, and the path below it)."""
    def propose(tokens, outputs):
        S, K = tokens.shape[1] - 1, heads.num_heads
        path = torch.cat([tokens[0, 1:], tokens.new_zeros(K)])                           # (S + K,)
        rows = path[torch.arange(S)[:, None] + torch.arange(K)]                          # (S, K): t + 1, t + 2, ...
        return heads(outputs[1][0, :S], rows)[:, 0].argmax(-1)                           # (S,)
    return propose
