"""`tokenmill bench startup [MODEL]`: cold start and one-shot memory, as a user meets them.

Each run is a fresh process, timed from its start to its first byte of output (the first token: the
CLI prints the prompt with it) and measured for its peak resident memory, on the same GGUF and
prompt, `--max-tokens` tokens, `--threads` threads:

- tokenmill: `tokenmill generate PROMPT` with the kernels compiled and the converted weights cached
  (a warm-up run first): a start as every start after the first;
- tokenmill, no weight cache: the same with `--no-weight-cache` (the checkpoint converted each time);
- tokenmill, first ever: the cache folder empty ($TOKENMILL_CACHE_DIR a new temporary folder): the C
  kernels compiled and the weights converted and cached in the run (once: it takes a while);
- llama.cpp: its Python API (llama-cpp-python, when installed: `scripts/install-peers.sh`) in a
  fresh interpreter, loading the GGUF with the same context length as tokenmill's (the model's) and
  streaming the same completion. Its Python start is part of its time, as tokenmill's is of
  tokenmill's; llama.cpp's C++ CLI would start without it.

Every run is launched from a small interpreter (procs.run_bare) so that its peak RSS is its own.
The targets (the issue's): tokenmill's start to first token <= 1.5 s, and its peak RSS <= 1.5x
llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.bench import batch1, output_file, peers
from tokenmill.bench.procs import load_average, print_load, run_bare, timed_command
from tokenmill.errors import TokenmillError

DEFAULT_PROMPT = "Once upon a time"
DEFAULT_REPEATS = 5
DEFAULT_MAX_TOKENS = 32
RUN_TIMEOUT_S = 900
TARGET_START_S = 1.5
TARGET_RSS_RATIO = 1.5

LLAMA_CPP_SCRIPT = """
import importlib.util
import sys
import llama_cpp
model, prompt, max_tokens, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if sys.argv[5] == "0":   # peers.llama_repack: batch1.py (standard library only) turns it off
    spec = importlib.util.spec_from_file_location("batch1", sys.argv[6])
    batch1 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(batch1)
    batch1.turn_off_repacking()
llm = llama_cpp.Llama(model_path=model, n_ctx=0, n_threads=threads, n_threads_batch=threads, verbose=False)
sys.stdout.write(prompt)
for chunk in llm(prompt, max_tokens=max_tokens, temperature=0.0, stream=True):
    sys.stdout.write(chunk["choices"][0]["text"])
    sys.stdout.flush()
