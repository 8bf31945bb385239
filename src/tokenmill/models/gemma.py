"""Gemma 2 and Gemma 3 (text): the shared decoder with Gemma's options.

- embeddings scaled by sqrt(hidden_size); tied LM head; RMSNorm weights stored as w - 1 in HF
  checkpoints (Gemma's norm multiplies by 1 + w): +1 at load, as llama.cpp's converter does
- GeGLU MLP (gelu_tanh); norms on the attention and MLP outputs too ("sandwich")
- attention scale query_pre_attn_scalar ** -0.5; Gemma 2: attention and final logit softcaps
- sliding-window and global layers interleaved (Gemma 2: every other layer slides; Gemma 3: five
  of every six); Gemma 3: q/k norms, and the sliding layers' own rope base (10000)
llama.cpp writes neither query_pre_attn_scalar nor the local rope base: a GGUF file gets base
10000 and, as llama.cpp computes it, head_dim ** -0.5, but (hidden_size / heads) ** -0.5 for the 27B
models (Gemma 2: 46 layers, Gemma 3: 62; their query_pre_attn_scalar, 144 and 168, is not head_dim).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from tokenmill.checkpoint import GGUFCheckpoint, HFCheckpoint
from tokenmill.config import ConfigFields, ModelConfig, rope_scaling_from_gguf, rope_scaling_from_hf
from tokenmill.errors import UnsupportedModelError
from tokenmill.models.causal_lm import DecoderForCausalLM, Tensor, gguf_tensor_names, sliding_window
from tokenmill.models.gguf_names import gguf_name_table

_GGUF_PATTERNS = gguf_name_table({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
})
# every `sliding_pattern`-th layer is global, the others slide
_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
_LOCAL_ROPE_THETA = 10000.0
# llama.cpp's LLM_TYPE_27B, by layer count: attention scale (hidden_size / heads) ** -0.5, not head_dim ** -0.5
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def _layer_types(pattern: int, num_layers: int) -> tuple[str, ...]:
    return tuple("sliding" if (i + 1) % pattern else "full" for i in range(num_layers))


# What Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration: the 4B and larger) leave out
# of their text_config, relying on transformers' Gemma3TextConfig defaults.
_GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh",
}


class GemmaForCausalLM(DecoderForCausalLM):
    GGUF_NAMES = _GGUF_PATTERNS
    HF_RENAMES = [
        # a multimodal checkpoint's language model, in the hub's and in transformers 5's naming
        (r"^(language_model\.model|model\.language_model)\.", "model."), (r"^language_model\.lm_head\.", "lm_head."),
        (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".attn_out_norm."),
        (r"\.pre_feedforward_layernorm\.", ".mlp_norm."), (r"\.post_feedforward_layernorm\.", ".mlp_out_norm.")]

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        # the vision tower and projector of a multimodal checkpoint: text generation does not use them
        self.ignored_tensors += [r"(model\.)?(vision_tower|multi_modal_projector)\..*"]

    @staticmethod
    def config_from_hf(cfg: ConfigFields) -> ModelConfig:
        if cfg.get("architectures", [""])[0] == "Gemma3ForConditionalGeneration":
            # transformers' multimodal model applies no final logit softcap, whatever text_config says
            text = {**_GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {}), "architectures": ["Gemma3ForCausalLM"],
                    "final_logit_softcapping": None}
            cfg = ConfigFields(text, f"{cfg.source} (text_config)")
        arch = "gemma3" if cfg.get("architectures", [""])[0].startswith("Gemma3") else "gemma2"
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"{cfg.source}: hidden_activation {act!r} is not supported "
                                        "(gelu_pytorch_tanh)")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError(f"{cfg.source}: use_bidirectional_attention (an encoder) is not supported")
        hidden, heads, layers = cfg.int("hidden_size"), cfg.int("num_attention_heads"), cfg.int("num_hidden_layers")
        rope = cfg.get("rope_parameters") or {}
        if "full_attention" in rope:  # transformers 5: one rope per layer type
            theta, scaling = rope_scaling_from_hf(ConfigFields({"rope_parameters": rope["full_attention"]},
                                                               cfg.source))
            local_theta, local_scaling = rope_scaling_from_hf(ConfigFields(
                {"rope_parameters": rope.get("sliding_attention") or {"rope_theta": _LOCAL_ROPE_THETA}}, cfg.source))
            if local_scaling is not None:
                raise UnsupportedModelError(f"{cfg.source}: rope scaling of the sliding layers is not supported")
        else:
            theta, scaling = rope_scaling_from_hf(cfg)
            local_theta = cfg.float("rope_local_base_freq", _LOCAL_ROPE_THETA)
        types = cfg.get("layer_types")
        head_dim = cfg.int("head_dim", hidden // heads)
        return ModelConfig(
            architecture=arch, vocab_size=cfg.int("vocab_size"), hidden_size=hidden, num_layers=layers,
            num_heads=heads, num_kv_heads=cfg.int("num_key_value_heads", heads), head_dim=head_dim,
            intermediate_size=cfg.int("intermediate_size"),
            max_position_embeddings=cfg.int("max_position_embeddings", 8192), norm_eps=cfg.float("rms_norm_eps", 1e-6),
            rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=True,
            attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=arch == "gemma3", hidden_act="gelu_tanh",
            attn_scale=cfg.float("query_pre_attn_scalar", head_dim) ** -0.5,
            attn_logit_softcap=cfg.float("attn_logit_softcapping", None),
            final_logit_softcap=cfg.float("final_logit_softcapping", None),
            sliding_window=sliding_window(cfg, "sliding_window"),
            layer_types=(tuple("sliding" if t == "sliding_attention" else "full" for t in types) if types
                         else _layer_types(cfg.int("sliding_window_pattern", _SLIDING_PATTERN[arch]), layers)),
            rope_local_theta=local_theta if arch == "gemma3" else None,
            embed_scale=math.sqrt(hidden), sandwich_norms=True, norm_float32_weight=True,
        )

    @staticmethod
    def config_from_gguf(ckpt: GGUFCheckpoint, cfg: ConfigFields) -> ModelConfig:
        gguf_tensor_names(ckpt)
        arch = ckpt.architecture
        hidden, heads, layers = cfg.int("embedding_length"), cfg.int("attention.head_count"), cfg.int("block_count")
        theta, scaling = rope_scaling_from_gguf(cfg)
        # per layer (true: slides) or every n-th layer global, as llama.cpp reads the key
        pattern = cfg.get("attention.sliding_window_pattern")
        types = (tuple("sliding" if s else "full" for s in pattern) if isinstance(pattern, list) else
                 _layer_types(cfg.int("attention.sliding_window_pattern", _SLIDING_PATTERN[arch]), layers))
        head_dim = cfg.int("attention.key_length", hidden // heads)
        return ModelConfig(
            architecture=arch, vocab_size=ckpt.tensor_shape("token_embd.weight")[0], hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=cfg.int("attention.head_count_kv", heads),
            head_dim=head_dim, intermediate_size=cfg.int("feed_forward_length"),
            max_position_embeddings=cfg.int("context_length", 8192),
            norm_eps=cfg.float("attention.layer_norm_rms_epsilon", 1e-6), rope_theta=theta, rope_scaling=scaling,
            tie_word_embeddings=True, qk_norm=arch == "gemma3", hidden_act="gelu_tanh",
            attn_scale=(hidden // heads if layers == _LAYERS_27B[arch] else head_dim) ** -0.5,
            attn_logit_softcap=cfg.float("attn_logit_softcapping", None),
            final_logit_softcap=cfg.float("final_logit_softcapping", None),
            sliding_window=sliding_window(cfg, "attention.sliding_window"),
            layer_types=types,
            rope_local_theta=_LOCAL_ROPE_THETA if arch == "gemma3" else None,
            embed_scale=math.sqrt(hidden), sandwich_norms=True, norm_float32_weight=True,
        )

    def convert(self, name: str, tensor: Tensor, ckpt: GGUFCheckpoint | HFCheckpoint) -> Iterator[tuple[str, Tensor]]:
        if isinstance(ckpt, HFCheckpoint) and name.endswith("norm.weight"):
            tensor = tensor + 1  # Gemma's RMSNorm scales by 1 + w; GGUF files store 1 + w already
        yield name, tensor
