"""Block-quantized weights for CPU, multiplied by the C kernel in kernels/quant_matmul.c.

One form holds every quantized weight: unsigned values u of 4 or 8 bits in groups of 32 inputs,
each group of each output row with its own scale d and offset m,

    W[n, k] = d[n, g] * u[n, k] + m[n, g],   g = k // 32,   d and m stored as fp16.

GGUF Q4_0/Q4_1/Q4_K blocks are exactly this with 4 bits, Q5_0/Q5_1/Q5_K/Q8_0 with 8 bits (see
layers/gguf_quant.py); other GGUF types and dense checkpoints (`quantization="int8"|"int4"`) are
quantized to it at load (`quantize`). A symmetric weight, every m = -z d for one integer z (Q4_0: 8,
Q5_0: 16, Q8_0: 128), is held without its offsets (`zero_point`): the kernels form m from d, exactly.

The kernel splits each row of activations, per group of 32, into two int8 planes (x ~ dx (254 hi +
lo): 16-bit precision; SmolLM2's mean KL to the float model 1.0e-7, where llama.cpp's plain int8
activations reach 4.7e-3), sums u8 x s8 products with AVX-512 VNNI (a portable C loop elsewhere)
and returns the dequantized weight times the quantized activations, to float32 rounding. Here it runs
2-6x faster than a dense fp32 matmul at 1-32 rows and within 0.6-1.1x of it at 512-row prefill
chunks, from 1/6 of the bytes, so every row of every step takes it. Each row's output depends on
that row alone, so a request's tokens do not depend on what it is batched with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill import kernels

GROUP_SIZE = 32
TILE_ROWS = 16  # output rows per tile of the packed layout (one AVX-512 register of fp32 lanes)


def kernel_available() -> bool:
    return kernels.load() is not None


@dataclass
class BlockQuant:
    """An unpacked quantized weight (the loader's working form): W = d * u + m per group of 32."""

    u: torch.Tensor       # uint8 [N, K], values < 2**bits
    d: torch.Tensor       # float32 [N, K/32], fp16 values
    m: torch.Tensor       # float32 [N, K/32], fp16 values
    bits: int             # 4 or 8

    def __post_init__(self) -> None:
        # Scales and offsets are stored as fp16: GGUF's own scales already are (Q4_0/Q4_1/Q5_*/Q8_0
        # stay exact); K-quant sub-block products d * sc round with a relative error <= 2^-11.
        self.d, self.m = _f16(self.d), _f16(self.m)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.u.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.u.shape
        return (self.u.float().view(n, -1, GROUP_SIZE) * self.d[..., None] + self.m[..., None]).view(n, k)

    def widened(self, bits: int) -> BlockQuant:
        """The same weight in `bits` (4 -> 8 bits is exact: the values fit)."""
        if bits < self.bits:
            raise ValueError("cannot narrow a quantized weight")
        return self if bits == self.bits else BlockQuant(self.u, self.d, self.m, bits)

    @staticmethod
    def cat(parts: list[BlockQuant]) -> BlockQuant:
        """Stack along output rows (fused projections), in the widest part's bits."""
        bits = max(p.bits for p in parts)
        return BlockQuant(torch.cat([p.u for p in parts]), torch.cat([p.d for p in parts]),
                          torch.cat([p.m for p in parts]), bits)


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.float16).float()


def zero_point(q: BlockQuant) -> int | None:
    """z where every offset is exactly -z times its scale (z an integer in [0, 2^bits)), else None."""
    nonzero = q.d != 0
    if not bool(nonzero.any()):
        return 0 if not bool(q.m.any()) else None
    z = -float(q.m[nonzero][0] / q.d[nonzero][0])
    if not (z.is_integer() and 0 <= z < 2**q.bits):
        return None
    return int(z) if torch.equal(q.m, -z * q.d) else None


