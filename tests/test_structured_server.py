"""Structured output and tool calling through a real `tokenmill serve` on the default model, with
the official `openai` client: response_format (json_object, json_schema, `beta...parse` with a
pydantic model), vLLM's structured_outputs and guided_* fields, tool_choice auto / required /
named, parallel calls, a full round trip, streaming == non-streaming, and every invalid form a
400 naming its field.

The default model's chat template does not render tools, so its tool calls use the "generic"
syntax (a JSON answer kept by a grammar); tests/test_tool_calls.py covers the native syntaxes.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from test_server import Server, running

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web",
        "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60},
                                                        "max_results": {"type": "integer", "minimum": 1,
                                                                        "maximum": 10}},
                       "required": ["query"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_gguf_path, tmp_path_factory):
    s = Server([str(default_gguf_path), "--served-model-name", "smol"],
               tmp_path_factory.mktemp("structured") / "server.log")
    with running(s, None):
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, **kwargs):
    return client.chat.completions.create(model="smol", temperature=kwargs.pop("temperature", 0),
                                          max_tokens=kwargs.pop("max_tokens", 150), **kwargs)


def streamed(client, **kwargs) -> tuple[str, list[dict], str | None]:
    """(content, tool calls as {"id", "name", "arguments"}, finish_reason) put together from the chunks."""
    content, calls, finish = "", {}, None
    for chunk in chat(client, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += call.function.name or "" if call.function else ""
                entry["arguments"] += call.function.arguments or "" if call.function else ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


# ---- structured output --------------------------------------------------------------------------------

class Person(BaseModel):
    name: str
    age: int
    city: str


def test_parse_with_a_pydantic_model(client):
    reply = client.beta.chat.completions.parse(
        model="smol", messages=[{"role": "user", "content": "Describe a person."}], response_format=Person,
        max_tokens=200, temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, Person)


def test_json_schema_streaming_equals_non_streaming(client):
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                               "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
              "required": ["title", "year"], "additionalProperties": False}
    form = {"type": "json_schema", "json_schema": {"name": "movie", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Name a movie as JSON."}]
    whole = chat(client, messages=messages, response_format=form)
    content, calls, finish = streamed(client, messages=messages, response_format=form)
    assert (content, finish) == (whole.choices[0].message.content, whole.choices[0].finish_reason) and not calls
    jsonschema.validate(json.loads(content), schema)


def test_json_object_and_text(client):
    reply = chat(client, messages=[{"role": "user", "content": "A JSON object please."}],
                 response_format={"type": "json_object"}, max_tokens=300)
    assert reply.choices[0].finish_reason == "stop" and isinstance(json.loads(reply.choices[0].message.content), dict)
    assert chat(client, messages=WEATHER, response_format={"type": "text"}, max_tokens=3).choices[0].message.content


def test_vllm_fields_regex_choice_and_guided(client):
    regex = chat(client, messages=WEATHER, extra_body={"structured_outputs": {"regex": r"[0-9]{1,2} degrees"}})
    assert re.fullmatch(r"[0-9]{1,2} degrees", regex.choices[0].message.content)
    choice = chat(client, messages=WEATHER, extra_body={"guided_choice": ["sunny", "rainy"]})
    assert choice.choices[0].message.content in ("sunny", "rainy")
    completion = client.completions.create(model="smol", prompt="Call me at", max_tokens=20, temperature=0,
                                           extra_body={"guided_regex": r" \(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", completion.choices[0].text)


# ---- tool calling -------------------------------------------------------------------------------------

def _check_calls(calls: list, allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.function.name in allowed and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("tool_choice,allowed", [
    ("required", {"get_weather", "search"}),
    ({"type": "function", "function": {"name": "search"}}, {"search"}),
    ("auto", {"get_weather", "search"}),
], ids=["required", "named", "auto"])
def test_tool_choice_calls_valid_tools_and_streams_the_same(client, tool_choice, allowed):
    kwargs = dict(messages=WEATHER, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    reply = chat(client, **kwargs)
    message, finish = reply.choices[0].message, reply.choices[0].finish_reason
    if tool_choice != "auto" or message.tool_calls:   # ("auto" may answer in words)
        assert finish == "tool_calls" and message.content is None and len(message.tool_calls) == 1
        _check_calls(message.tool_calls, allowed)
    content, calls, streamed_finish = streamed(client, **kwargs)
    assert streamed_finish == finish and (content or None) == message.content
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_parallel_calls_at_temperature_one(client):
    counts = []
    for seed in range(4):
        reply = chat(client, messages=[{"role": "user", "content": "Weather in Paris, Rome and Oslo?"}], tools=TOOLS,
                     tool_choice="required", temperature=1.0, seed=seed, max_tokens=400)
        if reply.choices[0].finish_reason == "tool_calls":
            _check_calls(reply.choices[0].message.tool_calls, {"get_weather", "search"})
            counts.append(len(reply.choices[0].message.tool_calls))
    assert counts and max(counts) > 1, counts


def test_tool_choice_none_answers_in_words(client):
    reply = chat(client, messages=WEATHER, tools=TOOLS, tool_choice="none", max_tokens=10)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


def test_round_trip_call_result_answer(client):
    first = chat(client, messages=WEATHER, tools=TOOLS, tool_choice={"type": "function",
                                                                     "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*WEATHER, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    final = chat(client, messages=messages, tools=TOOLS, max_tokens=200)
    assert final.choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert final.choices[0].message.content or final.choices[0].message.tool_calls


# ---- refused ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema", ["wat"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", ["uniqueItems"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
     ["name"]),
    ({"response_format": {"type": "xml"}}, "response_format", ["json_schema"]),
    ({"guided_regex": "(("}, "guided_regex", ["unclosed"]),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar", ["nothing_here"]),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", ["exactly one"]),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "response_format", ["one output"]),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", ["a b"]),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     ["nope"]),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     ["keeps the output to tool calls", "cannot be combined"]),
    # (the default model's template renders no tools: "auto" runs the generic format's grammar)
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice",
     ["'auto' keeps the output to the generic tool-call format's answer", "cannot be combined"]),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", ["tool_call_id"]),
    # a schema the grammar engine cannot compile: the tool is named, not the whole tools grammar
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools[1].function.parameters", ["tools[1].function.parameters", "uniqueItems"]),
    ({"min_tokens": 2, "guided_choice": ["a"]}, "min_tokens", ["structured_outputs"]),
])
def test_invalid_forms_are_a_400_naming_the_field(server, body, param, words):
    r = httpx.post(server.base + "/v1/chat/completions", json={"model": "smol", "messages": WEATHER, "max_tokens": 5,
                                                               **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


# ---- hostile constraints ------------------------------------------------------------------------------

def _ref_chain(n: int) -> dict:
    """A schema whose $refs form a chain n links long (objects nested n deep)."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["a"],
                      "additionalProperties": False} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _rule_chain(n: int) -> str:
    """A Lark grammar whose rules form a chain n long: n "w"s, then an "x"."""
    return "start: r0\n" + "".join(f'r{i}: "w" r{i + 1}\n' for i in range(n)) + f'r{n}: "x"\n'


