"""Rotary position embeddings (NeoX / HF `rotate_half` layout), with Llama-3 frequency scaling.

GGUF files of the llama architecture store Q/K rows permuted for GGML's interleaved rope; the
llama model file un-permutes them at load, so one rotary layout serves every checkpoint.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.config import RopeScaling


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if scaling is None:
        return inv_freq
    # Llama 3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_medium, blended, out)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position; `forward(positions)` gathers the rows of one batch once,
    and every layer applies them with `apply_rotary`."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self._build_cache()

    def set_frequency_factors(self, factors: torch.Tensor) -> None:
        """GGUF `rope_freqs`: per-frequency divisors that llama.cpp applies instead of rope scaling."""
        device = self.inv_freq.device  # the model's: load_model calls this outside its device context
        self.inv_freq = rope_inv_freq(self.head_dim, self.theta, None).to(device) / factors.float().to(device)
        self._build_cache()

    def _build_cache(self) -> None:
        t = torch.arange(self.max_positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        # Full-width tables for the rotate-half layout: cos over both halves, sin negated on the
        # first half, so a rotation is x * cos + roll(x, half) * sin (4 ops instead of 8).
        cos, sin = freqs.cos(), freqs.sin()
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin of shape [T, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] in the rotate-half layout ([x1, x2] -> [x1 cos - x2 sin,
    x2 cos + x1 sin]) with the tables of RotaryEmbedding.forward; computed in float32."""
    if x.dtype == torch.float32:
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
    h = x.float()
    return (h * cos + h.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)
