"""`tokenmill bench throughput`: offline throughput on a fixed request mix, vs `transformers`.

N requests (input and output lengths drawn uniformly from fixed ranges with a fixed seed, greedy,
ignore_eos) are run to completion; each run reports requests/s, output tokens/s and total
(input + output) tokens/s. Every run happens in its own spawned subprocess, one after the other,
so the peak resident memory is that engine's own:

- tokenmill with everything on, then leave-one-out rows: without continuous batching (static
  batches of `max_num_seqs` requests through `LLM.generate`, each waiting for the slowest),
  without chunked prefill, without prefix caching. Each tokenmill row also records the prefix
  cache hit rate, the number of preemptions, and its resident memory sampled through the run
  (the KV pool is preallocated, so it should not grow after warm-up).
- Hugging Face `transformers` batched `generate`: static batches, left padding with an attention
  mask, `max_new_tokens` = the batch's longest request; only each request's own requested output
  tokens count as useful output. Each batch size given is measured and the best is reported.

Prompts are token ids of the exact lengths, cut from a fixed text with the model's tokenizer.
Each starts with its own tag, so no two share a KV block (prefix caching should find ~nothing),
and both engines get the same ids.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from tokenmill.bench.latency import load_hf_peer
from tokenmill.bench.procs import RSSSampler, rss_mib, run_spawned
from tokenmill.bench.workload import check_range, make_lengths, make_prompts, pad_token_id
from tokenmill.errors import TokenmillError

# Leave-one-out rows: engine options over the baseline (everything on).
VARIANTS: dict[str, dict[str, Any]] = {
    "all on": {},
    "no continuous batching": {"static_batches": True},
    "no chunked prefill": {"enable_chunked_prefill": False},
    "no prefix caching": {"enable_prefix_caching": False},
}
# The issue asks for 64 requests; on the 2-core CPU that run took 25 minutes (four tokenmill runs
# of ~5 minutes each at max_num_seqs 16, and transformers on 16 of the requests). So the CLI
# defaults are smaller: 16 requests in 2 waves of 8 sequences (so that continuous batching still
# has something to do), and transformers in static batches of the same size, 8.
ISSUE_NUM_REQUESTS = 64
DEFAULT_NUM_REQUESTS = 16
DEFAULT_MAX_NUM_SEQS = 8
DEFAULT_HF_BATCH_SIZES = [8]
DEFAULT_PEER_NUM_REQUESTS = 16
DEFAULT_RUN_MINUTES = 9          # a default run on the 2-core CPU when nothing else runs
RSS_GROWTH_TOLERANCE_MIB = 32.0   # allocator noise; more than this after warm-up counts as growth


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _downsample(samples: list[tuple[float, float]], n: int = 12) -> list[list[float]]:
    if len(samples) > n:
        step = (len(samples) - 1) / (n - 1)
        samples = [samples[round(i * step)] for i in range(n)]
    return [[round(t, 2), round(m, 1)] for t, m in samples]


def _rates(num_requests: int, input_tokens: int, output_tokens: int, elapsed: float,
           cpu_s: float, threads: int) -> dict[str, float]:
    """Rates over `elapsed` wall seconds; `cpu_share` is the CPU time the process got over what its
    threads could use (well below 1: other processes competed for the cores, the rates are low)."""
    return {"elapsed_s": elapsed, "requests_per_s": num_requests / elapsed,
            "output_tok_s": output_tokens / elapsed, "total_tok_s": (input_tokens + output_tokens) / elapsed,
            "cpu_share": cpu_s / (elapsed * threads)}


# ---- the engines (each in its own subprocess) --------------------------------------------------

def _variant_name(options: dict[str, Any]) -> str:
    off = [name for name, opts in VARIANTS.items() if opts and all(options.get(k) == v for k, v in opts.items())]
    return ", ".join(off) or "all on"


def _run_tokenmill(cfg: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """One tokenmill run; `options` are engine arguments over cfg["engine_args"], plus
    `static_batches` (no continuous batching)."""
    import torch

    from tokenmill import LLM, SamplingParams

    options = {**cfg["engine_args"], **options}
    variant = _variant_name(options)
    static = options.pop("static_batches", False)
    t0 = time.perf_counter()
    llm = LLM(cfg["model"], **options)
    load_s = time.perf_counter() - t0
    prompts, output_lens = cfg["prompts"], cfg["output_lens"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]

    # Warm-up (prompts of their own, so the run finds none of them in the prefix cache).
    llm.generate(cfg["warmup_prompts"], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                 use_tqdm=False)
    rss_after_warmup = rss_mib()

    kv, scheduler = llm.engine.kv, llm.engine.scheduler
    queries, hits, preemptions = kv.prefix_queries, kv.prefix_hits, scheduler.num_preemptions
    batch = llm.engine.config.max_num_seqs if static else len(prompts)
    outputs = []
    with RSSSampler(cfg["rss_interval_s"]) as sampler:
        start, cpu_start = time.perf_counter(), time.process_time()
        for idx in _chunks(list(range(len(prompts))), batch):
            outputs += llm.generate([prompts[i] for i in idx], [params[i] for i in idx], use_tqdm=False)
        elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    rss_max = max(m for _, m in sampler.samples)
    # Growth in the second half of the run: a pool-bounded engine whose allocator has settled adds ~0 here.
    rss_first_half = max(m for t, m in sampler.samples if t <= elapsed / 2)
    return {
        "engine": "tokenmill", "config": variant, "load_s": load_s, "dtype": str(llm.engine.dtype),
        "torch_threads": torch.get_num_threads(),
        "device": str(llm.engine.device), "num_requests": len(prompts),
        **_rates(len(prompts), sum(map(len, prompts)), sum(generated), elapsed, cpu_s, torch.get_num_threads()),
        "generated_tokens": generated,
        # the timed run's share of the counters behind `kv.prefix_hit_rate`
        "prefix_hit_rate": (kv.prefix_hits - hits) / max(1, kv.prefix_queries - queries),
        "num_preemptions": scheduler.num_preemptions - preemptions,
        "static_batch_size": batch if static else None,
        "rss_after_warmup_mib": rss_after_warmup,
        "rss_max_during_run_mib": rss_max,
        "rss_growth_after_warmup_mib": rss_max - rss_after_warmup,
        "rss_grew_after_warmup": rss_max - rss_after_warmup > RSS_GROWTH_TOLERANCE_MIB,
        "rss_growth_second_half_mib": rss_max - rss_first_half,
        "rss_samples_s_mib": _downsample(sampler.samples),
    }


def run_transformers(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers on the requests in static batches of each size in cfg["hf_batch_sizes"], with
    cfg["threads"] (None: torch's default); run it in a fresh process (`procs.run_spawned`)."""
    import torch

    if cfg["threads"] is not None:
        torch.set_num_threads(cfg["threads"])
    import transformers

    transformers.logging.set_verbosity_error()   # generation-config notes, one per generate call
    dtype = getattr(torch, cfg["resolved_dtype"])
    device = torch.device(cfg["resolved_device"])
    t0 = time.perf_counter()
    model = load_hf_peer(cfg["model"], dtype).to(device)
    load_s = time.perf_counter() - t0
    n = cfg["peer_num_requests"]
    prompts, output_lens = cfg["prompts"][:n], cfg["output_lens"][:n]
    pad = cfg["pad_token_id"]

    @torch.inference_mode()
    def run_batch(batch_prompts: list[list[int]], batch_outputs: list[int]) -> None:
        width, new = max(map(len, batch_prompts)), max(batch_outputs)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts], device=device)
        # min_new_tokens = max_new_tokens: EOS is suppressed, every row runs the batch's longest request.
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=pad)
        if out.shape[1] != width + new:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, asked for {new}")

    run_batch([p[:8] for p in prompts[:2]], [2, 2])   # warm-up
    per_batch_size = []
    for batch_size in cfg["hf_batch_sizes"]:
        start, cpu_start = time.perf_counter(), time.process_time()
        for idx in _chunks(list(range(len(prompts))), batch_size):
            run_batch([prompts[i] for i in idx], [output_lens[i] for i in idx])
        elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        per_batch_size.append({"batch_size": batch_size, **_rates(len(prompts), sum(map(len, prompts)),
                                                                  sum(output_lens), elapsed, cpu_s,
                                                                  torch.get_num_threads())})
    best = max(per_batch_size, key=lambda r: r["output_tok_s"])
    return {"engine": "transformers", "config": f"static batches of {best['batch_size']}", "load_s": load_s,
            "dtype": str(dtype), "device": str(device), "torch_threads": torch.get_num_threads(),
            "num_requests": len(prompts), **best, "per_batch_size": per_batch_size}


