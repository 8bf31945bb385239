"""Quantized execution: GGUF blocks and at-load int8/int4 in one block form (layers/quant.py), run
by the C kernel with int8 activations (kernels/quant_matmul.c).

The claims, each checked below:
- the GGUF conversion is exact: every convertible type dequantizes to what the `gguf` package's
  reference dequantizer gives (K-quants: to fp16 rounding of their sub-block scales);
- the packed layout holds the weight: its rows read back (C) equal the unpacked weight;
- the kernel computes sum_g d dx sum(u q) + m sum(x) of int8-quantized activations: the SIMD path
  equals the portable C path bit for bit, both equal a float64 evaluation of that formula, a row's
  output does not depend on the other rows, and the error against x W^T stays within what the
  activation rounding allows;
- requantization (Q6_K etc.) and at-load int8/int4 stay within their error bounds;
- models: greedy tokens with quantized weights == with their dequantized values (float activations),
  and on the real model the int8 activations cost little (KL, perplexity, top-1 agreement).
"""

from __future__ import annotations

import ctypes
import importlib.util

import gguf
import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.bench.quality import TEXT_PATH, Scorer, compare_scorers, run_quality
from tokenmill.checkpoint import GGUFBlocks, GGUFCheckpoint
from tokenmill.config import EngineConfig
from tokenmill.errors import TokenmillError
from tokenmill.layers.gguf_quant import EIGHT_BIT_TYPES, FOUR_BIT_TYPES, gguf_to_blocks
from tokenmill.layers.linear import Embedding, Linear
from tokenmill.layers.op import set_backend
from tokenmill.layers.quant import BlockQuant, QuantWeight, kernel_available, quantize
from tokenmill.models.llama import unpermute_rope_rows
from tokenmill.models.loader import build_weight, weight_forms

pytestmark = pytest.mark.skipif(not kernel_available(), reason="the C kernel cannot be built here")

