"""Each step: which requests run and how many tokens each, within a token budget.

Running requests go first (a decode is one token; a prompt that did not fit in earlier steps
continues as a chunk), then waiting requests are admitted first-come-first-served while there are
free sequence slots, budget and blocks. A prompt longer than the remaining budget is prefilled in
chunks over several steps, so one long prompt never stalls the running streams.

Admission reserves the blocks for the request's whole life (prompt + max_tokens), so a running
request can never run out of cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tokenmill.engine.kv_cache import BlockPool
from tokenmill.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]   # (request, num_scheduled_tokens), in batch order

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def blocks_needed(self, request: Request) -> int:
        return -(-(len(request.prompt_token_ids) + request.max_tokens) // self.block_size)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        for request in self.running:
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n > 0:
                scheduled.append((request, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            need = self.blocks_needed(request)
            if need > self.pool.num_free:
                break
            self.waiting.popleft()
            request.block_ids = self.pool.allocate(need)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            n = min(request.num_tokens, budget)
            scheduled.append((request, n))
            budget -= n
        return SchedulerOutput(scheduled)

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request and return its blocks to the pool."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.block_ids)
        request.block_ids = []
