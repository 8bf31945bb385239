"""CPU kernels written in C where no PyTorch op fits, compiled on first use and called by ctypes.

- paged_decode.c: single-query (decode) attention straight from the paged KV cache, alone or with
  the rotary embedding and the cache write fused in.
- paged_prefill.c: causal attention of a prefill chunk over the paged KV cache (AVX-512 and AVX2
  builds).
- quant_matmul.c: x W^T for weights in 4/8-bit groups of 32 with int8 activations (VNNI), and
  row dequantization of the same layout (layers/quant.py packs the weights).
- dense_matmul.c: x W^T for a dense bfloat16 weight and a few activation rows (a bf16 model's decode
  steps), at the rate the weight's bytes allow.
- moe.c: sparse_moe, a mixture-of-experts block with quantized experts in one call (routing, the
  experts grouped, the weighted sum).
- kernels.c: decode_stack, a decoder stack's decode step as one call, run from per-layer plan
  structs declared in kernels.h (mirrored here with ctypes).
- norm.c: rms_norm, the RMSNorm of norm.h that every kernel above uses too (layers/norm.py runs it).
- shm_exchange.c: tensor-parallel ranks of one machine exchanging buffers through shared memory
  (tokenmill/parallel.py's collectives: gloo's cost more than a decode step's compute here).

Each .c file is its own translation unit compiled against kernels.h (every exported function and
plan struct) and the helper headers simd.h / norm.h / attention.h; all of them link into one library.

The C sources ship with the package; they are compiled once per machine with the system's C compiler
(`cc`, or $CC) into the cache folder (tokenmill/cache.py: kernels/) and reused.
The build links OpenMP by soname, so at run time it shares the runtime PyTorch already loaded (one
thread pool, not two). Without a compiler the callers fall back to their PyTorch path: `load()`
returns None and says why in the log, once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from tokenmill.cache import cache_root

logger = logging.getLogger(__name__)

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo's flags line, else the processor's name): part of the
    kernels' build key (-march=native builds for this CPU: a cache shared with another CPU must not
    reuse it), and what the bench peers check for AMX."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


_DIR = Path(__file__).parent
# the attention kernels' kv_type argument (kernels.h TM_KV_*) by KV-cache dtype: torch.int8 is the
# int8 cache with a bfloat16 scale per group of 32 (layers/attention.py quantize_kv)
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def _compile(compiler: str) -> Path:
    units = sorted(_DIR.glob("*.c"))
    sources = b"\0".join(p.name.encode() + b"\0" + p.read_bytes() for p in sorted([*units, *_DIR.glob("*.h")]))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([sources, version.encode(), " ".join(_FLAGS).encode(),
                                     cpu_flags().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        build(compiler, units, built)
        os.replace(built, target)  # atomic: a concurrent build of the same key loses nothing
    return target


def build(compiler: str, units: list[Path], target: Path) -> None:
    """The C sources `units` compiled as the kernels are into the shared library `target` (this
    package's, or a variant's: scripts/kernel-ab.py). Raises RuntimeError with the compiler's errors."""
    result = subprocess.run([compiler, *_FLAGS, *map(str, units), "-o", str(target), "-lm"],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:2000]}")


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


_FALLBACK = "decode attention uses the slower PyTorch path and quantized weights are dequantized at load"


@cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) if they cannot be built here."""
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler found: %s", _FALLBACK)
        return None
    try:
        lib = ctypes.CDLL(str(_compile(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("could not build the C kernels (%s): %s", e, _FALLBACK)
        return None
    declare(lib)
    return lib


def declare(lib: ctypes.CDLL) -> None:
    """Argument and result types of every exported function (of this build, or of a variant build:
    scripts/kernel-ab.py)."""
    i64, f32, ptr, i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    options = [f32, i64, f32]  # scale, sliding window, logit softcap
    args = [ptr] * 3 + [i32, ptr, i64, ptr, ptr] + [i64] * 6 + options + [i32, i32]   # q, k, v, kv_type, ...
    lib.paged_decode.argtypes = args
    lib.paged_decode.restype = i32
    # qkv, cos, sin, slots, k, v, kv_type, ... softcap, q_norm, k_norm, qk_norm_eps, num_threads, generic
    lib.paged_decode_rotary.argtypes = [ptr] * 6 + args[3:-2] + [ptr, ptr, f32] + args[-2:]
    lib.paged_decode_rotary.restype = i32
    lib.paged_prefill.argtypes = [ptr, ptr, ptr, i32, ptr, i64, i64, ptr] + [i64] * 5 + options + [i32]
    lib.paged_prefill.restype = i32
    lib.paged_prefill_available.restype = i32
    lib.paged_prefill_bf16_dots.restype = i32
    lib.quant_matmul.argtypes = [ptr, i64, ptr, i32, ptr, f32, ptr, ptr, i32, i32]
    lib.quant_matmul.restype = i32
    lib.quant_rows.argtypes = [ptr, ptr, i64, ptr]
    lib.quant_rows.restype = None
    lib.quant_matmul_has_simd.restype = i32
    lib.quant_matmul_has_amx.restype = i32
    lib.bf16_matmul.argtypes = [ptr, i64, i64, ptr, i64, i32, ptr, f32, ptr, ptr, i32, i32]
    lib.bf16_matmul.restype = i32
    lib.sparse_moe.argtypes = [ptr, ptr, i64, ptr, ptr, i32]
    lib.sparse_moe.restype = i32
    lib.decode_stack.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, i32]
    lib.decode_stack.restype = i32
    lib.plan_struct_size.argtypes = [i32]
    lib.plan_struct_size.restype = i64
    lib.rms_norm.argtypes = [ptr, i64, i64, ptr, f32, ptr, i32, i32]
    lib.rms_norm.restype = None
    lib.shm_exchange.argtypes = [ptr, ptr, i64]
    lib.shm_exchange.restype = i32
    lib.shm_all_reduce.argtypes = [ptr, ptr, i64, i32]
    lib.shm_all_reduce.restype = i32
    lib.shm_header_bytes.restype = i64


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) if they cannot be built here."""
    return _library()


MAX_ROTARY_HEAD_DIM = 512  # paged_decode_rotary's stack buffer


def supports_paged_decode(cache: torch.Tensor) -> bool:
    return cache.device.type == "cpu" and cache.dtype in KV_TYPES and load() is not None


def cache_geometry(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, kv_heads, block_stride) of a layer's K and V caches [blocks, block_size, kv_heads,
    row]: each block's rows contiguous, the blocks `block_stride` elements apart (engine/kv_cache.py
    interleaves the layers' blocks), the same for K and V."""
    _, block_size, kv_heads, row = k_cache.shape
    assert k_cache.dtype == v_cache.dtype and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride()[1:] == (kv_heads * row, row, 1), f"cache rows not contiguous: {k_cache.stride()}"
    return block_size, kv_heads, k_cache.stride(0)


