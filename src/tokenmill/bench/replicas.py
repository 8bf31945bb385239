"""`tokenmill bench replicas [MODEL]`: several engine processes behind one server, measured
through HTTP (`tokenmill serve` started here for each configuration, driven by bench/serve.py's
streaming client; greedy, ignore_eos, so every configuration generates the same tokens).

Data parallelism (`--data-parallel-size`), on this machine's cores split between replicas:
- throughput: DP=1 with every core vs DP=2 with half of them each, on a uniform workload
  (`--num-requests` requests at `--concurrency`); the target is DP=2 >= 0.9x DP=1 (replication,
  routing and relaying cost under 10%);
- prefix-heavy: groups of requests sharing a long prefix, shuffled; the prefix-cache hit rate of
  DP=1 (one cache sees everything) vs DP=2, whose router must send each group to the replica that
  cached it, and the share of its requests routed by cache affinity.

Disaggregation (`--kv-transfer-config`): short-prompt streams decoding while a burst of long
prompts arrives; colocated (one engine, every core) vs a prefill and a decode engine (half each).
Reported: the short streams' inter-token latency p50/p99 (the target: p99 >= 2x lower
disaggregated) and the long prompts' time to first token.

Each configuration runs `--repeats` times (a fresh server each time); the table shows medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

from tokenmill.bench import output_file, positive_int, positive_seconds
from tokenmill.bench.procs import print_load
from tokenmill.bench.serve import (
    percentile,
    run_level,
    served_model,
    start_tokenmill,
    stop_process,
    stream_request,
    summarize,
    wait_ready,
)
from tokenmill.bench.workload import make_prompts
from tokenmill.config import cores_per_process

DP_RATIO_TARGET = 0.9
ITL_P99_TARGET = 2.0
KV = '{"kv_connector": "SharedMemoryConnector"}'


def add_replicas_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--what", nargs="+", choices=["dp", "pd"], default=["dp", "pd"])
    b.add_argument("--num-requests", type=positive_int, default=48, help="requests of the uniform DP workload")
    b.add_argument("--concurrency", type=positive_int, default=16, help="requests in flight in the DP workloads")
    b.add_argument("--input-len", type=positive_int, default=192, help="prompt tokens of the uniform DP workload")
    b.add_argument("--output-len", type=positive_int, default=96, help="output tokens of the DP workloads")
    b.add_argument("--prefix-groups", type=positive_int, default=6,
                   help="prefix-heavy workload: groups sharing a prefix")
    b.add_argument("--group-size", type=positive_int, default=6, help="prefix-heavy workload: requests per group")
    b.add_argument("--prefix-len", type=positive_int, default=384, help="prefix-heavy workload: shared prefix tokens")
    b.add_argument("--streams", type=positive_int, default=8, help="disaggregation: short-prompt streams decoding")
    b.add_argument("--stream-output-len", type=positive_int, default=160)
    b.add_argument("--long-prompts", type=positive_int, default=6, help="disaggregation: long prompts in the burst")
    b.add_argument("--long-len", type=positive_int, default=1536, help="disaggregation: tokens per long prompt")
    b.add_argument("--repeats", type=positive_int, default=2)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--timeout", type=positive_seconds, default=600.0,
                   help="seconds per request before it counts as failed")
    b.add_argument("--output", type=output_file, default="bench-results/replicas.json")


def _metric(text: str, name: str, replica: str | None) -> float:
    """A sample's value in /metrics text (with replica="..." when given; 0 when absent)."""
    label = rf'\{{[^}}]*replica="{replica}"[^}}]*\}}' if replica is not None else ""
    match = re.search(rf"^{name}{label} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


class _Server:
    """`tokenmill serve` with extra flags, for one measurement."""

    def __init__(self, model: str, args: argparse.Namespace, log: Path, extra: list[str]):
        self.process, self.url = start_tokenmill(model, args, log, extra)
        self.replicated = "--data-parallel-size" in extra or "--kv-transfer-config" in extra

    def __enter__(self) -> _Server:
        try:
            wait_ready(self.url, self.process, 600)
            self.name = served_model(self.url, None)
        except BaseException:
            stop_process(self.process)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_process(self.process)

    def run(self, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
        """`prompts` at --concurrency, --output-len tokens each: bench/serve.py's summary."""
        results, elapsed = asyncio.run(run_level(self.url, self.name, prompts, [args.output_len] * len(prompts),
                                                 args.concurrency, None, args.seed, None, args.timeout))
        return summarize(results, elapsed)

    def metrics(self) -> str:
        import httpx

        return httpx.get(self.url + "/metrics", timeout=30).text

    def value(self, text: str, name: str) -> float:
        return _metric(text, name, "all" if self.replicated else None)


def run_dp(model: str, args: argparse.Namespace, tokenizer: Any, out: Path) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    configs = [("DP=1", ["--threads", str(cores)]),
               ("DP=2", ["--threads", str(cores_per_process(2)), "--data-parallel-size", "2"])]
    # the uniform workload
    uniform = {name: [] for name, _ in configs}
    prefix = {name: [] for name, _ in configs}
    rng = random.Random(args.seed)
    for repeat in range(args.repeats):
        prompts = make_prompts(tokenizer, [args.input_len] * args.num_requests, args.seed,
                               tag=f"Uniform {repeat}")
        heads = make_prompts(tokenizer, [args.prefix_len] * args.prefix_groups, args.seed, tag=f"Prefix {repeat}")
        tails = make_prompts(tokenizer, [32] * (args.prefix_groups * args.group_size), args.seed + 1,
                             tag=f"Question {repeat}")
        grouped = [heads[i // args.group_size] + tails[i] for i in range(len(tails))]
        rng.shuffle(grouped)
        for name, flags in configs:
            print_load(f"{name} (repeat {repeat + 1})")
            with _Server(model, args, out.with_name(f"{out.stem}-{name}.log"), flags) as server:
                uniform[name].append(server.run(prompts, args))
                before = server.metrics()
                row = server.run(grouped, args)
                after = server.metrics()
                hits = server.value(after, "tokenmill_prefix_cache_hits_total") - \
                    server.value(before, "tokenmill_prefix_cache_hits_total")
                queries = server.value(after, "tokenmill_prefix_cache_queries_total") - \
                    server.value(before, "tokenmill_prefix_cache_queries_total")
                row["prefix_hit_rate"] = hits / queries if queries else 0.0
                routed = {reason: sum(_metric(after, rf'tokenmill_router_requests_total\{{reason="{reason}",'
                                              rf'replica="{r}"\}}', None) -
                                      _metric(before, rf'tokenmill_router_requests_total\{{reason="{reason}",'
                                              rf'replica="{r}"\}}', None) for r in ("0", "1"))
                          for reason in ("cache", "load")}
                if sum(routed.values()):
                    row["routed_by_cache"] = routed["cache"] / sum(routed.values())
                prefix[name].append(row)
    ratio = statistics.median(r["output_tok_s"] for r in uniform["DP=2"]) / \
        statistics.median(r["output_tok_s"] for r in uniform["DP=1"])
    return {"cores": cores, "uniform": uniform, "prefix_heavy": prefix, "dp2_vs_dp1": ratio,
            "target": DP_RATIO_TARGET}


async def _mixed_load(url: str, model: str, streams: list[list[int]], stream_len: int, longs: list[list[int]],
                      burst_after_s: float, timeout: float) -> tuple[list, list]:
    """Short streams from the start, the long prompts all at once `burst_after_s` later."""
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=timeout) as client:
        url = url + "/v1/completions"

        async def long(prompt: list[int]):
            await asyncio.sleep(burst_after_s)
            return await stream_request(client, url, model, prompt, 8, {}, timeout)

        short = [stream_request(client, url, model, p, stream_len, {}, timeout) for p in streams]
        results = await asyncio.gather(*short, *(long(p) for p in longs))
    return list(results[:len(streams)]), list(results[len(streams):])


def run_pd(model: str, args: argparse.Namespace, tokenizer: Any, out: Path) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0))
    configs = [("colocated", ["--threads", str(cores)]),
               ("disaggregated", ["--threads", str(cores_per_process(2)), "--kv-transfer-config", KV])]
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in configs}
    for repeat in range(args.repeats):
        streams = make_prompts(tokenizer, [32] * args.streams, args.seed, tag=f"Stream {repeat}")
        longs = make_prompts(tokenizer, [args.long_len] * args.long_prompts, args.seed, tag=f"Long {repeat}")
        for name, flags in configs:
            print_load(f"{name} (repeat {repeat + 1})")
            with _Server(model, args, out.with_name(f"{out.stem}-{name}.log"), flags) as server:
                # a warm-up: the first requests' one-time costs stay out
                asyncio.run(_mixed_load(server.url, server.name, streams[:1], 4, longs[:1], 0.0, args.timeout))
                start = time.perf_counter()
                short, long = asyncio.run(_mixed_load(server.url, server.name, streams, args.stream_output_len,
                                                      longs, 1.0, args.timeout))
                elapsed = time.perf_counter() - start
            itl = [x for r in short for x in r.itl_s]
            ttft = [r.ttft_s for r in long if r.ttft_s is not None]
            failed = [r.error for r in short + long if not r.ok]
            rows[name].append({"itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
                               "itl_max_ms": 1e3 * max(itl), "long_ttft_p50_ms": 1e3 * percentile(ttft, 50),
                               "long_ttft_max_ms": 1e3 * max(ttft), "elapsed_s": elapsed, "failed": len(failed),
                               "errors": failed[:3]})
    p99 = {name: statistics.median(r["itl_p99_ms"] for r in rows[name]) for name in rows}
    return {"cores": cores, "rows": rows, "itl_p99_improvement": p99["colocated"] / p99["disaggregated"],
            "target": ITL_P99_TARGET}


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def print_report(report: dict[str, Any]) -> None:
    if "dp" in report:
        dp = report["dp"]
        print(f"\ndata parallelism ({dp['cores']} cores: DP=1 uses all, DP=2 half each); medians")
        print(f"{'config':<8}{'workload':<14}{'out tok/s':>11}{'TTFT p50 ms':>13}{'failed':>8}{'short':>7}"
              f"{'prefix hits':>13}{'by cache':>10}")
        for workload in ("uniform", "prefix_heavy"):
            for name, rows in dp[workload].items():
                cache = f"{_median(rows, 'routed_by_cache'):>10.0%}" if "routed_by_cache" in rows[0] else f"{'':>10}"
                hits = f"{_median(rows, 'prefix_hit_rate'):>13.1%}" if "prefix_hit_rate" in rows[0] else f"{'':>13}"
                print(f"{name:<8}{workload:<14}{_median(rows, 'output_tok_s'):>11.1f}"
                      f"{_median(rows, 'ttft_p50_ms'):>13.0f}{sum(r['failed'] for r in rows):>8}"
                      f"{sum(r['short_outputs'] for r in rows):>7}{hits}{cache}")
        verdict = "met" if dp["dp2_vs_dp1"] >= dp["target"] else "NOT met"
        print(f"DP=2 / DP=1 output tok/s (uniform): {dp['dp2_vs_dp1']:.2f}x (target >= {dp['target']}x) {verdict}")
    if "pd" in report:
        pd = report["pd"]
        print("\nprefill/decode disaggregation: short streams decoding through a burst of long prompts; medians")
        print(f"{'config':<15}{'ITL p50 ms':>11}{'ITL p99 ms':>11}{'ITL max ms':>11}{'long TTFT p50 ms':>18}"
              f"{'elapsed s':>10}{'failed':>8}")
        for name, rows in pd["rows"].items():
            print(f"{name:<15}{_median(rows, 'itl_p50_ms'):>11.1f}{_median(rows, 'itl_p99_ms'):>11.1f}"
                  f"{_median(rows, 'itl_max_ms'):>11.1f}{_median(rows, 'long_ttft_p50_ms'):>18.0f}"
                  f"{_median(rows, 'elapsed_s'):>10.1f}{sum(r['failed'] for r in rows):>8}")
        verdict = "met" if pd["itl_p99_improvement"] >= pd["target"] else "NOT met"
        print(f"ITL p99 colocated / disaggregated: {pd['itl_p99_improvement']:.2f}x (target >= {pd['target']}x) "
              f"{verdict}")


def cmd_replicas(args: argparse.Namespace) -> int:
    from tokenmill.hub import model_path
    from tokenmill.tokenizer import load_tokenizer

    model = model_path(args.model_path if args.model_path is not None else args.model)
    tokenizer = load_tokenizer(model)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"model": model, "settings": {k: v for k, v in vars(args).items()
                                                           if isinstance(v, (int, float, str, list))}}
    if "dp" in args.what:
        report["dp"] = run_dp(model, args, tokenizer, out)
    if "pd" in args.what:
        report["pd"] = run_pd(model, args, tokenizer, out)
    print_report(report)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0
