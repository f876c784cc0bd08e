"""The state of a generation: its rows, their tokens and caches, and what a request gets back."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specrt.decoding import tuning
from specrt.decoding.drafters import PassInputs
from specrt.decoding.grammar import Grammar, Matcher
from specrt.decoding.processors import Context, Penalties
from specrt.decoding.sampling import SamplingParams, TokenLogprob, noise, probs, seeded_pick, softmax_host


METHODS = ("autoregressive", "draft", "ngram", "medusa", "eagle", "mtp", "self", "rest")
MODEL_FREE = ("autoregressive", "ngram", "rest")   # the methods every engine set runs (no drafter engine)
AUTO = tuning.AUTO   # the method the engine set's tuning chose for the regime, else tuning.rule's
MAX_GAMMA = 8
MAX_MEASURED_BATCH = 16   # larger batches speculate by the pass times measured at this size
PREFILL_CHUNK = 128       # prompt tokens per prefill pass (see Generator): the largest that kept EAGLE over a
                          # 5,743-token prompt within 1.5 GB on the CPU (peak 1.45 GB; 256: 1.64, 512: 1.96)


@dataclass
class Round:
    """What one round did for a row (Batch.join(rounds=True)): the drafter's tokens, how many of them the target
    accepted, how many tokens the row's grammar forced (rounds without drafts), and the tokens it committed:
    tokens[:accepted] (or tokens[:forced]) came from the drafter (the grammar), the last is the target's own (a
    correction where it rejected a draft, else its bonus token). A round cut by the row's end (eos, its token limit)
    commits fewer. A tree's drafted tokens: the branch the target followed, then the tree's first candidate where it
    stopped."""
    drafted: list[int]
    accepted: int
    tokens: list[int]
    forced: int = 0

    @property
    def corrected(self) -> int | None:
        """The target's token where it rejected a draft (None: every draft was accepted, or there was none)."""
        k = self.accepted
        return self.tokens[k] if k < len(self.drafted) and k < len(self.tokens) else None

    def cut(self, n: int) -> "Round":
        """The round as far as its first n tokens (a stop token after which the rest is dropped)."""
        return Round(self.drafted, min(self.accepted, n), self.tokens[:n], min(self.forced, n))


@dataclass
class Generation:
    token_ids: list[list[int]]      # new tokens, one list per returned sequence
    text: list[str] | None          # decoded, when the engine set has a tokenizer
    stats: dict
    logprobs: list[list[TokenLogprob]] | None = None   # per sequence, one per new token (generate(logprobs=N))
    rounds: list[list[Round]] | None = None   # per sequence, what each round drafted and kept (generate(rounds=True))


@dataclass
class Chunk:
    """What one round of a streamed generation adds (`Generator.stream`)."""
    token_ids: list[int]            # the new tokens
    text: str | None                # the text they complete (None without a tokenizer)
    stats: dict | None = None       # on the last chunk: generate()'s stats
    logprobs: list[TokenLogprob] | None = None   # the new tokens' (stream(logprobs=N))
    rounds: list[Round] | None = None            # the rounds that made them (stream(rounds=True))


@dataclass
class _Joining:
    """A request on its way into a batch: its prompt is prefilled chunk by chunk into row `row` (its copies take the
    rows after it at the end), which no round reads until it joins (Batch.prefill)."""
    ids: list[int]
    max_new: int
    owners: list
    row: int
    cache: object                   # the target cache's row `row` (a KVCache view)
    done: int = 0                   # prompt positions prefilled so far
    logprobs: int | None = None     # report each new token's log-probability and this many alternatives
    penalties: Penalties | None = None   # its context-dependent logits processors
    grammar: Grammar | None = None       # its output's grammar (structured output)
    cached: int | None = None            # prompt positions from the prefix cache (None: not looked up yet)
    rounds: bool = False                 # its rows keep a Round per round (_Row.round_log)
    partition: str | None = None         # its prefix cache partition (PrefixCache: its tenant; None: the shared one)
    seed: int | None = None              # its seed (a seeded batch's: else the batch's own), see _Row.seed_key
    defer: bool = False                  # its drafter pass waits for its first proposal (Batch._defers): all chunks

    @property
    def copies(self) -> int:
        return len(self.owners)


