"""The C decode-attention kernel (tokenmill/kernels) against the PyTorch reference backend."""

from __future__ import annotations

import copy
import ctypes
import itertools
import logging

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import greedy, make_engine, prefill_logits

from tokenmill import LLM, SamplingParams, config, kernels
from tokenmill.config import resolve_kv_cache_dtype
from tokenmill.engine.kv_cache import kv_bytes_per_token
from tokenmill.errors import TokenmillError
from tokenmill.layers.attention import (
    Attention,
    AttentionMetadata,
    dequantize_kv,
    from_cache_rows,
    kv_row_width,
    quantize_kv,
    to_cache_rows,
)
from tokenmill.layers.op import set_backend
from tokenmill.layers.quant import QuantWeight, kernel_available
from tokenmill.models.loader import weight_forms

KV_DTYPES = [torch.float32, torch.bfloat16, torch.int8]   # cache dtypes; int8: rows with a scale each


def query_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    return kv_dtype if kv_dtype.is_floating_point else torch.float32


def random_paged_batch(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype, seed: int = 0):
    """Caches full of random values (also in slots nobody owns), shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    cache = to_cache_rows(torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g), dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for count in need:
        tables.append(order[:count])
        order = order[count:]
    width = max(need)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(query_dtype(dtype))
    return q, cache, block_tables, torch.tensor(lens)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """The layer's cache write: x [len(slots), kv_heads, head_dim] into one K or V cache's slots."""
    cache.view(-1, *cache.shape[-2:]).index_copy_(0, slots, to_cache_rows(x, cache.dtype))


def poison(cache: torch.Tensor, index) -> None:
    """Cache rows that must never be read made NaN (int8 rows: every byte 0xff, a NaN scale)."""
    cache[index] = float("nan") if cache.dtype.is_floating_point else -1


def gather_exact(cache, table, n, block_size, heads):
    """A request's first n K and V rows, one token at a time from its block table, in float64 and
    repeated per query head: two [n, heads, d] tensors."""
    pos = torch.arange(n)
    slots = table[pos // block_size] * block_size + pos % block_size
    group = heads // cache.shape[3]
    return tuple(from_cache_rows(c.flatten(0, 1)[slots], torch.float64).repeat_interleave(group, dim=1)
                 for c in cache)


def exact_decode(q, cache, block_tables, seq_lens, block_size, scale):
    """float64 attention of each query over its request's slots."""
    out = []
    for b, n in enumerate(seq_lens.tolist()):
        k, v = gather_exact(cache, block_tables[b], n, block_size, q.shape[1])
        probs = (torch.einsum("hd,nhd->hn", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", probs, v))
    return torch.stack(out)


def test_kernel_builds_here():
    assert kernels.load() is not None, "the C kernel must build on a machine with a C compiler (CI has gcc)"


@pytest.mark.parametrize("generic", [False, True])   # AVX-512 path (where present) and the portable loops
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 64, 4), (8, 1, 64, 1), (6, 2, 64, 32), (4, 2, 128, 16),
                          (2, 1, 80, 16)])
def test_kernel_equals_exact_attention(generic, dtype, heads, kv_heads, head_dim, block_size):
    lens = [1, 2, 15, 16, 17, 100, 333, 64]   # one token, block boundaries, partial last blocks
    q, cache, tables, seq_lens = random_paged_batch(lens, heads, kv_heads, head_dim, block_size, dtype)
    got = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, head_dim**-0.5, generic=generic)
    assert got.dtype == torch.float32
    expected = exact_decode(q, cache, tables, seq_lens, block_size, head_dim**-0.5)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)


def exact_prefill(q, cache, table, seq_len, block_size, scale):
    """float64 causal attention of q [n, heads, d] (the last n of seq_len positions) over one request."""
    n = q.shape[0]
    k, v = gather_exact(cache, table, seq_len, block_size, q.shape[1])   # [L, heads, d]
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    scores.masked_fill_(torch.arange(seq_len)[None, :] > torch.arange(seq_len - n, seq_len)[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def bf16_dots(cache: torch.Tensor) -> bool:
    """Does the prefill kernel take bfloat16 dot products on this cache here (AVX512-BF16, bf16 cache)?"""
    return cache.dtype == torch.bfloat16 and kernels.prefill_bf16_dots()


def assert_prefill_close(got: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, reference) -> None:
    """The prefill kernel's output == reference(q) in float64, to float32's rounding; where it takes
    bfloat16 dot products, == reference(q rounded to bfloat16) to within what rounding each
    probability to bfloat16 (2^-9 of itself) can move a weighted mean of V: at most about 2^-8 max
    |v| (2^-8 / (1 - 2^-9), plus float32's rounding), and on average far less (2^-12 max |v| here is
    at least twice the mean error of any of these cases)."""
    if not bf16_dots(cache):
        torch.testing.assert_close(got.double(), reference(q), atol=2e-6, rtol=1e-5)
        return
    assert_within_probability_rounding(got, reference(q.bfloat16().float()), cache[1].float().abs().max().item())


def assert_within_probability_rounding(got: torch.Tensor, expected: torch.Tensor, vmax: float) -> None:
    """assert_prefill_close's bound for bf16 dot products: got within 2^-8 vmax of expected at most,
    2^-12 vmax on average (vmax: the largest |v| the rows can weigh)."""
    error = (got.double() - expected.double()).abs()
    assert error.max().item() <= 2**-8 * vmax and error.mean().item() <= 2**-12 * vmax, (error.max(), error.mean())


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 64, 4), (8, 1, 64, 1), (6, 2, 64, 32), (4, 2, 128, 16),
                          (2, 1, 80, 16)])
@pytest.mark.parametrize(("seq_len", "num_q"), [(1, 1), (17, 17), (100, 100), (333, 5), (64, 63), (40, 1)])
def test_prefill_kernel_equals_exact_attention(dtype, heads, kv_heads, head_dim, block_size, seq_len, num_q):
    """A whole prompt (num_q == seq_len) and a chunk after cached tokens (num_q < seq_len); row blocks
    of 4 with a partial last one, keys past a row's position masked, blocks anywhere in the cache."""
    if not kernels.has_prefill_kernel():
        pytest.skip("no prefill kernel in this build (SDPA runs)")
    q, cache, tables, _ = random_paged_batch([seq_len], heads, kv_heads, head_dim, block_size, dtype, seed=seq_len)
    q = torch.randn(num_q, heads, head_dim, generator=torch.Generator().manual_seed(5)).to(query_dtype(dtype))
    got = kernels.paged_prefill(q, cache[0], cache[1], tables[0], seq_len, head_dim**-0.5)
    assert got is not None and got.dtype == torch.float32 and got.shape == q.shape
    assert_prefill_close(got, q, cache, lambda q: exact_prefill(q, cache, tables[0], seq_len, block_size,
                                                                head_dim**-0.5))


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_prefill_kernel_output_is_a_weighted_mean_of_v(dtype):
    """Each row's output is its probabilities times V over their sum: V the same everywhere comes out
    as itself, to float32 rounding (sums of a few hundred terms), also where the probabilities are
    rounded to bfloat16 (their sum must then add the rounded values, or the output is off by up to
    2^-9 of itself)."""
    if not kernels.has_prefill_kernel():
        pytest.skip("no prefill kernel in this build (SDPA runs)")
    q, cache, tables, _ = random_paged_batch([300], 9, 3, 64, 16, dtype, seed=3)
    cache[1] = to_cache_rows(torch.full((*cache[1].shape[:-1], 64), 1.5), dtype)
    value = from_cache_rows(cache[1][:1, :1, :1], torch.float32).flatten()[0].item()   # 1.5 as the cache holds it
    q = torch.randn(200, 9, 64, generator=torch.Generator().manual_seed(4)) * 4
    got = kernels.paged_prefill(q, cache[0], cache[1], tables[0], 300, 64**-0.5)
    torch.testing.assert_close(got, torch.full_like(got, value), atol=0, rtol=1e-5)


def test_prefill_kernel_bf16_probabilities_are_the_exact_ones_rounded():
    """With bfloat16 dot products, each probability is exp(score - max) rounded to bfloat16; the kernel
    computes the exp with a polynomial (2^f, good to ~2e-7 of itself), which may move a rounding
    only where the exact value lies that close to a rounding boundary. In one tile of keys (<= 64: the
    running max is the row's max) the output is then the exact attention with the probabilities rounded
    to bfloat16 to float32 rounding and a few such flips: a mean error of ~2^-27 vmax here, where a
    polynomial off by 1e-4 of itself gives ~2^-18 (many probabilities round differently).
    At most one flip's worth anywhere: 2^-8 of a probability's share of vmax."""
    if not kernels.has_prefill_kernel() or not kernels.prefill_bf16_dots():
        pytest.skip("no bf16 dot products in this build")
    heads, kv_heads, head_dim, seq_len = 4, 2, 64, 64
    q, cache, tables, _ = random_paged_batch([seq_len], heads, kv_heads, head_dim, 16, torch.bfloat16, seed=11)
    q = torch.randn(seq_len, heads, head_dim, generator=torch.Generator().manual_seed(12)) * 3
    got = kernels.paged_prefill(q, cache[0], cache[1], tables[0], seq_len, head_dim**-0.5)
    k, v = gather_exact(cache, tables[0], seq_len, 16, heads)   # [L, heads, d] float64
    scores = torch.einsum("nhd,lhd->hnl", q.bfloat16().double(), k) * head_dim**-0.5
    scores.masked_fill_(torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1), float("-inf"))
    p = (scores - scores.amax(-1, keepdim=True)).exp().bfloat16().double()
    expected = torch.einsum("hnl,lhd->nhd", p / p.sum(-1, keepdim=True), v)
    error = (got.double() - expected).abs() / v.abs().max()
    assert error.mean().item() <= 2**-22 and error.max().item() <= 2**-8, (error.mean(), error.max())


