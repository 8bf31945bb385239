"""The batched sampler: [B, V] logits + a SamplingBatch -> one token id per row (and logprobs).

It holds no engine state. Greedy rows take the argmax of their processed logits; when every row
is greedy and nothing can move the argmax (no bias, suppression or penalty), it is one argmax of
the raw logits. A sampled row of a seeded request (and one whose noise was drawn ahead for
speculative decoding) uses the exponential race: token = argmax(probs / q) with q ~ Exponential(1)
per token, which picks token i with probability probs[i]; it draws its q row from its own
generator, so its tokens do not depend on its batch neighbours (with a small top-k, the race runs
over the k largest logits, the noise computed there only: race). The other sampled rows invert their
distribution's CDF at one uniform each from the global generator: the same distribution from one
random number per row instead of one per vocabulary entry (a Mersenne Twister draw per entry cost
more than the rest of the sampler), draw top-k from the row's k largest logits (sample_top_k),
and top-p by rejection (sample_nucleus) rather than find the nucleus.

Log-probabilities are of the RAW model distribution (log_softmax of the logits as given, before
bias, penalties, temperature and filters), as vLLM returns by default; on a row with a grammar,
of that distribution restricted to the tokens the grammar allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.sampling.batch import SamplingBatch
from tokenmill.sampling.processing import logits_before_top_k, nucleus_filtered, top_k_filtered


@dataclass
class SamplerOutput:
    """One step's result for B rows."""

    token_ids: torch.Tensor
    """[B] int64: the chosen token of each row."""
    logprobs: torch.Tensor | None
    """[B] float32: raw log-probability of each chosen token; None if no row asked for logprobs."""
    top_logprob_ids: torch.Tensor | None
    """[B, K] int64, K = the most any row asked for (a row that asked for k uses its first k);
    None if no row asked for top logprobs."""
    top_logprobs: torch.Tensor | None
    """[B, K] float32: raw log-probabilities of `top_logprob_ids`, most likely first."""


