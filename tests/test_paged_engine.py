"""Paged attention and the engine core on tiny random models (and the default model).

- `Attention` over a paged cache equals plain contiguous causal attention for ragged batches,
  GQA / MQA / MHA, chunks that start or end on block boundaries and partially filled last blocks,
  on both the decode-only path and the mixed (varlen) path; it writes exactly its own slots.
- A preemption storm (32 requests, a pool far too small) reproduces every request's solo output,
  greedy and seeded sampling, with and without prefix caching.
- Prefix-cache hits give the same tokens as misses; cached (shared) blocks are never written.
- n > 1 shares the prompt's blocks; aborts at any stage return blocks at once; priorities.
- Greedy output does not depend on the batch (random models and the default model), with the
  one float-rounding caveat shown and explained in `test_float_rounding_can_flip_only_a_near_tie`.

Every engine test ends with every block back in the pool.
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_helpers import greedy, make_engine

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.layers.attention import Attention, AttentionMetadata


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These tensors are tiny: one intra-op thread is faster than two, and it keeps this module's
    runtime steady when other processes load the CPU (two OpenMP threads fighting another job for
    two cores make each small matmul ~1000x slower). Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- paged attention against a contiguous reference --------------------------------------------------


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        start: int) -> torch.Tensor:
    """Plain causal attention in float64: q [n, H, D] at positions start..start+n-1 over
    keys/values [L, KVH, D] at positions 0..L-1; query head h uses kv head h // (H / KVH)."""
    n, heads, dim = q.shape
    group = heads // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    visible = torch.arange(keys.shape[0])[None, :] <= torch.arange(start, start + n)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, v).reshape(n, heads * dim)


