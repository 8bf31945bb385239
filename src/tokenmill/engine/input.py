"""The input side shared by the offline `LLM` and the server: a loaded engine's prompts, checked and
tokenized the same way for both.

`load_engine` builds an engine from a model id or path and engine settings (checkpoint, tokenizer,
chat template, end-of-generation ids, generation_config.json's sampling defaults). The
`InputProcessor` it returns turns what a user sends (a prompt string, token ids, a conversation)
into validated token ids, and gives the model's default SamplingParams, so the Python API and the
HTTP server accept and refuse exactly the same things (as vLLM v1's LLMEngine and AsyncLLM share
one input processor).
"""

from __future__ import annotations

from typing import Any

from tokenmill.checkpoint import GGUFCheckpoint, HFCheckpoint, open_checkpoint
from tokenmill.config import EngineConfig
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.request import check_prompt_token_ids
from tokenmill.errors import TokenmillError
from tokenmill.hub import model_path, resolve_model
from tokenmill.sampling import SamplingParams
from tokenmill.tokenizer import (
    Tokenizer,
    chat_messages,
    check_chat_template_kwargs,
    load_tokenizer,
    read_chat_template,
)

PromptType = str | list[int]
Messages = list[dict[str, Any]]

# generation_config.json keys that become default sampling values (as vLLM does).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class InputProcessor:
    """Prompts -> checked token ids for one engine, and its model's default sampling values."""

    def __init__(self, tokenizer: Tokenizer, generation_config: dict[str, Any], vocab_size: int):
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.vocab_size = vocab_size    # the model's (it may exceed the tokenizer's: padded embeddings)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() updated with the model's generation_config.json sampling values."""
        values = {k: self.generation_config[k] for k in _GENERATION_DEFAULTS if k in self.generation_config}
        if self.generation_config.get("do_sample") is False:
            values["temperature"] = 0.0
        return SamplingParams(**values)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or as token ids, checked before
        anything decodes them."""
        if isinstance(prompt, str):
            if not prompt:
                raise TokenmillError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            check_prompt_token_ids(prompt, self.vocab_size)
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


def load_engine(model: str | None = None, **engine_args: Any) -> tuple[LLMEngine, InputProcessor]:
    """Load `model` (a .gguf file, an HF folder, a hub id, or None for the embedded default) with
    `engine_args` (the fields of EngineConfig): the engine and its input processor."""
    try:
        config = EngineConfig(model=model, **engine_args)
    except TypeError as e:
        raise TokenmillError(f"engine settings: {e}") from e
    path = model_path(model)
    ckpt = open_checkpoint(path)
    tokenizer = load_tokenizer(resolve_model(config.tokenizer) if config.tokenizer else
                               ckpt if isinstance(ckpt, GGUFCheckpoint) else path)
    if config.chat_template is not None:
        tokenizer.set_chat_template(read_chat_template(config.chat_template), "chat_template")
    generation_config = ckpt.generation_config if isinstance(ckpt, HFCheckpoint) else {}
    eos = set(tokenizer.eos_token_ids)
    gen_eos = generation_config.get("eos_token_id")
    eos.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    engine = LLMEngine(ckpt, config, frozenset(eos))
    return engine, InputProcessor(tokenizer, generation_config, engine.model_config.vocab_size)
