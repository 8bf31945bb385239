"""`tokenmill bench compare`: tokenmill against llama.cpp and Hugging Face `transformers`, side by
side in the same run, on the same GGUF file (default: the embedded SmolLM2-135M-Instruct), with
the same thread count for everyone (default 2) and one table of ratios.

What is measured, each engine in its own process, one after the other:

- batch 1 (the same token ids for every engine; a fresh prompt for every repeat, so no prefix
  cache can help): prefill tokens/s = prompt length / time to the first generated token, for
  each `--prefill-lens` (128 and 512); decode tokens/s = tokens after the first / time between
  the first and the last, greedy from a 32-token prompt. Engines: tokenmill's `LLM` API, llama.cpp
  through llama-cpp-python's `Llama` (`eval` + greedy argmax on its logits, `logits_all` off), and
  `transformers` `generate` (token times from a streamer).
- concurrent load (`--concurrency`, default 8 and 32): total output tokens/s on the mixed
  workload of `bench throughput` (lengths drawn with a fixed seed, greedy, ignore_eos), streamed
  through the load generator of `bench serve` to `tokenmill serve` and to llama.cpp's C++
  `llama-server` (`-np` = the largest concurrency, continuous batching, the same KV capacity for
  both). `transformers` has no server: it runs the same requests as static batches of C
  (`bench throughput`'s runner).
- peak resident memory of each engine's process (batch-1 process; server or batch process).

The llama.cpp process for batch 1 runs this file as a script, so it does not import tokenmill or
torch (whose ~200 MiB would count as llama.cpp's memory). A peer that is not installed is a
column saying so (and the command says how to install it); the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_THREADS = 2
DEFAULT_PREFILL_LENS = [128, 512]
DEFAULT_DECODE_TOKENS = 128
DEFAULT_DECODE_PROMPT_LEN = 32
DEFAULT_REPEATS = 3
DEFAULT_CONCURRENCY = [8, 32]
DEFAULT_NUM_REQUESTS = 32    # per concurrency level; `bench throughput`'s issue size is 64 (--num-requests 64)
ENGINES = ["tokenmill", "llama.cpp", "transformers"]
# The targets, as tokenmill / llama.cpp ratios in the same run: (row key, minimum ratio).
TARGETS = {"prefill_512_tok_s": 2.0, "decode_tok_s": 1.0, "concurrent_32_out_tok_s": 3.0}


def add_compare_args(b: argparse.ArgumentParser) -> None:
    # --threads (an engine flag, see config.EngineConfig) is every engine's thread count here:
    # torch.set_num_threads, llama.cpp's -t/-tb.
    b.set_defaults(threads=DEFAULT_THREADS)
    g = b.add_argument_group("compare")
    g.add_argument("--peers", nargs="*", default=["llama.cpp", "transformers"], choices=ENGINES[1:],
                   help="peers to run next to tokenmill (default: both)")
    g.add_argument("--prefill-lens", type=int, nargs="+", default=DEFAULT_PREFILL_LENS)
    g.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE_TOKENS)
    g.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="batch-1 repeats (the median is reported)")
    g.add_argument("--concurrency", type=int, nargs="*", default=DEFAULT_CONCURRENCY,
                   help="concurrent-load levels (none: batch 1 only)")
    g.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS,
                   help="requests per concurrency level (the issue's workload size: 64)")
    g.add_argument("--seed", type=int, default=0, help="seed of the request lengths and prompts")
    g.add_argument("--input-len-range", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    g.add_argument("--output-len-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request / per batch-1 run")
    g.add_argument("--llama-server", default=None, metavar="PATH",
                   help="a llama-server binary (default: $TOKENMILL_LLAMA_SERVER, else the one built into the cache)")
    g.add_argument("--build-peers", action="store_true",
                   help="build llama-server first if it is missing (about 6 minutes on 2 cores)")
    b.add_argument("--output", default="bench-results/compare.json")


# ---- batch 1: one measuring loop, three engines ---------------------------------------------------

def _measure_batch1(gen, cfg: dict[str, Any]) -> dict[str, Any]:
    """`gen(ids, n)` generates n tokens greedily from `ids` and returns (start time, the time each
    generated token became available, the token ids). Returns prefill and decode rates (medians
    over repeats) and the greedy tokens of the first decode prompt (to check the engines agree)."""
    for ids in cfg["warmup_prompts"]:   # one of each length: first-call costs stay out of the timings
        gen(ids, 2)
    result: dict[str, Any] = {}
    for n, prompts in cfg["prefill_prompts"].items():
        ttfts = []
        for ids in prompts:
            start, times, _ = gen(ids, 1)
            ttfts.append(times[0] - start)
        result[f"prefill_{n}_tok_s"] = int(n) / statistics.median(ttfts)
        result[f"ttft_{n}_s"] = statistics.median(ttfts)
    rates = []
    for i, ids in enumerate(cfg["decode_prompts"]):
        _, times, tokens = gen(ids, cfg["decode_tokens"])
        if len(times) != cfg["decode_tokens"] or len(tokens) != cfg["decode_tokens"]:
            raise RuntimeError(f"asked for {cfg['decode_tokens']} tokens, got {len(tokens)}")
        rates.append((len(times) - 1) / (times[-1] - times[0]))
        if i == 0:
            result["greedy_tokens"] = [int(t) for t in tokens]
    result["decode_tok_s"] = statistics.median(rates)
    return result


def vm_hwm_mib(pid: int | str) -> float | None:
    """A live process's peak resident memory (Linux /proc; None elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """This process's peak resident memory, for every benchmark (here because this file also runs as
    a torch-free script for the llama.cpp worker, which cannot import the tokenmill package). Linux's
    VmHWM, not getrusage's ru_maxrss: ru_maxrss survives exec, so a child started from a big parent
    (one that had loaded torch reports >= ~230 MiB whatever it did) would report the parent's peak."""
    import resource

    hwm = vm_hwm_mib("self")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _batch1_tokenmill(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(cfg["threads"])
    from tokenmill import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(cfg["model"], **cfg["engine_args"])
    load_s = time.perf_counter() - t0

    def gen(ids: list[int], n: int) -> tuple[float, list[float], list[int]]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        times: list[float] = []
        tokens: list[int] = []
        start = time.perf_counter()
        for out in llm.stream(ids, params):
            now = time.perf_counter()
            tokens = out.outputs[0].token_ids
            times += [now] * (len(tokens) - len(times))
        return start, times, tokens

    from tokenmill.config import resolve_dtype

    result = _measure_batch1(gen, cfg)
    # transformers runs dense weights: the dtype these settings give a dense model (bf16 where the CPU
    # has bf16 units), not tokenmill's float32 for its quantized kernels
    dense = resolve_dtype(llm.engine.config.dtype, llm.engine.device)
    return {"engine": "tokenmill", "load_s": load_s, "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "dense_dtype": str(dense).removeprefix("torch."), "threads": torch.get_num_threads(), **result,
            "peak_rss_mib": peak_rss_mib()}


def _batch1_transformers(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(cfg["threads"])
    import transformers
    from transformers.generation.streamers import BaseStreamer

    from tokenmill.bench.latency import load_hf_peer

    transformers.logging.set_verbosity_error()
    dtype = getattr(torch, cfg["dtype"])
    t0 = time.perf_counter()
    model = load_hf_peer(cfg["model"], dtype)
    load_s = time.perf_counter() - t0

    class Clock(BaseStreamer):
        """Records when generate hands over each tensor: first the prompt, then each new token."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    @torch.inference_mode()
    def gen(ids: list[int], n: int) -> tuple[float, list[float], list[int]]:
        inp = torch.tensor([ids])
        clock = Clock()
        start = time.perf_counter()
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=cfg["pad_token_id"], streamer=clock)
        if out.shape[1] != len(ids) + n:
            raise RuntimeError(f"transformers generated {out.shape[1] - len(ids)} tokens, asked for {n}")
        return start, clock.times[1:], out[0, len(ids):].tolist()

    result = _measure_batch1(gen, cfg)
    return {"engine": "transformers", "load_s": load_s, "dtype": cfg["dtype"], "threads": torch.get_num_threads(),
            **result, "peak_rss_mib": peak_rss_mib()}


def _batch1_llama_cpp(cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp through llama-cpp-python. Runs in a process that has not imported tokenmill."""
    import ctypes

    import llama_cpp
    import numpy as np

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(cfg["model"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
                          n_threads_batch=cfg["threads"], logits_all=False, n_gpu_layers=0, verbose=False)
    load_s = time.perf_counter() - t0
    n_vocab = llm.n_vocab()

    def next_token() -> int:
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
                   .argmax())

    def gen(ids: list[int], n: int) -> tuple[float, list[float], list[int]]:
        llm.reset()   # no reuse of the previous prompt's KV: eval() drops every cell from position 0
        start = time.perf_counter()
        llm.eval(ids)
        tokens = [next_token()]
        times = [time.perf_counter()]
        for _ in range(n - 1):
            llm.eval(tokens[-1:])
            tokens.append(next_token())
            times.append(time.perf_counter())
        return start, times, tokens

    result = _measure_batch1(gen, cfg)
    return {"engine": "llama.cpp", "load_s": load_s, "version": llama_cpp.__version__,
            "threads": cfg["threads"], "n_ctx": cfg["n_ctx"], **result, "peak_rss_mib": peak_rss_mib()}


def _llama_cpp_in_clean_process(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run `_batch1_llama_cpp` by executing this file as a script (see `_worker_main`)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out_path = Path(tmp) / "cfg.json", Path(tmp) / "out.json"
        cfg_path.write_text(json.dumps(cfg))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--llama-cpp-worker", str(cfg_path),
                               str(out_path)], capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"the llama.cpp run failed (status {proc.returncode}): {proc.stderr[-2000:]}")
        return json.loads(out_path.read_text())


def _worker_main(argv: list[str]) -> int:
    cfg = json.loads(Path(argv[1]).read_text())
    Path(argv[2]).write_text(json.dumps(_batch1_llama_cpp(cfg)))
    return 0


# ---- concurrent load --------------------------------------------------------------------------------

def _drive(base_url: str, prompts: list[list[int]], output_lens: list[int], concurrency: int, seed: int,
           timeout: float) -> dict[str, Any]:
    """Adapter over `bench serve`'s load generator: N streaming requests at fixed concurrency,
    summarized (output tokens/s, TTFT / ITL / end-to-end percentiles)."""
    import asyncio

    from tokenmill.bench import serve as bench_serve

    model = bench_serve.served_model(base_url, None)
    results, elapsed = asyncio.run(bench_serve.run_level(base_url, model, prompts, output_lens, concurrency, None,
                                                          seed, None, timeout))
    return bench_serve.summarize(results, elapsed)


def _serve_run(name: str, start, work: dict[str, Any], levels: list[int], log_path: Path,
               timeout: float) -> dict[str, Any]:
    """Start a server (`start()` -> (process, base_url)), warm it up, drive each level, read its peak
    RSS, stop it."""
    from tokenmill.bench import serve as bench_serve

    process, base_url = start()
    row: dict[str, Any] = {"engine": name, "levels": {}}
    try:
        t0 = time.perf_counter()
        bench_serve.wait_ready(base_url, process, bench_serve.SERVER_START_TIMEOUT_S)
        row["ready_s"] = time.perf_counter() - t0
        _drive(base_url, work["warmup_prompts"], [4] * len(work["warmup_prompts"]), len(work["warmup_prompts"]),
               work["seed"], timeout)
        for level in levels:
            _print_load(f"{name}: {len(work['prompts'])} requests at concurrency {level}")
            # Each level gets prompts of its own: a server must not answer one level from its prompt cache of
            # the level before (both tokenmill and llama-server cache prompts).
            row["levels"][str(level)] = _drive(base_url, work["level_prompts"][level], work["output_lens"], level,
                                               work["seed"], timeout)
        row["peak_rss_mib"] = vm_hwm_mib(process.pid)
    finally:
        code = bench_serve.stop_process(process)
        if code not in (0, None, -15):
            print(f"  {name} exited with status {code}; its log: {log_path}", flush=True)
    return row


def _static_transformers(cfg: dict[str, Any]) -> dict[str, Any]:
    """`bench throughput`'s transformers runner (static batches), at this run's thread count."""
    import torch

    torch.set_num_threads(cfg["threads"])
    from tokenmill.bench.throughput import run_transformers

    return {**run_transformers(cfg), "peak_rss_mib": peak_rss_mib()}


# ---- the command ----------------------------------------------------------------------------------------

def _guarded(what: str, fn, *args: Any) -> dict[str, Any]:
    """fn(*args) for a peer: a peer that fails is a cell of the table, not the end of the run."""
    try:
        return fn(*args)
    except Exception as e:
        print(f"  {what} failed: {type(e).__name__}: {e}", flush=True)
        return {"error": f"{type(e).__name__}: {e}"[:4000]}


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _print_load(what: str) -> None:
    load = _load_average()
    print(f"[load average {'-' if load is None else f'{load:.2f}'}] {what} ...", flush=True)


def _check_args(args: argparse.Namespace) -> None:
    from tokenmill.errors import TokenmillError

    for name in ("threads", "decode_tokens", "repeats", "num_requests"):
        if getattr(args, name) < (2 if name == "decode_tokens" else 1):
            raise TokenmillError(f"--{name.replace('_', '-')}: must be >= {2 if name == 'decode_tokens' else 1}, "
                                 f"got {getattr(args, name)}")
    if any(n < 1 for n in args.prefill_lens):
        raise TokenmillError(f"--prefill-lens: must be >= 1, got {args.prefill_lens}")
    if any(c < 1 for c in args.concurrency):
        raise TokenmillError(f"--concurrency: must be >= 1, got {args.concurrency}")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def run_compare_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.bench import peers
    from tokenmill.bench import serve as bench_serve
    from tokenmill.bench.throughput import check_range, make_lengths, make_prompts, timed_run
    from tokenmill.config import engine_args as engine_flag_values
    from tokenmill.errors import TokenmillError
    from tokenmill.llm import default_model_path
    from tokenmill.tokenizer import load_tokenizer

    _check_args(args)
    input_range = check_range("--input-len-range", args.input_len_range)
    output_range = check_range("--output-len-range", args.output_len_range)
    model = args.model or default_model_path()
    if not Path(model).is_file() or not model.endswith(".gguf"):
        raise TokenmillError(f"--model: bench compare needs a .gguf file (llama.cpp runs it too), got {model!r}")
    levels = sorted(set(args.concurrency))
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bench_start = time.perf_counter()

    # Which peers are there.
    server_status = peers.llama_server_status(args.llama_server)
    if "llama.cpp" in args.peers and levels and args.build_peers and not server_status.available:
        peers.build_llama_server()
        server_status = peers.llama_server_status(args.llama_server)
    status = {"llama_cpp": peers.llama_cpp_python_status(), "llama_server": server_status}
    missing = [s for s in status.values() if not s.available] if "llama.cpp" in args.peers else []
    for s in missing:
        print(f"{s.name}: {s.detail}", flush=True)

    # The workload: the same token ids for every engine.
    tokenizer = load_tokenizer(args.tokenizer or model)
    seed = args.seed
    max_prefill = max(args.prefill_lens)
    prefill_prompts = {str(n): make_prompts(tokenizer, [n] * args.repeats, seed, tag=f"Prefill {n}")
                       for n in args.prefill_lens}
    decode_prompts = make_prompts(tokenizer, [DEFAULT_DECODE_PROMPT_LEN] * args.repeats, seed, tag="Decode")
    warmup_prompts = make_prompts(tokenizer, sorted({*args.prefill_lens, DEFAULT_DECODE_PROMPT_LEN}), seed,
                                  tag="Warm-up")
    lengths = make_lengths(args.num_requests, input_range, output_range, seed)
    prompts = make_prompts(tokenizer, [i for i, _ in lengths], seed)
    output_lens = [o for _, o in lengths]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_ids or [0])[0]
    batch1_ctx = _round_up(max(max_prefill, DEFAULT_DECODE_PROMPT_LEN + args.decode_tokens) + 16, 256)
    ctx_per_slot = _round_up(input_range[1] + output_range[1] + 16, 256)
    slots = max(levels) if levels else 1

    engine_args = {**engine_flag_values(args), "show_progress": False}
    if engine_args["num_kv_blocks"] is None and engine_args["kv_cache_memory"] is None:
        # the same KV capacity as llama.cpp's context (the default pool, up to 4 GiB, would count in RSS)
        engine_args["num_kv_blocks"] = batch1_ctx // args.block_size + 1
    b1 = {"model": model, "threads": args.threads, "engine_args": engine_args, "prefill_prompts": prefill_prompts,
          "decode_prompts": decode_prompts, "warmup_prompts": warmup_prompts, "decode_tokens": args.decode_tokens,
          "n_ctx": batch1_ctx, "pad_token_id": pad}
    cfg: dict[str, Any] = {
        "model": model, "threads": args.threads, "peers": args.peers, "prefill_lens": args.prefill_lens,
        "decode_tokens": args.decode_tokens, "decode_prompt_len": DEFAULT_DECODE_PROMPT_LEN, "repeats": args.repeats,
        "concurrency": levels, "num_requests": args.num_requests, "seed": seed, "input_len_range": list(input_range),
        "output_len_range": list(output_range), "output_tokens": sum(output_lens), "batch1_n_ctx": batch1_ctx,
        "server_slots": slots, "server_ctx_per_slot": ctx_per_slot, "cpu_count": os.cpu_count(),
        "llama_cpp_python_pin": peers.LLAMA_CPP_PYTHON_VERSION,
    }
    results: dict[str, dict[str, Any]] = {e: {"engine": e} for e in ENGINES}
    load_avgs: dict[str, float | None] = {}

    def note_load(label: str) -> None:
        """Before each run: save what is measured so far (a run stopped later keeps it), print the load."""
        out_path.write_text(json.dumps({"config": cfg, "partial": True, "load_average_before": load_avgs,
                                        "results": results}, indent=2, default=str))
        load_avgs[label] = _load_average()
        _print_load(label)

    # ---- batch 1 ----
    note_load("tokenmill batch 1")
    results["tokenmill"]["batch1"] = timed_run(_batch1_tokenmill, b1)
    dtype = results["tokenmill"]["batch1"]["dense_dtype"]   # the transformers peer's
    if "llama.cpp" in args.peers:
        if status["llama_cpp"].available:
            note_load("llama.cpp (llama_cpp.Llama) batch 1")
            results["llama.cpp"]["batch1"] = _guarded("llama.cpp batch 1", _llama_cpp_in_clean_process, b1,
                                                      args.timeout * 4)
        else:
            results["llama.cpp"]["batch1"] = {"missing": status["llama_cpp"].detail}
    if "transformers" in args.peers:
        note_load(f"transformers batch 1 ({dtype})")
        results["transformers"]["batch1"] = _guarded("transformers batch 1", timed_run, _batch1_transformers,
                                                     {**b1, "dtype": dtype})

    # ---- concurrent load ----
    if levels:
        work = {"prompts": prompts, "output_lens": output_lens, "seed": seed,
                "level_prompts": {c: make_prompts(tokenizer, [len(p) for p in prompts], seed, tag=f"Level {c} request")
                                  for c in levels},
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
            "tokenmill", start_tokenmill, work, levels, out_path.with_name(f"{out_path.stem}-tokenmill.log"),
            args.timeout)
        if "llama.cpp" in args.peers:
            if status["llama_server"].available:
                binary = status["llama_server"].where
                extra = f"-t {args.threads} -tb {args.threads}"
                log = out_path.with_name(f"{out_path.stem}-llama-server.log")
                cfg["llama_server"] = {"binary": binary, "slots": slots, "ctx_per_slot": ctx_per_slot, "args": extra}
                note_load(f"llama-server -np {slots}")
                results["llama.cpp"]["concurrent"] = _guarded(
                    "llama-server", _serve_run, "llama-server",
                    lambda: bench_serve.start_llama_server(binary, model, slots, ctx_per_slot, extra, log),
                    work, levels, log, args.timeout)
            else:
                results["llama.cpp"]["concurrent"] = {"missing": status["llama_server"].detail}
        if "transformers" in args.peers:
            note_load(f"transformers static batches of {levels}")
            row = _guarded("transformers static batches", timed_run, _static_transformers, {
                "model": model, "threads": args.threads, "resolved_dtype": dtype,
                "resolved_device": "cpu", "peer_num_requests": len(prompts), "prompts": prompts,
                "output_lens": output_lens, "pad_token_id": pad, "hf_batch_sizes": levels})
            if "error" not in row:
                row["levels"] = {str(r["batch_size"]): r for r in row["per_batch_size"]}
            results["transformers"]["concurrent"] = row

    cfg["wall_s"] = time.perf_counter() - bench_start
    table = build_table(cfg, results)
    agreement = greedy_agreement(results)
    print_table(cfg, table, load_avgs, status if missing else {}, agreement)
    report = {"config": cfg, "load_average_before": load_avgs, "peers": peers.status_dict(), "table": table,
              "greedy_agreement": agreement, "results": results, "input_lens": [len(p) for p in prompts],
              "output_lens": output_lens}
    out_path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out_path}")
    return report


