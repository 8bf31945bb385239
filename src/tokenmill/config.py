"""Validated configuration: what the model is (ModelConfig) and how to run it (dtype, device).

ModelConfig is filled by each architecture file from a checkpoint (HF config.json or GGUF
metadata) and never changes afterwards. Field names follow Hugging Face's where they exist.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, replace
from typing import Any

import torch

from tokenmill.errors import CheckpointError, TokenmillError, UnsupportedModelError

ROPE_TYPES = ("linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling beyond plain RoPE (which is `None`), in Hugging Face's terms
    (`rope_parameters` / `rope_scaling` keys of the same names). What each `rope_type` reads:

      linear    factor: every frequency divided by it
      dynamic   factor, original_max_position_embeddings: NTK-scaled base once the context passes
                the original length (the rule for a cache that cannot be re-rotated: layers/rotary.py)
      yarn      factor, original_max_position_embeddings, beta_fast, beta_slow, truncate (the band
                blended between interpolation and extrapolation), mscale / mscale_all_dim or
                attention_factor (the cos/sin multiplier)
      longrope  short_factor / long_factor (per-frequency divisors; empty until a GGUF file's
                rope_factors_* tensors are given to the RotaryEmbedding), original_max_position_embeddings,
                factor and attention_factor (the cos/sin multiplier)
      llama3    factor, low_freq_factor, high_freq_factor, original_max_position_embeddings

    Values are checked here; the parsers (`rope_scaling_from_hf` / `_gguf`) resolve the defaults."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        kind = self.rope_type
        if kind not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope_type {kind!r} is not supported (default, {', '.join(ROPE_TYPES)})")

        def bad(key: str, rule: str) -> CheckpointError:
            return CheckpointError(f"rope scaling ({kind}): {key} must be {rule}, got {getattr(self, key)!r}")

        def positive(key: str) -> bool:
            value = getattr(self, key)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            return number and math.isfinite(value) and value > 0

        if not positive("factor"):
            raise bad("factor", "a positive number")
        if kind != "linear":
            original = self.original_max_position_embeddings
            if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
                raise bad("original_max_position_embeddings", "a positive integer")
        if kind == "llama3":
            for key in ("low_freq_factor", "high_freq_factor"):
                if not positive(key):
                    raise bad(key, "a positive number")
            if self.high_freq_factor <= self.low_freq_factor:  # the blend divides by their difference
                raise bad("high_freq_factor", f"greater than low_freq_factor ({self.low_freq_factor})")
        if kind == "yarn":
            for key in ("beta_fast", "beta_slow"):
                if not positive(key):
                    raise bad(key, "a positive number")
            for key in ("mscale", "mscale_all_dim"):
                if getattr(self, key) is not None and not math.isfinite(getattr(self, key)):
                    raise bad(key, "a finite number")
            if not isinstance(self.truncate, bool):
                raise bad("truncate", "true or false")
        if self.attention_factor is not None and (kind not in ("yarn", "longrope") or not positive("attention_factor")):
            raise bad("attention_factor", "a positive number, and only for yarn or longrope")
        if kind == "longrope":
            if len(self.short_factor) != len(self.long_factor):
                raise bad("long_factor", f"as long as short_factor ({len(self.short_factor)} values)")
            for key in ("short_factor", "long_factor"):
                if not all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in getattr(self, key)):
                    raise bad(key, "a list of positive numbers")

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by (transformers' `attention_scaling`): it scales every
        attention logit by its square. 1 but for yarn and longrope, which derive it from `factor`
        unless `attention_factor` gives it."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.rope_type == "yarn":
            if self.mscale and self.mscale_all_dim:
                return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
            return _yarn_mscale(self.factor, 1.0)
        if self.rope_type == "longrope" and self.factor > 1.0:
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))
        return 1.0


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder-only transformer."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"                     # the gated MLP's activation: silu or gelu_tanh
    attn_scale: float | None = None              # softmax scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None      # scores -> c tanh(scores / c) (Gemma 2)
    final_logit_softcap: float | None = None     # the same on the LM head's logits
    sliding_window: int | None = None            # the window of the layers that slide
    layer_types: tuple[str, ...] | None = None   # per layer "full" or "sliding"; None: all slide if a window is set
    rope_local_theta: float | None = None        # rope base of the sliding layers, if it differs (Gemma 3)
    embed_scale: float | None = None             # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    sandwich_norms: bool = False                 # RMSNorms on the attention and MLP outputs too (Gemma 2/3)
    norm_float32_weight: bool = False            # RMSNorm weights held and applied in float32 (Gemma's 1 + w)
    num_experts: int = 0                         # > 0: a mixture-of-experts model (layers/moe.py)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_routing: str = "mixtral"                 # layers/moe.py ROUTINGS
    norm_topk_prob: bool | None = None           # qwen_moe routing: renormalize the top k
    shared_expert_intermediate_size: int | None = None
    dense_layers: tuple[int, ...] = ()           # layers of a MoE model with a dense MLP instead
    extra: dict[str, Any] = field(default_factory=dict)

    def layer_slides(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise TokenmillError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers
                                             or set(self.layer_types) - {"full", "sliding"}):
            raise TokenmillError(f"model config: layer_types must give 'full' or 'sliding' for each of the "
                                 f"{self.num_layers} layers, got {self.layer_types!r}")
        if self.num_heads % self.num_kv_heads:
            raise TokenmillError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )


_REQUIRED: Any = object()


class ConfigFields:
    """Typed reads of a checkpoint's configuration (an HF config.json dict, or GGUF metadata with
    the `{architecture}.` prefix), with errors that name the file and the key."""

    def __init__(self, values: Mapping[str, Any], source: str, prefix: str = ""):
        self.values = values
        self.source = source
        self.prefix = prefix

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(self.prefix + key, default)

    def _read(self, key: str, default: Any, kind: type) -> Any:
        value = self.values.get(self.prefix + key)
        if value is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.source}: required key {self.prefix + key!r} is missing")
            return default
        try:
            if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return kind(value)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{self.source}: {self.prefix + key!r} must be {kind.__name__}, "
                                  f"got {value!r}") from e

    def int(self, key: str, default: Any = _REQUIRED) -> int:
        return self._read(key, default, int)

    def float(self, key: str, default: Any = _REQUIRED) -> float:
        return self._read(key, default, float)


def rope_scaling_from_hf(cfg: ConfigFields) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from an HF config, old (`rope_scaling`) or new (`rope_parameters`) style,
    with transformers' defaults: the length before scaling (`original_max_position_embeddings`) is the
    config's top-level key where there is one (Phi-3 keeps it there; transformers prefers it too), else
    the rope parameters', else max_position_embeddings; dynamic NTK always scales from
    max_position_embeddings; a longrope `factor` defaults to max_position_embeddings / that length."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    values = cfg.get(key) or {}
    if not isinstance(values, Mapping):
        raise CheckpointError(f"{cfg.source}: {key!r} must be an object, got {values!r:.60}")
    params = ConfigFields(values, f"{cfg.source} ({key})")
    if any(isinstance(v, Mapping) for v in values.values()):
        raise UnsupportedModelError(f"{params.source}: rope parameters per layer type are not supported")
    theta = params.float("rope_theta", cfg.float("rope_theta", 10000.0))
    rotary_fraction = params.float("partial_rotary_factor", cfg.float("partial_rotary_factor", 1.0))
    if rotary_fraction != 1.0:
        raise UnsupportedModelError(f"{cfg.source}: partial_rotary_factor {rotary_fraction} is not supported (1.0)")
    type_key = "rope_type" if "rope_type" in values else "type"
    rope_type = values.get(type_key, "default")
    rope_type = "longrope" if rope_type == "su" else rope_type  # the name of early Phi-3 configs
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"{params.source}: {type_key} {rope_type!r} is not supported "
                                    f"(default, {', '.join(ROPE_TYPES)})")

    def original_length() -> int:
        length = cfg.int("original_max_position_embeddings", None)
        if length is None:
            length = params.int("original_max_position_embeddings", None)
        return cfg.int("max_position_embeddings") if length is None else length

    kwargs: dict[str, Any] = {}
    if rope_type == "dynamic":
        kwargs["original_max_position_embeddings"] = cfg.int("max_position_embeddings")
    elif rope_type != "linear":
        kwargs["original_max_position_embeddings"] = original_length()
    if rope_type == "longrope":
        original = kwargs["original_max_position_embeddings"]
        kwargs["factor"] = params.float("factor", None) or cfg.int("max_position_embeddings") / original
        kwargs["short_factor"] = _float_list(params, "short_factor")
        kwargs["long_factor"] = _float_list(params, "long_factor")
        kwargs["attention_factor"] = params.float("attention_factor", None)
    else:
        kwargs["factor"] = params.float("factor")
    if rope_type == "llama3":
        kwargs["low_freq_factor"] = params.float("low_freq_factor")
        kwargs["high_freq_factor"] = params.float("high_freq_factor")
    if rope_type == "yarn":
        # a zero or null beta means the default in transformers (`or 32`, `or 1`)
        kwargs["beta_fast"] = params.float("beta_fast", None) or 32.0
        kwargs["beta_slow"] = params.float("beta_slow", None) or 1.0
        kwargs["mscale"] = params.float("mscale", None)
        kwargs["mscale_all_dim"] = params.float("mscale_all_dim", None)
        kwargs["attention_factor"] = params.float("attention_factor", None)
        kwargs["truncate"] = params.get("truncate", True)
    return theta, _rope_scaling(params.source, rope_type, kwargs)


def _float_list(params: ConfigFields, key: str) -> tuple[float, ...]:
    values = params.get(key)
    if values is None:
        raise CheckpointError(f"{params.source}: required key {key!r} is missing")
    if not isinstance(values, list) or not values or \
            not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise CheckpointError(f"{params.source}: {key!r} must be a non-empty list of numbers, got {values!r:.60}")
    return tuple(float(v) for v in values)


def _rope_scaling(source: str, rope_type: str, kwargs: dict[str, Any]) -> RopeScaling:
    try:
        return RopeScaling(rope_type=rope_type, **kwargs)
    except CheckpointError as e:
        raise type(e)(f"{source}: {e}") from None


def rope_scaling_from_gguf(cfg: ConfigFields) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from GGUF metadata (`cfg` carries the `{arch}.` prefix), read as llama.cpp
    reads it: `rope.scaling.type` none | linear | yarn | longrope, where a missing type with a
    `rope.scaling.factor` (or the older `rope.scale_linear`) is linear and a missing or zero factor
    scales nothing; the yarn length before scaling defaults to `context_length`.

    Yarn's attention factor is transformers': from `rope.scaling.yarn_attn_factor` (the HF
    `attention_factor` llama.cpp's converter writes), else from the factor, with llama.cpp's reading
    of `rope.scaling.yarn_log_multiplier` as mscale_all_dim (mscale 1); `rope.scaling.attn_factor`
    multiplies it, as in llama.cpp. Longrope (Phi-3) comes with empty factor lists: its factors are the
    `rope_factors_long` / `rope_factors_short` tensors, for `RotaryEmbedding.set_longrope_factors`; its
    attention factor is `rope.scaling.attn_factor`, else transformers' default."""
    theta = cfg.float("rope.freq_base", 10000.0)
    type_key = "rope.scaling.type"
    scaling_type = cfg.get(type_key)
    factor = cfg.float("rope.scaling.factor", None)
    if factor is None:
        factor = cfg.float("rope.scale_linear", None)
    factor = factor or None  # llama.cpp reads 0 as "no factor"
    attn_factor = cfg.float("rope.scaling.attn_factor", None)
    if cfg.get("rope.scaling.alpha") is not None:  # HunYuan's NTK alpha
        raise UnsupportedModelError(f"{cfg.source}: {cfg.prefix}rope.scaling.alpha is not supported")
    if scaling_type is None:
        scaling_type = "linear" if factor else "none"
    if scaling_type not in ("none", "linear", "yarn", "longrope"):
        raise UnsupportedModelError(f"{cfg.source}: {cfg.prefix + type_key!r} {scaling_type!r} is not supported "
                                    "(none, linear, yarn, longrope)")
    if scaling_type in ("none", "linear") and attn_factor not in (None, 1.0):
        raise UnsupportedModelError(f"{cfg.source}: {cfg.prefix}rope.scaling.attn_factor {attn_factor} is "
                                    f"supported with yarn or longrope scaling only")
    if scaling_type == "none" or (scaling_type == "linear" and factor is None):
        return theta, None
    if scaling_type == "linear":
        return theta, _rope_scaling(cfg.source, "linear", {"factor": factor})
    original = cfg.int("rope.scaling.original_context_length", None) or cfg.int("context_length")
    if scaling_type == "longrope":
        return theta, _rope_scaling(cfg.source, "longrope", {
            "factor": factor or cfg.int("context_length") / original,
            "original_max_position_embeddings": original, "attention_factor": attn_factor})
    ext_factor = cfg.float("rope.scaling.yarn_ext_factor", 1.0)
    if ext_factor != 1.0:
        raise UnsupportedModelError(f"{cfg.source}: {cfg.prefix}rope.scaling.yarn_ext_factor {ext_factor} is not "
                                    "supported (1.0)")
    log_multiplier = cfg.float("rope.scaling.yarn_log_multiplier", 0.0)
    scaling = _rope_scaling(cfg.source, "yarn", {
        "factor": factor or 1.0, "original_max_position_embeddings": original,
        "beta_fast": cfg.float("rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": cfg.float("rope.scaling.yarn_beta_slow", 1.0),
        "mscale": 1.0 if log_multiplier else None, "mscale_all_dim": log_multiplier or None,
        "attention_factor": cfg.float("rope.scaling.yarn_attn_factor", None)})
    if attn_factor is not None:
        scaling = replace(scaling, attention_factor=scaling.attention_scaling * attn_factor)
    return theta, scaling


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise TokenmillError(f"device: {device!r} is not a valid torch device") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TokenmillError(f"device: {device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise TokenmillError(f"device: {device!r} is not supported (cpu or cuda)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise TokenmillError(f"device: {device!r} does not exist (this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s))")
    return dev


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without it torch emulates
    bf16 matmuls through fp32 conversions (several times slower than fp32, tens of times for large
    products on an AVX2 EPYC), so a bf16 weight's many-row products run in float32 there
    (`linear.dense_linear`)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, quantized: bool = False) -> torch.dtype:
    """'auto' is bfloat16 on GPUs and for dense weights on CPUs, float32 wherever the weights run
    quantized on a CPU (`quantized`: the quantized kernels and the decode stack take float32
    activations; on an AVX512-BF16 EPYC the default GGUF model decoded at 160 tok/s in bfloat16 against
    341 in float32), float16 on GPUs without native bf16 (before Ampere); float16 is refused on CPU.
    A CPU without bf16 units takes bfloat16 too: a decode step reads half the bytes of float32 weights
    (bf16_matmul needs no bf16 units), and the many-row products run in float32 (cpu_has_fast_bf16);
    on a 2-core AVX2 EPYC an F16 GGUF decoded at 67 tok/s in bfloat16 against 20 in float32, and
    prefilled at 577 against 528."""
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            # native bf16 from Ampere (compute capability 8) on, asked of this device (not the current one)
            return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
        return torch.float32 if quantized else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str) and dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise TokenmillError(f"dtype: {dtype!r} is not supported (auto, float32, bfloat16, float16)")
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise TokenmillError(f"dtype: {resolved} is not supported (float32, bfloat16, float16)")
    if resolved == torch.float16 and device.type == "cpu":
        raise TokenmillError("dtype: float16 is not supported on CPU (use bfloat16 or float32)")
    return resolved


