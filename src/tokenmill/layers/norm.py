"""Normalization layers. RMSNorm normalizes in float32 and scales in the input dtype, as HF does.

A float32 CPU input runs the C kernels' one RMSNorm (`kernels.rms_norm`, norm.h): the quantized
matmul's fused input norm, the fused rotary decode's q/k norms and the decode stack's sandwich norms
are that same function, so a row gets the same bits whichever path it takes (the decode stack or the
layer loop, a decode-only step or one shared with another request's prefill chunk). The PyTorch code
is the reference (backend "torch", other dtypes and devices, no C compiler)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import kernels
from tokenmill.layers.op import KernelOp


class RMSNorm(KernelOp):
    """`float32_weight`: the weight is held and applied in float32 whatever the model's dtype, the
    result cast after the multiply (Gemma's norm, whose weight 1 + w would lose w's low bits in bf16)."""

    def __init__(self, dim: int, eps: float, float32_weight: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32 if float32_weight else None),
                                   requires_grad=False)
        self.eps = eps
        self.float32_weight = float32_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.backend == "auto" and x.dtype == torch.float32 and x.device.type == "cpu"
                and kernels.load() is not None):
            return kernels.rms_norm(x, self.weight, self.eps)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:   # no casts: each op costs a dispatch on CPU
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.float32_weight:
            return (h * self.weight).to(x.dtype)
        return self.weight * h.to(x.dtype)