CONVERTIBLE_TYPES = sorted(FOUR_BIT_TYPES | EIGHT_BIT_TYPES)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> GGUFBlocks:
    """Valid random blocks: quantized random weights where `gguf` can quantize the type, otherwise
    random bytes with small positive fp16 super-block scales."""
    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[qtype]
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[t]
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        w = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        return GGUFBlocks(qtype, (rows, cols), torch.from_numpy(gguf.quants.quantize(w, t)))
    raw = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
    scales = (rng.random((rows, cols // block_size, 2)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8)
    if qtype in ("Q3_K", "Q6_K"):  # quants and sub-block scales, then d
        raw[..., -2:] = scales[..., :2]
    elif qtype == "Q2_K":  # ... then d, dmin
        raw[..., -4:] = scales.reshape(rows, cols // block_size, 4)
    else:  # d, dmin first
        raw[..., :4] = scales.reshape(rows, cols // block_size, 4)
    return GGUFBlocks(qtype, (rows, cols), torch.from_numpy(raw.reshape(rows, -1)))


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    err = (actual.float() - expected.float()).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} x {scale:.3g}"


# ------------------------------------------------------------------------- GGUF conversion, per type


@pytest.mark.parametrize("qtype", CONVERTIBLE_TYPES)
def test_gguf_blocks_equal_reference_dequantization(qtype):
    blocks = random_blocks(qtype, 40, 512)
    q = gguf_to_blocks(blocks)
    assert q.bits == (4 if qtype in FOUR_BIT_TYPES else 8) and int(q.u.max()) < 2**q.bits
    ref = blocks.dequantize()
    if qtype.endswith("_K"):  # sub-block scales d * sc and dmin * mn rounded to fp16
        assert_close_rel(q.dequantize(), ref, 2**-10)
    else:
        torch.testing.assert_close(q.dequantize(), ref, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- packing and kernel


def random_block_quant(rows: int, cols: int, bits: int, seed: int = 0) -> BlockQuant:
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2**bits, (rows, cols), generator=g, dtype=torch.uint8)
    d = torch.rand(rows, cols // 32, generator=g) * 0.01
    return BlockQuant(u, d, -d * 2 ** (bits - 1) * torch.rand(rows, cols // 32, generator=g), bits)


def quantize_activations(x: torch.Tensor, one_plane: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation split, x ~ dx (254 hi + lo) per group of 32, computed in float32 as the
    kernel does: (254 hi + lo as float64, dx, the group sums of the quantized activations). `one_plane`:
    int8 activations, x ~ step hi: (hi, step, its sums)."""
    g = x.float().view(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    amax = torch.where(amax < 127 * 254 * torch.finfo(torch.float32).tiny, torch.zeros_like(amax), amax)
    step = amax / 127
    fine = step / 254
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    inv_fine = torch.where(amax > 0, 1 / fine, torch.zeros_like(amax))
    hi = torch.round(g * inv)
    lo = torch.round((g - hi * step) * inv_fine).clamp(-127, 127)
    if one_plane:
        return hi.double(), step.squeeze(-1).double(), step.squeeze(-1).double() * hi.double().sum(-1)
    qx = (254 * hi + lo).double()
    return qx, fine.squeeze(-1).double(), fine.squeeze(-1).double() * qx.sum(-1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("rows", "cols"), [(16, 32), (40, 96), (100, 256), (960, 576)])
def test_packed_rows_read_back_exactly(bits, rows, cols):
    q = random_block_quant(rows, cols, bits, seed=rows)
    weight = QuantWeight(q, torch.float32)
    assert torch.equal(weight.dequantize(), q.dequantize())
    ids = torch.tensor([[0, rows - 1], [rows // 2, 15]])
    assert torch.equal(weight.rows(ids), q.dequantize()[ids])
    with pytest.raises(IndexError, match="out of range"):
        weight.rows(torch.tensor([rows]))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("rows", "cols"), [(16, 32), (40, 96), (200, 576)])
def test_kernel_computes_its_formula(bits, rows, cols):
    q = random_block_quant(rows, cols, bits, seed=cols)
    weight = QuantWeight(q, torch.float32)
    x = torch.randn(21, cols)  # 21 rows: blocks of 8, 8 and 5 rows in the SIMD path
    x[3] = 0  # an all-zero row (scale 0)
    y = weight.matmul(x)
    generic = kernels.quant_matmul(x, weight.plan(), generic=True)
    if kernels.load().quant_matmul_has_simd():
        assert torch.equal(y, generic)  # exact integer sums, the same float operations in the same order
    qx, dx, sums = quantize_activations(x)
    u = q.u.double().view(rows, -1, 32)
    expected = (torch.einsum("ngk,mgk->mng", u, qx) * q.d.double() * dx[:, None, :]
                + q.m.double() * sums[:, None, :]).sum(-1)
    assert_close_rel(generic, expected, 1e-5)
    assert torch.equal(y[3], torch.zeros(rows))
    # a row's output does not depend on its batch (alone, or at another position of another batch)
    for i in (0, 7, 8, 20):
        assert torch.equal(weight.matmul(x[i:i + 1]), y[i:i + 1])
    assert torch.equal(weight.matmul(x[5:18]), y[5:18])
    for m in range(2, 8):   # a step of m rows: one block of m (each size its own SIMD code)
        assert torch.equal(weight.matmul(x[:m]), y[:m])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize(("n", "k"), [(40, 96), (48, 160), (16, 1536)])
def test_amx_row_blocks_equal_the_generic_path(bits, symmetric, n, k):
    """Where AMX runs (blocks of 16 activation rows in tiles, a step of 10 to 15 rows as one block,
    the rest with VNNI), every output is the portable path's bit for bit: steps of 9, 10 and 15
    rows, chunks of 64 rows with a short last block, a partial last tile
    (n = 40), weights of 3, 5 and 48 groups (batches of 4 groups, a short last batch), a zero row,
    the fused residual. On a VNNI build without AMX it holds VNNI to the same (on other builds it
    checks only the zero row)."""
    weight = symmetric_and_stored(bits, n, k, seed=n)[0] if symmetric else \
        QuantWeight(random_block_quant(n, k, bits, seed=n), torch.float32)
    x, residual = torch.randn(150, k) * 3, torch.randn(150, n)
    x[3] = 0
    for rows in (9, 10, 15, 16, 17, 64, 80, 150):
        y = kernels.quant_matmul(x[:rows], weight.plan(), residual=residual[:rows])
        if kernels.has_vnni_matmul():
            assert torch.equal(y, kernels.quant_matmul(x[:rows], weight.plan(), residual=residual[:rows], generic=True))
        assert torch.equal(y[3], residual[3])


@pytest.mark.skipif("amx_int8" not in kernels.cpu_flags().split(), reason="the CPU has no AMX")
def test_the_quantized_matmul_takes_amx_where_the_cpu_has_it():
    """On a CPU with AMX, where Linux grants this process the tile state (asked here again: the
    answer is the process's), the build has the tile path and uses it: a build or a permission
    request gone wrong would fall back to VNNI silently, at VNNI's speed."""
    arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18   # x86-64 Linux's numbers
    syscall = ctypes.CDLL(None, use_errno=True).syscall   # (variadic: every argument a long)
    if syscall(*map(ctypes.c_long, (arch_prctl, req_xcomp_perm, xtiledata))) != 0:
        pytest.skip(f"Linux did not grant the AMX tile state (errno {ctypes.get_errno()})")
    assert kernels.has_amx_matmul()


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_multiplies_the_weight_by_the_quantized_activations(bits):
    """y = W x^ with W the dequantized weight and x^ = dx (254 hi + lo) the activations as the kernel
    quantized them, to float32 rounding: the offset term m sum(x) takes the sum of x^, not of x. With
    the exact sum of x, the rounding error of each group is weighted by d u (every value of the
    same sign, about z d on average) where it should be weighted by W = d u + m, which is centred:
    an error ~100x larger here (and SmolLM2's mean KL 6.8e-7 against 1.0e-7 with x^)."""
    q = random_block_quant(64, 1536, bits, seed=5)
    weight = QuantWeight(q, torch.float32)
    x = torch.randn(9, 1536)
    x[:, ::97] *= 50   # outlier channels: coarse steps for their groups
    qx, dx, _ = quantize_activations(x)
    x_hat = (qx * dx[..., None]).reshape(x.shape)
    expected = x_hat @ q.dequantize().double().t()
    for generic in (False, True):
        y = kernels.quant_matmul(x, weight.plan(), generic=generic)
        assert_close_rel(y, expected, 2e-6)


@pytest.mark.parametrize("generic", [False, True])
def test_fused_input_ops_equal_the_layers_they_stand_for(generic):
    """silu(gate) * up, RMSNorm and the residual add inside the kernel == the PyTorch layers, then the
    kernel (to float32 rounding: the fused ops sum in another order)."""
    from tokenmill.layers.activation import silu_and_mul
    from tokenmill.layers.norm import RMSNorm

    q = random_block_quant(100, 96, 4, seed=11)
    weight = QuantWeight(q, torch.float32)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.rand(96) + 0.5
    gate_up = torch.randn(7, 192) * 3
    residual = torch.randn(7, 100)

    def run(x, **kw):
        return kernels.quant_matmul(x, weight.plan(), generic=generic, **kw)

    h = norm(silu_and_mul(gate_up))
    assert_close_rel(run(gate_up, gated="silu", norm=(norm.weight, 1e-5), residual=residual),
                     residual + run(h), 1e-5)
    assert_close_rel(run(gate_up, gated="silu"), run(silu_and_mul(gate_up)), 1e-5)
    x = torch.randn(7, 96)
    assert_close_rel(run(x, norm=(norm.weight, 1e-5)), run(norm(x)), 1e-5)
    assert torch.equal(run(x, residual=residual), residual + run(x))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_int8_activations_multiply_the_hi_plane_alone(bits, symmetric):
    """A weight with int8_activations: the activations rounded to one int8 plane per group (llama.cpp's
    rounding; the symmetric form subtracts zero * sum(hi) in the integers' float): the portable path's
    bits at every block size (1 to 8 rows, AMX blocks, chunks of 64 rows), its formula to float32
    rounding, and an error ~2^8 times the two planes' (so the setting is not ignored)."""
    n, k = 48, 1536
    weight = symmetric_and_stored(bits, n, k, seed=3)[0] if symmetric else \
        QuantWeight(random_block_quant(n, k, bits, seed=3), torch.float32)
    x, residual = torch.randn(150, k), torch.randn(150, n)
    x[3] = 0
    two = weight.matmul(x)
    weight.int8_activations = True
    y = weight.matmul(x)
    for rows in (1, 2, 5, 8, 9, 10, 15, 16, 17, 64, 80, 150):
        got = kernels.quant_matmul(x[:rows], weight.plan(), residual=residual[:rows])
        assert torch.equal(got, kernels.quant_matmul(x[:rows], weight.plan(), residual=residual[:rows], generic=True))
        assert torch.equal(weight.matmul(x[:rows]), y[:rows])   # (a row's output does not depend on its batch)
    assert torch.equal(y[3], torch.zeros(n))
    qx, dx, _ = quantize_activations(x, one_plane=True)
    x_hat = (qx * dx[..., None]).reshape(x.shape)
    w = weight.dequantize().double()
    assert_close_rel(y, x_hat @ w.t(), 2e-6)
    exact = x.double() @ w.t()
    error_one, error_two = ((out.double() - exact).norm() / exact.norm() for out in (y, two))
    assert 1e-3 < error_one < 2e-2 and error_one > 50 * error_two


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("int8_activations", [False, True])
def test_tiny_activation_groups_are_quantized_as_zeros(bits, int8_activations):
    """A group of activations too small for its quantization steps to be normal floats (1 / step would
    overflow) is quantized as zeros, on every path, rather than making the row's outputs NaN."""
    weight = QuantWeight(random_block_quant(48, 256, bits, seed=1), torch.float32)
    weight.int8_activations = int8_activations
    x = torch.randn(4, 256)
    x[1, 64:96] = torch.randn(32) * 1e-38   # one tiny group (denormal values)
    x[2] = torch.randn(256) * 1e-36         # a whole row of them
    x[3, 32:64] = torch.linspace(-3e-34, 3e-34, 32)   # fine steps below the normal range (< 3.8e-34)
    y = weight.matmul(x)
    assert torch.equal(y, kernels.quant_matmul(x, weight.plan(), generic=True))
    assert torch.isfinite(y).all()
    assert torch.equal(y[2], torch.zeros(48))
    dropped = x.clone()
    dropped[1, 64:96] = dropped[2] = dropped[3, 32:64] = 0
    assert torch.equal(y, weight.matmul(dropped))


@pytest.mark.parametrize("bits", [4, 8])
def test_activation_rounding_error_is_bounded(bits):
    """|y - x W^T| <= sum_k |W[n, k]| dx[k] / 2 (each activation is within half a fine step), and in
    practice ~3e-5 of |y| (plain int8 activations: ~1e-2)."""
    q = random_block_quant(576, 1536, bits, seed=9)
    weight = QuantWeight(q, torch.float32)
    x = torch.randn(6, 1536)
    w = q.dequantize().double()
    exact = x.double() @ w.t()
    err = (weight.matmul(x).double() - exact).abs()
    _, dx, _ = quantize_activations(x)
    bound = (w.abs().view(576, -1, 32).sum(-1) @ dx.t()).t() / 2  # [6, 576]
    assert (err <= bound * 1.01 + 1e-5).all()
    assert (err.norm() / exact.norm()) < 1e-4


@pytest.mark.parametrize("qtype", ["Q6_K", "Q3_K", "Q2_K"])
def test_types_without_block_form_are_requantized_to_8_bits(qtype):
    blocks = random_blocks(qtype, 32, 256, seed=4)
    assert gguf_to_blocks(blocks) is None
    weight = build_weight([blocks], "auto", torch.float32)
    assert isinstance(weight, QuantWeight) and weight.bits == 8
    ref = blocks.dequantize()
    groups = ref.view(32, -1, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 255  # 8 bits per group of 32
    err = (weight.dequantize() - ref).abs().view(32, -1, 32).amax(-1)
    assert (err <= 0.5 * step * 1.01 + groups.abs().amax(-1) * 2**-10).all()


# ------------------------------------------------------------------------ at-load quantization


@pytest.mark.parametrize("bits", [4, 8])
def test_group_quantization_error_is_half_a_step(bits):
    w = torch.randn(64, 256) * 0.05
    q = quantize(w, bits)
    assert q.bits == bits and int(q.u.max()) < 2**bits
    groups = w.view(64, -1, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
    abs_err = (q.dequantize() - w).abs().view(64, -1, 32)
    # half a step, plus the fp16 rounding of scale and offset (values are chosen against them)
    assert (abs_err.amax(-1) <= 0.5 * step * 1.01 + groups.abs().amax(-1) * 2**-10).all()
    assert abs_err.mean() < 0.3 * step.mean()  # rounding to nearest: ~step / 4 on average


@pytest.mark.parametrize(("qtype", "zero"), [("Q4_0", 8), ("Q5_0", 16), ("Q8_0", 128), ("Q4_1", None),
                                           ("Q5_1", None), ("Q4_K", None)])
def test_symmetric_types_are_held_without_offsets(qtype, zero):
    """Q4_0 / Q5_0 / Q8_0 blocks (every offset -z d) keep scales only, and read back exactly; the
    asymmetric types keep their offsets."""
    blocks = random_blocks(qtype, 40, 256, 3)
    weight = QuantWeight(gguf_to_blocks(blocks), torch.float32)
    assert weight.zero == zero and (weight.offsets is None) == (zero is not None)
    held = {name for name, _ in weight.named_parameters()}
    assert held == ({"packed", "scales"} if zero is not None else {"packed", "scales", "offsets"})
    tol = 2**-10 if qtype.endswith("_K") else 0.0
    assert_close_rel(weight.dequantize(), blocks.dequantize(), tol)


def symmetric_and_stored(bits: int, rows: int, cols: int, seed: int) -> tuple[QuantWeight, QuantWeight]:
    """One weight with every m = -2^(bits-1) d, twice: symmetric (no offsets) and with its offsets
    stored (the same packed values and scales)."""
    q = random_block_quant(rows, cols, bits, seed)
    q = BlockQuant(q.u, q.d, -(2 ** (bits - 1)) * q.d, bits)
    symmetric = QuantWeight(q, torch.float32)
    assert symmetric.zero == 2 ** (bits - 1) and symmetric.offsets is None
    offsets = (-symmetric.zero * symmetric.scales.float()).to(torch.float16)
    stored = QuantWeight.from_packed(symmetric.packed.data, symmetric.scales.data, offsets, None, rows, cols, bits,
                                     torch.float32)
    return symmetric, stored


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("generic", [False, True])
def test_symmetric_weight_computes_the_bits_of_its_stored_offsets(bits, generic):
    """The kernels' m = -z d (formed from d) == the stored fp16 offsets, bit for bit: every row run
    (8, 4, 2, 1 rows), a partial last tile, the fused gate, norm and residual, and row reads."""
    symmetric, stored = symmetric_and_stored(bits, 40, 96, seed=bits)
    x, gate_up, residual = torch.randn(21, 96) * 3, torch.randn(21, 192) * 3, torch.randn(21, 40)
    norm = (torch.rand(96) + 0.5, 1e-5)
    for rows in (1, 2, 3, 7, 21):
        for kw in ({}, {"norm": norm, "residual": residual[:rows]}):
            got = kernels.quant_matmul(x[:rows], symmetric.plan(), generic=generic, **kw)
            assert torch.equal(got, kernels.quant_matmul(x[:rows], stored.plan(), generic=generic, **kw))
    got = kernels.quant_matmul(gate_up, symmetric.plan(), gated="silu", generic=generic)
    assert torch.equal(got, kernels.quant_matmul(gate_up, stored.plan(), gated="silu", generic=generic))
    assert torch.equal(symmetric.dequantize(), stored.dequantize())
    assert_close_rel(symmetric.matmul(x), x @ stored.dequantize().T, 1e-3)
    assert sum(p.numel() * p.element_size() for p in symmetric.parameters()) < \
        sum(p.numel() * p.element_size() for p in stored.parameters())


# ------------------------------------------------------------------ shards, permutation, forms


def test_fused_shards_of_mixed_types_stack_exactly():
    """q (Q4_0, 4 bits), k (Q8_0, 8 bits), v (Q5_1): one 8-bit weight, rows in order, exact."""
    shards = [random_blocks("Q4_0", 64, 256, 5), random_blocks("Q8_0", 32, 256, 6), random_blocks("Q5_1", 32, 256, 7)]
    weight = build_weight(shards, "auto", torch.float32)
    assert weight.bits == 8
    torch.testing.assert_close(weight.dequantize(), torch.cat([s.dequantize() for s in shards]), rtol=0, atol=1e-6)


def test_rope_row_permutation_of_blocks_equals_permutation_of_weights():
    blocks = random_blocks("Q4_1", 4 * 16, 64, 8)
    permuted = unpermute_rope_rows(blocks, 4)
    assert isinstance(permuted, GGUFBlocks)
    assert torch.equal(permuted.dequantize(), unpermute_rope_rows(blocks.dequantize(), 4))


def test_forms_by_mode():
    dense = torch.randn(32, 64)
    assert build_weight([dense], "auto", torch.float32) is None
    assert build_weight([dense], "int8", torch.float32).bits == 8
    assert build_weight([dense], "int4", torch.float32).bits == 4
    assert build_weight([torch.randn(32, 48)], "int4", torch.float32) is None  # 48 is no multiple of 32
    # a dense shard next to quantized ones keeps the layer dense (mode auto); int8 mode requantizes it
    mixed = [random_blocks("Q4_0", 32, 64), dense]
    assert build_weight(mixed, "auto", torch.float32) is None
    assert build_weight(mixed, "int8", torch.float32).bits == 8


def test_quantization_option_is_validated():
    with pytest.raises(TokenmillError, match="quantization"):
        EngineConfig(quantization="int3")
    with pytest.raises(TokenmillError, match="CPU only"):
        from tokenmill.models.loader import _check_quantization
        _check_quantization("int4", torch.device("meta"))


def test_int8_activations_are_refused_for_a_model_that_runs_dense(tiny_gguf_model, tiny_hf_model):
    """activation_precision applies to quantized weights: a model that runs dense refuses int8 (it would
    change nothing) with a message naming the setting; a quantized target's dense draft keeps the
    default while the target's weights take int8."""
    with pytest.raises(TokenmillError, match="activation_precision.*quantized weights"):
        LLM(str(tiny_hf_model("smollm")), activation_precision="int8")
    with pytest.raises(TokenmillError, match="activation_precision.*quantized weights"):
        LLM(str(tiny_gguf_model("smollm", "Q8_0")), quantization="none", activation_precision="int8")
    with pytest.raises(TokenmillError, match="activation_precision: 'int4' is not one of int16, int8"):
        EngineConfig(activation_precision="int4")
    path = str(tiny_gguf_model("smollm", "Q8_0"))
    llm = LLM(path, activation_precision="int8", num_kv_blocks=64,
              speculative_config={"model": path, "quantization": "none", "num_speculative_tokens": 2})
    assert llm.engine.speculator is not None
    assert all(m.int8_activations for m in llm.engine.model.modules() if isinstance(m, QuantWeight))


# ------------------------------------------------------------------------------- models


PROMPTS = ["The weather today is", "Once upon a time there was", "To make bread, mix"]


def greedy(llm: LLM, n: int = 24, logprobs: int | None = None) -> list:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return outputs if logprobs else [o.token_ids for o in outputs]


def exact(llm: LLM) -> LLM:
    """Float activations times the dequantized packed weights: a quantized model then computes exactly
    its quantized weights, so whole-model plumbing (packing, fused shards, Q/K permutation, tied
    heads, biases, embedding rows) is checked without activation rounding. The tiny random models are
    chaotic enough that the int8 rounding alone flips greedy tokens within a few steps (the kernel and
    its error are checked per layer above, and on the real model below)."""
    set_backend(llm.engine.model, "torch", (Linear, Embedding))
    return llm


@pytest.mark.parametrize(("kind", "ftype", "forms"), [
    ("llama", "Q4_1", {"int4": 10}),    # Q/K row permutation, fused q/k/v and gate/up, untied head
    ("smollm", "Q8_0", {"int8": 9}),    # tied LM head = the quantized embedding; 3:1 GQA
    ("qwen2", "Q5_0", {"int8": 10}),    # q/k/v biases on a quantized fused projection
    ("gpt2", "Q4_0", {"int4": 9, "dense": 1}),  # fused c_attn; position embeddings stay F32
    ("llama256", "Q4_K", {"int4": 10}),
])
def test_tiny_gguf_quantized_greedy_equals_dequantized(kind, ftype, forms, tiny_gguf_model):
    path = str(tiny_gguf_model(kind, ftype))
    # float32 and the reference's cache for both, to isolate the weights
    quantized = exact(LLM(path, dtype="float32", num_kv_blocks=64, kv_cache_dtype="float32"))
    assert weight_forms(quantized.engine.model) == forms
    reference = LLM(path, dtype="float32", quantization="none", num_kv_blocks=64)
    assert weight_forms(reference.engine.model) == {"dense": sum(forms.values())}
    ref_modules = dict(reference.engine.model.named_modules())
    for name, q in quantized.engine.model.named_modules():
        if not isinstance(q, (Linear, Embedding)) or q.qweight is None:
            continue
        ref = ref_modules[name]
        # the held weight is the checkpoint's (fused shards, Q/K permutation of blocks, tied head):
        # exact up to float32 rounding (one fma vs the reference's multiply-add); K-quants up to the
        # fp16 rounding of their sub-block scales. The reference then takes the held weight exactly.
        held = q.qweight.dequantize()
        assert_close_rel(held, ref.weight, 2**-10 if ftype.endswith("_K") else 1e-6)
        with torch.no_grad():
            ref.weight.copy_(held)
    assert greedy(quantized) == greedy(reference)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tiny_hf_quantized_at_load_computes_its_quantized_weights(mode, tiny_hf_model):
    """Dense checkpoints quantized at load: every projection and the tied LM head quantized; the model
    equals the dense model whose weights are replaced by their quantized values."""
    path = str(tiny_hf_model("smollm"))
    quantized = exact(LLM(path, dtype="float32", quantization=mode, num_kv_blocks=64, kv_cache_dtype="float32"))
    assert weight_forms(quantized.engine.model) == {mode: 9}
    reference = LLM(path, dtype="float32", num_kv_blocks=64)
    with torch.no_grad():
        for module in reference.engine.model.modules():
            if isinstance(module, (Linear, Embedding)):
                module.weight.copy_(build_weight([module.weight.data], mode, torch.float32).dequantize())
    assert greedy(quantized) == greedy(reference)


def test_quality_bench_orders_modes(tiny_hf_model):
    """`bench quality` on a dense checkpoint: the reference scores itself exactly, int8 is closer to
    it than int4, and the text is scored in full."""
    report = run_quality(str(tiny_hf_model("smollm")), ["int4", "int8", "auto-kv-f32"], context=128,
                         chunk_size=16, text=TEXT_PATH.read_text(encoding="utf-8")[:1500])
    rows = {r["mode"]: r for r in report["results"]}
    assert list(rows) == ["none", "int4", "int8", "auto-kv-f32"]
    assert rows["none"]["mean_kl"] == 0 and rows["none"]["top1_agreement"] == 1
    # a dense checkpoint with an explicit float32 cache is the reference itself
    assert rows["auto-kv-f32"]["mean_kl"] == 0 and rows["auto-kv-f32"]["top1_agreement"] == 1
    assert 0 < rows["int8"]["mean_kl"] < rows["int4"]["mean_kl"]
    assert rows["int8"]["top1_agreement"] >= 0.9
    assert report["predicted"] == report["tokens"] - 1  # every token after the first, once


def test_quality_bench_measures_int8_activations(tiny_gguf_model):
    """`bench quality`'s auto-kv-f32-act-int8 mode runs the quantized file with activation_precision int8:
    further from the dequantized reference than the default two planes (auto-kv-f32), by orders of
    magnitude."""
    report = run_quality(str(tiny_gguf_model("smollm", "Q8_0")), ["auto-kv-f32", "auto-kv-f32-act-int8"],
                         context=128, chunk_size=16, text=TEXT_PATH.read_text(encoding="utf-8")[:800])
    rows = {r["mode"]: r for r in report["results"]}
    assert 100 * rows["auto-kv-f32"]["mean_kl"] < rows["auto-kv-f32-act-int8"]["mean_kl"]


def test_quality_scorer_runs_models_with_several_kv_cache_groups(tiny_hf_model):
    """Gemma 3 (a global layer and five sliding ones: six KV cache groups sharing one cache tensor): the
    scorer gives each group blocks of its own, so its chunk-by-chunk logits over a sequence longer
    than the window are one prefill's."""
    from engine_helpers import make_engine, prefill_logits

    path = str(tiny_hf_model("gemma3"))
    scorer = Scorer.load(path, "none", context=48)
    assert scorer.groups == 6 and scorer.num_blocks * 16 >= 48
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    chunks = torch.cat([scorer.logits(ids[i:i + 16], i) for i in range(0, 40, 16)])
    torch.testing.assert_close(chunks, prefill_logits(make_engine(path), ids), atol=1e-4, rtol=0)


def test_quality_bench_scores_in_float32_by_default(monkeypatch, tiny_gguf_model):
    """The reference is the dequantized model in float32 on every CPU: dtype auto would make it
    bfloat16 where the CPU has bf16 units (and the quantized modes float32), measuring bf16's error."""
    from tokenmill import config

    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: True)

    def reference_dtype(**dtype):
        return run_quality(str(tiny_gguf_model("llama", "Q4_1")), ["auto"], context=32, chunk_size=16,
                           text=TEXT_PATH.read_text(encoding="utf-8")[:200], **dtype)["dtype"]

    assert reference_dtype() == "torch.float32"
    assert reference_dtype(dtype="auto") == "torch.bfloat16"   # asked for: the machine's choice


class FakeLlama:
    """llama_cpp.Llama's surface that LlamaCppScorer uses (reset, eval, n_tokens, scores), computing
    its logits with tokenmill's own reference scorer position by position as llama.cpp keeps them."""

    def __init__(self, model_path, n_ctx, **kwargs):
        self.inner = Scorer.load(model_path, "none", n_ctx)
        self.n_ctx, self.n_tokens, self.scores = n_ctx, 0, None

    def reset(self):
        self.n_tokens = 0

    def eval(self, ids):
        logits = self.inner.logits(ids, self.n_tokens).numpy()
        if self.scores is None:
            self.scores = np.full((self.n_ctx, logits.shape[1]), np.nan, dtype=np.float32)
        self.scores[self.n_tokens:self.n_tokens + len(ids)] = logits
        self.n_tokens += len(ids)


def test_quality_bench_llama_cpp_mode_scores_each_window_from_position_zero(monkeypatch, tiny_gguf_model):
    """Mode llama.cpp through a fake llama_cpp that computes the reference's own logits: every row it
    returns is the reference's row for the same position (KL 0, top-1 100%) across several windows,
    so a window not started from an empty cache, or rows taken from the wrong positions, fail here."""
    import sys
    import types

    from tokenmill.bench import peers
    from tokenmill.bench.quality import LLAMA_CPP, LlamaCppScorer

    fake = types.ModuleType("llama_cpp")
    fake.Llama = FakeLlama
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(peers, "llama_cpp_python_status", lambda: peers.PeerStatus("fake", True, "0", None, "fake"))
    monkeypatch.setenv(peers.REPACK_ENV, "1")   # (on an AMX CPU the peer would patch the C API, which the fake lacks)
    path = str(tiny_gguf_model("llama", "Q8_0"))
    report = run_quality(path, ["auto", LLAMA_CPP], context=40, chunk_size=16,
                         text=TEXT_PATH.read_text(encoding="utf-8")[:600])
    rows = {r["mode"]: r for r in report["results"]}
    assert report["predicted"] > 2 * 40   # three windows or more
    assert rows[LLAMA_CPP]["mean_kl"] == 0 and rows[LLAMA_CPP]["top1_agreement"] == 1
    tensor_types = [t.tensor_type.name for t in gguf.GGUFReader(path).tensors]   # (read by gguf-py, not by us)
    assert rows[LLAMA_CPP]["weight_forms"] == {f"llama.cpp {t}": tensor_types.count(t) for t in ("F32", "Q8_0")}
    assert rows["auto"]["mean_kl"] > 0
    scorer = LlamaCppScorer(path, 40)
    scorer.logits([1, 2, 3], 0)
    with pytest.raises(ValueError, match="holds 3 positions, asked to continue at 5"):
        scorer.logits([4], 5)


def test_quality_bench_llama_cpp_mode_needs_the_peer_and_a_gguf(monkeypatch, tiny_hf_model):
    from tokenmill.bench import peers
    from tokenmill.bench.quality import LLAMA_CPP, LlamaCppScorer

    monkeypatch.setattr(peers, "llama_cpp_python_status", lambda: peers.PeerStatus("x", True, "0", None, "x"))
    with pytest.raises(TokenmillError, match="llama.cpp reads GGUF files"):
        LlamaCppScorer(str(tiny_hf_model("llama")), 32)
    monkeypatch.setattr(peers, "llama_cpp_python_status", lambda: peers.PeerStatus("x", False, None, None,
                                                                                    "not installed: pip it"))
    with pytest.raises(TokenmillError, match=f"--modes {LLAMA_CPP}: llama-cpp-python is not installed: pip it"):
        LlamaCppScorer("model.gguf", 32)


@pytest.mark.skipif(not importlib.util.find_spec("llama_cpp"), reason="llama-cpp-python is not installed "
                    "(scripts/install-peers.sh)")
def test_quality_bench_llama_cpp_mode_agrees_with_the_reference_on_the_same_file(tiny_gguf_model):
    """Real llama.cpp on a tiny Q8_0 GGUF: its logits follow tokenmill's fp32 reference closely (the
    same model, token for token), so the mode compares like with like."""
    from tokenmill.bench.quality import LLAMA_CPP

    report = run_quality(str(tiny_gguf_model("llama", "Q8_0")), [LLAMA_CPP], context=64, chunk_size=16,
                         text=TEXT_PATH.read_text(encoding="utf-8")[:800])
    row = report["results"][1]
    assert row["mean_kl"] < 0.02 and row["top1_agreement"] > 0.9, row


@pytest.mark.slow
def test_default_model_kept_quantized_matches_dequantized_reference(default_gguf_path):
    """SmolLM2-135M Q4_1 (+ a Q8_0 embedding / tied LM head) run quantized vs dequantized to fp32.

    The kernel's activations carry ~16 bits per group of 32 (the LM head too): over the bundled
    text the quantized model stays far closer to the fp32 reference than the dense model run in
    bf16 (mean KL 1.2e-7 vs 1.6e-3 measured). Greedy tokens then agree unless the reference itself
    hesitates: a continuation may flip only where the reference's top two candidates are within
    0.05 nats. That is with the reference's float32 KV cache; the default (a bfloat16 cache on CPU)
    adds the cache's rounding: still within 0.2% perplexity. Over ~850 tokens: on a quarter of that,
    last-bit changes in any kernel (flipping a bf16 or activation rounding somewhere) swing the
    perplexity by up to 0.2% either way (-0.02% and -0.24% seen for two equally exact attention
    kernels). An int8 cache adds its own rounding: bounded below."""
    ckpt = GGUFCheckpoint(default_gguf_path)
    assert {ckpt.tensor_type(n) for n in ckpt.tensor_names()} == {"F32", "Q4_1", "Q8_0"}
    quantized = LLM(str(default_gguf_path), num_kv_blocks=64, dtype="float32", kv_cache_dtype="float32")
    assert weight_forms(quantized.engine.model) == {"int4": 120, "int8": 1}
    reference = LLM(str(default_gguf_path), num_kv_blocks=64, dtype="float32", quantization="none")
    for got, want in zip(greedy(quantized, 32), greedy(reference, 32, logprobs=2), strict=True):
        first = next((i for i, (a, b) in enumerate(zip(got, want.token_ids, strict=True)) if a != b), None)
        if first is not None:
            top2 = sorted((lp.logprob for lp in want.logprobs[first].values()), reverse=True)
            assert top2[0] - top2[1] < 0.05, (first, top2)
    default = LLM(str(default_gguf_path), num_kv_blocks=64, dtype="float32")
    assert default.engine.kv_caches[0].dtype == torch.bfloat16
    int8_cache = LLM(str(default_gguf_path), num_kv_blocks=64, dtype="float32", kv_cache_dtype="int8")
    report = compare_scorers({"none": Scorer(reference), "auto-kv-f32": Scorer(quantized), "auto": Scorer(default),
                              "auto-kv-int8": Scorer(int8_cache)},
                             TEXT_PATH.read_text(encoding="utf-8")[:4000], context=1024, chunk_size=32)
    ppl = {r["mode"]: r["perplexity"] for r in report["results"]}
    exact_cache, auto, int8 = report["results"][1:]
    # 2.1e-7 measured (1.1e-6 when the kernel's offset term took the exact sum of x, not of x^)
    assert exact_cache["mean_kl"] < 5e-7 and exact_cache["top1_agreement"] > 0.99
    assert abs(ppl["auto-kv-f32"] / ppl["none"] - 1) < 1e-3
    assert auto["mean_kl"] < 5e-4 and auto["top1_agreement"] > 0.98
    assert abs(ppl["auto"] / ppl["none"] - 1) < 2e-3
    # an int8 cache (8 bits and a bf16 scale per 32 values) costs more, still about what running the
    # whole model in bf16 costs (mean KL ~1.6e-3 on the full text)
    assert int8["mean_kl"] < 3e-3 and int8["top1_agreement"] > 0.96
    assert abs(ppl["auto-kv-int8"] / ppl["none"] - 1) < 5e-3
