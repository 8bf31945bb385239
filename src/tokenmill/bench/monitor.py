"""`tokenmill bench monitor [MODEL]`: what the live view (GET /engine/feed) costs the engine.

The served path (an AsyncEngine in this process, the engine in its worker thread) runs a
decode-heavy workload (`--batch-sizes` requests at once, short random prompts, `--max-tokens`
output tokens each, greedy, ignore_eos) in three modes, interleaved, `--repeats` times each:

- bare: the feed's hooks in the engine loop and the engine's per-step record (StepRecord, its
  rows) replaced by no-ops: the engine as it was before the live view;
- unwatched: as served, nobody subscribed (the feed's cost when no page is open);
- watched: one subscriber reading and parsing every frame, as a page does, at the server's
  frame interval (`--interval`).

Reported per batch size: output tokens/s (median and spread) and its ratio to bare; watched, the
feed's own time in the engine loop (snapshot, frame, JSON: `EngineMonitor.overhead_s`) as a
fraction of the engine's step time (target: under 2%); unwatched, what the live view adds to every
step (the step record of a batch that size, the loop's two hooks), timed alone over many calls, as
a fraction of the step time (target: nothing measurable, i.e. far below the tok/s spread). The peer
of each mode is bare, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from tokenmill.bench import output_file, positive_seconds
from tokenmill.bench.procs import load_average, print_load
from tokenmill.bench.structured import spread_stat
from tokenmill.errors import TokenmillError

DEFAULT_BATCH_SIZES = [1, 32]
DEFAULT_REPEATS = 5
DEFAULT_MAX_TOKENS = 128
PROMPT_TOKENS = 32
MODES = ["bare", "unwatched", "watched"]
TARGET_WATCHED_OVERHEAD = 0.02     # of step time
TARGET_UNWATCHED_COST = 0.001      # of step time: "nothing measurable"


def add_monitor_args(b: argparse.ArgumentParser) -> None:
    b.set_defaults(threads=2)
    g = b.add_argument_group("monitor")
    g.add_argument("--batch-sizes", type=int, nargs="+", default=DEFAULT_BATCH_SIZES,
                   help="requests in flight at once, one row each")
    g.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help="runs of each mode (interleaved; the median and the spread are reported)")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="output tokens per request")
    g.add_argument("--interval", type=positive_seconds, default=None,
                   help="seconds between frames while watched (default: the server's)")
    b.add_argument("--output", type=output_file, default="bench-results/monitor.json")


@contextmanager
def bare_engine():
    """The engine loop and step without the live view's work: its hooks and the step record no-ops."""
    from tokenmill.engine import engine as engine_module
    from tokenmill.server.monitor import EngineMonitor

    saved = (engine_module.scheduled_rows, engine_module.step_record, EngineMonitor.after_step,
             EngineMonitor.between_steps)
    engine_module.scheduled_rows = lambda scheduled: ()
    engine_module.step_record = lambda *args: None
    EngineMonitor.after_step = EngineMonitor.between_steps = lambda self: None
    try:
        yield
    finally:
        (engine_module.scheduled_rows, engine_module.step_record, EngineMonitor.after_step,
         EngineMonitor.between_steps) = saved