ATTENTION_BACKENDS = ("auto", "torch")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "generic")   # tool_calls.PARSERS' names


QUANTIZATION_MODES = (None, "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
ACTIVATION_PRECISIONS = ("int16", "int8")


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device,
                           quantized: bool) -> torch.dtype:
    """'auto' is the model's dtype, except float32 with quantized weights on a CPU: bfloat16 there
    (llama.cpp's default cache is 16-bit too). That path is the CPU speed path, and at many
    concurrent requests decode attention is bound by the cache bytes it reads; a 16-bit cache halves
    them and the pool's memory, for a mean KL of ~6e-5 on the default model (`tokenmill bench quality
    --modes none auto auto-kv-f32`). The dense float32 path stays float32 throughout: it is the one
    held exactly to transformers. "int8" is torch.int8: int8 values with a bfloat16 scale per group of
    32 (layers/attention.py quantize_kv), about half a 16-bit cache's bytes."""
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype != "auto":
        return resolve_dtype(kv_cache_dtype, device)
    if device.type == "cpu" and quantized and dtype == torch.float32:
        return torch.bfloat16
    return dtype


SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 128
"""The most num_speculative_tokens may ask for: far past where one more row still pays (the
adaptive draft length stops short of it), and each step weighs every length up to it."""
MAX_PROMPT_LOOKUP = 128
"""The longest n-gram prompt_lookup_max may ask for: each step weighs every request's acceptance of
every match length up to it."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative.py), given as vLLM's `speculative_config` dict.

    method: "ngram" (prompt lookup: the tokens that followed the latest earlier occurrence of the
    last n tokens, prompt_lookup_max >= n >= prompt_lookup_min) or "draft_model" (a smaller
    model with the target's tokenizer, `model`; implied by `model`). num_speculative_tokens: the
    most proposed tokens a request verifies per step (each request adapts below it from its
    acceptance rate for proposals found the same way: engine/speculative.py).
    disable_by_batch_size: no speculation in a step with more requests running than this (their
    spare compute is gone). quantization: the draft's, as EngineConfig's."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5
    model: str | None = None
    quantization: str | None = None
    disable_by_batch_size: int = 32

    def __post_init__(self) -> None:
        where = "speculative_config"
        if self.method not in SPECULATIVE_METHODS:
            raise TokenmillError(f"{where}: method {self.method!r} is not one of {', '.join(SPECULATIVE_METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            _check_positive(f"{where}.{name}", getattr(self, name))
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise TokenmillError(f"{where}.num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, got "
                                 f"{self.num_speculative_tokens}")
        if self.prompt_lookup_max > MAX_PROMPT_LOOKUP:
            raise TokenmillError(f"{where}.prompt_lookup_max must be at most {MAX_PROMPT_LOOKUP}, got "
                                 f"{self.prompt_lookup_max}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise TokenmillError(f"{where}: prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                                 f"({self.prompt_lookup_max})")
        if (self.method == "draft_model") != (self.model is not None):
            raise TokenmillError(f"{where}: method draft_model needs a model (the draft) and only it takes one")
        if self.model is not None and not isinstance(self.model, str):
            raise TokenmillError(f"{where}.model must be a string, got {self.model!r:.60}")
        if self.quantization not in QUANTIZATION_MODES:
            raise TokenmillError(f"{where}.quantization: {self.quantization!r} is not supported "
                                 f"(None, {', '.join(repr(m) for m in QUANTIZATION_MODES if m)})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """From a dict (the Python API) or its JSON text (the command line)."""
        if isinstance(value, SpeculativeConfig):
            return value
        values = _config_dict("speculative_config", value, cls)
        if "method" not in values:
            if values.get("model") is None:
                raise TokenmillError("speculative_config: give a method (ngram) or a draft model")
            values["method"] = "draft_model"
        if "num_speculative_tokens" not in values:
            raise TokenmillError("speculative_config: num_speculative_tokens is required")
        return cls(**values)


KV_CONNECTORS = ("SharedMemoryConnector",)
KV_ROLES = ("kv_producer", "kv_consumer")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (engine/kv_transfer.py), vLLM's `kv_transfer_config` dict.

    kv_connector: how K/V travels (SharedMemoryConnector: files in /dev/shm, one machine).
    kv_role: kv_producer (prefills and exports a request's prompt K/V when the request asks, with
    kv_transfer_params {"do_remote_decode": true}) or kv_consumer (loads it, given
    {"remote_kv": NAME}). Without a role, `tokenmill serve` runs one engine of each behind its
    front end (server/frontend.py)."""

    kv_connector: str
    kv_role: str | None = None

    def __post_init__(self) -> None:
        _check_choice("kv_transfer_config.kv_connector", self.kv_connector, KV_CONNECTORS)
        if self.kv_role is not None:
            _check_choice("kv_transfer_config.kv_role", self.kv_role, KV_ROLES)

    @classmethod
    def parse(cls, value: KVTransferConfig | Mapping[str, Any] | str) -> KVTransferConfig:
        if isinstance(value, KVTransferConfig):
            return value
        values = _config_dict("kv_transfer_config", value, cls)
        if "kv_connector" not in values:
            raise TokenmillError(f"kv_transfer_config: kv_connector is required ({', '.join(KV_CONNECTORS)})")
        return cls(**values)


