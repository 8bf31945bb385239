"""Speculative decoding: a proposer guesses a request's next k tokens, one target step verifies them.

Per step, before scheduling, `Speculator.propose` gives each running request that is decoding
(one uncomputed token) up to k proposed tokens (`Request.spec_token_ids`). The scheduler schedules
1 + k tokens for it, the runner scores them as k + 1 decode rows of the one packed batch
(engine/runner.py) and samples every row as if it were a plain decode step there, and the
proposals are accepted while they equal the target's own samples. The accepted tokens and the
target's token after them (1 to k + 1 tokens) are appended; the K/V of rejected rows are rolled
back (`KVCacheManager.truncate`).

Why the output distribution is exactly the target's: each row's token is drawn from the target's
processed distribution at that position, given the tokens before it, and a row is only kept when
every token before it is the target's own sample too. A seeded request's rows draw with noise drawn
ahead from its generator (the exponential race: argmax(p / E), E ~ Exp(1) per token; see
sampling/sampler.py), so every kept token is the token plain decoding would have drawn from the
same noise. For a proposer that proposes one token deterministically (n-gram lookup), this is
rejection sampling's rule exactly (accept d with probability p(d); on rejection, a draw from p
without d). A draft model samples its proposals with the same noise E as the rows that verify them
(drawn ahead, `sampler.draw_noise`, seeded or not): its token is argmax(q / E), accepted when it equals
argmax(p / E), which happens with probability at least (1 - TV) / (1 + TV) for TV the total
variation between p and q (Leviathan et al.'s residual rule reaches 1 - TV; it needs a fresh
uniform per row, so a seeded request's tokens would depend on its proposals). With the same
noise, a seeded request's tokens are the same with or without speculation, and greedy rows (the
argmax, no noise) are identical to plain decoding by construction.

Adaptive draft length: a proposal carries a key, how the proposer found it (an n-gram lookup's
match length: a 5-token match is followed far more often than a 1-token one; a draft model's
proposals share one key). Each request keeps decayed counts of its proposals accepted and verified
per key (`SpecState.acceptance`), and the speculator the same counts over all requests (`shared`);
the request's estimate of the probability a that a proposal with that key is accepted is its own
counts with the shared rate counted as SHARED_WEIGHT more trials (a request's first proposals of a
kind start from what the others saw). It takes the k that maximizes the expected tokens per step,
(1 - a^(k+1)) / (1 - a), over its cost. Before proposing, k is chosen for the request's likeliest
key (none proposes where no key would pay); the n-gram proposer looks up that many tokens and k is
chosen again from the key it found (a draft model's proposals have one key). A row costs
c of a batch-1 decode step on top of the weights' one read (`RowCost`: learned from the engine's
own decode steps, starting from `row_cost`, the value measured for its kernel path), so a step of
B plain rows costs 1 + c (B - 1), a request's share of it c + (1 - c) / B,
and k proposed rows add c k: the larger the batch, the more a proposal must be likely to pay
(at B = 1 a > c; at B = 32 with c = 0.15, a > ~0.85 for one row). Proposing one token costs p of a
batch-1 step too (`ProposalCost`, learned: ~0 for n-gram lookup, most of a step for a draft model
about the target's size), added to c for the proposed rows. Where no k > 0 pays, the request does
not speculate, and tries one token every PROBE_INTERVAL steps to learn whether that changed (where
proposals accepted every time would pay). With more than `disable_by_batch_size` requests running,
nobody speculates (nor spends the proposers' time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tokenmill import kernels
from tokenmill.config import SpeculativeConfig
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import AcceptanceCounts, Request
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.snapshot import ScheduledRow
from tokenmill.sampling import Sampler, SamplingBatch
from tokenmill.sampling.sampler import draw_noise

ROW_COST = 0.15
"""The cost of one more verified row, relative to a batch-1 decode step, where a step reads its
weights once for all rows and the rows' arithmetic is cheap beside that: quantized weights on the
VNNI matmul, dense weights, other devices (see docs/ARCHITECTURE.md for the measurement)."""
ROW_COST_NO_VNNI = 0.35
"""The same for quantized weights on a CPU whose matmul has no VNNI (the AVX2 tiles): there a row's
integer arithmetic costs a third of the weights' read, so each extra row adds much more."""
SHARED_DECAY = 0.95
"""Weight of the earlier verifications in the speculator's shared acceptance counts at each new one."""
SHARED_WEIGHT = 2.0
"""How many of a request's own verified proposals the shared acceptance rate counts as."""
PRIOR = (1.5, 2.0)
"""(accepted, verified) assumed of a key before any proposal with it was verified: 3 in 4."""
COST_DECAY = 0.98
"""Weight of the earlier decode steps in RowCost's fit at each new one (about the last 50 count)."""
MIN_ROW_SPREAD = 0.5
"""RowCost fits a line once its steps' row counts vary this much (their weighted variance): before
that, steps of one size give no slope, and the prior stands."""
MIN_ROW_COST = 0.02
"""The least c RowCost reports (a slope at or below 0 is noise: a row is never free)."""
OUTLIER = 1.5
"""A step slower than this many times the fitted line's time counts as this many times it: one stall
(the process descheduled, a page-fault storm) must not move the fit for the next 50 steps, while
a lasting change still moves it, step by step."""
MIN_GAIN = 1.05
"""The least gain, expected tokens per unit of step cost over not speculating, for which a request
speculates. The cost model leaves out speculation's fixed costs (its bookkeeping, lookups, the
proposal rows' sampling) and its estimates are noisy (at a large batch the row cost is a slope
fitted over a few rows' spread), so a predicted gain of a few percent is as likely a loss."""
PROBE_INTERVAL = 16
"""A request that stopped speculating tries one proposed token again after this many steps (where
proposals accepted every time would pay)."""


