"""The Scheduler driven directly, with no model: a fake step advances `num_computed_tokens` by what
was scheduled and appends a token that is a fixed function of the request's tokens so far (a
deterministic "model", so recomputation after preemption and prefix-cache hits must reproduce it).

Besides the K/V bookkeeping the fake step keeps a fake KV cache: every slot a step writes holds
the identity of the prefix it was computed from. After every step each scheduled request must see,
through its block table, exactly its own prefix in every slot it attends over -- the
no-model version of "paged attention reads the right K/V", through preemptions and cache hits.

With `speculate`, decoding requests verify proposed tokens (some right, some wrong) as the engine's
speculative decoding does: rejected rows' K/V roll back (block-table truncation), and the same
checks must hold (a rolled-back slot is never read before it is written again, and never enters
the prefix cache).

The hypothesis test runs random arrivals, prompt lengths, priorities, aborts, pool sizes,
budgets and speculation and checks after every step: the budget and sequence limits hold, every step makes
progress while work remains, blocks are neither leaked nor double counted, no cached (shared)
block is ever written, victims of preemption are the lowest-priority latest requests, and every
request finishes with exactly the tokens it would get alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tokenmill.engine.kv_cache import BlockPool, KVCacheManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerOutput

VOCAB = 5


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole context."""
    return hash(tuple(tokens)) % VOCAB


def solo_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, priority: int = 0,
                 arrival: float = 0.0) -> Request:
    from tokenmill.sampling import SamplingParams

    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0), max_tokens,
                   frozenset(), arrival_time=arrival, priority=priority)


