"""`tokenmill bench spec [MODEL]`: speculative decoding's speed, on the default SmolLM2 GGUF or any
model, with `--repeats` runs and the median and spread ((max - min) / median) of every number.

Two workloads of chat requests, greedy, `--max-tokens` each:
  - grounded: the answer copies from the prompt (a function returned with a docstring added, JSON
    records reformatted, a list repeated with one change): where prompt lookup finds its tokens;
  - free: open questions and stories (little to copy).
Each prompt carries a run tag in its system message, so no run is served from another's prefix
cache. At batch 1 the requests run one after another; at batch b, b requests (the workload's
prompts cycled) run at once in an engine with max_num_seqs = b.

Modes (one engine each; at each batch size every mode's engine is loaded, and within each repeat
the modes run in turn, so that a shared machine's drift meets them alike): `off`; `ngram`
(speculative_config {"method": "ngram", "num_speculative_tokens": k}); `draft` (the MODEL's GGUF
run dense, `quantization none`, with the same GGUF run quantized as its draft: the pairing the
issue names for one file) measured against
`off-dense` (the same dense target without speculation). Greedy outputs are identical with and
without speculation (the tests hold that), so each pair of rates is over the same tokens. Reported:
output tokens/s, the speedup over the mode's baseline, the draft acceptance rate and the mean
tokens per verifying step. `--disable-by-batch-size` overrides the default cut-off (to measure the
crossover where speculation stops paying: run with a large value and several batch sizes).

Peer: llama.cpp's `llama-server` (`--peers llama-server`, when built), the same requests through
/v1/chat/completions (temperature 0, max_tokens, seed 0): without speculation, and with its prompt
lookup (`--llama-spec`, default `--spec-type ngram-mod`, its best of four here; `--spec-draft-n-max k`),
started with `-np` = the batch size and
`-t`/`-tb` = --threads. llama.cpp cannot run this GGUF dense, so its draft-model mode has no
like-for-like pairing here and is not run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

from tokenmill.bench import output_file, peers, positive_seconds
from tokenmill.bench import serve as bench_serve
from tokenmill.bench.procs import load_average, print_load
from tokenmill.bench.structured import chat_requests, spread_stat
from tokenmill.bench.workload import context_for
from tokenmill.errors import TokenmillError

DEFAULT_THREADS = 2
DEFAULT_BATCH_SIZES = [1, 8, 32]
DEFAULT_REPEATS = 3
DEFAULT_MAX_TOKENS = 256
DEFAULT_K = 6
MODES = ["off", "ngram", "off-dense", "draft"]
PEERS = ["llama-server"]
# llama-server's best lookup here: grounded batch-1 decode over its own off, measured once each: ngram-simple
# 0.81x, ngram-cache 0.84x, ngram-map-k 1.09x, ngram-mod 1.12x
DEFAULT_LLAMA_SPEC = "--spec-type ngram-mod"
# The targets (never changed to fit a result): ngram >= 2x batch-1 decode on the grounded
# workload, >= 0.95x on free generation, and never slower than off at batch 32.
TARGET_GROUNDED_B1 = 2.0
TARGET_FREE_B1 = 0.95
TARGET_B32 = 1.0

SYSTEM = "Session {tag}. You are a helpful assistant."
GROUNDED = [
    "Add a docstring to this Python function and return the whole function:\n\n"
    "def summarize(orders, currency='EUR'):\n    totals = {}\n    for order in orders:\n"
    "        if order['status'] == 'cancelled':\n            continue\n        customer = order['customer']\n"
    "        amount = order['quantity'] * order['unit_price']\n        if order.get('discount'):\n"
    "            amount = amount * (1 - order['discount'])\n"
    "        totals[customer] = totals.get(customer, 0) + amount\n"
    "    ranked = sorted(totals.items(), key=lambda item: item[1], reverse=True)\n"
    "    return [f'{name}: {value:.2f} {currency}' for name, value in ranked]\n",
    'Reformat this JSON with one key per line and two spaces of indentation:\n{"id": 4821, "name": "Ada Lovelace", '
    '"born": "1815-12-10", "died": "1852-11-27", "field": "mathematics", "known_for": ["Analytical Engine", '
    '"first published algorithm", "notes on Menabrea"], "parents": {"father": "Lord Byron", "mother": "Anne '
    'Isabella Milbanke"}, "city": "London", "country": "United Kingdom"}',
    "Rename the variable `total` to `result` everywhere in this code and return the code:\n\n"
    "def weighted_mean(values, weights):\n    if len(values) != len(weights):\n"
    "        raise ValueError('values and weights differ in length')\n    total = 0.0\n    weight_sum = 0.0\n"
    "    for value, weight in zip(values, weights):\n        total += value * weight\n"
    "        weight_sum += weight\n    if weight_sum == 0:\n        return 0.0\n    total = total / weight_sum\n"
    "    return total\n",
    'Reformat this JSON with one key per line:\n{"city": "Lisbon", "country": "Portugal", "population": 545000, '
    '"area_km2": 100.05, "rivers": ["Tagus"], "founded": "before 1200 BC", "mayor": "Carlos Moedas", '
    '"districts": ["Alfama", "Baixa", "Belem", "Chiado", "Graca"], "airport": "Humberto Delgado"}',
    "Add type hints to this Python class and return the whole class:\n\n"
    "class Inventory:\n    def __init__(self, name):\n        self.name = name\n        self.items = {}\n\n"
    "    def add(self, item, count):\n        self.items[item] = self.items.get(item, 0) + count\n\n"
    "    def remove(self, item, count):\n        if self.items.get(item, 0) < count:\n"
    "            raise KeyError(item)\n        self.items[item] -= count\n\n"
    "    def total(self):\n        return sum(self.items.values())\n",
    "Copy this shopping list and add milk at the end:\n- bread (two loaves, whole wheat)\n- eggs (a dozen, free "
    "range)\n- butter (unsalted)\n- apples (six, green)\n- rice (basmati, 2 kg)\n- tea (black, 100 bags)\n"
    "- tomatoes (a kilo)\n- olive oil (extra virgin)\n- cheese (cheddar, mature)\n- onions (three)",
]
FREE = [
    "Write a short story about a lighthouse keeper.",
    "Why is the sky blue? Explain for a child.",
    "Give me three ideas for a weekend trip and why.",
    "Describe how a bicycle works.",
    "What makes a good friend? Answer in a paragraph.",
    "Write a poem about autumn rain.",
]
WORKLOADS = {"grounded": GROUNDED, "free": FREE}


def add_spec_args(b: argparse.ArgumentParser) -> None:
    b.set_defaults(threads=DEFAULT_THREADS)   # every engine's thread count, as in `bench compare`
    g = b.add_argument_group("spec")
    g.add_argument("--modes", nargs="+", default=MODES, choices=MODES, help="tokenmill modes to run")
    g.add_argument("--batch-sizes", type=int, nargs="+", default=DEFAULT_BATCH_SIZES,
                   help="requests in flight at once, one run per value")
    g.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    g.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help="runs of each measurement (the median and the spread are reported)")
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="max_tokens of every request")
    g.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_K, help="k: the most proposed tokens per step")
    g.add_argument("--prompt-lookup-min", type=int, default=None,
                   help="speculative_config's prompt_lookup_min for ngram (default: the engine's)")
    g.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculative_config's disable_by_batch_size (default: the engine's)")
    g.add_argument("--peers", nargs="*", default=PEERS, choices=PEERS,
                   help="peers to run next to tokenmill (default: llama-server; none: `--peers` alone)")
    g.add_argument("--llama-server", default=None, metavar="PATH",
                   help="a llama-server binary (default: $TOKENMILL_LLAMA_SERVER, else the one built into the cache)")
    g.add_argument("--llama-spec", default=DEFAULT_LLAMA_SPEC,
                   help=f"llama-server's speculative flags for its ngram mode (default: {DEFAULT_LLAMA_SPEC!r}; "
                   "--spec-draft-n-max is added)")
    g.add_argument("--timeout", type=positive_seconds, default=600.0, help="seconds per llama-server request")
    b.add_argument("--output", type=output_file, default="bench-results/spec.json")


def messages(workload: str, n: int, run: int) -> list[list[dict[str, str]]]:
    """n chat requests cycling through the workload's prompts, each tagged with the run."""
    prompts = WORKLOADS[workload]
    return [[{"role": "system", "content": SYSTEM.format(tag=f"{run:04d}-{i:03d}")},
             {"role": "user", "content": prompts[i % len(prompts)]}] for i in range(n)]


