"""`tokenmill bench structured [MODEL]`: the cost of structured output (JSON-schema constrained
decoding), on the default SmolLM2 GGUF or any model, with `--repeats` runs and the median and the
spread ((max - min) / median) of every number.

1. Output tokens/s of a JSON-schema workload against the same workload unconstrained, at each
   `--batch-sizes` (requests in flight at once; default 1 and 32). The workload: one chat prompt
   per schema of `bench.schemas.SCHEMAS` asking for a JSON object ("Answer with a JSON object. It
   describes: order. Fields: ..."), cycled to fill the batch (batch 1: the first schema only;
   `--num-requests N` runs N requests at that concurrency instead),
   greedy, max_tokens 400. The constrained run goes first; the unconstrained one then generates
   exactly as many tokens per request (max_tokens = that request's constrained output length,
   ignore_eos), so both runs produce the same tokens per request and the ratio compares like with
   like. Every prompt carries its own tag (run and request number) at the start of its system
   message, so no run is answered from a previous run's prefix cache. Tokens are output tokens,
   the ones the grammar forced included. Jump-forward is reported apart: forced tokens / output
   tokens, and the model steps saved: (forced tokens + requests that ended without an EOS step) /
   (the steps a token-by-token decode would have needed: output tokens + those requests).
   tokenmill runs in this process (`LLM.generate`, one engine per batch size with max_num_seqs =
   the batch size); the schemas are compiled in the warm-up (compile time is part 2).
2. Schema compile time: for each schema, a fresh `GrammarCompiler` (its cache empty), its one-off
   llguidance tokenizer setup timed apart, then `compile` (the engine's call; the target: p50 < 50
   ms) and the first mask after it (llguidance builds lexer states lazily: a request's first token
   waits for both).
3. llama.cpp's `llama-server` (`--peers llama-server`, when built; see bench/peers.py) on the same
   GGUF: the same chat requests through /v1/chat/completions, constrained with `response_format:
   {"type": "json_schema", "json_schema": {"name": ..., "schema": ...}}` (the OpenAI nesting: its
   server reads the schema at response_format.json_schema.schema; a flat response_format.schema is
   read only for type json_object, and with type json_schema is silently ignored, leaving the output
   unconstrained), then unconstrained with the same per-request token counts (max_tokens, ignore_eos);
   started with `-np` = the batch size and `-t`/`-tb` = --threads, as `bench compare` starts it.

Every output of a constrained run (both engines) is parsed and validated against its schema with
`jsonschema` (formats included where jsonschema checks them); the fraction valid is reported, over
all outputs and over those that finished with "stop" (tokenmill's should be 1.0: an output cut by
max_tokens is incomplete JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tokenmill.bench import output_file, peers, positive_seconds
from tokenmill.bench import serve as bench_serve
from tokenmill.bench.procs import load_average, print_load
from tokenmill.bench.schemas import SCHEMAS, SchemaCase
from tokenmill.bench.serve import percentile
from tokenmill.bench.workload import context_for
from tokenmill.errors import TokenmillError

DEFAULT_THREADS = 2
DEFAULT_BATCH_SIZES = [1, 32]
DEFAULT_REPEATS = 3
DEFAULT_MAX_TOKENS = 400
PEERS = ["llama-server"]
# The targets (never changed to fit a result): constrained output tokens/s at least 90% of the
# same workload unconstrained at batch 32, and a first schema compile under 50 ms at the median.
TARGET_RATIO = 0.90
TARGET_RATIO_BATCH = 32
TARGET_COMPILE_P50_MS = 50.0

SYSTEM = "Session {tag}. You are a helpful assistant."
PROMPT = "Answer with a JSON object. It describes: {name}. Fields: {fields}."


def add_structured_args(b: argparse.ArgumentParser) -> None:
    b.set_defaults(threads=DEFAULT_THREADS)   # every engine's thread count, as in `bench compare`
    g = b.add_argument_group("structured")
    g.add_argument("--batch-sizes", type=int, nargs="+", default=DEFAULT_BATCH_SIZES,
                   help="requests in flight at once, one run per value (tokenmill max_num_seqs, llama-server -np)")
    g.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help="runs of each measurement (the median and the spread are reported)")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="max_tokens of a constrained request")
    g.add_argument("--num-schemas", type=int, default=len(SCHEMAS),
                   help=f"use the first N schemas of bench.schemas.SCHEMAS (default: all {len(SCHEMAS)})")
    g.add_argument("--num-requests", type=int, default=None,
                   help="requests per run (default: the batch size; the schemas are cycled to fill it)")
    g.add_argument("--peers", nargs="*", default=PEERS, choices=PEERS,
                   help="peers to run next to tokenmill (default: llama-server; none: `--peers` alone)")
    g.add_argument("--llama-server", default=None, metavar="PATH",
                   help="a llama-server binary (default: $TOKENMILL_LLAMA_SERVER, else the one built into the cache)")
    g.add_argument("--timeout", type=positive_seconds, default=600.0, help="seconds per llama-server request")
    b.add_argument("--output", type=output_file, default="bench-results/structured.json")


# ---- numbers ----------------------------------------------------------------------------------------

def spread_stat(values: list[float]) -> dict[str, Any]:
    """The median of repeated measurements, their range and the spread: (max - min) / median."""
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / med if med else 0.0, "values": values}


def validate(text: str, schema: dict[str, Any]) -> str | None:
    """None when `text` is one JSON value valid against `schema` (formats checked where jsonschema
    can), else why not."""
    import jsonschema

    try:
        instance = json.loads(text)
    except ValueError as e:
        return f"not JSON: {e}"[:200]
    try:
        jsonschema.validate(instance, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    except jsonschema.ValidationError as e:
        return f"invalid: {e.message}"[:200]
    return None


def _validity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Fraction valid over the outputs of constrained runs (`rows`: one per output), and over those
    that finished with "stop"."""
    stopped = [r for r in rows if r["finish_reason"] == "stop"]
    return {"outputs": len(rows), "valid": sum(r["error"] is None for r in rows),
            "valid_fraction": sum(r["error"] is None for r in rows) / len(rows) if rows else None,
            "stopped": len(stopped), "valid_stopped": sum(r["error"] is None for r in stopped),
            "valid_fraction_stopped": sum(r["error"] is None for r in stopped) / len(stopped) if stopped else None,
            "finish_reasons": dict(Counter(r["finish_reason"] for r in rows)),
            "invalid_examples": [{"schema": r["schema"], "finish_reason": r["finish_reason"], "error": r["error"],
                                  "text": r["text"][:300]} for r in rows if r["error"] is not None][:5]}


