"""The tiny-model fixtures are what they claim: loadable, non-degenerate, and converted to GGUF
the way llama.cpp converts (names, types, shapes, values, metadata, rope layout).

transformers' own GGUF loader (which un-permutes Q/K) is an independent check of the converter:
from GGUF metadata alone it rebuilds llama, smollm, mistral and qwen2 exactly. For llama3 it
ignores `rope_freqs`, for qwen3 it does not read `attention.key_length` (head_dim) and for gpt2 it
maps `context_length` to `n_ctx` rather than `n_positions`, so for those three it gets the HF
config and checks the tensors only.

These checks cover the first families (BASE_KINDS). For the later ones (Gemma 2/3, Phi-3, the MoE
kinds) transformers 5's GGUF loader rebuilds none faithfully (it drops softcaps, windows or
experts); llama.cpp itself is their independent check, where llama-cpp-python is installed (the
benchmark peer): it reproduces transformers' logits from their GGUF files (last test below).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tiny_models import (
    BASE_KINDS,
    BOS_TOKEN_ID,
    CHAT_TEMPLATE,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    UNK_TOKEN_ID,
    build_hf_model,
    tokenizer_json,
)

PROMPT = "The weather today is"
LLAMA_ARCH_KINDS = ("llama", "llama3", "smollm", "mistral")
GGUF_ARCH = {"llama": "llama", "llama3": "llama", "smollm": "llama", "mistral": "llama",
             "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}
FILE_TYPE = {"F32": 0, "F16": 1, "Q8_0": 7}


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _fields(reader: gguf.GGUFReader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def _load_hf(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


def _prompt_ids() -> torch.Tensor:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(tokenizer_json()).encode(PROMPT).ids
    return torch.tensor([ids * 4])  # 36 tokens: several positions, so rope matters


# ------------------------------------------------------------------------------------ tokenizer

def test_tokenizer_files(tiny_hf_model):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    folder = tiny_hf_model("llama")
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert raw.get_vocab_size() == TOKENIZER_VOCAB_SIZE
    assert [raw.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    assert (UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID) == (0, 1, 2, 2)
    text = "Hello, wörld! 3.14 ✓ \n\ttabs  and  spaces"
    ids = raw.encode(text).ids
    assert raw.decode(ids) == text  # byte-level: any text round-trips
    assert len(ids) < len(text.encode())  # merges were learned

    tok = AutoTokenizer.from_pretrained(folder)
    assert tok(text)["input_ids"] == ids  # no BOS added, same pre-tokenization
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 2, 0)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == ("<|im_start|>system\nYou are a tiny test model.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok(chat)["input_ids"].count(raw.token_to_id("<|im_start|>")) == 3
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


# ----------------------------------------------------------------------------------- HF models

# kind -> (architecture class, tied embeddings, config entries, tensors that must exist)
FEATURES = {
    "llama": ("LlamaForCausalLM", False,
              {"num_attention_heads": 4, "num_key_value_heads": 2}, ["lm_head.weight"]),
    "llama3": ("LlamaForCausalLM", True, {"num_key_value_heads": 2}, []),
    "smollm": ("LlamaForCausalLM", True,
               {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16}, []),
    "mistral": ("MistralForCausalLM", False,
                {"num_key_value_heads": 1, "sliding_window": None}, ["lm_head.weight"]),
    "qwen2": ("Qwen2ForCausalLM", False, {"vocab_size": 448},
              ["model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias"]),
    "qwen3": ("Qwen3ForCausalLM", True, {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32},
              ["model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"]),
    "gpt2": ("GPT2LMHeadModel", True, {"n_positions": 256, "n_embd": 64},
             ["transformer.wpe.weight", "transformer.h.0.attn.c_attn.bias"]),
}


@pytest.mark.parametrize("kind", BASE_KINDS)
def test_hf_model_reloads_with_identical_logits(kind, tiny_hf_model):
    folder = tiny_hf_model(kind)
    arch, tied, config_entries, required = FEATURES[kind]
    config = _config(folder)
    assert config["architectures"] == [arch]
    assert config["tie_word_embeddings"] is tied
    assert {k: config[k] for k in config_entries} == config_entries
    tensors = load_file(folder / "model.safetensors")
    assert ("lm_head.weight" in tensors) is not tied
    assert set(required) <= set(tensors)
    for name, tensor in tensors.items():  # norms and biases are random too, not 1 or 0
        assert tensor.dtype == np.float32 and tensor.std() > 0.05, name
    if kind == "llama3":
        assert config["rope_parameters"]["rope_type"] == "llama3"

    ids = _prompt_ids()
    with torch.no_grad():
        expected = build_hf_model(kind).eval()(ids).logits
        actual = _load_hf(folder)(ids).logits
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("kind", BASE_KINDS)
def test_greedy_output_is_not_degenerate(kind, tiny_hf_model):
    model = _load_hf(tiny_hf_model(kind))
    prompt = _prompt_ids()[:, :9]
    with torch.no_grad():  # min_new_tokens: EOS is masked, so all 40 steps run
        out = model.generate(prompt, do_sample=False, max_new_tokens=40, min_new_tokens=40,
                             output_logits=True, return_dict_in_generate=True)
    generated = out.sequences[0, prompt.shape[1]:].tolist()
    logits = torch.cat(out.logits)  # raw logits, [40, vocab]
    top2 = logits.topk(2, dim=-1).values
    gaps, stds = (top2[:, 0] - top2[:, 1]).tolist(), logits.std(dim=-1).tolist()
    assert len(set(generated)) >= 8, generated
    assert np.mean(gaps) > 0.5, gaps
    assert np.mean(stds) > 2.0, stds


# ------------------------------------------------------------------------------------------ GGUF

def _expected_tensors(kind: str, config: dict) -> dict[str, tuple[str, str]]:
    """GGUF name -> (HF name, how the HF tensor was rearranged: "", "q", "k" or "T")."""
    if kind == "gpt2":
        names = {"token_embd.weight": ("transformer.wte.weight", ""),
                 "position_embd.weight": ("transformer.wpe.weight", "")}
        for suffix in ("weight", "bias"):
            names[f"output_norm.{suffix}"] = (f"transformer.ln_f.{suffix}", "")
            for i in range(config["n_layer"]):
                h = f"transformer.h.{i}"
                transpose = "T" if suffix == "weight" else ""
                names.update({
                    f"blk.{i}.attn_norm.{suffix}": (f"{h}.ln_1.{suffix}", ""),
                    f"blk.{i}.attn_qkv.{suffix}": (f"{h}.attn.c_attn.{suffix}", transpose),
                    f"blk.{i}.attn_output.{suffix}": (f"{h}.attn.c_proj.{suffix}", transpose),
                    f"blk.{i}.ffn_norm.{suffix}": (f"{h}.ln_2.{suffix}", ""),
                    f"blk.{i}.ffn_up.{suffix}": (f"{h}.mlp.c_fc.{suffix}", transpose),
                    f"blk.{i}.ffn_down.{suffix}": (f"{h}.mlp.c_proj.{suffix}", transpose),
                })
        return names
    permuted = kind in LLAMA_ARCH_KINDS
    names = {"token_embd.weight": ("model.embed_tokens.weight", ""),
             "output_norm.weight": ("model.norm.weight", "")}
    if not config["tie_word_embeddings"]:
        names["output.weight"] = ("lm_head.weight", "")
    for i in range(config["num_hidden_layers"]):
        layer, attn, mlp = f"model.layers.{i}", f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        names.update({
            f"blk.{i}.attn_norm.weight": (f"{layer}.input_layernorm.weight", ""),
            f"blk.{i}.attn_q.weight": (f"{attn}.q_proj.weight", "q" if permuted else ""),
            f"blk.{i}.attn_k.weight": (f"{attn}.k_proj.weight", "k" if permuted else ""),
            f"blk.{i}.attn_v.weight": (f"{attn}.v_proj.weight", ""),
            f"blk.{i}.attn_output.weight": (f"{attn}.o_proj.weight", ""),
            f"blk.{i}.ffn_norm.weight": (f"{layer}.post_attention_layernorm.weight", ""),
            f"blk.{i}.ffn_gate.weight": (f"{mlp}.gate_proj.weight", ""),
            f"blk.{i}.ffn_up.weight": (f"{mlp}.up_proj.weight", ""),
            f"blk.{i}.ffn_down.weight": (f"{mlp}.down_proj.weight", ""),
        })
        if kind == "qwen2":
            for p in "qkv":
                names[f"blk.{i}.attn_{p}.bias"] = (f"{attn}.{p}_proj.bias", "")
        if kind == "qwen3":
            names[f"blk.{i}.attn_q_norm.weight"] = (f"{attn}.q_norm.weight", "")
            names[f"blk.{i}.attn_k_norm.weight"] = (f"{attn}.k_norm.weight", "")
    return names


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGML interleaved rows (2j, 2j+1) -> HF halves (j, j + d/2), written independently."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_arrays(path: Path) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType, tuple]]:
    """name -> (dequantized float32 array in torch order, stored type, GGUF (ggml) shape)."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        ggml_shape = tuple(int(n) for n in t.shape)
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ggml_shape[::-1])
        out[t.name] = (data.astype(np.float32), t.tensor_type, ggml_shape)
    return out


