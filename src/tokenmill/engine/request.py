"""One request's state as the engine sees it: token ids, sampling parameters, progress, blocks.

Vocabulary (the same everywhere): `num_tokens` = prompt + output tokens so far;
`num_computed_tokens` = tokens whose K/V are written to the cache; a step schedules
`num_tokens - num_computed_tokens` (or fewer, for a prefill chunk). Prefill and decode are both
"computed catches up to total".
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from tokenmill.engine.block_table import BlockTable
from tokenmill.engine.grammar import GrammarMatcher
from tokenmill.engine.kv_transfer import LoadedKV
from tokenmill.errors import TokenmillError
from tokenmill.sampling import SamplingParams


@dataclass
class AcceptanceCounts:
    """Decayed counts of speculative proposals accepted and verified, per proposal key (how the
    proposer found them: an n-gram lookup's match length; a draft model's proposals share one
    key). Each record first scales the key's earlier counts by `decay`: recent steps count most."""

    decay: float
    counts: dict[int, tuple[float, float]] = field(default_factory=dict)   # key -> (accepted, verified)

    def get(self, key: int) -> tuple[float, float]:
        return self.counts.get(key, (0.0, 0.0))

    def record(self, key: int, accepted: int, verified: int) -> None:
        a, v = self.get(key)
        self.counts[key] = (self.decay * a + accepted, self.decay * v + verified)


SPEC_DECAY = 0.8
"""A request's acceptance counts keep this much of their weight per verification (adaptive k)."""


@dataclass
class SpecState:
    """A request's speculative decoding so far: counts for its metrics, and its acceptance counts
    per proposal key, from which its draft length is chosen (engine/speculative.py)."""

    num_steps: int = 0            # steps that verified at least one proposed token
    num_draft_tokens: int = 0     # proposed tokens verified
    num_accepted_tokens: int = 0  # of which accepted
    acceptance: AcceptanceCounts = field(default_factory=lambda: AcceptanceCounts(SPEC_DECAY))
    key: int = 0                  # the key of the proposals this step verifies
    idle_steps: int = 0           # steps since it last speculated


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def generator_seed(seed: int) -> int:
    """What a request's `seed` (-2**63 .. 2**64 - 1) seeds its torch CPU generator with. That
    generator keeps only the low 32 bits of its seed, so seeds differing only above them (0 and
    2**32) drew the same numbers. The high half, hashed (the top 32 bits of its product with the
    64-bit golden-ratio constant), is mixed into the low one instead; seeds 0 .. 2**32 - 1 are kept
    as they are. (-1 and 2**64 - 1 are one seed to torch as well.)"""
    s = seed % 2**64
    return (s ^ ((s >> 32) * 0x9E3779B97F4A7C15 % 2**64 >> 32)) & 0xFFFFFFFF


@dataclass(eq=False)   # a request is itself: found in the scheduler's lists by identity, not field by field
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                       # resolved: never None here
    eos_token_ids: frozenset[int]         # empty when params.ignore_eos
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    priority: int = 0                     # lower runs first (ties: earlier arrival first)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0            # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    num_forced_pending: int = 0           # output tokens a grammar forced whose K/V is not computed yet
    tables: list[BlockTable] = field(default_factory=list)    # one per KV cache group, once allocated
    block_hashes: list[bytes] = field(default_factory=list)   # chained hashes of full blocks so far
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    ended_by_token: bool = False          # by an EOS or stop token: the last output token, not part of the text
    error: str | None = None              # why it failed, when finish_reason is "error"
    error_param: str | None = None        # the params field whose value made it fail (the request's own input)
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # the output's constraint (params.structured_outputs)
    # Speculative decoding (engine/speculative.py), set for one step by the speculator:
    spec_token_ids: list[int] = field(default_factory=list)   # proposed tokens this step verifies
    spec_masks: list | None = None         # with a grammar: the mask of each verified row
    spec_noise: torch.Tensor | None = None  # [rows, V] the sampler's noise for its rows (sampled requests)
    spec_noise_states: list[torch.Tensor] | None = None   # its generator's state before each row, and after
    spec: SpecState = field(default_factory=SpecState)   # its acceptance so far (adaptive k)
    # Prefill/decode disaggregation (engine/kv_transfer.py):
    kv_export: bool = False                # a producer's: export the prompt's K/V once computed
    kv_exported: str | None = None         # ... under this name
    kv_load: LoadedKV | None = None        # a consumer's: K/V of a prompt prefix, written in at admission
    # Per output token: (logprob of the sampled token, [(token_id, logprob), ...] top-k).
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # Per prompt token after the first, once computed (params.prompt_logprobs): (its logprob, its
    # rank, [(token_id, logprob), ...] top-k).
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] = field(default_factory=list)

    all_token_ids: list[int] = field(init=False)   # prompt + output, kept in step with output_token_ids

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(generator_seed(self.params.seed))

    @property
    def block_ids(self) -> list[int]:
        """The first KV cache group's block table (every layer's, in a model with one group)."""
        return self.tables[0].block_ids if self.tables else []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt's log-probabilities are asked for and not all computed yet (they need the
        prompt's rows computed: no prefix-cache hit)."""
        return self.params.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def check_stop(self, max_model_len: int) -> None:
        """After appending a token: EOS, a stop token, max_tokens or the context limit."""
        last = self.output_token_ids[-1]
        if len(self.output_token_ids) >= self.params.min_tokens:
            if last in self.eos_token_ids or (self.params.stop_token_ids and last in self.params.stop_token_ids):
                self.ended_by_token = True
                return self.finish("stop", None if last in self.eos_token_ids else last)
        if len(self.output_token_ids) >= self.max_tokens or self.num_tokens >= max_model_len:
            self.finish("length")


def check_prompt_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """A prompt given as token ids: at least one, each an int in the vocabulary. Checked before
    anything decodes them (a huge or negative id would overflow the tokenizer)."""
    if not token_ids:
        raise TokenmillError("prompt: must contain at least one token")
    bad = [t for t in token_ids if isinstance(t, bool) or not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        shown = repr(bad[0]) if not isinstance(bad[0], int) or abs(bad[0]) < 10**30 else "a huge integer"
        raise TokenmillError(f"prompt: token id {shown:.60} is out of range [0, {vocab_size})")
