"""Weight-only quantized weights for CPU, run by PyTorch's weight-only matmul kernels.

Two packed forms, each an `nn.Module` that a `Linear` or `Embedding` holds instead of a dense weight:

- `Int4Weight`: `torch._weight_int4pack_mm_for_cpu`, 4-bit values with a scale and a zero per
  group of 32 inputs: W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n], q in 0..15, g = k // 32.
  A 32-block of Q4_0 / Q4_1 or a Q4_K sub-block is exactly one group.
- `Int8Weight`: `torch._weight_int8pack_mm`, int8 values with one scale per output row
  (`quantization="int8"` of dense weights).

Planes. A weight with more than 4 bits per value (Q5_*, Q8_0, 8-bit requantization) is split into
two 4-bit planes, the low nibble and the high bits, laid side by side along the input dimension:
W' = [W_lo | W_hi] (K' = 2K), and the input is duplicated, x' = [x | x], so one kernel call gives
x' W'^T = x W_lo^T + x W_hi^T = x W^T. It reads 8.5 bits per weight, as fast as the int8 kernel at
one row, and keeps the per-32 scales of Q8_0 (the int8 kernel has one scale per row, which would
mean requantizing).

Both kernels take bfloat16 activations and bfloat16 scales (they run 10-60x slower with float32
activations): an fp32 model converts at the op boundary, and scales/zeros are rounded to bf16
(a relative error of at most 2^-9 on each scale, like storing the weight in bf16). Quantizers
below choose the values against the rounded scales, so their error bound holds exactly.

Kernel by batch rows. The weight-only kernels win while a step reads more weight bytes than it
does arithmetic; from `DENSE_MIN_ROWS` rows on (prefill chunks) the weight is dequantized to the
activation dtype for the step and multiplied densely, which is faster here (see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

GROUP_SIZE = 32
# From this many rows on (prefill chunks), a step dequantizes the weight and multiplies densely:
# the crossover measured (one thread, AVX-512 Xeon, SmolLM2 shapes): ~192 rows for one plane, ~128 for two.
DENSE_MIN_ROWS = {1: 192, 2: 128}
LOGITS_REFINE_TOP_K = 64  # LM heads: the top candidates' logits are recomputed in float32
# Activation and scale dtype of the kernels. bfloat16 is the fast path; float32 is the kernels' exact
# (slow) reference path, which tests use to check a whole model against its dequantized weights.
KERNEL_DTYPE = torch.bfloat16
# Inside an engine step, the prompt rows of a request whose prompt has at least this many tokens take
# the dense path; every other row (generated tokens, short prompts) takes the kernel. See step_rows().
DENSE_MIN_PROMPT = 128


# ------------------------------------------------------------------------- which rows take which path


class _StepRows(threading.local):
    num_rows = -1                           # rows of the step being run; -1 outside a step
    dense: torch.Tensor | None = None       # row indices for the dense path (None: no row)
    kernel: torch.Tensor | None = None      # row indices for the kernel (None: no row)


_step = _StepRows()


@contextmanager
def step_rows(dense: list[bool]) -> Iterator[None]:
    """Run one model step whose row i takes the dense path iff dense[i].

    The two paths round differently (the kernels use bf16 activations and round their output to
    bf16), so choosing by the step's row count would make a request's tokens depend on what it is
    batched with. The runner instead decides each row from its own request alone (see
    DENSE_MIN_PROMPT); both kernels give each row the same bits whatever the other rows are."""
    n = len(dense)
    num_dense = sum(dense)
    _step.num_rows = n
    _step.dense = None if num_dense == 0 else torch.tensor([i for i in range(n) if dense[i]])
    _step.kernel = None if num_dense == n else torch.tensor([i for i in range(n) if not dense[i]])
    try:
        yield
    finally:
        _step.num_rows, _step.dense, _step.kernel = -1, None, None


def _routed(x2: torch.Tensor, dense_mm: Callable[[torch.Tensor], torch.Tensor],
            kernel_mm: Callable[[torch.Tensor], torch.Tensor], dense_min_rows: int) -> torch.Tensor:
    """x2 @ W^T with each row on the path step_rows() chose for it; outside a step (or for a call
    on other rows than the step's), by row count."""
    if _step.num_rows != x2.shape[0]:
        return dense_mm(x2) if x2.shape[0] >= dense_min_rows else kernel_mm(x2)
    if _step.dense is None:
        return kernel_mm(x2)
    if _step.kernel is None:
        return dense_mm(x2)
    dense = dense_mm(x2[_step.dense])
    y = dense.new_empty(x2.shape[0], dense.shape[1])
    y[_step.dense] = dense
    y[_step.kernel] = kernel_mm(x2[_step.kernel])
    return y


# ---------------------------------------------------------------------------------------- planes


@dataclass
class Int4Planes:
    """An unpacked int4 weight (the loader's working form, before packing).

    W[n, k] = sum over planes p of (q[n, pK + k] - 8) * scale[n, (pK + k) // 32] + zero[n, (pK + k) // 32].
    """

    q: torch.Tensor       # uint8 [N, P*K], values 0..15
    scale: torch.Tensor   # float32 [N, P*K/32]
    zero: torch.Tensor    # float32 [N, P*K/32]
    num_planes: int

    @property
    def in_features(self) -> int:
        return self.q.shape[1] // self.num_planes

    def with_planes(self, num_planes: int) -> Int4Planes:
        """The same weight with extra all-zero planes (q = 8, scale = zero = 0): exact."""
        extra = num_planes - self.num_planes
        if extra == 0:
            return self
        n, groups = self.scale.shape[0], self.scale.shape[1] // self.num_planes
        return Int4Planes(
            torch.cat([self.q, self.q.new_full((n, extra * self.in_features), 8)], 1),
            torch.cat([self.scale, self.scale.new_zeros(n, extra * groups)], 1),
            torch.cat([self.zero, self.zero.new_zeros(n, extra * groups)], 1),
            num_planes,
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], computed with the float32 scales."""
        n = self.q.shape[0]
        w = (self.q.float() - 8).view(n, -1, GROUP_SIZE) * self.scale[..., None] + self.zero[..., None]
        return w.view(n, self.num_planes, self.in_features).sum(1)

    @staticmethod
    def cat(parts: list[Int4Planes]) -> Int4Planes:
        """Stack along output rows (fused projections); all parts must have the same plane count."""
        return Int4Planes(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), parts[0].num_planes)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def quantize_planes(w: torch.Tensor, bits: int) -> Int4Planes:
    """Asymmetric `bits`-bit quantization (4: one plane, 8: two planes) per group of 32 inputs.

    Scale and zero are rounded to bf16 first and the values chosen against them, so every weight is
    within half a step (scale) of its value, up to the bf16 rounding of the zero."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    n, k = w.shape
    g = w.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = g.amin(-1), g.amax(-1)
    levels, offset = (15, 8) if bits == 4 else (255, 136)  # 136: (lo - 8) + 16 * (hi - 8) = u - 136
    scale = _bf16((hi - lo) / levels)
    zero = _bf16(lo + offset * scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = torch.round((g - zero[..., None]) / safe[..., None]) + offset
    u = u.clamp_(0, levels).to(torch.uint8).view(n, k)
    if bits == 4:
        return Int4Planes(u, scale, zero, 1)
    return Int4Planes(torch.cat([u & 15, u >> 4], 1), torch.cat([scale, 16 * scale], 1),
                      torch.cat([zero, torch.zeros_like(zero)], 1), 2)


# ------------------------------------------------------------------------------- packed layout


@functools.cache
def int4_layout() -> tuple[int, bool] | None:
    """How `_convert_weight_to_int4pack_for_cpu` lays out the packed weight on this CPU, or None if
    it is not the layout we know (then int4 weights are not used: gathers and dense fallbacks read
    the packed bytes).

    Rows are packed in blocks of `block_n` (64 with AVX-512, 32 otherwise; the last block may be
    narrower), each block stored [K, width/2] bytes. In a full block with `split` (AVX-512/AVX2),
    byte j holds rows j (low nibble) and j + block_n/2 (high); otherwise rows 2j and 2j+1.
    """
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    layout = {"AVX512": (64, True), "AVX2": (32, True)}.get(capability, (32, False))
    probe = torch.arange(80 * 64).reshape(80, 64) * 7 % 16
    try:
        packed = torch._convert_weight_to_int4pack_for_cpu(probe.to(torch.int32), 1)
    except RuntimeError:
        return None
    if not torch.equal(_unpack_t(packed, 80, 64, layout).t(), probe.to(torch.uint8)):
        return None
    return layout


def _unpack_t(packed: torch.Tensor, n: int, k: int, layout: tuple[int, bool]) -> torch.Tensor:
    """The 4-bit values of a packed [n, k] weight, transposed: uint8 [k, n]."""
    block_n, split = layout
    flat = packed.reshape(-1)
    n_full = n // block_n * block_n
    parts = []
    if n_full:
        b = flat[: n_full * k // 2].view(n_full // block_n, k, block_n // 2)
        lo, hi = b & 15, b >> 4
        q = torch.cat([lo, hi], 2) if split else torch.stack([lo, hi], 3).flatten(2)
        parts.append(q.permute(1, 0, 2).reshape(k, n_full))
    if n_full < n:
        t = flat[n_full * k // 2:].view(k, (n - n_full) // 2)
        parts.append(torch.stack([t & 15, t >> 4], 2).flatten(1))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def _unpack_rows(packed: torch.Tensor, n: int, k: int, rows: torch.Tensor,
                 layout: tuple[int, bool]) -> torch.Tensor:
    """The 4-bit values of rows `rows` of a packed [n, k] weight: uint8 [len(rows), k]."""
    block_n, split = layout
    half = block_n // 2
    n_full = n // block_n * block_n
    r = rows % block_n
    in_full = rows < n_full
    if split:
        base_full, shift_full = rows // block_n * (block_n * k // 2) + r % half, r // half * 4
    else:
        base_full, shift_full = rows // block_n * (block_n * k // 2) + r // 2, r % 2 * 4
    tail = rows - n_full
    base = torch.where(in_full, base_full, n_full * k // 2 + tail // 2)
    stride = torch.where(in_full, half, max((n - n_full) // 2, 1))
    shift = torch.where(in_full, shift_full, tail % 2 * 4)
    index = base[:, None] + stride[:, None] * torch.arange(k, device=rows.device)
    return (packed.reshape(-1)[index] >> shift[:, None].to(torch.uint8)) & 15


# -------------------------------------------------------------------------------- weight forms


class Int4Weight(nn.Module):
    """A [N, K] weight packed for `_weight_int4pack_mm_for_cpu` (one or two planes).

    Rows are padded to a multiple of 16 (the kernel's smallest row block); padding rows are zero.
    """

    def __init__(self, planes: Int4Planes, dtype: torch.dtype):
        super().__init__()
        layout = int4_layout()
        if layout is None:
            raise RuntimeError("this PyTorch build's int4 CPU weight layout is unknown")
        self.layout = layout
        self.dtype = dtype
        self.num_planes = planes.num_planes
        self.out_features, self.in_features = planes.q.shape[0], planes.in_features
        pad = -self.out_features % 16
        q, scale, zero = planes.q, planes.scale, planes.zero
        if pad:
            q = torch.cat([q, q.new_full((pad, q.shape[1]), 8)])
            scale, zero = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, zero))
        chunks = [torch._convert_weight_to_int4pack_for_cpu(c.to(torch.int32), 1).reshape(-1)
                  for c in q.split(4096)]  # 4096 rows: a whole number of row blocks per chunk
        self.packed = nn.Parameter(torch.cat(chunks).view(q.shape[0], q.shape[1] // 2), requires_grad=False)
        self.scales_zeros = nn.Parameter(torch.stack([scale, zero], -1).transpose(0, 1).to(KERNEL_DTYPE)
                                         .contiguous(), requires_grad=False)  # [K'/32, N, 2]

    def extra_repr(self) -> str:
        return f"out={self.out_features}, in={self.in_features}, planes={self.num_planes}"

    def _scale_zero(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sz = self.scales_zeros[:, rows].float()  # [K'/32, rows, 2]
        return sz[..., 0], sz[..., 1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the kernel multiplies by (bf16 scales), [N, K]."""
        return self.dequantize_t(dtype).t()

    def dequantize_t(self, dtype: torch.dtype) -> torch.Tensor:
        """W^T [K, N] (the layout a dense `mm` wants), in `dtype`.

        Written for speed (it runs per step on the dense path): each plane's nibbles are scaled
        straight from uint8 into the float32 output, and all planes' offsets are added at once:
        W = sum_p q_p s_p + sum_p (z_p - 8 s_p)."""
        n_pad, k, groups = self.packed.shape[0], self.in_features, self.in_features // GROUP_SIZE
        sz = self.scales_zeros.float()
        scale = sz[..., 0].view(self.num_planes, groups, 1, n_pad)
        offset = (sz[..., 1] - 8 * sz[..., 0]).view(self.num_planes, groups, 1, n_pad).sum(0)
        out = torch.empty(groups, GROUP_SIZE, n_pad)
        for p in range(self.num_planes):
            for cols, nibbles in self._nibbles_by_columns(p):
                if p == 0:
                    cols(out).copy_(nibbles)  # uint8 -> float32 (measured faster than one addcmul here)
                else:
                    cols(out).addcmul_(nibbles, cols(scale[p]))
            if p == 0:
                out.mul_(scale[0])
        return out.add_(offset).view(k, n_pad)[:, : self.out_features].to(dtype)

    def _nibbles_by_columns(self, plane: int):
        """Plane `plane`'s values as (view of output columns, uint8 [K/32, 32, *cols]) pairs: the
        packed layout's row blocks turned into column views of W^T (see `int4_layout`)."""
        block_n, split = self.layout
        n_pad, kp, k = self.packed.shape[0], self.packed.shape[1] * 2, self.in_features
        groups, half = k // GROUP_SIZE, block_n // 2
        flat = self.packed.view(-1)
        n_full = n_pad // block_n * block_n
        if n_full:
            b = flat[: n_full * kp // 2].view(n_full // block_n, kp, half)[:, plane * k:(plane + 1) * k]
            b = b.permute(1, 0, 2).reshape(groups, GROUP_SIZE, n_full // block_n, half)
            def full(t: torch.Tensor, j: int) -> torch.Tensor:  # noqa: E306 - column view j of each block
                blocks = t[..., :n_full].unflatten(-1, (n_full // block_n, block_n))
                return blocks[..., j * half:(j + 1) * half] if split else blocks.unflatten(-1, (half, 2))[..., j]
            yield (lambda t: full(t, 0)), b & 15
            yield (lambda t: full(t, 1)), b >> 4
        if n_full < n_pad:  # the last, narrower block: byte j holds rows 2j and 2j + 1
            t = flat[n_full * kp // 2:].view(kp, (n_pad - n_full) // 2)[plane * k:(plane + 1) * k]
            t = t.reshape(groups, GROUP_SIZE, -1)
            yield (lambda x: x[..., n_full:].unflatten(-1, (-1, 2))[..., 0]), t & 15
            yield (lambda x: x[..., n_full:].unflatten(-1, (-1, 2))[..., 1]), t >> 4

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantized rows `ids` (an embedding lookup), [*ids.shape, K] in `dtype` (default: the
        compute dtype)."""
        flat = ids.reshape(-1)
        q = _unpack_rows(self.packed, self.packed.shape[0], self.packed.shape[1] * 2, flat, self.layout)
        scale, zero = self._scale_zero(flat)  # [K'/32, T]
        w = (q.view(len(flat), -1, GROUP_SIZE).to(torch.float32) - 8) * scale.t()[..., None] + zero.t()[..., None]
        w = w.view(len(flat), self.num_planes, self.in_features).sum(1)
        return w.view(*ids.shape, self.in_features).to(dtype or self.dtype)

    def kernel_mm(self, x2: torch.Tensor) -> torch.Tensor:
        xb = x2.to(self.scales_zeros.dtype)
        if self.num_planes > 1:
            xb = xb.repeat(1, self.num_planes)
        y = torch._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP_SIZE, self.scales_zeros)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        return y.to(x2.dtype)

    def dense_mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.mm(x2, self.dequantize_t(x2.dtype))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = _routed(x2, self.dense_mm, self.kernel_mm, DENSE_MIN_ROWS[self.num_planes])
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], self.out_features)


class Int8Weight(nn.Module):
    """A [N, K] weight as int8 with one bf16 scale per row, for `_weight_int8pack_mm`."""

    def __init__(self, w: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.out_features, self.in_features = w.shape
        w = w.float()
        scale = _bf16(w.abs().amax(1) / 127)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w / safe[:, None]).clamp_(-128, 127).to(torch.int8)
        self.qweight = nn.Parameter(q, requires_grad=False)
        self.scales = nn.Parameter(scale.to(KERNEL_DTYPE), requires_grad=False)

    def extra_repr(self) -> str:
        return f"out={self.out_features}, in={self.in_features}"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return (self.qweight[ids].float() * self.scales[ids].float()[..., None]).to(dtype or self.dtype)

    def kernel_mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x2.to(self.scales.dtype), self.qweight, self.scales).to(x2.dtype)

    def dense_mm(self, x2: torch.Tensor) -> torch.Tensor:
        return torch.mm(x2, self.dequantize(x2.dtype).t())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        # int8: as much unpacking per row as two int4 planes
        y = _routed(x2, self.dense_mm, self.kernel_mm, DENSE_MIN_ROWS[2])
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], self.out_features)


QuantizedWeight = Int4Weight | Int8Weight


def quantized_logits(weight: QuantizedWeight, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits hidden @ W^T of a quantized LM head.

    The kernels round their output to bf16: logits of magnitude 16-32 land on a grid of 0.125, so
    close candidates tie and greedy picks differ from the float32 reference. The top
    `LOGITS_REFINE_TOP_K` candidates of each row are therefore recomputed in float32 from their
    dequantized rows (the same weight values), which makes greedy choice and the top of the
    distribution exact for the quantized weight; the tail keeps bf16 precision. Always the kernel,
    whatever the number of rows, so a row's logits do not depend on its batch.
    """
    logits = weight.kernel_mm(hidden).float()
    top = logits.topk(min(LOGITS_REFINE_TOP_K, logits.shape[-1]), dim=-1).indices  # [B, k]
    rows = weight.rows(top, torch.float32)                                          # [B, k, K]
    exact = torch.bmm(rows, hidden.float()[:, :, None]).squeeze(-1)
    return logits.scatter_(1, top, exact)
