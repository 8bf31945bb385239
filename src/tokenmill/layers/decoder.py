"""The decoder layer and stack every rotary model is composed of.

A layer: x + attention(norm(x)), then x + mlp(norm(x)) (with `sandwich_norms`, Gemma's extra
norms on both outputs: x + norm(attention(norm(x)))). A stack: embeddings (optionally scaled),
the layers, a final norm. A decode step on CPU with quantized (or dense bfloat16) weights runs the
whole stack in one C call (`kernels.decode_stack`) when every layer built a plan (`DecoderLayer.plan`): a block with
an option the C code lacks returns None, and the stack then runs the layer loop, so such an option
never passes through the C code unnoticed.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from tokenmill import kernels, parallel
from tokenmill.config import ModelConfig
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.linear import Embedding
from tokenmill.layers.mlp import GatedMLP
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.op import backend_generation
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.layers.self_attention import Rope, RotaryAttention


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, mlp: nn.Module | None = None):
        super().__init__()
        slides = cfg.layer_slides(index)
        self.rope = "local" if slides and cfg.rope_local_theta is not None else "global"
        f32 = cfg.norm_float32_weight
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, f32)
        self.self_attn = RotaryAttention(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bias=cfg.attention_bias,
            qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None, norm_float32_weight=f32, scale=cfg.attn_scale,
            sliding_window=cfg.sliding_window if slides else None, logit_softcap=cfg.attn_logit_softcap)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, f32)
        self.mlp = mlp if mlp is not None else GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.attn_out_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, f32) if cfg.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, f32) if cfg.sandwich_norms else None

    def forward(self, x: torch.Tensor, ropes: dict[str, Rope], meta: AttentionMetadata) -> torch.Tensor:
        rope = ropes[self.rope]
        if self.attn_out_norm is None:
            x = self.self_attn(x, rope, meta, norm=self.attn_norm, residual=x)
            return self.mlp(x, norm=self.mlp_norm, residual=x)
        x = x + self.attn_out_norm(self.self_attn(x, rope, meta, norm=self.attn_norm))
        return x + self.mlp_out_norm(self.mlp(x, norm=self.mlp_norm))

    def plan(self) -> tuple[kernels.LayerPlan, list[object]] | None:
        """kernels.h's tm_layer_plan for this layer (its blocks' plans, the sandwich norms, which
        rotary table), or None if one of its blocks has none."""
        norms = (self.attn_norm, self.mlp_norm, self.attn_out_norm, self.mlp_out_norm)
        if any(n is not None and n.backend != "auto" for n in norms):  # a norm pinned to its reference
            return None
        attn, mlp = self.self_attn.plan(self.attn_norm), self.mlp.plan(self.mlp_norm)
        if attn is None or mlp is None:
            return None
        if isinstance(mlp[0], kernels.MoEPlan) and self.mlp_out_norm is not None:
            return None   # (no family has both; decode_stack does not implement it)
        out_norms = [None if n is None else n.weight.float().contiguous()
                     for n in (self.attn_out_norm, self.mlp_out_norm)]
        # the MLP block: a tm_mlp_plan held in the layer's struct, or a tm_moe_plan it points to
        block = {"moe": ctypes.addressof(mlp[0])} if isinstance(mlp[0], kernels.MoEPlan) else {"mlp": mlp[0]}
        plan = kernels.LayerPlan(attn=attn[0], **block, rope_local=int(self.rope == "local"),
                                 attn_out_norm=kernels.pointer(out_norms[0]),
                                 mlp_out_norm=kernels.pointer(out_norms[1]),
                                 attn_out_norm_eps=0.0 if self.attn_out_norm is None else self.attn_out_norm.eps,
                                 mlp_out_norm_eps=0.0 if self.mlp_out_norm is None else self.mlp_out_norm.eps)
        return plan, [*attn[1], mlp[0], *mlp[1], *[n for n in out_norms if n is not None]]


class DecoderModel(nn.Module):
    """`embed_tokens`, `layers`, `norm`: the Hugging Face names of a decoder-only model's stack."""

    def __init__(self, cfg: ModelConfig, layers: list[DecoderLayer] | None = None):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, vocab_parallel=True)
        self.layers = nn.ModuleList(layers if layers is not None else
                                    [DecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, cfg.norm_float32_weight)
        self.embed_scale = cfg.embed_scale
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = None if cfg.rope_local_theta is None else RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta, None)
        self.use_decode_stack = True  # False: always the layer loop (the reference the tests compare with)
        self._plan: kernels.StackPlan | bool | None = None  # None: not built yet; False: does not apply
        self._plan_cache: torch.Tensor | None = None  # the KV cache and the ops' backends it was built for
        self._plan_generation = -1

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # in the model's dtype, as the reference rounds it
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        ropes = {"global": self.rotary(positions)}
        if self.rotary_local is not None:
            ropes["local"] = self.rotary_local(positions)
        plan = self.stack_plan(x, meta)
        if plan is not None:  # the whole stack in one C call: the same kernel calls as the loop below, same bits
            shm = self.embed_tokens.tp.shm   # (tensor parallelism: the row-parallel all-reduces run in C too)
            try:
                x = kernels.decode_stack(plan, x, ropes["global"], meta.group_tables, meta.seq_lens_tensor,
                                         ropes.get("local"),
                                         None if shm is None else shm.plan).to(x.dtype)
            except kernels.ShmError as e:
                raise parallel.ParallelError(str(e)) from e
        else:
            for layer in self.layers:
                x = layer(x, ropes, meta)
        return self.norm(x)

    def stack_plan(self, x: torch.Tensor, meta: AttentionMetadata) -> kernels.StackPlan | None:
        """The plan for kernels.decode_stack, where it applies: a decode-only step on the C attention
        kernels whose every layer built a plan, with at most the plan's max_rows rows. The stack saves
        the loop's per-op dispatch. It computes in float32: a bfloat16 model's decode step (dense bf16
        weights) runs it with float32 activations, more exact than its layer loop, and rounds the
        result to bfloat16 once at the end."""
        first = self.layers[0].self_attn.attn
        if not (self.use_decode_stack and x.dtype in (torch.float32, torch.bfloat16)
                and first.fuses_rotary_decode(meta)):
            return None
        if self._plan_cache is not first.kv_cache or self._plan_generation != backend_generation():
            self._plan, self._plan_cache = self._build_plan(), first.kv_cache
            self._plan_generation = backend_generation()
        if not self._plan or (self._plan.max_rows is not None and x.shape[0] > self._plan.max_rows):
            return None
        return self._plan

    def _build_plan(self) -> kernels.StackPlan | bool:
        plans = [layer.plan() for layer in self.layers]
        if any(p is None for p in plans):
            return False
        return kernels.StackPlan([p[0] for p in plans], [t for p in plans for t in p[1]])
