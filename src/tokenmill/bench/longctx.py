"""`tokenmill bench longctx [MODEL]`: long context at batch 1, tokenmill against llama.cpp at its best
there, on the same GGUF and the same prompts, with the same thread count (default 2).

For each context length L (`--contexts`, default 2048, 8192 and 16384) and each of `--repeats`
fresh prompts of L tokens (no prefix cache can help): prefill tokens/s (L / the time to the first
token) and decode tokens/s (`--decode-tokens` greedy tokens after the first, ignore_eos), the
medians (`batch1.measure_long`, the same for both engines). llama.cpp runs through llama-cpp-python
in a process of its own, with flash attention on (`flash_attn`, the `-fa` of its CLI) and the K/V
cache type of tokenmill's (bf16 -> f16, the same bytes per value; int8 -> q8_0), its best settings
at long context. Each decode row also shows tokenmill's rate as a fraction of the memory-bandwidth
bound of a step at that context (`bench roofline`'s: every weight plus the L cached tokens' K/V read
once, at the highest read bandwidth measured in tokenmill's process, before and after its runs).

Where L exceeds the model's context length (SmolLM2's 8192), both engines run a copy of the GGUF
whose `context_length` says L (made once in the cache folder; RoPE unchanged): the text past the
trained length is not meaningful, its speed is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from tokenmill.bench import batch1, output_file, peers, positive_seconds
from tokenmill.bench.procs import load_average, print_load, run_bare, run_spawned
from tokenmill.bench.workload import context_for, make_prompts
from tokenmill.errors import TokenmillError

DEFAULT_CONTEXTS = [2048, 8192, 16384]
DEFAULT_DECODE_TOKENS = 32
DEFAULT_REPEATS = 2
DEFAULT_TIMEOUT_S = 3600.0   # each engine's whole run
KV_TYPES = {"bfloat16": "f16", "int8": "q8_0"}   # tokenmill's cache dtype -> llama.cpp's of the same size
# The issue's targets: (what, context or None for every context, minimum).
TARGETS = [("prefill ratio", 8192, 4.0), ("decode ratio", None, 3.0), ("decode roofline fraction", None, 0.85)]


def add_longctx_args(b: argparse.ArgumentParser) -> None:
    b.set_defaults(threads=2)   # every engine's thread count here
    b.add_argument("--contexts", type=int, nargs="+", default=DEFAULT_CONTEXTS, help="prompt lengths in tokens")
    b.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE_TOKENS,
                   help="decode tokens timed after the first (ignore_eos)")
    b.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="fresh prompts per context length")
    b.add_argument("--no-peer", action="store_true", help="tokenmill only")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT_S,
                   help="seconds for each engine's whole run")
    b.add_argument("--output", type=output_file, default="bench-results/longctx.json")


def long_context_copy(model: str, context: int) -> str:
    """`model`, or where its GGUF says a context length under `context`, a copy in the cache folder
    that says `context` (written once: peers.derived_gguf)."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    field = reader.fields.get(f"{arch}.context_length")
    if field is None or int(field.parts[field.data[0]][0]) >= context:
        return model
    target = peers.derived_gguf(model, "long-context", f"ctx{context}")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(model, partial)
        copy = GGUFReader(partial, "r+")
        f = copy.fields[f"{arch}.context_length"]
        f.parts[f.data[0]][0] = context
        copy.data.flush()
        del copy
        partial.replace(target)
    return str(target)