def run_tag(workload: str, repeat: int) -> int:
    """The tag of a run: unique within an engine (each run misses its prefix cache), the same for the
    same run of every mode (so modes answer the same prompts)."""
    return 10 * list(WORKLOADS).index(workload) + repeat


def _requests_per_run(batch: int, workload: str) -> int:
    """Batch 1: each prompt once (one after another); batch b: b requests at once."""
    return len(WORKLOADS[workload]) if batch == 1 else batch


# ---- tokenmill ----------------------------------------------------------------------------------------

def _engine_kwargs(mode: str, args: argparse.Namespace, model: str, base: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] | None = None
    if mode == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    elif mode == "draft":
        spec = {"model": model, "num_speculative_tokens": args.num_speculative_tokens}
    if spec is not None and args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size
    if mode == "ngram" and args.prompt_lookup_min is not None:
        spec["prompt_lookup_min"] = args.prompt_lookup_min
    kwargs = {**base, "speculative_config": spec}
    if mode in ("off-dense", "draft"):
        kwargs["quantization"] = "none"
    return kwargs


def _tokenmill_run(llm: Any, batch: int, workload: str, run: int, max_tokens: int) -> dict[str, Any]:
    from tokenmill import SamplingParams

    prompts = [llm.chat_prompt(m, True)[1] for m in messages(workload, _requests_per_run(batch, workload), run)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    stats0 = llm.engine.stats()
    load = load_average()
    start = time.perf_counter()
    decode_s, outs = 0.0, []
    if batch == 1:   # one at a time, streamed: the decode time is from the first token to the last
        for p in prompts:
            first = None
            for out in llm.stream(p, params):
                if first is None and out.outputs[0].token_ids:
                    first = time.perf_counter()
            decode_s += time.perf_counter() - first
            outs.append(out)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafted = stats.spec_num_draft_tokens - stats0.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - stats0.spec_num_accepted_tokens
    drafts = stats.spec_num_drafts - stats0.spec_num_drafts
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed, "requests": len(outs),
            # batch 1: tokens after each request's first / the time after it (prefill excluded)
            "decode_tok_s": (tokens - len(outs)) / decode_s if decode_s else None,
            "draft_tokens": drafted, "accepted_tokens": accepted, "verify_steps": drafts,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_per_step": accepted / drafts if drafts else None,
            # the adaptive draft length's learned costs of a row and of proposing a token, at the end
            "row_cost": stats.spec_row_cost, "proposal_cost": stats.spec_proposal_cost,
            "token_ids": [o.outputs[0].token_ids for o in outs], "load_avg_before": load}