def test_prefill_kernel_declines_other_head_dims():
    q, cache, tables, _ = random_paged_batch([20], 2, 1, 40, 16, torch.float32)
    assert kernels.paged_prefill(torch.randn(20, 2, 40), cache[0], cache[1], tables[0], 20, 0.1) is None


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_kernel_backend_equals_torch_backend_in_the_layer(dtype):
    lens = [5, 48, 200, 7, 129]
    q, cache, tables, seq_lens = random_paged_batch(lens, 9, 3, 64, 16, dtype, seed=3)
    layer = Attention(9, 3, 64, 0.125)
    fast = layer._decode(q, cache[0], cache[1], tables, seq_lens)
    reference = layer._decode_torch(q, cache[0], cache[1], tables, seq_lens)
    assert fast.dtype == reference.dtype == query_dtype(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5   # bf16: both round the fp32 result once
    torch.testing.assert_close(fast.float(), reference.float(), atol=tol, rtol=tol)


def test_engine_greedy_tokens_equal_on_both_backends(tiny_hf_model):
    path = tiny_hf_model("llama")
    prompts = [[1, 5, 9, 2], list(range(3, 40)), [7] * 19, [11, 12]]
    outputs = {}
    for backend in ("torch", "auto"):
        engine = make_engine(path, block_size=4, attention_backend=backend)
        outputs[backend] = greedy(engine, prompts, max_tokens=24)
    assert outputs["auto"] == outputs["torch"]


def _clear_kernel_caches() -> None:
    kernels._library.cache_clear()


def test_no_compiler_falls_back_with_a_warning(monkeypatch, caplog, tiny_gguf_model):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    _clear_kernel_caches()
    try:
        with caplog.at_level(logging.WARNING, logger="tokenmill.kernels"):
            assert kernels.load() is None
            assert not kernels.supports_paged_decode(torch.zeros(1, 1, 1, 1))
        assert "PyTorch path" in caplog.text and "dequantized at load" in caplog.text
        # quantized GGUF weights are then dequantized; asking for at-load quantization is an error
        llm = LLM(str(tiny_gguf_model("llama", "Q4_1")), num_kv_blocks=16)
        assert weight_forms(llm.engine.model) == {"dense": 10}
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
        with pytest.raises(TokenmillError, match="quantization: 'int4' runs with the C kernel only"):
            LLM(str(tiny_gguf_model("llama", "Q4_1")), quantization="int4", num_kv_blocks=16)
    finally:
        _clear_kernel_caches()


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("head_dim", [64, 80])   # 80: an int8 row's last group holds 16 values
def test_fused_rotary_decode_equals_the_unfused_ops(dtype, generic, head_dim):
    """decode_rotary (rotary + cache write + attention in one C call) == apply_rotary, the layer's
    index_copy_ cache write and the decode kernel: the same bits in the output and the cache (an
    int8 cache: the same quantized bytes, a zero V head and a large K included)."""
    from tokenmill.layers.attention import AttentionMetadata
    from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary

    heads, kv_heads, block_size = 9, 3, 16
    lens = [5, 48, 200, 17]
    _, cache, tables, seq_lens = random_paged_batch(lens, heads, kv_heads, head_dim, block_size, dtype, seed=5)
    positions = seq_lens - 1
    slots = tables[torch.arange(len(lens)), positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(query_start_loc=list(range(len(lens) + 1)), seq_lens=seq_lens.tolist(),
                             block_tables=tables, slot_mapping=slots, seq_lens_tensor=seq_lens, block_size=block_size)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim)
    qkv[0, (heads + kv_heads) * head_dim:][:head_dim] = 0      # a zero V head: scale 0
    qkv[1, heads * head_dim:][:head_dim] *= 1e4                # a large K head
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)(positions)

    unfused_cache = cache.clone()
    q, k, v = qkv.view(len(lens), -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    q = apply_rotary(q, *rope)
    for i, t in enumerate((apply_rotary(k, *rope), v)):  # the layer's cache write
        write_rows(unfused_cache[i], slots, t)
    expected = kernels.paged_decode(q, unfused_cache[0], unfused_cache[1], tables, seq_lens, head_dim**-0.5,
                                    generic=generic).view(len(lens), -1)
    if not generic:  # and through the layer, as the model calls it
        layer = Attention(heads, kv_heads, head_dim, head_dim**-0.5)
        layer.kv_cache = cache.clone()
        assert torch.equal(layer(q, apply_rotary(k, *rope), v, meta), expected)

    fused_cache = cache.clone()
    got = kernels.paged_decode_rotary(qkv, rope[0].view(len(lens), -1), rope[1].view(len(lens), -1), slots,
                                      fused_cache[0], fused_cache[1], tables, seq_lens, heads, head_dim**-0.5,
                                      generic=generic)
    assert torch.equal(fused_cache, unfused_cache)
    assert torch.equal(got, expected)


def interleaved(cache: torch.Tensor, slots: int = 3, slot: int = 1) -> torch.Tensor:
    """`cache` [2, blocks, ...] copied into slot `slot` of a pool laid out as the engine lays a CPU pool
    out ([blocks, slots, 2, ...]: engine/kv_cache.py), the other slots' rows poisoned: the same values
    whose blocks are not contiguous with each other."""
    pool = torch.empty(cache.shape[1], slots, *cache.shape[:1], *cache.shape[2:], dtype=cache.dtype)
    poison(pool, (slice(None),))
    view = pool[:, slot].transpose(0, 1)
    view.copy_(cache)
    return view


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("generic", [False, True])
def test_kernels_read_and_write_a_cache_whose_blocks_are_interleaved(dtype, generic):
    """decode, fused rotary decode (its cache write too), prefill and the layer's own write give the
    same bits on a layer's cache inside the engine's pool layout as on a contiguous one, and touch
    nothing of the other layers'."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    lens = [5, 48, 200, 17]
    q, cache, tables, seq_lens = random_paged_batch(lens, heads, kv_heads, head_dim, block_size, dtype, seed=7)
    view = interleaved(cache)
    assert not view.is_contiguous() and view.stride(1) == 3 * 2 * view[0, 0].numel()
    expected = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, head_dim**-0.5, generic=generic)
    assert torch.equal(kernels.paged_decode(q, view[0], view[1], tables, seq_lens, head_dim**-0.5, generic=generic),
                       expected)

    positions = seq_lens - 1
    slots = tables[torch.arange(len(lens)), positions // block_size] * block_size + positions % block_size
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(3))
    cos, sin = torch.randn(2, len(lens), head_dim, generator=torch.Generator().manual_seed(4))
    pool = view._base
    others = pool[:, [0, 2]].clone()
    args = (tables, seq_lens, heads, head_dim**-0.5)
    expected = kernels.paged_decode_rotary(qkv, cos, sin, slots, cache[0], cache[1], *args, generic=generic)
    got = kernels.paged_decode_rotary(qkv, cos, sin, slots, view[0], view[1], *args, generic=generic)
    assert torch.equal(got, expected) and torch.equal(view, cache)
    assert torch.equal(pool[:, [0, 2]].view(torch.uint8), others.view(torch.uint8)), "another layer's rows changed"

    if kernels.has_prefill_kernel() and not generic:
        qp = torch.randn(17, heads, head_dim, generator=torch.Generator().manual_seed(5)).to(query_dtype(dtype))
        assert torch.equal(kernels.paged_prefill(qp, view[0], view[1], tables[2], 200, head_dim**-0.5),
                           kernels.paged_prefill(qp, cache[0], cache[1], tables[2], 200, head_dim**-0.5))

    layer = Attention(heads, kv_heads, head_dim, head_dim**-0.5)   # the layer's write (a prefill step's)
    k, v = torch.randn(2, 3, kv_heads, head_dim, generator=torch.Generator().manual_seed(6)).to(query_dtype(dtype))
    written = []
    for c in (cache.clone(), view):
        layer.kv_cache = c
        meta = AttentionMetadata(query_start_loc=[0, 3], seq_lens=[3], block_tables=tables[:1],
                                 slot_mapping=slots[:1].new_tensor([4, 17, 33]), seq_lens_tensor=torch.tensor([3]),
                                 block_size=block_size)
        layer(torch.randn(3, heads, head_dim).to(query_dtype(dtype)), k, v, meta)
        written.append(c.clone())
    assert torch.equal(written[0], written[1])
    assert torch.equal(pool[:, [0, 2]].view(torch.uint8), others.view(torch.uint8))


WINDOWS = [None, 1, 5, 16, 17, 64, 100, 1000]   # none; smaller than, equal to and larger than the contexts
# 1.5 binds (the scaled scores have a standard deviation ~1); 1000 barely does: tanh of tiny arguments,
# where computing it as (1 - e^-2x) / (1 + e^-2x) would lose most of its digits
SOFTCAPS = [None, 1.5, 1000.0]


def torch_reference(heads: int, kv_heads: int, head_dim: int, window: int | None, softcap: float | None,
                    cache: torch.Tensor) -> Attention:
    layer = Attention(heads, kv_heads, head_dim, head_dim**-0.5, sliding_window=window, logit_softcap=softcap)
    layer.kv_cache = cache
    set_backend(layer, "torch")
    return layer


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 2, 80, 4), (8, 1, 128, 1)])
def test_decode_kernel_window_and_softcap_equal_the_torch_reference(generic, dtype, window, softcap, heads, kv_heads,
                                                                    head_dim, block_size):
    """Sliding windows and the logit softcap in the decode kernel (AVX-512 and portable paths) == the
    layer's PyTorch backend: windows that start inside a block, on a block edge, at position 0."""
    lens = [1, 2, 15, 16, 17, 64, 100, 333]
    _, cache, tables, seq_lens = random_paged_batch(lens, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(1))
    reference = torch_reference(heads, kv_heads, head_dim, window, softcap, cache)
    expected = reference._decode(q, cache[0], cache[1], tables, seq_lens)
    got = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, head_dim**-0.5, generic=generic,
                               sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_decode_kernel_reads_no_block_before_the_window():
    """The blocks wholly before a request's window are never read: NaN there changes nothing."""
    heads, kv_heads, head_dim, block_size, window = 4, 2, 64, 4, 6
    lens = [3, 13, 40]
    q, cache, tables, seq_lens = random_paged_batch(lens, heads, kv_heads, head_dim, block_size, torch.float32)
    q = q.float()
    clean = {g: kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, 0.125, generic=g, sliding_window=window)
             for g in (False, True)}
    for b, n in enumerate(lens):
        first_block = max(0, n - window) // block_size
        cache[:, tables[b, :first_block]] = float("nan")
    for g in (False, True):
        got = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, 0.125, generic=g, sliding_window=window)
        assert torch.equal(got, clean[g])


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (700, None), (None, 30.0)])
def test_split_decode_equals_exact_attention(generic, dtype, window, softcap):
    """Batch 1 and 2 at long context on 4 threads: too few (request, kv head) tasks, so each request's
    keys are split into runs whose partial softmaxes are combined (flash-decoding); a short request
    beside a long one is not split. The 1-thread result (never split) sums in another order, so it
    differs in the last bits: that shows the split path ran."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    saved = torch.get_num_threads()
    for lens in ([3001], [2500, 40]):
        _, cache, tables, seq_lens = random_paged_batch(lens, heads, kv_heads, head_dim, block_size, dtype,
                                                        seed=len(lens))
        q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(1))
        options = {"generic": generic, "sliding_window": window, "logit_softcap": softcap}
        try:
            torch.set_num_threads(4)
            got = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, head_dim**-0.5, **options)
            torch.set_num_threads(1)
            unsplit = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, head_dim**-0.5, **options)
        finally:
            torch.set_num_threads(saved)
        expected = torch_reference(heads, kv_heads, head_dim, window, softcap, cache)._decode(
            q, cache[0], cache[1], tables, seq_lens)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(unsplit, expected, atol=1e-5, rtol=1e-5)
        assert not torch.equal(got[0], unsplit[0])
        if len(lens) == 2:   # the short request is one run either way
            assert torch.equal(got[1], unsplit[1])


def check_verify_rows(dtype, window, softcap, heads, kv_heads, head_dim, block_size) -> None:
    """A speculative verify step enters a request as consecutive rows over one block table (the
    runner's k + 1 entries); the kernel takes such rows in one task per kv head (paged_decode.c,
    "Verify rows"). Every entry's output == the entry decoded alone, bit for bit: 7- and 3-row
    requests beside a plain one, and a request whose rows are consecutive in length but whose second
    entry reads another table (taken together they would read the wrong blocks); and a batch-1
    step of 7 rows, which the kernel cuts into pieces to give every thread a task."""
    lens = [40, 23, 90, 61, 62]
    _, cache, tables, _ = random_paged_batch(lens, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim)
    mixed = [(0, 34 + j) for j in range(7)] + [(1, 23)] + [(2, 88 + j) for j in range(3)] + [(3, 61), (4, 62)]
    alone_request = [(2, 84 + j) for j in range(7)]
    options = {"sliding_window": window, "logit_softcap": softcap}
    for rows in (mixed, alone_request):
        entry_tables = tables[[b for b, _ in rows]]
        seq_lens = torch.tensor([n for _, n in rows])
        q = torch.randn(len(rows), heads, head_dim, generator=torch.Generator().manual_seed(2)).to(query_dtype(dtype))
        got = kernels.paged_decode(q, cache[0], cache[1], entry_tables, seq_lens, head_dim**-0.5, **options)
        for i in range(len(rows)):
            alone = kernels.paged_decode(q[i:i + 1], cache[0], cache[1], entry_tables[i:i + 1], seq_lens[i:i + 1],
                                         head_dim**-0.5, **options)
            assert torch.equal(got[i], alone[0]), f"entry {i} (request {rows[i][0]}, length {rows[i][1]})"
        reference = torch_reference(heads, kv_heads, head_dim, window, softcap, cache)._decode(
            q.float(), cache[0], cache[1], entry_tables, seq_lens)
        torch.testing.assert_close(got.float(), reference.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (20, None), (None, 1.5)])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (4, 2, 80, 4)])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_verify_rows_equal_their_rows_decoded_alone(dtype, window, softcap, heads, kv_heads, head_dim, block_size,
                                                    threads):
    """check_verify_rows on 1, 2 and 4 threads (how a request's rows are cut into tasks depends on
    the thread count)."""
    torch.set_num_threads(threads)   # (conftest's torch_threads_restored puts the count back)
    check_verify_rows(dtype, window, softcap, heads, kv_heads, head_dim, block_size)


@pytest.mark.parametrize("threads", [1, 2])
def test_an_empty_decode_step_returns_no_rows(threads):
    """A step with no entries (batch 0) returns an empty output, fused or not (it divided by its
    zero task count: SIGFPE, the process gone)."""
    heads, kv_heads, head_dim = 9, 3, 64
    cache = torch.randn(2, 4, 16, kv_heads, head_dim).bfloat16()
    tables, seq_lens = torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    torch.set_num_threads(threads)   # (conftest's torch_threads_restored puts the count back)
    out = kernels.paged_decode(torch.randn(0, heads, head_dim), cache[0], cache[1], tables, seq_lens, 0.125)
    assert out.shape == (0, heads, head_dim)
    qkv = torch.randn(0, (heads + 2 * kv_heads) * head_dim)
    cos, sin = torch.randn(2, 0, head_dim)
    out = kernels.paged_decode_rotary(qkv, cos, sin, torch.zeros(0, dtype=torch.int64), cache[0], cache[1], tables,
                                      seq_lens, heads, 0.125)
    assert out.shape == (0, heads * head_dim)


def exact_prefill_options(q, cache, table, seq_len, block_size, scale, window, softcap):
    """float64 causal attention of q [n, heads, d] (the last n positions of seq_len) with a window and
    a softcap."""
    n = q.shape[0]
    k, v = gather_exact(cache, table, seq_len, block_size, q.shape[1])
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keys, rows = torch.arange(seq_len)[None, :], torch.arange(seq_len - n, seq_len)[:, None]
    hidden = keys > rows
    if window is not None:
        hidden |= keys <= rows - window
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (4, 2, 80, 4)])
@pytest.mark.parametrize(("seq_len", "num_q"), [(17, 17), (100, 100), (333, 5), (64, 63), (40, 1)])
def test_prefill_kernel_window_and_softcap_equal_exact_attention(dtype, window, softcap, heads, kv_heads, head_dim,
                                                                 block_size, seq_len, num_q):
    if not kernels.has_prefill_kernel():
        pytest.skip("no prefill kernel in this build (SDPA runs)")
    _, cache, tables, _ = random_paged_batch([seq_len], heads, kv_heads, head_dim, block_size, dtype, seed=seq_len)
    q = torch.randn(num_q, heads, head_dim, generator=torch.Generator().manual_seed(5))
    got = kernels.paged_prefill(q, cache[0], cache[1], tables[0], seq_len, head_dim**-0.5, sliding_window=window,
                                logit_softcap=softcap)
    assert_prefill_close(got, q, cache, lambda q: exact_prefill_options(q, cache, tables[0], seq_len, block_size,
                                                                        head_dim**-0.5, window, softcap))
    if window is not None:  # blocks wholly before the first row's window are not read
        first_block = max(0, seq_len - num_q - window + 1) // block_size
        poison(cache, (slice(None), tables[0, :first_block]))
        assert torch.equal(kernels.paged_prefill(q, cache[0], cache[1], tables[0], seq_len, head_dim**-0.5,
                                                 sliding_window=window, logit_softcap=softcap), got)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (100, None), (37, 1.5)])
def test_prefill_kernel_rows_do_not_depend_on_their_chunk(dtype, window, softcap):
    """A prompt's rows computed as one chunk == the same rows in chunks of any size, bit for bit (the
    engine's batch independence rests on it): tiles start at multiples of their width whatever the
    first key a chunk sees, so each row sums its keys (and bf16 dot products their pairs) in one order."""
    if not kernels.has_prefill_kernel():
        pytest.skip("no prefill kernel in this build (SDPA runs)")
    seq_len = 333
    q, cache, tables, _ = random_paged_batch([seq_len], 8, 2, 64, 16, dtype, seed=8)
    q = torch.randn(seq_len, 8, 64, generator=torch.Generator().manual_seed(9)) * 3
    options = {"sliding_window": window, "logit_softcap": softcap}
    whole = kernels.paged_prefill(q, cache[0], cache[1], tables[0], seq_len, 0.125, **options)
    for cuts in ([0, 1, 70, 71, 200, 333], [0, 129, 131, 333], [0, 300, 333]):
        parts = [kernels.paged_prefill(q[a:b], cache[0], cache[1], tables[0], b, 0.125, **options)
                 for a, b in itertools.pairwise(cuts)]
        assert torch.equal(torch.cat(parts), whole), cuts


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (6, None), (None, 1.5), (6, 1.5), (1, 1.5), (300, None)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_layer_kernels_equal_the_torch_backend_with_options(dtype, window, softcap, block_size):
    """A mixed step through Attention.forward (whole prompts, chunks after cached tokens, decode rows):
    backend auto (the C prefill and decode kernels, which now take windows and softcaps) == backend
    torch (SDPA / matmuls and the gathered decode reference)."""
    from tokenmill.layers.attention import AttentionMetadata

    heads, kv_heads, head_dim = 8, 2, 64
    spans = [(40, 40), (100, 7), (17, 1), (333, 1), (64, 63), (9, 2)]   # (seq_len, rows this step)
    g = torch.Generator().manual_seed(block_size)
    need = [-(-n // block_size) for n, _ in spans]
    order = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables, slots, starts = [], [], [0]
    for (n, rows), count in zip(spans, need, strict=True):
        table, order = order[:count], order[count:]
        tables.append(table + [0] * (max(need) - count))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n - rows, n)]
        starts.append(starts[-1] + rows)
    cache = to_cache_rows(torch.randn(2, sum(need) + 3, block_size, kv_heads, head_dim, generator=g), dtype)
    meta = AttentionMetadata(query_start_loc=starts, seq_lens=[n for n, _ in spans], block_tables=torch.tensor(tables),
                             slot_mapping=torch.tensor(slots), seq_lens_tensor=torch.tensor([n for n, _ in spans]),
                             block_size=block_size)
    q, k, v = (torch.randn(starts[-1], h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    prefill = torch.tensor([starts[b + 1] - starts[b] > 1 for b in range(len(spans)) for _ in range(spans[b][1])])
    if bf16_dots(cache):   # the prefill rows' queries as the kernel rounds them (assert_prefill_close)
        q_torch = torch.where(prefill[:, None, None], q.bfloat16().float(), q)
    else:
        q_torch = q
    outputs = {}
    for backend, queries in (("auto", q), ("torch", q_torch)):
        layer = Attention(heads, kv_heads, head_dim, head_dim**-0.5, sliding_window=window, logit_softcap=softcap)
        layer.kv_cache = cache.clone()
        set_backend(layer, backend)
        assert layer.uses_kernels() == (backend == "auto")
        outputs[backend] = layer(queries, k, v, meta)
    if not bf16_dots(cache):
        torch.testing.assert_close(outputs["auto"], outputs["torch"], atol=2e-5, rtol=1e-5)
        return
    decode = ~prefill
    torch.testing.assert_close(outputs["auto"][decode], outputs["torch"][decode], atol=2e-5, rtol=1e-5)
    vmax = max(cache[1].float().abs().max().item(), v.bfloat16().float().abs().max().item())   # (v: written this step)
    assert_within_probability_rounding(outputs["auto"][prefill], outputs["torch"][prefill], vmax)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("generic", [False, True])
def test_fused_rotary_decode_with_qk_norms_equals_the_unfused_ops(dtype, generic):
    """q/k RMSNorms per head inside decode_rotary (Qwen3, Gemma 3) == the RMSNorm layers (their C path,
    the same norm.h function), apply_rotary, the cache write and the decode kernel: the same bits in the
    output and the cache; and the norms are applied (without them the output differs)."""
    from tokenmill.layers.norm import RMSNorm
    from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary

    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    lens = [5, 48, 200, 17]
    _, cache, tables, seq_lens = random_paged_batch(lens, heads, kv_heads, head_dim, block_size, dtype, seed=6)
    positions = seq_lens - 1
    slots = tables[torch.arange(len(lens)), positions // block_size] * block_size + positions % block_size
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=g) * 3
    norms = [RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)]
    for norm in norms:
        norm.weight.data = torch.rand(head_dim, generator=g) + 0.5
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)(positions)

    unfused_cache = cache.clone()
    q, k, v = qkv.view(len(lens), -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    q, k = apply_rotary(norms[0](q), *rope), apply_rotary(norms[1](k), *rope)
    for i, t in enumerate((k, v)):
        write_rows(unfused_cache[i], slots, t)
    expected = kernels.paged_decode(q, unfused_cache[0], unfused_cache[1], tables, seq_lens, head_dim**-0.5,
                                    generic=generic).view(len(lens), -1)

    fused_cache = cache.clone()
    got = kernels.paged_decode_rotary(qkv, rope[0].view(len(lens), -1), rope[1].view(len(lens), -1), slots,
                                      fused_cache[0], fused_cache[1], tables, seq_lens, heads, head_dim**-0.5,
                                      generic=generic, qk_norm=(norms[0].weight, norms[1].weight, 1e-6))
    assert torch.equal(fused_cache, unfused_cache)
    assert torch.equal(got, expected)
    unnormed = kernels.paged_decode_rotary(qkv, rope[0].view(len(lens), -1), rope[1].view(len(lens), -1), slots,
                                           cache.clone()[0], cache.clone()[1], tables, seq_lens, heads,
                                           head_dim**-0.5, generic=generic)
    assert not torch.allclose(unnormed, expected, atol=1e-3)   # the norms matter on these inputs


def tokens_and_logprobs(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    return [(o.outputs[0].token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(("kind", "ftype", "kv_cache_dtype"),
                         [("llama", "Q4_1", "auto"), ("smollm", "Q8_0", "auto"), ("llama", "Q4_1", "bfloat16"),
                          ("llama", "Q4_1", "int8"), ("qwen3", "Q8_0", "int8"), ("gemma2", "Q8_0", "int8"),
                          # mixtures of experts (moe.c): renormalized top k, Qwen2-MoE's shared expert
                          ("mixtral", "Q8_0", "auto"), ("qwen2_moe", "Q4_1", "auto"), ("qwen3_moe", "Q8_0", "int8"),
                          ("qwen2", "Q5_0", "auto"),  # qwen2: q/k/v biases
                          # Qwen3: q/k norms inside the fused rotary kernel
                          ("qwen3", "Q8_0", "auto"), ("qwen3", "Q8_0", "float32"),
                          # Gemma: GeGLU, sandwich norms, softcap, sliding layers (Gemma 3: q/k norms, local rope)
                          ("gemma2", "Q8_0", "auto"), ("gemma2", "Q4_1", "auto"), ("gemma3", "Q8_0", "auto"),
                          ("gemma3", "Q4_1", "auto")])
def test_decode_stack_equals_the_layer_loop(tiny_gguf_model, kind, ftype, kv_cache_dtype):
    """kernels.decode_stack (every layer of a decode step in one C call) makes the same kernel calls as
    the per-layer Python loop (every RMSNorm, the sandwich norms too, the one C function of norm.h): the
    same logprobs, bit for bit, over a generation with several requests."""
    path = str(tiny_gguf_model(kind, ftype))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[1, 5, 9, 2], list(range(3, 40)), [7] * 19]
    results = {}
    for use_stack in (True, False):
        llm = LLM(path, num_kv_blocks=256, block_size=4, kv_cache_dtype=kv_cache_dtype)
        model = llm.engine.model.model
        if kind in ("qwen3", "gemma3"):
            assert all(layer.self_attn.q_norm is not None for layer in model.layers)
        model.use_decode_stack = use_stack
        results[use_stack] = tokens_and_logprobs(llm, prompts, params)
        assert isinstance(model._plan, kernels.StackPlan) == use_stack
        if use_stack:
            assert len(model._plan.layers) == len(model.layers)
    assert results[True] == results[False]


@pytest.mark.parametrize(("kind", "ftype"), [("llama", "Q4_1"), ("mixtral", "Q8_0")])
def test_int8_activations_reach_every_kernel_of_both_paths(tiny_gguf_model, kind, ftype):
    """activation_precision="int8": every quantized weight of the model (experts and LM head too) is
    planned with int8 activations, the decode stack gives the layer loop's logprobs bit for bit, and
    the logprobs differ from the default's (the setting is not ignored on either path)."""
    path = str(tiny_gguf_model(kind, ftype))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[1, 5, 9, 2], list(range(3, 40))]
    results = {}
    for precision, use_stack in (("int8", True), ("int8", False), ("int16", True)):
        llm = LLM(path, num_kv_blocks=64, block_size=4, activation_precision=precision)
        weights = [m for m in llm.engine.model.modules() if isinstance(m, QuantWeight)]
        assert weights and all(w.plan().int8_activations == (precision == "int8") for w in weights)
        model = llm.engine.model.model
        model.use_decode_stack = use_stack
        results[precision, use_stack] = tokens_and_logprobs(llm, prompts, params)
        assert isinstance(model._plan, kernels.StackPlan) == use_stack
    assert results["int8", True] == results["int8", False]
    assert results["int8", True] != results["int16", True]