@dataclass
class _Row:
    """One sequence of a batch: its request's bookkeeping, host side."""
    owner: object                   # the caller's handle (generate(): the sequence's index)
    prompt_len: int
    max_new: int
    cached: int = 0                 # prompt positions that came from the prefix cache
    stop_reason: str | None = None  # set when it finishes: eos, max_new_tokens, max_seq_len, cancelled, grammar_error
    sent: int = 0                   # new tokens already handed out (Batch.new_tokens)
    rounds: int = 0                 # rounds it took part in, and its drafts in them
    accepted: int = 0
    proposed: int = 0
    drafts: int = 0                 # rounds that proposed tokens for it
    accepted_per_position: list[int] = field(default_factory=list)   # accepted draft tokens at each depth
    logprobs_top: int | None = None  # None: no logprobs; else the alternatives reported per token
    logprobs: list[TokenLogprob] = field(default_factory=list)       # one per new token, when asked for
    penalties: Penalties | None = None   # processors of the target's logits at its positions, with...
    context: Context | None = None       # ...its tokens so far (processors.py)
    matcher: Matcher | None = None       # its place in its grammar, at its committed tokens
    round_log: list[Round] | None = None  # each round's drafts and outcome, when asked for (Batch.join(rounds=True))
    rounds_sent: int = 0                 # the entries of round_log already handed out
    partition: str | None = None         # its request's prefix cache partition (_Joining.partition)
    seed_key: tuple[int, int] | None = None  # a seeded batch's: (its request's seed, its copy), the key of its noise


