"""What the server writes to its log: the periodic engine stats line, and no progress-bar frames.

The stats line is checked on an AsyncEngine driven in-process on the tiny model, with a short
interval and each engine step slowed down (a sleep in the engine thread) so that a burst of
requests spans several intervals on any machine. Each line's record carries its numbers
(`record.engine_stats`), so totals are checked exactly and the text against them within rounding.
The progress bar is checked on `tokenmill generate` run as a subprocess: its stderr a pipe (no
`\\r` frames) or a terminal (the bar shows).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import TokenmillError
from tokenmill.server.async_engine import AsyncEngine, StatsInterval

INTERVAL = 0.2          # seconds between stats lines in these tests
STEP_DELAY = 0.02       # added to every engine step: a burst of MAX_TOKENS steps spans several intervals
MAX_TOKENS = 30
PROMPTS = [[1, 5, 9, 12, 30], [1, 40, 41, 42], [1, 8, 8, 8, 8, 8, 3], [1, 60, 2, 61]]
LONG_PROMPT = list(range(1, 41))   # two full 16-token blocks: the prefix cache keeps them
STATS_LOGGER = "tokenmill.server.stats"


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_hf_model) -> LLM:
    return LLM(str(tiny_hf_model("llama")), dtype="float32")


def slow_down(llm: LLM, monkeypatch) -> None:
    """Every engine step of `llm` STEP_DELAY longer: a burst spans several stats intervals."""
    step = llm.engine.step

    def slow_step():
        time.sleep(STEP_DELAY)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)


@pytest.fixture
def slow_steps(llm, monkeypatch):
    slow_down(llm, monkeypatch)


def stats_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == STATS_LOGGER]


async def num_generated(stream) -> int:
    return len([out async for out in stream][-1].outputs[0].token_ids)


async def run_all(engine: AsyncEngine, requests: list[tuple[list[int], SamplingParams]], tag: str) -> list[int]:
    """Run `requests` at once; the number of tokens each generated."""
    streams = [await engine.add_request(f"{tag}{i}", None, p, q) for i, (p, q) in enumerate(requests)]
    return list(await asyncio.gather(*(num_generated(s) for s in streams)))


def run_logged(llm: LLM, requests: list[tuple[list[int], SamplingParams]], tag: str,
               interval: float | None = INTERVAL) -> list[int]:
    """`requests` at once through an AsyncEngine logging stats every `interval`, then three
    intervals idle (its last line); the number of tokens each generated."""
    async def main():
        engine = AsyncEngine(llm.engine, llm.inputs, max_queued_requests=8, stats_log_interval=interval)
        engine.start()
        try:
            generated = await run_all(engine, requests, tag)
            await asyncio.sleep(3 * INTERVAL)
            return generated
        finally:
            await engine.stop()

    return asyncio.run(main())


def rate(message: str, name: str) -> float:
    return float(re.search(rf"Avg {name} throughput: ([0-9.]+) tokens/s", message).group(1))


def test_stats_lines_while_busy_one_when_idle_then_none(llm, slow_steps, caplog):
    """A burst of 4 requests: lines every interval with its tokens counted (over all lines, exactly
    the tokens prompted and generated) and all 4 running at first; one last line showing nothing
    running once idle, then no line however long it stays idle; a second burst logs again, its
    first interval counting from when the work came, not from the last line."""
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    idle_s = 6 * INTERVAL

    async def main():
        engine = AsyncEngine(llm.engine, llm.inputs, max_queued_requests=8, stats_log_interval=INTERVAL)
        engine.start()
        try:
            generated = await run_all(engine, [(p, greedy()) for p in PROMPTS], "a")
            await asyncio.sleep(idle_s)          # the idle line comes within an interval, then nothing
            after_first = len(stats_lines(caplog))
            await asyncio.sleep(idle_s)
            assert len(stats_lines(caplog)) == after_first, "a stats line was logged while idle"
            # Twice the same prompt of two full blocks, the second once the first's prefill ran
            # (in the same burst): it finds them cached.
            first_run = aiter(await engine.add_request("b", None, LONG_PROMPT, greedy()))
            await anext(first_run)
            second_run = await engine.add_request("c", None, LONG_PROMPT, greedy())
            generated += await asyncio.gather(num_generated(first_run), num_generated(second_run))
            await asyncio.sleep(idle_s)
            return generated, after_first
        finally:
            await engine.stop()

    generated, after_first = asyncio.run(main())
    records = stats_lines(caplog)
    first, second = records[:after_first], records[after_first:]
    assert len(first) >= 2 and len(second) >= 2
    stats: list[StatsInterval] = [r.engine_stats for r in records]
    assert all(r.levelno == logging.INFO for r in records)

    # Every token counted once over the lines; the text says the same numbers, rounded.
    assert sum(s.generation_tokens for s in stats) == sum(generated) == MAX_TOKENS * (len(PROMPTS) + 2)
    # Prompt tokens computed: the second long prompt's two cached blocks were not computed.
    assert sum(s.prompt_tokens for s in stats) == sum(map(len, PROMPTS)) + len(LONG_PROMPT) + len(LONG_PROMPT) - 32
    for r, s in zip(records, stats, strict=True):
        message = r.getMessage()
        assert rate(message, "generation") == pytest.approx(s.generation_tokens / s.seconds, abs=0.051)
        assert rate(message, "prompt") == pytest.approx(s.prompt_tokens / s.seconds, abs=0.051)
        assert f"Running: {s.num_running} seqs, Waiting: {s.num_waiting} seqs" in message
        assert s.num_preemptions == 0 and "Preemptions: 0" in message
        assert s.seconds >= INTERVAL * 0.99

    # The burst: all four running at the first line, their blocks held; idle at the last line.
    assert (stats[0].num_running, stats[0].num_waiting) == (4, 0) and stats[0].kv_blocks_used > 0
    assert "KV blocks used: 0.0%" not in records[0].getMessage()
    for burst in (first, second):
        *busy, idle = [r.engine_stats for r in burst]
        assert (idle.num_running, idle.num_waiting, idle.kv_blocks_used) == (0, 0, 0.0)
        assert all(s.num_running + s.num_waiting > 0 for s in busy), "an idle line before the burst ended"
    # The second burst's first interval started when its request came, not at the idle line.
    assert second[0].engine_stats.seconds < idle_s
    # Prefix cache: every prompt token admitted was looked up; 32 of the second long prompt's hit.
    assert sum(s.prefix_cache_queries for s in stats) == sum(map(len, PROMPTS)) + 2 * len(LONG_PROMPT)
    assert sum(s.prefix_cache_hits for s in stats) == 32
    for r, s in zip(records, stats, strict=True):
        assert f"Prefix cache hit rate: {100 * s.prefix_cache_hit_rate:.1f}%" in r.getMessage()
    assert max(s.prefix_cache_hit_rate for s in stats) > 0


def test_stats_lines_count_preemptions(tiny_hf_model, caplog, monkeypatch):
    """A pool too small for the four requests at once preempts some; the lines count each once."""
    llm = LLM(str(tiny_hf_model("llama")), dtype="float32", num_kv_blocks=6)   # each request needs 3 at the end
    slow_down(llm, monkeypatch)
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    generated = run_logged(llm, [(p, greedy(40)) for p in PROMPTS], "p")
    stats = [r.engine_stats for r in stats_lines(caplog)]
    preemptions = llm.engine.stats().num_preemptions
    assert preemptions > 0
    assert sum(s.num_preemptions for s in stats) == preemptions
    assert sum(s.generation_tokens for s in stats) == sum(generated) == 40 * len(PROMPTS)
    assert any(s.num_waiting > 0 for s in stats)
    assert max(s.kv_blocks_used for s in stats) <= 1.0


def test_no_stats_lines_when_disabled(llm, slow_steps, caplog):
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)

    run_logged(llm, [(PROMPTS[0], greedy(10))], "n", interval=None)
    assert stats_lines(caplog) == []


@pytest.mark.parametrize("interval", [0, -1.0, True, "5", float("nan")])
def test_stats_log_interval_must_be_positive_seconds(llm, interval):
    with pytest.raises(TokenmillError, match="stats_log_interval"):
        AsyncEngine(llm.engine, llm.inputs, max_queued_requests=8, stats_log_interval=interval)


def generate_command(model) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "generate", "Hi", "--max-tokens", "2", "--model", str(model),
            "--dtype", "float32", "--device", "cpu"]


def test_no_progress_bar_frames_when_stderr_is_not_a_terminal(tiny_gguf_model):
    result = subprocess.run(generate_command(tiny_gguf_model("llama")), capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert b"\r" not in result.stderr
    assert b"Loading weights" not in result.stderr


def test_progress_bar_shows_on_a_terminal(tiny_gguf_model):
    """The other side of the test above: on a terminal the loader's bar is still drawn."""
    controller, terminal = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, which tqdm fills with nothing: give it 80.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    try:
        proc = subprocess.Popen(generate_command(tiny_gguf_model("llama")), stdout=subprocess.DEVNULL,
                                stderr=terminal)
    finally:
        os.close(terminal)   # the child holds its own copy: reading ends when it exits
    shown = b""
    try:
        while chunk := os.read(controller, 4096):
            shown += chunk
    except OSError:   # EIO: the child closed the terminal
        pass
    finally:
        os.close(controller)
    assert proc.wait(timeout=300) == 0, shown.decode(errors="replace")
    assert b"Loading weights" in shown