def paged_case(specs: list[tuple[int, int]], heads: int, kv_heads: int, block_size: int, seed: int = 0):
    """A ragged batch: spec (context, new) = a request with `context` tokens already in the cache
    that now computes `new` more. Block tables are shuffled, non-contiguous block ids; every slot
    not holding a request's context is filled with large garbage (unused tails of last blocks, the
    padding block 0 of short tables, other requests' blocks), which attention must never see."""
    g = torch.Generator().manual_seed(seed)
    dim = 8
    need = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = sum(need) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=g) * 50
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, qs, ks, vs, contexts, slots = [], [], [], [], [], []
    for (context, new), count in zip(specs, need, strict=True):
        table, order = order[:count], order[count:]
        keys = torch.randn(context + new, kv_heads, dim, generator=g)
        values = torch.randn(context + new, kv_heads, dim, generator=g)
        positions = torch.arange(context + new)
        slot = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        cache[0].view(-1, kv_heads, dim)[slot[:context]] = keys[:context]
        cache[1].view(-1, kv_heads, dim)[slot[:context]] = values[:context]
        tables.append(table)
        qs.append(torch.randn(new, heads, dim, generator=g))
        ks.append(keys)
        vs.append(values)
        contexts.append(context)
        slots.append(slot[context:])
    width = max(len(t) for t in tables)
    seq_lens = [c + n for c, n in specs]
    query_start_loc = [0]
    for _, n in specs:
        query_start_loc.append(query_start_loc[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        slot_mapping=torch.cat(slots),
        seq_lens_tensor=torch.tensor(seq_lens),
        block_size=block_size,
    )
    q = torch.cat(qs)
    new_k = torch.cat([k[c:] for k, c in zip(ks, contexts, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(vs, contexts, strict=True)])
    expected = torch.cat([reference_attention(qi, k, v, dim**-0.5, c)
                          for qi, k, v, c in zip(qs, ks, vs, contexts, strict=True)])
    return cache, q, new_k, new_v, meta, expected


GQA = [(4, 2), (6, 2), (4, 1), (4, 4)]   # (heads, kv_heads): GQA 2:1, GQA 3:1, MQA, MHA

# (context, new) per request, for block size 4: a prefill with a partial last block, a decode
# into a fresh block, a chunk from a block boundary to a block boundary, a chunk starting and
# ending mid-block, a prefill of exactly two blocks, a chunk crossing two boundaries, a decode
# filling a block's last slot.
MIXED = [(0, 5), (8, 1), (4, 4), (9, 2), (0, 8), (3, 7), (6, 1)]
# Decode-only: contexts ending anywhere in a block, tables of different lengths (padded).
DECODE = [(0, 1), (3, 1), (4, 1), (7, 1), (16, 1), (22, 1)]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_paged_attention_mixed_batch_equals_contiguous(heads, kv_heads, block_size):
    cache, q, k, v, meta, expected = paged_case(MIXED, heads, kv_heads, block_size)
    assert not meta.is_decode_only
    layer = Attention(heads, kv_heads, 8, 8**-0.5)
    layer.kv_cache = cache
    written = cache.clone()
    written[0].view(-1, kv_heads, 8)[meta.slot_mapping] = k
    written[1].view(-1, kv_heads, 8)[meta.slot_mapping] = v
    out = layer(q, k, v, meta)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, written), "the layer writes exactly its tokens' slots, nothing else"


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), GQA)
def test_paged_attention_decode_batch_equals_contiguous_on_both_paths(heads, kv_heads, block_size, backend):
    cache, q, k, v, meta, expected = paged_case(DECODE, heads, kv_heads, block_size, seed=1)
    assert meta.is_decode_only
    layer = Attention(heads, kv_heads, 8, 8**-0.5)
    layer.kv_cache = cache
    layer.backend = backend
    out = layer(q, k, v, meta)            # the batched decode path
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # The varlen path over the same (now written) cache gives the same rows.
    varlen = torch.empty_like(q)  # the per-request SDPA path, forced on single-query requests
    layer._varlen(q, cache[0], cache[1], meta, list(range(len(meta.seq_lens))), varlen)
    varlen = varlen.reshape(q.shape[0], -1)
    torch.testing.assert_close(varlen.double(), expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_ignores_block_order_and_placement():
    """The same request under two different block tables (and different garbage) gives the same
    output: only the table's mapping matters, not where the blocks are."""
    outs = []
    for seed in (2, 3):
        cache, q, k, v, meta, expected = paged_case([(10, 3)], 4, 2, 4, seed=seed)
        # Same q/k/v for both seeds: rebuild them from a fixed generator, rewrite the context.
        g = torch.Generator().manual_seed(99)
        keys, values, q = torch.randn(13, 2, 8, generator=g), torch.randn(13, 2, 8, generator=g), \
            torch.randn(3, 4, 8, generator=g)
        table = meta.block_tables[0]
        pos = torch.arange(13)
        slot = table[pos // 4] * 4 + pos % 4
        cache[0].view(-1, 2, 8)[slot[:10]] = keys[:10]
        cache[1].view(-1, 2, 8)[slot[:10]] = values[:10]
        layer = Attention(4, 2, 8, 8**-0.5)
        layer.kv_cache = cache
        outs.append(layer(q, keys[10:], values[10:], meta))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(outs[0].double(), reference_attention(q, keys, values, 8**-0.5, 10),
                               atol=1e-5, rtol=1e-5)


# ---- engine helpers ---------------------------------------------------------------------------------------


def _prompts(vocab: int, lengths: list[int], seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run(engine, prompt: list[int], params: SamplingParams, **kwargs):
    request = engine.add_request(prompt, params, **kwargs)
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_blocks == engine.pool.num_blocks
    return request


def assert_no_leak(engine) -> None:
    assert not engine.has_unfinished()
    assert engine.num_free_blocks == engine.pool.num_blocks, "blocks leaked"
    assert all(r == 0 for r in engine.pool.ref_count)


@pytest.fixture(scope="module")
def llama_path(tiny_hf_model):
    return tiny_hf_model("llama")


# ---- preemption storm ------------------------------------------------------------------------------------


def _storm_workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """32 requests: prompts of 2..8 tokens, the first 8 sharing a 4-token stem (prefix-cache hits);
    even ones greedy, odd ones seeded sampling at temperature 1; 6..14 new tokens each. Short
    prompts and long outputs: many requests are admitted, then all grow and evict each other."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(2, 9, (32,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    stem = torch.randint(3, vocab, (4,), generator=g).tolist()
    prompts[:8] = [stem + p[:4] for p in prompts[:8]]
    params = [SamplingParams(max_tokens=6 + i % 9, ignore_eos=True,
                             **(dict(temperature=0.0) if i % 2 == 0 else dict(temperature=1.0, seed=1000 + i)))
              for i in range(32)]
    return prompts, params


@pytest.fixture(scope="module")
def storm_solo(llama_path):
    """Each storm request run alone on a big pool."""
    engine = make_engine(llama_path, block_size=4, num_kv_blocks=256)
    prompts, params = _storm_workload(engine.model_config.vocab_size)
    solo = [run(engine, p, sp).output_token_ids for p, sp in zip(prompts, params, strict=True)]
    assert_no_leak(engine)
    return prompts, params, solo


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_storm_reproduces_solo_outputs(llama_path, storm_solo, prefix_caching):
    prompts, params, solo = storm_solo
    # The largest request needs 8 + 14 = 22 tokens = 6 blocks: the pool holds just that.
    engine = make_engine(llama_path, block_size=4, num_kv_blocks=6, enable_prefix_caching=prefix_caching)
    check_storm(engine, prompts, params, solo)


def test_preemption_storm_with_an_int8_cache(llama_path):
    """The storm with an int8 cache: a preempted request recomputes its K/V in a prefill where they were
    first written by decode steps; each value rounds to the same int8 step unless a last-bit
    difference of the float32 model crosses a rounding boundary, and the outputs are the solo ones."""
    solo_engine = make_engine(llama_path, block_size=4, num_kv_blocks=256, kv_cache_dtype="int8")
    prompts, params = _storm_workload(solo_engine.model_config.vocab_size)
    solo = [run(solo_engine, p, sp).output_token_ids for p, sp in zip(prompts, params, strict=True)]
    check_storm(make_engine(llama_path, block_size=4, num_kv_blocks=6, kv_cache_dtype="int8"), prompts, params, solo)


def check_storm(engine, prompts: list[list[int]], params: list[SamplingParams], solo: list[list[int]]) -> None:
    """Every storm request at once on `engine`'s small pool: many preemptions, the solo outputs."""
    requests = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 5000
        pool = engine.pool
        assert pool.num_free + sum(r > 0 for r in pool.ref_count) == pool.num_blocks
    assert engine.scheduler.num_preemptions >= 32, engine.scheduler.num_preemptions
    assert sum(r.num_preemptions > 0 for r in requests) >= 16
    for i, request in enumerate(requests):
        kind = "greedy" if i % 2 == 0 else "seeded"
        assert request.output_token_ids == solo[i], f"request {i} ({kind}, {request.num_preemptions} preemptions)"
    assert_no_leak(engine)


# ---- prefix caching ---------------------------------------------------------------------------------------


def test_prefix_cache_hit_gives_the_same_tokens_as_a_miss(llama_path):
    hit = make_engine(llama_path, block_size=4, enable_prefix_caching=True)
    miss = make_engine(llama_path, block_size=4, enable_prefix_caching=False)
    vocab = hit.model_config.vocab_size
    prompt = _prompts(vocab, [22], seed=3)[0]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    first = run(hit, prompt, params)
    assert first.num_cached_tokens == 0 and hit.kv.prefix_hit_rate == 0
    assert first.output_token_ids == run(miss, prompt, params).output_token_ids
    # Same prompt again: every full block but the one holding the last prompt token is reused.
    again = run(hit, prompt, params)
    assert again.num_cached_tokens == 20
    assert again.output_token_ids == first.output_token_ids
    # A follow-up that continues the first answer reuses blocks written by DECODE steps too.
    follow = prompt + first.output_token_ids[:7] + _prompts(vocab, [3], seed=4)[0]
    with_hit = run(hit, follow, params)
    without = run(miss, follow, params)
    assert with_hit.num_cached_tokens == 28 and without.num_cached_tokens == 0
    assert hit.kv.prefix_hit_rate > 0 and miss.kv.prefix_hit_rate == 0
    assert with_hit.output_token_ids == without.output_token_ids
    torch.testing.assert_close(torch.tensor([lp for lp, _ in with_hit.logprobs]),
                               torch.tensor([lp for lp, _ in without.logprobs]), atol=1e-4, rtol=0)
    assert_no_leak(hit)
    assert_no_leak(miss)


def test_shared_blocks_are_never_written(llama_path):
    """Three requests share an owner's cached prompt blocks while all of them decode; before and
    after every step, each block that stays cached under the same hash keeps its K/V bit for bit."""
    engine = make_engine(llama_path, block_size=4, max_num_batched_tokens=8)
    solo_engine = make_engine(llama_path, block_size=4, enable_prefix_caching=False)
    vocab = engine.model_config.vocab_size
    stem = _prompts(vocab, [13], seed=5)[0]
    suffixes = _prompts(vocab, [1, 2, 3, 6], seed=6)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    solo = [run(solo_engine, stem + s, params).output_token_ids for s in suffixes]
    owner = engine.add_request(stem + suffixes[0], params)
    engine.step()
    engine.step()                     # owner's 14 tokens prefilled in chunks of 8: 3 blocks cached
    sharers = [engine.add_request(stem + s, params) for s in suffixes[1:]]
    most_shared = 0
    checked = 0
    while engine.has_unfinished():
        pool = engine.pool
        cached = dict(pool.block_hash)
        most_shared = max(most_shared, max(pool.ref_count))
        before = {b: [layer[:, b].clone() for layer in engine.kv_caches] for b in cached}
        engine.step()
        for block, block_hash in cached.items():
            if pool.block_hash.get(block) == block_hash:
                checked += 1
                for old, layer in zip(before[block], engine.kv_caches, strict=True):
                    assert torch.equal(old, layer[:, block]), f"cached block {block} was written"
    assert most_shared == 4, "the stem's blocks were shared by all four requests"
    assert checked > 20
    assert all(s.num_cached_tokens == 12 for s in sharers)
    assert [r.output_token_ids for r in [owner, *sharers]] == solo
    assert_no_leak(engine)
    assert_no_leak(solo_engine)


def test_a_request_arriving_mid_prefill_reuses_only_computed_blocks(llama_path):
    """The owner's 10-token prompt is prefilled in chunks of 7: after one step block 0 is full and
    block 1 holds 3 of its 4 tokens. A request with the same prompt admitted in the next step (next
    to the owner's last chunk) may reuse block 0 only."""
    engine = make_engine(llama_path, block_size=4, max_num_batched_tokens=7)
    prompt = _prompts(engine.model_config.vocab_size, [10], seed=15)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = greedy(make_engine(llama_path, block_size=4, enable_prefix_caching=False), [prompt], 6)[0]
    owner = engine.add_request(prompt, params)
    engine.step()
    assert owner.num_computed_tokens == 7
    late = engine.add_request(prompt, params)
    engine.step()
    assert late.num_cached_tokens == 4 and late.num_computed_tokens == 8   # 4 cached + a chunk of 4
    while engine.has_unfinished():
        engine.step()
    assert owner.output_token_ids == expected and late.output_token_ids == expected
    assert_no_leak(engine)


def test_aborting_the_owner_keeps_shared_blocks_for_the_sharer(llama_path):
    engine = make_engine(llama_path, block_size=4)
    vocab = engine.model_config.vocab_size
    prompt, tail = _prompts(vocab, [12, 2], seed=8)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = greedy(make_engine(llama_path, block_size=4, enable_prefix_caching=False), [prompt + tail], 8)[0]
    owner = engine.add_request(prompt, params)
    engine.step()
    sharer = engine.add_request(prompt + tail, params)
    engine.step()
    shared = owner.block_ids[:3]
    assert sharer.block_ids[:3] == shared and [engine.pool.ref_count[b] for b in shared] == [2, 2, 2]
    free = engine.num_free_blocks
    engine.abort(owner.request_id)
    assert [engine.pool.ref_count[b] for b in shared] == [1, 1, 1]
    assert engine.num_free_blocks == free + 1       # only the owner's private last block came back
    while engine.has_unfinished():
        engine.step()
    assert sharer.output_token_ids == expected
    assert_no_leak(engine)


# ---- n > 1 -----------------------------------------------------------------------------------------------


def test_parallel_samples_share_the_prompt_blocks(llama_path):
    llm = LLM(str(llama_path), dtype="float32", block_size=4, num_kv_blocks=64)
    engine = llm.engine
    prompt = _prompts(engine.model_config.vocab_size, [17], seed=9)[0]
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    peak_used, peak_shared = 0, 0
    step = engine.step

    def observed_step():
        updated = step()
        running = engine.scheduler.running
        nonlocal peak_used, peak_shared
        peak_used = max(peak_used, engine.pool.num_blocks - engine.num_free_blocks)
        if len(running) == 4:
            heads = {tuple(r.block_ids[:4]) for r in running}
            if len(heads) == 1:
                peak_shared = max(peak_shared, min(engine.pool.ref_count[b] for b in heads.pop()))
        return updated

    engine.step = observed_step
    [out] = llm.generate(prompt, params, use_tqdm=False)
    # 17 prompt tokens = 4 full blocks, shared by all 4 samples; each sample then needs blocks for
    # positions 16..24 of its own: 3 blocks. 4 + 4 * 3 = 16 blocks, against 4 * 7 = 28 for copies.
    assert peak_shared == 4
    assert peak_used <= 16
    # Sharing does not change the samples: each equals its seed run alone, without prefix caching.
    alone = make_engine(llama_path, block_size=4, enable_prefix_caching=False)
    for i, completion in enumerate(out.outputs):
        solo = run(alone, prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=3 + i, ignore_eos=True))
        assert completion.token_ids == solo.output_token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_no_leak(engine)


# ---- aborts ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_at_any_stage_returns_blocks_within_one_step(llama_path, stage):
    engine = make_engine(llama_path, block_size=4, num_kv_blocks=8, max_num_batched_tokens=6,
                         enable_prefix_caching=False)
    vocab = engine.model_config.vocab_size
    keep_prompt, victim_prompt = _prompts(vocab, [9, 10], seed=10)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = greedy(make_engine(llama_path, block_size=4), [keep_prompt], 12)[0]
    keep = engine.add_request(keep_prompt, params)
    victim = engine.add_request(victim_prompt, params)
    if stage == "prefilling":
        engine.step()
        engine.step()                 # keep: 9 tokens in chunks of 6 and 3; victim: 3 of 10
        assert 0 < victim.num_computed_tokens < victim.num_tokens and victim.block_ids
    elif stage == "decoding":
        while not victim.output_token_ids:
            engine.step()
        assert victim.block_ids
    elif stage == "preempted":        # 8 blocks cannot hold both at 21 + 22 tokens
        while victim.num_preemptions == 0:
            engine.step()
        assert victim in engine.scheduler.waiting and victim.output_token_ids
    else:
        assert victim in engine.scheduler.waiting
    held, free = len(victim.block_ids), engine.num_free_blocks
    engine.abort(victim.request_id)
    assert victim.finish_reason == "abort" and victim.block_ids == []
    assert engine.num_free_blocks == free + held
    assert victim not in engine.scheduler.running and victim not in engine.scheduler.waiting
    engine.step()
    assert engine.num_free_blocks == engine.pool.num_blocks - len(keep.block_ids)
    while engine.has_unfinished():
        engine.step()
    assert keep.output_token_ids == expected
    assert_no_leak(engine)


def test_unchunked_prompt_longer_than_the_budget_still_runs(llama_path):
    """With chunked prefill off, a prompt longer than max_num_batched_tokens used to wait forever
    (and block every request behind it); it is prefilled in chunks anyway, with the same tokens."""
    engine = make_engine(llama_path, block_size=4, max_num_batched_tokens=4, enable_chunked_prefill=False)
    long, short = _prompts(engine.model_config.vocab_size, [10, 3], seed=16)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in (long, short)]
    for _ in range(100):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished(), "a prompt longer than the budget never ran"
    assert [r.output_token_ids for r in requests] == greedy(make_engine(llama_path, block_size=4), [long, short], 5)
    assert_no_leak(engine)


# ---- priorities ------------------------------------------------------------------------------------------


def test_late_high_priority_request_runs_before_earlier_low_priority_ones(llama_path):
    engine = make_engine(llama_path, block_size=4, max_num_seqs=1)
    prompts = _prompts(engine.model_config.vocab_size, [5, 6, 7, 8], seed=12)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = engine.add_request(prompts[0], params, priority=1)
    engine.step()
    low = [engine.add_request(p, params, priority=1) for p in prompts[1:3]]
    urgent = engine.add_request(prompts[3], params, priority=0)
    order = []
    while engine.has_unfinished():
        for request in engine.step():
            if request.is_finished:
                order.append(request)
    assert order == [first, urgent, *low]
    assert_no_leak(engine)


# ---- batch independence ---------------------------------------------------------------------------------

# Greedy decoding is "argmax of the logits", but the logits of one row are not bit-identical
# across batch compositions: packing other requests into the step changes the shapes of the
# matmuls, and CPU/GPU kernels then sum in a different order (float addition is not associative).
# The differences are ~1e-6 in float32. A greedy token can therefore flip only when its top-2
# logits are within that noise -- a near-tie. The tests below compare solo and batched greedy
# runs exactly and accept a difference only at such a near-tie, so a real bug (wrong K/V, wrong
# positions, a mixed-up block table) cannot hide behind "rounding".
NEAR_TIE = 1e-4


def _run_greedy(engine, prompts: list[list[int]], max_tokens: int, logprobs: int) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(engine)
    return requests


def _greedy_with_margins(engine, prompts: list[list[int]], max_tokens: int):
    return [(r.output_token_ids, [top[0][1] - top[1][1] for _, top in r.logprobs])
            for r in _run_greedy(engine, prompts, max_tokens, 2)]


def assert_batch_independent(engine, prompts: list[list[int]], max_tokens: int) -> float:
    """Solo vs all-together greedy runs; returns the smallest top-2 margin seen."""
    alone = [_greedy_with_margins(engine, [p], max_tokens)[0] for p in prompts]
    together = _greedy_with_margins(engine, prompts, max_tokens)
    for i, ((solo, margins), (batched, _)) in enumerate(zip(alone, together, strict=True)):
        if solo != batched:
            at = next(j for j, (a, b) in enumerate(zip(solo, batched, strict=True)) if a != b)
            assert margins[at] < NEAR_TIE, (f"prompt {i}: greedy token {at} differs between solo and batched runs "
                                            f"with a top-2 margin of {margins[at]:.3g}: not rounding, a bug")
    return min(min(m) for _, m in alone)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gpt2"])
def test_greedy_output_does_not_depend_on_the_batch(tiny_hf_model, kind):
    # A small budget mixes prefill chunks and decodes of different requests in one step.
    engine = make_engine(tiny_hf_model(kind), block_size=4, max_num_batched_tokens=16)
    prompts = _prompts(engine.model_config.vocab_size, [1, 5, 12, 19, 8, 3, 16], seed=13)
    margin = assert_batch_independent(engine, prompts, 12)
    # On these models no near-tie occurs, so the outputs above were compared exactly.
    assert margin > NEAR_TIE


def test_greedy_output_does_not_depend_on_the_batch_default_model(default_gguf_path):
    llm = LLM(str(default_gguf_path), dtype="float32", max_model_len=512, num_kv_blocks=64,
              max_num_batched_tokens=24)
    # With the GGUF weights kept quantized (the default): every row runs the quantized kernel, whose
    # output for a row does not depend on the other rows (a long prompt's chunks share steps with decodes).
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "1, 2, 3, 4,", "Here is a long story about the sea. " * 20]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    assert len(prompts[-1]) > 100 > max(map(len, prompts[:-1]))
    assert llm.engine.config.quantization is None
    assert_batch_independent(llm.engine, prompts, 8)