# ---- the workload ----------------------------------------------------------------------------------

def messages_for(case: SchemaCase, tag: str) -> list[dict[str, str]]:
    fields = ", ".join(case.schema.get("properties", {})) or "any"
    return [{"role": "system", "content": SYSTEM.format(tag=tag)},
            {"role": "user", "content": PROMPT.format(name=case.name.replace("_", " "), fields=fields)}]


def workload(cases: list[SchemaCase], n: int, run: int) -> list[tuple[SchemaCase, list[dict[str, str]]]]:
    """n requests cycling through `cases`; run `run`'s tag in each (no prefix shared across runs)."""
    return [(cases[i % len(cases)], messages_for(cases[i % len(cases)], f"{run:04d}-{i:03d}")) for i in range(n)]


def requests_per_run(args: argparse.Namespace, batch: int, num_schemas: int) -> int:
    return args.num_requests if args.num_requests is not None else batch


# ---- tokenmill ------------------------------------------------------------------------------------

def _tokenmill_run(llm: Any, requests: list[tuple[SchemaCase, list[dict[str, str]]]],
                   max_tokens: list[int], constrained: bool) -> dict[str, Any]:
    """One timed `LLM.generate` of the requests; constrained: JSON schema, else ignore_eos with
    exactly max_tokens[i] tokens."""
    from tokenmill import SamplingParams
    from tokenmill.sampling.structured import StructuredOutputsParams

    prompts = [llm.chat_prompt(messages, True)[1] for _, messages in requests]
    params = [SamplingParams(max_tokens=n, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(json=case.schema) if constrained else None,
                             ignore_eos=not constrained)
              for (case, _), n in zip(requests, max_tokens, strict=True)]
    engine = llm.engine
    forced0, generated0 = engine.num_forced_tokens, engine.num_generation_tokens
    load = load_average()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    eos = engine.eos_token_ids
    rows = []
    for (case, _), out in zip(requests, outs, strict=True):
        o = out.outputs[0]
        rows.append({"schema": case.name, "tokens": len(o.token_ids), "finish_reason": o.finish_reason,
                     # the grammar completed the output: no EOS token was sampled (one model step saved)
                     "ended_without_eos": (o.finish_reason == "stop" and bool(o.token_ids)
                                           and o.token_ids[-1] not in eos),
                     "text": o.text, "error": validate(o.text, case.schema) if constrained else None})
    tokens = sum(r["tokens"] for r in rows)
    forced = engine.num_forced_tokens - forced0
    no_eos = sum(r["ended_without_eos"] for r in rows)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "prompt_tokens": sum(map(len, prompts)),
            "engine_generation_tokens": engine.num_generation_tokens - generated0,
            "forced_tokens": forced, "ended_without_eos": no_eos,
            "forced_fraction": forced / tokens if tokens else 0.0,
            "steps_saved_fraction": (forced + no_eos) / (tokens + no_eos) if tokens else 0.0,
            "load_avg_before": load, "outputs": rows}


