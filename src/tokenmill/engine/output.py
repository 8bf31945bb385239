"""Turns engine token ids into user-facing outputs: incremental text, stop strings, logprobs.

This runs after each engine step, outside the model's token loop, and is shared by the offline
`LLM` and the server's AsyncEngine. A request with `n` samples runs as n child requests
(parallel_sampling.py); their outputs are merged here into one RequestOutput.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.parallel_sampling import ParentRequest
from tokenmill.engine.request import Request, SpecState
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.sampling import SamplingParams, StopStringMatcher
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Sample:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher | None
    num_seen: int = 0      # engine tokens already processed
    spec: SpecState | None = None   # its speculative decoding counts (when the engine speculates)


@dataclass
class _Parent:
    request: ParentRequest
    output: RequestOutput
    samples: dict[str, _Sample]   # by child request id


class OutputProcessor:
    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0) -> None:
        """Submit a request (its n samples as child requests, see ParentRequest)."""
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = ParentRequest.fan_out(request_id, prompt_token_ids, params, priority,
                                        share_prompt=self.engine.kv.enable_prefix_caching)
        parent = _Parent(request, RequestOutput(request_id, prompt, list(prompt_token_ids)), {})
        for i, (child_id, _) in enumerate(request.children):
            completion = CompletionOutput(index=i, text="", token_ids=[],
                                          cumulative_logprob=0.0 if params.logprobs is not None else None,
                                          logprobs=[] if params.logprobs is not None else None)
            parent.output.outputs.append(completion)
            parent.samples[child_id] = _Sample(
                completion,
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens),
                StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None,
            )
        request.submit_first(self.engine)   # last: nothing reaches the engine unless the samples exist
        for child_id in parent.samples:
            self._child_parent[child_id] = request_id
        self._parents[request_id] = parent

    def abort(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        for child_id, sample in parent.samples.items():
            self.engine.abort(child_id)
            if sample.output.finish_reason is None:
                sample.output.finish_reason = "abort"
            del self._child_parent[child_id]

    def has_unfinished(self) -> bool:
        return bool(self._parents)

    def process(self, updated: list[Request]) -> list[RequestOutput]:
        """Fold one engine step's updates into the outputs; returns the parents that changed.

        A request whose sample failed (in the engine, or here while detokenizing or matching stop
        strings) ends with `error` set; the failure stays with that request."""
        changed: dict[str, RequestOutput] = {}
        for request in updated:
            parent_id = self._child_parent.get(request.request_id)
            if parent_id is None:
                continue
            parent = self._parents[parent_id]
            changed[parent_id] = parent.output
            if request.finish_reason == "error":
                self._fail(parent, request.request_id, request.error or "unknown error", request.error_param)
                continue
            try:
                self._update(parent, request)
            except Exception as e:
                logger.error("request %s failed while making its output: %s: %s", parent_id, type(e).__name__, e,
                             exc_info=e)
                self._fail(parent, request.request_id, f"{type(e).__name__}: {e}")
        for parent_id, output in changed.items():
            if output.finished:
                for child_id in self._parents.pop(parent_id).samples:
                    del self._child_parent[child_id]
        return list(changed.values())

    def _update(self, parent: _Parent, request: Request) -> None:
        if parent.request.pending:
            parent.request.submit_pending(self.engine, request.arrival_time)
        sample = parent.samples[request.request_id]
        if sample.output.index == 0:
            parent.output.num_cached_tokens = request.num_cached_tokens
            if request.params.prompt_logprobs is not None and parent.output.prompt_logprobs is None and \
                    not request.needs_prompt_logprobs:
                parent.output.prompt_logprobs = [None] + [
                    self._logprob_entry(token_id, lp, rank, top)
                    for token_id, (lp, rank, top) in zip(request.prompt_token_ids[1:], request.prompt_logprobs,
                                                         strict=True)]
            if request.kv_exported is not None:
                parent.output.kv_transfer_params = {"remote_kv": request.kv_exported}
        if self.engine.speculator is not None:
            sample.spec = request.spec
            states = [s.spec for s in parent.samples.values() if s.spec is not None]
            parent.output.metrics = RequestMetrics(sum(s.num_steps for s in states),
                                                   sum(s.num_draft_tokens for s in states),
                                                   sum(s.num_accepted_tokens for s in states))
        self._update_sample(request, sample)

    def _logprob_entry(self, token_id: int, logprob: float, rank: int | None,
                       top: list[tuple[int, float]]) -> dict[int, Logprob]:
        """A token's logprobs entry: the top-k by rank (most likely first), then the token itself
        if it is not among them (with its rank where known)."""
        entry = {tid: Logprob(tlp, i + 1, self.tokenizer.token_text(tid)) for i, (tid, tlp) in enumerate(top)}
        if token_id not in entry:
            entry[token_id] = Logprob(logprob, rank, self.tokenizer.token_text(token_id))
        return entry

    def _fail(self, parent: _Parent, child_id: str, error: str, param: str | None = None) -> None:
        """End the whole request: the failed sample with "error", its siblings aborted."""
        parent.output.error, parent.output.error_param = error, param
        parent.request.pending = []
        for sample_id, sample in parent.samples.items():
            self.engine.finish_request(sample_id, "error" if sample_id == child_id else "abort")
            if sample.output.finish_reason is None or sample_id == child_id:
                sample.output.finish_reason = "error" if sample_id == child_id else "abort"

    def _update_sample(self, request: Request, sample: _Sample) -> None:
        out = sample.output
        new_ids = request.output_token_ids[sample.num_seen:]
        new_logprobs = request.logprobs[sample.num_seen:]
        sample.num_seen = len(request.output_token_ids)
        # A step can add several tokens (speculative decoding, a grammar's forced tokens): each is
        # folded in on its own, so that a stop string ends the output at the token completing it,
        # as it would have one token per step.
        for i, token_id in enumerate(new_ids or [None]):   # (None: it finished without a new token)
            last = i >= len(new_ids) - 1
            if token_id is not None:
                out.token_ids.append(token_id)
            if token_id is not None and out.logprobs is not None:
                lp, top = new_logprobs[i]
                out.logprobs.append(self._logprob_entry(token_id, lp, None, top))
                out.cumulative_logprob += lp
            ends = last and request.is_finished
            # As vLLM: the EOS or stop token that ended the request is in token_ids, not in the text.
            in_text = not (last and request.ended_by_token and not request.params.include_stop_str_in_output)
            delta = sample.detokenizer.step([token_id] if in_text and token_id is not None else [])
            if ends:
                delta += sample.detokenizer.flush()
            if sample.stop is not None:
                emitted, stopped = sample.stop.feed(delta)
                if stopped:
                    out.text += emitted
                    self.engine.finish_request(request.request_id, "stop", sample.stop.matched)
                    out.finish_reason, out.stop_reason = "stop", sample.stop.matched
                    return
                delta = emitted + (sample.stop.flush() if ends else "")
            out.text += delta
        if request.is_finished:
            out.finish_reason, out.stop_reason = request.finish_reason, request.stop_reason
