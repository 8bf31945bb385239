"""Speculative decoding (engine/speculative.py): proposals verified in the packed batch.

The claims: greedy outputs are identical with and without speculation (ngram and draft model, mixed
batches, chunked prefill, preemption); a seeded request gets the same tokens and logprobs with and
without it under every sampling option; the output distribution is the target's (within 0.002 total
variation, with a deliberately poor draft); the K/V cache after rejections holds what plain
decoding writes; speculation adapts (off above disable_by_batch_size, short drafts where proposals
fail). The K/V bookkeeping of rollback under random workloads is tested in test_scheduler.py's
hypothesis state machine.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from engine_helpers import make_engine, prefill_logits
from test_sampling import CHI2_999
from tiny_models import make_hf_model

from tokenmill import kernels
from tokenmill.checkpoint import open_checkpoint
from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import Request
from tokenmill.engine.speculative import (
    MIN_GAIN,
    MIN_ROW_COST,
    ROW_COST,
    ROW_COST_NO_VNNI,
    ProposalCost,
    RowCost,
    draft_length,
    ngram_lookup,
    row_cost,
)
from tokenmill.errors import TokenmillError
from tokenmill.sampling import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[1, 5, 9, 5, 9, 5], [3] * 40 + [7, 8], list(range(2, 30)), [11, 12, 13, 11, 12], [4, 4]]


def engine(path: Path, spec: dict | None = None, draft: Path | None = None, **kwargs) -> LLMEngine:
    """A float32 engine on `path`, speculating with `spec` (and the draft model at `draft`). Its
    proposals are held free (ProposalCost 0): the tests' drafts are as large as their targets, so a
    learned cost would rightly stop them speculating, and these tests need them to."""
    draft_engine = None
    if draft is not None:
        draft_engine = make_engine(draft, enable_prefix_caching=False, **kwargs)
        spec = {"model": str(draft), **(spec or {"num_speculative_tokens": 3})}
    config = EngineConfig(dtype="float32", speculative_config=spec, **kwargs)
    eng = LLMEngine(open_checkpoint(path), config, frozenset(), draft_engine)
    if eng.speculator is not None:
        eng.speculator.proposal_cost.observe = lambda *args: None
    return eng


def pin_row_cost(eng: LLMEngine, monkeypatch, value: float | None = None) -> None:
    """Hold the engine's row cost at `value` (default: its prior) instead of learning it from step times,
    which would make draft lengths, and counts of them, depend on how fast the machine ran."""
    eng.speculator.cost = RowCost(eng.speculator.cost.value if value is None else value)
    monkeypatch.setattr(eng.speculator.cost, "observe", lambda rows, seconds: None)


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Request]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    requests = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    while eng.has_unfinished():
        eng.step()
    assert eng.num_free_blocks == eng.pool.num_blocks, "blocks leaked"
    if eng.speculator is not None and hasattr(eng.speculator.proposer, "shadows"):
        assert not eng.speculator.proposer.shadows, "draft shadows outlived their requests"
        draft_kv = eng.speculator.proposer.kv
        assert draft_kv.pool.num_free == draft_kv.pool.num_blocks, "draft blocks leaked"
    return requests


def perturbed(path: Path, scale: float, seed: int = 1) -> Path:
    """The checkpoint at `path` with noise of `scale` times each weight's spread added: a draft that
    shares the target's tokenizer and is right only part of the time."""
    weights = path / "model.safetensors"
    tensors = safetensors.torch.load_file(weights)
    generator = torch.Generator().manual_seed(seed)
    for t in tensors.values():
        t += torch.randn(t.shape, generator=generator) * t.std() * scale if t.numel() > 1 else 0
    safetensors.torch.save_file(tensors, weights, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def poor_draft(tmp_path_factory) -> Path:
    """The tiny llama (tiny_hf_model's seed) with noisy weights: many of its proposals are wrong."""
    return perturbed(make_hf_model("llama", tmp_path_factory.mktemp("draft") / "poor"), 0.05)


# ---- pieces ----------------------------------------------------------------------------------------


def test_ngram_lookup_takes_the_longest_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 4, 8, 7, 1, 2]
    assert ngram_lookup(tokens, 1, 3, 2) == ([4, 8], 2)          # "1 2": latest earlier occurrence
    assert ngram_lookup(tokens + [3], 1, 3, 3) == ([9, 1, 2], 3)  # "1 2 3" (longest first) beats "2 3", "3"
    assert ngram_lookup([5, 6, 7], 1, 3, 4) == ([], 0)
    assert ngram_lookup([5, 6, 5], 2, 3, 4) == ([], 0)           # only a 1-gram matches, below min
    assert ngram_lookup([5, 6, 5], 1, 3, 4) == ([6, 5], 1)       # proposals stop at the end of the context
    assert ngram_lookup([7], 1, 3, 4) == ([], 0)


