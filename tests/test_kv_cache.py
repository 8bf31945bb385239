"""BlockPool and KVCacheManager on CPU, with no model: exact block ids, reference counts, LRU
eviction, revival of cached blocks, chained prefix hashes and all-or-nothing slot allocation; and
the pool's memory, resident only where written.

The last test is a hypothesis state machine that drives the pool with random allocate / share /
free / cache calls against a plain model of it and checks the pool's invariants after every call.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from memory_helpers import advised_huge, resident_mib

from tokenmill.config import ModelConfig
from tokenmill.engine.kv_cache import (
    BlockPool,
    KVCacheManager,
    KVLayout,
    allocate_kv_caches,
    hash_block,
    kv_bytes_per_token,
    kv_layout,
)
from tokenmill.engine.request import Request
from tokenmill.sampling import SamplingParams

BS = 4  # block size of every manager in this file


def make_request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(request_id, list(tokens), SamplingParams(max_tokens=8, temperature=0.0), 8, frozenset(),
                   arrival_time=0.0)


def pool_state(pool: BlockPool) -> tuple:
    return (list(pool.ref_count), list(pool.free_queue), dict(pool.cached), dict(pool.block_hash))


def check_pool(pool: BlockPool) -> None:
    """Every block is either referenced or free (never both); the two hash maps are inverses."""
    free = list(pool.free_queue)
    assert len(free) == len(set(free))
    assert set(free) == {b for b in range(pool.num_blocks) if pool.ref_count[b] == 0}
    assert all(r >= 0 for r in pool.ref_count)
    assert pool.num_free + sum(r > 0 for r in pool.ref_count) == pool.num_blocks
    assert {b: h for h, b in pool.cached.items()} == pool.block_hash
    assert all(b in pool.block_hash for b in range(pool.num_blocks) if pool.ref_count[b] > 1), \
        "a shared block must be a cached (full, immutable) block"


def computed(manager: KVCacheManager, request: Request, num_new: int, num_cached_blocks: int = 0) -> None:
    """Allocate and 'compute' num_new tokens of the request, as one engine step would."""
    assert manager.allocate_slots(request, num_new, num_cached_blocks)
    request.num_computed_tokens += num_cached_blocks * BS + num_new
    manager.cache_full_blocks(request)
    manager.release_behind_window(request)


# ---- BlockPool ------------------------------------------------------------------------------------


def test_allocate_hands_out_blocks_in_order_and_counts_refs():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.ref_count == [1, 1, 1, 1, 1, 0]
    assert pool.num_free == 1
    check_pool(pool)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_cpu_pool_is_zero_and_resident_only_where_written(dtype):
    cfg = ModelConfig(architecture="llama", vocab_size=10, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=64, intermediate_size=8, max_position_embeddings=64, norm_eps=1e-6)
    num_blocks = 8192   # 4 layers x 2 x 8192 blocks x 16 tokens x 2 heads x 64: 512 MiB in bf16
    before = resident_mib()
    caches = allocate_kv_caches(cfg, num_blocks, 16, dtype, torch.device("cpu"))
    assert sum(c.numel() * c.element_size() for c in caches) == kv_bytes_per_token(cfg, dtype) * num_blocks * 16
    assert all(c.shape == (2, num_blocks, 16, 2, 64) and c.dtype == dtype for c in caches)
    for c in caches:
        c[:, :4] = 1.0    # the first 4 blocks of every layer
    # one 2 MB page holds them all (a mapping per layer would have made 2 MB of each layer's K and V resident)
    assert resident_mib() - before < 6, "unwritten blocks became resident"
    for c in caches:
        assert (c[:, :4] == 1).all() and (c[:, 4:].sum() == 0)   # (summing touches them: read last)


def test_a_cpu_pool_lays_each_block_of_every_layer_side_by_side_on_huge_pages():
    """[blocks, layers, K/V, block_size, kv_heads, row] in one mapping advised for 2 MB pages: a block of
    the whole model is one stretch of memory, and the blocks handed out first share pages."""
    caches = allocate_kv_caches(_config(None, None), 6, BS, torch.bfloat16, torch.device("cpu"))
    block = caches[0][0, 0].numel() * caches[0].element_size()   # one layer's K (or V) of one block
    base = caches[0].data_ptr()
    for layer, c in enumerate(caches):
        for b, kv in itertools.product(range(6), range(2)):
            assert c[kv, b].data_ptr() - base == ((b * len(caches) + layer) * 2 + kv) * block
        assert c[0, 0].is_contiguous() and advised_huge(c)
    assert base % (2 << 20) == 0


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    before = pool_state(pool)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate(2)
    assert pool_state(pool) == before
    assert pool.allocate(0) == []


def test_free_releases_cached_blocks_in_reverse_table_order_behind_the_unused_ones():
    pool = BlockPool(5)
    table = pool.allocate(3)            # [0, 1, 2]; free queue [3, 4]
    for block in table:
        pool.cache(block, bytes([block]))
    pool.free(table)
    assert list(pool.free_queue) == [3, 4, 2, 1, 0]
    assert pool.allocate(5) == [3, 4, 2, 1, 0]   # never-used blocks, then the freed table's tail first


def test_blocks_freed_holding_nothing_are_handed_out_before_never_used_ones():
    """So that the pool's memory becomes resident only as far as blocks ever held something."""
    pool = BlockPool(6)
    table = pool.allocate(3)            # [0, 1, 2]; free queue [3, 4, 5]
    pool.cache(table[0], b"h")          # a full block, cached; 1 and 2 hold nothing reusable
    pool.free(table)
    assert list(pool.free_queue) == [1, 2, 3, 4, 5, 0]
    assert pool.allocate(2) == [1, 2]   # reused before 3, 4, 5 are ever touched
    assert pool.lookup(b"h") == 0       # and the cached block is kept longest


