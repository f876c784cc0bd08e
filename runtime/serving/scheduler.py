"""The scheduler: one thread owns the engines and runs a batch (decoding.Batch) round after round. A request's
sequences (a Job) join the running batch at the next round boundary when rows are free and its options match the
batch's, and leave it when they finish, when the request has gone or when its time is up; a joining request's prompt
is prefilled in chunks, one chunk between two rounds of the running batch (chunked prefill). A round that fails
answers its requests with the error and the next batch starts afresh; a prefill pass that fails answers its own
request alone. A failure of the thread outside any request's work kills it: every request running, waiting or still
to come is then answered with a 503 that names the cause (`Scheduler.dead`)."""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specrt.decoding.generate import AUTO, MAX_MEASURED_BATCH, Batch, Detokenizer, Generator
from specrt.errors import InputError
from specrt.serving.metrics import Metrics
from specrt.serving.protocol import APIError

log = logging.getLogger("specrt.serving.scheduler")


def shutting_down() -> APIError:
    return APIError(503, "the server is shutting down: this request was not finished; send it again to a running "
                         "server", code="server_shutting_down")


@dataclass(eq=False)
class Job:
    """One request's sequences in the scheduler. Its events, through `put`: ("tokens", index, ids, text, logprobs,
    rounds) as rounds add tokens (their TokenLogprobs, or None when the request asked for none; the rounds that made
    them as dicts with each token's text, or None when the request asked for none), ("end", index, stop reason,
    text, stats) when sequence `index` ends (the text a split character held back), or an exception. A sequence that
    emits one of its `stop_token_ids` ends there: that token is its last (its text is not in the text), the tokens
    the round added after it are dropped, its stop reason is "stop_token"."""
    ids: list[int]
    options: dict                      # generate()'s keyword arguments, and the request's stop_token_ids
    copies: int
    put: Callable
    gone: threading.Event = field(default_factory=threading.Event)   # the request has ended: free its rows
    texts: list = field(default_factory=list)
    arrived: float = 0.0               # when the scheduler got it (time.perf_counter())
    deadline: float = float("inf")     # when its time is up (--request-timeout), on the same clock
    latency: list = field(default_factory=list)   # a Latency per sequence
    stopped: set = field(default_factory=set)      # the sequences that a stop token has ended

    def stop_token(self, ids: list[int]) -> int | None:
        """Where the first of the request's stop tokens is in `ids`, if any."""
        stops = self.options.get("stop_token_ids")
        return next((k for k, t in enumerate(ids) if t in stops), None) if stops else None

    @property
    def key(self):
        """Requests that can share a batch: the same method and speculation options and the same sampling (greedy
        ignores top-k, top-p and min-p). Seeded requests batch with seeded ones: each row samples by its own seed's
        noise (Batch.join), the same tokens whatever its neighbours; with typical acceptance (lossy, its rounds
        depend on the drafts) a seeded request runs in a batch of its own. Penalties, logit_bias, logprobs and grammars are each row's own; but `auto` may run another method for
        requests with a grammar (Generator.method_for), so under `auto` those batch apart from those without."""
        o = self.options
        sampling = (0.0,) if o["temperature"] == 0 else (o["temperature"], o["top_k"], o["top_p"], o.get("min_p", 0.0),
                                                         o["acceptance"])
        if o["seed"] is not None and o["temperature"] > 0:
            sampling = (*sampling, "seeded") if o["acceptance"] == "exact" else (self,)
        method = (o["method"], o.get("grammar") is not None) if o["method"] == AUTO else o["method"]
        return (method, o["gamma"], o["tree"], o["adaptive"], *sampling)


@dataclass
class Latency:
    """When a sequence's tokens were handed out: time to the first, and the gaps between hand-outs."""
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    max_gap: float = 0.0

    def handed(self, now: float, n: int) -> None:
        if self.first is None:
            self.first = now
        else:
            self.max_gap = max(self.max_gap, now - self.last)
        self.last, self.tokens = now, self.tokens + n

    def stats(self, arrived: float) -> dict:
        """ttft_s (from its arrival at the scheduler); the inter-token latency after the first token: its mean
        per token and the largest gap between two hand-outs."""
        more = self.tokens > 1 and self.last > self.first
        return {"ttft_s": None if self.first is None else self.first - arrived,
                "itl_mean_s": (self.last - self.first) / (self.tokens - 1) if more else None,
                "itl_max_s": self.max_gap if more else None}


