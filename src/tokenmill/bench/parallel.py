"""`tokenmill bench parallel [MODEL]`: what running one model in several processes costs here.

Tensor parallelism, decode steps (`bench roofline`'s measurement: `--steps` decode steps of `batch`
requests of `--context` random tokens, median of `--repeats`), each configuration in a fresh
process: TP=1 on one thread, TP=1 on two threads (the same cores used by one process: the peer at
its best on this machine) and TP=2 with one thread per rank. For TP=2, the time rank 0 spends
communicating during the timed steps (TPWorkers.comm_time: the step's batch broadcast and every
all-reduce and gather, waits for the other rank included, so an upper bound of the overhead) is
reported as a share of the step; the target is under 15%.

On one machine the ranks share its cores and memory bandwidth, so TP=2 is not expected to beat
TP=1 on the same cores: it splits the weights' memory, and the table shows what that costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from tokenmill.bench import output_file, positive_int
from tokenmill.bench.procs import Row, print_load, run_spawned, vm_hwm_mib

COMM_SHARE_TARGET = 0.15
CONFIGS = [("TP=1, 1 thread", 1, 1), ("TP=1, 2 threads", 1, 2), ("TP=2, 1 thread/rank", 2, 1)]


def add_parallel_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8])
    b.add_argument("--context", type=positive_int, default=256, help="cached tokens per request")
    b.add_argument("--steps", type=positive_int, default=16, help="decode steps timed per point")
    b.add_argument("--repeats", type=positive_int, default=3)
    b.add_argument("--output", type=output_file, default="bench-results/parallel.json")


def measure_config(model: str | None, flags: dict[str, Any], batch_sizes: list[int], context: int, steps: int,
                   repeats: int) -> Row:
    """One configuration's points (in a fresh process: run_spawned)."""
    from tokenmill import LLM
    from tokenmill.bench.roofline import decode_tokens_per_request, start_decode, time_decode

    longest = context + max(decode_tokens_per_request(b, context, steps, flags.get("max_num_batched_tokens", 2048))
                            for b in batch_sizes)
    llm = LLM(model, **{**flags, "max_num_seqs": max(batch_sizes), "max_model_len": longest + 1,
                        "num_kv_blocks": max(batch_sizes) * (longest // flags.get("block_size", 16) + 2)})
    workers = llm.engine.workers
    points = []
    for batch in batch_sizes:
        rates, shares = [], []
        for _ in range(repeats):
            start_decode(llm, batch, context, steps)
            comm = 0.0 if workers is None else workers.comm_time()
            tokens, elapsed = time_decode(llm, steps)
            rates.append(tokens / elapsed)
            if workers is not None:
                shares.append((workers.comm_time() - comm) / elapsed)
        tok_s = statistics.median(rates)
        point = {"batch": batch, "tok_s": tok_s, "tok_s_all": rates, "step_ms": 1e3 * batch / tok_s}
        if shares:
            point["comm_share"] = statistics.median(shares)
            point["comm_ms"] = point["comm_share"] * point["step_ms"]
        points.append(point)
    workers_mib = [] if workers is None else [vm_hwm_mib(p.pid) for p in workers.procs]
    llm.engine.shutdown()
    return {"points": points, "worker_peak_rss_mib": workers_mib}


def run_parallel(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.config import engine_args

    flags = engine_args(args)
    model = args.model_path or args.model
    rows = []
    for name, tp, threads in CONFIGS:
        print_load(name)
        row = run_spawned(measure_config, model, {**flags, "tensor_parallel_size": tp, "threads": threads},
                          args.batch_sizes, args.context, args.steps, args.repeats)
        rows.append({"config": name, "tensor_parallel_size": tp, "threads": threads, **row})
    report = {"model": model, "context": args.context, "steps": args.steps, "repeats": args.repeats,
              "comm_share_target": COMM_SHARE_TARGET, "rows": rows}
    print_report(report)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


def print_report(report: dict[str, Any]) -> None:
    base = {p["batch"]: p["step_ms"] for p in report["rows"][0]["points"]}
    print(f"\ndecode, context {report['context']}, median of {report['repeats']}")
    print(f"{'configuration':<22}{'batch':>6}{'step ms':>9}{'tok/s':>9}{'vs TP=1x1':>11}{'comm ms':>9}"
          f"{'comm share':>12}{'peak MiB per process':>22}")
    for row in report["rows"]:
        memory = " + ".join(f"{m:.0f}" for m in [row["peak_rss_mib"], *row["worker_peak_rss_mib"]])
        for p in row["points"]:
            comm = f"{p['comm_ms']:>9.2f}{p['comm_share']:>12.1%}" if "comm_ms" in p else f"{'':>9}{'':>12}"
            print(f"{row['config']:<22}{p['batch']:>6}{p['step_ms']:>9.2f}{p['tok_s']:>9.1f}"
                  f"{base[p['batch']] / p['step_ms']:>10.2f}x{comm}{memory:>22}")
    shares = [p["comm_share"] for row in report["rows"] for p in row["points"] if "comm_share" in p]
    if shares:
        worst = max(shares)
        verdict = "met" if worst < report["comm_share_target"] else "NOT met"
        print(f"\nTP=2 communication (batch broadcast + collectives) at most {worst:.1%} of a step: target < "
              f"{report['comm_share_target']:.0%} {verdict}")


def cmd_parallel(args: argparse.Namespace) -> int:
    run_parallel(args)
    return 0
