"""`tokenmill bench latency`: batch-1 load time, time to first token and decode speed.

Each engine runs in its own subprocess (so peak resident memory is its own), one after the other
on the same model file, prompts and dtype: tokenmill, then Hugging Face `transformers` (which
loads GGUF files with `gguf_file=`, dequantizing them). Prompts are the same token ids for both.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

from tokenmill.bench.compare import peak_rss_mib

_TEXT = ("The history of computing is a story of people who wanted to calculate faster than they could "
         "by hand. From the abacus to mechanical calculators, from punched cards to transistors, every "
         "generation built tools that made the previous one look slow. ")


def _prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(_TEXT * (1 + n // 20), add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"bench text too short for a {n}-token prompt")
    return ids[:n]


def load_hf_peer(model: str, dtype):
    """The same checkpoint in Hugging Face `transformers` (a GGUF file is loaded with `gguf_file=`,
    dequantized), in eval mode: the peer every benchmark compares against."""
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.is_file():
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return hf.eval()


def _run_tokenmill(cfg: dict[str, Any]) -> dict[str, Any]:
    from tokenmill import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(cfg["model"], dtype=cfg["dtype"], device=cfg["device"], quantization=cfg.get("quantization"))
    load_s = time.perf_counter() - t0
    result: dict[str, Any] = {"engine": "tokenmill", "load_s": load_s, "dtype": str(llm.engine.dtype)}

    def timed(ids: list[int], n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate([ids], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - start

    timed(_prompt_ids(llm.tokenizer, 16), 4)  # warm-up
    for n in cfg["prompt_lens"]:
        ids = _prompt_ids(llm.tokenizer, n)
        result[f"ttft_{n}_s"] = statistics.median(timed(ids, 1) for _ in range(cfg["repeats"]))
    ids = _prompt_ids(llm.tokenizer, 32)
    ttft = statistics.median(timed(ids, 1) for _ in range(cfg["repeats"]))
    total = statistics.median(timed(ids, cfg["decode_tokens"]) for _ in range(cfg["repeats"]))
    result["decode_tok_s"] = (cfg["decode_tokens"] - 1) / (total - ttft)
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def _run_transformers(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from tokenmill.tokenizer import load_tokenizer

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["resolved_dtype"]]
    t0 = time.perf_counter()
    model = load_hf_peer(cfg["model"], dtype)
    load_s = time.perf_counter() - t0
    tokenizer = load_tokenizer(cfg["model"])
    result: dict[str, Any] = {"engine": "transformers", "load_s": load_s, "dtype": str(dtype)}

    @torch.inference_mode()
    def timed(ids: list[int], n: int) -> float:
        inp = torch.tensor([ids])
        start = time.perf_counter()
        out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        assert out.shape[1] == len(ids) + n
        return time.perf_counter() - start

    timed(_prompt_ids(tokenizer, 16), 4)
    for n in cfg["prompt_lens"]:
        ids = _prompt_ids(tokenizer, n)
        result[f"ttft_{n}_s"] = statistics.median(timed(ids, 1) for _ in range(cfg["repeats"]))
    ids = _prompt_ids(tokenizer, 32)
    ttft = statistics.median(timed(ids, 1) for _ in range(cfg["repeats"]))
    total = statistics.median(timed(ids, cfg["decode_tokens"]) for _ in range(cfg["repeats"]))
    result["decode_tok_s"] = (cfg["decode_tokens"] - 1) / (total - ttft)
    result["peak_rss_mib"] = peak_rss_mib()
    return result


def _in_subprocess(fn, cfg: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, (cfg,))


def run_latency_bench(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.llm import default_model_path

    cfg = {"model": args.model or default_model_path(), "dtype": args.dtype, "device": args.device,
           "quantization": getattr(args, "quantization", None),
           "prompt_lens": args.prompt_lens, "decode_tokens": args.decode_tokens, "repeats": args.repeats}
    rows = [_in_subprocess(_run_tokenmill, cfg)]
    cfg["resolved_dtype"] = rows[0]["dtype"].removeprefix("torch.")
    if not args.no_peer:
        rows.append(_in_subprocess(_run_transformers, cfg))
    keys = ["load_s", *[f"ttft_{n}_s" for n in args.prompt_lens], "decode_tok_s", "peak_rss_mib"]
    print(f"model: {cfg['model']}  dtype: {cfg['resolved_dtype']}  threads: {os.cpu_count()}")
    print(f"{'metric':<16}" + "".join(f"{r['engine']:>14}" for r in rows) + ("      ratio" if len(rows) > 1 else ""))
    for k in keys:
        line = f"{k:<16}" + "".join(f"{r[k]:>14.3f}" for r in rows)
        if len(rows) > 1:
            ratio = rows[0][k] / rows[1][k] if k == "decode_tok_s" else rows[1][k] / rows[0][k]
            line += f"{ratio:>10.2f}x"
        print(line)
    if len(rows) > 1:
        print("ratio: how many times better tokenmill is (higher is better for tokenmill)")
    report = {"config": cfg, "results": rows}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report