async def _run(llm: Any, executor: Any, mode: str, batch: int, max_tokens: int, interval: float | None,
               seed: int) -> dict[str, Any]:
    from tokenmill import SamplingParams
    from tokenmill.server.async_engine import AsyncEngine

    rng = random.Random(seed)   # fresh prompts every run: no prefix-cache hits across runs
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)] for _ in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine = AsyncEngine(llm.engine, llm.inputs, max_queued_requests=batch, stats_log_interval=None,
                         executor=executor, keep_executor=True)
    step_s = [0.0, 0]   # seconds, steps
    inner = llm.engine.step

    def timed_step():
        start = time.perf_counter()
        try:
            return inner()
        finally:
            step_s[0] += time.perf_counter() - start
            step_s[1] += 1

    llm.engine.step = timed_step
    if interval is not None:
        engine.monitor.interval = interval
    engine.start()
    frames = []

    async def watch(subscription):
        while (frame := await subscription.queue.get()) is not None:
            frames.append(len(json.loads(frame)["steps"]))

    watcher = asyncio.ensure_future(watch(engine.monitor.subscribe())) if mode == "watched" else None
    try:
        start = time.perf_counter()
        streams = [await engine.add_request(f"{seed}-{i}", None, p, params) for i, p in enumerate(prompts)]

        async def drain(stream):
            async for out in stream:
                last = out
            return len(last.outputs[0].token_ids)

        tokens = sum(await asyncio.gather(*(drain(s) for s in streams)))
        elapsed = time.perf_counter() - start
    finally:
        await engine.stop()
        if watcher is not None:
            await watcher
        del llm.engine.step
    return {"tok_s": tokens / elapsed, "tokens": tokens, "elapsed_s": elapsed, "step_s": step_s[0],
            "steps": step_s[1],
            "monitor_s": engine.monitor.overhead_s, "frames": len(frames),
            "overhead": engine.monitor.overhead_s / step_s[0] if step_s[0] else None}


def unwatched_step_cost(llm: Any, batch: int, calls: int = 2000) -> float:
    """Seconds the live view adds to an engine step of `batch` decoding requests when nobody
    watches: the step's record and the engine loop's two hooks, timed alone over `calls` calls."""
    from tokenmill import SamplingParams
    from tokenmill.engine.request import Request
    from tokenmill.engine.snapshot import scheduled_rows, step_record
    from tokenmill.server.monitor import EngineMonitor

    scheduled = []
    for i in range(batch):
        request = Request(f"r{i}", list(range(PROMPT_TOKENS)), SamplingParams(max_tokens=8), 8, frozenset())
        request.append_token(1)
        request.num_computed_tokens = request.num_tokens - 1   # decoding: its last token left to compute
        scheduled.append((request, 1))
    monitor = EngineMonitor(llm.engine, lambda: None)
    start = time.perf_counter()
    for _ in range(calls):
        step_record(1, 0.0, 0.0, 2048, scheduled_rows(scheduled), 0, batch, 0)
        monitor.after_step()
        monitor.between_steps()
    return (time.perf_counter() - start) / calls


def run_monitor_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill import LLM
    from tokenmill.config import engine_args
    from tokenmill.hub import model_path
    from tokenmill.server.async_engine import engine_thread

    for name in ("repeats", "max_tokens"):
        if getattr(args, name) < 1:
            raise TokenmillError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if any(b < 1 for b in args.batch_sizes):
        raise TokenmillError(f"--batch-sizes: must be >= 1, got {args.batch_sizes}")
    model = model_path(args.model)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    kwargs = {**engine_args(args), "show_progress": False, "max_num_seqs": max(args.batch_sizes)}
    report: dict[str, Any] = {"config": {"model": model, "threads": args.threads, "batch_sizes": args.batch_sizes,
                                         "repeats": args.repeats, "max_tokens": args.max_tokens,
                                         "prompt_tokens": PROMPT_TOKENS, "interval": args.interval,
                                         "cpu_count": os.cpu_count(),
                                         "targets": {"watched_overhead": TARGET_WATCHED_OVERHEAD,
                                                     "unwatched_cost": TARGET_UNWATCHED_COST}},
                              "runs": {}}
    executor = engine_thread()   # loads the model and steps it in every run, as the server does
    llm = executor.submit(LLM, model, **kwargs).result()
    seed = 0
    asyncio.run(_run(llm, executor, "watched", 2, 8, args.interval, seed))   # warm-up
    for batch in args.batch_sizes:
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
        for rep in range(args.repeats):
            for mode in MODES:   # interleaved: a slow spell of the machine hits every mode
                seed += 1
                print_load(f"batch {batch}, {mode}, repeat {rep + 1}/{args.repeats}")
                load = load_average()
                with bare_engine() if mode == "bare" else nullcontext():
                    run = asyncio.run(_run(llm, executor, mode, batch, args.max_tokens, args.interval, seed))
                runs[mode].append({**run, "load_avg_before": load})
        report["runs"][str(batch)] = runs
        report.setdefault("unwatched_step_cost_s", {})[str(batch)] = unwatched_step_cost(llm, batch)
    executor.shutdown(wait=True)
    report["table"] = build_table(report)
    report["config"]["wall_s"] = time.perf_counter() - started
    print_report(report)
    out_path.write_text(json.dumps(report, indent=2))
    print(f"wrote {out_path}")
    return report


