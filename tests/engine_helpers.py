"""Test helpers that drive the engine directly on token ids (no tokenizer involved)."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.checkpoint import open_checkpoint
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.sampling import SamplingParams


def make_engine(path: str | Path, dtype: str = "float32", **kwargs) -> LLMEngine:
    return LLMEngine(open_checkpoint(path), EngineConfig(dtype=dtype, **kwargs), frozenset())


def prefill_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of one packed prefill of `ids` through the engine's model and cache,
    on the host (the references they are compared with are computed on the CPU)."""
    # Compute every position: a prefix-cache hit would skip rows whose logits we want.
    engine.kv.enable_prefix_caching, enabled = False, engine.kv.enable_prefix_caching
    try:
        request = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0))
        scheduled = engine.scheduler.schedule().scheduled
    finally:
        engine.kv.enable_prefix_caching = enabled
    assert scheduled == [(request, len(ids))], "the prompt must fit one step"
    input_ids, positions, meta, _, _ = engine.runner.prepare(scheduled)
    with torch.inference_mode():
        logits = engine.model.compute_logits(engine.model(input_ids, positions, meta))
    engine.abort(request.request_id)
    return logits.cpu()


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of all prompts, submitted together (the engine batches them)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_blocks == engine.pool.num_blocks, "blocks leaked"
    return [r.output_token_ids for r in requests]
