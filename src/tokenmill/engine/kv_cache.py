"""The KV block pool and the per-request cache manager.

K/V live in preallocated tensors, one per layer, cut into fixed-size blocks of `block_size` token
slots. A request owns a block table (a list of block ids, append-only while it runs). With prefix
caching, every FULL block is identified by a chained hash of its tokens (hash(parent block's hash,
this block's token ids)), so two requests with the same prefix map the same blocks, shared
through reference counts.

Layers whose attention reads the same positions share block tables: a KV cache group (KVLayout).
A model's layers are one group unless it mixes full-attention layers with sliding-window ones
(Gemma 2/3, Qwen2 with max_window_layers): then each kind has groups of its own, so that a sliding
layer holds only the blocks its window reaches while a full layer holds them all. One pool serves
every group (vLLM's hybrid KV cache manager): groups have equal numbers of layers, g, the j-th layer
of every group uses the same cache tensor, and a block belongs to one group at a time, so a block is
the same bytes (its slots in g tensors) whichever group takes it, and no memory is set aside per kind.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tokenmill import memory
from tokenmill.config import ModelConfig
from tokenmill.engine.block_table import BlockTable
from tokenmill.engine.request import Request
from tokenmill.layers.attention import kv_row_width


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x a row's bytes (head_dim elements, plus an int8 row's scale):
    what one token's K/V take in every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * kv_row_width(cfg.head_dim, dtype) * dtype.itemsize


@dataclass(frozen=True)
class KVLayout:
    """The KV cache groups of a model's layers (see the module's docstring)."""

    windows: tuple[int | None, ...]   # per group: its layers' sliding window (None: full attention)
    layer_group: tuple[int, ...]      # per layer: its group
    layer_slot: tuple[int, ...]       # per layer: its cache tensor (shared with that slot of the other groups)

    @property
    def num_slots(self) -> int:
        """Cache tensors: layers per group (the number of layers when there is one group)."""
        return max(self.layer_slot) + 1

    def max_blocks_held(self, num_tokens: int, block_size: int, step_tokens: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once, over every group, when a
        step computes at most `step_tokens` of its tokens (in a sliding group: its window's and a step's)."""
        full = -(-num_tokens // block_size)
        return sum(full if w is None else min(full, -(-(w - 1 + step_tokens) // block_size) + 1) for w in self.windows)


def kv_layout(cfg: ModelConfig) -> KVLayout:
    """One group of every layer when they all attend alike; else groups of g = min(full, sliding)
    layers of one kind each, the full layers' first (the last group of a kind may be smaller)."""
    kinds = [cfg.layer_slides(i) for i in range(cfg.num_layers)]
    if len(set(kinds)) == 1:
        window = cfg.sliding_window if kinds[0] else None   # (a window no layer uses is none)
        return KVLayout((window,), (0,) * cfg.num_layers, tuple(range(cfg.num_layers)))
    full = [i for i, slides in enumerate(kinds) if not slides]
    sliding = [i for i, slides in enumerate(kinds) if slides]
    size = min(len(full), len(sliding))
    windows: list[int | None] = []
    group, slot = [0] * cfg.num_layers, [0] * cfg.num_layers
    for layers, window in ((full, None), (sliding, cfg.sliding_window)):
        for j, layer in enumerate(layers):
            if j % size == 0:
                windows.append(window)
            group[layer], slot[layer] = len(windows) - 1, j % size
    return KVLayout(tuple(windows), tuple(group), tuple(slot))


def allocate_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, num_kv_heads: int | None = None) -> list[torch.Tensor]:
    """Each layer's zeroed [2, num_blocks, block_size, kv_heads, row] tensor (layers/attention.py: a
    row is head_dim elements, or an int8 row with its scale); layers of different KV cache groups in
    the same slot (kv_layout) get the same tensor. `num_kv_heads`: a tensor-parallel rank's (default:
    the model's). Zeroed matters: the reference attention reads the unwritten tail of a request's
    last block (masked, but 0 x NaN would still be NaN).

    On the CPU all of them are views of one anonymous memory mapping laid out block by block,
    [num_blocks, slots, 2, block_size, kv_heads, row] (a block of the whole model's K/V is one
    stretch), advised for 2 MB pages. The OS hands its pages out zeroed when first written, so the
    pool costs resident memory only for the blocks requests have used (a one-shot generation touches
    a few blocks of a pool sized for a server), and since the blocks are handed out from the first
    (BlockPool) a 2 MB page holds blocks that are used together: with one mapping per layer, the
    first block would have made a 2 MB page of every layer's K and V resident. The attention
    kernels read a block's rows in 4 KB pages otherwise (ARCHITECTURE, "KV cache on huge pages")."""
    kv_heads = num_kv_heads or cfg.num_kv_heads
    block = (2, block_size, kv_heads, kv_row_width(cfg.head_dim, dtype))
    layout = kv_layout(cfg)
    if device.type != "cpu":
        slots = [torch.zeros(2, num_blocks, *block[1:], dtype=dtype, device=device) for _ in range(layout.num_slots)]
    else:
        nbytes = num_blocks * layout.num_slots * math.prod(block) * dtype.itemsize
        pool = memory.anonymous_bytes(nbytes, huge_pages=True).view(dtype).view(num_blocks, layout.num_slots, *block)
        slots = [pool[:, s].transpose(0, 1) for s in range(layout.num_slots)]
    return [slots[s] for s in layout.layer_slot]


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


def first_in_window(position: int, window: int, block_size: int) -> int:
    """The first block a query at `position` reads through a sliding window (it sees keys after
    position - window)."""
    return max(0, position - window + 1) // block_size


class KVCacheManager:
    """Allocates slots for requests on demand and matches their prefixes against the cache, for
    every KV cache group of the model (`windows`: each group's sliding window or None; one group of
    full attention by default). A request has one BlockTable per group (Request.tables).

    A sliding group gives back a request's leading blocks that no future query can see as it
    advances, so a long request holds about window / block_size blocks there; given back once
    registered in the prefix cache, they stay there for reuse until evicted. Their table entries
    then point at block 0, which attention never reads: it reads only the blocks its window reaches
    (layers/attention.py). A prefix-cache hit needs, in a sliding group, only the blocks the window
    of the first uncached position reaches."""

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool,
                 windows: tuple[int | None, ...] = (None,)):
        self.pool = pool
        self.windows = windows
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0   # tokens of admitted requests (counted by the scheduler at admission)
        self.prefix_hits = 0      # of which found cached

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _tables(self, request: Request) -> list[BlockTable]:
        """The request's tables, one per group (created empty the first time)."""
        while len(request.tables) < len(self.windows):
            request.tables.append(BlockTable())
        return request.tables

    def _key(self, group: int, block_hash: bytes) -> bytes:
        """A block's prefix-cache key in `group`: groups hold different layers, so a block's hash is
        its own group's (group 0's keys are the plain hashes)."""
        return block_hash if group == 0 else bytes([group]) + block_hash

    def _full_block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended incrementally as tokens arrive."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * self.block_size <= len(tokens):
            start = len(hashes) * self.block_size
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[start:start + self.block_size]))
        return hashes

    def find_cached_prefix(self, request: Request) -> int:
        """How many leading blocks of the request the cache holds in every group (a sliding group:
        those its window reaches from the first position after them). At least one token is always
        left to compute, since the last prompt position must produce logits."""
        if not self.enable_prefix_caching:
            return 0
        hashes = self._full_block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        hit = len(hashes)
        while True:   # (a sliding group's test is not monotone in the hit: repeated until every group agrees)
            agreed = hit
            for group, window in enumerate(self.windows):
                present = [self.pool.lookup(self._key(group, h)) is not None for h in hashes[:agreed]]
                if window is None:
                    agreed = present.index(False) if False in present else agreed
                while agreed > 0 and window is not None and not all(
                        present[first_in_window(agreed * self.block_size, window, self.block_size):agreed]):
                    agreed -= 1
            if agreed == hit:
                return hit
            hit = agreed

    def allocate_slots(self, request: Request, num_new_tokens: int, num_cached_blocks: int = 0,
                       num_loaded_tokens: int = 0) -> bool:
        """Grow the request's block tables to hold its computed tokens, then `num_cached_blocks`
        blocks found by find_cached_prefix (at admission), `num_loaded_tokens` whose K/V is written
        in (kv_transfer) and `num_new_tokens` to compute. A sliding group skips the blocks before the
        window of the first token to compute. Returns False (taking no block) when the pool has too
        few free blocks."""
        tables = self._tables(request)
        hashes = self._full_block_hashes(request)
        start = request.num_computed_tokens + num_cached_blocks * self.block_size + num_loaded_tokens
        total_blocks = self.blocks_for(start + num_new_tokens)
        plans = []   # per group: (placeholders, cached blocks to share, blocks to allocate)
        for group, (table, window) in enumerate(zip(tables, self.windows, strict=True)):
            skip = 0 if window is None or table.block_ids else first_in_window(start, window, self.block_size)
            cached = [self.pool.lookup(self._key(group, h)) for h in hashes[skip:num_cached_blocks]]
            have = max(len(table.block_ids), skip) + len(cached)
            plans.append((skip, cached, max(0, total_blocks - have)))
        revived = sum(1 for _, cached, _ in plans for b in cached if self.pool.ref_count[b] == 0)
        if sum(need for _, _, need in plans) + revived > self.pool.num_free:
            return False
        for _, cached, _ in plans:   # every group's cached blocks out of the free queue before any allocation
            self.pool.share(cached)
        for table, (skip, cached, need) in zip(tables, plans, strict=True):
            if skip > len(table.block_ids):   # a new table: entries before the window hold nothing
                table.block_ids.extend([0] * (skip - len(table.block_ids)))
                table.num_released = skip
            table.block_ids.extend(cached)
            table.block_ids.extend(self.pool.allocate(need))
            table.num_cached = max(table.num_cached, num_cached_blocks, table.num_released)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """After a step: register the request's newly computed full blocks for reuse."""
        if not self.enable_prefix_caching:
            return
        hashes = self._full_block_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(hashes))
        for group, table in enumerate(self._tables(request)):
            for i in range(table.num_cached, num_full):
                self.pool.cache(table.block_ids[i], self._key(group, hashes[i]))
            table.num_cached = max(table.num_cached, num_full)

    def release_behind_window(self, request: Request) -> None:
        """After a step: in each sliding group, give back the blocks wholly before the window of the
        request's next query (at position num_computed_tokens)."""
        for table, window in zip(self._tables(request), self.windows, strict=True):
            if window is None:
                continue
            first_needed = first_in_window(request.num_computed_tokens, window, self.block_size)
            if self.enable_prefix_caching:  # registered first, so that a later prompt can reuse them
                first_needed = min(first_needed, table.num_cached)
            start = table.num_released
            if first_needed > start:
                self.pool.free(table.block_ids[start:first_needed])
                table.block_ids[start:first_needed] = [0] * (first_needed - start)
                table.num_released = first_needed

    def truncate(self, request: Request) -> None:
        """After a step that rolled back rejected proposals: give back the blocks past the request's
        computed tokens (they hold only rejected K/V; none is registered in the prefix cache, which
        registers computed full blocks only)."""
        for table in request.tables:
            keep = max(self.blocks_for(request.num_computed_tokens), table.num_released)
            if len(table.block_ids) > keep:
                self.pool.free(table.block_ids[keep:])
                del table.block_ids[keep:]

    def free(self, request: Request) -> None:
        for table in request.tables:
            self.pool.free(table.block_ids[table.num_released:])
        request.tables = []

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
