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

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from tokenmill.checkpoint import GGUFCheckpoint, HFCheckpoint, open_checkpoint
from tokenmill.config import EngineConfig, SpeculativeConfig, resolve_device
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.grammar import GrammarCompiler
from tokenmill.engine.request import check_prompt_token_ids
from tokenmill.errors import TokenmillError
from tokenmill.hub import model_path, resolve_model
from tokenmill.models.loader import checkpoint_config, runs_quantized
from tokenmill.sampling import SamplingParams, SamplingParamsError
from tokenmill.sampling.structured import StructuredOutputsParams
from tokenmill.tokenizer import (
    Tokenizer,
    chat_messages,
    check_chat_template_kwargs,
    end_at_final_message,
    load_tokenizer,
    read_chat_template,
)
from tokenmill.tool_calls import (
    PARSERS,
    MistralToolParser,
    ToolChoice,
    ToolParser,
    detect_tool_parser,
    parse_tool_choice,
    parse_tools,
)

# a prompt: text, token ids, or vLLM's TextPrompt {"prompt": text} / TokensPrompt {"prompt_token_ids": ids}
PromptType = str | list[int] | dict[str, Any]
Messages = list[dict[str, Any]]

# generation_config.json keys that become default sampling values (as vLLM does).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class ToolPlan:
    """How one chat request uses tools: the parser of the model's tool-call syntax (it also renders
    earlier calls in the conversation), what tool_choice allows, and the grammar that keeps the
    output to it (None when the model writes freely)."""

    parser: ToolParser
    choice: ToolChoice
    grammar: str | None

    @property
    def parses_output(self) -> bool:
        """Whether the output is read for tool calls (not with tool_choice "none", or no tools)."""
        return self.choice.mode != "none"

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the grammar as its constraint; special tokens kept in the text where the
        syntax is made of them (Mistral's [TOOL_CALLS])."""
        changes: dict[str, Any] = {}
        if self.grammar is not None:
            if params.structured_outputs is not None:
                # (of the formats, only generic has a grammar for "auto")
                kept = ("to the generic tool-call format's answer, {\"tool_calls\": [...]} or {\"content\": "
                        "\"...\"}" if self.choice.mode == "auto" else "to tool calls")
                raise SamplingParamsError("tool_choice", f"{self.choice.name or self.choice.mode!r} keeps the output "
                                          f"{kept}, so it cannot be combined with response_format or another output "
                                          "constraint")
            changes["structured_outputs"] = StructuredOutputsParams(grammar=self.grammar)
        if self.parses_output and isinstance(self.parser, MistralToolParser):
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params


class InputProcessor:
    """Prompts -> checked token ids for one engine, and its model's default sampling values."""

    def __init__(self, tokenizer: Tokenizer, generation_config: dict[str, Any], vocab_size: int,
                 grammars: GrammarCompiler, tool_call_parser: str | None = None):
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.vocab_size = vocab_size    # the model's (it may exceed the tokenizer's: padded embeddings)
        self.grammars = grammars        # the engine's: what the server compiles before submitting
        self.tool_call_parser = tool_call_parser or detect_tool_parser(tokenizer.chat_template)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() updated with the model's generation_config.json sampling values."""
        values = {k: self.generation_config[k] for k in _GENERATION_DEFAULTS if k in self.generation_config}
        if self.generation_config.get("do_sample") is False:
            values["temperature"] = 0.0
        return SamplingParams(**values)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text, as token ids or as vLLM's dict of
        either, checked before anything decodes them."""
        if isinstance(prompt, str):
            if not prompt:
                raise TokenmillError("prompt: must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            check_prompt_token_ids(prompt, self.vocab_size)
            return None, list(prompt)
        if isinstance(prompt, dict):
            keys = set(prompt)
            if keys not in ({"prompt"}, {"prompt_token_ids"}):
                raise TokenmillError(f"prompt: a dict prompt holds one key, \"prompt\" (text) or \"prompt_token_ids\" "
                                     f"(token ids), got {sorted(keys)}")
            text = "prompt" in keys
            inner = prompt["prompt"] if text else prompt["prompt_token_ids"]
            if not (isinstance(inner, str) if text else isinstance(inner, (list, tuple))):
                raise TokenmillError("prompt: \"prompt\" holds text and \"prompt_token_ids\" a list of token ids, "
                                     f"got {type(inner).__name__}")
            return self.tokenize_prompt(inner)
        raise TokenmillError(f"prompt: expected a string, a list of token ids or a dict with \"prompt\" or "
                             f"\"prompt_token_ids\", got {type(prompt).__name__}")

    def tool_plan(self, tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool = True) -> ToolPlan:
        """The tools of a chat request (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`),
        checked (TokenmillError naming the field), with this model's parser and the grammar that
        tool_choice "required" or a named function (and "auto" in the generic syntax) needs."""
        parsed = parse_tools(tools) if tools is not None else []
        choice = parse_tool_choice(tool_choice, parsed or None)
        parser = PARSERS[self.tool_call_parser](parsed)
        grammar = parser.grammar(choice, parallel_tool_calls, self.grammars.special_token_ids(parser.markers)) \
            if parsed else None
        return ToolPlan(parser, choice, grammar)

    def chat_prompt(self, messages: Messages, add_generation_prompt: bool,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: ToolPlan | None = None, continue_final_message: bool = False) -> tuple[str, list[int]]:
        """The chat template applied to `messages` (checked by `chat_messages`): (text, token ids).
        `chat_template_kwargs` are extra template variables (e.g. {"enable_thinking": False});
        `tools` (from `tool_plan`) puts the tools in the prompt as the model's syntax wants them,
        unless tool_choice is "none". `continue_final_message` (vLLM's and transformers' name; with
        add_generation_prompt false): the text ends with the final message, an assistant's, so that
        the model goes on with it (an answer's start that the client gives) instead of a new turn."""
        # Checked before the conversation, so that a reserved key is named even in a bad conversation.
        template_kwargs = check_chat_template_kwargs(chat_template_kwargs)
        if continue_final_message and add_generation_prompt:
            raise TokenmillError("continue_final_message: needs add_generation_prompt false (the model goes on with "
                                 "the final message, not a new turn)")
        plan = tools or self.tool_plan()
        shown = plan.parser.tools if plan.parses_output else []
        conversation = chat_messages(messages)
        if continue_final_message and conversation[-1]["role"] != "assistant":
            raise TokenmillError(f"continue_final_message: the final message must be the assistant's (the start of "
                                 f"its answer), got role {conversation[-1]['role']!r}")
        conversation = plan.parser.prepare_messages(conversation, shown)
        if shown and plan.parser.template_tools() is not None:
            template_kwargs["tools"] = plan.parser.template_tools()
        def render(messages: list[dict[str, Any]]) -> str:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      **template_kwargs)

        text = end_at_final_message(render, conversation) if continue_final_message else render(conversation)
        # The template may already start with BOS; add it only if it does not (as llama.cpp does).
        bos = self.tokenizer.bos_token_id
        has_bos = bos is not None and text.startswith(self.tokenizer.id_to_token(bos))
        return text, self.tokenizer.encode(text, add_special_tokens=not has_bos)


def load_engine(model: str | os.PathLike | None = None, **engine_args: Any) -> tuple[LLMEngine, InputProcessor]:
    """Load `model` (a .gguf file, an HF folder, a hub id, or None for the embedded default) with
    `engine_args` (the fields of EngineConfig): the engine and its input processor."""
    try:
        config = EngineConfig(model=model, **engine_args)
    except TypeError as e:
        raise TokenmillError(f"engine settings: {e}") from e
    ckpt, tokenizer, generation_config, eos = _open_model(config.model, config)
    draft = None
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        draft = _draft_engine(spec, config, tokenizer, eos)
    engine = LLMEngine(ckpt, config, eos, draft)
    engine.grammars = GrammarCompiler(tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    return engine, InputProcessor(tokenizer, generation_config, engine.model_config.vocab_size, engine.grammars,
                                  config.tool_call_parser)


def _open_model(model: str | None, config: EngineConfig) -> tuple[GGUFCheckpoint | HFCheckpoint, Tokenizer,
                                                                   dict[str, Any], frozenset[int]]:
    """(checkpoint, tokenizer, generation_config, every EOS id) of `model`."""
    path = model_path(model)
    ckpt = open_checkpoint(path)
    tokenizer = load_tokenizer(resolve_model(config.tokenizer) if config.tokenizer else
                               ckpt if isinstance(ckpt, GGUFCheckpoint) else path)
    if config.tokenizer:   # (a model may have more embedding rows than tokens, never fewer)
        vocab_size = checkpoint_config(ckpt)[1].vocab_size
        if tokenizer.vocab_size > vocab_size:
            raise TokenmillError(f"tokenizer: {tokenizer.source} has {tokenizer.vocab_size} tokens, more than the "
                                 f"model's vocabulary ({vocab_size}): it is another model's tokenizer")
    if config.chat_template is not None:
        tokenizer.set_chat_template(read_chat_template(config.chat_template), "the chat_template setting")
    generation_config = ckpt.generation_config if isinstance(ckpt, HFCheckpoint) else {}
    eos = set(tokenizer.eos_token_ids)
    gen_eos = generation_config.get("eos_token_id")
    eos.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    return ckpt, tokenizer, generation_config, frozenset(eos)


def _draft_engine(spec: SpeculativeConfig, config: EngineConfig, tokenizer: Tokenizer,
                  eos: frozenset[int]) -> LLMEngine:
    """The draft model's engine: the target's settings but its own model, quantization and (no
    prefix caching: a shadow's blocks are its own) KV pool; refused unless its tokenizer is the
    target's. A draft that runs dense keeps the default activation_precision (the target's applies to
    quantized weights: a dense draft for a quantized target is a pairing this allows)."""
    draft_config = dataclasses.replace(config, model=spec.model, tokenizer=None, chat_template=None,
                                       quantization=spec.quantization, speculative_config=None, tensor_parallel_size=1,
                                       enable_prefix_caching=False)
    ckpt, draft_tokenizer, _, _ = _open_model(spec.model, draft_config)
    if not runs_quantized(ckpt, draft_config.quantization, resolve_device(draft_config.device)):
        draft_config.activation_precision = EngineConfig.activation_precision
    difference = tokenizer.vocabulary_difference(draft_tokenizer)
    if difference is not None:
        raise TokenmillError(f"speculative_config.model: the draft's tokenizer is not the target's ({difference}); "
                             f"a draft model must share the target's vocabulary")
    label = "speculative_config.model (the draft): "
    try:
        return LLMEngine(ckpt, draft_config, eos, label=label)
    except TokenmillError as e:   # (the target's settings, applied to the draft: say which model failed)
        raise TokenmillError(f"{label}{e}") from e
