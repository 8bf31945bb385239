"""GGUF quantized blocks -> `quant.BlockQuant` (W = d u + m per group of 32), without going
through float weights.

  Q4_0   32-block: w = d (q - 8)             4 bits: u = q, m = -8 d
  Q4_1   32-block: w = d q + m               4 bits: u = q
  Q4_K   32-sub-block: w = d sc q - dmin mn  4 bits: u = q, scale d sc, offset -dmin mn
  Q5_0   w = d (lo + 16 hi - 16)             8 bits: u = lo + 16 hi, m = -16 d
  Q5_1   w = d (lo + 16 hi) + m              8 bits: u = lo + 16 hi
  Q5_K   w = d sc (lo + 16 hi) - dmin mn     8 bits: u = lo + 16 hi, scale d sc, offset -dmin mn
  Q8_0   w = d q, q int8                     8 bits: u = q + 128, m = -128 d

Exact for every type whose scales are fp16 numbers (all but the K-quants, whose sub-block products
d sc and dmin mn are rounded to fp16: relative error <= 2^-11). Every other quantized type (Q6_K
with 16-element sub-blocks, Q2_K, Q3_K, IQ4_NL, IQ4_XS) has no such form: `gguf_to_blocks` returns
None and the caller requantizes the dequantized values to 8 bits per group of 32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.checkpoint import GGUFBlocks
from tokenmill.layers.quant import BlockQuant

FOUR_BIT_TYPES = frozenset(["Q4_0", "Q4_1", "Q4_K"])
EIGHT_BIT_TYPES = frozenset(["Q5_0", "Q5_1", "Q5_K", "Q8_0"])


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


def _blocks(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> BlockQuant:
    n = u.shape[0]
    return BlockQuant(u.reshape(n, -1), d.reshape(n, -1), m.reshape(n, -1), bits)


def _q4_0(b: torch.Tensor) -> BlockQuant:
    d = _f16(b[..., 0:2])
    return _blocks(_nibbles(b[..., 2:18]), d, -8 * d, 4)


def _q4_1(b: torch.Tensor) -> BlockQuant:
    return _blocks(_nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4)


def _q5_0(b: torch.Tensor) -> BlockQuant:
    d = _f16(b[..., 0:2])
    return _blocks(_nibbles(b[..., 6:22]) + 16 * _bits32(b[..., 2:6]), d, -16 * d, 8)


def _q5_1(b: torch.Tensor) -> BlockQuant:
    return _blocks(_nibbles(b[..., 8:24]) + 16 * _bits32(b[..., 4:8]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 8)


def _q8_0(b: torch.Tensor) -> BlockQuant:
    d = _f16(b[..., 0:2])
    u = (b[..., 2:34].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return _blocks(u, d, -128 * d, 8)


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


def _q4_k(b: torch.Tensor) -> BlockQuant:
    scale, mins = _k_scales(b)
    return _blocks(_k_low_nibbles(b[..., 16:144]), scale, -mins, 4)


def _q5_k(b: torch.Tensor) -> BlockQuant:
    scale, mins = _k_scales(b)
    qh = b[..., 16:48]  # bit j of byte l: the fifth bit of sub-block j, element l
    hi = (qh[..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
    return _blocks(_k_low_nibbles(b[..., 48:176]) + 16 * hi, scale, -mins, 8)


# qtype -> (bytes per block, decoder of [N, blocks, bytes] -> BlockQuant)
_DECODERS: dict[str, tuple[int, Callable[[torch.Tensor], BlockQuant]]] = {
    "Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q5_0": (22, _q5_0), "Q5_1": (24, _q5_1),
    "Q8_0": (34, _q8_0), "Q4_K": (144, _q4_k), "Q5_K": (176, _q5_k),
}


def gguf_to_blocks(blocks: GGUFBlocks) -> BlockQuant | None:
    """The BlockQuant form of `blocks`, or None for types that have none."""
    if blocks.qtype not in _DECODERS:
        return None
    block_bytes, decode = _DECODERS[blocks.qtype]
    n = blocks.shape[0]
    return decode(blocks.data.view(n, -1, block_bytes))