@pytest.mark.parametrize(("window", "softcap", "kv_cache_dtype"),
                         [(6, None, "auto"), (6, 1.5, "float32"), (None, 1.5, "auto"), (1, None, "auto"),
                          (6, 1.5, "int8")])
def test_decode_stack_equals_the_layer_loop_with_options(tiny_gguf_model, window, softcap, kv_cache_dtype):
    """A sliding window (ending inside blocks of 4, and shorter than the prompts) and a logit softcap set
    on every layer: the C stack takes them (a plan is built) and gives the layer loop's logprobs bit
    for bit; the options change the output, so neither path can be ignoring them."""
    path = str(tiny_gguf_model("llama", "Q4_1"))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[1, 5, 9, 2], list(range(3, 40)), [7] * 19]
    results = {}
    for use_stack, options in ((True, True), (False, True), (True, False)):
        llm = LLM(path, num_kv_blocks=64, block_size=4, kv_cache_dtype=kv_cache_dtype)
        model = llm.engine.model.model
        model.use_decode_stack = use_stack
        if options:
            for layer in model.layers:
                layer.self_attn.attn.sliding_window, layer.self_attn.attn.logit_softcap = window, softcap
        results[use_stack, options] = tokens_and_logprobs(llm, prompts, params)
        assert isinstance(model._plan, kernels.StackPlan) == use_stack
        if use_stack and options:
            assert [(p.attn.sliding_window, p.attn.logit_softcap) for p in model._plan.layers] == \
                [(window or 0, pytest.approx(softcap or 0.0))] * len(model.layers)
    assert results[True, True] == results[False, True]
    assert results[True, True] != results[True, False]


