"""The generation loop: propose → verify → accept → commit, over engines of one engine directory."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from specrt import verification
from specrt.adaptive import Costs, GammaPolicy, TreePolicy
from specrt.backends import OrtHeads, engine_class, pick_device
from specrt.drafters import DraftModelDrafter, MedusaDrafter, NgramDrafter, Proposal, _arange, chain_mask
from specrt.eagle import DynamicTree, EagleDrafter
from specrt.errors import InputError, ManifestError
from specrt.manifest import check_file, read_manifest
from specrt.sampling import SamplingParams, argmax, probs, sample
from specrt.tree import DEFAULT_MEDUSA_PATHS, Tree

METHODS = ("autoregressive", "draft", "ngram", "medusa", "eagle")
MAX_GAMMA = 8


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
class _Run:
    """The state of one generate call: B rows sharing a prompt, each with its own length. `tokens` and `lengths` live
    on the engines' device; `host_tokens`, `host_lengths` and `active` are the host's, updated once a round from
    the one host read (see Generator._commit) and copied to the device (on the CPU they share memory)."""
    tokens: torch.Tensor            # (B, Smax) int64, on the device
    lengths: torch.Tensor           # (B,) tokens held, prompt included, on the device
    prompt_len: int
    max_new: int
    stop_ids: frozenset[int]        # end-of-sequence ids
    params: SamplingParams
    generator: torch.Generator      # on the device
    max_len: int                    # the engines' max_seq_len
    host_tokens: np.ndarray         # (B, Smax) int64
    host_lengths: np.ndarray        # (B,) int64
    active: np.ndarray              # (B,) bool
    stop_reason: list[str | None]
    cache_len: int = 0              # slots per row in this request's caches (<= max_len)
    cache: object = None            # the target's KVCache
    hidden: torch.Tensor | None = None       # (B, d) target hidden state at each row's last accepted position
    path_hidden: torch.Tensor | None = None  # (B, D+1, d) target hidden states along the last accepted path
    path_start: torch.Tensor | None = None   # (B,) the position of path_hidden[:, 0] (the last round's root)
    prompt_hidden: torch.Tensor | None = None  # (1, m, d) the prompt's, from the prefill (valid until the next pass)
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    per_position: list[list[int]] = field(default_factory=list)  # [accepted, proposed] per draft position

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def last_tokens(self) -> torch.Tensor:
        """(B,) each row's last committed token."""
        return self.tokens.gather(1, (self.lengths - 1)[:, None])[:, 0]


