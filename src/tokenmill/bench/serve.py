"""`tokenmill bench serve`: a load generator for OpenAI-compatible servers (streaming completions).

It replays N requests, the workload of `bench throughput` (input and output lengths drawn with a
fixed seed, prompts as token ids of exactly those lengths, greedy unless `--temperature`,
`ignore_eos` so every request generates exactly its output length), at fixed concurrency levels (C
requests in flight at all times) or at a request rate (Poisson arrivals, seeded), and reports per
target and level: requests/s, output and total tokens/s, and time to first token (TTFT),
inter-token latency (ITL: the gaps between streamed chunks that carry text) and end-to-end latency
at p50 / p90 / p99, as a table and as JSON. Each level gets its own prompts (same lengths, a
different tag at the start), so no level finds the previous one's prompts in the server's prefix
cache.

Targets, measured one after the other in the same run on the same requests:
- tokenmill: `tokenmill serve` started here on a free port, with the engine flags given (default);
- `--base-url URL` (repeatable): any server already running that speaks the OpenAI API and serves
  the same model file (prompts are token ids of its tokenizer);
- `--llama-server PATH`: llama.cpp's `llama-server` binary, started here on the same GGUF file
  with `-np` parallel slots (continuous batching) and `-c` = slots x per-slot context.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench import output_file, peers, positive_seconds
from tokenmill.bench.workload import check_range, context_for, make_lengths, make_prompts
from tokenmill.config import engine_argv
from tokenmill.engine.workers import free_port
from tokenmill.errors import TokenmillError

DEFAULT_NUM_REQUESTS = 32
DEFAULT_CONCURRENCY = [1, 8, 32]
DEFAULT_LLAMA_SERVER_SLOTS = 64
SERVER_START_TIMEOUT_S = 600.0
PERCENTILES = (50, 90, 99)
SSE_LINE_END = re.compile("\r\n|\r|\n")


def add_bench_serve_args(b: argparse.ArgumentParser) -> None:
    g = b.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS)
    g.add_argument("--seed", type=int, default=0, help="seed of the request lengths, prompts and arrival times")
    g.add_argument("--input-len-range", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    g.add_argument("--output-len-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    g.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help=f"requests in flight at once, one run per value (default {DEFAULT_CONCURRENCY}); with "
                   "--request-rate, a cap on it")
    g.add_argument("--request-rate", type=float, default=None,
                   help="requests per second, Poisson arrivals (instead of fixed concurrency)")
    g.add_argument("--timeout", type=positive_seconds, default=600.0,
                   help="seconds per request before it counts as failed")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="every request's sampling temperature (default 0: greedy). With a temperature, top_k "
                        "and min_p are always sent (default 0: off), so that llama-server does not add its "
                        "defaults (top-k 40, min-p 0.05); it applies the filters before the temperature, so "
                        "the two engines draw from the same distribution at temperature 1")
    g.add_argument("--top-p", type=float, default=1.0, help="every request's top_p, with --temperature")
    g.add_argument("--top-k", type=int, default=0, help="every request's top_k, with --temperature (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="every request's min_p, with --temperature (0: off)")
    g = b.add_argument_group("targets")
    g.add_argument("--base-url", action="append", default=[],
                   help="also measure this running OpenAI-compatible server (e.g. http://127.0.0.1:8080); "
                   "repeatable")
    g.add_argument("--no-tokenmill", action="store_true", help="do not start and measure tokenmill itself")
    g.add_argument("--llama-server", default=None, metavar="PATH",
                   help="a llama-server binary to start on the same GGUF file and measure too; `auto`: the one "
                   "`python -m tokenmill.bench.peers build-llama-server` built (or $TOKENMILL_LLAMA_SERVER)")
    g.add_argument("--llama-server-slots", type=int, default=DEFAULT_LLAMA_SERVER_SLOTS,
                   help="llama-server -np (parallel slots)")
    g.add_argument("--llama-server-args", default="", help="more llama-server arguments, e.g. \"-t 2\"")
    g.add_argument("--api-key", default=None, help="Bearer key for --base-url targets")
    b.add_argument("--output", type=output_file, default="bench-results/serve.json")


# ---- one request ---------------------------------------------------------------------------------

@dataclass
class RequestResult:
    input_len: int
    output_len: int                 # asked for
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0          # from the usage chunk, else the token chunks


def sampling_fields(temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> dict[str, float]:
    """A request body's sampling fields: greedy at temperature 0, else temperature, top-p, top-k and
    min-p, each sent even when off (top_k 0 and min_p 0 mean off to tokenmill, vLLM and
    llama-server), so that no server adds its own default filters."""
    if temperature == 0:
        return {"temperature": 0.0}
    return {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p}


async def sse_lines(response: Any) -> AsyncIterator[str]:
    """A Server-Sent Events stream's lines, ended at CRLF, LF or CR only, as SSE says (httpx's
    aiter_lines also ends them at U+0085, U+2028 and U+2029, which a server's JSON may hold raw)."""
    rest = ""
    async for text in response.aiter_text():
        rest += text
        held = rest.endswith("\r")   # (the first half of a CRLF, maybe: it waits for the next text)
        *lines, rest = SSE_LINE_END.split(rest[:-1] if held else rest)
        for line in lines:
            yield line
        rest += "\r" if held else ""
    if rest:   # (no line end in it but a held CR, which ends it)
        yield rest.removesuffix("\r")