def _warm_up(llm: Any, cases: list[SchemaCase]) -> None:
    """Compile every schema (cached for the timed runs) and run a few short requests of both kinds."""
    from tokenmill.sampling.structured import StructuredOutputsParams

    for case in cases:
        llm.engine.grammars.compile(StructuredOutputsParams(json=case.schema))
    warm = workload(cases[:2], 2, run=9999)
    _tokenmill_run(llm, warm, [8, 8], constrained=True)
    _tokenmill_run(llm, warm, [8, 8], constrained=False)


def tokenmill_batches(args: argparse.Namespace, model: str, cases: list[SchemaCase], slot_ctx: int,
                      engine_kwargs: dict[str, Any], runs: dict[str, Any], save) -> None:
    """Constrained then unconstrained runs, `--repeats` times, for each batch size (one engine each)."""
    from tokenmill import LLM

    run_id = 0
    for batch in args.batch_sizes:
        kwargs = {**engine_kwargs, "max_num_seqs": batch}
        if kwargs.get("num_kv_blocks") is None and kwargs.get("kv_cache_memory") is None:
            kwargs["num_kv_blocks"] = batch * slot_ctx // kwargs["block_size"] + 1   # llama-server's -c, in blocks
        print_load(f"tokenmill: batch {batch}, loading")
        llm = LLM(model, **kwargs)
        _warm_up(llm, cases)
        n = requests_per_run(args, batch, len(cases))
        reps = []
        for rep in range(args.repeats):
            run_id += 1
            print_load(f"tokenmill: batch {batch}, repeat {rep + 1}/{args.repeats}: {n} requests constrained")
            c = _tokenmill_run(llm, workload(cases, n, run_id), [args.max_tokens] * n, constrained=True)
            run_id += 1
            print_load(f"tokenmill: batch {batch}, repeat {rep + 1}/{args.repeats}: the same tokens unconstrained")
            u = _tokenmill_run(llm, workload(cases, n, run_id), [r["tokens"] for r in c["outputs"]],
                               constrained=False)
            u["short_outputs"] = sum(a["tokens"] != b["tokens"] for a, b in zip(c["outputs"], u["outputs"],
                                                                                strict=True))
            for r in u["outputs"]:
                r.pop("text")   # unconstrained text: not validated, not kept
            reps.append({"constrained": c, "unconstrained": u})
            runs[str(batch)] = summarize_batch(batch, n, reps)
            save()
        del llm
        gc.collect()


