"""Linear and Embedding layers whose weight is dense or quantized (`layers/quant.py`).

Parameters are created empty (no random init): every value is filled from the checkpoint. The
loader may then replace the dense weight by a quantized one (`set_quantized`), which the layer
runs with the quantized kernels; an Embedding's quantized weight also serves as a tied LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels, parallel
from tokenmill.config import cpu_has_fast_bf16
from tokenmill.layers.activation import GATED_ACTIVATIONS
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.op import KernelOp, invalidate_plans
from tokenmill.layers.quant import QuantWeight


def dense_matmul_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype `dense_linear` multiplies `weight`'s many-row products in: float32 for a bf16 CPU
    weight where the CPU has no bf16 units (PyTorch emulates a bf16 matmul there, several times
    slower than float32; the products of bf16 values are exact in float32, as in the kernel), else
    the weight's own."""
    if weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not cpu_has_fast_bf16():
        return torch.float32
    return weight.dtype


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 kernel: bool = True) -> torch.Tensor:
    """x W^T (+ b) for a dense weight, in x's dtype: a bf16 CPU weight's few-row products (decode
    steps) run the C kernel where `kernel` (kernels.bf16_matmul: PyTorch's are far slower there),
    everything else `F.linear` in `dense_matmul_dtype`."""
    if kernel and kernels.uses_bf16_matmul(x, weight):
        y = kernels.bf16_matmul(x, weight)
        return (y if bias is None else y + bias).to(x.dtype)
    dtype = dense_matmul_dtype(weight)
    if dtype != weight.dtype:
        return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).to(x.dtype)
    return F.linear(x, weight, bias)


class _Weighted(KernelOp):
    """A layer holding a [N, K] weight, dense (`weight`) or quantized (`qweight`), that can also
    serve as an LM head. A quantized weight runs the quantized kernel (int8 activations); backend
    "torch" multiplies float activations by its dequantized values instead, which checks a whole
    model's plumbing (packing, fused shards, tied heads) without the activation rounding.

    Under tensor parallelism (tokenmill/parallel.py) a layer holds part of the checkpoint's weight:
    `rows` (column-parallel: per checkpoint shard, the output rows kept) or `cols` (row-parallel: the
    input columns kept; the outputs are summed over the ranks). `vocab_sizes`: a vocabulary-parallel
    LM head's (or tied embedding's) rows per rank, gathered on rank 0 by `logits`."""

    def __init__(self) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = None
        self.keep_dense = False
        self.qweight: QuantWeight | None = None  # an instance attribute: a class one would hide the submodule
        self.tp = parallel.current()
        self.rows: list[list[range]] | None = None
        self.cols: range | None = None
        self.vocab_sizes: list[int] | None = None

    def _vocab_rows(self, vocab_size: int) -> int:
        """Hold this rank's slice of a vocabulary of `vocab_size` rows; its size."""
        if self.tp.size == 1:
            return vocab_size
        parts = parallel.split(vocab_size, self.tp.size)
        self.rows, self.vocab_sizes = [[parts[self.tp.rank]]], [len(p) for p in parts]
        return len(parts[self.tp.rank])

    def set_quantized(self, qweight: QuantWeight) -> None:
        """Run with `qweight` instead of the dense weight (which is dropped); C plans that point at
        the old weight are rebuilt."""
        self.weight = None
        self.qweight = qweight
        invalidate_plans()

    def kernel_weight(self) -> QuantWeight | None:
        """The quantized weight the kernels run, for a C plan; None where this layer runs dense or its
        PyTorch reference (backend "torch"), or sums its output over tensor-parallel ranks that have
        no shared mapping to do it in C (ranks on several machines)."""
        return self.qweight if self._plannable() else None

    def plan_weight(self) -> kernels.WeightPlan | None:
        """This layer's weight as kernels.h's tm_weight for a C plan: the quantized one (kernel_weight),
        or a dense bfloat16 CPU weight (run by bf16_matmul, as `dense` runs it for a decode step's
        rows); None where neither applies (the caller keeps this layer alive)."""
        if self.qweight is not None:
            return self.qweight.plan() if self._plannable() else None
        w = self.weight
        if (self._plannable() and w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.is_contiguous()
                and kernels.load() is not None):
            return kernels.WeightPlan(w.data_ptr(), None, None, w.shape[0], w.shape[1], kernels.DENSE_BITS)
        return None

    def _plannable(self) -> bool:
        return self.backend == "auto" and (self.cols is None or self.tp.shm is not None)

    def dense(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b) for a dense weight, in x's dtype (`dense_linear`; the C kernel on backend "auto")."""
        return dense_linear(x, weight, bias, kernel=self.backend == "auto")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 hidden @ W^T for an LM head (no bias): an Embedding's for a tied head."""
        if self.qweight is None:
            logits = self.dense(hidden, self.weight).float()
        elif self.backend == "torch":
            logits = hidden.float() @ self.qweight.dequantize().t()
        else:
            logits = self.qweight.matmul(hidden)
        if self.vocab_sizes is None:
            return logits
        return parallel.gather_columns(logits, self.vocab_sizes, self.tp)