@pytest.mark.parametrize("generic", [False, True])
def test_fused_gelu_tanh_equals_the_torch_activation(generic):
    """GELU-tanh (GeGLU) fused into the quantized matmul's input pass == F.gelu(approximate="tanh") *
    up, then the kernel, to float32 rounding; and it is not SiLU."""
    import torch.nn.functional as F

    from tokenmill.layers.quant import QuantWeight, quantize

    g = torch.Generator().manual_seed(4)
    weight = QuantWeight(quantize(torch.randn(48, 96, generator=g), 4), torch.float32)
    gate_up = torch.randn(9, 192, generator=g) * 4   # gates from -15 to 15: both tails and the middle
    gate, up = gate_up.chunk(2, dim=-1)

    def run(x, gated):
        return kernels.quant_matmul(x, weight.plan(), gated=gated,
                                    generic=generic)

    expected = run(F.gelu(gate, approximate="tanh") * up, None)
    got = run(gate_up, "gelu_tanh")
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert not torch.allclose(got, run(gate_up, "silu"), atol=1e-2)
    with pytest.raises(ValueError, match="gated activation"):
        run(gate_up, "relu")


def test_portable_build_fuses_gelu_tanh(monkeypatch):
    """The portable build's GELU-tanh (libm's tanhf, no vectors) == F.gelu(approximate="tanh") * up,
    then the kernel."""
    import torch.nn.functional as F

    from tokenmill.layers.quant import QuantWeight, quantize

    g = torch.Generator().manual_seed(4)
    weight = QuantWeight(quantize(torch.randn(48, 96, generator=g), 4), torch.float32)
    gate_up = torch.randn(9, 192, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    monkeypatch.setattr(kernels, "_FLAGS", [f if f != "-march=native" else "-march=x86-64" for f in kernels._FLAGS])
    _clear_kernel_caches()
    try:
        assert kernels.load().quant_matmul_has_simd() == 0
        got = kernels.quant_matmul(gate_up, weight.plan(), gated="gelu_tanh")
        expected = kernels.quant_matmul(F.gelu(gate, approximate="tanh") * up, weight.plan())
    finally:
        _clear_kernel_caches()
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


NORM_WIDTHS = [1, 7, 16, 32, 40, 64, 100, 576, 2048]   # shorter than, equal to and past a vector, with tails


@pytest.mark.parametrize("n", NORM_WIDTHS)
def test_rms_norm_equals_the_torch_reference(n):
    """kernels.rms_norm (norm.h, the one C RMSNorm): its AVX-512 sum == its portable sum bit for bit;
    both within float32 rounding of a float64 evaluation and of RMSNorm's PyTorch reference; the RMSNorm
    layer runs it for float32 CPU inputs (views too) and its reference for backend "torch" and other
    dtypes."""
    from tokenmill.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, 9, n, generator=g) * torch.logspace(-3, 3, 9)[:, None]   # rows of very different scales
    norm = RMSNorm(n, 1e-6)
    norm.weight.data = torch.rand(n, generator=g) + 0.5
    got = kernels.rms_norm(x, norm.weight, norm.eps)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert torch.equal(kernels.rms_norm(x, norm.weight, norm.eps, generic=True), got)
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    scale = exact.abs().amax(-1, keepdim=True)
    assert ((got.double() - exact).abs() / scale).max() < 4e-7
    reference = norm.forward_native(x)
    assert ((got - reference).abs() / scale).max() < 8e-7
    assert torch.equal(norm(x), got)
    view = torch.cat([x, x], dim=-1)[..., n:]   # not contiguous
    assert torch.equal(norm(view), got)
    set_backend(norm, "torch")
    assert torch.equal(norm(x), reference)
    set_backend(norm, "auto")
    assert torch.equal(norm(x.bfloat16()), norm.forward_native(x.bfloat16()))