def test_share_and_free_count_references():
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.cache(b, b"h")
    pool.share([b])
    pool.share([b])
    assert pool.ref_count[b] == 3
    pool.free([b])
    pool.free([b])
    assert pool.ref_count[b] == 1 and b not in pool.free_queue
    pool.free([b])
    assert pool.ref_count[b] == 0 and list(pool.free_queue)[-1] == b
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free([b])


def test_freed_cached_block_is_revived_by_share():
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.cache(b, b"h")
    pool.free([b])
    assert pool.lookup(b"h") == b and pool.num_free == 4    # free, but its K/V are still cached
    pool.share([b])
    assert pool.ref_count[b] == 1 and b not in pool.free_queue and pool.lookup(b"h") == b
    assert b not in pool.allocate(3), "a revived block must not be handed out again"
    check_pool(pool)


def test_eviction_is_least_recently_freed_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, (b"a", b"b", b"c"), strict=True):
        pool.cache(b, h)
    for b in (1, 0, 2):                 # freed in this order: 1 is the least recently used
        pool.free([b])
    assert pool.allocate(1) == [1]
    assert pool.lookup(b"b") is None and 1 not in pool.block_hash   # its hash is evicted with it
    assert pool.lookup(b"a") == 0 and pool.lookup(b"c") == 2
    pool.share([0])                     # using block 0 again makes it the most recent on its next free
    pool.free([0])
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) == [0]
    assert pool.cached == {} and pool.block_hash == {}
    check_pool(pool)


def test_cache_first_writer_wins():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(a, b"h")
    pool.cache(b, b"h")         # the same content computed twice: the first block stays the cached one
    assert pool.lookup(b"h") == a and b not in pool.block_hash
    pool.cache(a, b"other")     # a block is cached under one hash only
    assert pool.lookup(b"other") is None and pool.block_hash[a] == b"h"
    check_pool(pool)


# ---- hashes ---------------------------------------------------------------------------------------