class _Run:
    """The state of a batch: up to `capacity` rows, each a sequence with its own prompt, length and stop, the
    live ones first (rows 0 .. batch−1). Rows join at round boundaries (each prompt prefilled on its own) and
    leave when they finish: the last live rows move into the freed ones, so that passes run over live rows
    only. `tokens` and `lengths` live on the engines' device; `host_tokens`, `host_lengths` and `active` are the
    host's, updated once a round from the one host read (see Generator._commit) and copied to the device (on
    the CPU they share memory). The attributes without a leading underscore are views of the live rows."""

    def __init__(self, capacity: int, max_len: int, cache_len: int, params: SamplingParams, stop_ids, cache,
                 reused):
        device = cache.data.device
        self.capacity, self.max_len, self.cache_len = capacity, max_len, cache_len
        self.params, self.stop_ids, self.pool = params, frozenset(stop_ids), cache
        # (role, sizes, make) -> the drafters' buffers, the last batch's where the sizes repeat (Generator.reused)
        self.reused = reused
        self.generator = params.generator(device)
        self._host_tokens = np.zeros((capacity, max_len), np.int64)
        self._host_lengths = np.zeros(capacity, np.int64)
        self._active = np.zeros(capacity, bool)
        # on the CPU the device tensors share the mirrors' memory (from_numpy); elsewhere they are copies
        self._tokens = torch.from_numpy(self._host_tokens).to(device)
        self._lengths = torch.from_numpy(self._host_lengths).to(device)
        self.rows: list[_Row] = []
        self._hidden: torch.Tensor | None = None       # see hidden
        self._path_hidden: torch.Tensor | None = None  # see path_hidden
        self._pass: tuple | None = None                # the last verify pass's features, accepted path and counts
        self.host_pass: tuple | None = None            # its accepted paths' node ids and counts, host lists
        self._hidden_rows: dict[int, torch.Tensor] = {}  # B -> hidden's buffer on the CPU's host path
        self.path_start: torch.Tensor | None = None   # (B,) the position of path_hidden[:, 0] (the last round's root)
        self.rounds = self.proposed = self.accepted = 0
        self.forced = 0                                # tokens committed as the rows' grammars forced them
        self.skipped = 0   # tokens of the rounds no drafter proposed in (the most any row took in each): catch-up
        self.refused = 0                               # tree nodes the rows' grammars refused (never verified)
        self.per_position: list[list[int]] = []       # [accepted, proposed] per draft position
        self.round_logprobs: dict[int, list[TokenLogprob]] = {}   # row -> the round's tokens', for _account
        self.by_batch: dict[int, list[int]] = {}      # live rows -> [rounds, speculative rounds]
        self._inputs: dict[tuple[int, int], PassInputs] = {}
        self._noise: dict[tuple, np.ndarray] = {}     # (seed key, position, size) -> sampling.noise, see noise()
        self.resize(0)

    def inputs(self, B: int, S: int) -> PassInputs:
        """A verify pass's inputs for B rows of S tokens, made once per shape (see PassInputs)."""
        got = self._inputs.get((B, S))
        if got is None:
            got = self._inputs[(B, S)] = PassInputs(B, S, self.device)
        return got

    def after_pass(self, out, path, n) -> None:
        """A verify pass ran: its StepOutput (features (B, S, d)), the accepted path's node ids (B, D+1) (None for
        a chain: the pass's own order) and accepted counts (B,), as device tensors or host lists. path_hidden and
        hidden are taken from them when a drafter asks (before the next pass reuses the engine's buffers)."""
        self._pass, self._path_hidden, self._hidden = (out, path, n), None, None
        self.host_pass = (path, n) if isinstance(n, list) else None   # a device pass's: from the round's read

    def noise(self, b: int, index: int, size: int) -> np.ndarray:
        """Row b's noise for its token at position `index` (sampling.noise of its seed key), kept for the round's
        other uses of it (the draft model's draft there, then its verification)."""
        at = (self.rows[b].seed_key, index, size)
        e = self._noise.get(at)
        if e is None:
            if len(self._noise) >= 4 * self.capacity * (MAX_GAMMA + 1):   # ~a round's worth each row
                self._noise.clear()
            e = self._noise[at] = noise(at[0], index, size)
        return e

    def host_picker(self, logits: np.ndarray, depth):
        """A seeded batch's rule on the host: pick(b, node), the token of row b at a pass's node (at depth[node]
        below the row's pending token) drawn by its noise from softmax(logits / T) (sampling.seeded_pick)."""
        T, V = self.params.temperature, logits.shape[-1]
        lengths = self.host_lengths.tolist()

        def pick(b: int, node: int) -> int:
            w = softmax_host(logits[b, node], T, normalise=False)
            return seeded_pick(w, self.noise(b, lengths[b] + depth[node], V))
        return pick

    def seeded_scores(self, logits: torch.Tensor, depth, rows=None) -> torch.Tensor:
        """A seeded batch's rule on tensors: P / E over a pass's logits (B, S, V) of `rows` (default: the live
        ones), whose argmax at each node is its seeded pick (host_picker's; the greedy rules take it from here), P
        after temperature, top-k, top-p and min-p."""
        B, S, V = logits.shape
        lengths = self.host_lengths.tolist()
        e = np.stack([[self.noise(b, lengths[b] + depth[i], V) for i in range(S)] for b in (rows or range(B))])
        return probs(logits, self.params) / torch.from_numpy(e).to(logits.device)

    @property
    def last_pass(self) -> tuple:
        """The last verify pass: its StepOutput, accepted path and counts (host lists on the CPU's host path)."""
        return self._pass

    def _device(self, a) -> torch.Tensor:
        return a if isinstance(a, torch.Tensor) else torch.tensor(a, device=self.device)

    @property
    def path_hidden(self) -> torch.Tensor | None:
        """(B, D+1, d) the target's hidden states along the last accepted path, root first."""
        if self._path_hidden is None and self._pass is not None:
            feats, path = self._pass[0].hidden, self._pass[1]
            self._path_hidden = feats if path is None else \
                feats.gather(1, self._device(path)[..., None].expand(-1, -1, feats.shape[-1]))
        return self._path_hidden

    @property
    def hidden(self) -> torch.Tensor | None:
        """(B, d) the target's hidden state at each row's last accepted position (Medusa's input)."""
        if self._hidden is None and self._pass is not None:
            out, path, n = self._pass
            if isinstance(n, list) and out.host is not None:   # the CPU's host path: a row copy each
                feats, B = out.host_hidden(), len(n)
                if B not in self._hidden_rows:
                    self._hidden_rows[B] = torch.zeros(B, feats.shape[-1], device="cpu")
                self._hidden = self._hidden_rows[B]
                host = self._hidden.numpy()
                for b, k in enumerate(n):
                    host[b] = feats[b, k if path is None else path[b][k]]
            else:
                n = self._device(n)
                self._hidden = self.path_hidden[torch.arange(len(n), device=n.device), n]   # a copy
        return self._hidden

    @hidden.setter
    def hidden(self, value: torch.Tensor) -> None:
        self._hidden, self._path_hidden, self._pass, self.host_pass = value, None, None, None

    def resize(self, n: int) -> None:
        self.host_tokens, self.host_lengths = self._host_tokens[:n], self._host_lengths[:n]
        self.active, self.tokens, self.lengths = self._active[:n], self._tokens[:n], self._lengths[:n]
        self.cache = self.pool.prefix(n)

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def device(self) -> torch.device:
        return self._tokens.device

    def prompt(self, row: int, m: int) -> torch.Tensor:
        """(1, m) the first m tokens of row `row`, on the device: a joining request's prompt, live or not."""
        return self._tokens[row:row + 1, :m]

    def last_tokens(self) -> torch.Tensor:
        """(B,) each row's last committed token."""
        return self.tokens.gather(1, (self.lengths - 1)[:, None])[:, 0]

    def host_last_tokens(self) -> list[int]:
        """Each row's last committed token, from the host mirrors."""
        return [int(self.host_tokens[b, n - 1]) for b, n in enumerate(self.host_lengths.tolist())]

    def new_tokens(self, b: int) -> list[int]:
        """Row b's tokens since the last call for it."""
        row = self.rows[b]
        start, end = row.prompt_len + row.sent, int(self.host_lengths[b])
        row.sent = end - row.prompt_len
        return self.host_tokens[b, start:end].tolist()

    def output(self, b: int) -> list[int]:
        """Row b's new tokens so far."""
        return self.host_tokens[b, self.rows[b].prompt_len:self.host_lengths[b]].tolist()