@pytest.mark.parametrize("ftype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("kind", BASE_KINDS)
def test_gguf_tensors_reproduce_hf(kind, ftype, tiny_hf_model, tiny_gguf_model):
    folder = tiny_hf_model(kind)
    config = _config(folder)
    hf = load_file(folder / "model.safetensors")
    arrays = _gguf_arrays(tiny_gguf_model(kind, ftype))
    expected = _expected_tensors(kind, config)
    if kind == "llama3":
        expected["rope_freqs.weight"] = ("", "")
    assert set(arrays) == set(expected)
    assert _fields(gguf.GGUFReader(tiny_gguf_model(kind, ftype)))["general.file_type"] == FILE_TYPE[ftype]

    file_qtype = gguf.GGMLQuantizationType[ftype]
    for name, (hf_name, layout) in expected.items():
        data, qtype, ggml_shape = arrays[name]
        if name == "rope_freqs.weight":
            assert qtype == gguf.GGMLQuantizationType.F32 and ggml_shape == (8,)
            continue
        ref = hf[hf_name]
        keep_f32 = ref.ndim == 1 or name.endswith("_norm.weight") or name.startswith("position_embd")
        assert qtype == (gguf.GGMLQuantizationType.F32 if keep_f32 else file_qtype), name
        stored_shape = ref.T.shape if layout == "T" else ref.shape  # torch order
        assert ggml_shape == stored_shape[::-1], name  # GGUF lists dimensions innermost first
        if layout == "T":
            data = data.T
        elif layout == "q":
            data = _unpermute(data, config["num_attention_heads"])
        elif layout == "k":
            data = _unpermute(data, config["num_key_value_heads"])
        if qtype == gguf.GGMLQuantizationType.F32:
            np.testing.assert_array_equal(data, ref, err_msg=name)
        elif qtype == gguf.GGMLQuantizationType.F16:
            np.testing.assert_array_equal(data, ref.astype(np.float16).astype(np.float32), err_msg=name)
        else:  # Q8_0: blocks of 32 along the row, scale = max|x| / 127 (stored in f16)
            rows = ref.T if layout == "T" else ref
            got = data.T if layout == "T" else data
            scale = np.abs(rows.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
            err = np.abs(got.reshape(-1, 32) - rows.reshape(-1, 32))
            assert np.all(err <= 0.6 * scale + 1e-7), name
            assert err.max() > 0, f"{name} is not actually quantized"


@pytest.mark.parametrize("kind", BASE_KINDS)
def test_gguf_metadata(kind, tiny_hf_model, tiny_gguf_model):
    folder = tiny_hf_model(kind)
    config = _config(folder)
    fields = _fields(gguf.GGUFReader(tiny_gguf_model(kind, "F32")))
    arch = GGUF_ARCH[kind]
    assert fields["general.architecture"] == arch
    assert fields["general.name"] == folder.name
    if kind == "gpt2":
        hparams = {"block_count": 2, "context_length": 256, "embedding_length": 64,
                   "feed_forward_length": 256, "attention.head_count": 4,
                   "attention.layer_norm_epsilon": 1e-5}
    else:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        hparams = {
            "block_count": 2, "context_length": 256, "embedding_length": config["hidden_size"],
            "feed_forward_length": config["intermediate_size"],
            "attention.head_count": config["num_attention_heads"],
            "attention.head_count_kv": config["num_key_value_heads"],
            "rope.freq_base": config["rope_parameters"]["rope_theta"],
            "attention.layer_norm_rms_epsilon": config["rms_norm_eps"],
        }
        if kind != "qwen2":  # transformers 5 writes head_dim to config.json except for Qwen2
            hparams["attention.key_length"] = hparams["attention.value_length"] = head_dim
        if arch == "llama":
            hparams["vocab_size"] = config["vocab_size"]
            hparams["rope.dimension_count"] = head_dim
    got = {k.removeprefix(f"{arch}."): v for k, v in fields.items() if k.startswith(f"{arch}.")}
    assert set(got) == set(hparams)
    for key, value in hparams.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key

    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = {i: t for t, i in tokenizer["model"]["vocab"].items()}
    vocab.update({a["id"]: a["content"] for a in tokenizer["added_tokens"]})
    n_vocab = config["vocab_size"]
    tokens = [vocab.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    token_types = [3 if i < 3 else 1 if i in vocab else 5 for i in range(n_vocab)]
    assert fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.tokens"] == tokens
    assert fields["tokenizer.ggml.token_type"] == token_types
    assert fields["tokenizer.ggml.merges"] == [" ".join(m) for m in tokenizer["model"]["merges"]]
    assert fields["tokenizer.ggml.bos_token_id"] == BOS_TOKEN_ID
    assert fields["tokenizer.ggml.eos_token_id"] == EOS_TOKEN_ID
    assert fields["tokenizer.ggml.unknown_token_id"] == UNK_TOKEN_ID
    assert fields["tokenizer.ggml.padding_token_id"] == PAD_TOKEN_ID
    assert fields["tokenizer.ggml.add_bos_token"] is False
    assert fields["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert fields.get("tokenizer.ggml.add_space_prefix") == (False if arch == "llama" else None)


def _ggml_rope(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    """GGML rope mode 0 (llama.cpp's llama arch): rotates adjacent pairs (2j, 2j+1)."""
    d = x.shape[-1]
    theta = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * theta.cos() - odd * theta.sin()
    out[..., 1::2] = even * theta.sin() + odd * theta.cos()
    return out


def _hf_rope(x: torch.Tensor, pos: int, base: float) -> torch.Tensor:
    """transformers' rotate_half rope: rotates pairs (j, j + d/2)."""
    d = x.shape[-1]
    theta = pos * base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cat([theta.cos()] * 2), torch.cat([theta.sin()] * 2)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("kind", ["llama", "smollm", "mistral"])
def test_permuted_qk_give_hf_attention_scores_under_ggml_rope(kind, tiny_hf_model, tiny_gguf_model):
    """The permutation is the right one: GGML's rope on GGUF weights == HF's rope on HF weights."""
    config = _config(tiny_hf_model(kind))
    hf = load_file(tiny_hf_model(kind) / "model.safetensors")
    arrays = _gguf_arrays(tiny_gguf_model(kind, "F32"))
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    base = config["rope_parameters"]["rope_theta"]
    x = torch.randn(2, config["hidden_size"], generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64)

    def scores(wq, wk, rope):
        q = (x[0] @ torch.from_numpy(wq).double().T).reshape(n_head, -1)
        k = (x[1] @ torch.from_numpy(wk).double().T).reshape(n_kv, -1)
        q, k = rope(q, 37, base), rope(k, 5, base)
        return (q * k.repeat_interleave(n_head // n_kv, dim=0)).sum(-1)

    hf_scores = scores(hf["model.layers.0.self_attn.q_proj.weight"],
                       hf["model.layers.0.self_attn.k_proj.weight"], _hf_rope)
    ggml_scores = scores(arrays["blk.0.attn_q.weight"][0], arrays["blk.0.attn_k.weight"][0], _ggml_rope)
    torch.testing.assert_close(ggml_scores, hf_scores, rtol=1e-9, atol=1e-9)
    # and the permutation matters: HF weights under GGML's rope give other scores
    wrong = scores(hf["model.layers.0.self_attn.q_proj.weight"],
                   hf["model.layers.0.self_attn.k_proj.weight"], _ggml_rope)
    assert not torch.allclose(wrong, hf_scores, atol=1e-3)


def test_llama3_rope_freqs_match_transformers(tiny_hf_model, tiny_gguf_model):
    config = _config(tiny_hf_model("llama3"))
    rope_freqs = torch.from_numpy(_gguf_arrays(tiny_gguf_model("llama3", "F32"))["rope_freqs.weight"][0])
    head_dim = config["head_dim"]
    base = config["rope_parameters"]["rope_theta"]
    default = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    hf_inv_freq = _load_hf(tiny_hf_model("llama3")).model.rotary_emb.inv_freq
    torch.testing.assert_close(default / rope_freqs, hf_inv_freq, rtol=1e-6, atol=0)
    assert rope_freqs[0] == 1 and rope_freqs[-1] == 8  # both ends of the scaling are exercised
    assert ((rope_freqs > 1) & (rope_freqs < 8)).any()


@pytest.mark.parametrize("kind", BASE_KINDS)
def test_transformers_gguf_loader_reproduces_hf_logits(kind, tiny_hf_model, tiny_gguf_model):
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf_path = tiny_gguf_model(kind, "F32")
    kwargs = {}
    if kind in ("llama3", "qwen3", "gpt2"):  # metadata transformers cannot read; see module doc
        kwargs["config"] = AutoConfig.from_pretrained(tiny_hf_model(kind))
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, **kwargs)
    ids = _prompt_ids()
    with torch.no_grad():
        expected = _load_hf(tiny_hf_model(kind))(ids).logits
        actual = from_gguf.eval()(ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_default_gguf_path(default_gguf_path):
    # only the header: GGUFReader needs ~6 s here to parse the 49k-token vocabulary
    with open(default_gguf_path, "rb") as f:
        magic, version, _n_tensors, _n_kv, key_len = struct.unpack("<4sIQQQ", f.read(32))
        key = f.read(key_len).decode()
        value_type, value_len = struct.unpack("<IQ", f.read(12))
        value = f.read(value_len).decode()
    assert (magic, version) == (b"GGUF", 3)
    assert (key, value_type, value) == ("general.architecture", gguf.GGUFValueType.STRING, "llama")


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_llama_cpp_reproduces_hf_logits_from_the_gguf(kind, tiny_hf_model, tiny_gguf_model):
    """llama.cpp itself (llama-cpp-python, the optional benchmark peer: scripts/install-peers.sh) reads
    the later families' GGUF files and computes transformers' logits: the independent check of the
    converter that transformers' GGUF loader cannot be for them. Phi-3 is left out: when a file's
    general.name says "phi3", llama.cpp's vocabulary loader adjusts Phi-3's own special tokens
    (`</s>`, ...), which the tiny tokenizer does not have, and fails to load."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (scripts/install-peers.sh)")
    ids = _prompt_ids()[0].tolist()
    with torch.no_grad():
        expected = _load_hf(tiny_hf_model(kind))(torch.tensor([ids])).logits[0].numpy()
    # float32 K/V (llama.cpp's default cache is f16)
    llm = llama_cpp.Llama(model_path=str(tiny_gguf_model(kind, "F32")), logits_all=True, n_ctx=256, n_threads=1,
                          type_k=0, type_v=0, verbose=False)
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)])
    # gemma2 differs most (~3e-4 of the largest logit): llama.cpp's tanh softcaps and GELU
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-3 * np.abs(expected).max())