async def stream_request(client: Any, url: str, model: str, prompt: list[int], output_len: int,
                         headers: dict[str, str], timeout: float,
                         sampling: dict[str, float] | None = None) -> RequestResult:
    """One streamed completion of exactly `output_len` tokens, timed chunk by chunk; greedy unless
    `sampling` (sampling_fields) says otherwise."""
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, **(sampling or sampling_fields(0.0, 1.0)),
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(len(prompt), output_len)
    start = time.perf_counter()
    last = None
    token_chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            async for line in sse_lines(response):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = str(chunk["error"])[:200]
                    return result
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                # a token's chunk: text, or (llama-server) an empty text before the finish, as a
                # token that renders as nothing streams (random-weight models make many of them)
                if any(c.get("text") or c.get("finish_reason") is None for c in chunk.get("choices") or []):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    token_chunks += 1
    except Exception as e:   # a failed request is a row in the report, not a crash of the bench
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    result.e2e_s = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else token_chunks
    result.ok = result.ttft_s is not None
    if not result.ok:
        result.error = "no token streamed"
    return result


async def run_level(base_url: str, model: str, prompts: list[list[int]], output_lens: list[int],
                     concurrency: int | None, rate: float | None, seed: int, api_key: str | None,
                     timeout: float, sampling: dict[str, float] | None = None) -> tuple[list[RequestResult], float]:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = concurrency or len(prompts)
    semaphore = asyncio.Semaphore(limit)
    rng = random.Random(seed + 2)
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        async def run(i: int, delay: float) -> RequestResult:
            await asyncio.sleep(delay)
            async with semaphore:
                return await stream_request(client, url, model, prompts[i], output_lens[i], headers, timeout,
                                            sampling)

        delays, t = [], 0.0
        for _ in prompts:
            delays.append(t)
            if rate is not None:
                t += rng.expovariate(rate)
        if rate is None:
            delays = [0.0] * len(prompts)
        start = time.perf_counter()
        results = await asyncio.gather(*(run(i, d) for i, d in enumerate(delays)))
        elapsed = time.perf_counter() - start
    return list(results), elapsed


# ---- statistics ----------------------------------------------------------------------------------

