"""The `tokenmill` command: generate, chat, serve, worker (a tensor-parallel rank elsewhere), bench.

Every user error (bad path, bad parameter) is one line on stderr and exit status 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tokenmill.config import add_engine_args, engine_args
from tokenmill.errors import TokenmillError
from tokenmill.llm import LLM
from tokenmill.outputs import RequestOutput
from tokenmill.sampling import SamplingParams


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", "-t", type=float, default=None, help="0 = greedy (default: the model's "
                   "generation config, else 1.0)")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace, base: SamplingParams) -> SamplingParams:
    """The flags applied over `base` (the model's generation-config defaults, or plain defaults
    when checking the flags before the model is loaded)."""
    overrides = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
                 if getattr(args, k) is not None}
    return dataclasses.replace(base, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                               presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                               seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, **overrides)


def _load(args: argparse.Namespace) -> tuple[LLM, SamplingParams]:
    """Check the sampling flags (fast), load the model (slow), then resolve the sampling params."""
    _sampling_params(args, SamplingParams())
    print("loading model ...", file=sys.stderr, flush=True)
    llm = LLM(args.model, **engine_args(args), show_progress=True)
    return llm, _sampling_params(args, llm.get_default_sampling_params())


def _print_stream(outputs) -> RequestOutput | None:
    """Write each output's new text as it comes; the last output."""
    printed = ""
    last = None
    for out in outputs:
        text = out.outputs[0].text
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text
        last = out
    return last


def cmd_generate(args: argparse.Namespace) -> int:
    llm, params = _load(args)
    stream = llm.stream(args.prompt, params)
    first = next(stream)  # submits the request: a prompt the engine refuses fails before any output
    sys.stdout.write(args.prompt)
    last = _print_stream(itertools.chain([first], stream))
    sys.stdout.write("\n")
    if last.error is not None:   # (logged with its traceback too)
        print(f"tokenmill: error: the request failed: {last.error}", file=sys.stderr)
        return 1
    print(f"[finish_reason: {last.outputs[0].finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm, params = _load(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("chat with the model; Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        last = _print_stream(llm.stream(sampling_params=params, messages=messages))
        sys.stdout.write("\n")
        if last.error is not None:   # the turn is dropped from the history; the chat goes on
            print(f"tokenmill: error: the reply failed: {last.error}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": last.outputs[0].text})


def cmd_bench(args: argparse.Namespace) -> int:
    from tokenmill.bench.latency import run_latency_bench

    run_latency_bench(args)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.server.command import serve

    return serve(args, engine_args(args))


def cmd_worker(args: argparse.Namespace) -> int:
    from tokenmill.engine.worker_process import worker_main
    from tokenmill.engine.workers import Rendezvous
    from tokenmill.errors import EngineDeadError

    found = Rendezvous.from_env(os.environ)
    if found is None:
        raise TokenmillError("worker: set MASTER_ADDR and MASTER_PORT (where the engine, rank 0, listens), "
                             "WORLD_SIZE (its tensor_parallel_size) and RANK (this worker's, 1..WORLD_SIZE-1)")
    meet, rank = found
    if rank == 0:
        raise TokenmillError("worker: RANK=0 is the engine's own (`tokenmill serve` or LLM(...) with the same "
                             "variables); a worker is rank 1..WORLD_SIZE-1")
    print(f"tokenmill worker: rank {rank} of {meet.world_size}, joining {meet.host}:{meet.port}", file=sys.stderr)
    try:
        worker_main(rank, meet)
    except EngineDeadError as e:
        print(f"tokenmill worker: {e}", file=sys.stderr)
        return 1
    return 0


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(LOG_LEVELS)}")
    return text.upper()


def _log_level_flag(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", type=_log_level, default=default,
                        help="tokenmill's log level (" + " | ".join(LOG_LEVELS) + "; default INFO), before or "
                        "after the command")