def tokenmill_long(cfg: dict[str, Any]) -> dict[str, Any]:
    """tokenmill's rows and, after them, the machine's read bandwidth and each context's decode bound
    (run it with `procs.run_spawned`)."""
    import torch

    from tokenmill import LLM
    from tokenmill.bench.latency import stream_gen
    from tokenmill.bench.roofline import read_bandwidth_gb_s, weight_bytes_per_step
    from tokenmill.engine.kv_cache import kv_bytes_per_token

    t0 = time.perf_counter()
    llm = LLM(cfg["model"], **cfg["engine_args"])
    load_s = time.perf_counter() - t0
    before = read_bandwidth_gb_s()
    contexts = batch1.measure_long(stream_gen(llm), cfg)
    engine = llm.engine
    read_samples = [*before, *read_bandwidth_gb_s()]   # the highest bounds (read_bandwidth_gb_s: why)
    read_gb_s = max(read_samples)
    weights = weight_bytes_per_step(engine.model, engine.model_config.vocab_size)
    kv_token = kv_bytes_per_token(engine.model_config, engine.kv_dtype)
    for n, row in contexts.items():   # a batch-1 step reads every weight and the context's K/V once
        row["decode_bound_tok_s"] = read_gb_s * 1e9 / (weights + (int(n) + 1) * kv_token)
        row["decode_roofline_fraction"] = row["decode_tok_s"] / row["decode_bound_tok_s"]
    return {"engine": "tokenmill", "load_s": load_s, "threads": torch.get_num_threads(),
            "kv_dtype": str(engine.kv_dtype).removeprefix("torch."), "read_gb_s": read_gb_s,
            "read_samples": read_samples,
            "weight_bytes_per_step": weights, "kv_bytes_per_token": kv_token, "contexts": contexts}


def check_contexts(contexts: list[int]) -> list[int]:
    if any(n < 16 for n in contexts):
        raise TokenmillError(f"long contexts: each must be >= 16 tokens, got {contexts}")
    return sorted(set(contexts))