def test_block_hash_is_chained_over_the_prefix():
    first = hash_block(None, [1, 2, 3, 4])
    assert first == hash_block(None, [1, 2, 3, 4])
    assert first != hash_block(None, [1, 2, 3, 5])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])


def test_equal_blocks_after_different_prefixes_do_not_match():
    manager = KVCacheManager(BlockPool(16), BS, enable_prefix_caching=True)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    owner = make_request(a + b + [0], "owner")
    computed(manager, owner, 9)
    assert owner.tables[0].num_cached == 2
    # Same second block, different first block: nothing matches.
    assert manager.find_cached_prefix(make_request(c + b + [0])) == 0
    # Same first block, different second block: only the first matches.
    assert manager.find_cached_prefix(make_request(a + c + [0])) == 1
    # The whole prefix: both blocks, which it then shares.
    request = make_request(a + b + [7, 7])
    assert manager.find_cached_prefix(request) == 2
    computed(manager, request, 2, 2)
    assert request.block_ids[:2] == owner.block_ids[:2] and request.block_ids[2] not in owner.block_ids


# ---- KVCacheManager -------------------------------------------------------------------------------


def test_slots_are_allocated_on_demand():
    manager = KVCacheManager(BlockPool(8), BS, enable_prefix_caching=False)
    request = make_request(list(range(5)))
    computed(manager, request, 5)
    assert request.block_ids == [0, 1]
    for _ in range(3):                  # decode positions 5, 6, 7 fit the second block
        request.append_token(0)
        computed(manager, request, 1)
        assert request.block_ids == [0, 1]
    request.append_token(0)  # position 8 needs a third block
    computed(manager, request, 1)
    assert request.block_ids == [0, 1, 2]
    assert manager.pool.ref_count[:4] == [1, 1, 1, 0]


def test_allocate_slots_returns_false_and_changes_nothing_when_short():
    pool = BlockPool(4)
    manager = KVCacheManager(pool, BS, enable_prefix_caching=True)
    other = make_request(list(range(9)), "other")
    computed(manager, other, 9)                    # blocks 0, 1, 2; 0 and 1 cached
    request = make_request(list(range(8)) + [50] * 9)
    cached = manager.find_cached_prefix(request)
    assert cached == 2
    manager.free(other)                            # cached blocks 0, 1 are free now: reviving them costs 2
    before, table = pool_state(pool), list(request.block_ids)
    # 2 revived + 3 new (17 tokens = 5 blocks) > 4 free.
    assert not manager.allocate_slots(request, 9, cached)
    assert pool_state(pool) == before and request.block_ids == table
    # 2 revived + 1 new (12 tokens) fits, and takes exactly those blocks: the new one is other's
    # partial block 2 (it holds nothing reusable), before block 3, never used.
    assert manager.allocate_slots(request, 4, cached)
    assert request.block_ids == [0, 1, 2]
    assert pool.ref_count == [1, 1, 1, 0] and pool.lookup(other.block_hashes[1]) == 1
    # Growing a running request: false when short, with nothing changed.
    request.num_computed_tokens = 12
    big = make_request([7] * 4, "big")
    computed(manager, big, 4)                      # takes block 3, the last free one
    before = pool_state(pool)
    assert not manager.allocate_slots(request, 1)
    assert pool_state(pool) == before and request.block_ids == [0, 1, 2]
    check_pool(pool)


def test_cached_prefix_leaves_at_least_one_token_to_compute():
    manager = KVCacheManager(BlockPool(8), BS, enable_prefix_caching=True)
    owner = make_request(list(range(8)), "owner")
    computed(manager, owner, 8)
    assert owner.tables[0].num_cached == 2
    # The same 8 tokens: the last position must produce logits, so only one block is reused.
    again = make_request(list(range(8)))
    assert manager.find_cached_prefix(again) == 1
    assert manager.find_cached_prefix(make_request(list(range(9)))) == 2