class Scheduler:
    """The one thread that touches the engines: admits waiting jobs into the running batch at round boundaries,
    runs one prefill chunk of the oldest joining job and one round of the live rows in turn, hands each job its
    new tokens and retires finished rows."""

    def __init__(self, gen: Generator, capacity: int, measure: bool = False, metrics: Metrics | None = None,
                 max_waiting: int | None = None, timeout: float | None = None):
        self.gen, self.capacity, self.measure = gen, capacity, measure
        self.max_waiting, self.timeout = max_waiting, timeout
        self.metrics = metrics or Metrics("", lambda: len(self.waiting))
        self.waiting: collections.deque[Job] = collections.deque()
        self.ready = threading.Condition()
        self.batch: Batch | None = None
        self.key = None                      # the options of the running batch, or of the next one to make
        self.deadline: float | None = None   # stopping: when the requests still running end (time.monotonic())
        self.stopped = False
        self.died: Exception | None = None   # why the thread has died (see _loop)
        self.thread = threading.Thread(target=self._loop, name="specrt-batch", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if job.copies > self.capacity:   # it could never join: it would hold up every request behind it
            raise InputError(f"{job.copies} sequences in one request: the batch holds {self.capacity}")
        with self.ready:
            if self.died is not None:
                raise self.dead()
            if self.stopped:
                job.put(shutting_down())
                return
            if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
                raise APIError(429, f"{len(self.waiting)} requests are waiting for a row already (--max-waiting "
                                    f"{self.max_waiting}): send it again later", code="too_many_requests")
            job.arrived = time.perf_counter()
            if self.timeout is not None:
                job.deadline = job.arrived + self.timeout
            self.waiting.append(job)
            self.ready.notify()

    def stop(self, grace: float) -> None:
        """Shut down: the requests running or waiting get `grace` seconds to finish, then end with an error; the
        thread ends once none is left."""
        with self.ready:
            deadline = time.monotonic() + grace
            self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)
            self.ready.notify()

    def close(self) -> None:
        self.stop(0)
        self.thread.join(timeout=30)

    @property
    def live(self) -> int:
        return self.batch.run.batch if self.batch is not None else 0

    @property
    def taken(self) -> int:
        """The batch's rows that are live or held by joining jobs."""
        return self.batch.taken if self.batch is not None else 0

    def kv_usage(self) -> tuple[int, int, int, int]:
        """The static KV cache in use now (read by /metrics off this thread, a round's figures at most apart): rows
        taken, rows, positions holding tokens (the live rows' and the prefilled part of the joining ones'),
        positions."""
        batch = self.batch
        if batch is None:
            return 0, self.capacity, 0, self.capacity * self.gen.max_len
        run = batch.run
        used = int(run.host_lengths[:run.batch].sum()) + sum(j.done for j in list(batch.joining))
        return batch.taken, run.capacity, used, run.capacity * run.cache_len

    def dead(self) -> APIError | None:
        """The 503 that every request gets once the thread has died (None while it runs)."""
        e = self.died
        if e is None:
            return None
        return APIError(503, f"the server's scheduler has died ({type(e).__name__}: {e}): no request can be served "
                             "until the server restarts (its log has the traceback)", code="scheduler_died")

    def _loop(self) -> None:
        """The thread. A failure outside any request's work kills it: every request running or waiting, and every
        one that comes, is answered with a 503 that names the cause (`dead`)."""
        try:
            self._serve()
        except Exception as e:   # noqa: BLE001 -- answered to every request; /health fails: restart the process
            log.critical("the scheduler has died: no request can be served until the server restarts",
                         exc_info=True)
            with self.ready:
                self.died = e
                self._end_all(self.dead())

    def _serve(self) -> None:
        torch.set_num_threads(1)   # the loop's own tensors are small (the engines keep their thread pools)
        # the target's pass times at the batch sizes speculation follows, before the first request, not in the middle
        # of its rounds: every size where the default method speculates, else the smallest and the largest (a request
        # asking for a method that speculates takes the sizes between on the line through them); a tuning's sizes
        # are not timed again (a tuning of 1, 2, 4 and 8 rows, a batch of 16: the sizes 9 to 16 took 0.7-1.1 s each
        # in the rounds where the batch first reached them)
        top = min(self.capacity, MAX_MEASURED_BATCH)
        sizes = [n for n in (range(1, top + 1) if self.measure else sorted({1, top})) if not self.gen.timed(n)]
        if sizes:
            log.info("timing target passes at batch sizes %s (speculation follows them)",
                     ", ".join(map(str, sizes)))
        for n in sizes:
            self.gen.costs(n, draft=False)   # a draft request times the draft's step itself
        while True:
            self.metrics.running.set(self.taken)
            with self.ready:
                while self.deadline is None and not self.waiting and not self.taken:
                    self.ready.wait()
                if self.deadline is not None and (time.monotonic() >= self.deadline or
                                                  not self.waiting and not self.taken):
                    self._end_all(shutting_down())
                    return
                admit = self._admissible()
                self._expire()
            try:
                for job in admit:
                    self._admit(job)
                self._prefill()
                if self.live:
                    self.batch.step()
                    self._dispatch()
            except Exception as e:   # noqa: BLE001 -- every request of the batch gets it; the server goes on
                log.exception("a round failed; its requests are answered with the error")
                self._fail(e)

    def _prefill(self) -> None:
        """The next prefill pass of the oldest joining job; after its last pass its rows take their first tokens.
        A pass that fails before its rows join answers that job alone: it leaves the queue, and its row, which no
        round reads, is free again."""
        batch = self.batch
        if batch is None or not batch.joining:
            return
        joining, rows = batch.joining[0], len(batch.run.rows)
        try:
            out = batch.prefill()
        except Exception as e:   # noqa: BLE001 -- answered to its request; the rows that ran go on
            if len(batch.run.rows) != rows:   # it failed while its rows joined: the batch's state is in doubt
                raise
            log.exception("a prefill failed; its request is answered with the error")
            batch.joining.remove(joining)
            joining.owners[0][0].put(e)
            return
        if out is not None:   # its first tokens now
            self._dispatch()

    def _admissible(self) -> list[Job]:
        """Waiting jobs that join now: from the oldest, while they match the batch and fit. Once a batch has
        drained (or failed), the oldest waiting job's options decide the next (the same batch when they match)."""
        if not self.taken and self.waiting and self.waiting[0].key != self.key:
            self.batch, self.key = None, None
        admit, free = [], self.capacity - self.taken
        while self.waiting and self.waiting[0].copies <= free and self.key in (None, self.waiting[0].key):
            job = self.waiting.popleft()
            if job.gone.is_set():
                continue
            self.key, free = job.key, free - job.copies
            admit.append(job)
        return admit

    def _expire(self) -> None:
        """--request-timeout: the rows of requests whose time is up stop now (their answers end with finish reason
        "length"); requests whose time is up before their first token (waiting, or prefilling) get an error."""
        if self.timeout is None:
            return
        now = time.perf_counter()
        late = [job for job in self.waiting if job.deadline <= now]
        if self.batch is not None:
            late += [j.owners[0][0] for j in self.batch.joining if j.owners[0][0].deadline <= now]
            self.batch.cancel(lambda owner: owner[0].deadline <= now, reason="time_limit")
        for job in late:
            if job in self.waiting:
                self.waiting.remove(job)
            job.put(APIError(503, f"no token within the server's time limit of {self.timeout:g} s a request "
                                  "(--request-timeout): it is busy; send it again later", code="timeout"))

    def _admit(self, job: Job) -> None:
        """The job queues to join the batch (a new one if none runs); its prefill passes come between rounds. A
        request the batch refuses is answered with the error (an InputError is a 400) and leaves nothing behind."""
        o = job.options
        try:
            if self.batch is None:
                self.batch = self.gen.batch(self.capacity, method=o["method"], temperature=o["temperature"],
                                            top_k=o["top_k"], top_p=o["top_p"], seed=o["seed"], gamma=o["gamma"],
                                            tree=o["tree"], adaptive=o["adaptive"], acceptance=o["acceptance"],
                                            min_p=o.get("min_p", 0.0), constrained=o.get("grammar") is not None)
            job.texts = [Detokenizer(self.gen.tokenizer) for _ in range(job.copies)]
            job.latency = [Latency() for _ in range(job.copies)]
            self.batch.join(job.ids, o["max_new_tokens"], owner=[(job, i) for i in range(job.copies)],
                            copies=job.copies, logprobs=o.get("logprobs"), penalties=o.get("penalties"),
                            grammar=o.get("grammar"), rounds=o.get("rounds", False),
                            partition=o.get("cache_partition"), seed=o["seed"])
            self.metrics.admitted(self.batch.method, len(job.ids), time.perf_counter() - job.arrived)
        except Exception as e:   # noqa: BLE001 -- answered to the request
            job.put(e)

    def _fail(self, e: Exception) -> None:
        """A round failed: every request of the batch is answered with a 500 that names the error's type only (its
        message may carry one request's text: the log has it), its rows are let go; the next batch is made afresh
        (for the waiting requests, or for the rest of this round's admissions). `e` itself when the server ends
        them all."""
        if not isinstance(e, APIError) or e.status != 503:
            e = APIError(500, f"a round of the batch this request was decoded in failed ({type(e).__name__}; the "
                              "server's log has the details): send it again", code="round_failed")
        if self.batch is not None:
            joining = [o for j in self.batch.joining for o in j.owners]
            for job in {owner[0] for owner in [row.owner for row in self.batch.run.rows] + joining}:
                job.put(e)
        self.batch = None

    def _end_all(self, e: APIError) -> None:
        """Stopped (or dead): the requests still waiting or running end with the error `e`."""
        self.stopped = True
        while self.waiting:
            self.waiting.popleft().put(e)
        self._fail(e)

    def _dispatch(self) -> None:
        """New tokens to their jobs; rows of jobs that have gone, or that a stop token ended, are cancelled;
        finished rows retired."""
        batch = self.batch
        if batch is None:
            return
        run, now = batch.run, time.perf_counter()
        failed: set[Job] = set()   # requests whose own work here failed: answered with the error, their rows freed
        for row in run.rows:   # a row whose grammar matcher failed: its request alone gets the matcher's error
            if row.stop_reason == "grammar_error" and row.owner[0] not in failed:
                failed.add(row.owner[0])
                row.owner[0].put(row.matcher.error)
        for b, row in enumerate(run.rows):
            ids = run.new_tokens(b)
            if ids and row.owner[0] not in failed:
                self._isolated(failed, row.owner[0], "handing a sequence its tokens", self._hand_out, batch, row, ids,
                               now)
        batch.cancel(lambda owner: owner[1] in owner[0].stopped, reason="stop_token")
        batch.cancel(lambda owner: owner[0].gone.is_set() or owner[0] in failed)
        for row, tokens in batch.retire():
            if row.owner[0] not in failed:   # (its row has left the batch already)
                self._isolated(failed, row.owner[0], "ending a sequence", self._end, batch, row, tokens)

    @staticmethod
    def _isolated(failed: set[Job], job: Job, what: str, work: Callable, *args) -> None:
        """One sequence's work; if it fails, its request alone is answered with the error (and joins `failed`):
        the other rows go on."""
        try:
            work(*args)
        except Exception as e:   # noqa: BLE001
            log.exception("%s failed; its request is answered with the error", what)
            failed.add(job)
            job.put(e)

    def _hand_out(self, batch: Batch, row, ids: list[int], now: float) -> None:
        job, index = row.owner
        if index in job.stopped:
            return
        latency = job.latency[index]
        first, sent = latency.first is None, latency.tokens
        text = ids
        if (cut := job.stop_token(ids)) is not None:   # the stop token is its last; its text is not shown
            ids, text = ids[:cut + 1], ids[:cut]
            job.stopped.add(index)
        self.metrics.handed(batch.method, len(ids), now - job.arrived if first else None,
                            None if first else now - latency.last)
        latency.handed(now, len(ids))
        logprobs = row.logprobs[sent:sent + len(ids)] if row.logprobs_top is not None else None
        if row.round_log is None:
            job.put(("tokens", index, ids, job.texts[index].feed(text), logprobs, None))
            return
        pieces = [job.texts[index].feed([t]) if k < len(text) else "" for k, t in enumerate(ids)]
        rounds, rest = [], ids
        for r in row.round_log[row.rounds_sent:]:   # the rounds that made these tokens (a stop token cuts them)
            r, rest = r.cut(len(rest)), rest[len(r.tokens):]
            texts, pieces = pieces[:len(r.tokens)], pieces[len(r.tokens):]
            rounds.append({"tokens": r.tokens, "text": texts, "drafted": r.drafted, "accepted": r.accepted,
                           "forced": r.forced, "corrected": r.corrected})
        row.rounds_sent = len(row.round_log)
        job.put(("tokens", index, ids, "".join(t for r in rounds for t in r["text"]), logprobs, rounds))

    def _end(self, batch: Batch, row, tokens: list[int]) -> None:
        job, index = row.owner
        if row.stop_reason == "cancelled":
            log.info("generation stopped after %d tokens: the request has ended (client gone or a stop "
                     "string)", len(tokens))
        elif row.stop_reason == "time_limit":
            log.info("generation stopped after %d tokens: the request's time is up (--request-timeout %g s)",
                     len(tokens), self.timeout)
        reason = row.stop_reason
        if index in job.stopped:   # a stop token came (the round may have ended the row for another reason too)
            tokens, reason = tokens[:job.latency[index].tokens], "stop_token"
        stats = {**batch.row_stats(row, len(tokens)), "stop_reason": reason, "batch_rounds": batch.batch_rounds(),
                 **job.latency[index].stats(job.arrived)}
        self.metrics.ended(batch.method, stats, time.perf_counter() - job.arrived)
        job.put(("end", index, reason, job.texts[index].feed([], final=True), stats))

