"""`tokenmill bench compare`: tokenmill against llama.cpp and Hugging Face `transformers`, side by
side in the same run, on the same GGUF file (default: the embedded SmolLM2-135M-Instruct), with
the same thread count for everyone (default 2) and one table of ratios.

What is measured, each engine in its own process, one after the other:

- batch 1: `bench latency`'s rows (the same prompt ids for every engine, a fresh prompt for every
  repeat; prefill tokens/s for each `--prefill-lens`, 128 and 512, and decode tokens/s of 128
  greedy tokens after a 32-token prompt, as `batch1.measure` defines them). Engines: tokenmill's
  `LLM` API, llama.cpp through llama-cpp-python's `Llama` (`batch1.llama_cpp`, in a process that
  does not import torch, whose ~200 MiB would count as llama.cpp's memory), and `transformers`
  `generate`.
- concurrent load, two workloads, each level `--concurrent-repeats` times with fresh prompts (the
  median and the spread reported): the mixed workload of `bench throughput` (`--concurrency`,
  default 8 and 32: lengths drawn with a fixed seed, mostly prompt tokens) and a decode-heavy one
  (`--decode-heavy-concurrency`, default 8, 32, 64: 2 x C requests of 32 prompt tokens and 128
  output tokens), greedy, ignore_eos, streamed through the load generator of `bench serve` to
  `tokenmill serve` and to llama.cpp's C++ `llama-server`, started for each level with `-np` = that
  level (continuous batching; -c = level x the context a request needs; tokenmill's pool holds as
  many tokens for the largest level). A request that gets fewer or more tokens than asked is shown
  in the table and fails the command. `transformers` has no server: it runs the mixed requests as
  static batches of C (`bench throughput`'s runner). A third workload, sampled
  (`--sampled-concurrency`, default 32), is the decode-heavy one drawn at temperature 1 through
  llama.cpp's default filters (top-k 40, top-p 0.95, min-p 0.05; sent to both servers, which apply
  them before the temperature), as a chat client's requests are, rather than greedily.
- peak resident memory of each engine's process (batch-1 process; server or batch process).
- with `--quant-types` (e.g. every type of `peers.QUANT_TYPES`: Q4_0 Q4_1 Q5_K_M Q4_K_M Q6_K Q8_0
  F16), the batch-1 rows again for tokenmill and llama.cpp on each type, made from the same weights
  by llama.cpp's own `llama-quantize` (`peers.quantized_copy`; built with llama-server): llama.cpp
  has fast paths for some types and not for others, so one type's ratios do not speak for the rest.
- with `--long-contexts` (e.g. 2048 8192 16384), `bench longctx`'s rows: batch-1 prefill of prompts
  that long and decode after them, against llama.cpp with flash attention and the same K/V bytes,
  and decode as a fraction of the bandwidth bound (`longctx.measure`).

A peer that is not installed is a column saying so (and the command says how to install it); the
others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from tokenmill.bench import batch1, longctx, output_file, peers, positive_seconds
from tokenmill.bench import serve as bench_serve
from tokenmill.bench.latency import (
    DEFAULT_DECODE_PROMPT_LEN,
    add_batch1_args,
    batch1_config,
    check_batch1_args,
    tokenmill_row,
    transformers_row,
)
from tokenmill.bench.procs import load_average, print_load, run_bare, run_spawned, vm_hwm_mib
from tokenmill.bench.structured import spread_stat
from tokenmill.bench.throughput import run_transformers
from tokenmill.bench.workload import check_range, context_for, make_lengths, make_prompts
from tokenmill.errors import TokenmillError

DEFAULT_THREADS = 2
DEFAULT_CONCURRENCY = [8, 32]
DEFAULT_DECODE_HEAVY_CONCURRENCY = [8, 32, 64]
DECODE_HEAVY_PROMPT_LEN = 32
DECODE_HEAVY_OUTPUT_LEN = 128
DEFAULT_CONCURRENT_REPEATS = 3
DEFAULT_NUM_REQUESTS = 32    # per concurrency level; `bench throughput`'s issue size is 64 (--num-requests 64)
ENGINES = ["tokenmill", "llama.cpp", "transformers"]
DEFAULT_SAMPLED_CONCURRENCY = [32]
# The sampled workload's fields: llama.cpp's default filters, at temperature 1 (where both engines
# draw from the same distribution whatever order they apply the filters and the temperature in).
SAMPLING = bench_serve.sampling_fields(1.0, top_p=0.95, top_k=40, min_p=0.05)
# workload -> its rows' key prefix
WORKLOADS = {"mixed": "concurrent", "decode-heavy": "decode_heavy", "sampled": "sampled"}
# The issues' targets, as tokenmill / llama.cpp ratios in the same run: (row key, minimum ratio).
TARGETS = {"prefill_512_tok_s": 2.0, "decode_tok_s": 1.0, "concurrent_32_out_tok_s": 3.0,
           "decode_heavy_32_out_tok_s": 4.0, "decode_heavy_64_out_tok_s": 4.0, "long_8192_prefill_tok_s": 4.0}
LONG_DECODE_TARGET = 3.0         # every long context's decode ratio
LONG_ROOFLINE_TARGET = 0.85      # and tokenmill's decode there as a fraction of the bandwidth bound


def add_compare_args(b: argparse.ArgumentParser) -> None:
    # --threads (an engine flag, see config.EngineConfig) is every engine's thread count here:
    # torch.set_num_threads, llama.cpp's -t/-tb.
    b.set_defaults(threads=DEFAULT_THREADS)
    add_batch1_args(b)
    g = b.add_argument_group("compare")
    g.add_argument("--peers", nargs="*", default=["llama.cpp", "transformers"], choices=ENGINES[1:],
                   help="peers to run next to tokenmill (default: both)")
    g.add_argument("--concurrency", type=int, nargs="*", default=DEFAULT_CONCURRENCY,
                   help="concurrency levels of the mixed workload (none: no mixed rows)")
    g.add_argument("--decode-heavy-concurrency", type=int, nargs="*", default=DEFAULT_DECODE_HEAVY_CONCURRENCY,
                   help=f"concurrency levels of the decode-heavy workload: 2 x C requests of {DECODE_HEAVY_PROMPT_LEN} "
                   f"prompt and {DECODE_HEAVY_OUTPUT_LEN} output tokens (none: no decode-heavy rows)")
    g.add_argument("--sampled-concurrency", type=int, nargs="*", default=DEFAULT_SAMPLED_CONCURRENCY,
                   help="concurrency levels of the decode-heavy workload sampled with llama.cpp's default filters "
                   "at temperature 1 (none: no sampled rows)")
    g.add_argument("--concurrent-repeats", type=int, default=DEFAULT_CONCURRENT_REPEATS,
                   help="runs of each concurrent level, fresh prompts each (the median and the spread are reported)")
    g.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS,
                   help="requests per concurrency level (the issue's workload size: 64)")
    g.add_argument("--seed", type=int, default=0, help="seed of the request lengths and prompts")
    g.add_argument("--input-len-range", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    g.add_argument("--output-len-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    g.add_argument("--long-contexts", type=int, nargs="*", default=[], metavar="N",
                   help="also batch 1 after prompts of N tokens (bench longctx's rows, e.g. 2048 8192 16384; "
                   "llama.cpp with flash attention)")
    g.add_argument("--long-decode-tokens", type=int, default=longctx.DEFAULT_DECODE_TOKENS,
                   help="decode tokens timed after each long prompt")
    g.add_argument("--timeout", type=positive_seconds, default=600.0, help="seconds per request / per batch-1 run")
    g.add_argument("--llama-server", default=None, metavar="PATH",
                   help="a llama-server binary (default: $TOKENMILL_LLAMA_SERVER, else the one built into the cache)")
    g.add_argument("--build-peers", action="store_true",
                   help="build llama-server and llama-quantize first if missing (about 6 minutes on 2 cores)")
    g.add_argument("--quant-types", nargs="*", default=[], choices=peers.QUANT_TYPES, metavar="TYPE",
                   help=f"also the batch-1 rows on the model requantized by llama-quantize to each TYPE "
                   f"({' '.join(peers.QUANT_TYPES)})")
    b.add_argument("--output", type=output_file, default="bench-results/compare.json")


# ---- concurrent load --------------------------------------------------------------------------------

def _drive(base_url: str, prompts: list[list[int]], output_lens: list[int], concurrency: int, seed: int,
           timeout: float, sampling: dict[str, float] | None = None) -> dict[str, Any]:
    """Adapter over `bench serve`'s load generator: N streaming requests at fixed concurrency (greedy
    unless `sampling`), summarized (output tokens/s, TTFT / ITL / end-to-end percentiles)."""
    import asyncio

    model = bench_serve.served_model(base_url, None)
    results, elapsed = asyncio.run(bench_serve.run_level(base_url, model, prompts, output_lens, concurrency, None,
                                                          seed, None, timeout, sampling))
    return bench_serve.summarize(results, elapsed)


def _serve_run(name: str, start, work: dict[str, Any], levels: set[int] | None, log_path: Path,
               timeout: float) -> dict[str, Any]:
    """Start a server (`start()` -> (process, base_url)), warm it up, drive each workload's levels
    (those in `levels`; None: all) `work["repeats"]` times, read its peak RSS, stop it."""
    process, base_url = start()
    row: dict[str, Any] = {"engine": name, "levels": {}}
    try:
        t0 = time.perf_counter()
        bench_serve.wait_ready(base_url, process, bench_serve.SERVER_START_TIMEOUT_S)
        row["ready_s"] = time.perf_counter() - t0
        _drive(base_url, work["warmup_prompts"], [4] * len(work["warmup_prompts"]), len(work["warmup_prompts"]),
               work["seed"], timeout)
        for workload, spec in work["workloads"].items():
            for level in spec["levels"]:
                if levels is not None and level not in levels:
                    continue
                runs = []
                for rep in range(work["repeats"]):
                    print_load(f"{name}: {workload}, {len(spec['output_lens'][level])} requests at concurrency "
                               f"{level}, repeat {rep + 1}/{work['repeats']}")
                    # Fresh prompts for every run: a server must not answer one run from its prompt cache of
                    # the one before (both tokenmill and llama-server cache prompts).
                    runs.append(_drive(base_url, spec["prompts"][level][rep], spec["output_lens"][level], level,
                                       work["seed"], timeout, spec.get("sampling")))
                row["levels"][f"{workload}/{level}"] = level_summary(runs)
        row["peak_rss_mib"] = vm_hwm_mib(process.pid)
    finally:
        code = bench_serve.stop_process(process)
        if code not in (0, None, -15):
            print(f"  {name} exited with status {code}; its log: {log_path}", flush=True)
    return row


def level_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A level's repeated runs: output tok/s median and spread ((max - min) / median), and the
    requests that failed or got the wrong number of tokens, over all runs."""
    rates = spread_stat([r["output_tok_s"] for r in runs])
    return {"output_tok_s": rates["median"], "spread": rates["spread"],
            "failed": sum(r["failed"] for r in runs), "short_outputs": sum(r["short_outputs"] for r in runs),
            "runs": runs}


