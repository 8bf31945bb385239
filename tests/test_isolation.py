"""Request isolation: a failure that belongs to one request ends that request alone.

Failures are injected at each stage of a step (the model forward, the step after sampling, the
token append, detokenizing, stop-string matching) for one "poisoned" request batched with others.
The poisoned request must end with finish_reason "error" and `error` set; every other request
must produce exactly what it produces alone (greedy and seeded sampled ones), and no KV block or
request may be left behind. The asyncio front (the server's engine) is checked the same way: the
poisoned stream raises, the others finish with their solo outputs.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import Request
from tokenmill.engine.runner import ModelRunner
from tokenmill.sampling import StopStringMatcher
from tokenmill.server.async_engine import AsyncEngine, RequestFailedError
from tokenmill.tokenizer import IncrementalDetokenizer

POISON = 77           # the poisoned request's prompt has this token at position POISON_AT; no other does
POISON_AT = 2
PROMPTS = [[1, 5, 9, 12, 30], [1, 40, 41, 42], [1, 8, 8, 8, 8, 8, 3], [1, 60, 2, 61]]
POISONED = [1, 20, POISON, 21, 22]
MAX_TOKENS = 12


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_hf_model) -> LLM:
    return LLM(str(tiny_hf_model("llama")), dtype="float32")


@pytest.fixture(scope="module")
def solo(llm) -> list[list[int]]:
    """Each prompt's tokens generated alone: greedy for the first two, seeded sampling for the others."""
    params = [greedy(), greedy(), seeded(3), seeded(4)]
    return [llm.generate([p], q, use_tqdm=False)[0].outputs[0].token_ids for p, q in zip(PROMPTS, params, strict=True)]


def run_with_poison(llm: LLM, stop: list[str] | None = None) -> tuple[list, object]:
    params = [greedy(), greedy(), seeded(3), seeded(4)]
    poisoned = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=stop)
    outs = llm.generate(PROMPTS + [POISONED], params + [poisoned], use_tqdm=False)
    return outs[:-1], outs[-1]


def check_isolated(llm: LLM, solo: list[list[int]], stop: list[str] | None = None) -> str:
    others, poisoned = run_with_poison(llm, stop)
    assert [o.outputs[0].token_ids for o in others] == solo
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in others)
    assert poisoned.error is not None and poisoned.outputs[0].finish_reason == "error"
    engine = llm.engine
    assert engine.num_free_blocks == engine.pool.num_blocks and not engine.has_unfinished()
    assert not llm._processor.has_unfinished()
    return poisoned.error


