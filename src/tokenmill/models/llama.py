"""The Llama family: Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norms).

The default decoder of layers/decoder.py: RMSNorm -> rotary attention (fused q/k/v, GQA) ->
residual -> RMSNorm -> SwiGLU MLP (fused gate/up) -> residual; final RMSNorm and an LM head that
may be tied to the embeddings.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tokenmill.checkpoint import GGUFBlocks, GGUFCheckpoint, HFCheckpoint
from tokenmill.config import ConfigFields, ModelConfig, rope_scaling_from_gguf, rope_scaling_from_hf
from tokenmill.errors import UnsupportedModelError
from tokenmill.models.causal_lm import DecoderForCausalLM, Tensor, gguf_tensor_names, require_silu, sliding_window
from tokenmill.models.gguf_names import gguf_name_table

_HF_FAMILY = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
              "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}

# GGUF tensor name -> HF tensor name ("{i}" is the layer index).
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_GGUF_PATTERNS = gguf_name_table(_GGUF_NAMES)


def unpermute_rope_rows(w: torch.Tensor | GGUFBlocks, n_heads: int) -> torch.Tensor | GGUFBlocks:
    """Undo llama.cpp's converter, which reorders each head's Q/K rows from HF's rotate-half layout
    (first half / second half) to GGML's interleaved pairs: row (h, j, p) <- HF row (h, p, j).
    Quantized blocks are whole rows, so they are reordered without dequantizing."""
    rows = w.shape[0]
    order = torch.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).transpose(1, 2).reshape(-1)
    return w.take_rows(order) if isinstance(w, GGUFBlocks) else w[order]


class LlamaForCausalLM(DecoderForCausalLM):
    GGUF_NAMES = _GGUF_PATTERNS

    @staticmethod
    def config_from_hf(cfg: ConfigFields) -> ModelConfig:
        family = _HF_FAMILY[(cfg.get("architectures") or ["LlamaForCausalLM"])[0]]
        require_silu(cfg)
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError(f"{cfg.source}: mlp_bias=true is not supported")
        theta, scaling = rope_scaling_from_hf(cfg)
        hidden, heads = cfg.int("hidden_size"), cfg.int("num_attention_heads")
        # Mistral slides every layer; Qwen2/3 with use_sliding_window the layers its layer_types say,
        # else (older configs) those from max_window_layers on, as transformers reads them
        window = sliding_window(cfg, "sliding_window") if family == "mistral" or cfg.get("use_sliding_window") else None
        types = None
        if window and family != "mistral":
            first = cfg.int("max_window_layers", 28)
            types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                               for i in range(cfg.int("num_hidden_layers"))]
        return ModelConfig(
            architecture=family,
            vocab_size=cfg.int("vocab_size"),
            hidden_size=hidden,
            num_layers=cfg.int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.int("num_key_value_heads", heads),
            head_dim=cfg.int("head_dim", hidden // heads),
            intermediate_size=cfg.int("intermediate_size"),
            max_position_embeddings=cfg.int("max_position_embeddings", 4096),
            norm_eps=cfg.float("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=window,
            layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types) if types else None,
        )

    @staticmethod
    def config_from_gguf(ckpt: GGUFCheckpoint, cfg: ConfigFields) -> ModelConfig:
        theta, scaling = rope_scaling_from_gguf(cfg)
        names = gguf_tensor_names(ckpt)
        heads, hidden = cfg.int("attention.head_count"), cfg.int("embedding_length")
        return ModelConfig(
            architecture=ckpt.architecture,
            vocab_size=ckpt.tensor_shape("token_embd.weight")[0],
            hidden_size=hidden,
            num_layers=cfg.int("block_count"),
            num_heads=heads,
            num_kv_heads=cfg.int("attention.head_count_kv", heads),
            head_dim=cfg.int("attention.key_length", hidden // heads),
            intermediate_size=cfg.int("feed_forward_length"),
            max_position_embeddings=cfg.int("context_length", 4096),
            norm_eps=cfg.float("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
        )

    SETUP_TENSORS = ("rope_freqs.weight",)

    def take_setup_tensor(self, name: str, tensor: torch.Tensor) -> None:
        self.model.rotary.set_frequency_factors(tensor)   # llama3 rope scaling as per-frequency divisors

    def convert(self, name: str, tensor: Tensor, ckpt: GGUFCheckpoint | HFCheckpoint) -> Iterator[tuple[str, Tensor]]:
        if not isinstance(ckpt, GGUFCheckpoint):
            yield name, tensor
        elif ckpt.architecture == "llama" and (".q_proj." in name or ".k_proj." in name):
            # llama.cpp permutes Q/K of the "llama" architecture only (qwen2/qwen3 use NeoX rope).
            yield name, unpermute_rope_rows(tensor, self.config.num_heads if ".q_proj." in name
                                            else self.config.num_kv_heads)
        else:
            yield name, tensor
