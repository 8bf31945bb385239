"""The KV block pool: fixed-size blocks of K/V slots in one preallocated tensor per layer.

Invariants: a block is either free (in `free_blocks`) or owned by exactly one request's block
table; block tables only grow while a request runs and are returned whole when it finishes or is
aborted; `num_free + sum(len(table))` is always `num_blocks`.
"""

from __future__ import annotations

from collections import deque

import torch

from tokenmill.config import ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise RuntimeError(f"block pool exhausted: asked for {n}, {len(self.free_blocks)} free")
        return [self.free_blocks.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self.free_blocks.extend(block_ids)