def has_poison(input_ids: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether a packed batch holds the poisoned prompt (a generated token may equal POISON, but
    never at a prompt position)."""
    return bool(((input_ids == POISON) & (positions == POISON_AT)).any())


def poisoned_request(request: Request) -> bool:
    return POISON in request.prompt_token_ids


def test_failing_forward_is_retried_without_the_request_that_fails(llm, solo, monkeypatch):
    forward = type(llm.engine.model).forward
    calls = []

    def failing_forward(self, input_ids, positions, meta):
        calls.append(len(meta.seq_lens))
        if has_poison(input_ids, positions):
            raise RuntimeError("injected forward failure")
        return forward(self, input_ids, positions, meta)

    monkeypatch.setattr(type(llm.engine.model), "forward", failing_forward)
    error = check_isolated(llm, solo)
    assert "injected forward failure" in error
    assert any(n > 1 for n in calls) and calls.count(1) >= 5   # batched steps, then each request alone


def test_failure_after_sampling_keeps_seeded_neighbours_exact(llm, solo, monkeypatch):
    """The failed step had already drawn the seeded rows' noise: their generators are rewound
    before the retry, so they sample exactly what they sample alone."""
    execute = ModelRunner.execute

    def failing_execute(self, scheduled):
        results = execute(self, scheduled)
        if any(poisoned_request(r) for r, _ in scheduled):
            raise RuntimeError("injected failure after sampling")
        return results

    monkeypatch.setattr(ModelRunner, "execute", failing_execute)
    assert "injected failure after sampling" in check_isolated(llm, solo)


def test_failing_token_append_ends_that_request_alone(llm, solo, monkeypatch):
    check_stop = Request.check_stop

    def failing_check_stop(self, max_model_len):
        if poisoned_request(self) and len(self.output_token_ids) == 3:
            raise ValueError("injected stop-check failure")
        return check_stop(self, max_model_len)

    monkeypatch.setattr(Request, "check_stop", failing_check_stop)
    assert "injected stop-check failure" in check_isolated(llm, solo)


def test_failing_detokenizer_ends_that_request_alone(llm, solo, monkeypatch):
    init, step = IncrementalDetokenizer.__init__, IncrementalDetokenizer.step
    poisoned: set[int] = set()

    def tracking_init(self, tokenizer, prompt_ids=(), *args, **kwargs):
        init(self, tokenizer, prompt_ids, *args, **kwargs)
        if POISON in prompt_ids:
            poisoned.add(id(self))

    def failing_step(self, ids):
        if id(self) in poisoned:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")
        return step(self, ids)

    monkeypatch.setattr(IncrementalDetokenizer, "__init__", tracking_init)
    monkeypatch.setattr(IncrementalDetokenizer, "step", failing_step)
    assert "injected detokenizer failure" in check_isolated(llm, solo)


def test_failing_stop_matcher_ends_that_request_alone(llm, solo, monkeypatch):
    feed = StopStringMatcher.feed

    def failing_feed(self, delta):
        if self.matched is None and "POISON" in getattr(self, "stop_strings", ()):
            raise RuntimeError("injected stop-matcher failure")
        return feed(self, delta)

    init = StopStringMatcher.__init__

    def tracking_init(self, stop, *args, **kwargs):
        init(self, stop, *args, **kwargs)
        self.stop_strings = list(stop)

    monkeypatch.setattr(StopStringMatcher, "__init__", tracking_init)
    monkeypatch.setattr(StopStringMatcher, "feed", failing_feed)
    assert "injected stop-matcher failure" in check_isolated(llm, solo, stop=["POISON"])


def test_n_samples_fail_together_and_free_their_blocks(llm, solo, monkeypatch):
    """One sample of an n=3 request fails: the request ends with `error`, its other samples are
    aborted, and its neighbours are untouched."""
    check_stop = Request.check_stop

    def failing_check_stop(self, max_model_len):
        if poisoned_request(self) and self.request_id.endswith("#1"):
            raise ValueError("injected failure of sample 1")
        return check_stop(self, max_model_len)

    monkeypatch.setattr(Request, "check_stop", failing_check_stop)
    params = [greedy(), greedy(), seeded(3), seeded(4)]
    poisoned = SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=1.0, seed=5, ignore_eos=True)
    outs = llm.generate(PROMPTS + [POISONED], params + [poisoned], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:-1]] == solo
    assert "injected failure of sample 1" in outs[-1].error
    assert [o.finish_reason for o in outs[-1].outputs] == ["abort", "error", "abort"]
    assert llm.engine.num_free_blocks == llm.engine.pool.num_blocks and not llm.engine.has_unfinished()


def test_every_request_failing_leaves_the_engine_usable(llm, solo, monkeypatch):
    def broken(self, scheduled):
        raise RuntimeError("injected: everything fails")

    with monkeypatch.context() as m:
        m.setattr(ModelRunner, "execute", broken)
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "error" and "everything fails" in o.error for o in outs)
    assert llm.engine.num_free_blocks == llm.engine.pool.num_blocks
    assert llm.generate([PROMPTS[0]], greedy(), use_tqdm=False)[0].outputs[0].token_ids == solo[0]


def test_async_engine_fails_the_poisoned_stream_alone(llm, solo, monkeypatch):
    """The server's engine front: the poisoned stream raises RequestFailedError, the others finish
    with their solo tokens, and the loop keeps serving."""
    forward = type(llm.engine.model).forward

    def failing_forward(self, input_ids, positions, meta):
        if has_poison(input_ids, positions):
            raise RuntimeError("injected forward failure")
        return forward(self, input_ids, positions, meta)

    monkeypatch.setattr(type(llm.engine.model), "forward", failing_forward)

    async def main() -> tuple[list, BaseException | None]:
        engine = AsyncEngine(llm.engine, llm.inputs, max_queued_requests=8)
        engine.start()
        try:
            params = [greedy(), greedy(), seeded(3), seeded(4)]
            streams = [await engine.add_request(f"r{i}", None, p, q) for i, (p, q) in
                       enumerate(zip(PROMPTS, params, strict=True))]
            bad = await engine.add_request("bad", None, POISONED, greedy())

            async def last(stream):
                outputs = [out async for out in stream]
                return outputs[-1]

            results = await asyncio.gather(*(last(s) for s in streams), last(bad), return_exceptions=True)
            again = await last(await engine.add_request("again", None, PROMPTS[0], greedy()))
            return results + [again], None
        finally:
            await engine.stop()

    results, _ = asyncio.run(main())
    *others, bad, again = results
    assert [o.outputs[0].token_ids for o in others] == solo
    assert isinstance(bad, RequestFailedError) and "injected forward failure" in str(bad)
    assert again.outputs[0].token_ids == solo[0]
    assert llm.engine.num_free_blocks == llm.engine.pool.num_blocks


def test_engine_step_returns_the_failed_request(tiny_hf_model, solo, monkeypatch):
    """LLMEngine.step returns the failed request (finished, reason "error") so callers see it."""
    from engine_helpers import make_engine

    engine: LLMEngine = make_engine(tiny_hf_model("llama"))
    good = engine.add_request(PROMPTS[0], greedy())
    bad = engine.add_request(POISONED, greedy())
    forward = type(engine.model).forward

    def failing_forward(self, input_ids, positions, meta):
        if has_poison(input_ids, positions):
            raise RuntimeError("boom")
        return forward(self, input_ids, positions, meta)

    monkeypatch.setattr(type(engine.model), "forward", failing_forward)
    updated = engine.step()
    assert bad in updated and bad.finish_reason == "error" and "boom" in bad.error
    assert good in updated and len(good.output_token_ids) == 1
    while engine.has_unfinished():
        engine.step()
    assert good.output_token_ids == solo[0]
    assert engine.num_free_blocks == engine.pool.num_blocks


def test_the_cli_reports_a_failed_request(tiny_hf_model, monkeypatch, capsys):
    """`tokenmill generate` exits 1 with the error (not "[finish_reason: error]" and 0); `chat`
    says so, drops the turn and goes on."""
    from tokenmill.cli import main

    def broken(self, scheduled):
        raise RuntimeError("injected: the step fails")

    monkeypatch.setattr(ModelRunner, "execute", broken)
    model = ["--model", str(tiny_hf_model("llama")), "--dtype", "float32", "--max-tokens", "3"]
    assert main(["generate", "Hello", *model]) == 1
    err = capsys.readouterr().err
    assert "tokenmill: error: the request failed: RuntimeError: injected: the step fails" in err
    lines = iter(["hi", "again"])

    def typed(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", typed)
    assert main(["chat", *model]) == 0
    assert capsys.readouterr().err.count("tokenmill: error: the reply failed") == 2
