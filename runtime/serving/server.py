"""An OpenAI-compatible HTTP API over one Generator: `specrt serve ENGINES`.

Requests are decoded together (continuous batching): one scheduler thread owns the engines and runs a batch
(generate.Batch) round after round; a request that arrives joins the running batch at the next round boundary
when a row is free and its options match the batch's (method and sampling; a greedy request matches any greedy
batch of its method), and leaves it when it finishes, when its client has gone or when a stop string came. A
joining request's prompt is prefilled in chunks (--prefill-chunk tokens), one chunk between two rounds of the
running batch, so that a long prompt does not stall the streams already running (chunked prefill). A
request that does not match waits until the batch has drained. The handlers are async: they tokenize on a
thread of their own and wait for the scheduler's events. A round that fails answers its requests with the error
(a stream: an error chunk, then [DONE]) and the next batch starts afresh; a prefill pass that fails answers its own
request alone. A failure of the scheduler thread outside any request's work (timing the passes at start-up, the top
of its loop) kills it: every request running, waiting or still to come is then answered with a 503 that names the
cause, and /health fails (503), so that a supervisor (or Ray Serve's health check) restarts the process. On SIGTERM
(or Ctrl-C) the running requests get SHUTDOWN_GRACE_S seconds to finish, then end with an error. Limits (an API key,
a bound on waiting requests, a time limit per request, a body size limit) and Prometheus metrics (/metrics,
specrt.serving.metrics) are the app's; specrt.serving.replicas runs it in Ray Serve replicas.
"""
from __future__ import annotations

import asyncio
import collections
import copy
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
import torch
import uvicorn
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from specrt.errors import InputError, SpecrtError
from specrt.decoding.datastore import SuffixCache
from specrt.decoding.generate import AUTO, MAX_MEASURED_BATCH, METHODS, PREFILL_CHUNK, Batch, Detokenizer, Generator
from specrt.decoding.run import MODEL_FREE
from specrt.decoding.sampling import ACCEPTANCE, SamplingParams
from specrt.serving.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger("specrt.serving.server")

SHUTDOWN_GRACE_S = 5.0   # after SIGTERM or Ctrl-C, how long the running requests may still take

# ---- the request schema (OpenAI's fields that specrt serves; other fields are ignored) -----------------------------


class SpecrtOptions(BaseModel):
    """The `specrt` extension field of a request: how to speculate (generate()'s keyword arguments)."""
    model_config = ConfigDict(extra="forbid")
    method: Literal[(AUTO, *METHODS)] | None = None  # default: the server's --method
    top_k: int = Field(0, ge=0)
    gamma: int | None = Field(None, ge=1, le=64)
    tree: bool = False
    adaptive: bool = True
    acceptance: Literal[ACCEPTANCE] = "exact"  # typical: Medusa's typical acceptance, NOT the target's distribution


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)   # OpenAI's default 1.0; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1, max_length=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    specrt: SpecrtOptions = Field(default_factory=SpecrtOptions)


class CompletionRequest(_Request):
    prompt: str | list[int]                         # text (no chat template) or token ids
    max_tokens: int | None = Field(16, ge=1)        # OpenAI's default for completions


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: str
    content: str | list[TextPart] | None = None


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error object: every answer that is not a 200."""
    error: ErrorDetail


ERRORS = {   # the statuses the API answers besides 200 (the OpenAPI document lists them)
    400: "Bad input: malformed JSON, a field's value, an unknown method, a prompt that does not fit.",
    401: "No valid API key (the server runs with --api-key).",
    404: "An unknown model.",
    413: "A body larger than --max-body-bytes.",
    429: "More requests waiting for a row than --max-waiting.",
    500: "The request failed in the engines (the server keeps serving).",
    503: "The server is shutting down, gave no token within --request-timeout, or its scheduler has died (it must be "
         "restarted).",
}


def _errors(*statuses: int) -> dict:
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}


class APIError(Exception):
    """An answer in OpenAI's error format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(_error(self.message, self.param, self.code, self.status), status_code=self.status)


