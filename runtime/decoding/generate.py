"""The generation loop: propose → verify → accept → commit, over engines of one engine directory."""
from __future__ import annotations

import collections
import functools
import json
import os
import time
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from specrt.decoding import verification
from specrt.decoding.adaptive import Costs, GammaPolicy, TreePolicy
from specrt.engines.base import OrtHeads, StepOutput, engine_set_device
from specrt.engines.registry import engine_class
from specrt.decoding.drafters import DraftModelDrafter, MedusaDrafter, NgramDrafter, PassInputs, Proposal, _arange, chain_mask
from specrt.decoding.eagle import DynamicTree, EagleDrafter
from specrt.errors import InputError, ManifestError
from specrt.engines.manifest import check_file, read_manifest
from specrt.decoding.sampling import SamplingParams, argmax, probs, sample
from specrt.decoding.tree import DEFAULT_MEDUSA_PATHS, Tree

METHODS = ("autoregressive", "draft", "ngram", "medusa", "eagle")
MAX_GAMMA = 8
MAX_MEASURED_BATCH = 16   # larger batches speculate by the pass times measured at this size
PREFILL_CHUNK = 512       # prompt tokens per prefill pass (see Generator)


@dataclass
class Generation:
    token_ids: list[list[int]]      # new tokens, one list per returned sequence
    text: list[str] | None          # decoded, when the engine set has a tokenizer
    stats: dict


@dataclass
class Chunk:
    """What one round of a streamed generation adds (`Generator.stream`)."""
    token_ids: list[int]            # the new tokens
    text: str | None                # the text they complete (None without a tokenizer)
    stats: dict | None = None       # on the last chunk: generate()'s stats


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

    @property
    def copies(self) -> int:
        return len(self.owners)


@dataclass
class _Row:
    """One sequence of a batch: its request's bookkeeping, host side."""
    owner: object                   # the caller's handle (generate(): the sequence's index)
    prompt_len: int
    max_new: int
    stop_reason: str | None = None  # set when it finishes: eos, max_new_tokens, max_seq_len, cancelled
    sent: int = 0                   # new tokens already handed out (Batch.new_tokens)
    rounds: int = 0                 # rounds it took part in, and its drafts in them
    accepted: int = 0
    proposed: int = 0


class _Run:
    """The state of a batch: up to `capacity` rows, each a sequence with its own prompt, length and stop, the
    live ones first (rows 0 .. batch−1). Rows join at round boundaries (each prompt prefilled on its own) and
    leave when they finish: the last live rows move into the freed ones, so that passes run over live rows
    only. `tokens` and `lengths` live on the engines' device; `host_tokens`, `host_lengths` and `active` are the
    host's, updated once a round from the one host read (see Generator._commit) and copied to the device (on
    the CPU they share memory). The attributes without a leading underscore are views of the live rows."""

    def __init__(self, capacity: int, max_len: int, cache_len: int, params: SamplingParams, stop_ids, cache):
        device = cache.data.device
        self.capacity, self.max_len, self.cache_len = capacity, max_len, cache_len
        self.params, self.stop_ids, self.pool = params, frozenset(stop_ids), cache
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
        self.per_position: list[list[int]] = []       # [accepted, proposed] per draft position
        self.by_batch: dict[int, list[int]] = {}      # live rows -> [rounds, speculative rounds]
        self._inputs: dict[tuple[int, int], PassInputs] = {}
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