def test_stats_lines_count_speculative_decoding(tiny_hf_model, caplog, monkeypatch):
    """With speculation on, a second line per interval gives the interval's acceptance; over the
    run the lines add up to the engine's counters."""
    llm = LLM(str(tiny_hf_model("llama")), dtype="float32",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    slow_down(llm, monkeypatch)
    caplog.set_level(logging.INFO, logger=STATS_LOGGER)
    run_logged(llm, [(p, greedy(40)) for p in PROMPTS[:2]], "s")
    totals = llm.engine.stats()
    assert totals.spec_num_draft_tokens > 0
    spec_lines = [r for r in stats_lines(caplog) if r.getMessage().startswith("SpecDecoding metrics")]
    assert spec_lines, "no SpecDecoding line"
    intervals = [r.engine_stats for r in spec_lines]
    assert sum(s.spec_num_draft_tokens for s in intervals) == totals.spec_num_draft_tokens
    assert sum(s.spec_num_accepted_tokens for s in intervals) == totals.spec_num_accepted_tokens
    for r in spec_lines:
        s = r.engine_stats
        rate = re.search(r"Draft acceptance rate: ([\d.]+)%", r.getMessage()).group(1)
        assert float(rate) == pytest.approx(100 * s.spec_num_accepted_tokens / s.spec_num_draft_tokens, abs=0.06)
        cost = re.search(r"Row cost: ([\d.]+)", r.getMessage()).group(1)
        assert float(cost) == pytest.approx(s.spec_row_cost, abs=0.006) and 0 < s.spec_row_cost <= 1
        proposing = re.search(r"Proposal cost: ([\d.]+)", r.getMessage()).group(1)
        assert float(proposing) == pytest.approx(s.spec_proposal_cost, abs=0.0006)
    # a lookup takes some time, far less than a step
    assert 0 < intervals[-1].spec_proposal_cost < 1
    assert intervals[-1].spec_proposal_cost == llm.engine.speculator.proposal_cost.value