def _error(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _answer(e: Exception) -> APIError:
    """Any exception as the error a client gets: an InputError is a 400, anything else a 500 that names it."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InputError):
        return APIError(400, str(e))
    if isinstance(e, SpecrtError):
        return APIError(500, str(e))
    return APIError(500, f"the server failed on this request: {type(e).__name__}: {e} (its log has the details)")


# ---- text with stop strings ----------------------------------------------------------------------------------------


class StopText:
    """Text as it grows, cut at the first stop string; holds back a tail that could begin one."""

    def __init__(self, stops: list[str]):
        self.stops, self.text, self.sent = stops, "", 0

    def feed(self, new: str) -> tuple[str, bool]:
        """The text that is safe to send now, and whether a stop string has come (the text ends before it)."""
        self.text += new
        cut = min((i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0),
                  default=None)
        if cut is not None:
            out, self.sent = self.text[self.sent:cut], cut
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        end = max(self.sent, len(self.text) - hold)
        out, self.sent = self.text[self.sent:end], end
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


def _finish(stop_reason: str | None) -> str:
    return "stop" if stop_reason == "eos" else "length"


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down: this request was not finished; send it again to a running "
                         "server", code="server_shutting_down")


# ---- the scheduler -------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Job:
    """One request's sequences in the scheduler. Its events, through `put`: ("tokens", index, ids, text) as rounds
    add tokens, ("end", index, stop reason, text, stats) when sequence `index` ends (the text a split character
    held back), or an exception."""
    ids: list[int]
    options: dict                      # generate()'s keyword arguments
    copies: int
    put: Callable
    gone: threading.Event = field(default_factory=threading.Event)   # the request has ended: free its rows
    texts: list = field(default_factory=list)
    arrived: float = 0.0               # when the scheduler got it (time.perf_counter())
    deadline: float = float("inf")     # when its time is up (--request-timeout), on the same clock
    latency: list = field(default_factory=list)   # a Latency per sequence

    @property
    def key(self):
        """Requests that can share a batch: the same method and speculation options and the same sampling (greedy
        ignores top-k and top-p). A seeded request runs in a batch of its own, so that its seed reproduces it."""
        o = self.options
        sampling = (0.0,) if o["temperature"] == 0 else (o["temperature"], o["top_k"], o["top_p"], o["acceptance"])
        if o["seed"] is not None:
            sampling = (self,)
        return (o["method"], o["gamma"], o["tree"], o["adaptive"], *sampling)


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
                job.put(_shutting_down())
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
        if self.measure:   # before the first request, not in the middle of its rounds
            sizes = range(1, min(self.capacity, MAX_MEASURED_BATCH) + 1)
            log.info("timing target passes at batch sizes 1 to %d (speculation follows them)", sizes[-1])
            for n in sizes:
                self.gen.costs(n, draft=False)   # a draft request times the draft's step itself
        while True:
            self.metrics.running.set(self.taken)
            with self.ready:
                while self.deadline is None and not self.waiting and not self.taken:
                    self.ready.wait()
                if self.deadline is not None and (time.monotonic() >= self.deadline or
                                                  not self.waiting and not self.taken):
                    self._end_all(_shutting_down())
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
                                            tree=o["tree"], adaptive=o["adaptive"], acceptance=o["acceptance"])
            job.texts = [Detokenizer(self.gen.tokenizer) for _ in range(job.copies)]
            job.latency = [Latency() for _ in range(job.copies)]
            self.batch.join(job.ids, o["max_new_tokens"], owner=[(job, i) for i in range(job.copies)],
                            copies=job.copies)
            self.metrics.admitted(self.batch.method, len(job.ids), time.perf_counter() - job.arrived)
        except Exception as e:   # noqa: BLE001 -- answered to the request
            job.put(e)

    def _fail(self, e: Exception) -> None:
        """A round failed: every request of the batch is answered with the error, its rows are let go; the next
        batch is made afresh (for the waiting requests, or for the rest of this round's admissions)."""
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
        """New tokens to their jobs; rows of jobs that have gone are cancelled; finished rows retired."""
        batch = self.batch
        if batch is None:
            return
        run, now = batch.run, time.perf_counter()
        failed: set[Job] = set()   # requests whose own work here failed: answered with the error, their rows freed
        for b, row in enumerate(run.rows):
            ids = run.new_tokens(b)
            if ids and row.owner[0] not in failed:
                self._isolated(failed, row.owner[0], "handing a sequence its tokens", self._hand_out, batch, row, ids,
                               now)
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
        latency = job.latency[index]
        first = latency.first is None
        self.metrics.handed(batch.method, len(ids), now - job.arrived if first else None,
                            None if first else now - latency.last)
        latency.handed(now, len(ids))
        job.put(("tokens", index, ids, job.texts[index].feed(ids)))

    def _end(self, batch: Batch, row, tokens: list[int]) -> None:
        job, index = row.owner
        if row.stop_reason == "cancelled":
            log.info("generation stopped after %d tokens: the request has ended (client gone or a stop "
                     "string)", len(tokens))
        elif row.stop_reason == "time_limit":
            log.info("generation stopped after %d tokens: the request's time is up (--request-timeout %g s)",
                     len(tokens), self.timeout)
        stats = {**batch.row_stats(row, len(tokens)), "batch_rounds": batch.batch_rounds(),
                 **job.latency[index].stats(job.arrived)}
        self.metrics.ended(batch.method, stats, time.perf_counter() - job.arrived)
        job.put(("end", index, row.stop_reason, job.texts[index].feed([], final=True), stats))


# ---- the server ----------------------------------------------------------------------------------------------------


class Server:
    """One generator, its scheduler, the answers."""

    def __init__(self, gen: Generator, model_name: str, method: str = AUTO, max_batch: int = 8,
                 max_waiting: int | None = None, request_timeout: float | None = None):
        self.gen, self.model_name = gen, model_name
        self.methods = [AUTO] + [m for m in METHODS if m in MODEL_FREE or gen.has(m)]
        if method not in self.methods:
            raise InputError(f"method {method!r}: {gen.directory} serves {', '.join(self.methods)}")
        if max_batch < 1:
            raise InputError(f"max batch {max_batch}: must be at least 1")
        self.method = method
        greedy = gen.method_for(method, greedy=True)[0]   # what the default runs for greedy requests
        if gen.has(greedy):   # its drafter now (its load errors too), the others at first use
            getattr(gen, greedy)
        self.max_len = gen.max_len
        # the most characters a prompt that fits can have: every token covers at most the longest token's
        self.token_chars = max(map(len, gen.tokenizer.get_vocab())) if gen.tokenizer is not None else None
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="specrt-tokenize")
        self.metrics = Metrics(model_name, lambda: len(self.scheduler.waiting))
        self.scheduler = Scheduler(gen, max_batch, measure=greedy != "autoregressive", metrics=self.metrics,
                                   max_waiting=max_waiting, timeout=request_timeout)

    async def call(self, fn: Callable, *args):
        """fn(*args) on the tokenizing thread (tokenizers are not shared between threads)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    def close(self) -> None:
        self.scheduler.close()
        self.tokenizing.shutdown(wait=False, cancel_futures=True)

    # ---- requests --------------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist: this server serves {self.model_name!r}", "model",
                           "model_not_found")

    def check_chars(self, chars: int, param: str) -> None:
        """A text that cannot fit the model's sequence length even in the tokenizer's longest tokens is refused
        before it is tokenized (the one tokenizer thread is not held up by a huge prompt)."""
        if self.token_chars is not None and chars > self.max_len * self.token_chars:
            raise APIError(400, f"{param}: {chars} characters do not fit the model's maximum sequence length "
                                f"{self.max_len} (at most {self.max_len * self.token_chars} characters: "
                                f"{self.token_chars} a token at the most): shorten it", param,
                           "context_length_exceeded")

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.gen.tokenizer is None:
                raise APIError(400, f"prompt: {self.model_name} has no tokenizer: send the prompt as a list of "
                                    "token ids", "prompt")
            return self.gen.encode(prompt, chat=False)
        vocab = self.gen.target.spec["vocab_size"]
        bad = [i for i in prompt if not 0 <= i < vocab]
        if not prompt or bad:
            raise APIError(400, f"prompt: token ids {bad[:5] or prompt}: need at least one id, each in [0, {vocab})",
                           "prompt")
        return prompt

    def chat_ids(self, messages: list[Message]) -> list[int]:
        tok = self.gen.tokenizer
        if tok is None or not tok.chat_template:
            raise APIError(400, f"messages: {self.model_name} has no chat template: use /v1/completions with the "
                                "prompt as text or token ids", "messages")
        turns = [{"role": m.role, "content": m.content if not isinstance(m.content, list) else
                  "".join(p.text for p in m.content)} for m in messages]
        try:
            ids = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
        except jinja2.TemplateError as e:
            raise APIError(400, f"messages: the model's chat template refused them: {e}", "messages") from e
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def options(self, req: _Request, ids: list[int], param: str, max_tokens: int | None) -> dict:
        """generate()'s keyword arguments for a request whose prompt is `ids`."""
        if not ids:
            raise APIError(400, f"{param}: empty: it gives no token to start from; send some text", param)
        if len(ids) >= self.max_len:
            raise APIError(400, f"{param}: {len(ids)} tokens do not fit the model's maximum sequence length "
                                f"{self.max_len} (with room for one new token): shorten it", param,
                           "context_length_exceeded")
        method = req.specrt.method or self.method
        if method not in self.methods:
            raise APIError(400, f"specrt.method {method!r}: {self.model_name} serves {', '.join(self.methods)}",
                           "specrt.method")
        if req.n > 1 and req.stream:
            raise APIError(400, f"n {req.n}: a stream gives one choice; ask for n=1 or stream=false", "n")
        if req.n > self.scheduler.capacity:
            raise APIError(400, f"n {req.n}: this server decodes at most {self.scheduler.capacity} sequences at once "
                                f"(--max-batch {self.scheduler.capacity}): ask for n <= {self.scheduler.capacity} in "
                                "each request, or serve with a larger --max-batch", "n")
        temperature = 1.0 if req.temperature is None else req.temperature
        try:
            SamplingParams(temperature)   # what the schema cannot say: too small to divide by
        except InputError as e:
            raise APIError(400, str(e), "temperature") from e
        return dict(max_new_tokens=max_tokens or self.max_len - len(ids), temperature=temperature,
                    top_p=1.0 if req.top_p is None else req.top_p, top_k=req.specrt.top_k, seed=req.seed,
                    method=method, gamma=req.specrt.gamma, tree=req.specrt.tree,
                    adaptive=req.specrt.adaptive, acceptance=req.specrt.acceptance)

    # ---- generation ------------------------------------------------------------------------------------------
    async def events(self, ids: list[int], options: dict, copies: int) -> AsyncIterator[tuple]:
        """The scheduler's events for one request, until all its sequences have ended. Leaving early (client gone,
        stop string) frees its rows at the next round."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def put(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:   # the event loop has closed: nobody is listening
                pass

        job = Job(ids, options, copies, put)
        self.scheduler.submit(job)
        ended = 0
        try:
            while ended < copies:
                event = await queue.get()
                if isinstance(event, Exception):
                    raise _answer(event)   # the scheduler has logged where it came from
                ended += event[0] == "end"
                yield event
        finally:
            job.gone.set()

    def method_run(self, options: dict) -> str:
        """The method a request runs (`auto` resolved as its batch resolves it)."""
        return self.gen.method_for(options["method"], greedy=options["temperature"] == 0)[0]

    async def pieces(self, ids: list[int], options: dict, stops: list[str]) -> AsyncIterator[tuple]:
        """One sequence as the rounds produce it: (text, token ids, finish reason or None, stats or None). Its
        finish reason is counted (abort: left before its end)."""
        text, events, end = StopText(stops), self.events(ids, options, 1), "abort"
        try:
            async for kind, _, *rest in events:
                if kind == "tokens":
                    new_ids, new = rest
                    new, stopped = text.feed(new or "")
                    end = "stop" if stopped else end
                    yield new, new_ids, "stop" if stopped else None, None
                    if stopped:
                        return
                else:
                    reason, tail, stats = rest
                    new, stopped = text.feed(tail or "")
                    end = "stop" if stopped else _finish(reason)
                    yield (new if stopped else new + text.flush()), [], end, stats
                    return
        except Exception as e:
            end = "error" if _answer(e).status >= 500 else None   # a refused request (400, 429) never ran
            raise
        finally:
            if end is not None:
                self.metrics.finish(self.method_run(options), end)
            await events.aclose()

    async def answer(self, req: _Request, ids: list[int], options: dict, chat: bool):
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_name}
        if req.n > 1:
            texts, tokens, ends = [[] for _ in range(req.n)], [[] for _ in range(req.n)], {}
            async for kind, i, *rest in self.events(ids, options, req.n):
                if kind == "tokens":
                    tokens[i] += rest[0]
                    texts[i].append(rest[1] or "")
                else:
                    texts[i].append(rest[1] or "")
                    ends[i] = (rest[0], rest[2])
            choices = []
            for i in range(req.n):
                text = StopText(stops)
                cut, stopped = text.feed("".join(texts[i]))
                reason = "stop" if stopped else _finish(ends[i][0])
                self.metrics.finish(ends[i][1]["method"], reason)
                choices.append(_choice(chat, i, cut if stopped else cut + text.flush(), tokens[i], reason))
            return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                    "usage": _usage(ids, sum(map(len, tokens))),
                    "specrt": {key: ends[0][1][key] for key in ("method", "acceptance", "distribution_preserving")}
                    | {"choices": [ends[i][1] for i in range(req.n)]}}
        pieces = self.pieces(ids, options, stops)
        first = await anext(pieces)    # the prefill's: errors are answered before the stream starts
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(_events(first, pieces, head, chat, ids, usage), media_type="text/event-stream")
        texts, tokens, reason, stats = [first[0]], list(first[1]), first[2], first[3]
        if reason is None:
            async for text, new, reason, stats in pieces:
                texts.append(text)
                tokens += new
        choice = _choice(chat, 0, "".join(texts), tokens, reason)
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": _usage(ids, len(tokens)), "specrt": stats}


def _choice(chat: bool, index: int, text: str | None, token_ids: list[int], reason: str | None,
            delta: bool = False) -> dict:
    if not chat:
        body = {"text": text or ""}
    elif delta:
        body = {"delta": {"content": text} if text is not None else {}}
    else:
        body = {"message": {"role": "assistant", "content": text or ""}}
    return {"index": index, **body, "logprobs": None, "finish_reason": reason, "token_ids": token_ids}


def _param(loc: tuple) -> str | None:
    """The field a validation error is about, as OpenAI names it: `messages[0].content` (no union branch names)."""
    param = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool"):
            param += f".{part}" if param else part
        else:
            break
    return param or None


def _usage(ids: list[int], completion: int) -> dict:
    return {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion}


async def _events(first: tuple, pieces: AsyncIterator, head: dict, chat: bool, ids: list[int],
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format: the pieces, a last chunk with the finish reason, the usage
    chunk when asked, then [DONE]."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    def event(choices: list, usage: dict | None = None, stats: dict | None = None) -> str:
        body = {**head, "choices": choices, **({"usage": usage} if include_usage else {}),
                **({"specrt": stats} if stats else {})}
        return f"data: {json.dumps(body)}\n\n"

    if chat:
        yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None, "token_ids": []}])
    count = 0
    try:
        piece = first
        while True:
            text, tokens, reason, stats = piece
            count += len(tokens)
            if text or tokens:
                yield event([_choice(chat, 0, text, tokens, None, delta=True)])
            if reason is not None:   # the last chunk carries the request's figures (a stop string's: none)
                yield event([_choice(chat, 0, None if chat else "", [], reason, delta=True)], stats=stats)
                break
            piece = await anext(pieces)
        if include_usage:
            yield event([], _usage(ids, count))
    except Exception as e:   # noqa: BLE001 -- any error ends the stream with an error chunk, then [DONE]
        e = _answer(e)
        yield f"data: {json.dumps(_error(e.message, e.param, e.code, e.status))}\n\n"
    finally:
        await pieces.aclose()
    yield "data: [DONE]\n\n"


# ---- the app -------------------------------------------------------------------------------------------------------

# a completion's answers: JSON, or server-sent events when streamed (each event's data: a chunk in OpenAI's format,
# an error object, or [DONE]); errors
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
ANSWERS = {200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}},
           **_errors(400, 401, 404, 413, 429, 500, 503)}

MAX_BODY_BYTES = 4 << 20   # a request body's default limit: a prompt that fits 8k tokens, with JSON's escapes


def _too_large(limit: int) -> str:
    return f"the request body is larger than {limit} bytes (--max-body-bytes): shorten it"


class Guard:
    """ASGI middleware in front of the app: the API key (`Authorization: Bearer KEY`, compared in constant time;
    every path but /health) and the request body's size limit (413), before anything reads the body."""

    def __init__(self, app, api_key: str | None = None, max_body: int = MAX_BODY_BYTES):
        self.app, self.max_body = app, max_body
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] != "/health" and \
                not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
            response = APIError(401, "no valid API key: send the server's key as `Authorization: Bearer KEY` (the "
                                     "openai client's api_key)", code="invalid_api_key").response()
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body:
            return await APIError(413, _too_large(self.max_body)).response()(scope, receive, send)
        read = 0

        async def limited():   # a body without Content-Length (chunked) is counted as it comes
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > self.max_body:
                raise HTTPException(413, _too_large(self.max_body))   # answered by the app's handler
            return message

        await self.app(scope, limited, send)