def ngram_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[list[int], int]:
    """Prompt lookup: for n from max_n down to min_n, find the latest earlier occurrence of the
    last n tokens; the (up to k) tokens that followed it, and n. ([], 0) when none occurs.

    One pass: every earlier position holding the last token is a candidate; its match is extended
    backwards one token at a time (while it still matches, up to max_n), then the longest match
    wins, the latest among equals."""
    ids = np.asarray(tokens, dtype=np.int64)
    last = len(ids) - 1
    ends = np.flatnonzero(ids[:last] == ids[last])   # candidate match ends, each followed by a token
    length = np.ones(len(ends), dtype=np.int64)
    for m in range(1, min(max_n, last)):
        alive = (length == m) & (ends >= m)
        length[alive] += ids[ends[alive] - m] == ids[last - m]
    if not len(ends) or length.max() < min_n:
        return [], 0
    end = int(ends[np.flatnonzero(length == length.max())[-1]])
    return ids[end + 1:end + 1 + k].tolist(), int(length.max())


def row_cost(device: torch.device, quantized: bool) -> float:
    """An extra row's cost relative to a batch-1 decode step, for the target model's decode path."""
    if device.type == "cpu" and quantized and not kernels.has_vnni_matmul():
        return ROW_COST_NO_VNNI
    return ROW_COST


class RowCost:
    """c, an extra row's cost relative to a batch-1 decode step, learned from this engine's own steps.

    Every step that only decodes (each request computing its token, after proposals or forced
    tokens or not) gives its rows x and its seconds t; a least-squares line t = a + b x over the
    recent steps (weights decaying by COST_DECAY per step) gives c = b / (a + b), the slope over a
    one-row step. Speculating requests vary x themselves (1 + k rows each); until the rows seen vary
    enough to fit a line, c is `prior` (row_cost(): measured for the decode path), and a fit that
    no longer has the spread keeps its last value."""

    def __init__(self, prior: float):
        self.value = prior
        self.line: tuple[float, float] | None = None   # (a, b) of the last fit
        self._sums = np.zeros(5)   # decayed sums of 1, x, t, x^2, x t

    def observe(self, rows: int, seconds: float) -> None:
        if self.line is not None:
            seconds = min(seconds, OUTLIER * (self.line[0] + self.line[1] * rows))
        self._sums = COST_DECAY * self._sums + np.array([1.0, rows, seconds, rows * rows, rows * seconds])
        _, sx, st, sxx, sxt = (self._sums / self._sums[0]).tolist()   # weighted means
        spread = sxx - sx * sx
        if spread < MIN_ROW_SPREAD:
            return
        b = (sxt - sx * st) / spread
        a = st - b * sx
        if a + b > 0:
            self.line = (a, b)
            self.value = min(max(b / (a + b), MIN_ROW_COST), 1.0)


class ProposalCost:
    """p, the cost of proposing one token for one request relative to a batch-1 decode step of the
    target, learned from this engine's own steps: a draft model's forward passes are not free (a
    quantized copy of the target costs about as much per step as the target), an n-gram lookup
    nearly is. Each step that verified proposals gives the proposer's seconds per proposed token,
    over the step's one-row time (the target's seconds over 1 + c (rows - 1)); p is their mean with
    weights decaying by COST_DECAY per step, 0 until a step has proposed."""

    def __init__(self):
        self.value = 0.0
        self._sums = np.zeros(2)   # decayed sums of 1 and the per-token costs

    def observe(self, seconds: float, proposed: int, step_seconds: float, rows: int, row_cost: float) -> None:
        one_row = step_seconds / (1 + row_cost * (rows - 1))
        if proposed < 1 or one_row <= 0:
            return
        self._sums = COST_DECAY * self._sums + np.array([1.0, seconds / proposed / one_row])
        self.value = float(self._sums[1] / self._sums[0])


