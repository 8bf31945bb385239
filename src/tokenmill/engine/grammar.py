"""Grammar-constrained decoding on llguidance: constraints compiled once (cached by content), one
matcher per request, and the allowed-token bitmasks of a step's requests filled in one call.

Why llguidance (measured against xgrammar in docs/ARCHITECTURE.md): no dependencies (xgrammar
needs torch, transformers and triton), masks in tens of microseconds on a CPU, and JSON schema,
regex, Lark and GBNF grammars from one library (llama.cpp and vLLM use it too).

The engine keeps a request's matcher in step with its output: each appended token is consumed,
then the mask for the next token is filled (for every constrained request of the step at once).
A mask that allows exactly one token means that token is certain whatever the model's logits say,
so the engine appends it without sampling (jump-forward; see `GrammarMatcher.forced_token`). A
preempted request keeps its output tokens, so its matcher stays valid: nothing is rebuilt.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import llguidance
import numpy as np
import torch

from tokenmill.errors import SamplingParamsError
from tokenmill.sampling.structured import StructuredOutputsParams
from tokenmill.tokenizer import Tokenizer

CACHE_SIZE = 256
"""Compiled constraints kept (least recently used dropped first)."""

MAX_ERROR_CHARS = 400

# JSON whitespace between tokens, as llama.cpp's JSON-schema grammars allow it: one space, or one or
# two newlines and an indent of at most 20 spaces or tabs. Pretty-printed JSON fits; a small model
# cannot fill its output with blank lines (llguidance's default allows any amount of whitespace).
_JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"(\x20|\n{1,2}[\x20\t]{0,20})?"}
_COMPACT_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

# Bounds on the work one grammar may cost, at compile time and per token: llguidance's defaults,
# but a fifth of its initial lexer fuel, which bounds the lexer built at the first mask (a regex
# such as a{1000000} otherwise costs half a second there, and tens of milliseconds per later
# mask). A grammar that exceeds them fails with an error naming the limit: at compile time a 400,
# later that request alone.
_LIMITS = dict(initial_lexer_fuel=200_000, step_lexer_fuel=200_000, max_lexer_states=100_000,
               max_grammar_size=200_000, verbose_errors=False)


COMPLETE = -1
"""`GrammarMatcher.forced_token()` when the output is complete: only end-of-sequence tokens may
follow, so the request ends there (with no EOS token: which of the model's EOS tokens it would have
sampled is unknown without a model step, and none of them is part of the text)."""


class GrammarMatcher:
    """One request's position in its grammar, and the mask of the tokens that may come next.

    The grammar failing mid-output (llguidance's limits on the lexer and the parser, checked as
    they grow, are met by some constraints only after their first token) is a SamplingParamsError
    naming the constraint's field: the request's own input failed, and it ends that request alone."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_mask: np.ndarray, field: str):
        self._matcher = matcher
        self.field = field
        """The constraint's field (structured_outputs.FORM), which the errors name."""
        self._not_eos = ~eos_mask.view(np.uint32)
        self.mask = np.zeros(len(eos_mask), dtype=np.int32)
        """Bit t (word t // 32, bit t % 32) set: token t may come next. Valid after a fill."""

    def accept(self, token_id: int) -> None:
        """Advance past `token_id`. It was sampled under the mask, so a refusal means the grammar
        engine failed here (past a limit), and it ends that request alone."""
        if not self._matcher.consume_token(token_id):
            raise self.failure(f"rejected token {token_id}: {self._matcher.get_error()[:MAX_ERROR_CHARS]}")

    @property
    def failed(self) -> bool:
        """Whether the grammar engine stopped on this request's constraint (past one of its limits)."""
        return self._matcher.is_error()

    def failure(self, what: str) -> SamplingParamsError:
        return SamplingParamsError(self.field, f"failed during generation (the grammar engine {what})")

    def draft_masks(self, drafts: list[int]) -> tuple[list[int], list[np.ndarray]]:
        """For speculative decoding: the longest prefix of `drafts` the grammar allows from here, and
        the masks of the rows that verify it (the current mask, then the mask after each allowed
        draft token). The matcher is left where it was."""
        allowed = drafts[:self._matcher.validate_tokens(drafts)]
        masks = [self.mask.copy()]
        for token_id in allowed:
            self._matcher.consume_token(token_id)
            masks.append(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.int32).copy())
        if allowed:
            self._matcher.rollback(len(allowed))
        return allowed, masks

    def forced_token(self) -> int | None:
        """The one token the current mask allows, COMPLETE when it allows only EOS tokens, None
        when it allows several. A mask that allows none (the grammar failed) is an error."""
        bits = self.mask.view(np.uint32)
        if not (bits & self._not_eos).any():
            if not bits.any():
                raise self.failure(f"allows no token here: "
                                   f"{self._matcher.get_error()[:MAX_ERROR_CHARS] or 'no error given'}")
            return COMPLETE
        if np.bitwise_count(bits).sum() != 1:
            return None
        word = int(np.flatnonzero(bits)[0])
        return word * 32 + int(bits[word]).bit_length() - 1