def test_constraints_with_long_chains_compile_and_the_server_goes_on(server, client):
    """llguidance's compiler recurses once per link of a chain of $refs or grammar rules: on a
    thread's usual stack, a chain of ~1000 overflowed it and the segfault took the server down.
    Chains as long as the length limit allows compile (grammar.COMPILE_STACK_BYTES), and the server
    answers the next request as before."""
    alone = chat(client, messages=WEATHER, max_tokens=8).choices[0].message.content
    nested = chat(client, messages=WEATHER, max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "chain", "schema": _ref_chain(1500)}})
    assert re.match(r'\{\s*"a"', nested.choices[0].message.content)
    ws = client.completions.create(model="smol", prompt="w", max_tokens=8, temperature=0,
                                   extra_body={"guided_grammar": _rule_chain(8000)})
    assert re.fullmatch("w+", ws.choices[0].text)
    assert chat(client, messages=WEATHER, max_tokens=8).choices[0].message.content == alone
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200


def test_a_constraint_that_fails_during_generation_is_a_400_naming_its_field(server):
    """a{100000} compiles and gives a first mask, but the lexer outgrows llguidance's limits at the
    first token: the request's own input failed, so it is a 400 naming the field (not a 500), or,
    once a stream has begun, an error event naming it. It counts as invalid (not an engine error),
    and the log says so in one line, without a traceback (any client can cause it)."""
    before, logged = server.metrics(), len(server.log())
    body = {"model": "smol", "prompt": "a", "max_tokens": 8, "guided_regex": "a{100000}"}
    r = httpx.post(server.base + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "guided_regex" and error["type"] == "invalid_request_error", error
    assert error["message"].startswith("guided_regex failed during generation") and "lexer" in error["message"]
    streamed = httpx.post(server.base + "/v1/completions", json={**body, "stream": True}, timeout=60)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert streamed.status_code == 200 and events[-1]["error"]["param"] == "guided_regex", events
    after = server.metrics()
    for status, more in (("invalid", 2), ("error", 0)):
        key = f'tokenmill_requests_total{{status="{status}"}}'
        assert after[key] - before[key] == more, (status, before[key], after[key])
    log = server.log()[logged:]
    assert log.count("ended by its own input: structured_outputs.regex failed during generation") == 2
    assert "Traceback" not in log
