"""An OpenAI-compatible HTTP API over one Generator: `specrt serve ENGINES`. The app is here: its routes (GET / is
the playground, a chat page of static/), the API key and body limit in front of them (Guard), errors as OpenAI's
error objects, the OpenAPI document, start and shutdown. The rest of the room, by seam (vLLM's `entrypoints/openai/`
is the example):

- protocol: the request schema (the fields served, those accepted with no effect, those refused) and the errors;
- completions: a request's options for the generator and its answers, JSON or server-sent events;
- scheduler: the one thread that owns the engines and decodes the requests together (continuous batching, chunked
  prefill), and how its failures are answered;
- metrics: Prometheus' /metrics; replicas: the app in Ray Serve replicas.

The handlers are async: they tokenize on a thread of their own and wait for the scheduler's events. A failure of the
scheduler thread outside any request's work makes /health fail (503), so that a supervisor (or Ray Serve's health
check) restarts the process. On SIGTERM (or Ctrl-C) the running requests get SHUTDOWN_GRACE_S seconds to finish, then
end with an error.
"""
from __future__ import annotations

import copy
import hashlib
import json
import hmac
import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
import uvicorn
from starlette.exceptions import HTTPException

from specrt.errors import InputError, SpecrtError
from specrt.decoding.datastore import SuffixCache
from specrt.decoding.generate import AUTO, PREFILL_CHUNK, Generator
from specrt.decoding.prefix_cache import PrefixCache
from specrt.serving.completions import Server, message_chars
from specrt.serving.metrics import CONTENT_TYPE
from specrt.serving.protocol import (APIError, ChatRequest, CompletionRequest, api_error, error_body, error_responses,
                                     invalid)
from specrt.serving.reasoning import AUTO as REASONING_PARSER
from specrt.serving.tool_parsers import AUTO as TOOL_PARSER
from specrt.serving.scheduler import Job, Scheduler  # noqa: F401 -- re-exported: the scheduler's users import it here

SHUTDOWN_GRACE_S = 5.0   # after SIGTERM or Ctrl-C, how long the running requests may still take

# a completion's answers: JSON, or server-sent events when streamed (each event's data: a chunk in OpenAI's format,
# an error object, or [DONE]); errors
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
ANSWERS = {200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}},
           **error_responses(400, 401, 404, 413, 429, 500, 503)}

REQUESTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}   # each route's schema

PLAYGROUND = Path(__file__).with_name("static") / "playground.html"   # GET /: a chat page over the API
PUBLIC = ("/health", "/")   # served without the API key: liveness, and the page (its API calls carry the key)
TENANT = "specrt.tenant"    # the ASGI scope's key for the request's tenant: its API key's name (Guard), else None

MAX_BODY_BYTES = 4 << 20   # a request body's default limit: a prompt that fits 8k tokens, with JSON's escapes

# the prefix cache's default bound: PREFIX_CACHE_MB, or less where that is more than 1/PREFIX_CACHE_SHARE of the
# memory still available once the engines are loaded (the GPU's on CUDA); 512 MB holds ~11k positions of SmolLM2-135M
# in float32 (46 KB a position), a 2,000-token system prompt and dozens of chats
PREFIX_CACHE_MB, PREFIX_CACHE_SHARE = 512, 8

log = logging.getLogger("specrt.serving")


def _too_large(limit: int) -> str:
    return f"the request body is larger than {limit} bytes (--max-body-bytes): shorten it"


def tenant(key: str) -> str:
    """An API key's name as a tenant of the prefix cache (a digest: the key itself is kept nowhere else)."""
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


def read_api_keys(path: str | Path) -> tuple[str, ...]:
    """`--api-key-file`: one key a line (llama.cpp's format), blank lines skipped; each key is a tenant."""
    try:
        keys = tuple(dict.fromkeys(line.strip() for line in Path(path).read_text().splitlines() if line.strip()))
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"API key file {path}: cannot be read ({e}); give a text file of one key a line") from e
    if not keys:
        raise InputError(f"API key file {path}: no key in it; write one key a line")
    return keys