# ---- the table ------------------------------------------------------------------------------------------

def _metric_rows(cfg: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(key, label, where in an engine's results): the table's rows, in order."""
    rows = [(f"prefill_{n}_tok_s", f"prefill {n} tok/s", "batch1") for n in cfg["prefill_lens"]]
    rows.append(("decode_tok_s", "decode tok/s", "batch1"))
    rows += [(f"concurrent_{c}_out_tok_s", f"{c}-concurrent out tok/s", "concurrent") for c in cfg["concurrency"]]
    rows.append(("batch1_peak_rss_mib", "peak RSS MiB, batch 1", "batch1"))
    if cfg["concurrency"]:
        rows.append(("concurrent_peak_rss_mib", "peak RSS MiB, concurrent", "concurrent"))
    return rows


def _value(result: dict[str, Any], key: str, where: str) -> float | str | None:
    part = result.get(where)
    if part is None:
        return None   # not run (--peers)
    if "missing" in part:
        return "not built" if "not built" in part["missing"] else "not installed"
    if "error" in part:
        return "error"
    if key.endswith("peak_rss_mib"):
        return part.get("peak_rss_mib")
    if key.startswith("concurrent_"):
        level = part["levels"].get(key.split("_")[1])
        if level is None:
            return None
        if level.get("failed"):
            return f"{level['failed']} failed"
        return level["output_tok_s"]
    return part.get(key)


def build_table(cfg: dict[str, Any], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    table = []
    for key, label, where in _metric_rows(cfg):
        row: dict[str, Any] = {"metric": key, "label": label}
        for engine in ENGINES:
            row[engine] = _value(results[engine], key, where)
        tm, lc = row["tokenmill"], row["llama.cpp"]
        numeric = isinstance(tm, (int, float)) and isinstance(lc, (int, float)) and lc > 0
        row["ratio"] = tm / lc if numeric else None
        target = TARGETS.get(key)
        row["target"] = target
        row["met"] = None if target is None or row["ratio"] is None else row["ratio"] >= target
        table.append(row)
    return table


def greedy_agreement(results: dict[str, dict[str, Any]]) -> dict[str, int]:
    """For each peer with batch-1 results: how many leading greedy tokens (first decode prompt, the
    same ids for everyone) equal tokenmill's. Quantized and dequantized weights may part ways
    after a while; a mismatch at token 0 means the engines do not run the same model."""
    mine = results["tokenmill"].get("batch1", {}).get("greedy_tokens")
    agree = {}
    for engine in ENGINES[1:]:
        theirs = (results[engine].get("batch1") or {}).get("greedy_tokens")
        if mine is not None and theirs is not None:
            same = [a == b for a, b in zip(mine, theirs, strict=False)]
            agree[engine] = same.index(False) if False in same else len(same)
    return agree


def _cell(v: Any, key: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return f"{v:.0f}" if key.endswith("rss_mib") or v >= 100 else f"{v:.1f}"


def print_table(cfg: dict[str, Any], table: list[dict[str, Any]], load_avgs: dict[str, float | None],
                missing: dict[str, Any], agreement: dict[str, int]) -> None:
    print(f"\nmodel: {cfg['model']}\nthreads: {cfg['threads']} for every engine (of {cfg['cpu_count']} cores); "
          f"batch 1: median of {cfg['repeats']}, decode = {cfg['decode_tokens']} tokens after a "
          f"{cfg['decode_prompt_len']}-token prompt")
    if cfg["concurrency"]:
        print(f"concurrent: {cfg['num_requests']} requests per level, input {cfg['input_len_range'][0]}-"
              f"{cfg['input_len_range'][1]}, output {cfg['output_len_range'][0]}-{cfg['output_len_range'][1]} tokens "
              f"({cfg['output_tokens']} in all), greedy, ignore_eos, streamed to `tokenmill serve` and `llama-server "
              f"-np {cfg['server_slots']}`; transformers: static batches of C (no server)")
    loads = [v for v in load_avgs.values() if v is not None]
    if loads:
        print(f"system load average before the runs: {min(loads):.2f}-{max(loads):.2f} (a shared machine: load above "
              f"{cfg['threads']} means other work competed for the cores)")
        if max(loads) > (cfg["cpu_count"] or 1) + 0.5:
            print("WARNING: the machine was busy. Engine threads that wait for each other on shared cores slow down "
                  "unevenly (10-1000x seen on 2 cores): these numbers do not compare the engines; rerun when quiet.")
    header = f"{'metric':<28}{'tokenmill':>13}{'llama.cpp':>15}{'transformers':>15}{'tm/llama.cpp':>14}  target"
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
        print(f"{r['label']:<28}{_cell(r['tokenmill'], key):>13}{_cell(r['llama.cpp'], key):>15}"
              f"{_cell(r['transformers'], key):>15}{ratio:>14}  {target}")
    print("ratio: tokenmill / llama.cpp (rates: higher is better for tokenmill; memory: lower is)")
    if agreement:
        print("greedy decode tokens equal to tokenmill's, from the start (same prompt ids): "
              + ", ".join(f"{e} {n}/{cfg['decode_tokens']}" for e, n in agreement.items()))
    for s in missing.values():
        if not s.available:
            print(f"{s.name} is missing: {s.detail}")


def cmd_compare(args: argparse.Namespace) -> int:
    report = run_compare_bench(args)
    broken = [r["label"] for r in report["table"] for e in ENGINES
              if isinstance(r[e], str) and (r[e] == "error" or "failed" in r[e])]
    return 1 if broken else 0


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--llama-cpp-worker":
    sys.exit(_worker_main(sys.argv[1:]))
