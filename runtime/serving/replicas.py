"""Replicas of `specrt serve` on Ray Serve (the `scale` extra, `pip install 'specrt[scale]'`).

Two deployments, as `ray.serve.llm` has them: `Engine` replicas, each of which loads one engine set and runs today's
server in its process (create_app: the scheduler, continuous batching, the limits, /metrics), and one `Ingress`
behind `@serve.ingress` that takes every HTTP request through Serve's proxy and hands it to an Engine replica (Serve
routes it to a replica with room: `max_ongoing_requests` is the batch size, where Serve's default of 5 would starve
the batcher), then streams the replica's answer back. A replica that dies in the middle of a stream ends that stream
with an error event and `[DONE]`; Serve starts a new replica in its place.

`application(args)` is the Serve application builder (`serve run specrt.serving.replicas:application
engines=engines/default`, or the `import_path` of a `serve deploy` config: docs/serving.md#replicas-on-ray-serve);
`run` is `specrt serve ENGINES --replicas N`.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve

from specrt.decoding.generate import AUTO, PREFILL_CHUNK, Generator
from specrt.errors import InputError
from specrt.serving.server import APIError, Guard, Limits, _error, create_app

REPLICA_HEADER = "x-specrt-replica"   # which replica answered: host:pid


@dataclass
class ReplicaConfig:
    """What each Engine replica serves (`specrt serve`'s options)."""
    engines: str
    model_name: str | None = None
    method: str = AUTO
    device: str = "auto"
    threads: int = 1              # engine threads of each replica; Ray reserves as many CPUs for it
    max_batch: int = 8
    prefill_chunk: int = PREFILL_CHUNK
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self):
        self.engines = str(Path(self.engines).resolve())   # the same path on every node of the cluster
        self.model_name = self.model_name or Path(self.engines).name
        if isinstance(self.limits, dict):
            self.limits = Limits(**self.limits)


class Engine:
    """One replica: one engine set and today's server, run in this process; a request comes in as its method, path,
    query, headers and body, its answer goes back as a stream: {"status", "headers"}, then the body's chunks."""

    def __init__(self, config: ReplicaConfig):
        gen = Generator.from_engines(config.engines, device=config.device, threads=config.threads,
                                     prefill_chunk=config.prefill_chunk)
        self.app = create_app(gen, config.model_name, config.method, config.max_batch, config.limits)
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    async def answer(self, method: str, path: str, query: bytes, headers: list, body: bytes) -> AsyncIterator:
        """The app's answer to one request. Leaving early (the client has gone) cancels it: its rows are freed."""
        queue: asyncio.Queue = asyncio.Queue()
        stop = asyncio.Event()

        async def receive():
            if not stop.is_set():
                stop.set()
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()   # nothing more comes: the request ends by cancellation

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
                 "headers": [(k.encode(), v.encode()) for k, v in headers], "client": None, "server": None}
        task = asyncio.create_task(self.app(scope, receive, queue.put))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (message := await queue.get()) is not None:
                if message["type"] == "http.response.start":
                    yield {"status": message["status"], "headers": [
                        (k.decode(), v.decode()) for k, v in message["headers"]] + [(REPLICA_HEADER, self.name)]}
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        return
            task.result()   # the app ended without an answer: its error
        finally:
            task.cancel()


class Ingress:
    """Every request through Serve's proxy, handed to an Engine replica; the answer streamed back. The API key and
    the body limit are checked here too, before a replica is asked."""

    def __init__(self, engine, limits: Limits):
        self.engine, self.limits = engine, limits

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="specrt", openapi_url=None, docs_url=None, redoc_url=None)   # the replicas' document
        app.add_middleware(Guard, api_key=self.limits.api_key, max_body=self.limits.max_body_bytes)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
        async def forward(request: Request):
            return await self.forward(request)

        return app

    async def forward(self, request: Request):
        body = await request.body()
        answer = self.engine.options(stream=True).answer.remote(
            request.method, request.url.path, request.url.query.encode(), list(request.headers.items()), body)
        try:
            head = await answer.__anext__()
        except Exception as e:   # noqa: BLE001 -- no replica answered: the client gets an error object
            return _replica_failed(e).response()
        headers = {k: v for k, v in head["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        if headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_relay(answer), status_code=head["status"], headers=headers)
        try:
            content = b"".join([chunk async for chunk in answer])
        except Exception as e:   # noqa: BLE001
            return _replica_failed(e).response()
        return Response(content, status_code=head["status"], headers=headers)


def _replica_failed(e: Exception) -> APIError:
    return APIError(503, f"the replica serving this request failed ({type(e).__name__}): send it again; Serve "
                         "replaces the replica", code="replica_failed")


async def _relay(answer) -> AsyncIterator[bytes]:
    """A stream's chunks; a replica that fails in the middle ends it with an error event, then [DONE]."""
    try:
        async for chunk in answer:
            yield chunk
    except Exception as e:   # noqa: BLE001
        e = _replica_failed(e)
        yield f"data: {json.dumps(_error(e.message, e.param, e.code, e.status))}\n\ndata: [DONE]\n\n".encode()
    finally:
        answer.cancel()   # the client has gone: the replica frees the request's rows


def build(config: ReplicaConfig, replicas: int = 1, autoscale: tuple[int, int] | None = None):
    """The Serve application: `replicas` Engine replicas (or autoscaling between autoscale's bounds, aiming at a
    full batch each) behind one Ingress."""
    if replicas < 1:
        raise InputError(f"replicas {replicas}: must be at least 1")
    scaling = {"num_replicas": replicas} if autoscale is None else {"autoscaling_config": {
        "min_replicas": autoscale[0], "max_replicas": autoscale[1], "target_ongoing_requests": config.max_batch}}
    engine = serve.deployment(Engine, max_ongoing_requests=config.max_batch,
                              ray_actor_options={"num_cpus": config.threads}, **scaling)
    # the ingress only relays: as many requests as all replicas take at once and their waiting ones
    ingress = serve.deployment(serve.ingress()(Ingress), max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(config), config.limits)


def application(args: dict):
    """The Serve application builder: `args` are ReplicaConfig's fields (limits: a mapping of Limits' fields) plus
    `replicas` (the number of Engine replicas; a config's `deployments` entry may override it)."""
    args = dict(args)
    replicas = int(args.pop("replicas", 1))
    return build(ReplicaConfig(**args), replicas)


def run(config: ReplicaConfig, host: str, port: int, replicas: int, autoscale: tuple[int, int] | None) -> None:
    """Serve on a Ray cluster (RAY_ADDRESS, else a local Ray instance) until Ctrl-C."""
    import signal

    import ray

    def stop(*_):
        raise KeyboardInterrupt

    ray.init(include_dashboard=False)
    signal.signal(signal.SIGTERM, stop)   # SIGTERM as Ctrl-C (after Ray's own): the replicas and Ray stop too
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build(config, replicas, autoscale), name="specrt", route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()

