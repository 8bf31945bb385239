"""What every rotary decoder model file shares: the LM head, logits, and the walk over a checkpoint's
tensors that renames them onto the module tree of layers/decoder.py.

A model file subclasses DecoderForCausalLM and gives:
  - `config_from_hf(fields)` / `config_from_gguf(ckpt, fields)` -> ModelConfig
  - `GGUF_NAMES`: llama.cpp tensor names -> Hugging Face names (gguf_names.gguf_name_table)
  - `HF_RENAMES`: (regex, replacement) pairs from Hugging Face names onto this package's module
    names (layers/decoder.py names a layer's norms by role: attn_norm, mlp_norm, attn_out_norm,
    mlp_out_norm, because the families name them differently)
  - optionally `build(cfg)` (the stack, when its layers are not the default ones) and
    `convert(name, tensor, ckpt)` (a family's layout changes, e.g. llama.cpp's Q/K permutation).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from tokenmill.checkpoint import GGUFBlocks, GGUFCheckpoint, HFCheckpoint
from tokenmill.config import ConfigFields, ModelConfig
from tokenmill.errors import CheckpointError, UnsupportedModelError
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.layers.decoder import DecoderModel
from tokenmill.layers.linear import Linear
from tokenmill.models.gguf_names import NameTable, map_gguf_name

Tensor = torch.Tensor | GGUFBlocks | list[torch.Tensor | GGUFBlocks]  # a list: stacked experts

# The Llama naming of a layer's two norms, which most families share.
LLAMA_NORMS = [(r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".mlp_norm.")]


def require_silu(cfg: ConfigFields) -> None:
    """The gated MLP of the Llama-style families: SiLU only (Gemma's GELU-tanh is read by its file)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{cfg.source}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")


def gguf_tensor_names(ckpt: GGUFCheckpoint) -> set[str]:
    """The file's tensor names, after checking it holds weights at all."""
    names = set(ckpt.tensor_names())
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{ckpt.path}: no token_embd.weight tensor (is this a vocab-only file?)")
    return names


def sliding_window(cfg: ConfigFields, key: str) -> int | None:
    """An optional window size: absent, null or 0 mean none."""
    return cfg.int(key, None) or None


class DecoderForCausalLM(nn.Module):
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    GGUF_NAMES: NameTable = []
    HF_RENAMES: list[tuple[str, str]] = LLAMA_NORMS

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = self.build(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size,
                                                                   vocab_parallel=True)
        # Rotary buffers and, for tied models, a redundant saved LM head carry nothing to load.
        self.ignored_tensors = [r".*rotary_emb\.inv_freq"] + (["lm_head.weight"] if cfg.tie_word_embeddings else [])
        self._renames = [(re.compile(p), r) for p, r in self.HF_RENAMES]

    @classmethod
    def build(cls, cfg: ModelConfig) -> DecoderModel:
        return DecoderModel(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Packed batch in, final hidden states out ([T, hidden])."""
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = (self.model.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        cap = self.config.final_logit_softcap
        if logits is None or cap is None:   # (None: a tensor-parallel worker, whose part went to rank 0)
            return logits
        return torch.tanh(logits / cap) * cap

    def convert(self, name: str, tensor: Tensor, ckpt: GGUFCheckpoint | HFCheckpoint) -> Iterator[tuple[str, Tensor]]:
        """A family's layout changes, on Hugging Face names: (name, tensor) pairs to load."""
        yield name, tensor

    # GGUF tensors that set a module up rather than fill a parameter (rope factors): `set_up` takes
    # them on every load, also when the parameters come from the converted-weights cache
    SETUP_TENSORS: tuple[str, ...] = ()

    def set_up(self, ckpt: GGUFCheckpoint | HFCheckpoint) -> None:
        """Hand the checkpoint's SETUP_TENSORS to `take_setup_tensor`."""
        if isinstance(ckpt, GGUFCheckpoint):
            present = set(ckpt.tensor_names())
            for name in self.SETUP_TENSORS:
                if name in present:
                    self.take_setup_tensor(name, ckpt.load_tensor(name, torch.float32))

    def take_setup_tensor(self, name: str, tensor: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} lists {name} in SETUP_TENSORS but does not take it")

    def checkpoint_tensors(self, ckpt: GGUFCheckpoint | HFCheckpoint) -> Iterator[tuple[str, Tensor]]:
        """(module name, tensor) pairs; GGUF quantized matrices come as their blocks (the loader decides
        whether to dequantize them). Names no table knows pass through, for the loader to report."""
        for name in ckpt.tensor_names():
            if name in self.SETUP_TENSORS and isinstance(ckpt, GGUFCheckpoint):
                continue   # (set_up's)
            if isinstance(ckpt, HFCheckpoint):
                tensor: Tensor = ckpt.load_tensor(name, torch.float32)
            elif len(ckpt.tensor_shape(name)) == 3:  # experts stacked by llama.cpp: one matrix each
                tensor = ckpt.load_stacked(name, torch.float32)
                name = map_gguf_name(name, self.GGUF_NAMES) or name
            else:
                tensor = ckpt.load_raw(name, torch.float32)
                name = map_gguf_name(name, self.GGUF_NAMES) or name
            for hf_name, converted in self.convert(name, tensor, ckpt):
                for pattern, replacement in self._renames:
                    hf_name = pattern.sub(replacement, hf_name)
                yield hf_name, converted
