"""`tokenmill bench scaling [MODEL]`: how a decode step's cost grows with the batch and the context,
against the roofline bound, as a table, JSON and two PNG plots.

Two sweeps of decode steps (each point: `batch` requests of `context` random tokens prefilled, then
`--steps` decode steps timed, `bench roofline`'s measurement): the batch size at a fixed context
(`--batch-sizes`, default 1..128, at `--context`, default 256), and the context length at batch 1
and 8 (`--contexts`, default 128..16384). Every point is shown next to its bound: the step reads
every weight once plus each request's K/V and does the matmul and attention FLOPs, so its time is at
least max(bytes / read bandwidth, FLOPs / matmul peak) (`roofline.bound`, the machine measured in
the same process). Where the two cross, the regime turns over: small batches are bound by the
weights' bytes, large ones by the matmul's FLOPs, long contexts by the K/V's bytes.

The plots (matplotlib, the `bench` extra: `pip install -e .[bench]`) are `<output stem>-batch.png`
and `<output stem>-context.png`: tokens/s measured and bound (log axes), and the measured fraction
of the bound. Without matplotlib the table and the JSON are still written.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenmill.bench import output_file
from tokenmill.errors import TokenmillError

DEFAULT_BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]
DEFAULT_CONTEXTS = [128, 512, 2048, 8192, 16384]
DEFAULT_CONTEXT_BATCHES = [1, 8]


def add_scaling_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--batch-sizes", type=int, nargs="+", default=DEFAULT_BATCH_SIZES)
    b.add_argument("--context", type=int, default=256, help="cached tokens per request in the batch sweep")
    b.add_argument("--contexts", type=int, nargs="+", default=DEFAULT_CONTEXTS, help="the context sweep's lengths")
    b.add_argument("--context-batches", type=int, nargs="+", default=DEFAULT_CONTEXT_BATCHES,
                   help="batch sizes of the context sweep")
    b.add_argument("--steps", type=int, default=8, help="decode steps timed per point")
    b.add_argument("--output", type=output_file, default="bench-results/scaling.json")


def run_scaling(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill import LLM
    from tokenmill.bench.longctx import long_context_copy
    from tokenmill.bench.roofline import StepCost, decode_tokens_per_request, measure_decode
    from tokenmill.config import engine_args
    from tokenmill.hub import model_path

    sizes = [*args.batch_sizes, *args.contexts, *args.context_batches, args.context, args.steps]
    if min(sizes) < 1:
        raise TokenmillError("--batch-sizes, --contexts, --context-batches, --context and --steps must be >= 1")
    source = model_path(args.model_path or args.model)

    def need(batch: int, context: int) -> int:   # tokens per request at a point
        return context + decode_tokens_per_request(batch, context, args.steps, args.max_num_batched_tokens)

    longest = max(need(b, c) for b, c in [(max(args.batch_sizes), args.context), *((max(args.context_batches), c)
                                                                                 for c in args.contexts)])
    # past the trained length (a GGUF's copy that says longer): speed only
    model = long_context_copy(source, longest) if source.endswith(".gguf") else source
    # room for the largest point of either sweep at once
    flags = engine_args(args)

    tokens = max(max(args.batch_sizes) * need(max(args.batch_sizes), args.context),
                 max(args.context_batches) * need(max(args.context_batches), max(args.contexts)))
    llm = LLM(model, **{**flags, "max_model_len": longest,
                        "max_num_seqs": max(args.max_num_seqs, *args.batch_sizes, *args.context_batches),
                        "num_kv_blocks": flags.get("num_kv_blocks") or tokens // args.block_size + 1})
    engine = llm.engine
    if engine.device.type != "cpu":
        raise TokenmillError("bench scaling measures this CPU; run it with --device cpu")
    cost = StepCost.of(engine)

    def measure(batch: int, context: int) -> tuple[int, int, float]:
        print(f"  batch {batch}, context {context} ...", flush=True)
        return batch, context, measure_decode(llm, batch, context, args.steps)

    def point(batch: int, context: int, tok_s: float) -> dict[str, Any]:
        row = cost.decode(batch, context, tok_s)
        return {**asdict(row), "batch": batch, "context": context, "fraction": row.fraction,
                "step_ms": 1e3 * batch / row.measured_tok_s, "bound_step_ms": 1e3 * batch / row.bound_tok_s}

    print("batch sweep:", flush=True)
    batch_runs = [measure(b, args.context) for b in sorted(set(args.batch_sizes))]
    print("context sweep:", flush=True)
    context_runs = [measure(b, c) for b in sorted(set(args.context_batches)) for c in sorted(set(args.contexts))]
    cost = cost.remeasured()
    batch_sweep, context_sweep = [point(*r) for r in batch_runs], [point(*r) for r in context_runs]
    report = {"model": source, "run_model": model, "dtype": str(engine.dtype), "kv_dtype": str(engine.kv_dtype),
              "machine": asdict(cost.machine), "weight_bytes_per_step": cost.weight_bytes,
              "kv_bytes_per_token": cost.kv_bytes_per_token,
              "steps": args.steps, "batch_sweep": batch_sweep, "context_sweep": context_sweep}
    print_report(report)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    report["plots"] = plot(report, out)
    return report


def print_report(report: dict[str, Any]) -> None:
    m = report["machine"]
    print(f"\nmodel: {report['model']}  weights read per step: {report['weight_bytes_per_step'] / 2**20:.1f} MiB  "
          f"K/V: {report['kv_bytes_per_token']} B/token")
    print(f"machine ({m['threads']} threads): read {m['read_gb_s']:.1f} GB/s, {m['matmul']} {m['matmul_gflop_s']:.0f} "
          f"GFLOP/s")
    print(f"\n{'batch':>6}{'context':>9}{'step ms':>10}{'bound ms':>10}{'tok/s':>9}{'bound':>9}{'fraction':>10}"
          f"{'bound by':>10}")
    for sweep in ("batch_sweep", "context_sweep"):
        for r in report[sweep]:
            print(f"{r['batch']:>6}{r['context']:>9}{r['step_ms']:>10.2f}{r['bound_step_ms']:>10.2f}"
                  f"{r['measured_tok_s']:>9.1f}{r['bound_tok_s']:>9.1f}{r['fraction']:>10.0%}{r['bound_by']:>10}")
        print()


def plot(report: dict[str, Any], out: Path) -> list[str]:
    """The two PNGs next to the JSON; none (said so) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("no plots: matplotlib is not installed (pip install -e .[bench])")
        return []
    matplotlib.use("Agg")   # files only, no display
    import matplotlib.pyplot as plt

    written = []
    sweeps = {
        "batch": (report["batch_sweep"], "batch", "batch size", f"context {report['batch_sweep'][0]['context']}"
                  if report["batch_sweep"] else ""),
        "context": (report["context_sweep"], "context", "context length (tokens)", ""),
    }
    for name, (rows, x_key, x_label, note) in sweeps.items():
        if not rows:
            continue
        fig, (rates, fractions) = plt.subplots(1, 2, figsize=(11, 4.2))
        series: dict[Any, list[dict[str, Any]]] = {}
        for r in rows:   # one line per batch size in the context sweep, one in the batch sweep
            series.setdefault(r["batch"] if name == "context" else None, []).append(r)
        for key, points in series.items():
            xs = [p[x_key] for p in points]
            label = "" if key is None else f"batch {key}, "
            line, = rates.plot(xs, [p["measured_tok_s"] for p in points], "o-", label=f"{label}measured")
            rates.plot(xs, [p["bound_tok_s"] for p in points], "--", color=line.get_color(), label=f"{label}bound")
            fractions.plot(xs, [p["fraction"] for p in points], "o-", color=line.get_color(),
                           label=label.rstrip(", ") or "measured / bound")
        for ax in (rates, fractions):
            ax.set_xscale("log", base=2)
            ax.set_xlabel(x_label)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        rates.set_yscale("log")
        rates.set_ylabel("decode tokens/s")
        rates.set_title(f"decode tokens/s vs the roofline bound {note}".strip())
        fractions.set_ylabel("measured / bound")
        fractions.set_ylim(0, 1.1)
        fractions.set_title("fraction of the bound")
        fig.suptitle(f"{Path(report['model']).name}, threads: {report['machine']['threads']}, "
                     f"{report['machine']['read_gb_s']:.0f} GB/s, {report['machine']['matmul_gflop_s']:.0f} GFLOP/s",
                     fontsize=9)
        fig.tight_layout()
        path = out.with_name(f"{out.stem}-{name}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
        print(f"wrote {path}")
    return written


def cmd_scaling(args: argparse.Namespace) -> int:
    run_scaling(args)
    return 0
