"""Mixture-of-experts families on the shared decoder: Mixtral (GGUF architecture "llama" with
expert counts), Qwen2-MoE (q/k/v biases, a shared expert) and Qwen3-MoE (q/k norms). Each MoE
layer's MLP is layers/moe.py's SparseMoE; llama.cpp stacks each layer's experts into 3-D tensors
(ffn_*_exps), read per expert without dequantizing."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from torch import nn

from tokenmill.checkpoint import GGUFCheckpoint, HFCheckpoint
from tokenmill.config import ConfigFields, ModelConfig
from tokenmill.errors import UnsupportedModelError
from tokenmill.layers.decoder import DecoderLayer, DecoderModel
from tokenmill.layers.moe import SparseMoE, expert_tensors
from tokenmill.models.causal_lm import Tensor
from tokenmill.models.gguf_names import gguf_name_table
from tokenmill.models.llama import LlamaForCausalLM

_GGUF_PATTERNS = LlamaForCausalLM.GGUF_NAMES + gguf_name_table({
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.gate_proj",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.up_proj",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj",
    "blk.{i}.ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "blk.{i}.ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "blk.{i}.ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
})


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama family's attention with SparseMoE MLPs (dense ones on `dense_layers`)."""

    GGUF_NAMES = _GGUF_PATTERNS

    @classmethod
    def build(cls, cfg: ModelConfig) -> DecoderModel:
        def mlp(i: int) -> nn.Module | None:
            if i in cfg.dense_layers:
                return None  # the layer's default GatedMLP
            return SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                             cfg.moe_routing, cfg.norm_topk_prob, cfg.shared_expert_intermediate_size)
        return DecoderModel(cfg, [DecoderLayer(cfg, i, mlp(i)) for i in range(cfg.num_layers)])

    @staticmethod
    def config_from_hf(cfg: ConfigFields) -> ModelConfig:
        arch = (cfg.get("architectures") or [""])[0]
        family = {"MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                  "Qwen3MoeForCausalLM": "qwen3_moe"}[arch]
        base = LlamaForCausalLM.config_from_hf(ConfigFields(
            {**cfg.values, "architectures": ["MistralForCausalLM" if family == "mixtral" else
                                             "Qwen2ForCausalLM" if family == "qwen2_moe" else "Qwen3ForCausalLM"]},
            cfg.source))
        if family == "mixtral":
            experts = dict(num_experts=cfg.int("num_local_experts"), moe_intermediate_size=cfg.int("intermediate_size"),
                           moe_routing="mixtral")
        else:
            # hub configs say num_experts; transformers 5 saves num_local_experts
            count = cfg.int("num_experts", None) or cfg.int("num_local_experts")
            experts = dict(num_experts=count, moe_intermediate_size=cfg.int("moe_intermediate_size"),
                           moe_routing="qwen_moe", norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
            if family == "qwen2_moe" and cfg.int("shared_expert_intermediate_size", 0):
                experts["shared_expert_intermediate_size"] = cfg.int("shared_expert_intermediate_size")
        step, only_dense = cfg.int("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(base.num_layers) if i in only_dense or (i + 1) % step)
        return _with_experts(base, family, cfg.int("num_experts_per_tok"), dense, **experts)

    @staticmethod
    def config_from_gguf(ckpt: GGUFCheckpoint, cfg: ConfigFields) -> ModelConfig:
        base = LlamaForCausalLM.config_from_gguf(ckpt, cfg)
        count = cfg.int("expert_count")
        if ckpt.architecture == "llama":  # Mixtral: llama.cpp converts it as a llama with experts
            return _with_experts(base, "mixtral", cfg.int("expert_used_count"), (), num_experts=count,
                                 moe_intermediate_size=base.intermediate_size, moe_routing="mixtral")
        shared = cfg.int("expert_shared_feed_forward_length", 0) if ckpt.architecture == "qwen2moe" else 0
        # llama.cpp renormalizes the top k of qwen3moe and not of qwen2moe (their configs' norm_topk_prob)
        return _with_experts(base, ckpt.architecture, cfg.int("expert_used_count"), (), num_experts=count,
                             moe_intermediate_size=cfg.int("expert_feed_forward_length"), moe_routing="qwen_moe",
                             norm_topk_prob=ckpt.architecture == "qwen3moe",
                             shared_expert_intermediate_size=shared or None)

    def convert(self, name: str, tensor: Tensor, ckpt: GGUFCheckpoint | HFCheckpoint) -> Iterator[tuple[str, Tensor]]:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's hub name of the block
        for converted_name, converted in super().convert(name, tensor, ckpt):
            yield from expert_tensors(converted_name, converted)


def _with_experts(base: ModelConfig, family: str, top_k: int, dense: tuple[int, ...], **experts: object) -> ModelConfig:
    if not 1 <= top_k <= int(experts["num_experts"]):
        raise UnsupportedModelError(f"experts per token {top_k} is not in [1, {experts['num_experts']}]")
    return dataclasses.replace(base, architecture=family, num_experts_per_tok=top_k, dense_layers=dense, **experts)
