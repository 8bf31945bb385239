"""GPT-2: learned positions, pre-LayerNorm blocks, fused q/k/v, GELU (tanh) MLP, tied LM head.

HF checkpoints store the projections as Conv1D ([in, out]); they are transposed to Linear
([out, in]) at load. GGUF files already hold them as [out, in].
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import parallel
from tokenmill.checkpoint import GGUFBlocks, GGUFCheckpoint, HFCheckpoint
from tokenmill.config import ConfigFields, ModelConfig
from tokenmill.errors import UnsupportedModelError
from tokenmill.layers.attention import Attention, AttentionMetadata
from tokenmill.layers.linear import Embedding, Linear
from tokenmill.models.causal_lm import gguf_tensor_names
from tokenmill.models.gguf_names import gguf_name_table, map_gguf_name

_GGUF_NAMES = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
    **{f"blk.{{i}}.{g}.{leaf}": f"transformer.h.{{i}}.{h}.{leaf}"
       for g, h in [("attn_norm", "ln_1"), ("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"),
                    ("ffn_norm", "ln_2"), ("ffn_up", "mlp.c_fc"), ("ffn_down", "mlp.c_proj")]
       for leaf in ("weight", "bias")},
}
_GGUF_PATTERNS = gguf_name_table(_GGUF_NAMES)
_CONV1D = re.compile(r".*\.(c_attn|c_proj|c_fc)\.weight")


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class GPT2Attention(nn.Module):
    """Under tensor parallelism: this rank's heads, taken from each third ([q | k | v]) of c_attn."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        heads = parallel.head_slice(cfg.num_heads, cfg.num_heads, parallel.current()).q
        self.num_heads, self.head_dim = len(heads), cfg.head_dim
        size, kept = cfg.num_heads * cfg.head_dim, parallel.scaled(heads, cfg.head_dim)
        self.c_attn = Linear(cfg.hidden_size, 3 * size, bias=True,
                             rows=[[range(i * size + kept.start, i * size + kept.stop) for i in range(3)]])
        self.c_proj = Linear(size, cfg.hidden_size, bias=True, cols=kept)
        self.attn = Attention(self.num_heads, self.num_heads, cfg.head_dim, cfg.head_dim**-0.5)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        return self.c_proj(self.attn(q, k, v, meta))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        kept = parallel.mlp_slice(cfg.intermediate_size, parallel.current())
        self.c_fc = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True, rows=[[kept]])
        self.c_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True, cols=kept)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = LayerNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = Embedding(cfg.vocab_size, cfg.hidden_size, vocab_parallel=True)
        self.wpe = Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            x = block(x, meta)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    stacked_params: dict[str, tuple[str, int]] = {}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.transformer = GPT2Model(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size,
                                                                   vocab_parallel=True)
        # Old checkpoints save the causal-mask buffers; tied ones may also save the LM head.
        self.ignored_tensors = [r".*\.attn\.(bias|masked_bias)"] + (
            ["lm_head.weight"] if cfg.tie_word_embeddings else [])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.transformer(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.transformer.wte if self.lm_head is None else self.lm_head).logits(hidden)

    def set_up(self, ckpt: GGUFCheckpoint | HFCheckpoint) -> None:
        """(GPT-2 checkpoints carry no tensors that set modules up: DecoderForCausalLM.set_up)"""

    @staticmethod
    def config_from_hf(cfg: ConfigFields) -> ModelConfig:
        act = cfg.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"{cfg.source}: activation_function {act!r} is not supported (gelu_new)")
        hidden, heads = cfg.int("n_embd"), cfg.int("n_head")
        return ModelConfig(
            architecture="gpt2", vocab_size=cfg.int("vocab_size"), hidden_size=hidden,
            num_layers=cfg.int("n_layer"), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            intermediate_size=cfg.int("n_inner", 4 * hidden), max_position_embeddings=cfg.int("n_positions"),
            norm_eps=cfg.float("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )

    @staticmethod
    def config_from_gguf(ckpt: GGUFCheckpoint, cfg: ConfigFields) -> ModelConfig:
        names = gguf_tensor_names(ckpt)
        hidden, heads = cfg.int("embedding_length"), cfg.int("attention.head_count")
        return ModelConfig(
            architecture="gpt2", vocab_size=ckpt.tensor_shape("token_embd.weight")[0], hidden_size=hidden,
            num_layers=cfg.int("block_count"), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            intermediate_size=cfg.int("feed_forward_length"), max_position_embeddings=cfg.int("context_length"),
            norm_eps=cfg.float("attention.layer_norm_epsilon", 1e-5),
            tie_word_embeddings="output.weight" not in names,
        )

    def checkpoint_tensors(self, ckpt: GGUFCheckpoint | HFCheckpoint
                           ) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
        """(HF name, tensor) pairs; GGUF quantized matrices come as their blocks."""
        for name in ckpt.tensor_names():
            if isinstance(ckpt, GGUFCheckpoint):
                yield map_gguf_name(name, _GGUF_PATTERNS) or name, ckpt.load_raw(name, torch.float32)
                continue
            tensor = ckpt.load_tensor(name, torch.float32)
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name  # the original checkpoints omit the prefix
            yield name, tensor.t() if _CONV1D.fullmatch(name) else tensor
