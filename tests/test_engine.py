"""The engine on tiny random models: batching, chunked prefill, aborts and bad input.

Each test ends with every KV block back in the pool.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import greedy, make_engine, prefill_logits

from tokenmill import SamplingParams, TokenmillError


def _prompts(vocab: int, lengths: list[int], seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llama_path(tiny_hf_model):
    return tiny_hf_model("llama")


def test_batch_composition_does_not_change_greedy_output(llama_path):
    engine = make_engine(llama_path, block_size=4)
    prompts = _prompts(engine.model_config.vocab_size, [3, 17, 9, 30, 1, 12])
    alone = [greedy(engine, [p], 20)[0] for p in prompts]
    together = greedy(engine, prompts, 20)
    assert together == alone


@pytest.mark.parametrize("budget", [1, 3, 4, 5, 16])
def test_chunked_prefill_matches_one_shot(llama_path, budget):
    """A prompt prefilled in chunks of `budget` tokens writes the same KV and yields the same tokens."""
    one_shot = make_engine(llama_path, block_size=4, num_kv_blocks=32)
    chunked = make_engine(llama_path, block_size=4, num_kv_blocks=32, max_num_batched_tokens=budget)
    prompt = _prompts(one_shot.model_config.vocab_size, [22])[0]
    # Same tokens, greedy.
    assert greedy(chunked, [prompt], 12) == greedy(one_shot, [prompt], 12)
    # Same KV cache contents after the prompt (both pools hand out blocks in the same order).
    for engine in (one_shot, chunked):
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
    for a, b in zip(one_shot.kv_caches, chunked.kv_caches, strict=True):
        used = -(-len(prompt) // 4)
        torch.testing.assert_close(a[:, :used].flatten(1, 2)[:, :len(prompt)],
                                   b[:, :used].flatten(1, 2)[:, :len(prompt)], atol=1e-5, rtol=0)


def test_mixed_prefill_and_decode_step_matches_separate(llama_path):
    """A step that mixes a prefill chunk with decodes gives each request its solo logits."""
    engine = make_engine(llama_path, block_size=4, max_num_batched_tokens=6)
    prompts = _prompts(engine.model_config.vocab_size, [5, 14])
    solo = [greedy(engine, [p], 8)[0] for p in prompts]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = engine.add_request(prompts[0], params)
    engine.step()  # first is prefilled and samples its first token
    second = engine.add_request(prompts[1], params)
    while engine.has_unfinished():
        engine.step()
    assert [first.output_token_ids, second.output_token_ids] == solo


def test_abort_returns_blocks(llama_path):
    engine = make_engine(llama_path, block_size=4, max_num_batched_tokens=4)
    prompts = _prompts(engine.model_config.vocab_size, [10, 10, 10])
    params = SamplingParams(max_tokens=10, temperature=0.0)
    waiting, prefilling, decoding = (engine.add_request(p, params) for p in prompts)
    engine.step()
    engine.step()
    engine.step()  # decoding: prefilled (10 tokens in 3 chunks of 4), has tokens
    engine.abort(decoding.request_id)
    assert decoding.finish_reason == "abort"
    engine.step()
    engine.abort(prefilling.request_id)
    engine.abort(waiting.request_id)
    assert not engine.has_unfinished()
    assert engine.num_free_blocks == engine.pool.num_blocks


def test_stop_token_ids_and_max_tokens(llama_path):
    engine = make_engine(llama_path)
    prompt = _prompts(engine.model_config.vocab_size, [6])[0]
    tokens = greedy(engine, [prompt], 12)[0]
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    request = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at]))
    while engine.has_unfinished():
        engine.step()
    assert request.output_token_ids == tokens[:first + 1]
    assert (request.finish_reason, request.stop_reason) == ("stop", stop_at)
    # min_tokens suppresses the stop token until reached.
    request = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_at],
                                                        min_tokens=first + 2))
    while engine.has_unfinished():
        engine.step()
    assert len(request.output_token_ids) >= first + 2
    assert stop_at not in request.output_token_ids[:first + 2]


def test_eos_stops_unless_ignored(tiny_hf_model):
    from tokenmill.checkpoint import open_checkpoint
    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import LLMEngine

    path = tiny_hf_model("llama")
    plain = make_engine(path)
    prompt = _prompts(plain.model_config.vocab_size, [6])[0]
    tokens = greedy(plain, [prompt], 12)[0]
    eos = tokens[3]
    engine = LLMEngine(open_checkpoint(path), EngineConfig(dtype="float32"), frozenset({eos}))
    stopped = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    ignored = engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert stopped.output_token_ids == tokens[:tokens.index(eos) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", None)
    assert ignored.output_token_ids == tokens and ignored.finish_reason == "length"


def test_bad_requests_are_clear_errors(llama_path):
    engine = make_engine(llama_path, max_model_len=64)
    vocab = engine.model_config.vocab_size
    with pytest.raises(TokenmillError, match="prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(TokenmillError, match="out of range"):
        engine.add_request([1, vocab], SamplingParams())
    with pytest.raises(TokenmillError, match="max_model_len"):
        engine.add_request([1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(TokenmillError, match="max_model_len"):
        engine.add_request([1] * 64, SamplingParams(max_tokens=None))
    with pytest.raises(TokenmillError, match="logit_bias"):
        engine.add_request([1, 2], SamplingParams(logit_bias={vocab + 5: 1.0}))
    # max_tokens=None fills the context.
    request = engine.add_request([1] * 60, SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(request.output_token_ids) == 4 and request.finish_reason == "length"
    assert engine.num_free_blocks == engine.pool.num_blocks


def test_decode_logits_match_prefill_logits(llama_path):
    """The batched decode attention path equals the varlen prefill path row for row."""
    engine = make_engine(llama_path, block_size=4)
    prompt = _prompts(engine.model_config.vocab_size, [9])[0]
    tokens = greedy(engine, [prompt], 6)[0]
    full = prefill_logits(engine, prompt + tokens)
    request = engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, logprobs=0))
    while engine.has_unfinished():
        engine.step()
    expected = torch.log_softmax(full[len(prompt) - 1:-1], -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([lp for lp, _ in request.logprobs]), expected, atol=1e-4, rtol=0)