class Sampler:
    """Chooses the next token of every row; see the module docstring for the method."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.shape != (batch.num_rows, batch.vocab_size):
            raise ValueError(
                f"logits must have shape [{batch.num_rows}, {batch.vocab_size}] to match the batch, "
                f"got {list(logits.shape)}"
            )
        if batch.all_greedy and not batch.needs_logit_processing:
            token_ids = logits.argmax(dim=-1)
        else:
            token_ids = _choose(logits_before_top_k(logits, batch), batch)

        if batch.num_top_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        raw = logits.float()
        if batch.banned is not None:   # what a constrained row was drawn from: only the allowed tokens
            raw = raw.masked_fill(batch.banned, float("-inf"))
        raw_logprobs = raw.log_softmax(dim=-1)
        sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        if batch.num_top_logprobs == 0:
            return SamplerOutput(token_ids, sampled, None, None)
        top = raw_logprobs.topk(batch.num_top_logprobs, dim=-1)
        return SamplerOutput(token_ids, sampled, top.indices, top.values)


def _choose(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """From logits processed up to the temperature: the argmax on greedy rows (top-k, top-p and
    min-p never remove the most likely token), a draw from the fully processed distribution on the
    others: the exponential race on rows with a seed or given noise (race), sample_top_k on the
    rest (in a batch with racing rows, only on the sampled rows that do not race)."""
    if batch.all_greedy:
        return logits.argmax(dim=-1)
    noises = {row: _own_row_noise(g, batch.vocab_size) for row, g in batch.seeded_rows}
    noises.update((row, RowNoise(noise=given)) for row, given in batch.given_noise)
    if not noises:
        sampled_ids = sample_top_k(logits, batch.top_k, batch.top_p, batch.min_p)
    else:
        sampled_ids = torch.zeros(batch.num_rows, dtype=torch.int64, device=logits.device)
        skipped = set(noises)
        if batch.any_greedy:
            skipped |= {row for row, greedy in enumerate(batch.greedy.tolist()) if greedy}
        drawn = [row for row in range(batch.num_rows) if row not in skipped]
        if drawn:
            sampled_ids[drawn] = sample_top_k(*_rows_of(drawn, logits, batch.top_k, batch.top_p, batch.min_p))
        raced = sorted(noises)
        sampled_ids[raced] = race(*_rows_of(raced, logits, batch.top_k, batch.top_p, batch.min_p),
                                  [noises[row] for row in raced])
    return torch.where(batch.greedy, logits.argmax(dim=-1), sampled_ids) if batch.any_greedy else sampled_ids


@dataclass
class RowNoise:
    """A raced row's Exponential(1) noise over the vocabulary: given whole ([V], drawn ahead), or as
    the float64 uniforms it is computed from (exponential's transform), so that only the entries the
    race reads are computed."""

    noise: torch.Tensor | None = None
    uniform: torch.Tensor | None = None

    def at(self, indices: torch.Tensor | None = None) -> torch.Tensor:
        """The noise at `indices` (None: every entry), float32, at least _TINY."""
        if self.noise is not None:
            picked = self.noise if indices is None else self.noise[indices]
        else:
            picked = exponential_of(self.uniform.clone() if indices is None else self.uniform[indices])
        # a draw is exactly 0 where its uniform is: p / 0 would be inf, or NaN where p is 0, which
        # argmax would pick
        return picked.clamp_min(_TINY)


def race(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
         min_p: torch.Tensor | None, noises: list[RowNoise]) -> torch.Tensor:
    """[R] token ids: the exponential race, argmax(probs / noise), over each row's fully processed
    distribution (processed_logits from here), which draws token i with probability probs[i].

    On a CPU, a row with top_k <= MAX_TOP_K_DRAWN races its k largest logits alone (one `topk`;
    its noise computed there only) where they are its top-k, as sample_top_k draws them: every
    other token has probability 0, so p / noise is 0 there, and equal ratios go to the smallest
    token id as argmax over the whole row would. Other rows race over the whole vocabulary."""
    rows, vocab = logits.shape
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    rest = list(range(rows))
    if logits.device.type == "cpu" and top_k is not None:
        drawn, candidates, indices = _top_k_candidates(logits, top_k)
        if len(drawn):
            probs = nucleus_filtered(candidates, *_rows_of(drawn, top_p, min_p)).softmax(dim=-1)
            ratios = probs.div_(torch.stack([noises[row].at(ix) for row, ix in zip(drawn.tolist(), indices,
                                                                                    strict=True)]))
            best = ratios == ratios.amax(dim=-1, keepdim=True)
            ids[drawn] = torch.where(best, indices, vocab).amin(dim=-1)
            rest = sorted(set(rest) - set(drawn.tolist()))
    if rest:
        filtered = nucleus_filtered(top_k_filtered(*_rows_of(rest, logits, top_k)), *_rows_of(rest, top_p, min_p))
        noise = torch.stack([noises[row].at().to(logits.device) for row in rest])
        ids[rest] = filtered.softmax(dim=-1).div_(noise).argmax(dim=-1)
    return ids


def _top_k_candidates(logits: torch.Tensor, top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows with top_k <= MAX_TOP_K_DRAWN whose k largest logits are their top-k (the token
    after them does not tie with the k-th, which the top-k filter would keep too), ascending, with
    those logits in descending order (-inf past each row's k) and their token ids: one `topk`."""
    narrow = ((top_k <= MAX_TOP_K_DRAWN) & (top_k < logits.shape[1])).nonzero().squeeze(1)
    if not len(narrow):
        return narrow, logits[:0], narrow.unsqueeze(1)
    k = top_k[narrow].unsqueeze(1)
    width = int(k.max())
    values, indices = _rows_of(narrow, logits)[0].topk(width + 1, dim=-1)
    decided = (values.gather(1, k) < values.gather(1, k - 1)).squeeze(1)
    candidates = values[decided, :width]
    candidates.masked_fill_(torch.arange(width) >= k[decided], float("-inf"))
    return narrow[decided], candidates, indices[decided, :width]


def _rows_of(rows: torch.Tensor | list[int], *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Those rows (ascending) of each tensor (None stays None: a filter no row uses); every row is
    the tensor itself, not a copy."""
    return [None if t is None else t if len(rows) == len(t) else t[rows] for t in tensors]


# The largest k that sample_top_k and race draw from the row's k largest logits alone (one `topk`,
# whose cost grows with k); rows with a larger top-k filter the whole row.
MAX_TOP_K_DRAWN = 256


def sample_top_k(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                 min_p: torch.Tensor | None) -> torch.Tensor:
    """[B] token ids, each row's drawn from processed_logits' distribution given its logits before
    top-k (None: no row uses the filter).

    On a CPU, a row with top_k <= MAX_TOP_K_DRAWN draws from its k largest logits (one `topk`) where
    they are its top-k: unless the token after them ties with the k-th, which the top-k filter would
    keep too. Top-p and min-p of the top-k's renormalized distribution are the same on those k
    candidates as on the row with every other token at -inf. Other rows (every row off the CPU,
    where counting them would wait for the device) filter the whole row first."""
    if top_k is None:
        return sample_nucleus(logits, top_p, min_p)
    rows = logits.shape[0]
    ids = torch.empty(rows, dtype=torch.int64, device=logits.device)
    rest = torch.arange(rows, device=logits.device)
    if logits.device.type == "cpu":
        drawn, candidates, indices = _top_k_candidates(logits, top_k)
        if len(drawn):
            positions = sample_nucleus(candidates, *_rows_of(drawn, top_p, min_p))
            ids[drawn] = indices.gather(1, positions.unsqueeze(1)).squeeze(1)
            left = torch.ones(rows, dtype=torch.bool)
            left[drawn] = False
            rest = rest[left]
    if len(rest):
        logits, top_k, top_p, min_p = _rows_of(rest, logits, top_k, top_p, min_p)
        ids[rest] = sample_nucleus(top_k_filtered(logits, top_k), top_p, min_p)
    return ids


# Draws per row before sample_nucleus takes a row's nucleus by thresholds instead (a few are typical).
MAX_ROUNDS = 16


def sample_nucleus(logits: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """[B] token ids, each row's drawn from softmax(logits) restricted to its top-p nucleus and the
    tokens min-p keeps (nucleus_filtered's distribution; None: no row uses the filter).

    On a CPU, without finding the nucleus (a sort, or top-k passes, per row): a token t is in it when
    the tokens strictly more likely than t hold less than top_p of the mass (the set
    filter_top_k_top_p's threshold keeps). Draw t from the row's probabilities over a set S (at
    first every token min-p keeps); if t is outside the nucleus, S becomes the tokens of S more
    likely than t, which still holds the whole nucleus (its most likely tokens), and the row draws
    again. The first draw inside the nucleus is distributed as the probabilities restricted to it,
    since every round's draw is, given that it lands there. Rows still drawing after MAX_ROUNDS,
    and every row on other devices (counting the rows still drawing would wait for the device),
    take the nucleus by thresholds."""
    rows = logits.shape[0]
    if logits.device.type != "cpu":
        return _draw_by_thresholds(logits, top_p, min_p)
    probs = logits.softmax(dim=-1)
    weights = probs if min_p is None else \
        probs.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0.0)
    ids = inverse_cdf(weights, _uniform(rows, logits.device))
    if top_p is None:
        return ids
    # the rows still drawing (at first every row), and their rows of each tensor
    pending, mine_ids, mine_top_p = torch.arange(rows), ids, top_p
    mine, mine_probs, mine_weights, mine_max = logits, probs, weights, logits.amax(dim=-1)
    for _ in range(MAX_ROUNDS):
        drawn = mine.gather(1, mine_ids.unsqueeze(1))
        # only rows a bound cannot decide sum the mass above their token (most draws are decided)
        unsure = (~surely_in_nucleus(drawn.squeeze(1), mine_probs.gather(1, mine_ids.unsqueeze(1)).squeeze(1),
                                     mine_max, mine_top_p)).nonzero().squeeze(1)
        if len(unsure) == 0:
            return ids
        in_doubt, doubt_probs = _rows_of(unsure, mine, mine_probs)
        above = doubt_probs.masked_fill(in_doubt <= drawn[unsure], 0.0).sum(dim=-1)
        outside = unsure[above >= mine_top_p[unsure]]
        if len(outside) == 0:
            return ids
        pending, drawn = pending[outside], drawn[outside]
        mine, mine_probs, mine_top_p, mine_max = _rows_of(outside, mine, mine_probs, mine_top_p, mine_max)
        mine_weights = mine_weights[outside].masked_fill_(mine <= drawn, 0.0)
        ids[pending] = mine_ids = inverse_cdf(mine_weights, _uniform(len(pending), logits.device))
    ids[pending] = _draw_by_thresholds(*_rows_of(pending, logits, top_p, min_p))
    return ids


# How far below top_p the mass of a drawn token's other tokens must be for surely_in_nucleus: far
# more than a float32 sum of a vocabulary's probabilities can be off (the exact test sums them).
NUCLEUS_MARGIN = 1e-4


def surely_in_nucleus(drawn_logit: torch.Tensor, drawn_prob: torch.Tensor, max_logit: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """[B] bool: the drawn token is in its row's top-p nucleus by a bound, without summing the mass
    of the tokens more likely than it: top_p is 1 (every token is kept), none is more likely (it
    has the largest logit), or all the other tokens together hold less than top_p. False means
    undecided."""
    return (top_p >= 1.0) | (drawn_logit >= max_logit) | (1.0 - drawn_prob < top_p - NUCLEUS_MARGIN)


def _draw_by_thresholds(logits: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """sample_nucleus's draw with the nucleus found first: nucleus_filtered, then the inverse CDF."""
    return inverse_cdf(nucleus_filtered(logits, top_p, min_p).softmax(dim=-1), _uniform(logits.shape[0], logits.device))


def _uniform(rows: int, device: torch.device) -> torch.Tensor:
    """[rows] float64 uniforms in [0, 1) from the global generator."""
    return torch.rand(rows, dtype=torch.float64, device=device)


# Entries per block of inverse_cdf's two-level CDF.
CDF_BLOCK = 256


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[B] token ids: row b's id is where its CDF (probs[b] / probs[b].sum()) first exceeds
    uniform[b] ([B] float64 in [0, 1)), i.e. a draw from that distribution.

    In two levels, so that no float64 copy of the whole row is made: the CDF of blocks of CDF_BLOCK
    tokens (each block's float32 sum, run in float64) finds the point's block, then the float64
    running sum of that block's entries alone finds the token, at the same share of the block's
    mass. A float32 running sum over a whole vocabulary would round by up to ~V ulps, moving that
    much mass between tokens; here each token's probability is off by the relative rounding of its
    block's float32 sum, as small as that of the float32 probabilities themselves. The point is
    kept below the total (u x total can round up to it) and below its block's running sum, and a
    token of probability 0 adds nothing to the CDF, so the first entry above the point is never one."""
    rows, vocab = probs.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    pad = -vocab % CDF_BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(rows, -1, CDF_BLOCK)
    block_sums = blocks.sum(dim=-1)
    block_cdf = block_sums.double().cumsum_(dim=-1)
    total = block_cdf[:, -1:]
    point = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    # (clamped: a row of NaN or of zeros, which no model step gives, has no block past its point; it
    # yields a token in range, not an index past the last block, which a device would assert on)
    block = torch.searchsorted(block_cdf, point, right=True).clamp_(max=blocks.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), 0.0)
    inside = blocks.gather(1, block.unsqueeze(2).expand(-1, -1, CDF_BLOCK)).squeeze(1).double().cumsum_(dim=-1)
    last = inside[:, -1:]
    offset = (point - before) / block_sums.gather(1, block).double() * last
    offset = torch.minimum(offset, torch.nextafter(last, torch.zeros_like(last)))
    return (block * CDF_BLOCK + torch.searchsorted(inside, offset, right=True)).squeeze(1).clamp_(max=vocab - 1)


_TINY = torch.finfo(torch.float32).tiny


def exponential(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """float32 Exponential(1) draws of `shape` on `device`, from `generator` (None: the global one).

    On a CPU, -log1p(-u) of float64 uniforms u: the values Tensor.exponential_ returns and the
    generator state it leaves (it draws the same uniform per value and applies the same transform),
    with a vectorized log1p where exponential_ calls the scalar one per value (most of a sampled
    step's sampler time went there). Other devices run exponential_ itself (one fused kernel)."""
    if torch.device(device).type == "cpu":
        return exponential_of(torch.rand(shape, dtype=torch.float64, generator=generator))
    return torch.empty(shape, device=device).exponential_(generator=generator)


def exponential_of(uniform: torch.Tensor) -> torch.Tensor:
    """float32 -log1p(-u) of float64 uniforms (overwritten): exponential's transform, elementwise,
    so that it gives the same value for an entry computed alone as in its whole row."""
    return uniform.neg_().log1p_().neg_().float()


def _own_noise(generator: torch.Generator, vocab_size: int) -> torch.Tensor:
    """One row's draw from a request's own generator, on the generator's device: what one sampling
    step consumes from it."""
    return exponential((vocab_size,), generator, generator.device)


def _own_row_noise(generator: torch.Generator, vocab_size: int) -> RowNoise:
    """What one sampling step consumes from a request's own generator: on a CPU the uniforms of its
    noise (RowNoise computes the noise where the race reads it), else the noise itself."""
    if generator.device.type == "cpu":
        return RowNoise(uniform=torch.rand(vocab_size, dtype=torch.float64, generator=generator))
    return RowNoise(noise=_own_noise(generator, vocab_size))


def draw_noise(generator: torch.Generator | None, rows: int, vocab_size: int,
               device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The noise of a request's next `rows` sampling steps, drawn ahead ([rows, V]; speculative
    decoding samples the draft and verifies with it). From the request's own generator, row by row
    exactly as that many steps would draw, with the generator's state before each row and after the
    last, so that a caller that uses only the first r rows rewinds it to states[r] and the
    request's later tokens are those it would have had without drawing ahead; else from the
    global generator (states None)."""
    if generator is None:
        return exponential((rows, vocab_size), None, device).clamp_min_(_TINY), None
    states, noise = [generator.get_state()], []
    for _ in range(rows):
        noise.append(_own_noise(generator, vocab_size))
        states.append(generator.get_state())
    return torch.stack(noise).to(device).clamp_min_(_TINY), states
