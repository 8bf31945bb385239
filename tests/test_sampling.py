"""Tests for tokenmill.sampling: parameter validation, the batched sampler, stop strings.

The sampler tests check exact logits and surviving-token sets on hand-built distributions, and
sampling frequencies against the distribution the sampler claims to draw from.
"""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.request import Request, generator_seed
from tokenmill.errors import TokenmillError
from tokenmill.sampling import (
    Sampler,
    SamplingBatch,
    SamplingParams,
    SamplingParamsError,
    StopStringMatcher,
)
from tokenmill.sampling import sampler as sampler_module
from tokenmill.sampling.processing import apply_penalties_, filter_top_k_top_p, processed_logits
from tokenmill.sampling.sampler import exponential, inverse_cdf

INF = float("inf")


def make_batch(
    params: list[SamplingParams],
    vocab_size: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    eos: frozenset[int] | list[frozenset[int]] = frozenset(),
) -> SamplingBatch:
    num_rows = len(params)
    return SamplingBatch.build(
        params,
        prompt_ids=prompts or [[] for _ in range(num_rows)],
        output_ids=outputs or [[] for _ in range(num_rows)],
        generators=generators or [None] * num_rows,
        vocab_size=vocab_size,
        eos_token_ids=eos,
        device="cpu",
    )


def kept(logits_row: torch.Tensor) -> set[int]:
    """Token ids a processed logits row still allows."""
    return set(torch.isfinite(logits_row).nonzero().flatten().tolist())


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("n", {"n": 0}),
        ("n", {"n": 1.5}),
        ("n", {"n": True}),
        ("max_tokens", {"max_tokens": 0}),
        ("max_tokens", {"max_tokens": 2.0}),
        ("min_tokens", {"min_tokens": -1}),
        ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": math.nan}),
        ("temperature", {"temperature": INF}),
        ("temperature", {"temperature": "1"}),
        ("top_k", {"top_k": -2}),
        ("top_k", {"top_k": 2.0}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.01}),
        ("min_p", {"min_p": -0.01}),
        ("min_p", {"min_p": 1.01}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("repetition_penalty", {"repetition_penalty": -1.0}),
        ("presence_penalty", {"presence_penalty": 2.01}),
        ("presence_penalty", {"presence_penalty": -2.01}),
        ("frequency_penalty", {"frequency_penalty": 2.01}),
        ("frequency_penalty", {"frequency_penalty": -2.01}),
        ("logit_bias", {"logit_bias": {1: 100.5}}),
        ("logit_bias", {"logit_bias": {"2": -101}}),
        ("logit_bias", {"logit_bias": {"x": 1.0}}),
        ("logit_bias", {"logit_bias": {"-1": 1.0}}),
        ("logit_bias", {"logit_bias": {-1: 1.0}}),
        ("logit_bias", {"logit_bias": [1.0]}),
        ("seed", {"seed": 1.5}),
        ("seed", {"seed": 2**64}),
        ("stop", {"stop": ""}),
        ("stop", {"stop": ["ok", ""]}),
        ("stop", {"stop": [1]}),
        ("stop_token_ids", {"stop_token_ids": [-1]}),
        ("stop_token_ids", {"stop_token_ids": 5}),
        ("include_stop_str_in_output", {"include_stop_str_in_output": 1}),
        ("ignore_eos", {"ignore_eos": "yes"}),
        ("logprobs", {"logprobs": -1}),
        ("logprobs", {"logprobs": 21}),
        ("prompt_logprobs", {"prompt_logprobs": -1}),
        ("prompt_logprobs", {"prompt_logprobs": 21}),
        ("prompt_logprobs", {"prompt_logprobs": 1, "kv_transfer_params": {"remote_kv": "x"}}),
        ("skip_special_tokens", {"skip_special_tokens": None}),
    ],
)
def test_invalid_params_name_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(SamplingParamsError, match=rf"^{field}\b") as info:
        SamplingParams(**kwargs)
    assert info.value.field.startswith(field)
    assert isinstance(info.value, TokenmillError)


def test_boundary_values_are_accepted() -> None:
    params = SamplingParams(
        max_tokens=3,
        min_tokens=3,
        temperature=0,
        top_k=-1,
        top_p=1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={0: -100, 1: 100},
        seed=0,
        logprobs=20,
    )
    assert params.top_k == 0  # -1 is stored as the one spelling of "disabled"
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    assert SamplingParams(logprobs=0).logprobs == 0


def test_normalization() -> None:
    params = SamplingParams(logit_bias={"5": 2, 7: -1.5}, stop="###")
    assert params.logit_bias == {5: 2.0, 7: -1.5}
    assert all(type(k) is int and type(v) is float for k, v in params.logit_bias.items())
    assert params.stop == ["###"]
    defaults = SamplingParams()
    assert defaults.stop == [] and defaults.stop_token_ids == [] and defaults.logit_bias is None
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop == ["a", "b"]


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_validate_for_vocab() -> None:
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).validate_for_vocab(10)
    with pytest.raises(SamplingParamsError, match=r"^logit_bias .*\[0, 10\)"):
        SamplingParams(logit_bias={"10": 1.0}).validate_for_vocab(10)
    with pytest.raises(SamplingParamsError, match=r"^stop_token_ids .*\[0, 10\)"):
        SamplingParams(stop_token_ids=[3, 10]).validate_for_vocab(10)


# --------------------------------------------------------------------------- greedy, temperature