def summarize_batch(batch: int, n: int, reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch size's repeats: median and spread of each rate and fraction, validity over all runs."""
    c = [r["constrained"] for r in reps]
    u = [r["unconstrained"] for r in reps]
    out: dict[str, Any] = {
        "batch_size": batch, "requests_per_run": n, "repeats": len(reps),
        "constrained_tok_s": spread_stat([x["output_tok_s"] for x in c]),
        "unconstrained_tok_s": spread_stat([x["output_tok_s"] for x in u]),
        "ratio": spread_stat([a["output_tok_s"] / b["output_tok_s"] for a, b in zip(c, u, strict=True)]),
        "output_tokens": spread_stat([x["output_tokens"] for x in c]),
        "validity": _validity([o for x in c for o in x["outputs"]]),
        "short_outputs_unconstrained": sum(x.get("short_outputs", 0) for x in u),
        "runs": reps,
    }
    if "forced_fraction" in c[0]:
        out["forced_fraction"] = spread_stat([x["forced_fraction"] for x in c])
        out["steps_saved_fraction"] = spread_stat([x["steps_saved_fraction"] for x in c])
    return out


# ---- schema compile time ------------------------------------------------------------------------------

def compile_times(llm: Any, cases: list[SchemaCase], repeats: int) -> dict[str, Any]:
    """Per schema and repeat: a fresh GrammarCompiler (empty cache); its llguidance tokenizer
    setup, then `compile` (uncached), then the first mask (`matcher`: compile is a cache hit there)."""
    from tokenmill.engine.grammar import GrammarCompiler
    from tokenmill.sampling.structured import StructuredOutputsParams

    engine = llm.engine
    setup, compile_ms, first_mask = [], {c.name: [] for c in cases}, {c.name: [] for c in cases}
    for _ in range(repeats):
        for case in cases:
            spec = StructuredOutputsParams(json=case.schema)
            t0 = time.perf_counter()
            compiler = GrammarCompiler(llm.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
            compiler.llguidance_tokenizer()   # the one-off setup, built on first use otherwise
            t1 = time.perf_counter()
            compiler.compile(spec)
            t2 = time.perf_counter()
            compiler.matcher(spec)
            t3 = time.perf_counter()
            setup.append((t1 - t0) * 1000)
            compile_ms[case.name].append((t2 - t1) * 1000)
            first_mask[case.name].append((t3 - t2) * 1000)

    def over_schemas(per_schema: dict[str, list[float]]) -> dict[str, Any]:
        medians = [statistics.median(v) for v in per_schema.values()]
        per_repeat_p50 = [percentile([v[i] for v in per_schema.values()], 50) for i in range(repeats)]
        return {"p50": percentile(medians, 50), "p90": percentile(medians, 90), "max": max(medians),
                "p50_over_repeats": spread_stat(per_repeat_p50),
                "per_schema_median": {k: statistics.median(v) for k, v in per_schema.items()}}

    return {"schemas": len(cases), "repeats": repeats, "tokenizer_setup_ms": spread_stat(setup),
            "compile_ms": over_schemas(compile_ms), "first_mask_ms": over_schemas(first_mask),
            "slowest_compile": max(compile_ms, key=lambda k: statistics.median(compile_ms[k]))}


# ---- llama-server ---------------------------------------------------------------------------------------

async def chat_requests(base_url: str, model: str, bodies: list[dict[str, Any]], concurrency: int,
                         timeout: float) -> tuple[list[dict[str, Any]], float]:
    """POST each body to /v1/chat/completions (not streamed), `concurrency` in flight at once;
    (the responses, or {"error": ...}, in order; the wall time)."""
    import httpx

    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with semaphore:
                try:
                    r = await client.post(base_url + "/v1/chat/completions", json={"model": model, **body})
                except Exception as e:
                    return {"error": f"{type(e).__name__}: {e}"[:200]}
                if r.status_code != 200:
                    return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
                return r.json()

        start = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        return list(results), time.perf_counter() - start


def _llama_run(base_url: str, model: str, requests: list[tuple[SchemaCase, list[dict[str, str]]]],
               max_tokens: list[int], constrained: bool, concurrency: int, timeout: float) -> dict[str, Any]:
    bodies = []
    for (case, messages), n in zip(requests, max_tokens, strict=True):
        body: dict[str, Any] = {"messages": messages, "max_tokens": n, "temperature": 0.0, "seed": 0}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema}}
        else:
            body["ignore_eos"] = True
        bodies.append(body)
    load = load_average()
    responses, elapsed = asyncio.run(chat_requests(base_url, model, bodies, concurrency, timeout))
    rows, errors, prompt_tokens = [], [], 0
    for (case, _), resp in zip(requests, responses, strict=True):
        if "error" in resp or not resp.get("choices"):
            errors.append(str(resp.get("error", resp))[:200])
            rows.append({"schema": case.name, "tokens": 0, "finish_reason": "error", "text": "",
                         "error": "request failed"})
            continue
        choice, usage = resp["choices"][0], resp.get("usage") or {}
        text = choice.get("message", {}).get("content") or ""
        prompt_tokens += usage.get("prompt_tokens", 0)
        rows.append({"schema": case.name, "tokens": usage.get("completion_tokens", 0),
                     "finish_reason": choice.get("finish_reason"), "text": text,
                     "error": validate(text, case.schema) if constrained else None})
    tokens = sum(r["tokens"] for r in rows)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "prompt_tokens": prompt_tokens, "failed": len(errors), "errors": sorted(set(errors))[:5],
            "load_avg_before": load, "outputs": rows}


