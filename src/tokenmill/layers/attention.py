"""Attention over a paged KV cache for one packed, unpadded batch.

The packed batch (B requests, T tokens; here B = 3, T = 7, block_size = 4):

    rows            A0 A1 A2 A3 | B8 | C0 C1        (request A prefills 4 tokens, B decodes its 9th,
    positions        0  1  2  3 |  8 |  0  1         C prefills the first 2 of a longer prompt)
    query_start_loc [0, 4, 5, 7]
    seq_lens        [4, 9, 2]          context length once this step's tokens are written
    block_tables    A: [5]  B: [2, 7, 3]  C: [0]    (padded with 0 to [B, max_blocks])
    slot_mapping    token at `pos` of request b -> block_tables[b][pos // 4] * 4 + pos % 4

Each layer's cache is one tensor [2 (K, V), num_blocks, block_size, kv_heads, row] (shared with the
layers in the same slot of the model's other KV cache groups, which read their own block tables and
slots: AttentionMetadata.group, engine/kv_cache.py), each block's rows contiguous; on the CPU the
blocks of all layers lie side by side (engine/kv_cache.py allocate_kv_caches), so a layer's blocks
are not contiguous with each other and a slot is addressed as (block, offset). A layer
first writes the new K/V of every row to its slot, then each request's queries attend over the
first seq_lens[b] slots of its own blocks (causally: query at position p sees keys 0..p).

A row holds one (token, kv head)'s head_dim values: float32 or bfloat16, or for an int8 cache
(kv_cache_dtype="int8") head_dim int8 values q and then one bfloat16 scale s per group of 32: the
values are q * s, each group quantized symmetrically (quantize_kv; kernels.h TM_KV_I8 the same in
C), llama.cpp's q8_0 in granularity and bytes. One tensor per layer either way, so every block
holds its own scales and moves with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels
from tokenmill.layers.op import KernelOp, set_backend

KV_GROUP = 32   # an int8 cache row's values per bfloat16 scale (kernels.h TM_KV_GROUP)
_CANONICAL_NAN = torch.tensor(float("nan"), dtype=torch.bfloat16)


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements in a cache row of `dtype` (an int8 row carries a 2-byte scale per group)."""
    return head_dim + 2 * -(-head_dim // KV_GROUP) if dtype == torch.int8 else head_dim


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """K or V rows [..., head_dim] -> int8 cache rows [..., kv_row_width]: per group of 32 values (the
    last may be shorter) s = bfloat16(max |x| / 127) and q = round-half-even(x / s) clamped to +-127 (0
    for a zero group; NaN poisons its group's scale, its values 0); the values, then the groups' scales."""
    x = x.float()
    head_dim = x.shape[-1]
    groups = -(-head_dim // KV_GROUP)
    padded = F.pad(x, (0, groups * KV_GROUP - head_dim)).unflatten(-1, (groups, KV_GROUP))
    scale = (padded.abs().amax(dim=-1) / 127.0).to(torch.bfloat16)                 # [..., groups]
    scale = torch.where(scale.isnan(), _CANONICAL_NAN, scale)   # one NaN's bits, as C's float_to_bf16
    step = _per_value(scale, head_dim)
    q = torch.where(step > 0, x / step, 0.0).round().clamp(-127, 127).nan_to_num(0.0).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor) -> torch.Tensor:
    """int8 cache rows [..., kv_row_width] -> float32 [..., head_dim]: q * s."""
    groups = -(-rows.shape[-1] // (KV_GROUP + 2))   # the width is head_dim + 2 groups, head_dim <= 32 groups
    head_dim = rows.shape[-1] - 2 * groups
    scale = rows[..., head_dim:].contiguous().view(torch.bfloat16)
    return rows[..., :head_dim].float() * _per_value(scale, head_dim)


def _per_value(scale: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Group scales [..., groups] as float32 per value [..., head_dim]."""
    return scale.float().repeat_interleave(KV_GROUP, dim=-1)[..., :head_dim]


def to_cache_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V [..., head_dim] as rows of a `dtype` cache."""
    return quantize_kv(x) if dtype == torch.int8 else x.to(dtype)


def from_cache_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows read back as values [..., head_dim] of `dtype` (an int8 cache's dequantized)."""
    return (dequantize_kv(rows) if rows.dtype == torch.int8 else rows).to(dtype)


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]        # [B + 1], row offsets of each request in the packed batch
    seq_lens: list[int]               # [B]
    block_tables: torch.Tensor        # [B, max_blocks] int64
    slot_mapping: torch.Tensor        # [T] int64
    seq_lens_tensor: torch.Tensor     # [B] int64, same values as seq_lens
    block_size: int
    # The same rows over the block tables of the model's other KV cache groups (engine/kv_cache.py:
    # a model that mixes full and sliding-window layers), whose layers read `group(i)`.
    other_groups: tuple[AttentionMetadata, ...] = ()

    def group(self, index: int) -> AttentionMetadata:
        """The metadata of KV cache group `index` (this one is group 0's)."""
        return self if index == 0 else self.other_groups[index - 1]

    @property
    def group_tables(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slot_mapping, block_tables) of every KV cache group, in group order."""
        return [(m.slot_mapping, m.block_tables) for m in (self, *self.other_groups)]

    @property
    def is_decode_only(self) -> bool:
        return len(self.query_start_loc) - 1 == int(self.slot_mapping.numel())

    @cached_property
    def split(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(requests with a single query row, their rows, the other requests), computed once per
        step: in a mixed step the single-query rows still take the batched decode path."""
        starts = self.query_start_loc
        single = [b for b in range(len(self.seq_lens)) if starts[b + 1] - starts[b] == 1]
        multi = [b for b in range(len(self.seq_lens)) if starts[b + 1] - starts[b] > 1]
        device = self.block_tables.device
        return (torch.tensor(single, dtype=torch.int64, device=device),
                torch.tensor([starts[b] for b in single], dtype=torch.int64, device=device), multi)


class Attention(KernelOp):
    """Writes K/V into this layer's cache slots, then attends.

    Options: `sliding_window` w (a query at position p sees keys p - w < k <= p; blocks wholly
    before the window are not read) and `logit_softcap` c (scores -> c tanh(scores / c), Gemma 2).

    Backends: "torch" is the plain PyTorch reference (the oracle every faster path is tested
    against); "auto" runs the C kernels (tokenmill/kernels) on a CPU cache where they build
    (`uses_kernels`; they implement both options): single-query rows read each request's blocks in
    place instead of gathering and padding them, prefill chunks take the C prefill kernel (AVX-512 and
    AVX2 builds). Everything else runs SDPA or, with a softcap, plain matmuls."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.kv_cache: torch.Tensor | None = None  # bound once by the runner, see bind_kv_caches
        self.kv_group = 0   # its KV cache group: the block tables it reads (AttentionMetadata.group)

    def uses_kernels(self) -> bool:
        """The one place the kernel choice is made: backend auto and a cache the C kernels read (they
        implement every option of this layer; one they lacked would be refused here)."""
        return self.backend == "auto" and self.kv_cache is not None and kernels.supports_paged_decode(self.kv_cache)

    @property
    def kernel_options(self) -> dict[str, int | float | None]:
        """The layer's options as the C kernels' keyword arguments."""
        return {"sliding_window": self.sliding_window, "logit_softcap": self.logit_softcap}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        assert self.kv_cache is not None, "KV cache not bound: call bind_kv_caches() first"
        meta = meta.group(self.kv_group)
        k_cache, v_cache = self.kv_cache[0], self.kv_cache[1]
        # (slot = block * block_size + offset, indexed as such: the blocks need not be contiguous)
        at = meta.slot_mapping // k_cache.shape[1], meta.slot_mapping % k_cache.shape[1]
        for cache, new in ((k_cache, k), (v_cache, v)):
            cache[at] = to_cache_rows(new, cache.dtype)
        if meta.is_decode_only:
            out = self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor)
        else:
            out = torch.empty_like(q)
            single, rows, multi = meta.split
            if single.numel():
                decoded = self._decode(q[rows], k_cache, v_cache, meta.block_tables[single],
                                       meta.seq_lens_tensor[single])
                out[rows] = decoded.reshape(-1, self.num_heads, self.head_dim)
            self._varlen(q, k_cache, v_cache, meta, multi, out)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def fuses_rotary_decode(self, meta: AttentionMetadata) -> bool:
        """Can this step run as one `decode_rotary` call (decode-only step, C kernel backend)?"""
        return meta.is_decode_only and self.head_dim <= kernels.MAX_ROTARY_HEAD_DIM and self.uses_kernels()

    def decode_rotary(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                      qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
        """A decode-only step from the unrotated fused q/k/v projection [T, (heads + 2 kv_heads) *
        head_dim]: per-head q/k RMSNorms (`qk_norm` = (q weight, k weight, eps)), rotary, cache write
        and attention in one C call (see fuses_rotary_decode); the same result as norming and
        rotating, then forward()."""
        cos, sin = (t.reshape(qkv.shape[0], self.head_dim) for t in rope)
        meta = meta.group(self.kv_group)
        out = kernels.paged_decode_rotary(qkv, cos, sin, meta.slot_mapping, self.kv_cache[0], self.kv_cache[1],
                                          meta.block_tables, meta.seq_lens_tensor, self.num_heads, self.scale,
                                          qk_norm=qk_norm, **self.kernel_options)
        return out.to(qkv.dtype)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                seq_lens: torch.Tensor) -> torch.Tensor:
        """One query per request -> [B, heads, head_dim]."""
        if self.uses_kernels():
            out = kernels.paged_decode(q.view(q.shape[0], self.num_heads, self.head_dim), k_cache, v_cache,
                                       block_tables, seq_lens, self.scale, **self.kernel_options)
            return out.to(q.dtype)
        return self._decode_torch(q, k_cache, v_cache, block_tables, seq_lens)

    def _decode_torch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor) -> torch.Tensor:
        """The reference: grouped-query matmuls over each request's gathered (padded) blocks; with a
        window, only the blocks that hold its keys."""
        batch = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        block_size = k_cache.shape[1]
        first = torch.zeros_like(seq_lens)  # each request's first gathered block
        if self.sliding_window is not None:
            first = (seq_lens - self.sliding_window).clamp(min=0) // block_size
            span = min(block_tables.shape[1], self.sliding_window // block_size + 2)
            index = (first[:, None] + torch.arange(span, device=q.device)).clamp(max=block_tables.shape[1] - 1)
            block_tables = block_tables.gather(1, index)
        keys = from_cache_rows(k_cache[block_tables].flatten(1, 2), torch.float32)    # [B, L, kv_heads, head_dim]
        values = from_cache_rows(v_cache[block_tables].flatten(1, 2), torch.float32)
        qg = q.float().view(batch, self.num_kv_heads, group, self.head_dim)
        scores = self._softcap(torch.matmul(qg, keys.permute(0, 2, 3, 1)) * self.scale)  # [B, kv_heads, group, L]
        position = first[:, None] * block_size + torch.arange(keys.shape[1], device=q.device)[None, :]
        hidden = position >= seq_lens[:, None]
        if self.sliding_window is not None:
            hidden |= position <= (seq_lens - 1 - self.sliding_window)[:, None]
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))              # [B, kv_heads, group, hd]
        return out.to(q.dtype).view(batch, self.num_heads, self.head_dim)

    def _varlen(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, requests: list[int], out: torch.Tensor) -> None:
        """Requests with several query rows (prefill chunks), each into `out`: the C prefill kernel
        (backend auto, CPU cache, AVX-512 or AVX2 build), else one causal SDPA call each."""
        starts = meta.query_start_loc
        kernel = self.uses_kernels()
        for b in requests:
            seq_len = meta.seq_lens[b]
            q_start, q_end = starts[b], starts[b + 1]
            num_q = q_end - q_start
            num_blocks = -(-seq_len // meta.block_size)
            if kernel:   # the C kernel (AVX-512 and AVX2 builds); None: it does not apply here, SDPA below
                o = kernels.paged_prefill(q[q_start:q_end], k_cache, v_cache, meta.block_tables[b, :num_blocks],
                                          seq_len, self.scale, **self.kernel_options)
                if o is not None:
                    out[q_start:q_end] = o.to(out.dtype)
                    continue
            # keys from the first block the window of the first query reaches
            first = 0 if self.sliding_window is None else max(0, seq_len - num_q - self.sliding_window + 1)
            first_block = first // meta.block_size
            blocks = meta.block_tables[b, first_block:num_blocks]
            offset = first_block * meta.block_size
            # [kv_heads, L, hd], in q's dtype (float32 where the softcap needs it)
            kv_dtype = q.dtype if self.logit_softcap is None else torch.float32
            keys = from_cache_rows(k_cache[blocks].flatten(0, 1)[:seq_len - offset], kv_dtype).transpose(0, 1)
            values = from_cache_rows(v_cache[blocks].flatten(0, 1)[:seq_len - offset], kv_dtype).transpose(0, 1)
            query = q[q_start:q_end].transpose(0, 1)                                     # [heads, n, hd]
            rows = torch.arange(seq_len - num_q, seq_len, device=q.device)[:, None]   # query positions
            cols = torch.arange(offset, seq_len, device=q.device)[None, :]            # key positions
            mask = cols <= rows
            if self.sliding_window is not None:
                mask &= cols > rows - self.sliding_window
            if self.logit_softcap is None:
                o = F.scaled_dot_product_attention(query.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                                   attn_mask=mask, scale=self.scale, enable_gqa=True)[0]
            else:  # SDPA has no softcap: the same steps in plain matmuls, float32
                group = self.num_heads // self.num_kv_heads
                k = keys.repeat_interleave(group, 0)
                scores = self._softcap(torch.matmul(query.float(), k.transpose(1, 2)) * self.scale)
                probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
                o = torch.matmul(probs, values.repeat_interleave(group, 0)).to(q.dtype)
            out[q_start:q_end] = o.transpose(0, 1)

    def _softcap(self, scores: torch.Tensor) -> torch.Tensor:
        if self.logit_softcap is None:
            return scores
        return torch.tanh(scores / self.logit_softcap) * self.logit_softcap


def bind_kv_caches(model: nn.Module, kv_caches: list[torch.Tensor], backend: str = "auto",
                   groups: Sequence[int] | None = None) -> None:
    """Give each Attention layer (in module order) its cache tensor, its KV cache group (`groups`,
    default 0 for all) and the attention backend ("auto" or "torch")."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if len(layers) != len(kv_caches):
        raise ValueError(f"{len(layers)} attention layers but {len(kv_caches)} KV cache tensors")
    for layer, cache, group in zip(layers, kv_caches, groups or [0] * len(layers), strict=True):
        layer.kv_cache = cache
        layer.kv_group = group
    set_backend(model, backend, Attention)
