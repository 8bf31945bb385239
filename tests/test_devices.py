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
from tokenmill.engine import engine as engine_module
from tokenmill.models.loader import weight_forms
from tokenmill.sampling.sampler import Sampler, SamplerOutput

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
    torch.testing.assert_close(prefill_logits(engine, prompts[2]).float(), expected, atol=1e-3, rtol=0)
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
    got, want = (prefill_logits(x.engine, ids).float() for x in (llm, reference))
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert agreement >= 0.9, agreement
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.parametrize(("kind", "ftype"), [("llama", None), ("gpt2", None), ("qwen2", None), ("qwen3", None),
                                             ("llama3", "Q8_0")])   # llama3 GGUF: rope_freqs set at load
def test_every_tensor_follows_the_engine_device(kind, ftype, monkeypatch, tiny_hf_model, tiny_gguf_model):
    """Without a GPU, the meta device stands in for one: its tensors carry shapes and no values, and an
    op that mixes them with CPU tensors raises, as with CUDA tensors. The engine runs its real steps
    there (chunked prefill, a prefix-cache hit, decode, every sampling knob); only the sampled tokens,
    which a step copies to the host, are replaced by CPU values after the sampler has run on meta."""
    monkeypatch.setattr(engine_module, "resolve_device", lambda device: torch.device("meta"))
    sample = Sampler.__call__

    def sample_on_meta(self: Sampler, logits: torch.Tensor, batch) -> SamplerOutput:
        out = sample(self, logits, batch)
        outputs = [out.token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs]
        assert all(t.device.type == "meta" for t in outputs if t is not None)
        host = [None if t is None else torch.zeros(t.shape, dtype=t.dtype) for t in outputs]
        return SamplerOutput(host[0] + 7, *host[1:])

    monkeypatch.setattr(Sampler, "__call__", sample_on_meta)
    path = tiny_gguf_model(kind, ftype) if ftype else tiny_hf_model(kind)
    engine = make_engine(path, dtype="bfloat16", num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    named = [*engine.model.named_parameters(), *engine.model.named_buffers(),
             *((f"kv_cache.{i}", t) for i, t in enumerate(engine.kv_caches))]
    assert [name for name, t in named if t.device.type != "meta"] == []
    params = SamplingParams(max_tokens=4, temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3, min_tokens=2,
                            repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5,
                            logit_bias={3: 1.0}, logprobs=3)
    prompt = list(range(3, 15))                      # 12 tokens: prefilled in chunks of 8
    requests = [engine.add_request(prompt, params), engine.add_request([5], params)]
    while engine.has_unfinished():
        engine.step()
    requests.append(engine.add_request(prompt + [9, 9], params))   # its first 12 tokens are cached
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in requests] == [[7] * 4] * 3
    assert engine.stats().prefix_cache_hits >= 8