def tokenmill_modes(args: argparse.Namespace, model: str, base: dict[str, Any], report: dict[str, Any],
                    save) -> None:
    """Every mode's engine for a batch size loaded at once, and the modes run in turn within each
    repeat: on a shared machine whose speed drifts over minutes, each mode's runs then meet the same
    drift (run one mode after another, a slow spell during one mode's runs moves the ratio)."""
    from tokenmill import LLM

    for batch in args.batch_sizes:
        llms = {}
        for mode in args.modes:
            print_load(f"tokenmill {mode}: batch {batch}, loading")
            llms[mode] = LLM(model, **{**_engine_kwargs(mode, args, model, base), "max_num_seqs": batch})
            _tokenmill_run(llms[mode], 1, "free", 9999, 8)   # warm-up
        for workload in args.workloads:
            reps: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
            for rep in range(args.repeats):
                for mode, llm in llms.items():
                    print_load(f"tokenmill {mode}: batch {batch}, {workload}, repeat {rep + 1}/{args.repeats}")
                    reps[mode].append(_tokenmill_run(llm, batch, workload, run_tag(workload, rep), args.max_tokens))
            for mode in args.modes:
                report["tokenmill"].setdefault(mode, {})[f"{workload}/{batch}"] = _summary(reps[mode])
            save()
        del llms
        gc.collect()


