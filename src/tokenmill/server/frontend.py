"""One HTTP front end over several engine replicas (server/replicas.py): `tokenmill serve
--data-parallel-size N`, and prefill/decode disaggregation (`--kv-transfer-config`).

    client --HTTP--> front end --HTTP (loopback)--> replica 0 .. N-1 (each a whole `tokenmill serve`)

Data parallel: each generation request goes to one replica, chosen by server/router.py (prefix
affinity, else load); the response (a stream included) is relayed as it comes. Everything else
(/v1/models, /tokenize, the web UI and its feed) goes to the lowest-numbered replica in rotation.
/health is 200 while at least one replica is up (disaggregated: one of each role); /metrics holds
every replica's metrics labelled `replica="i"`, their sums as `replica="all"` (not when
disaggregated: a request runs on both), and the front end's own (routing decisions, replicas up,
restarts).

Disaggregated: replica 0 prefills, replica 1 decodes. A generation request goes first to the
prefill replica as a one-token request that exports its prompt's KV (`kv_transfer_params`:
{"do_remote_decode": true}, vLLM's field); its answer names the exported KV, and the original
request then goes to the decode replica with that name, which loads the KV into its own cache and
computes only the last prompt token onward (engine/kv_transfer.py); once that answer is over, the
front end deletes the export if the decode replica did not take it. Long prompts then never share a
step with the decode replica's running streams.

A replica that dies is taken out of rotation at once (its requests in flight fail: a stream gets an
error event, a request still waiting for its answer a 502; one sent to it before supervision
noticed goes to another replica) and restarted; the other replicas' requests never notice. A
replica that dies before it was ever up fails the whole server (its log says why: a bad flag, a
model that does not load).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.config import KVTransferConfig
from tokenmill.engine.kv_transfer import transfer_path
from tokenmill.server import serving
from tokenmill.server.app import (
    HEAD_LIMIT,
    add_error_handlers,
    add_middleware,
    draining_server,
    echoed,
    listening_sockets,
    print_ready,
    read_body,
    run_until_signal,
)
from tokenmill.server.config import ServerConfig
from tokenmill.server.protocol import ErrorBody
from tokenmill.server.replicas import Replica
from tokenmill.server.router import CacheAwareRouter

logger = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 0.2
HEALTH_TIMEOUT_S = 2.0
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Not relayed either way: hop-by-hop headers, and those the relaying HTTP client sets itself.
_DROPPED_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                    "date", "server"}
# The decode replica generates; the prefill replica's request (n = 1, not streamed) leaves these
# out. It keeps max_tokens and min_tokens: the prefill replica checks them as the decode replica will
# (a prompt too long for them is refused before it is prefilled), and ends an export after one token.
_PREFILL_DROPPED = ("stream_options", "best_of")


def relayable(headers: httpx.Headers) -> dict[str, str]:
    """The headers of a replica's response to pass on (not hop-by-hop ones, not those set anew)."""
    return {k: v for k, v in headers.items() if k.lower() not in _DROPPED_HEADERS}


def request_headers(request: Request, dropped: frozenset[str] = frozenset()) -> list[tuple[bytes, bytes]]:
    """A client's request headers to pass on to a replica, as the bytes that came (a header value
    may hold any byte, which httpx would refuse to encode from text), less hop-by-hop ones and
    `dropped`; a 431 if the head is over HEAD_LIMIT (the replicas take twice that: app.REPLICA_HEAD_LIMIT,
    room for the headers the relay adds)."""
    skip = _DROPPED_HEADERS | dropped
    headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in skip]
    head = len(request.scope.get("raw_path", b"")) + len(request.scope.get("query_string", b"")) + sum(
        len(k) + len(v) + 4 for k, v in headers)
    if head > HEAD_LIMIT:
        raise ErrorBody(431, f"the request's headers are too large to relay ({head} bytes with the path; at most "
                        f"{HEAD_LIMIT})")
    return headers


