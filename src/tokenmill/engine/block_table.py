"""A request's block table in one KV cache group (engine/kv_cache.py), on its own so that the
modules that read tables (the request, the cache manager, K/V transfer) need not import each other."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockTable:
    """A request's blocks in one KV cache group, in position order (entry i holds positions
    [i * block_size, (i + 1) * block_size)), append-only while it runs."""

    block_ids: list[int] = field(default_factory=list)
    num_cached: int = 0      # leading entries registered in the prefix cache
    num_released: int = 0    # leading entries given back, behind a sliding window (set to 0, never read)