def llama_server_batches(args: argparse.Namespace, binary: str, model: str, cases: list[SchemaCase], slot_ctx: int,
                         runs: dict[str, Any], log_dir: Path, save) -> None:
    run_id = 1000   # tags of their own (llama-server caches prompts too)
    for batch in args.batch_sizes:
        log = log_dir / f"structured-llama-server-np{batch}.log"
        print_load(f"llama-server -np {batch}: starting")
        process, base_url = bench_serve.start_llama_server(binary, model, batch, slot_ctx,
                                                           f"-t {args.threads} -tb {args.threads}", log)
        try:
            bench_serve.wait_ready(base_url, process, bench_serve.SERVER_START_TIMEOUT_S)
            served = bench_serve.served_model(base_url, None)
            warm = workload(cases[:2], 2, run=9998)
            _llama_run(base_url, served, warm, [8, 8], True, batch, args.timeout)
            n = requests_per_run(args, batch, len(cases))
            reps = []
            for rep in range(args.repeats):
                run_id += 1
                print_load(f"llama-server: batch {batch}, repeat {rep + 1}/{args.repeats}: {n} requests constrained")
                c = _llama_run(base_url, served, workload(cases, n, run_id), [args.max_tokens] * n, True, batch,
                               args.timeout)
                run_id += 1
                print_load(f"llama-server: batch {batch}, repeat {rep + 1}/{args.repeats}: the same tokens "
                           "unconstrained")
                u = _llama_run(base_url, served, workload(cases, n, run_id),
                               [max(1, r["tokens"]) for r in c["outputs"]], False, batch, args.timeout)
                u["short_outputs"] = sum(a["tokens"] != b["tokens"] for a, b in zip(c["outputs"], u["outputs"],
                                                                                    strict=True))
                for r in u["outputs"]:
                    r.pop("text")
                reps.append({"constrained": c, "unconstrained": u})
                runs[str(batch)] = summarize_batch(batch, n, reps)
                save()
        finally:
            code = bench_serve.stop_process(process)
            if code not in (0, None, -15):
                print(f"  llama-server exited with status {code}; its log: {log}", flush=True)