def test_all_greedy_is_argmax_and_leaves_logits_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    before = logits.clone()
    batch = make_batch([SamplingParams(temperature=0)] * 5, 50)
    out = Sampler()(logits, batch)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprob_ids is None and out.top_logprobs is None
    assert torch.equal(logits, before)
    bf16 = logits.to(torch.bfloat16)
    assert torch.equal(Sampler()(bf16, batch).token_ids, bf16.float().argmax(-1))


def test_greedy_row_in_mixed_batch_uses_processed_logits() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 4.9], [5.0, 1.0, 0.0, 4.9], [5.0, 1.0, 0.0, 4.9]])
    params = [
        SamplingParams(temperature=0, logit_bias={2: 10.0}),
        SamplingParams(temperature=0, top_k=1, repetition_penalty=2.0),
        SamplingParams(temperature=1.0),
    ]
    batch = make_batch(params, 4, prompts=[[], [0], []])
    token_ids = Sampler()(logits, batch).token_ids
    assert token_ids[0] == 2  # the bias moved the argmax
    assert token_ids[1] == 3  # the penalty halved token 0's logit: 2.5 < 4.9
    greedy_fast = Sampler()(logits, make_batch([SamplingParams(temperature=0)] * 3, 4)).token_ids
    assert greedy_fast.tolist() == [0, 0, 0]
    # Near-flat logits: greedy rows next to a sampled row still never leave the argmax.
    flat = torch.tensor([1.0, 0.99, 0.98, 0.97]).repeat(201, 1)
    params = [SamplingParams(temperature=0)] * 200 + [SamplingParams(temperature=1.0)]
    assert (Sampler()(flat, make_batch(params, 4)).token_ids[:200] == 0).all()


def test_temperature_scales_the_distribution() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=t) for t in (0.5, 2.0, 0.0)]
    processed = processed_logits(logits, make_batch(params, 20))
    for row, temperature in enumerate((0.5, 2.0)):
        expected = torch.softmax(logits[row] / temperature, dim=-1)
        torch.testing.assert_close(processed[row].softmax(-1), expected)
    assert torch.equal(processed[2], logits[2])  # greedy rows are never divided


def test_processed_logits_do_not_modify_input() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    params = [SamplingParams(temperature=0.5, top_k=1, logit_bias={0: 1.0}, presence_penalty=1.0)]
    processed_logits(logits, make_batch(params, 3, outputs=[[1]]))
    assert logits.tolist() == [[1.0, 2.0, 3.0]]


# --------------------------------------------------------------------------- top-k, top-p, min-p

TIED = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0, -1.0])


@pytest.mark.parametrize(
    ("top_k", "survivors"),
    [
        (1, {0}),
        (2, {0, 2, 3}),  # the 2nd largest logit is tied: both copies survive
        (3, {0, 2, 3}),
        (4, {0, 1, 2, 3}),
        (6, {0, 1, 2, 3, 4, 5}),
        (100, {0, 1, 2, 3, 4, 5}),  # larger than the vocabulary: keep all
        (0, {0, 1, 2, 3, 4, 5}),
        (-1, {0, 1, 2, 3, 4, 5}),
    ],
)
def test_top_k_survivors(top_k: int, survivors: set[int]) -> None:
    params = [SamplingParams(top_k=top_k), SamplingParams(top_k=1)]
    processed = processed_logits(TIED.repeat(2, 1), make_batch(params, 6))
    assert kept(processed[0]) == survivors
    assert kept(processed[1]) == {0}  # per-row k
    assert torch.equal(processed[0][list(survivors)], TIED[list(survivors)])


DYADIC = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])


