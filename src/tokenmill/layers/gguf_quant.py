"""GGUF quantized blocks -> int4 planes (`quant.Int4Planes`), without going through float weights.

Exact forms (W equals the `gguf` package's dequantization, up to float32 rounding of the scales):

  Q4_0   32-block: w = d (q - 8)             one plane: scale d, zero 0
  Q4_1   32-block: w = d q + m               one plane: scale d, zero m + 8d
  Q4_K   32-sub-block: w = d sc q - dmin m   one plane: scale d sc, zero 8 d sc - dmin m
  Q5_0   w = d (lo + 16 hi - 16)             low plane: scale d, zero -8d;
                                             high plane: q = hi + 8, scale 16d, zero 0
  Q5_1   w = d (lo + 16 hi) + m              low: scale d, zero 8d + m; high as Q5_0
  Q5_K   w = d sc (lo + 16 hi) - dmin m      low: scale d sc, zero 8 d sc - dmin m; high: 16 d sc
  Q8_0   w = d q, q + 128 = lo + 16 hi       low: scale d, zero 8d; high: q = hi, scale 16d, zero 0

(the high plane is stored so that q - 8 is the value times one: no large zero to cancel, which
keeps the bf16 rounding of zeros small). Every other quantized type (Q6_K with 16-element
sub-blocks, Q2_K, Q3_K, IQ4_NL, IQ4_XS) has no exact int4 group-32 form: `gguf_to_planes` returns
None and the caller requantizes the dequantized values to 8 bits per group of 32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.checkpoint import GGUFBlocks
from tokenmill.layers.quant import Int4Planes

ONE_PLANE_TYPES = frozenset(["Q4_0", "Q4_1", "Q4_K"])
TWO_PLANE_TYPES = frozenset(["Q5_0", "Q5_1", "Q5_K", "Q8_0"])


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes (last dim) -> float32 [...]: a little-endian fp16 field of a block."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: element j is byte j's low nibble, element j + 16 its high nibble."""
    return torch.cat([qs & 15, qs >> 4], -1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """A little-endian uint32 (4 bytes, last dim) -> its 32 bits, bit j at index j."""
    j = torch.arange(32)
    return (qh[..., j // 8] >> (j % 8).to(torch.uint8)) & 1


def _one_plane(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> Int4Planes:
    n = q.shape[0]
    return Int4Planes(q.reshape(n, -1), scale.reshape(n, -1), zero.reshape(n, -1), 1)


def _two_planes(lo: torch.Tensor, hi: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                hi_scale: torch.Tensor) -> Int4Planes:
    n = lo.shape[0]
    return Int4Planes(torch.cat([lo.reshape(n, -1), hi.reshape(n, -1)], 1),
                      torch.cat([scale.reshape(n, -1), hi_scale.reshape(n, -1)], 1),
                      torch.cat([zero.reshape(n, -1), torch.zeros_like(zero).reshape(n, -1)], 1), 2)


def _q4_0(b: torch.Tensor) -> Int4Planes:
    d = _f16(b[..., 0:2])
    return _one_plane(_nibbles(b[..., 2:18]), d, torch.zeros_like(d))


def _q4_1(b: torch.Tensor) -> Int4Planes:
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return _one_plane(_nibbles(b[..., 4:20]), d, m + 8 * d)


def _q5_0(b: torch.Tensor) -> Int4Planes:
    d = _f16(b[..., 0:2])
    return _two_planes(_nibbles(b[..., 6:22]), _bits32(b[..., 2:6]) + 8, d, -8 * d, 16 * d)


def _q5_1(b: torch.Tensor) -> Int4Planes:
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return _two_planes(_nibbles(b[..., 8:24]), _bits32(b[..., 4:8]) + 8, d, 8 * d + m, 16 * d)


def _q8_0(b: torch.Tensor) -> Int4Planes:
    d = _f16(b[..., 0:2])
    u = (b[..., 2:34].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return _two_planes(u & 15, u >> 4, d, 8 * d, 16 * d)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K super-block -> per-sub-block (d * sc, dmin * m), float32 [..., 8].

    The 12 scale bytes hold 8 six-bit scales and 8 six-bit mins (llama.cpp's get_scale_min_k4):
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the
    nibbles of bytes 8-11 plus the top 2 bits of bytes 0-3 / 4-7."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    s = b[..., 4:16]
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return d[..., None] * sc.float(), dmin[..., None] * m.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes -> 8 sub-blocks of 32: chunk c (32 bytes) holds sub-block 2c in its low nibbles
    and sub-block 2c + 1 in its high nibbles."""
    chunks = qs.unflatten(-1, (4, 32))
    return torch.stack([chunks & 15, chunks >> 4], -2).flatten(-3, -2)  # [..., 8, 32]


def _q4_k(b: torch.Tensor) -> Int4Planes:
    scale, mins = _k_scales(b)
    return _one_plane(_k_low_nibbles(b[..., 16:144]), scale, 8 * scale - mins)


def _q5_k(b: torch.Tensor) -> Int4Planes:
    scale, mins = _k_scales(b)
    qh = b[..., 16:48]  # bit j of byte l: the fifth bit of sub-block j, element l
    hi = (qh[..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    return _two_planes(_k_low_nibbles(b[..., 48:176]), hi + 8, scale, 8 * scale - mins, 16 * scale)


# qtype -> (bytes per block, decoder of [N, blocks, bytes] -> planes)
_DECODERS: dict[str, tuple[int, Callable[[torch.Tensor], Int4Planes]]] = {
    "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q5_0": (22, _q5_0), "Q5_1": (24, _q5_1),
    "Q8_0": (34, _q8_0), "Q4_K": (144, _q4_k), "Q5_K": (176, _q5_k),
}


def gguf_to_planes(blocks: GGUFBlocks) -> Int4Planes | None:
    """The exact int4-plane form of `blocks`, or None for types that have none."""
    if blocks.qtype not in _DECODERS:
        return None
    block_bytes, decode = _DECODERS[blocks.qtype]
    n = blocks.shape[0]
    return decode(blocks.data.view(n, -1, block_bytes))
