"""`tokenmill bench quality [MODEL]`: what quantized execution costs in quality.

Every quantization mode loads the same model; all of them score the same fixed text
(`quality_text.txt`: the Gettysburg Address and the opening of the Declaration of Independence,
public domain, then prose written for tokenmill and dedicated to the public domain) in lockstep,
window by window, `--chunk-size` rows per step (each row's result depends on that row alone, so the
chunk size changes speed, not scores). Reported per mode: perplexity of the text, and
against the dequantized reference ("none"): max and mean |logit difference| over every position
and vocabulary entry, mean KL(reference || mode), and how often the top-1 token agrees.

Mode "llama.cpp" scores the same token ids of the same GGUF through llama-cpp-python (a bench-only
peer): the quality a llama.cpp user gets, on the same scale, so that "as good as llama.cpp" is a
measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from tokenmill import hub
from tokenmill.bench import batch1, output_file, peers, positive_int
from tokenmill.checkpoint import open_checkpoint
from tokenmill.engine.kv_cache import kv_layout
from tokenmill.errors import TokenmillError
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.models.loader import checkpoint_config, weight_forms

LLAMA_CPP = "llama.cpp"
MODES = ("none", "auto", "int8", "int4", "bf16", "auto-kv-f32", "auto-kv-int8", "auto-act-int8",
         "auto-kv-f32-act-int8", LLAMA_CPP)
# auto: quantization=None (GGUF types kept quantized; on CPU with a bfloat16 KV cache); bf16: dense
# bfloat16 (the error of plain bf16 inference); auto-kv-f32 / auto-kv-int8: auto with kv_cache_dtype
# "float32" / "int8" (the cache's own cost, next to auto's bfloat16 one); auto-act-int8: auto with
# activation_precision "int8" (and -kv-f32: with a float32 cache, its cost alone); llama.cpp: LlamaCppScorer
AUTO_MODES = {"auto-kv-f32": {"kv_cache_dtype": "float32"}, "auto-kv-int8": {"kv_cache_dtype": "int8"},
              "auto-act-int8": {"activation_precision": "int8"},
              "auto-kv-f32-act-int8": {"kv_cache_dtype": "float32", "activation_precision": "int8"}}
TEXT_PATH = Path(__file__).with_name("quality_text.txt")


def _weight_mib(model: torch.nn.Module) -> float:
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values()) / 2**20


class Scorer:
    """One loaded model that returns float32 logits for consecutive chunks of one sequence.

    The LLM needs `ceil(context / block_size)` KV blocks per KV cache group; the scorer uses them
    directly: group g's sequence in blocks g n, g n + 1, ... (n blocks each), so slot == g n
    block_size + position."""

    def __init__(self, llm: Any, load_s: float = 0.0):
        self.llm = llm
        self.load_s = load_s
        self.model = llm.engine.model
        self.device = llm.engine.device
        self.block_size = llm.engine.config.block_size
        self.groups = len(llm.engine.layout.windows)
        self.num_blocks = llm.engine.pool.num_blocks // self.groups   # per group

    @classmethod
    def load(cls, model_path: str, mode: str, context: int, dtype: str = "float32", block_size: int = 16) -> Scorer:
        from tokenmill import LLM

        start = time.perf_counter()
        settings = AUTO_MODES.get(mode, {})
        if mode == "bf16":  # dense bf16, for scale: the error of plain bf16 inference
            mode, dtype = "none", "bfloat16"
        elif settings:
            mode = "auto"
        groups = len(kv_layout(checkpoint_config(open_checkpoint(hub.model_path(model_path)))[1]).windows)
        llm = LLM(model_path, dtype=dtype, quantization=None if mode == "auto" else mode,
                  num_kv_blocks=groups * -(-context // block_size), block_size=block_size, max_num_seqs=1, **settings)
        return cls(llm, time.perf_counter() - start)

    @torch.inference_mode()
    def logits(self, ids: list[int], start: int) -> torch.Tensor:
        """Logits of rows `start .. start + len(ids) - 1` of the sequence whose earlier rows were
        fed by the previous calls (blocks 0, 1, ... of the pool, so slot == position)."""
        if start + len(ids) > self.num_blocks * self.block_size:
            raise ValueError(f"position {start + len(ids)} is past the scorer's {self.num_blocks} KV blocks")
        n, end = len(ids), start + len(ids)
        metas = [AttentionMetadata(
            query_start_loc=[0, n], seq_lens=[end],
            block_tables=torch.arange(g * self.num_blocks, (g + 1) * self.num_blocks, device=self.device)[None],
            slot_mapping=torch.arange(start, end, device=self.device) + g * self.num_blocks * self.block_size,
            seq_lens_tensor=torch.tensor([end], device=self.device), block_size=self.block_size)
            for g in range(self.groups)]
        meta = metas[0]
        meta.other_groups = tuple(metas[1:])
        hidden = self.model(torch.tensor(ids, device=self.device), torch.arange(start, end, device=self.device), meta)
        return self.model.compute_logits(hidden).float().cpu()

    def describe(self) -> dict[str, Any]:
        return {"weight_forms": weight_forms(self.model), "weights_mib": _weight_mib(self.model)}


class LlamaCppScorer:
    """llama.cpp scoring a GGUF: `logits` as Scorer's, from llama-cpp-python's `eval` with logits_all,
    at llama.cpp's defaults (f16 K/V cache, no flash attention; weights repacked as in the other
    benches, peers.llama_repack) on torch's thread count."""

    def __init__(self, model_path: str, context: int):
        status = peers.llama_cpp_python_status()
        if not status.available:
            raise TokenmillError(f"bench quality --modes {LLAMA_CPP}: llama-cpp-python is {status.detail}")
        if not model_path.endswith(".gguf"):
            raise TokenmillError(f"bench quality --modes {LLAMA_CPP}: llama.cpp reads GGUF files, not {model_path}")
        import llama_cpp

        if not peers.llama_repack():
            batch1.turn_off_repacking()
        start = time.perf_counter()
        threads = torch.get_num_threads()
        self.llm = llama_cpp.Llama(model_path, n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                   logits_all=True, n_gpu_layers=0, verbose=False)
        self.load_s = time.perf_counter() - start
        self.path = model_path

    def logits(self, ids: list[int], start: int) -> torch.Tensor:
        if start == 0:
            self.llm.reset()   # a new window: eval() then drops every cached position
        elif start != self.llm.n_tokens:
            raise ValueError(f"llama.cpp holds {self.llm.n_tokens} positions, asked to continue at {start}")
        self.llm.eval(ids)
        return torch.from_numpy(self.llm.scores[start:start + len(ids)].copy()).float()

    def describe(self) -> dict[str, Any]:
        """The GGUF's tensor types (llama.cpp runs each as stored) and the file's size."""
        ckpt = open_checkpoint(self.path)
        types = Counter(ckpt.tensor_type(name) for name in ckpt.tensor_names())
        return {"weight_forms": {f"{LLAMA_CPP} {t}": n for t, n in sorted(types.items())},
                "weights_mib": Path(self.path).stat().st_size / 2**20}