@pytest.mark.parametrize(
    ("top_p", "survivors"),
    [
        (0.3, {0}),
        (0.5, {0}),  # cumulative 0.5 >= 0.5: one token is enough
        (0.5001, {0, 1}),
        (0.75, {0, 1}),
        (0.8, {0, 1, 2}),
        (0.875, {0, 1, 2}),
        (0.9, {0, 1, 2, 3, 4}),  # token 3 is needed and token 4 ties with it
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_survivors(top_p: float, survivors: set[int]) -> None:
    logits = DYADIC.log()
    assert logits.softmax(-1).tolist() == DYADIC.tolist()  # boundaries below are exact in float32
    processed = processed_logits(logits.unsqueeze(0), make_batch([SamplingParams(top_p=top_p)], 5))
    assert kept(processed[0]) == survivors


def test_top_p_ties_and_top_p_one_keeps_negligible_tokens() -> None:
    logits = torch.tensor([0.4, 0.2, 0.2, 0.2]).log()
    processed = processed_logits(logits.repeat(2, 1), make_batch([SamplingParams(top_p=0.5)] * 2, 4))
    assert kept(processed[0]) == {0, 1, 2, 3}
    # A token of probability ~1e-17: the float32 cumsum reaches 1.0 before it, yet top_p=1 keeps it.
    logits = torch.tensor([10.0, 10.0, -30.0])
    batch = make_batch([SamplingParams(top_p=1.0), SamplingParams(top_p=0.999999, top_k=3)], 3)
    processed = processed_logits(logits.repeat(2, 1), batch)
    assert kept(processed[0]) == {0, 1, 2}
    assert kept(processed[1]) == {0, 1}


def test_top_p_sees_the_distribution_renormalized_after_top_k() -> None:
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # After top_k=2 the head is 4/7 = 0.571 >= 0.55, so one token; unrenormalized 0.4 would need two.
    batch = make_batch([SamplingParams(top_k=2, top_p=0.55), SamplingParams(top_p=0.55)], 4)
    processed = processed_logits(logits.repeat(2, 1), batch)
    assert kept(processed[0]) == {0}
    assert kept(processed[1]) == {0, 1}


def reference_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens top-k then top-p keep ([B, V] bool), the plain way: sort every row whole, in
    float64."""
    ordered = logits.double().sort(dim=-1, descending=True).values
    kth = ordered.gather(1, (top_k - 1).unsqueeze(1))
    probs = ordered.masked_fill(ordered < kth, -INF).softmax(dim=-1)
    needed = ((probs.cumsum(dim=-1) - probs) < top_p.double().unsqueeze(1)).sum(-1, keepdim=True).clamp_min(1)
    threshold = torch.where(top_p.unsqueeze(1) >= 1, kth, torch.maximum(kth, ordered.gather(1, needed - 1)))
    return logits.double() >= threshold


def test_top_k_top_p_at_a_real_vocabulary_size_matches_sorting_everything() -> None:
    """Rows whose filters the first candidates decide, rows that need more of them (a wide nucleus, a
    top-k past the first candidates or tied past them), and rows that need the whole row sorted: the
    kept tokens are the plain sort's, up to float rounding at the top-p boundary (a token is kept or
    dropped alike with top_p moved by 1e-4 either way)."""
    vocab = 8192
    gen = torch.Generator().manual_seed(3)
    zipf = -torch.arange(1, vocab + 1, dtype=torch.float32).log()   # the top 256 hold ~64% of the mass
    peaked = torch.randn(vocab, generator=gen)
    peaked[17] = 15.0
    tied = torch.randn(vocab, generator=gen)
    tied[:300] = 8.0   # 300 tokens tied for the largest logit
    head = tied.clone()
    head[300] = 14.0   # 57.5% of the mass after top-k = 50 (61% if the ties past 255 were missed)
    flat = torch.randn(vocab, generator=gen) * 0.1
    banned = torch.randn(vocab, generator=gen) * 3
    banned[::3] = -INF
    cases = [  # (row, top_k (vocab: off), top_p)
        (peaked, vocab, 0.9), (peaked, 5, 0.95), (zipf, vocab, 0.9), (zipf, vocab, 0.5), (zipf, 40, 0.99),
        (zipf, 300, 0.7), (zipf, 5000, 0.95), (zipf, 5000, 1.0), (tied, 50, 1.0), (tied, 50, 0.5),
        (tied, vocab, 0.99), (head, 50, 0.6), (flat, vocab, 0.9), (flat, 100, 0.9), (flat, vocab, 0.3),
        (banned, vocab, 0.95), (banned, 3000, 0.99), (torch.randn(vocab, generator=gen) * 4, vocab, 0.9),
    ]
    # each row's tokens in its own order, so that the candidates are not simply its first tokens
    logits = torch.stack([row[torch.randperm(vocab, generator=gen)] for row, _, _ in cases])
    top_k = torch.tensor([k for _, k, _ in cases])
    top_p = torch.tensor([p for _, _, p in cases])
    kept_now = filter_top_k_top_p(logits, top_k, top_p) > -INF
    fewer = reference_top_k_top_p(logits, top_k, (top_p - 1e-4).where(top_p < 1, top_p))
    more = reference_top_k_top_p(logits, top_k, (top_p + 1e-4).clamp(max=1.0))
    for row in range(len(cases)):
        assert (fewer[row] <= kept_now[row]).all() and (kept_now[row] <= more[row]).all(), f"case {row}"
    assert torch.equal(kept_now[:2].sum(-1), torch.tensor([1, 1]))
    assert int(kept_now[8].sum()) == int(kept_now[9].sum()) == 300   # ties at the top-k boundary all kept


@pytest.mark.parametrize(
    ("min_p", "temperature", "survivors"),
    [
        (0.0, 1.0, {0, 1, 2, 3}),
        (0.25, 1.0, {0, 1, 2}),  # threshold 0.125: 0.15 stays, 0.1 goes
        (0.45, 1.0, {0, 1}),
        (0.4, 1.0, {0, 1}),
        (0.4, 2.0, {0, 1, 2, 3}),  # T=2: ratios sqrt(p/p_max) = 1, .71, .55, .45, all >= 0.4
        (1.0, 1.0, {0}),
    ],
)
def test_min_p_survivors(min_p: float, temperature: float, survivors: set[int]) -> None:
    logits = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()
    params = [SamplingParams(min_p=min_p, temperature=temperature)]
    assert kept(processed_logits(logits, make_batch(params, 4))[0]) == survivors


def test_min_p_one_keeps_tied_maxima() -> None:
    logits = torch.tensor([[2.0, 2.0, 1.0]])
    assert kept(processed_logits(logits, make_batch([SamplingParams(min_p=1.0)], 3))[0]) == {0, 1}


# Upper 0.1% points of the chi-square distribution by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def assert_frequencies_match(samples: torch.Tensor, expected: torch.Tensor) -> None:
    """Chi-square goodness of fit of integer samples to `expected` (zero-probability tokens must
    never appear)."""
    counts = torch.bincount(samples, minlength=len(expected)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, f"sampled filtered tokens: {counts.tolist()}"
    want = expected[support].double() * len(samples)
    chi2 = ((counts[support] - want) ** 2 / want).sum().item()
    assert chi2 < CHI2_999[int(support.sum()) - 1], (chi2, counts.tolist(), want.tolist())


def test_sampling_frequencies_match_the_filtered_distribution() -> None:
    torch.manual_seed(1234)
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    num_draws = 20000
    # top_k=4 keeps tokens 0-3; temperature 0.8 then renormalize by hand.
    expected = torch.zeros(6)
    expected[:4] = torch.softmax(logits[:4] / 0.8, dim=-1)
    params = [SamplingParams(temperature=0.8, top_k=4)] * num_draws
    samples = Sampler()(logits.repeat(num_draws, 1), make_batch(params, 6)).token_ids
    assert_frequencies_match(samples, expected)

    params = [SamplingParams(temperature=1.3, top_p=0.8, min_p=0.2, presence_penalty=0.5)] * num_draws
    batch = make_batch(params, 6, outputs=[[0]] * num_draws)
    expected = processed_logits(logits.unsqueeze(0), make_batch(params[:1], 6, outputs=[[0]]))[0].softmax(-1)
    assert 2 <= int((expected > 0).sum()) < 6  # the filters really removed tokens
    samples = Sampler()(logits.repeat(num_draws, 1), batch).token_ids
    assert_frequencies_match(samples, expected)


def test_inverse_cdf_never_lands_on_a_token_of_probability_zero() -> None:
    """The unseeded rows' draw: token i covers [cdf[i - 1], cdf[i]) of the unit interval, scaled by
    the row's total; tokens of probability 0 cover nothing, at either end or between others."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5 + [[0.0, 0.0, 2.0, 0.0, 1.0]] * 3)
    uniform = torch.tensor([0.0, 0.2499, 0.25, 0.9999, 1.0,   # 1.0: u x total at the total itself
                            0.0, 2 / 3, 1.0], dtype=torch.float64)
    assert inverse_cdf(probs, uniform).tolist() == [1, 1, 3, 3, 3, 2, 4, 4]


@pytest.mark.parametrize("vocab", [49152, 1000])   # (1000: the last block padded)
def test_inverse_cdf_in_two_levels_draws_as_the_whole_rows_float64_cdf(vocab: int) -> None:
    """The block-then-token search equals a search of the whole row's float64 running sum, but
    where the point lies within rounding of a boundary (none here in 6400 draws over rows from
    peaked to flat, with zeros and whole blocks of zeros)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, vocab, generator=g) * torch.linspace(0.5, 8.0, 64).unsqueeze(1)
    probs = logits.softmax(dim=-1)
    probs[:16].masked_fill_(torch.rand(16, vocab, generator=g) < 0.5, 0.0)
    probs[16:32, :600] = 0.0   # (whole blocks of zeros before the mass)
    for _ in range(100):
        uniform = torch.rand(64, dtype=torch.float64, generator=g)
        cdf = probs.double().cumsum(dim=-1)
        expected = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        assert torch.equal(inverse_cdf(probs, uniform), expected)
    sparse = torch.zeros(3, vocab)
    sparse[:, 300], sparse[:, 777] = 1.0, 3.0
    edges = torch.tensor([0.0, 0.25, 1.0], dtype=torch.float64)
    assert inverse_cdf(sparse, edges).tolist() == [300, 777, 777]


def test_the_nucleus_bound_decides_only_draws_inside_the_nucleus() -> None:
    """sample_nucleus skips the exact test (the mass of the tokens more likely than the draw) where
    surely_in_nucleus says the draw is inside: it must never say so of a draw outside, and decide
    most draws of peaked rows (else it saves nothing)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(256, 4096, generator=g) * torch.linspace(0.5, 12.0, 256).unsqueeze(1)
    logits[:8, :3] = logits[:8, :3].amax(dim=-1, keepdim=True)   # (ties at the largest logit)
    probs = logits.softmax(dim=-1)
    decided = 0
    for top_p in (0.5, 0.9, 0.95, 1.0):
        top_p = torch.full((256,), top_p)
        ids = inverse_cdf(probs, torch.rand(256, dtype=torch.float64, generator=g))
        drawn = logits.gather(1, ids.unsqueeze(1))
        above = probs.masked_fill(logits <= drawn, 0.0).sum(dim=-1)
        inside = (above < top_p) | (top_p >= 1.0)
        sure = sampler_module.surely_in_nucleus(drawn.squeeze(1), probs.gather(1, ids.unsqueeze(1)).squeeze(1),
                                                logits.amax(dim=-1), top_p)
        assert not (sure & ~inside).any()
        decided += int(sure[128:].sum())
    assert decided > 0.75 * 4 * 128


@pytest.mark.parametrize("max_rounds", [16, 1, 0])
@pytest.mark.parametrize("top_p, min_p, support", [(0.12, 0.0, 3), (0.5, 0.1, 4)])
def test_nucleus_draws_match_the_thresholds(monkeypatch, max_rounds: int, top_p: float, min_p: float,
                                            support: int) -> None:
    """Unseeded rows draw top-p by rejection (sampler.sample_nucleus) rather than from thresholds:
    their frequencies must match processed_logits' distribution. 83% of the mass is in a tail of
    196 tied tokens, so most first draws fall outside a nucleus of 3 (tokens 1 and 2 tied at its
    edge: both kept) and take more rounds; with min-p the tail is never drawn. max_rounds 1 and 0
    send the rows still drawing (or every row) to the thresholds' fallback."""
    monkeypatch.setattr(sampler_module, "MAX_ROUNDS", max_rounds)
    torch.manual_seed(7)
    logits = torch.cat([torch.tensor([2.0, 1.0, 1.0, 0.5]), torch.full((196,), -1.0)])
    params = [SamplingParams(temperature=1.0, top_p=top_p, min_p=min_p)] * 20000
    expected = processed_logits(logits.unsqueeze(0), make_batch(params[:1], 200))[0].softmax(-1)
    assert int((expected > 0).sum()) == support
    samples = Sampler()(logits.repeat(len(params), 1), make_batch(params, 200)).token_ids
    assert_frequencies_match(samples, expected)


def test_top_k_draws_match_the_filtered_distribution() -> None:
    """Unseeded rows with a small top-k draw from their k largest logits (sampler.sample_top_k); rows
    whose k-th logit ties with the next, rows without top-k or with a large one, and rows with fewer
    than k finite logits filter the whole row. All kinds share one batch, each with its own logits
    and filters; every kind's frequencies must match processed_logits' distribution."""
    torch.manual_seed(11)
    vocab, per_kind = 300, 6000
    base = torch.randn(vocab) * 2
    tied = base.clone()
    tied[tied.topk(4).indices[2:]] = tied.topk(4).values[2]       # 3rd and 4th largest equal
    nucleus_tie = base.clone()
    order = base.argsort(descending=True)
    nucleus_tie[order[:5]] = torch.tensor([2.0, 1.8, 1.8, 1.0, 0.0]) + base.max()   # nucleus: 3, 2 tied
    sparse = torch.full((vocab,), float("-inf"))
    sparse[order[:2]] = base[order[:2]]                          # 2 finite logits, top_k 4
    kinds = [
        (base, SamplingParams(temperature=0.9, top_k=3)),
        (nucleus_tie, SamplingParams(temperature=1.0, top_k=5, top_p=0.5)),
        (base.flip(0) * 2, SamplingParams(temperature=0.9, top_k=40, min_p=0.2)),
        (tied, SamplingParams(temperature=0.9, top_k=3)),
        (base.roll(7) * 2, SamplingParams(temperature=0.9, top_p=0.6)),
        (base * 2, SamplingParams(temperature=0.9, top_k=280, top_p=0.9)),
        (sparse, SamplingParams(temperature=0.9, top_k=4)),
    ]
    logits = torch.cat([row.repeat(per_kind, 1) for row, _ in kinds])
    params = [p for _, p in kinds for _ in range(per_kind)]
    samples = Sampler()(logits, make_batch(params, vocab)).token_ids
    for index, (row, p) in enumerate(kinds):
        expected = processed_logits(row.unsqueeze(0), make_batch([p], vocab))[0].softmax(-1)
        assert 1 < int((expected > 0).sum()) < vocab, index
        assert_frequencies_match(samples[index * per_kind:(index + 1) * per_kind], expected)


def test_seeded_sampling_frequencies() -> None:
    logits = torch.tensor([[1.0, 0.0, -0.5, 0.5]])
    generator = torch.Generator().manual_seed(99)
    batch = make_batch([SamplingParams(seed=99, top_k=3)], 4, generators=[generator])
    samples = torch.cat([Sampler()(logits, batch).token_ids for _ in range(3000)])
    expected = torch.zeros(4)
    expected[[0, 1, 3]] = torch.softmax(logits[0, [0, 1, 3]], dim=-1)
    assert_frequencies_match(samples, expected)


# --------------------------------------------------------------------------- penalties and bias

PENALTY_LOGITS = torch.tensor([1.0, 2.0, -1.0, 3.0, -2.0, 0.5])
PROMPT = [1, 1, 2]  # tokens 1 and 2 seen in the prompt
OUTPUT = [2, 3, 3, 3]  # token 2 once and token 3 three times in the output


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, [1.0, 2.0, -1.0, 3.0, -2.0, 0.5]),
        # prompt and output tokens {1, 2, 3}: positive / 2, negative * 2
        ({"repetition_penalty": 2.0}, [1.0, 1.0, -2.0, 1.5, -2.0, 0.5]),
        ({"repetition_penalty": 0.5}, [1.0, 4.0, -0.5, 6.0, -2.0, 0.5]),
        # output tokens only, once each
        ({"presence_penalty": 0.5}, [1.0, 2.0, -1.5, 2.5, -2.0, 0.5]),
        # output tokens only, once per occurrence
        ({"frequency_penalty": 0.5}, [1.0, 2.0, -1.5, 1.5, -2.0, 0.5]),
        ({"frequency_penalty": -1.0}, [1.0, 2.0, 0.0, 6.0, -2.0, 0.5]),
        # repetition first, then frequency, then presence
        (
            {"repetition_penalty": 2.0, "frequency_penalty": 0.5, "presence_penalty": 0.5},
            [1.0, 1.0, -3.0, -0.5, -2.0, 0.5],
        ),
        ({"logit_bias": {0: 2.5, "5": -100}}, [3.5, 2.0, -1.0, 3.0, -2.0, -99.5]),
        # bias first, then the penalty on the biased logit: token 2 is (-1 + 5) / 2 = 2, not -1 * 2 + 5
        ({"logit_bias": {2: 5.0, 4: 1.0}, "repetition_penalty": 2.0}, [1.0, 1.0, 2.0, 1.5, -1.0, 0.5]),
    ],
)
def test_penalties_and_bias_exact_logits(kwargs: dict, expected: list[float]) -> None:
    params = [SamplingParams(**kwargs), SamplingParams(presence_penalty=1.0, repetition_penalty=3.0)]
    batch = make_batch(params, 6, prompts=[PROMPT, [0]], outputs=[OUTPUT, [5, 5]])
    processed = processed_logits(PENALTY_LOGITS.repeat(2, 1), batch)
    assert processed[0].tolist() == expected
    # The neighbour row is penalized by its own tokens only (prompt 0, output 5 twice).
    torch.testing.assert_close(processed[1], torch.tensor([1.0 / 3, 2.0, -1.0, 3.0, -2.0, 0.5 / 3 - 1.0]))


