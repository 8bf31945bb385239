"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(...)`.

Names and shapes follow vLLM's on purpose. All prompts of one call are submitted to the engine
together and batched by its scheduler.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from tokenmill.engine.input import Messages, PromptType, load_engine
from tokenmill.engine.output import OutputProcessor
from tokenmill.errors import TokenmillError
from tokenmill.outputs import RequestOutput, snapshot_output
from tokenmill.sampling import SamplingParams
from tokenmill.tokenizer import Tokenizer


class LLM:
    """Load a model (a .gguf file, an HF folder, a Hugging Face id, or None for the embedded
    default) and generate."""

    def __init__(self, model: str | os.PathLike | None = None, **engine_args: Any):
        """`engine_args`: the fields of EngineConfig (`tokenizer`, `dtype`, `max_num_seqs`, ...)."""
        self.engine, self.inputs = load_engine(model, **engine_args)
        self.tokenizer: Tokenizer = self.inputs.tokenizer
        self.generation_config = self.inputs.generation_config
        self.model_config = self.engine.model_config
        self._processor = OutputProcessor(self.engine, self.tokenizer)
        self._ids = itertools.count()
        self._busy = threading.Lock()   # held by the one generate / chat / stream call running

    @contextlib.contextmanager
    def _one_call(self) -> Iterator[None]:
        """An LLM steps its engine in the calling thread, so two calls at once (from two threads,
        or a second stream opened while one is still being read) would step each other's
        requests and corrupt the engine's state: the second is refused instead."""
        if not self._busy.acquire(blocking=False):
            raise TokenmillError("LLM: another generate / chat / stream call is running on this LLM (in another "
                                 "thread, or a stream not yet read to the end or closed); an LLM runs one call at a "
                                 "time, from the thread that created it")
        try:
            yield
        finally:
            self._busy.release()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() updated with the model's generation_config.json sampling values."""
        return self.inputs.default_sampling_params()

    # ---- prompts (see InputProcessor) ---------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text, as token ids or as vLLM's dict of
        either (validated)."""
        return self.inputs.tokenize_prompt(prompt)

    def chat_prompt(self, messages: Messages, add_generation_prompt: bool,
                    chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        """The chat template applied to `messages`: (text, token ids)."""
        return self.inputs.chat_prompt(messages, add_generation_prompt, chat_template_kwargs)

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts: a string, a list of token ids, or vLLM's
        dict form ({"prompt": text} or {"prompt_token_ids": ids}), or a list of those. `priority`:
        one int per prompt, lower runs first."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TokenmillError(f"prompts: expected a string, a list of token ids, a dict prompt or a list of "
                                 f"those, got {type(prompts).__name__}")
        tokenized = [self.tokenize_prompt(p) for p in prompts]
        return self._run(tokenized, sampling_params, use_tqdm, priority)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
             tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of {"role", "content"} dicts)
        or to a list of conversations, and generate a reply for each. `chat_template_kwargs`: extra
        template variables for every conversation (vLLM's name; e.g. Qwen3's {"enable_thinking": False}).

        `tools`, `tool_choice`, `parallel_tool_calls`: as in OpenAI's chat API (see tool_calls.py);
        each output's `tool_calls` is then the calls parsed from its text (a list, maybe empty).
        `continue_final_message` (with add_generation_prompt False): each conversation ends with an
        assistant message that the model goes on with (vLLM's name)."""
        conversations = [messages] if isinstance(messages, (list, tuple)) and messages and \
            isinstance(messages[0], dict) else messages
        if not isinstance(conversations, (list, tuple)) or not all(isinstance(c, (list, tuple)) for c in conversations):
            raise TokenmillError("messages: expected a list of {'role', 'content'} dicts or a list of such lists, "
                                 f"got {messages!r:.80}")
        plan = self.inputs.tool_plan(tools, tool_choice, parallel_tool_calls)
        tokenized = [self.inputs.chat_prompt(list(c), add_generation_prompt, chat_template_kwargs, plan,
                                             continue_final_message) for c in conversations]
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if isinstance(params, (list, tuple)):   # (one per conversation; _run checks them)
            params = [plan.sampling_params(p) if isinstance(p, SamplingParams) else p for p in params]
        elif isinstance(params, SamplingParams):
            params = plan.sampling_params(params)
        outputs = self._run(tokenized, params, use_tqdm)
        if tools is not None and plan.parses_output:
            for output in outputs:
                for sample in output.outputs:
                    sample.tool_calls = plan.parser.parse(sample.text).tool_calls
        return outputs

    def _run(self, tokenized: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool,
             priority: Sequence[int] | None = None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(tokenized)
        elif isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
            params = list(sampling_params)
        else:
            raise TokenmillError(f"sampling_params: expected a SamplingParams or a list of them, "
                                 f"got {type(sampling_params).__name__}")
        if len(params) != len(tokenized):
            raise TokenmillError(f"sampling_params: got {len(params)} for {len(tokenized)} prompts")
        priorities = [0] * len(tokenized) if priority is None else list(priority)
        if len(priorities) != len(tokenized) or not all(isinstance(x, int) for x in priorities):
            raise TokenmillError(f"priority: expected {len(tokenized)} ints, one per prompt")
        with self._one_call():
            return self._generate(tokenized, params, priorities, use_tqdm)

    def _generate(self, tokenized: list[tuple[str | None, list[int]]], params: list[SamplingParams],
                  priorities: list[int], use_tqdm: bool) -> list[RequestOutput]:
        ids = []
        try:
            for (text, token_ids), p, prio in zip(tokenized, params, priorities, strict=True):
                request_id = str(next(self._ids))
                self._processor.add_request(request_id, text, token_ids, p, prio)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self._processor.abort(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", leave=False,
               disable=None if use_tqdm else True)   # None: no bar off a terminal (\r frames in logs)
        start, generated = time.perf_counter(), 0
        try:
            while len(finished) < len(ids):
                for out in self._processor.process(self.engine.step()):
                    if out.finished:
                        finished[out.request_id] = out
                        generated += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s")
        except BaseException:
            for request_id in ids:
                self._processor.abort(request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in ids]

    def stream(self, prompt: PromptType | None = None, sampling_params: SamplingParams | None = None, *,
               messages: Messages | None = None,
               chat_template_kwargs: dict[str, Any] | None = None) -> Iterator[RequestOutput]:
        """Generate for one prompt (any one form `generate` takes) or one chat conversation (with
        optional extra template variables as in `chat`), yielding the output after every step that changed it;
        `outputs[i].text` grows, the last yield has finished=True."""
        if (prompt is None) == (messages is None):
            raise TokenmillError("stream(): pass exactly one of prompt or messages")
        if chat_template_kwargs is not None and messages is None:
            raise TokenmillError("chat_template_kwargs: only for messages (a prompt is not rendered by the chat "
                                 "template)")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise TokenmillError(f"sampling_params: expected a SamplingParams, got {type(sampling_params).__name__}")
        text, token_ids = (self.tokenize_prompt(prompt) if messages is None
                           else self.chat_prompt(messages, True, chat_template_kwargs))
        with self._one_call():
            request_id = str(next(self._ids))
            self._processor.add_request(request_id, text, token_ids,
                                        sampling_params or self.get_default_sampling_params())
            try:
                while True:
                    for out in self._processor.process(self.engine.step()):
                        if out.request_id == request_id:
                            yield snapshot_output(out)
                            if out.finished:
                                return
            finally:
                self._processor.abort(request_id)