class Linear(_Weighted):
    """y = x W^T (+ b). `shard_sizes` marks a fused projection (q/k/v or gate/up): the loader fills
    each shard from its own checkpoint tensor, stacked along the output dimension. `keep_dense`: the
    loader never quantizes this layer (a MoE router, whose rounding would change which experts run).

    Sizes are the checkpoint's; `rows` / `cols` / `vocab_parallel` make this rank's part of it (see
    _Weighted). A row-parallel layer's bias (and the residual) is added on rank 0 only, before the
    all-reduce sums the ranks' parts."""

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool = False, keep_dense: bool = False,
                 *, rows: list[list[range]] | None = None, cols: range | None = None, vocab_parallel: bool = False):
        super().__init__()
        self.keep_dense = keep_dense
        sizes = out_features if isinstance(out_features, list) else [out_features]
        if vocab_parallel:
            sizes = [self._vocab_rows(sizes[0])]
        elif rows is not None and self.tp.size > 1:
            self.rows, sizes = rows, [sum(len(r) for r in shard) for shard in rows]
        if cols is not None and self.tp.size > 1:
            self.cols, in_features = cols, len(cols)
            bias = bias and self.tp.rank == 0
        self.shard_sizes = sizes
        self.weight = nn.Parameter(torch.empty(sum(sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(sizes)), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, gated: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + f(x) W^T + b, where the input ops f are, in order: `gated` (x is a fused
        [gate | up] projection: act(gate) * up, act "silu" or "gelu_tanh"), then `norm` (an RMSNorm).
        A quantized weight fuses them into its kernel's activation pass (one call instead of several
        dispatched ops); otherwise they run as the PyTorch layers they stand for."""
        if self.cols is not None and self.tp.rank != 0:
            residual = None   # (rank 0 adds it)
        if self.qweight is not None and self.backend == "auto":
            y = self.qweight.linear(x, self.bias, gated, None if norm is None else (norm.weight, norm.eps), residual)
        else:
            y = self.forward_native(x, norm, gated, residual)
        return y if self.cols is None else parallel.all_reduce(y, self.tp)

    def forward_native(self, x: torch.Tensor, norm: RMSNorm | None = None, gated: str | None = None,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        if gated is not None:
            x = GATED_ACTIVATIONS[gated](x)
        if norm is not None:
            x = norm(x)
        weight = self.weight if self.qweight is None else self.qweight.dequantize(x.dtype)
        y = self.dense(x, weight, self.bias)
        return y if residual is None else residual + y


class Embedding(_Weighted):
    """`vocab_parallel`: each rank holds a slice of the rows; a lookup takes the ids in its slice (zero
    for the others) and an all-reduce sums the ranks' parts (exactly: each row comes from one rank)."""

    def __init__(self, num_embeddings: int, dim: int, vocab_parallel: bool = False):
        super().__init__()
        if vocab_parallel:
            num_embeddings = self._vocab_rows(num_embeddings)
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return self._lookup(ids)
        kept = self.rows[0][0]
        outside = (ids < kept.start) | (ids >= kept.stop)
        x = self._lookup((ids - kept.start).masked_fill(outside, 0)).masked_fill(outside[..., None], 0)
        return parallel.all_reduce(x, self.tp)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.rows(ids)
        return F.embedding(ids, self.weight)
