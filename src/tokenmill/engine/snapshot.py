"""What a watcher of the engine sees: a record of each step, and a snapshot of the engine's state.

A `StepRecord` is made by every `LLMEngine.step` (a few sums over the scheduled batch: nothing
measurable next to the step). An `EngineSnapshot` (every request's state, and who holds each KV
block) costs a pass over the pool, so it is taken only when someone asks, between steps: the
server's live view (server/monitor.py) takes one a few times a second while a page watches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.engine.request import Request, RequestStatus

# Owner codes in EngineSnapshot.block_owner besides a request's index.
FREE = -1          # in the free queue, holding nothing reusable
CACHED_FREE = -2   # in the free queue, still holding a cached prefix block (revived on a hit, else evicted)


@dataclass(frozen=True)
class ScheduledRow:
    """One request's part of a step."""
    request_id: str
    kind: str           # "prefill" (a prompt chunk, or a preempted request's recomputation) or "decode"
    num_tokens: int     # tokens computed for it in the step (a decode verifying proposals: 1 + proposals)


@dataclass(frozen=True)
class StepRecord:
    step: int                  # the engine's step counter (1 for its first step)
    start: float               # time.monotonic() when the step began
    duration: float            # seconds: schedule + model + sampling + bookkeeping
    budget: int                # max_num_batched_tokens: the most tokens a step may schedule
    num_prefill_tokens: int
    num_prefill_chunks: int    # requests that had a prefill chunk in the step
    num_decode_tokens: int
    num_decodes: int           # requests that decoded in the step
    num_preempted: int         # requests preempted to make room in this step
    num_running: int           # after the step
    num_waiting: int
    rows: tuple[ScheduledRow, ...]


def scheduled_rows(scheduled: list[tuple[Request, int]]) -> tuple[ScheduledRow, ...]:
    """Before a step runs: which of its rows are prefill and which decode. A request decodes once
    it has output and at most its last token (with proposals, or grammar-forced tokens, after it)
    is left to compute; anything else (a prompt chunk, a preempted request's recomputation) is
    prefill."""
    rows = []
    for request, n in scheduled:
        decoding = bool(request.output_token_ids) and \
            request.num_computed_tokens >= request.num_tokens - 1 - request.num_forced_pending
        rows.append(ScheduledRow(request.request_id, "decode" if decoding else "prefill", n))
    return tuple(rows)


def step_record(step: int, start: float, duration: float, budget: int, rows: tuple[ScheduledRow, ...],
                num_preempted: int, num_running: int, num_waiting: int) -> StepRecord:
    prefill = [r.num_tokens for r in rows if r.kind == "prefill"]
    decode = [r.num_tokens for r in rows if r.kind == "decode"]
    return StepRecord(step, start, duration, budget, sum(prefill), len(prefill), sum(decode), len(decode),
                      num_preempted, num_running, num_waiting, rows)


@dataclass(frozen=True)
class RequestView:
    request_id: str
    status: str                 # "running" | "waiting" | "preempted" (waiting to be recomputed)
    priority: int
    arrival_time: float         # time.monotonic()
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    max_tokens: int
    num_blocks: int             # blocks it holds now (shared ones included)
    num_cached_tokens: int      # prompt tokens the prefix cache served at admission
    num_preemptions: int


@dataclass(frozen=True)
class EngineSnapshot:
    step: int                       # steps run so far
    requests: list[RequestView]     # running (batch order), then waiting (queue order)
    block_owner: np.ndarray         # int32 [num_blocks]: index into `requests`, FREE or CACHED_FREE
    block_refs: np.ndarray          # int32 [num_blocks]: reference counts (> 1: a shared prefix block)
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


def held_blocks(request: Request) -> list[int]:
    """The blocks `request` holds, in every KV cache group (not those given back behind a window)."""
    return [b for table in request.tables for b in table.block_ids[table.num_released:]]


def request_view(request: Request) -> RequestView:
    if request.status is RequestStatus.RUNNING:
        status = "running"
    else:
        status = "preempted" if request.num_preemptions else "waiting"
    held = held_blocks(request)
    return RequestView(request.request_id, status, request.priority, request.arrival_time,
                       len(request.prompt_token_ids), len(request.output_token_ids), request.num_computed_tokens,
                       request.max_tokens, len(held), request.num_cached_tokens, request.num_preemptions)


def take_snapshot(step: int, running: list[Request], waiting: list[Request], ref_count: list[int],
                  cached_free_blocks: list[int], block_size: int, max_num_seqs: int,
                  max_num_batched_tokens: int) -> EngineSnapshot:
    """Between steps only (a step changes the block tables as it runs). A block shared by several
    requests is shown as the earliest one's (the one listed first)."""
    requests = running + waiting
    owner = np.full(len(ref_count), FREE, dtype=np.int32)
    owner[np.asarray(cached_free_blocks, dtype=np.int64)] = CACHED_FREE
    for i in range(len(requests) - 1, -1, -1):   # backwards, so that the first holder of a shared block wins
        held = held_blocks(requests[i])
        if held:
            owner[np.asarray(held, dtype=np.int64)] = i
    refs = np.asarray(ref_count, dtype=np.int32)
    return EngineSnapshot(step, [request_view(r) for r in requests], owner, refs, block_size, max_num_seqs,
                          max_num_batched_tokens)
