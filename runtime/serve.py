"""An OpenAI-compatible HTTP API over one Generator: `specrt serve ENGINES`.

The engines are not thread-safe, so every piece of work that touches the generator (tokenizing, generating) runs
on one worker thread, request after request; the handlers are async and only wait for it. A stream runs on the
worker round by round into a queue and stops at the next round once its client has gone (or a stop string came).
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Literal

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from specrt.errors import InputError, SpecrtError
from specrt.generate import METHODS, Chunk, Generator

log = logging.getLogger("specrt.serve")

# ---- the request schema (OpenAI's fields that specrt serves; other fields are ignored) -----------------------------


class SpecrtOptions(BaseModel):
    """The `specrt` extension field of a request: how to speculate (generate()'s keyword arguments)."""
    model_config = ConfigDict(extra="forbid")
    method: Literal[METHODS] | None = None          # default: the server's --method
    top_k: int = Field(0, ge=0)
    gamma: int | None = Field(None, ge=1, le=64)
    tree: bool = False
    adaptive: bool = True


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


# ---- the server ----------------------------------------------------------------------------------------------------


class Server:
    """One generator, one worker thread, the answers."""

    def __init__(self, gen: Generator, model_name: str, method: str = "autoregressive"):
        self.gen, self.model_name = gen, model_name
        self.methods = [m for m in METHODS if m in ("autoregressive", "ngram") or getattr(gen, m) is not None]
        if method not in self.methods:
            raise InputError(f"method {method!r}: {gen.directory} serves {', '.join(self.methods)}")
        self.method = method
        self.max_len = min(e.spec["max_seq_len"] for e in (gen.target, gen.draft) if e is not None)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="specrt-generate")

    async def call(self, fn: Callable, *args):
        """fn(*args) on the worker, in turn with every other request's work."""
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    # ---- requests --------------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist: this server serves {self.model_name!r}", "model",
                           "model_not_found")

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
        return dict(max_new_tokens=max_tokens or self.max_len - len(ids),
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p, top_k=req.specrt.top_k, seed=req.seed,
                    method=method, gamma=req.specrt.gamma, tree=req.specrt.tree, adaptive=req.specrt.adaptive)

    # ---- generation ------------------------------------------------------------------------------------------
    async def pieces(self, ids: list[int], options: dict, stops: list[str]) -> AsyncIterator[tuple]:
        """One sequence as the rounds produce it: (text, token ids, finish reason or None, stats or None). Runs
        gen.stream on the worker; leaving early (client gone, stop string) stops it at the next round."""
        loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

        def put(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:   # the event loop has closed: nobody is listening
                pass

        self.worker.submit(_produce, self.gen.stream(prompt_ids=ids, **options), put, stop)
        text = StopText(stops)
        try:
            while (chunk := await queue.get()) is not None:
                if isinstance(chunk, Exception):
                    raise chunk
                new, stopped = text.feed(chunk.text or "")
                if stopped:
                    yield new, chunk.token_ids, "stop", None
                    return
                if chunk.stats is not None:
                    yield new + text.flush(), chunk.token_ids, _finish(chunk.stats["stop_reason"]), chunk.stats
                    return
                yield new, chunk.token_ids, None, None
        finally:
            stop.set()

    async def answer(self, req: _Request, ids: list[int], options: dict, chat: bool):
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_name}
        if req.n > 1:
            out = await self.call(lambda: self.gen.generate(prompt_ids=ids, num_return_sequences=req.n, **options))
            choices = []
            for i, tokens in enumerate(out.token_ids):
                text = StopText(stops)
                cut, stopped = text.feed(out.text[i] if out.text else "")
                reason = "stop" if stopped else _finish(out.stats["stop_reasons"][i])
                choices.append(_choice(chat, i, cut if stopped else cut + text.flush(), tokens, reason))
            return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                    "usage": _usage(ids, sum(map(len, out.token_ids))), "specrt": out.stats}
        pieces = self.pieces(ids, options, stops)
        first = await anext(pieces)    # the prefill's: errors are answered before the stream starts
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(_events(first, pieces, head, chat, ids, usage), media_type="text/event-stream")
        texts, tokens, reason, stats = [first[0]], list(first[1]), first[2], first[3]
        async for text, new, reason, stats in pieces:
            texts.append(text)
            tokens += new
        choice = _choice(chat, 0, "".join(texts), tokens, reason)
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": _usage(ids, len(tokens)), "specrt": stats}


def _produce(chunks: Iterator[Chunk], put: Callable, stop: threading.Event) -> None:
    """On the worker: a stream's chunks into put(), then None; stops after the round in which `stop` is set."""
    tokens = 0
    try:
        if not stop.is_set():
            for chunk in chunks:
                put(chunk)
                tokens += len(chunk.token_ids)
                if stop.is_set() and chunk.stats is None:   # the request ended before its generation
                    log.info("generation stopped after %d tokens: the request has ended (client gone or a stop "
                             "string)", tokens)
                    break
    except Exception as e:   # noqa: BLE001 -- handed to the request, which answers it
        put(e)
    finally:
        chunks.close()
        put(None)


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

    def event(choices: list, usage: dict | None = None) -> str:
        body = {**head, "choices": choices, **({"usage": usage} if include_usage else {})}
        return f"data: {json.dumps(body)}\n\n"

    if chat:
        yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None, "token_ids": []}])
    count = 0
    try:
        piece = first
        while True:
            text, tokens, reason, _ = piece
            count += len(tokens)
            if text or tokens:
                yield event([_choice(chat, 0, text, tokens, None, delta=True)])
            if reason is not None:
                yield event([_choice(chat, 0, None if chat else "", [], reason, delta=True)])
                break
            piece = await anext(pieces)
        if include_usage:
            yield event([], _usage(ids, count))
    except SpecrtError as e:
        yield f"data: {json.dumps(_error(str(e), status=500))}\n\n"
    finally:
        await pieces.aclose()
    yield "data: [DONE]\n\n"


# ---- the app -------------------------------------------------------------------------------------------------------


def create_app(gen: Generator, model_name: str, method: str = "autoregressive") -> FastAPI:
    server = Server(gen, model_name, method)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specrt", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return e.response()

    @app.exception_handler(InputError)
    async def input_error(request: Request, e: InputError):
        return JSONResponse(_error(str(e)), status_code=400)

    @app.exception_handler(SpecrtError)
    async def specrt_error(request: Request, e: SpecrtError):
        return JSONResponse(_error(str(e), status=500), status_code=500)

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

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": 0, "owned_by": "specrt",
            "specrt": {"methods": server.methods, "default_method": server.method, "max_seq_len": server.max_len}}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        server.check_model(req.model)
        ids = await server.call(server.completion_ids, req.prompt)
        return await server.answer(req, ids, server.options(req, ids, "prompt", req.max_tokens), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest):
        server.check_model(req.model)
        ids = await server.call(server.chat_ids, req.messages)
        return await server.answer(req, ids, server.options(req, ids, "messages",
                                                            req.max_completion_tokens or req.max_tokens), chat=True)

    return app


def serve(engines: str | Path, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          method: str = "autoregressive", device: str = "auto", threads: int | None = None) -> None:
    """Load ENGINES and serve them until interrupted."""
    import uvicorn
    gen = Generator.from_engines(engines, device=device, threads=threads)
    app = create_app(gen, model_name or Path(engines).resolve().name, method)
    logs = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    logs["loggers"]["specrt"] = {"handlers": ["default"], "level": "INFO"}
    uvicorn.run(app, host=host, port=port, log_config=logs)