def build_table(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for batch, runs in report["runs"].items():
        bare = spread_stat([r["tok_s"] for r in runs["bare"]])["median"]
        for mode in MODES:
            tok_s = spread_stat([r["tok_s"] for r in runs[mode]])
            overhead = [r["overhead"] for r in runs[mode] if r["frames"]]
            step_s = spread_stat([r["step_s"] / r["steps"] for r in runs[mode]])["median"]
            cost = report["unwatched_step_cost_s"][batch] / step_s if mode == "unwatched" else None
            rows.append({"batch": int(batch), "mode": mode, "tok_s": tok_s["median"], "spread": tok_s["spread"],
                         "vs_bare": tok_s["median"] / bare, "step_ms": 1000 * step_s, "unwatched_cost": cost,
                         "frames": spread_stat([r["frames"] for r in runs[mode]])["median"],
                         "overhead": spread_stat(overhead)["median"] if overhead else None})
    return rows


def print_report(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(f"\nmodel: {cfg['model']}\nthreads: {cfg['threads']}; each request of a batch: {cfg['prompt_tokens']} "
          f"random prompt tokens, {cfg['max_tokens']} output tokens (greedy, ignore_eos); median of "
          f"{cfg['repeats']} interleaved repeats (spread: (max - min) / median); vs bare: tok/s over the bare "
          "engine's in the same run")
    print(f"\n{'batch':>6}  {'mode':<10}{'tok/s':>9}{'spread':>8}{'vs bare':>9}{'step ms':>9}{'frames':>8}"
          f"{'feed / step time':>18}")
    for r in report["table"]:
        share = r["overhead"] if r["mode"] == "watched" else r["unwatched_cost"]
        shown = "-" if share is None else f"{share:.3%}"
        print(f"{r['batch']:>6}  {r['mode']:<10}{r['tok_s']:>9.1f}{r['spread']:>8.0%}{r['vs_bare']:>8.3f}x"
              f"{r['step_ms']:>9.2f}{r['frames']:>8.0f}{shown:>18}")
    print("feed / step time: watched, the feed's time in the engine loop; unwatched, the step record and the "
          "loop's hooks timed alone")
    for r in report["table"]:
        if r["mode"] == "watched":
            overhead = r["overhead"]
            met = "met" if overhead is not None and overhead < TARGET_WATCHED_OVERHEAD else "NOT met"
            shown = "-" if overhead is None else f"{overhead:.2%}"
            print(f"target batch {r['batch']} watched: feed time < {TARGET_WATCHED_OVERHEAD:.0%} of step time: "
                  f"{shown}, {met}")
        if r["mode"] == "unwatched":
            met = "met" if r["unwatched_cost"] < TARGET_UNWATCHED_COST else "NOT met"
            print(f"target batch {r['batch']} unwatched: cost < {TARGET_UNWATCHED_COST:.1%} of step time: "
                  f"{r['unwatched_cost']:.3%}, {met} (tok/s {r['vs_bare']:.3f}x bare, spread "
                  f"{r['spread']:.0%})")
    print(f"whole bench {cfg['wall_s']:.0f} s")


def cmd_monitor(args: argparse.Namespace) -> int:
    args.model = args.model_path or args.model
    run_monitor_bench(args)
    return 0
