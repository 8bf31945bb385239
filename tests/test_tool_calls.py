"""Tool calling (`tokenmill.tool_calls`): request checks, prompts, parsing, streaming and grammars.

- parse_tools / parse_tool_choice: every error names its field;
- detect_tool_parser on excerpts of real chat templates;
- parse() of hand-written outputs per syntax (content around calls, several calls, malformed JSON);
- streaming == parse, for many outputs split at random places (hypothesis);
- prepare_messages: history calls and tool results as templates expect them, rendered by real
  templates;
- grammar(): random walks over the default model's 49k-token vocabulary, each allowed by the
  grammar's token masks, must parse back into calls that obey tool_choice and whose arguments
  validate against the tool's JSON schema; also with the markers as special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.errors import TokenmillError
from tokenmill.tokenizer import compile_chat_template, load_tokenizer, render_chat_template
from tokenmill.tool_calls import (
    PARSERS,
    ParsedOutput,
    Tool,
    ToolCall,
    ToolChoice,
    ToolParser,
    detect_tool_parser,
    new_call_id,
    parse_tool_choice,
    parse_tools,
)

llguidance = pytest.importorskip("llguidance")

TOOLS_JSON = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "City, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["location"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["query", "max_results"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "create_event",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string"},
            "date": {"type": "string", "format": "date"},
            "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
            "required": ["title", "date"], "additionalProperties": False}}},
]
TOOLS = parse_tools(TOOLS_JSON)


def call_of(parsed: ParsedOutput) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


# ---------------------------------------------------------------------------------------------
# parse_tools / parse_tool_choice
# ---------------------------------------------------------------------------------------------


def test_parse_tools_reads_openai_tools():
    assert [t.name for t in TOOLS] == ["get_weather", "search", "create_event"]
    assert TOOLS[0].description == "Current weather in a city." and TOOLS[2].description is None
    bare = parse_tools([{"type": "function", "function": {"name": "ping", "parameters": None, "strict": True}}])[0]
    assert bare == Tool("ping", None, {"type": "object", "properties": {}}, strict=True)
    assert bare.to_openai() == {"type": "function", "function": {
        "name": "ping", "parameters": {"type": "object", "properties": {}}, "strict": True}}
    assert TOOLS[0].to_openai() == TOOLS_JSON[0]


@pytest.mark.parametrize("tools, message", [
    (None, "tools: must be a non-empty list"),
    ([], "tools: must be a non-empty list"),
    ([TOOLS_JSON[0]] * 129, "tools: at most 128 tools, got 129"),
    (["get_weather"], "tools[0]: must be an object, got 'get_weather'"),
    ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0].type: must be 'function', got 'retrieval'"),
    ([{"type": "function", "function": {"name": "f"}, "extra": 1}], "tools[0]: unknown field 'extra'"),
    ([{"type": "function"}], "tools[0].function: must be an object, got None"),
    ([{"type": "function", "function": {"name": "f", "parameter": {}}}],
     "tools[0].function: unknown field 'parameter'"),
    ([*TOOLS_JSON[:2], {"type": "function", "function": {"name": "a b"}}],
     "tools[2].function.name: must match ^[a-zA-Z0-9_-]{1,64}$, got 'a b'"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name: must match"),
    ([{"type": "function", "function": {}}], "tools[0].function.name: must match ^[a-zA-Z0-9_-]{1,64}$, got None"),
    ([TOOLS_JSON[0], TOOLS_JSON[0]], "tools[1].function.name: 'get_weather' is already the name of another tool"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}],
     "tools[0].function.description: must be a string, got 3"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}],
     "tools[0].function.strict: must be true or false, got 'yes'"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
     "tools[0].function.parameters: must be a JSON schema object, got '{}'"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
     "tools[0].function.parameters.type: not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": "1"}}}}}],
     "tools[0].function.parameters.properties.n.minimum: not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters.type: must be 'object' (arguments are a JSON object), got 'string'"),
])
def test_parse_tools_errors_name_the_field(tools, message):
    with pytest.raises(TokenmillError) as error:
        parse_tools(tools)
    assert str(error.value).startswith(message), str(error.value)


def test_parse_tool_choice():
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert parse_tool_choice(None, None) == ToolChoice("none")
    assert parse_tool_choice("none", TOOLS) == ToolChoice("none")
    assert parse_tool_choice("auto", TOOLS) == ToolChoice("auto")
    assert parse_tool_choice("auto", []) == ToolChoice("none")
    assert parse_tool_choice("required", TOOLS) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "search"}}
    assert parse_tool_choice(named, TOOLS) == ToolChoice("function", "search")
    auto_tool = parse_tools([{"type": "function", "function": {"name": "auto"}}])
    assert parse_tool_choice({"type": "function", "function": {"name": "auto"}}, auto_tool) == ToolChoice(
        "function", "auto")


@pytest.mark.parametrize("choice, tools, message", [
    ("required", None, "tool_choice: 'required' needs tools"),
    ({"type": "function", "function": {"name": "search"}}, None, "tool_choice: names the function 'search'"),
    ({"type": "function", "function": {"name": "nope"}}, TOOLS,
     "tool_choice.function.name: no tool is named 'nope' (tools: get_weather, search, create_event)"),
    ({"type": "function", "function": {}}, TOOLS, "tool_choice.function.name: must be a string, got None"),
    ({"type": "function"}, TOOLS, "tool_choice.function.name: must be a string"),
    ({"type": "tool", "function": {"name": "search"}}, TOOLS, "tool_choice.type: must be 'function', got 'tool'"),
    ("any", TOOLS, "tool_choice: must be 'none', 'auto', 'required' or"),
    (3, TOOLS, "tool_choice: must be"),
])
def test_parse_tool_choice_errors_name_the_field(choice, tools, message):
    with pytest.raises(TokenmillError) as error:
        parse_tool_choice(choice, tools)
    assert str(error.value).startswith(message), str(error.value)


def test_call_ids_have_openai_shape():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() and i.isascii() for i in ids)
    call = ToolCall("call_x", "f", '{"a": 1}')
    assert call.to_openai() == {"id": "call_x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


# ---------------------------------------------------------------------------------------------
# detect_tool_parser
# ---------------------------------------------------------------------------------------------

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

MISTRAL_TEMPLATE = """{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}{%- for tool in tools %}{{- tool|tojson }}{%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}{{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.tool_call_id is not defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content|string + ", \\"call_id\\": \\"" + message.tool_call_id \
+ '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""

LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{%- for message in messages %}
    {%- if 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
        {%- else %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}{{- message.content | tojson }}{{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
"""

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize("template, parser", [
    (QWEN25_TEMPLATE, "hermes"),
    (MISTRAL_TEMPLATE, "mistral"),
    (LLAMA31_TEMPLATE, "llama3_json"),
    (LLAMA31_TEMPLATE.replace('"<|python_tag|>" + ', ""), "llama3_json"),  # the "parameters" convention alone
    (SMOLLM2_TEMPLATE, "generic"),
    (None, "generic"),
    # Qwen3-Coder: <tool_call> around XML, not JSON; not a syntax we parse
    ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{% for tool in tools %}{% endfor %}", "generic"),
])
def test_detect_tool_parser(template, parser):
    assert detect_tool_parser(template) == parser
    assert parser in PARSERS and PARSERS[parser].name == parser


# ---------------------------------------------------------------------------------------------
# parse(): hand-written outputs
# ---------------------------------------------------------------------------------------------

WEATHER = ("get_weather", {"location": "Paris", "unit": "celsius"})
SEARCH = ("search", {"query": "café \"quotes\" ü", "max_results": 3})


@pytest.mark.parametrize("text, content, calls", [
    ("Just text.", "Just text.", []),
    ("  \n", None, []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [WEATHER]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "search", "parameters": {"query": "café \\"quotes\\" \\u00fc", '
     '"max_results": 3}}\n</tool_call>\nDone.', "Let me check.\n\n\nDone.", [WEATHER, SEARCH]),
    ('<tool_call>{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}', None, [WEATHER]),
    ('a <tool_call>\n{"name": "f", "arguments": {"x": </tool_call> b',
     'a <tool_call>\n{"name": "f", "arguments": {"x": </tool_call> b', []),
    ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    ("<tool_call>\n{\"name\": \"f\", \"argu", "<tool_call>\n{\"name\": \"f\", \"argu", []),
    ("x <tool_ca", "x <tool_ca", []),
    ("<tool_call>" + "[" * 100_000, "<tool_call>" + "[" * 100_000, []),
])
def test_parse_hermes(text, content, calls):
    parsed = PARSERS["hermes"](TOOLS).parse(text)
    assert parsed.content == content
    assert call_of(parsed) == calls


@pytest.mark.parametrize("text, content, calls", [
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}', None, [WEATHER]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}', None, [WEATHER]),
    ('\n{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}; '
     '{"name": "search", "arguments": {"query": "café \\"quotes\\" ü", "max_results": 3}}', None, [WEATHER, SEARCH]),
    ('I will call {"name": "get_weather", "parameters": {}}', 'I will call {"name": "get_weather", "parameters": {}}',
     []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "get_weather", "parameters": {"location": "Par',
     '{"name": "get_weather", "parameters": {"location": "Par', []),
    ('{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}} That is all.', "That is all.",
     [WEATHER]),
    ("<|python_tag|>brave_search.call(query=\"x\")", "brave_search.call(query=\"x\")", []),
    ("<|python_ta", "<|python_ta", []),
])
def test_parse_llama3_json(text, content, calls):
    parsed = PARSERS["llama3_json"](TOOLS).parse(text)
    assert parsed.content == content
    assert call_of(parsed) == calls


@pytest.mark.parametrize("text, content, calls", [
    ("No tools needed.", "No tools needed.", []),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}, '
     '{"name": "search", "arguments": {"query": "café \\"quotes\\" ü", "max_results": 3}, "id": "abcdefghi"}]',
     None, [WEATHER, SEARCH]),
    ('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}]',
     "Sure.", [WEATHER]),
    ('[TOOL_CALLS]get_weather[ARGS]{"location": "Paris", "unit": "celsius"}'
     '[TOOL_CALLS]search[ARGS]{"query": "café \\"quotes\\" ü", "max_results": 3}', None, [WEATHER, SEARCH]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": ', '[TOOL_CALLS][{"name": "get_weather", '
     '"arguments": {"location":', []),
    ('[TOOL_CALLS][{"name": "get_weather"}] rest', '[TOOL_CALLS][{"name": "get_weather"}] rest', []),
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("[TOOL_CALLS]get weather[ARGS]{}", "[TOOL_CALLS]get weather[ARGS]{}", []),
    ('[TOOL_CALLS]f[ARGS]"x"', '[TOOL_CALLS]f[ARGS]"x"', []),
])
def test_parse_mistral(text, content, calls):
    parsed = PARSERS["mistral"](TOOLS).parse(text)
    assert parsed.content == content
    assert call_of(parsed) == calls


@pytest.mark.parametrize("text, content, calls", [
    ('{"content": "Hello!"}', "Hello!", []),
    ('{"content": " line\\nbreak, \\"quoted\\", caf\\u00e9 \\ud83d\\ude00 tab\\t "}',
     'line\nbreak, "quoted", café 😀 tab', []),
    ('{"content": "lone \\ud83d surrogate"}', "lone \ufffd surrogate", []),
    ('{"content": "cut short', "cut short", []),
    ('{"content": ""}', None, []),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}, '
     '{"name": "search", "arguments": {"query": "café \\"quotes\\" ü", "max_results": 3}}]}', None, [WEATHER, SEARCH]),
    ("Plain text, no JSON.", "Plain text, no JSON.", []),
    ('{"tool_calls": []}', '{"tool_calls": []}', []),
    ('{"tool_calls": [{"name": "get_weather"}]}', '{"tool_calls": [{"name": "get_weather"}]}', []),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {', '{"tool_calls": [{"name": "get_weather", "arguments": {',
     []),
    ('{"content": 5}', '{"content": 5}', []),
])
def test_parse_generic(text, content, calls):
    parsed = PARSERS["generic"](TOOLS).parse(text)
    assert parsed.content == content
    assert call_of(parsed) == calls


def test_parsed_arguments_are_json_text_of_the_object():
    parsed = PARSERS["hermes"](TOOLS).parse(
        '<tool_call>{"name":"search","arguments":{"query":"Zürich","max_results":2}}</tool_call>')
    assert parsed.tool_calls[0].arguments == '{"query": "Zürich", "max_results": 2}'
    assert parsed.tool_calls[0].id.startswith("call_")


# ---------------------------------------------------------------------------------------------
# Streaming == parse
# ---------------------------------------------------------------------------------------------

STREAM_OUTPUTS = {
    "hermes": [
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "x", "max_results": 1}}\n</tool_call>',
        "plain <b>html</b> <tool <tool_cal text",
        'a <tool_call>{"bad json</tool_call> b <tool_call>{"name": "f", "arguments": {}}</tool_call>  c  ',
        '<tool_call>{"name": "f", "arguments": {"a": [1, 2]}}',
        "  \n <tool_call>\n",
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"location": "Paris"}}',
        ' <|python_tag|>{"name": "a", "parameters": {}} ;{"name": "b", "parameters": {"x": "}"}}',
        'Text first {"name": "a", "parameters": {}}',
        '{"name": "a", "parameters": {}}; then text',
        '{"name": "a", "parameters": {"x": ',
        "<|python_tag|>tool.call()",
        "<|pyth",
    ],
    "mistral": [
        'Sure [TOOL_CALLS][{"name": "a", "arguments": {"q": "[TOOL_CALLS]"}}, {"name": "b", "arguments": {}}] ok',
        '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS] {"y": "]"} tail [TOOL_CALLS',
        '[TOOL_CALLS]bad name[ARGS]{} [TOOL_CALLS] [1, 2] [TOOL_CALLS]a[AR',
        "[TOOL_CALLS][{",
    ],
    "generic": [
        '{"content": "Hi \\"there\\" \\ud83d\\ude00 caf\\u00e9\\n  bye  "}',
        '  {"tool_calls": [{"name": "a", "arguments": {"x": "}"}}, {"name": "b", "arguments": {}}]} trailing',
        '{"content": "lone \\ud83d then \\u00e9 and \\ud83d\\u0041 and \\\\ud83d"} ignored',
        '{"content": "unfinished \\ud83d',
        '{"content": "bad \\x escape"}',
        '{"tool_calls": [{"name": "a"}]}',
        "not json at all",
        '{"content" : 7}',
    ],
}


def stream_output(parser: ToolParser, pieces: list[str]) -> tuple[str, list[dict], object]:
    """Feed `pieces` (the last one final); the content, the calls rebuilt from the fragments, and the stream."""
    stream = parser.stream()
    fragments = []
    for i, piece in enumerate(pieces):
        fragments += stream.feed(piece, final=i == len(pieces) - 1)
    content, calls = "", []
    for fragment in fragments:
        assert set(fragment) in ({"content"}, {"tool_calls"}), fragment
        if "content" in fragment:
            assert fragment["content"]
            content += fragment["content"]
            continue
        (delta,) = fragment["tool_calls"]
        if "id" in delta:
            assert delta["index"] == len(calls) and delta["type"] == "function"
            assert delta["function"]["arguments"] == ""
            calls.append({"id": delta["id"], "name": delta["function"]["name"], "arguments": ""})
        else:
            assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, calls, stream


def assert_stream_matches_parse(parser: ToolParser, text: str, cuts: list[int]) -> None:
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    content, calls, stream = stream_output(parser, pieces)
    parsed = parser.parse(text)
    assert content == (parsed.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in parsed.tool_calls]
    assert [c["id"] for c in calls] == [c.id for c in stream.tool_calls]
    assert stream.content == content


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_streaming_equals_parse_for_any_split(data):
    name = data.draw(st.sampled_from(sorted(STREAM_OUTPUTS)))
    text = data.draw(st.sampled_from(STREAM_OUTPUTS[name]))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    assert_stream_matches_parse(PARSERS[name](TOOLS), text, cuts)


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[TOOL_", "[ARGS]", "<|python_tag|>", "<|py",
    '{"name": "a", "arguments": {"x": [1, "}"]}}', '{"name": "b", "parameters": {}}', '{"content": "',
    '{"tool_calls": [',
    "{", "}", "[", "]", '"', ",", ";", ": ", "\\", "\\u", "d83d", "\\ude00", "\\n", " ", "\n", "text", "é😀", "NaN",
]


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(sorted(PARSERS)), st.lists(st.sampled_from(FRAGMENTS), max_size=12), st.data())
def test_streaming_equals_parse_on_fragment_soup(name, fragments, data):
    """Outputs made of markers, JSON pieces and escapes in any order: never a crash, and streamed == parsed."""
    text = "".join(fragments)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    assert_stream_matches_parse(PARSERS[name](TOOLS), text, cuts)


@pytest.mark.parametrize("name", sorted(STREAM_OUTPUTS))
def test_streaming_character_by_character(name):
    parser = PARSERS[name](TOOLS)
    for text in STREAM_OUTPUTS[name]:
        assert_stream_matches_parse(parser, text, list(range(len(text))))


def test_stream_emits_calls_as_soon_as_they_close():
    stream = PARSERS["hermes"](TOOLS).stream()
    assert stream.feed("Checking") == [{"content": "Checking"}]
    assert stream.feed(" now <tool") == [{"content": " now"}]
    assert stream.feed('_call>{"name": "search", "arguments": {"query": "q", "max_results": 1}}') == []
    header, arguments = stream.feed("</tool_call>")
    call_id = stream.tool_calls[0].id
    assert header == {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                      "function": {"name": "search", "arguments": ""}}]}
    assert arguments == {"tool_calls": [{"index": 0, "function": {"arguments": '{"query": "q", "max_results": 1}'}}]}
    assert stream.feed("\n", final=True) == []
    with pytest.raises(RuntimeError):
        stream.feed("more")


# ---------------------------------------------------------------------------------------------
# prepare_messages
# ---------------------------------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Paris, and search for cafés?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": '{"location": "Paris"}'}},
        {"id": "call_def", "type": "function", "function": {"name": "search",
                                                            "arguments": '{"query": "cafés", "max_results": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_def", "content": "Café de Flore"},
]


def test_prepare_messages_follows_the_hf_convention():
    prepared = PARSERS["hermes"](TOOLS).prepare_messages(HISTORY, TOOLS)
    assert prepared[0] == HISTORY[0]
    assert prepared[1]["content"] == ""
    assert prepared[1]["tool_calls"][1] == {"id": "call_def", "type": "function", "function": {
        "name": "search", "arguments": {"query": "cafés", "max_results": 2}}}
    assert prepared[2] == {**HISTORY[2], "name": "get_weather"}
    assert prepared[3]["name"] == "search"
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"location": "Paris"}'  # input untouched
    template = compile_chat_template(QWEN25_TEMPLATE, "qwen")
    prompt = render_chat_template(template, "qwen", messages=prepared, tools=PARSERS["hermes"](TOOLS).template_tools(),
                                  add_generation_prompt=True)
    assert ('<tool_call>\n{"name": "search", "arguments": {"query": "cafés", "max_results": 2}}\n</tool_call>'
            in prompt)
    assert json.dumps(TOOLS[2].to_openai()) in prompt
    assert "<tool_response>\nCafé de Flore\n</tool_response>" in prompt


@pytest.mark.parametrize("messages, message", [
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[0].tool_calls[0].function.arguments: must be the JSON text of an object, got '{oops'"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": {"id": "c"}}],
     "messages[1].tool_calls: must be a list"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls[0].id: must be a string, got None"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function: must be {'name', 'arguments'}"),
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id: a tool message needs the id"),
])
def test_prepare_messages_errors_name_the_field(messages, message):
    with pytest.raises(TokenmillError) as error:
        PARSERS["hermes"](TOOLS).prepare_messages(messages, TOOLS)
    assert str(error.value).startswith(message), str(error.value)


def test_prepare_messages_mistral_ids_are_nine_alphanumerics():
    prepared = PARSERS["mistral"](TOOLS).prepare_messages(HISTORY, TOOLS)
    ids = [c["id"] for c in prepared[1]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and ids[0] != ids[1]
    assert [prepared[2]["tool_call_id"], prepared[3]["tool_call_id"]] == ids
    kept = PARSERS["mistral"](TOOLS).prepare_messages(
        [{"role": "tool", "tool_call_id": "aB3dE6gH9", "content": "x"}], TOOLS)
    assert kept[0]["tool_call_id"] == "aB3dE6gH9"
    env = {"loop_messages": prepared, "user_messages": [prepared[0]], "tools": None, "eos_token": "</s>"}
    prompt = render_chat_template(compile_chat_template(MISTRAL_TEMPLATE, "mistral"), "mistral", messages=prepared,
                                  **env)
    assert f'"arguments": {{"location": "Paris"}}, "id": "{ids[0]}"}}' in prompt
    assert f'[TOOL_RESULTS] {{"content": Café de Flore, "call_id": "{ids[1]}"}}[/TOOL_RESULTS]' in prompt


def test_prepare_messages_generic_describes_tools_in_the_system_prompt(default_gguf_path: Path):
    parser = PARSERS["generic"](TOOLS)
    assert parser.template_tools() is None
    prepared = parser.prepare_messages(HISTORY, TOOLS)
    assert prepared[0]["role"] == "system"
    for tool in TOOLS:
        assert json.dumps({"name": tool.name, "description": tool.description, "parameters": tool.parameters},
                          ensure_ascii=False) in prepared[0]["content"]
    assert '{"tool_calls": [' in prepared[0]["content"] and '{"content": ' in prepared[0]["content"]
    assert json.loads(prepared[2]["content"]) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"location": "Paris"}},
        {"name": "search", "arguments": {"query": "cafés", "max_results": 2}}]}
    assert prepared[3] == {"role": "user", "content": json.dumps(
        {"tool_response": {"name": "get_weather", "content": "18 C, sunny"}})}
    with_system = parser.prepare_messages([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], TOOLS)
    assert len(with_system) == 2 and with_system[0]["content"].startswith("Be brief.\n\nYou can call")
    assert parser.prepare_messages(HISTORY[:1], []) == HISTORY[:1]  # tool_choice "none": no answer format
    tokenizer = load_tokenizer(default_gguf_path)
    prompt = tokenizer.apply_chat_template(prepared, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou can call the following tools.")
    assert prompt.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------
# grammar(): random walks over the default model's vocabulary
# ---------------------------------------------------------------------------------------------


class Walker:
    """Random token walks through an llguidance grammar with a tokenizer."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, n_vocab: int, eos: list[int]):
        self.tokenizer, self.n_vocab, self.eos = tokenizer, n_vocab, np.array(eos)
        texts = [tokenizer.decode_str([i]) for i in range(n_vocab)]
        # Uniform draws over 49k tokens would make every JSON string hundreds of tokens long; half
        # the draws are from tokens that can close a string, array or object, or that are free of
        # letters and digits, so walks end within the cap.
        self.closing = np.array([any(c in t for c in '"]}') for t in texts])
        self.punctuation = np.array([bool(t) and not any(c.isalnum() for c in t) for t in texts])

    def walk(self, grammar: str, seed: int, max_tokens: int = 400) -> tuple[list[int], bool]:
        """The tokens of one walk, and whether it ended where the grammar allows the output to end
        (EOS is drawn with probability 0.7 wherever it is allowed)."""
        rng = np.random.default_rng(seed)
        matcher = llguidance.LLMatcher(self.tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        tokens: list[int] = []
        while len(tokens) < max_tokens and not matcher.is_stopped():
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")[:self.n_vocab]
            allowed = np.flatnonzero(bits)
            ends = np.isin(allowed, self.eos)
            if ends.any() and (ends.all() or rng.random() < 0.7):
                return tokens, True
            allowed = allowed[~ends]
            draw = rng.random()
            for kind, threshold in ((self.closing, 0.25), (self.punctuation, 0.5)):
                if draw < threshold and kind[allowed].any():
                    allowed = allowed[kind[allowed]]
                    break
            token = int(rng.choice(allowed))
            assert matcher.consume_token(token), matcher.get_error()
            tokens.append(token)
        return tokens, matcher.is_stopped()


@pytest.fixture(scope="module")
def default_tokenizer(default_gguf_path: Path):
    return load_tokenizer(default_gguf_path)


@pytest.fixture(scope="module")
def walker(default_tokenizer) -> Walker:
    eos = sorted(default_tokenizer.eos_token_ids)
    tokenizer = llguidance.LLTokenizer(default_tokenizer._backend.to_str(), n_vocab=49152, eos_token=eos)
    return Walker(tokenizer, 49152, eos)


def check_walk(parser: ToolParser, choice: ToolChoice, parallel: bool, text: str) -> ParsedOutput:
    """What any output the grammar allows must satisfy."""
    parsed = parser.parse(text)
    allowed = [choice.name] if choice.mode == "function" else [t.name for t in TOOLS]
    if choice.mode == "auto" and not parsed.tool_calls:  # generic: {"content": "..."}
        assert parsed.content == (json.loads(text)["content"].strip() or None)
        return parsed
    assert parsed.content is None, text
    assert parsed.tool_calls, text
    if choice.mode == "function" or not parallel:
        assert len(parsed.tool_calls) == 1, text
    for call in parsed.tool_calls:
        assert call.name in allowed, text
        schema = parser._tools_by_name[call.name].parameters
        jsonschema.validate(json.loads(call.arguments), schema, jsonschema.Draft202012Validator,
                            format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return parsed


WALK_CASES = [
    (name, choice, parallel)
    for name in sorted(PARSERS)
    for choice, parallel in [
        (ToolChoice("required"), False), (ToolChoice("required"), True),
        (ToolChoice("function", "get_weather"), True), (ToolChoice("function", "search"), False),
        (ToolChoice("function", "create_event"), True),
        *([(ToolChoice("auto"), False), (ToolChoice("auto"), True)] if name == "generic" else []),
    ]
]


@pytest.mark.parametrize("name, choice, parallel", WALK_CASES,
                         ids=[f"{n}-{c.name or c.mode}-{'parallel' if p else 'single'}" for n, c, p in WALK_CASES])
def test_grammar_random_walks_parse_into_valid_calls(walker: Walker, name, choice, parallel):
    parser = PARSERS[name](TOOLS)
    grammar = parser.grammar(choice, parallel)
    call_counts = []
    for seed in range(6):
        tokens, ended = walker.walk(grammar, seed)
        text = walker.tokenizer.decode_str(tokens)
        assert ended, f"walk {seed} did not end within 400 tokens: {text!r}"
        call_counts.append(len(check_walk(parser, choice, parallel, text).tool_calls))
        cuts = np.random.default_rng(seed).integers(0, len(text) + 1, size=12).tolist()
        assert_stream_matches_parse(parser, text, cuts)
    if parallel and choice.mode in ("required", "auto"):  # the walks did exercise what is allowed
        assert max(call_counts) >= 2, call_counts
    if choice.mode == "auto":
        assert min(call_counts) == 0, call_counts


def test_grammar_arguments_are_an_object_even_for_an_open_schema(walker: Walker):
    tools = parse_tools([{"type": "function", "function": {"name": "anything", "parameters": {}}}])
    parser = PARSERS["hermes"](tools)
    grammar = parser.grammar(ToolChoice("required"), False)
    for seed in range(3):
        tokens, ended = walker.walk(grammar, seed)
        assert ended
        (call,) = parser.parse(walker.tokenizer.decode_str(tokens)).tool_calls
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_grammar_is_none_where_the_model_writes_freely(name):
    parser = PARSERS[name](TOOLS)
    assert parser.grammar(ToolChoice("none"), True) is None
    assert (parser.grammar(ToolChoice("auto"), True) is None) == (name != "generic")


def test_quoted_special_token_text_is_a_dead_end_in_llguidance(walker: Walker):
    """Why grammar() takes `special_tokens`: when a grammar forces a quoted string that equals a
    special token's text ("<|im_end|>" is one in the default model), llguidance's mask allows only
    that special token, and then refuses to consume it. Token syntax works."""
    tokenizer = walker.tokenizer
    (im_end,) = tokenizer.tokenize_str("<|im_end|>", parse_special=True)
    assert tokenizer.is_special_token(im_end)
    quoted = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark('start: "<|im_end|>" "x"'),
                                  log_level=0)
    bits = np.unpackbits(np.frombuffer(quoted.compute_bitmask(), np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [im_end]
    assert not quoted.consume_token(im_end)
    token = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(f'start: <[{im_end}]> "x"'),
                                 log_level=0)
    assert token.consume_token(im_end) and not token.is_error()


def special_markers(tokenizer: llguidance.LLTokenizer, parser: ToolParser) -> dict[str, int]:
    """The recipe grammar()'s docstring gives the integrator."""
    return {m: ids[0] for m in parser.markers
            if len(ids := tokenizer.tokenize_str(m, parse_special=True)) == 1 and tokenizer.is_special_token(ids[0])}


@pytest.fixture(scope="module")
def marker_walker(default_tokenizer) -> Walker:
    """The default vocabulary plus the native formats' markers as special tokens (as in Qwen and
    Mistral vocabularies)."""
    backend = tokenizers.Tokenizer.from_str(default_tokenizer._backend.to_str())
    backend.add_special_tokens(["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"])
    n_vocab = backend.get_vocab_size(with_added_tokens=True)
    eos = sorted(default_tokenizer.eos_token_ids)
    return Walker(llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos), n_vocab, eos)


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_grammar_uses_special_marker_tokens(walker: Walker, marker_walker: Walker, name):
    parser = PARSERS[name](TOOLS)
    assert special_markers(walker.tokenizer, parser) == {}  # the default model has none of them
    special = special_markers(marker_walker.tokenizer, parser)
    assert set(special) == {"hermes": {"<tool_call>", "</tool_call>"}, "mistral": {"[TOOL_CALLS]"}}[name]
    for choice in [ToolChoice("required"), ToolChoice("function", "search")]:
        grammar = parser.grammar(choice, True, special)
        for marker, token in special.items():
            assert f"<[{token}]>" in grammar and marker not in grammar
        for seed in range(3):
            tokens, ended = marker_walker.walk(grammar, seed)
            assert ended
            assert set(special.values()) <= set(tokens)
            check_walk(parser, choice, True, marker_walker.tokenizer.decode_str(tokens))


def test_grammar_arguments_follow_the_json_style_of_templates(walker: Walker):
    """Grammar JSON is spaced like json.dumps / tojson, as the calls the model saw in its prompts."""
    grammar = PARSERS["hermes"](TOOLS).grammar(ToolChoice("function", "get_weather"), False)
    matcher = llguidance.LLMatcher(walker.tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    spaced = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>'
    tokens = walker.tokenizer.tokenize_str(spaced)
    assert matcher.validate_tokens(tokens) == len(tokens)
    compact = walker.tokenizer.tokenize_str(spaced.replace('": ', '":'))
    assert matcher.validate_tokens(compact) < len(compact)