def measure(source: str, contexts: list[int], args: argparse.Namespace, decode_tokens: int, peer: bool,
            load_avgs: dict[str, float | None], timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both engines' long-context rows on the GGUF `source` (a copy with a longer context where
    needed), each in its own process: (what ran, {"tokenmill": ..., "llama.cpp": ...}). From `args`:
    every engine flag, threads, repeats, seed; `timeout`: seconds for each engine's whole run (llama.cpp
    takes minutes per 16k-token prompt). Used by this command and `bench compare --long-contexts`."""
    from tokenmill.config import engine_args
    from tokenmill.tokenizer import load_tokenizer

    n_ctx = context_for(contexts[-1] + decode_tokens + 1)
    model = long_context_copy(source, n_ctx)
    tokenizer = load_tokenizer(model)
    work = {"long_prompts": {str(n): make_prompts(tokenizer, [n] * args.repeats, args.seed, tag=f"Long {n}")
                             for n in contexts},
            "warmup_prompts": make_prompts(tokenizer, [min(512, contexts[0])], args.seed, tag="Warm-up"),
            "decode_tokens": decode_tokens, "threads": args.threads, "n_ctx": n_ctx, "repack": peers.llama_repack()}
    tm_args = {**engine_args(args), "threads": args.threads, "max_model_len": n_ctx,
               "max_num_seqs": max(args.max_num_seqs, 1)}
    if tm_args.get("num_kv_blocks") is None and tm_args.get("kv_cache_memory") is None:
        tm_args["num_kv_blocks"] = n_ctx // args.block_size + 1
    results: dict[str, Any] = {}
    print_load("tokenmill, long context")
    load_avgs["tokenmill long context"] = load_average()
    results["tokenmill"] = run_spawned(tokenmill_long, {**work, "model": model, "engine_args": tm_args})
    kv_type = KV_TYPES.get(results["tokenmill"]["kv_dtype"])
    status = peers.llama_cpp_python_status()
    if not peer:
        results["llama.cpp"] = {"missing": "not asked for"}
    elif not status.available:
        print(f"{status.name}: {status.detail}", flush=True)
        results["llama.cpp"] = {"missing": status.detail}
    elif kv_type is None:
        results["llama.cpp"] = {"missing": f"no llama.cpp cache type of {results['tokenmill']['kv_dtype']}'s size"}
    else:
        print_load(f"llama.cpp, long context (flash attention, {kv_type} K/V)")
        load_avgs["llama.cpp long context"] = load_average()
        results["llama.cpp"] = peers.guarded("llama.cpp long context", run_bare, batch1.llama_cpp_long,
                                             {**work, "model": model, "flash_attn": True, "kv_type": kv_type},
                                             timeout)
    ran = {"run_model": model, "contexts": contexts, "decode_tokens": decode_tokens, "repeats": args.repeats,
           "n_ctx": n_ctx, "engine_args": tm_args}
    return ran, results


def run_longctx_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.hub import model_path

    for name in ("threads", "repeats", "decode_tokens"):
        if getattr(args, name) < 1:
            raise TokenmillError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    contexts = check_contexts(args.contexts)
    source = model_path(args.model_path or args.model)
    if not source.endswith(".gguf"):
        raise TokenmillError(f"--model: bench longctx needs a .gguf file (llama.cpp runs it too), got {source!r}")
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    load_avgs: dict[str, float | None] = {}
    ran, results = measure(source, contexts, args, args.decode_tokens, not args.no_peer, load_avgs, args.timeout)
    cfg = {"model": source, **ran, "threads": args.threads, "cpu_count": os.cpu_count(),
           "llama_repack": peers.llama_repack(), "wall_s": time.perf_counter() - started}
    table = build_table(contexts, results)
    report = {"config": cfg, "load_average_before": load_avgs, "table": table, "results": results}
    print_table(report)
    out_path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out_path}")
    return report


def build_table(contexts: list[int], results: dict[str, Any]) -> list[dict[str, Any]]:
    """A row per context: both engines' rates, the ratios, the roofline fraction, and per target met or
    not (None where the peer did not run)."""
    tm, peer = results["tokenmill"]["contexts"], results["llama.cpp"].get("contexts")
    rows = []
    for n in contexts:
        t, p = tm[str(n)], (peer or {}).get(str(n))
        row = {"context": n, "tokenmill": t, "llama.cpp": p,
               "prefill_ratio": t["prefill_tok_s"] / p["prefill_tok_s"] if p else None,
               "decode_ratio": t["decode_tok_s"] / p["decode_tok_s"] if p else None,
               "decode_roofline_fraction": t["decode_roofline_fraction"]}
        row["targets"] = {what: (None if row[what.replace(" ", "_")] is None else
                                 row[what.replace(" ", "_")] >= minimum)
                          for what, at, minimum in TARGETS if at in (None, n)}
        rows.append(row)
    return rows


def print_table(report: dict[str, Any]) -> None:
    from tokenmill.bench.roofline import describe_read

    cfg, results, table = report["config"], report["results"], report["table"]
    tm = results["tokenmill"]
    peer = results["llama.cpp"]
    print(f"\nmodel: {cfg['model']}  threads: {cfg['threads']}  tokenmill K/V: {tm['kv_dtype']}  "
          f"llama.cpp: {peer.get('missing') or 'flash attention, ' + peer['kv_type'] + ' K/V'}")
    print(f"each rate the median of {cfg['repeats']} fresh prompts; decode: {cfg['decode_tokens']} tokens after the "
          f"first; bound: weights + context K/V read at {describe_read(tm['read_gb_s'], tm.get('read_samples', []))}")
    peers.print_repack_note(cfg.get("llama_repack"))
    print()
    print(f"{'context':>8} | {'prefill tok/s':>13} {'llama.cpp':>10} {'ratio':>6} | {'decode tok/s':>12} "
          f"{'llama.cpp':>10} {'ratio':>6} | {'bound':>6} {'fraction':>8}")
    for row in table:
        t, p = row["tokenmill"], row["llama.cpp"]

        def cell(v: float | None, fmt: str, width: int) -> str:
            return f"{'-':>{width}}" if v is None else f"{v:>{width}{fmt}}"

        print(f"{row['context']:>8} | {t['prefill_tok_s']:>13.1f} {cell(p and p['prefill_tok_s'], '.1f', 10)} "
              f"{cell(row['prefill_ratio'], '.2f', 5)}x | {t['decode_tok_s']:>12.1f} "
              f"{cell(p and p['decode_tok_s'], '.1f', 10)} {cell(row['decode_ratio'], '.2f', 5)}x | "
              f"{t['decode_bound_tok_s']:>6.0f} {t['decode_roofline_fraction']:>8.0%}")
    print("\ntargets:")
    for row in table:
        for what, met in row["targets"].items():
            minimum = next(m for w, _, m in TARGETS if w == what)
            state = "not measured" if met is None else ("met" if met else "NOT met")
            print(f"  {what} at {row['context']} >= {minimum:g}: {state}")


def cmd_longctx(args: argparse.Namespace) -> int:
    run_longctx_bench(args)
    return 0
