"""The live view's numbers (engine/snapshot.py, server/monitor.py) against the engine's own.

Each step's record is checked against what the scheduler returned for that step and its queues
after it; each snapshot's block owners against the block tables and the pool's reference counts;
the feed's frames, over a whole burst through an AsyncEngine, against the engine's counters.
A small pool makes the burst share prefix blocks, evict cached ones and preempt.
"""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.snapshot import CACHED_FREE, FREE
from tokenmill.server import monitor as monitor_module
from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.monitor import percentiles, run_lengths

BLOCK = 16
NUM_BLOCKS = 24


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def burst(seed: int, n: int = 8) -> list[list[int]]:
    """Prompts of 20-60 tokens, half of them starting with the same 40 tokens (two full blocks)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 200) for _ in range(40)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, 200) for _ in range(rng.randrange(20, 60))]
        prompts.append(shared + tail[:20] if i % 2 else tail)
    return prompts


@pytest.fixture
def llm(tiny_hf_model) -> LLM:
    return LLM(str(tiny_hf_model("llama")), dtype="float32", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK,
               max_num_batched_tokens=64, max_num_seqs=6)


def decode_runs(values: list[int]) -> np.ndarray:
    return np.repeat(values[0::2], values[1::2])


def test_run_lengths_and_percentiles():
    a = np.array([-1, -1, 3, 3, 3, -2, 0, 0, -1], dtype=np.int32)
    assert run_lengths(a) == [-1, 2, 3, 3, -2, 1, 0, 2, -1, 1]
    assert (decode_runs(run_lengths(a)) == a).all()
    assert run_lengths(np.array([], dtype=np.int32)) == []
    from collections import deque
    samples = deque([(0.0, 9.0), (1.0, 1.0), (2.0, 2.0), (3.0, 3.0)])
    assert percentiles(samples, since=1.0) == {"count": 3, "p50": 2.0, "p90": pytest.approx(2.8),
                                               "p99": pytest.approx(2.98)}
    assert percentiles(samples, since=5.0)["count"] == 0


def test_step_records_and_snapshots_equal_the_schedulers_own_state(llm):
    engine = llm.engine
    outputs = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        outputs.append((out, [(r, n, list(r.output_token_ids), r.num_computed_tokens, r.num_tokens)
                              for r, n in out.scheduled]))
        return out

    engine.scheduler.schedule = spy
    for prompt in burst(0):
        engine.add_request(prompt, greedy(24))
    kinds = set()
    saw = {"shared": False, "cached_free": False, "preempted": False}
    while engine.has_unfinished():
        engine.step()
        out, before = outputs[-1]
        record = engine.last_step
        assert record.step == engine.num_steps
        assert record.budget == engine.scheduler.max_num_batched_tokens == 64
        assert record.num_prefill_tokens + record.num_decode_tokens == out.num_scheduled_tokens
        assert record.num_prefill_chunks + record.num_decodes == len(out.scheduled)
        assert record.num_preempted == len(out.preempted)
        saw["preempted"] |= bool(out.preempted)
        assert (record.num_running, record.num_waiting) == (len(engine.scheduler.running),
                                                            len(engine.scheduler.waiting))
        for row, (request, n, output_before, computed, total) in zip(record.rows, before, strict=True):
            assert (row.request_id, row.num_tokens) == (request.request_id, n)
            decoding = bool(output_before) and computed == total - 1 and n == 1
            assert row.kind == ("decode" if decoding else "prefill"), (row, computed, total)
            kinds.add(row.kind)

        snap = engine.snapshot()
        views = {v.request_id: v for v in snap.requests}
        assert [v.request_id for v in snap.requests] == \
            [r.request_id for r in engine.scheduler.running + engine.scheduler.waiting]
        assert (snap.block_refs == np.array(engine.pool.ref_count)).all()
        owner = snap.block_owner
        for i, request in enumerate(engine.scheduler.running + engine.scheduler.waiting):
            held = {b for table in request.tables for b in table.block_ids[table.num_released:]}
            assert views[request.request_id].num_blocks == len(held)
            assert set(np.flatnonzero(owner == i)) <= held
            # a block it holds but is not shown holding is shared with an earlier request
            assert all(owner[b] < i and snap.block_refs[b] > 1 for b in held - set(np.flatnonzero(owner == i)))
            expected = "running" if request in engine.scheduler.running else \
                "preempted" if request.num_preemptions else "waiting"
            assert views[request.request_id].status == expected
        assert set(np.flatnonzero(owner == CACHED_FREE)) == set(engine.pool.cached_free_blocks())
        assert set(np.flatnonzero(owner == FREE)) | set(np.flatnonzero(owner == CACHED_FREE)) == \
            set(engine.pool.free_queue)
        saw["shared"] |= bool((snap.block_refs > 1).any())
        saw["cached_free"] |= bool((owner == CACHED_FREE).any())
    assert kinds == {"prefill", "decode"}
    assert saw == {"shared": True, "cached_free": True, "preempted": True}, "the burst should exercise all three"
    assert [reason for _, reason in engine.finished_log] == ["length"] * 8


def test_feed_frames_add_up_to_the_engines_counters(llm, monkeypatch):
    """A burst watched through the feed: every step reaches a frame once, the steps' tokens add up
    to the engine's counters, every request's end is reported, and the last frame shows the pool
    with nothing running."""
    prompts = burst(1)

    async def main():
        engine = AsyncEngine(llm.engine, llm.inputs, max_queued_requests=8, stats_log_interval=None)
        engine.monitor.interval = 0.0   # a frame after every step
        engine.start()
        subscription = engine.monitor.subscribe()
        frames = []
        try:
            streams = [await engine.add_request(f"r{i}", None, p, greedy(16)) for i, p in enumerate(prompts)]
            for stream in streams:
                async for _ in stream:
                    pass
            await asyncio.sleep(0.2)
            while not subscription.queue.empty():
                frames.append(json.loads(subscription.queue.get_nowait()))
            unwatched = engine.monitor.watching
            engine.monitor.unsubscribe(subscription)
            return frames, unwatched, engine.stats(), engine.monitor
        finally:
            await engine.stop()

    monkeypatch.setattr(monitor_module, "SUBSCRIBER_BACKLOG", 10_000)   # keep every frame for the test
    frames, watching, stats, monitor = asyncio.run(main())
    assert watching
    steps = [s for f in frames for s in f["steps"]]
    assert [s["step"] for s in steps] == list(range(1, llm.engine.num_steps + 1)), "each step once, in order"
    prefill = sum(s["prefill_tokens"] for s in steps)
    decode = sum(s["decode_tokens"] for s in steps)
    # A request's first token comes from its prefill's last row; a preempted one recomputes.
    if stats.num_preemptions == 0:
        assert (prefill, decode) == (stats.prompt_tokens, stats.generation_tokens - len(prompts))
    else:
        assert prefill > stats.prompt_tokens and decode < stats.generation_tokens - len(prompts)
    finished = {f["id"]: f["reason"] for frame in frames for f in frame["finished"]}
    assert finished == {f"r{i}#0": "length" for i in range(len(prompts))}   # (the engine ids of n=1 requests)
    last = frames[-1]
    assert last["requests"] == [] and last["now"]["running"] == last["now"]["waiting"] == 0
    assert last["counters"]["generation_tokens"] == stats.generation_tokens == 16 * len(prompts)
    assert last["counters"]["prefix_cache_hits"] == stats.prefix_cache_hits > 0
    owner = decode_runs(last["blocks"]["owner"])
    assert len(owner) == NUM_BLOCKS == last["config"]["num_kv_blocks"]
    assert set(owner.tolist()) <= {FREE, CACHED_FREE}
    assert last["now"]["kv_blocks_used"] == 0
    assert last["now"]["kv_blocks_free"] + last["now"]["kv_blocks_cached_free"] == NUM_BLOCKS
    assert (decode_runs(last["blocks"]["refs"]) == 0).all()
    assert last["latency"]["ttft"]["count"] == len(prompts)
    assert last["latency"]["itl"]["count"] == 15 * len(prompts)
    # While running, a frame's block owners point into its own request list.
    for frame in frames:
        owner = decode_runs(frame["blocks"]["owner"])
        assert owner.max() < len(frame["requests"])
        held = {r["id"]: r["blocks"] for r in frame["requests"]}
        for i, request in enumerate(frame["requests"]):
            assert (owner == i).sum() <= held[request["id"]]
    assert monitor.num_frames == len(frames) and monitor.overhead_s > 0


def test_nobody_watching_collects_nothing(llm):
    async def main():
        engine = AsyncEngine(llm.engine, llm.inputs, max_queued_requests=8, stats_log_interval=None)
        engine.start()
        try:
            stream = await engine.add_request("a", None, burst(2)[0], greedy(8))
            async for _ in stream:
                pass
            return engine.monitor
        finally:
            await engine.stop()

    monitor = asyncio.run(main())
    assert monitor.num_frames == 0 and monitor.overhead_s == 0 and not monitor.ttft and not monitor.itl


def test_a_failing_feed_ends_its_streams_and_no_request(llm, monkeypatch, caplog):
    def broken():
        raise RuntimeError("snapshot bug")

    monkeypatch.setattr(llm.engine, "snapshot", broken)

    async def main():
        engine = AsyncEngine(llm.engine, llm.inputs, max_queued_requests=8, stats_log_interval=None)
        engine.start()
        try:
            subscription = engine.monitor.subscribe()
            stream = await engine.add_request("a", None, burst(3)[0], greedy(8))
            outputs = [out async for out in stream]
            return outputs[-1], await asyncio.wait_for(subscription.queue.get(), 5), engine.monitor.watching
        finally:
            await engine.stop()

    last, frame, watching = asyncio.run(main())
    assert last.outputs[0].finish_reason == "length" and len(last.outputs[0].token_ids) == 8
    assert frame is None and not watching
    assert "the live view's feed failed" in caplog.text
