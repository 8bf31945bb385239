"""The FastAPI app: routes, API-key check, body-size limit, OpenAI error bodies, lifespan; and the
uvicorn server around it (read timeouts, draining shutdown).

    POST /v1/completions, /v1/chat/completions     (stream or not; see serving.py)
    GET  /v1/models, /v1/models/{model}
    GET  /health        200 once the model is loaded, 503 while loading or shutting down (HEAD too)
    GET  /metrics       Prometheus text (see metrics.py; HEAD too)
    POST /tokenize, /detokenize
    GET  /, /engine     the web UI: a chat playground, and the engine live (see web.py)

The model loads in the background after the socket opens, so /health can say "loading".
Every error is OpenAI's body {"error": {"message", "type", "param", "code"}}, a 500 included, and
never closes a kept-alive connection; request bodies are parsed by hand (not by FastAPI's
signature binding) so that a bad or unknown field is a 400 naming it. With an API key set, every
/v1 route needs `Authorization: Bearer <key>`. Paths take no trailing slash (no redirects: a
redirected POST loses its body in many clients).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import hmac
import importlib.metadata
import json
import logging
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import h11
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.input import InputProcessor, load_engine
from tokenmill.errors import TokenmillError
from tokenmill.server import serving
from tokenmill.server.async_engine import DEFAULT_STATS_LOG_INTERVAL, AsyncEngine, EngineStoppedError, engine_thread
from tokenmill.server.config import DEFAULT_REQUEST_READ_TIMEOUT_S, ServerConfig
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorBody,
    TokenizeRequest,
    parse_body,
)
from tokenmill.server.web import add_web_routes

logger = logging.getLogger(__name__)

# uvicorn's own graceful-shutdown timeout is this much longer than --shutdown-timeout: a backstop
# that cancels only handlers still running after the drain ended their requests (it takes effect
# between engine steps, so at most one step later).
DRAIN_BACKSTOP_S = 5.0
TLS_DRAIN_POLL_S = 0.05   # how often a TLS connection closing at shutdown checks that its bytes are out
HEAD_LIMIT = 16 * 1024    # a request line and headers, while incomplete (h11's default)
# The replicas behind a front end take heads of up to twice that, so a head the front end relays
# (HEAD_LIMIT at most, checked there: h11 holds a head to its limit only while it is incomplete, so
# one that came whole in one read can be longer) parses there with the headers the relay adds.
REPLICA_HEAD_LIMIT = 2 * HEAD_LIMIT
LISTEN_BACKLOG = 2048     # (uvicorn's default)

Loaded = tuple[LLMEngine, InputProcessor]   # what load_engine returns


class ServerState:
    """What the routes share: the config, the engine once loaded, the metrics."""

    def __init__(self, config: ServerConfig, loaded: Loaded | None, on_ready: Callable[[], None] | None,
                 on_load_error: Callable[[BaseException], None] | None,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.config = config
        self.loaded = loaded
        self.owns_engine = loaded is None   # loaded here: shut down here (its tensor-parallel workers)
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.stopping = False
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine.stats() if self.engine is not None else None)
        self._on_ready = on_ready
        self._on_load_error = on_load_error
        self._on_fatal = on_fatal

    async def load(self) -> None:
        try:
            executor = engine_thread()
            if self.loaded is None:
                logger.info("loading %s ...", self.config.model)
                self.loaded = await asyncio.get_running_loop().run_in_executor(
                    executor, functools.partial(load_engine, self.config.model, **self.config.engine_args))
            config = self.config
            engine = AsyncEngine(*self.loaded, config.max_queued_requests, self.metrics, executor,
                                 stats_log_interval=DEFAULT_STATS_LOG_INTERVAL if config.log_stats else None,
                                 on_fatal=self._on_fatal, log_requests=config.log_requests,
                                 max_log_len=config.max_log_len)
            engine.start()
            self.engine = engine
            logger.info("ready: serving %s as %r", self.config.model, self.config.served_model_name)
            if self._on_ready is not None:
                self._on_ready()
        except Exception as e:
            self.load_error = e
            logger.error("loading the model failed: %s", e)
            if self._on_load_error is not None:
                self._on_load_error(e)

    def status(self) -> str:
        """ok | loading | failed (the model did not load) | shutting down (draining included)."""
        if self.engine is not None:
            return "ok" if self.engine.is_running else "shutting down"
        return "shutting down" if self.stopping else "failed" if self.load_error else "loading"

    def ready_engine(self) -> AsyncEngine:
        status = self.status()
        if status != "ok":
            what = {"loading": "loading the model", "failed": "without a model (it failed to load)"}.get(status, status)
            raise ErrorBody(503, f"the server is {what}; retry later", type_="server_error", code="unavailable",
                            headers={"Retry-After": "1"})
        return self.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise ErrorBody(404, f"The model `{echoed(model)}` does not exist. This server serves "
                            f"`{self.config.served_model_name}`.", param="model", code="model_not_found")


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, refused (413) past `limit` bytes whether or not Content-Length says so, and
    (408) when it has not all arrived within `timeout` seconds. A client that disconnects meanwhile
    raises starlette's ClientDisconnect (answered quietly by create_app)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ErrorBody(413, f"the request body ({declared} bytes) exceeds the server's limit of {limit} bytes",
                        code="request_too_large")

    async def chunks() -> bytes:
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ErrorBody(413, f"the request body exceeds the server's limit of {limit} bytes",
                                code="request_too_large")
            parts.append(chunk)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(chunks(), timeout)
    except asyncio.TimeoutError:
        # The rest of the body may still come, or not: the connection cannot be reused.
        raise ErrorBody(408, f"the request body was not received within {timeout:g} s", code="request_timeout",
                        headers={"Connection": "close"}) from None


class InternalErrorMiddleware:
    """Answers an exception that no handler took with OpenAI's 500 body, on a connection kept open.

    Starlette runs an `Exception` handler in its outermost middleware and then re-raises, so uvicorn
    closes the kept-alive connection and the client's next request on it fails. This middleware
    sits inside that one (app.add_middleware) and outside the routing, so every route, dependency
    and streaming response setup goes through it, and it ends the exchange normally. An exception
    after the response started (a stream's body) cannot become a 500: it goes on to uvicorn, which
    logs it and closes the connection, telling the client the response is cut."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        except Exception as e:
            if started:
                raise
            logger.exception("unhandled error on %s %s", scope["method"], scope["path"])
            body = ErrorBody(500, f"internal error: {type(e).__name__}", type_="server_error").body()
            await JSONResponse(body, status_code=500)(scope, receive, send)


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI error bodies for ErrorBody, HTTP errors (404 naming a missed route) and validation errors;
    a client gone mid-body answered quietly."""
    @app.exception_handler(ErrorBody)
    async def _error_body(request: Request, e: ErrorBody) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = not_found_message(request) if e.status_code == 404 else str(e.detail)
        return JSONResponse(ErrorBody(e.status_code, message).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(ErrorBody(400, str(e)).body(), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, e: ClientDisconnect) -> Response:
        # The client's choice, not a server fault: one line, no traceback. Nobody reads the answer.
        client = request.client
        logger.info("client %s disconnected while sending the body of %s %s",
                    f"{client.host}:{client.port}" if client else "?", request.method, request.url.path)
        return Response(status_code=499)


def add_middleware(app: FastAPI, config: ServerConfig) -> None:
    """The server's middleware, innermost first (each added wraps the ones before it): the 500 of
    InternalErrorMiddleware, then, for the pages of config.allowed_origins (none by default: a
    page elsewhere could otherwise use a server on this machine through its visitor's browser),
    CORS outermost, so that a preflight is answered before the routing and the key check (a browser
    sends it without the key) and every answer, errors too, carries the headers a page needs to
    read it."""
    app.add_middleware(InternalErrorMiddleware)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                           allow_methods=config.allowed_methods, allow_headers=config.allowed_headers,
                           allow_credentials=config.allow_credentials)


def create_app(config: ServerConfig, loaded: Loaded | None = None, on_ready: Callable[[], None] | None = None,
               on_load_error: Callable[[BaseException], None] | None = None,
               on_fatal: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The app for `config`; pass `loaded` (what `load_engine` returns) to serve an already loaded
    model. `on_fatal`: the engine died (AsyncEngine's)."""
    state = ServerState(config, loaded, on_ready, on_load_error, on_fatal)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.ensure_future(state.load())
        yield
        state.stopping = True
        await loading   # a load still running finishes first (it cannot be interrupted)
        if state.engine is not None:
            await state.engine.stop()
        if state.owns_engine and state.loaded is not None:
            state.loaded[0].shutdown()
        logger.info("engine stopped")

    # No slash redirects: a 307 has no error body, and POST /v1/completions/ is then a 404 that says so.
    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)
    app.state.tokenmill = state
    add_middleware(app, config)

    add_error_handlers(app)

    def check_api_key(request: Request) -> None:
        key = config.api_key
        if not key:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise ErrorBody(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    async def generate(request: Request, model_cls: type, prepare: Callable) -> Response:
        try:
            body = parse_body(model_cls, await read_body(request, config.max_body_bytes,
                                                         config.request_read_timeout))
            state.check_model(body.model)
            engine = state.ready_engine()
            prepared = await asyncio.to_thread(prepare, body, engine.inputs)
            await serving.compile_constraint(prepared, engine.inputs)
            return await serving.run(engine, prepared, config.served_model_name, request)
        except ErrorBody as e:   # (requests that failed in the engine are counted by the engine front)
            if not e.counted and (e.status < 500 or e.status == 503):
                state.metrics.count("rejected" if e.status in (429, 503) else "invalid")
            raise

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, serving.prepare_completion)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, serving.prepare_chat)

    def model_card() -> dict[str, Any]:
        max_len = state.engine.engine.max_model_len if state.engine is not None else None
        return {"id": config.served_model_name, "object": "model", "created": state.created, "owned_by": "tokenmill",
                "max_model_len": max_len}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model:path}")   # (a path: a hub id such as org/name holds a slash)
    async def retrieve_model(model: str) -> dict[str, Any]:
        if not model:   # ("/v1/models/": the trailing-slash 404)
            raise StarletteHTTPException(404)
        state.check_model(model)
        return model_card()

    app.include_router(v1)
    add_web_routes(app, config, state.ready_engine, check_api_key,
                   lambda request: read_body(request, config.max_body_bytes, config.request_read_timeout))

    @app.api_route("/health", methods=["GET", "HEAD"])   # HEAD: load balancers' probes
    async def health() -> JSONResponse:
        status = state.status()
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/version")   # (vLLM's: clients check what they talk to)
    async def version() -> dict[str, str]:
        # (the installed distribution's: importing the tokenmill package would import the offline LLM class)
        return {"version": importlib.metadata.version("tokenmill")}

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body: TokenizeRequest = parse_body(TokenizeRequest, await read_body(request, config.max_body_bytes,
                                                                            config.request_read_timeout))
        state.check_model(body.model)
        engine = state.ready_engine()
        if (body.prompt is None) == (body.messages is None):
            raise ErrorBody(400, "prompt: give exactly one of prompt or messages", param="prompt")
        try:
            if body.prompt is not None:
                ids = engine.inputs.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                messages = [m.for_template() for m in body.messages]
                _, ids = engine.inputs.chat_prompt(messages, body.add_generation_prompt, body.chat_template_kwargs,
                                                   continue_final_message=body.continue_final_message)
        except TokenmillError as e:
            param = "prompt" if body.prompt is not None else serving.chat_error_param(str(e))
            raise ErrorBody(400, str(e), param=param) from None
        return {"count": len(ids), "max_model_len": engine.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body: DetokenizeRequest = parse_body(DetokenizeRequest, await read_body(request, config.max_body_bytes,
                                                                                config.request_read_timeout))
        state.check_model(body.model)
        inputs = state.ready_engine().inputs
        bad = [t for t in body.tokens if not 0 <= t < inputs.vocab_size]
        if bad:
            raise ErrorBody(400, f"tokens: token id {bad[0]} is out of range [0, {inputs.vocab_size})",
                            param="tokens")
        return {"prompt": inputs.tokenizer.decode(body.tokens)}

    return app


def echoed(text: str, limit: int = 200) -> str:
    """A client's text as an error message quotes it: cut at `limit` characters (a 1 MB model name
    or path is not sent back)."""
    return text if len(text) <= limit else text[:limit] + "..."


def not_found_message(request: Request) -> str:
    """The 404 message; it names the route a trailing slash missed (`/v1/completions/`)."""
    path = request.url.path
    message = f"no route {echoed(request.method)} {echoed(path)} on this server"
    stripped = path.rstrip("/")
    if stripped and stripped != path:
        scope = {**request.scope, "path": stripped}
        if any(route.matches(scope)[0] != Match.NONE for route in request.app.routes):
            message += f"; did you mean {stripped} (paths take no trailing slash)?"
    return message


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for a request's headers.

    uvicorn has none: its keep-alive timer starts only after a response and any byte received
    cancels it, so a client that connects and sends nothing, or sends its headers a byte at a time
    (slowloris), holds a connection forever. Here a timer is armed when the connection opens and
    after every response, and disarmed only once a request's headers are complete (uvicorn then
    starts a request cycle), never by a byte arriving; when it fires, the connection is closed.
    The body has its own deadline, in read_body. Use `with_timeout` for a subclass to give uvicorn.
    Malformed requests get the JSON error body (send_400_response). On shutdown a closing TLS
    connection is not waited for (shutdown)."""

    header_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S

    @classmethod
    def with_timeout(cls, seconds: float) -> type[HeaderTimeoutH11Protocol]:
        # uvicorn builds each connection's protocol from a class, so the timeout rides on one.
        return type(cls.__name__, (cls,), {"header_timeout": seconds})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.header_timer: asyncio.TimerHandle | None = None
        self.tls = False
        self.shutting_down = False
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.tls = transport.get_extra_info("sslcontext") is not None
        self.arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.disarm_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:   # a request's headers are complete: the app has it until it answers
            self.disarm_header_timer()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self.disarm_header_timer()   # (the connection is no longer this protocol's)
        super().handle_websocket_upgrade(event)

    def shutdown(self) -> None:
        """uvicorn's (close the connection if no response is in flight, else once it is sent), without
        waiting for a TLS client. uvicorn's shutdown waits until every connection is gone, and asyncio's
        TLS close sends close_notify, then keeps the socket until the client answers it (or for 30 s):
        a client that holds the connection idle in its pool (the openai client does), or one that never
        sent a request, does not answer, so a shutdown took 30 s more. Here the socket closes once
        close_notify and everything before it have left (end_tls). A connection closed earlier (the
        keep-alive or read timeout) may still be waiting for that answer; uvicorn would close it a
        second time, which asyncio's TLS transport does not allow for (it drops its protocol)."""
        self.shutting_down = True
        if not self.transport.is_closing():
            super().shutdown()
        self.end_tls()

    def end_tls(self) -> None:
        """While shutting down, close a TLS connection that is closing as soon as asyncio holds nothing
        more to send on it (as nginx and Go close TLS: close_notify sent, no answer awaited). What it
        holds is in the socket transport under the TLS one, which asyncio does not expose: where that
        cannot be read, the close goes on as asyncio's (up to its 30 s)."""
        if not (self.shutting_down and self.tls and self.transport.is_closing()) or self.lost:
            return
        socket_transport = getattr(getattr(self.transport, "_ssl_protocol", None), "_transport", None)
        if socket_transport is None:
            return
        if socket_transport.get_write_buffer_size() > 0:   # (a response still going out to a slow reader)
            self.loop.call_later(TLS_DRAIN_POLL_S, self.end_tls)
            return
        self.transport.abort()

    def on_response_complete(self) -> None:
        self.arm_header_timer()      # first: the call below may start a pipelined request, which disarms it
        super().on_response_complete()
        self.end_tls()               # (a response in flight at shutdown closes its connection once sent)

    def arm_header_timer(self) -> None:
        self.disarm_header_timer()
        self.header_timer = self.loop.call_later(self.header_timeout, self.header_timeout_expired)

    def disarm_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a bad request line, chunk size or Content-Length, headers past
        its size limit) gets OpenAI's JSON error body like every other error here (uvicorn's is
        text/plain), then the connection closes: where the next request would begin is unknown."""
        error = ErrorBody(400, f"{msg.rstrip('.')}: the request is malformed HTTP (its request line, headers, "
                          f"Content-Length or chunked encoding)")
        body = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def header_timeout_expired(self) -> None:
        self.header_timer = None
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:   # part of a request came (else: an idle connection, closed quietly)
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
            logger.info("closing the connection from %s: no complete request headers within %g s", client,
                        self.header_timeout)
        self.transport.close()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on shutdown (SIGTERM, SIGINT).

    uvicorn's graceful shutdown stops accepting and waits for the requests in flight, then cancels
    the handlers still running: a stream is cut mid-chunk, with no error event and no [DONE], and
    every cancelled handler logs a traceback. Here, `drain_timeout` seconds into the shutdown,
    `on_drain_timeout` runs (it ends the engine's requests with an error, so every handler finishes
    by itself); uvicorn's own timeout (`timeout_graceful_shutdown`, set longer) stays the backstop.
    `on_shutdown` runs as the shutdown begins (it ends the live view's feeds, which never end by
    themselves)."""

    def __init__(self, config: uvicorn.Config, drain_timeout: float, on_drain_timeout: Callable[[], None],
                 on_shutdown: Callable[[], None]):
        super().__init__(config)
        self.drain_timeout = drain_timeout
        self.on_drain_timeout = on_drain_timeout
        self.on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_shutdown()
        timer = asyncio.get_running_loop().call_later(self.drain_timeout, self.on_drain_timeout)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def curl_example(base_url: str, model: str, api_key: bool) -> str:
    """The request the server suggests once ready. Greedy: at the API's default temperature (1) a
    small model's answer wanders from one try to the next; the first one a user sees should not."""
    auth = ' -H "Authorization: Bearer $TOKENMILL_API_KEY"' if api_key else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32, "temperature": 0})
    return f"curl {base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def print_ready(config: ServerConfig, host: str, port: int, detail: str = "") -> None:
    shown_host = f"[{host}]" if ":" in host else host
    base_url = f"{'https' if config.tls else 'http'}://{shown_host}:{port}"
    print(f"tokenmill: serving {config.served_model_name!r} at {base_url}{detail} (OpenAI API under /v1). Try:\n"
          f"  {curl_example(base_url, config.served_model_name, bool(config.api_key))}\n"
          f"or open {base_url}/ in a browser (a chat playground; the engine, live: {base_url}/engine)",
          file=sys.stderr, flush=True)