@pytest.mark.parametrize("generic", [False, True])
def test_fused_norm_of_the_quantized_matmul_is_rms_norm(generic):
    """The RMSNorm fused into quant_matmul's input pass (a quantized Linear's norm) == kernels.rms_norm,
    then the matmul: the same bits, so the layer loop (fused norms) and the norms run alone agree."""
    from tokenmill.layers.quant import QuantWeight, quantize

    g = torch.Generator().manual_seed(5)
    weight = QuantWeight(quantize(torch.randn(48, 96, generator=g), 8), torch.float32)
    x = torch.randn(11, 96, generator=g) * 5
    w = torch.rand(96, generator=g) + 0.5

    def run(x, norm):
        return kernels.quant_matmul(x, weight.plan(), norm=norm, generic=generic)

    assert torch.equal(run(x, (w, 1e-5)), run(kernels.rms_norm(x, w, 1e-5), None))


def decode_step_both_ways(path: str) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One decode step of three requests (after their prefill) from the same KV cache, through the C
    decode stack and through the layer loop: the two final hidden states and the stack's layer plans."""
    engine = make_engine(path, block_size=4)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for prompt in ([1, 5, 9, 2], list(range(3, 40)), [7] * 19):
        engine.add_request(prompt, params)
    engine.step()  # the prefills
    scheduled = engine.scheduler.schedule().scheduled
    input_ids, positions, meta, _, _ = engine.runner.prepare(scheduled)
    assert meta.is_decode_only
    model = engine.model.model
    caches = [c.clone() for c in engine.kv_caches]
    hidden = {}
    with torch.inference_mode():
        for use_stack in (True, False):
            for cache, saved in zip(engine.kv_caches, caches, strict=True):
                cache.copy_(saved)
            model.use_decode_stack = use_stack
            hidden[use_stack] = engine.model(input_ids, positions, meta)
            assert isinstance(model._plan, kernels.StackPlan), "every layer must plan"
    return hidden[True], hidden[False], list(model._plan.layers)


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_1"])
@pytest.mark.parametrize(("kind", "local", "groups"), [("gemma2", [0, 0], [1, 0]),
                                                      ("gemma3", [1, 1, 1, 1, 1, 0], [1, 2, 3, 4, 5, 0])])
