"""Pure logits processing: raw model logits -> the logits the sampler draws from.

`processed_logits` applies, in this order (vLLM's order, except that min-p comes last):

    grammar mask -> logit_bias -> min_tokens suppression -> repetition, frequency, presence penalties
    -> temperature -> top-k -> top-p -> min-p

Tokens removed by a filter get logit -inf, so `processed_logits(...).softmax(-1)` is exactly the
distribution a request samples from. Every step is a tensor op over all B rows; features no row
uses are None in the batch and skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.sampling.batch import SamplingBatch


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] float32 logits after every step above; `logits` (any float dtype) is not modified."""
    logits = logits.to(torch.float32, copy=True)
    if batch.banned is not None:
        logits.masked_fill_(batch.banned, float("-inf"))
    if batch.bias_index is not None:
        logits.index_put_(batch.bias_index, batch.bias_values, accumulate=True)
    if batch.suppress_index is not None:
        logits.index_put_(batch.suppress_index, torch.tensor(float("-inf"), device=logits.device))
    logits = apply_penalties(logits, batch)
    if not batch.all_greedy:   # (greedy rows' temperature is 1)
        logits /= batch.temperature.unsqueeze(1)
    if batch.top_k is not None:
        logits = filter_top_k_top_p(logits, batch.top_k, batch.top_p)
    if batch.min_p is not None:
        logits = filter_min_p(logits, batch.min_p)
    return logits


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, then OpenAI frequency and presence
    penalties over output tokens."""
    counts = batch.output_counts
    if batch.repetition_penalty is not None:
        seen = batch.prompt_mask | (counts > 0)
        penalty = batch.repetition_penalty.unsqueeze(1)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty.unsqueeze(1) * (counts > 0)
    return logits


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the top_k most likely tokens, then the nucleus of mass top_p among them.

    One descending sort serves both. Ties at either boundary are kept (every token whose logit
    equals the last one kept survives), so the result does not depend on how the sort orders
    equal logits. Top-p sees the distribution renormalized after top-k, as in HF and vLLM.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth_largest = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
    keep = sorted_logits >= kth_largest
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))

    probs = sorted_logits.softmax(dim=-1)
    mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # exclusive cumsum; 0 at position 0
    # >= 1 whenever top_p > 0 (SamplingParams refuses values that round to 0 in float32); the
    # clamp keeps the most likely token even so, instead of indexing position -1.
    num_needed = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_min_(1)
    last_needed = sorted_logits.gather(1, num_needed - 1)
    # top_p = 1 keeps everything even where float rounding makes the cumsum reach 1 early.
    keep &= (sorted_logits >= last_needed) | (top_p >= 1.0).unsqueeze(1)

    keep_unsorted = torch.empty_like(keep).scatter_(1, order, keep)
    return logits.masked_fill(~keep_unsorted, float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is >= min_p times the row's largest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))
