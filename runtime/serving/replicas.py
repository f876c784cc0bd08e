"""Replicas of `specrt serve` on Ray Serve (the `scale` extra, `pip install 'specrt[scale]'`).

Two deployments, as `ray.serve.llm` has them: `Engine` replicas, each of which loads one engine set and runs today's
server in its process (create_app: the scheduler, continuous batching, the limits, /metrics), and one `Ingress`
behind `@serve.ingress` that takes every HTTP request through Serve's proxy and hands it to an Engine replica (Serve
routes it to a replica with room: `max_ongoing_requests` is the batch size, where Serve's default of 5 would starve
the batcher), then streams the replica's answer back. A replica that dies in the middle of a stream ends that stream
with an error event and `[DONE]`; Serve starts a new replica in its place, as it does for a replica whose scheduler
has died (its health check, `Engine.check_health`, fails as its /health does). Requests beyond `--max-waiting`
waiting for a replica with room get a 429 (Serve's `max_queued_requests` at the ingress).

Routing: with the replicas' prefix caches on, the ingress's handle routes through `PrefixRouter`
(specrt.serving.router, Serve's `request_router_config`): a request goes to the replica that holds the longest prefix
of it, falling back to the less loaded of two; `prefix_routing=False` (`--no-prefix-routing`) leaves Serve's default.

Metrics: every replica sends its registry's text to one `MetricsHub` actor each PUSH_S seconds; the ingress's
`/metrics` answers with all of them merged, each sample labelled with its `replica`, and before them the whole (summed;
shares averaged) without that label (specrt.serving.metrics.merge), so one scrape counts every replica.

`application(args)` is the Serve application builder (`serve run specrt.serving.replicas:application
engines=engines/default`, or the `import_path` of a `serve deploy` config: docs/serving.md#replicas-on-ray-serve);
`run` is `specrt serve ENGINES --replicas N`.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError

from specrt.decoding.generate import AUTO, PREFILL_CHUNK
from specrt.errors import InputError
from specrt.serving.metrics import CONTENT_TYPE, merge
from specrt.serving.protocol import APIError, error_body
from specrt.serving.router import PrefixRouter
from specrt.serving.server import Guard, Limits, create_app, load

REPLICA_HEADER = "x-specrt-replica"   # which replica answered: host:pid
HUB = "specrt-metrics"   # the MetricsHub actor's name (namespace "specrt")
PUSH_S = 1.0             # how often a replica sends its metrics to the hub
GONE_S = 15.0            # a replica not heard from for this long has gone: its figures leave /metrics
READY = "replicas ready at"   # `specrt serve --replicas` prints it once every replica serves (before, /health may be
# answered by the first replica up while Serve still routes every request to it)


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
    datastore: str | None = None          # rest's datastore (each replica maps it: the pages are shared)
    suffix_cache_mb: float | None = None  # suffix decoding's index, one of this size in each replica
    prefix_cache_mb: float | None = None  # each replica's own prefix cache (None: the default, see server.load)
    tool_parser: str = "auto"             # the format of tool calls (tool_parsers.FORMATS; auto: the template's)
    reasoning_parser: str = "auto"        # the reasoning section (reasoning.FORMATS; auto: the template's; none)
    prefix_routing: bool | None = None    # route by prefix to the replica whose cache holds it (None: if it caches)

    def __post_init__(self):
        if self.prefix_routing and self.prefix_cache_mb == 0:
            raise InputError("prefix routing sends a request to the replica whose prefix cache holds its prefix, and "
                             "--prefix-cache 0 turns the caches off: drop --prefix-routing or give the cache its MB")
        if self.prefix_routing is None:
            self.prefix_routing = self.prefix_cache_mb != 0
        self.engines = str(Path(self.engines).resolve())   # the same path on every node of the cluster
        self.model_name = self.model_name or Path(self.engines).name
        if self.datastore is not None:
            self.datastore = str(Path(self.datastore).resolve())
        if isinstance(self.limits, dict):
            self.limits = Limits(**self.limits)


class Engine:
    """One replica: one engine set and today's server, run in this process; a request comes in as its method, path,
    query, headers and body, its answer goes back as a stream: {"status", "headers"}, then the body's chunks."""

    def __init__(self, config: ReplicaConfig):
        gen = load(config.engines, config.device, config.threads, config.prefill_chunk, config.datastore,
                   config.suffix_cache_mb, config.prefix_cache_mb)
        self.app = create_app(gen, config.model_name, config.method, config.max_batch, config.limits,
                              config.tool_parser, config.reasoning_parser)
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        metrics, hub = self.app.state.server.metrics, MetricsHub.get()

        def push():
            while True:
                hub.push.remote(self.name, metrics.exposition())
                time.sleep(PUSH_S)

        threading.Thread(target=push, name="specrt-metrics-push", daemon=True).start()

    def check_health(self) -> None:
        """Serve's health check of the replica (every `health_check_period_s`): it fails once the replica's scheduler
        has died, as the replica's /health does, and Serve replaces the replica."""
        dead = self.app.state.server.scheduler.dead()
        if dead is not None:
            raise RuntimeError(dead.message)   # a plain error: it crosses to Serve's controller

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