def quantize(w: torch.Tensor, bits: int) -> BlockQuant:
    """Asymmetric `bits`-bit quantization per group of 32 inputs (K must be a multiple of 32).

    Scale and offset are rounded to fp16 first and the values chosen against them, so every weight is
    within half a step of its value, up to the fp16 rounding of the offset."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = g.amin(-1), g.amax(-1)
    levels = 2**bits - 1
    d, m = _f16((hi - lo) / levels), _f16(lo)
    safe = torch.where(d > 0, d, torch.ones_like(d))
    u = torch.round((g - m[..., None]) / safe[..., None]).clamp_(0, levels).to(torch.uint8)
    return BlockQuant(u.view(n, k), d, m, bits)


class QuantWeight(nn.Module):
    """A [N, K] weight packed for kernels/quant_matmul.c (its layout is described there); `offsets` is
    None for a symmetric weight, whose offsets are -zero * scales. `int8_activations`: the kernel rounds
    the activations it multiplies to one int8 plane per group instead of two (EngineConfig's
    activation_precision; set by the loader)."""

    int8_activations: bool = False

    def __init__(self, q: BlockQuant, dtype: torch.dtype):
        super().__init__()
        n, k = q.u.shape
        if k % GROUP_SIZE:
            raise ValueError(f"in_features {k} is not a multiple of {GROUP_SIZE}")
        pad, groups = -n % TILE_ROWS, k // GROUP_SIZE
        u, d, m = q.u, q.d, q.m
        if pad:  # zero rows (d = m = 0) complete the last tile
            u = torch.cat([u, u.new_zeros(pad, k)])
            d, m = (torch.cat([t, t.new_zeros(pad, groups)]) for t in (d, m))
        tiles = u.shape[0] // TILE_ROWS
        if q.bits == 8:  # [tile, group, chunk of 4 inputs, row, 4]
            packed = u.view(tiles, TILE_ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4)
        else:  # [tile, group, j, row, 4 inputs]: chunk j in the low nibble, chunk j + 4 in the high
            v = u.view(tiles, TILE_ROWS, groups, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)
            packed = v[..., 0] | (v[..., 1] << 4)
        def per_tile(t: torch.Tensor) -> torch.Tensor:   # [tiles, groups, 16] fp16
            return t.view(tiles, TILE_ROWS, groups).transpose(1, 2).to(torch.float16).contiguous()

        zero = zero_point(q)   # (a symmetric weight's offsets are not laid out: the kernels derive them)
        self._hold(packed.contiguous().view(-1), per_tile(d), per_tile(m) if zero is None else None, zero, n, k,
                   q.bits, dtype)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                    zero: int | None, out_features: int, in_features: int, bits: int,
                    dtype: torch.dtype) -> QuantWeight:
        """A weight packed before (its `packed`, `scales`, `offsets` or `zero` saved: models/weight_cache.py)."""
        weight = cls.__new__(cls)
        nn.Module.__init__(weight)
        weight._hold(packed, scales, offsets, zero, out_features, in_features, bits, dtype)
        return weight

    def _hold(self, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, zero: int | None,
              out_features: int, in_features: int, bits: int, dtype: torch.dtype) -> None:
        if (offsets is None) == (zero is None):
            raise ValueError("a quantized weight has either offsets or a zero point")
        tiles, groups = -(-out_features // TILE_ROWS), in_features // GROUP_SIZE
        expected = {"packed": (packed, torch.uint8, (tiles * TILE_ROWS * in_features * bits // 8,)),
                    "scales": (scales, torch.float16, (tiles, groups, TILE_ROWS)),
                    "offsets": (offsets, torch.float16, (tiles, groups, TILE_ROWS))}
        for what, (t, want_dtype, want_shape) in expected.items():
            if t is not None and (t.dtype != want_dtype or tuple(t.shape) != want_shape):
                raise ValueError(f"{what}: {tuple(t.shape)} {t.dtype}, expected {want_shape} {want_dtype} for a "
                                 f"[{out_features}, {in_features}] {bits}-bit weight")
        self.dtype, self.bits, self.out_features, self.in_features = dtype, bits, out_features, in_features
        self.zero = zero
        self.packed, self.scales = (nn.Parameter(t, requires_grad=False) for t in (packed, scales))
        self.offsets = None if offsets is None else nn.Parameter(offsets, requires_grad=False)

    def extra_repr(self) -> str:
        zero = "" if self.zero is None else f", zero={self.zero}"
        activations = ", int8 activations" if self.int8_activations else ""
        return f"out={self.out_features}, in={self.in_features}, bits={self.bits}{zero}{activations}"

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup), [*ids.shape, K] in `dtype` (default: the
        compute dtype)."""
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.out_features):
            raise IndexError(f"row index out of range for a weight of {self.out_features} rows")
        out = kernels.quant_rows(self.plan(), ids)
        return out.view(*ids.shape, self.in_features).to(dtype or self.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the kernel multiplies by, [N, K]."""
        return self.rows(torch.arange(self.out_features), dtype)

    def matmul(self, x2: torch.Tensor) -> torch.Tensor:
        """float32 x2 @ W^T."""
        return kernels.quant_matmul(x2, self.plan())

    def plan(self) -> kernels.WeightPlan:
        """This weight as kernels.h's tm_weight (the caller keeps self alive)."""
        return kernels.WeightPlan(self.packed.data_ptr(), self.scales.data_ptr(), kernels.pointer(self.offsets),
                                  self.out_features, self.in_features, self.bits, self.zero or 0,
                                  int(self.int8_activations))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, gated: str | None = None,
               norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + f(x) @ W^T + bias, the input ops f (see `Linear.forward`) fused into the kernel's
        activation pass (float32 inside, the result in x's dtype)."""
        rows = x.reshape(-1, x.shape[-1])
        res = None if residual is None else residual.reshape(-1, self.out_features)
        y = kernels.quant_matmul(rows, self.plan(), gated, norm, res).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], self.out_features)
