"""Tool calling: OpenAI `tools` in, model-specific prompt and grammar out, tool calls parsed back.

A chat model calls a function by writing it in the syntax it was trained on. One `ToolParser`
subclass per syntax, named as vLLM's `--tool-call-parser`:

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5/3, Hermes, SmolLM3)
    llama3_json  {"name": "f", "parameters": {...}}; {...}                        (Llama 3.1+)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]              (Mistral)
    generic      {"tool_calls": [{"name": "f", "arguments": {...}}]} | {"content": "..."}

"generic" (llama.cpp's fallback) serves models whose chat template does not render tools: the tools
and the answer format are described in the system prompt, and a grammar keeps the answer to that
JSON. A parser does these things for one request:

    prepare_messages()  the conversation as its chat template expects it (history calls included)
    template_tools()    the template's `tools` variable (None for generic: the tools are in the prompt)
    grammar()           an llguidance Lark grammar for tool_choice "required" or a named function
                        (and, for generic, "auto"): calls in this syntax, arguments valid against
                        the function's JSON schema
    parse()             the finished output -> content + tool calls
    stream()            the same, incrementally, as OpenAI chat.completion.chunk delta fragments

`parse()` is the stream fed the whole text at once, so streamed and whole results cannot disagree.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import jsonschema

from tokenmill.errors import TokenmillError

MAX_TOOLS = 128
"""Most tools one request may declare (the OpenAI API's cap)."""

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""What a function name may be (the OpenAI API's rule)."""

_CALL_ID_ALPHABET = string.ascii_letters + string.digits
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_WHITESPACE = " \t\n\r"


# ---------------------------------------------------------------------------------------------
# Tools, calls and tool_choice
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """One OpenAI function tool."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    """JSON schema of the arguments object ({"type": "object", "properties": {}} when absent)."""
    strict: bool = False
    """OpenAI's strict flag. Kept for the template; whenever a grammar is used the arguments follow
    the schema exactly anyway, and without one (tool_choice "auto") nothing is enforced."""

    def to_openai(self) -> dict[str, Any]:
        """The tool as chat templates receive it (`tools=[...]`)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        if self.strict:
            function["strict"] = True
        return {"type": "function", "function": function}


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's shape: "call_" + 24 random letters and digits. Drawn from
    the OS's generator, so seeding Python's `random` (for reproducible sampling) cannot make two
    requests' ids collide."""
    return "call_" + "".join(secrets.choice(_CALL_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    """One call the model made."""

    id: str
    name: str
    arguments: str
    """JSON text of the arguments object."""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI `tool_choice`, resolved: a mode, plus the function's name when the mode is "function".
    (A bare name would be ambiguous: a function may well be called "auto".)"""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None


@dataclass
class ParsedOutput:
    content: str | None
    """The text outside tool calls, stripped of leading and trailing whitespace; None when empty."""
    tool_calls: list[ToolCall]


def parse_tools(tools: object) -> list[Tool]:
    """OpenAI `tools`, checked: a non-empty list of at most 128 function tools with distinct valid
    names, optional string descriptions, and parameters that are a valid JSON schema (Draft 2020-12)
    of an object. Errors start with the field's path, e.g. "tools[2].function.name: ..."."""
    if not isinstance(tools, list) or not tools:
        raise TokenmillError(f"tools: must be a non-empty list of function tools, got {_brief(tools)}")
    if len(tools) > MAX_TOOLS:
        raise TokenmillError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    parsed: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        _check_keys(where, tool, {"type", "function"})
        if tool.get("type") != "function":
            raise TokenmillError(f"{where}.type: must be 'function', got {_brief(tool.get('type'))}")
        function = tool.get("function")
        _check_keys(f"{where}.function", function, {"name", "description", "parameters", "strict"})
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise TokenmillError(f"{where}.function.name: must match ^{TOOL_NAME.pattern}$, got {_brief(name)}")
        if any(t.name == name for t in parsed):
            raise TokenmillError(f"{where}.function.name: {name!r} is already the name of another tool")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise TokenmillError(f"{where}.function.description: must be a string, got {_brief(description)}")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise TokenmillError(f"{where}.function.strict: must be true or false, got {_brief(strict)}")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        _check_parameters(f"{where}.function.parameters", parameters)
        parsed.append(Tool(name, description, parameters, bool(strict)))
    return parsed


def parse_tool_choice(tool_choice: object, tools: list[Tool] | None) -> ToolChoice:
    """OpenAI `tool_choice`, resolved against the request's tools. None means "auto" when there are
    tools and "none" otherwise; "auto" without tools is "none" (there is nothing to call);
    "required" or a named function without tools is an error, as is a name that is not a tool."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice == "none" or (tool_choice == "auto" and not tools):
        return ToolChoice("none")
    if tool_choice == "auto":
        return ToolChoice("auto")
    if tool_choice == "required":
        if not tools:
            raise TokenmillError("tool_choice: 'required' needs tools, and the request has none")
        return ToolChoice("required")
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise TokenmillError(f"tool_choice.type: must be 'function', got {_brief(tool_choice.get('type'))}")
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise TokenmillError(f"tool_choice.function.name: must be a string, got {_brief(name)}")
        if not tools:
            raise TokenmillError(f"tool_choice: names the function {name!r}, but the request has no tools")
        if all(t.name != name for t in tools):
            raise TokenmillError(f"tool_choice.function.name: no tool is named {name!r} "
                                 f"(tools: {', '.join(t.name for t in tools)})")
        return ToolChoice("function", name)
    raise TokenmillError("tool_choice: must be 'none', 'auto', 'required' or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}, got {_brief(tool_choice)}")


def _check_keys(where: str, value: object, allowed: set[str]) -> None:
    if not isinstance(value, dict):
        raise TokenmillError(f"{where}: must be an object, got {_brief(value)}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise TokenmillError(f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")


def _check_parameters(where: str, parameters: object) -> None:
    if not isinstance(parameters, dict):
        raise TokenmillError(f"{where}: must be a JSON schema object, got {_brief(parameters)}")
    try:
        jsonschema.Draft202012Validator.check_schema(parameters)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.path)
        raise TokenmillError(f"{where}{path}: not a valid JSON schema: {e.message}") from e
    if parameters.get("type", "object") != "object":
        raise TokenmillError(f"{where}.type: must be 'object' (arguments are a JSON object), "
                             f"got {_brief(parameters['type'])}")


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------------------------
# Streaming parsers
# ---------------------------------------------------------------------------------------------


class ToolCallStream:
    """Incremental parser of one output: text deltas in, OpenAI chat.completion.chunk delta
    fragments out.

    Text that may still turn out to be part of a call (a partial marker, a call not yet closed) is
    held back until that is decided, so nothing emitted is ever taken back: the content fragments
    concatenate to the final content, and each call is emitted once, when complete, as a header
    fragment (index, id, name, arguments "") and one fragment with its whole arguments text.
    `tool_calls` holds the calls emitted so far, with the ids the fragments carried. Subclasses
    implement `_scan`, which consumes `_buffer` as far as the text received decides it.
    """

    def __init__(self) -> None:
        self.tool_calls: list[ToolCall] = []
        self._buffer = ""  # text received and not yet decided
        self._content = _TrimmedText()
        self._fragments: list[dict[str, Any]] = []
        self._final = False

    @property
    def content(self) -> str:
        """The content emitted so far."""
        return self._content.text

    def feed(self, delta: str, final: bool = False) -> list[dict[str, Any]]:
        """The delta fragments that `delta` decides; with `final`, everything left (an unfinished
        call that is not valid JSON becomes content). No feed may follow a final one."""
        if self._final:
            raise RuntimeError("ToolCallStream.feed() after the final delta")
        self._final = final
        self._buffer += delta
        self._scan(final)
        fragments, self._fragments = self._fragments, []
        return fragments

    def _scan(self, final: bool) -> None:
        raise NotImplementedError

    def _emit_text(self, text: str) -> None:
        piece = self._content.push(text)
        if not piece:
            return
        if self._fragments and "content" in self._fragments[-1]:
            self._fragments[-1]["content"] += piece
        else:
            self._fragments.append({"content": piece})

    def _emit_text_before(self, marker: str, final: bool) -> None:
        """Emit the buffer as text, all but an end that may be the start of `marker`."""
        keep = 0 if final else _partial_marker_length(self._buffer, marker)
        self._emit_text(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]

    def _skip_to(self, marker: str, final: bool) -> bool:
        """Emit the text before `marker` as content; True when the buffer now starts with it (False:
        no marker yet, and only text that cannot be the start of one was emitted)."""
        start = self._buffer.find(marker)
        if start < 0:
            self._emit_text_before(marker, final)
            return False
        self._emit_text(self._buffer[:start])
        self._buffer = self._buffer[start:]
        return True

    def _emit_call(self, name: str, arguments: dict[str, Any]) -> None:
        call = ToolCall(new_call_id(), name, _json_text(arguments))
        index = len(self.tool_calls)
        self.tool_calls.append(call)
        self._fragments.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                                "function": {"name": name, "arguments": ""}}]})
        self._fragments.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})


class _TrimmedText:
    """Content with the whole content's leading and trailing whitespace removed, decided piece by
    piece: leading whitespace is dropped, and whitespace at the end is held until text follows it
    (and dropped if none does)."""

    def __init__(self) -> None:
        self.text = ""
        self._held = ""

    def push(self, text: str) -> str:
        """The piece of content `text` adds now."""
        if not self.text:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        piece = self._held + body
        self._held = text[len(body):]
        self.text += piece
        return piece


class _HermesStream(ToolCallStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._in_call = False  # the buffer starts with OPEN

    def _scan(self, final: bool) -> None:
        while self._buffer:
            if not self._in_call:
                if not self._skip_to(self.OPEN, final):
                    return
                self._in_call = True
            close = self._buffer.find(self.CLOSE, len(self.OPEN))
            if close < 0 and not final:
                return
            end = len(self._buffer) if close < 0 else close + len(self.CLOSE)
            raw, self._buffer, self._in_call = self._buffer[:end], self._buffer[end:], False
            call = _call_from_object(_json_value(raw[len(self.OPEN):].removesuffix(self.CLOSE)))
            if call is None:
                self._emit_text(raw)  # not a call after all: the text as it was
            else:
                self._emit_call(*call)


class _Llama3JsonStream(ToolCallStream):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._expect: Literal["start", "call", "separator", "text"] = "start"

    def _scan(self, final: bool) -> None:
        while self._buffer:
            if self._expect == "text":
                self._emit_text(self._buffer)
                self._buffer = ""
                return
            pos = _skip_json_whitespace(self._buffer, 0)
            if pos == len(self._buffer):
                if final:
                    self._emit_text(self._buffer)
                    self._buffer = ""
                return
            if self._expect == "start":
                rest = self._buffer[pos:]
                if rest.startswith(self.TAG):
                    self._buffer, self._expect = rest[len(self.TAG):], "call"
                elif not final and self.TAG.startswith(rest):
                    return
                else:
                    self._expect = "call" if rest[0] == "{" else "text"
            elif self._expect == "separator":
                if self._buffer[pos] == ";":
                    self._buffer, self._expect = self._buffer[pos + 1:], "call"
                else:
                    self._expect = "text"
            elif self._buffer[pos] != "{":
                self._expect = "text"
            else:
                decoded = _json_prefix(self._buffer, pos)
                if decoded is None and not final:
                    return
                call = None if decoded is None else _call_from_object(decoded[0])
                if call is None:
                    self._expect = "text"
                else:
                    self._emit_call(*call)
                    self._buffer, self._expect = self._buffer[decoded[1]:], "separator"


class _MistralStream(ToolCallStream):
    MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self) -> None:
        super().__init__()
        self._in_calls = False  # the buffer starts with MARKER

    def _scan(self, final: bool) -> None:
        while self._buffer:
            if not self._in_calls:
                if not self._skip_to(self.MARKER, final):
                    return
                self._in_calls = True
            if not self._decide_calls(final):
                return
            self._in_calls = False

    def _decide_calls(self, final: bool) -> bool:
        """Emit the calls after the marker at the buffer's start and consume them, or, when they
        are not valid calls, consume the text up to where that became clear and emit it as
        content; False (nothing consumed) when more text is needed to decide."""
        text = self._buffer
        pos = _skip_json_whitespace(text, len(self.MARKER))
        if pos < len(text) and text[pos] == "[":  # [TOOL_CALLS][{...}, ...]
            decoded = _json_prefix(text, pos)
            if decoded is None:
                return final and self._reject(len(text))
            calls = _calls_from_list(decoded[0])
            return self._reject(decoded[1]) if calls is None else self._accept(calls, decoded[1])
        name_end = _NAME_CHARACTERS.match(text, pos).end()  # [TOOL_CALLS]name[ARGS]{...}
        after = text[name_end:]
        if not after.startswith(self.ARGS):
            return (final or not self.ARGS.startswith(after)) and self._reject(name_end)
        if not TOOL_NAME.fullmatch(text[pos:name_end]):
            return self._reject(name_end)
        args = _skip_json_whitespace(text, name_end + len(self.ARGS))
        if args < len(text) and text[args] != "{":
            return self._reject(args)
        decoded = _json_prefix(text, args) if args < len(text) else None
        if decoded is None:
            return final and self._reject(len(text))
        return self._accept([(text[pos:name_end], decoded[0])], decoded[1])

    def _accept(self, calls: list[tuple[str, dict[str, Any]]], end: int) -> bool:
        for call in calls:
            self._emit_call(*call)
        self._buffer = self._buffer[end:]
        return True

    def _reject(self, end: int) -> bool:
        self._emit_text(self._buffer[:end])
        self._buffer = self._buffer[end:]
        return True


class _GenericStream(ToolCallStream):
    # {"content": "... streamed as it is decoded; the rest of the object after the string is dropped
    CONTENT_HEAD = re.compile(r'[ \t\n\r]*\{[ \t\n\r]*"content"[ \t\n\r]*:[ \t\n\r]*"')

    def __init__(self) -> None:
        super().__init__()
        self._expect: Literal["start", "object", "string", "text", "end"] = "start"

    def _scan(self, final: bool) -> None:
        while self._buffer:
            if self._expect == "text":
                self._emit_text(self._buffer)
                self._buffer = ""
            elif self._expect == "end":
                self._buffer = ""
            elif self._expect == "start":
                pos = _skip_json_whitespace(self._buffer, 0)
                if pos == len(self._buffer):
                    if final:
                        self._emit_text(self._buffer)
                        self._buffer = ""
                    return
                self._expect = "object" if self._buffer[pos] == "{" else "text"
            elif self._expect == "object":
                head = self.CONTENT_HEAD.match(self._buffer)
                if head:
                    self._buffer, self._expect = self._buffer[head.end():], "string"
                    continue
                decoded = _json_prefix(self._buffer, _skip_json_whitespace(self._buffer, 0))
                if decoded is None and not final:
                    return
                value = None if decoded is None else decoded[0]
                calls = _calls_from_list(value.get("tool_calls")) if isinstance(value, dict) else None
                if calls is not None:
                    for call in calls:
                        self._emit_call(*call)
                    self._buffer = self._buffer[decoded[1]:]
                self._expect = "text"
            else:
                end = _string_units_end(self._buffer, final)
                self._emit_text(_decode_string_units(self._buffer[:end]))
                self._buffer = self._buffer[end:]
                if not final and _PENDING_STRING_END.fullmatch(self._buffer):
                    return
                self._expect = "end"


# ---------------------------------------------------------------------------------------------
# JSON helpers (tolerant: model output may be anything)
# ---------------------------------------------------------------------------------------------


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


_JSON_DECODER = json.JSONDecoder(parse_constant=_refuse_constant)  # NaN and Infinity are not JSON
_NAME_CHARACTERS = re.compile(r"[a-zA-Z0-9_-]*")
_STRING_UNIT = re.compile(r'[^"\\]+|\\["\\/bfnrt]|\\u([0-9a-fA-F]{4})')
_PENDING_STRING_END = re.compile(r"(?:\\u[dD][89abAB][0-9a-fA-F]{2})?(?:\\(?:u[0-9a-fA-F]{0,3})?)?")
"""What may follow the decodable part of a JSON string's body while it is still arriving: a high
surrogate escape waiting for its low half, then a partial escape (or nothing)."""


def _json_prefix(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value that starts at text[start], and where it ends; None when there is none there,
    or not yet (a value cut short)."""
    try:
        return _JSON_DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None


def _json_value(text: str) -> Any:
    """The JSON value `text` holds (whitespace around it allowed), or None when it holds none."""
    start = _skip_json_whitespace(text, 0)
    decoded = _json_prefix(text, start)
    if decoded is None or _skip_json_whitespace(text, decoded[1]) != len(text):
        return None
    return decoded[0]


def _json_text(value: Any) -> str:
    """`value` as JSON text, non-ASCII kept as is; lone surrogates (which no UTF-8 response can
    carry) become U+FFFD."""
    return _LONE_SURROGATE.sub("\ufffd", json.dumps(value, ensure_ascii=False))


def _call_from_object(value: object) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of {"name": str, "arguments" or "parameters": {...}}; None for anything else."""
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments", value.get("parameters"))
    if isinstance(name, str) and name and isinstance(arguments, dict):
        return name, arguments
    return None


def _calls_from_list(value: object) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls of a non-empty list of call objects; None unless every item is one."""
    if not isinstance(value, list) or not value:
        return None
    calls = [_call_from_object(item) for item in value]
    return None if None in calls else calls


def _skip_json_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _JSON_WHITESPACE:
        pos += 1
    return pos


def _partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def _string_units_end(body: str, final: bool) -> int:
    """How much of a JSON string body (after its opening quote) is whole characters and escapes,
    stopping at the closing quote. A high surrogate escape at the very end is left out until its
    low half can arrive (decoded apart, the two halves would not make one character)."""
    pos, last_high = 0, -1
    while unit := _STRING_UNIT.match(body, pos):
        is_high = unit.group(1) is not None and 0xD800 <= int(unit.group(1), 16) <= 0xDBFF
        last_high = pos if is_high else -1
        pos = unit.end()
    if not final and last_high >= 0 and _PENDING_STRING_END.fullmatch(body, pos):
        return last_high
    return pos


def _decode_string_units(units: str) -> str:
    decoded = json.loads(f'"{units}"', strict=False)  # strict=False: raw control characters allowed
    return _LONE_SURROGATE.sub("\ufffd", decoded)


# ---------------------------------------------------------------------------------------------
# Parsers: one per tool-call syntax
# ---------------------------------------------------------------------------------------------

_GRAMMAR_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How grammar-forced JSON is spaced: like json.dumps and the templates' `tojson`, i.e. like the
calls the model saw in training. Flexible whitespace would also let it pad JSON endlessly."""


class ToolParser:
    """Prompt, grammar and output parsing for one tool-call syntax (a subclass per syntax).

    The grammar of a syntax is `list_open call (separator call)* list_close`, each call being
    `call_open {"name": "<name>", "<arguments_key>": <arguments>} call_close` with the arguments a
    JSON schema embedded by llguidance's `%json`. Subclasses set those pieces; `markers` lists the
    texts that introduce calls, which may be special tokens of the model (see `grammar()`)."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    arguments_key: ClassVar[str] = "arguments"
    call_open: ClassVar[str] = ""
    call_close: ClassVar[str] = ""
    list_open: ClassVar[str] = ""
    separator: ClassVar[str]
    list_close: ClassVar[str] = ""
    stream_class: ClassVar[type[ToolCallStream]]

    def __init__(self, tools: list[Tool]):
        self.tools = tools
        self._tools_by_name = {t.name: t for t in tools}

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The chat template's `tools` variable."""
        return [t.to_openai() for t in self.tools]

    def prepare_messages(self, messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
        """The conversation as chat templates expect it (the Hugging Face convention): an assistant
        message's `tool_calls[i].function.arguments` as a dict rather than OpenAI's JSON text, and a
        "tool" message's `name` filled in from the call its `tool_call_id` answers."""
        names: dict[str, str] = {}
        prepared = []
        for i, message in enumerate(messages):
            message = dict(message)
            if message.get("role") == "assistant" and "tool_calls" in message:
                calls = _history_calls(f"messages[{i}].tool_calls", message.pop("tool_calls"))
                if calls:
                    message["tool_calls"] = calls
                    names.update((c["id"], c["function"]["name"]) for c in calls)
                if message.get("content") is None:
                    message["content"] = ""  # Jinja would print None as "None"
            elif message.get("role") == "tool":
                call_id = message.get("tool_call_id")
                if not isinstance(call_id, str):
                    raise TokenmillError(f"messages[{i}].tool_call_id: a tool message needs the id of the call "
                                         f"it answers, got {_brief(call_id)}")
                if "name" not in message and call_id in names:
                    message["name"] = names[call_id]
            prepared.append(message)
        return prepared

    def grammar(self, choice: ToolChoice, parallel: bool,
                special_tokens: Mapping[str, int] | None = None) -> str | None:
        """An llguidance Lark grammar for `choice`: "required" is one or more calls to any tool
        (exactly one when not `parallel`), "function" exactly one call to that function; "auto"
        and "none" get None (the model writes freely and its text is parsed).

        `special_tokens` maps each of `markers` that the model's tokenizer has as one special
        token to that token's id; the grammar then asks for the token itself, as the model was
        trained. It must be complete: llguidance treats every added token spelled <...> (and every
        HF special token) as special, and a quoted grammar string equal to a special token's text
        is a trap: when the grammar forces that string, the mask allows only the special token,
        and consuming it is then refused (llguidance 1.9). Build it with the matcher's tokenizer:
            {m: ids[0] for m in parser.markers
             if len(ids := ll_tokenizer.tokenize_str(m, parse_special=True)) == 1
             and ll_tokenizer.is_special_token(ids[0])}
        """
        if choice.mode in ("none", "auto"):
            return None
        return "start: calls\n" + self._calls_rules(choice, parallel, special_tokens or {})

    def parse(self, text: str) -> ParsedOutput:
        """The content and tool calls of a finished output."""
        stream = self.stream()
        stream.feed(text, final=True)
        return ParsedOutput(stream.content or None, stream.tool_calls)

    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one output."""
        return self.stream_class()

    def called_tools(self, choice: ToolChoice) -> list[Tool]:
        """The tools a grammar for `choice` lets the model call: the named function, or all."""
        return [self._tools_by_name[choice.name]] if choice.mode == "function" else self.tools

    def _calls_rules(self, choice: ToolChoice, parallel: bool, special_tokens: Mapping[str, int]) -> str:
        """Lark rules, the first named `calls`, for this syntax's calls as `choice` allows them:
        one call to the named function, or one or more (exactly one when not `parallel`) to any."""
        tools, many = self.called_tools(choice), parallel and choice.mode != "function"
        more = f"({_lark_text(self.separator, special_tokens)} call)* " if many else ""
        rules = [f"calls: {_lark_text(self.list_open, special_tokens)} call {more}"
                 f"{_lark_text(self.list_close, special_tokens)}",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            head = f'{self.call_open}{{"name": {json.dumps(tool.name)}, {json.dumps(self.arguments_key)}: '
            rules.append(f"call_{i}: {_lark_text(head, special_tokens)} args_{i} "
                         f"{_lark_text('}' + self.call_close, special_tokens)}")
            rules.append(f"args_{i}: %json {json.dumps(arguments_schema(tool))}")
        return "\n".join(rules)


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema a call's arguments follow in the grammars: the tool's, as an object ({} is an
    object too) with no properties beyond the declared ones unless the schema allows them (small
    models otherwise copy schema keywords into the arguments), in the templates' JSON style."""
    return {"type": "object", "additionalProperties": False, **tool.parameters, "x-guidance": _GRAMMAR_JSON_STYLE}


def _lark_text(text: str, special_tokens: Mapping[str, int]) -> str:
    """`text` as a Lark expression: string literals, with every special-token marker in it as its
    token (`<[id]>`). json.dumps quotes ASCII text exactly as Lark string literals need."""
    pieces = re.split(f"({'|'.join(map(re.escape, special_tokens))})", text) if special_tokens else [text]
    return " ".join(f"<[{special_tokens[p]}]>" if p in special_tokens else json.dumps(p) for p in pieces if p)


class HermesToolParser(ToolParser):
    """Hermes / Qwen: each call a JSON object in <tool_call> tags; text around the tags is content."""

    name = "hermes"
    markers = ("<tool_call>", "</tool_call>")
    call_open, call_close, separator = "<tool_call>\n", "\n</tool_call>", "\n"
    stream_class = _HermesStream


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+ JSON tool calling: the whole answer is `{"name": ..., "parameters": {...}}`,
    optionally after <|python_tag|>, several separated by ";" (as vLLM accepts). An answer that
    does not start that way is content."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    arguments_key, separator = "parameters", "; "
    stream_class = _Llama3JsonStream


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS]` and a JSON list of calls; parsing also accepts the newer
    `[TOOL_CALLS]name[ARGS]{...}` form. [TOOL_CALLS] is a special token, so the text to parse must
    be detokenized with special tokens kept."""

    name = "mistral"
    markers = ("[TOOL_CALLS]", "[ARGS]")
    list_open, separator, list_close = "[TOOL_CALLS][", ", ", "]"
    stream_class = _MistralStream

    def prepare_messages(self, messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
        """As the base, with every tool-call id made 9 letters and digits: Mistral's templates
        raise an error on any other id (OpenAI's are "call_" + 24)."""
        prepared = super().prepare_messages(messages, tools)
        for message in prepared:
            if "tool_calls" in message:
                message["tool_calls"] = [{**c, "id": _mistral_call_id(c["id"])} for c in message["tool_calls"]]
            if message.get("role") == "tool":
                message["tool_call_id"] = _mistral_call_id(message["tool_call_id"])
        return prepared


def _mistral_call_id(call_id: str) -> str:
    """`call_id` if it is already 9 ASCII letters and digits, else 9 hex digits of its hash: the
    same for a call and for the tool message that answers it."""
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


_GENERIC_SYSTEM_PROMPT = """\
You can call the following tools. Each line gives a tool's name, what it does, and the JSON schema \
of its arguments:
{tools}

Answer with one JSON object and nothing else, in one of two forms:
- to call tools: {{"tool_calls": [{{"name": "<tool name>", "arguments": {{<arguments>}}}}]}}
- to reply to the user: {{"content": "<your reply>"}}"""


class GenericToolParser(ToolParser):
    """For chat templates that do not render tools (llama.cpp's "generic" format): the tools and
    the answer format are described in the system prompt, and the answer is one JSON object,
    {"tool_calls": [...]} or {"content": "..."}. Unlike the native formats it has a grammar for
    tool_choice "auto" too: a model that was never trained on the format needs it to stay in it."""

    name = "generic"
    list_open, separator, list_close = '{"tool_calls": [', ", ", "]}"
    stream_class = _GenericStream

    def template_tools(self) -> list[dict[str, Any]] | None:
        """None: the tools are in the system prompt instead."""
        return None

    def prepare_messages(self, messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
        """As the base, then: earlier calls become assistant messages holding the JSON answer that
        made them, tool results become user messages {"tool_response": {"name", "content"}} (the
        template may know no "tool" role), and, when `tools` is not empty, the system message gets
        the tools and the answer format (pass [] for tool_choice "none": the answer is plain text)."""
        prepared = []
        for message in super().prepare_messages(messages, tools):
            if message.get("role") == "assistant" and "tool_calls" in message:
                calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                         for c in message["tool_calls"]]
                message = {"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)}
            elif message.get("role") == "tool":
                response = {"name": message["name"]} if "name" in message else {}
                response["content"] = _content_text(message.get("content"))
                message = {"role": "user", "content": json.dumps({"tool_response": response}, ensure_ascii=False)}
            prepared.append(message)
        if not tools:
            return prepared
        described = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                         ensure_ascii=False) for t in tools)
        system = _GENERIC_SYSTEM_PROMPT.format(tools=described)
        if prepared and prepared[0].get("role") in ("system", "developer"):
            prepared[0] = {**prepared[0], "content": f"{_content_text(prepared[0].get('content'))}\n\n{system}"}
        else:
            prepared.insert(0, {"role": "system", "content": system})
        return prepared

    def grammar(self, choice: ToolChoice, parallel: bool,
                special_tokens: Mapping[str, int] | None = None) -> str | None:
        """As the base, and for "auto" either the calls answer or {"content": "<any string>"}."""
        if choice.mode != "auto":
            return super().grammar(choice, parallel, special_tokens)
        text_schema = {"type": "string", "x-guidance": _GRAMMAR_JSON_STYLE}
        head, tail = _lark_text('{"content": ', {}), _lark_text("}", {})
        content = f"content: {head} %json {json.dumps(text_schema)} {tail}"
        return "start: calls | content\n" + self._calls_rules(ToolChoice("required"), parallel, {}) + "\n" + content


def _content_text(content: object) -> str:
    """A message's content as one string (OpenAI allows a list of text parts, or None)."""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def _history_calls(where: str, calls: object) -> list[dict[str, Any]]:
    """An assistant message's OpenAI `tool_calls`, checked, in the templates' convention."""
    if not isinstance(calls, list):
        raise TokenmillError(f"{where}: must be a list, got {_brief(calls)}")
    converted = []
    for j, call in enumerate(calls):
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise TokenmillError(f"{where}[{j}]: must be {{'id', 'type': 'function', 'function'}}, got {_brief(call)}")
        call_id, function = call.get("id"), call.get("function")
        if not isinstance(call_id, str):
            raise TokenmillError(f"{where}[{j}].id: must be a string, got {_brief(call_id)}")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TokenmillError(f"{where}[{j}].function: must be {{'name', 'arguments'}}, got {_brief(function)}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            arguments = _json_value(arguments)
        if not isinstance(arguments, dict):
            raise TokenmillError(f"{where}[{j}].function.arguments: must be the JSON text of an object, "
                                 f"got {_brief(function.get('arguments'))}")
        converted.append({"id": call_id, "type": "function",
                          "function": {"name": function["name"], "arguments": arguments}})
    return converted


# ---------------------------------------------------------------------------------------------
# Registry and detection
# ---------------------------------------------------------------------------------------------

PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, GenericToolParser)
}
"""The parsers by vLLM's --tool-call-parser names (plus "generic")."""

_OTHER_TAGGED_SYNTAXES = ("<function=", "<arg_key>")
"""Templates that wrap calls in <tool_call> but write them as XML, not JSON (Qwen3-Coder, GLM-4.5)."""


def detect_tool_parser(chat_template: str | None) -> str:
    """The parser for a model, from its chat template's text: "[TOOL_CALLS]" -> mistral;
    "<tool_call>" with JSON inside -> hermes (Qwen2.5/3, Hermes, SmolLM3); "<|python_tag|>", or
    Llama 3 headers with the {"name", "parameters"} convention -> llama3_json. Anything else is
    "generic", also a template that renders tools in a syntax not listed here (llama.cpp's choice):
    generic's grammar makes any model's answer parseable, where guessing a native syntax would leave
    calls in an unknown syntax as content."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template and not any(syntax in template for syntax in _OTHER_TAGGED_SYNTAXES):
        return "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3_json"
    return "generic"
