"""SamplingParams: what one request asks of the sampler and of the stop logic, validated up front.

Names and meanings follow vLLM's `SamplingParams` (and, for the penalties and `logit_bias`, the
OpenAI API), so requests translate one to one. Every field is checked in `__post_init__`; a bad
value raises `SamplingParamsError` with a message that names the field and its allowed range.
Checks that need the model (token ids against the vocabulary) are in `validate_for_vocab`, which
the engine calls when the request arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import SamplingParamsError
from tokenmill.sampling.structured import StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy: dividing logits by them would overflow to inf."""

MAX_LOGPROBS = 20
"""Most top log-probabilities one request may ask for (the OpenAI API's and vLLM's default cap)."""

MAX_N = 128
"""Most samples one request may ask for (the OpenAI API's cap): checked before anything of size n
is built."""

MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MIN_REPETITION_PENALTY = 0.01
"""Finite ranges the sampler honours: far beyond any useful value, and far from float32's limits
(the sampler works in float32: 1e308 would be inf there, and inf / inf is NaN)."""

MAX_STOP_STRINGS = 64
MAX_TOKEN_LISTS = 1024
"""Most stop strings, and most entries in `logit_bias` / `stop_token_ids`: each is matched or
packed every step, so their count bounds the work one request adds to every step."""

FLOAT32_TINY = 2.0**-126
"""The smallest normal float32: a positive value below it (top_p=1e-46) is 0 or a denormal once
the sampler's float32 tensors hold it, so "> 0" ranges start here."""