@dataclass
class Sim:
    """A scheduler over a pool, plus the fake engine step and the invariant checks."""

    num_blocks: int
    block_size: int = 4
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 16
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    speculate: bool = False   # decoding requests verify proposals, some wrong (engine/speculative.py)
    slots: dict[int, int] = field(default_factory=dict)   # fake KV: slot -> hash of the prefix it holds
    finished: list[Request] = field(default_factory=list)

    def __post_init__(self):
        self.pool = BlockPool(self.num_blocks)
        self.kv = KVCacheManager(self.pool, self.block_size, self.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, self.max_num_seqs, self.max_num_batched_tokens,
                                   self.enable_chunked_prefill)

    def add(self, request: Request) -> Request:
        self.scheduler.add(request)
        return request

    def abort(self, request: Request) -> None:
        request.finish("abort")
        self.scheduler.remove(request)
        assert request.block_ids == [], "an aborted request's blocks go back at once"
        self.check_pool()

    def propose(self) -> None:
        """Proposals for the decoding requests: the true continuation up to a point, then wrong
        tokens (how many of each: a fixed function of the request's state)."""
        for request in self.scheduler.running:
            if request.num_tokens - request.num_computed_tokens == 1:
                key = hash((request.request_id, request.num_tokens))
                k = min(key % 4, request.max_tokens - len(request.output_token_ids) - 1)
                truth = solo_output(request.all_token_ids, k)
                right = (key // 4) % (k + 1)
                request.spec_token_ids = truth[:right] + [(t + 1) % VOCAB for t in truth[right:]]

    def step(self) -> SchedulerOutput:
        if self.speculate:
            self.propose()
        running_before = list(self.scheduler.running)
        cached_before = dict(self.pool.block_hash)
        out = self.scheduler.schedule()
        self.check_schedule(out, running_before, cached_before)
        # "Run the model": write each scheduled token's K/V (all writes before any read, like a layer).
        for request, n in out.scheduled:
            tokens = request.all_token_ids + request.spec_token_ids
            for pos in range(request.num_computed_tokens, request.num_computed_tokens + n):
                self.slots[self.slot(request, pos)] = hash(tuple(tokens[:pos + 1]))
        for request, n in out.scheduled:
            tokens = request.all_token_ids + request.spec_token_ids
            end = request.num_computed_tokens + n
            seen = [self.slots.get(self.slot(request, pos)) for pos in range(end)]
            assert seen == [hash(tuple(tokens[:pos + 1])) for pos in range(end)], \
                f"request {request.request_id} attends over K/V of another prefix"
        # Postprocess like LLMEngine.step: proposals are accepted while they are the model's tokens;
        # rejected rows roll back.
        new_tokens = {}
        for request, n in out.scheduled:
            spec = request.spec_token_ids
            new = []
            if request.num_computed_tokens + n == request.num_tokens + len(spec):
                truth = solo_output(request.all_token_ids, len(spec) + 1)
                accepted = next((j for j, t in enumerate(spec) if t != truth[j]), len(spec))
                new = truth[:accepted + 1]
                n -= len(spec) - accepted
            request.num_computed_tokens += n
            if spec:
                self.kv.truncate(request)
                spec.clear()
            self.kv.cache_full_blocks(request)
            new_tokens[request.request_id] = new
        for request in self.scheduler.running:
            request.spec_token_ids.clear()   # (not scheduled this step)
        for request, _ in out.scheduled:
            for token in new_tokens[request.request_id]:
                request.append_token(token)
                if len(request.output_token_ids) >= request.max_tokens:
                    request.finish("length")
                    self.scheduler.remove(request)
                    self.finished.append(request)
                    break
        self.check_pool()
        return out

    def slot(self, request: Request, pos: int) -> int:
        return request.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def check_schedule(self, out: SchedulerOutput, running_before: list[Request],
                       cached_before: dict[int, bytes]) -> None:
        sched = self.scheduler
        requests = [r for r, _ in out.scheduled]
        assert len(requests) == len(set(map(id, requests)))
        assert all(n > 0 for _, n in out.scheduled)
        assert out.num_scheduled_tokens <= self.max_num_batched_tokens
        assert len(sched.running) <= self.max_num_seqs
        assert all(r.status is RequestStatus.RUNNING for r in sched.running)
        assert all(r.status is RequestStatus.WAITING and r.block_ids == [] for r in sched.waiting)
        assert {id(r) for r in requests} <= {id(r) for r in sched.running}
        for request, n in out.scheduled:
            end = request.num_computed_tokens + n
            assert end <= request.num_tokens + len(request.spec_token_ids)
            assert not request.spec_token_ids or end == request.num_tokens + len(request.spec_token_ids)
            assert len(request.block_ids) == self.kv.blocks_for(end), "blocks are allocated on demand"
            if not self.enable_chunked_prefill:
                assert end == request.num_tokens + len(request.spec_token_ids) or \
                    request.num_tokens > self.max_num_batched_tokens, \
                    "without chunked prefill a request that fits one step runs whole"
            # No request writes into a block that already held cached K/V.
            first, last = request.num_computed_tokens // self.block_size, (end - 1) // self.block_size
            for block in request.block_ids[first:last + 1]:
                assert not (block in cached_before and self.pool.block_hash.get(block) == cached_before[block]), \
                    f"request {request.request_id} writes into cached block {block}"
        for victim in out.preempted:
            assert any(victim is r for r in running_before), "only running requests are preempted"
            assert victim.status is RequestStatus.WAITING and victim.num_computed_tokens == 0
            # The victims are the lowest-priority, latest-arriving running requests.
            for r in sched.running:
                assert (r.priority, r.arrival_time) < (victim.priority, victim.arrival_time)
        if out.preempted:
            assert {id(r) for r in sched.running} <= {id(r) for r in running_before}, \
                "no admission in a step that preempted"

    def check_pool(self) -> None:
        pool, sched = self.pool, self.scheduler
        assert pool.num_free + sum(r > 0 for r in pool.ref_count) == pool.num_blocks
        assert set(pool.free_queue) == {b for b in range(pool.num_blocks) if pool.ref_count[b] == 0}
        refs = [0] * pool.num_blocks
        for request in sched.running:
            for b in request.block_ids:
                refs[b] += 1
        assert refs == pool.ref_count, "reference counts must match the block tables"
        assert all(b in pool.block_hash for b in range(pool.num_blocks) if pool.ref_count[b] > 1)

    def run(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_unfinished():
            steps += 1
            assert steps <= max_steps, "no progress"
            self.step()
        assert self.pool.num_free == self.pool.num_blocks
        return steps


def budgets(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


# ---- token budget, chunked prefill, sequence limit --------------------------------------------------


def test_token_budget_and_chunked_prefill():
    sim = Sim(num_blocks=32, max_num_batched_tokens=8)
    a, b, c = (sim.add(make_request(x, [1] * 10 if x == "a" else [2 + i] * 10, max_tokens=3, arrival=i))
               for i, x in enumerate("abc"))
    assert budgets(sim.step()) == [("a", 8)]
    assert budgets(sim.step()) == [("a", 2), ("b", 6)]            # a completes and samples its first token
    assert a.output_token_ids and not b.output_token_ids
    assert budgets(sim.step()) == [("a", 1), ("b", 4), ("c", 3)]  # running first, then admission
    assert budgets(sim.step()) == [("a", 1), ("b", 1), ("c", 6)]
    sim.run()
    assert [r.output_token_ids for r in (a, b, c)] == [solo_output(r.prompt_token_ids, 3) for r in (a, b, c)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_it_fits():
    sim = Sim(num_blocks=32, max_num_batched_tokens=8, enable_chunked_prefill=False)
    sim.add(make_request("a", [1] * 5, max_tokens=3, arrival=0))
    sim.add(make_request("b", [2] * 5, max_tokens=3, arrival=1))
    assert budgets(sim.step()) == [("a", 5)]                  # b does not fit the remaining 3 tokens
    assert budgets(sim.step()) == [("a", 1), ("b", 5)]
    sim.run()


def test_without_chunked_prefill_a_prompt_longer_than_the_budget_still_runs():
    """Chunking is off, yet a prompt longer than any step's budget must not wait forever (and block
    every request behind it)."""
    sim = Sim(num_blocks=32, max_num_batched_tokens=4, enable_chunked_prefill=False)
    long = sim.add(make_request("long", [1] * 10, max_tokens=2, arrival=0))
    short = sim.add(make_request("short", [2] * 3, max_tokens=2, arrival=1))
    sim.run(max_steps=50)
    assert long.output_token_ids == solo_output(long.prompt_token_ids, 2)
    assert short.output_token_ids == solo_output(short.prompt_token_ids, 2)


def test_max_num_seqs_limits_running_requests():
    sim = Sim(num_blocks=32, max_num_seqs=2, max_num_batched_tokens=64)
    requests = [sim.add(make_request(str(i), [i] * 3, max_tokens=2, arrival=i)) for i in range(4)]
    assert budgets(sim.step()) == [("0", 3), ("1", 3)]
    assert budgets(sim.step()) == [("0", 1), ("1", 1)]       # both finish here
    assert budgets(sim.step()) == [("2", 3), ("3", 3)]
    sim.run()
    assert all(r.finish_reason == "length" for r in requests)


# ---- priority and preemption ------------------------------------------------------------------------


def test_late_high_priority_request_is_admitted_before_earlier_low_priority_ones():
    sim = Sim(num_blocks=32, max_num_seqs=1, max_num_batched_tokens=64)
    first = sim.add(make_request("first", [1] * 3, max_tokens=2, priority=1, arrival=0))
    assert budgets(sim.step()) == [("first", 3)]
    sim.add(make_request("low-a", [2] * 3, max_tokens=1, priority=1, arrival=1))
    sim.add(make_request("low-b", [3] * 3, max_tokens=1, priority=1, arrival=2))
    sim.add(make_request("urgent", [4] * 3, max_tokens=1, priority=0, arrival=3))
    assert budgets(sim.step()) == [("first", 1)]
    assert first.is_finished
    order = [budgets(sim.step()) for _ in range(3)]
    assert order == [[("urgent", 3)], [("low-a", 3)], [("low-b", 3)]]
    assert not sim.scheduler.has_unfinished()


def test_preemption_picks_lowest_priority_latest_request_and_keeps_its_output():
    # 3 blocks of 4 tokens. Three 3-token prompts take one block each; at position 4 each needs a
    # second block and none is free.
    sim = Sim(num_blocks=3, max_num_batched_tokens=64, enable_prefix_caching=False)
    a = sim.add(make_request("a", [1] * 3, max_tokens=6, priority=0, arrival=2))
    b = sim.add(make_request("b", [2] * 3, max_tokens=6, priority=1, arrival=0))
    c = sim.add(make_request("c", [3] * 3, max_tokens=6, priority=0, arrival=1))
    assert budgets(sim.step()) == [("c", 3), ("a", 3), ("b", 3)]   # priority 0 first, then arrival
    assert budgets(sim.step()) == [("c", 1), ("a", 1), ("b", 1)]   # position 3: still the first block
    out = sim.step()
    # c goes first and takes b's block (b has the lowest priority); then a, the latest of the rest,
    # can only preempt itself.
    assert out.preempted == [b, a]
    assert budgets(out) == [("c", 1)]
    assert b.num_preemptions == 1 and b.block_ids == [] and b.num_computed_tokens == 0
    assert len(b.output_token_ids) == 2 and b.status is RequestStatus.WAITING
    assert [r.request_id for r in sim.scheduler.waiting] == ["a", "b"]
    assert sim.scheduler.num_preemptions == 2
    sim.run()
    for r in (a, b, c):
        assert r.output_token_ids == solo_output(r.prompt_token_ids, 6)


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_lowest():
    sim = Sim(num_blocks=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    a = sim.add(make_request("a", [1] * 4, max_tokens=4, arrival=0))
    b = sim.add(make_request("b", [2] * 4, max_tokens=4, arrival=1))
    assert budgets(sim.step()) == [("a", 4), ("b", 4)]
    out = sim.step()                        # both need a second block; none free: b goes
    assert out.preempted == [b] and budgets(out) == [("a", 1)]
    sim.run()
    assert b.num_preemptions >= 1
    assert [a.output_token_ids, b.output_token_ids] == [solo_output(r.prompt_token_ids, 4) for r in (a, b)]


def test_preempted_request_reuses_its_cached_blocks_on_readmission():
    sim = Sim(num_blocks=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    a = sim.add(make_request("a", [1] * 3, max_tokens=6, arrival=0))
    b = sim.add(make_request("b", [2] * 7, max_tokens=4, arrival=1))
    assert budgets(sim.step()) == [("a", 3), ("b", 7)]   # a: block 0; b: blocks 1, 2
    assert not sim.step().preempted                      # positions 3 and 7 fit; b's block 2 is now full
    out = sim.step()                                     # a takes the last block; b, at position 8, preempts itself
    assert out.preempted == [b] and budgets(out) == [("a", 1)]
    assert [sim.pool.lookup(h) for h in b.block_hashes] == [1, 2]   # free, but still cached
    while not any(r is b for r, _ in out.scheduled):
        out = sim.step()
    assert dict(budgets(out))["b"] == 1, "only the token after the cached blocks is recomputed"
    sim.run()
    assert [a.output_token_ids, b.output_token_ids] == [solo_output(r.prompt_token_ids, r.max_tokens) for r in (a, b)]


# ---- prefix caching and sharing ---------------------------------------------------------------------


def test_prefix_hit_skips_the_cached_tokens():
    sim = Sim(num_blocks=16, max_num_batched_tokens=64)
    first = sim.add(make_request("first", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], max_tokens=1, arrival=0))
    sim.run()
    second = sim.add(make_request("second", [1, 2, 3, 4, 5, 6, 7, 8, 0], max_tokens=1, arrival=1))
    out = sim.step()
    assert budgets(out) == [("second", 1)]
    assert second.num_cached_tokens == 8
    assert second.output_token_ids == solo_output(second.prompt_token_ids, 1)
    assert first.num_cached_tokens == 0
    assert sim.kv.prefix_hit_rate > 0


def test_prefix_hit_rate_counts_each_admission_once():
    """A request that waits for blocks is looked up in the cache every step; the hit rate must count
    its tokens once, when it is admitted, or a busy pool drives the reported rate towards zero."""
    sim = Sim(num_blocks=5, max_num_seqs=4, max_num_batched_tokens=64)
    sim.add(make_request("a", [1] * 9, max_tokens=10, arrival=0))
    sim.add(make_request("b", [1] * 9, max_tokens=1, arrival=1))     # 8 tokens hit a's blocks
    sim.add(make_request("c", [2] * 16, max_tokens=1, arrival=2))    # waits many steps for blocks
    sim.run()
    assert sim.scheduler.num_preemptions == 0
    assert (sim.kv.prefix_hits, sim.kv.prefix_queries) == (8, 9 + 9 + 16)


def test_samples_of_one_prompt_share_its_blocks_and_never_write_them():
    """The n > 1 pattern (samples submitted once the first one's prompt is computed): the others
    reference its full prompt blocks and write only their own last block."""
    sim = Sim(num_blocks=16, max_num_batched_tokens=64)
    prompt = list(range(10))
    first = sim.add(make_request("s0", prompt, max_tokens=3, arrival=0))
    sim.step()
    others = [sim.add(make_request(f"s{i}", prompt, max_tokens=3, arrival=i)) for i in range(1, 4)]
    out = sim.step()          # Sim.step checks that nobody writes into a cached block
    assert budgets(out) == [("s0", 1), ("s1", 2), ("s2", 2), ("s3", 2)]
    samples = [first, *others]
    shared = first.block_ids[:2]
    assert all(s.block_ids[:2] == shared for s in samples)
    assert [sim.pool.ref_count[b] for b in shared] == [4, 4]
    assert len({s.block_ids[2] for s in samples}) == 4           # each has its own partial last block
    assert sim.pool.num_free == 16 - 2 - 4                       # not 4 x 3 blocks
    sim.run()
    assert all(s.output_token_ids == solo_output(prompt, 3) for s in samples)


# ---- aborts -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_at_any_stage_returns_blocks_at_once(stage):
    sim = Sim(num_blocks=6, max_num_batched_tokens=4, enable_prefix_caching=False)
    other = sim.add(make_request("other", [1] * 6, max_tokens=8, arrival=0))
    victim = sim.add(make_request("victim", [2] * 6, max_tokens=8, arrival=1))
    if stage == "prefilling":
        sim.step()
        sim.step()                          # other done, victim has 2 of 6 computed
        assert 0 < victim.num_computed_tokens < victim.num_tokens
    elif stage == "decoding":
        for _ in range(4):
            sim.step()
        assert victim.output_token_ids and victim.status is RequestStatus.RUNNING
    elif stage == "preempted":
        while victim.num_preemptions == 0:
            sim.step()
        assert victim.status is RequestStatus.WAITING and victim.output_token_ids
    held = len(victim.block_ids)
    free = sim.pool.num_free
    sim.abort(victim)
    assert sim.pool.num_free == free + held
    assert victim not in sim.scheduler.running and victim not in sim.scheduler.waiting
    sim.run()
    assert other.output_token_ids == solo_output(other.prompt_token_ids, 8)


def test_abort_among_requests_of_equal_order_removes_exactly_that_one():
    """n > 1 samples share one arrival time and priority: the scheduler finds a request among its
    equals by identity (it bisects on the order, then compares identities)."""
    sim = Sim(num_blocks=32, max_num_seqs=3, max_num_batched_tokens=64)
    requests = [sim.add(make_request(str(i), [i + 1] * 3, max_tokens=8, arrival=5.0)) for i in range(5)]
    sim.step()
    assert sim.scheduler.running == requests[:3] and sim.scheduler.waiting == requests[3:]
    sim.abort(requests[1])
    sim.abort(requests[4])
    assert sim.scheduler.running == [requests[0], requests[2]] and sim.scheduler.waiting == [requests[3]]
    sim.abort(requests[1])   # twice: nothing else goes
    assert sim.scheduler.running == [requests[0], requests[2]] and sim.scheduler.waiting == [requests[3]]
    sim.run()
    assert [r.output_token_ids for r in (requests[0], requests[2], requests[3])] == \
        [solo_output(r.prompt_token_ids, 8) for r in (requests[0], requests[2], requests[3])]


# ---- property-based --------------------------------------------------------------------------------


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    requests = []
    for _ in range(draw(st.integers(2, 12))):
        prompt_len = draw(st.integers(1, 20))
        # A tiny vocabulary and shared stems make prefix-cache hits common.
        stem = draw(st.sampled_from([[], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [0] * 12, [3] * 16]))[:prompt_len]
        prompt = stem + draw(st.lists(st.integers(0, VOCAB - 1), min_size=prompt_len - len(stem),
                                      max_size=prompt_len - len(stem)))
        requests.append(dict(
            prompt=prompt, max_tokens=draw(st.integers(1, 8)),
            arrival_step=draw(st.sampled_from([0, 0, 1, 2, 5, 9])),
            priority=draw(st.integers(0, 2)),
            abort_step=draw(st.one_of(st.none(), st.none(), st.integers(0, 30))),
        ))
    # The pool always fits the largest request alone (the engine refuses bigger ones), and is
    # often too small for all of them at once.
    largest = max(-(-(len(r["prompt"]) + r["max_tokens"]) // block_size) for r in requests)
    config = dict(
        num_blocks=largest + draw(st.sampled_from([0, 0, 1, 2, 4, 3 * largest])), block_size=block_size,
        max_num_seqs=draw(st.sampled_from([1, 3, 8, 16, 16])),
        max_num_batched_tokens=draw(st.sampled_from([1, 3, 8, 16, 64, 64])),
        enable_chunked_prefill=draw(st.booleans()),
        enable_prefix_caching=draw(st.booleans()),
        speculate=draw(st.booleans()),
    )
    return config, requests


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_never_deadlock_leak_exceed_budget_or_starve(scenario):
    config, specs = scenario
    sim = Sim(**config)
    requests = [make_request(str(i), s["prompt"], s["max_tokens"], s["priority"], arrival=float(i))
                for i, s in enumerate(specs)]
    last_arrival = max(s["arrival_step"] for s in specs)
    step, idle = 0, 0
    while step <= last_arrival or sim.scheduler.has_unfinished():
        for request, spec in zip(requests, specs, strict=True):
            if spec["arrival_step"] == step:
                sim.add(request)
        for request, spec in zip(requests, specs, strict=True):
            if spec["abort_step"] == step and spec["arrival_step"] <= step and not request.is_finished:
                sim.abort(request)
        had_work = sim.scheduler.has_unfinished()
        out = sim.step()
        # Progress: a step either runs tokens or preempts, and never two empty steps in a row.
        if had_work:
            idle = 0 if out.scheduled else idle + 1
            assert idle <= 1, "the scheduler stalled with work waiting"
        step += 1
        assert step < 5_000, "requests did not finish"
    assert sim.pool.num_free == sim.pool.num_blocks, "blocks leaked"
    event(f"preemptions: {min(sim.scheduler.num_preemptions, 5)}{'+' if sim.scheduler.num_preemptions >= 5 else ''}")
    event(f"prefix hits: {sim.kv.prefix_hits > 0}")
    event(f"aborted: {sum(r.finish_reason == 'abort' for r in requests) > 0}")
    event(f"speculating: {sim.speculate}")
    for request, spec in zip(requests, specs, strict=True):
        assert request.is_finished
        expected = solo_output(spec["prompt"], spec["max_tokens"])
        if request.finish_reason == "abort":
            assert request.output_token_ids == expected[:len(request.output_token_ids)]
        else:
            assert request.output_token_ids == expected