def dense_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                    outputs: list[list[int]]) -> torch.Tensor:
    """The penalties' definition, one [V] row at a time: repetition over every token in the prompt
    or the output, then frequency times each output token's count, then presence once per token."""
    result = logits.clone()
    for row, p in enumerate(params):
        counts = torch.zeros(logits.shape[1])
        for token in outputs[row]:
            counts[token] += 1
        seen = counts > 0
        seen[prompts[row]] = True
        values = result[row]
        penalty, frequency, presence = (torch.tensor(v, dtype=torch.float32) for v in
                                        (p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
        if p.repetition_penalty != 1.0:
            values = torch.where(seen, torch.where(values > 0, values / penalty, values * penalty), values)
        if p.frequency_penalty != 0.0:
            values = values - frequency * counts
        if p.presence_penalty != 0.0:
            values = values - presence * (counts > 0)
        result[row] = values
    return result


def test_penalties_touch_only_seen_tokens_with_the_definitions_arithmetic() -> None:
    # Rows with each penalty alone, all three, none, and extreme values; prompts and outputs with
    # repeated ids, shared ids, and none; logits with -inf (banned) entries. The engine applies the
    # penalties at the seen ids only: the result must equal the dense definition bit for bit.
    vocab = 1000
    generator = torch.Generator().manual_seed(7)
    params = [
        SamplingParams(repetition_penalty=1.05),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=-1.3),
        SamplingParams(repetition_penalty=0.3, frequency_penalty=-2.0, presence_penalty=2.0),
        SamplingParams(),
        SamplingParams(repetition_penalty=100.0, frequency_penalty=0.1),
        SamplingParams(repetition_penalty=1.7, presence_penalty=0.5),
        SamplingParams(frequency_penalty=1.9),
    ]

    def ids(n: int, high: int) -> list[int]:
        return torch.randint(0, high, (n,), generator=generator).tolist()

    prompts = [ids(300, vocab), ids(50, 40), [], ids(200, 60), ids(90, vocab), ids(3, vocab), [5] * 40, ids(9, 9)]
    outputs = [ids(20, 30), ids(60, 25), ids(33, 30), [], ids(10, vocab), ids(40, 50), ids(7, 6), []]
    logits = torch.randn(len(params), vocab, generator=generator) * 4
    logits[logits.abs() < 0.05] = 0.0
    logits[torch.rand(logits.shape, generator=generator) < 0.1] = float("-inf")
    batch = make_batch(params, vocab, prompts=prompts, outputs=outputs)
    processed = logits.clone()
    apply_penalties_(processed, batch)
    expected = dense_penalties(logits, params, prompts, outputs)
    assert torch.equal(processed, expected)
    assert not torch.equal(processed, logits)


# --------------------------------------------------------------------------- min_tokens


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_suppresses_eos_and_stop_token_ids(ignore_eos: bool) -> None:
    vocab_size, eos = 8, 7
    logits = torch.zeros(4, vocab_size)
    logits[:, eos] = 50.0
    logits[:, 5] = 49.0
    params = [SamplingParams(min_tokens=3, stop_token_ids=[5], ignore_eos=ignore_eos, temperature=0)] * 4
    outputs = [[], [1], [1, 2], [1, 2, 3]]
    batch = make_batch(params, vocab_size, outputs=outputs, eos=frozenset({eos}))
    processed = processed_logits(logits, batch)
    for row in range(3):
        assert kept(processed[row]) == {0, 1, 2, 3, 4, 6}
    assert kept(processed[3]) == set(range(vocab_size))
    assert Sampler()(logits, batch).token_ids.tolist() == [0, 0, 0, eos]


def test_min_tokens_uses_each_rows_eos_ids() -> None:
    params = [SamplingParams(min_tokens=1, temperature=0.7), SamplingParams(min_tokens=1)]
    batch = make_batch(params, 6, eos=[frozenset({4}), frozenset({1, 5})])
    processed = processed_logits(torch.zeros(2, 6), batch)
    assert kept(processed[0]) == {0, 1, 2, 3, 5}
    assert kept(processed[1]) == {0, 2, 3, 4}
    # Sampled rows never draw a suppressed token even when it dominates.
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 30.0, 0.0]]).repeat(500, 1)
    batch = make_batch([SamplingParams(min_tokens=1)] * 500, 6, eos=frozenset({4}))
    assert (Sampler()(logits, batch).token_ids != 4).all()