def _greedy_with_logprobs(engine, prompts: list[list[int]], max_tokens: int):
    return [(r.output_token_ids, r.logprobs) for r in _run_greedy(engine, prompts, max_tokens, 3)]


@pytest.mark.parametrize(("kind", "kv_cache_dtype"),
                         [("llama", "auto"), ("qwen3", "auto"), ("gemma2", "auto"), ("gemma3", "auto"),
                          ("llama", "int8"), ("gemma3", "int8"), ("mixtral", "auto"), ("qwen2_moe", "auto")])
def test_quantized_rows_do_not_depend_on_the_batch(tiny_gguf_model, kind, kv_cache_dtype):
    """On the quantized CPU path a row's output does not depend on the other rows, bit for bit: each
    request's greedy tokens and logprobs alone == packed with the others. Alone, its decodes run in
    decode-only steps (the C decode stack); packed, many share a step with another request's prefill
    chunk (the layer loop, whose decode rows take the same C kernels). That holds only if every op of a
    row takes the same C code on both paths; the q/k norms (Qwen3, Gemma 3) and the sandwich norms
    (Gemma 2/3) once ran in C in the stack and the fused rotary decode but in PyTorch in mixed steps.
    Prefix caching is off: a prompt whose first blocks come from the cache computes its last row alone,
    with the decode kernel rather than the prefill kernel (another summation order). An int8 cache
    quantizes the same K/V to the same bytes in the prefill path (PyTorch) and the decode path (C).
    Mixtures of experts run one C block (moe.c) that routes and sums each row on its own. Builds without
    AVX-512 or AVX2 have no C prefill kernel: their prompts run SDPA, whose rows depend on their chunk."""
    if not kernels.has_prefill_kernel():
        pytest.skip("no C prefill kernel in this build; SDPA's rows depend on their chunk")
    engine = make_engine(tiny_gguf_model(kind, "Q8_0"), device="cpu", block_size=4, max_num_batched_tokens=16,
                         enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    prompts = _prompts(engine.model_config.vocab_size, [1, 5, 12, 19, 8, 3, 16], seed=13)
    alone = [_greedy_with_logprobs(engine, [p], 12)[0] for p in prompts]
    assert isinstance(engine.model.model._plan, kernels.StackPlan)   # the quantized C path, stack included
    together = _greedy_with_logprobs(engine, prompts, 12)
    for i, (solo, batched) in enumerate(zip(alone, together, strict=True)):
        assert solo == batched, f"prompt {i}: tokens or logprobs differ between the solo and the batched run"


def test_float_rounding_can_flip_only_a_near_tie(llama_path):
    """Shows the caveat above on the real model: the last-row logits of a prompt alone and packed
    with other prompts differ by float noise, never by more than NEAR_TIE; and a tie placed inside
    that noise (via a logit bias equal to the midpoint of the two runs' top-2 gaps) does flip."""
    engine = make_engine(llama_path, block_size=4)
    prompts = _prompts(engine.model_config.vocab_size, [7, 13, 3, 20, 9], seed=14)

    def last_row_logits(batch: list[list[int]]) -> torch.Tensor:
        requests = [engine.add_request(p, SamplingParams(max_tokens=1, temperature=0.0)) for p in batch]
        scheduled = engine.scheduler.schedule().scheduled
        input_ids, positions, meta, rows, _ = engine.runner.prepare(scheduled)
        with torch.inference_mode():
            hidden = engine.model(input_ids, positions, meta)
            logits = engine.model.compute_logits(hidden[torch.tensor(rows)])
        for request in requests:
            engine.abort(request.request_id)
        return logits

    alone = last_row_logits(prompts[:1])[0]
    packed = last_row_logits(prompts)[0]
    noise = (alone - packed).abs().max().item()
    assert noise < NEAR_TIE
    assert_no_leak(engine)
    if noise == 0:
        pytest.skip("this platform computes the row bit-identically in both batches: no tie can flip")
    # Make token b tie with the argmax a, at the midpoint between the two runs' gaps.
    a = int(alone.argmax())
    gaps = [(alone[a] - alone[b]).item() - (packed[a] - packed[b]).item() for b in range(alone.numel())]
    b = max(range(alone.numel()), key=lambda t: abs(gaps[t]) if t != a else -1.0)
    bias = torch.zeros_like(alone, dtype=torch.float64)
    bias[b] = ((alone[a] - alone[b]).item() + (packed[a] - packed[b]).item()) / 2
    solo_pick, batched_pick = int((alone.double() + bias).argmax()), int((packed.double() + bias).argmax())
    assert {solo_pick, batched_pick} == {a, b}, "a tie inside the rounding noise flips with the batch"
    assert math.isclose((alone.double() + bias)[a].item(), (alone.double() + bias)[b].item(), abs_tol=NEAR_TIE)
