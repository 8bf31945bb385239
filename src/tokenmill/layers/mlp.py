"""The gated MLP: down(act(gate(x)) * up(x)), gate and up fused into one projection."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import kernels, parallel
from tokenmill.layers.activation import GATED_ACTIVATIONS
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm


class GatedMLP(nn.Module):
    """`gate_up_proj` holds the gate and up projections as two shards (checkpoint names gate_proj
    and up_proj); `activation` is "silu" (SwiGLU) or "gelu_tanh" (GeGLU). Under tensor parallelism
    each rank holds a slice of the intermediate dimension: gate/up column-, down row-parallel."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str = "silu"):
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(GATED_ACTIVATIONS)}")
        self.activation = activation
        kept = parallel.mlp_slice(intermediate_size, parallel.current())
        self.gate_up_proj = Linear(hidden_size, [intermediate_size, intermediate_size], rows=[[kept], [kept]])
        self.down_proj = Linear(intermediate_size, hidden_size, cols=kept)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + mlp(norm(x)); the norm, the gated activation and the residual add run inside the
        projections (fused by quantized weights)."""
        return self.down_proj(self.gate_up_proj(x, norm=norm), gated=self.activation, residual=residual)

    def plan(self, norm: RMSNorm) -> tuple[kernels.MLPPlan, list[torch.Tensor]] | None:
        """This block as kernels.h's tm_mlp_plan with `norm` as its input norm (and the tensors it
        points into), or None where the C stack does not implement it: a projection with no plan
        weight (Linear.plan_weight), biases, an activation the kernel does not fuse."""
        gate_up, down = self.gate_up_proj.plan_weight(), self.down_proj.plan_weight()
        if (gate_up is None or down is None or self.activation not in kernels.GATES
                or self.gate_up_proj.bias is not None or self.down_proj.bias is not None):
            return None
        norm_weight = norm.weight.float().contiguous()
        return kernels.MLPPlan(gate_up=gate_up, down=down, norm=norm_weight.data_ptr(),
                               norm_eps=norm.eps, activation=kernels.gate_code(self.activation)), [norm_weight]
