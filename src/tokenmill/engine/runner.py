"""Builds the packed batch for one step, runs the model, samples the rows that need a token.

Per step: input_ids[T], positions[T], AttentionMetadata (see layers/attention.py for the layout)
and `logits_rows`, the last row of every request whose computed tokens reach its total this step
(a prefill chunk that ends mid-prompt needs no logits), and the prompt rows of a request that
asked for its prompt's log-probabilities (Rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.engine.request import Request
from tokenmill.layers.attention import AttentionMetadata, bind_kv_caches
from tokenmill.parallel import ParallelError
from tokenmill.sampling import Sampler, SamplingBatch

if TYPE_CHECKING:   # (a worker process runs a ModelRunner: workers.py imports this module)
    from tokenmill.engine.workers import TPWorkers


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]]


@dataclass
class Rows:
    """Whose rows a step's logits are, in the order of the scheduled requests: those of each request
    that samples (1 + len(spec_token_ids) rows: `sampled`, at `sample_index`), after, for a request
    scoring its prompt (params.prompt_logprobs), the rows whose next token is a prompt token
    (`scored`: (request, first, end), its positions first .. end - 1, at `score_index`)."""

    sampled: list[Request] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)
    scored: list[tuple[Request, int, int]] = field(default_factory=list)
    score_index: list[int] = field(default_factory=list)


def score_prompts(logits: torch.Tensor, index: list[int], scored: list[tuple[Request, int, int]]) -> None:
    """Append to each scored request's prompt_logprobs those of its prompt tokens first + 1 .. end,
    from the rows `index` of `logits` (its positions first .. end - 1, request after request):
    each one's raw log-probability, its rank (1: the most likely) and the prompt_logprobs most
    likely tokens. SCORE_ROWS rows at a time, so that a long prompt chunk adds no more than that
    many rows to its logits (which the LM head computed for every scored row)."""
    targets = torch.tensor([t for r, first, end in scored for t in r.prompt_token_ids[first + 1:end + 1]],
                           device=logits.device)
    k = max(r.params.prompt_logprobs for r, _, _ in scored)
    chosen: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    for start in range(0, len(targets), SCORE_ROWS):
        rows = torch.tensor(index[start:start + SCORE_ROWS], device=logits.device)
        logprobs = logits.index_select(0, rows).float().log_softmax(dim=-1)
        mine = logprobs.gather(1, targets[start:start + SCORE_ROWS].unsqueeze(1))
        ranks += (logprobs > mine).sum(dim=-1).add_(1).tolist()
        chosen += mine.squeeze(1).tolist()
        if k:
            top = logprobs.topk(k, dim=-1)
            top_ids += top.indices.tolist()
            top_lps += top.values.tolist()
    row = 0
    for request, first, end in scored:
        n = request.params.prompt_logprobs
        for i in range(row, row + end - first):
            top_i = list(zip(top_ids[i][:n], top_lps[i][:n], strict=True)) if n else []
            request.prompt_logprobs.append((chosen[i], ranks[i], top_i))
        row += end - first


# Prompt rows score_prompts turns into log-probabilities at a time.
SCORE_ROWS = 256


class ModelRunner:
    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 vocab_size: int, device: torch.device, attention_backend: str = "auto",
                 workers: TPWorkers | None = None, layer_groups: tuple[int, ...] | None = None):
        """`workers`: the tensor-parallel ranks that run each step with this one (engine/workers.py).
        `layer_groups`: each layer's KV cache group (engine/kv_cache.py KVLayout; default: one group)."""
        self.model = model
        self.workers = workers
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler()
        # A request scheduled with at most this many rows enters attention as single-query entries,
        # as a verifying one does (prepare): a draft model's catch-up rows (speculative.py) then run
        # as a decode step, one C call for the whole stack, not the layer loop with a prefill
        # call per request and layer. 0 for a target model, whose prompt rows keep the prefill path.
        self.single_query_rows = 0
        bind_kv_caches(model, kv_caches, attention_backend, layer_groups)

    def prepare(self, scheduled: list[tuple[Request, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                      list[int], Rows]:
        """The packed batch. A request verifying k proposed tokens (`spec_token_ids`, scheduled with
        its one uncomputed token: n = k + 1), or one of at most `single_query_rows` rows, enters
        attention as n single-query entries over its block tables, at consecutive positions: every
        row writes its K/V before any row attends (layers/attention.py), so entry j sees the keys of
        the rows before it, and the step stays a decode step (the C decode stack) with each row
        computed exactly as a plain decode would."""
        ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        owners: list[Request] = []   # each attention entry's request
        logits_rows: list[int] = []
        whose = Rows()
        bs = self.block_size
        slots: list[list[int]] = [[] for _ in scheduled[0][0].tables]   # per KV cache group, per row
        for request, n in scheduled:
            start = request.num_computed_tokens
            spec = request.spec_token_ids
            ids.extend(request.all_token_ids[start:start + n] if not spec else request.all_token_ids[start:] + spec)
            positions.extend(range(start, start + n))
            for group_slots, table in zip(slots, request.tables, strict=True):
                blocks = table.block_ids
                group_slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            single = spec or n <= self.single_query_rows
            entries = [(1, start + j + 1) for j in range(n)] if single else [(n, start + n)]
            for rows, seq_len in entries:   # (query rows, context length once written)
                query_start_loc.append(query_start_loc[-1] + rows)
                seq_lens.append(seq_len)
                owners.append(request)
            if request.needs_prompt_logprobs:
                # the rows of this chunk whose next token is a prompt token not scored yet
                first = max(start, len(request.prompt_logprobs))
                end = min(start + n, len(request.prompt_token_ids) - 1)
                if first < end:
                    whose.score_index.extend(range(len(logits_rows), len(logits_rows) + end - first))
                    logits_rows.extend(range(len(ids) - n + first - start, len(ids) - n + end - start))
                    whose.scored.append((request, first, end))
            if start + n == request.num_tokens + len(spec):
                whose.sample_index.extend(range(len(logits_rows), len(logits_rows) + 1 + len(spec)))
                logits_rows.extend(range(len(ids) - 1 - len(spec), len(ids)))
                whose.sampled.append(request)
        seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int64, device=self.device)
        groups = []   # the metadata of each KV cache group: the same rows over the group's own block tables
        for group, group_slots in enumerate(slots):
            tables = [r.tables[group].block_ids for r in owners]
            max_blocks = max(len(t) for t in tables)
            block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64,
                                        device=self.device)
            groups.append(AttentionMetadata(query_start_loc=query_start_loc, seq_lens=seq_lens,
                                            block_tables=block_tables,
                                            slot_mapping=torch.tensor(group_slots, dtype=torch.int64,
                                                                      device=self.device),
                                            seq_lens_tensor=seq_lens_tensor, block_size=bs))
        meta = groups[0]
        meta.other_groups = tuple(groups[1:])
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return input_ids, torch.tensor(positions, dtype=torch.int64, device=self.device), meta, logits_rows, whose

    def logits(self, scheduled: list[tuple[Request, int]]) -> tuple[torch.Tensor | None, Rows]:
        """Run the model on one step's batch: the logits of the rows that need them ([rows, V], in
        request order) and whose rows they are. Under tensor parallelism the batch goes to the
        workers first, which run it with this process."""
        input_ids, positions, meta, logits_rows, whose = self.prepare(scheduled)
        if self.workers is None:
            return self.run(input_ids, positions, meta, logits_rows), whose
        try:
            self.workers.step((input_ids, positions, meta, logits_rows))
            return self.run(input_ids, positions, meta, logits_rows), whose
        except ParallelError as e:
            raise self.workers.explain(e) from e
        except Exception as e:   # this rank stopped mid-forward: the others may be waiting in a collective
            self.workers.broken = True
            raise ParallelError(f"a tensor-parallel step failed on rank 0 ({type(e).__name__}: {e}); the ranks "
                                f"are out of step") from e

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logits_rows: list[int]) -> torch.Tensor | None:
        """The forward pass of a packed batch: the logits of `logits_rows` (None if there are none, or
        on a tensor-parallel worker, whose LM head part is gathered on rank 0)."""
        hidden = self.model(input_ids, positions, meta)
        if not logits_rows:
            return None
        if len(logits_rows) < hidden.shape[0]:   # (distinct and increasing: as many as the rows are all of them)
            hidden = hidden[torch.tensor(logits_rows, device=self.device)]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]]) -> list[tuple[Request, list[SampledToken]]]:
        """Run one step; returns the new tokens of each request that completed its tokens: one, or,
        verifying proposed tokens, those accepted and the target's own token after them."""
        logits, whose = self.logits(scheduled)
        if logits is None:
            return []
        if whose.scored:
            score_prompts(logits, whose.score_index, whose.scored)
            if not whose.sampled:
                return []
            logits = logits[torch.tensor(whose.sample_index, device=self.device)]
        sampled = whose.sampled
        # Row j of a request verifying proposals d_1..d_k samples what follows d_1..d_j: its output
        # so far includes them (penalties, min_tokens), its mask is the grammar's after them.
        rows = [(r, j) for r in sampled for j in range(len(r.spec_token_ids) + 1)]
        batch = SamplingBatch.build(
            params=[r.params for r, _ in rows],
            prompt_ids=[r.prompt_token_ids for r, _ in rows],
            output_ids=[r.output_token_ids + r.spec_token_ids[:j] if j else r.output_token_ids for r, j in rows],
            generators=[r.generator for r, _ in rows],
            vocab_size=logits.shape[-1],
            eos_token_ids=[r.eos_token_ids for r, _ in rows],
            device=self.device,
            grammar_masks=[None if r.grammar is None else r.spec_masks[j] if r.spec_token_ids else r.grammar.mask
                           for r, j in rows],
            noise=[None if r.spec_noise is None else r.spec_noise[j] for r, j in rows],
        )
        out = self.sampler(logits, batch)
        token_ids = out.token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_logprob_ids.tolist() if out.top_logprob_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        results = []
        row = 0
        for request in sampled:
            # Each row's token is the target's own sample there (the same draw as without
            # speculation); a proposal is accepted while it equals it, and the first row whose
            # sample differs (or the row after the last proposal) gives the target's token.
            tokens = []
            k = request.params.logprobs
            for j in range(len(request.spec_token_ids) + 1):
                i = row + j
                lp = logprobs[i] if (logprobs is not None and k is not None) else None
                top = list(zip(top_ids[i][:k], top_lps[i][:k], strict=True)) if (k and top_ids is not None) else []
                tokens.append(SampledToken(token_ids[i], lp, top))
                if j == len(request.spec_token_ids) or token_ids[i] != request.spec_token_ids[j]:
                    break
            results.append((request, tokens))
            row += len(request.spec_token_ids) + 1
        return results
