"""Each step: which requests run and how many tokens each, within a token budget.

Running requests go first, in priority order (a decode is one token; a prompt that did not fit
in earlier steps continues as a chunk). Then waiting requests are admitted while there are free
sequence slots, budget and blocks; a cached prefix is reused instead of recomputed. With chunked
prefill, a prompt longer than the remaining budget is prefilled over several steps, so one long
prompt never stalls the running streams.

Blocks are allocated on demand. When a running request needs a block and none is free, the
lowest-priority running request (latest arrival among equals) is preempted: its blocks are freed
and it goes back to the waiting queue at its (priority, arrival) place, ahead of everything that
arrived after it, to be recomputed from its tokens later (its output so far is kept, so nothing
is lost or generated twice).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.kv_transfer import LoadedKV
from tokenmill.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]   # (request, num_scheduled_tokens), in batch order
    preempted: list[Request]
    # (request, its received K/V, start, end): positions [start, end) to write into its new blocks
    # before the step runs (engine/kv_transfer.py); those tokens count as computed
    loads: list[tuple[Request, LoadedKV, int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def _order(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


def _discard(queue: list[Request], request: Request) -> bool:
    """Remove `request` from `queue` (sorted by _order) if it is there: found by bisection, then by
    identity among its equals, so finishing one of n running requests is not a scan of all n."""
    key = _order(request)
    i = bisect.bisect_left(queue, key, key=_order)
    while i < len(queue) and _order(queue[i]) == key:
        if queue[i] is request:
            del queue[i]
            return True
        i += 1
    return False


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: list[Request] = []   # kept sorted by (priority, arrival)
        self.running: list[Request] = []   # kept sorted by (priority, arrival)
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=_order)   # after its equals: they arrived earlier

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        # Tokens a grammar forced (engine/grammar.py: jump-forward) leave a decoding request more than
        # one token to compute. With other requests decoding too, it computes one per step, so that
        # the step stays all single-token rows (the fast decode path); alone, it computes them at once.
        one_each = len(self.running) > 1 and all(r.num_tokens - r.num_computed_tokens <= 1 + r.num_forced_pending
                                                 for r in self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(1 if one_each else request.num_tokens - request.num_computed_tokens, budget)
            spec = request.spec_token_ids   # proposed tokens to verify (engine/speculative.py): as many as fit
            del spec[max(0, budget - n):]
            n += len(spec)
            while not self.kv.allocate_slots(request, n):
                if spec:   # verify nothing rather than preempt anyone
                    n -= len(spec)
                    spec.clear()
                    continue
                victim = self.running[-1]   # lowest priority, latest arrival
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, n))
                budget -= n
                i += 1
        loads: list[tuple[Request, LoadedKV, int, int]] = []
        if not preempted:
            self._admit(scheduled, loads, budget)
        return SchedulerOutput(scheduled, preempted, loads)

    def _admit(self, scheduled: list[tuple[Request, int]], loads: list[tuple[Request, LoadedKV, int, int]],
               budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_cached_blocks = 0 if request.needs_prompt_logprobs else self.kv.find_cached_prefix(request)
            num_cached = num_cached_blocks * self.kv.block_size
            # Received K/V beyond the cached prefix counts as computed too (the last token never: it
            # gives the logits of the first sampled token).
            num_known = num_cached
            if request.kv_load is not None:
                num_known = max(num_cached, min(request.kv_load.num_tokens, request.num_tokens - 1))
            n = request.num_tokens - num_known
            # Unchunked, a prompt waits for a step with room for all of it; one longer than any
            # step's budget (a long prompt, or prompt + output after a preemption) is chunked anyway.
            if n > budget and not self.enable_chunked_prefill and n <= self.max_num_batched_tokens:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(request, n, num_cached_blocks, num_known - num_cached):
                break
            self.waiting.pop(0)
            # Counted here, not per lookup: a request retried for many steps counts once.
            self.kv.prefix_queries += request.num_tokens
            self.kv.prefix_hits += num_cached
            if num_known > num_cached:
                loads.append((request, request.kv_load, num_cached, num_known))
            request.kv_load = None   # (used once: a preempted request recomputes)
            request.num_computed_tokens = num_known
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_order)
            scheduled.append((request, n))
            budget -= n

    def _preempt(self, request: Request) -> None:
        if not _discard(self.running, request):
            raise RuntimeError(f"preempting {request.request_id}, which is not running")
        request.spec_token_ids.clear()
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        bisect.insort(self.waiting, request, key=_order)

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request and return its blocks to the pool."""
        if not _discard(self.running, request):
            _discard(self.waiting, request)
        self.kv.free(request)