def test_gemma_stacks_take_the_c_path(tiny_gguf_model, ftype, kind, local, groups):
    """Gemma 2 (GeGLU, sandwich norms, a sliding and a global layer, attention softcap) and Gemma 3 (q/k
    norms too, five local-rope sliding layers then a global one) plan every layer, each reading its KV
    cache group's block tables (the global layer's group 0, each sliding layer's its own: groups of
    one layer), and a decode step through the C stack equals the layer loop's bit for bit (both run
    norm.h's RMSNorm)."""
    stack, loop, plans = decode_step_both_ways(str(tiny_gguf_model(kind, ftype)))
    assert [p.rope_local for p in plans] == local
    assert [p.attn.kv_group for p in plans] == groups
    assert all(p.attn_out_norm and p.mlp_out_norm and p.mlp.activation == 2 for p in plans)
    assert plans[0].attn.sliding_window == 8 and plans[-1].attn.sliding_window == 0
    assert all(bool(p.attn.q_norm) == (kind == "gemma3") for p in plans)
    assert torch.equal(stack, loop)


@pytest.mark.parametrize("kind", ["phi3", "qwen3"])
def test_decode_stack_runs_windowed_and_qk_norm_models_bit_for_bit(tiny_gguf_model, kind):
    """Phi-3 (every layer slides, window 16, blocks given back behind it) and Qwen3 (q/k norms): a decode
    step through the C stack == the layer loop, bit for bit (no sandwich norms)."""
    stack, loop, plans = decode_step_both_ways(str(tiny_gguf_model(kind, "Q8_0")))
    assert all(p.attn.sliding_window == (16 if kind == "phi3" else 0) for p in plans)
    assert torch.equal(stack, loop)


def test_plan_structs_match_the_header():
    """The ctypes mirrors of kernels.h's plan structs have the C sizes (a field missing, added or of
    another width on either side shows here rather than as a misread pointer)."""
    lib = kernels.load()
    if lib is None:
        pytest.skip("no C compiler")
    for which, struct in enumerate(kernels.PLAN_STRUCTS):
        assert lib.plan_struct_size(which) == ctypes.sizeof(struct), struct.__name__


def test_bf16_kv_cache_on_a_float32_model(tiny_hf_model):
    """kv_cache_dtype="bfloat16": half the bytes per token; the C kernel and the PyTorch reference read
    the same bf16 cache and give the same tokens, and the prefill logits stay within bf16 rounding of K/V
    of the float32-cache model."""
    path = tiny_hf_model("llama")
    fp32 = make_engine(path, block_size=4)
    engines = {backend: make_engine(path, block_size=4, kv_cache_dtype="bfloat16", attention_backend=backend)
               for backend in ("auto", "torch")}
    assert engines["auto"].kv_caches[0].dtype == torch.bfloat16 and fp32.kv_caches[0].dtype == torch.float32
    assert engines["auto"].kv_caches[0].element_size() * 2 == fp32.kv_caches[0].element_size()
    prompts = [[1, 5, 9, 2], list(range(3, 40)), [7] * 19]
    assert greedy(engines["auto"], prompts, 16) == greedy(engines["torch"], prompts, 16)
    ids = list(range(5, 60))
    exact, rounded = prefill_logits(fp32, ids), prefill_logits(engines["auto"], ids)
    assert (rounded - exact).abs().max() < 0.05 * exact.abs().max()
    with pytest.raises(TokenmillError, match="kv_cache_dtype"):
        make_engine(path, kv_cache_dtype="fp8")


@pytest.mark.parametrize("head_dim", [64, 80])
def test_int8_kv_rows_quantize_per_group(head_dim):
    """quantize_kv: a (token, kv head) row becomes head_dim int8 values and a bfloat16 scale per group of 32
    (80: a last group of 16), s = bf16(max |x| / 127); dequantized, every value is within half a step of
    x (groups of very different magnitudes in one row: the scale is per group); a group's largest value
    maps to +-127 (or 126 where bf16 rounded s up); a zero group stays zero."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, head_dim, generator=g)
    x[..., :32] *= 300.0
    x[..., 32:64] *= 0.01
    x[2, 1, 32:64] = 0
    rows = quantize_kv(x)
    groups = -(-head_dim // 32)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, kv_row_width(head_dim, torch.int8))
    assert rows.shape[-1] == head_dim + 2 * groups   # llama.cpp q8_0's bytes: 34 per 32 values
    scale = rows[..., head_dim:].contiguous().view(torch.bfloat16).float()
    for i in range(groups):
        expected = (x[..., 32 * i:32 * (i + 1)].abs().amax(-1) / 127).to(torch.bfloat16).float()
        assert torch.equal(scale[..., i], expected)
    step = scale.repeat_interleave(32, -1)[..., :head_dim]
    back = dequantize_kv(rows)
    assert back.shape == x.shape
    assert ((back - x).abs() <= step / 2 + 1e-6 * x.abs()).all()
    assert torch.equal(back[2, 1, 32:64], torch.zeros(32)) and scale[2, 1, 1].item() == 0
    peaks = torch.stack([rows[..., 32 * i:min(32 * (i + 1), head_dim)].float().abs().amax(-1)
                         for i in range(groups)], dim=-1)
    assert ((peaks >= 126) | (scale == 0)).all()
    # half-way values round to even, as the C kernels round (nearbyintf)
    assert quantize_kv(torch.tensor([127.0, 2.5, -3.5, 0.5]))[:4].tolist() == [127, 2, -4, 0]


@pytest.mark.parametrize("generic", [False, True])
def test_int8_cache_write_of_nan_and_inf_equals_pytorch(generic):
    """Non-finite K/V (a diverging model) quantize to the same bytes in C as in PyTorch: a group holding
    NaN gets a NaN scale and zero values; infinities give NaN quotients, stored as 0."""
    heads, kv_heads, head_dim, block_size = 2, 2, 64, 4
    _, cache, tables, seq_lens = random_paged_batch([3, 5], heads, kv_heads, head_dim, block_size, torch.int8)
    positions = seq_lens - 1
    slots = tables[torch.arange(2), positions // block_size] * block_size + positions % block_size
    qkv = torch.randn(2, (heads + 2 * kv_heads) * head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(2, kv_heads, head_dim)
    v[0, 0, 3], v[0, 1, 40], v[1, 0, 7], v[1, 1, 33] = float("nan"), float("inf"), -float("inf"), float("nan")
    cos, sin = torch.ones(2, head_dim), torch.zeros(2, head_dim)   # no rotation
    fused = cache.clone()
    kernels.paged_decode_rotary(qkv, cos, sin, slots, fused[0], fused[1], tables, seq_lens, heads, 0.125,
                                generic=generic)
    expected = cache.clone()
    write_rows(expected[1], slots, v)
    assert torch.equal(fused[1], expected[1])
    rows = quantize_kv(v)
    assert rows[0, 0, :32].eq(0).all() and rows[0, 0, 64:66].view(torch.bfloat16).isnan().item()


def test_int8_kv_cache_on_a_float32_model(tiny_hf_model):
    """kv_cache_dtype="int8": a row of head_dim bytes and a 2-byte scale per 32 of them per (token, kv
    head), so a token costs (head_dim + 2 ceil(head_dim / 32)) / (4 head_dim) of a float32 cache; the C
    kernels and the PyTorch reference read the same int8 cache and give the same tokens; the prefill
    logits stay within the K/V rounding of the float32-cache model's."""
    path = tiny_hf_model("llama")
    fp32 = make_engine(path, block_size=4)
    engines = {backend: make_engine(path, block_size=4, kv_cache_dtype="int8", attention_backend=backend)
               for backend in ("auto", "torch")}
    head_dim = fp32.model_config.head_dim
    width = head_dim + 2 * -(-head_dim // 32)
    cache = engines["auto"].kv_caches[0]
    assert cache.dtype == torch.int8 and cache.shape == (*fp32.kv_caches[0].shape[:-1], width)
    assert (kv_bytes_per_token(fp32.model_config, torch.int8) * 4 * head_dim
            == kv_bytes_per_token(fp32.model_config, torch.float32) * width)
    assert engines["auto"].runner.model.model.layers[0].self_attn.attn.uses_kernels()
    prompts = [[1, 5, 9, 2], list(range(3, 40)), [7] * 19]
    assert greedy(engines["auto"], prompts, 16) == greedy(engines["torch"], prompts, 16)
    ids = list(range(5, 60))
    exact, rounded = prefill_logits(fp32, ids), prefill_logits(engines["auto"], ids)
    assert (rounded - exact).abs().max() < 0.05 * exact.abs().max()
    assert not torch.equal(rounded, exact)


@pytest.mark.skipif(not kernel_available(), reason="quantized execution needs the C kernels")
def test_kv_cache_dtype_auto_is_bf16_for_quantized_float32_on_cpu(tiny_hf_model, tiny_gguf_model):
    """auto: the model's dtype, except float32 with quantized weights on a CPU (the speed path), which
    gets a bfloat16 cache; an explicit kv_cache_dtype always wins."""
    hf, gguf = tiny_hf_model("llama"), tiny_gguf_model("llama", "Q4_1")

    def cache_dtype(path, **kwargs):
        return make_engine(path, num_kv_blocks=8, **kwargs).kv_caches[0].dtype

    assert cache_dtype(hf) == torch.float32                                  # dense float32: exact path
    assert cache_dtype(hf, quantization="int8") == torch.bfloat16
    assert cache_dtype(hf, quantization="int8", kv_cache_dtype="float32") == torch.float32
    assert cache_dtype(gguf) == torch.bfloat16                              # GGUF types kept quantized
    assert cache_dtype(gguf, quantization="none") == torch.float32          # dequantized at load
    assert cache_dtype(gguf, dtype="bfloat16", kv_cache_dtype="float32") == torch.float32
    # the rule itself, for devices this machine may lack
    assert resolve_kv_cache_dtype("auto", torch.float32, torch.device("cuda"), True) == torch.float32
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu"), True) == torch.bfloat16


def test_auto_dtype_is_float32_when_weights_run_quantized(monkeypatch, tiny_hf_model, tiny_gguf_model):
    """On a CPU with bf16 units, dtype auto is bfloat16 for dense weights but float32 where the weights
    run quantized (GGUF quantized types, --quantization int8/int4): those kernels take float32
    activations, and the decode stack is float32 only."""
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: True)
    hf, gguf_q, gguf_f32 = tiny_hf_model("llama"), tiny_gguf_model("llama", "Q4_1"), tiny_gguf_model("llama", "F32")

    def dtype(path, dtype="auto", **kwargs):
        return make_engine(path, dtype, num_kv_blocks=8, **kwargs).dtype

    assert dtype(hf) == torch.bfloat16
    assert dtype(hf, quantization="int4") == torch.float32
    assert dtype(gguf_q) == torch.float32
    assert dtype(gguf_q, quantization="none") == torch.bfloat16          # dequantized at load: dense
    assert dtype(gguf_f32) == torch.bfloat16
    assert dtype(gguf_q, dtype="bfloat16") == torch.bfloat16            # an explicit dtype wins