def _summary(reps: list[dict[str, Any]]) -> dict[str, Any]:
    def stat(key: str) -> dict[str, Any] | None:
        values = [r[key] for r in reps if r.get(key) is not None]   # (llama-server runs have no row_cost)
        return spread_stat(values) if values else None

    token_ids = [r.pop("token_ids") for r in reps]
    return {"output_tok_s": stat("output_tok_s"), "decode_tok_s": stat("decode_tok_s"),
            "output_tokens": stat("output_tokens"),
            "acceptance_rate": stat("acceptance_rate"), "mean_accepted_per_step": stat("mean_accepted_per_step"),
            "row_cost": stat("row_cost"), "proposal_cost": stat("proposal_cost"),
            "first_run_token_ids": token_ids[0], "runs": reps}


# ---- llama-server ------------------------------------------------------------------------------------

def llama_server_modes(args: argparse.Namespace, binary: str, model: str, slot_ctx: int, report: dict[str, Any],
                       log_dir: Path, save) -> None:
    modes = {"off": "", "ngram": f"{args.llama_spec} --spec-draft-n-max {args.num_speculative_tokens}"}
    for mode, extra in modes.items():
        results = report["llama_server"].setdefault("modes", {}).setdefault(mode, {})
        for batch in args.batch_sizes:
            log = log_dir / f"spec-llama-server-{mode}-np{batch}.log"
            print_load(f"llama-server {mode} -np {batch}: starting")
            process, base_url = bench_serve.start_llama_server(
                binary, model, batch, slot_ctx, f"-t {args.threads} -tb {args.threads} {extra}", log)
            try:
                bench_serve.wait_ready(base_url, process, bench_serve.SERVER_START_TIMEOUT_S)
                served = bench_serve.served_model(base_url, None)
                _llama_run(base_url, served, 1, "free", 9998, 8, args.timeout)
                for workload in args.workloads:
                    reps = []
                    for rep in range(args.repeats):
                        print_load(f"llama-server {mode}: batch {batch}, {workload}, repeat {rep + 1}/{args.repeats}")
                        reps.append(_llama_run(base_url, served, batch, workload, run_tag(workload, rep),
                                               args.max_tokens, args.timeout))
                    results[f"{workload}/{batch}"] = _summary(reps)
                    save()
            finally:
                bench_serve.stop_process(process)


def _llama_run(base_url: str, model: str, batch: int, workload: str, run: int, max_tokens: int,
               timeout: float) -> dict[str, Any]:
    bodies = [{"messages": m, "max_tokens": max_tokens, "temperature": 0.0, "seed": 0}
              for m in messages(workload, _requests_per_run(batch, workload), run)]
    load = load_average()
    responses, elapsed = asyncio.run(chat_requests(base_url, model, bodies, batch, timeout))
    failed = [r for r in responses if "error" in r or not r.get("choices")]
    if failed:
        raise TokenmillError(f"llama-server: {len(failed)} requests failed: {str(failed[0])[:300]}")
    tokens = sum((r.get("usage") or {}).get("completion_tokens", 0) for r in responses)
    drafted = sum((r.get("timings") or {}).get("draft_n", 0) for r in responses)
    accepted = sum((r.get("timings") or {}).get("draft_n_accepted", 0) for r in responses)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed, "requests": len(bodies),
            "decode_tok_s": decode_tok_s(responses) if batch == 1 else None,
            "draft_tokens": drafted, "accepted_tokens": accepted, "verify_steps": None,
            "acceptance_rate": accepted / drafted if drafted else None, "mean_accepted_per_step": None,
            "token_ids": [], "load_avg_before": load}