def _options(scale: float, sliding_window: int | None, logit_softcap: float | None) -> tuple[float, int, float]:
    """The attention kernels' (scale, window, softcap) arguments: 0 turns an option off."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be positive, got {logit_softcap}")
    return scale, sliding_window or 0, logit_softcap or 0.0


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, generic: bool = False, sliding_window: int | None = None,
                 logit_softcap: float | None = None) -> torch.Tensor:
    """q [B, heads, head_dim] -> fp32 [B, heads, head_dim]; caches [blocks, block_size, kv_heads,
    row] (head_dim values, or an int8 cache's layers.attention.kv_row_width); block_tables [B,
    max_blocks] and seq_lens [B] int64. Caller checks supports_paged_decode(k_cache) first. `generic`
    runs the portable C loops (the tests' reference for the AVX-512 path). Options as in
    layers/attention.Attention: `sliding_window` w (the query sees the last w positions; only their
    blocks are read), `logit_softcap` c."""
    lib = load()
    q = q.float().contiguous()
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    batch, heads, head_dim = q.shape
    block_size, kv_heads, block_stride = cache_geometry(k_cache, v_cache)
    out = torch.empty_like(q)
    failed = lib.paged_decode(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), KV_TYPES[k_cache.dtype], block_tables.data_ptr(),
        block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, head_dim, block_size,
        block_stride, *_options(scale, sliding_window, logit_softcap), torch.get_num_threads(), int(generic))
    if failed:
        raise MemoryError("paged decode attention: out of memory for the score buffer")
    return out


def paged_decode_rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, heads: int, scale: float, generic: bool = False,
                        sliding_window: int | None = None, logit_softcap: float | None = None,
                        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """One decode step of a layer in one call: qkv [B, (heads + 2 kv_heads) * head_dim] (a fused
    projection's output), cos/sin [B, head_dim] (RotaryEmbedding's full-width tables at each row's
    position), slots [B]: optionally RMSNorms each q and k head (`qk_norm` = (q weight, k weight, eps),
    weights [head_dim]), rotates q and k, writes k and v to their cache slots, attends (options as in
    paged_decode); returns fp32 [B, heads * head_dim]: the same bits as the unfused ops (rms_norm,
    apply_rotary, the cache write, paged_decode). Caller checks supports_paged_decode."""
    lib = load()
    block_size, kv_heads, block_stride = cache_geometry(k_cache, v_cache)
    head_dim = cos.shape[-1]
    assert head_dim <= MAX_ROTARY_HEAD_DIM
    qkv, cos, sin = (t.float().contiguous() for t in (qkv, cos, sin))
    q_norm, k_norm, eps = (None, None, 0.0) if qk_norm is None else (
        qk_norm[0].float().contiguous(), qk_norm[1].float().contiguous(), qk_norm[2])
    batch = qkv.shape[0]
    out = torch.empty(batch, heads * head_dim)
    failed = lib.paged_decode_rotary(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        KV_TYPES[k_cache.dtype], block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr(),
        batch, heads, kv_heads, head_dim, block_size, block_stride, *_options(scale, sliding_window, logit_softcap),
        pointer(q_norm), pointer(k_norm), eps, torch.get_num_threads(), int(generic))
    if failed:
        raise MemoryError("paged decode attention: out of memory")
    return out


def has_vnni_matmul() -> bool:
    """Does this machine's build run the quantized matmul on VNNI dot products (AVX-512 VNNI)? Elsewhere
    it takes the AVX2 tiles or the portable loops, where an extra activation row costs more."""
    lib = load()
    return lib is not None and bool(lib.quant_matmul_has_simd())


def has_amx_matmul() -> bool:
    """Does the quantized matmul run blocks of 16 activation rows (and steps of 10 to 15 rows) on AMX
    tiles (Sapphire Rapids and later, with a Linux that grants the tile state)? The results are the
    VNNI path's, bit for bit."""
    lib = load()
    return lib is not None and bool(lib.quant_matmul_has_amx())


def has_prefill_kernel() -> bool:
    """Does this machine's build have paged_prefill (AVX-512 or AVX2; elsewhere prompts run SDPA)?"""
    lib = load()
    return lib is not None and bool(lib.paged_prefill_available())


def prefill_bf16_dots() -> bool:
    """Does this build's prefill kernel take bfloat16 dot products on a bfloat16 cache (AVX512-BF16:
    queries and probabilities rounded to bfloat16, paged_prefill.c)?"""
    lib = load()
    return lib is not None and bool(lib.paged_prefill_bf16_dots())


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_len: int, scale: float, sliding_window: int | None = None,
                  logit_softcap: float | None = None) -> torch.Tensor | None:
    """Causal attention of one request's query rows q [n, heads, head_dim] (its last n positions of
    seq_len) over its paged K/V (block_table [>= ceil(seq_len / block_size)] int64) -> fp32 [n, heads,
    head_dim]; None where the kernel does not apply (no AVX-512 or AVX2 build, head_dim not a multiple of
    16): the caller runs SDPA. Options as in paged_decode (blocks wholly before the first row's window
    are not read). Caller checks supports_paged_decode(k_cache) first."""
    lib = load()
    q = q.float().contiguous()
    block_table = block_table.contiguous()
    num_q, heads, head_dim = q.shape
    block_size, kv_heads, block_stride = cache_geometry(k_cache, v_cache)
    out = torch.empty_like(q)
    status = lib.paged_prefill(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), KV_TYPES[k_cache.dtype], block_table.data_ptr(),
        seq_len, num_q, out.data_ptr(), heads, kv_heads, head_dim, block_size, block_stride,
        *_options(scale, sliding_window, logit_softcap), torch.get_num_threads())
    if status == 1:
        raise MemoryError("paged prefill attention: out of memory")
    return None if status < 0 else out


