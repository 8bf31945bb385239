"""n > 1 (parallel sampling): a request with n samples runs as n child requests in the engine.

Child i is "{request_id}#{i}" with n=1 and, for a seeded request, seed + i, so the samples differ
but each is reproducible. With prefix caching on, child 0 is submitted first and the others once
its prompt is computed, so they map its cached prompt blocks instead of computing their own
copies. The output processor merges the children's outputs back into one RequestOutput.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenmill.engine.engine import LLMEngine
from tokenmill.sampling import SamplingParams


@dataclass
class ParentRequest:
    prompt_token_ids: list[int]
    priority: int
    children: list[tuple[str, SamplingParams]]   # (child request id, its params); sample i at index i
    pending: list[tuple[str, SamplingParams]]    # children not submitted yet (waiting for child 0's prompt)

    @classmethod
    def fan_out(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                share_prompt: bool) -> ParentRequest:
        """The children of a request; with `share_prompt` (prefix caching on) all but child 0 wait."""
        # (the prompt's log-probabilities are computed once, by child 0)
        children = [(f"{request_id}#{i}", dataclasses.replace(params, n=1, seed=None if params.seed is None
                                                                else params.seed + i,
                                                                prompt_logprobs=params.prompt_logprobs if i == 0
                                                                else None))
                    for i in range(params.n)]
        return cls(list(prompt_token_ids), priority, children, children[1 if share_prompt else params.n:])

    def submit_first(self, engine: LLMEngine) -> None:
        """Submit the children that need not wait (all of them, or child 0): all or none."""
        self._submit(engine, self.children[:len(self.children) - len(self.pending)], None)

    def submit_pending(self, engine: LLMEngine, arrival_time: float) -> None:
        """Child 0 has its first token, so its prompt blocks are cached: submit the others, in its
        place in the queue (its arrival time)."""
        pending, self.pending = self.pending, []
        self._submit(engine, pending, arrival_time)

    def _submit(self, engine: LLMEngine, children: list[tuple[str, SamplingParams]],
                arrival_time: float | None) -> None:
        submitted: list[str] = []
        try:
            for child_id, params in children:
                engine.add_request(self.prompt_token_ids, params, request_id=child_id, priority=self.priority,
                                   arrival_time=arrival_time)
                submitted.append(child_id)
        except Exception:
            for child_id in submitted:
                engine.abort(child_id)
            raise