def decode_tok_s(responses: list[dict[str, Any]]) -> float | None:
    """llama-server's own decode rate over sequential requests: its `timings` (predicted_n tokens in
    predicted_ms after the prompt)."""
    timings = [r.get("timings") or {} for r in responses]
    ms = sum(t.get("predicted_ms", 0.0) for t in timings)
    return sum(t.get("predicted_n", 0) for t in timings) / ms * 1000 if ms else None


# ---- the command -------------------------------------------------------------------------------------

def run_spec_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.config import engine_args
    from tokenmill.hub import model_path

    for name in ("repeats", "max_tokens", "num_speculative_tokens", "threads"):
        if getattr(args, name) is None or getattr(args, name) < 1:
            raise TokenmillError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if any(b < 1 for b in args.batch_sizes):
        raise TokenmillError(f"--batch-sizes: must be >= 1, got {args.batch_sizes}")
    model = model_path(args.model)
    args.batch_sizes = sorted(set(args.batch_sizes))
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    bench_start = time.perf_counter()
    base = {**engine_args(args), "show_progress": False}
    base.pop("speculative_config", None)
    base.pop("quantization", None)
    server = peers.llama_server_for(args.llama_server, "llama-server" in args.peers, model)
    cfg = {"model": model, "threads": args.threads, "batch_sizes": args.batch_sizes, "repeats": args.repeats,
           "max_tokens": args.max_tokens, "num_speculative_tokens": args.num_speculative_tokens,
           "disable_by_batch_size": args.disable_by_batch_size, "prompt_lookup_min": args.prompt_lookup_min,
           "llama_spec": args.llama_spec, "modes": args.modes, "workloads": args.workloads,
           "engine_args": base, "cpu_count": os.cpu_count(), "llama_repack": peers.llama_repack(), "temperature": 0.0,
           "targets": {"ngram_grounded_batch1": TARGET_GROUNDED_B1, "ngram_free_batch1": TARGET_FREE_B1,
                       "batch32_not_slower": TARGET_B32}}
    report: dict[str, Any] = {"config": cfg, "tokenmill": {},
                              "llama_server": {"status": None if server is None else server.detail}}

    def save(partial: bool = True) -> None:
        out_path.write_text(json.dumps({**report, "partial": partial}, indent=2, default=str))

    save()
    tokenmill_modes(args, model, base, report, save)
    if server is not None and server.available:
        cfg["llama_server"] = {"binary": server.where, "args": f"-t {args.threads} -tb {args.threads}",
                               "ngram": f"{args.llama_spec} --spec-draft-n-max {args.num_speculative_tokens}"}
        report["llama_server"].update(peers.guarded("llama-server", llama_server_modes, args, server.where, model,
                                                    context_for(1024 + args.max_tokens), report, out_path.parent,
                                                    save) or {})
    cfg["wall_s"] = time.perf_counter() - bench_start
    report["table"] = build_table(report)
    print_report(report)
    save(partial=False)
    print(f"wrote {out_path}")
    return report


BASELINE = {"ngram": "off", "draft": "off-dense"}


