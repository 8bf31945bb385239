"""Rotary self-attention: fused q/k/v projection (optional bias), optional q/k RMSNorms, rotary
embedding, paged attention (optional sliding window and logit softcap), output projection."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import kernels, parallel
from tokenmill.layers.attention import Attention, AttentionMetadata
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]


class RotaryAttention(nn.Module):
    """`qkv_proj` holds q, k and v as three shards (checkpoint names q_proj, k_proj, v_proj). Under
    tensor parallelism the module holds its rank's heads (parallel.head_slice): q/k/v column-parallel,
    o_proj row-parallel."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool = False,
                 qk_norm_eps: float | None = None, norm_float32_weight: bool = False, scale: float | None = None,
                 sliding_window: int | None = None,
                 logit_softcap: float | None = None):
        super().__init__()
        heads = parallel.head_slice(num_heads, num_kv_heads, parallel.current())
        q_rows, kv_rows = parallel.scaled(heads.q, head_dim), parallel.scaled(heads.kv, head_dim)
        self.qkv_proj = Linear(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                               bias=bias, rows=[[q_rows], [kv_rows], [kv_rows]])
        self.o_proj = Linear(num_heads * head_dim, hidden_size, cols=q_rows)
        num_heads, num_kv_heads = len(heads.q), len(heads.kv)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps, norm_float32_weight)
        self.k_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps, norm_float32_weight)
        self.attn = Attention(num_heads, num_kv_heads, head_dim, head_dim**-0.5 if scale is None else scale,
                              sliding_window, logit_softcap)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + attention(norm(x)); the norm and the residual add run inside the projections."""
        qkv = self.qkv_proj(x, norm=norm)
        # q/k norms, rotary, cache write and attention in one C call
        if self.attn.fuses_rotary_decode(meta) and self._qk_norms_fuse():
            return self.o_proj(self.attn.decode_rotary(qkv, rope, meta, self._qk_norm()), residual=residual)
        qkv = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        qk = apply_rotary(qk, *rope)  # q and k heads rotated in one call
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v, meta), residual=residual)

    def _qk_norms_fuse(self) -> bool:
        """The q/k norms (if any) may run inside the C kernels: not pinned to their reference."""
        return self.q_norm is None or (self.q_norm.backend == "auto" and self.k_norm.backend == "auto")

    def _qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """The q/k norms as the C kernel takes them: (q weight, k weight, eps), float32."""
        if self.q_norm is None:
            return None
        return self.q_norm.weight.float().contiguous(), self.k_norm.weight.float().contiguous(), self.q_norm.eps

    def plan(self, norm: RMSNorm) -> tuple[kernels.AttentionPlan, list[torch.Tensor]] | None:
        """This block as kernels.h's tm_attention_plan with `norm` as its input norm (and the tensors
        it points into), or None where the C stack does not implement it: a projection with no plan
        weight (Linear.plan_weight), a bias on o_proj, options the attention kernels lack."""
        qkv, o, cache = self.qkv_proj.plan_weight(), self.o_proj.plan_weight(), self.attn.kv_cache
        if (qkv is None or o is None or self.o_proj.bias is not None or not self.attn.uses_kernels()
                or self.head_dim > kernels.MAX_ROTARY_HEAD_DIM or not self._qk_norms_fuse()):
            return None
        norm_weight = norm.weight.float().contiguous()
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias.float().contiguous()   # (a bf16 model's)
        qk_norm = self._qk_norm()
        tensors = [norm_weight] + ([] if bias is None else [bias]) + ([] if qk_norm is None else list(qk_norm[:2]))
        block_size, _, block_stride = kernels.cache_geometry(cache[0], cache[1])
        return kernels.AttentionPlan(
            qkv=qkv, o=o, qkv_bias=kernels.pointer(bias),
            norm=norm_weight.data_ptr(), norm_eps=norm.eps, scale=self.attn.scale, k_cache=cache[0].data_ptr(),
            v_cache=cache[1].data_ptr(), kv_type=kernels.KV_TYPES[cache.dtype], heads=self.num_heads,
            kv_heads=self.num_kv_heads, head_dim=self.head_dim, block_size=block_size, block_stride=block_stride,
            sliding_window=self.attn.sliding_window or 0, logit_softcap=self.attn.logit_softcap or 0.0,
            q_norm=kernels.pointer(None if qk_norm is None else qk_norm[0]),
            k_norm=kernels.pointer(None if qk_norm is None else qk_norm[1]),
            qk_norm_eps=0.0 if qk_norm is None else qk_norm[2], kv_group=self.attn.kv_group), tensors
