"""OpenAI request bodies as pydantic models, and OpenAI's error body.

Every model forbids unknown fields, so a field tokenmill does not implement is a 400 naming it,
never silently ignored. Types are strict (JSON numbers may still be ints where floats are asked
for): "0.5" is not a temperature. Value ranges are checked once, by `SamplingParams`; the models
only check shapes. vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens) and its
`chat_template_kwargs` are accepted too.

Client libraries send some OpenAI fields tokenmill does not implement, mostly with values that ask
for nothing (`store: false`, `response_format: {"type": "text"}`). Those fields are declared, and
NO_OP_VALUES is the one list of the values accepted; any other value would change the output (or
promise something tokenmill does not do), so it stays a 400 naming the field and saying why.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, ValidationInfo, field_validator

from tokenmill.errors import TokenmillError
from tokenmill.tokenizer import ChatRole, check_chat_template_kwargs


class ErrorBody(Exception):
    """An error to send as OpenAI's body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, counted: bool = False):
        """`counted`: the request ran, and the engine front counted how it ended (in /metrics)."""
        super().__init__(message)
        self.counted = counted
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class NoOp:
    """The values of an unimplemented OpenAI field that change nothing, besides null (the default,
    always accepted), and why every other value is refused."""

    values: tuple[Any, ...]
    refusal: str

    def accepts(self, value: Any) -> bool:
        # Compared as JSON (`False == 0` in Python; the strict field types already keep a 0 out).
        return value is None or any(json.dumps(value) == json.dumps(v) for v in self.values)

    def error(self) -> str:
        accepted = ", ".join(json.dumps(v) for v in (None, *self.values))
        return f"{self.refusal} (accepted: {accepted})"


# Unimplemented OpenAI fields, by name wherever they occur (request, messages[i], stream_options),
# with the values accepted because they change nothing. Declared with their types on the models below.
# Also accepted with any value, because they describe a request without changing its output: `user`,
# `safety_identifier`, `prompt_cache_key`, `metadata` (OpenAI keeps it with stored completions; kept
# nowhere here) and `messages[i].name` (passed to the chat template, as vLLM does). `best_of` is
# accepted when it equals `n` (see CompletionRequest).
NO_OP_VALUES: dict[str, NoOp] = {
    # chat requests
    "store": NoOp((False,), "tokenmill stores no completions, so it cannot keep store: true"),
    "service_tier": NoOp(("auto", "default"), "tokenmill serves every request the same way"),
    "prediction": NoOp((), "predicted outputs are not implemented"),
    "modalities": NoOp((["text"],), "only text output is implemented"),
    # (request: audio output settings; message: an earlier audio reply)
    "audio": NoOp((), "audio is not implemented"),
    "reasoning_effort": NoOp((), "tokenmill does not control reasoning; for a model whose chat template has a "
                                 "switch, use chat_template_kwargs (e.g. {\"enable_thinking\": false})"),
    # completion requests
    "suffix": NoOp(("",), "inserting text before a suffix is not implemented"),
    # stream_options
    "include_obfuscation": NoOp((False,), "stream obfuscation is not implemented"),
    # messages[i]: what a client sends back of an earlier reply's message
    "refusal": NoOp((), "a refusal is not part of the prompt tokenmill renders"),
    "annotations": NoOp(([],), "annotations are not part of the prompt tokenmill renders"),
    # (the deprecated form of tool calls: send tools / tool_calls instead)
    "function_call": NoOp((), "the deprecated function_call is not implemented; use tools and tool_calls"),
    "functions": NoOp((), "the deprecated functions field is not implemented; use tools"),
}


# Any JSON object. (Not dict[str, Any]: its JSON schema, `additionalProperties: true`, is not one the
# fuzz test's schema-to-strategy compiler reads.)
JsonObject = dict[str, JsonValue]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*")
    @classmethod
    def _only_no_op_values(cls, value: Any, info: ValidationInfo) -> Any:
        rule = NO_OP_VALUES.get(info.field_name or "")
        if rule is not None and not rule.accepts(value):
            raise ValueError(rule.error())
        return value


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None     # vLLM's: every chunk carries the usage so far
    include_obfuscation: bool | None = None


def _template_kwargs(kwargs: JsonObject | None) -> JsonObject | None:
    """`chat_template_kwargs` checked as the Python API checks it (the 400 names the field)."""
    try:
        check_chat_template_kwargs(kwargs)
    except TokenmillError as e:
        raise ValueError(str(e).removeprefix("chat_template_kwargs: ")) from None
    return kwargs