# --------------------------------------------------------------------------- seeds


def run_steps(
    rows: list[tuple[SamplingParams, torch.Tensor]], seeded_row: int, steps: int, global_seed: int
) -> list[int]:
    """Sample `steps` tokens for a batch; return the tokens of `seeded_row`. Each row's logits for
    step s are logits[s]."""
    torch.manual_seed(global_seed)
    generators = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p, _ in rows]
    params = [p for p, _ in rows]
    vocab_size = rows[0][1].shape[1]
    batch = make_batch(params, vocab_size, generators=generators)
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        logits = torch.stack([row_logits[step] for _, row_logits in rows])
        tokens.append(int(sampler(logits, batch).token_ids[seeded_row]))
    return tokens


def test_seeded_row_is_independent_of_its_batch() -> None:
    steps, vocab_size = 25, 64
    torch.manual_seed(0)
    mine = torch.randn(steps, vocab_size)
    other = torch.randn(steps, vocab_size)
    seeded = SamplingParams(seed=42, temperature=0.9, top_p=0.95)
    alone = run_steps([(seeded, mine)], 0, steps, global_seed=1)
    with_neighbours = run_steps(
        [
            (SamplingParams(temperature=1.5), other),
            (SamplingParams(temperature=0), other),
            (seeded, mine),
            (SamplingParams(seed=7, top_k=5), other),
        ],
        2,
        steps,
        global_seed=2,
    )
    first_of_three = run_steps(
        [(seeded, mine), (SamplingParams(), other), (SamplingParams(presence_penalty=1.0), mine)],
        0,
        steps,
        global_seed=3,
    )
    assert alone == with_neighbours == first_of_three
    other_seed = run_steps([(SamplingParams(seed=43, temperature=0.9, top_p=0.95), mine)], 0, steps, 1)
    assert other_seed != alone
    unseeded = [run_steps([(SamplingParams(temperature=0.9), mine)], 0, steps, s) for s in (1, 2)]
    assert unseeded[0] != unseeded[1]  # the global generator is used for unseeded rows


