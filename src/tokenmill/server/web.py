"""The web UI: a chat playground at `/`, the engine live at `/engine`, and what they read.

    GET  /                 the chat playground (it talks to the server's own /v1 endpoints)
    GET  /engine           the engine view: KV block grid, steps, time series, request timeline
    GET  /static/...       their files (shipped in the package; nothing is fetched from elsewhere)
    GET  /engine/feed      server-sent events, one `frame` event per frame (server/monitor.py)
    POST /engine/burst     send a burst of generated requests (only with --allow-burst)
    DELETE /engine/burst   abort the bursts still running

The pages themselves hold nothing secret and need no API key; the feed and the burst need it
when the server has one, as /v1 does. The pages keep a key the user types in sessionStorage: this
tab only, gone when it closes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.responses import FileResponse, StreamingResponse
from starlette.staticfiles import StaticFiles

from tokenmill.errors import SamplingParamsError, TokenmillError
from tokenmill.sampling import SamplingParams
from tokenmill.server.async_engine import AsyncEngine, QueueFullError, RequestStream
from tokenmill.server.config import ServerConfig
from tokenmill.server.monitor import IDLE_FRAME_INTERVAL
from tokenmill.server.protocol import BurstRequest, ErrorBody, parse_body

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
FEED_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}   # (and no proxy buffering)


class Bursts:
    """The bursts in flight: their request ids, and the tasks that read their streams."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.running: dict[str, list[str]] = {}   # burst id -> request ids
        self.tasks: set[asyncio.Task] = set()

    async def start(self, engine: AsyncEngine, body: BurstRequest) -> dict[str, Any]:
        max_len = engine.engine.max_model_len
        if body.prompt_tokens + body.output_tokens > max_len:
            raise ErrorBody(400, f"prompt_tokens + output_tokens ({body.prompt_tokens + body.output_tokens}) exceed "
                            f"max_model_len ({max_len})", param="prompt_tokens")
        burst_id = f"burst-{next(self.ids)}"
        rng = random.Random()
        vocab = engine.inputs.vocab_size
        shared = [rng.randrange(vocab) for _ in range(round(body.shared_prefix * body.prompt_tokens))]
        try:
            params = SamplingParams(max_tokens=body.output_tokens, temperature=body.temperature, ignore_eos=True)
        except SamplingParamsError as e:   # (a temperature past the sampler's bound)
            raise ErrorBody(400, str(e), param=e.field) from None
        streams: list[RequestStream] = []
        rejected = 0
        for i in range(body.requests):
            ids = shared + [rng.randrange(vocab) for _ in range(body.prompt_tokens - len(shared))]
            try:
                streams.append(await engine.add_request(f"{burst_id}-{i}", None, ids, params))
            except QueueFullError:
                rejected = body.requests - i
                break
            except TokenmillError as e:
                raise ErrorBody(400, str(e)) from None
        self.running[burst_id] = [s.request_id for s in streams]
        task = asyncio.ensure_future(self._drain(burst_id, streams))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return {"id": burst_id, "accepted": len(streams), "rejected": rejected}

    async def _drain(self, burst_id: str, streams: list[RequestStream]) -> None:
        async def read(stream: RequestStream) -> None:
            try:
                async for _ in stream:
                    pass
            except Exception as e:   # (an aborted or failed request: the feed shows it)
                logger.debug("burst request %s ended: %s", stream.request_id, e)

        try:
            await asyncio.gather(*(read(s) for s in streams))
        finally:
            self.running.pop(burst_id, None)

    def abort(self, engine: AsyncEngine) -> int:
        request_ids = [r for ids in self.running.values() for r in ids]
        for request_id in request_ids:
            engine.abort(request_id)
        return len(request_ids)


def add_web_routes(app: FastAPI, config: ServerConfig, ready_engine: Callable[[], AsyncEngine],
                   check_api_key: Callable[[Request], None],
                   read_body: Callable[[Request], Awaitable[bytes]]) -> None:
    """The routes above; `check_api_key` and `read_body` are the app's (its key check, and its
    request-body reader with the size and time limits)."""
    router = APIRouter()
    bursts = Bursts()

    def bursts_allowed() -> None:
        if not config.allow_burst:
            raise ErrorBody(403, "bursts are off on this server: start it with --allow-burst to allow them",
                            code="burst_not_allowed")

    def page(name: str) -> Callable[[], Any]:
        async def serve_page() -> FileResponse:
            return FileResponse(STATIC_DIR / name, media_type="text/html; charset=utf-8",
                                headers={"Cache-Control": "no-cache"})
        return serve_page

    router.add_api_route("/", page("chat.html"), methods=["GET"])
    router.add_api_route("/engine", page("engine.html"), methods=["GET"])

    @router.get("/engine/feed", dependencies=[Depends(check_api_key)])
    async def feed(request: Request) -> StreamingResponse:
        engine = ready_engine()
        subscription = engine.monitor.subscribe()

        async def events() -> AsyncIterator[str]:
            try:
                yield "retry: 1000\n\n"
                while True:
                    try:
                        frame = await asyncio.wait_for(subscription.queue.get(), IDLE_FRAME_INTERVAL)
                    except asyncio.TimeoutError:
                        engine.monitor.request_frame()
                        continue
                    if frame is None:
                        return
                    yield f"event: frame\ndata: {frame}\n\n"
            finally:
                engine.monitor.unsubscribe(subscription)

        return StreamingResponse(events(), media_type="text/event-stream", headers=FEED_HEADERS)

    guarded = [Depends(check_api_key), Depends(bursts_allowed)]

    @router.post("/engine/burst", dependencies=guarded)
    async def burst(request: Request) -> dict[str, Any]:
        body = parse_body(BurstRequest, await read_body(request))
        return await bursts.start(ready_engine(), body)

    @router.delete("/engine/burst", dependencies=guarded)
    async def abort_bursts() -> dict[str, Any]:
        return {"aborted": bursts.abort(ready_engine())}

    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