def draft_length(acceptance: float, k_max: int, batch: int = 1, row_cost: float = ROW_COST,
                 proposal_cost: float = 0.0) -> int:
    """The k in 0..k_max that maximizes the request's expected tokens per step over its share of
    the step's cost, for proposals each accepted with probability `acceptance`, with `batch`
    requests running, an extra row costing `row_cost` of a batch-1 step and proposing one token
    `proposal_cost` of it (module docstring); 0 where that gains less than MIN_GAIN."""
    a = min(acceptance, 0.99)
    # A step of B plain rows costs 1 + c (B - 1) batch-1 steps, a request's share of it c + (1 - c) / B;
    # its k proposed rows add c k, and proposing them p k: relative to its share, c' k.
    c = (row_cost + proposal_cost) / (row_cost + (1 - row_cost) / batch)
    gains = [(1 - a ** (k + 1)) / (1 - a) / (1 + c * k) for k in range(k_max + 1)]
    best = max(range(k_max + 1), key=gains.__getitem__)
    return best if gains[best] >= MIN_GAIN else 0


@dataclass
class SpecDecodeStats:
    """Cumulative counts of one proposer (the engine's stats and /metrics)."""

    num_drafts: int = 0             # request-steps that verified at least one proposed token
    num_draft_tokens: int = 0       # proposed tokens verified
    num_accepted_tokens: int = 0    # of which accepted

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted


class NgramProposer:
    """Prompt lookup over the request's prompt and output so far (no model)."""

    name = "ngram"
    samples = False   # its proposals do not depend on the sampling noise
    steady = True     # its last propose() cost what proposing costs (ProposalCost learns from it)
    keyed = True      # a lookup is cheap and finds its key (the match length): k is chosen again from it

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.keys = range(self.min_n, self.max_n + 1)   # the keys its proposals can have

    def propose(self, jobs: list[tuple[Request, int]]) -> list[tuple[list[int], int]]:
        """Per (request, k): up to k tokens, and their key (the match length)."""
        return [ngram_lookup(r.all_token_ids, self.min_n, self.max_n, k) for r, k in jobs]

    def release(self, request: Request) -> None:
        pass