def test_shared_prefix_blocks_are_reference_counted_and_freed():
    pool = BlockPool(8)
    manager = KVCacheManager(pool, BS, enable_prefix_caching=True)
    prompt = list(range(10))
    first = make_request(prompt, "first")
    computed(manager, first, 10)                     # blocks 0, 1 (cached), 2 (partial)
    second = make_request(prompt, "second")
    cached = manager.find_cached_prefix(second)
    computed(manager, second, 2, cached)
    assert second.block_ids == [0, 1, 3]
    assert pool.ref_count[:4] == [2, 2, 1, 1]
    manager.free(first)
    assert pool.ref_count[:4] == [1, 1, 0, 1] and first.block_ids == [] and first.tables == []
    manager.free(second)
    assert pool.num_free == pool.num_blocks
    # The partial tails (nothing reusable) first, second's (freed last) before first's; then the
    # blocks never used; then the cached shared head, in reverse table order.
    assert list(pool.free_queue) == [3, 2, 4, 5, 6, 7, 1, 0]
    check_pool(pool)


def test_cache_full_blocks_registers_only_computed_full_blocks():
    pool = BlockPool(8)
    manager = KVCacheManager(pool, BS, enable_prefix_caching=True)
    request = make_request(list(range(11)))
    assert manager.allocate_slots(request, 11)
    request.num_computed_tokens = 6                  # a chunk: block 0 full, block 1 half written
    manager.cache_full_blocks(request)
    assert pool.block_hash == {0: request.block_hashes[0]} and request.tables[0].num_cached == 1
    request.num_computed_tokens = 11
    manager.cache_full_blocks(request)
    assert set(pool.block_hash) == {0, 1} and request.tables[0].num_cached == 2
    assert request.block_hashes[1] == hash_block(request.block_hashes[0], [4, 5, 6, 7])
    # Output tokens extend the hashes: after 12 computed tokens the third block is full.
    request.append_token(99)
    assert manager.allocate_slots(request, 1)
    request.num_computed_tokens = 12
    manager.cache_full_blocks(request)
    assert request.block_hashes[2] == hash_block(request.block_hashes[1], [8, 9, 10, 99])
    assert pool.lookup(request.block_hashes[2]) == 2


def test_prefix_caching_disabled_never_matches_or_caches():
    pool = BlockPool(8)
    manager = KVCacheManager(pool, BS, enable_prefix_caching=False)
    owner = make_request(list(range(9)), "owner")
    computed(manager, owner, 9)
    assert pool.cached == {} and owner.tables[0].num_cached == 0
    assert manager.find_cached_prefix(make_request(list(range(9)))) == 0
    assert manager.prefix_hit_rate == 0.0


# ---- property-based: the pool against a model -----------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / share / free / cache; holders are lists of block ids like block tables."""

    def __init__(self):
        super().__init__()
        self.holders: list[list[int]] = []
        self.hashes = 0

    @initialize(num_blocks=st.integers(1, 12))
    def create(self, num_blocks):
        self.pool = BlockPool(num_blocks)

    @rule(n=st.integers(0, 13))
    def allocate(self, n):
        pool = self.pool
        if n > pool.num_free:
            before = pool_state(pool)
            with pytest.raises(RuntimeError):
                pool.allocate(n)
            assert pool_state(pool) == before
            return
        expected = list(pool.free_queue)[:n]
        evicted = {b for b in expected if b in pool.block_hash}
        blocks = pool.allocate(n)
        assert blocks == expected
        assert not evicted & set(pool.block_hash)
        self.holders.append(blocks)

    @rule(data=st.data())
    def share_cached(self, data):
        if not self.pool.cached:
            return
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.pool.block_hash)), unique=True, max_size=4))
        free_before = self.pool.num_free
        revived = sum(self.pool.ref_count[b] == 0 for b in blocks)
        self.pool.share(blocks)
        assert self.pool.num_free == free_before - revived
        self.holders.append(blocks)

    @rule(data=st.data())
    def free(self, data):
        if not self.holders:
            return
        blocks = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        queue = list(self.pool.free_queue)
        self.pool.free(blocks)
        released = [b for b in reversed(blocks) if self.pool.ref_count[b] == 0]
        empty = [b for b in released if b not in self.pool.block_hash]    # to the front, the latest first
        assert list(self.pool.free_queue) == empty[::-1] + queue + [b for b in released if b not in empty]

    @rule(data=st.data())
    def cache(self, data):
        holder = data.draw(st.sampled_from(self.holders)) if self.holders else []
        if holder:
            block = data.draw(st.sampled_from(holder))
            h = data.draw(st.sampled_from([b"dup", str(self.hashes).encode()]))
            self.hashes += 1
            was_cached = block in self.pool.block_hash or h in self.pool.cached
            self.pool.cache(block, h)
            assert was_cached or self.pool.lookup(h) == block

    @invariant()
    def consistent(self):
        check_pool(self.pool)
        refs = [0] * self.pool.num_blocks
        for holder in self.holders:
            for b in holder:
                refs[b] += 1
        assert refs == self.pool.ref_count


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