def test_ngram_lookup_equals_trying_each_n_in_turn():
    """The one-pass lookup == the definition: for n from max_n down, all windows of n compared."""
    import random

    import numpy as np
    from numpy.lib.stride_tricks import sliding_window_view

    def by_definition(tokens, min_n, max_n, k):
        ids = np.asarray(tokens)
        for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
            hits = np.flatnonzero((sliding_window_view(ids[:-1], n) == ids[-n:]).all(axis=1))
            if hits.size:
                return ids[hits[-1] + n:hits[-1] + n + k].tolist(), n
        return [], 0

    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 4)
        args = (tokens, min_n, rng.randint(min_n, 6), rng.randint(1, 6))
        assert ngram_lookup(*args) == by_definition(*args), args


def test_draft_length_follows_the_acceptance_rate_and_the_batch():
    assert draft_length(0.99, 4) == 4
    assert draft_length(0.0, 4) == 0
    ks = [draft_length(a / 10, 6) for a in range(11)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 6
    # the larger the batch, the dearer a row relative to a request's share of the step
    by_batch = [draft_length(0.7, 6, b) for b in (1, 4, 16, 64)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[0] > 0 and by_batch[-1] == 0
    # a predicted gain of under MIN_GAIN is no reason to speculate: at batch 32 with dear rows, a 97%
    # proposal gains 1.004x (k = 1 would be the argmax); alone, the same proposal pays well
    c = ROW_COST_NO_VNNI / (ROW_COST_NO_VNNI + (1 - ROW_COST_NO_VNNI) / 32)
    assert 1 < (1 + 0.97) / (1 + c) < MIN_GAIN
    assert draft_length(0.97, 6, 32, ROW_COST_NO_VNNI) == 0 and draft_length(0.97, 6, 1, ROW_COST_NO_VNNI) > 0


def test_ngram_draft_length_follows_the_match_length(tiny_hf_model, monkeypatch):
    """An n-gram proposal's key is its match length, and each key has its own acceptance record.
    Taught that proposals after 5-token matches are always accepted and after 1-token matches never,
    a request verifies all 6 after a long match and none after a short one; a new request, with no
    record of its own, starts from the others' (shared) rates: 6 and at most 1 on its first step,
    where the 3-in-4 prior alone would give both 3."""
    eng = engine(tiny_hf_model("llama"), {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5})
    pin_row_cost(eng, monkeypatch, ROW_COST)
    spec = eng.speculator
    seq = list(range(10, 30))
    long_prompt, short_prompt = seq + seq[:5], [40, 41, 42, 43, 44, 45, 46, 42]
    params = SamplingParams(max_tokens=50, temperature=0.0)

    def decoding(prompt):
        request = eng.add_request(prompt, params)
        request.num_computed_tokens = request.num_tokens - 1   # as if its prompt were computed
        return request

    long, short = decoding(long_prompt), decoding(short_prompt)
    assert ngram_lookup(long.all_token_ids, 1, 5, 6) == (seq[5:11], 5)
    assert ngram_lookup(short.all_token_ids, 1, 5, 6) == ([43, 44, 45, 46, 42], 1)
    for request in (long, short):   # untaught, the prior gives every key the same draft length
        assert spec.acceptance(request, 5) == spec.acceptance(request, 1) == pytest.approx(0.75)
    for _ in range(12):
        spec.propose([long, short])
        assert long.spec.key == 5 and (short.spec.key == 1 or not short.spec_token_ids)
        spec.verified(long, len(long.spec_token_ids) + 1)   # every proposal accepted
        spec.verified(short, 1)                            # the first one rejected
    spec.propose([long, short])
    assert long.spec_token_ids == seq[5:11] and short.spec_token_ids == []
    assert spec.acceptance(long, 5) > 0.95 and spec.acceptance(short, 1) < 0.25
    fresh_long, fresh_short = decoding(long_prompt), decoding(short_prompt)
    spec.propose([fresh_long, fresh_short])
    assert fresh_long.spec_token_ids == seq[5:11] and len(fresh_short.spec_token_ids) <= 1
    assert draft_length(0.75, 6, 2, ROW_COST) == 3   # what the prior alone would have given both


def test_no_lookup_where_no_proposal_would_pay(tiny_hf_model, monkeypatch):
    """Where rows cost as much as a whole step, no key's proposals pay (nor probes): the n-gram
    lookup is not run at all (its time adds up over a large batch), and nothing is proposed."""
    eng = engine(tiny_hf_model("llama"), NGRAM)
    pin_row_cost(eng, monkeypatch, 1.0)
    lookups = []
    propose = eng.speculator.proposer.propose
    monkeypatch.setattr(eng.speculator.proposer, "propose", lambda jobs: lookups.append(jobs) or propose(jobs))
    run(eng, [PROMPTS[1]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert lookups == [] and eng.speculator.stats.num_drafts == 0
    pin_row_cost(eng, monkeypatch, ROW_COST)
    run(eng, [PROMPTS[1]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert lookups and eng.speculator.stats.num_drafts > 0   # (the same request speculates where rows are cheap)


def test_dearer_rows_shorten_drafts_and_the_cost_follows_the_matmul_path(monkeypatch, tiny_hf_model):
    """Where an extra row costs more (quantized weights without the VNNI matmul), a request needs
    likelier proposals to speculate, and the engine takes the cost of its own decode path."""
    state = 0.7
    ks = [draft_length(state, 6, 1, c) for c in (0.05, ROW_COST, ROW_COST_NO_VNNI, 0.9)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]
    assert draft_length(0.3, 6, 1, ROW_COST) > 0
    assert draft_length(0.3, 6, 1, ROW_COST_NO_VNNI) == 0
    cpu = torch.device("cpu")
    for vnni in (False, True):
        monkeypatch.setattr(kernels, "has_vnni_matmul", lambda v=vnni: v)
        assert row_cost(cpu, quantized=True) == (ROW_COST if vnni else ROW_COST_NO_VNNI)
        assert row_cost(cpu, quantized=False) == row_cost(torch.device("cuda"), quantized=True) == ROW_COST
    monkeypatch.undo()
    for quantization in ("none", "int4"):
        eng = make_engine(tiny_hf_model("llama"), device="cpu", quantization=quantization, speculative_config=NGRAM)
        assert eng.speculator.cost.value == row_cost(cpu, quantization != "none")   # the prior, before any step


def test_row_cost_is_learned_from_decode_steps():
    """RowCost fits t = a + b rows over the steps it is shown: exact on a line, close under noise,
    the prior until the rows vary, unmoved by one stalled step, following a machine that changes."""
    cost = RowCost(0.45)
    for _ in range(100):
        cost.observe(1, 0.012)
    assert cost.value == 0.45 and cost.line is None       # one size of step: no slope to see
    for i in range(100):
        cost.observe(1 + i % 7, 0.010 + 0.002 * (1 + i % 7))
    assert cost.value == pytest.approx(0.002 / 0.012, rel=1e-6)
    cost.observe(7, 1.0)                                   # a stall: counted as OUTLIER x the line
    assert abs(cost.value - 0.002 / 0.012) < 0.05
    for _ in range(300):
        cost.observe(1, 0.012)                             # the spread fades: the last fit stays
    assert abs(cost.value - 0.002 / 0.012) < 0.05
    noise = torch.Generator().manual_seed(0)
    for i in range(400):                                   # rows now cost as much as the first
        x = 1 + i % 7
        cost.observe(x, (0.005 + 0.005 * x) * (1 + 0.05 * (2 * torch.rand(1, generator=noise).item() - 1)))
    assert cost.value == pytest.approx(0.5, abs=0.03)
    flat = RowCost(0.45)
    for i in range(100):
        flat.observe(1 + i % 7, 0.01 - 0.0001 * (i % 7))    # faster with more rows: noise, never free
    assert flat.value == MIN_ROW_COST


def test_the_engine_teaches_the_row_cost_its_decode_steps_only(monkeypatch, tiny_hf_model):
    """Every step that only decodes (with or without proposals) reaches RowCost with its rows and the
    model's time; steps with a prompt chunk do not; the learned value is what draft lengths use."""
    eng = make_engine(tiny_hf_model("llama"), speculative_config=NGRAM, max_num_batched_tokens=16)
    seen, expected = [], []
    monkeypatch.setattr(eng.speculator.cost, "observe", lambda rows, seconds: seen.append((rows, seconds)))
    prompt = [5, 6, 7, 8] * 6   # 24 tokens: two chunks of 16, then decode steps with proposals
    for i in range(2):
        eng.add_request(prompt, SamplingParams(max_tokens=24 - 8 * i, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        if not eng.step():
            continue
        record = eng.last_step
        if record.num_prefill_chunks == 0 and record.num_decodes:
            expected.append((record.num_decode_tokens, record.duration))
    assert len(seen) == len(expected) and len(expected) > 10
    assert [rows for rows, _ in seen] == [rows for rows, _ in expected]
    assert any(rows > 2 for rows, _ in seen)                            # proposals verified
    assert all(0 < t <= duration for (_, t), (_, duration) in zip(seen, expected, strict=True))
    monkeypatch.setattr(eng.speculator.cost, "value", 1.0)              # rows as dear as a step: k = 0
    eng.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
        assert eng.last_step.num_decode_tokens <= 1
    assert eng.stats().spec_row_cost == 1.0


def test_proposal_cost_is_learned_per_proposed_token():
    """p = the proposer's seconds per proposed token over the step's one-row time (the step's
    seconds over 1 + c (rows - 1)), a decayed mean; steps without proposals leave it; draft lengths
    weigh it with the row cost, so a proposer as dear as a step stops a request speculating."""
    cost = ProposalCost()
    assert cost.value == 0.0
    cost.observe(0.02, 4, 0.01, 5, 0.25)      # one row 0.005 s; 0.005 s per proposed token
    assert cost.value == pytest.approx(1.0)
    cost.observe(0.0, 0, 0.01, 1, 0.25)       # nothing proposed: no measure
    assert cost.value == pytest.approx(1.0)
    for _ in range(300):
        cost.observe(0.001, 4, 0.01, 5, 0.25)   # 0.05 of a one-row step per token
    assert cost.value == pytest.approx(0.05, abs=0.01)
    likely = 0.9
    assert draft_length(likely, 6, 1, ROW_COST, 0.05) > 0
    assert draft_length(likely, 6, 1, ROW_COST, 1.0) == 0
    # the same proposal cost weighs more in a larger batch, whose rows share each step's weight read
    assert draft_length(likely, 6, 32, ROW_COST, 0.05) < draft_length(likely, 6, 1, ROW_COST, 0.05)


def test_a_dear_proposer_stops_speculating(monkeypatch, tiny_hf_model):
    """The engine teaches ProposalCost the time of each step's proposing. A proposer that always
    proposes the right tokens (the greedy continuation, read from a plain run) and costs nothing goes
    on proposing; the same proposer made slow (50 ms a call: ten steps, each held at 5 ms so that the
    ratio does not move with the machine's load) is learned as so dear that its requests stop
    proposing, probes included."""
    target = tiny_hf_model("llama")
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    continuation = run(engine(target), [prompt], params)[0].output_token_ids

    class Oracle:
        name, samples, steady, keyed, keys = "ngram", False, True, False, (0,)

        def __init__(self, delay: float):
            self.delay = delay

        def propose(self, jobs):
            time.sleep(self.delay)
            return [(continuation[len(r.output_token_ids):len(r.output_token_ids) + k], 0) for r, k in jobs]

        def release(self, request):
            pass

    drafted = {}
    for delay in (0.0, 0.05):
        eng = make_engine(target, speculative_config=NGRAM)
        pin_row_cost(eng, monkeypatch)
        monkeypatch.setattr(eng.speculator, "observe_step",
                            lambda rows, seconds, observe=eng.speculator.observe_step: observe(rows, 0.005))
        eng.speculator.proposer = Oracle(delay)
        assert run(eng, [prompt], params)[0].output_token_ids == continuation
        drafted[delay] = eng.speculator.stats.num_draft_tokens
        assert (eng.speculator.proposal_cost.value > 1.0) == (delay > 0)
    assert drafted[0.05] * 3 < drafted[0.0]
    # so dear that proposals accepted every time would not pay: not even probes (the last engine)
    assert run(eng, [prompt], params)[0].output_token_ids == continuation
    assert eng.speculator.stats.num_draft_tokens == drafted[0.05]


def test_a_drafts_catch_up_rows_run_as_one_decode_step(tiny_gguf_model, tiny_hf_model, poor_draft, monkeypatch):
    """A draft's catch-up (its requests' few uncomputed rows: at most num_speculative_tokens + 2 in
    a steady step) enters attention as single-query entries, as verification does, so the step is
    a decode step, the whole stack in one C call, with the logits of the multi-row prefill path;
    a request with more rows keeps the prefill path (and the layer loop)."""
    eng = make_engine(tiny_gguf_model("llama", "Q8_0"), enable_prefix_caching=False, kv_cache_dtype="float32")
    prompts = [[1, 5, 9, 5, 9, 5, 2, 7], list(range(2, 12)), [4, 4, 6]]
    uncomputed = [2, 4, 2]   # (8 rows: at most what a dense plan's decode stack takes)
    requests = [eng.add_request(p, SamplingParams(max_tokens=8)) for p in prompts]
    for request, prompt, n in zip(requests, prompts, uncomputed, strict=True):
        assert eng.kv.allocate_slots(request, len(prompt))
        if len(prompt) > n:   # the rows before them computed
            input_ids, positions, meta, _, _ = eng.runner.prepare([(request, len(prompt) - n)])
            with torch.inference_mode():
                eng.model(input_ids, positions, meta)
            request.num_computed_tokens = len(prompt) - n
    stacks = []
    real = kernels.decode_stack
    monkeypatch.setattr(kernels, "decode_stack", lambda *args, **kwargs: stacks.append(1) or real(*args, **kwargs))
    logits = {}
    for rows in (0, 3, 4):
        eng.runner.single_query_rows = rows
        input_ids, positions, meta, _, _ = eng.runner.prepare(list(zip(requests, uncomputed, strict=True)))
        # attention entries: a request's rows together, or each row alone where it has at most `rows`
        assert len(meta.seq_lens) == {0: 3, 3: 5, 4: 8}[rows]
        with torch.inference_mode():
            logits[rows] = eng.model.compute_logits(eng.model(input_ids, positions, meta))
        assert len(stacks) == (rows == 4), "the decode stack runs exactly where every entry has one row"
        stacks.clear()
    # (the quantized matmul rounds its activations to 16 bits a group, so attention's summation order
    # reaches the logits: up to ~1e-3 here, logits ~4 apart, as between the torch backend's own two
    # paths; a row seeing one key too many or too few moves them by ~0.1-1)
    torch.testing.assert_close(logits[4], logits[0], atol=4e-3, rtol=0)
    torch.testing.assert_close(logits[3], logits[0], atol=4e-3, rtol=0)
    assert not torch.equal(logits[0][0], logits[0][1])   # (rows that differ: a comparison that can fail)
    # the draft's runner is the one set so (num_speculative_tokens 3 here), the target's keeps its prompt rows
    spec = engine(tiny_hf_model("llama"), draft=poor_draft)
    assert (spec.speculator.proposer.runner.single_query_rows, spec.runner.single_query_rows) == (5, 0)


def test_speculative_config_is_vllms_dict_or_its_json():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == ("ngram", 4, 3)
    assert SpeculativeConfig.parse({"model": "x.gguf", "num_speculative_tokens": 2}).method == "draft_model"
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).speculative_config \
        == SpeculativeConfig("ngram", 2)
    for bad, message in [({"method": "ngram"}, "num_speculative_tokens is required"),
                         ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle'"),
                         ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                         ({"method": "ngram", "num_speculative_tokens": 10**8}, "at most 128, got 100000000"),
                         # (every step weighs each match length up to it: 10**11 hung the first request)
                         ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 10**11},
                          "prompt_lookup_max must be at most 128, got 100000000000"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key(s) 'typo'"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                           "prompt_lookup_max": 2}, "prompt_lookup_min (4) exceeds"),
                         ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a model"),
                         ("{not json", "not a JSON object"), ("[" * 20000 + "]" * 20000, "nested too deeply"),
                         ([1], "expected a dict")]:
        with pytest.raises(TokenmillError, match=message.replace("(", r"\(").replace(")", r"\)")):
            EngineConfig(speculative_config=bad)


# ---- greedy: identical outputs ---------------------------------------------------------------------


@pytest.mark.parametrize("proposer", ["ngram", "draft-same-weights", "draft-poor"])
def test_greedy_outputs_are_identical_with_speculation(tiny_hf_model, poor_draft, proposer):
    target = tiny_hf_model("llama")
    # a small step budget: long prompts prefill in chunks while the others decode and verify
    kwargs = dict(max_num_batched_tokens=24)
    spec = {"ngram": dict(spec=NGRAM), "draft-same-weights": dict(draft=target),
            "draft-poor": dict(draft=poor_draft)}[proposer]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (40, 33, 25, 40, 3)]
    plain = run(engine(target, **kwargs), PROMPTS, params)
    eng = engine(target, **spec, **kwargs)
    fast = run(eng, PROMPTS, params)
    assert [r.output_token_ids for r in fast] == [r.output_token_ids for r in plain]
    assert [len(r.output_token_ids) for r in fast] == [40, 33, 25, 40, 3]
    stats = eng.speculator.stats
    assert stats.num_accepted_tokens > 0, "nothing was accepted: the test would prove nothing"
    if proposer == "draft-same-weights":   # a perfect draft: every proposal accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens, "nothing was rejected"


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_greedy_outputs_survive_a_preemption_storm(tiny_hf_model, poor_draft, proposer):
    target = tiny_hf_model("llama")
    kwargs = dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=32)
    spec = dict(spec=NGRAM) if proposer == "ngram" else dict(draft=poor_draft)
    prompts = [[i % 7 + 1, 3, i % 5 + 2] * 3 for i in range(10)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = run(engine(target, **kwargs), prompts, params)
    eng = engine(target, **spec, **kwargs)
    fast = run(eng, prompts, params)
    assert eng.scheduler.num_preemptions > 0, "no preemption: the storm did not happen"
    assert eng.speculator.stats.num_draft_tokens > 0
    assert [r.output_token_ids for r in fast] == [r.output_token_ids for r in plain]


# ---- sampling: the same tokens for a seed, the target's distribution ---------------------------------


# (low temperatures: the tiny model's samples then repeat often enough for n-gram proposals to hit)
SAMPLING_OPTIONS = [
    dict(temperature=0.5),
    dict(temperature=0.7, top_k=5, top_p=0.9),
    dict(temperature=0.5, min_p=0.1, presence_penalty=1.5, frequency_penalty=1.0),
    dict(temperature=0.6, repetition_penalty=2.0, logit_bias={4: 2.0, 9: -1.0}),
    dict(temperature=0.6, min_tokens=6, stop_token_ids=[3, 4], logprobs=3),
]


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_a_seeded_request_gets_the_same_tokens_and_logprobs_with_speculation(tiny_hf_model, poor_draft, proposer,
                                                                            monkeypatch):
    """Every row is sampled from the target's processed distribution with the draw plain decoding
    would use there, so penalties, filters, bias, min_tokens and the seed all carry over exactly."""
    target = tiny_hf_model("llama")
    spec = dict(spec=NGRAM) if proposer == "ngram" else dict(draft=poor_draft)
    params = [SamplingParams(max_tokens=30, seed=100 + i, **options) for i, options in enumerate(SAMPLING_OPTIONS)]
    prompt = [1, 5, 9, 5, 9, 5, 9]
    plain_eng, eng = engine(target), engine(target, **spec)
    # whether a request speculates must not hang on the machine's step times; rows held nearly free,
    # so that requests go on speculating after the earlier ones' proposals were mostly rejected
    pin_row_cost(eng, monkeypatch, 0.02)
    # one at a time: alone, a request speculates whenever a proposal is likely enough to pay
    plain = [run(plain_eng, [prompt], p)[0] for p in params]
    fast = [run(eng, [prompt], p)[0] for p in params]
    assert eng.speculator.stats.num_accepted_tokens > 0
    for a, b in zip(fast, plain, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.finish_reason == b.finish_reason
        for (lp_a, top_a), (lp_b, top_b) in zip(a.logprobs, b.logprobs, strict=True):
            assert lp_a == pytest.approx(lp_b, abs=1e-4)
            assert [t for t, _ in top_a] == [t for t, _ in top_b]


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_sampled_outputs_follow_the_target_distribution(tmp_path, monkeypatch, proposer):
    """A 4-token vocabulary, temperature 2, unseeded requests, a draft with other weights (its
    proposals sampled with the noise the verifying rows use) or n-gram lookup (the verifying rows
    draw as plain rows do): the two
    tokens a verification step produces (the first from the row verifying the proposal, the second
    only where that proposal was accepted) against the target's exact distribution: a chi-square
    test at 200k samples, failing at its upper 0.1% point (as the sampler's frequency tests; a
    total-variation bound of 0.002 was within ~1.5x of the sampling noise alone, ~0.0015, and failed
    for some seeds of the random stream; a rule that accepted proposals without checking them is
    off by ~0.1 in total variation, a chi-square in the thousands)."""
    target = make_hf_model("llama", tmp_path / "target", seed=0, overrides={"vocab_size": 4})
    # a one-token prompt: every step is a decode step (the fast path), so 200k samples take a minute;
    # n-gram lookup gets one where nearly every first output token finds a match, whose proposal this
    # model accepts about half the time
    prompt = [2] if proposer == "draft" else [3, 2, 0]
    temperature, batch, samples = 2.0, 20_000, 200_000
    kwargs = dict(max_num_seqs=batch, max_num_batched_tokens=4 * batch, num_kv_blocks=batch + 10)
    config = {"num_speculative_tokens": 2, "disable_by_batch_size": batch}
    if proposer == "draft":
        draft = make_hf_model("llama", tmp_path / "draft", seed=3, overrides={"vocab_size": 4})
        eng = engine(target, config, draft, **kwargs)
    else:
        eng = engine(target, {**NGRAM, **config}, **kwargs)
    # every request speculates, however large the batch (the adaptive draft length would stop them)
    pin_row_cost(eng, monkeypatch, 0.0)
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True)
    counts = torch.zeros(4, 4, 4)
    torch.manual_seed(0)
    # (the cyclic garbage collector's passes over 20k live requests were a third of the test's time;
    # reference counting frees all of it, and the collector is back on for the checks below)
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(samples // batch):
            for r in run(eng, [prompt] * batch, params):
                counts[tuple(r.output_token_ids)] += 1
    finally:
        if collecting:
            gc.enable()
    stats = eng.speculator.stats
    assert stats.num_draft_tokens >= 0.9 * samples
    assert 0.1 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.9, "the proposals are not poor ones"
    reference = make_engine(target)
    p1 = (prefill_logits(reference, prompt)[-1] / temperature).softmax(-1)
    exact = torch.zeros(4, 4, 4)
    for a in range(4):
        p2 = (prefill_logits(reference, prompt + [a])[-1] / temperature).softmax(-1)
        for b in range(4):
            p3 = (prefill_logits(reference, prompt + [a, b])[-1] / temperature).softmax(-1)
            exact[a, b] = p1[a] * p2[b] * p3
    # output tokens 2 and 3 come from verification steps (token 1 from the prefill)
    for position, dims in [(2, (0, 2)), (3, (0, 1))]:
        seen, want = counts.sum(dims).double(), exact.sum(dims).double() * samples
        chi2 = ((seen - want) ** 2 / want).sum().item()
        tv = 0.5 * (seen - want).abs().sum().item() / samples
        assert chi2 < CHI2_999[3], f"output position {position}: chi-square {chi2:.1f}, total variation {tv:.4f}"


# ---- the KV cache after rejections ------------------------------------------------------------------


def kv_rows(eng: LLMEngine, request: Request, n: int) -> torch.Tensor:
    """The request's K/V of positions [0, n) in every layer: [layers, 2, n, kv_heads, head_dim]."""
    positions = torch.arange(n)
    table = torch.tensor(request.block_ids)
    slots = table[positions // eng.config.block_size] * eng.config.block_size + positions % eng.config.block_size
    return torch.stack([cache.flatten(1, 2)[:, slots] for cache in eng.kv_caches]).float()


def test_the_cache_after_rejections_holds_what_plain_decoding_writes(tiny_hf_model, poor_draft):
    target = tiny_hf_model("llama")
    prompt = PROMPTS[2]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng = engine(target, draft=poor_draft, block_size=4)
    fast = eng.add_request(prompt, params)
    while len(fast.output_token_ids) < 30:
        eng.step()
    stats = eng.speculator.stats
    assert stats.num_draft_tokens - stats.num_accepted_tokens >= 5, "too few rejections to test"
    n = fast.num_computed_tokens
    assert len(fast.block_ids) == eng.kv.blocks_for(n), "blocks past the computed tokens were not given back"
    assert all(b not in eng.pool.block_hash for b in fast.block_ids[n // 4:]), "a partial block was cached"
    plain_eng = engine(target, block_size=4)
    plain = plain_eng.add_request(prompt, params)
    while plain.num_computed_tokens < n:
        plain_eng.step()
    assert plain.all_token_ids[:n] == fast.all_token_ids[:n]
    torch.testing.assert_close(kv_rows(eng, fast, n), kv_rows(plain_eng, plain, n), rtol=1e-5, atol=1e-5)


# ---- adaptivity --------------------------------------------------------------------------------------


def test_no_speculation_with_more_requests_running_than_disable_by_batch_size(tiny_hf_model):
    target = tiny_hf_model("llama")
    eng = engine(target, {**NGRAM, "disable_by_batch_size": 2})
    run(eng, [PROMPTS[1]] * 3, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    first = eng.speculator.stats.num_drafts
    assert first == 0
    run(eng, [PROMPTS[1]] * 2, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert eng.speculator.stats.num_drafts > 0


def test_draft_length_adapts_to_each_requests_acceptance(tiny_hf_model, tmp_path, monkeypatch):
    target = tiny_hf_model("llama")
    useless = perturbed(make_hf_model("llama", tmp_path / "useless"), 0.5)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engines = [engine(target, {"num_speculative_tokens": 4}, draft=draft) for draft in (target, useless)]
    for eng in engines:   # (the counts below follow the acceptance alone, not this machine's step times)
        pin_row_cost(eng, monkeypatch)
    good, bad = (run(eng, [PROMPTS[0]], params)[0] for eng in engines)
    # a perfect draft proposes the full 4 (but where max_tokens cuts it) and takes ~5 tokens per step
    assert good.spec.num_draft_tokens >= 4 * (good.spec.num_steps - 1)
    assert good.spec.num_steps <= 60 // 5 + 1
    # proposals that nearly always fail: it stops speculating but for occasional one-token probes
    # (a fixed draft length would verify 4 per token: 240)
    assert bad.spec.num_accepted_tokens <= 0.1 * bad.spec.num_draft_tokens
    assert bad.spec.num_draft_tokens <= 20


# ---- the default model: the Python API and the server ----------------------------------------------

COPY_TASK = [{"role": "user", "content": "Add a docstring to this Python function and return the whole function:\n\n"
              "def area(width, height):\n    if width < 0 or height < 0:\n        raise ValueError('negative size')"
              "\n    return width * height\n"}]


@pytest.fixture(scope="module")
def plain_llm(default_gguf_path):
    from tokenmill import LLM
    return LLM(str(default_gguf_path))


@pytest.fixture(scope="module")
def ngram_llm(default_gguf_path):
    from tokenmill import LLM
    return LLM(str(default_gguf_path), speculative_config={"method": "ngram", "num_speculative_tokens": 4})


def test_default_model_copy_task_is_identical_and_speculation_pays(plain_llm, ngram_llm):
    """Greedy, with stop strings, logprobs and n = 2 seeded samples: the same outputs, and on a
    copying task most of the output comes from accepted proposals."""
    params = [SamplingParams(max_tokens=80, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=80, temperature=0.0, stop=["Error"]),
              SamplingParams(max_tokens=60, temperature=0.7, n=2, seed=5)]
    for sp in params:
        a = ngram_llm.chat(COPY_TASK, sp, use_tqdm=False)[0]
        b = plain_llm.chat(COPY_TASK, sp, use_tqdm=False)[0]
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
        assert [o.finish_reason for o in a.outputs] == [o.finish_reason for o in b.outputs]
        if sp.logprobs:
            assert [list(e) for e in a.outputs[0].logprobs] == [list(e) for e in b.outputs[0].logprobs]
            assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)
        assert b.metrics is None and a.metrics is not None
    stop = ngram_llm.chat(COPY_TASK, params[1], use_tqdm=False)[0].outputs[0]
    assert stop.finish_reason == "stop" and stop.stop_reason == "Error" and stop.text.endswith("Value")
    out = ngram_llm.chat(COPY_TASK, params[0], use_tqdm=False)[0]
    assert out.metrics.spec_num_accepted_tokens >= len(out.outputs[0].token_ids) / 2, out.metrics
    assert out.metrics.spec_num_steps < len(out.outputs[0].token_ids)


def test_default_model_structured_output_with_speculation(plain_llm, ngram_llm):
    schema = {"type": "object", "properties": {"fruit": {"type": "array", "items": {"type": "string"}}},
              "required": ["fruit"]}
    messages = [{"role": "user", "content": "List the fruit as JSON: apples, pears, plums, apples, pears."}]
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_outputs={"json": schema})
    a = ngram_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    b = plain_llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    if a.finish_reason == "stop":
        import json
        assert isinstance(json.loads(a.text)["fruit"], list)


@pytest.mark.slow
def test_default_model_quantized_draft_for_the_dense_target(default_gguf_path, plain_llm):
    """The default GGUF run quantized proposes for the same weights run dense: greedy outputs are
    the dense model's, and nearly every proposal is accepted."""
    from tokenmill import LLM
    dense = LLM(str(default_gguf_path), quantization="none", dtype="float32")
    spec = LLM(str(default_gguf_path), quantization="none", dtype="float32",
               speculative_config={"model": str(default_gguf_path), "num_speculative_tokens": 4})
    messages = [{"role": "user", "content": "Write two sentences about rivers."}]
    params = SamplingParams(max_tokens=64, temperature=0.0)
    a = spec.chat(messages, params, use_tqdm=False)[0]
    b = dense.chat(messages, params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.metrics.spec_acceptance_rate > 0.8, a.metrics
    stats = spec.engine.stats()
    assert stats.spec_proposer == "draft_model" and stats.spec_num_accepted_tokens == a.metrics.spec_num_accepted_tokens


def test_the_drafts_log_lines_and_errors_name_it(tiny_hf_model, tmp_path, caplog):
    """The draft's engine takes the target's settings: where they do not fit the draft, its warning
    and its error say it is the draft's."""
    from tokenmill import LLM
    target = tiny_hf_model("llama")
    spec = {"model": str(target), "num_speculative_tokens": 2}
    with caplog.at_level(logging.INFO, logger="tokenmill.engine.engine"):
        LLM(str(target), speculative_config=spec, dtype="float32", max_model_len=256, num_kv_blocks=4)
    lines = [r.getMessage() for r in caplog.records]
    draft = "speculative_config.model (the draft): "
    assert sum(line.startswith("max_model_len 256 lowered") for line in lines) == 1, lines
    assert sum(line.startswith(draft + "max_model_len 256 lowered") for line in lines) == 1, lines
    assert sum(line.startswith(draft + "memory plan") for line in lines) == 1, lines
    short = make_hf_model("llama", tmp_path / "short", seed=1, overrides={"max_position_embeddings": 64})
    with pytest.raises(TokenmillError, match=r"^speculative_config.model \(the draft\): max_model_len \(128\) exceeds"):
        LLM(str(target), speculative_config={**spec, "model": str(short)}, dtype="float32", max_model_len=128)


def test_a_draft_with_another_tokenizer_is_refused(default_gguf_path, tiny_hf_model):
    from tokenmill import LLM
    with pytest.raises(TokenmillError, match="the draft's tokenizer is not the target's"):
        LLM(str(default_gguf_path), speculative_config={"model": str(tiny_hf_model("llama")),
                                                         "num_speculative_tokens": 2})


def test_server_speculative_config_flag_and_metrics(default_gguf_path, tmp_path):
    import openai
    from test_server import Server, running
    config = '{"method": "ngram", "num_speculative_tokens": 4}'
    s = Server([str(default_gguf_path), "--served-model-name", "smol", "--speculative-config", config],
               tmp_path / "server.log", {})
    with running(s, None):
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=300)
        out = client.chat.completions.create(model="smol", messages=COPY_TASK, max_tokens=60, temperature=0)
        assert "def area(width, height):" in out.choices[0].message.content
        m = s.metrics()
        drafted = m['tokenmill_spec_decode_num_draft_tokens_total{proposer="ngram"}']
        accepted = m['tokenmill_spec_decode_num_accepted_tokens_total{proposer="ngram"}']
        assert 0 < accepted <= drafted
        assert m['tokenmill_spec_decode_num_drafts_total{proposer="ngram"}'] > 0
        assert 0 < m['tokenmill_spec_decode_row_cost{proposer="ngram"}'] <= 1
        # a lookup: not free, and far cheaper than verifying a row
        assert 0 < m['tokenmill_spec_decode_proposal_cost{proposer="ngram"}'] < \
            m['tokenmill_spec_decode_row_cost{proposer="ngram"}']