def draining_server(app: ASGIApp, config: ServerConfig, host: str, port: int, log_level: str,
                    shutdown_timeout: float, on_drain_timeout: Callable[[], None], on_shutdown: Callable[[], None],
                    head_limit: int = HEAD_LIMIT) -> DrainingServer:
    """uvicorn for `app`, with `config`'s header/body read timeout, HTTPS and root path, and the
    draining shutdown; `head_limit`: the bytes of a request line and headers h11 takes while they
    are incomplete."""
    tls = config.tls
    return DrainingServer(
        uvicorn.Config(app, host=host, port=port, log_level=log_level,
                       http=HeaderTimeoutH11Protocol.with_timeout(config.request_read_timeout),
                       timeout_graceful_shutdown=shutdown_timeout + DRAIN_BACKSTOP_S,
                       h11_max_incomplete_event_size=head_limit, root_path=config.root_path,
                       access_log=config.access_log,
                       **({} if tls is None else {"ssl_certfile": tls.certfile, "ssl_keyfile": tls.keyfile,
                                                  "ssl_ca_certs": tls.ca_certs, "ssl_cert_reqs": tls.cert_reqs})),
        shutdown_timeout, on_drain_timeout, on_shutdown)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets listening on host:port (every address the name has, as asyncio's create_server binds
    them; "" is every interface), for uvicorn to serve on. Made before anything loads, so that a
    port in use or an address not of this machine is one error naming the flag, at once (uvicorn
    binds only after the app has started, and then exits with status 3)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise TokenmillError(f"--host: {host!r} is not an address ({e.strerror})") from e
    except UnicodeError as e:   # (a name the IDNA codec refuses: a label empty or over 63 characters)
        raise TokenmillError(f"--host: {host!r} is not an address ({e})") from e
    sockets: list[socket.socket] = []
    for family, kind, proto, _, address in dict.fromkeys(infos):
        sock = socket.socket(family, kind, proto)
        sockets.append(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # (as uvicorn: a restart can reuse the port)
        if family == socket.AF_INET6:   # (as asyncio: an IPv4 address of the name gets its own socket)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)   # (now: a port taken by a socket bound but not listening yet fails here)
        except OSError as e:
            for s in sockets:
                s.close()
            flag = "--host" if e.errno == errno.EADDRNOTAVAIL else "--port"
            raise TokenmillError(f"{flag}: cannot listen on {host}:{port}: {e.strerror}") from e
    return sockets


def run_until_signal(server: uvicorn.Server, listeners: list[socket.socket]) -> None:
    """Serve on `listeners` (listening_sockets') until the server exits; they are closed then."""
    # uvicorn handles SIGTERM itself (graceful shutdown), then re-raises it to the previous handler
    # once done; a no-op handler there makes that a clean exit instead of death by signal.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run(sockets=listeners)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for sock in listeners:
            sock.close()


def run_server(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
               log_level: str = "info", announce: bool = True, head_limit: int = HEAD_LIMIT) -> int:
    """Serve until SIGINT / SIGTERM (`announce`: print where, with a curl example, once ready;
    `head_limit`: draining_server's). On SIGTERM: stop accepting, let requests in flight finish for
    up to `shutdown_timeout` seconds, then end the rest with an error (a stream gets an error event
    and `data: [DONE]`, a non-streaming request a 500), stop the engine, return 0. If the engine dies
    (a tensor-parallel worker is gone), its requests fail and the server shuts down: return 1."""
    def on_ready() -> None:
        print_ready(config, host, port)

    def on_load_error(error: BaseException) -> None:
        server.should_exit = True

    def on_fatal(error: BaseException) -> None:
        logger.error("the engine cannot go on (%s); shutting down", error)
        server.should_exit = True

    def drain() -> None:
        engine = app.state.tokenmill.engine
        if engine is None:   # still loading: nothing is in flight
            return
        logger.warning("shutting down: ending the requests still in flight after --shutdown-timeout (%g s)",
                       shutdown_timeout)
        engine.fail_all(EngineStoppedError(f"the server is shutting down and ended this request, still running "
                                           f"after --shutdown-timeout ({shutdown_timeout:g} s)"))

    def end_feeds() -> None:   # (a live view's stream never ends by itself: the drain would wait for it)
        engine = app.state.tokenmill.engine
        if engine is not None:
            engine.monitor.close()

    app = create_app(config, on_ready=on_ready if announce else None, on_load_error=on_load_error, on_fatal=on_fatal)
    server = draining_server(app, config, host, port, log_level, shutdown_timeout, drain,
                             end_feeds, head_limit)
    run_until_signal(server, listening_sockets(host, port))   # (the model loads once it serves)
    error = app.state.tokenmill.load_error
    if isinstance(error, TokenmillError):
        raise error
    if error is not None:
        raise RuntimeError(f"loading the model failed: {error}") from error
    dead = app.state.tokenmill.engine is not None and app.state.tokenmill.engine.fatal_error is not None
    return 0 if server.started and not dead else 1