# ---------------------------------------------------------------------------------- RMSNorm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, generic: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension of float32 CPU x: x * r * weight, r = 1 / sqrt(mean(x^2) + eps),
    each row's squares summed in one fixed order (norm.h: the same bits as the norms fused into
    quant_matmul, paged_decode_rotary and decode_stack) -> a new tensor of x's shape. `generic` runs the
    portable C sum (the tests' reference: the same bits)."""
    assert x.dtype == torch.float32 and x.device.type == "cpu"
    x = x.contiguous()
    weight = weight.float().contiguous()
    n = x.shape[-1]
    assert weight.shape == (n,)
    out = torch.empty_like(x)
    load().rms_norm(x.data_ptr(), x.numel() // n if n else 0, n, weight.data_ptr(), eps, out.data_ptr(),
                    int(generic), torch.get_num_threads())
    return out


# ---------------------------------------------------------------------------------- quantized matmul


GATES = {None: 0, "silu": 1, "gelu_tanh": 2}  # kernels.h TM_GATE_*: the fused activation's code


def gate_code(gated: str | None) -> int:
    if gated not in GATES:
        raise ValueError(f"gated activation {gated!r} is not one of {sorted(map(str, GATES))}")
    return GATES[gated]


def quant_matmul(x: torch.Tensor, weight: WeightPlan, gated: str | None = None,
                 norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
                 generic: bool = False) -> torch.Tensor:
    """fp32 [M, N] = f(x) @ W^T (+ residual), W packed by layers/quant.py (`weight`: its plan, whose
    tensors the caller keeps alive); activations quantized inside.

    f, fused into the activation pass: `gated` (x [M, 2K] = [gate | up] -> act(gate) * up, act "silu"
    or "gelu_tanh", GELU's tanh approximation), then
    `norm` = (weight [K], eps): RMSNorm. `generic` runs the portable C path (the tests' reference)."""
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], weight.out_features)
    norm_w, eps = (norm[0].float().contiguous(), norm[1]) if norm is not None else (None, 0.0)
    if residual is not None:
        residual = residual.float().contiguous()
        assert residual.shape == y.shape
    if x.shape[1] != weight.in_features * (2 if gated else 1):
        raise ValueError(f"x has {x.shape[1]} columns for a weight of {weight.in_features} inputs (gated: {gated})")
    if load().quant_matmul(x.data_ptr(), x.shape[0], ctypes.byref(weight), gate_code(gated), pointer(norm_w), eps,
                           pointer(residual), y.data_ptr(), int(generic), torch.get_num_threads()):
        raise MemoryError("quantized matmul: out of memory for the activation buffer")
    return y


# Activation rows up to which a bf16 weight's product runs bf16_matmul: past a few rows PyTorch's
# matmul (oneDNN, bf16 dot products) is faster, and the weight's bytes no longer bound the product.
DENSE_MATMUL_MAX_ROWS = 8