class DraftModelProposer:
    """A smaller model with the target's tokenizer, run by its own engine (its own weights, paged
    KV cache and block pool; `draft` is an LLMEngine whose scheduler is never used). Each target
    request has a shadow request in the draft's cache; a proposal first brings the shadow up to
    the target's tokens (its rejected proposals rolled back, the new tokens computed: the whole
    prompt the first time), then samples k tokens, one draft step each, all requests batched."""

    name = "draft_model"
    samples = True   # it samples with the noise the target's rows will use
    keyed = False    # each proposed token costs a draft step: k is chosen before it runs
    keys = (0,)

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, max_model_len: int, vocab_size: int,
                 max_tokens: int):
        """`max_tokens`: the most tokens proposed to a request at once (num_speculative_tokens)."""
        self.runner, self.kv, self.max_model_len, self.vocab_size = runner, kv, max_model_len, vocab_size
        # a steady catch-up (below) runs as a decode step
        runner.single_query_rows = max_tokens + 2
        self.sampler = Sampler()
        self.shadows: dict[str, Request] = {}
        self.synced: dict[str, int] = {}   # request id -> how many of the shadow's tokens are the target's
        self.steady = True   # False after a propose() that also computed a prompt (a new shadow's)

    def _sync(self, request: Request) -> Request:
        """The request's shadow, holding the target's tokens, its K/V valid where they agree."""
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            # (the target scores the prompt where asked, not its draft)
            params = request.params if request.params.prompt_logprobs is None else \
                replace(request.params, prompt_logprobs=None)
            shadow = self.shadows[request.request_id] = Request(request.request_id, list(request.prompt_token_ids),
                                                                params, request.max_tokens, frozenset())
            shadow.generator = None   # draws nothing: proposals use the target's noise
        same = self.synced.get(request.request_id, 0)   # the target only appends: those stay the same
        for mine, theirs in zip(shadow.all_token_ids[same:], request.all_token_ids[same:]):  # noqa: B905
            if mine != theirs:
                break
            same += 1
        self.synced[request.request_id] = request.num_tokens
        # (at least the last token is computed again: its logits give the first proposal)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, same, request.num_tokens - 1)
        self.kv.truncate(shadow)
        # (no later sync rolls the shadow back past this point: the target keeps what it has now)
        self.kv.release_behind_window(shadow)
        shadow.output_token_ids = list(request.output_token_ids)
        shadow.all_token_ids = list(request.all_token_ids)
        return shadow

    @torch.inference_mode()
    def propose(self, jobs: list[tuple[Request, int]]) -> list[tuple[list[int], int]]:
        """Per (request, k): k sampled tokens (fewer where the draft's pool or context is full), key 0."""
        active: list[tuple[Request, Request, int]] = []   # (target request, shadow, k)
        for request, k in jobs:
            if request.num_tokens + k - 1 > self.max_model_len:
                continue
            shadow = self._sync(request)
            if not self.kv.allocate_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens + k - 1):
                self.release(request)   # no room in the draft's pool: it proposes nothing this step
                continue
            active.append((request, shadow, k))
        proposals: dict[str, list[int]] = {r.request_id: [] for r, _ in jobs}
        # a shadow catching up on more than a verify step adds (the accepted tokens, the target's own and
        # the last one again) is computing a prompt: a new shadow's, or one idle for a while
        self.steady = all(s.num_tokens - s.num_computed_tokens <= k + 2 for _, s, k in active)
        for j in range(max((k for _, _, k in active), default=0)):
            active = [job for job in active if job[2] > j]
            scheduled = [(shadow, shadow.num_tokens - shadow.num_computed_tokens) for _, shadow, _ in active]
            logits, _ = self.runner.logits(scheduled)
            tokens = self._sample(logits, [(r, shadow, j) for r, shadow, _ in active])
            for (request, shadow, _), (_, n), token in zip(active, scheduled, tokens, strict=True):
                shadow.num_computed_tokens += n
                shadow.append_token(token)
                proposals[request.request_id].append(token)
        return [(proposals[r.request_id], 0) for r, _ in jobs]

    def _sample(self, logits: torch.Tensor, rows: list[tuple[Request, Request, int]]) -> list[int]:
        """Each shadow's next token under its request's sampling parameters and noise row j,
        over the target's vocabulary (the draft's logits cut or padded to its width)."""
        vocab = self.vocab_size
        if logits.shape[1] != vocab:
            padded = logits.new_full((logits.shape[0], vocab), float("-inf"))
            width = min(vocab, logits.shape[1])
            padded[:, :width] = logits[:, :width]
            logits = padded
        batch = SamplingBatch.build(
            params=[r.params for r, _, _ in rows],
            prompt_ids=[s.prompt_token_ids for _, s, _ in rows],
            output_ids=[s.output_token_ids for _, s, _ in rows],
            generators=[None] * len(rows),
            vocab_size=vocab,
            eos_token_ids=[r.eos_token_ids for r, _, _ in rows],
            device=logits.device,
            noise=[None if r.spec_noise is None else r.spec_noise[j] for r, _, j in rows],
        )
        return self.sampler(logits, batch).token_ids.tolist()

    def release(self, request: Request) -> None:
        shadow = self.shadows.pop(request.request_id, None)
        self.synced.pop(request.request_id, None)
        if shadow is not None:
            self.kv.free(shadow)