class Guard:
    """ASGI middleware in front of the app: the API keys (`Authorization: Bearer KEY`, each compared in constant
    time; every path but PUBLIC's) and the request body's size limit (413), before anything reads the body. The key
    a request carries names its tenant (the scope's TENANT)."""

    def __init__(self, app, api_keys: tuple[str, ...] = (), max_body: int = MAX_BODY_BYTES):
        self.app, self.max_body = app, max_body
        self.expected = [(f"Bearer {key}".encode(), tenant(key)) for key in api_keys]

    def _tenant(self, headers: dict) -> str | None:
        """The tenant whose key the request carries, None if none (every key is compared: no early exit)."""
        sent, found = headers.get(b"authorization", b""), None
        for expected, name in self.expected:
            if hmac.compare_digest(sent, expected):
                found = name
        return found

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        scope[TENANT] = self._tenant(headers) if self.expected else None
        if self.expected and scope["path"] not in PUBLIC and scope[TENANT] is None:
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
    """Who may call and how much (`specrt serve`'s --api-key, --max-waiting, --request-timeout, --max-body-bytes,
    --api-key-file)."""
    api_key: str | None = None          # requests must carry `Authorization: Bearer KEY` (all but PUBLIC's paths)
    max_waiting: int | None = None      # requests waiting for a row beyond this get a 429 (None: no bound)
    request_timeout: float | None = None   # seconds from a request's arrival to its end (None: no limit)
    max_body_bytes: int = MAX_BODY_BYTES
    api_keys: tuple[str, ...] = ()      # more keys (--api-key-file), each a tenant as api_key is

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key a request may carry; each is a tenant of the prefix cache."""
        return tuple(dict.fromkeys(((self.api_key,) if self.api_key is not None else ()) + tuple(self.api_keys)))

    def __post_init__(self):
        if self.max_waiting is not None and self.max_waiting < 1:
            raise InputError(f"max waiting {self.max_waiting}: must be at least 1 (or none: no bound)")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise InputError(f"request timeout {self.request_timeout}: must be more than 0 seconds")
        if self.max_body_bytes < 1:
            raise InputError(f"max body bytes {self.max_body_bytes}: must be at least 1")
        if self.api_key is not None and not self.api_key.strip():
            raise InputError("API key: empty; give a key, or leave --api-key and SPECRT_API_KEY unset")
        if any(not key.strip() for key in self.api_keys):
            raise InputError("API keys: one is empty; give each key on a line of its own")


def create_app(gen: Generator, model_name: str, method: str = AUTO, max_batch: int = 8,
               limits: Limits = Limits(), tool_parser: str = TOOL_PARSER,
               reasoning_parser: str = REASONING_PARSER) -> FastAPI:
    server = Server(gen, model_name, method, max_batch, limits.max_waiting, limits.request_timeout, tool_parser,
                    reasoning_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        server.close()

    app = FastAPI(title="specrt", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(Guard, api_keys=limits.keys, max_body=limits.max_body_bytes)
    app.openapi = lambda: _openapi(app)

    @app.exception_handler(Exception)   # APIError, InputError (400), any other (500): an OpenAI error object
    @app.exception_handler(APIError)
    @app.exception_handler(SpecrtError)
    async def error(request: Request, e: Exception):
        return api_error(e).response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        return invalid(REQUESTS.get(request.url.path), e.body, e.errors()).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(error_body(message, status=e.status_code), status_code=e.status_code)

    @app.get("/health", responses=error_responses(503))
    async def health():
        """Liveness alone: {"status": "ok"}, a 503 once the scheduler has died (restart the process). It is open
        to anyone (PUBLIC), so it says nothing of the requests or the caches: /metrics (behind the key) does."""
        if (dead := server.scheduler.dead()) is not None:
            raise dead
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def playground():
        """The playground: a chat page that streams from /v1/chat/completions and marks each round's accepted
        drafts (static/playground.html: HTML, CSS and JavaScript in one file)."""
        return HTMLResponse(PLAYGROUND.read_text(encoding="utf-8"))

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(401))
    async def metrics():
        """Prometheus' text format (see specrt.serving.metrics)."""
        return PlainTextResponse(server.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", responses=error_responses(401))
    async def models():
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": 0, "owned_by": "specrt",
            "specrt": {"methods": server.methods, "default_method": server.method, "max_seq_len": server.max_len}}]}

    @app.post("/v1/completions", responses=ANSWERS)
    async def completions(req: CompletionRequest, request: Request):
        server.check_model(req.model)
        if isinstance(req.prompt, str):
            server.check_chars(len(req.prompt), "prompt")
        ids = await server.call(server.completion_ids, req.prompt)
        grammar = await server.compiled(req)
        options = server.options(req, ids, "prompt", req.max_tokens, grammar, request.scope.get(TENANT))
        return await server.answer(req, ids, options, chat=False)

    @app.post("/v1/chat/completions", responses=ANSWERS)
    async def chat_completions(req: ChatRequest, request: Request):
        server.check_model(req.model)
        server.check_chars(sum(map(message_chars, req.messages)), "messages")
        tools = server.tools(req)
        if tools is not None:
            server.check_chars(len(json.dumps(tools.shown)), "tools")
        ids = await server.call(server.chat_ids, req.messages, tools and tools.shown, req.chat_template_kwargs)
        thinking = await server.call(server.thinking, ids)
        grammar = await server.compiled(req, tools, thinking)
        options = server.options(req, ids, "messages", req.max_completion_tokens or req.max_tokens, grammar,
                                 request.scope.get(TENANT))
        return await server.answer(req, ids, options, chat=True, tools=tools, thinking=thinking)

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