_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop it."""

    n: int = 1
    """Number of completions to generate for the prompt; in [1, 128]."""

    max_tokens: int | None = 16
    """Most tokens to generate per completion; >= 1, or None for "up to the context limit"
    (the engine resolves None against the model's context length)."""

    min_tokens: int = 0
    """Tokens to generate before EOS or any of `stop_token_ids` may be sampled; >= 0,
    <= max_tokens and (checked by the engine) <= the room the context leaves after the prompt.
    Until then those ids get logit -inf (also when `ignore_eos` is set)."""

    temperature: float = 1.0
    """Logits are divided by it before sampling; in [0, 100]. Below 1e-5 (e.g. 0) means greedy."""

    top_k: int = 0
    """Sample only from the k most likely tokens (ties with the k-th are kept); >= 1, or 0 to
    disable. -1 is accepted as vLLM's spelling of "disabled" and stored as 0."""

    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose probability sums to
    >= top_p (ties with its least likely member are kept, and never fewer than one); in (0, 1]
    (values below float32's smallest normal number, 1.2e-38, are refused: they round to 0)."""

    min_p: float = 0.0
    """Keep only tokens whose probability is >= min_p times the most likely token's; in [0, 1]."""

    repetition_penalty: float = 1.0
    """HF/vLLM repetition penalty over every token in the prompt and the output so far: positive
    logits are divided by it, negative ones multiplied; in [0.01, 100] (1 disables)."""

    presence_penalty: float = 0.0
    """OpenAI presence penalty: subtracted once from the logit of every token already in the
    output (not the prompt); in [-2, 2]."""

    frequency_penalty: float = 0.0
    """OpenAI frequency penalty: subtracted from a token's logit once per time it already occurs
    in the output (not the prompt); in [-2, 2]."""

    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit, each in [-100, 100]; at most 1024 entries. Keys may be strings of digits
    (OpenAI JSON) and are converted to int; ids are checked against the vocabulary by
    `validate_for_vocab`."""

    seed: int | None = None
    """Seed for this request's own random generator, so its samples do not depend on what it is
    batched with; None uses the global generator. Sample i of n uses seed + i, so seed + n - 1
    must still be a valid seed (<= 2**64 - 1)."""

    stop: str | list[str] | None = None
    """Strings that end generation when they appear in the output text; normalized to a list
    (None -> []); at most 64. Empty strings are rejected."""

    stop_token_ids: list[int] | None = None
    """Token ids that end generation when sampled (after `min_tokens`); normalized to a list
    (None -> []); at most 1024."""

    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the output text instead of cutting it off."""

    ignore_eos: bool = False
    """Do not stop when EOS is sampled (keep generating until max_tokens or a stop condition)."""

    logprobs: int | None = None
    """None: no log-probabilities. 0: the sampled token's log-probability. k in [1, 20]: also the
    k most likely tokens' ones. They are of the raw model distribution, before penalties,
    temperature and filtering; under `structured_outputs`, of that distribution restricted to the
    tokens the constraint allows (renormalized), the one the token was actually drawn from."""

    prompt_logprobs: int | None = None
    """None: none. k in [0, 20]: the log-probability of every prompt token after the first under
    the model given the tokens before it (RequestOutput.prompt_logprobs; the first entry is None),
    with the k most likely tokens at its position; of the raw model distribution, as `logprobs`.
    The whole prompt is computed for them: such a request takes no prefix-cache hit for it."""

    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized output text."""

    structured_outputs: StructuredOutputsParams | None = None
    """A constraint the output must satisfy (JSON schema, JSON object, regex, choice or grammar;
    see sampling/structured.py); a dict of its fields is accepted too. Tokens that cannot continue
    a valid output are never sampled, and the request ends with "stop" once the output is
    complete. `min_tokens` cannot be combined with it: the grammar decides where the output ends."""

    kv_transfer_params: dict[str, Any] | None = None
    """Prefill/decode disaggregation (vLLM's field; engine/kv_transfer.py), for an engine started
    with a kv_transfer_config: {"do_remote_decode": true} on a producer (export the prompt's K/V;
    the output's kv_transfer_params names it; the request ends after one token, its max_tokens
    checked against max_model_len as the consumer will check it), {"remote_kv": NAME} on a consumer (load it)."""

    def __post_init__(self) -> None:
        _check_int("n", self.n, low=1, high=MAX_N)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1, none_ok=True)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        self.temperature = _check_float("temperature", self.temperature, low=0.0, high=MAX_TEMPERATURE)
        if self.top_k == -1:
            self.top_k = 0
        _check_int("top_k", self.top_k, low=0, range_text="must be >= 1, or 0 or -1 to disable")
        self.top_p = _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.top_p < FLOAT32_TINY:
            raise SamplingParamsError("top_p", f"must be >= {FLOAT32_TINY:.2g} (float32's smallest normal number; "
                                      f"smaller values round to 0 in the sampler), got {self.top_p}")
        self.min_p = _check_float("min_p", self.min_p, low=0.0, high=1.0)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty,
                                               low=MIN_REPETITION_PENALTY, high=MAX_REPETITION_PENALTY)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.seed is not None:
            high = _SEED_RANGE[1] - (self.n - 1)
            _check_int("seed", self.seed, low=_SEED_RANGE[0], high=high,
                       range_text=f"must be an integer in [{_SEED_RANGE[0]}, {high}] or None" +
                       (f" (sample i of n={self.n} uses seed + i)" if self.n > 1 else ""))
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, f"must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, high=MAX_LOGPROBS, none_ok=True)
        if self.prompt_logprobs is not None and isinstance(self.kv_transfer_params, dict) and \
                "remote_kv" in self.kv_transfer_params:
            raise SamplingParamsError("prompt_logprobs", "cannot be combined with kv_transfer_params remote_kv: the "
                                      "prompt's K/V is loaded, not computed")
        if self.kv_transfer_params is not None and (
                not isinstance(self.kv_transfer_params, dict) or
                self.kv_transfer_params not in ({"do_remote_decode": True}, {"do_remote_decode": False}) and
                set(self.kv_transfer_params) != {"remote_kv"}):
            raise SamplingParamsError("kv_transfer_params", 'must be {"do_remote_decode": true} or {"remote_kv": '
                                      f'NAME}}, got {self.kv_transfer_params!r:.80}')
        if self.kv_transfer_params == {"do_remote_decode": True} and self.n > 1:
            # (each sample would export its own copy of the prompt's K/V, and the output names one)
            raise SamplingParamsError("kv_transfer_params", f"do_remote_decode needs n = 1, got n = {self.n}")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
            if self.min_tokens:
                raise SamplingParamsError("min_tokens", "cannot be combined with structured_outputs: the grammar "
                                          "decides where the output ends")

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the most likely token every step."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Check the token ids in `logit_bias` and `stop_token_ids` against the model's vocabulary."""
        for field, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = [token_id for token_id in ids if token_id >= vocab_size]
            if bad:
                raise SamplingParamsError(field, f"token ids must be in [0, {vocab_size}) for this model, got {bad[0]}")


def _check_int(
    field: str,
    value: object,
    low: int,
    high: int | None = None,
    none_ok: bool = False,
    range_text: str | None = None,
) -> None:
    if range_text is None:
        range_text = f"must be an integer in [{low}, {high}]" if high is not None else f"must be >= {low}"
        if none_ok:
            range_text += " or None"
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(field, f"{range_text}, got {_short(value)}")
    if value < low or (high is not None and value > high):
        raise SamplingParamsError(field, f"{range_text}, got {_short(value)}")


def _check_float(
    field: str,
    value: object,
    low: float,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    """Check a finite real number against [low, high] (or (low, high]); return it as a float."""
    if high is None:
        range_text = f"must be {'>' if low_open else '>='} {low:g}"
    else:
        range_text = f"must be in {'(' if low_open else '['}{low:g}, {high:g}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _is_finite(value):
        raise SamplingParamsError(field, f"{range_text}, got {_short(value)}")
    below = value <= low if low_open else value < low
    if below or (high is not None and value > high):
        raise SamplingParamsError(field, f"{range_text}, got {_short(value)}")
    return float(value)


def _is_finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float (JSON allows 1 followed by 400 zeros)
        return False


def _short(value: object) -> str:
    """repr(value), cut to a readable length (error messages echo what the client sent)."""
    if isinstance(value, int) and abs(value) >= 10**30:  # (str() refuses ints of over 4300 digits)
        return f"an integer of about {int(abs(value).bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _normalize_logit_bias(logit_bias: object) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise SamplingParamsError("logit_bias", f"must be a dict of token id -> bias, got {_short(logit_bias)}")
    if len(logit_bias) > MAX_TOKEN_LISTS:
        raise SamplingParamsError("logit_bias", f"must have at most {MAX_TOKEN_LISTS} entries, got {len(logit_bias)}")
    normalized: dict[int, float] = {}
    for key, bias in logit_bias.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 20:
            token_id = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            token_id = key
        else:
            raise SamplingParamsError("logit_bias", f"keys must be token ids >= 0, got {_short(key)}")
        normalized[token_id] = _check_float(f"logit_bias[{token_id}]", bias, low=-100.0, high=100.0)
    return normalized


def _normalize_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise SamplingParamsError("stop", f"must be a string or a list of strings, got {_short(stop)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise SamplingParamsError("stop", f"must have at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    if any(s == "" for s in stops):
        raise SamplingParamsError("stop", "must not contain empty strings")
    return list(stops)


def _normalize_stop_token_ids(stop_token_ids: object) -> list[int]:
    if stop_token_ids is None:
        return []
    if not isinstance(stop_token_ids, (list, tuple)):
        raise SamplingParamsError("stop_token_ids", f"must be a list of token ids, got {_short(stop_token_ids)}")
    if len(stop_token_ids) > MAX_TOKEN_LISTS:
        raise SamplingParamsError("stop_token_ids", f"must have at most {MAX_TOKEN_LISTS} token ids, "
                                  f"got {len(stop_token_ids)}")
    for token_id in stop_token_ids:
        _check_int("stop_token_ids", token_id, low=0, range_text="must contain token ids >= 0")
    return list(stop_token_ids)