def run_quality(model_path: str, modes: list[str], dtype: str = "float32", context: int = 1024,
                chunk_size: int = 32, text: str | None = None) -> dict[str, Any]:
    """Score `text` (default: the bundled text) under each mode; "none" is added as the reference."""
    modes = ["none"] + [m for m in modes if m != "none"]
    scorers: dict[str, Scorer | LlamaCppScorer] = {
        m: LlamaCppScorer(model_path, context) if m == LLAMA_CPP else Scorer.load(model_path, m, context, dtype)
        for m in modes}
    return compare_scorers(scorers, text if text is not None else TEXT_PATH.read_text(encoding="utf-8"),
                           context, chunk_size) | {"model": model_path}


def compare_scorers(scorers: dict[str, Scorer | LlamaCppScorer], text: str, context: int,
                    chunk_size: int) -> dict[str, Any]:
    """The metrics of each scorer against `scorers["none"]` on `text`."""
    ref = scorers["none"]
    modes = list(scorers)
    context = min(context, ref.llm.engine.max_model_len)
    ids = ref.llm.tokenizer.encode(text, add_special_tokens=False)
    stats = {m: {"nll": 0.0, "max_abs": 0.0, "sum_abs": 0.0, "kl": 0.0, "top1": 0} for m in modes}
    predicted = 0
    for w0 in range(0, len(ids) - 1, context):
        # a window starts with an empty cache and predicts window[1:]: every token after the first once
        window = ids[w0:w0 + context + 1]
        for c0 in range(0, len(window) - 1, chunk_size):
            chunk = window[c0:min(c0 + chunk_size, len(window) - 1)]
            targets = torch.tensor(window[c0 + 1:c0 + 1 + len(chunk)])
            ref_logits = ref.logits(chunk, c0)
            ref_lp = torch.log_softmax(ref_logits, -1)
            for m, scorer in scorers.items():
                logits = ref_logits if m == "none" else scorer.logits(chunk, c0)
                if logits.shape != ref_logits.shape:
                    raise TokenmillError(f"bench quality: mode {m} gives logits of shape {tuple(logits.shape)}, the "
                                         f"reference {tuple(ref_logits.shape)}")
                lp = torch.log_softmax(logits, -1)
                s = stats[m]
                s["nll"] -= lp.gather(1, targets[:, None]).sum().item()
                diff = (logits - ref_logits).abs()
                s["max_abs"] = max(s["max_abs"], diff.max().item())
                s["sum_abs"] += diff.mean(-1).sum().item()
                s["kl"] += (ref_lp.exp() * (ref_lp - lp)).sum().item()
                s["top1"] += (logits.argmax(-1) == ref_logits.argmax(-1)).sum().item()
            predicted += len(chunk)
    rows = []
    for m, scorer in scorers.items():
        s = stats[m]
        rows.append({
            "mode": m, **scorer.describe(), "load_s": scorer.load_s, "perplexity": math.exp(s["nll"] / predicted),
            "max_abs_logit_err": s["max_abs"], "mean_abs_logit_err": s["sum_abs"] / predicted,
            "mean_kl": s["kl"] / predicted, "top1_agreement": s["top1"] / predicted,
        })
    return {"dtype": str(ref.llm.engine.dtype), "tokens": len(ids), "predicted": predicted,
            "context": context, "chunk_size": chunk_size, "results": rows}


