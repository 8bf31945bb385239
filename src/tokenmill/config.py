"""Validated configuration: what the model is (ModelConfig) and how to run it (dtype, device).

ModelConfig is filled by each architecture file from a checkpoint (HF config.json or GGUF
metadata) and never changes afterwards. Field names follow Hugging Face's where they exist.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
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
    dtype: str = setting("auto", "auto (float32 for quantized weights on CPU, else bfloat16 where the hardware "
                         "has it, else float32) | float32 | bfloat16 | float16 (CUDA)")
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    threads: int | None = setting(None, "CPU threads for PyTorch and the C kernels (default: PyTorch's, one per "
                                  "core)")
    max_model_len: int | None = setting(None, "context limit (default: the model's, capped by the KV pool)")
    block_size: int = setting(16, "tokens per KV-cache block")
    max_num_seqs: int = setting(64, "requests running at once")
    max_num_batched_tokens: int = setting(2048, "tokens per engine step (prefill chunks + decodes)")
    kv_cache_memory: int | str | None = setting(
        None, "memory for the KV cache: bytes or a size such as 4GiB, 512MiB, 2G (default: a quarter of the free "
        "memory, at most 4 GiB)")
    num_kv_blocks: int | None = setting(None, "explicit KV pool size in blocks (overrides --kv-cache-memory)")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = setting(True, "prefill prompts longer than the step's token budget in chunks")
    attention_backend: str = setting("auto", "auto: the C attention kernels on CPU where they build; torch: the "
                                     "plain PyTorch reference", choices=ATTENTION_BACKENDS)
    kv_cache_dtype: str = setting("auto", "KV cache element type (auto: the model's dtype, but bfloat16 for float32 "
                                  "with quantized weights on CPU)", choices=KV_CACHE_DTYPES)
    quantization: str | None = setting(None, "default: GGUF quantized weights run quantized (CPU); none: "
                                       "dequantize everything; int8 | int4: also quantize dense weights at load",
                                       choices=tuple(m for m in QUANTIZATION_MODES if m))
    show_progress: bool = setting(False, "progress bars while loading", cli=False)

    def __post_init__(self) -> None:
        for f in fields(self):   # the types ints and sizes are not checked for below
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool) or \
                    f.type in ("str", "str | None") and not isinstance(value, str) and value is not None:
                raise TokenmillError(f"{f.name} must be {f.type.replace(' | None', ' or None')}, got {value!r:.60}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_positive(name, getattr(self, name))
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_size("kv_cache_memory", self.kv_cache_memory)
        if self.quantization not in QUANTIZATION_MODES:
            raise TokenmillError(f"quantization: {self.quantization!r} is not supported "
                                 f"(None, {', '.join(repr(m) for m in QUANTIZATION_MODES if m)})")
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks", "threads"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise TokenmillError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise TokenmillError(f"attention_backend: {self.attention_backend!r} is not one of "
                                 f"{', '.join(ATTENTION_BACKENDS)}")


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


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TokenmillError(f"{name} must be a positive integer, got {value!r}")
