"""The generation loop: propose → verify → accept → commit, over engines of one engine directory."""
from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from specrt.decoding import grammar, processors, tuning, verification
from specrt.decoding.adaptive import Costs, GammaPolicy, TreePolicy
from specrt.engines.base import LayerSkipEngine, OrtHeads, engine_set_device
from specrt.engines.registry import engine_class
from specrt.decoding.drafters import DraftModelDrafter, MedusaDrafter, NgramDrafter, Proposal, SelfDrafter
from specrt.decoding.eagle import DynamicTree, EagleDrafter, Figures, pass_inputs
from specrt.errors import InputError, ManifestError
from specrt.engines.manifest import check_file, read_manifest
from specrt.decoding.grammar import Grammar
from specrt.decoding.prefix_cache import PrefixCache
from specrt.decoding.processors import Penalties
from specrt.decoding.sampling import probs, token_logprobs
from specrt.decoding.tree import DEFAULT_MEDUSA_PATHS, Tree
from specrt.decoding.vocab_map import VocabMap

from specrt.decoding.batch import Batch, Detokenizer
from specrt.decoding.datastore import Datastore, tokenizer_identity
from specrt.decoding.rest import RestDrafter, RestShape
from specrt.decoding.run import (AUTO, MAX_GAMMA, MAX_MEASURED_BATCH, METHODS, MODEL_FREE, PREFILL_CHUNK,  # noqa: F401
                                 Chunk, Generation, Round, _Run)   # (all but _Run: the public names)


