"""SamplingBatch: one step's sampling parameters for B requests, packed into tensors once.

The sampler then works on whole [B, V] tensors with per-row parameter vectors and never loops
over requests. A feature no row uses is stored as None and skipped entirely, so a batch of plain
requests pays nothing for penalties, biases or filters.

Token-level inputs (logit bias, tokens suppressed by `min_tokens`, the tokens that penalties
change) are sparse: flat (row, token id) index pairs for indexing and `Tensor.index_put_`. A
penalty changes only the tokens a request has seen, a few thousand of a row's V, so its cost
follows the prompt and output lengths, not B x V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from tokenmill.sampling.params import SamplingParams

TokenIndex = tuple[torch.Tensor, torch.Tensor]
"""(rows, token_ids): two equal-length int64 vectors addressing entries of a [B, V] tensor."""


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step's B requests, as tensors on the logits' device."""

    num_rows: int
    vocab_size: int
    temperature: torch.Tensor
    """[B] float32; 1.0 on greedy rows, whose temperature is never applied."""
    greedy: torch.Tensor
    """[B] bool: rows that take the argmax of their processed logits."""
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None
    """[B] int64 in [1, V]; V on rows without top-k. None when no row uses top-k."""
    top_p: torch.Tensor | None
    """[B] float32 in (0, 1]; 1 on rows without top-p. None when no row uses top-p."""
    min_p: torch.Tensor | None
    """[B] float32 in [0, 1]. None when no row uses min-p."""
    repetition_penalty: torch.Tensor | None
    """[B] float32 (1 = off). None when no row uses it."""
    presence_penalty: torch.Tensor | None
    """[B] float32 (0 = off). None when no row uses it."""
    frequency_penalty: torch.Tensor | None
    """[B] float32 (0 = off). None when no row uses it."""
    repeated_index: TokenIndex | None
    """Every token of the prompt and the output of each row with a repetition penalty; a token
    can occur more than once. None when no row uses the repetition penalty."""
    output_index: TokenIndex | None
    """Each distinct output token of each row with a frequency or presence penalty, once. None
    when no row uses either."""
    output_counts: torch.Tensor | None
    """float32, how many times each entry of `output_index` occurs in its row's output."""
    bias_index: TokenIndex | None
    """Where `bias_values` are added. None when no row has a logit bias."""
    bias_values: torch.Tensor | None
    """float32, one value per entry of `bias_index`."""
    suppress_index: TokenIndex | None
    """EOS and stop token ids of rows that have not reached `min_tokens`; they get -inf."""
    banned: torch.Tensor | None
    """[B, V] bool: the tokens each row's structured-output grammar does not allow (none, on rows
    without one); they get -inf before anything else. None when no row has a grammar."""
    seeded_rows: list[tuple[int, torch.Generator]]
    """(row, the request's own generator) for each sampled (non-greedy) row that has one; the
    other rows draw from the global generator."""
    given_noise: list[tuple[int, torch.Tensor]]
    """(row, [V] Exponential(1) noise) for sampled rows whose noise was drawn beforehand (speculative
    decoding: the draft sampled with it too); they draw nothing."""
    num_top_logprobs: int | None
    """K = the most top log-probabilities any row asked for; None when no row asked for any
    log-probability (0 when rows asked only for the sampled token's)."""

    @property
    def needs_logit_processing(self) -> bool:
        """Whether anything can change which token is the argmax (bias, suppression, penalties)."""
        return any(
            t is not None
            for t in (
                self.banned,
                self.bias_index,
                self.suppress_index,
                self.repetition_penalty,
                self.presence_penalty,
                self.frequency_penalty,
            )
        )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        eos_token_ids: Sequence[frozenset[int]] | frozenset[int],
        device: torch.device | str,
        grammar_masks: Sequence[np.ndarray | None] | None = None,
        noise: Sequence[torch.Tensor | None] | None = None,
    ) -> SamplingBatch:
        """Pack B requests: their params, prompt and output token ids so far, generators (one per
        seeded request, reused every step; greedy rows never draw from theirs), EOS ids (one
        set for all rows, or one set per row), grammar masks (per row: None, or int32 words
        whose bit t % 32 of word t // 32 allows token t; see engine/grammar.py) and noise (per row:
        None, or the [V] noise a sampled row uses instead of drawing; see sampler.draw_noise)."""
        num_rows = len(params)
        if isinstance(eos_token_ids, frozenset):
            eos_token_ids = [eos_token_ids] * num_rows
        lengths = {len(prompt_ids), len(output_ids), len(generators), len(eos_token_ids)}
        if lengths != {num_rows}:
            raise ValueError(
                f"SamplingBatch.build needs one prompt, output, generator and EOS set per request: "
                f"{num_rows} params, {len(prompt_ids)} prompts, {len(output_ids)} outputs, "
                f"{len(generators)} generators, {len(eos_token_ids)} EOS sets"
            )
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")

        def row_vector(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        def vector_unless_all(values: list[float], neutral: float) -> torch.Tensor | None:
            return row_vector(values) if any(v != neutral for v in values) else None

        greedy = [p.is_greedy for p in params]
        # top_k = 0 (off) and top_k >= V both mean "keep all V".
        top_k = [min(p.top_k, vocab_size) or vocab_size for p in params]
        top_k = row_vector(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None

        uses_repetition = [p.repetition_penalty != 1.0 for p in params]
        repeated_index = output_index = output_counts = None
        if any(uses_repetition):
            prompt_rows, prompt_tokens = _host_token_index(prompt_ids, uses_repetition)
            output_rows, output_tokens = _host_token_index(output_ids, uses_repetition)
            repeated_index = _to_device(np.concatenate([prompt_rows, output_rows]),
                                        np.concatenate([prompt_tokens, output_tokens]), device)
        uses_count = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
        if any(uses_count):
            rows, token_ids = _host_token_index(output_ids, uses_count)
            keys, counts = np.unique(rows * vocab_size + token_ids, return_counts=True)
            output_index = _to_device(keys // vocab_size, keys % vocab_size, device=device)
            output_counts = torch.from_numpy(counts.astype(np.float32)).to(device)

        bias_index = bias_values = None
        if any(p.logit_bias for p in params):
            biases = [sorted((p.logit_bias or {}).items()) for p in params]
            bias_index = _token_index([[token_id for token_id, _ in row] for row in biases], None, device)
            bias_values = row_vector([bias for row in biases for _, bias in row])

        suppressed = [
            sorted(eos | set(p.stop_token_ids)) if len(out) < p.min_tokens else []
            for p, out, eos in zip(params, output_ids, eos_token_ids, strict=True)
        ]
        requested_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            temperature=row_vector([1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]),
            greedy=row_vector(greedy, torch.bool),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            top_k=top_k,
            top_p=vector_unless_all([p.top_p for p in params], 1.0),
            min_p=vector_unless_all([p.min_p for p in params], 0.0),
            repetition_penalty=vector_unless_all([p.repetition_penalty for p in params], 1.0),
            presence_penalty=vector_unless_all([p.presence_penalty for p in params], 0.0),
            frequency_penalty=vector_unless_all([p.frequency_penalty for p in params], 0.0),
            repeated_index=repeated_index,
            output_index=output_index,
            output_counts=output_counts,
            bias_index=bias_index,
            bias_values=bias_values,
            suppress_index=_token_index(suppressed, None, device) if any(suppressed) else None,
            banned=_banned_tokens(grammar_masks, vocab_size, device),
            seeded_rows=[(row, g) for row, g in enumerate(generators)
                         if g is not None and not greedy[row] and (noise is None or noise[row] is None)],
            given_noise=[] if noise is None else [(row, n) for row, n in enumerate(noise)
                                                  if n is not None and not greedy[row]],
            num_top_logprobs=min(max(requested_logprobs), vocab_size) if requested_logprobs else None,
        )


def _banned_tokens(masks: Sequence[np.ndarray | None] | None, vocab_size: int,
                   device: torch.device | str) -> torch.Tensor | None:
    """[B, V] bool from per-row bitmasks of allowed tokens (rows without one ban nothing)."""
    if masks is None or all(m is None for m in masks):
        return None
    words = -(-vocab_size // 32)
    packed = np.full((len(masks), words), -1, dtype=np.int32)
    for row, mask in enumerate(masks):
        if mask is not None:
            packed[row] = mask[:words]
    bits = np.unpackbits((~packed).view(np.uint8), axis=1, bitorder="little")
    # contiguous: masked_fill with a strided mask is several times slower
    return torch.from_numpy(np.ascontiguousarray(bits[:, :vocab_size]).view(np.bool_)).to(device)


def _token_index(
    token_ids: Sequence[Sequence[int]], rows_wanted: list[bool] | None, device: torch.device | str
) -> TokenIndex:
    """(rows, token_ids) of every token of every wanted row (all rows when rows_wanted is None)."""
    return _to_device(*_host_token_index(token_ids, rows_wanted), device=device)


def _host_token_index(
    token_ids: Sequence[Sequence[int]], rows_wanted: list[bool] | None
) -> tuple[np.ndarray, np.ndarray]:
    """_token_index as two int64 numpy arrays."""
    rows = [r for r in range(len(token_ids)) if rows_wanted is None or rows_wanted[r]]
    lengths = [len(token_ids[r]) for r in rows]
    # built on the host (repeat_interleave on device counts would wait for the device to learn the
    # size), by numpy: a row's prompt can be thousands of ids, and this runs every step
    row_index = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    flat = np.fromiter(chain.from_iterable(token_ids[r] for r in rows), dtype=np.int64, count=sum(lengths))
    return row_index, flat


def _to_device(rows: np.ndarray, token_ids: np.ndarray, device: torch.device | str) -> TokenIndex:
    return torch.from_numpy(rows).to(device), torch.from_numpy(token_ids).to(device)