# ---- the command ----------------------------------------------------------------------------------------

def _check_args(args: argparse.Namespace) -> None:
    check_batch1_args(args)
    for name in ("threads", "num_requests"):
        if getattr(args, name) < 1:
            raise TokenmillError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    for name in ("concurrency", "decode_heavy_concurrency", "sampled_concurrency"):
        if any(c < 1 for c in getattr(args, name)):
            raise TokenmillError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.concurrent_repeats < 1:
        raise TokenmillError(f"--concurrent-repeats: must be >= 1, got {args.concurrent_repeats}")
    if args.long_decode_tokens < 1:
        raise TokenmillError(f"--long-decode-tokens: must be >= 1, got {args.long_decode_tokens}")
    if args.long_contexts:
        args.long_contexts = longctx.check_contexts(args.long_contexts)


def run_compare_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.hub import model_path
    from tokenmill.tokenizer import load_tokenizer

    _check_args(args)
    input_range = check_range("--input-len-range", args.input_len_range)
    output_range = check_range("--output-len-range", args.output_len_range)
    model = model_path(args.model)
    if not Path(model).is_file() or not model.endswith(".gguf"):
        raise TokenmillError(f"--model: bench compare needs a .gguf file (llama.cpp runs it too), got {model!r}")
    levels = sorted(set(args.concurrency))
    dh_levels = sorted(set(args.decode_heavy_concurrency))
    sampled_levels = sorted(set(args.sampled_concurrency))
    all_levels = sorted(set(levels) | set(dh_levels) | set(sampled_levels))
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bench_start = time.perf_counter()

    # Which peers are there.
    server_status = peers.llama_server_status(args.llama_server)
    if args.build_peers and ((all_levels and "llama.cpp" in args.peers and not server_status.available)
                             or (args.quant_types and not peers.llama_quantize_status().available)):
        peers.build_llama_server()
        server_status = peers.llama_server_status(args.llama_server)
    status = {"llama_cpp": peers.llama_cpp_python_status(), "llama_server": server_status}
    missing = [s for s in status.values() if not s.available] if "llama.cpp" in args.peers else []
    for s in missing:
        print(f"{s.name}: {s.detail}", flush=True)

    # The workload: the same token ids for every engine.
    tokenizer = load_tokenizer(model_path(args.tokenizer) if args.tokenizer else model)
    seed = args.seed
    b1 = batch1_config(args, model, tokenizer, seed)
    lengths = make_lengths(args.num_requests, input_range, output_range, seed)
    prompts = make_prompts(tokenizer, [i for i, _ in lengths], seed)
    output_lens = [o for _, o in lengths]
    ctx_per_slot = context_for(max(input_range[1] + output_range[1], DECODE_HEAVY_PROMPT_LEN + DECODE_HEAVY_OUTPUT_LEN))
    slots = max(all_levels) if all_levels else 1
    cfg: dict[str, Any] = {
        "model": model, "threads": args.threads, "peers": args.peers, "prefill_lens": args.prefill_lens,
        "decode_tokens": args.decode_tokens, "decode_prompt_len": DEFAULT_DECODE_PROMPT_LEN,
        "repeats": args.repeats, "concurrency": levels, "num_requests": args.num_requests, "seed": seed,
        "decode_heavy_concurrency": dh_levels, "decode_heavy_prompt_len": DECODE_HEAVY_PROMPT_LEN,
        "decode_heavy_output_len": DECODE_HEAVY_OUTPUT_LEN, "sampled_concurrency": sampled_levels,
        "sampling": SAMPLING, "concurrent_repeats": args.concurrent_repeats,
        "input_len_range": list(input_range), "output_len_range": list(output_range),
        "output_tokens": sum(output_lens), "batch1_n_ctx": b1["n_ctx"], "server_slots": slots,
        "server_ctx_per_slot": ctx_per_slot, "cpu_count": os.cpu_count(), "quant_types": args.quant_types,
        "long_contexts": args.long_contexts,
        "llama_cpp_python_pin": peers.LLAMA_CPP_PYTHON_VERSION, "llama_repack": b1["repack"],
        "engine_args": b1["engine_args"],
    }
    results: dict[str, dict[str, Any]] = {e: {"engine": e} for e in ENGINES}
    load_avgs: dict[str, float | None] = {}

    def note_load(label: str) -> None:
        """Before each run: save what is measured so far (a run stopped later keeps it), print the load."""
        out_path.write_text(json.dumps({"config": cfg, "partial": True, "load_average_before": load_avgs,
                                        "results": results}, indent=2, default=str))
        load_avgs[label] = load_average()
        print_load(label)

    # ---- batch 1 ----
    note_load("tokenmill batch 1")
    results["tokenmill"]["batch1"] = run_spawned(tokenmill_row, b1)
    dtype = results["tokenmill"]["batch1"]["dense_dtype"]   # the transformers peer's
    if "llama.cpp" in args.peers:
        if status["llama_cpp"].available:
            note_load("llama.cpp (llama_cpp.Llama) batch 1")
            results["llama.cpp"]["batch1"] = peers.guarded("llama.cpp batch 1", run_bare, batch1.llama_cpp, b1,
                                                      args.timeout * 4)
        else:
            results["llama.cpp"]["batch1"] = {"missing": status["llama_cpp"].detail}
    if "transformers" in args.peers:
        note_load(f"transformers batch 1 ({dtype})")
        results["transformers"]["batch1"] = peers.guarded("transformers batch 1", run_spawned, transformers_row,
                                                     {**b1, "dtype": dtype})

    # ---- batch 1 on each GGUF type ----
    for qtype in args.quant_types:
        try:
            typed = {**b1, "model": peers.quantized_copy(model, qtype, args.threads)}
        except TokenmillError as e:
            print(f"{qtype}: {e}", flush=True)
            for engine in ("tokenmill", "llama.cpp"):
                results[engine].setdefault("types", {})[qtype] = {"error": str(e)}
            continue
        note_load(f"tokenmill batch 1, {qtype}")
        results["tokenmill"].setdefault("types", {})[qtype] = peers.guarded(
            f"tokenmill batch 1, {qtype}", run_spawned, tokenmill_row, typed)
        if "llama.cpp" in args.peers and status["llama_cpp"].available:
            note_load(f"llama.cpp batch 1, {qtype}")
            results["llama.cpp"].setdefault("types", {})[qtype] = peers.guarded(
                f"llama.cpp batch 1, {qtype}", run_bare, batch1.llama_cpp, typed, args.timeout * 4)

    # ---- long context ----
    if args.long_contexts:
        note_load("long context")
        cfg["long"], long_results = longctx.measure(model, args.long_contexts, args, args.long_decode_tokens,
                                                    "llama.cpp" in args.peers, load_avgs,
                                                    max(args.timeout, longctx.DEFAULT_TIMEOUT_S))
        for engine, row in long_results.items():
            results[engine]["long"] = row

    # ---- concurrent load ----
    if all_levels:
        repeats = args.concurrent_repeats

        def fresh(lengths: list[int], level: int, workload: str) -> list[list[list[int]]]:
            return [make_prompts(tokenizer, lengths, seed, tag=f"{workload} {level}.{rep} request")
                    for rep in range(repeats)]

        def decode_heavy(levels: list[int], tag: str) -> dict[str, Any]:
            """2 x C requests of the decode-heavy shape per level C."""
            return {"levels": levels, "output_lens": {c: [DECODE_HEAVY_OUTPUT_LEN] * (2 * c) for c in levels},
                    "prompts": {c: fresh([DECODE_HEAVY_PROMPT_LEN] * (2 * c), c, tag) for c in levels}}

        workloads = {
            "mixed": {"levels": levels, "output_lens": {c: output_lens for c in levels},
                      "prompts": {c: fresh([len(p) for p in prompts], c, "Mixed") for c in levels}},
            "decode-heavy": decode_heavy(dh_levels, "Decode-heavy"),
            "sampled": {**decode_heavy(sampled_levels, "Sampled"), "sampling": SAMPLING}}
        work = {"workloads": workloads, "seed": seed, "repeats": repeats,
                "warmup_prompts": make_prompts(tokenizer, [16] * 2, seed, tag="Warm-up")}
        serve_args = argparse.Namespace(**vars(args))
        if serve_args.num_kv_blocks is None and serve_args.kv_cache_memory is None:
            serve_args.num_kv_blocks = slots * ctx_per_slot // args.block_size   # llama-server's -c, in blocks
        serve_args.max_num_seqs = max(args.max_num_seqs, slots)

        def start_tokenmill():
            saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
            os.environ.update({k: str(args.threads) for k in saved})
            try:
                return bench_serve.start_tokenmill(model, serve_args, out_path.with_name(f"{out_path.stem}-tokenmill"
                                                                                            ".log"))
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v

        note_load("tokenmill serve")
        results["tokenmill"]["concurrent"] = _serve_run(
            "tokenmill", start_tokenmill, work, None, out_path.with_name(f"{out_path.stem}-tokenmill.log"),
            args.timeout)
        if "llama.cpp" in args.peers:
            if status["llama_server"].available:
                binary = status["llama_server"].where
                extra = f"-t {args.threads} -tb {args.threads}"
                log = out_path.with_name(f"{out_path.stem}-llama-server.log")
                cfg["llama_server"] = {"binary": binary, "slots": "the level's concurrency",
                                       "ctx_per_slot": ctx_per_slot, "args": extra}
                merged: dict[str, Any] = {"engine": "llama-server", "levels": {}, "peak_rss_mib": 0.0}
                for level in all_levels:   # -np = the level: a server per level
                    note_load(f"llama-server -np {level}")
                    row = peers.guarded(
                        f"llama-server -np {level}", _serve_run, "llama-server",
                        lambda level=level: bench_serve.start_llama_server(binary, model, level, ctx_per_slot, extra,
                                                                           log),
                        work, {level}, log, args.timeout)
                    if "error" in row:
                        merged = row
                        break
                    merged["levels"].update(row["levels"])
                    merged["peak_rss_mib"] = max(merged["peak_rss_mib"], row["peak_rss_mib"] or 0.0)
                results["llama.cpp"]["concurrent"] = merged
            else:
                results["llama.cpp"]["concurrent"] = {"missing": status["llama_server"].detail}
        if "transformers" in args.peers and levels:
            note_load(f"transformers static batches of {levels}")
            row = peers.guarded("transformers static batches", run_spawned, run_transformers, {
                "model": model, "threads": args.threads, "resolved_dtype": dtype,
                "resolved_device": "cpu", "peer_num_requests": len(prompts), "prompts": prompts,
                "output_lens": output_lens, "pad_token_id": b1["pad_token_id"], "hf_batch_sizes": levels})
            if "error" not in row:
                row["levels"] = {f"mixed/{r['batch_size']}": r for r in row["per_batch_size"]}
            results["transformers"]["concurrent"] = row

    cfg["wall_s"] = time.perf_counter() - bench_start
    table = build_table(cfg, results)
    agreement = greedy_agreement(results)
    roofline = long_roofline(results)
    print_table(cfg, table, load_avgs, status if missing else {}, agreement, roofline)
    report = {"config": cfg, "load_average_before": load_avgs, "peers": peers.status_dict(), "table": table,
              "greedy_agreement": agreement, "long_roofline": roofline, "results": results,
              "input_lens": [len(p) for p in prompts], "output_lens": output_lens}
    out_path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out_path}")
    return report


