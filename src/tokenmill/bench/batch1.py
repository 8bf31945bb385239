"""Batch 1, measured one way for every benchmark (`bench latency`, `bench compare`, `bench roofline`)
and every engine, and llama.cpp's batch-1 run.

- prefill tokens/s of a length n = n / the time to the first generated token (TTFT), the median
  over fresh prompts (one per repeat: no prefix cache can help);
- decode tokens/s = tokens after the first / the time between the first and the last, greedy,
  ignore_eos, the median over repeats.

Standard library only (this file is a leaf): llama.cpp's run goes through `procs.run_bare`, in a
process that must not import torch (whose ~200 MiB would count as llama.cpp's memory), and
importing anything of tokenmill would.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

# gen(ids, n): generate n tokens greedily from the prompt ids; returns (the start time, the time
# each generated token became available, the token ids)
Generate = Callable[[list[int], int], tuple[float, list[float], list[int]]]


def measure(gen: Generate, work: dict[str, Any]) -> dict[str, Any]:
    """Prefill and decode rates of `gen` on `work` (`workload.batch1_prompts` and `decode_tokens`),
    and the greedy tokens of the first decode prompt (to check that engines agree)."""
    for ids in work["warmup_prompts"]:
        gen(ids, 2)
    result: dict[str, Any] = {}
    for n, prompts in work["prefill_prompts"].items():
        ttfts = []
        for ids in prompts:
            start, times, _ = gen(ids, 1)
            ttfts.append(times[0] - start)
        result[f"prefill_{n}_tok_s"] = int(n) / statistics.median(ttfts)
        result[f"ttft_{n}_s"] = statistics.median(ttfts)
    rates = []
    for i, ids in enumerate(work["decode_prompts"]):
        _, times, tokens = gen(ids, work["decode_tokens"])
        if len(times) != work["decode_tokens"] or len(tokens) != work["decode_tokens"]:
            raise RuntimeError(f"asked for {work['decode_tokens']} tokens, got {len(tokens)}")
        rates.append((len(times) - 1) / (times[-1] - times[0]))
        if i == 0:
            result["greedy_tokens"] = [int(t) for t in tokens]
    result["decode_tok_s"] = statistics.median(rates)
    return result


def measure_long(gen: Generate, work: dict[str, Any]) -> dict[str, Any]:
    """Long context (`bench longctx`): for each length L of work["long_prompts"] ({L: a fresh prompt
    per repeat}), prefill tokens/s (L / TTFT) and the decode tokens/s of work["decode_tokens"] tokens
    after the first, the medians over repeats and their spreads ((max - min) / median)."""
    for ids in work["warmup_prompts"]:
        gen(ids, 2)
    rows: dict[str, Any] = {}
    for n, prompts in work["long_prompts"].items():
        ttfts, rates = [], []
        for ids in prompts:
            start, times, tokens = gen(ids, work["decode_tokens"] + 1)
            if len(tokens) != work["decode_tokens"] + 1:
                raise RuntimeError(f"asked for {work['decode_tokens'] + 1} tokens, got {len(tokens)}")
            ttfts.append(times[0] - start)
            rates.append((len(times) - 1) / (times[-1] - times[0]))
        rows[str(n)] = {"prefill_tok_s": int(n) / statistics.median(ttfts), "ttft_s": statistics.median(ttfts),
                        "prefill_spread": (max(ttfts) - min(ttfts)) / statistics.median(ttfts),
                        "decode_tok_s": statistics.median(rates),
                        "decode_spread": (max(rates) - min(rates)) / statistics.median(rates)}
    return rows


def turn_off_repacking() -> None:
    """Every llama_cpp.Llama made after this loads its model without weight repacking (peers.llama_repack).
    Llama() takes no argument for it: it starts from its C API's default model params, so those
    defaults get use_extra_bufts off."""
    import llama_cpp.llama_cpp as c_api

    defaults = c_api.llama_model_default_params

    def without_repacking():
        params = defaults()
        params.use_extra_bufts = False
        return params

    c_api.llama_model_default_params = without_repacking


def _llama_cpp_generator(cfg: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    """llama.cpp's `gen` through llama-cpp-python (`eval` + greedy argmax on its logits, `logits_all`
    off) on cfg's model, threads and context, with flash attention and the K/V cache type where cfg
    asks (`flash_attn`, `kv_type`: "f16" or "q8_0"; otherwise llama.cpp's defaults); and what describes
    the run."""
    import ctypes

    import llama_cpp
    import numpy as np

    options: dict[str, Any] = {}   # llama.cpp's defaults where cfg does not ask: no flash attention, f16 K/V
    if "flash_attn" in cfg:
        options["flash_attn"] = cfg["flash_attn"]
    if "kv_type" in cfg:
        kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[cfg["kv_type"]]
        options.update(type_k=kv_type, type_v=kv_type)
    if not cfg.get("repack", True):
        turn_off_repacking()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(cfg["model"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
                          n_threads_batch=cfg["threads"], logits_all=False, n_gpu_layers=0, verbose=False, **options)
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

    return gen, {"engine": "llama.cpp", "load_s": load_s, "version": llama_cpp.__version__,
                 "threads": cfg["threads"], "n_ctx": cfg["n_ctx"], "flash_attn": cfg.get("flash_attn", False),
                 "kv_type": cfg.get("kv_type", "f16"), "repack": cfg.get("repack", True)}


def llama_cpp(cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's batch-1 row (`measure`); run it with `procs.run_bare`."""
    gen, info = _llama_cpp_generator(cfg)
    return {**info, **measure(gen, cfg)}


def llama_cpp_long(cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's long-context rows (`measure_long`); run it with `procs.run_bare`."""
    gen, info = _llama_cpp_generator(cfg)
    return {**info, "contexts": measure_long(gen, cfg)}