class Generator:
    """Engines of one engine directory, ready to generate. `Generator.from_engines(path)` then `generate()`."""

    def __init__(self, directory: Path, manifest: dict, target, draft, tokenizer, medusa=None, eagle=None):
        self.directory, self.manifest = directory, manifest
        self.target, self.draft, self.medusa, self.tokenizer = target, draft, medusa, tokenizer
        self.eagle = eagle
        self.engine_time = 0.0
        self._costs: Costs | None = None

    @classmethod
    def from_engines(cls, path: str | os.PathLike, device: str = "auto", threads: int | None = None) -> "Generator":
        directory = Path(path)
        manifest = read_manifest(directory)
        models = manifest["models"]
        if "draft" in models and models["draft"]["vocab_size"] != models["target"]["vocab_size"]:
            raise ManifestError(f"draft vocab size {models['draft']['vocab_size']} differs from target vocab size "
                                f"{models['target']['vocab_size']}: re-export with a draft over the same tokenizer")
        device = pick_device(device)
        # Drafters run on the calling thread: their small matrices gain little from a thread pool, and an idle
        # pool keeps spinning for a while after each run, taking cores from the target's next pass.
        drafter_threads = 1 if device == "cpu" else threads
        engines = {}
        for role, spec in models.items():
            if "engine" not in spec:
                raise ManifestError(f"{role} in {directory} has no built engine: run `specrt build {directory}`")
            path = check_file(directory, spec["engine"], f"{role} engine")
            role_threads = threads if role == "target" else drafter_threads
            if role == "medusa":
                engines[role] = OrtHeads(path, spec, device=device, threads=role_threads)
                continue
            backend = engine_class(spec["engine"])
            engines[role] = backend(path, spec, device=device, threads=role_threads)
        tokenizer = None
        if manifest.get("tokenizer"):
            for entry in manifest["tokenizer"]:
                check_file(directory, entry, "tokenizer")
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
        return cls(directory, manifest, engines["target"], engines.get("draft"), tokenizer, engines.get("medusa"),
                   engines.get("eagle"))

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
    def generate(self, prompt: str | None = None, prompt_ids: list[int] | None = None, *,
                 max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, num_return_sequences: int = 1, method: str = "autoregressive",
                 gamma: int | None = None, ngram_max: int = 3, ngram_min: int = 1, chat: bool = True,
                 tree: bool = False, tree_choices: str | Path | Tree | None = None,
                 adaptive: bool = True) -> Generation:
        """`tree=True` makes the draft model propose a tree (top-k branching along its chain); `medusa`
        always verifies a tree: `tree_choices` (a Tree or a JSON file of paths), else the engine set's
        calibrated tree, else the built-in default. `adaptive` (the default) lets each round choose: chains
        their length γ (unless `gamma` fixes it), trees a tree or a plain step, whichever the measured
        acceptance and costs say is faster; `adaptive=False` speculates in every round that has room."""
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
        rounds, sent, shown = self._rounds(prompt, prompt_ids, **options), 0, ""
        threads = torch.get_num_threads()   # the caller's, while it holds control
        while True:
            try:
                run = next(rounds)
                stats = None
            except StopIteration as done:
                stats = done.value.stats
            ids = run.host_tokens[0, run.prompt_len:run.host_lengths[0]].tolist()
            text = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                text = text if stats is not None or not text.endswith("\ufffd") else shown
                text, shown = text[len(shown):], text
            if len(ids) > sent or stats is not None:
                loop_threads = torch.get_num_threads()
                torch.set_num_threads(threads)
                yield Chunk(ids[sent:], text, stats)
                torch.set_num_threads(loop_threads)
                sent = len(ids)
            if stats is not None:
                return

    def _rounds(self, prompt, prompt_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int | None = None, num_return_sequences: int = 1,
                method: str = "autoregressive", gamma: int | None = None, ngram_max: int = 3, ngram_min: int = 1,
                chat: bool = True, tree: bool = False, tree_choices=None, adaptive: bool = True):
        """The loop, one round at a time: yields the request's state after the prefill and after every round,
        returns the Generation. The loop runs with one torch thread (its tensors are small: a pool only adds
        latency); the caller's setting is back when it ends."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            params = SamplingParams(temperature, top_k, top_p, seed)
            self._check_request(method, gamma, max_new_tokens, num_return_sequences)
            run = self._new_run(self._prompt_ids(prompt, prompt_ids, chat), params, max_new_tokens,
                                num_return_sequences)
            drafter = self._drafter(method, tree, tree_choices, gamma, ngram_max, ngram_min)
            tree = getattr(drafter, "tree", None)
            run.cache_len = min(run.max_len, run.prompt_len + max_new_tokens + 1 +
                                (tree.size if tree is not None else (gamma or MAX_GAMMA) + 1))
            policy = GammaPolicy(self.costs(), MAX_GAMMA) if drafter and adaptive and gamma is None and \
                tree is None else None
            trees = TreePolicy() if tree is not None and adaptive else None

            self.engine_time = 0.0
            started = time.perf_counter()
            self._prefill(run)
            prefill_time = time.perf_counter() - started
            if drafter is not None:
                drafter.start(run)
            while True:
                yield run
                if not run.active.any():
                    break
                began, live = time.perf_counter(), int(run.active.sum())
                if tree is not None:  # a tree round needs cache room for the whole tree, else a plain step
                    g = tree.max_depth if self._room(run) >= tree.size - 1 and (trees is None or trees.choose()) \
                        else 0
                else:
                    g = self._fit_gamma(run, (policy.choose() if policy else gamma or MAX_GAMMA) if drafter else 0)
                proposal = drafter.propose(run, g) if drafter and g else Proposal.empty(run.batch, run.device)
                accepted, proposed = self._commit(run, proposal, *self._verify(run, proposal))
                if drafter is not None:
                    drafter.observe(run)
                if policy:
                    policy.update(accepted, proposed)
                if trees:
                    trees.update(g > 0, accepted / live + 1, time.perf_counter() - began)
            wall = time.perf_counter() - started
            return self._result(run, method, wall, prefill_time, policy, gamma, tree, trees)
        finally:
            torch.set_num_threads(threads)

    def _check_request(self, method: str, gamma, max_new_tokens: int, num_return_sequences: int) -> None:
        if method not in METHODS:
            raise InputError(f"method {method!r}: choose one of {', '.join(METHODS)}")
        if method == "draft" and self.draft is None:
            raise InputError(f"--method draft: {self.directory} has no draft model; export with --draft SOURCE")
        if method == "medusa" and self.medusa is None:
            raise InputError(f"--method medusa: {self.directory} has no Medusa heads; export with --medusa PATH")
        if method == "eagle" and self.eagle is None:
            raise InputError(f"--method eagle: {self.directory} has no EAGLE drafter; export with --eagle PATH")
        if gamma is not None and not 1 <= gamma <= 64:
            raise InputError(f"gamma {gamma}: must be between 1 and 64")
        if max_new_tokens < 1 or num_return_sequences < 1:
            raise InputError(f"max_new_tokens {max_new_tokens} and num_return_sequences {num_return_sequences} "
                             "must be at least 1")

    def _prompt_ids(self, prompt: str | None, prompt_ids, chat: bool) -> list[int]:
        if (prompt is None) == (prompt_ids is None):
            raise InputError("give exactly one of prompt (text) and prompt_ids (token ids)")
        ids = self.encode(prompt, chat) if prompt is not None else list(prompt_ids)
        vocab = self.target.spec["vocab_size"]
        bad = [i for i in ids if not 0 <= i < vocab]
        if not ids or bad:
            raise InputError(f"prompt ids {bad[:5] or ids}: need at least one id, each in [0, {vocab})")
        return ids

    def _new_run(self, ids: list[int], params: SamplingParams, max_new_tokens: int, batch: int) -> _Run:
        max_len = min(s.spec["max_seq_len"] for s in (self.target, self.draft) if s is not None)
        if len(ids) >= max_len:
            raise InputError(f"prompt of {len(ids)} tokens does not fit the engine's maximum sequence length "
                             f"{max_len} (it needs room for one new token): shorten the prompt or re-export "
                             "with a larger --max-seq-len")
        device = self.target.device
        tokens = np.zeros((batch, max_len), np.int64)
        tokens[:, :len(ids)] = ids
        lengths = np.full(batch, len(ids), np.int64)
        stop = frozenset(self.target.spec.get("eos_token_ids", []))
        # on the CPU the device tensors share the mirrors' memory (from_numpy); elsewhere they are copies
        return _Run(torch.from_numpy(tokens).to(device), torch.from_numpy(lengths).to(device), len(ids),
                    max_new_tokens, stop, params, params.generator(device), max_len, tokens, lengths,
                    np.ones(batch, bool), [None] * batch)

    def _drafter(self, method, tree, tree_choices, gamma, ngram_max, ngram_min):
        if method == "autoregressive":
            return None
        if method == "ngram":
            return NgramDrafter(ngram_max, ngram_min)
        if method == "medusa":
            return MedusaDrafter(self.medusa, self.tree_for("medusa", tree_choices), self._timed_call)
        if method == "eagle":
            return EagleDrafter(self.eagle, self._timed, DynamicTree(**self.eagle.spec.get("dynamic_tree", {})))
        if tree or tree_choices is not None:
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

    def _prefill(self, run: _Run) -> None:
        """The prompt runs once (one row); its cache is copied to the B rows, each samples its first token."""
        B, m, dev = run.batch, run.prompt_len, run.device
        one = self.target.new_cache(1, run.cache_len)
        out = self._timed(self.target, one, run.tokens[:1, :m], _arange(m, dev)[None], chain_mask(1, m, dev), 1)
        one.write(out.new_kv)
        one.past_len += m
        logits = out.logits[:, -1].expand(B, -1)                                        # (B, V)
        run.hidden = out.hidden[:, -1].expand(B, -1).clone()                            # (B, d)
        run.prompt_hidden = out.hidden                                                  # (1, m, d)
        first = argmax(logits) if run.params.greedy else sample(probs(logits, run.params), run.generator)
        run.cache = one
        if B > 1:
            run.cache = self.target.new_cache(B, run.cache_len)
            run.cache.broadcast_row(one)
        zero = torch.zeros(B, dtype=torch.int64, device=dev)
        self._commit(run, Proposal.empty(B, dev), zero, first, zero[:, None], first[:, None])

    def _room(self, run: _Run) -> int:
        """Tokens that every live row can still add to its cache beyond the pending one."""
        return run.max_len - int(run.host_lengths[run.active].max())

    def _fit_gamma(self, run: _Run, gamma: int) -> int:
        """No more drafts than the cache has room for, or than the longest-remaining row can still emit."""
        left = run.max_new - (int(run.host_lengths[run.active].min()) - run.prompt_len)
        return max(0, min(gamma, self._room(run), left - 1))

    def _verify(self, run: _Run, proposal: Proposal):
        """One target pass over [last token, proposal] per row (a chain or a tree), written into the cache at
        past_len = length − 1. Returns accepted counts, next tokens, accepted paths (node ids, root first) and the
        pass's tokens."""
        B, g = proposal.tokens.shape
        cache, dev = run.cache, run.device
        # the round's inputs from the host mirrors: numpy is cheaper than device ops on a few values
        past = np.minimum(run.host_lengths - 1, run.max_len - 1 - g)                      # (B,)
        last = run.host_tokens[np.arange(B), run.host_lengths - 1][:, None]              # (B, 1)
        cache.truncate(torch.from_numpy(past))
        ids = torch.from_numpy(last).to(dev)
        if g:
            ids = torch.cat([ids, proposal.tokens], 1)                                  # (B, S)
        tree = proposal.tree.on(dev) if proposal.tree is not None else None
        depth = tree.depth if tree is not None else _arange(g + 1, dev)
        mask = tree.mask.expand(B, -1, -1).contiguous() if tree is not None else chain_mask(B, g + 1, dev)
        pos = (cache.past_len[:, None] + depth).clamp(max=run.max_len - 1)
        out = self._timed(self.target, cache, ids, pos, mask, g + 1)
        cache.write(out.new_kv)
        if tree is not None:
            rule = (lambda: verification.tree_greedy(out.logits, ids, tree)) if run.params.greedy else \
                (lambda: verification.tree_sampled(probs(out.logits, run.params), ids, tree, run.generator))
            n, nxt, path = rule()
            path = path.clamp(min=0)                                                    # padding past the leaf
        else:
            if run.params.greedy:
                n, nxt = verification.greedy(out.logits, proposal.tokens, proposal.valid)
            else:
                P = probs(out.logits, run.params)                                       # (B, γ+1, V)
                n, nxt = verification.sampled(P, proposal.q, proposal.tokens, proposal.valid, run.generator)
            path = _arange(g + 1, dev).expand(B, -1)
        # the target's features along the accepted path (views of the engine's buffer when it is a chain: they
        # are read by the next proposal, before the target's next pass)
        d = out.hidden.shape[-1]
        run.path_hidden = out.hidden if tree is None else out.hidden.gather(1, path[..., None].expand(-1, -1, d))
        run.path_start = cache.past_len
        run.hidden = run.path_hidden[:, 0] if g == 0 else \
            run.path_hidden.gather(1, n[:, None, None].expand(-1, 1, d))[:, 0]            # (B, d) for Medusa
        return n, nxt, path, ids

    def _commit(self, run: _Run, proposal: Proposal, n: torch.Tensor, nxt: torch.Tensor, path: torch.Tensor,
                ids: torch.Tensor) -> tuple[int, int]:
        """Append each live row's accepted drafts and next token (cut at a stop), after compacting a tree path's KV
        entries into consecutive slots. The device gives the round's one host read (accepted counts, next
        tokens, the path's tokens, proposal widths); the bookkeeping is host work on the mirrors."""
        tree = proposal.tree
        if tree is not None:
            run.cache.compact(path)
            ids = ids.gather(1, path)                                                   # (B, D+1) root first
            width = torch.full_like(n, tree.max_depth)
        else:
            width = proposal.valid.sum(1)                                               # a chain's path is itself
        host = torch.cat([n[:, None], nxt[:, None], width[:, None], ids], 1).cpu().numpy()  # the read
        return self._account(run, host)

    def _account(self, run: _Run, host: np.ndarray) -> tuple[int, int]:
        """Host side of a commit, from the read: per row the accepted count n, the next token, the proposal width,
        then the path's tokens (root first). Writes the mirrors (on the CPU, the device tensors themselves), the
        stop reasons and the acceptance counts. Plain Python over the rows: for the few rows of a request it
        costs a fraction of numpy's per-call overhead."""
        limit = min(run.max_new + run.prompt_len, run.max_len)
        accepted = proposed = 0
        for b, (n, nxt, width, _root, *path) in enumerate(host.tolist()):
            if not run.active[b]:
                continue
            accepted, proposed = accepted + n, proposed + width
            for i in range(width):
                while len(run.per_position) <= i:
                    run.per_position.append([0, 0])
                run.per_position[i][0] += i < n
                run.per_position[i][1] += 1
            length = int(run.host_lengths[b])
            new = (path[:n] + [nxt])[:limit - length]
            eos = next((i for i, tok in enumerate(new) if tok in run.stop_ids), None)
            if eos is not None:
                new = new[:eos + 1]
            run.host_tokens[b, length:length + len(new)] = new
            length += len(new)
            run.host_lengths[b] = length
            reason = ("eos" if eos is not None else "max_new_tokens" if length - run.prompt_len >= run.max_new else
                      "max_seq_len" if length >= run.max_len else None)
            if reason:
                run.active[b], run.stop_reason[b] = False, reason
        if run.device.type != "cpu":   # on the CPU the mirrors are the device tensors
            run.tokens.copy_(torch.from_numpy(run.host_tokens), non_blocking=True)
            run.lengths.copy_(torch.from_numpy(run.host_lengths), non_blocking=True)
        run.rounds += 1
        run.accepted += accepted
        run.proposed += proposed
        return accepted, proposed

    def _result(self, run: _Run, method: str, wall: float, prefill: float, policy, gamma, tree, trees) -> Generation:
        new = [run.host_tokens[b, run.prompt_len:run.host_lengths[b]].tolist() for b in range(run.batch)]
        total = sum(map(len, new))
        rounds = run.rounds - 1  # the prefill emits the first token, it is not a speculation round
        stats = {
            "method": method,
            "tokens": total,
            "rounds": rounds,
            "acceptance_rate": run.accepted / run.proposed if run.proposed else None,
            "mean_tokens_per_round": (total - run.batch) / (rounds * run.batch) if rounds else None,
            "acceptance_per_position": [a / p for a, p in run.per_position],
            "tokens_per_s": total / wall if wall > 0 else None,
            "engine_time_s": self.engine_time,
            "loop_time_s": wall - self.engine_time,
            "prefill_time_s": prefill,
            "stop_reason": run.stop_reason[0] if run.batch == 1 else None,
            "stop_reasons": run.stop_reason,
            "gamma": gamma if gamma is not None else (policy.chosen[-1] if policy and policy.chosen else None),
        }
        if tree is not None:
            stats.update(tree_size=tree.size - 1, tree_depth=tree.max_depth, gamma=tree.max_depth,
                         mean_accepted_length=run.accepted / max(1, run.proposed) * tree.max_depth)
        if trees is not None:
            stats.update(tree_rounds=trees.tree_rounds, plain_rounds=trees.plain_rounds)
        if policy is not None:
            stats["gamma_mean"] = sum(policy.chosen) / len(policy.chosen) if policy.chosen else None
            stats["plain_rounds"] = policy.chosen.count(0)
        if method == "draft" or policy is not None:
            costs = self.costs()
            alpha = stats["acceptance_rate"]
            g = stats["gamma"] or 1
            stats["cost_ratio_c"] = costs.c if method == "draft" else 0.0
            stats["predicted_speedup"] = costs.predicted_speedup(alpha, g) if alpha is not None else None
        text = None
        if self.tokenizer is not None:
            text = [self.tokenizer.decode(t, skip_special_tokens=True) for t in new]
        return Generation(new, text, stats)

    # ---- costs --------------------------------------------------------------------------------------------
    def costs(self) -> Costs:
        """Time a draft step and target passes over 1..MAX_GAMMA+1 tokens on this machine (once, ~1 s)."""
        if self._costs is None:
            saved = self.engine_time
            context = min(64, self.target.spec["max_seq_len"] - MAX_GAMMA - 2)
            verify = {k: self.target.time_pass(context, k) for k in range(1, MAX_GAMMA + 2)}
            draft = self.draft.time_pass(context, 1) if self.draft is not None else 0.0
            self._costs = Costs(draft, verify)
            self.engine_time = saved
        return self._costs