def test_portable_build_without_avx512(monkeypatch):
    """The kernels compiled for a baseline x86-64 CPU (no AVX-512, no VNNI: the portable C paths)
    give the quantized matmul's exact sums (two activation planes or one), the same RMSNorm bits and
    the same attention as this machine's build."""
    from tokenmill.layers.quant import QuantWeight, quantize

    weight = QuantWeight(quantize(torch.randn(40, 96, generator=torch.Generator().manual_seed(1)), 4), torch.float32)
    one_plane = QuantWeight(quantize(torch.randn(40, 96, generator=torch.Generator().manual_seed(2)), 4),
                            torch.float32)
    one_plane.int8_activations = True
    x = torch.randn(5, 96)
    q, cache, tables, seq_lens = random_paged_batch([3, 40, 17], 6, 2, 64, 16, torch.float32, seed=8)

    rows, norm_weight = torch.randn(6, 100) * 7, torch.rand(100) + 0.5

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (kernels.quant_matmul(x, weight.plan()),
                kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, 0.125),
                kernels.rms_norm(rows, norm_weight, 1e-5),
                kernels.quant_matmul(x, one_plane.plan()))

    native = run()
    if kernels.load().quant_matmul_has_simd():
        native_generic = kernels.quant_matmul(x, weight.plan(), generic=True)
        assert torch.equal(native_generic, native[0])
    monkeypatch.setattr(kernels, "_FLAGS", [f if f != "-march=native" else "-march=x86-64" for f in kernels._FLAGS])
    _clear_kernel_caches()
    try:
        assert kernels.load().quant_matmul_has_simd() == 0
        portable = run()
    finally:
        _clear_kernel_caches()
    assert torch.equal(portable[0], native[0])
    torch.testing.assert_close(portable[1], native[1], atol=2e-6, rtol=1e-5)
    assert torch.equal(portable[2], native[2])
    assert torch.equal(portable[3], native[3])


def test_avx2_build_gives_the_same_quantized_matmul(monkeypatch):
    """The kernels compiled for x86-64-v3 (AVX2, FMA and F16C, no AVX-512: most x86 CPUs without it),
    where the quantized matmul takes its AVX2 path: exactly the sums of this machine's build and of the
    portable loops, for 4- and 8-bit weights (u up to 255, where a plain u8 x s8 pair sum saturates),
    1 to 9 rows (a run of every length from 1 to 8; one row of a 4-bit weight takes its own maddubs
    form), a partial last tile, the fused norm, a residual; with two activation planes and with one
    (int8 activations: a 4-bit weight's nibble products at every run length).
    The fused gating (a vectorized exp / tanh in every SIMD build, `generic` or not) == the activation
    computed by torch and then the kernel, to float32 rounding."""
    import torch.nn.functional as F

    from tokenmill.layers.quant import BlockQuant, QuantWeight, quantize

    if not all(f in kernels.cpu_flags().split() for f in ("avx2", "fma", "f16c")):
        pytest.skip("this CPU cannot run an AVX2 build")
    g = torch.Generator().manual_seed(4)
    cases = []
    for bits in (4, 8):
        for m, n, k in [(1, 17, 576), (3, 40, 96), (9, 33, 128), (6, 16, 64), (2, 16, 64), (4, 33, 128), (5, 17, 96),
                        (7, 40, 64)]:
            q = quantize(torch.randn(n, k, generator=g) * 3, bits)
            if k == 96:   # a symmetric weight (no offsets held: m = -z d in the kernel)
                q = BlockQuant(q.u, q.d, -(2 ** (bits - 1)) * q.d, bits)
            weight = QuantWeight(q, torch.float32)
            x, residual = torch.randn(m, 2 * k, generator=g) * 5, torch.randn(m, n, generator=g)
            norm = (torch.rand(k, generator=g) + 0.5, 1e-5)
            cases.append((weight, x, residual, norm))

    def run(generic: bool = False) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        exact, gated = [], []
        for weight, x, residual, norm in cases:
            gate, up = x.chunk(2, dim=-1)
            for int8_activations in (False, True):
                weight.int8_activations = int8_activations
                plan = weight.plan()
                exact.append(kernels.quant_matmul(gate, plan, generic=generic))
                exact.append(kernels.quant_matmul(up, plan, norm=norm, residual=residual, generic=generic))
            weight.int8_activations = False
            plan = weight.plan()
            gated.append((kernels.quant_matmul(x, plan, gated="silu", norm=norm, residual=residual, generic=generic),
                          kernels.quant_matmul(F.silu(gate) * up, plan, norm=norm, residual=residual,
                                               generic=generic)))
            gated.append((kernels.quant_matmul(x, plan, gated="gelu_tanh", generic=generic),
                          kernels.quant_matmul(F.gelu(gate, approximate="tanh") * up, plan, generic=generic)))
        return exact, gated

    native, portable = run(), run(generic=True)
    monkeypatch.setattr(kernels, "_FLAGS", [f if f != "-march=native" else "-march=x86-64-v3" for f in kernels._FLAGS])
    _clear_kernel_caches()
    try:
        assert kernels.load().quant_matmul_has_simd() == 0   # (the VNNI path is not there)
        avx2 = run()
    finally:
        _clear_kernel_caches()
    for a, b, c in zip(avx2[0], native[0], portable[0], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    for got, expected in avx2[1]:
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_avx2_build_bf16_matmul_equals_the_exact_product(monkeypatch):
    """The dense bf16 kernel compiled for x86-64-v3 (8-lane vectors, blocks of 4 weight rows x 2
    activation rows) == the float64 product: 1 to 5 rows (runs of 2 and 1), partial weight blocks,
    k a multiple of 16 and not (72: the portable loops). That the SIMD loop ran shows in the bits: it
    sums in another order than the portable loop."""
    if not all(f in kernels.cpu_flags().split() for f in ("avx2", "fma", "f16c")):
        pytest.skip("this CPU cannot run an AVX2 build")
    g = torch.Generator().manual_seed(5)
    cases = [(torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(torch.bfloat16))
             for m, n, k in [(1, 17, 576), (2, 6, 80), (3, 5, 1536), (5, 9, 96), (2, 3, 72)]]
    monkeypatch.setattr(kernels, "_FLAGS", [f if f != "-march=native" else "-march=x86-64-v3" for f in kernels._FLAGS])
    _clear_kernel_caches()
    try:
        got = [(kernels.bf16_matmul(x, w), kernels.bf16_matmul(x, w, generic=True)) for x, w in cases]
    finally:
        _clear_kernel_caches()
    for (x, w), (simd, portable) in zip(cases, got, strict=True):
        torch.testing.assert_close(simd.double(), x.double() @ w.double().t(), atol=1e-4, rtol=1e-5)
        assert torch.equal(simd, portable) == (x.shape[1] == 72)


def test_avx2_build_attention_kernels_equal_exact_attention(monkeypatch):
    """The attention kernels compiled for x86-64-v3 (their SIMD code on 8-lane vectors, where an
    AVX-512 machine runs 16) == float64 attention: decode (verify rows too) and prefill, every cache
    dtype (a bf16 row in even/odd order per 16 values), head_dim 64 to 256 (up to 32 vectors a row),
    a window and a softcap.
    On an AVX-512 machine this is the only test that runs those paths."""
    if not all(f in kernels.cpu_flags().split() for f in ("avx2", "fma", "f16c")):
        pytest.skip("this CPU cannot run an AVX2 build")
    monkeypatch.setattr(kernels, "_FLAGS", [f if f != "-march=native" else "-march=x86-64-v3" for f in kernels._FLAGS])
    _clear_kernel_caches()
    try:
        assert kernels.has_prefill_kernel()
        for dtype in KV_DTYPES:
            for heads, kv_heads, head_dim, block_size in [(9, 3, 64, 16), (4, 2, 80, 4), (4, 1, 256, 16)]:
                lens = [1, 15, 17, 100, 333]
                q, cache, tables, seq_lens = random_paged_batch(lens, heads, kv_heads, head_dim, block_size, dtype)
                scale = head_dim**-0.5
                got = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, scale)
                expected = exact_decode(q, cache, tables, seq_lens, block_size, scale)
                torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)
                q = q.float()
                got = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, scale, sliding_window=17,
                                           logit_softcap=1.5)
                expected = torch_reference(heads, kv_heads, head_dim, 17, 1.5, cache)._decode(
                    q, cache[0], cache[1], tables, seq_lens)
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
                check_verify_rows(dtype, 17, 1.5, heads, kv_heads, head_dim, block_size)
                prefills = [(333, 5, None, None), (100, 100, 17, 1.5), (64, 63, None, 30.0)]
                for seq_len, num_q, window, softcap in prefills:
                    b = lens.index(seq_len) if seq_len in lens else 3   # (64 of request 3's 100 tokens)
                    q = torch.randn(num_q, heads, head_dim, generator=torch.Generator().manual_seed(num_q))
                    got = kernels.paged_prefill(q, cache[0], cache[1], tables[b], seq_len, scale,
                                                sliding_window=window, logit_softcap=softcap)
                    expected = exact_prefill_options(q, cache, tables[b], seq_len, block_size, scale, window, softcap)
                    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)
    finally:
        _clear_kernel_caches()


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 32), (1, 17, 576), (3, 5, 1536), (4, 64, 64), (8, 7, 96),
                                           (2, 3, 80), (2, 3, 72)])