# ---- the command ----------------------------------------------------------------------------------------

def _check_args(args: argparse.Namespace) -> None:
    for name in ("repeats", "max_tokens", "num_schemas", "threads"):
        if getattr(args, name) is None or getattr(args, name) < 1:
            raise TokenmillError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if any(b < 1 for b in args.batch_sizes):
        raise TokenmillError(f"--batch-sizes: must be >= 1, got {args.batch_sizes}")
    if args.num_requests is not None and args.num_requests < 1:
        raise TokenmillError(f"--num-requests: must be >= 1, got {args.num_requests}")


def run_structured_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill import LLM
    from tokenmill.config import engine_args
    from tokenmill.hub import model_path

    _check_args(args)
    model = model_path(args.model)
    cases = SCHEMAS[:args.num_schemas]
    args.batch_sizes = sorted(set(args.batch_sizes))
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bench_start = time.perf_counter()
    engine_kwargs = {**engine_args(args), "show_progress": False}

    server = peers.llama_server_for(args.llama_server, "llama-server" in args.peers, model)

    # The compile times, and the longest prompt (each engine's KV capacity per request).
    print_load(f"schema compile times ({len(cases)} schemas x {args.repeats})")
    llm = LLM(model, **{**engine_kwargs, "num_kv_blocks": engine_kwargs.get("num_kv_blocks") or 64})
    compile_report = compile_times(llm, cases, args.repeats)
    longest = max(len(llm.chat_prompt(m, True)[1]) for _, m in workload(cases, len(cases), 0))
    del llm
    gc.collect()
    slot_ctx = context_for(longest + 8 + args.max_tokens)   # +8: room for the tag's digits

    cfg: dict[str, Any] = {
        "model": model, "threads": args.threads, "batch_sizes": args.batch_sizes, "repeats": args.repeats,
        "max_tokens": args.max_tokens, "schemas": [c.name for c in cases], "num_requests": args.num_requests,
        "temperature": 0.0, "longest_prompt_tokens": longest, "ctx_per_slot": slot_ctx,
        "engine_args": engine_kwargs, "cpu_count": os.cpu_count(), "llama_repack": peers.llama_repack(),
        "peers": args.peers,
        "targets": {"ratio": TARGET_RATIO, "ratio_batch_size": TARGET_RATIO_BATCH,
                    "compile_p50_ms": TARGET_COMPILE_P50_MS},
        "llama_server_response_format": {"type": "json_schema", "json_schema": {"name": "<schema name>",
                                                                                 "schema": "<the schema>"}},
    }
    report: dict[str, Any] = {"config": cfg, "compile": compile_report, "tokenmill": {},
                              "llama_server": {"status": None if server is None else server.detail}}

    def save(partial: bool = True) -> None:
        out_path.write_text(json.dumps({**report, "partial": partial}, indent=2, default=str))

    save()
    tokenmill_batches(args, model, cases, slot_ctx, engine_kwargs, report["tokenmill"], save)
    if server is not None and server.available:
        cfg["llama_server"] = {"binary": server.where, "args": f"-t {args.threads} -tb {args.threads}",
                               "ctx_per_slot": slot_ctx}
        runs: dict[str, Any] = {}
        report["llama_server"]["batches"] = runs
        report["llama_server"].update(peers.guarded("llama-server", llama_server_batches, args, server.where, model,
                                                    cases, slot_ctx, runs, out_path.parent, save) or {})
    cfg["wall_s"] = time.perf_counter() - bench_start
    report["table"] = build_table(report)
    print_report(report)
    save(partial=False)
    print(f"wrote {out_path}")
    return report


# ---- the table ------------------------------------------------------------------------------------------

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _cell(stat: dict[str, Any] | None, fmt: str) -> str:
    """`median (spread)`."""
    if stat is None:
        return "-"
    return f"{fmt.format(stat['median'])} ({stat['spread']:.0%})"