@dataclass(frozen=True)
class Limits:
    """Who may call and how much (`specrt serve`'s --api-key, --max-waiting, --request-timeout, --max-body-bytes)."""
    api_key: str | None = None          # requests must carry `Authorization: Bearer KEY` (all paths but /health)
    max_waiting: int | None = None      # requests waiting for a row beyond this get a 429 (None: no bound)
    request_timeout: float | None = None   # seconds from a request's arrival to its end (None: no limit)
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self):
        if self.max_waiting is not None and self.max_waiting < 1:
            raise InputError(f"max waiting {self.max_waiting}: must be at least 1 (or none: no bound)")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise InputError(f"request timeout {self.request_timeout}: must be more than 0 seconds")
        if self.max_body_bytes < 1:
            raise InputError(f"max body bytes {self.max_body_bytes}: must be at least 1")
        if self.api_key is not None and not self.api_key.strip():
            raise InputError("API key: empty; give a key, or leave --api-key and SPECRT_API_KEY unset")


def create_app(gen: Generator, model_name: str, method: str = AUTO, max_batch: int = 8,
               limits: Limits = Limits()) -> FastAPI:
    server = Server(gen, model_name, method, max_batch, limits.max_waiting, limits.request_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.close()

    app = FastAPI(title="specrt", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Guard, api_key=limits.api_key, max_body=limits.max_body_bytes)
    app.openapi = lambda: _openapi(app)

    @app.exception_handler(Exception)   # APIError, InputError (400), any other (500): an OpenAI error object
    @app.exception_handler(APIError)
    @app.exception_handler(SpecrtError)
    async def error(request: Request, e: Exception):
        return _answer(e).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        if errors[0]["type"] == "json_invalid":
            return APIError(400, f"malformed JSON body: {errors[0]['msg']} "
                                 f"({errors[0].get('ctx', {}).get('error', '')})", None, "invalid_json").response()
        param = _param(errors[0]["loc"])
        msgs = dict.fromkeys(err["msg"] for err in errors if _param(err["loc"]) == param)   # a union's branches
        return APIError(400, f"{param or 'body'}: {' or '.join(msgs)}", param).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(_error(message, status=e.status_code), status_code=e.status_code)

    @app.get("/health", responses=_errors(503))
    async def health():
        """Liveness: a 503 once the scheduler has died (restart the process)."""
        if (dead := server.scheduler.dead()) is not None:
            raise dead
        cache = server.gen.suffix_cache
        return {"status": "ok", "model": server.model_name, "batch": server.scheduler.live,
                "waiting": len(server.scheduler.waiting),
                **({"suffix_cache": {"outputs": cache.outputs, "tokens": cache.used, "bytes": cache.nbytes}}
                   if cache is not None else {})}

    @app.get("/metrics", response_class=PlainTextResponse, responses=_errors(401))
    async def metrics():
        """Prometheus' text format (see specrt.serving.metrics)."""
        return PlainTextResponse(server.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=_errors(401))
    async def models():
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": 0, "owned_by": "specrt",
            "specrt": {"methods": server.methods, "default_method": server.method, "max_seq_len": server.max_len}}]}

    @app.post("/v1/completions", responses=ANSWERS)
    async def completions(req: CompletionRequest):
        server.check_model(req.model)
        if isinstance(req.prompt, str):
            server.check_chars(len(req.prompt), "prompt")
        ids = await server.call(server.completion_ids, req.prompt)
        return await server.answer(req, ids, server.options(req, ids, "prompt", req.max_tokens), chat=False)

    @app.post("/v1/chat/completions", responses=ANSWERS)
    async def chat_completions(req: ChatRequest):
        server.check_model(req.model)
        server.check_chars(sum(len(m.role) + (len(m.content) if isinstance(m.content, str) else
                                              sum(len(p.text) for p in m.content or [])) for m in req.messages),
                           "messages")
        ids = await server.call(server.chat_ids, req.messages)
        return await server.answer(req, ids, server.options(req, ids, "messages",
                                                            req.max_completion_tokens or req.max_tokens), chat=True)

    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document without its 422 (a body that does not validate is a 400 here, OpenAI's way)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def load(engines: str | Path, device: str = "auto", threads: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
         datastore: str | Path | None = None, suffix_cache_mb: float | None = None) -> Generator:
    """The generator a server (or a replica) serves: the engine set, rest's datastore and the suffix cache."""
    gen = Generator.from_engines(engines, device=device, threads=threads, prefill_chunk=prefill_chunk,
                                 datastore=datastore)
    if suffix_cache_mb is not None:
        gen.suffix_cache = SuffixCache(suffix_cache_mb)
    return gen