class CompiledGrammar(NamedTuple):
    matcher: llguidance.LLMatcher   # at the start of the output; never advanced (requests get copies)
    first_mask: np.ndarray          # its mask, int32 words as GrammarMatcher.mask


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and fills masks. Thread-safe: the server
    compiles in a worker thread (so that a bad grammar is a 400 before anything runs) while the
    engine thread makes matchers from the cached result."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        # llguidance's vocabulary: the model's, or the tokenizer's where that is larger (masks
        # cover it; the sampler reads the model's part)
        self._n_vocab = max(vocab_size, tokenizer.vocab_size)
        self.mask_words = -(-self._n_vocab // 32)
        self._eos_mask = np.zeros(self.mask_words, dtype=np.uint32)
        for token_id in self._eos:
            if token_id < self._n_vocab:
                self._eos_mask[token_id // 32] |= np.uint32(1 << (token_id % 32))

    def llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (a fraction of a second for a
        large vocabulary, seconds for Gemma's 262k), under the lock."""
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend_json(), n_vocab=self._n_vocab,
                                                        eos_token=self._eos or None)
            # Masks are filled between model steps, when the model's threads are idle: use as many
            # (llguidance's default, 80% of the cores, is one thread on a 2-core machine).
            self._executor = llguidance.LLExecutor(num_threads=torch.get_num_threads())
        return self._ll_tokenizer

    def special_token_ids(self, texts: tuple[str, ...]) -> dict[str, int]:
        """{text: id} for each of `texts` that is one special token of the vocabulary (as llguidance
        sees it), so a grammar can ask for the token itself (`<[id]>`; see tool_calls.py)."""
        with self._lock:
            tokenizer = self.llguidance_tokenizer()
        found = {}
        for text in texts:
            ids = tokenizer.tokenize_str(text, parse_special=True)
            if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
                found[text] = ids[0]
        return found

    def compile(self, spec: StructuredOutputsParams, cache: bool = True) -> CompiledGrammar:
        """The compiled constraint (a matcher at the start of the output, to copy, and its first
        mask), from the cache when the same constraint was compiled before. Raises
        SamplingParamsError naming the field when the schema, regex or grammar is invalid or
        exceeds the limits. `cache` False: neither looked up nor kept (a diagnosis)."""
        key = spec.key()
        with self._lock:
            cached = self._cache.get(key) if cache else None
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
            tokenizer = self.llguidance_tokenizer()
        compiled = _on_compile_stack(_compile, spec, tokenizer)
        if not cache:
            return compiled
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one request, with its first mask."""
        compiled = self.compile(spec)
        state = GrammarMatcher(compiled.matcher.deep_copy(), self._eos_mask, spec.field)
        state.mask = compiled.first_mask.copy()
        return state

    def fill_masks(self, matchers: list[GrammarMatcher]) -> None:
        """Fill each matcher's mask for its next token, all in one parallel llguidance call."""
        if not matchers:
            return
        masks = np.empty((len(matchers), self.mask_words), dtype=np.int32)
        assert self._executor is not None   # made with the tokenizer, before any matcher
        self._executor.unsafe_compute_mask_ptr([(m._matcher, i) for i, m in enumerate(matchers)],
                                               masks.ctypes.data, self.mask_words * 4, len(matchers))
        for m, row in zip(matchers, masks, strict=True):
            m.mask = row


def _compile(spec: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer) -> CompiledGrammar:
    """GrammarCompiler.compile's work, on the compile stack."""
    try:
        grammar = _grammar_text(spec)
    except ValueError as e:
        raise SamplingParamsError(spec.field, f"is not valid: {str(e)[:MAX_ERROR_CHARS]}") from None
    limits = llguidance.LLParserLimits(**_LIMITS)
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    # The first mask builds the lexer, which the copies share: built here, at compile time (in the
    # server's worker, before the request is admitted), not in the engine's step.
    first_mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
    if matcher.is_error():
        raise SamplingParamsError(spec.field, f"is not supported or not valid: "
                                  f"{matcher.get_error()[:MAX_ERROR_CHARS]}")
    return CompiledGrammar(matcher, first_mask)


COMPILE_STACK_BYTES = 256 << 20
"""The stack a constraint is compiled on. llguidance's compiler recurses once per link of a chain
of $refs or grammar rules, a few KB a link: a chain of ~1000 overflows a thread's usual 8 MB, and
the segfault takes the whole server down. The longest chains that fit in MAX_SPEC_CHARS (an 18k-rule
Lark chain; 2-3k-link $ref, allOf, anyOf, items chains) need under 64 MB. Address space only:
pages become resident as the recursion touches them."""

_stack_size_lock = threading.Lock()
T = TypeVar("T")


def _on_compile_stack(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a new thread with a COMPILE_STACK_BYTES stack, its exception re-raised here."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as e:   # re-raised in the caller's thread below
            outcome.append((False, e))

    with _stack_size_lock:   # threading.stack_size is process-wide: set for this thread alone
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile")
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (ValueError when it cannot be converted)."""
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        options = _COMPACT_JSON_OPTIONS if spec.disable_any_whitespace else _JSON_OPTIONS
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    assert spec.grammar is not None
    return llguidance.grammar_from("grammar", spec.grammar)   # Lark, or GBNF converted to Lark
