"""The same checks on every device this machine has: the CPU always, CUDA where a GPU exists.

CI has no GPU, so there the CUDA cases skip and the CPU cases keep the test bodies honest; on a
GPU machine `pytest tests/test_devices.py` is the CUDA check (README, "On a GPU"). On CUDA the
engine runs the same model code with CUDA tensors: weights dense (GGUF types dequantized at
load; the quantized C kernels are CPU-only), PyTorch SDPA for prefill chunks (its fused flash /
memory-efficient kernels) and the PyTorch paged decode path.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy, make_engine, prefill_logits
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.models.loader import weight_forms

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_model_matches_transformers_on_device(device, tiny_hf_model):
    """float32 on the device: prefill logits within 1e-3 of transformers on the CPU, and the same
    greedy tokens for prompts batched together (continuous batching, paged KV on the device)."""
    path = tiny_hf_model("llama")
    engine = make_engine(path, device=device, num_kv_blocks=64, block_size=4)
    assert engine.kv_caches[0].device.type == device
    assert all(p.device.type == device for p in engine.model.parameters())
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, engine.model_config.vocab_size, (n,), generator=g).tolist() for n in (1, 9, 23)]
    with torch.inference_mode():
        expected = ref(torch.tensor([prompts[2]])).logits[0]
    torch.testing.assert_close(prefill_logits(engine, prompts[2]).float().cpu(), expected, atol=1e-3, rtol=0)
    ours = greedy(engine, prompts, 12)
    with torch.inference_mode():
        theirs = [ref.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p):]
                  .tolist() for p in prompts]
    assert ours == theirs


@pytest.mark.parametrize("device", DEVICES)
def test_default_model_on_device(device, default_gguf_path):
    """The default GGUF with the device's default settings (CUDA: bfloat16, dense weights; CPU:
    float32 activations, quantized weights) against the dense float32 model on the CPU: next-token
    agreement over a prompt, and a sensible chat answer."""
    llm = LLM(str(default_gguf_path), device=device, num_kv_blocks=64)
    if device == "cuda":
        assert llm.engine.dtype == torch.bfloat16 and set(weight_forms(llm.engine.model)) == {"dense"}
    reference = LLM(str(default_gguf_path), device="cpu", dtype="float32", quantization="none", num_kv_blocks=64)
    ids = reference.tokenizer.encode("The history of the printing press begins in the fifteenth century, when "
                                     "Johannes Gutenberg combined movable metal type with an oil-based ink and a "
                                     "screw press adapted from wine making.", add_special_tokens=False)
    got, want = (prefill_logits(x.engine, ids).float().cpu() for x in (llm, reference))
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