def routing_text(body: Any) -> str:
    """What the router matches prefixes on: a completion's prompt, a chat's messages (as JSON: a
    conversation that grows keeps its prefix), "" for anything else."""
    if not isinstance(body, dict):
        return ""
    prompt = body.get("prompt", body.get("messages"))
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, ensure_ascii=False) if prompt is not None else ""


def _no_answer(replica: Replica, error: httpx.HTTPError) -> ErrorBody:
    """The 502 for a request `replica` did not answer."""
    logger.warning("%s did not answer: %s", replica.name, error)
    return ErrorBody(502, f"{replica.name} did not answer (it may have just died; retry)", type_="server_error",
                     code="bad_gateway")


def _computed_where_decoded(body: dict[str, Any]) -> bool:
    """A request the decode replica computes whole: a completion with a list of prompts (each its
    own K/V), or one that scores its prompt (prompt_logprobs, or echo with logprobs: the prompt's
    rows must be computed where they are scored)."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
    scored = body.get("prompt_logprobs") is not None or (body.get("echo") is True and body.get("logprobs") is not None)
    return several or scored


class _Relayed(StreamingResponse):
    """A replica's response relayed as it arrives; `on_close` runs however the relay ends (finished,
    client gone, or never started)."""

    def __init__(self, upstream: httpx.Response, replica: Replica, on_close: Callable[[], Any]):
        self.upstream = upstream
        self.replica = replica
        self.on_close = on_close
        headers = relayable(upstream.headers)
        super().__init__(self._chunks(), status_code=upstream.status_code, headers=headers)

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:   # the replica died mid-response
            logger.warning("%s failed mid-response: %s", self.replica.name, e)
            if self.upstream.headers.get("content-type", "").startswith("text/event-stream"):
                error = ErrorBody(502, f"{self.replica.name} failed while generating this response",
                                  type_="server_error").body()
                yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()
            self.on_close()


class AggregatedMetrics(Collector):
    """Replicas' metrics (parsed exposition texts) labelled by replica, plus their sums (`totals`)."""

    def __init__(self, texts: dict[int, str], totals: bool = True):
        self.texts = texts
        self.totals = totals

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        totals: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                total = totals.setdefault(family.name, {})
                for s in family.samples:
                    merged.add_sample(s.name, {**s.labels, "replica": str(replica)}, s.value)
                    if not s.name.endswith("_created"):
                        key = (s.name, tuple(sorted(s.labels.items())))
                        total[key] = total.get(key, 0.0) + s.value
        if not self.totals:
            return list(families.values())
        sums = {sample: value for total in totals.values() for (sample, _), value in total.items()}
        for name, total in totals.items():
            for (sample, labels), value in total.items():
                if sample == "tokenmill_prefix_cache_hit_rate":   # a ratio: of the summed counts
                    queries = sums.get("tokenmill_prefix_cache_queries_total", 0.0)
                    value = sums.get("tokenmill_prefix_cache_hits_total", 0.0) / queries if queries else 0.0
                families[name].add_sample(sample, {**dict(labels), "replica": "all"}, value)
        return list(families.values())