class _SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None   # the prompt's tokens' logprobs (and top k), in vLLM's form
    priority: int = 0                    # lower runs first (the scheduler orders by it; ties: arrival)
    return_tokens_as_token_ids: bool = False   # logprobs name each token "token_id:<id>"
    # vLLM's structured output: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} |
    # {"json_object": true} (see sampling/structured.py), and its older guided_* names for the same.
    structured_outputs: JsonObject | None = None
    guided_json: JsonValue = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's prefill/decode disaggregation field (sent by server/frontend.py; see engine/kv_transfer.py)
    kv_transfer_params: JsonObject | None = None


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        # Generating best_of samples and returning the n most likely is not implemented; best_of == n
        # returns every sample, which is what n alone does. (`n` is validated before: it is declared first.)
        n = info.data.get("n", 1)
        if best_of is not None and best_of != n:
            raise ValueError(f"choosing the best {n} of {best_of} samples is not implemented (accepted: null or "
                             f"n, {n})")
        return best_of

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> PromptInput:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(prompt, str) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) and p for p in prompt) or is_ids(prompt) or all(is_ids(p) for p in prompt):
                return prompt
        raise ValueError("must be a non-empty string, a list of non-empty strings, a list of token ids or a list "
                         "of non-empty lists of token ids")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: ChatRole
    # (None only in an assistant message with tool_calls; an empty list of parts is refused, as OpenAI does)
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[JsonObject] | None = None     # an earlier assistant reply's calls
    tool_call_id: str | None = None                # a "tool" message: the call it answers
    # Only as no-ops (NO_OP_VALUES): a client's copy of an earlier reply's message holds them.
    refusal: str | None = None
    function_call: JsonObject | None = None
    audio: JsonObject | None = None
    annotations: list[JsonObject] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: role, content as one string, and `name`,
        `tool_calls`, `tool_call_id` when given (as vLLM passes them; a template that knows them
        renders them, the others ignore them). Checked further by tokenizer.chat_messages."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: JsonObject | None = None
    add_generation_prompt: bool = True        # vLLM's: false with continue_final_message
    continue_final_message: bool = False      # vLLM's: the model goes on with the final (assistant) message
    echo: bool = False                        # vLLM's: the reply begins with the final message, if the assistant's
    # Accepted with any value (see NO_OP_VALUES' comment).
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # tool calling (see tool_calls.py)
    tools: list[JsonObject] | None = None
    tool_choice: str | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    # {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: JsonObject | None = None
    # Accepted only with the values in NO_OP_VALUES.
    store: bool | None = None
    service_tier: str | None = None
    functions: list[JsonObject] | None = None
    function_call: str | JsonObject | None = None
    prediction: JsonObject | None = None
    modalities: list[str] | None = None
    audio: JsonObject | None = None
    reasoning_effort: str | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, kwargs: JsonObject | None) -> JsonObject | None:
        return _template_kwargs(kwargs)


class BurstRequest(_Body):
    """POST /engine/burst: `requests` generated prompts of `prompt_tokens` random token ids, the first
    `shared_prefix` fraction of them the same in every prompt, each generating `output_tokens`."""
    requests: int = Field(ge=1, le=256)
    prompt_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)
    shared_prefix: float = Field(default=0.0, ge=0.0, le=1.0)
    temperature: float = Field(default=1.0, ge=0.0)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: JsonObject | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, kwargs: JsonObject | None, info: ValidationInfo) -> JsonObject | None:
        if kwargs is not None and info.data.get("prompt") is not None:
            raise ValueError("only with messages (a prompt is not rendered by the chat template)")
        return _template_kwargs(kwargs)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param(loc: tuple[int | str, ...]) -> str | None:
    """`messages[0].content` from pydantic's loc, leaving out the union-branch tags it inserts."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


def validation_error(e: ValidationError) -> ErrorBody:
    """The first problem of a failed validation, as a 400 naming the field."""
    err = e.errors(include_url=False)[0]
    param = _param(tuple(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":
        message = f"{param}: this field is not supported by tokenmill"
    elif kind == "missing":
        message = f"{param}: this field is required"
    elif kind == "json_invalid":
        message = f"the request body is not valid JSON: {err['msg']}"
    elif kind == "model_type" and not err["loc"]:
        message = "the request body must be a JSON object"
    else:
        message = f"{param}: {err['msg'].removeprefix('Value error, ')}" if param else err["msg"]
    return ErrorBody(400, message, param=param)


def parse_body(model: type[_Body], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None
