"""A batch of rows decoded together, round by round (continuous batching), and the streaming detokenizer."""
from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from specrt.decoding.adaptive import Costs, GammaPolicy, TreePolicy
from specrt.engines.base import StepOutput
from specrt.decoding.drafters import Proposal, _arange, chain_mask
from specrt.decoding.eagle import Figures
from specrt.errors import InputError
from specrt.decoding import processors, steering
from specrt.decoding.grammar import Grammar, Matcher
from specrt.decoding.processors import Context, Penalties
from specrt.decoding.sampling import SamplingParams, argmax, check_logprobs, probs, sample, token_logprobs
from specrt.decoding.run import AUTO, MAX_GAMMA, MAX_MEASURED_BATCH, Generation, _Joining, _Row, _Run

log = logging.getLogger(__name__)


class Batch:
    """Sequences decoded together, round by round, over one set of engines (continuous batching): `add` a
    request's prompt between rounds (it is prefilled on its own and joins the next round), or `join` it and run its
    prefill passes one `prefill` call at a time between the rounds (chunked prefill: a long prompt does not stall
    the live rows), `step` runs one round over the live rows, `retire` takes the finished ones out and frees their
    rows. The rows share the method and the sampling options; each has its own prompt, length, acceptance and
    stop (`constrained`: its requests have grammars, and `auto` runs the tuning's method for that). Speculation
    follows the batch size (its live rows and those of the prompts queued to join): with several rows, a round
    speculates only where the measured pass times at that size say a verify pass still pays for the tokens it adds
    (on a CPU it stops being nearly free within a few rows), and the stats count rounds by batch size. generate()
    and `specrt serve` are built on it."""

    def __init__(self, gen: "Generator", capacity: int, cache_len: int | None = None, *, method: str = AUTO,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 gamma: int | None = None, ngram_max: int = 3, ngram_min: int = 1, tree: bool = False,
                 tree_choices=None, adaptive: bool = True, acceptance: str = "exact", min_p: float = 0.0,
                 constrained: bool = False, seeding: str = "position"):
        params = SamplingParams(temperature, top_k, top_p, seed, acceptance, min_p, seeding)
        method, self.method_from = gen.method_for(method, params.greedy, constrained)
        # what the last request of this regime measured (acceptance, EAGLE's calibration) seeds this one's policies;
        # typical acceptance accepts more than exact, so its requests keep their own figures, which start from the
        # sampled regime's and never reach the tuning (Generator.measured reads the greedy and sampled regimes)
        regime = "typical" if params.typical else params.greedy
        gen._check_request(method, gamma)
        if capacity < 1:
            raise InputError(f"batch capacity {capacity}: must be at least 1")
        self.gen, self.method, self.gamma, self.adaptive = gen, method, gamma, adaptive
        figures = None
        if method in ("eagle", "mtp") and adaptive:   # EAGLE's calibration: from the last request of its regime
            last = gen._eagle_figures.get(regime) or gen._eagle_figures.get(params.greedy)
            figures = gen._eagle_figures[regime] = last.following() if last else Figures()
        self.drafter = gen._drafter(method, tree, tree_choices, gamma, ngram_max, ngram_min, adaptive, figures)
        self.tree = getattr(self.drafter, "tree", None)
        max_len = gen.max_len
        # cache slots a round may write from the pending token's on (EAGLE's expansion passes can need more)
        self.span = (getattr(self.drafter, "span", self.tree.size) if self.tree is not None
                     else (gamma or MAX_GAMMA) + 1)
        cache_len = min(max_len, (cache_len or max_len) + self.span)
        self.draft_failures = 0   # rounds whose drafting failed (each a plain step instead)
        self.policy = None
        if self.drafter and adaptive and gamma is None and self.tree is None:
            # the acceptance expected at first: what the last request of this kind measured
            last = gen._gamma_policies.get((method, regime)) or gen._gamma_policies.get((method, params.greedy))
            self.policy = gen._gamma_policies[(method, regime)] = GammaPolicy(
                self._chain_costs(1), MAX_GAMMA, prior_alpha=last.alpha if last else GammaPolicy.prior_alpha)
        self.trees = None
        # trees or plain steps: from what the last request measured; a drafter that sizes each round's tree from
        # this machine's costs and its own calibration, and takes plain steps itself where none pays (rest), is
        # left to it (its rounds without a match would count as trees of one token and stop the trees for good)
        if self.tree is not None and adaptive and not getattr(self.drafter, "sizes_itself", False):
            last = gen._tree_policies.get((method, regime)) or gen._tree_policies.get((method, params.greedy))
            self.trees = gen._tree_policies[(method, regime)] = last.following() if last else TreePolicy()
        self._costs_for = 1   # the batch size the policy's costs are for (gen.costs() above)
        self.drafting = None  # this round's rows that draft (per-row budgets, _chain_gamma); None: every row
        if getattr(self.drafter, "costs", None) is not None:
            self.drafter.costs(1)   # EAGLE's tree sizing: the passes are timed now, not inside the first round
        self.run = _Run(capacity, max_len, cache_len, params, gen.target.spec.get("eos_token_ids", []),
                        gen._pool(capacity, cache_len), gen.reused)
        self.joining: collections.deque[_Joining] = collections.deque()   # oldest first, in rows after the live
        self.prompt_tokens = self.cached_tokens = 0   # the requests' prompt tokens, those from the prefix cache
        gen.engine_time = 0.0

    # ---- rows in and out ----------------------------------------------------------------------------------
    def add(self, ids: list[int], max_new_tokens: int, owner=None, copies: int = 1,
            logprobs: int | None = None, penalties: Penalties | None = None, grammar: Grammar | None = None,
            rounds: bool = False, partition: str | None = None, seed: int | None = None) -> None:
        """A request joins now: `join`, then its prefill passes (and those of any request queued before it)."""
        self.join(ids, max_new_tokens, owner, copies, logprobs, penalties, grammar, rounds, partition, seed)
        while self.joining:
            self.prefill()

    def join(self, ids: list[int], max_new_tokens: int, owner=None, copies: int = 1,
             logprobs: int | None = None, penalties: Penalties | None = None, grammar: Grammar | None = None,
             rounds: bool = False, partition: str | None = None, seed: int | None = None) -> None:
        """A request queues to join: its prompt is prefilled in passes of the generator's `prefill_chunk` tokens
        (`prefill`, one pass a call) in a row after the live ones, which no round reads; after the last pass it is
        copied to `copies` rows (the request's sequences), which go live and sample their first token. `owner`:
        the caller's handle for the rows, or a sequence of one per row. `logprobs`: each new token's log-probability
        and this many alternatives are kept (`_Row.logprobs`; None: not). `penalties`: its rows' processors of the
        target's logits (processors.py); `grammar`: the grammar its output follows (decoding/grammar.py: each row
        a Matcher of it); `rounds`: its rows keep a Round per round, the first token's included (_Row.round_log);
        `partition`: the prefix cache's partition it reads and adds to (its tenant; None: the shared one); `seed`:
        in a seeded batch (one made with a seed, at temperature > 0), its own seed (None: the batch's): its copy i
        samples by the noise of (seed, i) (sampling.noise), so its tokens do not depend on the method or on its
        neighbours. Bad requests are refused here."""
        check_logprobs(logprobs)
        if penalties is not None:
            penalties.check_vocab(self.gen.target.spec["vocab_size"])
        joining = self._reserve(ids, max_new_tokens, owner, copies)
        joining.logprobs = logprobs
        joining.penalties = penalties if penalties is not None and penalties.active else None
        joining.grammar = grammar
        joining.rounds = rounds
        joining.partition = partition
        joining.seed = seed
        self.joining.append(joining)

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
                else:   # not prefilled yet: row r may still hold a retired request's cache length
                    j.cache.truncate(0)
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
        if run.batch:   # the live rows' features, kept before a pass reuses the engine's buffers
            run.hidden = run.hidden.clone()
        if j.cached is None:   # its first chunk: whether the drafter's pass waits, once for all its chunks (a
            # chunk fed after one that waited would write its slots at the row's cache end); before its own pass,
            # since the answer may time passes at a new size, which reuse the engine's buffers
            j.defer = self.drafter is not None and self._defers()
            self._restore(j)
        m, start, dev = len(j.ids), j.done, run.device
        # the odd-sized chunk first: the passes over the longest context, the largest, then share one shape (the
        # engines' allocators reuse their buffers rather than adding new ones for a last, smaller pass)
        S = (m - start - 1) % gen.prefill_chunk + 1
        prompt = run.prompt(j.row, m)                                                   # (1, m)
        out = gen._timed(gen.target, j.cache, prompt[:, start:start + S], (start + _arange(S, dev))[None],
                         chain_mask(1, S, dev), 1)
        j.cache.write(out.new_kv)
        j.cache.past_len += S
        j.done += S
        if self.drafter is not None:
            # an EAGLE-3 drafter reads the target's aux states (the inputs of three layers) where others read hidden
            feats = out.aux if getattr(self.drafter, "aux", None) else out.hidden
            self.drafter.prefill(run, j.row, prompt, start, feats, defer=j.defer)
        if j.done < m:
            return None
        if gen.prefix_cache is not None:
            parts = {"target": (j.cache.data[:, 0], 2, m)}                             # (2L, Hkv, Smax, D)
            gen.prefix_cache.store(j.ids, parts | (self.drafter.cache_parts(j.row, m) if self.drafter else {}),
                                   j.partition)
        self._join(j, out)
        return out

    def _restore(self, j: _Joining) -> None:
        """The longest prefix of a joining request's prompt that the generator's prefix cache holds, with every part
        the method cannot do without, into its row: the target's keys and values, and the drafter's state (its
        `restore`: the draft model's cache copied where cached, EAGLE's layer prefilled from the target's cached
        states). Its prefill goes on from there."""
        cache, run = self.gen.prefix_cache, self.run
        j.cached = 0
        self.prompt_tokens += len(j.ids)
        if cache is None:
            return
        hit = cache.match(j.ids, ("target", *(self.drafter.cache_needs if self.drafter else ())), j.partition)
        if not hit.tokens:
            return
        cache.copy(hit, "target", j.cache.data[:, 0], axis=2)                          # (2L, Hkv, Smax, D)
        j.cache.truncate(hit.tokens)
        if self.drafter is not None:
            self.drafter.restore(run, j.row, run.prompt(j.row, len(j.ids)), cache, hit, self.gen.prefill_chunk,
                                 defer=j.defer)
        j.done = j.cached = hit.tokens
        self.cached_tokens += hit.tokens

    def _defers(self) -> bool:
        """Whether a joining prompt's drafter pass waits for the row's first proposal: where the drafter can feed a
        row from what it keeps (EAGLE: the target's features at every position) and the batch, this prompt's rows
        counted, takes plain steps because a tree's verify pass does not pay at its size (a server under load:
        EAGLE's pass over each prompt was 7 % of its prefill, and most rows never drafted)."""
        return getattr(self.drafter, "defers", False) and self.trees is not None and not self._tree_pays(self.taken)

    def _join(self, j: _Joining, out) -> None:
        """A request's prompt is in its row (`out`: the target's pass over its last chunk): the rows go live, each
        samples its first token."""
        run, gen = self.run, self.gen
        r, m, copies = run.batch, len(j.ids), j.copies
        if j.row != r:   # rows retired while it was prefilled
            self._place()
        V = gen.target.spec["vocab_size"]
        seed = j.seed if j.seed is not None else run.params.seed
        run.rows += [_Row(o, m, j.max_new, cached=j.cached, logprobs_top=j.logprobs, penalties=j.penalties,
                          context=Context(j.ids) if j.penalties else None,
                          matcher=Matcher(j.grammar, V, run.stop_ids or None) if j.grammar else None,
                          round_log=[] if j.rounds else None, partition=j.partition,
                          seed_key=(seed, c) if run.params.seeded else None) for c, o in enumerate(j.owners)]
        run.resize(r + copies)
        run.host_lengths[r:], run.active[r:] = m, True
        if run.device.type != "cpu":
            run.lengths[r:].copy_(torch.from_numpy(run.host_lengths[r:]))
        for c in range(1, copies):
            run.pool.copy_row(r, r + c, m)
        logits = out.logits[:, -1]                                                     # (1, V)
        if j.penalties is not None or j.grammar is not None:
            logits = logits.clone()
            if j.penalties is not None:
                processors.apply(logits[0], j.penalties, run.rows[r].context)
            if j.grammar is not None:
                processors.mask(logits[0], run.rows[r].matcher.allowed())
        logits = logits.expand(copies, -1)                                              # (copies, V)
        if run.params.seeded:   # each copy's seeded pick at position m (see Generator._verify)
            first = run.seeded_scores(logits[:, None], [0], rows=range(r, r + copies))[:, 0].argmax(-1)
        else:
            first = argmax(logits) if run.params.greedy else sample(probs(logits, run.params), run.generator)
        if j.logprobs is not None:
            firsts = first.tolist()
            run.round_logprobs = {r + c: token_logprobs(logits[c:c + 1], firsts[c:c + 1], run.params, j.logprobs)
                                  for c in range(copies)}
        hidden = out.hidden[:, -1].expand(copies, -1)
        run.hidden = torch.cat([run.hidden[:r], hidden]) if r else hidden.clone()     # (B, d)
        if self.drafter is not None:
            self.drafter.join(run, r, copies)
        zero = torch.zeros(copies, 1, dtype=torch.int64, device=run.device)
        gen._account(run, torch.cat([zero, first[:, None], zero, first[:, None]], 1).tolist(), first=r)

    def cancel(self, which: Callable[[object], bool], reason: str = "cancelled") -> None:
        """The rows whose owner `which` picks stop now (stop reason `reason`); retire() frees them. Joining
        requests whose owners it all picks leave the queue (their rows are free again)."""
        for b, row in enumerate(self.run.rows):
            if which(row.owner) and self.run.active[b]:
                self.run.active[b], row.stop_reason = False, reason
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
        if self.gen.prefix_cache is not None:   # a chat's next turn resends this prompt and answer
            for b in done:
                self._keep(b)
        if self.gen.suffix_cache is not None:   # suffix decoding: later requests draft from these outputs
            for _, tokens in finished:
                if len(tokens) > 1:
                    self.gen.suffix_cache.add(tokens)
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

    def _keep(self, b: int) -> None:
        """A finished row's prompt and answer into the prefix cache: its whole blocks but the last token's (whose
        keys and values no pass has computed yet), the target's and what the drafter keeps of a finished row."""
        run, n = self.run, int(self.run.host_lengths[b]) - 1
        parts = {"target": (run.pool.data[:, b], 2, n)}                             # (2L, Hkv, Smax, D)
        if self.drafter is not None:
            parts |= self.drafter.cache_parts(b, n, finished=True)
        self.gen.prefix_cache.store(run.host_tokens[b, :n].tolist(), parts, run.rows[b].partition)

    # ---- a round ------------------------------------------------------------------------------------------
    def step(self) -> None:
        """One round over the live rows: propose, verify, accept, commit."""
        run, gen, drafter, tree = self.run, self.gen, self.drafter, self.tree
        active = run.active.tolist()   # host lists, not numpy reductions: see _verify
        live = active.count(True)
        if not live:
            return
        began, n = time.perf_counter(), run.batch
        # speculation follows the size the batch is about to have: the rows of the prompts queued to join count (a
        # round that speculates for 1 row while 7 prompts wait delays their prefills, and their tokens, to add a
        # token or two to that row's)
        size = self.taken
        timed = True
        if tree is not None:   # a tree round needs cache room for its span, else a plain step
            g = tree.max_depth if gen._room(run) >= self.span - 1 else 0
            if g and self.trees is not None:
                timed = self._tree_pays(size)     # rounds the batch size decides are not the trees' to time
                g = g if timed and self.trees.choose() else 0
        elif drafter is None:
            g = 0
        else:
            if self.policy is not None and size != self._costs_for:   # the costs at this batch size
                self.policy.costs, self._costs_for = self._chain_costs(size), size
            g = self._chain_gamma(active, live) if self.policy else self.gamma or MAX_GAMMA
            g = gen._fit_gamma(run, g) if g else 0
        constrained = any(row.matcher is not None for row in run.rows)
        forced = None
        if constrained and g:
            forced = self._forced(every=2)   # a forced run in every live row: one pass takes it, no drafter's
            g = 0 if forced is not None else g
        proposal = self._propose(g) if drafter and g else None
        if proposal is not None and tree is None and self.drafting is not None and not all(self.drafting):
            proposal = _only(proposal, self.drafting)
        kept = None   # a tree the grammars pruned: its nodes' ids in the drafter's tree
        if constrained and proposal is not None and proposal.tree is None:
            proposal = self._steer(proposal, g)
        elif constrained and proposal is not None:
            proposal, kept, refused = steering.steer_tree(proposal, run.rows, active)
            run.refused += refused
            g = g if proposal is not None else 0
        if proposal is None and forced is None and constrained:
            forced = self._forced()   # a plain round takes what the grammars force in its one pass
        if proposal is None:
            g, proposal = 0, forced or run.inputs(run.batch, 1).empty
        taking_part = [row for row, a in zip(run.rows, active) if a]
        host = gen._verify(run, proposal)
        drafts = self._drafted(proposal, host) if g and any(row.round_log is not None for row in run.rows) else None
        accepted, proposed = gen._account(run, host, drafted=forced is None, drafts=drafts)
        if not g:   # the drafters' caches catch up on these tokens (a forced run's too) at their next proposal
            run.skipped += max(r[0] + 1 for r, a in zip(host, active) if a)
        if drafter is not None:
            if kept is not None and run.host_pass is not None:   # the drafter's own node ids
                run.host_pass = steering.original_ids(run.host_pass, kept)
            drafter.observe(run)
        run.rounds += 1
        for row in taking_part:
            row.rounds += 1
        counts = run.by_batch.setdefault(n, [0, 0])
        counts[0], counts[1] = counts[0] + 1, counts[1] + (g > 0)
        if self.policy:
            self.policy.update(accepted, proposed)
        if self.trees and timed and forced is None:   # (a forced round is neither a tree's nor a plain step's)
            self.trees.update(g > 0, accepted / live + 1, time.perf_counter() - began)

    @staticmethod
    def _drafted(proposal: Proposal, host: list[list[int]]) -> list[list[int]]:
        """Each row's drafted tokens this round, for the round logs (Round): a chain's valid drafts; a tree's branch
        that the target followed (`host`: its accepted path), then the tree's first candidate where it stopped."""
        tokens, widths = proposal.host or (proposal.tokens.cpu().numpy(), proposal.valid.sum(1).tolist())
        tree = proposal.tree
        if tree is None:
            return [tokens[b, :w].tolist() for b, w in enumerate(widths)]
        drafts = []
        for b, (n, _nxt, _width, _root, *path) in enumerate(host):
            node, branch = 0, []
            while tree.children[node]:
                kids = tree.children[node]
                depth = len(branch)
                node = next((c for c in kids if depth < n and tokens[b, c - 1] == path[depth]), kids[0])
                branch.append(int(tokens[b, node - 1]))
                if depth >= n:   # the first candidate below the accepted path
                    break
            drafts.append(branch)
        return drafts

    def _forced(self, every: int = 0) -> Proposal | None:
        """What the live rows' grammars force (the only token each allows, one after another), as a chain of
        deterministic drafts: their masked P is one-hot, so they are accepted with certainty, and the plain round's
        one pass takes them all with the token after them. None where no grammar forces a token, or (`every`) where
        a live row's grammar forces fewer than `every` tokens (a tree round drafts for it instead)."""
        run = self.run
        cap = self.gen._fit_gamma(run, MAX_GAMMA)
        active = run.active.tolist()
        chains = [row.matcher.forced()[:cap] if row.matcher is not None and a and cap else []
                  for row, a in zip(run.rows, active)]
        k = max(map(len, chains))
        if not k or every and min(len(c) for c, a in zip(chains, active) if a) < every:
            return None
        tokens, valid = np.zeros((run.batch, k), np.int64), np.zeros((run.batch, k), bool)
        for b, chain in enumerate(chains):
            tokens[b, :len(chain)], valid[b, :len(chain)] = chain, True
        return Proposal(torch.from_numpy(tokens).to(run.device), None, torch.from_numpy(valid).to(run.device))

    def _steer(self, proposal: Proposal, g: int) -> Proposal:
        """A drafted chain along each constrained row's grammar: where the grammar forces a token, the draft is
        that token (drawn deterministically given the path before it: Q = δ, accepted with certainty), and a
        deterministic chain goes on with forced tokens past its own drafts, up to the round's γ = g; it stops
        at the first draft the grammar refuses (it could not be accepted). A sampled draft the grammar refuses
        stays: its Q is what it was drawn from, and the rule rejects it exactly."""
        run = self.run
        tokens, valid = proposal.tokens.cpu().numpy().copy(), proposal.valid.cpu().numpy().copy()   # (B, γ)
        q = proposal.q.clone() if proposal.q is not None else None                                 # (B, γ, V)
        if q is None and tokens.shape[1] < g:   # a lookup that found less than γ: room for forced tokens
            pad = ((0, 0), (0, g - tokens.shape[1]))
            tokens, valid = np.pad(tokens, pad), np.pad(valid, pad)
        for b, row in enumerate(run.rows):
            m = row.matcher
            if m is None or not run.active[b]:
                continue
            taken, width = 0, int(valid[b].sum())
            for i in range(width if q is not None else tokens.shape[1]):
                allowed = m.allowed()
                if np.count_nonzero(allowed) == 1:
                    tokens[b, i], valid[b, i] = int(allowed.argmax()), True
                    if q is not None:
                        q[b, i] = 0.0
                        q[b, i, tokens[b, i]] = 1.0
                elif i >= width or not allowed[tokens[b, i]]:
                    if q is None:
                        valid[b, i:] = False
                    break
                if m.advance([int(tokens[b, i])]) != 1:   # (allowed, so not expected)
                    break
                taken += 1
            m.rollback(taken)
        dev = proposal.tokens.device
        return Proposal(torch.from_numpy(tokens).to(dev), q, torch.from_numpy(valid).to(dev))

    def _propose(self, g: int):
        """The drafter's proposal, or None if drafting failed: the round is then a plain step for every row, whose
        output is the target's all the same (a drafter only proposes; verification decides). The failure is
        logged, with its traceback the first time in the batch."""
        try:
            return self.drafter.propose(self.run, g)
        except Exception:   # noqa: BLE001 -- no row's request fails for a drafter's fault
            self.draft_failures += 1
            log.warning("drafting failed (%s; %d rounds of this batch): the round is a plain step", self.method,
                        self.draft_failures, exc_info=self.draft_failures == 1)
            return None

    def _chain_gamma(self, active: list[bool], live: int) -> int:
        """γ of a chain round, and which rows draft (self.drafting). One live row: the policy's γ from the
        acceptance. Several: per-row budgets (GammaPolicy.choose_rows), each row's acceptance its own drafts' shrunk
        toward the batch's (worth one draft), a row probing on every `probe_every`-th round of its own. A saturated
        batch: a plain round, without the drafter or any per-row work."""
        policy, self.drafting = self.policy, None
        if live == 1:
            return policy.choose()
        if policy.saturated():
            policy.chosen.append(0)
            return 0
        a = policy.alpha   # the batch's, worth one draft of the row's own
        alphas = [(r.accepted + a) / (r.proposed + 1) if on else None for r, on in zip(self.run.rows, active)]
        probing = [r.rounds % policy.probe_every == 0 for r in self.run.rows]
        g, self.drafting = policy.choose_rows(alphas, probing)
        return g

    def _chain_costs(self, n: int) -> Costs:
        """What a chain round costs with n rows live: the target's passes and, for the draft model, its step;
        prompt lookup drafts on the host in microseconds (charged the draft model's step, 5 % of a target pass on
        float32 and 15 % on int4, its mean γ came out 0.3–0.65 lower and its decoding 1–3 % slower)."""
        costs = self.gen.costs(min(n, MAX_MEASURED_BATCH), draft=self._stepper)
        return costs if self._stepper else Costs(0.0, costs.verify)

    @property
    def _stepper(self) -> str | bool:
        """Whose step a chain round's drafting costs (`gen.costs`' draft): the draft model's or the self drafter's;
        False where drafts cost no model step (prompt lookup, rest)."""
        return self.method if self.method in ("draft", "self") else False

    def _tree_pays(self, n: int) -> bool:
        """With n rows live, whether a tree's verify pass (n × its size) costs less than the tokens it adds: the
        tokens per tree round measured so far (2 before any), against the pass times measured at that size."""
        if n == 1:
            return True
        costs = self.gen.costs(min(n, MAX_MEASURED_BATCH), draft=False)
        tokens = self.trees.mean("tokens") if self.trees.tree_rounds > 1 else 2.0
        return tokens * costs.pass_time(1) >= costs.pass_time(self.tree.size)

    # ---- results ------------------------------------------------------------------------------------------
    def acceptance(self) -> dict:
        """The verification rules that made the output and whether it has the target's distribution: typical
        acceptance at temperature > 0 does not; asked for at temperature 0 it is greedy decoding, exact."""
        typical = self.run.params.typical
        return {"acceptance": "typical" if typical else "exact", "distribution_preserving": not typical}

    def row_stats(self, row: _Row, tokens: int) -> dict:
        """One sequence's figures (the server's per-request `specrt` field)."""
        return {"method": self.method, "method_from": self.method_from, **self.acceptance(), "tokens": tokens,
                "rounds": row.rounds, "acceptance_rate": row.accepted / row.proposed if row.proposed else None,
                "mean_tokens_per_round": (tokens - 1) / row.rounds if row.rounds else None,
                "stop_reason": row.stop_reason, "drafts": row.drafts, "draft_tokens": row.proposed,
                "accepted_tokens": row.accepted, "accepted_per_position": list(row.accepted_per_position),
                "prefix_cache_tokens": row.cached}

    def batch_rounds(self) -> dict:
        """Rounds by live rows since the batch began, and how many of them speculated."""
        return {n: {"rounds": r, "speculative": s} for n, (r, s) in sorted(self.run.by_batch.items())}

    def stats(self) -> dict:
        """The batch's figures since it began."""
        run = self.run
        stats = {
            "method": self.method,
            "method_from": self.method_from,
            **self.acceptance(),
            "rounds": run.rounds,
            "acceptance_rate": run.accepted / run.proposed if run.proposed else None,
            "acceptance_per_position": [a / p for a, p in run.per_position],
            "engine_time_s": self.gen.engine_time,
            "gamma": self.gamma if self.gamma is not None else (
                self.policy.chosen[-1] if self.policy and self.policy.chosen else None),
            "batch_rounds": self.batch_rounds(),
            "draft_failures": self.draft_failures,   # rounds a failed drafting made plain steps (logged)
            "forced_tokens": run.forced,             # taken as the grammars forced them, not as drafts
            "grammar_refused_nodes": run.refused,    # tree nodes the grammars refused: dropped before the pass
            "prompt_tokens": self.prompt_tokens,     # the prompts prefilled, and their positions that came from
            "prefix_cache_tokens": self.cached_tokens,   # the prefix cache (copied, not computed)
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
        if self._stepper or policy is not None:
            costs = policy.costs if policy is not None else self.gen.costs(draft=self._stepper)
            alpha = stats["acceptance_rate"]
            g = stats["gamma"] or 1
            stats["cost_ratio_c"] = costs.c if self._stepper else 0.0
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
        logprobs = [r.logprobs for r in rows] if any(r.logprobs_top is not None for r in rows) else None
        rounds = [r.round_log for r in rows] if any(r.round_log is not None for r in rows) else None
        return Generation(new, text, stats, logprobs, rounds)


def _only(proposal: Proposal, rows: list[bool]) -> Proposal:
    """A chain proposal whose rows not in `rows` have no drafts (a plain step for them in the same pass)."""
    keep = torch.tensor(rows, device=proposal.valid.device)[:, None]                  # (B, 1)
    host = proposal.host and (proposal.host[0], [w if r else 0 for w, r in zip(proposal.host[1], rows)])
    return Proposal(proposal.tokens, proposal.q, proposal.valid & keep, None, host)


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
