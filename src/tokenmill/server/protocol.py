"""OpenAI request bodies as pydantic models, and OpenAI's error body.

Every model forbids unknown fields, so a field tokenmill does not implement is a 400 naming it,
never silently ignored. Types are strict (JSON numbers may still be ints where floats are asked
for): "0.5" is not a temperature. Value ranges are checked once, by `SamplingParams`; the models
only check shapes. vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos,
min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens) are accepted too.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tokenmill.tokenizer import ChatRole


class ErrorBody(Exception):
    """An error to send as OpenAI's body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


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


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: Any
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

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
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


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
