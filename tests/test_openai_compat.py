"""What OpenAI client libraries send, through a real server: the OpenAI fields tokenmill does not
implement are accepted where their value changes nothing (`store: false`, `metadata`,
`service_tier: "auto"`, ...; the table is `protocol.NO_OP_VALUES`), and refused with a
400 naming them where it would; `messages[i].name` and `chat_template_kwargs` reach the chat
template; vLLM's `stream_options.continuous_usage_stats` puts the usage so far on every chunk.

One `tokenmill serve` on a copy of the tiny random llama (an HF folder) whose chat template renders
a message's name and Qwen3's `enable_thinking` switch, so that the prompt shows what reached it.
"""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from test_server import Server, check_error, running

from tokenmill import LLM, SamplingParams, TokenmillError, load_tokenizer
from tokenmill.server.protocol import (
    NO_OP_VALUES,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    StreamOptions,
)
from tokenmill.tokenizer import RESERVED_TEMPLATE_VARIABLES

MODEL = "tiny"
# Renders `name` and, like Qwen3's, an empty think block when enable_thinking is false.
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] }}{% if m['name'] is defined %}{{ ' (' + m['name'] + ')' }}"
    "{% endif %}{{ '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
HI = [{"role": "user", "content": "hi"}]
BOB = [{"role": "user", "name": "bob", "content": "hi"}]