def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[RequestResult], elapsed: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    row: dict[str, Any] = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "short_outputs": sum(1 for r in ok if r.output_tokens != r.output_len),
        "elapsed_s": elapsed, "requests_per_s": len(ok) / elapsed, "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (in_tokens + out_tokens) / elapsed, "output_tokens": out_tokens,
    }
    series = {"ttft": [r.ttft_s for r in ok], "itl": [x for r in ok for x in r.itl_s], "e2e": [r.e2e_s for r in ok]}
    for name, values in series.items():
        for p in PERCENTILES:
            v = percentile(values, p)
            row[f"{name}_p{p}_ms"] = None if v is None else v * 1000
        row[f"{name}_mean_ms"] = sum(values) / len(values) * 1000 if values else None
    return row


# ---- targets -------------------------------------------------------------------------------------

def wait_ready(base_url: str, process: subprocess.Popen | None, timeout: float) -> None:
    """Poll GET /health until 200 (tokenmill and llama-server both answer 503 while loading)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise TokenmillError(f"the server at {base_url} exited with status {process.returncode} while starting")
        try:
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TokenmillError(f"the server at {base_url} was not ready after {timeout:.0f} s")


def served_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def stop_process(process: subprocess.Popen, timeout: float = 60.0) -> int | None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def start_tokenmill(model: str, args: argparse.Namespace, log_path: Path,
                    extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`tokenmill serve` with the engine flags in `args` (then `extra`, which win), on a free port."""
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", model, "--port", str(port),
               "--uvicorn-log-level", "warning", "--max-queued-requests", str(max(256, args.num_requests)),
               *engine_argv(args), *extra]
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    log = open(log_path, "wb")   # noqa: SIM115 - the child writes to it until stopped
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), f"http://127.0.0.1:{port}"


def resolve_llama_server(binary: str, model: str) -> str:
    """The llama-server binary to run (`auto`: the peer built by tokenmill.bench.peers)."""
    if binary == "auto":
        from tokenmill.bench.peers import llama_server_status

        status = llama_server_status()
        if not status.available:
            raise TokenmillError(f"--llama-server auto: {status.detail}")
        binary = status.where
    if not Path(binary).is_file() or not os.access(binary, os.X_OK):
        raise TokenmillError(f"--llama-server: {binary!r} is not an executable file")
    if not model.endswith(".gguf"):
        raise TokenmillError(f"--llama-server: llama-server needs a .gguf model, got {model!r}")
    return binary


def start_llama_server(binary: str, model: str, slots: int, ctx_per_slot: int, extra: str,
                       log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
               "-c", str(slots * ctx_per_slot), "-cb", *([] if peers.llama_repack() else ["--no-repack"]),
               *shlex.split(extra)]
    log = open(log_path, "wb")   # noqa: SIM115 - the child writes to it until stopped
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


# ---- the command ---------------------------------------------------------------------------------