def _config_dict(where: str, value: Mapping[str, Any] | str, cls: type) -> dict[str, Any]:
    """A settings dict given as a dict (the Python API) or its JSON text (the command line), with
    only `cls`'s field names as keys."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise TokenmillError(f"{where}: not a JSON object ({e})") from e
        except RecursionError as e:   # (nesting deeper than the parser's recursion)
            raise TokenmillError(f"{where}: not a JSON object (nested too deeply)") from e
    if not isinstance(value, Mapping):
        raise TokenmillError(f"{where}: expected a dict (or its JSON text), got {value!r:.60}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise TokenmillError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (known: "
                             f"{', '.join(sorted(known))})")
    return dict(value)


MAX_PORT = 65535   # the largest TCP port (--port, MASTER_PORT)

MAX_THREADS = 512
"""The most threads a process may ask for (ggml's GGML_MAX_N_THREADS too): far past any machine's
cores, and short of where OpenMP's runtime fails to start its threads (it crashes the process)."""

MAX_PROCESSES = 512
"""The most engine processes one setting may ask for (tensor-parallel ranks, WORLD_SIZE, data-parallel
replicas): each holds its part of a model, so far more than a deployment runs; it keeps a mistyped
count from starting processes without end or overflowing the sizes derived from it."""


def setting(default: Any, help: str, *, flags: tuple[str, ...] = (), choices: tuple | None = None,
            cli: bool = True) -> Any:
    """A field of EngineConfig with what the command line needs: its help text, extra flag spellings
    (`-m`), the allowed values, and whether it is a flag at all."""
    return field(default=default, metadata={"help": help, "flags": flags, "choices": choices, "cli": cli})


@dataclass
class EngineConfig:
    """How to run a model: every engine setting, declared once (names follow vLLM's).

    Each field is a keyword argument of `LLM(...)` and, through `add_engine_args`, a flag of every
    command that runs an engine (`--max-num-seqs`; booleans as `--x / --no-x`); `engine_argv` turns
    a command's values back into flags (the bench starting `tokenmill serve`). Values are validated
    in __post_init__, so the Python API and the CLI refuse the same things with the same message."""

    model: str | None = setting(None, "a .gguf file, an HF folder, or a Hugging Face repo id (org/name; "
                                "org/name:Q4_K_M or org/name/file.gguf picks a GGUF in the repo), from the local "
                                "cache first (default: the embedded SmolLM2-135M-Instruct GGUF)", flags=("-m",))
    tokenizer: str | None = setting(None, "load the tokenizer from another .gguf file, HF folder or repo id")
    chat_template: str | None = setting(None, "a Jinja chat template, or the path of a file holding one, used "
                                        "instead of the model's")
    tool_call_parser: str | None = setting(None, "how the model writes tool calls (default: detected from the chat "
                                           "template; generic, a JSON answer kept by a grammar, for a template "
                                           "that does not render tools)", choices=TOOL_CALL_PARSERS)
    dtype: str = setting("auto", "auto (float32 for quantized weights on CPU, else bfloat16; float16 on GPUs "
                         "before Ampere) | float32 | bfloat16 | float16 (CUDA)")
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    threads: int | None = setting(None, "CPU threads for PyTorch and the C kernels, per tensor-parallel rank "
                                  "(default: PyTorch's, one per core, divided among the ranks)")
    tensor_parallel_size: int = setting(1, "split the model over this many processes (Megatron tensor "
                                        "parallelism over torch.distributed: gloo on CPU)", flags=("-tp",))
    pipeline_parallel_size: int = setting(1, "layers split over processes: not supported (1 only; on a CPU, "
                                          "--tensor-parallel-size splits the memory at a lower latency)",
                                          flags=("-pp",))
    max_model_len: int | None = setting(None, "context limit (default: the model's, capped by the KV pool)")
    block_size: int = setting(16, "tokens per KV-cache block")
    max_num_seqs: int = setting(64, "requests running at once")
    max_num_batched_tokens: int = setting(2048, "tokens per engine step (prefill chunks + decodes)")
    kv_cache_memory: int | str | None = setting(
        None, "memory for the KV cache: bytes or a size such as 4GiB, 512MiB, 2G (default: a quarter of the free "
        "memory, at most 4 GiB)")
    num_kv_blocks: int | None = setting(
        None, "explicit KV pool size in blocks (overrides --kv-cache-memory): a block is block_size tokens of every "
        "layer, or of one group of layers in a model that mixes sliding-window and global ones")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = setting(True, "prefill prompts longer than the step's token budget in chunks")
    attention_backend: str = setting("auto", "auto: the C attention kernels on CPU where they build; torch: the "
                                     "plain PyTorch reference", choices=ATTENTION_BACKENDS)
    kv_cache_dtype: str = setting("auto", "KV cache element type (auto: the model's dtype, but bfloat16 for float32 "
                                  "with quantized weights on CPU; int8: int8 values with a bfloat16 scale per 32, "
                                  "about half the bytes of a 16-bit cache)", choices=KV_CACHE_DTYPES)
    quantization: str | None = setting(None, "default: GGUF quantized weights run quantized (CPU); none: "
                                       "dequantize everything; int8 | int4: also quantize dense weights at load",
                                       choices=tuple(m for m in QUANTIZATION_MODES if m))
    activation_precision: str = setting(
        "int16", "how the CPU kernel of quantized weights rounds the activations it multiplies, per group of 32: "
        "int16 (two int8 planes; each value within 2^-16 of its group's largest) | int8 (one plane, llama.cpp's "
        "rounding: about 2^8 times the rounding error, for half the integer products, which speeds up prefill and "
        "batched decode; batch-1 decode reads the same weight bytes). "
        "docs/ARCHITECTURE.md has bench quality's measurements of both", choices=ACTIVATION_PRECISIONS)
    weight_cache: bool = setting(True, "keep quantized weights converted at load (GGUF blocks repacked for the "
                                 "kernels, int8 / int4 quantization) in the cache folder, and read them there on the "
                                 "next load of the same file instead of converting again")
    speculative_config: SpeculativeConfig | dict | str | None = setting(
        None, "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4} (prompt "
        "lookup; prompt_lookup_min / prompt_lookup_max bound the n-gram) or {\"model\": DRAFT, "
        "\"num_speculative_tokens\": 4} (a draft model with the same tokenizer; quantization: the draft's); "
        "disable_by_batch_size: off when more requests run")
    kv_transfer_config: KVTransferConfig | dict | str | None = setting(
        None, "prefill/decode disaggregation, as JSON: {\"kv_connector\": \"SharedMemoryConnector\"} (`serve` runs "
        "a prefill engine and a decode engine behind one port; a prompt is prefilled on the first and its K/V "
        "handed to the second through shared memory), or with \"kv_role\": kv_producer | kv_consumer, one engine "
        "in that role (vLLM's kv_transfer_params on requests)")
    show_progress: bool = setting(False, "progress bars while loading", cli=False)

    def __post_init__(self) -> None:
        # what Python callers hold (a Path, torch.float32, torch.device("cpu")) as the names the CLI takes
        for name in ("model", "tokenizer", "chat_template"):
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if isinstance(self.dtype, torch.dtype):
            self.dtype = str(self.dtype).removeprefix("torch.")
        if isinstance(self.device, torch.device):
            self.device = str(self.device)
        for f in fields(self):   # the types ints and sizes are not checked for below
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool) or \
                    f.type in ("str", "str | None") and not isinstance(value, str) and value is not None:
                raise TokenmillError(f"{f.name} must be {f.type.replace(' | None', ' or None')}, got {value!r:.60}")
        for name in ("model", "tokenizer", "chat_template"):
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise TokenmillError(f"{name} must not be empty")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            _check_positive(name, getattr(self, name))
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_size("kv_cache_memory", self.kv_cache_memory)
        if self.quantization not in QUANTIZATION_MODES:
            raise TokenmillError(f"quantization: {self.quantization!r} is not supported "
                                 f"(None, {', '.join(repr(m) for m in QUANTIZATION_MODES if m)})")
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks", "threads"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.tensor_parallel_size > MAX_PROCESSES:
            raise TokenmillError(f"tensor_parallel_size must be at most {MAX_PROCESSES}, got "
                                 f"{self.tensor_parallel_size}")
        if self.threads is not None and self.threads > MAX_THREADS:
            raise TokenmillError(f"threads must be at most {MAX_THREADS}, got {self.threads} (this machine has "
                                 f"{os.cpu_count()} cores)")
        if self.pipeline_parallel_size != 1:
            raise TokenmillError(f"pipeline_parallel_size {self.pipeline_parallel_size!r}: pipeline parallelism is "
                                 f"not supported (on a CPU a pipeline's stages run one after the other for each "
                                 f"token; use tensor_parallel_size to split a model's memory, see "
                                 f"docs/ARCHITECTURE.md)")
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("activation_precision", self.activation_precision, ACTIVATION_PRECISIONS)
        if self.tool_call_parser is not None:
            _check_choice("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
            if self.tensor_parallel_size > 1:
                raise TokenmillError("kv_transfer_config: K/V transfer with tensor_parallel_size > 1 is not supported "
                                     "(each rank holds a slice of the K/V)")
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
               "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(name: str, text: str) -> int:
    """Bytes of a size written as `4GiB`, `512MiB`, `1.5G` or `1000000`: KiB/MiB/GiB/TiB and the
    one-letter K/M/G/T are powers of 1024, kB/MB/GB/TB powers of 1000 (as in `ls -h` and SI)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _SIZE_UNITS:
        raise TokenmillError(f"{name}: {text!r} is not a size (e.g. 4GiB, 512MiB, 2G, or a number of bytes)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _cli_fields() -> list[Field]:
    return [f for f in fields(EngineConfig) if f.metadata["cli"]]


_FLAG_TYPES = {"int | None": int, "int": int}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig setting as a flag of `parser` (the defaults are EngineConfig's)."""
    group = parser.add_argument_group("model and engine")
    for f in _cli_fields():
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata["help"], "dest": f.name}
        if f.type == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _FLAG_TYPES.get(f.type, str)
            if f.metadata["choices"]:
                kwargs["choices"] = f.metadata["choices"]
            if f.default is not None:
                kwargs["help"] += f" (default: {f.default})"
        group.add_argument(flag, *f.metadata["flags"], **kwargs)


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig keyword arguments a command's parsed flags hold, but the model: commands
    resolve it themselves (a positional MODEL, the default model), and `LLM` takes it first."""
    return {f.name: getattr(args, f.name) for f in _cli_fields() if f.name != "model" and hasattr(args, f.name)}


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags given to a command (those that differ from the defaults), as flags again,
    e.g. for the `tokenmill serve` a benchmark starts; the model is left out (a positional there)."""
    argv: list[str] = []
    for f in _cli_fields():
        value = getattr(args, f.name, f.default)
        if f.name == "model" or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def cores_per_process(processes: int) -> int:
    """This process's cores shared out among `processes` (tensor-parallel ranks, replicas): the
    default thread count of each."""
    return max(1, len(os.sched_getaffinity(0)) // processes)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise TokenmillError(f"{name}: {value!r} is not one of {', '.join(choices)}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TokenmillError(f"{name} must be a positive integer, got {value!r}")