class Generator:
    """Engines of one engine directory, ready to generate. `Generator.from_engines(path)` then `generate()`."""

    def __init__(self, directory: Path, manifest: dict, target, draft, tokenizer, medusa=None, eagle=None,
                 loaders: dict[str, Callable] | None = None, prefill_chunk: int = PREFILL_CHUNK):
        """`draft`, `medusa`, `eagle`: the drafters' engines (None: the set has none), or in `loaders` functions
        that load them, called when a request first needs one: a process that decodes with one method holds
        only its engines (the int4 set's drafters take 350 MB resident, more than its target).
        `prefill_chunk`: prompt tokens per prefill pass. A prompt runs through the target (and the drafter) in
        passes of at most this many tokens over the cache, so that a pass's activations, its attention scores
        (chunk × context) and its mask (chunk × chunk) are bounded by the chunk, not by the prompt."""
        if prefill_chunk < 1:
            raise InputError(f"prefill chunk {prefill_chunk}: must be at least 1 token (default {PREFILL_CHUNK})")
        self.prefill_chunk = prefill_chunk
        self.directory, self.manifest = directory, manifest
        self.target, self.tokenizer = target, tokenizer
        self._drafters = {role: e for role, e in (("draft", draft), ("medusa", medusa), ("eagle", eagle))
                          if e is not None}
        self._loaders = dict(loaders or {})
        self.eagle_ids = None   # the vocabulary ids of the EAGLE drafter's logit columns, if only its kept ones
        self.engine_time = 0.0
        self._batch_costs: dict = {}
        self._last_pool = None
        self._gamma_policies: dict[tuple, GammaPolicy] = {}  # (method, greedy) -> the last request's
        self._tree_policies: dict[tuple, TreePolicy] = {}    # the same for tree methods

    def has(self, role: str) -> bool:
        """Whether the engine set has the drafter `role` ("draft", "medusa" or "eagle"), loaded or not."""
        return role in self._drafters or role in self._loaders

    def _drafter_engine(self, role: str):
        if role in self._loaders:
            self._drafters[role] = self._loaders.pop(role)()
        return self._drafters.get(role)

    draft = property(lambda self: self._drafter_engine("draft"), doc="The draft model's engine (loaded on use).")
    medusa = property(lambda self: self._drafter_engine("medusa"), doc="The Medusa heads (loaded on use).")
    eagle = property(lambda self: self._drafter_engine("eagle"), doc="The EAGLE drafter's engine (loaded on use).")

    @classmethod
    def from_engines(cls, path: str | os.PathLike, device: str = "auto", threads: int | None = None,
                     prefill_chunk: int = PREFILL_CHUNK) -> "Generator":
        directory = Path(path)
        manifest = read_manifest(directory)
        models = manifest["models"]
        if "draft" in models and models["draft"]["vocab_size"] != models["target"]["vocab_size"]:
            raise ManifestError(f"draft vocab size {models['draft']['vocab_size']} differs from target vocab size "
                                f"{models['target']['vocab_size']}: re-export with a draft over the same tokenizer")
        device = engine_set_device(manifest, directory, device)
        # Drafters run on the calling thread: their small matrices gain little from a thread pool, and an idle
        # pool keeps spinning for a while after each run, taking cores from the target's next pass.
        drafter_threads = 1 if device == "cpu" else threads
        engines = {}
        for role, spec in models.items():
            if "engine" not in spec:
                raise ManifestError(f"{role} in {directory} has no built engine: run `specrt build {directory}`")
            path = check_file(directory, spec["engine"], f"{role} engine")
            role_threads = threads if role == "target" else drafter_threads
            backend = OrtHeads if role == "medusa" else engine_class(spec["engine"])
            engines[role] = functools.partial(backend, path, spec, device=device, threads=role_threads)
        tokenizer = None
        if manifest.get("tokenizer"):
            for entry in manifest["tokenizer"]:
                check_file(directory, entry, "tokenizer")
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
        target = engines.pop("target")()
        gen = cls(directory, manifest, target, None, tokenizer, loaders=engines, prefill_chunk=prefill_chunk)
        if "output_ids" in models.get("eagle", {}):
            path = check_file(directory, models["eagle"]["output_ids"], "EAGLE output ids")
            gen.eagle_ids = np.array(json.loads(path.read_text())["kept_ids"], dtype=np.int64)
        return gen

    # ---- inputs -------------------------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InputError(f"{self.directory} has no tokenizer: pass token ids (--prompt-ids 1,2,3)")
        if chat and self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if not isinstance(ids, list) else ids
            return list(ids)
        return self.tokenizer(prompt)["input_ids"]

    def _timed(self, engine, cache, ids, pos, mask, num_logits, **extra):
        return self._timed_call(engine.forward, ids, pos, cache.past_len, mask, num_logits, cache, **extra)

    def _timed_call(self, fn, *args, **kw):
        """fn(*args, **kw), its time counted as engine time (a pass of an engine)."""
        t = time.perf_counter()
        out = fn(*args, **kw)
        self.engine_time += time.perf_counter() - t
        return out

    # ---- the loop -----------------------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, prompt_ids: list[int] | list[list[int]] | None = None,
                 *, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, num_return_sequences: int = 1, method: str = "autoregressive",
                 gamma: int | None = None, ngram_max: int = 3, ngram_min: int = 1, chat: bool = True,
                 tree: bool = False, tree_choices: str | Path | Tree | None = None,
                 adaptive: bool = True) -> Generation:
        """One prompt, or a batch of different prompts (a list of texts, or of token-id lists) decoded together,
        each row at its own length and acceptance, finished rows leaving the batch. Sequences come back prompt
        by prompt, `num_return_sequences` each. `tree=True` makes the draft model propose a tree (top-k
        branching along its chain); `medusa` always verifies a tree: `tree_choices` (a Tree or a JSON file of
        paths), else the engine set's calibrated tree, else the built-in default. `adaptive` (the default) lets
        each round choose: chains their length γ (unless `gamma` fixes it), trees a tree or a plain step,
        whichever the measured acceptance and costs say is faster, at the batch's size; `adaptive=False`
        speculates in every round that has room."""
        rounds = self._rounds(prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed,
                              num_return_sequences, method, gamma, ngram_max, ngram_min, chat, tree, tree_choices,
                              adaptive)
        while True:
            try:
                next(rounds)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: str | None = None, prompt_ids: list[int] | None = None, **options) -> Iterator[Chunk]:
        """`generate` for one sequence, as it goes: after every round a Chunk with the new tokens and the text they
        complete (decoded incrementally: a multi-byte character split across tokens waits for its last byte); the
        last chunk carries the stats. `options` are generate's."""
        if options.get("num_return_sequences", 1) != 1:
            raise InputError(f"num_return_sequences {options['num_return_sequences']}: streaming gives one "
                             "sequence; use generate() for several")
        if isinstance(prompt, list) or (prompt_ids and isinstance(prompt_ids[0], list)):
            raise InputError("stream() takes one prompt; use generate() for a batch of prompts")
        rounds, text = self._rounds(prompt, prompt_ids, **options), Detokenizer(self.tokenizer)
        threads = torch.get_num_threads()   # the caller's, while it holds control
        while True:
            try:
                run = next(rounds)
                ids, stats = run.new_tokens(0) if run.batch else [], None
            except StopIteration as done:
                ids, stats = done.value.token_ids[0][text.count:], done.value.stats
            if ids or stats is not None:
                loop_threads = torch.get_num_threads()
                torch.set_num_threads(threads)
                yield Chunk(ids, text.feed(ids, final=stats is not None), stats)
                torch.set_num_threads(loop_threads)
            if stats is not None:
                return

    def batch(self, capacity: int, cache_len: int | None = None, **options) -> "Batch":
        """A batch of up to `capacity` sequences that requests join between rounds (continuous batching); options
        are generate()'s speculation and sampling ones. See Batch."""
        return Batch(self, capacity, cache_len, **options)

    def _rounds(self, prompt, prompt_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int | None = None, num_return_sequences: int = 1,
                method: str = "autoregressive", gamma: int | None = None, ngram_max: int = 3, ngram_min: int = 1,
                chat: bool = True, tree: bool = False, tree_choices=None, adaptive: bool = True):
        """The loop, one round at a time: yields the batch's state after the prefills and after every round,
        returns the Generation. The loop runs with one torch thread (its tensors are small: a pool only adds
        latency); the caller's setting is back when it ends."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if max_new_tokens < 1 or num_return_sequences < 1:
                raise InputError(f"max_new_tokens {max_new_tokens} and num_return_sequences {num_return_sequences} "
                                 "must be at least 1")
            prompts = self._prompts(prompt, prompt_ids, chat)
            n = num_return_sequences
            room = max(map(len, prompts)) + max_new_tokens + 1
            batch = self.batch(len(prompts) * n, room, method=method, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed, gamma=gamma, ngram_max=ngram_max, ngram_min=ngram_min,
                               tree=tree, tree_choices=tree_choices, adaptive=adaptive)
            started = time.perf_counter()
            for i, ids in enumerate(prompts):
                batch.add(ids, max_new_tokens, owner=range(i * n, i * n + n), copies=n)
            prefill_time = time.perf_counter() - started
            outputs: list = [None] * (len(prompts) * n)
            while True:
                yield batch.run
                for row, tokens in batch.retire():
                    outputs[row.owner] = (row, tokens)
                if not batch.run.batch:
                    break
                batch.step()
            return batch.result(outputs, time.perf_counter() - started, prefill_time)
        finally:
            torch.set_num_threads(threads)

    def _check_request(self, method: str, gamma) -> None:
        if method not in METHODS:
            raise InputError(f"method {method!r}: choose one of {', '.join(METHODS)}")
        if method == "draft" and not self.has("draft"):
            raise InputError(f"--method draft: {self.directory} has no draft model; export with --draft SOURCE")
        if method == "medusa" and not self.has("medusa"):
            raise InputError(f"--method medusa: {self.directory} has no Medusa heads; export with --medusa PATH")
        if method == "eagle" and not self.has("eagle"):
            raise InputError(f"--method eagle: {self.directory} has no EAGLE drafter; export with --eagle PATH")
        if gamma is not None and not 1 <= gamma <= 64:
            raise InputError(f"gamma {gamma}: must be between 1 and 64")

    def _prompts(self, prompt, prompt_ids, chat: bool) -> list[list[int]]:
        """The batch's prompts as token ids: one text or id list, or a list of them."""
        if (prompt is None) == (prompt_ids is None):
            raise InputError("give exactly one of prompt (text) and prompt_ids (token ids)")
        if prompt is not None:
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if not texts:
                raise InputError("prompt: an empty list of prompts")
            return [self.encode(t, chat) for t in texts]
        many = bool(prompt_ids) and all(isinstance(p, (list, tuple)) for p in prompt_ids)
        lists = [list(p) for p in prompt_ids] if many else [list(prompt_ids)]
        vocab = self.target.spec["vocab_size"]
        for ids in lists:
            bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < vocab]
            if not ids or bad:
                raise InputError(f"prompt ids {bad[:5] or ids}: need at least one id, each in [0, {vocab})")
        return lists

    @property
    def max_len(self) -> int:
        """The longest sequence (prompt and new tokens) that every engine of the set holds."""
        models = self.manifest["models"]
        return min(models[role]["max_seq_len"] for role in ("target", "draft") if role in models)

    def _pool(self, capacity: int, length: int):
        """The target's cache for a batch: the last one made when the size repeats (a server's batches, a bench's
        requests), else a new one."""
        key = (capacity, length)
        if self._last_pool is None or self._last_pool[0] != key:
            self._last_pool = None   # let the old one go first
            self._last_pool = (key, self.target.new_cache(capacity, length))
        return self._last_pool[1]

    @property
    def chains_only(self) -> bool:
        """A target whose MatMuls quantize their input to int8 (`--target-weights int4|int8`) verifies trees as
        chains. A tree pass gives a node's ancestors other attention columns than a chain does, so its softmax
        and P·V sums round differently; float32 engines shrug that off (a near tie at most), but the rounding
        flips int8 activations downstream and the tree's logits drift from the engine's own by up to ~1–3
        (measured on the int4 SmolLM2 target), which would break the token-identical promise. A chain of the
        drafter's top choices (one node per depth) lays out exactly as the target's own steps."""
        return self.target.spec.get("engine", {}).get("activations") == "int8"

    def _drafter(self, method, tree, tree_choices, gamma, ngram_max, ngram_min, adaptive=False):
        if method == "autoregressive":
            return None
        if method == "ngram":
            return NgramDrafter(ngram_max, ngram_min)
        if method == "medusa":
            chosen = self.tree_for("medusa", tree_choices)
            return MedusaDrafter(self.medusa, Tree.chain(chosen.max_depth) if self.chains_only else chosen,
                                 self._timed_call)
        if method == "eagle":
            shape = DynamicTree(**self.eagle.spec.get("dynamic_tree", {}))
            if self.chains_only:
                shape = DynamicTree(top_k=1, depth=shape.depth, nodes=shape.depth)
            sizing = (lambda n: self.eagle_costs(min(n, MAX_MEASURED_BATCH), shape)) if adaptive else None
            return EagleDrafter(self.eagle, self._timed, shape, sizing, self.eagle_ids, chains=self.chains_only)
        if (tree or tree_choices is not None) and not self.chains_only:
            return DraftModelDrafter(self.draft, self._timed, self.tree_for("draft", tree_choices, gamma))
        return DraftModelDrafter(self.draft, self._timed)

    def tree_for(self, method: str, choices=None, depth: int | None = None) -> Tree:
        """The tree a tree method verifies: given choices, else the engine set's calibrated one, else a default."""
        if isinstance(choices, Tree):
            return choices
        if choices is not None:
            return Tree.load(choices)
        saved = self.manifest.get("trees", {}).get(method)
        if saved is not None:
            return Tree.load(check_file(self.directory, saved, f"{method} tree"))
        if method == "medusa":
            heads = self.medusa.num_heads
            return Tree.from_paths(p for p in DEFAULT_MEDUSA_PATHS if len(p) <= heads)
        return Tree.chain_with_siblings(depth or 4, 2)

    def _room(self, run: _Run) -> int:
        """Tokens that every live row can still add to its cache beyond the pending one."""
        return run.max_len - max(n for n, a in zip(run.host_lengths.tolist(), run.active.tolist()) if a)

    def _fit_gamma(self, run: _Run, gamma: int) -> int:
        """No more drafts than the cache has room for, or than the row with the fewest tokens left can still emit."""
        left = min(r.max_new - (n - r.prompt_len) for r, n, a in zip(run.rows, run.host_lengths.tolist(),
                                                                       run.active.tolist()) if a)
        return max(0, min(gamma, self._room(run), left - 1))

    def _verify(self, run: _Run, proposal: Proposal) -> list[list[int]]:
        """One target pass over [last token, proposal] per row (a chain or a tree), written into the cache at
        past_len = length − 1; a tree's accepted path is compacted into consecutive slots. Returns the round's one
        host read: per row the accepted count, the next token, the proposal's width and the accepted path's
        tokens (root first), see _account. The pass's inputs come from the host mirrors into buffers the engine
        keeps bound. On the CPU the greedy rules and the sampled ones (top-k/top-p off) run in plain Python over
        numpy views of the engine's buffers, and only the accepted entries are written to the cache: a pass
        streams all the weights through the caches, so right after it every distinct torch or numpy operation
        costs tens of µs of cold code and data (a torch round took ~0.8 ms of host time, this one ~0.25)."""
        B, g = proposal.tokens.shape
        cache, dev, tree = run.cache, run.device, proposal.tree
        on_host = dev.type == "cpu"
        top, past = run.max_len - 1, []
        inputs = run.inputs(B, g + 1)
        host = inputs.host                                                                # (2, B, S): ids, positions
        depth = tree.depth_list if tree is not None else range(g + 1)
        for b, n in enumerate(run.host_lengths.tolist()):
            past.append(min(n - 1, top - g))
            host[0, b, 0] = run.host_tokens[b, n - 1]
            host[1, b] = [min(past[b] + d, top) for d in depth]
        cache.truncate(past)
        if on_host:
            if g:
                host[0, :, 1:] = proposal.on_host()[0]
        else:
            inputs.send()
            if g:
                inputs.ids[:, 1:] = proposal.tokens
        ids = inputs.ids
        mask = tree.batch_mask(B, dev) if tree is not None else inputs.chain_mask
        out = self._timed(self.target, cache, ids, inputs.positions, mask, g + 1)
        run.path_start = cache.past_len
        params = run.params
        if on_host and (params.greedy or params.plain) and out.host is not None:   # plain Python on the host
            logits, tokens, path = out.host_logits(), host[0].tolist(), None
            u = None if params.greedy else \
                torch.rand(B, g + 1, generator=run.generator, device="cpu", dtype=torch.float64).tolist()
            if tree is not None:   # u: one uniform per child tried, then the draw
                rows, path = verification.tree_greedy_host(logits, tokens, tree) if params.greedy else \
                    verification.tree_sampled_host(logits, tokens, tree, params.temperature, u)
                accepted = [p[:r[0] + 1] for r, p in zip(rows, path)]
            elif params.greedy:
                rows = verification.greedy_host(logits, tokens, proposal.on_host()[1] if g else [0] * B)
                accepted = [r[0] + 1 for r in rows]
            else:                  # u: acceptance at each position, then the draw
                q = proposal.q.numpy() if proposal.q is not None else None
                rows = verification.sampled_host(logits, tokens, proposal.on_host()[1] if g else [0] * B, q,
                                                 params.temperature, u)
                accepted = [r[0] + 1 for r in rows]
            cache.write(out.host_kv(), past, accepted)   # the accepted path's entries only, in order
            run.after_pass(out, path, [r[0] for r in rows])
            return rows
        cache.write(out.new_kv)
        if tree is not None:
            dtree = tree.on(dev)
            n, nxt, path = verification.tree_greedy(out.logits, ids, dtree) if run.params.greedy else \
                verification.tree_sampled(probs(out.logits, run.params), ids, dtree, run.generator)
            path = path.clamp(min=0)                                                    # padding past the leaf
            cache.compact(path)
            tokens, width = ids.gather(1, path), torch.full_like(n, tree.max_depth)
        else:
            if run.params.greedy:
                n, nxt = verification.greedy(out.logits, proposal.tokens, proposal.valid)
            else:
                P = probs(out.logits, run.params)                                       # (B, γ+1, V)
                n, nxt = verification.sampled(P, proposal.q, proposal.tokens, proposal.valid, run.generator)
            path, tokens, width = None, ids, proposal.valid.sum(1)
        run.after_pass(out, path, n)
        read = torch.cat([n[:, None], nxt[:, None], width[:, None], tokens, *([] if path is None else [path])],
                         1).tolist()   # the read: the commit rows, then a tree's accepted node ids (the drafters')
        cut = 3 + tokens.shape[1]
        run.host_pass = (None if path is None else [r[cut:] for r in read], [r[0] for r in read])
        return [r[:cut] for r in read]

    def _account(self, run: _Run, host: list[list[int]], first: int = 0) -> tuple[int, int]:
        """Host side of a commit, from the read: per row (from row `first`) the accepted count n, the next token,
        the proposal width, then the path's tokens (root first). Writes the mirrors (on the CPU, the device
        tensors themselves), the stop reasons and the acceptance counts. Plain Python over the rows: for the
        few rows of a batch it costs a fraction of numpy's per-call overhead."""
        accepted = proposed = 0
        active, lengths, tokens = run.active.tolist(), run.host_lengths.tolist(), run.host_tokens
        for b, (n, nxt, width, _root, *path) in enumerate(host, first):
            if not active[b]:
                continue
            row = run.rows[b]
            accepted, proposed = accepted + n, proposed + width
            row.accepted, row.proposed = row.accepted + n, row.proposed + width
            for i in range(width):
                while len(run.per_position) <= i:
                    run.per_position.append([0, 0])
                run.per_position[i][0] += i < n
                run.per_position[i][1] += 1
            length = lengths[b]
            new = (path[:n] + [nxt])[:min(row.max_new + row.prompt_len, run.max_len) - length]
            eos = next((i for i, tok in enumerate(new) if tok in run.stop_ids), None)
            if eos is not None:
                new = new[:eos + 1]
            for tok in new:
                tokens[b, length] = tok
                length += 1
            run.host_lengths[b] = length
            reason = ("eos" if eos is not None else "max_new_tokens" if length - row.prompt_len >= row.max_new else
                      "max_seq_len" if length >= run.max_len else None)
            if reason:
                run.active[b], row.stop_reason = False, reason
        if run.device.type != "cpu":   # on the CPU the mirrors are the device tensors
            run.tokens.copy_(torch.from_numpy(run.host_tokens), non_blocking=True)
            run.lengths.copy_(torch.from_numpy(run.host_lengths), non_blocking=True)
        run.accepted += accepted
        run.proposed += proposed
        return accepted, proposed

    # ---- costs --------------------------------------------------------------------------------------------
    def costs(self, batch: int = 1, upto: int = MAX_GAMMA + 1, draft: bool = True) -> Costs:
        """Time target passes over 1..MAX_GAMMA+1 tokens per row on this machine (once per batch size, ~1 s for one
        row; for several rows two passes, with a line through them) and, with `draft` where the set has a draft
        model, its step (else `draft_step` stays 0: the caller does not need it, and the model is not loaded for
        it); `upto` (a tree's size) adds passes over a few more sizes up to it."""
        saved = self.engine_time
        context = min(64, self.target.spec["max_seq_len"] - MAX_GAMMA - 2)
        if batch not in self._batch_costs:
            if batch == 1:
                verify = self._pass_times(context, range(1, MAX_GAMMA + 2), batch)
            else:
                one, most = self._pass_times(context, (1, MAX_GAMMA + 1), batch).values()
                verify = {k: one + (most - one) * (k - 1) / MAX_GAMMA for k in range(1, MAX_GAMMA + 2)}
            self._batch_costs[batch] = Costs(0.0, verify)
        costs = self._batch_costs[batch]
        if draft and self.has("draft") and not costs.draft_step:
            costs.draft_step = self.draft.time_pass(context, 1)
        upto = min(upto, self.target.spec["max_seq_len"])
        more = sorted({k for k in (12, 16, 24, 32, 48, 64, upto) if max(costs.verify) < k <= upto})
        if more:
            costs.verify.update(self._pass_times(min(64, self.target.spec["max_seq_len"] - more[-1]), more, batch))
        self.engine_time = saved
        return costs

    def _pass_times(self, context: int, sizes, batch: int, sweeps: int = 2) -> dict[int, float]:
        """Seconds of a target pass over each size: the best of `sweeps` sweeps over the sizes, interleaved, so
        that a slow spell of a shared machine spoils one sweep, not every measurement of one size (timed one
        size after the other, a pass over 2 tokens once came out cheaper than one over 1)."""
        best = dict.fromkeys(sizes, float("inf"))
        for _ in range(sweeps):
            for k in best:
                best[k] = min(best[k], self.target.time_pass(context, k, reps=1, batch=batch))
        return best

    def eagle_costs(self, batch: int, shape: DynamicTree) -> Costs:
        """The target's passes up to the tree's size (`verify`) and one EAGLE drafter pass over two frontiers
        (`draft_step`, the cost of a tree level), timed once per batch size."""
        key = ("eagle", batch, shape)
        if key not in self._batch_costs:
            verify = self.costs(batch, upto=shape.nodes + 1, draft=False).verify
            saved = self.engine_time
            k, spec = 2 * shape.top_k, self.eagle.spec
            level = self.eagle.time_pass(min(64, spec["max_seq_len"] - k), k, batch=batch,
                                         features=torch.zeros(batch, k, spec["hidden_size"], device=self.eagle.device))
            self.engine_time = saved
            self._batch_costs[key] = Costs(level, verify)
        return self._batch_costs[key]


