"""Rotary position embeddings (NeoX / HF `rotate_half` layout) with every RoPE scaling type of the
Hugging Face families: linear, dynamic NTK, YaRN, LongRoPE and Llama 3 (config.RopeScaling).

GGUF files of the llama architecture store Q/K rows permuted for GGML's interleaved rope; the
llama model file un-permutes them at load, so one rotary layout serves every checkpoint.

The tables are built once, for the context the model is built for (`max_positions`). transformers
recomputes two types from the length of the sequence at hand, which an engine cannot do: keys in
the KV cache were rotated when they were written and are never rotated again. So, as llama.cpp and
vLLM do, the choice is made once from `max_positions`:

  longrope  the long factors when max_positions > original_max_position_embeddings, else the
            short ones (transformers' choice for every sequence up to the original length)
  dynamic   plain RoPE when max_positions <= original_max_position_embeddings (transformers'
            frequencies for every sequence that fits), else the NTK-scaled base transformers
            computes for a sequence of exactly max_positions tokens (vLLM's fixed table)
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from tokenmill.config import RopeScaling
from tokenmill.errors import CheckpointError


def _plain_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None,
                  max_positions: int | None = None) -> torch.Tensor:
    """The rotation frequencies ([rotary_dim / 2], float32) of a model built for `max_positions`
    tokens (None: a context within the original length). The cos/sin multiplier is
    `scaling.attention_scaling`."""
    if scaling is None:
        return _plain_inv_freq(rotary_dim, theta)
    kind = scaling.rope_type
    if kind == "linear":
        return _plain_inv_freq(rotary_dim, theta) / scaling.factor
    if kind == "dynamic":
        return _dynamic_ntk_inv_freq(rotary_dim, theta, scaling, max_positions)
    if kind == "yarn":
        return _yarn_inv_freq(rotary_dim, theta, scaling)
    if kind == "longrope":
        return _longrope_inv_freq(rotary_dim, theta, scaling, max_positions)
    return _llama3_inv_freq(rotary_dim, theta, scaling)


def _dynamic_ntk_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling,
                          max_positions: int | None) -> torch.Tensor:
    original = scaling.original_max_position_embeddings
    if max_positions is None or max_positions <= original:
        return _plain_inv_freq(rotary_dim, theta)
    # NTK-aware: raise the base so the lowest frequency stretches over max_positions, keeping the
    # highest (local order) almost unchanged.
    stretch = scaling.factor * max_positions / original - (scaling.factor - 1)
    return _plain_inv_freq(rotary_dim, theta * stretch ** (rotary_dim / (rotary_dim - 2)))


def _yarn_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    # Frequencies that turn many times within the original context keep their value (extrapolate),
    # those that turn less than once are divided by `factor` (interpolate), and a linear ramp over
    # the frequency index blends the band between: from the index that turns beta_fast times to
    # the one that turns beta_slow times over original_max_position_embeddings.
    original = scaling.original_max_position_embeddings

    def index_turning(turns: float) -> float:
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_turning(scaling.beta_fast), index_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a one-index band: keep the ramp finite
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wavelength_base = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolated = 1.0 / wavelength_base
    interpolated = 1.0 / (scaling.factor * wavelength_base)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def _longrope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling,
                       max_positions: int | None) -> torch.Tensor:
    use_long = max_positions is not None and max_positions > scaling.original_max_position_embeddings
    key = "long_factor" if use_long else "short_factor"
    divisors = getattr(scaling, key)
    if not divisors:
        raise CheckpointError("rope scaling (longrope): no short_factor / long_factor (a GGUF file carries them "
                              "as the rope_factors_short / rope_factors_long tensors)")
    if len(divisors) != rotary_dim // 2:
        raise CheckpointError(f"rope scaling (longrope): {key} has {len(divisors)} values, the rotary "
                              f"dimension {rotary_dim} needs {rotary_dim // 2}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (torch.tensor(divisors, dtype=torch.float32) * theta**exponents)


def _llama3_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band between blended.
    inv_freq = _plain_inv_freq(rotary_dim, theta)
    original = scaling.original_max_position_embeddings
    low_wavelen = original / scaling.low_freq_factor
    high_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_medium, blended, out)


LONGROPE_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position below `max_positions` (scaled as the module docstring
    says); `forward(positions)` gathers the rows of one batch once, and every layer applies them
    with `apply_rotary`.

    GGUF files carry some scalings as tensors, which a model file hands over while loading:
    `rope_freqs.weight` (Llama 3) to `set_frequency_factors`; `rope_factors_long.weight` and
    `rope_factors_short.weight` (LongRoPE, with `config.rope_scaling_from_gguf`'s longrope scaling)
    to `set_longrope_factors`, one call each, without which such a model has no tables."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self._longrope_factors: dict[str, tuple[float, ...]] = {}  # GGUF tensors received so far
        if scaling is not None and scaling.rope_type == "longrope" and not scaling.long_factor:
            # no tables until set_longrope_factors; forward refuses to run without them
            self.register_buffer("inv_freq", torch.empty(0), persistent=False)
            self.register_buffer("cos", torch.empty(0, head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(0, head_dim), persistent=False)
        else:
            self._build_cache(rope_inv_freq(head_dim, theta, scaling, max_positions),
                              1.0 if scaling is None else scaling.attention_scaling)

    def set_frequency_factors(self, factors: torch.Tensor) -> None:
        """GGUF `rope_freqs`: per-frequency divisors that llama.cpp applies instead of rope scaling."""
        device = self.inv_freq.device  # the model's: load_model calls this outside its device context
        self._build_cache(rope_inv_freq(self.head_dim, self.theta, None).to(device) / factors.float().to(device), 1.0)

    def set_longrope_factors(self, name: str, factors: torch.Tensor) -> None:
        """GGUF `rope_factors_long.weight` / `rope_factors_short.weight` ([head_dim / 2] each, in
        either order): LongRoPE's per-frequency divisors. The tables are built once both are in
        (`max_positions` picks one set)."""
        key = LONGROPE_TENSORS.get(name)
        if key is None:
            raise CheckpointError(f"{name!r} is not a longrope factor tensor ({', '.join(LONGROPE_TENSORS)})")
        if self.scaling is None or self.scaling.rope_type != "longrope":
            raise CheckpointError(f"{name} needs longrope rope scaling "
                                  f"(this model's: {self.scaling.rope_type if self.scaling else 'none'})")
        self._longrope_factors[key] = tuple(factors.float().flatten().tolist())
        if len(self._longrope_factors) < len(LONGROPE_TENSORS):
            return
        self.scaling = replace(self.scaling, **self._longrope_factors)
        device = self.inv_freq.device  # the model's: load_model calls this outside its device context
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, self.max_positions)
        self._build_cache(inv_freq.to(device), self.scaling.attention_scaling)

    def _build_cache(self, inv_freq: torch.Tensor, scale: float) -> None:
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(t, inv_freq)
        # Full-width tables for the rotate-half layout: cos over both halves, sin negated on the
        # first half, so a rotation is x * cos + roll(x, half) * sin (4 ops instead of 8). `scale`
        # (the attention scaling) is folded in, as transformers folds it into its cos and sin.
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin of shape [T, 1, head_dim] (broadcast over heads)."""
        if not self.cos.shape[0]:
            raise CheckpointError("longrope rope scaling without its factors: the model file must pass both "
                                  "rope_factors_long / rope_factors_short tensors to set_longrope_factors")
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in the rotate-half layout ([x1, x2] -> [x1 cos - x2 sin,
    x2 cos + x1 sin]) with the tables of RotaryEmbedding.forward; computed in float32."""
    if x.dtype == torch.float32:
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
    h = x.float()
    return (h * cos + h.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)
