"""`tokenmill bench latency`: batch 1 (load time, time to first token, prefill and decode rates)
of tokenmill and of Hugging Face `transformers` on the same model, prompts and threads.

This is the batch-1 half of `bench compare` with its two torch engines, on any model tokenmill
loads (compare also runs llama.cpp, which needs a GGUF file): the same settings, workload
(`workload.batch1_prompts`), measuring loop (`batch1.measure`) and rows. Each engine runs in a
spawned process of its own (`procs.run_spawned`), so its peak resident memory is its own.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from tokenmill.bench import batch1, peers
from tokenmill.bench.procs import print_load, run_spawned
from tokenmill.bench.workload import batch1_prompts, context_for, pad_token_id
from tokenmill.config import engine_args
from tokenmill.errors import TokenmillError

DEFAULT_PREFILL_LENS = [128, 512]
DEFAULT_DECODE_TOKENS = 128
DEFAULT_DECODE_PROMPT_LEN = 32
DEFAULT_REPEATS = 3


def add_batch1_args(p: argparse.ArgumentParser) -> None:
    """The batch-1 workload flags of `bench latency` and `bench compare`."""
    g = p.add_argument_group("batch 1")
    g.add_argument("--prefill-lens", "--prompt-lens", type=int, nargs="+", default=DEFAULT_PREFILL_LENS,
                   help="prompt lengths of the prefill / time-to-first-token rows")
    g.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE_TOKENS,
                   help=f"tokens generated from a {DEFAULT_DECODE_PROMPT_LEN}-token prompt for the decode row")
    g.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="batch-1 repeats (the median is reported)")


def check_batch1_args(args: argparse.Namespace) -> None:
    if args.decode_tokens < 2:   # the decode rate is measured between the first token and the last
        raise TokenmillError(f"--decode-tokens: must be >= 2, got {args.decode_tokens}")
    if args.repeats < 1:
        raise TokenmillError(f"--repeats: must be >= 1, got {args.repeats}")
    if any(n < 1 for n in args.prefill_lens):
        raise TokenmillError(f"--prefill-lens: must be >= 1, got {args.prefill_lens}")


def batch1_config(args: argparse.Namespace, model: str, tokenizer: Any, seed: int = 0) -> dict[str, Any]:
    """What every engine's batch-1 run gets: the model, the prompts, the threads, the context
    (llama.cpp's n_ctx) and tokenmill's keyword arguments (every engine flag of the command)."""
    n_ctx = context_for(max(*args.prefill_lens, DEFAULT_DECODE_PROMPT_LEN + args.decode_tokens))
    tokenmill_args = {**engine_args(args), "show_progress": False}
    if tokenmill_args["num_kv_blocks"] is None and tokenmill_args["kv_cache_memory"] is None:
        # the KV capacity of llama.cpp's context (the default pool, up to 4 GiB, would count in the RSS)
        tokenmill_args["num_kv_blocks"] = n_ctx // args.block_size + 1
    return {"model": model, "threads": args.threads, "engine_args": tokenmill_args, "n_ctx": n_ctx,
            "repack": peers.llama_repack(),
            "decode_tokens": args.decode_tokens, "pad_token_id": pad_token_id(tokenizer),
            **batch1_prompts(tokenizer, args.prefill_lens, DEFAULT_DECODE_PROMPT_LEN, args.repeats, seed)}


# ---- the engines --------------------------------------------------------------------------------

def stream_gen(llm: Any) -> batch1.Generate:
    """`batch1.measure`'s gen for a tokenmill LLM: greedy through `LLM.stream`, each token's time
    when its output arrives."""
    from tokenmill import SamplingParams

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

    return gen


def tokenmill_row(cfg: dict[str, Any]) -> dict[str, Any]:
    """tokenmill's batch-1 row (run it in a fresh process: `procs.run_spawned`)."""
    import torch

    from tokenmill import LLM
    from tokenmill.config import cpu_has_fast_bf16, resolve_dtype

    t0 = time.perf_counter()
    llm = LLM(cfg["model"], **cfg["engine_args"])
    load_s = time.perf_counter() - t0
    result = batch1.measure(stream_gen(llm), cfg)
    # transformers runs dense weights: the dtype these settings give a dense model, not tokenmill's
    # float32 for its quantized kernels; with auto, float32 on a CPU without bf16 units (transformers'
    # best there: PyTorch emulates bf16 matmuls, which tokenmill's dense path avoids)
    dense = resolve_dtype(llm.engine.config.dtype, llm.engine.device)
    if llm.engine.config.dtype in (None, "auto") and llm.engine.device.type == "cpu" and not cpu_has_fast_bf16():
        dense = torch.float32
    return {"engine": "tokenmill", "load_s": load_s, "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "dense_dtype": str(dense).removeprefix("torch."), "threads": torch.get_num_threads(), **result}


def load_hf_peer(model: str, dtype: Any) -> Any:
    """The same checkpoint in Hugging Face `transformers` (a GGUF file is loaded with `gguf_file=`,
    dequantized), in eval mode: the peer every benchmark compares against."""
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.is_file():
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return hf.eval()


def transformers_row(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers' batch-1 row in cfg["dtype"] (`generate`, token times from a streamer; run it in
    a fresh process: `procs.run_spawned`)."""
    import torch

    if cfg["threads"] is not None:
        torch.set_num_threads(cfg["threads"])
    import transformers
    from transformers.generation.streamers import BaseStreamer

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

    return {"engine": "transformers", "load_s": load_s, "dtype": cfg["dtype"], "threads": torch.get_num_threads(),
            **batch1.measure(gen, cfg)}


# ---- the command --------------------------------------------------------------------------------

def run_latency_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.hub import model_path
    from tokenmill.tokenizer import load_tokenizer

    check_batch1_args(args)
    model = model_path(args.model)
    b1 = batch1_config(args, model, load_tokenizer(model_path(args.tokenizer) if args.tokenizer else model))
    print_load("tokenmill batch 1")
    rows = [run_spawned(tokenmill_row, b1)]
    dtype = rows[0]["dense_dtype"]
    if not args.no_peer:
        print_load(f"transformers batch 1 ({dtype})")
        rows.append(run_spawned(transformers_row, {**b1, "dtype": dtype}))

    keys = ["load_s", *[f"ttft_{n}_s" for n in args.prefill_lens], "decode_tok_s", "peak_rss_mib"]
    print(f"\nmodel: {model}  dtype: {rows[0]['dtype']}  threads: {rows[0]['threads']}  batch 1: median of "
          f"{args.repeats}, decode = {args.decode_tokens} tokens after a {DEFAULT_DECODE_PROMPT_LEN}-token prompt")
    print(f"{'metric':<16}" + "".join(f"{r['engine']:>14}" for r in rows) + ("      ratio" if len(rows) > 1 else ""))
    for k in keys:
        line = f"{k:<16}" + "".join(f"{r[k]:>14.3f}" for r in rows)
        if len(rows) > 1:
            ratio = rows[0][k] / rows[1][k] if k == "decode_tok_s" else rows[1][k] / rows[0][k]
            line += f"{ratio:>10.2f}x"
        print(line)
    if len(rows) > 1:
        print("ratio: how many times better tokenmill is (higher is better for tokenmill)")
    cfg = {"model": model, "engine_args": b1["engine_args"], "prefill_lens": args.prefill_lens,
           "decode_tokens": args.decode_tokens, "decode_prompt_len": DEFAULT_DECODE_PROMPT_LEN,
           "repeats": args.repeats, "n_ctx": b1["n_ctx"]}
    report = {"config": cfg, "results": rows}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report