def test_bf16_matmul_equals_the_exact_product(generic, m, n, k):
    """The dense bf16 kernel: products of fp32 activations and bf16 weights summed in fp32 == the
    float64 product (SIMD blocks of 4 weight rows x 4 (AVX-512) or 2 (AVX2) activation rows with
    partial ones, and the portable loops: k = 80 is not a multiple of AVX-512's 32, k = 72 of AVX2's 16)."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(torch.bfloat16)
    got = kernels.bf16_matmul(x, w, generic=generic)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), x.double() @ w.double().t(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("generic", [False, True])
@pytest.mark.parametrize(("gated", "norm", "residual"), [("silu", False, True), ("gelu_tanh", True, False),
                                                         (None, True, True)])
def test_bf16_matmul_fuses_the_input_ops_and_the_residual(generic, gated, norm, residual):
    """bf16_matmul's fused input ops (rows.h, quant_matmul's: act(gate) * up, then an RMSNorm) and residual
    add == the ops done apart, in float64 (the decode stack runs a bf16 model's projections this way)."""
    g = torch.Generator().manual_seed(3)
    m, n, k = 3, 40, 96
    x = torch.randn(m, 2 * k if gated else k, generator=g) * 2
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    norm_w = torch.rand(k, generator=g) + 0.5
    res = torch.randn(m, n, generator=g) if residual else None
    got = kernels.bf16_matmul(x, w, generic=generic, gated=gated, norm=(norm_w, 1e-5) if norm else None,
                              residual=res)
    h = x.double()
    if gated == "silu":
        h = F.silu(h[:, :k]) * h[:, k:]
    elif gated == "gelu_tanh":
        h = F.gelu(h[:, :k], approximate="tanh") * h[:, k:]
    if norm:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()
    want = h @ w.double().t() + (0 if res is None else res.double())
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-5)
    plain = kernels.bf16_matmul(x[:, :k], w, generic=generic)
    assert not torch.allclose(plain.double(), want, atol=1e-2)   # the fused ops change the result


def _first_decode_step(llm: LLM, prompts: list[list[int]]) -> tuple:
    """(a copy of the model as it was before the engine's first decode-only step, that step's input
    ids, positions and metadata): the copy holds its own clone of the K/V cache of that moment."""
    model = llm.engine.model.model
    captured = []
    real = model.forward

    def forward(input_ids, positions, meta):
        if meta.is_decode_only and not captured:
            captured.append((copy.deepcopy(model), input_ids.clone(), positions.clone(), meta))
        return real(input_ids, positions, meta)

    model.forward = forward
    llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    del model.forward
    return captured[0]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma2", "gemma3"])
def test_decode_stack_runs_a_bf16_model_in_float32(tiny_gguf_model, kind):
    """A bfloat16 model (an F16 GGUF, dense weights) runs its decode steps through the C stack, the
    weights through bf16_matmul with float32 activations: from the same cache and input, the stack's
    hidden states == the layer loop of that model made float32 (weights = the bf16 values, the same
    bf16 K/V cache) up to float32 summation order, and far closer to it than the model's own bf16
    layer loop (so the stack computes every op, in float32). The K/V cache is float32: a bfloat16 cache
    rounds the step's new K/V, and a difference of summation order at a rounding tie becomes a bf16
    step there (seen on a portable, non-AVX-512 build)."""
    llm = LLM(str(tiny_gguf_model(kind, "F16")), dtype="bfloat16", num_kv_blocks=512, block_size=4,
              kv_cache_dtype="float32")
    assert weight_forms(llm.engine.model) == {"dense": weight_forms(llm.engine.model)["dense"]}
    snapshot, ids, positions, meta = _first_decode_step(llm, [[1, 5, 9, 2], list(range(3, 30)), [7] * 13])

    def layers(float32: bool, stack: bool) -> torch.Tensor:
        model = copy.deepcopy(snapshot)   # (each run writes the step's K/V into its own cache)
        x = model.embed_tokens(ids)
        if model.embed_scale is not None:
            x = x * torch.tensor(model.embed_scale, dtype=x.dtype)
        ropes = {"global": model.rotary(positions)}
        if model.rotary_local is not None:
            ropes["local"] = model.rotary_local(positions)
        ropes = {name: tuple(t.float() for t in rope) for name, rope in ropes.items()}
        if stack:
            plan = model.stack_plan(x, meta)
            assert plan is not None and plan.max_rows == kernels.DENSE_MATMUL_MAX_ROWS
            return kernels.decode_stack(plan, x, ropes["global"], meta.group_tables,
                                        meta.seq_lens_tensor, ropes.get("local"))
        if float32:
            model.float()
            x = x.float()
        for layer in model.layers:
            x = layer(x, ropes if float32 else {n: tuple(t.to(x.dtype) for t in r) for n, r in ropes.items()}, meta)
        return x.float()

    reference = layers(float32=True, stack=False)
    stack_error = (layers(float32=False, stack=True) - reference).abs().max().item()
    bf16_error = (layers(float32=False, stack=False) - reference).abs().max().item()
    scale = reference.abs().max().item()
    assert stack_error <= 1e-5 * scale, (stack_error, scale)
    assert stack_error * 50 < bf16_error, (stack_error, bf16_error)


def test_a_bf16_model_takes_the_stack_for_a_few_rows_only(tiny_gguf_model, monkeypatch):
    """bf16_matmul is for a few rows: a bf16 model's decode steps of up to DENSE_MATMUL_MAX_ROWS rows run
    the C stack, larger ones the layer loop (PyTorch's bf16 matmul)."""
    path = str(tiny_gguf_model("llama", "F16"))
    rows = []
    real = kernels.decode_stack
    monkeypatch.setattr(kernels, "decode_stack", lambda plan, x, *a: rows.append(x.shape[0]) or real(plan, x, *a))
    prompts = [[1 + i, 5, 9, 2 + i] for i in range(12)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for max_num_seqs in (12, 4):
        rows.clear()
        llm = LLM(path, dtype="bfloat16", num_kv_blocks=64, max_num_seqs=max_num_seqs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
        if max_num_seqs == 12:   # every decode step has 12 rows
            assert rows == []
        else:
            assert rows and set(rows) <= {1, 2, 3, 4}


def test_bf16_linear_decode_rows_take_the_kernel(monkeypatch):
    """A bf16 Linear (and a tied LM head) runs bf16_matmul for a decode step's few rows and PyTorch's
    matmul for a prefill chunk; both == F.linear to bf16 rounding; backend "torch" never takes it."""
    from tokenmill.layers.linear import Embedding, Linear

    layer = Linear(64, 48, bias=True).to(torch.bfloat16)
    head = Embedding(100, 64).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for p in (*layer.parameters(), *head.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=g))
    calls = []
    real = kernels.bf16_matmul
    monkeypatch.setattr(kernels, "bf16_matmul", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=0.05, rtol=0.02)
        torch.testing.assert_close(head.logits(x), F.linear(x, head.weight).float(), atol=0.05, rtol=0.02)
    assert calls == [(1, 64), (1, 64), (8, 64), (8, 64)]
    set_backend(layer, "torch")
    layer(torch.randn(1, 64).to(torch.bfloat16))
    assert len(calls) == 4