def uses_bf16_matmul(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does x @ weight^T run bf16_matmul: a bf16 CPU weight, at most DENSE_MATMUL_MAX_ROWS rows of
    x, the kernels built?"""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and x.numel() // max(x.shape[-1], 1) <= DENSE_MATMUL_MAX_ROWS and load() is not None)


def bf16_matmul(x: torch.Tensor, weight: torch.Tensor, generic: bool = False, gated: str | None = None,
                norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [..., N] = f(x) @ weight^T (+ residual) for a bf16 weight [N, K] (dense_matmul.c: the products
    exact in fp32, summed in fp32); f, `gated` and `norm` as quant_matmul's (x [..., 2K] when gated).
    `generic` runs the portable C loops (the tests' reference)."""
    n, k = weight.shape
    rows = x.reshape(-1, 2 * k if gated else k).float().contiguous()
    weight = weight.contiguous()
    y = torch.empty(rows.shape[0], n)
    norm_w, eps = (norm[0].float().contiguous(), norm[1]) if norm is not None else (None, 0.0)
    if residual is not None:
        residual = residual.reshape(y.shape).float().contiguous()
    if load().bf16_matmul(rows.data_ptr(), rows.shape[0], k, weight.data_ptr(), n, gate_code(gated), pointer(norm_w),
                          eps, pointer(residual), y.data_ptr(), int(generic), torch.get_num_threads()):
        raise MemoryError("bf16 matmul: out of memory for the activation buffer")
    return y.view(*x.shape[:-1], n)


def quant_rows(weight: WeightPlan, ids: torch.Tensor) -> torch.Tensor:
    """fp32 [len(ids), K]: rows `ids` of the packed W (`weight`: its plan), dequantized."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), weight.in_features)
    load().quant_rows(ctypes.byref(weight), ids.data_ptr(), ids.numel(), out.data_ptr())
    return out


# ---------------------------------------------------------------------------------- decode stack
# ctypes mirrors of kernels.h's plan structs (same fields, same order; test_kernels checks the sizes).


DENSE_BITS = 16   # kernels.h tm_weight: `bits` of a dense bfloat16 weight


class WeightPlan(ctypes.Structure):
    _fields_ = [("packed", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("out_features", ctypes.c_int64), ("in_features", ctypes.c_int64), ("bits", ctypes.c_int64),
                ("zero", ctypes.c_int64), ("int8_activations", ctypes.c_int64)]


class AttentionPlan(ctypes.Structure):
    _fields_ = [("qkv", WeightPlan), ("o", WeightPlan), ("qkv_bias", ctypes.c_void_p),
                ("norm", ctypes.c_void_p), ("norm_eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("kv_type", ctypes.c_int64),
                ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("block_stride", ctypes.c_int64), ("sliding_window", ctypes.c_int64),
                ("logit_softcap", ctypes.c_float),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p), ("qk_norm_eps", ctypes.c_float),
                ("kv_group", ctypes.c_int64)]


class MLPPlan(ctypes.Structure):
    _fields_ = [("gate_up", WeightPlan), ("down", WeightPlan), ("norm", ctypes.c_void_p),
                ("norm_eps", ctypes.c_float), ("activation", ctypes.c_int64)]


class MoEPlan(ctypes.Structure):
    _fields_ = [("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p), ("router", ctypes.c_void_p),
                ("norm", ctypes.c_void_p), ("norm_eps", ctypes.c_float), ("num_experts", ctypes.c_int64),
                ("top_k", ctypes.c_int64), ("renormalize", ctypes.c_int64), ("activation", ctypes.c_int64),
                ("shared_gate_up", ctypes.c_void_p), ("shared_down", ctypes.c_void_p),
                ("shared_gate", ctypes.c_void_p)]


class LayerPlan(ctypes.Structure):
    _fields_ = [("attn", AttentionPlan), ("mlp", MLPPlan), ("attn_out_norm", ctypes.c_void_p),
                ("mlp_out_norm", ctypes.c_void_p), ("attn_out_norm_eps", ctypes.c_float),
                ("mlp_out_norm_eps", ctypes.c_float), ("rope_local", ctypes.c_int64), ("moe", ctypes.c_void_p)]


def sparse_moe(plan: MoEPlan, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + moe(norm(x)) for x [T, hidden] (moe.c, the plan's experts and norm) -> fp32 [T, hidden]."""
    x = x.float().contiguous()
    residual = None if residual is None else residual.float().contiguous()
    out = torch.empty_like(x)
    if load().sparse_moe(ctypes.byref(plan), x.data_ptr(), x.shape[0], pointer(residual), out.data_ptr(),
                         torch.get_num_threads()):
        raise MemoryError("sparse MoE: out of memory")
    return out


class ShmError(RuntimeError):
    """decode_stack's all-reduce failed: a rank died, did not answer in time or fell out of step
    (layers/decoder.py raises it as parallel.ParallelError)."""


class ShmPlan(ctypes.Structure):
    """kernels.h's tm_shm: a tensor-parallel group's shared mapping (parallel.SharedExchange)."""
    _fields_ = [("region", ctypes.c_void_p), ("slot_bytes", ctypes.c_int64), ("seq", ctypes.c_void_p),
                ("peer_pids", ctypes.c_void_p), ("num_peer_pids", ctypes.c_int64), ("timeout_us", ctypes.c_int64),
                ("stats", ctypes.c_void_p), ("rank", ctypes.c_int32), ("size", ctypes.c_int32)]


class KVGroupTables(ctypes.Structure):
    """kernels.h's tm_kv_group: one KV cache group's slots [B] and block tables [B, max_blocks]."""
    _fields_ = [("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("max_blocks", ctypes.c_int64)]


PLAN_STRUCTS = (WeightPlan, AttentionPlan, MLPPlan, LayerPlan, ShmPlan, MoEPlan,
                KVGroupTables)  # plan_struct_size's numbering


def pointer(t: torch.Tensor | None) -> int | None:
    """A tensor's data address for a plan field (None: NULL). The plan's owner keeps the tensor alive."""
    return None if t is None else t.data_ptr()


class StackPlan:
    """The layers' plans as one C array for decode_stack; holds what they point into (tensors, and
    ctypes objects such as a MoEPlan and its arrays). `max_rows`: the most rows a step may have to run
    it (None: any), DENSE_MATMUL_MAX_ROWS where a weight is dense (bf16_matmul is for a few rows)."""

    def __init__(self, layers: list[LayerPlan], tensors: list[object]):
        self.layers = (LayerPlan * len(layers))(*layers)
        self.tensors = tensors
        weights = [w for p in layers for w in (p.attn.qkv, p.attn.o) + (() if p.moe else (p.mlp.gate_up, p.mlp.down))]
        self.max_rows = DENSE_MATMUL_MAX_ROWS if any(w.bits == DENSE_BITS for w in weights) else None


def decode_stack(plan: StackPlan, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 groups: list[tuple[torch.Tensor, torch.Tensor]], seq_lens: torch.Tensor,
                 rope_local: tuple[torch.Tensor, torch.Tensor] | None = None,
                 shm: ShmPlan | None = None) -> torch.Tensor:
    """A decode step through every layer of `plan`: x [B, hidden] fp32 (a new tensor is returned),
    rope = (cos, sin) [B, head_dim] (full-width rotary tables at each row's position), rope_local the
    same for the layers planned with rope_local (None if there are none), `groups`: (slots [B],
    block tables [B, max_blocks]) int64 of each KV cache group. `shm`: the tensor-parallel group the
    layers' row-parallel outputs are all-reduced in (a status 3 is returned as ShmError)."""
    x = x.float().contiguous().clone()
    tables = [t.reshape(x.shape[0], -1).float().contiguous() for t in (*rope, *(rope_local or ()))]
    cos, sin, cos_local, sin_local = (*tables, None, None)[:4]
    kv = [(slots.contiguous(), block_tables.contiguous()) for slots, block_tables in groups]
    kv_groups = (KVGroupTables * len(kv))(*[KVGroupTables(s.data_ptr(), t.data_ptr(), t.shape[1]) for s, t in kv])
    status = load().decode_stack(plan.layers, len(plan.layers), x.data_ptr(), x.shape[0], cos.data_ptr(),
                                 sin.data_ptr(), pointer(cos_local), pointer(sin_local), kv_groups, len(kv),
                                 seq_lens.data_ptr(), None if shm is None else ctypes.addressof(shm),
                                 torch.get_num_threads())
    if status == 3:
        raise ShmError("decode stack: a tensor-parallel all-reduce failed (a rank died or stopped answering)")
    if status == 2:
        raise ValueError("decode stack: a layer plan has an unknown weight, activation or cache type, needs local "
                         "rotary tables, reads a KV cache group it was not given, or has a mixture of experts under "
                         "tensor parallelism or with a sandwich norm")
    if status:
        raise MemoryError("decode stack: out of memory")
    return x