# ---- the table ------------------------------------------------------------------------------------------

def _metric_rows(cfg: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(key, label, where in an engine's results): the table's rows, in order."""
    rows = [(f"prefill_{n}_tok_s", f"prefill {n} tok/s", "batch1") for n in cfg["prefill_lens"]]
    rows.append(("decode_tok_s", "decode tok/s", "batch1"))
    for qtype in cfg.get("quant_types", []):   # key "TYPE/metric", where "types/TYPE"
        rows += [(f"{qtype}/prefill_{n}_tok_s", f"{qtype} prefill {n} tok/s", f"types/{qtype}")
                 for n in cfg["prefill_lens"]]
        rows.append((f"{qtype}/decode_tok_s", f"{qtype} decode tok/s", f"types/{qtype}"))
    for n in cfg.get("long_contexts", []):
        rows += [(f"long_{n}_prefill_tok_s", f"{n}-token prompt prefill tok/s", "long"),
                 (f"long_{n}_decode_tok_s", f"{n}-token prompt decode tok/s", "long")]
    rows += [(f"concurrent_{c}_out_tok_s", f"mixed {c}-conc. out tok/s", "concurrent") for c in cfg["concurrency"]]
    rows += [(f"decode_heavy_{c}_out_tok_s", f"decode-heavy {c}-conc. out tok/s", "concurrent")
             for c in cfg["decode_heavy_concurrency"]]
    rows += [(f"sampled_{c}_out_tok_s", f"sampled {c}-conc. out tok/s", "concurrent")
             for c in cfg.get("sampled_concurrency", [])]
    rows.append(("batch1_peak_rss_mib", "peak RSS MiB, batch 1", "batch1"))
    if _served(cfg):
        rows.append(("concurrent_peak_rss_mib", "peak RSS MiB, concurrent", "concurrent"))
    return rows


def _served(cfg: dict[str, Any]) -> bool:
    """Whether the run had concurrent (served) rows."""
    return bool(cfg["concurrency"] or cfg["decode_heavy_concurrency"] or cfg.get("sampled_concurrency"))


def _value(result: dict[str, Any], key: str, where: str) -> float | str | None:
    if where.startswith("types/"):   # a GGUF type's batch-1 rows
        part = result.get("types", {}).get(where.removeprefix("types/"))
        key = key.split("/", 1)[1]
    else:
        part = result.get(where)
    if part is None:
        return None   # not run (--peers)
    if "missing" in part:
        return "not built" if "not built" in part["missing"] else "not installed"
    if "error" in part:
        return "error"
    if key.endswith("peak_rss_mib"):
        return part.get("peak_rss_mib")
    if where == "long":   # "long_N_prefill_tok_s" -> the rate at context N
        _, n, metric = key.split("_", 2)
        return part["contexts"][n][metric]
    name = _level_name(key)
    if name is not None:
        level = part["levels"].get(name)
        if level is None:
            return None
        if level.get("failed"):
            return f"{level['failed']} failed"
        if level.get("short_outputs"):
            return f"{level['short_outputs']} short"
        return level["output_tok_s"]
    return part.get(key)


def _level_name(key: str) -> str | None:
    """The results' level of a concurrent row ("decode_heavy_32_out_tok_s" -> "decode-heavy/32"); None
    for the other rows."""
    for workload, prefix in WORKLOADS.items():
        if key.startswith(prefix + "_") and key.endswith("_out_tok_s"):
            return f"{workload}/{key.removeprefix(prefix + '_').split('_')[0]}"
    return None


def _spread(result: dict[str, Any], key: str, where: str) -> float | None:
    """A concurrent row's spread over its repeats (None elsewhere)."""
    part, name = result.get(where) or {}, _level_name(key)
    if name is None or "levels" not in part:
        return None
    return (part["levels"].get(name) or {}).get("spread")


def build_table(cfg: dict[str, Any], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    table = []
    for key, label, where in _metric_rows(cfg):
        row: dict[str, Any] = {"metric": key, "label": label}
        for engine in ENGINES:
            row[engine] = _value(results[engine], key, where)
        row["spreads"] = {engine: _spread(results[engine], key, where) for engine in ENGINES}
        tm, lc = row["tokenmill"], row["llama.cpp"]
        numeric = isinstance(tm, (int, float)) and isinstance(lc, (int, float)) and lc > 0
        row["ratio"] = tm / lc if numeric else None
        target = target_of(key)
        row["target"] = target
        row["met"] = None if target is None or row["ratio"] is None else row["ratio"] >= target
        table.append(row)
    return table


def long_roofline(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """tokenmill's decode after each long prompt as a fraction of the bandwidth bound, against
    LONG_ROOFLINE_TARGET."""
    long = results["tokenmill"].get("long") or {}
    return [{"context": int(n), "bound_tok_s": row["decode_bound_tok_s"], "fraction": row["decode_roofline_fraction"],
             "read_gb_s": long["read_gb_s"], "target": LONG_ROOFLINE_TARGET,
             "met": row["decode_roofline_fraction"] >= LONG_ROOFLINE_TARGET}
            for n, row in long.get("contexts", {}).items()]


def target_of(key: str) -> float | None:
    """A row's target ratio (a GGUF type's rows: the batch-1 targets)."""
    if key.startswith("long_") and key.endswith("_decode_tok_s"):
        return LONG_DECODE_TARGET
    return TARGETS.get(key.split("/")[-1])


def greedy_agreement(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    """For each peer with batch-1 results: how many leading greedy tokens (first decode prompt, the
    same ids for everyone) equal tokenmill's. Quantized and dequantized weights may part ways
    after a while; a mismatch at token 0 means the engines do not run the same model."""
    pairs = [(engine, results["tokenmill"].get("batch1"), results[engine].get("batch1")) for engine in ENGINES[1:]]
    pairs += [(f"llama.cpp {qtype}", row, results["llama.cpp"].get("types", {}).get(qtype))
              for qtype, row in results["tokenmill"].get("types", {}).items()]
    agree = {}
    for name, mine, theirs in pairs:
        mine, theirs = (mine or {}).get("greedy_tokens"), (theirs or {}).get("greedy_tokens")
        if mine is not None and theirs is not None:
            same = [a == b for a, b in zip(mine, theirs, strict=False)]
            agree[name] = same.index(False) if False in same else len(same)
    return agree


def _cell(v: Any, key: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return f"{v:.0f}" if key.endswith("rss_mib") or v >= 100 else f"{v:.1f}"


def print_table(cfg: dict[str, Any], table: list[dict[str, Any]], load_avgs: dict[str, float | None],
                missing: dict[str, Any], agreement: dict[str, int], roofline: list[dict[str, Any]]) -> None:
    print(f"\nmodel: {cfg['model']}\nthreads: {cfg['threads']} for every engine (of {cfg['cpu_count']} cores); "
          f"batch 1: median of {cfg['repeats']}, decode = {cfg['decode_tokens']} tokens after a "
          f"{cfg['decode_prompt_len']}-token prompt")
    if cfg["concurrency"]:
        print(f"mixed: {cfg['num_requests']} requests per level, input {cfg['input_len_range'][0]}-"
              f"{cfg['input_len_range'][1]}, output {cfg['output_len_range'][0]}-{cfg['output_len_range'][1]} tokens "
              f"({cfg['output_tokens']} in all); transformers: static batches of C (no server)")
    if cfg["decode_heavy_concurrency"]:
        print(f"decode-heavy: 2 x C requests per level C, {cfg['decode_heavy_prompt_len']} prompt and "
              f"{cfg['decode_heavy_output_len']} output tokens each")
    if cfg.get("sampled_concurrency"):
        print(f"sampled: the decode-heavy requests at {bench_serve.describe_sampling(cfg['sampling'])}")
    if _served(cfg):
        print(f"concurrent rows: greedy (the sampled rows as above), ignore_eos, streamed to `tokenmill serve` and to "
              f"`llama-server -np C` (a server per level); median of {cfg['concurrent_repeats']} runs, fresh "
              f"prompts each (± spread: (max - min) / median)")
    peers.print_repack_note(cfg.get("llama_repack"))
    if cfg.get("engine_args", {}).get("activation_precision", "int16") != "int16":
        print(f"tokenmill runs with activation_precision {cfg['engine_args']['activation_precision']} (not the "
              f"default int16): its quantized matmuls round activations as llama.cpp does")
    loads = [v for v in load_avgs.values() if v is not None]
    if loads:
        print(f"system load average before the runs: {min(loads):.2f}-{max(loads):.2f} (a shared machine: load above "
              f"{cfg['threads']} means other work competed for the cores)")
        if max(loads) > (cfg["cpu_count"] or 1) + 0.5:
            print("WARNING: the machine was busy. Engine threads that wait for each other on shared cores slow down "
                  "unevenly (10-1000x seen on 2 cores): these numbers do not compare the engines; rerun when quiet.")
    header = f"{'metric':<34}{'tokenmill':>13}{'llama.cpp':>15}{'transformers':>15}{'tm/llama.cpp':>14}  target"
    print("\n" + header)
    for r in table:
        key = r["metric"]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        if r["target"] is None:
            target = ""
        elif r["met"] is None:
            target = f">= {r['target']:g}x (no llama.cpp number)"
        else:
            target = f">= {r['target']:g}x {'met' if r['met'] else 'NOT met'}"
        cells = [_cell(r[e], key) + (f" ±{r['spreads'][e]:.0%}" if isinstance(r[e], float) and
                                       r["spreads"].get(e) is not None else "") for e in ENGINES]
        print(f"{r['label']:<34}{cells[0]:>13}{cells[1]:>15}{cells[2]:>15}{ratio:>14}  {target}")
    print("ratio: tokenmill / llama.cpp (rates: higher is better for tokenmill; memory: lower is)")
    if cfg.get("long_contexts"):
        print(f"N-token prompt rows (bench longctx): llama.cpp with flash attention and K/V of tokenmill's cache size "
              f"(f16 for bf16); decode = {cfg['long']['decode_tokens']} tokens after the first")
    for r in roofline:
        print(f"{r['context']}-token prompt decode: {r['fraction']:.0%} of the bandwidth bound ({r['bound_tok_s']:.0f} "
              f"tok/s at {r['read_gb_s']:.1f} GB/s read): >= {r['target']:.0%} {'met' if r['met'] else 'NOT met'}")
    if agreement:
        print("greedy decode tokens equal to tokenmill's, from the start (same prompt ids): "
              + ", ".join(f"{e} {n}/{cfg['decode_tokens']}" for e, n in agreement.items()))
    for s in missing.values():
        if not s.available:
            print(f"{s.name} is missing: {s.detail}")


def cmd_compare(args: argparse.Namespace) -> int:
    report = run_compare_bench(args)
    broken = [r["label"] for r in report["table"] for e in ENGINES
              if isinstance(r[e], str) and (r[e] == "error" or "failed" in r[e] or "short" in r[e])]
    return 1 if broken else 0