def available_bytes(device: str) -> int:
    """Memory not yet taken: the GPU's free memory on CUDA, else the host's MemAvailable (Linux; elsewhere its free
    pages)."""
    if device.startswith("cuda"):
        import torch
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_prefix_cache_mb(device: str) -> float:
    """`specrt serve`'s prefix cache without --prefix-cache: PREFIX_CACHE_MB, at most 1/PREFIX_CACHE_SHARE of the
    memory available on `device` now."""
    return min(PREFIX_CACHE_MB, available_bytes(device) / PREFIX_CACHE_SHARE / 2**20)


def load(engines: str | Path, device: str = "auto", threads: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
         datastore: str | Path | None = None, suffix_cache_mb: float | None = None,
         prefix_cache_mb: float | None = None) -> Generator:
    """The generator a server (or a replica) serves: the engine set, rest's datastore, the suffix cache and the
    prefix cache (`prefix_cache_mb`: its bound, 0 for none; None: default_prefix_cache_mb, once the engines have
    taken their memory)."""
    gen = Generator.from_engines(engines, device=device, threads=threads, prefill_chunk=prefill_chunk,
                                 datastore=datastore)
    if suffix_cache_mb is not None:
        gen.suffix_cache = SuffixCache(suffix_cache_mb)
    if prefix_cache_mb is None:
        prefix_cache_mb = default_prefix_cache_mb(str(gen.target.device))
    gen.prefix_cache = PrefixCache.of_mb(prefix_cache_mb)
    return gen


def serve(engines: str | Path, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          method: str = AUTO, device: str = "auto", threads: int | None = None,
          max_batch: int = 8, prefill_chunk: int = PREFILL_CHUNK, limits: Limits = Limits(),
          datastore: str | Path | None = None, suffix_cache_mb: float | None = None,
          prefix_cache_mb: float | None = None, tool_parser: str = TOOL_PARSER,
          reasoning_parser: str = REASONING_PARSER) -> None:
    """Load ENGINES and serve them until SIGTERM or Ctrl-C (the running requests get SHUTDOWN_GRACE_S to finish).
    `datastore`: rest's (see Generator.use_datastore); `suffix_cache_mb`: suffix decoding's index of the finished
    outputs (see SuffixCache); `prefix_cache_mb`: the prefix cache's bound (see load); `tool_parser`: the format of
    tool calls (serving.tool_parsers.FORMATS; auto: from the chat template); `reasoning_parser`: the reasoning section
    (serving.reasoning.FORMATS; auto: from the chat template; none: off)."""
    gen = load(engines, device, threads, prefill_chunk, datastore, suffix_cache_mb, prefix_cache_mb)
    app = create_app(gen, model_name or Path(engines).resolve().name, method, max_batch, limits, tool_parser,
                     reasoning_parser)
    logs = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    logs["loggers"]["specrt"] = {"handlers": ["default"], "level": "INFO"}
    # uvicorn's own limit, should a request not end when the scheduler ends it
    config = uvicorn.Config(app, host=host, port=port, log_config=logs, timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 5)
    cache = gen.prefix_cache   # logged once uvicorn's config has set the loggers up
    log.info("prefix cache: %s", "off" if cache is None else f"{cache.max_bytes / 2**20:.0f} MB" +
             (" (the default)" if prefix_cache_mb is None else ""))
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
