"""The KV block pool and the per-request cache manager.

K/V of every layer live in one preallocated tensor per layer, cut into fixed-size blocks of
`block_size` token slots. A request owns a block table (a list of block ids, append-only while it
runs). With prefix caching, every FULL block is identified by a chained hash of its tokens
(hash(parent block's hash, this block's token ids)), so two requests with the same prefix map
the same blocks, shared through reference counts.
"""

from __future__ import annotations

import hashlib
import math
import mmap
from array import array
from collections import OrderedDict

import torch

from tokenmill.config import ModelConfig
from tokenmill.engine.request import Request
from tokenmill.layers.attention import kv_row_width


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x a row's bytes (head_dim elements, plus an int8 row's scale)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * kv_row_width(cfg.head_dim, dtype) * dtype.itemsize


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, num_kv_heads: int | None = None) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, block_size, kv_heads, row] tensor per layer (layers/attention.py: a
    row is head_dim elements, or an int8 row with its scale). On the CPU each is
    an anonymous memory mapping: the OS hands its pages out zeroed when first written, so the pool
    costs resident memory only for the blocks requests have used (a one-shot generation touches a
    few blocks of a pool sized for a server). Zeroed matters: the reference attention reads the
    unwritten tail of a request's last block (masked, but 0 x NaN would still be NaN).
    `num_kv_heads`: a tensor-parallel rank's (default: the model's)."""
    shape = (2, num_blocks, block_size, num_kv_heads or cfg.num_kv_heads, kv_row_width(cfg.head_dim, dtype))
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
    return [lazy_zeros(shape, dtype) for _ in range(cfg.num_layers)]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages become resident only when written (MAP_ANONYMOUS memory is
    zero-filled on first touch, and page-aligned)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)   # (the tensor keeps the mapping alive)


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: it depends on every token of the prefix, not just the block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    """Physical blocks with reference counts, a prefix-hash index and LRU eviction.

    Invariants:
      - every block is either in use (ref_count > 0) or in `free_queue` (ref_count == 0), never both;
      - a free block may still hold cached K/V (it has a hash in `cached`): it can be revived by a
        later request with the same prefix, until it is handed out again, which evicts its hash;
      - `free_queue` is in hand-out order, from the front: blocks freed holding nothing reusable (no
        cached hash; the latest freed first), then blocks never used yet, then blocks holding cached
        prefixes, least recently freed first (LRU eviction). A used block that holds nothing goes
        before a never-used one so that the pool's resident memory (allocate_kv_caches: pages
        become resident when first written) grows only with the blocks that held something;
      - a block that is shared (ref_count > 1) is full and cached; nobody writes into it.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}            # block hash -> block id
        self.block_hash: dict[int, bytes] = {}        # block id -> its hash, for cached blocks

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def cached_free_blocks(self) -> list[int]:
        """Free blocks that still hold a cached prefix (revived on a hit, else evicted when handed out)."""
        return [block for block in self.block_hash if self.ref_count[block] == 0]

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks from the front of the free queue (evicting their cached hashes)."""
        if n > len(self.free_queue):
            raise RuntimeError(f"block pool exhausted: asked for {n}, {len(self.free_queue)} free")
        blocks = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            old = self.block_hash.pop(block, None)
            if old is not None:
                del self.cached[old]
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks (reviving free ones out of the free queue)."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self.free_queue[block]
            self.ref_count[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Blocks are released in reverse table order so that a
        request's tail blocks (least likely to be shared) are evicted before its head."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} freed twice"
            if self.ref_count[block] == 0:
                self.free_queue[block] = None
                if block not in self.block_hash:   # nothing to keep: handed out next
                    self.free_queue.move_to_end(block, last=False)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a full block under its hash (first writer wins for duplicate content)."""
        if block_hash not in self.cached and block not in self.block_hash:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash


class KVCacheManager:
    """Allocates slots for requests on demand and matches their prefixes against the cache.

    `sliding_window` (set when every layer of the model slides): a request's leading blocks that no
    future query can see are given back as it advances, so a long request holds about window /
    block_size blocks; given back once registered in the prefix cache, they stay there for reuse
    until evicted. Their table entries then point at block 0, which attention never reads: it reads
    only the blocks its window reaches (layers/attention.py)."""

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool,
                 sliding_window: int | None = None):
        self.pool = pool
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0   # tokens of admitted requests (counted by the scheduler at admission)
        self.prefix_hits = 0      # of which found cached

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _full_block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * self.block_size <= len(tokens):
            start = len(hashes) * self.block_size
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[start:start + self.block_size]))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks holding the longest prefix of the request's tokens. At least one token is
        always left to compute, since the last prompt position must produce logits."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        max_blocks = (request.num_tokens - 1) // self.block_size
        for block_hash in self._full_block_hashes(request)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grow the request's block table to hold num_computed + cached + num_new tokens.
        Returns False (changing nothing) when the pool has too few free blocks."""
        cached_blocks = list(cached_blocks)
        total = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        have = len(request.block_ids) + len(cached_blocks)
        need = max(0, self.blocks_for(total) - have)
        revived = sum(1 for b in cached_blocks if self.pool.ref_count[b] == 0)
        if need + revived > self.pool.num_free:
            return False
        self.pool.share(cached_blocks)
        request.block_ids.extend(cached_blocks)
        request.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """After a step: register the request's newly computed full blocks for reuse."""
        if not self.enable_prefix_caching:
            return
        hashes = self._full_block_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(hashes))
        for i in range(request.num_cached_blocks, num_full):
            self.pool.cache(request.block_ids[i], hashes[i])
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def release_behind_window(self, request: Request) -> None:
        """After a step: give back the blocks wholly before the window of the request's next query
        (at position p = num_computed_tokens, it reads keys after p - window)."""
        if self.sliding_window is None:
            return
        first_needed = max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        if self.enable_prefix_caching:  # registered first, so that a later prompt can reuse them
            first_needed = min(first_needed, request.num_cached_blocks)
        start = request.num_released_blocks
        if first_needed > start:
            self.pool.free(request.block_ids[start:first_needed])
            request.block_ids[start:first_needed] = [0] * (first_needed - start)
            request.num_released_blocks = first_needed

    def truncate(self, request: Request) -> None:
        """After a step that rolled back rejected proposals: give back the blocks past the request's
        computed tokens (they hold only rejected K/V; none is registered in the prefix cache, which
        registers computed full blocks only)."""
        keep = max(self.blocks_for(request.num_computed_tokens), request.num_released_blocks)
        if len(request.block_ids) > keep:
            self.pool.free(request.block_ids[keep:])
            del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        self.pool.free(request.block_ids[request.num_released_blocks:])
        request.block_ids = []
        request.num_cached_blocks = 0
        request.num_released_blocks = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