def build_table(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (engine, mode, workload, batch): tok/s, speedup over its baseline, acceptance."""
    rows = []
    for engine, modes in (("tokenmill", report["tokenmill"]), ("llama-server", report["llama_server"].get("modes")
                                                                or {})):
        for mode, cells in modes.items():
            for key, cell in cells.items():
                base = modes.get(BASELINE.get(mode, ""), {}).get(key)
                rate = cell["output_tok_s"]["median"]
                decode = (cell.get("decode_tok_s") or {}).get("median")
                base_decode = ((base or {}).get("decode_tok_s") or {}).get("median")
                same = None if not base or engine != "tokenmill" else \
                    cell["first_run_token_ids"] == base["first_run_token_ids"]
                rows.append({"engine": engine, "mode": mode, "workload": key.split("/")[0], "same_tokens": same,
                             "batch": int(key.split("/")[1]), "tok_s": rate, "spread": cell["output_tok_s"]["spread"],
                             "speedup": rate / base["output_tok_s"]["median"] if base else None,
                             "decode_tok_s": decode,
                             "decode_speedup": decode / base_decode if decode and base_decode else None,
                             "acceptance_rate": (cell["acceptance_rate"] or {}).get("median"),
                             "mean_accepted_per_step": (cell["mean_accepted_per_step"] or {}).get("median")})
    return rows


def print_report(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(f"\nmodel: {cfg['model']}\nthreads: {cfg['threads']} for every engine (of {cfg['cpu_count']} cores); greedy, "
          f"max_tokens {cfg['max_tokens']}, k = {cfg['num_speculative_tokens']}; each cell the median of "
          f"{cfg['repeats']} repeats (spread: (max - min) / median); speedup: over off (ngram) or off-dense (draft)")
    print("tok/s: output tokens / wall time (prefill included); decode: batch 1, after each first token")
    peers.print_repack_note(cfg.get("llama_repack"))
    print(f"\n{'engine':<13}{'mode':<10}{'workload':<10}{'batch':>6}{'tok/s':>10}{'spread':>8}{'speedup':>9}"
          f"{'decode':>9}{'speedup':>9}{'accept':>8}{'acc/step':>9}")

    def fmt(x: float | None, f: str) -> str:
        return "-" if x is None else f.format(x)

    for r in sorted(report["table"], key=lambda r: (r["workload"], r["batch"], r["engine"], r["mode"])):
        print(f"{r['engine']:<13}{r['mode']:<10}{r['workload']:<10}{r['batch']:>6}{r['tok_s']:>10.1f}"
              f"{r['spread']:>8.0%}{fmt(r['speedup'], '{:.2f}x'):>9}{fmt(r['decode_tok_s'], '{:.1f}'):>9}"
              f"{fmt(r['decode_speedup'], '{:.2f}x'):>9}{fmt(r['acceptance_rate'], '{:.0%}'):>8}"
              f"{fmt(r['mean_accepted_per_step'], '{:.2f}'):>9}")
    differ = [r for r in report["table"] if r["same_tokens"] is False]
    for r in differ:
        print(f"note: tokenmill {r['mode']} {r['workload']} batch {r['batch']}: outputs differ from its baseline's")
    cells = {(r["engine"], r["mode"], r["workload"], r["batch"]): r for r in report["table"]}
    for label, key, target in [("ngram, grounded, batch 1", ("tokenmill", "ngram", "grounded", 1), TARGET_GROUNDED_B1),
                               ("ngram, free, batch 1", ("tokenmill", "ngram", "free", 1), TARGET_FREE_B1),
                               ("ngram, grounded, batch 32", ("tokenmill", "ngram", "grounded", 32), TARGET_B32),
                               ("ngram, free, batch 32", ("tokenmill", "ngram", "free", 32), TARGET_B32),
                               ("draft, grounded, batch 32", ("tokenmill", "draft", "grounded", 32), TARGET_B32)]:
        r = cells.get(key)
        speedup = None if r is None else r["decode_speedup"] if r["batch"] == 1 else r["speedup"]
        what = "decode" if key[3] == 1 else "throughput"
        if speedup is None:
            print(f"target {label} {what} >= {target:.2f}x: not measured")
            continue
        met = "met" if speedup >= target else "NOT met"
        print(f"target {label} {what} >= {target:.2f}x: {speedup:.2f}x, {met} (gap {speedup - target:+.2f})")
    ls = report["llama_server"]
    if ls.get("error"):
        print(f"llama-server: error: {ls['error']}")
    elif not ls.get("modes"):
        print(f"llama-server: not run ({ls['status'] or 'not asked for: --peers'})")
    loads = [run["load_avg_before"] for modes in (report["tokenmill"], ls.get("modes") or {})
             for cells in modes.values() for cell in cells.values() for run in cell["runs"]
             if run["load_avg_before"] is not None]
    if loads:
        print(f"system load average before the runs: {min(loads):.2f}-{max(loads):.2f}")
    print(f"whole bench {cfg['wall_s']:.0f} s")


def cmd_spec(args: argparse.Namespace) -> int:
    args.model = args.model_path or args.model
    report = run_spec_bench(args)
    return 1 if report["llama_server"].get("error") else 0
