"""The later families (Gemma 2/3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE) through every path the
engine has: their logits and greedy tokens equal transformers' in test_model_parity.py; here the
engine's own equivalences hold for them too (paging, chunked prefill, prefix hits, the attention
kernels, quantized weights and experts; cached decode in test_model_parity.py), with small KV
blocks so that sliding windows (8 and 16 tokens in these models) start and end inside blocks.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy, make_engine, prefill_logits
from tiny_models import BASE_KINDS, KINDS, MOE_KINDS

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.layers.linear import Embedding, Linear
from tokenmill.layers.moe import SparseMoE
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.op import set_backend
from tokenmill.layers.quant import kernel_available
from tokenmill.models.loader import weight_forms

NEW_KINDS = KINDS[len(BASE_KINDS):]


def _prompts(vocab: int, lengths: tuple[int, ...] = (5, 19, 37), seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_chunks_blocks_and_prefix_hits_give_the_same_tokens(kind, tiny_hf_model):
    """One whole prefill with 16-token blocks == chunks of 8 tokens with 4-token blocks == a prompt
    whose first blocks are prefix-cache hits (the window then starts inside cached blocks)."""
    path = tiny_hf_model(kind)
    whole = make_engine(path, enable_prefix_caching=False)
    prompts = _prompts(whole.model_config.vocab_size)
    expected = greedy(whole, prompts, 16)
    chunked = make_engine(path, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert greedy(chunked, prompts, 16) == expected
    cached = make_engine(path, block_size=4)
    greedy(cached, [prompts[2][:29]], 1)   # its first 7 blocks stay cached
    assert greedy(cached, prompts, 16) == expected
    assert cached.kv.prefix_hit_rate > 0


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_attention_kernels_equal_the_reference(kind, tiny_hf_model):
    path = tiny_hf_model(kind)
    auto, reference = (make_engine(path, block_size=4, attention_backend=b) for b in ("auto", "torch"))
    prompts = _prompts(auto.model_config.vocab_size)
    assert greedy(auto, prompts, 16) == greedy(reference, prompts, 16)
    ids = prompts[2]
    torch.testing.assert_close(prefill_logits(auto, ids), prefill_logits(reference, ids), atol=1e-4, rtol=0)


@pytest.mark.skipif(not kernel_available(), reason="quantized execution needs the C kernels")
@pytest.mark.parametrize("kind", NEW_KINDS)
def test_quantized_gguf_computes_its_quantized_weights(kind, tiny_gguf_model):
    """A Q8_0 file runs quantized (experts too: one int8 weight per expert, run on its own rows) and,
    with float activations, computes exactly the model of its dequantized weights."""
    path = str(tiny_gguf_model(kind, "Q8_0"))
    quantized = LLM(path, device="cpu", dtype="float32", num_kv_blocks=64, kv_cache_dtype="float32")
    reference = LLM(path, device="cpu", dtype="float32", quantization="none", num_kv_blocks=64)
    forms = weight_forms(quantized.engine.model)
    assert set(forms) <= {"int8", "dense"} and forms["int8"] > 0
    model = quantized.engine.model
    experts = [e for m in model.modules() if isinstance(m, SparseMoE) for e in m.experts]
    assert (len(experts) > 0) == (kind in MOE_KINDS)
    assert all(e.gate_up_proj.qweight is not None and e.down_proj.qweight is not None for e in experts)
    assert all(m.gate.qweight is None for m in model.modules() if isinstance(m, SparseMoE))  # routers dense
    set_backend(model, "torch", (Linear, Embedding))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = _prompts(quantized.engine.model_config.vocab_size)
    got = [o.outputs[0].token_ids for o in quantized.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.skipif(not kernel_available(), reason="quantized execution needs the C kernels")
@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_a_block_without_a_c_plan_keeps_the_stack_off(tiny_gguf_model, kind):
    """The C decode stack runs only when every layer's blocks built a plan. A dense MLP (llama) and a
    mixture of experts (Mixtral: moe.c) both build one; pinning a block to its PyTorch reference (the
    MoE block; llama's norms) takes its plan away, and the decode steps then take the layer loop,
    giving the same tokens (to the reference's rounding)."""
    llm = LLM(str(tiny_gguf_model(kind, "Q8_0")), device="cpu", num_kv_blocks=64)
    model = llm.engine.model.model
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = _prompts(llm.engine.model_config.vocab_size)[:1]
    tokens = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert isinstance(model._plan, kernels.StackPlan)
    set_backend(model, "torch", SparseMoE if kind == "mixtral" else RMSNorm)
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == tokens
    assert model._plan is False


# Gemma's chat template as published with Gemma 3 (Gemma 2's differs only in not folding a system
# message into the first user turn, which it refuses instead): "model" turns, <start_of_turn> /
# <end_of_turn>, a system message prefixed to the first user turn, and strict alternation.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def test_gemma_chat_template_renders_as_transformers_and_refuses_bad_turns(tiny_hf_model):
    from transformers import AutoTokenizer

    from tokenmill import load_tokenizer
    from tokenmill.errors import TokenmillError

    path = tiny_hf_model("gemma3")
    ours = load_tokenizer(path)
    ours.set_chat_template(GEMMA_CHAT_TEMPLATE, "gemma template")
    theirs = AutoTokenizer.from_pretrained(path)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there "},
                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather?"}]
    expected = theirs.apply_chat_template(conversation, chat_template=GEMMA_CHAT_TEMPLATE, tokenize=False,
                                          add_generation_prompt=True)
    assert ours.apply_chat_template(conversation) == expected
    assert expected.endswith("<start_of_turn>user\nWeather?<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(TokenmillError, match="roles must alternate"):
        ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_longrope_factor_set_follows_the_context_the_model_is_built_for(tmp_path):
    """A Phi-3 whose context (256) exceeds its original one (64): built for 256 it takes longrope's
    long factors; built for max_model_len 64 the short ones, which is what transformers uses for a
    prompt within the original length, so then (and only then) its logits are transformers'."""
    from tiny_models import make_hf_model
    from transformers import AutoModelForCausalLM

    path = make_hf_model("phi3", tmp_path / "phi3-long", overrides={"original_max_position_embeddings": 64})
    ids = _prompts(400)[1]
    with torch.inference_mode():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([ids])).logits[0]
    short = prefill_logits(make_engine(path, max_model_len=64), ids)
    torch.testing.assert_close(short, ref, atol=1e-4, rtol=0)
    long = prefill_logits(make_engine(path), ids)
    assert (long - ref).abs().max() > 1e-2


def test_gemma3_multimodal_checkpoint_runs_its_language_model(tmp_path):
    """Gemma 3 4B and larger ship as Gemma3ForConditionalGeneration (text_config, the language model
    under language_model.model.*, a vision tower): its text generation is the language model's,
    equal to transformers' on text-only input; the vision tensors are left unused."""
    import json

    from tiny_models import build_hf_model, make_hf_model
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = build_hf_model("gemma3")
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    config = Gemma3Config(text_config=text.config, vision_config=vision, mm_tokens_per_image=4, image_token_index=399)
    model = Gemma3ForConditionalGeneration(config).eval()
    missing, _ = model.model.language_model.load_state_dict(text.model.state_dict(), strict=False)
    assert not missing
    folder = make_hf_model("gemma3", tmp_path / "gemma3-mm")  # the tokenizer files
    for f in folder.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    ids = _prompts(399)[2]
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(make_engine(folder), ids), ref, atol=1e-4, rtol=0)


def _held(request) -> list[int]:
    """Blocks the request holds in each KV cache group."""
    return [len(t.block_ids) - t.num_released for t in request.tables]


@pytest.mark.parametrize("kind", ["phi3", "gemma2", "gemma3"])
def test_sliding_layers_give_back_blocks_behind_the_window(kind, tiny_hf_model):
    """Phi-3's layers all slide (window 16 here): one KV cache group. Gemma 2 and 3 mix sliding
    layers (window 8) with global ones: a group of each kind, the global layers' holding every block.
    A long request holds, in a sliding group, only the blocks its window reaches (at most window /
    block_size + 2 of them), the tokens do not change (against an engine whose every group keeps its
    blocks), and the blocks it gave back stay in the prefix cache for a later prompt."""
    path = tiny_hf_model(kind)
    engine = make_engine(path, block_size=4)
    layout = engine.layout
    assert layout.windows == ((16,) if kind == "phi3" else (None, 8) if kind == "gemma2" else (None,) + (8,) * 5)
    # one tensor per slot: Gemma 3's six layers (five sliding) in groups of one share one cache tensor
    assert len({c.data_ptr() for c in engine.kv_caches}) == layout.num_slots == (1 if kind != "phi3" else 2)
    reference = make_engine(path, block_size=4)
    reference.kv.windows = (None,) * len(layout.windows)   # holds every block
    prompt = _prompts(engine.model_config.vocab_size)[2]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    request = engine.add_request(prompt, params)
    held = []
    while engine.has_unfinished():
        engine.step()
        if request.tables:   # (none once it has finished)
            held.append(_held(request))
    total = len(request.all_token_ids) // 4
    for group, w in enumerate(layout.windows):
        most = max(h[group] for h in held[1:])
        assert most <= w // 4 + 2 < total if w else most == total
    assert request.output_token_ids == greedy(reference, [prompt], 40)[0]
    assert engine.num_free_blocks == engine.pool.num_blocks
    # the same prompt again: its leading blocks, given back long ago, are still cached
    again = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert again.num_cached_tokens >= 32 and again.output_token_ids == request.output_token_ids[:4]


def test_a_pool_smaller_than_a_block_per_group_is_refused(tiny_hf_model):
    from tokenmill.errors import TokenmillError

    with pytest.raises(TokenmillError, match="smaller than one block per KV cache group"):
        make_engine(tiny_hf_model("gemma3"), num_kv_blocks=5)


def test_config_details_read_as_transformers_reads_them():
    """Qwen2 with use_sliding_window slides only the layers from max_window_layers on (no layer_types in
    older configs); a multimodal Gemma 3 config.json as the hub trims it (text_config with a few keys)
    takes Gemma3TextConfig's defaults for the rest and no final logit softcap."""
    from tokenmill.config import ConfigFields
    from tokenmill.models.gemma import GemmaForCausalLM
    from tokenmill.models.llama import LlamaForCausalLM

    qwen = LlamaForCausalLM.config_from_hf(ConfigFields({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 400, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "use_sliding_window": True,
        "sliding_window": 32, "max_window_layers": 2}, "qwen2"))
    assert qwen.layer_types == ("full", "full", "sliding", "sliding") and qwen.sliding_window == 32
    gemma = GemmaForCausalLM.config_from_hf(ConfigFields({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
                        "final_logit_softcapping": 30.0}}, "gemma-3-4b"))
    assert (gemma.num_heads, gemma.num_kv_heads, gemma.head_dim, gemma.vocab_size) == (8, 4, 256, 262208)
    assert gemma.layer_types[:6] == ("sliding",) * 5 + ("full",) and gemma.final_logit_softcap is None
    assert gemma.rope_scaling.rope_type == "linear" and gemma.rope_local_theta == 10000.0


