"""The asyncio front of the engine: one background task steps it; each request has its own stream.

Who touches the engine: only the loop task below, one thing at a time. HTTP handlers never call
the engine; they queue an add or an abort and wake the loop, which applies queued adds and aborts
between steps and runs each step (schedule -> model -> outputs) in a worker thread, so the event
loop keeps serving other connections while the model runs. An abort therefore takes effect
(blocks freed) right after the step in flight, at most one step later.

    handler --add/abort--> pending --(between steps)--> OutputProcessor / LLMEngine
    loop: apply pending -> await step in thread -> hand each changed output to its stream

A stream holds only the latest cumulative output (a snapshot: the processor keeps updating its
own objects), so a slow reader costs no memory; the reader computes deltas itself.

While the engine is busy, a second task logs one stats line every `stats_log_interval` seconds
(throughputs, running / waiting, KV usage, prefix-cache hits, preemptions over the interval) and
one more when it goes idle. It reads the engine's counters from the event loop: the engine thread
only counts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tokenmill.engine.engine import EngineStats, LLMEngine
from tokenmill.engine.input import InputProcessor
from tokenmill.engine.output import OutputProcessor
from tokenmill.errors import EngineDeadError, TokenmillError
from tokenmill.outputs import RequestOutput, snapshot_output
from tokenmill.sampling import SamplingParams
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.monitor import EngineMonitor

logger = logging.getLogger(__name__)
# A logger of its own so that the periodic line can be silenced alone (its level set to WARNING)
# while the engine's errors still show; under "tokenmill", so `--log-level` reaches it.
stats_logger = logging.getLogger("tokenmill.server.stats")
request_logger = logging.getLogger("tokenmill.server.requests")

DEFAULT_STATS_LOG_INTERVAL = 5.0   # seconds; vLLM logs its stats line every 5 s too


def engine_thread() -> ThreadPoolExecutor:
    """The one thread that should run every PyTorch / kernel call of a served model, its loading
    included. libgomp keeps a thread pool per calling thread and, once its threads outnumber the
    cores, stops spinning between parallel regions: every region then waits for a futex wake-up.
    Loading in one thread and stepping in another made each decode step ~3x slower (measured:
    33 vs 10 ms per token at batch 1)."""
    return ThreadPoolExecutor(1, thread_name_prefix="tokenmill-engine")


class QueueFullError(Exception):
    """Accepting the request would queue more sequences than `max_queued_requests` allows."""


class EngineStoppedError(Exception):
    """The engine is shutting down (or its step failed) and takes no more requests."""


class RequestFailedError(Exception):
    """This request failed inside the engine (the others in its step went on); the message says why.
    `param`: the SamplingParams field whose value made it fail, when its own input did (then `error`,
    the engine's message, begins with that field's name); else None."""

    def __init__(self, error: str, param: str | None = None):
        super().__init__(f"the request failed in the engine: {error}")
        self.error, self.param = error, param


class RequestStream:
    """One request's outputs: `async for out in stream` yields cumulative RequestOutputs (the
    latest each time; intermediate ones may be skipped), the last with `finished` set."""

    def __init__(self, request_id: str, num_prompt_tokens: int, num_seqs: int):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_seqs = num_seqs
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_output_tokens = 0
        self.finished = False
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            await self._event.wait()
            self._event.clear()
            if self._error is not None:
                raise self._error
            output = self._latest
            yield output
            if output.finished:
                return


@dataclass(frozen=True)
class StatsInterval:
    """What one periodic stats line says: the engine's work over `seconds` and its state at the end.
    Each line's log record carries it as `record.engine_stats`, for handlers that want numbers."""
    seconds: float
    prompt_tokens: int            # prompt tokens computed (prefix-cache hits are not work)
    generation_tokens: int
    num_running: int              # sequences, now
    num_waiting: int
    kv_blocks_used: float         # fraction of the pool held by requests, now
    prefix_cache_queries: int     # prompt tokens admitted
    prefix_cache_hits: int        # of which the prefix cache served
    num_preemptions: int
    spec_num_drafts: int = 0          # speculative decoding: request-steps that verified proposals
    spec_num_draft_tokens: int = 0    # proposed tokens verified
    spec_num_accepted_tokens: int = 0
    spec_row_cost: float | None = None   # now
    spec_proposal_cost: float | None = None   # now

    @classmethod
    def between(cls, before: EngineStats, after: EngineStats, seconds: float) -> StatsInterval:
        return cls(seconds, after.prompt_tokens - before.prompt_tokens,
                   after.generation_tokens - before.generation_tokens, after.num_running, after.num_waiting,
                   (after.num_kv_blocks - after.num_free_kv_blocks) / after.num_kv_blocks,
                   after.prefix_cache_queries - before.prefix_cache_queries,
                   after.prefix_cache_hits - before.prefix_cache_hits, after.num_preemptions - before.num_preemptions,
                   after.spec_num_drafts - before.spec_num_drafts,
                   after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                   after.spec_num_accepted_tokens - before.spec_num_accepted_tokens, after.spec_row_cost,
                   after.spec_proposal_cost)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """0 when no prompt was admitted in the interval (as /metrics' gauge)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def log(self) -> None:
        # Worded as vLLM's line, so that habits and log-scraping scripts carry over.
        stats_logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                          "Running: %d seqs, Waiting: %d seqs, KV blocks used: %.1f%%, "
                          "Prefix cache hit rate: %.1f%%, Preemptions: %d",
                          self.prompt_tokens / self.seconds, self.generation_tokens / self.seconds,
                          self.num_running, self.num_waiting, 100 * self.kv_blocks_used,
                          100 * self.prefix_cache_hit_rate, self.num_preemptions, extra={"engine_stats": self})
        if self.spec_num_draft_tokens:
            stats_logger.info("SpecDecoding metrics: Draft acceptance rate: %.1f%%, Mean acceptance length: %.2f, "
                              "Accepted: %d tokens, Drafted: %d tokens, Row cost: %.2f, Proposal cost: %.3f",
                              100 * self.spec_num_accepted_tokens / self.spec_num_draft_tokens,
                              1 + self.spec_num_accepted_tokens / self.spec_num_drafts,
                              self.spec_num_accepted_tokens, self.spec_num_draft_tokens, self.spec_row_cost,
                              self.spec_proposal_cost,
                              extra={"engine_stats": self})


@dataclass
class _PendingAdd:
    stream: RequestStream
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    accepted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class AsyncEngine:
    """Runs `engine` in the background for concurrent async callers; `inputs` is its input
    processor (the one `load_engine` made with it), for the handlers that prepare requests.

    Backpressure: at most `max_num_seqs + max_queued_requests` sequences (a request with n samples
    counts n) are in flight; `add_request` raises QueueFullError past that instead of queueing
    without limit.

    `stats_log_interval`: seconds between the INFO stats lines logged while busy (None: none).

    `executor`: the one thread to step the engine in (the thread that loaded it, ideally: see
    engine_thread); `stop` shuts it down unless `keep_executor` (its owner steps more engines in it).

    `log_requests`: log each request at INFO (logger tokenmill.server.requests) when it is accepted
    (its prompt and at most `max_log_len` of its characters and token ids, None: all; its sampling
    parameters) and when it ends (how, its token counts and time), as vLLM's --enable-log-requests.

    `on_fatal(error)`: called once if the engine dies (errors.EngineDeadError: a tensor-parallel
    worker is gone); every request in flight has failed by then and no more are taken."""

    def __init__(self, engine: LLMEngine, inputs: InputProcessor, max_queued_requests: int,
                 metrics: ServerMetrics | None = None,
                 executor: ThreadPoolExecutor | None = None,
                 stats_log_interval: float | None = DEFAULT_STATS_LOG_INTERVAL, keep_executor: bool = False,
                 on_fatal: Callable[[BaseException], None] | None = None, log_requests: bool = False,
                 max_log_len: int | None = None):
        if isinstance(max_queued_requests, bool) or not isinstance(max_queued_requests, int) or \
                max_queued_requests < 0:
            raise TokenmillError(f"max_queued_requests must be an integer >= 0, got {max_queued_requests!r}")
        if stats_log_interval is not None and (isinstance(stats_log_interval, bool) or
                                               not isinstance(stats_log_interval, (int, float)) or
                                               not stats_log_interval > 0):
            raise TokenmillError(f"stats_log_interval must be a number of seconds > 0 or None, "
                                 f"got {stats_log_interval!r}")
        self.engine = engine
        self.inputs = inputs
        self.max_queued_requests = max_queued_requests
        self.capacity = self.engine.config.max_num_seqs + max_queued_requests
        self.metrics = metrics
        self._processor = OutputProcessor(engine, inputs.tokenizer)
        self._executor = executor or engine_thread()
        self._keep_executor = keep_executor and executor is not None
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: list[str] = []
        self._pending_fail_all: BaseException | None = None
        self._failed_all = False
        self._num_seqs = 0            # sequences of accepted or pending requests not finished yet
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task | None = None
        self.stats_log_interval = stats_log_interval
        self._stats_task: asyncio.Task | None = None
        self._busy = asyncio.Event()   # set by the loop when it steps; cleared by the stats task once idle
        self._busy_since = 0.0
        self.monitor = EngineMonitor(engine, self._wake.set)   # the live view's feed (GET /engine/feed)
        self.on_fatal = on_fatal
        self.fatal_error: BaseException | None = None
        self.log_requests = log_requests
        self.max_log_len = max_log_len

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="tokenmill-engine-loop")
        if self.stats_log_interval is not None:
            # The counters' baseline is read now, before the loop can run a step in its thread.
            self._stats_task = loop.create_task(self._log_stats(self.engine.stats()), name="tokenmill-stats-log")

    async def stop(self) -> None:
        """Abort whatever is still in flight, stop the loop and its thread."""
        self._stopping = True
        self.monitor.close()
        self._wake.set()
        if self._task is not None:
            await self._task
        if self._stats_task is not None:
            self._stats_task.cancel()
            await asyncio.wait([self._stats_task])   # wait() raises nothing: the task's CancelledError stays in it
        for add in self._pending_adds:
            if not add.accepted.done():
                add.accepted.set_exception(EngineStoppedError("the server is shutting down"))
        self._pending_adds.clear()
        for request_id in list(self._streams):
            self._abort_now(request_id, EngineStoppedError("the server is shutting down"))
        if not self._keep_executor:
            self._executor.shutdown(wait=True)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping and not self._failed_all

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- requests -----------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                          params: SamplingParams, priority: int = 0) -> RequestStream:
        """Queue a request (`priority`: lower runs first); returns its stream once the engine accepted
        it. Raises QueueFullError when full, TokenmillError when the engine refuses it (e.g. the prompt
        is too long)."""
        if not self.is_running:
            raise EngineStoppedError("the server is shutting down")
        self.check_capacity("n", f"{params.n} samples", params.n)
        if self._num_seqs + params.n > self.capacity:
            raise QueueFullError(f"the server is at capacity ({self._num_seqs} sequences in flight, "
                                 f"{self.capacity} allowed); retry later")
        stream = RequestStream(request_id, len(prompt_token_ids), params.n)
        add = _PendingAdd(stream, prompt, prompt_token_ids, params, priority)
        self._num_seqs += params.n
        self._pending_adds.append(add)
        self._wake.set()
        try:
            await add.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def check_capacity(self, field: str, what: str, num_seqs: int) -> None:
        """Refuse (TokenmillError naming `field`) `num_seqs` sequences that could never be in flight at
        once: a request to correct, not a 429 to retry."""
        if num_seqs > self.capacity:
            raise TokenmillError(f"{field}: {what} exceed the server's capacity of {self.capacity} sequences "
                                 "(--max-num-seqs + --max-queued-requests)")

    def abort(self, request_id: str) -> None:
        """Abort a request (its client went away); a no-op for one that already finished."""
        for add in self._pending_adds:
            if add.stream.request_id == request_id:
                self._pending_adds.remove(add)
                self._num_seqs -= add.stream.num_seqs
                return
        if request_id in self._streams and request_id not in self._pending_aborts:
            self._pending_aborts.append(request_id)
            self._wake.set()

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error` (its stream raises it), between steps; used
        when a graceful shutdown's time is up, so that streams end with an error event instead
        of being cut."""
        self._pending_fail_all = error
        self._failed_all = True   # and take no more: a request still uploading would run past the drain
        self._wake.set()

    # ---- the loop -----------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._wake.clear()
            try:
                self._apply_pending()
                self.monitor.between_steps()
                if not self._processor.has_unfinished():
                    await self._wake.wait()
                    continue
                if not self._busy.is_set():   # work after an idle spell: the stats interval starts now
                    self._busy_since = time.monotonic()
                    self._busy.set()
                outputs = await loop.run_in_executor(self._executor, self._step)
                self._dispatch(outputs, time.monotonic())
                self.monitor.after_step()

            except Exception as e:   # a bug outside any one request (LLMEngine.step isolates those): fail all
                logger.exception("engine step failed; aborting %d requests", len(self._streams))
                for request_id in list(self._streams):
                    try:
                        self._abort_now(request_id, RequestFailedError(f"engine step failed: {type(e).__name__}: {e}"),
                                        status="error")
                    except Exception:
                        logger.exception("aborting %s failed", request_id)
                if isinstance(e, EngineDeadError):   # it cannot step again: take no more, tell the server
                    self.fatal_error = e
                    self._failed_all = True
                    if self.on_fatal is not None:
                        self.on_fatal(e)
                    return

    async def _log_stats(self, last: EngineStats) -> None:
        """Every `stats_log_interval` seconds while the engine is busy, one line of what the engine
        did in the interval; one more, showing nothing running or waiting, when it goes idle; then
        nothing until the loop steps again. Counters are read here, in the event loop, as /metrics
        reads them: the engine thread does nothing for this but count."""
        last_time = time.monotonic()
        while True:
            await self._busy.wait()
            start = max(last_time, self._busy_since)   # an idle spell is no part of an interval
            await asyncio.sleep(max(0.0, start + self.stats_log_interval - time.monotonic()))
            now, stats = time.monotonic(), self.engine.stats()
            StatsInterval.between(last, stats, now - start).log()
            last, last_time = stats, now
            if stats.num_running == stats.num_waiting == 0:
                self._busy.clear()

    def _step(self) -> list[RequestOutput]:
        """In the worker thread: one engine step, its outputs copied for the readers."""
        return [snapshot_output(out) for out in self._processor.process(self.engine.step())]

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for add in adds:
            stream = add.stream
            if add.accepted.done():   # its handler was cancelled while it waited: nobody will read it
                self._num_seqs -= stream.num_seqs
                continue
            try:
                self._processor.add_request(stream.request_id, add.prompt, add.prompt_token_ids, add.params,
                                            add.priority)
            except Exception as e:
                self._num_seqs -= stream.num_seqs
                add.accepted.set_exception(e)
                continue
            self._streams[stream.request_id] = stream
            add.accepted.set_result(None)
            if self.log_requests:
                cut = slice(self.max_log_len)
                request_logger.info("received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                                    stream.request_id, None if add.prompt is None else add.prompt[cut], add.params,
                                    add.prompt_token_ids[cut])
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(stream.num_prompt_tokens)
        aborts, self._pending_aborts = self._pending_aborts, []
        for request_id in aborts:
            self._abort_now(request_id, None)
        error, self._pending_fail_all = self._pending_fail_all, None
        if error is not None:
            for request_id in list(self._streams):
                self._abort_now(request_id, error)

    def _abort_now(self, request_id: str, error: BaseException | None, status: str = "abort") -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        try:
            self._processor.abort(request_id)
        finally:
            self._num_seqs -= stream.num_seqs
            stream.finished = True
            if error is not None:
                stream._fail(error)
            if self.metrics is not None:
                self.metrics.count(status)
            if self.log_requests:
                if error is None:
                    request_logger.info("aborted request %s", request_id)
                else:
                    request_logger.info("failed request %s: %s", request_id, error)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            self._observe(stream, output, now)
            if output.error is not None:
                stream._fail(RequestFailedError(output.error, output.error_param))
            else:
                stream._put(output)
            if output.finished:
                del self._streams[output.request_id]
                self._num_seqs -= stream.num_seqs
                stream.finished = True
                if self.log_requests:
                    how = f"failed ({output.error})" if output.error is not None else \
                        "finish_reason " + ", ".join(str(o.finish_reason) for o in output.outputs)
                    request_logger.info("finished request %s: %s; %d prompt and %d output tokens in %.3f s",
                                        output.request_id, how, stream.num_prompt_tokens,
                                        stream.num_output_tokens, now - stream.arrival_time)

    def _observe(self, stream: RequestStream, output: RequestOutput, now: float) -> None:
        num_tokens = sum(len(o.token_ids) for o in output.outputs)
        new = num_tokens - stream.num_output_tokens
        stream.num_output_tokens = num_tokens
        m = self.metrics
        if new > 0:
            if stream.first_token_time is None:
                stream.first_token_time = now
                self.monitor.observe("ttft", now - stream.arrival_time, now)
                if m is not None:
                    m.ttft.observe(now - stream.arrival_time)
            else:
                self.monitor.observe("itl", now - stream.last_token_time, now)
                if m is not None:
                    m.itl.observe(now - stream.last_token_time)
            stream.last_token_time = now
            if m is not None:
                m.generation_tokens.inc(new)
        if output.finished and m is not None:
            m.e2e.observe(now - stream.arrival_time)
            reasons = {o.finish_reason for o in output.outputs}
            if output.error is not None:   # (ended by its own input: invalid, as a request refused at once)
                m.count("invalid" if output.error_param is not None else "error")
            else:
                m.count("abort" if "abort" in reasons else "length" if "length" in reasons else "stop")
