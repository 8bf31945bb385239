"""Linear and Embedding layers whose weight is dense or quantized (`layers/quant.py`).

Parameters are created empty (no random init): every value is filled from the checkpoint. The
loader may then replace the dense weight by a quantized one (`set_quantized`), which the layer
runs with the quantized kernels; an Embedding's quantized weight also serves as a tied LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.layers.activation import GATED_ACTIVATIONS
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.op import KernelOp
from tokenmill.layers.quant import QuantWeight


class _Weighted(KernelOp):
    """A layer holding a [N, K] weight, dense (`weight`) or quantized (`qweight`), that can also
    serve as an LM head. A quantized weight runs the quantized kernel (int8 activations); backend
    "torch" multiplies float activations by its dequantized values instead, which checks a whole
    model's plumbing (packing, fused shards, tied heads) without the activation rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.weight: nn.Parameter | None = None
        self.keep_dense = False
        self.qweight: QuantWeight | None = None  # an instance attribute: a class one would hide the submodule

    def set_quantized(self, qweight: QuantWeight) -> None:
        """Run with `qweight` instead of the dense weight (which is dropped)."""
        self.weight = None
        self.qweight = qweight

    def kernel_weight(self) -> QuantWeight | None:
        """The quantized weight the kernels run, for a C plan; None where this layer runs dense or its
        PyTorch reference (backend "torch")."""
        return self.qweight if self.backend == "auto" else None

    def dense(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b) for a dense weight, in x's dtype: a bf16 CPU weight's few-row products (decode
        steps) run the C kernel on backend "auto" (kernels.bf16_matmul: PyTorch's are far slower
        there), everything else `F.linear`."""
        if self.backend == "auto" and kernels.uses_bf16_matmul(x, weight):
            y = kernels.bf16_matmul(x, weight)
            return (y if bias is None else y + bias).to(x.dtype)
        return F.linear(x, weight, bias)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 hidden @ W^T for an LM head (no bias): an Embedding's for a tied head."""
        if self.qweight is None:
            return self.dense(hidden, self.weight).float()
        if self.backend == "torch":
            return hidden.float() @ self.qweight.dequantize().t()
        return self.qweight.matmul(hidden)


class Linear(_Weighted):
    """y = x W^T (+ b). `shard_sizes` marks a fused projection (q/k/v or gate/up): the loader fills
    each shard from its own checkpoint tensor, stacked along the output dimension. `keep_dense`: the
    loader never quantizes this layer (a MoE router, whose rounding would change which experts run)."""

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool = False, keep_dense: bool = False):
        super().__init__()
        self.keep_dense = keep_dense
        sizes = out_features if isinstance(out_features, list) else [out_features]
        self.shard_sizes = sizes
        self.weight = nn.Parameter(torch.empty(sum(sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(sizes)), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, gated: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + f(x) W^T + b, where the input ops f are, in order: `gated` (x is a fused
        [gate | up] projection: act(gate) * up, act "silu" or "gelu_tanh"), then `norm` (an RMSNorm).
        A quantized weight fuses them into its kernel's activation pass (one call instead of several
        dispatched ops); otherwise they run as the PyTorch layers they stand for."""
        if self.qweight is not None and self.backend == "auto":
            return self.qweight.linear(x, self.bias, gated, None if norm is None else (norm.weight, norm.eps),
                                       residual)
        return self.forward_native(x, norm, gated, residual)

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
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.rows(ids)
        return F.embedding(ids, self.weight)
