"""Validated configuration: what the model is (ModelConfig) and how to run it (dtype, device).

ModelConfig is filled by each architecture file from a checkpoint (HF config.json or GGUF
metadata) and never changes afterwards. Field names follow Hugging Face's where they exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.errors import CheckpointError, TokenmillError, UnsupportedModelError


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise TokenmillError(f"model config: {name} must be a positive integer, got {value!r}")
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
    """(rope_theta, scaling) from an HF config, old (`rope_scaling`) or new (`rope_parameters`) style."""
    key = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params = ConfigFields(cfg.get(key) or {}, f"{cfg.source} ({key})")
    theta = params.float("rope_theta", cfg.float("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type == "llama3":
        return theta, RopeScaling(
            factor=params.float("factor"),
            low_freq_factor=params.float("low_freq_factor"),
            high_freq_factor=params.float("high_freq_factor"),
            original_max_position_embeddings=params.int("original_max_position_embeddings"),
        )
    raise UnsupportedModelError(f"{cfg.source}: rope type {rope_type!r} is not supported (default, llama3)")


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


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX). Without it torch emulates
    bf16 matmuls through fp32 conversions: measured ~3x slower than fp32 on an AVX-512 Xeon."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device, quantized: bool = False) -> torch.dtype:
    """'auto' is bfloat16 on GPUs and on CPUs with bf16 units, float32 on other CPUs and wherever the
    weights run quantized on a CPU (`quantized`: the quantized kernels and the decode stack take float32
    activations; on an AVX512-BF16 EPYC the default GGUF model decoded at 160 tok/s in bfloat16 against
    341 in float32), float16 on GPUs without native bf16 (before Ampere); float16 is refused on CPU."""
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            # native bf16 from Ampere (compute capability 8) on, asked of this device (not the current one)
            return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
        if quantized or not cpu_has_fast_bf16():
            return torch.float32
        return torch.bfloat16
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


QUANTIZATION_MODES = (None, "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, device: torch.device,
                           quantized: bool) -> torch.dtype:
    """'auto' is the model's dtype, except float32 with quantized weights on a CPU: bfloat16 there
    (llama.cpp's default cache is 16-bit too). That path is the CPU speed path, and at many
    concurrent requests decode attention is bound by the cache bytes it reads; a 16-bit cache halves
    them and the pool's memory, for a mean KL of ~6e-5 on the default model (`tokenmill bench quality
    --modes none auto auto-kv-f32`). The dense float32 path stays float32 throughout: it is the one
    held exactly to transformers."""
    if kv_cache_dtype != "auto":
        return resolve_dtype(kv_cache_dtype, device)
    if device.type == "cpu" and quantized and dtype == torch.float32:
        return torch.bfloat16
    return dtype


@dataclass
class EngineConfig:
    """How to run a model: every engine knob, validated in one place (names follow vLLM's)."""

    model: str | None = None               # .gguf file or HF folder; None = the embedded default model
    dtype: str = "auto"                    # auto (see resolve_dtype) | float32 | bfloat16 | float16
    device: str = "auto"                   # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None       # context limit; default: the model's, capped by the KV pool
    block_size: int = 16                   # tokens per KV block
    max_num_seqs: int = 64                 # running requests per step
    max_num_batched_tokens: int = 2048     # tokens per step (prefill chunks + decodes)
    kv_cache_memory: int | None = None     # bytes for the KV pool; default 1/4 of free memory, <= 4 GiB
    num_kv_blocks: int | None = None       # explicit pool size (overrides kv_cache_memory)
    enable_prefix_caching: bool = True     # reuse the KV blocks of shared prompt prefixes
    enable_chunked_prefill: bool = True    # split prompts longer than the step's token budget
    attention_backend: str = "auto"        # auto (C decode kernel on CPU where it builds) | torch (reference)
    show_progress: bool = False            # progress bars while loading
    quantization: str | None = None        # None: GGUF quantized weights run quantized (CPU) | "none": all
    #                                        dequantized | "int8" | "int4": dense weights quantized too
    kv_cache_dtype: str = "auto"           # auto (see resolve_kv_cache_dtype) | float32 | bfloat16

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_positive(name, getattr(self, name))
        if self.quantization not in QUANTIZATION_MODES:
            raise TokenmillError(f"quantization: {self.quantization!r} is not supported "
                                 f"(None, {', '.join(repr(m) for m in QUANTIZATION_MODES if m)})")
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise TokenmillError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise TokenmillError(f"attention_backend: {self.attention_backend!r} is not one of "
                                 f"{', '.join(ATTENTION_BACKENDS)}")


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TokenmillError(f"{name} must be a positive integer, got {value!r}")
