"""Tiny random-weight checkpoints for tests, built locally (no model hub).

Two builders:

- `make_hf_model(kind, out_dir)` writes a Hugging Face folder (config.json, model.safetensors,
  tokenizer.json, tokenizer_config.json, generation_config.json) for one of `KINDS`. Each kind
  carries one feature the engine must handle (see `_CONFIGS`). Weights are random but large
  (matrices ~ N(0, 0.2), norm weights ~ U(0.8, 1.2), biases ~ N(0, 0.1)) so logits are far from
  uniform and greedy tokens are well separated.
- `hf_to_gguf(hf_dir, out_path, ftype)` is a reference converter that writes what llama.cpp's
  `convert_hf_to_gguf.py` writes for these architectures (keys, tensor names, the Q/K row
  permutation, tokenizer metadata, which tensors stay F32). It is test code: it handles exactly
  the folders `make_hf_model` produces.

The tokenizer (shared by all kinds) is a byte-level BPE trained on `_CORPUS`: ByteLevel
pre-tokenizer (GPT-2 regex, no prefix space), ByteLevel decoder, 400 tokens = 3 special tokens +
256 byte symbols + 141 merges. Special tokens, mirroring SmolLM2-Instruct (the default model):

    id 0 "<|endoftext|>"  unk_token
    id 1 "<|im_start|>"   bos_token (never added automatically: add_bos_token is false)
    id 2 "<|im_end|>"     eos_token and pad_token; generation_config.eos_token_id == 2

The chat template (in tokenizer_config.json, like SmolLM2) is ChatML with a default system
message when the conversation has none.

GGUF conventions (llama.cpp):

- `general.architecture`: "llama" for LlamaForCausalLM and MistralForCausalLM (llama.cpp converts
  both with its LlamaModel class), "qwen2", "qwen3", "gpt2". `general.name` is the folder name.
- Keys: `{arch}.block_count`, `.context_length`, `.embedding_length`, `.feed_forward_length`,
  `.attention.head_count`, `.attention.head_count_kv` (not gpt2), `.rope.freq_base` (not gpt2),
  `.attention.layer_norm_rms_epsilon` (gpt2: `.attention.layer_norm_epsilon`),
  `.attention.key_length` / `.value_length` when config.json has `head_dim` (transformers 5
  writes it for llama, mistral and qwen3); llama only: `.vocab_size`, `.rope.dimension_count`.
- llama3 rope scaling writes no scaling keys; instead a `rope_freqs.weight` F32 tensor [head_dim/2]
  holds the factor each rotary frequency is divided by (1 for short wavelengths, `factor` for long
  ones, smooth in between). llama.cpp reads `original_max_position_embeddings` from the top level
  of config.json (default 8192); we read it from the rope parameters, where transformers keeps
  it, so the GGUF computes the same frequencies as the HF model (for real Llama 3.x both are 8192).
- Llama-arch `attn_q` / `attn_k` weights (and biases, if any) are row-permuted from HF's
  rotate-half layout to GGML's interleaved-pair layout, per head (see `permute_qk`). qwen2/qwen3
  use NEOX rope in llama.cpp and are stored unpermuted.
- gpt2's Conv1D weights (c_attn, c_proj, c_fc) are transposed to [out, in]; `attn_qkv` stays fused.
- Tensors stay F32 when 1-D, named `*_norm.weight`, not ending in `.weight` (biases), or
  `position_embd`; the rest take the file type (F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 via
  `gguf.quants.quantize`; Q4_K via `quantize_q4_k`, which needs rows of 256 values, e.g. the
  `llama256` kind).
  Tied output embeddings are not written (no `output.weight`), as llama.cpp does.
- Tokenizer: `tokenizer.ggml.model` "gpt2", `.pre` "gpt-2" (llama.cpp would reject this tokenizer's
  unknown hash; "gpt-2" names its pre-tokenizer regex), `.tokens` (padded with "[PAD{i}]" up to
  the model's vocab_size, type 5 UNUSED), `.token_type` (3 CONTROL for special tokens, 1 NORMAL),
  `.merges` ("a b"), bos/eos/unknown/padding ids, `add_bos_token`/`add_eos_token` false,
  `tokenizer.chat_template`; llama arch also `tokenizer.ggml.add_space_prefix` false.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

# the first families; the builder's own tests (test_tiny_models.py) cover these
BASE_KINDS = ("llama", "llama3", "smollm", "mistral", "qwen2", "qwen3", "gpt2")
KINDS = BASE_KINDS + ("gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")
FTYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2
PAD_TOKEN_ID = EOS_TOKEN_ID
TOKENIZER_VOCAB_SIZE = 400

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = """\
The little engine reads a prompt, turns the text into tokens, and writes one new token at a time.
Every step it looks at all the tokens it has seen so far and guesses the next one. When the guess
is the end of the message, it stops and hands the answer back to the user.
A user asks a question and the assistant answers it. The system message tells the assistant who
it is and how it should behave. Then the user writes again, and the assistant answers again.
Once upon a time there was a small model that lived on a small computer. It could not remember
much, but it was quick, and it liked to count: one, two, three, four, five, six, seven, eight,
nine, ten. It counted the stars at night and the birds in the morning.
The weather today is sunny with a light wind from the west. Tomorrow there will be rain in the
north and clouds in the south, and the temperature will fall by a few degrees in the evening.
To make bread, mix flour, water, salt and yeast. Let the dough rest for an hour, fold it, and let
it rest again. Bake it in a hot oven until the crust is brown and the kitchen smells wonderful.
The cat sat on the warm window and watched the garden. A bird landed on the fence, looked at the
cat, and flew away into the tall green trees behind the old stone house.
Numbers and words, questions and answers, stories and recipes: the model has seen a little of
everything, and it tries to continue whatever text you give it as well as it can.
"""

# Per kind: the transformers config class, its arguments, and the feature it exercises.
# vocab_size is added from the tokenizer (padded for qwen2, as real Qwen2 checkpoints are).
_COMMON_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
)
_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # plain Llama with GQA (4 heads share 2 kv heads) and an untied lm_head
    "llama": ("LlamaConfig", dict(_COMMON_LLAMA, rope_theta=10000.0, tie_word_embeddings=False)),
    # Llama 3 rope scaling (-> rope_freqs tensor in GGUF) and tied embeddings
    "llama3": ("LlamaConfig", dict(
        _COMMON_LLAMA, tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        },
    )),
    # SmolLM-like: tied embeddings, 3:1 GQA ratio (6 heads, 2 kv heads), rope theta 1e5
    "smollm": ("LlamaConfig", dict(
        _COMMON_LLAMA, hidden_size=96, intermediate_size=192, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, rope_theta=100000.0, tie_word_embeddings=True,
    )),
    # Mistral architecture class (GGUF arch "llama"), one kv head (MQA), no sliding window
    "mistral": ("MistralConfig", dict(
        _COMMON_LLAMA, num_key_value_heads=1, sliding_window=None, rope_theta=10000.0,
        tie_word_embeddings=False,
    )),
    # Qwen2: q/k/v biases, NEOX rope (unpermuted in GGUF), vocab padded past the tokenizer
    "qwen2": ("Qwen2Config", dict(
        _COMMON_LLAMA, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )),
    # Qwen3: q_norm/k_norm, head_dim (32) != hidden_size / heads (16), tied embeddings
    "qwen3": ("Qwen3Config", dict(
        _COMMON_LLAMA, head_dim=32, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )),
    # GPT-2: LayerNorm with biases, learned positions, fused Conv1D qkv, GELU, tied lm_head
    "gpt2": ("GPT2Config", dict(
        n_embd=64, n_layer=2, n_head=4, n_positions=256, n_ctx=256, layer_norm_epsilon=1e-5,
    )),
    # Gemma 2: GeGLU, sandwich norms, layer 0 slides (window 8), layer 1 global, attention and final
    # logit softcaps small enough to bind on these weights; query_pre_attn_scalar = head_dim, which is
    # what llama.cpp assumes (it does not store the scalar)
    "gemma2": ("Gemma2Config", dict(
        _COMMON_LLAMA, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=5.0,
        final_logit_softcapping=10.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
    )),
    # Gemma 3: q/k norms, five sliding layers (window 8, rope base 10000) then a global one whose rope
    # has linear scaling
    "gemma3": ("Gemma3TextConfig", dict(
        _COMMON_LLAMA, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )),
    # Phi-3: fused qkv and gate_up, longrope (short factors: the context is the original one), window 16
    "phi3": ("Phi3Config", dict(
        _COMMON_LLAMA, original_max_position_embeddings=256, sliding_window=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                         "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 16.0, 16.0, 16.0]},
    )),
    # Mixtral: 4 experts, 2 per token (GGUF arch "llama" with experts, Q/K permuted)
    "mixtral": ("MixtralConfig", dict(
        _COMMON_LLAMA, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        rope_theta=10000.0, tie_word_embeddings=False,
    )),
    # Qwen2-MoE: q/k/v biases, 4 experts (top 2, not renormalized) and a shared expert
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        _COMMON_LLAMA, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )),
    # Qwen3-MoE: q/k norms, 8 experts, top 2 renormalized
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        _COMMON_LLAMA, head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )),
    # Not in KINDS (only for quantized-kernel tests): rows of 256 values, so K-quant file types
    # (Q4_K) apply to every matrix instead of falling back to F16; untied LM head
    "llama256": ("LlamaConfig", dict(
        _COMMON_LLAMA, hidden_size=256, intermediate_size=512, rope_theta=10000.0, tie_word_embeddings=False,
    )),
}
_PADDED_VOCAB_KINDS = {"qwen2": 64}  # kind -> round vocab_size up to a multiple of this
# the final norm's weight, drawn larger than other norm weights to sharpen the logits
_FINAL_NORM_WEIGHTS = ("model.norm.weight", "transformer.ln_f.weight")
# Gemma stores RMSNorm weights as w - 1: drawn around 0 there, so the norm still scales by ~1
_NORM_OFFSET_KINDS = ("gemma2", "gemma3")
_GEMMA_OUTPUT_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")


@functools.cache
def tokenizer_json() -> str:
    """The trained tiny byte-level BPE tokenizer, serialized (trained once per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    if tokenizer.get_vocab_size() != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {tokenizer.get_vocab_size()} tokens, "
                           f"expected {TOKENIZER_VOCAB_SIZE}: extend _CORPUS")
    return tokenizer.to_str()


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "unk_token": SPECIAL_TOKENS[UNK_TOKEN_ID],
        "pad_token": SPECIAL_TOKENS[PAD_TOKEN_ID],
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
        "chat_template": CHAT_TEMPLATE,
    }