class Batch:
    """Sequences decoded together, round by round, over one set of engines (continuous batching): `add` a
    request's prompt between rounds (it is prefilled on its own and joins the next round), or `join` it and run its
    prefill passes one `prefill` call at a time between the rounds (chunked prefill: a long prompt does not stall
    the live rows), `step` runs one round over the live rows, `retire` takes the finished ones out and frees their
    rows. The rows share the method and the sampling options; each has its own prompt, length, acceptance and
    stop. Speculation follows the batch size: with several rows live, a round speculates only where the measured
    pass times at that size say a verify pass still pays for the tokens it adds (on a CPU it stops being nearly
    free within a few rows), and the stats count rounds by batch size. generate() and `specrt serve` are built
    on it."""

    def __init__(self, gen: Generator, capacity: int, cache_len: int | None = None, *, method: str = "autoregressive",
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 gamma: int | None = None, ngram_max: int = 3, ngram_min: int = 1, tree: bool = False,
                 tree_choices=None, adaptive: bool = True):
        params = SamplingParams(temperature, top_k, top_p, seed)
        gen._check_request(method, gamma)
        if capacity < 1:
            raise InputError(f"batch capacity {capacity}: must be at least 1")
        self.gen, self.method, self.gamma, self.adaptive = gen, method, gamma, adaptive
        self.drafter = gen._drafter(method, tree, tree_choices, gamma, ngram_max, ngram_min, adaptive)
        self.tree = getattr(self.drafter, "tree", None)
        max_len = gen.max_len
        # cache slots a round may write from the pending token's on (EAGLE's expansion passes can need more)
        self.span = (getattr(self.drafter, "span", self.tree.size) if self.tree is not None
                     else (gamma or MAX_GAMMA) + 1)
        cache_len = min(max_len, (cache_len or max_len) + self.span)
        self.policy = None
        if self.drafter and adaptive and gamma is None and self.tree is None:
            # the acceptance expected at first: what the last request of this kind measured
            last = gen._gamma_policies.get((method, params.greedy))
            self.policy = gen._gamma_policies[(method, params.greedy)] = GammaPolicy(
                self._chain_costs(1), MAX_GAMMA, prior_alpha=last.alpha if last else GammaPolicy.prior_alpha)
        self.trees = None
        if self.tree is not None and adaptive:   # trees or plain steps: from what the last request measured
            last = gen._tree_policies.get((method, params.greedy))
            self.trees = gen._tree_policies[(method, params.greedy)] = last.following() if last else TreePolicy()
        self._costs_for = 1   # the batch size the policy's costs are for (gen.costs() above)
        if getattr(self.drafter, "costs", None) is not None:
            self.drafter.costs(1)   # EAGLE's tree sizing: the passes are timed now, not inside the first round
        self.run = _Run(capacity, max_len, cache_len, params, gen.target.spec.get("eos_token_ids", []),
                        gen._pool(capacity, cache_len))
        self.joining: collections.deque[_Joining] = collections.deque()   # oldest first, in rows after the live
        gen.engine_time = 0.0

    # ---- rows in and out ----------------------------------------------------------------------------------
    def add(self, ids: list[int], max_new_tokens: int, owner=None, copies: int = 1) -> None:
        """A request joins now: `join`, then its prefill passes (and those of any request queued before it)."""
        self.join(ids, max_new_tokens, owner, copies)
        while self.joining:
            self.prefill()

    def join(self, ids: list[int], max_new_tokens: int, owner=None, copies: int = 1) -> None:
        """A request queues to join: its prompt is prefilled in passes of the generator's `prefill_chunk` tokens
        (`prefill`, one pass a call) in a row after the live ones, which no round reads; after the last pass it is
        copied to `copies` rows (the request's sequences), which go live and sample their first token. `owner`:
        the caller's handle for the rows, or a sequence of one per row. Bad requests are refused here."""
        self.joining.append(self._reserve(ids, max_new_tokens, owner, copies))

    @property
    def taken(self) -> int:
        """Rows that are live or held by joining requests."""
        return self.run.batch + sum(j.copies for j in self.joining)

    def prefill(self) -> StepOutput | None:
        """The next prefill pass of the oldest joining request (none: nothing is done); after its last pass its
        rows go live. Returns that pass (its buffers valid until the next pass) once they have, else None."""
        if not self.joining:
            return None
        out = self._prefill(self.joining[0])
        if out is not None:
            self.joining.popleft()
        return out

    def _reserve(self, ids: list[int], max_new_tokens: int, owner, copies: int) -> _Joining:
        """Check a request and take rows for it after the live and joining ones, its prompt in their tokens."""
        run = self.run
        m = len(ids)
        if m >= run.max_len:
            raise InputError(f"prompt of {m} tokens does not fit the engine's maximum sequence length {run.max_len} "
                             "(it needs room for one new token): shorten the prompt or re-export with a larger "
                             "--max-seq-len")
        if m >= run.cache_len or max_new_tokens < 1:
            raise InputError(f"prompt of {m} tokens and max_new_tokens {max_new_tokens}: the batch holds "
                             f"{run.cache_len} positions per row, and at least one new token is needed")
        if self.taken + copies > run.capacity:
            raise InputError(f"{copies} more sequences do not fit the batch: {self.taken} of {run.capacity} rows "
                             "are taken")
        owners = list(owner) if isinstance(owner, (list, tuple, range)) else [owner] * copies
        if self._end() + copies > run.capacity:   # rows freed below the joining ones: close the gaps
            self._place()
        joining = _Joining(list(ids), max_new_tokens, owners, self._end(), None)
        self._tokens_to(joining, joining.row)
        joining.cache.truncate(0)
        return joining

    def _end(self) -> int:
        """The first row after the live and joining ones."""
        last = self.joining[-1] if self.joining else None
        return last.row + last.copies if last else self.run.batch

    def _place(self) -> None:
        """Each joining request in the first rows after the live ones and the requests before it (rows freed since
        it came): its row so far (prompt tokens, target and drafter caches) moves there."""
        r = self.run.batch
        for j in self.joining:
            if j.row != r:
                src = j.row
                self._tokens_to(j, r)
                if j.done:
                    self.run.pool.copy_row(src, r, j.done)
                    if self.drafter is not None:
                        self.drafter.move(src, r, j.done)
            r += j.copies

    def _tokens_to(self, j: _Joining, row: int) -> None:
        """Request j's rows start at `row` from now: its prompt in their tokens, its prefill in `row`'s cache."""
        run, m = self.run, len(j.ids)
        run._host_tokens[row:row + j.copies, :m] = j.ids
        if run.device.type != "cpu":
            run._tokens[row:row + j.copies].copy_(torch.from_numpy(run._host_tokens[row:row + j.copies]))
        j.row, j.cache = row, run.pool.row(row)

    def _prefill(self, j: _Joining) -> StepOutput | None:
        """The next chunk of a joining request's prompt through the target (its last position's logits only) and
        the drafter, into its row; after the last chunk its rows join. Returns the last chunk's pass once they
        have (its buffers valid until the next pass), None before."""
        run, gen = self.run, self.gen
        m, start, dev = len(j.ids), j.done, run.device
        # the odd-sized chunk first: the passes over the longest context, the largest, then share one shape (the
        # engines' allocators reuse their buffers rather than adding new ones for a last, smaller pass)
        S = (m - start - 1) % gen.prefill_chunk + 1
        if run.batch:   # the live rows' features, kept before the pass reuses the engine's buffers
            run.hidden = run.hidden.clone()
        prompt = run.prompt(j.row, m)                                                   # (1, m)
        out = gen._timed(gen.target, j.cache, prompt[:, start:start + S], (start + _arange(S, dev))[None],
                         chain_mask(1, S, dev), 1)
        j.cache.write(out.new_kv)
        j.cache.past_len += S
        j.done += S
        if self.drafter is not None:
            self.drafter.prefill(run, j.row, prompt, start, out.hidden)
        if j.done < m:
            return None
        self._join(j, out)
        return out

    def _join(self, j: _Joining, out) -> None:
        """A request's prompt is in its row (`out`: the target's pass over its last chunk): the rows go live, each
        samples its first token."""
        run, gen = self.run, self.gen
        r, m, copies = run.batch, len(j.ids), j.copies
        if j.row != r:   # rows retired while it was prefilled
            self._place()
        run.rows += [_Row(o, m, j.max_new) for o in j.owners]
        run.resize(r + copies)
        run.host_lengths[r:], run.active[r:] = m, True
        if run.device.type != "cpu":
            run.lengths[r:].copy_(torch.from_numpy(run.host_lengths[r:]))
        for c in range(1, copies):
            run.pool.copy_row(r, r + c, m)
        logits = out.logits[:, -1].expand(copies, -1)                                  # (copies, V)
        first = argmax(logits) if run.params.greedy else sample(probs(logits, run.params), run.generator)
        hidden = out.hidden[:, -1].expand(copies, -1)
        run.hidden = torch.cat([run.hidden[:r], hidden]) if r else hidden.clone()     # (B, d)
        if self.drafter is not None:
            self.drafter.join(run, r, copies)
        zero = torch.zeros(copies, 1, dtype=torch.int64, device=run.device)
        gen._account(run, torch.cat([zero, first[:, None], zero, first[:, None]], 1).tolist(), first=r)

    def cancel(self, which: Callable[[object], bool]) -> None:
        """The rows whose owner `which` picks stop now (stop reason "cancelled"); retire() frees them. Joining
        requests whose owners it all picks leave the queue (their rows are free again)."""
        for b, row in enumerate(self.run.rows):
            if which(row.owner) and self.run.active[b]:
                self.run.active[b], row.stop_reason = False, "cancelled"
        self.joining = collections.deque(j for j in self.joining if not all(map(which, j.owners)))

    def retire(self) -> list[tuple[_Row, list[int]]]:
        """The finished rows and their new tokens, taken out of the batch: the last live rows move into the freed
        ones (their caches, the drafter's state and the host rows), so that the live rows stay first."""
        run = self.run
        active = run.active.tolist()
        if all(active):
            return []
        done = [b for b, a in enumerate(active) if not a]
        finished = [(run.rows[b], run.output(b)) for b in done]
        live = [b for b in range(run.batch) if run.active[b]]
        n = len(live)
        hidden = run.hidden.clone()
        for dst, src in zip((b for b in done if b < n), (b for b in live if b >= n)):
            count = int(run.host_lengths[src])
            run.pool.copy_row(src, dst, count)
            run.host_tokens[dst, :count] = run.host_tokens[src, :count]
            run.host_lengths[dst], run.active[dst], run.rows[dst] = count, True, run.rows[src]
            hidden[dst] = hidden[src]
            if self.drafter is not None:
                self.drafter.move(src, dst, count)
        run.active[n:] = False
        del run.rows[n:]
        run.hidden = hidden[:n]
        run.resize(n)
        if run.device.type != "cpu" and n:
            run.tokens.copy_(torch.from_numpy(run.host_tokens))
            run.lengths.copy_(torch.from_numpy(run.host_lengths))
        return finished

    # ---- a round ------------------------------------------------------------------------------------------
    def step(self) -> None:
        """One round over the live rows: propose, verify, accept, commit."""
        run, gen, drafter, tree = self.run, self.gen, self.drafter, self.tree
        active = run.active.tolist()   # host lists, not numpy reductions: see _verify
        live = active.count(True)
        if not live:
            return
        began, n = time.perf_counter(), run.batch
        timed = True
        if tree is not None:   # a tree round needs cache room for its span, else a plain step
            g = tree.max_depth if gen._room(run) >= self.span - 1 else 0
            if g and self.trees is not None:
                timed = self._tree_pays(n)     # rounds the batch size decides are not the trees' to time
                g = g if timed and self.trees.choose() else 0
        elif drafter is None:
            g = 0
        else:
            if self.policy is not None and n != self._costs_for:   # the costs at this batch size
                self.policy.costs, self._costs_for = self._chain_costs(n), n
            g = self.policy.choose() if self.policy else self.gamma or MAX_GAMMA
            g = gen._fit_gamma(run, g) if g else 0
        proposal = drafter.propose(run, g) if drafter and g else run.inputs(run.batch, 1).empty
        taking_part = [row for row, a in zip(run.rows, active) if a]
        accepted, proposed = gen._account(run, gen._verify(run, proposal))
        if drafter is not None:
            drafter.observe(run)
        run.rounds += 1
        for row in taking_part:
            row.rounds += 1
        counts = run.by_batch.setdefault(n, [0, 0])
        counts[0], counts[1] = counts[0] + 1, counts[1] + (g > 0)
        if self.policy:
            self.policy.update(accepted, proposed)
        if self.trees and timed:
            self.trees.update(g > 0, accepted / live + 1, time.perf_counter() - began)

    def _chain_costs(self, n: int) -> Costs:
        """What a chain round costs with n rows live: the target's passes and, for the draft model, its step;
        prompt lookup drafts on the host in microseconds (charged the draft model's step, 5 % of a target pass on
        float32 and 15 % on int4, its mean γ came out 0.3–0.65 lower and its decoding 1–3 % slower)."""
        costs = self.gen.costs(min(n, MAX_MEASURED_BATCH), draft=self.method == "draft")
        return costs if self.method == "draft" else Costs(0.0, costs.verify)

    def _tree_pays(self, n: int) -> bool:
        """With n rows live, whether a tree's verify pass (n × its size) costs less than the tokens it adds: the
        tokens per tree round measured so far (2 before any), against the pass times measured at that size."""
        if n == 1:
            return True
        costs = self.gen.costs(min(n, MAX_MEASURED_BATCH), draft=False)
        tokens = self.trees.mean("tokens") if self.trees.tree_rounds > 1 else 2.0
        return tokens * costs.pass_time(1) >= costs.pass_time(self.tree.size)

    # ---- results ------------------------------------------------------------------------------------------
    def row_stats(self, row: _Row, tokens: int) -> dict:
        """One sequence's figures (the server's per-request `specrt` field)."""
        return {"method": self.method, "tokens": tokens, "rounds": row.rounds,
                "acceptance_rate": row.accepted / row.proposed if row.proposed else None,
                "mean_tokens_per_round": (tokens - 1) / row.rounds if row.rounds else None,
                "stop_reason": row.stop_reason}

    def batch_rounds(self) -> dict:
        """Rounds by live rows since the batch began, and how many of them speculated."""
        return {n: {"rounds": r, "speculative": s} for n, (r, s) in sorted(self.run.by_batch.items())}

    def stats(self) -> dict:
        """The batch's figures since it began."""
        run = self.run
        stats = {
            "method": self.method,
            "rounds": run.rounds,
            "acceptance_rate": run.accepted / run.proposed if run.proposed else None,
            "acceptance_per_position": [a / p for a, p in run.per_position],
            "engine_time_s": self.gen.engine_time,
            "gamma": self.gamma if self.gamma is not None else (
                self.policy.chosen[-1] if self.policy and self.policy.chosen else None),
            "batch_rounds": self.batch_rounds(),
        }
        tree, trees, policy = self.tree, self.trees, self.policy
        if tree is not None:
            stats.update(tree_size=tree.size - 1, tree_depth=tree.max_depth, gamma=tree.max_depth,
                         mean_accepted_length=run.accepted / max(1, run.proposed) * tree.max_depth)
        if trees is not None:
            stats.update(tree_rounds=trees.tree_rounds, plain_rounds=run.rounds - trees.tree_rounds)
        if policy is not None:
            stats["gamma_mean"] = sum(policy.chosen) / len(policy.chosen) if policy.chosen else None
            stats["plain_rounds"] = policy.chosen.count(0)
        if self.method == "draft" or policy is not None:
            costs = policy.costs if policy is not None else self.gen.costs()
            alpha = stats["acceptance_rate"]
            g = stats["gamma"] or 1
            stats["cost_ratio_c"] = costs.c if self.method == "draft" else 0.0
            stats["predicted_speedup"] = costs.predicted_speedup(alpha, g) if alpha is not None else None
        return stats

    def result(self, outputs: list[tuple[_Row, list[int]]], wall: float, prefill: float) -> Generation:
        """generate()'s Generation from the retired rows, in the callers' order."""
        rows, new = [r for r, _ in outputs], [t for _, t in outputs]
        total, row_rounds = sum(map(len, new)), sum(r.rounds for r in rows)
        stats = {"tokens": total, **self.stats(),
                 "mean_tokens_per_round": (total - len(rows)) / row_rounds if row_rounds else None,
                 "tokens_per_s": total / wall if wall > 0 else None,
                 "loop_time_s": wall - self.gen.engine_time,
                 "prefill_time_s": prefill,
                 "stop_reason": rows[0].stop_reason if len(rows) == 1 else None,
                 "stop_reasons": [r.stop_reason for r in rows]}
        text = None
        if self.gen.tokenizer is not None:
            text = [self.gen.tokenizer.decode(t, skip_special_tokens=True) for t in new]
        return Generation(new, text, stats)


class Detokenizer:
    """Text of a growing token sequence, piece by piece: a multi-byte character split across tokens waits for its
    last byte."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    @property
    def count(self) -> int:
        return len(self.ids)

    def feed(self, ids: list[int], final: bool = False) -> str | None:
        """The text the new ids complete (None without a tokenizer)."""
        self.ids += ids
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        new, self.shown = text[len(self.shown):], text
        return new