def serve(engines: str | Path, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          method: str = AUTO, device: str = "auto", threads: int | None = None,
          max_batch: int = 8, prefill_chunk: int = PREFILL_CHUNK, limits: Limits = Limits(),
          datastore: str | Path | None = None, suffix_cache_mb: float | None = None) -> None:
    """Load ENGINES and serve them until SIGTERM or Ctrl-C (the running requests get SHUTDOWN_GRACE_S to finish).
    `datastore`: rest's (see Generator.use_datastore); `suffix_cache_mb`: suffix decoding's index of the finished
    outputs (see SuffixCache)."""
    gen = load(engines, device, threads, prefill_chunk, datastore, suffix_cache_mb)
    app = create_app(gen, model_name or Path(engines).resolve().name, method, max_batch, limits)
    logs = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    logs["loggers"]["specrt"] = {"handlers": ["default"], "level": "INFO"}
    # uvicorn's own limit, should a request not end when the scheduler ends it
    config = uvicorn.Config(app, host=host, port=port, log_config=logs, timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 5)
    _Uvicorn(config, app.state.server).run()


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, whose shutdown (it waits for the running requests) first tells the scheduler to end them
    within SHUTDOWN_GRACE_S."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.specrt = server

    async def shutdown(self, sockets=None) -> None:
        self.specrt.scheduler.stop(SHUTDOWN_GRACE_S)
        await super().shutdown(sockets)
