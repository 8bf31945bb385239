"""What generation returns: RequestOutput with one CompletionOutput per sample (vLLM's shapes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.tool_calls import ToolCall


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None          # 1 = most likely token; None when the rank is not known
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None   # per output token: sampled + top-k alternatives
    finish_reason: str | None = None                   # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None               # the stop token id or stop string, if one ended it
    # LLM.chat(tools=...): the calls parsed from `text` once finished (None without tools; `text` stays whole)
    tool_calls: list[ToolCall] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Speculative decoding's work on one request, summed over its samples (vLLM's `metrics`)."""

    spec_num_steps: int = 0             # steps that verified proposed tokens
    spec_num_draft_tokens: int = 0      # proposed tokens verified
    spec_num_accepted_tokens: int = 0   # of which accepted

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None



@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0    # prompt tokens served by the prefix cache (sample 0's, at admission)
    error: str | None = None      # set when the request failed: a sample ended with finish_reason "error"
                                  # and its siblings were aborted (other requests are not affected)
    error_param: str | None = None  # with `error`: the SamplingParams field whose value made it fail, if one did
                                    # (a structured-output constraint past the grammar engine's limits)
    metrics: RequestMetrics | None = None   # with speculative decoding: its proposals and acceptance
    kv_transfer_params: dict | None = None  # a K/V producer's: {"remote_kv": NAME}, the prompt's exported K/V
    # SamplingParams.prompt_logprobs: per prompt token, its logprob and the top-k at its position
    # (None for the first token, which nothing predicts), once the prompt is computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


def snapshot_output(out: RequestOutput) -> RequestOutput:
    """A copy of `out` that later steps leave alone (the output processor updates `out` in place),
    so a caller can keep each streamed output."""
    return dataclasses.replace(out, outputs=[
        dataclasses.replace(o, token_ids=list(o.token_ids), logprobs=None if o.logprobs is None else list(o.logprobs))
        for o in out.outputs
    ])
