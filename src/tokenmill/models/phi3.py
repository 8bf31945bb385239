"""Phi-3 / Phi-3.5-mini: the Llama decoder with fused q/k/v and gate/up checkpoint tensors, longrope
scaling and (Phi-3-mini-4k) a sliding window. llama.cpp keeps both fusions in its GGUF files
(attn_qkv, and ffn_up holding [gate | up]) and stores longrope's factors as tensors."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tokenmill.checkpoint import GGUFCheckpoint, HFCheckpoint, split_rows
from tokenmill.config import ConfigFields, ModelConfig, rope_scaling_from_gguf, rope_scaling_from_hf
from tokenmill.layers.rotary import LONGROPE_TENSORS
from tokenmill.models.causal_lm import DecoderForCausalLM, Tensor, gguf_tensor_names, require_silu, sliding_window
from tokenmill.models.gguf_names import gguf_name_table

_GGUF_PATTERNS = gguf_name_table({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
})


class Phi3ForCausalLM(DecoderForCausalLM):
    GGUF_NAMES = _GGUF_PATTERNS

    @staticmethod
    def config_from_hf(cfg: ConfigFields) -> ModelConfig:
        require_silu(cfg)
        theta, scaling = rope_scaling_from_hf(cfg)
        hidden, heads = cfg.int("hidden_size"), cfg.int("num_attention_heads")
        return ModelConfig(
            architecture="phi3", vocab_size=cfg.int("vocab_size"), hidden_size=hidden,
            num_layers=cfg.int("num_hidden_layers"), num_heads=heads,
            num_kv_heads=cfg.int("num_key_value_heads", heads), head_dim=hidden // heads,
            intermediate_size=cfg.int("intermediate_size"),
            max_position_embeddings=cfg.int("max_position_embeddings", 4096), norm_eps=cfg.float("rms_norm_eps", 1e-5),
            rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=sliding_window(cfg, "sliding_window"),
        )

    @staticmethod
    def config_from_gguf(ckpt: GGUFCheckpoint, cfg: ConfigFields) -> ModelConfig:
        names = gguf_tensor_names(ckpt)
        if "rope_factors_long.weight" in names and cfg.get("rope.scaling.type") is None:
            # llama.cpp writes longrope as its factor tensors alone, without a scaling type
            cfg = ConfigFields({**cfg.values, cfg.prefix + "rope.scaling.type": "longrope"}, cfg.source, cfg.prefix)
        theta, scaling = rope_scaling_from_gguf(cfg)
        hidden, heads = cfg.int("embedding_length"), cfg.int("attention.head_count")
        return ModelConfig(
            architecture="phi3", vocab_size=ckpt.tensor_shape("token_embd.weight")[0], hidden_size=hidden,
            num_layers=cfg.int("block_count"), num_heads=heads, num_kv_heads=cfg.int("attention.head_count_kv", heads),
            head_dim=hidden // heads, intermediate_size=cfg.int("feed_forward_length"),
            max_position_embeddings=cfg.int("context_length", 4096),
            norm_eps=cfg.float("attention.layer_norm_rms_epsilon", 1e-5), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in names,
            sliding_window=sliding_window(cfg, "attention.sliding_window"),
        )

    SETUP_TENSORS = tuple(LONGROPE_TENSORS)

    def take_setup_tensor(self, name: str, tensor: torch.Tensor) -> None:
        self.model.rotary.set_longrope_factors(name, tensor)

    def convert(self, name: str, tensor: Tensor, ckpt: GGUFCheckpoint | HFCheckpoint) -> Iterator[tuple[str, Tensor]]:
        cfg = self.config
        prefix = name.rpartition(".")[0].rpartition(".")[0]
        if name.endswith("self_attn.qkv_proj.weight"):
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            parts = split_rows(tensor, [q, kv, kv])
            yield from zip([f"{prefix}.{p}_proj.weight" for p in "qkv"], parts, strict=True)
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = split_rows(tensor, [cfg.intermediate_size, cfg.intermediate_size])
            yield from ((f"{prefix}.gate_proj.weight", gate), (f"{prefix}.up_proj.weight", up))
        else:
            yield name, tensor