def _command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand (`sub`: what add_subparsers returned) that also takes --log-level, so the flag
    may follow the command too (`tokenmill serve --log-level DEBUG`); SUPPRESS keeps the top-level
    value when it does not."""
    p = sub.add_parser(name, **kwargs)
    _log_level_flag(p, argparse.SUPPRESS)
    return p


def _model_bench(bench: Any, name: str, help: str,
                 add_args: Callable[[argparse.ArgumentParser], None],
                 func: Callable[[argparse.Namespace], int]) -> None:
    """A `tokenmill bench NAME [MODEL]` command: every engine flag, then the bench's own."""
    b = _command(bench, name, help=help)
    b.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="same as --model")
    add_engine_args(b)
    add_args(b)
    b.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="A readable LLM inference engine.")
    _log_level_flag(parser, "INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = _command(sub, "generate", help="complete a prompt, streaming to the terminal")
    p.add_argument("prompt")
    add_engine_args(p)
    _add_sampling_args(p, max_tokens=128)
    p.set_defaults(func=cmd_generate)

    p = _command(sub, "chat", help="interactive chat using the model's chat template (Ctrl-D to quit)")
    p.add_argument("--system", default=None, help="a system message")
    add_engine_args(p)
    _add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    from tokenmill.server.command import add_serve_args
    p = _command(sub, "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file, an HF folder or a Hugging Face id (default: the embedded "
                   "SmolLM2-135M-Instruct GGUF)")
    add_engine_args(p)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = _command(sub, "worker", help="a tensor-parallel rank on another machine: joins the engine at "
                 "MASTER_ADDR:MASTER_PORT as RANK of WORLD_SIZE (torchrun's variables); the model and every "
                 "setting come from the engine")
    p.set_defaults(func=cmd_worker)

    p = _command(sub, "bench", help="benchmarks (print a table, write JSON)")
    bench = p.add_subparsers(dest="bench", required=True)
    from tokenmill.bench import latency, output_file
    b = _command(bench, "latency", help="batch-1 load time, TTFT and decode speed vs transformers")
    add_engine_args(b)
    latency.add_batch1_args(b)
    b.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    b.add_argument("--output", type=output_file, default="bench-results/latency.json")
    b.set_defaults(func=cmd_bench)

    from tokenmill.bench import throughput
    b = _command(bench, "throughput", help="offline throughput on a mix of requests vs transformers, "
                         "with a leave-one-out table of engine features")
    add_engine_args(b)
    b.set_defaults(max_num_seqs=throughput.DEFAULT_MAX_NUM_SEQS)   # see throughput.py: sized for 2 CPU cores
    b.add_argument("--num-requests", type=int, default=throughput.DEFAULT_NUM_REQUESTS,
                   help=f"requests in the workload (the issue's size: {throughput.ISSUE_NUM_REQUESTS})")
    b.add_argument("--seed", type=int, default=0, help="seed of the request lengths and prompts")
    b.add_argument("--input-len-range", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    b.add_argument("--output-len-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    b.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    b.add_argument("--peer-num-requests", type=int, default=throughput.DEFAULT_PEER_NUM_REQUESTS,
                   help="run transformers on the first N requests only (its rates are per second, so comparable)")
    b.add_argument("--hf-batch-size", type=int, nargs="+", default=throughput.DEFAULT_HF_BATCH_SIZES,
                   help="transformers static batch sizes to try (e.g. 8 16 32); the best is reported")
    b.add_argument("--skip-ablations", action="store_true",
                   help="one tokenmill row, with the engine flags as given (no leave-one-out table)")
    b.add_argument("--output", type=output_file, default="bench-results/throughput.json")
    b.set_defaults(func=throughput.cmd_throughput)

    from tokenmill.bench import roofline
    _model_bench(bench, "roofline", "bytes and FLOPs per step, this machine's bandwidth and matmul peak, the "
                 "bound in tokens/s, and the measured tokens/s as a fraction of it",
                 roofline.add_roofline_args, roofline.cmd_roofline)

    from tokenmill.bench import quality
    b = _command(bench, "quality", help="perplexity and logit error of each quantization mode against the "
                         "dequantized reference, on a fixed text")
    quality.add_quality_args(b)
    b.set_defaults(func=quality.cmd_quality)

    from tokenmill.bench import serve as bench_serve
    b = _command(bench, "serve", help="streaming load on OpenAI-compatible servers (tokenmill, llama-server, "
                         "any --base-url): throughput and TTFT / ITL / end-to-end latency percentiles")
    add_engine_args(b)
    bench_serve.add_bench_serve_args(b)
    b.set_defaults(func=bench_serve.cmd_bench_serve)

    from tokenmill.bench import compare
    b = _command(bench, "compare", help="tokenmill vs llama.cpp (llama_cpp, llama-server) and transformers on the "
                         "same GGUF, 2 threads each: prefill, decode, concurrent throughput, memory, one table")
    add_engine_args(b)
    compare.add_compare_args(b)
    b.set_defaults(func=compare.cmd_compare)

    from tokenmill.bench import structured
    _model_bench(bench, "structured", "JSON-schema constrained decoding: output tok/s vs the same tokens "
                 "unconstrained, jump-forward savings, schema compile time, outputs valid; vs llama-server",
                 structured.add_structured_args, structured.cmd_structured)

    from tokenmill.bench import monitor
    _model_bench(bench, "monitor", "the live view's cost: output tok/s with its feed unwatched, watched, and "
                 "removed (bare), and the feed's time as a fraction of step time",
                 monitor.add_monitor_args, monitor.cmd_monitor)

    from tokenmill.bench import startup
    b = _command(bench, "startup", help="cold start (process start to first token) and peak RSS of a one-shot "
                 "`tokenmill generate`, warm, without the weight cache and first ever; vs llama.cpp")
    startup.add_startup_args(b)
    b.set_defaults(func=startup.cmd_startup)

    from tokenmill.bench import longctx
    _model_bench(bench, "longctx", "long context at batch 1: prefill and decode tok/s at 2k-16k tokens vs "
                 "llama.cpp with flash attention and the same K/V type, and decode against the roofline",
                 longctx.add_longctx_args, longctx.cmd_longctx)

    from tokenmill.bench import scaling
    _model_bench(bench, "scaling", "decode step time and tok/s against the roofline bound as the batch (1-128) and "
                 "the context (128-16k) grow: a table, JSON and PNG plots",
                 scaling.add_scaling_args, scaling.cmd_scaling)

    from tokenmill.bench import parallel
    _model_bench(bench, "parallel", "tensor parallelism on this machine: decode step time of TP=1 on 1 and 2 "
                 "threads and TP=2 on 1 thread per rank, and TP=2's communication as a share of its step",
                 parallel.add_parallel_args, parallel.cmd_parallel)

    from tokenmill.bench import replicas
    _model_bench(bench, "replicas", "engine replicas behind one server: data parallelism (DP=1 vs DP=2 throughput on "
                 "the same cores, prefix-cache routing) and prefill/decode disaggregation (decode latency through a "
                 "burst of long prompts, vs colocated)", replicas.add_replicas_args, replicas.cmd_replicas)

    from tokenmill.bench import spec
    _model_bench(bench, "spec", "speculative decoding: output tok/s off / ngram / draft model on an "
                 "input-grounded and a free workload at batch 1, 8, 32, acceptance rates; vs llama-server's lookup",
                 spec.add_spec_args, spec.cmd_spec)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tokenmill").setLevel(args.log_level)
    try:
        return args.func(args)
    except TokenmillError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