# ---- KV cache groups: models that mix full and sliding-window layers -------------------------------


def _config(layer_types: tuple[str, ...] | None, window: int | None = 8) -> ModelConfig:
    return ModelConfig(architecture="gemma3", vocab_size=10, hidden_size=64, num_layers=len(layer_types or "xxxx"),
                       num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=8, max_position_embeddings=64,
                       norm_eps=1e-6, sliding_window=window, layer_types=layer_types)


def test_layers_form_groups_of_equal_size_sharing_cache_tensors():
    """One group when the layers attend alike; else groups of g = min(full, sliding) layers of one kind,
    full ones first, the j-th layer of every group in cache tensor j (Gemma 3 1B's pattern: 4 global
    layers of 26, so one full group and six sliding ones of four, the last of two)."""
    assert kv_layout(_config(None, None)) == KVLayout((None,), (0,) * 4, (0, 1, 2, 3))
    assert kv_layout(_config(None, 8)) == KVLayout((8,), (0,) * 4, (0, 1, 2, 3))
    # a window that no layer uses (Qwen2's use_sliding_window with max_window_layers past the last layer)
    assert kv_layout(_config(("full",) * 4, 8)) == KVLayout((None,), (0,) * 4, (0, 1, 2, 3))
    assert kv_layout(_config(("sliding", "full"))) == KVLayout((None, 8), (1, 0), (0, 0))
    types = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(26))
    layout = kv_layout(_config(types))
    assert layout.windows == (None,) + (8,) * 6 and layout.num_slots == 4
    full = [i for i, t in enumerate(types) if t == "full"]
    assert [layout.layer_group[i] for i in full] == [0] * 4 and [layout.layer_slot[i] for i in full] == [0, 1, 2, 3]
    sliding = [i for i, t in enumerate(types) if t == "sliding"]
    assert [layout.layer_group[i] for i in sliding] == [1 + j // 4 for j in range(22)]
    assert [layout.layer_slot[i] for i in sliding] == [j % 4 for j in range(22)]
    caches = allocate_kv_caches(_config(types), 4, BS, torch.float32, torch.device("cpu"))
    assert len(caches) == 26 and len({c.data_ptr() for c in caches}) == 4
    assert all(caches[i] is caches[full[layout.layer_slot[i]]] for i in sliding)
    # a request of n tokens holds ceil(n / BS) blocks in a full group, its window's and a step's in a sliding one
    assert layout.max_blocks_held(100, BS, 16) == 25 + 6 * (-(-(8 - 1 + 16) // BS) + 1)
    assert layout.max_blocks_held(5, BS, 16) == 7 * 2


def test_a_sliding_group_holds_and_needs_only_its_window():
    """Groups (full, sliding with window 8) from one pool, blocks of 4: a long request gives back its
    sliding group's blocks behind the window (they read block 0, registered in the prefix cache first);
    a later prompt with the same prefix hits as far as the full group has every block and the sliding
    group the blocks its window reaches: not where the window's blocks were evicted, even though the
    full group still has them, and there the hit is only as long as the sliding group allows."""
    pool = BlockPool(24)
    manager = KVCacheManager(pool, BS, enable_prefix_caching=True, windows=(None, 8))
    owner = make_request(list(range(30)), "owner")
    computed(manager, owner, 30)
    full, sliding = owner.tables
    assert len(full.block_ids) == len(sliding.block_ids) == 8 and full.num_released == 0
    # the next query (position 30) sees keys 23..30: blocks 5..7 are held, 0..4 given back
    assert sliding.num_released == 5 and sliding.block_ids[:5] == [0] * 5
    assert not set(full.block_ids) & set(sliding.block_ids[5:])
    assert pool.num_free == 24 - 8 - 3
    manager.free(owner)
    assert pool.num_free == 24
    # the whole prefix hits: 7 full blocks (28 tokens), the sliding group's 5 and 6 cover positions 21..28
    again = make_request(list(range(30)) + [99], "again")
    assert manager.find_cached_prefix(again) == 7
    assert manager.allocate_slots(again, 3, 7)
    assert again.tables[1].num_released == 5 and again.tables[1].block_ids[5:7] == sliding.block_ids[5:7]
    assert again.tables[0].block_ids[:7] == full.block_ids[:7]
    manager.free(again)
    # evict the sliding group's block 6 (its key in group 1): a hit of 7 blocks is impossible; one of 6 needs
    # the sliding group's blocks 4..5, and block 4 was given back cached: 6 it is
    sliding_key = bytes([1]) + owner.block_hashes[6]
    block = pool.lookup(sliding_key)
    del pool.cached[sliding_key], pool.block_hash[block]
    assert manager.find_cached_prefix(make_request(list(range(30)) + [99], "third")) == 6
    for i in (3, 4):   # without the sliding group's blocks 3 and 4, 6, 5 and 4 blocks cannot hit; 3 (1..2) can
        key = bytes([1]) + owner.block_hashes[i]
        del pool.block_hash[pool.cached.pop(key)]
    assert manager.find_cached_prefix(make_request(list(range(30)) + [99], "fourth")) == 3
    check_pool(pool)


def test_a_hit_in_several_groups_revives_every_cached_block_before_allocating():
    """A prefix hit in two groups from a tight pool: the blocks allocated for one group never include a
    cached block another group is reviving (they come from the free queue's front, where the least
    recently freed cached blocks wait), so no block lands in two tables, and the reference counts are
    the tables' (swept over pool sizes and prompt lengths)."""
    checked = 0
    for num_blocks, length, release in itertools.product(range(6, 20), range(9, 40, 3), (False, True)):
        pool = BlockPool(num_blocks)
        manager = KVCacheManager(pool, BS, enable_prefix_caching=True, windows=(None, 8))
        owner = make_request(list(range(length)), "owner")
        if not manager.allocate_slots(owner, length):
            continue
        owner.num_computed_tokens = length
        manager.cache_full_blocks(owner)
        if release:
            manager.release_behind_window(owner)
        manager.free(owner)
        again = make_request(list(range(length)) + [99] * 5, "again")
        hit = manager.find_cached_prefix(again)
        if not manager.allocate_slots(again, again.num_tokens - hit * BS, hit):
            continue
        held = [b for t in again.tables for b in t.block_ids[t.num_released:]]
        assert len(held) == len(set(held)), (num_blocks, length, [t.block_ids for t in again.tables])
        assert [pool.ref_count[b] for b in range(num_blocks)] == [held.count(b) for b in range(num_blocks)]
        check_pool(pool)
        checked += hit > 0
    assert checked > 10
