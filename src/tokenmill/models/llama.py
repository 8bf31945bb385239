"""The Llama family: Llama 2/3, SmolLM/SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norms).

RMSNorm -> attention (fused q/k/v, RoPE, GQA) -> residual -> RMSNorm -> SwiGLU MLP (fused
gate/up) -> residual; final RMSNorm and an LM head that may be tied to the embeddings.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tokenmill import kernels
from tokenmill.checkpoint import GGUFBlocks, GGUFCheckpoint, HFCheckpoint
from tokenmill.config import ConfigFields, ModelConfig, rope_scaling_from_hf
from tokenmill.errors import CheckpointError, UnsupportedModelError
from tokenmill.layers import quant
from tokenmill.layers.attention import Attention, AttentionMetadata
from tokenmill.layers.linear import Embedding, Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.models.gguf_names import gguf_name_table, map_gguf_name

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


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=cfg.attention_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                norm: RMSNorm) -> torch.Tensor:
        """x + attention(norm(x))."""
        qkv = self.qkv_proj(x, norm=norm)
        if self.q_norm is None and self.attn.fuses_rotary_decode(meta):
            return self.o_proj(self.attn.decode_rotary(qkv, rope, meta), residual=x)
        qkv = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        qk = apply_rotary(qk, *rope)  # q and k heads rotated in one call
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v, meta), residual=x)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size])
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """x + SwiGLU(norm(x))."""
        return self.down_proj(self.gate_up_proj(x, norm=norm), gated=True, residual=x)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        # the norms and residual adds run inside the projections (fused by quantized weights)
        x = self.self_attn(x, rope, meta, self.input_layernorm)
        return self.mlp(x, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.use_decode_stack = True  # False: always the per-layer loop (the reference the tests compare with)
        self._plan: kernels.StackPlan | bool | None = None  # None: not built yet; False: does not apply
        self._plan_cache: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions)
        plan = self._stack_plan(x, meta)
        if plan is not None:  # the whole stack in one C call: the same kernel calls as the loop below
            cos, sin = (t.reshape(x.shape[0], -1) for t in rope)
            x = kernels.decode_stack(plan, x, cos, sin, meta.slot_mapping, meta.block_tables, meta.seq_lens_tensor)
        else:
            for layer in self.layers:
                x = layer(x, rope, meta)
        return self.norm(x)

    def _stack_plan(self, x: torch.Tensor, meta: AttentionMetadata) -> kernels.StackPlan | None:
        """The plan for kernels.decode_stack, where it applies: a decode-only float32 step on CPU whose
        every projection is quantized (biases on q/k/v only), no q/k norms, attention on the C kernel. Per layer
        the Python loop costs ~40 op dispatches (~0.25 ms at batch 1); the stack, none."""
        first = self.layers[0].self_attn
        if not (self.use_decode_stack and x.dtype == torch.float32 and first.attn.fuses_rotary_decode(meta)
                and first.q_norm is None and not quant.EXACT_ACTIVATIONS):
            return None
        cache = first.attn.kv_cache
        if self._plan is None or self._plan_cache is not cache:
            self._plan, self._plan_cache = self._build_plan(), cache
        return self._plan or None

    def _build_plan(self) -> kernels.StackPlan | bool:
        tensors: list[torch.Tensor | None] = []
        bits: list[int] = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            if any(p.qweight is None for p in projections) or any(p.bias is not None for p in projections[1:]):
                return False
            for p in projections:
                tensors += [p.qweight.packed, p.qweight.scales, p.qweight.offsets]
                bits.append(p.qweight.bits)
            tensors += [layer.input_layernorm.weight.float().contiguous(),
                        layer.post_attention_layernorm.weight.float().contiguous(), attn.attn.kv_cache[0],
                        attn.attn.kv_cache[1], attn.qkv_proj.bias]
        first = self.layers[0]
        return kernels.StackPlan(
            tensors=tensors, bits=bits, hidden=first.mlp.down_proj.qweight.out_features,
            intermediate=first.mlp.down_proj.qweight.in_features, heads=first.self_attn.num_heads,
            kv_heads=first.self_attn.num_kv_heads, head_dim=first.self_attn.head_dim,
            eps=first.input_layernorm.eps, scale=first.self_attn.attn.scale,
            block_size=first.self_attn.attn.kv_cache.shape[2],
            kv_bf16=first.self_attn.attn.kv_cache.dtype == torch.bfloat16)


class LlamaForCausalLM(nn.Module):
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        # Rotary buffers and, for tied models, a redundant saved LM head carry nothing to load.
        self.ignored_tensors = [r".*rotary_emb\.inv_freq"] + (["lm_head.weight"] if cfg.tie_word_embeddings else [])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Packed batch in, final hidden states out ([T, hidden])."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.model.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)

    # ---- checkpoints -------------------------------------------------------------------------

    @staticmethod
    def config_from_hf(cfg: ConfigFields) -> ModelConfig:
        family = _HF_FAMILY[(cfg.get("architectures") or ["LlamaForCausalLM"])[0]]
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"{cfg.source}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError(f"{cfg.source}: mlp_bias=true is not supported")
        theta, scaling = rope_scaling_from_hf(cfg)
        hidden, heads = cfg.int("hidden_size"), cfg.int("num_attention_heads")
        max_pos = cfg.int("max_position_embeddings", 4096)
        if family == "mistral" or cfg.get("use_sliding_window"):
            # Within the window, sliding-window attention is full attention: cap the context there.
            max_pos = min(max_pos, cfg.int("sliding_window", max_pos))
        return ModelConfig(
            architecture=family,
            vocab_size=cfg.int("vocab_size"),
            hidden_size=hidden,
            num_layers=cfg.int("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=cfg.int("num_key_value_heads", heads),
            head_dim=cfg.int("head_dim", hidden // heads),
            intermediate_size=cfg.int("intermediate_size"),
            max_position_embeddings=max_pos,
            norm_eps=cfg.float("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "qwen3",
        )

    @staticmethod
    def config_from_gguf(ckpt: GGUFCheckpoint, cfg: ConfigFields) -> ModelConfig:
        scaling_type = cfg.get("rope.scaling.type", "none")
        if scaling_type not in ("none", None):
            raise UnsupportedModelError(f"{ckpt.path}: rope scaling type {scaling_type!r} is not supported")
        names = set(ckpt.tensor_names())
        if "token_embd.weight" not in names:
            raise CheckpointError(f"{ckpt.path}: no token_embd.weight tensor (is this a vocab-only file?)")
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
            rope_theta=cfg.float("rope.freq_base", 10000.0),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
        )

    def checkpoint_tensors(self, ckpt: GGUFCheckpoint | HFCheckpoint
                           ) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
        """(HF name, tensor) pairs; GGUF quantized matrices come as their blocks (the loader decides
        whether to dequantize them)."""
        cfg = self.config
        if isinstance(ckpt, HFCheckpoint):
            for name in ckpt.tensor_names():
                yield name, ckpt.load_tensor(name, torch.float32)
            return
        for name in ckpt.tensor_names():
            tensor = ckpt.load_raw(name, torch.float32)
            if name == "rope_freqs.weight":  # llama3 rope scaling as per-frequency divisors
                self.model.rotary.set_frequency_factors(tensor)
                continue
            hf = map_gguf_name(name, _GGUF_PATTERNS)
            if hf is None:
                yield name, tensor  # the loader reports it as unused
                continue
            # llama.cpp permutes Q/K of the "llama" architecture only (qwen2/qwen3 use NeoX rope).
            if cfg.architecture == "llama" and (".q_proj." in hf or ".k_proj." in hf):
                tensor = unpermute_rope_rows(tensor, cfg.num_heads if ".q_proj." in hf else cfg.num_kv_heads)
            yield hf, tensor