@pytest.fixture(scope="module")
def folder(tiny_hf_model, tmp_path_factory):
    out = shutil.copytree(tiny_hf_model("llama"), tmp_path_factory.mktemp("compat") / "model")
    (out / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    s = Server([str(folder), "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
                "--served-model-name", MODEL], tmp_path_factory.mktemp("compat-log") / "server.log")
    with running(s, None):
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(folder):
    return load_tokenizer(folder)


def prompt_ids(tokenizer, messages, **template_kwargs) -> list[int]:
    """The ids the server should prompt with (the template writes no BOS here: encode adds it)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=True)


def greedy_chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, max_completion_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True, **kwargs.pop("extra_body", {})}, **kwargs)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json=body, timeout=60)


# ---- the table ---------------------------------------------------------------------------------------

def test_every_no_op_entry_is_a_declared_field():
    """NO_OP_VALUES is the one place for accepted values: an entry no model declares would be dead."""
    fields = {name for model in (ChatCompletionRequest, CompletionRequest, ChatMessage, StreamOptions)
              for name in model.model_fields}
    assert set(NO_OP_VALUES) <= fields, set(NO_OP_VALUES) - fields


# ---- accepted: the official client's fields with values that change nothing -------------------------------

def test_chat_no_op_fields_through_the_openai_client_change_nothing(client, tokenizer):
    plain = greedy_chat(client, messages=BOB)
    noisy = greedy_chat(
        client, messages=BOB, store=False, metadata={"a": "b"}, user="u", response_format={"type": "text"},
        service_tier="auto", parallel_tool_calls=False, tool_choice="none", logprobs=False, top_logprobs=0,
        frequency_penalty=0, presence_penalty=0, seed=None, max_tokens=None, n=1, modalities=["text"], audio=None,
        prediction=None, reasoning_effort=None, safety_identifier="s", prompt_cache_key="k")
    assert noisy.choices[0].message.content == plain.choices[0].message.content
    assert noisy.choices[0].logprobs is None
    assert noisy.usage.prompt_tokens == plain.usage.prompt_tokens == len(prompt_ids(tokenizer, BOB))
    assert noisy.usage.completion_tokens == 6
    also = greedy_chat(client, messages=BOB, service_tier="default", tool_choice="auto", store=None,
                       response_format=None, tools=None)
    assert also.choices[0].message.content == plain.choices[0].message.content


def test_chat_stream_no_op_stream_options(client):
    plain = greedy_chat(client, messages=HI).choices[0].message.content
    chunks = list(greedy_chat(client, messages=HI, stream=True, store=False, user="u",
                              stream_options={"include_usage": True, "continuous_usage_stats": False,
                                              "include_obfuscation": False}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    nulls = list(greedy_chat(client, messages=HI, stream=True, stream_options={"include_usage": None,
                                                                               "continuous_usage_stats": None}))
    assert all(c.usage is None for c in nulls) and all(c.choices for c in nulls)


def test_completion_no_op_fields_through_the_openai_client(client):
    def complete(**kwargs):
        return client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True}, **kwargs)

    plain = complete(n=2)
    noisy = complete(n=2, best_of=2, suffix="", echo=False, user="u", seed=None, frequency_penalty=0,
                     presence_penalty=0, logprobs=None)
    assert [c.text for c in noisy.choices] == [c.text for c in plain.choices]
    assert complete(suffix=None, best_of=None).choices[0].text == plain.choices[0].text


def test_message_name_reaches_the_chat_template(client, tokenizer):
    assert "(bob)" in tokenizer.apply_chat_template(BOB)     # (the template renders it)
    named = greedy_chat(client, messages=BOB).usage.prompt_tokens
    assert named == len(prompt_ids(tokenizer, BOB)) > greedy_chat(client, messages=HI).usage.prompt_tokens


def test_an_earlier_reply_sent_back_by_the_client_is_accepted(client):
    """The client sends a reply's message back as {"content", "refusal": null, "role"}."""
    reply = greedy_chat(client, messages=HI).choices[0].message
    again = greedy_chat(client, messages=[*HI, reply, {"role": "user", "content": "more"}])
    assert again.choices[0].finish_reason == "length"
    raw = {"role": "assistant", "content": "x", "refusal": None, "tool_calls": [], "annotations": [],
           "function_call": None, "audio": None}
    assert greedy_chat(client, messages=[*HI, raw, *HI]).usage.prompt_tokens == \
        greedy_chat(client, messages=[*HI, {"role": "assistant", "content": "x"}, *HI]).usage.prompt_tokens


# ---- refused: values that would change the output --------------------------------------------------------

CHAT = {"model": MODEL, "messages": HI, "max_tokens": 2}
REFUSED = [
    # (path, body, param, words the message must hold)
    ("/v1/chat/completions", {**CHAT, "store": True}, "store", ["stores no completions"]),
    ("/v1/chat/completions", {**CHAT, "tools": []}, "tools", ["non-empty"]),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", ["tools"]),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions", ["deprecated"]),
    ("/v1/chat/completions", {**CHAT, "prediction": {"type": "content", "content": "x"}}, "prediction",
     ["predicted outputs"]),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities", ["text output"]),
    ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio", ["audio"]),
    ("/v1/chat/completions", {**CHAT, "reasoning_effort": "low"}, "reasoning_effort", ["chat_template_kwargs"]),
    ("/v1/chat/completions", {**CHAT, "service_tier": "flex"}, "service_tier", ["auto"]),
    ("/v1/chat/completions", {**CHAT, "metadata": {"a": 1}}, "metadata.a", []),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation", ["obfuscation"]),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": "x", "refusal": "no"}]},
     "messages[0].refusal", ["refusal"]),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "assistant", "content": "x", "tool_calls": [{}]}]},
     "messages[0].tool_calls[0].id", ["must be a string"]),
    ("/v1/chat/completions", {**CHAT, "logprobs": False, "top_logprobs": 1}, "top_logprobs", ["logprobs"]),
    ("/v1/chat/completions", {**CHAT, "verbosity": "low"}, "verbosity", ["not supported"]),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix", ["suffix", "not implemented"]),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2}, "best_of", ["best 1 of 2"]),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2, "best_of": 3}, "best_of", ["best 2 of 3"]),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "store": False}, "store", ["not supported"]),
] + [
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {name: "x"}}, "chat_template_kwargs", [repr(name)])
    for name in RESERVED_TEMPLATE_VARIABLES
] + [
    ("/tokenize", {"messages": HI, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", ["'messages'"]),
    ("/tokenize", {"prompt": "x", "chat_template_kwargs": {}}, "chat_template_kwargs", ["only with messages"]),
]


@pytest.mark.parametrize("path,body,param,words", REFUSED, ids=[f"{i}-{c[2]}" for i, c in enumerate(REFUSED)])
def test_fields_that_would_change_the_output_are_a_400_naming_them(server, path, body, param, words):
    error = check_error(post(server, path, body), 400, param, None)
    assert error["param"] == param
    for word in words:
        assert word in error["message"], error


def test_refusal_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        greedy_chat(client, messages=HI, prediction={"type": "content", "content": "x"})
    assert e.value.param == "prediction" and "predicted outputs" in e.value.message


# ---- chat_template_kwargs ------------------------------------------------------------------------------

def test_chat_template_kwargs_reach_the_template(client, tokenizer):
    off = prompt_ids(tokenizer, HI, enable_thinking=False)
    assert "<think>" in tokenizer.decode(off) and len(off) > len(prompt_ids(tokenizer, HI))
    reply = greedy_chat(client, messages=HI, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.usage.prompt_tokens == len(off)
    unused = greedy_chat(client, messages=HI, extra_body={"chat_template_kwargs": {"not_in_the_template": 1}})
    assert unused.usage.prompt_tokens == len(prompt_ids(tokenizer, HI))


def test_tokenize_renders_messages_as_the_chat_does(server, client):
    kwargs = {"enable_thinking": False}
    chat = greedy_chat(client, messages=BOB, extra_body={"chat_template_kwargs": kwargs}).usage.prompt_tokens
    r = post(server, "/tokenize", {"messages": BOB, "chat_template_kwargs": kwargs})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == chat


# ---- continuous usage stats ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server, path):
    body = {"model": MODEL, "max_tokens": 5, "n": 2, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"messages": HI} if "chat" in path else {"prompt": "Once upon"})
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")
              and line != "data: [DONE]"]
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10
    prompt = final["usage"]["prompt_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
    assert all(c["usage"]["total_tokens"] == prompt + n for c, n in zip(chunks, counts, strict=True))
    assert counts == sorted(counts) and counts[-1] == 10 and len(set(counts)) > 2


# ---- the Python API ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), dtype="float32", device="cpu")


def test_llm_chat_template_kwargs(llm, tokenizer):
    off = prompt_ids(tokenizer, HI, enable_thinking=False)
    assert llm.chat_prompt(HI, True, chat_template_kwargs={"enable_thinking": False})[1] == off
    assert llm.chat_prompt(BOB, True)[1] == prompt_ids(tokenizer, BOB)
    params = SamplingParams(max_tokens=2, temperature=0)
    out = llm.chat(HI, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})
    assert out[0].prompt_token_ids == off
    streamed = list(llm.stream(messages=HI, sampling_params=params, chat_template_kwargs={"enable_thinking": False}))
    assert streamed[-1].prompt_token_ids == off and streamed[-1].outputs[0].token_ids == out[0].outputs[0].token_ids


@pytest.mark.parametrize("name", RESERVED_TEMPLATE_VARIABLES)
def test_llm_chat_template_kwargs_cannot_replace_what_tokenmill_sets(llm, name):
    with pytest.raises(TokenmillError, match=f"chat_template_kwargs: '{name}' is set by tokenmill"):
        llm.chat(HI, use_tqdm=False, chat_template_kwargs={name: "x"})


def test_llm_chat_template_kwargs_bad_arguments(llm):
    for bad in ("enable_thinking", [("enable_thinking", False)], {1: True}):
        with pytest.raises(TokenmillError, match="chat_template_kwargs: expected a dict"):
            llm.chat_prompt(HI, True, chat_template_kwargs=bad)
    with pytest.raises(TokenmillError, match="chat_template_kwargs: only for messages"):
        next(llm.stream("Once upon", chat_template_kwargs={"enable_thinking": False}))