def model_vocab_size(kind: str) -> int:
    multiple = _PADDED_VOCAB_KINDS.get(kind, 1)
    return -(-TOKENIZER_VOCAB_SIZE // multiple) * multiple


def build_hf_model(kind: str, seed: int = 0, overrides: dict[str, Any] | None = None) -> torch.nn.Module:
    """The random-weight transformers model of `kind` (float32, eval mode), not saved. `overrides`
    replaces config entries (the benchmarks' larger shapes; vocab_size past the tokenizer's is padded)."""
    import transformers

    if kind not in _CONFIGS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {KINDS}")
    config_class, kwargs = _CONFIGS[kind]
    kwargs = {"vocab_size": model_vocab_size(kind), **kwargs, **(overrides or {})}
    config = getattr(transformers, config_class)(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, **kwargs,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied parameters are listed once
            if param.ndim >= 2:
                # Gemma scales its embeddings by sqrt(hidden): drawn smaller, so that the residual
                # stream is not mostly the input token, which the tied head would echo greedily
                std = 0.05 if kind in _NORM_OFFSET_KINDS and name.endswith("embed_tokens.weight") else 0.2
                param.normal_(0.0, std, generator=generator)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1, generator=generator)
            elif name in _FINAL_NORM_WEIGHTS or (kind in _NORM_OFFSET_KINDS and name.endswith(_GEMMA_OUTPUT_NORMS)):
                # logits std ~ 2.5 * 0.2 * sqrt(hidden); Gemma's output norms: the layers outweigh the
                # scaled embedding, which the tied head would otherwise echo greedily
                param.uniform_(2.0, 3.0, generator=generator)
            else:  # norm weights: around 1 but not 1, so a missing weight multiply is caught
                param.uniform_(0.8, 1.2, generator=generator)
            if kind in _NORM_OFFSET_KINDS and param.ndim == 1 and "norm" in name:
                param.sub_(1.0)
    return model.eval()


def make_hf_model(kind: str, out_dir: Path, seed: int = 0, overrides: dict[str, Any] | None = None) -> Path:
    """Write a tiny random HF checkpoint folder of `kind` into `out_dir` and return it."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    model = build_hf_model(kind, seed, overrides)
    model.save_pretrained(out_dir)  # transformers 5 always writes safetensors
    GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID,
    ).save_pretrained(out_dir)
    (out_dir / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(), indent=2), encoding="utf-8")
    return out_dir


# ---------------------------------------------------------------- HF -> GGUF (llama.cpp style)

_ARCH_BY_HF_CLASS = {
    "LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "MistralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
    "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
    "GPT2LMHeadModel": gguf.MODEL_ARCH.GPT2,
    "Gemma2ForCausalLM": gguf.MODEL_ARCH.GEMMA2,
    "Gemma3ForCausalLM": gguf.MODEL_ARCH.GEMMA3,
    "Phi3ForCausalLM": gguf.MODEL_ARCH.PHI3,
    "MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,
    "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
    "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE,
}
_GEMMA_ARCHS = (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
_FILE_TYPES = {
    "F32": (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
    "F16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
    "Q8_0": (gguf.LlamaFileType.MOSTLY_Q8_0, gguf.GGMLQuantizationType.Q8_0),
    "Q4_0": (gguf.LlamaFileType.MOSTLY_Q4_0, gguf.GGMLQuantizationType.Q4_0),
    "Q4_1": (gguf.LlamaFileType.MOSTLY_Q4_1, gguf.GGMLQuantizationType.Q4_1),
    "Q5_0": (gguf.LlamaFileType.MOSTLY_Q5_0, gguf.GGMLQuantizationType.Q5_0),
    "Q5_1": (gguf.LlamaFileType.MOSTLY_Q5_1, gguf.GGMLQuantizationType.Q5_1),
    "Q4_K": (gguf.LlamaFileType.MOSTLY_Q4_K_S, gguf.GGMLQuantizationType.Q4_K),
}


def quantize_q4_k(data: np.ndarray) -> np.ndarray:
    """A plain Q4_K quantizer (the `gguf` package has none): llama.cpp's block layout, min/max
    scales per 32-value sub-block instead of llama.cpp's search for the best ones.

    Per super-block of 256 values: fp16 d and dmin, 12 bytes of 6-bit sub-block scales sc and mins
    m, 128 bytes of nibbles; w = d * sc * q - dmin * m. Returns uint8 [rows, 144 * cols / 256].
    """
    rows, cols = data.shape
    if cols % 256:
        raise gguf.QuantError(f"Q4_K needs rows of a multiple of 256 values, got {cols}")
    nb = cols // 256
    x = data.reshape(rows, nb, 8, 32).astype(np.float32)
    lo, hi = np.minimum(x.min(-1), 0.0), x.max(-1)
    d = (((hi - lo) / 15).max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)

    def steps(value: np.ndarray, unit: np.ndarray) -> np.ndarray:
        unit = unit.astype(np.float32)[..., None]
        return np.clip(np.round(value / np.where(unit > 0, unit, 1)), 0, 63).astype(np.uint8)

    sc, m = steps((hi - lo) / 15, d), steps(-lo, dmin)
    scale = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.round((x + offset[..., None]) / np.where(scale > 0, scale, 1)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)], -1)
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(rows, nb, 128)  # chunk c: sub-blocks 2c, 2c + 1
    blocks = np.concatenate([d.view(np.uint8).reshape(rows, nb, 2), dmin.view(np.uint8).reshape(rows, nb, 2),
                             scales, qs], -1)
    return blocks.reshape(rows, nb * 144)


def _quantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(data)
    return gguf.quants.quantize(data, qtype)


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> GGML interleaved rows, per head (llama.cpp's `LlamaModel.permute`).

    Within each head of size d, HF row `s * d/2 + j` (s in {0, 1}) becomes GGUF row `2 * j + s`,
    so the pairs GGML rotates together, (2j, 2j+1), are the pairs HF rotates, (j, j + d/2).
    `n_head` is the number of heads the tensor holds (kv heads for attn_k).
    """
    head_dim = weight.shape[0] // n_head
    return (weight.reshape(n_head, 2, head_dim // 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape))


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """Per-frequency divisors for llama3 rope scaling, as llama.cpp's `rope_freqs.weight`."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context_len / high:
            factors.append(1.0)
        elif wavelen > old_context_len / low:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "rope_theta" in config:
        rope.setdefault("rope_theta", config["rope_theta"])
    return rope


def _write_hparams(writer: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, config: dict[str, Any]) -> None:
    if arch == gguf.MODEL_ARCH.GPT2:  # llama.cpp's GPT2Model.set_gguf_parameters
        writer.add_block_count(config["n_layer"])
        writer.add_context_length(config.get("n_ctx", config["n_positions"]))
        writer.add_embedding_length(config["n_embd"])
        writer.add_feed_forward_length(4 * config["n_embd"])
        writer.add_head_count(config["n_head"])
        writer.add_layer_norm_eps(config["layer_norm_epsilon"])
        return
    # llama.cpp's TextModel.set_gguf_parameters
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = _rope_parameters(config)
    if arch == gguf.MODEL_ARCH.GEMMA3:  # llama.cpp's Gemma3Model: the global layers' rope
        rope = rope["full_attention"]
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3", "linear", "longrope"):
        raise NotImplementedError(f"rope type {rope_type!r} is not handled by this converter")
    if arch != gguf.MODEL_ARCH.GEMMA2:
        writer.add_rope_freq_base(rope["rope_theta"])
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch in _GEMMA_ARCHS:
        writer.add_sliding_window(config["sliding_window"])
        if config.get("attn_logit_softcapping") is not None:
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping") is not None:
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == gguf.MODEL_ARCH.PHI3:  # llama.cpp's Phi3MiniModel
        original = config["original_max_position_embeddings"]
        writer.add_rope_dimension_count(_head_dim(config))
        writer.add_rope_scaling_orig_ctx_len(original)
        factor = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        if config.get("sliding_window"):
            writer.add_sliding_window(config["sliding_window"])
    if "num_local_experts" in config or "num_experts" in config:
        writer.add_expert_count(config.get("num_local_experts") or config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if config.get("head_dim") is not None:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    if arch == gguf.MODEL_ARCH.LLAMA:  # llama.cpp's LlamaModel.set_gguf_parameters
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(_head_dim(config))


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _write_tokenizer(writer: gguf.GGUFWriter, arch: gguf.MODEL_ARCH, hf_dir: Path,
                     vocab_size: int) -> None:
    """llama.cpp's `_set_vocab_gpt2` (+ LlamaModel's add_space_prefix) for a byte-level BPE."""
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    id_to_token = {token_id: token for token, token_id in tokenizer["model"]["vocab"].items()}
    special_ids = set()
    for added in tokenizer["added_tokens"]:
        id_to_token[added["id"]] = added["content"]
        if added["special"]:
            special_ids.add(added["id"])
    if any(not added["special"] for added in tokenizer["added_tokens"]):
        raise NotImplementedError("non-special added tokens (USER_DEFINED) are not handled")
    if max(id_to_token) >= vocab_size:
        raise ValueError(f"tokenizer ids go up to {max(id_to_token)} but vocab_size is {vocab_size}")
    tokens, token_types = [], []
    for token_id in range(vocab_size):
        if token_id not in id_to_token:
            tokens.append(f"[PAD{token_id}]")
            token_types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(id_to_token[token_id])
            token_types.append(
                gguf.TokenType.CONTROL if token_id in special_ids else gguf.TokenType.NORMAL)
    if arch == gguf.MODEL_ARCH.LLAMA and tokenizer_config.get("add_prefix_space") is not None:
        writer.add_add_space_prefix(tokenizer_config["add_prefix_space"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    # merges, special token ids, add_{bos,eos}_token and the chat template, read the same way
    # llama.cpp reads them (it uses this class from gguf-py)
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


def _hf_tensors(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _gguf_tensors(arch: gguf.MODEL_ARCH, config: dict[str, Any],
                  hf_dir: Path) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in torch order), converted as llama.cpp's modify_tensors does."""
    out: list[tuple[str, np.ndarray]] = []
    rope = _rope_parameters(config)
    if rope.get("rope_type") == "llama3":  # generate_extra_tensors comes first in llama.cpp
        out.append(("rope_freqs.weight", llama3_rope_factors(rope, _head_dim(config))))
    if arch == gguf.MODEL_ARCH.PHI3:  # llama.cpp's Phi3MiniModel.generate_extra_tensors
        out.append(("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32)))
        out.append(("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32)))
    n_layers = config["n_layer"] if arch == gguf.MODEL_ARCH.GPT2 else config["num_hidden_layers"]
    name_map = gguf.get_tensor_name_map(arch, n_layers)
    for hf_name, data in _stack_experts(_hf_tensors(hf_dir)).items():
        if hf_name.endswith((".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")):
            continue
        data = data.astype(np.float32)
        if arch in _GEMMA_ARCHS and hf_name.endswith("norm.weight"):
            data = data + 1  # llama.cpp's Gemma converters store Gemma's 1 + w
        if arch == gguf.MODEL_ARCH.LLAMA:
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                data = permute_qk(data, config["num_attention_heads"])
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                data = permute_qk(data, config["num_key_value_heads"])
        if arch == gguf.MODEL_ARCH.GPT2 and hf_name.endswith(
                (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            data = np.ascontiguousarray(data.T)  # Conv1D stores [in, out]
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"cannot map HF tensor {hf_name!r} for arch {arch.name}")
        out.append((gguf_name, data))
    return out


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's per-expert matrices stacked into one [experts, rows, cols] tensor per projection,
    named `...experts.{projection}.weight` (llama.cpp's converters, which map them to ffn_*_exps)."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, data in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name] = data
        else:
            stacks.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = data
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in range(len(experts))])
    return out


def _tensor_qtype(name: str, data: np.ndarray,
                  file_qtype: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """Which tensors llama.cpp keeps in F32 whatever the file type."""
    if data.ndim <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp" in name:  # routers stay F32
        return gguf.GGMLQuantizationType.F32
    if name.startswith("position_embd.") or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    return file_qtype


def hf_to_gguf(hf_dir: Path, out_path: Path, ftype: str = "F32") -> Path:
    """Convert a `make_hf_model` folder to a GGUF file the way llama.cpp would; returns out_path."""
    if ftype not in _FILE_TYPES:
        raise ValueError(f"ftype must be one of {FTYPES}, got {ftype!r}")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    hf_class = config["architectures"][0]
    if hf_class not in _ARCH_BY_HF_CLASS:
        raise NotImplementedError(f"no GGUF conversion for {hf_class}")
    arch = _ARCH_BY_HF_CLASS[hf_class]
    file_type, file_qtype = _FILE_TYPES[ftype]

    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])
    for name, data in _gguf_tensors(arch, config, hf_dir):
        qtype = _tensor_qtype(name, data, file_qtype)
        try:
            stored = _quantize(data, qtype)
        except gguf.QuantError:  # row length not a multiple of the block size: llama.cpp uses F16
            qtype = gguf.GGMLQuantizationType.F16
            stored = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, stored, raw_dtype=qtype)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(hf_dir.name)
    _write_hparams(writer, arch, config)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_tokenizer(writer, arch, hf_dir, config["vocab_size"])

    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file(path=out_path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