def _check(args: argparse.Namespace) -> tuple[tuple[int, int], tuple[int, int], list[int | None]]:
    input_range = check_range("--input-len-range", args.input_len_range)
    output_range = check_range("--output-len-range", args.output_len_range)
    if args.num_requests < 1:
        raise TokenmillError(f"--num-requests: must be >= 1, got {args.num_requests}")
    if args.request_rate is not None and not args.request_rate > 0:
        raise TokenmillError(f"--request-rate: must be > 0, got {args.request_rate}")
    levels: list[int | None] = list(args.concurrency or ([None] if args.request_rate else DEFAULT_CONCURRENCY))
    if any(c is not None and c < 1 for c in levels):
        raise TokenmillError(f"--concurrency: must be >= 1, got {args.concurrency}")
    if args.no_tokenmill and not args.base_url and not args.llama_server:
        raise TokenmillError("nothing to measure: --no-tokenmill without --base-url or --llama-server")
    if not args.temperature >= 0:
        raise TokenmillError(f"--temperature: must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise TokenmillError(f"--top-p: must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise TokenmillError(f"--top-k: must be >= 0, got {args.top_k}")
    if not 0 <= args.min_p <= 1:
        raise TokenmillError(f"--min-p: must be in [0, 1], got {args.min_p}")
    for flag, value, off in (("--top-p", args.top_p, 1.0), ("--top-k", args.top_k, 0), ("--min-p", args.min_p, 0.0)):
        if value != off and args.temperature == 0:
            raise TokenmillError(f"{flag}: greedy requests (--temperature 0, the default) take no {flag[2:]}")
    return input_range, output_range, levels


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.hub import model_path
    from tokenmill.tokenizer import load_tokenizer

    input_range, output_range, levels = _check(args)
    model = model_path(args.model)
    llama_server = resolve_llama_server(args.llama_server, model) if args.llama_server else None
    tokenizer = load_tokenizer(model_path(args.tokenizer) if args.tokenizer else model)
    lengths = make_lengths(args.num_requests, input_range, output_range, args.seed)
    input_lens = [i for i, _ in lengths]
    # One prompt set per level: a level replaying the previous level's prompts would find them in the
    # server's prefix cache (same lengths, a different tag in each prompt's first block).
    prompt_sets = [make_prompts(tokenizer, input_lens, args.seed, tag=f"Request (run {k})") for k in range(len(levels))]
    output_lens = [o for _, o in lengths]
    warmup = make_prompts(tokenizer, [16], args.seed, tag="Warm-up")[0]
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    targets: list[tuple[str, str | None, str | None]] = []   # (name, base_url or None to start, api key)
    if not args.no_tokenmill:
        targets.append(("tokenmill", None, None))
    if args.llama_server:
        targets.append(("llama-server", None, None))
    targets += [(url, url.rstrip("/"), args.api_key) for url in args.base_url]
    names = [name for name, _, _ in targets]
    if len(set(names)) != len(names):
        raise TokenmillError(f"--base-url: a target is given twice: {names}")

    cfg = {"model": model, "num_requests": args.num_requests, "seed": args.seed,
           "input_len_range": list(input_range), "output_len_range": list(output_range),
           "input_tokens": sum(input_lens), "output_tokens": sum(output_lens),
           "concurrency": levels, "request_rate": args.request_rate, "tokenmill_flags": engine_argv(args),
           "cpu_count": os.cpu_count(), "llama_repack": peers.llama_repack(),
           "sampling": sampling_fields(args.temperature, args.top_p, args.top_k, args.min_p)}
    ctx_per_slot = context_for(input_range[1] + output_range[1])
    rows: list[dict[str, Any]] = []
    for name, base_url, api_key in targets:
        process = None
        log_path = out_path.with_name(f"{out_path.stem}-{name}.log") if base_url is None else None
        if base_url is None and name == "tokenmill":
            print("starting tokenmill serve ...", flush=True)
            process, base_url = start_tokenmill(model, args, log_path)
        elif base_url is None:
            cfg["llama_server"] = {"binary": llama_server, "slots": args.llama_server_slots,
                                   "ctx_per_slot": ctx_per_slot, "extra_args": args.llama_server_args}
            print(f"starting llama-server -np {args.llama_server_slots} ...", flush=True)
            process, base_url = start_llama_server(llama_server, model, args.llama_server_slots, ctx_per_slot,
                                                   args.llama_server_args, log_path)
        try:
            t0 = time.perf_counter()
            if process is not None:   # a --base-url server is up already (and may have no /health)
                wait_ready(base_url, process, SERVER_START_TIMEOUT_S)
            ready_s = time.perf_counter() - t0
            served = served_model(base_url, api_key)
            asyncio.run(run_level(base_url, served, [warmup], [4], 1, None, args.seed, api_key, args.timeout))
            for level, level_prompts in zip(levels, prompt_sets, strict=True):
                label = f"rate {args.request_rate}/s" if args.request_rate else f"concurrency {level}"
                if args.request_rate and level is not None:
                    label += f" (cap {level})"
                print(f"  {name}: {label} ...", flush=True)
                results, elapsed = asyncio.run(run_level(base_url, served, level_prompts, output_lens, level,
                                                          args.request_rate, args.seed, api_key, args.timeout,
                                                          cfg["sampling"]))
                rows.append({"target": name, "base_url": base_url, "served_model": served, "level": label,
                             "concurrency": level, "request_rate": args.request_rate,
                             "ready_s": ready_s if process is not None else None,
                             **summarize(results, elapsed)})
        finally:
            if process is not None:
                code = stop_process(process)
                if code not in (0, None):
                    print(f"  {name} exited with status {code}; its log: {log_path}", flush=True)
    _print_report(cfg, rows)
    report = {"config": cfg, "input_lens": input_lens, "output_lens": output_lens, "results": rows}
    out_path.write_text(json.dumps(report, indent=2))
    print(f"wrote {out_path}")
    return report


def _fmt(v: float | None, spec: str = "{:.0f}") -> str:
    return "-" if v is None else spec.format(v)


def describe_sampling(sampling: dict[str, float]) -> str:
    if sampling["temperature"] == 0:
        return "greedy"
    return (f"temperature {sampling['temperature']:g}, top_p {sampling['top_p']:g}, "
            f"top_k {sampling['top_k'] or 'off'}, min_p {sampling['min_p'] or 'off'}")


def _print_report(cfg: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(f"\nmodel: {cfg['model']}")
    if any(r["target"] == "llama-server" for r in rows):
        peers.print_repack_note(cfg.get("llama_repack"))
    print(f"workload: {cfg['num_requests']} requests, input {cfg['input_len_range'][0]}-{cfg['input_len_range'][1]} "
          f"tokens, output {cfg['output_len_range'][0]}-{cfg['output_len_range'][1]} tokens "
          f"({cfg['output_tokens']} in all), seed {cfg['seed']}, {describe_sampling(cfg['sampling'])}, "
          "ignore_eos, streaming")
    header = (f"{'target':<16}{'load':<22}{'ok':>5}{'req/s':>8}{'out tok/s':>10}{'tot tok/s':>10}"
              f"{'TTFT p50/p90/p99 ms':>22}{'ITL p50/p90/p99 ms':>21}{'E2E p50/p90/p99 s':>20}")
    print("\n" + header)
    for r in rows:
        ttft = "/".join(_fmt(r[f"ttft_p{p}_ms"]) for p in PERCENTILES)
        itl = "/".join(_fmt(r[f"itl_p{p}_ms"]) for p in PERCENTILES)
        e2e = "/".join(_fmt(None if r[f"e2e_p{p}_ms"] is None else r[f"e2e_p{p}_ms"] / 1000, "{:.1f}")
                       for p in PERCENTILES)
        print(f"{r['target'][:15]:<16}{r['level'][:21]:<22}{r['completed']:>5}{r['requests_per_s']:>8.2f}"
              f"{r['output_tok_s']:>10.1f}{r['total_tok_s']:>10.1f}{ttft:>22}{itl:>21}{e2e:>20}")
        if r["failed"] or r["short_outputs"]:
            print(f"  {r['failed']} failed, {r['short_outputs']} with fewer/more tokens than asked: {r['errors']}")
    names = list(dict.fromkeys(r["target"] for r in rows))
    if "tokenmill" in names and len(names) > 1:
        print("\nratios tokenmill / peer (output tok/s: higher is better for tokenmill; TTFT p50: lower is)")
        base = {r["level"]: r for r in rows if r["target"] == "tokenmill"}
        for r in rows:
            b = base.get(r["level"])
            if r["target"] == "tokenmill" or b is None or not r["output_tok_s"]:
                continue
            ttft = (f"{b['ttft_p50_ms'] / r['ttft_p50_ms']:.2f}x" if b["ttft_p50_ms"] and r["ttft_p50_ms"] else "-")
            print(f"  vs {r['target']} at {r['level']}: output tok/s {b['output_tok_s'] / r['output_tok_s']:.2f}x, "
                  f"TTFT p50 {ttft}")


def cmd_bench_serve(args: argparse.Namespace) -> int:
    report = run_serve_bench(args)
    return 0 if all(r["failed"] == 0 for r in report["results"]) else 1
