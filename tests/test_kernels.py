"""The C decode-attention kernel (tokenmill/kernels) against the PyTorch reference backend."""

from __future__ import annotations

import logging

import pytest
import torch
from engine_helpers import greedy, make_engine

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.errors import TokenmillError
from tokenmill.layers.attention import Attention
from tokenmill.models.loader import weight_forms


def random_paged_batch(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype, seed: int = 0):
    """Caches full of random values (also in slots nobody owns), shuffled block tables."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for count in need:
        tables.append(order[:count])
        order = order[count:]
    width = max(need)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, cache, block_tables, torch.tensor(lens)


def exact_decode(q, cache, block_tables, seq_lens, block_size, scale):
    """float64 attention of each query over its request's slots, gathered one token at a time."""
    heads, kv_heads = q.shape[1], cache.shape[3]
    out = []
    for b, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        slots = block_tables[b][pos // block_size] * block_size + pos % block_size
        k = cache[0].flatten(0, 1)[slots].double().repeat_interleave(heads // kv_heads, dim=1)  # [n, heads, d]
        v = cache[1].flatten(0, 1)[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        probs = (torch.einsum("hd,nhd->hn", q[b].double(), k) * scale).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", probs, v))
    return torch.stack(out)


def test_kernel_builds_here():
    assert kernels.load() is not None, "the C kernel must build on a machine with a C compiler (CI has gcc)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(9, 3, 16), (4, 4, 4), (8, 1, 1), (6, 2, 32)])
def test_kernel_equals_exact_attention(dtype, heads, kv_heads, block_size):
    lens = [1, 2, 15, 16, 17, 100, 333, 64]   # one token, block boundaries, partial last blocks
    q, cache, tables, seq_lens = random_paged_batch(lens, heads, kv_heads, 64, block_size, dtype)
    got = kernels.paged_decode(q, cache[0], cache[1], tables, seq_lens, 0.125)
    assert got.dtype == torch.float32
    expected = exact_decode(q, cache, tables, seq_lens, block_size, 0.125)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_backend_equals_torch_backend_in_the_layer(dtype):
    lens = [5, 48, 200, 7, 129]
    q, cache, tables, seq_lens = random_paged_batch(lens, 9, 3, 64, 16, dtype, seed=3)
    layer = Attention(9, 3, 64, 0.125)
    fast = layer._decode(q, cache[0], cache[1], tables, seq_lens)
    reference = layer._decode_torch(q, cache[0], cache[1], tables, seq_lens)
    assert fast.dtype == reference.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2   # bf16: both round the fp32 result once
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
    for fn in (kernels._library, kernels.load, kernels.load_quant):
        fn.cache_clear()


def test_no_compiler_falls_back_with_a_warning(monkeypatch, caplog, tiny_gguf_model):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    _clear_kernel_caches()
    try:
        with caplog.at_level(logging.WARNING, logger="tokenmill.kernels"):
            assert kernels.load() is None
            assert not kernels.supports_paged_decode(torch.zeros(1, 1, 1, 1))
            assert kernels.load_quant() is None
        assert "PyTorch path" in caplog.text and "dequantized at load" in caplog.text
        # quantized GGUF weights are then dequantized; asking for at-load quantization is an error
        llm = LLM(str(tiny_gguf_model("llama", "Q4_1")), num_kv_blocks=16)
        assert weight_forms(llm.engine.model) == {"dense": 10}
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
        with pytest.raises(TokenmillError, match="quantization: 'int4' runs with the C kernel only"):
            LLM(str(tiny_gguf_model("llama", "Q4_1")), quantization="int4", num_kv_blocks=16)
    finally:
        _clear_kernel_caches()
