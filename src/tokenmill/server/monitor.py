"""The live view's feed: frames of the engine's state, published while someone watches.

`GET /engine/feed` (server-sent events) streams one JSON frame every `interval` seconds while the
engine steps, and one a second while it idles. A frame carries the steps since the previous one
(their prefill / decode split against the token budget, durations), every request's state and
what it did in those steps, the requests that finished, who holds each KV block (run-length
encoded), the cumulative counters, and TTFT / inter-token latency percentiles over a recent window.
The page at /engine draws it; docs/ARCHITECTURE.md documents it as an API.

Cost: with nobody subscribed, the engine loop calls two methods per step that return at once.
With subscribers, the loop collects each step's record and, at most once per interval, takes an
engine snapshot (between steps: the loop owns the engine then) and serializes one frame that
every subscriber shares. The seconds spent so are counted (`overhead_s` in each frame), so that
the benchmark can set them against the engine's step time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.snapshot import CACHED_FREE, FREE, StepRecord

logger = logging.getLogger(__name__)

DEFAULT_FEED_INTERVAL = 0.25   # seconds between frames while the engine steps
IDLE_FRAME_INTERVAL = 1.0      # while it idles (the handler asks for one when nothing came this long)
LATENCY_WINDOW_S = 10.0        # TTFT / ITL percentiles are over the last this many seconds...
LATENCY_WINDOW_MAX = 4096      # ...and at most this many samples
MAX_STEPS_PER_FRAME = 256      # a frame after a long silence carries only the latest steps
SUBSCRIBER_BACKLOG = 8         # frames a slow reader may fall behind before it loses the oldest


def run_lengths(values: np.ndarray) -> list[int]:
    """[value, count, value, count, ...]: a pool's blocks are handed out in runs, so this is short."""
    if len(values) == 0:
        return []
    starts = np.concatenate(([0], np.flatnonzero(values[1:] != values[:-1]) + 1))
    counts = np.diff(np.append(starts, len(values)))
    return np.stack([values[starts], counts], axis=1).ravel().tolist()