class MetricsHub:
    """The latest metrics of every Engine replica (Prometheus' text), as they send them."""

    def __init__(self):
        self.latest: dict[str, tuple[float, bytes]] = {}

    @staticmethod
    def get():
        """The cluster's hub (made by the first replica or ingress that asks; it outlives them)."""
        import ray
        return ray.remote(MetricsHub).options(name=HUB, namespace="specrt", get_if_exists=True, lifetime="detached",
                                              num_cpus=0).remote()

    def push(self, replica: str, text: bytes) -> None:
        self.latest[replica] = (time.monotonic(), text)

    def collect(self) -> dict[str, bytes]:
        """Each live replica's text (a replica silent for GONE_S has gone)."""
        now = time.monotonic()
        self.latest = {name: (t, text) for name, (t, text) in self.latest.items() if now - t < GONE_S}
        return {name: text for name, (_, text) in self.latest.items()}


class Ingress:
    """Every request through Serve's proxy, handed to an Engine replica; the answer streamed back. The API key and
    the body limit are checked here too, before a replica is asked; /metrics answers for every replica."""

    def __init__(self, engine, limits: Limits):
        self.engine, self.limits = engine, limits
        self.hub = MetricsHub.get()

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="specrt", openapi_url=None, docs_url=None, redoc_url=None)   # the replicas' document
        app.add_middleware(Guard, api_keys=self.limits.keys, max_body=self.limits.max_body_bytes)

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(merge(await self.hub.collect.remote(), "replica"), media_type=CONTENT_TYPE)

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
        except BackPressureError:
            return APIError(429, f"{self.limits.max_waiting} requests are waiting for a replica with room already "
                                 "(--max-waiting): send it again later", code="too_many_requests").response()
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
        yield f"data: {json.dumps(error_body(e.message, e.param, e.code, e.status))}\n\ndata: [DONE]\n\n".encode()
    finally:
        answer.cancel()   # the client has gone: the replica frees the request's rows


def build(config: ReplicaConfig, replicas: int = 1, autoscale: tuple[int, int] | None = None):
    """The Serve application: `replicas` Engine replicas (or autoscaling between autoscale's bounds, aiming at a
    full batch each) behind one Ingress. `--max-waiting` bounds the requests the ingress holds for a replica with room
    (Serve's max_queued_requests; each replica's own queue stays empty: it takes no more than a batch). The ingress's
    handle routes with PrefixRouter where config.prefix_routing says so."""
    if replicas < 1:
        raise InputError(f"replicas {replicas}: must be at least 1")
    scaling = {"num_replicas": replicas} if autoscale is None else {"autoscaling_config": {
        "min_replicas": autoscale[0], "max_replicas": autoscale[1], "target_ongoing_requests": config.max_batch}}
    queued = {} if config.limits.max_waiting is None else {"max_queued_requests": config.limits.max_waiting}
    router = {"request_router_config": RequestRouterConfig(request_router_class=PrefixRouter)} \
        if config.prefix_routing else {}
    engine = serve.deployment(Engine, max_ongoing_requests=config.max_batch,
                              ray_actor_options={"num_cpus": config.threads}, **scaling, **queued, **router)
    # the ingress only relays: as many requests as all replicas take at once and their waiting ones
    ingress = serve.deployment(serve.ingress()(Ingress), max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(config), config.limits)


def application(args: dict):
    """The Serve application builder: `args` are ReplicaConfig's fields (limits: a mapping of Limits' fields) plus
    `replicas` (the number of Engine replicas; a config's `deployments` entry may override it)."""
    args = dict(args)
    replicas = int(args.pop("replicas", 1))
    routing = args.get("prefix_routing")
    if isinstance(routing, str):   # `serve run ... prefix_routing=false` passes text
        if routing.lower() not in ("true", "false"):
            raise InputError(f"prefix_routing {routing!r}: true or false")
        args["prefix_routing"] = routing.lower() == "true"
    return build(ReplicaConfig(**args), replicas)


def run(config: ReplicaConfig, host: str, port: int, replicas: int, autoscale: tuple[int, int] | None) -> None:
    """Serve on a Ray cluster (RAY_ADDRESS, else a local Ray instance) until Ctrl-C."""
    import signal

    import ray

    def stop(*_):
        raise KeyboardInterrupt

    # Serve's proxy must answer its readiness check within 5 s, three times, or it is killed and Serve's start fails:
    # on a busy 2-core machine (the replicas loading their engines beside other work) it took longer; a local Ray
    # instance's actors inherit this process's environment (a user's own setting stands)
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    ray.init(include_dashboard=False)
    signal.signal(signal.SIGTERM, stop)   # SIGTERM as Ctrl-C (after Ray's own): the replicas and Ray stop too
    try:
        serve.start(http_options={"host": host, "port": port})
        # not blocking: it returns once every replica runs, and then says so
        serve.run(build(config, replicas, autoscale), name="specrt", route_prefix="/", blocking=False)
        count = f"{autoscale[0]} to {autoscale[1]}" if autoscale else str(replicas)
        print(f"specrt: {count} {READY} http://{host}:{port} (Ctrl-C stops them)", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()