def run_throughput_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.config import engine_args
    from tokenmill.hub import model_path
    from tokenmill.tokenizer import load_tokenizer

    input_range = check_range("--input-len-range", args.input_len_range)
    output_range = check_range("--output-len-range", args.output_len_range)
    if args.num_requests < 1:
        raise TokenmillError(f"--num-requests: must be >= 1, got {args.num_requests}")
    if any(b < 1 for b in args.hf_batch_size):
        raise TokenmillError(f"--hf-batch-size: must be >= 1, got {args.hf_batch_size}")
    if args.peer_num_requests < 1:
        raise TokenmillError(f"--peer-num-requests: must be >= 1, got {args.peer_num_requests}")
    if args.skip_ablations:
        variants = [{}]   # one row, with the engine flags as given
    elif not (args.enable_prefix_caching and args.enable_chunked_prefill):
        raise TokenmillError("the leave-one-out table turns each feature off itself: drop "
                             "--no-enable-prefix-caching / --no-enable-chunked-prefill, or pass --skip-ablations")
    else:
        variants = list(VARIANTS.values())
    model = model_path(args.model)
    tokenizer = load_tokenizer(model_path(args.tokenizer) if args.tokenizer else model)
    lengths = make_lengths(args.num_requests, input_range, output_range, args.seed)
    prompts = make_prompts(tokenizer, [i for i, _ in lengths], args.seed)
    output_lens = [o for _, o in lengths]
    peer_n = min(args.peer_num_requests, args.num_requests)
    cfg: dict[str, Any] = {
        "model": model, "engine_args": {**engine_args(args), "show_progress": False},
        "num_requests": args.num_requests, "seed": args.seed,
        "input_len_range": list(input_range), "output_len_range": list(output_range),
        "input_tokens": sum(map(len, prompts)), "output_tokens": sum(output_lens),
        "peer": not args.no_peer, "threads": args.threads, "peer_num_requests": peer_n,
        "hf_batch_sizes": args.hf_batch_size,
        "pad_token_id": pad_token_id(tokenizer), "rss_interval_s": 0.5, "cpu_count": os.cpu_count(),
    }
    # Warm-up: one full step of prefill (the token budget) then one decode step of max_num_seqs
    # requests, so activation buffers are near their steady size before the memory baseline.
    warm_n = max(1, min(args.max_num_seqs, args.num_requests))
    warm_len = max(1, min(input_range[1], args.max_num_batched_tokens // warm_n))
    warmup_prompts = make_prompts(tokenizer, [warm_len] * warm_n, args.seed, tag="Warm-up")
    work = {**cfg, "prompts": prompts, "output_lens": output_lens, "warmup_prompts": warmup_prompts}
    bench_start = time.perf_counter()

    rows = []
    for options in variants:
        print(f"running tokenmill ({_variant_name({**cfg['engine_args'], **options})}) ...", flush=True)
        rows.append(run_spawned(_run_tokenmill, work, options))
    cfg["resolved_dtype"] = rows[0]["dtype"].removeprefix("torch.")
    cfg["resolved_device"] = rows[0]["device"]
    if not args.no_peer:
        print(f"running transformers (batch sizes {args.hf_batch_size}, {peer_n} requests) ...", flush=True)
        rows.append(run_spawned(run_transformers, {**work, **cfg}))
    cfg["wall_s"] = time.perf_counter() - bench_start

    _print_report(cfg, rows)
    report = {"config": cfg, "output_lens": output_lens, "input_lens": [len(p) for p in prompts], "results": rows}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    for row in rows:   # an engine bug, not a slow run: the rates above count tokens that were not asked for
        if row["engine"] == "tokenmill" and row["generated_tokens"] != output_lens:
            raise RuntimeError(f"tokenmill ({row['config']}) generated {row['generated_tokens']} tokens, "
                               f"asked for {output_lens}")
    return report


def _print_report(cfg: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    tm = rows[0]
    hf = rows[-1] if rows[-1]["engine"] == "transformers" else None
    engine = cfg["engine_args"]
    loads = [r["load_avg_before"] for r in rows if r["load_avg_before"] is not None]
    print(f"\nmodel: {cfg['model']}  dtype: {cfg['resolved_dtype']}  device: {cfg['resolved_device']}  "
          f"torch threads: {tm['torch_threads']} of {cfg['cpu_count']} cores")
    print(f"workload: {cfg['num_requests']} requests, input {cfg['input_len_range'][0]}-{cfg['input_len_range'][1]} "
          f"tokens ({cfg['input_tokens']} in all), output {cfg['output_len_range'][0]}-{cfg['output_len_range'][1]} "
          f"tokens ({cfg['output_tokens']} in all), seed {cfg['seed']}, greedy, ignore_eos")
    print(f"tokenmill ({tm['config']}): max_num_seqs {engine['max_num_seqs']}, max_num_batched_tokens "
          f"{engine['max_num_batched_tokens']}, KV pool preallocated at start (kv_cache_memory "
          f"{engine['kv_cache_memory'] or 'default'})")
    print(f"whole bench {cfg['wall_s']:.0f} s" + (f"; system load (1-min average) before each run {min(loads):.1f}-"
                                                   f"{max(loads):.1f}: other work on these cores slows every rate"
                                                   if loads else ""))
    print("CPU share (CPU time / (wall time x threads): near 1 when the cores were free for the run; lower when "
          "other processes competed, or when work ran on one thread): "
          + ", ".join(f"{r['engine']} ({r['config']}) {r['cpu_share']:.2f}" for r in rows))
    if cfg["num_requests"] != ISSUE_NUM_REQUESTS:
        print(f"note: {cfg['num_requests']} requests; the issue's size is {ISSUE_NUM_REQUESTS} (--num-requests "
              f"{ISSUE_NUM_REQUESTS}). The CLI defaults to {DEFAULT_NUM_REQUESTS} with max_num_seqs "
              f"{DEFAULT_MAX_NUM_SEQS} so that a full default run, ablations and peer included, takes about "
              f"{DEFAULT_RUN_MINUTES} minutes on 2 cores.")
    metrics = [("requests/s", "requests_per_s", "{:.3f}"), ("output tok/s", "output_tok_s", "{:.1f}"),
               ("total tok/s", "total_tok_s", "{:.1f}"), ("peak RSS MiB", "peak_rss_mib", "{:.0f}")]
    print(f"\n{'metric':<14}{'tokenmill':>12}" + (f"{'transformers':>14}{'tokenmill/transformers':>24}" if hf else ""))
    for label, key, fmt in metrics:
        line = f"{label:<14}{fmt.format(tm[key]):>12}"
        if hf:
            line += f"{fmt.format(hf[key]):>14}{tm[key] / hf[key]:>23.2f}x"
        print(line)
    if hf:
        tried = ", ".join(f"{r['batch_size']}: {r['output_tok_s']:.1f}" for r in hf["per_batch_size"])
        subset = "" if hf["num_requests"] == cfg["num_requests"] else (
            f"; measured on the first {hf['num_requests']} of the {cfg['num_requests']} requests "
            "(rates per second, comparable; tokenmill ran all of them)")
        print(f"transformers: best of static batch sizes (output tok/s) {tried}{subset}")
        print("ratio: tokenmill / transformers (higher is better for tokenmill on rates, lower on RSS)")
    grew = "GREW" if tm["rss_grew_after_warmup"] else "no growth"
    print(f"tokenmill RSS: {tm['rss_after_warmup_mib']:.0f} MiB after warm-up, max {tm['rss_max_during_run_mib']:.0f} "
          f"during the run ({tm['rss_growth_after_warmup_mib']:+.0f} MiB: {grew}, tolerance "
          f"{RSS_GROWTH_TOLERANCE_MIB:.0f} MiB; {tm['rss_growth_second_half_mib']:+.0f} MiB of it in the run's second "
          "half)")

    ablations = [r for r in rows if r["engine"] == "tokenmill"]
    if len(ablations) > 1:
        print(f"\n{'tokenmill leave-one-out':<24}{'req/s':>8}{'out tok/s':>11}{'total tok/s':>13}{'vs all on':>11}"
              f"{'peak RSS':>10}{'RSS growth':>12}{'prefix hit':>12}{'preempt':>9}")
        for r in ablations:
            print(f"{r['config']:<24}{r['requests_per_s']:>8.3f}{r['output_tok_s']:>11.1f}{r['total_tok_s']:>13.1f}"
                  f"{r['output_tok_s'] / tm['output_tok_s']:>10.2f}x{r['peak_rss_mib']:>10.0f}"
                  f"{r['rss_growth_after_warmup_mib']:>+12.0f}{r['prefix_hit_rate']:>12.1%}{r['num_preemptions']:>9d}")
        static = next((r for r in ablations if r["static_batch_size"]), None)
        if static:
            print(f"(no continuous batching: static batches of max_num_seqs = {static['static_batch_size']}, "
                  "each waiting for its longest request)")
    else:
        print(f"prefix hit rate {tm['prefix_hit_rate']:.1%}, preemptions {tm['num_preemptions']}")


def cmd_throughput(args: argparse.Namespace) -> int:
    run_throughput_bench(args)
    return 0