def test_cpu_noise_is_exponential_draws_bit_for_bit() -> None:
    """sampler.exponential computes the CPU noise its own (faster) way; it must be exactly what
    Tensor.exponential_ draws from the same generator state, and leave the same state behind, so
    that a seeded request's tokens are those exponential_ would give."""
    for shape in [(1000,), (3, 49152)]:
        mine, theirs = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
        for _ in range(2):
            drawn = exponential(shape, mine, torch.device("cpu"))
            assert drawn.dtype == torch.float32 and drawn.shape == shape
            assert torch.equal(drawn, torch.empty(shape).exponential_(generator=theirs))
        assert torch.equal(mine.get_state(), theirs.get_state())
    torch.manual_seed(5)
    drawn = exponential((2, 300), None, torch.device("cpu"))
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.empty(2, 300).exponential_())


def test_race_over_the_top_k_equals_the_race_over_the_whole_row() -> None:
    """race() draws a row with a small top-k from its k largest logits alone, computing the noise
    there only: the same token as the exponential race over the whole processed row (the
    reference, processed_logits' distribution over noise), for every filter mix, ties at the k-th
    logit (those rows take the whole-row path), equal ratios (the smallest token id, as argmax),
    and noise given whole or as the uniforms of a seeded generator."""
    vocab, rows = 3000, 64
    torch.manual_seed(3)
    logits = torch.randn(rows, vocab) * 3
    logits[1::5, :60] = 0.5   # ties across the k-th largest
    logits[::7, 5] = logits[::7, 2999] = logits[::7].amax(dim=-1) + 4   # two tied maxima
    top_k = torch.tensor([[40, 2, 5, 1, 256, 257, 0][i % 7] for i in range(rows)])
    top_k = torch.where(top_k == 0, vocab, top_k)
    top_p = torch.tensor([[1.0, 0.9, 0.5, 1.0, 0.95][i % 5] for i in range(rows)])
    min_p = torch.tensor([[0.0, 0.0, 0.05, 0.2][i % 4] for i in range(rows)])
    generators = [torch.Generator().manual_seed(row) for row in range(rows)]
    uniforms = [torch.rand(vocab, dtype=torch.float64, generator=g) for g in generators]
    noise = torch.stack([sampler_module.exponential_of(u.clone()) for u in uniforms]).clamp_min_(1.2e-38)
    noise[::7, 5] = noise[::7, 2999] = 1.0   # equal ratios at the two tied maxima
    expected = sampler_module.nucleus_filtered(sampler_module.top_k_filtered(logits, top_k), top_p, min_p)
    expected = expected.softmax(dim=-1).div_(noise).argmax(dim=-1)
    given = sampler_module.race(logits, top_k, top_p, min_p, [sampler_module.RowNoise(noise=n) for n in noise])
    assert torch.equal(given, expected)
    assert (given[::7] == 5).sum() > 5 and not (given == 2999).any()   # (2999 only ever ties with 5)
    plain = [r for r in range(rows) if r % 7]   # (the rows whose noise is the generators' own)
    seeded = sampler_module.race(logits[plain], top_k[plain], top_p[plain], min_p[plain],
                                 [sampler_module.RowNoise(uniform=uniforms[r].clone()) for r in plain])
    assert torch.equal(seeded, expected[plain])
    # every narrow row undecided: a grammar that allows fewer tokens than k + 1 leaves -inf ties there
    few = torch.full((2, vocab), -INF)
    few[:, [7, 500, 2000]] = torch.tensor([1.0, 2.0, 0.5])
    k40 = torch.tensor([40, 40])
    expected_few = few.softmax(dim=-1).div_(noise[:2]).argmax(dim=-1)
    assert torch.equal(sampler_module.race(few, k40, None, None, [sampler_module.RowNoise(noise=n) for n in noise[:2]]),
                       expected_few)


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_of_the_raw_distribution() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, 30)
    params = [
        SamplingParams(temperature=0.5, repetition_penalty=1.5, logit_bias={3: 20.0}),
        SamplingParams(logprobs=0, top_k=3),
        SamplingParams(logprobs=5, temperature=0, presence_penalty=2.0),
    ]
    out = Sampler()(logits, make_batch(params, 30, prompts=[[1, 2], [], []], outputs=[[3], [4], [5]]))
    raw = logits.log_softmax(-1)
    assert out.token_ids[0] == 3  # the bias decided the token ...
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.top_logprob_ids.shape == (3, 5)
    top = raw.topk(5, dim=-1)
    assert torch.equal(out.top_logprob_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values)
    assert out.top_logprobs.dtype == torch.float32