def build_table(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows (metric, per batch size: the stat or value), tokenmill first, then llama-server."""
    rows: list[dict[str, Any]] = []
    tm = report["tokenmill"]
    ls = report["llama_server"].get("batches") or {}
    batches = [str(b) for b in report["config"]["batch_sizes"]]

    def add(key: str, label: str, source: dict[str, Any], get, fmt: str) -> None:
        rows.append({"metric": key, "label": label, "fmt": fmt,
                     "values": {b: get(source[b]) if b in source else None for b in batches}})

    add("tokenmill_constrained_tok_s", "tokenmill constrained tok/s", tm, lambda r: r["constrained_tok_s"], "{:.1f}")
    add("tokenmill_unconstrained_tok_s", "tokenmill unconstrained tok/s", tm, lambda r: r["unconstrained_tok_s"],
        "{:.1f}")
    add("tokenmill_ratio", "tokenmill constrained/unconstr.", tm, lambda r: r["ratio"], "{:.2f}")
    add("tokenmill_forced_fraction", "forced / output tokens", tm, lambda r: r["forced_fraction"], "{:.1%}")
    add("tokenmill_steps_saved_fraction", "model steps saved", tm, lambda r: r["steps_saved_fraction"], "{:.1%}")
    add("tokenmill_output_tokens", "output tokens per run", tm, lambda r: r["output_tokens"], "{:.0f}")
    add("tokenmill_valid_fraction", "tokenmill valid (all)", tm, lambda r: r["validity"]["valid_fraction"], "pct")
    add("tokenmill_valid_fraction_stopped", "tokenmill valid (finish stop)", tm,
        lambda r: r["validity"]["valid_fraction_stopped"], "pct")
    if ls:
        add("llama_server_constrained_tok_s", "llama-server constrained tok/s", ls, lambda r: r["constrained_tok_s"],
            "{:.1f}")
        add("llama_server_unconstrained_tok_s", "llama-server unconstrained tok/s", ls,
            lambda r: r["unconstrained_tok_s"], "{:.1f}")
        add("llama_server_ratio", "llama-server constr./unconstr.", ls, lambda r: r["ratio"], "{:.2f}")
        add("llama_server_output_tokens", "llama-server output tokens/run", ls, lambda r: r["output_tokens"],
            "{:.0f}")
        add("llama_server_valid_fraction", "llama-server valid (all)", ls, lambda r: r["validity"]["valid_fraction"],
            "pct")
        add("llama_server_valid_fraction_stopped", "llama-server valid (stop)", ls,
            lambda r: r["validity"]["valid_fraction_stopped"], "pct")
        vs = {b: (tm[b]["constrained_tok_s"]["median"] / ls[b]["constrained_tok_s"]["median"]
                  if b in tm and b in ls and ls[b]["constrained_tok_s"]["median"] else None) for b in batches}
        rows.append({"metric": "tokenmill_vs_llama_server_constrained", "label": "tokenmill/llama-server constr.",
                     "fmt": "{:.2f}x", "values": vs})
    return rows


def _format(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return _cell(value, "{:.0%}" if fmt == "pct" else fmt)
    return _pct(value) if fmt == "pct" else fmt.format(value)


def print_report(report: dict[str, Any]) -> None:
    cfg = report["config"]
    batches = [str(b) for b in cfg["batch_sizes"]]
    print(f"\nmodel: {cfg['model']}\nthreads: {cfg['threads']} for every engine (of {cfg['cpu_count']} cores); "
          f"{len(cfg['schemas'])} schemas, greedy, max_tokens {cfg['max_tokens']}; the unconstrained run generates "
          "each request's constrained token count (ignore_eos)")
    print(f"each cell: the median of {cfg['repeats']} repeats (spread: (max - min) / median)")
    peers.print_repack_note(cfg.get("llama_repack"))
    header = f"{'metric':<34}" + "".join(f"{'batch ' + b:>20}" for b in batches)
    print("\n" + header)
    for row in report["table"]:
        print(f"{row['label']:<34}" + "".join(f"{_format(row['values'][b], row['fmt']):>20}" for b in batches))
    tm = report["tokenmill"]
    target_batch = str(cfg["targets"]["ratio_batch_size"])
    if target_batch in tm:
        ratio = tm[target_batch]["ratio"]["median"]
        met = "met" if ratio >= TARGET_RATIO else "NOT met"
        print(f"target: constrained >= {TARGET_RATIO:.0%} of unconstrained tok/s at batch {target_batch}: {ratio:.1%}, "
              f"{met} (gap {ratio - TARGET_RATIO:+.1%})")
    else:
        print(f"target: constrained >= {TARGET_RATIO:.0%} of unconstrained tok/s at batch {target_batch}: not measured "
              f"(--batch-sizes {' '.join(batches)})")
    for name, runs in (("tokenmill", tm), ("llama-server", report["llama_server"].get("batches") or {})):
        for b, r in runs.items():
            v = r["validity"]
            if v["valid"] < v["outputs"]:
                print(f"{name} batch {b}: {v['outputs'] - v['valid']} of {v['outputs']} constrained outputs invalid "
                      f"(finish reasons {v['finish_reasons']}); e.g. {v['invalid_examples'][0]['error']}")
            if r["short_outputs_unconstrained"]:
                print(f"{name} batch {b}: {r['short_outputs_unconstrained']} unconstrained outputs with another token "
                      "count than their constrained run")
    ls = report["llama_server"]
    if ls.get("error"):
        print(f"llama-server: error: {ls['error']}")
    elif not ls.get("batches"):
        print(f"llama-server: not run ({ls['status'] or 'not asked for: --peers'})")
    c = report["compile"]
    comp, mask, setup = c["compile_ms"], c["first_mask_ms"], c["tokenizer_setup_ms"]
    print(f"\nschema compile, uncached (engine's GrammarCompiler.compile; {c['schemas']} schemas, median of "
          f"{c['repeats']} per schema): p50 {comp['p50']:.1f} ms, p90 {comp['p90']:.1f} ms, max {comp['max']:.1f} ms "
          f"({c['slowest_compile']}); p50 spread over repeats {comp['p50_over_repeats']['spread']:.0%}")
    met = "met" if comp["p50"] < TARGET_COMPILE_P50_MS else "NOT met"
    gap = comp["p50"] - TARGET_COMPILE_P50_MS
    print(f"target: compile p50 < {TARGET_COMPILE_P50_MS:.0f} ms: {met} (gap {gap:+.1f} ms)")
    print(f"first mask after compile: p50 {mask['p50']:.1f} ms, p90 {mask['p90']:.1f} ms, max {mask['max']:.1f} ms; "
          f"llguidance tokenizer setup (once per model load): {setup['median']:.0f} ms ({setup['spread']:.0%})")
    loads = [r[k]["load_avg_before"] for runs in (tm, ls.get("batches") or {}) for b in runs.values()
             for r in b["runs"] for k in ("constrained", "unconstrained") if r[k]["load_avg_before"] is not None]
    if loads:
        print(f"system load average before the runs: {min(loads):.2f}-{max(loads):.2f} (a shared machine: load above "
              f"{cfg['threads']} means other work competed for the cores)")
        if max(loads) > (cfg["cpu_count"] or 1) + 0.5:
            print("WARNING: the machine was busy: threads that wait for each other on shared cores slow down "
                  "unevenly, so rates and ratios here are noisy (see the spreads); rerun when quiet.")
    print(f"whole bench {cfg['wall_s']:.0f} s")


def cmd_structured(args: argparse.Namespace) -> int:
    args.model = args.model_path or args.model
    report = run_structured_bench(args)
    failed = report["llama_server"].get("error") or any(
        r["constrained"].get("failed") or r["unconstrained"].get("failed")
        for b in (report["llama_server"].get("batches") or {}).values() for r in b["runs"])
    return 1 if failed else 0
