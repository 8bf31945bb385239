"""Builds the packed batch for one step, runs the model, samples the rows that need a token.

Per step: input_ids[T], positions[T], AttentionMetadata (see layers/attention.py for the layout)
and `logits_rows`, the last row of every request whose computed tokens reach its total this step
(a prefill chunk that ends mid-prompt needs no logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.engine.request import Request
from tokenmill.layers.attention import AttentionMetadata, bind_kv_caches
from tokenmill.sampling import Sampler, SamplingBatch


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]]


class ModelRunner:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 vocab_size: int, device: torch.device, attention_backend: str = "auto"):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        bind_kv_caches(model, kv_caches, attention_backend)

    def prepare(self, scheduled: list[tuple[Request, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                      list[int], list[Request]]:
        ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sampled: list[Request] = []
        for request, n in scheduled:
            start = request.num_computed_tokens
            ids.extend(request.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
            if start + n == request.num_tokens:
                logits_rows.append(query_start_loc[-1] - 1)
                sampled.append(request)
        max_blocks = max(len(r.block_ids) for r, _ in scheduled)
        block_tables = torch.tensor([r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r, _ in scheduled],
                                    dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        row_request = torch.repeat_interleave(torch.arange(len(scheduled)),
                                              torch.tensor([n for _, n in scheduled]))
        slot_mapping = block_tables[row_request, pos // self.block_size] * self.block_size + pos % self.block_size
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables.to(self.device),
            slot_mapping=slot_mapping.to(self.device),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64, device=self.device),
            block_size=self.block_size,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return input_ids, pos.to(self.device), meta, logits_rows, sampled

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> list[tuple[Request, SampledToken]]:
        """Run one step; returns a sampled token for each request that completed its tokens."""
        input_ids, positions, meta, logits_rows, sampled = self.prepare(scheduled)
        hidden = self.model(input_ids, positions, meta)
        if not sampled:
            return []
        logits = self.model.compute_logits(hidden[torch.tensor(logits_rows, device=self.device)])
        batch = SamplingBatch.build(
            params=[r.params for r in sampled],
            prompt_ids=[r.prompt_token_ids for r in sampled],
            output_ids=[r.output_token_ids for r in sampled],
            generators=[r.generator for r in sampled],
            vocab_size=logits.shape[-1],
            eos_token_ids=[r.eos_token_ids for r in sampled],
            device=self.device,
            grammar_masks=[r.grammar.mask if r.grammar is not None else None for r in sampled],
        )
        out = self.sampler(logits, batch)
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        results = []
        for i, request in enumerate(sampled):
            k = request.params.logprobs
            lp = logprobs[i] if (logprobs is not None and k is not None) else None
            top = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True)) if (k and top_ids is not None) else []
            results.append((request, SampledToken(token_ids[i], lp, top)))
        return results
