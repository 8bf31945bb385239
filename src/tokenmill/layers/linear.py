"""Parameters created empty (no random init): every value is filled from the checkpoint."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b). `shard_sizes` marks a fused projection (q/k/v or gate/up): the loader fills
    each shard from its own checkpoint tensor, stacked along the output dimension."""

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool = False):
        super().__init__()
        sizes = out_features if isinstance(out_features, list) else [out_features]
        self.shard_sizes = sizes
        self.weight = nn.Parameter(torch.empty(sum(sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(sizes)), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