class Generator:
    """Engines of one engine directory, ready to generate. `Generator.from_engines(path)` then `generate()`."""

    def __init__(self, directory: Path, manifest: dict, target, draft, tokenizer, medusa=None, eagle=None,
                 loaders: dict[str, Callable] | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 prefix_cache_mb: float = 0):
        """`draft`, `medusa`, `eagle`: the drafters' engines (None: the set has none), or in `loaders` functions
        that load them, called when a request first needs one: a process that decodes with one method holds
        only its engines (the int4 set's drafters take 350 MB resident, more than its target).
        `prefill_chunk`: prompt tokens per prefill pass. A prompt runs through the target (and the drafter) in
        passes of at most this many tokens over the cache, so that a pass's activations, its attention scores
        (chunk × context) and its mask (chunk × chunk) are bounded by the chunk, not by the prompt.
        `prefix_cache_mb`: keep the state of prompts' prefixes for later prompts that start the same way (a chat's
        next turn, a shared system prompt), up to this many MiB (0: none, the default); see `prefix_cache`."""
        if prefill_chunk < 1:
            raise InputError(f"prefill chunk {prefill_chunk}: must be at least 1 token (default {PREFILL_CHUNK})")
        self.prefill_chunk = prefill_chunk
        self.directory, self.manifest = directory, manifest
        self.target, self.tokenizer = target, tokenizer
        self._drafters = {role: e for role, e in (("draft", draft), ("medusa", medusa), ("eagle", eagle))
                          if e is not None}
        self._loaders = dict(loaders or {})
        self.draft_map = None   # a draft model of another vocabulary: its VocabMap
        self.eagle_ids = None   # the vocabulary ids of the EAGLE drafter's logit columns, if only its kept ones
        self.engine_time = 0.0
        self._batch_costs: dict = {}
        self._interpolated: set[int] = set()   # batch sizes of _batch_costs on the line between measured ones
        self._self_costs: dict[int, Costs] = {}   # batch -> the self drafter's step beside _batch_costs' passes
        self._buffers: dict[str, tuple] = {}   # role -> (sizes, a batch's buffers): see reused
        self._gamma_policies: dict[tuple, GammaPolicy] = {}  # (method, regime) -> the last request's; regime:
        self._tree_policies: dict[tuple, TreePolicy] = {}    # greedy (a bool) or "typical" (see Batch); the same
        self._eagle_figures: dict[bool | str, Figures] = {}  # for tree methods; regime -> the last EAGLE request's
        self.tuning: tuning.Tuning | None = None             # this machine's, see start_warm
        self.untuned = "no tuning loaded"                    # why there is none
        self.machine: dict = {}                              # what timings depend on (tuning.machine)
        self.datastore: Datastore | None = None              # --method rest's corpus (use_datastore)
        self.suffix_cache = None                             # a SuffixCache: finished outputs go in, rest drafts
        self.rest_shape = RestShape()                        # --method rest's trees at most
        # the blocks of earlier prompts' state that every request of this generator starts from (prefix_cache.py);
        # set it to a PrefixCache of another size, or None, at any time between batches
        self.prefix_cache: PrefixCache | None = PrefixCache.of_mb(prefix_cache_mb)

    def has(self, role: str) -> bool:
        """Whether the engine set has the drafter `role` ("draft", "medusa", "eagle" or "mtp"), loaded or not. The
        target's MTP module (specrt.export.mtp) is the `eagle` engine of kind "mtp": `mtp` names it, `eagle` not."""
        if role in ("eagle", "mtp"):   # one engine, `eagle`: a drafter trained for EAGLE or the target's MTP module
            if (self.manifest.get("models", {}).get("eagle", {}).get("kind") == "mtp") != (role == "mtp"):
                return False
            role = "eagle"
        return role in self._drafters or role in self._loaders

    def _drafter_engine(self, role: str):
        if role in self._loaders:
            self._drafters[role] = self._loaders.pop(role)()
        return self._drafters.get(role)

    draft = property(lambda self: self._drafter_engine("draft"), doc="The draft model's engine (loaded on use).")
    medusa = property(lambda self: self._drafter_engine("medusa"), doc="The Medusa heads (loaded on use).")
    eagle = property(lambda self: self._drafter_engine("eagle"), doc="The EAGLE drafter's engine (loaded on use).")
    self_draft = property(lambda self: self._drafter_engine("self"),
                          doc="The self drafter's engine: the target over some of its layers (loaded on use).")

    @classmethod
    def from_engines(cls, path: str | os.PathLike, device: str = "auto", threads: int | None = None,
                     warm: bool = True, prefill_chunk: int = PREFILL_CHUNK,
                     datastore: str | os.PathLike | None = None, prefix_cache_mb: float = 0) -> "Generator":
        """`warm`: start from the engine set's tuning for this machine, if any (see start_warm). `datastore`: a
        directory of `specrt datastore build` for --method rest (see use_datastore). `prefix_cache_mb`: see
        Generator (0: no prefix cache)."""
        directory = Path(path)
        manifest = read_manifest(directory)
        models = manifest["models"]
        if "draft" in models and models["draft"]["vocab_size"] != models["target"]["vocab_size"] \
                and "vocab_map" not in models["draft"]:
            raise ManifestError(f"draft vocab size {models['draft']['vocab_size']} differs from target vocab size "
                                f"{models['target']['vocab_size']}: re-export with a draft over the same tokenizer")
        device = engine_set_device(manifest, directory, device)
        # Drafters run on the calling thread: their small matrices gain little from a thread pool, and an idle
        # pool keeps spinning for a while after each run, taking cores from the target's next pass.
        drafter_threads = 1 if device == "cpu" else threads
        # the self drafter of an ONNX Runtime build runs in the target's own session (LayerSkipEngine): one copy of
        # the weights; two sessions repacked each MatMul weight twice (docs/notes/2026-12-self-speculation.md)
        engines = {}
        for role, spec in models.items():
            if "engine" not in spec:
                raise ManifestError(f"{role} in {directory} has no built engine: run `specrt build {directory}`")
            if spec["engine"].get("layer_skip") == "target":
                continue
            path = check_file(directory, spec["engine"], f"{role} engine")
            role_threads = threads if role in ("target", "self") else drafter_threads
            backend = OrtHeads if role == "medusa" else engine_class(spec["engine"])
            engines[role] = functools.partial(backend, path, spec, device=device, threads=role_threads)
        machine = tuning.machine(device, threads)
        tuned, why = tuning.load(directory, manifest, machine)   # checked before the engines load
        tokenizer = None
        if manifest.get("tokenizer"):
            for entry in manifest["tokenizer"]:
                check_file(directory, entry, "tokenizer")
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(directory / "tokenizer")
        target = engines.pop("target")()
        if models.get("self", {}).get("engine", {}).get("layer_skip") == "target":   # the layers tune chose
            kept = tuned.self_layers if tuned is not None and warm else None
            engines["self"] = functools.partial(LayerSkipEngine, target, models["self"], kept or None)
        elif "self" in engines and getattr(target, "weights", None) is not None:   # a CUDA build's: its tensors
            engines["self"] = functools.partial(engines["self"], weights=target.weights)   # are in the target's file
        gen = cls(directory, manifest, target, None, tokenizer, loaders=engines, prefill_chunk=prefill_chunk,
                  prefix_cache_mb=prefix_cache_mb)
        if "vocab_map" in models.get("draft", {}):   # a draft of another vocabulary (decoding/vocab_map.py)
            path = check_file(directory, models["draft"]["vocab_map"], "draft vocabulary map")
            gen.draft_map = VocabMap.load(path, models["target"]["vocab_size"], models["draft"]["vocab_size"])
        if "output_ids" in models.get("eagle", {}):
            path = check_file(directory, models["eagle"]["output_ids"], "EAGLE output ids")
            gen.eagle_ids = np.array(json.loads(path.read_text())["kept_ids"], dtype=np.int64)
        gen.machine, gen.untuned = machine, why if warm else "warm=False"
        if datastore is not None:
            gen.use_datastore(datastore)
        if tuned is not None and warm:
            gen.start_warm(tuned)
        return gen

    def use_datastore(self, directory: str | os.PathLike) -> None:
        """--method rest looks continuations up in this datastore (memory-mapped), besides each row's own text and
        the suffix cache. One built with another tokenizer is refused (TokenizerMismatchError)."""
        store = Datastore.open(directory)
        store.check_tokenizer(tokenizer_identity(self.manifest), self.directory)
        self.datastore = store

    @property
    def retrieval_sources(self) -> list:
        """The stores that rest (and EAGLE's lookup chains, where the text has no match) draft from."""
        return [s for s in (self.datastore, self.suffix_cache) if s is not None]

    def start_warm(self, tuned: tuning.Tuning) -> None:
        """Start from the engine set's tuning as from the last request of a warm process: its pass times (not
        measured again), and what its last request of each method left the adaptive policies and EAGLE's
        calibration. From nothing, a one-shot process timed its passes at the first request and sized its first
        trees from a handful of rounds (EAGLE made 1.06–1.29 tokens a round on a prompt where full trees make 2)."""
        self.tuning = tuned
        for b, verify in tuned.passes.items():
            self._batch_costs[b] = Costs(tuned.draft_step, dict(verify))
            if tuned.self_step:   # timed beside the same passes (a step timed later, on a busier machine, was not)
                self._self_costs[b] = Costs(tuned.self_step, self._batch_costs[b].verify)
        spec = self.manifest["models"].get("eagle")
        level = tuned.eagle_level
        if spec is not None and level:
            shape = self.eagle_shape(spec)
            for b, seconds in level["seconds"].items():
                if shape.top_k == level["top_k"] and b in self._batch_costs:
                    self._batch_costs[("eagle", b, shape)] = Costs(seconds, self._batch_costs[b].verify)
        for regime in tuning.REGIMES:
            greedy = regime == "greedy"
            for method, alpha in tuned.gamma.get(regime, {}).items():
                self._gamma_policies[(method, greedy)] = GammaPolicy(None, MAX_GAMMA, prior_alpha=alpha)
            for method, sums in tuned.trees.get(regime, {}).items():
                self._tree_policies[(method, greedy)] = TreePolicy(sums={k: list(v) for k, v in sums.items()})
            if regime in tuned.eagle:
                self._eagle_figures[greedy] = Figures.from_json(tuned.eagle[regime])

    def measured(self) -> dict:
        """What this process has measured that start_warm starts a new one from (Tuning's fields): the pass times,
        and per regime what the last request of each method left the policies and EAGLE's calibration."""
        passes = {b: dict(c.verify) for b, c in self._batch_costs.items() if isinstance(b, int)
                  and b not in self._interpolated}
        draft = max((c.draft_step for b, c in self._batch_costs.items() if isinstance(b, int)), default=0.0)
        self_step = max((c.draft_step for c in self._self_costs.values()), default=0.0)
        levels = {key[2]: {} for key in self._batch_costs if isinstance(key, tuple)}
        for key, c in self._batch_costs.items():
            if isinstance(key, tuple):
                levels[key[2]][key[1]] = c.draft_step
        shape = self.eagle_shape(self.manifest["models"]["eagle"]) if "eagle" in self.manifest["models"] else None
        level = {"top_k": shape.top_k, "seconds": levels[shape]} if shape in levels else {}
        out = {"passes": passes, "draft_step": draft, "self_step": self_step, "eagle_level": level, "gamma": {},
               "trees": {}, "eagle": {}}
        for regime in tuning.REGIMES:
            greedy = regime == "greedy"
            out["gamma"][regime] = {m: p.alpha for (m, g), p in self._gamma_policies.items() if g == greedy}
            out["trees"][regime] = {m: p.sums for (m, g), p in self._tree_policies.items() if g == greedy}
            if greedy in self._eagle_figures:
                out["eagle"][regime] = self._eagle_figures[greedy].to_json()
        return out

    def method_for(self, method: str, greedy: bool, constrained: bool = False) -> tuple[str, str]:
        """The method a request runs and where it came from: "request" (named), "tuning" (`auto`: the tuning's
        fastest for the regime, with a grammar where the request has one and the tuning measured that) or "rule"
        (`auto` without a tuning for this machine: tuning.rule)."""
        if method != AUTO:
            return method, "request"
        if self.tuning is not None:
            methods = self.tuning.methods
            chosen = methods.get(tuning.regime(greedy, constrained)) or methods.get(tuning.regime(greedy))
            if chosen in METHODS and (chosen in MODEL_FREE or self.has(chosen)):
                return chosen, "tuning"
        return tuning.rule(self), "rule"

    def eagle_shape(self, spec: dict | None = None) -> DynamicTree:
        """The dynamic tree EAGLE rounds grow: the engine set's shape (tune-tree), chains where the target verifies
        chains only."""
        shape = DynamicTree(**(spec if spec is not None else self.eagle.spec).get("dynamic_tree", {}))
        return DynamicTree(top_k=1, depth=shape.depth, nodes=shape.depth) if self.chains_only else shape

    # ---- inputs -------------------------------------------------------------------------------------------
    def grammar(self, kind: str, spec=None, isolated: bool = False) -> Grammar:
        """A grammar for this engine set's tokenizer (grammar.compile_grammar: cached, within grammar.LIMITS;
        `isolated`: compiled in a child process first, as a server compiles its requests'), for
        generate(grammar=...) and Batch.join."""
        if self.tokenizer is None:
            raise InputError(f"{self.directory} has no tokenizer: grammars are compiled over one")
        return grammar.compile_grammar(self.tokenizer, kind, spec, isolated=isolated)

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
                 seed: int | None = None, num_return_sequences: int = 1, method: str = AUTO,
                 gamma: int | None = None, ngram_max: int = 3, ngram_min: int = 1, chat: bool = True,
                 tree: bool = False, tree_choices: str | Path | Tree | None = None,
                 adaptive: bool = True, acceptance: str = "exact", logprobs: int | None = None,
                 min_p: float = 0.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, logit_bias: dict[int, float] | None = None,
                 grammar: Grammar | tuple[str, object] | None = None, rounds: bool = False,
                 cache_partition: str | None = None, seeding: str = "position") -> Generation:
        """One prompt, or a batch of different prompts (a list of texts, or of token-id lists) decoded together,
        each row at its own length and acceptance, finished rows leaving the batch. Sequences come back prompt
        by prompt, `num_return_sequences` each. `method`: "auto" (the default: the engine set's tuning's fastest
        for greedy or sampled decoding on this machine, else `tuning.rule`; `stats["method"]` says which) or one of
        METHODS. `tree=True` makes the draft model propose a tree (top-k
        branching along its chain); `medusa` always verifies a tree: `tree_choices` (a Tree or a JSON file of
        paths), else the engine set's calibrated tree, else the built-in default. `adaptive` (the default) lets
        each round choose: chains their length γ (unless `gamma` fixes it), trees a tree or a plain step,
        whichever the measured acceptance and costs say is faster, at the batch's size; `adaptive=False`
        speculates in every round that has room. `acceptance`: "exact" (the default: the target's distribution) or
        "typical" (Medusa's typical acceptance: drafts the target finds likely enough are accepted; more tokens a
        round at temperature > 0, but NOT the target's distribution; greedy at temperature 0). The stats say which
        (`acceptance`, `distribution_preserving`). `logprobs=N`: `Generation.logprobs` holds each new token's
        log-probability under the target's distribution it was drawn from (after the processors below, temperature,
        top-k, top-p and min-p) and the N most likely tokens there (0 to 20), drafted tokens included: the verify
        pass computed them.
        `min_p` drops tokens below min_p × the most likely one's probability (after top-p); `presence_penalty`,
        `frequency_penalty` (OpenAI's), `repetition_penalty` and `logit_bias` ({token id: bias}) process the
        target's logits at every position in the context it has (processors.py): the output is the processed
        target's, with every method. `grammar`: the output follows it, ("json_object", None), ("json_schema",
        {...}), ("regex", "...") or ("grammar", Lark or GBNF text), or a grammar.compile_grammar() result: every
        position's distribution is the target's masked to what the grammar allows there. `rounds=True`:
        `Generation.rounds` holds each sequence's Rounds, what every round drafted, accepted and kept (see Round).
        `cache_partition`: the prefix cache's partition the prompts read from and add to (a tenant's name; None, the
        default: the shared one): a prompt only reuses what prompts of its own partition left (prefix_cache.py).
        `seed` (at temperature > 0, exact acceptance): each sequence's tokens are a function of the seed, the prompt
        and the sequence's index alone: the same with every method, γ, tree and adaptive choice and any batch
        neighbours (each position sampled by the exponential race with noise keyed by the seed and the position,
        sampling.seeded_pick; drafts are checked against that pick, the target's distribution over seeds);
        `seeding="stream"`: the seed starts the rejection rules' random stream instead (the same tokens only with the
        same method and choices; what a request without a seed runs, from a random seed)."""
        loop = self._rounds(prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed,
                            num_return_sequences, method, gamma, ngram_max, ngram_min, chat, tree, tree_choices,
                            adaptive, acceptance, logprobs, min_p, presence_penalty, frequency_penalty,
                            repetition_penalty, logit_bias, grammar, rounds, cache_partition, seeding)
        while True:
            try:
                next(loop)
            except StopIteration as done:
                return done.value

    def stream(self, prompt: str | None = None, prompt_ids: list[int] | None = None, **options) -> Iterator[Chunk]:
        """`generate` for one sequence, as it goes: after every round a Chunk with the new tokens and the text they
        complete (decoded incrementally: a multi-byte character split across tokens waits for its last byte); the
        last chunk carries the stats; with `rounds=True` each chunk has the Rounds that made its tokens. `options`
        are generate's."""
        if options.get("num_return_sequences", 1) != 1:
            raise InputError(f"num_return_sequences {options['num_return_sequences']}: streaming gives one "
                             "sequence; use generate() for several")
        if isinstance(prompt, list) or (prompt_ids and isinstance(prompt_ids[0], list)):
            raise InputError("stream() takes one prompt; use generate() for a batch of prompts")
        rounds, text = self._rounds(prompt, prompt_ids, **options), Detokenizer(self.tokenizer)
        threads = torch.get_num_threads()   # the caller's, while it holds control
        want, logged = options.get("logprobs") is not None, 0
        while True:
            sent = text.count
            try:
                run = next(rounds)
                ids, stats = run.new_tokens(0) if run.batch else [], None
                lps = run.rows[0].logprobs[sent:sent + len(ids)] if run.batch else []
                log = run.rows[0].round_log if run.batch else None
            except StopIteration as done:
                ids, stats = done.value.token_ids[0][sent:], done.value.stats
                lps = done.value.logprobs[0][sent:] if want else []
                log = done.value.rounds[0] if done.value.rounds else None
            if ids or stats is not None:
                loop_threads = torch.get_num_threads()
                torch.set_num_threads(threads)
                yield Chunk(ids, text.feed(ids, final=stats is not None), stats, lps if want else None,
                            log[logged:] if log is not None else None)
                logged = len(log) if log is not None else 0
                torch.set_num_threads(loop_threads)
            if stats is not None:
                return

    def batch(self, capacity: int, cache_len: int | None = None, **options) -> "Batch":
        """A batch of up to `capacity` sequences that requests join between rounds (continuous batching); options
        are generate()'s speculation and sampling ones. See Batch."""
        return Batch(self, capacity, cache_len, **options)

    def _rounds(self, prompt, prompt_ids, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                top_p: float = 1.0, seed: int | None = None, num_return_sequences: int = 1,
                method: str = AUTO, gamma: int | None = None, ngram_max: int = 3, ngram_min: int = 1,
                chat: bool = True, tree: bool = False, tree_choices=None, adaptive: bool = True,
                acceptance: str = "exact", logprobs: int | None = None, min_p: float = 0.0,
                presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                logit_bias: dict[int, float] | None = None, grammar=None, rounds: bool = False,
                cache_partition: str | None = None, seeding: str = "position"):
        """The loop, one round at a time: yields the batch's state after the prefills and after every round,
        returns the Generation. The loop runs with one torch thread (its tensors are small: a pool only adds
        latency); the caller's setting is back when it ends."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if max_new_tokens < 1 or num_return_sequences < 1:
                raise InputError(f"max_new_tokens {max_new_tokens} and num_return_sequences {num_return_sequences} "
                                 "must be at least 1")
            penalties = Penalties(presence_penalty, frequency_penalty, repetition_penalty,
                                  tuple((int(t), float(v)) for t, v in (logit_bias or {}).items()))
            if grammar is not None and not isinstance(grammar, Grammar):
                grammar = self.grammar(*grammar)
            prompts = self._prompts(prompt, prompt_ids, chat)
            n = num_return_sequences
            room = max(map(len, prompts)) + max_new_tokens + 1
            batch = self.batch(len(prompts) * n, room, method=method, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed, gamma=gamma, ngram_max=ngram_max, ngram_min=ngram_min,
                               tree=tree, tree_choices=tree_choices, adaptive=adaptive, acceptance=acceptance,
                               min_p=min_p, constrained=grammar is not None, seeding=seeding)
            started = time.perf_counter()
            for i, ids in enumerate(prompts):
                batch.add(ids, max_new_tokens, owner=range(i * n, i * n + n), copies=n, logprobs=logprobs,
                          penalties=penalties, grammar=grammar, rounds=rounds, partition=cache_partition)
            prefill_time = time.perf_counter() - started
            outputs: list = [None] * (len(prompts) * n)
            while True:
                yield batch.run
                for row, tokens in batch.retire():
                    if row.stop_reason == "grammar_error":   # its matcher failed (grammar.Matcher.error)
                        raise row.matcher.error
                    outputs[row.owner] = (row, tokens)
                if not batch.run.batch:
                    break
                batch.step()
            return batch.result(outputs, time.perf_counter() - started, prefill_time)
        finally:
            torch.set_num_threads(threads)

    def _check_request(self, method: str, gamma) -> None:
        if method not in METHODS:
            raise InputError(f"method {method!r}: choose {AUTO} or one of {', '.join(METHODS)}")
        if method == "draft" and not self.has("draft"):
            raise InputError(f"--method draft: {self.directory} has no draft model; export with --draft SOURCE")
        if method == "medusa" and not self.has("medusa"):
            raise InputError(f"--method medusa: {self.directory} has no Medusa heads; export with --medusa PATH")
        if method == "eagle" and not self.has("eagle"):
            mtp = " (its feature drafter is the target's MTP module: --method mtp)" if self.has("mtp") else ""
            raise InputError(f"--method eagle: {self.directory} has no EAGLE drafter{mtp}; export with --eagle PATH")
        if method == "self" and not self.has("self"):
            raise InputError(f"--method self: {self.directory} has no self drafter; export with --self-layers auto "
                             "(or half, or the layers to keep, such as 0-14,29)")
        if method == "mtp" and not self.has("mtp"):
            raise InputError(f"--method mtp: {self.directory} has no MTP module; export a target checkpoint that ships "
                             "one (DeepSeek-V3, GLM-4.5 or MiMo layout: docs/drafters.md)")
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
        """The target's cache for a batch (`reused`)."""
        return self.reused("target", (capacity, length), lambda: self.target.new_cache(capacity, length))

    def reused(self, role: str, key: tuple, make):
        """A batch's buffers of `role` (the target's or a drafter's cache, EAGLE's feature history): the last ones
        made when `key` (their sizes) repeats, as a server's batches and a bench's requests do, else `make()` (the
        old ones let go first). One batch runs at a time over a Generator. New ones cost every request that starts
        a batch its time to first token: on 2 cores 150–200 ms for the target's cache, 15–20 ms for the draft
        model's, 15 ms for EAGLE's cache and history (a sampled request's `auto` took 40 ms longer than
        autoregressive's to its first token)."""
        last = self._buffers.get(role)
        if last is None or last[0] != key:
            self._buffers.pop(role, None)
            self._buffers[role] = (key, make())
        return self._buffers[role][1]

    @property
    def chains_only(self) -> bool:
        """A target whose MatMuls quantize their input to int8 (`--target-weights int4|int8`) verifies trees as
        chains. A tree pass gives a node's ancestors other attention columns than a chain does, so its softmax
        and P·V sums round differently; float32 engines shrug that off (a near tie at most), but the rounding
        flips int8 activations downstream and the tree's logits drift from the engine's own by up to ~1–3
        (measured on the int4 SmolLM2 target), which would break the token-identical promise. A chain of the
        drafter's top choices (one node per depth) lays out exactly as the target's own steps."""
        return self.target.spec.get("engine", {}).get("activations") == "int8"

    def _drafter(self, method, tree, tree_choices, gamma, ngram_max, ngram_min, adaptive=False, figures=None):
        if method == "autoregressive":
            return None
        if method == "ngram":
            return NgramDrafter(ngram_max, ngram_min)
        if method == "rest":
            shape = self.rest_shape
            sizing = (lambda n: self.costs(min(n, MAX_MEASURED_BATCH), upto=shape.nodes + 1, draft=False)) \
                if adaptive else None
            return RestDrafter(self.retrieval_sources, shape, sizing, chains=self.chains_only)
        if method == "medusa":
            chosen = self.tree_for("medusa", tree_choices)
            return MedusaDrafter(self.medusa, Tree.chain(chosen.max_depth) if self.chains_only else chosen,
                                 self._timed_call)
        if method in ("eagle", "mtp"):   # the same drafter: mtp's graph has three norms more
            shape = self.eagle_shape()
            sizing = (lambda n: self.eagle_costs(min(n, MAX_MEASURED_BATCH), shape)) if adaptive else None
            return EagleDrafter(self.eagle, self._timed, shape, sizing, self.eagle_ids, chains=self.chains_only,
                                figures=figures, sources=self.retrieval_sources)
        # the draft model, or the target over some of its layers on the target's cache
        kind, engine, vocab_map = (SelfDrafter, self.self_draft, None) if method == "self" else \
            (DraftModelDrafter, self.draft, self.draft_map)
        tree = self.tree_for(method, tree_choices, gamma) if (tree or tree_choices is not None) and \
            not self.chains_only else None
        return kind(engine, self._timed, tree, vocab_map, part=method)

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
        # a seeded batch: the greedy rules over each node's seeded pick (sampling.seeded_pick), which depends on its
        # row's seed and position only: the same tokens whatever was drafted
        seeded = params.seeded
        if on_host and (params.greedy or params.plain) and out.host is not None:   # plain Python on the host
            logits, tokens, path = out.host_logits(), host[0].tolist(), None
            logits = self._processed(run, logits, tokens, tree)
            pick = run.host_picker(logits, depth) if seeded else None
            u = None if params.greedy or seeded else \
                torch.rand(B, g + 1, generator=run.generator, device="cpu", dtype=torch.float64).tolist()
            if tree is not None:   # u: one uniform per child tried, then the draw
                rows, path = verification.tree_greedy_host(logits, tokens, tree, pick) if u is None else \
                    verification.tree_typical_host(logits, tokens, tree, params.temperature, u) if params.typical \
                    else verification.tree_sampled_host(logits, tokens, tree, params.temperature, u)
                accepted = [p[:r[0] + 1] for r, p in zip(rows, path)]
            elif u is None:
                rows = verification.greedy_host(logits, tokens, proposal.on_host()[1] if g else [0] * B, pick)
                accepted = [r[0] + 1 for r in rows]
            else:                  # u: acceptance at each position, then the draw
                q = proposal.q.numpy() if proposal.q is not None else None
                width = proposal.on_host()[1] if g else [0] * B
                rows = verification.typical_host(logits, tokens, width, params.temperature, u) if params.typical \
                    else verification.sampled_host(logits, tokens, width, q, params.temperature, u)
                accepted = [r[0] + 1 for r in rows]
            self._logprobs(run, logits, rows, path)
            cache.write(out.host_kv(), past, accepted)   # the accepted path's entries only, in order
            run.after_pass(out, path, [r[0] for r in rows])
            return rows
        cache.write(out.new_kv)
        logits = self._processed(run, out.logits, None, tree, ids)
        scores = run.seeded_scores(logits, depth) if seeded else logits   # argmax: the seeded picks
        if tree is not None:
            dtree = tree.on(dev)
            rule = verification.tree_typical if params.typical else verification.tree_sampled
            n, nxt, path = verification.tree_greedy(scores, ids, dtree) if params.greedy or seeded else \
                rule(probs(logits, params), ids, dtree, run.generator)
            path = path.clamp(min=0)                                                    # padding past the leaf
            cache.compact(path)
            tokens, width = ids.gather(1, path), torch.full_like(n, tree.max_depth)
        else:
            if params.greedy or seeded:
                n, nxt = verification.greedy(scores, proposal.tokens, proposal.valid)
            else:
                P = probs(logits, params)                                               # (B, γ+1, V)
                n, nxt = verification.typical(P, proposal.tokens, proposal.valid, run.generator) if params.typical \
                    else verification.sampled(P, proposal.q, proposal.tokens, proposal.valid, run.generator)
            path, tokens, width = None, ids, proposal.valid.sum(1)
        run.after_pass(out, path, n)
        read = torch.cat([n[:, None], nxt[:, None], width[:, None], tokens, *([] if path is None else [path])],
                         1).tolist()   # the read: the commit rows, then a tree's accepted node ids (the drafters')
        cut = 3 + tokens.shape[1]
        run.host_pass = (None if path is None else [r[cut:] for r in read], [r[0] for r in read])
        self._logprobs(run, logits, [r[:cut] for r in read], run.host_pass[0])
        return [r[:cut] for r in read]

    @staticmethod
    def _processed(run: _Run, logits, tokens: list[list[int]] | None, tree, ids=None):
        """The pass's logits (B, S, V) with each row's processors applied at every node in the context that node
        has under autoregressive decoding (processors.node_paths): its penalties, then its grammar's mask (a node
        whose own path leaves the grammar is left as it is: its parent's mask refuses its token, so it is never
        reached). A copy where a row has processors, else `logits` itself. `tokens`: the pass's tokens per row
        (None: read from `ids` once, only then)."""
        rows = [b for b, row in enumerate(run.rows)
                if (row.penalties is not None or row.matcher is not None) and run.active[b]]
        if not rows:
            return logits
        logits = logits.clone() if isinstance(logits, torch.Tensor) else logits.copy()
        tokens = tokens if tokens is not None else ids.tolist()
        parent = tree.parent if tree is not None else None
        for b in rows:
            row = run.rows[b]
            paths = processors.node_paths(tokens[b], parent)
            if row.penalties is not None:
                for i, path in enumerate(paths):
                    processors.apply(logits[b, i], row.penalties, row.context, path)
            if row.matcher is not None:
                masks, ok = grammar.path_masks(row.matcher, paths)
                for i in (i for i, inside in enumerate(ok) if inside):
                    processors.mask(logits[b, i], masks[i])
        return logits

    @staticmethod
    def _logprobs(run: _Run, logits, rows: list[list[int]], paths: list[list[int]] | None) -> None:
        """The round's tokens' logprobs for the rows that asked for them, into run.round_logprobs (_account keeps
        those it commits): row b's tokens (its accepted drafts, then the next token) are drawn from the pass's
        logits at the accepted path's nodes (a chain's: positions 0 .. n)."""
        run.round_logprobs = {}
        for b, (row, (n, nxt, _w, _root, *drafts)) in enumerate(zip(run.rows, rows)):
            if row.logprobs_top is None or not run.active[b]:
                continue
            nodes = list(range(n + 1)) if paths is None else paths[b][:n + 1]
            run.round_logprobs[b] = token_logprobs(logits[b, nodes], drafts[:n] + [nxt], run.params,
                                                   row.logprobs_top)

    def _account(self, run: _Run, host: list[list[int]], first: int = 0, drafted: bool = True,
                 drafts: list[list[int]] | None = None) -> tuple[int, int]:
        """Host side of a commit, from the read: per row (from row `first`) the accepted count n, the next token,
        the proposal width, then the path's tokens (root first). Writes the mirrors (on the CPU, the device
        tensors themselves), the stop reasons and the acceptance counts (`drafted=False`: the proposal was what
        the rows' grammars force, counted as forced tokens, not as drafts); a row's own counts are of the accepted
        drafts it keeps (a round its end cuts keeps fewer). Rows that keep a round log get the round (`drafts`: each
        row's drafted tokens, see Round). Plain Python over the rows: for the few rows of a batch it costs a
        fraction of numpy's per-call overhead."""
        accepted = proposed = 0
        active, lengths, tokens = run.active.tolist(), run.host_lengths.tolist(), run.host_tokens
        for b, (n, nxt, width, _root, *path) in enumerate(host, first):
            if not active[b]:
                continue
            row = run.rows[b]
            length = lengths[b]
            new = (path[:n] + [nxt])[:min(row.max_new + row.prompt_len, run.max_len) - length]
            eos = next((i for i, tok in enumerate(new) if tok in run.stop_ids), None)
            if eos is not None:
                new = new[:eos + 1]
            kept = min(n, len(new))   # the round's drafts (or forced tokens) in the output
            if drafted:
                self._count_drafts(run, row, n, width, kept)
                accepted, proposed = accepted + n, proposed + width
            else:
                run.forced += n
            if row.round_log is not None:
                row.round_log.append(Round(drafts[b - first], kept, new) if drafts and drafted else
                                     Round([], 0, new, 0 if drafted else kept))
            if b in run.round_logprobs:
                row.logprobs += run.round_logprobs[b][:len(new)]
            if row.context is not None:
                row.context.add(new)
            if row.matcher is not None:
                row.matcher.commit(new)
            for tok in new:
                tokens[b, length] = tok
                length += 1
            run.host_lengths[b] = length
            reason = ("grammar_error" if row.matcher is not None and row.matcher.error is not None else
                      "eos" if eos is not None else "max_new_tokens" if length - row.prompt_len >= row.max_new else
                      "max_seq_len" if length >= run.max_len else None)
            if reason:
                run.active[b], row.stop_reason = False, reason
        if run.device.type != "cpu":   # on the CPU the mirrors are the device tensors
            run.tokens.copy_(torch.from_numpy(run.host_tokens), non_blocking=True)
            run.lengths.copy_(torch.from_numpy(run.host_lengths), non_blocking=True)
        run.accepted += accepted
        run.proposed += proposed
        run.round_logprobs = {}
        return accepted, proposed

    @staticmethod
    def _count_drafts(run: _Run, row, n: int, width: int, kept: int | None = None) -> None:
        """A round in the acceptance counts: n of its `width` drafts accepted; the row's own counts take the `kept`
        of them that are in its output (default n)."""
        kept = n if kept is None else kept
        row.accepted, row.proposed = row.accepted + kept, row.proposed + width
        if width:
            row.drafts += 1
            per = row.accepted_per_position
            per += [0] * (kept - len(per))
            for i in range(kept):
                per[i] += 1
        for i in range(width):
            while len(run.per_position) <= i:
                run.per_position.append([0, 0])
            run.per_position[i][0] += i < n
            run.per_position[i][1] += 1

    # ---- costs --------------------------------------------------------------------------------------------
    def costs(self, batch: int = 1, upto: int = MAX_GAMMA + 1, draft: bool | str = True) -> Costs:
        """Time target passes over 1..MAX_GAMMA+1 tokens per row on this machine (once per batch size, ~1 s for one
        row; for several rows two passes, with a line through them; between two measured sizes, on the line between
        them: _between) and, with `draft` where the set has a draft
        model, its step (else `draft_step` stays 0: the caller does not need it, and the model is not loaded for
        it); `draft` "self": the self drafter's step instead. `upto` (a tree's size) adds passes over a few more
        sizes up to it."""
        saved = self.engine_time
        context = min(64, self.target.spec["max_seq_len"] - MAX_GAMMA - 2)
        if batch not in self._batch_costs and not self._between(batch):
            if batch == 1:
                verify = self._pass_times(context, range(1, MAX_GAMMA + 2), batch)
            else:
                one, most = self._pass_times(context, (1, MAX_GAMMA + 1), batch).values()
                verify = {k: one + (most - one) * (k - 1) / MAX_GAMMA for k in range(1, MAX_GAMMA + 2)}
            self._batch_costs[batch] = Costs(0.0, verify)
        costs = self._batch_costs[batch]
        if draft == "self":   # the self drafter's step beside the same target passes
            costs = self._self_costs.setdefault(batch, Costs(0.0, costs.verify))
        role = "self" if draft == "self" else "draft"
        if draft and self.has(role) and not costs.draft_step:
            costs.draft_step = self._drafter_engine(role).time_pass(context, 1)
        upto = min(upto, self.target.spec["max_seq_len"])
        more = sorted({k for k in (12, 16, 24, 32, 48, 64, upto) if max(costs.verify) < k <= upto})
        if more and batch not in self._interpolated:   # (an interpolated size's larger passes: on its line)
            costs.verify.update(self._pass_times(min(64, self.target.spec["max_seq_len"] - more[-1]), more, batch))
        self.engine_time = saved
        return costs

    def timed(self, batch: int) -> bool:
        """Whether the target's pass times at this batch size are measured (here or by the tuning)."""
        return batch in self._batch_costs and batch not in self._interpolated

    def _between(self, batch: int) -> bool:
        """Pass times at a batch size between two measured ones, on the line between them, into _batch_costs: a
        size first met while serving (rows joining and leaving) was timed then, and stalled the live streams for
        0.3–0.6 s a size on 2 cores (sizes 3, 5, 6 and 7 of a tuning that measured 1, 2, 4 and 8: 2 s). False where
        no measured size lies on either side (the size is measured)."""
        sizes = [b for b in self._batch_costs if isinstance(b, int) and b not in self._interpolated]
        lo, hi = max((b for b in sizes if b < batch), default=None), min((b for b in sizes if b > batch), default=None)
        if lo is None or hi is None:
            return False
        a, b, w = self._batch_costs[lo], self._batch_costs[hi], (batch - lo) / (hi - lo)
        verify = {k: a.verify[k] + (b.verify[k] - a.verify[k]) * w for k in sorted(set(a.verify) & set(b.verify))}
        self._batch_costs[batch] = Costs(a.draft_step, verify)
        self._interpolated.add(batch)
        return True

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
                                         **pass_inputs(spec, batch, k, self.eagle.device))
            self.engine_time = saved
            self._batch_costs[key] = Costs(level, verify)
        return self._batch_costs[key]