@dataclass
class Speculator:
    """Proposes, per step, the tokens each decoding request verifies, and keeps the counts."""

    config: SpeculativeConfig
    proposer: NgramProposer | DraftModelProposer
    vocab_size: int
    device: torch.device
    cost: RowCost                   # (its prior: row_cost(), the target's decode path)
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    proposal_cost: ProposalCost = field(default_factory=ProposalCost)
    shared: AcceptanceCounts = field(default_factory=lambda: AcceptanceCounts(SHARED_DECAY))   # all requests'
    _proposed: tuple[float, int] = (0.0, 0)   # this step's proposing: seconds, tokens proposed

    def observe_step(self, rows: tuple[ScheduledRow, ...], seconds: float) -> None:
        """After a step ran the model on `rows` in `seconds`: a step that only decodes teaches the row
        cost, and the proposal cost where it verified proposals."""
        if rows and all(r.kind == "decode" for r in rows):
            num_rows = sum(r.num_tokens for r in rows)
            self.cost.observe(num_rows, seconds)
            self.proposal_cost.observe(*self._proposed, seconds, num_rows, self.cost.value)

    def acceptance(self, request: Request, key: int) -> float:
        """The request's estimate that a proposal with this key is accepted (module docstring)."""
        accepted, verified = request.spec.acceptance.get(key)
        shared_accepted, shared_verified = self.shared.get(key)
        shared = (shared_accepted + PRIOR[0]) / (shared_verified + PRIOR[1])
        return (accepted + SHARED_WEIGHT * shared) / (verified + SHARED_WEIGHT)

    def _length(self, request: Request, acceptance: float, k_max: int, costs: tuple[int, float, float],
                probes_pay: bool) -> int:
        """How many of up to k_max proposals, each accepted with probability `acceptance`, the request
        verifies this step."""
        k = draft_length(acceptance, k_max, *costs)
        if k == 0 and k_max > 0 and request.spec.idle_steps >= PROBE_INTERVAL and probes_pay:
            k = 1
        return k

    def propose(self, running: list[Request]) -> None:
        """Set `spec_token_ids` (and, for sampled requests, the noise of their rows) of the running
        requests that speculate this step."""
        self._proposed = (0.0, 0)
        if not running or len(running) > self.config.disable_by_batch_size:
            return
        jobs = []
        costs = (len(running), self.cost.value, self.proposal_cost.value)
        # a probe re-learns the acceptance, where accepting every proposal would pay; a draft model's
        # probe is not cheap (its shadow catches up on every token since it last proposed)
        probes_pay = draft_length(1.0, self.config.num_speculative_tokens, *costs) > 0
        keyed = self.proposer.keyed
        for request in running:
            if request.num_tokens - request.num_computed_tokens != 1 or request.num_forced_pending:
                continue   # prefilling, or computing tokens a grammar forced
            # the proposals and the target's token after them must fit in max_tokens
            k = min(self.config.num_speculative_tokens, request.max_tokens - len(request.output_token_ids) - 1)
            # no proposals where none would pay whatever key they came with (nor the lookup's time, which
            # adds up over a large batch); a keyed proposer's k is chosen again once the key is known
            best = max(self.acceptance(request, key) for key in self.proposer.keys)
            k = self._length(request, best, k, costs, probes_pay)
            if k > 0:
                jobs.append((request, k))
            else:
                request.spec.idle_steps += 1
        if not jobs:
            return
        start = time.perf_counter()
        if self.proposer.samples:
            for request, k in jobs:
                self._draw_noise(request, k + 1)
        proposed = 0
        for (request, _), (drafts, key) in zip(jobs, self.proposer.propose(jobs), strict=True):
            if keyed:
                drafts = drafts[:self._length(request, self.acceptance(request, key), len(drafts), costs, probes_pay)]
            if request.grammar is not None:
                drafts, request.spec_masks = request.grammar.draft_masks(drafts)
            request.spec_token_ids = drafts
            request.spec.key = key
            request.spec.idle_steps = 0 if drafts else request.spec.idle_steps + 1
            proposed += len(drafts)
            if drafts and not self.proposer.samples:
                self._draw_noise(request, len(drafts) + 1)
        # a step that also prefilled a new shadow's prompt is no measure of proposing's cost
        self._proposed = (time.perf_counter() - start, proposed) if self.proposer.steady else (0.0, 0)

    def _draw_noise(self, request: Request, rows: int) -> None:
        # A sampled row needs noise drawn ahead only to be the token plain decoding would draw from
        # the request's own generator, or to be compared with a draft sampled from the same noise;
        # an unseeded row under a proposer that does not sample draws as any row does.
        if not request.params.is_greedy and (request.generator is not None or self.proposer.samples):
            request.spec_noise, request.spec_noise_states = draw_noise(request.generator, rows, self.vocab_size,
                                                                       self.device)

    def verified(self, request: Request, num_tokens: int) -> None:
        """After the step: `num_tokens` of the request's rows were sampled (0 if it was not, e.g.
        preempted): count, update its acceptance, rewind its generator to the rows it used, and
        clear the step's proposals."""
        proposed = len(request.spec_token_ids)
        if proposed and num_tokens:
            accepted = num_tokens - 1
            self.stats.record(proposed, accepted)
            state = request.spec
            state.num_steps += 1
            state.num_draft_tokens += proposed
            state.num_accepted_tokens += accepted
            verified = accepted + (accepted < proposed)   # up to and including the first rejected one
            state.acceptance.record(state.key, accepted, verified)
            self.shared.record(state.key, accepted, verified)
        if request.spec_noise_states is not None:
            request.generator.set_state(request.spec_noise_states[num_tokens])
        request.spec_token_ids = []
        request.spec_masks = request.spec_noise = request.spec_noise_states = None

    def release(self, request: Request) -> None:
        self.proposer.release(request)