class FrontEnd:
    """The replicas, their supervision, routing and relaying."""

    def __init__(self, config: ServerConfig, replicas: list[Replica], on_ready: Callable[[], None],
                 on_failed: Callable[[str], None]):
        self.config = config
        self.replicas = replicas
        self.disaggregated = any(r.role != "both" for r in replicas)
        self.router = CacheAwareRouter(len(replicas))
        self.on_ready = on_ready
        self.on_failed = on_failed
        self.ready = False
        self.stopping = False
        self.client: httpx.AsyncClient | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        self.routed = Counter("tokenmill_router_requests", "Generation requests routed, by replica and reason "
                              "(cache: prefix affinity; load: least loaded; prefill/decode: disaggregated)",
                              ["replica", "reason"], registry=self.registry)
        self.replica_up = Gauge("tokenmill_replica_up", "1 while the replica is in rotation", ["replica"],
                                registry=self.registry)
        self.restarts = Counter("tokenmill_replica_restarts", "Times the replica died and was restarted",
                                ["replica"], registry=self.registry)
        for r in replicas:
            self.replica_up.labels(str(r.index)).set(0)
            self.restarts.labels(str(r.index))

    # --- supervision ----------------------------------------------------------------------------

    async def supervise(self) -> None:
        """Start the replicas, put each in rotation once its /health says ok, restart any that dies."""
        for r in self.replicas:
            r.start()
        while not self.stopping:
            for r in self.replicas:
                if self.stopping:   # (the replicas are draining: their exits are expected)
                    return
                code = r.exit_code()
                if code is not None:
                    if not r.ever_up:
                        self.on_failed(f"{r.name} exited with code {code} before it was ready (its log above says "
                                       f"why)")
                        return
                    logger.error("%s exited with code %d; out of rotation, restarting it", r.name, code)
                    r.died()
                    self.router.forget(r.index)
                    self.replica_up.labels(str(r.index)).set(0)
                    self.restarts.labels(str(r.index)).inc()
                elif r.process is None and time.monotonic() >= r.next_start:
                    r.start()
                elif r.process is not None and not r.up and await self._healthy(r):
                    r.up = r.ever_up = True
                    r.consecutive_deaths = 0
                    self.replica_up.labels(str(r.index)).set(1)
                    if self.ready:
                        logger.warning("%s is back in rotation", r.name)
            if not self.ready and all(r.up for r in self.replicas):
                self.ready = True
                self.on_ready()
            await asyncio.sleep(SUPERVISE_INTERVAL_S)

    def supervisor_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("supervising the replicas failed", exc_info=task.exception())
            self.on_failed(f"supervising the replicas failed: {task.exception()!r}")

    async def _healthy(self, replica: Replica) -> bool:
        try:
            response = await self.client.get(replica.url + "/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def stop_replicas(self) -> None:
        self.stopping = True
        for r in self.replicas:
            r.terminate()

    # --- routing and relaying -------------------------------------------------------------------

    def in_rotation(self, role: str = "both") -> list[Replica]:
        return [r for r in self.replicas if r.up and (role == "both" or r.role == role)]

    def first_up(self) -> Replica:
        """The replica that answers everything but generation (tokenize, the web UI, its live feed):
        the same one while it stays up (the decode replica when disaggregated)."""
        return self._one("decode" if self.disaggregated else "both", lambda r: r.index)

    def _one(self, role: str = "both", key: Callable[[Replica], Any] = lambda r: (r.in_flight, r.index),
             other_than: Replica | None = None) -> Replica:
        candidates = [r for r in self.in_rotation(role) if r is not other_than]
        if not candidates:
            raise ErrorBody(503, "no replica is ready (starting or restarting); retry later", type_="server_error",
                            code="unavailable", headers={"Retry-After": "1"})
        return min(candidates, key=key)

    async def relay(self, replica: Replica, request: Request, body: bytes, counted: bool = True,
                    on_done: Callable[[], None] | None = None, retry: bool = False) -> Response:
        """Send the request to `replica` and relay its answer. `counted`: a generation request (it
        counts in the replica's load); `on_done` runs once the relay is over, however it ends.
        `retry`: a replica that refuses the connection (it died, and supervision has not noticed
        yet) never saw the request, which then goes once to another replica of its role."""
        path = relayed_path(request)
        headers = request_headers(request)
        try:
            upstream_request = self.client.build_request(request.method, replica.url + path,
                                                         params=request.query_params, headers=headers, content=body)
        except httpx.InvalidURL as e:
            raise ErrorBody(400, f"the request's URL cannot be relayed: {echoed(str(e))}") from None
        replica.in_flight += counted

        def done() -> None:
            replica.in_flight -= counted
            if on_done is not None:
                on_done()

        try:
            # A replica answers a request that is not streamed only when it is done: a client that
            # goes away meanwhile closes the upstream connection, so the replica aborts it too.
            sent = await serving.unless_disconnected(request, self.client.send(upstream_request, stream=True))
            if sent is None:
                done()
                return Response(status_code=499)
            upstream = sent.result()
        except httpx.HTTPError as e:
            others = [r for r in self.in_rotation(replica.role) if r is not replica]
            if retry and isinstance(e, httpx.ConnectError) and others:
                replica.in_flight -= counted   # (on_done is the retry's to run)
                other = self._one(replica.role, other_than=replica)
                logger.warning("%s refused the connection (%s); sending the request to %s", replica.name, e,
                               other.name)
                return await self.relay(other, request, body, counted, on_done)
            done()
            raise _no_answer(replica, e) from None
        except BaseException:   # (this handler cancelled)
            done()
            raise
        return _Relayed(upstream, replica, done)

    async def generate(self, request: Request) -> Response:
        body = await read_body(request, self.config.max_body_bytes, self.config.request_read_timeout)
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):   # the replica's answer names the problem
            parsed = None
        if self.disaggregated:
            if isinstance(parsed, dict) and not _computed_where_decoded(parsed):
                return await self._disaggregated(request, parsed)
            return await self.relay(self._one("decode"), request, body)   # (computed there, colocated)
        candidates = self.in_rotation()
        if not candidates:
            self._one()   # (raises the 503)
        choice = self.router.choose(routing_text(parsed), {r.index: r.in_flight for r in candidates})
        self.routed.labels(str(choice.replica), choice.reason).inc()
        return await self.relay(self.replicas[choice.replica], request, body, retry=True)

    async def _disaggregated(self, request: Request, body: dict[str, Any]) -> Response:
        """Prefill on the prefill replica (its KV exported), then the request on the decode replica."""
        body.pop("kv_transfer_params", None)   # (only the front end says where KV comes from)
        prefill, decode = self._one("prefill"), self._one("decode")
        headers = [*request_headers(request, frozenset({"content-type"})), (b"content-type", b"application/json")]
        first = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
        first.update(stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
        self.routed.labels(str(prefill.index), "prefill").inc()
        prefill.in_flight += 1
        # json.dumps writes what Python's parser accepted and the replicas' strict one does not (NaN,
        # a lone surrogate) as JSON text again, for the prefill replica to refuse with a 400. (A
        # client gone just as the prefill replica answers leaves its export to expire.)
        try:
            sent = await serving.unless_disconnected(request, self.client.post(
                prefill.url + relayed_path(request), content=json.dumps(first).encode(), headers=headers))
            if sent is None:
                return Response(status_code=499)
            answer = sent.result()
        except httpx.HTTPError as e:
            raise _no_answer(prefill, e) from None
        finally:
            prefill.in_flight -= 1
        if answer.status_code != 200:   # the request is bad (400), or the server busy: as the prefill replica says
            return Response(answer.content, status_code=answer.status_code, headers=relayable(answer.headers))
        params = answer.json().get("kv_transfer_params")
        cleanup = None
        if params is not None:
            body["kv_transfer_params"] = params
            path = transfer_path(params["remote_kv"])
            # the consumer deletes it when it reads it; not read (refused, queue full, died): here
            cleanup = functools.partial(path.unlink, missing_ok=True)
        self.routed.labels(str(decode.index), "decode").inc()
        return await self.relay(decode, request, json.dumps(body).encode(), on_done=cleanup)

    async def metrics(self) -> bytes:
        async def scrape(r: Replica) -> tuple[int, str | None]:
            try:
                response = await self.client.get(r.url + "/metrics", timeout=HEALTH_TIMEOUT_S)
            except httpx.HTTPError:
                return r.index, None
            return r.index, response.text if response.status_code == 200 else None

        texts = dict(await asyncio.gather(*(scrape(r) for r in self.in_rotation())))
        registry = CollectorRegistry(auto_describe=False)
        # (disaggregated, a request runs on both replicas: its counts would be summed twice)
        registry.register(AggregatedMetrics({i: t for i, t in texts.items() if t is not None},
                                            totals=not self.disaggregated))
        return generate_latest(self.registry) + generate_latest(registry)


def create_frontend(front: FrontEnd) -> FastAPI:
    config = front.config

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        front.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        supervisor = asyncio.ensure_future(front.supervise())
        supervisor.add_done_callback(front.supervisor_ended)
        yield
        front.stop_replicas()
        supervisor.cancel()
        await asyncio.gather(*(asyncio.to_thread(r.wait, front.replicas[0].shutdown_timeout + 10.0)
                               for r in front.replicas))
        await front.client.aclose()

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    add_middleware(app, config)
    add_error_handlers(app)

    for path in GENERATION_PATHS:
        app.add_api_route(path, front.generate, methods=["POST"])

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        ok = bool(front.in_rotation()) and not front.stopping
        replicas = [{"replica": r.index, "role": r.role, "up": r.up, "in_flight": r.in_flight, "restarts": r.restarts,
                     "pid": r.process.pid if r.process is not None else None} for r in front.replicas]
        if front.disaggregated:
            ok = ok and bool(front.in_rotation("prefill")) and bool(front.in_rotation("decode"))
        return JSONResponse({"status": "ok" if ok else "unavailable", "replicas": replicas},
                            status_code=200 if ok else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(await front.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST", "HEAD", "DELETE", "PUT", "PATCH"])
    async def anything_else(request: Request, path: str) -> Response:
        body = await read_body(request, config.max_body_bytes, config.request_read_timeout)
        return await front.relay(front.first_up(), request, body, counted=False, retry=True)

    return app


def relayed_path(request: Request) -> str:
    """The path as the client sent it, percent-escapes kept (the decoded one may hold bytes no URL
    can), less the --root-path prefix uvicorn puts before it: a replica serves at /."""
    path = request.scope.get("raw_path", request.url.path.encode()).decode("latin-1")
    root = request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def replica_config(config: ServerConfig, role: str) -> ServerConfig:
    """A replica's settings: the server's, less CORS, HTTPS and the root path (only this front end
    talks to it, over loopback, on paths without the prefix), and its K/V transfer role when
    disaggregated."""
    config = dataclasses.replace(config, allowed_origins=[], tls=None, root_path="")
    if role == "both":
        return config
    kv = KVTransferConfig.parse(config.engine_args["kv_transfer_config"])
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    return dataclasses.replace(config, engine_args={**config.engine_args, "kv_transfer_config": {
        "kv_connector": kv.kv_connector, "kv_role": kv_role}})


def run_frontend(config: ServerConfig, roles: list[str], host: str, port: int, shutdown_timeout: float,
                 log_level: str, replica_log_level: str) -> int:
    """Serve `config` with one replica per entry of `roles` ("both": data parallel; "prefill" +
    "decode": disaggregated) until SIGINT / SIGTERM, which drains the replicas. Returns 1 if a
    replica never came up."""
    failure: list[str] = []

    def on_ready() -> None:
        what = (f"{len(roles)} replicas" if not front.disaggregated else "a prefill and a decode replica")
        print_ready(config, host, port, f" ({what})")

    def on_failed(message: str) -> None:
        logger.error("%s; shutting down", message)
        failure.append(message)
        server.should_exit = True

    replicas = [Replica(i, replica_config(config, role), role, shutdown_timeout, replica_log_level)
                for i, role in enumerate(roles)]
    front = FrontEnd(config, replicas, on_ready, on_failed)
    app = create_frontend(front)
    # The replicas drain their own requests (SIGTERM at the start of the shutdown); the front end's
    # handlers end as their relays do.
    server = draining_server(app, config, host, port, log_level, shutdown_timeout,
                             lambda: None, front.stop_replicas)
    run_until_signal(server, listening_sockets(host, port))   # (the replicas start once it serves)
    return 1 if failure or not server.started else 0