@pytest.mark.skipif(not kernel_available(), reason="quantized execution needs the C kernels")
def test_pinning_ops_to_their_reference_after_a_step_turns_the_stack_off(tiny_gguf_model):
    llm = LLM(str(tiny_gguf_model("gemma2", "Q8_0")), device="cpu", num_kv_blocks=64)
    model = llm.engine.model.model
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert model._plan
    set_backend(model, "torch", RMSNorm)
    llm.generate([[5, 6, 8]], params, use_tqdm=False)
    assert model._plan is False


def test_gemma_norm_in_bfloat16_is_gemmas():
    """Gemma's RMSNorm multiplies by 1 + w in float32 and casts after: its weight is held in float32
    in a bfloat16 model (held in bf16, 1 + w would lose w's low bits), giving transformers' bits."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    g = torch.Generator().manual_seed(3)
    reference = Gemma2RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(64, generator=g) * 0.3)
    ours = RMSNorm(64, 1e-6, float32_weight=True)
    with torch.no_grad():
        ours.weight.copy_(reference.weight.float() + 1)   # as the loader stores Gemma's weights
    x = (torch.randn(5, 64, generator=g) * 4).to(torch.bfloat16)
    assert ours.weight.dtype == torch.float32
    assert torch.equal(ours(x), reference(x))
    held_in_bf16 = RMSNorm(64, 1e-6)
    with torch.no_grad():
        held_in_bf16.weight.data = (reference.weight.float() + 1).to(torch.bfloat16)
    assert not torch.equal(held_in_bf16(x), reference(x))


def test_gemma_bfloat16_model_keeps_float32_norms(tiny_hf_model):
    engine = make_engine(tiny_hf_model("gemma2"), dtype="bfloat16")
    layer = engine.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert {n.weight.dtype for n in (layer.attn_norm, layer.mlp_out_norm, engine.model.model.norm)} == {torch.float32}
    fp32 = make_engine(tiny_hf_model("gemma2"))
    ids = _prompts(400)[1]
    half, full = prefill_logits(engine, ids), prefill_logits(fp32, ids)
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() > 0.9
