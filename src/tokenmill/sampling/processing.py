"""Pure logits processing: raw model logits -> the logits the sampler draws from.

`processed_logits` applies, in this order (vLLM's order, except that min-p comes last):

    grammar mask -> logit_bias -> min_tokens suppression -> repetition, frequency, presence penalties
    -> temperature -> top-k -> top-p -> min-p

Tokens removed by a filter get logit -inf, so `processed_logits(...).softmax(-1)` is exactly the
distribution a request samples from. The sampler itself stops before top-k (`logits_before_top_k`)
and draws most rows' top-k from their largest logits and top-p and min-p token by token
(sampler.sample_top_k, sampler.sample_nucleus), from the same distribution. Every step is a tensor
op over all B rows; features no row uses are None in the batch and skipped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.sampling.batch import SamplingBatch


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] float32 logits after every step above; `logits` (any float dtype) is not modified."""
    return nucleus_filtered(top_k_filtered(logits_before_top_k(logits, batch), batch.top_k), batch.top_p, batch.min_p)


def logits_before_top_k(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """processed_logits up to the temperature, as a new float32 tensor: what the sampler starts
    from (sampler.sample_top_k), taking top-k, top-p and min-p token by token instead of filtering."""
    logits = logits.to(torch.float32, copy=True)
    if batch.banned is not None:
        logits.masked_fill_(batch.banned, float("-inf"))
    if batch.bias_index is not None:
        logits.index_put_(batch.bias_index, batch.bias_values, accumulate=True)
    if batch.suppress_index is not None:
        logits.index_put_(batch.suppress_index, torch.tensor(float("-inf"), device=logits.device))
    apply_penalties_(logits, batch)
    if not batch.all_greedy:   # (greedy rows' temperature is 1)
        logits /= batch.temperature.unsqueeze(1)
    return logits


def top_k_filtered(logits: torch.Tensor, top_k: torch.Tensor | None) -> torch.Tensor:
    """Top-k (None: no row uses it): the tokens below each row's k-th largest logit get -inf."""
    if top_k is None:
        return logits
    return filter_top_k_top_p(logits, top_k, torch.ones(top_k.shape, device=logits.device))


def nucleus_filtered(logits: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """Top-p, then min-p, on logits after top-k (None: no row uses it). Top-p sees the distribution
    renormalized after top-k: the logsumexp of the row, whose removed tokens are -inf."""
    if top_p is not None:
        full = torch.full_like(top_p, logits.shape[1], dtype=torch.int64)
        logits = filter_top_k_top_p(logits, full, top_p)
    if min_p is not None:
        logits = filter_min_p(logits, min_p)
    return logits


def apply_penalties_(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place: repetition penalty over prompt + output tokens, then OpenAI frequency and presence
    penalties over output tokens. Only the tokens each row has seen change, so only those are read
    and written."""
    if batch.repeated_index is not None:
        rows, token_ids = batch.repeated_index
        # every value is read before any is written, so a token listed twice is penalized once
        seen = logits[rows, token_ids]
        penalty = batch.repetition_penalty[rows]
        logits[rows, token_ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if batch.output_index is not None:
        rows, token_ids = batch.output_index
        seen = logits[rows, token_ids]
        if batch.frequency_penalty is not None:
            seen = seen - batch.frequency_penalty[rows] * batch.output_counts
        if batch.presence_penalty is not None:
            seen = seen - batch.presence_penalty[rows]
        logits[rows, token_ids] = seen


# Candidate counts tried before a full sort: top-k of a row is far cheaper than sorting its whole
# vocabulary, and a model's nucleus is rarely wider than a few hundred tokens.
CANDIDATES = (256, 4096)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the top_k most likely tokens, then the nucleus of mass top_p among them.

    Both filters keep the tokens at or above a threshold logit, so ties at either boundary are kept
    (every token whose logit equals the last one kept survives), and the result does not depend on
    how a sort orders equal logits. Top-p sees the distribution renormalized after top-k, as in HF
    and vLLM. On a CPU, a row's thresholds come from its largest CANDIDATES[0] logits in descending
    order when those decide them (they hold the top-k, all its ties, and at least top_p of the
    mass), else from more candidates, and at last from the whole row sorted.
    """
    vocab = logits.shape[1]
    normalizer = logits.logsumexp(dim=-1)   # of the rows without top-k: their whole row
    if logits.device.type == "cpu":
        threshold = _staged_thresholds(logits, top_k, top_p, normalizer)
    else:
        # one sort of every row: the stages need to know how many rows each decided, a host sync on
        # an accelerator (where the sort is fast anyway)
        threshold, _ = _thresholds(logits.sort(dim=-1, descending=True).values, vocab, top_k, top_p, normalizer)
    return logits.masked_fill(logits < threshold.unsqueeze(1), float("-inf"))


def _staged_thresholds(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       normalizer: torch.Tensor) -> torch.Tensor:
    """[B] threshold logits from each row's top CANDIDATES[0], then CANDIDATES[1], ..., then all of
    it sorted: each row from the first that decides it."""
    rows, vocab = logits.shape
    threshold = torch.empty(rows)
    pending = torch.arange(rows)
    for size in [c for c in CANDIDATES if c < vocab] + [vocab]:
        sub = logits if len(pending) == rows else logits[pending]
        candidates = sub.topk(size, dim=-1).values if size < vocab else sub.sort(dim=-1, descending=True).values
        found, decided = _thresholds(candidates, vocab, top_k[pending], top_p[pending], normalizer[pending])
        threshold[pending[decided]] = found[decided]
        pending = pending[~decided]
        if len(pending) == 0:
            break
    return threshold


def _thresholds(candidates: torch.Tensor, vocab: int, top_k: torch.Tensor, top_p: torch.Tensor,
                normalizer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows given by their largest logits in descending order ([n, C]; C = vocab: the whole
    row): each row's threshold logit, and whether these candidates decide it. `normalizer`: the
    logsumexp of the row's whole logits (used by rows without top-k)."""
    size = candidates.shape[1]
    has_top_k = top_k < vocab
    kth_largest = candidates.gather(1, (top_k.clamp(max=size) - 1).unsqueeze(1)).squeeze(1)
    kept = candidates.masked_fill(candidates < kth_largest.unsqueeze(1), float("-inf"))
    # the kept tokens' own logsumexp: after top-k the distribution is renormalized over them
    normalizer = torch.where(has_top_k, kept.logsumexp(dim=-1), normalizer)
    probs = (kept - normalizer.unsqueeze(1)).exp()
    cumulative = probs.cumsum(dim=-1)
    mass_before = F.pad(cumulative[:, :-1], (1, 0))  # exclusive cumsum; 0 at position 0
    # >= 1 whenever top_p > 0 (SamplingParams refuses values that round to 0 in float32); the
    # clamp keeps the most likely token even so, instead of indexing position -1.
    num_needed = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_min_(1)
    last_needed = candidates.gather(1, num_needed - 1).squeeze(1)
    top_k_floor = torch.where(has_top_k, kth_largest, float("-inf"))
    # top_p = 1 keeps everything even where float rounding makes the cumsum reach 1 early.
    threshold = torch.where(top_p >= 1.0, top_k_floor, torch.maximum(top_k_floor, last_needed))
    if size == vocab:
        return threshold, torch.ones_like(has_top_k)
    # the top-k and every token tied with its last are among the candidates ...
    top_k_inside = ~has_top_k | ((top_k <= size) & (candidates[:, -1] < kth_largest))
    # ... and so is the nucleus: the candidates' mass reaches top_p
    return threshold, top_k_inside & ((top_p >= 1.0) | (cumulative[:, -1] >= top_p))


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is >= min_p times the row's largest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))