def test_logprobs_only_sampled_and_bf16_input() -> None:
    torch.manual_seed(6)
    logits = torch.randn(2, 40).to(torch.bfloat16)
    out = Sampler()(logits, make_batch([SamplingParams(logprobs=0, temperature=0)] * 2, 40))
    assert out.top_logprob_ids is None and out.top_logprobs is None
    raw = logits.float().log_softmax(-1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.logprobs.dtype == torch.float32


def test_batch_and_logits_shape_are_checked() -> None:
    with pytest.raises(ValueError, match="one prompt, output, generator and EOS set per request"):
        SamplingBatch.build([SamplingParams()], [[1], [2]], [[]], [None], 10, frozenset(), "cpu")
    batch = make_batch([SamplingParams()], 10)
    with pytest.raises(ValueError, match=r"logits must have shape \[1, 10\]"):
        Sampler()(torch.zeros(1, 11), batch)


# --------------------------------------------------------------------------- stop strings


def stream(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    """Feed deltas until a stop; return (all emitted text, stopped)."""
    emitted = []
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        emitted.append(text)
        if stopped:
            return "".join(emitted), True
    return "".join(emitted) + matcher.flush(), False


def test_stop_split_across_deltas_is_never_emitted() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("hello ST") == ("hello ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("P and more") == ("", True)
    assert matcher.matched == "STOP"
    with pytest.raises(RuntimeError):
        matcher.feed("x")


def test_held_text_is_released_when_it_stops_matching() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("ST") == ("", False)
    assert matcher.feed("AR") == ("STAR", False)
    assert matcher.feed("S") == ("", False)
    assert matcher.flush() == "S"
    assert matcher.matched is None


def test_overlapping_prefixes() -> None:
    matcher = StopStringMatcher(["aab"])
    assert matcher.feed("aa") == ("", False)
    assert matcher.feed("a") == ("a", False)  # "aaa": only the last "aa" can still start "aab"
    assert matcher.feed("ab") == ("a", True)
    assert matcher.matched == "aab"


def test_earliest_completed_stop_wins() -> None:
    assert stream(StopStringMatcher(["world", "lo"]), ["hello world"]) == ("hel", True)
    # Both end at "c": the one starting first wins.
    matcher = StopStringMatcher(["bc", "abc"])
    assert stream(matcher, ["xabcd"]) == ("x", True) and matcher.matched == "abc"
    # "bc" is complete before "abcd" could be, whatever the split.
    for deltas in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"]):
        matcher = StopStringMatcher(["abcd", "bc"])
        assert stream(matcher, deltas) == ("a", True) and matcher.matched == "bc"


def test_include_stop_str_in_output() -> None:
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=True)
    assert matcher.feed("hello ST") == ("hello ST", False)  # nothing needs holding back
    assert matcher.feed("OP more") == ("OP", True)
    matcher = StopStringMatcher(["\n\n", "###"], include_stop_str_in_output=True)
    assert stream(matcher, ["a\n", "\nb###"]) == ("a\n\n", True)


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.flush() == ""
    with pytest.raises(SamplingParamsError, match="^stop"):
        StopStringMatcher(["ok", ""])


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Scan the text one character at a time, as a token-by-token stream would see it."""
    for end in range(1, len(text) + 1):
        complete = [s for s in stops if text[:end].endswith(s)]
        if complete:
            stop = max(complete, key=len)  # same end: the longest starts earliest
            return text[: end if include else end - len(stop)], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\nc", max_size=30),
    stops=st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
    include=st.booleans(),
)
def test_streamed_output_equals_truncated_text(text: str, stops: list[str], cuts: list[int], include: bool) -> None:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    deltas = [text[a:b] for a, b in pairwise(points)]
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    emitted, stopped = stream(matcher, deltas)
    expected, expected_stop = reference_stop(text, stops, include)
    assert emitted == expected
    assert stopped == (expected_stop is not None)
    assert matcher.matched == expected_stop


def test_seeds_that_differ_only_above_32_bits_draw_differently() -> None:
    """torch's CPU generator keeps only the low 32 bits of its seed: seeds 0 and 2**32 (and -1 and
    2**32 - 1) drew the same tokens. Seeds below 2**32 still seed it as they are (outputs kept)."""
    assert [generator_seed(s) for s in (0, 5, 2**32 - 1)] == [0, 5, 2**32 - 1]
    seeds = [0, 2**32, 2**33, -1, 2**32 - 1, -(2**63), 1, 2**32 + 1, 2**63 - 1, 2**32 * 3 + 7]   # (-1 is 2**64 - 1)
    generators = [Request("r", [1], SamplingParams(seed=s), 8, frozenset()).generator for s in seeds]
    draws = {tuple(torch.rand(4, generator=g).tolist()) for g in generators}
    assert len(draws) == len(seeds)
