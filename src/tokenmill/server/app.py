"""The FastAPI app: routes, API-key check, body-size limit, OpenAI error bodies, lifespan.

    POST /v1/completions, /v1/chat/completions     (stream or not; see serving.py)
    GET  /v1/models
    GET  /health        200 once the model is loaded, 503 while loading or shutting down
    GET  /metrics       Prometheus text (see metrics.py)
    POST /tokenize, /detokenize

The model loads in the background after the socket opens, so /health can say "loading".
Every error is OpenAI's body {"error": {"message", "type", "param", "code"}}; request bodies are
parsed by hand (not by FastAPI's signature binding) so that a bad or unknown field is a 400
naming it. With an API key set, every /v1 route needs `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from tokenmill.errors import TokenmillError
from tokenmill.llm import LLM
from tokenmill.server import serving
from tokenmill.server.async_engine import AsyncEngine, engine_thread
from tokenmill.server.command import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUED_REQUESTS
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorBody,
    TokenizeRequest,
    parse_body,
)

logger = logging.getLogger(__name__)



@dataclass
class ServerConfig:
    model: str                          # a .gguf file or HF folder
    served_model_name: str              # the name clients pass as `model`
    engine_args: dict[str, Any] = field(default_factory=dict)   # LLM(...) keyword arguments
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class ServerState:
    """What the routes share: the config, the engine once loaded, the metrics."""

    def __init__(self, config: ServerConfig, llm: LLM | None, on_ready: Callable[[], None] | None,
                 on_load_error: Callable[[BaseException], None] | None):
        self.config = config
        self.llm = llm
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.stopping = False
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine.stats() if self.engine is not None else None)
        self._on_ready = on_ready
        self._on_load_error = on_load_error

    async def load(self) -> None:
        try:
            executor = engine_thread()
            if self.llm is None:
                logger.info("loading %s ...", self.config.model)
                self.llm = await asyncio.get_running_loop().run_in_executor(
                    executor, functools.partial(LLM, self.config.model, **self.config.engine_args))
            engine = AsyncEngine(self.llm, self.config.max_queued_requests, self.metrics, executor)
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

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None or not self.engine.is_running:
            state = "loading the model" if self.engine is None and not self.stopping else "shutting down"
            raise ErrorBody(503, f"the server is {state}; retry later", type_="server_error", code="unavailable",
                            headers={"Retry-After": "1"})
        return self.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise ErrorBody(404, f"The model `{model}` does not exist. This server serves "
                            f"`{self.config.served_model_name}`.", param="model", code="model_not_found")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes whether or not Content-Length says so."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ErrorBody(413, f"the request body ({declared} bytes) exceeds the server's limit of {limit} bytes",
                        code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ErrorBody(413, f"the request body exceeds the server's limit of {limit} bytes",
                            code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(config: ServerConfig, llm: LLM | None = None, on_ready: Callable[[], None] | None = None,
               on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The app for `config`; pass `llm` to serve an already loaded model."""
    state = ServerState(config, llm, on_ready, on_load_error)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.ensure_future(state.load())
        yield
        state.stopping = True
        await loading   # a load still running finishes first (it cannot be interrupted)
        if state.engine is not None:
            await state.engine.stop()
        logger.info("engine stopped")

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tokenmill = state

    @app.exception_handler(ErrorBody)
    async def _error_body(request: Request, e: ErrorBody) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ErrorBody(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(ErrorBody(400, str(e)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(ErrorBody(500, f"internal error: {type(e).__name__}", type_="server_error").body(),
                            status_code=500)

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
            body = parse_body(model_cls, await read_body(request, config.max_body_bytes))
            state.check_model(body.model)
            engine = state.ready_engine()
            prepared = await asyncio.to_thread(prepare, body, engine.llm)
            return await serving.run(engine, prepared, config.served_model_name, request)
        except ErrorBody as e:   # (requests that failed in the engine are counted by the engine front)
            if e.status < 500 or e.status == 503:
                state.metrics.count("rejected" if e.status in (429, 503) else "invalid")
            raise

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, CompletionRequest, serving.prepare_completion)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, ChatCompletionRequest, serving.prepare_chat)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        max_len = state.engine.engine.max_model_len if state.engine is not None else None
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model",
                                            "created": state.created, "owned_by": "tokenmill",
                                            "max_model_len": max_len}]}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.engine is not None and state.engine.is_running:
            return JSONResponse({"status": "ok"})
        status = "shutting down" if state.stopping else "failed" if state.load_error else "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body: TokenizeRequest = parse_body(TokenizeRequest, await read_body(request, config.max_body_bytes))
        state.check_model(body.model)
        llm = state.ready_engine().llm
        if (body.prompt is None) == (body.messages is None):
            raise ErrorBody(400, "prompt: give exactly one of prompt or messages", param="prompt")
        try:
            if body.prompt is not None:
                ids = llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                            for m in body.messages]
                _, ids = llm.chat_prompt(messages, body.add_generation_prompt)
        except TokenmillError as e:
            raise ErrorBody(400, str(e), param="prompt" if body.prompt is not None else "messages") from None
        return {"count": len(ids), "max_model_len": llm.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body: DetokenizeRequest = parse_body(DetokenizeRequest, await read_body(request, config.max_body_bytes))
        state.check_model(body.model)
        llm = state.ready_engine().llm
        vocab = llm.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ErrorBody(400, f"tokens: token id {bad[0]} is out of range [0, {vocab})", param="tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    return app


def curl_example(base_url: str, model: str, api_key: bool) -> str:
    auth = ' -H "Authorization: Bearer $TOKENMILL_API_KEY"' if api_key else ""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 32})
    return f"curl {base_url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def run_server(config: ServerConfig, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
               log_level: str = "info") -> int:
    """Serve until SIGINT / SIGTERM. On SIGTERM: stop accepting, let requests in flight finish for
    up to `shutdown_timeout` seconds, abort the rest, stop the engine, return 0."""
    import uvicorn

    shown_host = f"[{host}]" if ":" in host else host
    base_url = f"http://{shown_host}:{port}"

    def on_ready() -> None:
        print(f"tokenmill: serving {config.served_model_name!r} at {base_url} (OpenAI API under /v1). Try:\n"
              f"  {curl_example(base_url, config.served_model_name, bool(config.api_key))}", file=sys.stderr,
              flush=True)

    def on_load_error(error: BaseException) -> None:
        server.should_exit = True

    app = create_app(config, on_ready=on_ready, on_load_error=on_load_error)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=shutdown_timeout))
    # uvicorn handles SIGTERM itself (graceful shutdown), then re-raises it to the previous handler
    # once done; a no-op handler there makes that a clean exit instead of death by signal.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    error = app.state.tokenmill.load_error
    if isinstance(error, TokenmillError):
        raise error
    if error is not None:
        raise RuntimeError(f"loading the model failed: {error}") from error
    return 0 if server.started else 1