def percentiles(samples: deque[tuple[float, float]], since: float) -> dict[str, float | int | None]:
    values = np.array([v for t, v in samples if t >= since])
    if len(values) == 0:
        return {"count": 0, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
    return {"count": len(values), "p50": p50, "p90": p90, "p99": p99}


class Subscription:
    """One watcher's queue of serialized frames (None: the feed ended)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str | None] = asyncio.Queue(SUBSCRIBER_BACKLOG)

    def put(self, frame: str | None) -> None:
        if self.queue.full():   # a slow reader loses its oldest frame, never the server its memory
            self.queue.get_nowait()
        self.queue.put_nowait(frame)


class EngineMonitor:
    """Owned by the AsyncEngine, whose loop task calls `between_steps` and `after_step`; every method
    runs on the event loop."""

    def __init__(self, engine: LLMEngine, wake: Callable[[], None], interval: float = DEFAULT_FEED_INTERVAL):
        self.engine = engine
        self.interval = interval
        self._wake = wake                 # wakes an idle engine loop, so that it publishes a frame
        self._subscribers: set[Subscription] = set()
        self._closed = False
        self._steps: deque[StepRecord] = deque(maxlen=MAX_STEPS_PER_FRAME)
        self._last_step = engine.num_steps
        self._phases: dict[str, str] = {}   # request id -> what it did in the frame's steps
        self._last_finished = engine.num_finished
        self._frame_requested = False
        self._last_frame = 0.0
        self.ttft: deque[tuple[float, float]] = deque(maxlen=LATENCY_WINDOW_MAX)
        self.itl: deque[tuple[float, float]] = deque(maxlen=LATENCY_WINDOW_MAX)
        self.overhead_s = 0.0             # seconds the engine loop spent on the feed
        self.num_frames = 0

    @property
    def watching(self) -> bool:
        return bool(self._subscribers)

    def subscribe(self) -> Subscription:
        subscription = Subscription()
        if self._closed:
            subscription.put(None)
            return subscription
        if not self._subscribers:   # start afresh: what happened unwatched is not collected
            self._steps.clear()
            self._phases.clear()
            self._last_step = self.engine.num_steps
            self._last_finished = self.engine.num_finished
        self._subscribers.add(subscription)
        self.request_frame()
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    def request_frame(self) -> None:
        """Publish a frame at the engine loop's next chance (a new watcher, or an idle second)."""
        self._frame_requested = True
        self._wake()

    def close(self) -> None:
        """End every feed, and take no more subscribers (the server is shutting down)."""
        self._closed = True
        self._end_feeds()

    def _end_feeds(self) -> None:
        for subscription in self._subscribers:
            subscription.put(None)
        self._subscribers.clear()

    def observe(self, kind: str, seconds: float, now: float) -> None:
        """A TTFT ("ttft") or inter-token latency ("itl") sample, from the engine front."""
        if self._subscribers:
            (self.ttft if kind == "ttft" else self.itl).append((now, seconds))

    # ---- called by the engine loop ------------------------------------------------------------

    def after_step(self) -> None:
        if self._subscribers:
            self._guarded(self._collect)

    def between_steps(self) -> None:
        """Before the loop waits or steps: publish a frame asked for, or the last one before idling."""
        if self._subscribers and (self._frame_requested or (self._steps and not self.engine.has_unfinished())):
            self._guarded(self._publish)

    def _guarded(self, work: Callable[[], None]) -> None:
        """Runs `work`, counting its time; a failure ends the feeds, never reaches the engine loop
        (where it would fail every request)."""
        start = time.perf_counter()
        try:
            work()
        except Exception:
            logger.exception("the live view's feed failed; ending its streams")
            self._end_feeds()
        self.overhead_s += time.perf_counter() - start

    def _collect(self) -> None:
        record = self.engine.last_step
        if record is not None and record.step > self._last_step:
            self._last_step = record.step
            self._steps.append(record)
            for row in record.rows:
                if self._phases.get(row.request_id) != "prefill":   # a prefill in the frame shows over decodes
                    self._phases[row.request_id] = row.kind
        if time.monotonic() - self._last_frame >= self.interval:
            self._publish()

    # ---- frames -------------------------------------------------------------------------------

    def _publish(self) -> None:
        frame = json.dumps(self.frame(), separators=(",", ":"))
        for subscription in self._subscribers:
            subscription.put(frame)
        self._frame_requested = False
        self._last_frame = time.monotonic()
        self.num_frames += 1

    def frame(self) -> dict:
        """The frame now (between steps), consuming the steps and finished requests collected."""
        engine = self.engine
        snapshot = engine.snapshot()
        stats = engine.stats()
        now_wall, now = time.time(), time.monotonic()

        def wall(t: float) -> float:
            return now_wall - (now - t)

        steps = [{"step": r.step, "time": wall(r.start), "duration": r.duration, "budget": r.budget,
                  "prefill_tokens": r.num_prefill_tokens, "prefill_chunks": r.num_prefill_chunks,
                  "decode_tokens": r.num_decode_tokens, "decodes": r.num_decodes, "preempted": r.num_preempted,
                  "running": r.num_running, "waiting": r.num_waiting} for r in self._steps]
        requests = [{"id": v.request_id, "status": v.status, "phase": self._phases.get(v.request_id, v.status),
                     "priority": v.priority, "arrival": wall(v.arrival_time), "prompt_tokens": v.num_prompt_tokens,
                     "output_tokens": v.num_output_tokens, "computed_tokens": v.num_computed_tokens,
                     "max_tokens": v.max_tokens, "blocks": v.num_blocks, "cached_tokens": v.num_cached_tokens,
                     "preemptions": v.num_preemptions} for v in snapshot.requests]
        new_finished = min(engine.num_finished - self._last_finished, len(engine.finished_log))
        finished = [{"id": request_id, "reason": reason}
                    for request_id, reason in list(engine.finished_log)[len(engine.finished_log) - new_finished:]]
        self._last_finished = engine.num_finished
        self._steps.clear()
        self._phases.clear()
        owner = snapshot.block_owner
        num_cached_free = int(np.count_nonzero(owner == CACHED_FREE))
        num_free = int(np.count_nonzero(owner == FREE))
        since = now - LATENCY_WINDOW_S
        return {
            "time": now_wall,
            "step": snapshot.step,
            "config": {"num_kv_blocks": len(owner), "block_size": snapshot.block_size,
                       "max_num_seqs": snapshot.max_num_seqs,
                       "max_num_batched_tokens": snapshot.max_num_batched_tokens,
                       "max_model_len": engine.max_model_len},
            "counters": {"prompt_tokens": stats.prompt_tokens, "generation_tokens": stats.generation_tokens,
                         "prefix_cache_queries": stats.prefix_cache_queries,
                         "prefix_cache_hits": stats.prefix_cache_hits, "preemptions": stats.num_preemptions,
                         "finished": engine.num_finished},
            "now": {"running": stats.num_running, "waiting": sum(v.status == "waiting" for v in snapshot.requests),
                    "preempted": sum(v.status == "preempted" for v in snapshot.requests),
                    "kv_blocks_used": len(owner) - num_free - num_cached_free, "kv_blocks_cached_free": num_cached_free,
                    "kv_blocks_free": num_free},
            "latency": {"window_s": LATENCY_WINDOW_S, "ttft": percentiles(self.ttft, since),
                        "itl": percentiles(self.itl, since)},
            "steps": steps,
            "requests": requests,
            "finished": finished,
            "blocks": {"owner": run_lengths(owner), "refs": run_lengths(snapshot.block_refs)},
            "monitor": {"overhead_s": self.overhead_s, "frames": self.num_frames, "interval": self.interval},
        }