def print_quality(report: dict[str, Any]) -> None:
    print(f"model: {report['model']}  dtype: {report['dtype'].removeprefix('torch.')}  text: {report['tokens']} "
          f"tokens, windows of {report['context']}, {report['chunk_size']} rows per step")
    width = max(6, *(len(r["mode"]) + 1 for r in report["results"]))
    print(f"{'mode':<{width}}{'weights MiB':>12}{'load s':>8}{'perplexity':>20}{'max|dlogit|':>13}{'mean|dlogit|':>14}"
          f"{'mean KL':>10}{'top-1 agree':>13}  weight forms (layers)")
    ref = report["results"][0]["perplexity"]
    for r in report["results"]:
        change = "" if r["mode"] == "none" else f" ({100 * (r['perplexity'] / ref - 1):+.2f}%)"
        ppl = f"{r['perplexity']:.3f}{change}"
        forms = ", ".join(f"{k} {v}" for k, v in r["weight_forms"].items())
        print(f"{r['mode']:<{width}}{r['weights_mib']:>12.1f}{r['load_s']:>8.2f}{ppl:>20}{r['max_abs_logit_err']:>13.4f}"
              f"{r['mean_abs_logit_err']:>14.5f}{r['mean_kl']:>10.2e}{100 * r['top1_agreement']:>12.2f}%  {forms}")
    print("errors are against the dequantized reference (mode none); auto keeps GGUF quantized types quantized "
          "(with a bfloat16 KV cache on CPU); auto-kv-f32 / auto-kv-int8 are auto with a float32 / int8 KV cache; "
          "auto-act-int8 is auto with activation_precision int8 (-kv-f32: and a float32 cache); "
          "bf16 is the dense model in bfloat16; llama.cpp is llama.cpp on the same file (f16 K/V cache)")


def add_quality_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                   help="a .gguf file or an HF folder (default: the embedded model)")
    p.add_argument("--dtype", default="float32",
                   help="compute dtype of the reference and the modes: float32 (default: the exact dequantized "
                   "reference on every machine) | bfloat16 | auto")
    p.add_argument("--modes", nargs="+", default=["none", "auto", "int8", "int4"], choices=MODES,
                   help="quantization modes to compare (auto = GGUF types kept quantized, with a bfloat16 KV "
                   "cache on CPU; auto-kv-f32 / auto-kv-int8 = auto with a float32 / int8 KV cache; auto-act-int8 "
                   "(-kv-f32) = auto with activation_precision int8 (and a float32 cache); bf16 = dense "
                   "bfloat16, for scale); none "
                   "(dense, --dtype) is the reference")
    p.add_argument("--context", type=positive_int, default=1024, help="tokens per window of the text")
    p.add_argument("--chunk-size", type=positive_int, default=32,
                   help="rows per step")
    p.add_argument("--output", type=output_file, default="bench-results/quality.json")


def cmd_quality(args: argparse.Namespace) -> int:
    from tokenmill.hub import model_path

    report = run_quality(model_path(args.model_path), args.modes, args.dtype, args.context,
                         args.chunk_size)
    print_quality(report)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0