"""


def add_startup_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="same as --model")
    b.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    b.add_argument("--prompt", default=DEFAULT_PROMPT)
    b.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    b.add_argument("--threads", type=int, default=2, help="threads of every engine")
    b.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    b.add_argument("--skip-first-ever", action="store_true",
                   help="skip the run with an empty cache folder (it compiles the kernels: minutes on 2 cores)")
    b.add_argument("--output", type=output_file, default="bench-results/startup.json")


def _tokenmill_command(model: str, args: argparse.Namespace, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "generate", args.prompt, "--log-level", "WARNING", "--model", model,
            "--max-tokens", str(args.max_tokens), "--temperature", "0", "--threads", str(args.threads), *extra]


def _run(label: str, command: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    print_load(label)
    load = load_average()
    row = run_bare(timed_command, {"command": command, "env": env or {}}, RUN_TIMEOUT_S)
    if row["returncode"] != 0 or row["first_output_s"] is None:
        raise TokenmillError(f"{label}: exited with {row['returncode']}: {row['stderr_tail']}")
    return {**row, "load_avg_before": load}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    starts = [r["first_output_s"] for r in runs]
    start = med("first_output_s")
    return {"first_output_s": start, "start_spread": (max(starts) - min(starts)) / start, "wall_s": med("wall_s"),
            "peak_rss_mib": med("child_peak_rss_mib"), "runs": runs}


def run_startup_bench(args: argparse.Namespace) -> dict[str, Any]:
    import importlib.util

    from tokenmill.hub import model_path

    for name in ("repeats", "max_tokens", "threads"):
        if getattr(args, name) < 1:
            raise TokenmillError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    model = model_path(args.model_path or args.model)
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    _run("tokenmill warm-up (compiles the kernels and caches the weights if they are not yet)",
         _tokenmill_command(model, args))
    cases = [("tokenmill", _tokenmill_command(model, args)),
             ("tokenmill, no weight cache", _tokenmill_command(model, args, "--no-weight-cache"))]
    has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    if has_llama_cpp:
        cases.append(("llama.cpp", [sys.executable, "-c", LLAMA_CPP_SCRIPT, model, args.prompt,
                                    str(args.max_tokens), str(args.threads), str(int(peers.llama_repack())),
                                    batch1.__file__]))
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in cases}
    for rep in range(args.repeats):   # interleaved: a slow spell of the machine hits every case
        for label, command in cases:
            runs[label].append(_run(f"{label}, repeat {rep + 1}/{args.repeats}", command))
    rows = {label: _summary(r) for label, r in runs.items()}
    if not args.skip_first_ever:
        with tempfile.TemporaryDirectory() as empty:
            rows["tokenmill, first ever"] = _summary([_run("tokenmill, first ever (empty cache folder)",
                                                           _tokenmill_command(model, args),
                                                           {"TOKENMILL_CACHE_DIR": empty})])
    report = {"config": {"model": model, "prompt": args.prompt, "max_tokens": args.max_tokens,
                         "threads": args.threads, "repeats": args.repeats, "cpu_count": os.cpu_count(),
                         "llama_repack": peers.llama_repack(),
                         "llama_cpp": "llama-cpp-python, n_ctx = the model's" if has_llama_cpp else None,
                         "targets": {"start_s": TARGET_START_S, "rss_ratio": TARGET_RSS_RATIO},
                         "wall_s": time.perf_counter() - started}, "rows": rows}
    print_report(report)
    out_path.write_text(json.dumps(report, indent=2))
    print(f"wrote {out_path}")
    return report


def print_report(report: dict[str, Any]) -> None:
    cfg, rows = report["config"], report["rows"]
    print(f"\nmodel: {cfg['model']}\none-shot generation of {cfg['max_tokens']} tokens, {cfg['threads']} threads; "
          f"each row the median of {cfg['repeats']} fresh processes (first ever: one)")
    if cfg.get("llama_cpp"):
        peers.print_repack_note(cfg.get("llama_repack"))
    print(f"\n{'':<28}{'to first token s':>17}{'spread':>8}{'to exit s':>11}{'peak RSS MiB':>14}")
    for label, r in rows.items():
        print(f"{label:<28}{r['first_output_s']:>17.2f}{r['start_spread']:>8.0%}{r['wall_s']:>11.2f}"
              f"{r['peak_rss_mib']:>14.0f}")
    start = rows["tokenmill"]["first_output_s"]
    print(f"target tokenmill start to first token <= {TARGET_START_S} s: {start:.2f} s, "
          f"{'met' if start <= TARGET_START_S else 'NOT met'}")
    peer = rows.get("llama.cpp")
    if peer is None:
        print(f"target peak RSS <= {TARGET_RSS_RATIO}x llama.cpp: not measured (llama-cpp-python not installed)")
    else:
        ratio = rows["tokenmill"]["peak_rss_mib"] / peer["peak_rss_mib"]
        print(f"target peak RSS <= {TARGET_RSS_RATIO}x llama.cpp: {ratio:.2f}x, "
              f"{'met' if ratio <= TARGET_RSS_RATIO else 'NOT met'}")
    print(f"whole bench {cfg['wall_s']:.0f} s")


def cmd_startup(args: argparse.Namespace) -> int:
    run_startup_bench(args)
    return 0
