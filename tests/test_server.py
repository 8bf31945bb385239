"""The OpenAI-compatible server, run for real: `tokenmill serve` as a subprocess on a free port,
driven by the official `openai` client (and raw HTTP where the client hides what is tested).

One server on the default model (SmolLM2-135M-Instruct GGUF, float32, API key from the
environment variable) serves most tests; a tiny random model serves the tests that need odd
settings (a queue of one, an --api-key flag) or kill the server (SIGTERM).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

import tokenmill
from tokenmill import load_tokenizer
from tokenmill.bench.serve import free_port, stop_process
from tokenmill.cli import main

KEY = "test-key-from-env"
TINY_KEY = "tiny-flag-key"
PROMPT = "The capital of France is"
MAX_MODEL_LEN = 512
START_TIMEOUT_S = 300


class Server:
    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 probe_loading: bool = False, verify: ssl.SSLContext | None = None):
        """`probe_loading`: while it loads, send a /v1 request at each /health poll (v1_while_loading);
        off by default, as a probe sent just as loading ends is a real request (it would show in
        the server's counters). `verify`: an HTTPS server's CA (its own certificate)."""
        self.port = free_port()
        self.probe_loading = probe_loading
        self.verify = verify if verify is not None else True
        self.base = f"{'https' if verify else 'http'}://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.health_seen: list[tuple[int, str]] = []      # /health answers while starting
        # (status of a /v1 request sent while /health said loading, /health's status right after it)
        self.v1_while_loading: list[tuple[int, int]] = []
        command = [sys.executable, "-m", "tokenmill.cli", "serve", *args, "--port", str(self.port),
                   "--uvicorn-log-level", "warning"]
        env = {**{k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}, **(env or {})}
        self.proc = subprocess.Popen(command, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, key: str | None) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.base + "/health", timeout=5, verify=self.verify)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            self.health_seen.append((r.status_code, r.json()["status"]))
            if r.status_code == 200:
                return
            if not self.probe_loading:
                time.sleep(0.2)
                continue
            v1 = httpx.post(self.base + "/v1/completions", json={"prompt": "x"}, headers=auth(key), timeout=5)
            after = httpx.get(self.base + "/health", timeout=5).status_code
            self.v1_while_loading.append((v1.status_code, after))
            time.sleep(0.2)
        pytest.fail(f"server not ready after {START_TIMEOUT_S} s:\n{self.log()}")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", timeout=10).text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(tokenmill_\S+) (\S+)$", text, re.M)}


@contextlib.contextmanager
def running(s: Server, key: str | None) -> Iterator[Server]:
    """`s` once it is ready (`key`: its API key, if any), stopped however the block ends."""
    try:
        s.wait_ready(key)
        yield s
    finally:
        stop_process(s.proc)


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@pytest.fixture(scope="module")
def server(default_gguf_path, tmp_path_factory) -> Server:
    log = tmp_path_factory.mktemp("server") / "default.log"
    # The default path (GGUF weights kept quantized): the kernel's output for a row does not depend on
    # the other rows, so the 32-request burst below must reproduce every solo greedy text exactly.
    # --no-weight-cache: converting the GGUF's blocks at load keeps the server loading for long enough
    # that the start-up test sees requests refused while it loads (from the cache it can take ms)
    s = Server([str(default_gguf_path), "--dtype", "float32", "--device", "cpu",
                "--max-num-seqs", "32", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256",
                "--max-queued-requests", "2", "--no-weight-cache"], log, {"TOKENMILL_API_KEY": KEY},
               probe_loading=True)
    with running(s, KEY):
        yield s


@pytest.fixture(scope="module")
def model_name(default_gguf_path) -> str:
    return default_gguf_path.name


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(default_gguf_path):
    return load_tokenizer(default_gguf_path)


@pytest.fixture(scope="module")
def greedy(client, model_name):
    """The reference: PROMPT's 12-token greedy completion, non-streaming."""
    return client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    has_bos = tokenizer.bos_token_id is not None and text.startswith(tokenizer.id_to_token(tokenizer.bos_token_id))
    return tokenizer.encode(text, add_special_tokens=not has_bos)


# ---- start-up --------------------------------------------------------------------------------------

def test_health_is_503_while_loading_then_ok_and_binds_localhost(server):
    assert (503, "loading") in server.health_seen
    assert server.health_seen[-1] == (200, "ok")
    # a /v1 request answered while the server still said loading afterwards was refused (one sent
    # just before loading ended may have run: only the sure samples count, and there must be one)
    sure = [v1 for v1, after in server.v1_while_loading if after == 503]
    assert sure and all(status == 503 for status in sure), server.v1_while_loading
    assert f"http://127.0.0.1:{server.port}" in server.log()   # the curl example names the bound address
    assert "curl " in server.log()


def test_the_printed_curl_example_answers_the_same_every_time(server):
    """The request in the command the server prints once ready (the README's too) is the first thing a
    user tries: it answers its question, and the same way each time (greedy, not the API's default
    temperature 1, at which this small model's answer wanders)."""
    printed = re.search(r"curl (\S+) .*?-d '(\{.*?\})'", server.log())
    assert printed and printed.group(1) == server.base + "/v1/chat/completions"
    answers = {httpx.post(printed.group(1), json=json.loads(printed.group(2)), headers=auth(KEY),
                          timeout=300).json()["choices"][0]["message"]["content"] for _ in range(3)}
    assert answers == {"The capital of France is Paris."}


# ---- completions -----------------------------------------------------------------------------------

def test_completion_usage_matches_tokenizer_and_stream_matches(client, model_name, tokenizer, greedy):
    choice = greedy.choices[0]
    assert greedy.object == "text_completion" and greedy.id.startswith("cmpl-") and greedy.model == model_name
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text.strip()
    usage = greedy.usage
    assert usage.prompt_tokens == len(tokenizer.encode(PROMPT)) == 5
    assert usage.completion_tokens == 12 and usage.total_tokens == 17

    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (5, 12)


def test_token_id_prompts_prompt_lists_and_echo(client, model_name, tokenizer, greedy):
    text = greedy.choices[0].text
    ids = tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == text

    echoed = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + text

    other = "Water boils at"
    two = client.completions.create(model=model_name, prompt=[PROMPT, other], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1]
    assert text.startswith(two.choices[0].text) and two.choices[1].text
    assert two.usage.prompt_tokens == len(ids) + len(tokenizer.encode(other))
    assert two.usage.completion_tokens == 6


def test_stop_string_cuts_the_greedy_text(client, model_name, greedy):
    text = greedy.choices[0].text
    words = text.split()
    stop = next(w for w in words[1:] if len(w) >= 3 and text.find(w) > 0)
    expected = text[:text.find(stop)]
    kwargs = dict(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "@@never@@"])
    r = client.completions.create(**kwargs)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_samples_and_seed_reproduces(client, model_name):
    kwargs = dict(model=model_name, prompt="Once upon a time", max_tokens=6, temperature=1.0, n=3, seed=1234,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1            # sample i uses seed + i
    assert a.usage.completion_tokens == 18 and a.usage.prompt_tokens == b.usage.prompt_tokens


def test_completion_logprobs(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and len(top) >= 3
        assert value == pytest.approx(max(top.values()))      # greedy: the sampled token is the most likely
        assert top[token] == pytest.approx(value)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_logprobs_scores_the_prompt(client, model_name, tokenizer, server):
    """The scoring request of evaluation harnesses (lm-evaluation-harness's loglikelihood): echo +
    logprobs returns every prompt token's logprob (the first's null), max_tokens 0 nothing else."""
    text = PROMPT + " Paris"
    ids = tokenizer.encode(text)
    scored = client.completions.create(model=model_name, prompt=text, max_tokens=0, echo=True, logprobs=2,
                                       temperature=0)
    choice = scored.choices[0]
    lp = choice.logprobs
    assert choice.text == text and scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    assert choice.finish_reason == "length"
    # (the token sampled after the prompt, hidden, is EOS here: still "length", nothing generated)
    eos = client.completions.create(model=model_name, prompt=text, max_tokens=0, echo=True, logprobs=0,
                                    logit_bias={str(tokenizer.eos_token_id): 100})
    assert eos.choices[0].finish_reason == "length" and eos.choices[0].text == text
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] and "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(ids))]
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert value < 0 and top[token] == value and max(top.values()) >= value
        assert len(top) in (2, 3) and (len(top) == 2) == (value >= sorted(top.values())[-2])
    # the last prompt token's logprob is what a request generating it reports
    generated = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    assert generated.choices[0].text == " Paris"
    assert lp.token_logprobs[-1] == pytest.approx(generated.choices[0].logprobs.token_logprobs[0], abs=1e-3)
    # streamed, with tokens after the prompt (their offsets go on from the prompt's) and n = 2
    body = {"model": model_name, "prompt": text, "max_tokens": 3, "echo": True, "logprobs": 0, "n": 2,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, headers=auth(KEY), timeout=60) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data: {")]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        values = [v for c in mine if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
        offsets = [o for c in mine if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert "".join(c["text"] for c in mine) == "".join(tokens) and len(tokens) == len(ids) + 3
        assert values[:len(ids)] == lp.token_logprobs and offsets == [len("".join(tokens[:i]))
                                                                     for i in range(len(tokens))]


def test_logprob_tokens_as_token_ids(client, model_name, tokenizer):
    """vLLM's return_tokens_as_token_ids: each logprob's token is "token_id:<id>" (what RL trainers
    read to get the exact ids back); the text and the offsets stay the text's."""
    ids = tokenizer.encode("🤖 robots")
    scored = client.completions.create(model=model_name, prompt=ids, max_tokens=2, echo=True, logprobs=1,
                                       temperature=0, extra_body={"return_tokens_as_token_ids": True})
    choice = scored.choices[0]
    assert choice.logprobs.tokens[:len(ids)] == [f"token_id:{i}" for i in ids]
    assert all(t.startswith("token_id:") for t in choice.logprobs.tokens)
    assert all(k.startswith("token_id:") for top in choice.logprobs.top_logprobs[1:] for k in top)
    assert choice.logprobs.text_offset[:len(ids) + 1] == [0, 0, 0, 1, len("🤖 robots")]
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    ids = [int(e.token.removeprefix("token_id:")) for e in content]
    assert tokenizer.decode(ids) == chat.choices[0].message.content
    assert all(bytes(e.bytes) == tokenizer.token_bytes(i) for e, i in zip(content, ids, strict=True))
    assert all(t.token.startswith("token_id:") for e in content for t in e.top_logprobs)


def test_chat_continues_the_final_assistant_message(client, model_name, tokenizer, server):
    """vLLM's continue_final_message (with add_generation_prompt false): the model goes on with the
    final assistant message (an answer's start given by the client) rather than a new turn; the
    reply is what it adds. /tokenize takes the same fields."""
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    fields = {"continue_final_message": True, "add_generation_prompt": False}
    ids = httpx.post(server.base + "/tokenize", json={"messages": messages, **fields},
                     headers=auth(KEY)).json()["tokens"]
    assert tokenizer.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\nThe capital of France is")
    reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0,
                                           extra_body=fields)
    same = client.completions.create(model=model_name, prompt=ids, max_tokens=4, temperature=0)
    assert reply.usage.prompt_tokens == len(ids) and reply.choices[0].message.content == same.choices[0].text
    assert "Paris" in reply.choices[0].message.content
    # vLLM's chat echo: the reply begins with the final message when it is the assistant's (whole or streamed)
    whole = messages[1]["content"] + reply.choices[0].message.content
    echoed = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0,
                                            extra_body={**fields, "echo": True})
    streamed = client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, temperature=0,
                                              stream=True, extra_body={**fields, "echo": True})
    assert echoed.choices[0].message.content == whole
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole
    plain = client.chat.completions.create(model=model_name, messages=messages[:1], max_tokens=4, temperature=0,
                                           extra_body={"echo": True})   # (a user's message is not echoed)
    assert not plain.choices[0].message.content.startswith(messages[0]["content"])
    for body, words in (({"messages": messages, "continue_final_message": True}, ["add_generation_prompt"]),
                        ({"messages": messages[:1], **fields}, ["final message", "assistant", "'user'"])):
        for path in ("/v1/chat/completions", "/tokenize"):
            r = httpx.post(server.base + path, json={"model": model_name, **body}, headers=auth(KEY))
            error = check_error(r, 400, "continue_final_message", None)
            assert all(w in error["message"] for w in words), error


def test_logprobs_of_tokens_that_split_a_character(client, model_name, tokenizer):
    """The default vocabulary splits "🤖" over three tokens, none of them a character: each logprob
    carries its own token's bytes (OpenAI's `bytes`, from which a client puts characters back
    together) and is named by them ("bytes:\\xf0\\x9f"; as U+FFFD every such token
    had one name, and a completions top_logprobs dict kept one of them), and /v1/completions'
    text_offset counts the characters of the text before each token."""
    text = "🤖 robots café"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode() and len(ids) > len(text.split())

    def name(piece: bytes) -> str:
        whole = piece.decode(errors="ignore")
        return whole if whole.encode() == piece else "bytes:" + "".join(f"\\x{b:02x}" for b in piece)

    scored = client.completions.create(model=model_name, prompt=text, max_tokens=0, echo=True, logprobs=5)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == text and lp.tokens == [name(p) for p in pieces]
    assert lp.tokens[:3] == ["bytes:\\xf0\\x9f", "bytes:\\xa4", "bytes:\\x96"]
    assert lp.text_offset == [len(b"".join(pieces[:i]).decode(errors="ignore")) for i in range(len(ids))]
    assert lp.text_offset[:4] == [0, 0, 0, 1]   # the emoji's three tokens, then " robots"
    assert all(len(top) >= 5 for top in lp.top_logprobs[1:])   # (no two of the five share a name)
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Say it."}],
                                          logprobs=True, top_logprobs=5, temperature=0,
                                          extra_body={"guided_choice": [text]})
    content = chat.choices[0].logprobs.content
    assert chat.choices[0].message.content == text and b"".join(bytes(e.bytes) for e in content) == text.encode()
    for entry in [*content, *(top for e in content for top in e.top_logprobs)]:
        assert entry.token == name(bytes(entry.bytes))
    assert sum(e.token.startswith("bytes:") for e in content) >= 2


def test_vllms_prompt_logprobs_field(client, model_name, tokenizer, server):
    """vLLM's `prompt_logprobs`: per choice on /v1/completions, on the response on chat (the
    rendered prompt's tokens), by token id; the same values as echo's; not on a stream."""
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1,
                                          extra_body={"prompt_logprobs": 1}).model_dump()
    ids = chat_prompt_ids(tokenizer, messages)
    listed = chat["prompt_logprobs"]
    assert listed[0] is None and len(listed) == len(ids) == chat["usage"]["prompt_tokens"]
    echoed = client.completions.create(model=model_name, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], listed[1:], strict=True)] == \
        echoed.choices[0].logprobs.token_logprobs[1:]
    for t, entry in zip(ids[1:], listed[1:], strict=True):
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[0] == 1 and entry[str(t)]["decoded_token"] == tokenizer.decode([t]) and len(entry) <= 2
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, n=2, seed=3, logprobs=1,
                                      extra_body={"prompt_logprobs": 0}).model_dump()
    assert [len(c["prompt_logprobs"]) for c in plain["choices"]] == [len(tokenizer.encode(PROMPT))] * 2
    # (without echo, a choice's logprobs stay its own tokens')
    assert [len(c["logprobs"]["tokens"]) for c in plain["choices"]] == [1, 1]
    with_logprobs = client.chat.completions.create(model=model_name, messages=messages, max_tokens=2, logprobs=True,
                                                   extra_body={"prompt_logprobs": 0})
    assert len(with_logprobs.choices[0].logprobs.content) == 2 and with_logprobs.prompt_logprobs[0] is None
    r = httpx.post(server.base + "/v1/chat/completions", json={"messages": messages, "stream": True,
                                                                "prompt_logprobs": 1}, headers=auth(KEY), timeout=60)
    check_error(r, 400, "prompt_logprobs", None)


# ---- chat ------------------------------------------------------------------------------------------

def test_chat_stream_and_not_with_usage(client, model_name, tokenizer):
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}]}]
    r = client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    flat = [messages[0], {"role": "user", "content": "Name a color."}]
    assert r.usage.prompt_tokens == len(chat_prompt_ids(tokenizer, flat))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_logprobs_and_n_stream(client, model_name):
    messages = [{"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(model=model_name, messages=messages, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert c.bytes == list(c.token.encode())

    chunks = list(client.chat.completions.create(model=model_name, messages=messages, max_tokens=4, n=2,
                                                 temperature=0.8, seed=3, stream=True))
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and all(texts.values())


def test_cached_prompt_tokens_are_reported(client, model_name):
    prompt = f"Cache probe {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy dog. " * 8
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=model_name, prompt=prompt, max_tokens=1)
    n = first.usage.prompt_tokens
    assert n > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % 16 == 0 and n - 16 <= cached < n     # every full block but the one holding the last token


# ---- other endpoints ---------------------------------------------------------------------------------

def test_models_tokenize_detokenize_metrics(server, client, model_name, tokenizer):
    assert [m.id for m in client.models.list().data] == [model_name]
    assert client.models.retrieve(model_name).id == model_name   # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("org/another-model")
    assert httpx.get(server.base + "/version").json() == {"version": tokenmill.__version__}
    r = httpx.post(server.base + "/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == tokenizer.encode(PROMPT) and r["count"] == 5 and r["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.base + "/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == chat_prompt_ids(tokenizer, messages)
    r = httpx.post(server.base + "/detokenize", json={"tokens": tokenizer.encode(PROMPT)}).json()
    assert r == {"prompt": PROMPT}
    m = server.metrics()
    for name in ("tokenmill_num_requests_running", "tokenmill_num_requests_waiting", "tokenmill_kv_blocks_used",
                 "tokenmill_kv_blocks_total", "tokenmill_prefix_cache_hit_rate", "tokenmill_num_preemptions_total",
                 "tokenmill_prompt_tokens_total", "tokenmill_generation_tokens_total",
                 "tokenmill_time_to_first_token_seconds_count", "tokenmill_inter_token_latency_seconds_count",
                 "tokenmill_e2e_request_latency_seconds_count", 'tokenmill_requests_total{status="length"}',
                 'tokenmill_requests_total{status="abort"}'):
        assert name in m, name
    assert m["tokenmill_kv_blocks_total"] == 256
    assert m["tokenmill_e2e_request_latency_seconds_count"] >= 1 and m["tokenmill_generation_tokens_total"] >= 12
    assert 0 < m["tokenmill_prefix_cache_hit_rate"] < 1


# ---- errors ------------------------------------------------------------------------------------------

ERROR_CASES = [
    # (path, body, status, param, code)
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("/v1/completions", {"prompt": "x", "stream": True, "stop": [""]}, 400, "stop", None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, 99999999]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "word " * 600}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x", "model": "m" * 100_000}, 404, "model", "model_not_found"),
    # hostile values that once gave a 500 (or, for top_p, failed every request of the step)
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "top_p": 1e-46}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "Hi", "temperature": 0, "top_p": 1e-300, "stream": True}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "n": 10**30}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "n": 10**8}, 400, "n", None),
    ("/v1/completions", {"prompt": [1, -1]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, 2**64]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [[1, 2], [3, -(2**63) - 1]]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": None, "min_tokens": 10**6}, 400, "min_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e308}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e308}, 400, "repetition_penalty", None),
    # (a lone surrogate is invalid JSON to the parser: refused before any field is read)
    ("/v1/completions", {"prompt": "a\ud800b"}, 400, None, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfffb"}]}, 400, None, None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, 400, "tools", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     400, "max_completion_tokens", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 30}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True, "n": -1},
     400, "n", None),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "hi"}]}, 400, "prompt", None),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", None),
]


def check_error(r: httpx.Response, status: int, param: str | None, code: str | None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param or (param is not None and str(error["param"]).startswith(param)), error
    assert error["code"] == code and error["message"]
    if param is not None:
        assert param.split("[")[0] in error["message"]
    return error


@pytest.mark.parametrize("path,body,status,param,code", ERROR_CASES,
                         ids=[f"{i}-{c[2]}-{c[3]}" for i, c in enumerate(ERROR_CASES)])
def test_bad_requests_are_openai_errors_naming_the_field(server, path, body, status, param, code):
    # json.dumps escapes lone surrogates as JSON allows ("\\ud800"); httpx's json= would fail to encode them
    r = httpx.post(server.base + path, content=json.dumps(body), headers={**auth(KEY), "Content-Type":
                                                                          "application/json"}, timeout=60)
    check_error(r, status, param, code)
    assert len(r.content) < 4096   # an error does not echo the request's input back at length


def test_error_classes_through_the_openai_client(server, client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "not a name"}}])
    assert e.value.status_code == 400 and e.value.param == "tools[0].function.name"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi")
    assert e.value.code == "model_not_found"
    bad = openai.OpenAI(base_url=server.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


def test_raw_protocol_errors(server):
    headers = {**auth(KEY), "Content-Type": "application/json"}
    r = httpx.post(server.base + "/v1/completions", content=b"{not json", headers=headers)
    assert check_error(r, 400, None, None)["message"].startswith("the request body is not valid JSON")
    check_error(httpx.post(server.base + "/v1/completions", content=b"[1, 2]", headers=headers), 400, None, None)
    big = json.dumps({"prompt": "x" * (2 << 20)}).encode()
    check_error(httpx.post(server.base + "/v1/completions", content=big, headers=headers), 413, None,
                "request_too_large")
    r = httpx.get(server.base + "/v1/nothing-here", headers=headers)
    check_error(r, 404, None, None)
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
        for h in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
            r = httpx.request("GET" if path == "/v1/models" else "POST", server.base + path, headers=h,
                              json={"prompt": "x"})
            check_error(r, 401, None, "invalid_api_key")
    assert httpx.get(server.base + "/health").status_code == 200       # open: no key needed
    assert httpx.get(server.base + "/metrics").status_code == 200


# ---- concurrency and cancellation ----------------------------------------------------------------------

def test_32_concurrent_streams_each_match_their_text_alone(client, model_name):
    prompts = [f"Note {i}: the {['red', 'blue', 'green', 'old'][i % 4]} {['ship', 'tree', 'house', 'road'][i // 8]} "
               f"number {i} is" for i in range(32)]
    kwargs = dict(model=model_name, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]
    barrier = threading.Barrier(32)

    def stream(p: str) -> str:
        barrier.wait()
        return "".join(c.choices[0].text for c in client.completions.create(prompt=p, stream=True, **kwargs))

    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(stream, prompts))
    assert together == alone
    assert len(set(alone)) > 8


def wait_for(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_client_disconnect_aborts_and_frees_every_block(server, model_name):
    before = server.metrics()['tokenmill_requests_total{status="abort"}']
    body = {"model": model_name, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.base + "/v1/completions", json=body, headers=auth(KEY)) as r:
            assert r.status_code == 200
            lines = 0
            for line in r.iter_lines():
                lines += line.startswith("data:")
                if lines == 3:
                    break
    assert server.metrics()["tokenmill_num_requests_running"] <= 1

    def aborted_and_free(n: float) -> bool:
        m = server.metrics()
        return (m['tokenmill_requests_total{status="abort"}'] == n and m["tokenmill_kv_blocks_used"] == 0
                and m["tokenmill_num_requests_running"] == 0)

    assert wait_for(lambda: aborted_and_free(before + 1)), server.metrics()

    # Not streaming: the client gives up waiting (the 480 tokens take the server well over the 0.5 s:
    # 400 in 1.5 s came back within the timeout on a fast machine).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json={**body, "stream": False, "max_tokens": 480},
                   headers=auth(KEY), timeout=0.5)
    assert wait_for(lambda: aborted_and_free(before + 2)), server.metrics()


def test_queue_full_is_429_with_retry_after(server, model_name):
    """32 running sequences (--max-num-seqs) + 2 queued (--max-queued-requests): the next one is refused."""
    headers = auth(KEY)
    body = {"model": model_name, "prompt": "List every animal you know.", "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    before = server.metrics()['tokenmill_requests_total{status="rejected"}']
    with httpx.Client(timeout=120) as c1, httpx.Client(timeout=120) as c2:
        with c1.stream("POST", server.base + "/v1/completions", json={**body, "n": 32}, headers=headers) as running:
            assert running.status_code == 200
            lines = running.iter_lines()    # (kept: dropping the iterator would close the connection)
            next(lines)                     # 32 sequences run (they last ~100 steps) ...
            with c2.stream("POST", server.base + "/v1/completions", json={**body, "n": 2}, headers=headers) as queued:
                assert queued.status_code == 200    # ... 2 more are accepted into the queue ...
                r = httpx.post(server.base + "/v1/completions", json=body, headers=headers)   # ... one more is not
                check_error(r, 429, None, "queue_full")
                assert r.headers["retry-after"] == "1"
                r = httpx.post(server.base + "/v1/completions", json={**body, "n": 35}, headers=headers)
                check_error(r, 400, "n", None)      # more than the server could ever hold
                r = httpx.post(server.base + "/v1/completions", json={**body, "prompt": ["a", "b", "c"], "n": 12},
                               headers=headers)
                check_error(r, 400, "prompt", None)   # so are 3 prompts x 12 (not a 429 to retry)
                assert "36 sequences" in r.json()["error"]["message"]
                assert wait_for(lambda: server.metrics()["tokenmill_num_requests_running"] == 32
                                and server.metrics()["tokenmill_num_requests_waiting"] >= 1), server.metrics()
    # Both clients went away: their requests are aborted, the queue drains, requests are accepted again.
    assert wait_for(lambda: server.metrics()["tokenmill_kv_blocks_used"] == 0)
    assert server.metrics()['tokenmill_requests_total{status="rejected"}'] == before + 1
    ok = httpx.post(server.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=headers)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


# ---- SIGTERM, the --api-key flag, a bad model path (on a tiny random model) ------------------------------

def test_api_key_flag_then_sigterm_finishes_the_stream_in_flight_and_exits_cleanly(tiny_gguf_model, tmp_path):
    s = Server([str(tiny_gguf_model("llama")), "--dtype", "float32", "--device", "cpu", "--api-key", TINY_KEY],
               tmp_path / "term.log", {"TOKENMILL_API_KEY": "ignored"})
    try:
        s.wait_ready(TINY_KEY)
        # The flag wins over the environment variable.
        check_error(httpx.get(s.base + "/v1/models", headers=auth("ignored")), 401, None, "invalid_api_key")
        assert httpx.get(s.base + "/v1/models", headers=auth(TINY_KEY)).status_code == 200

        body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=60) as c, c.stream("POST", s.base + "/v1/completions", json=body,
                                                     headers=auth(TINY_KEY)) as r:
            lines = r.iter_lines()
            next(lines)
            s.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][5:])["usage"]["completion_tokens"] == 200
        assert s.proc.wait(60) == 0
        assert "engine stopped" in s.log()
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.base + "/health")
    finally:
        stop_process(s.proc)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files)."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days",
                    "2", "-subj", "/CN=tokenmill-test", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def test_https_behind_a_root_path(tiny_gguf_model, certificate, tmp_path):
    cert, key = certificate
    trust = ssl.create_default_context(cafile=cert)
    s = Server([str(tiny_gguf_model("llama")), "--ssl-certfile", cert, "--ssl-keyfile", key, "--root-path", "/llm/"],
               tmp_path / "tls.log", verify=trust)
    with running(s, None):
        assert f"at https://127.0.0.1:{s.port} " in s.log()
        client = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0,
                               http_client=httpx.Client(verify=trust))
        done = client.completions.create(model="tiny-llama-F32.gguf", prompt="Hello", max_tokens=4,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 4
        with pytest.raises(httpx.HTTPError):   # (no plain HTTP on the port)
            httpx.get(f"http://127.0.0.1:{s.port}/health", timeout=10)
        # The proxy strips the prefix; paths are named as its clients sent them.
        error = check_error(httpx.get(s.base + "/v1/nope", verify=trust), 404, None, None)
        assert error["message"].startswith("no route GET /llm/v1/nope ")


def test_priority_orders_the_waiting_requests(default_gguf_path, tmp_path):
    """vLLM's `priority` (lower runs first; tokenmill always schedules by it): one sequence at a
    time, two requests wait behind a running one; the one with the lower value runs first, whatever
    the order they came in."""
    s = Server([str(default_gguf_path), "--max-num-seqs", "1", "--max-model-len", "2048"], tmp_path / "priority.log")
    with running(s, None), ThreadPoolExecutor(3) as pool:
        base = {"prompt": "Hello", "ignore_eos": True, "temperature": 0}
        done: list[str] = []

        def post(name: str, max_tokens: int, **fields) -> None:
            r = httpx.post(s.base + "/v1/completions", json={**base, "max_tokens": max_tokens, **fields}, timeout=120)
            assert r.status_code == 200, r.text
            done.append(name)

        first = pool.submit(post, "running", 1500)   # (seconds on a CPU: the others come in meanwhile)
        assert wait_for(lambda: s.metrics()["tokenmill_num_requests_running"] == 1)
        later = [pool.submit(post, "later", 8, priority=5)]
        assert wait_for(lambda: s.metrics()["tokenmill_num_requests_waiting"] == 1)
        later.append(pool.submit(post, "sooner", 8, priority=-1))
        assert wait_for(lambda: s.metrics()["tokenmill_num_requests_waiting"] == 2)
        for f in [first, *later]:
            f.result(timeout=120)
        assert done == ["running", "sooner", "later"]
        r = httpx.post(s.base + "/v1/completions", json={**base, "max_tokens": 1, "priority": 1.5})
        assert check_error(r, 400, "priority", None)


def test_https_shutdown_waits_for_no_idle_client(default_gguf_path, certificate, tmp_path):
    """On SIGTERM uvicorn closes the idle connections (the others once their response is sent) and
    waits for every connection to be gone, and asyncio's TLS close is gone only once the client
    answers close_notify, or after 30 s. Clients that keep a connection without reading it (in a
    pool, as the openai client does) never answer: one idle at SIGTERM, one whose stream was in
    flight then and that stops reading at its end, one that sent nothing (closed by the read
    timeout). The server must exit once its requests are done, well before the 30 s, and the
    stream must arrive whole."""
    cert, key = certificate
    trust = ssl.create_default_context(cafile=cert)
    s = Server([str(default_gguf_path), "--ssl-certfile", cert, "--ssl-keyfile", key, "--max-model-len", "1024",
                "--request-read-timeout", "3"], tmp_path / "tls.log", verify=trust)

    def tls_socket() -> ssl.SSLSocket:
        return trust.wrap_socket(socket.create_connection(("127.0.0.1", s.port)), server_hostname="127.0.0.1")

    with running(s, None), httpx.Client(verify=trust, timeout=60) as idle, tls_socket():
        time.sleep(4)   # (the read timeout closes that socket, which sent nothing: its TLS close waits)
        streaming = tls_socket()
        assert idle.get(s.base + "/health").status_code == 200   # then idle in its pool
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True})
        streaming.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        received = b""
        while b"data: {" not in received:   # the stream is in flight
            chunk = streaming.recv(65536)
            assert chunk, received
            received += chunk
        s.proc.send_signal(signal.SIGTERM)   # (the drain lets it finish)
        while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):   # its end; then no more reads
            chunk = streaming.recv(65536)
            assert chunk, received[-300:]
            received += chunk
        assert s.proc.wait(15) == 0
        streaming.close()
    # whole: ended by its length, not by the drain's error (chunks can hold several tokens: no count)
    assert b'"finish_reason": "length"' in received and b'"error"' not in received, received[-500:]
    assert "Traceback" not in s.log() and "engine stopped" in s.log(), s.log()


def test_serve_refuses_bad_flags_and_model_paths_before_listening(tmp_path, capsys, certificate):
    cert, key = certificate
    other_key = tmp_path / "other.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other_key), "2048"], check=True, capture_output=True)
    encrypted_key = tmp_path / "encrypted.pem"
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:secret", "-out", str(encrypted_key)],
                   check=True, capture_output=True)
    for argv, words in ((["serve", str(tmp_path / "missing.gguf")], ["missing.gguf"]),
                        (["serve", "--max-queued-requests", "-1"], ["--max-queued-requests", ">= 0"]),
                        (["serve", "a.gguf", "--model", "b.gguf"], ["MODEL", "given twice"]),
                        (["serve", "--ssl-keyfile", key], ["--ssl-keyfile", "needs --ssl-certfile"]),
                        (["serve", "--ssl-certfile", str(tmp_path / "none.pem")], ["--ssl-certfile", "cannot read"]),
                        (["serve", "--ssl-certfile", cert], ["--ssl-certfile:", "not a PEM certificate and its"]),
                        (["serve", "--ssl-certfile", cert, "--ssl-keyfile", str(other_key)],
                         ["--ssl-certfile and --ssl-keyfile", "private key"]),
                        (["serve", "--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", key,
                          "--ssl-cert-reqs", "1"], ["--ssl-ca-certs", "not PEM certificates"]),
                        (["serve", "--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-ca-certs", cert],
                         ["--ssl-ca-certs", "needs --ssl-cert-reqs"]),
                        (["serve", "--ssl-certfile", cert, "--ssl-keyfile", str(encrypted_key)],
                         ["--ssl-keyfile", "encrypted"]),
                        (["serve", "--ssl-certfile", cert, "--ssl-keyfile", key, "--ssl-cert-reqs", "2"],
                         ["--ssl-cert-reqs 2", "needs --ssl-ca-certs"]),
                        (["serve", "--root-path", "llm"], ["--root-path", "begins with /"]),
                        (["serve", "--root-path", "/a b"], ["--root-path", "'/a b'"])):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("tokenmill: error:") and all(w in err for w in words) and "Traceback" not in err


def test_serve_exits_with_one_line_when_the_model_fails_to_load(tiny_gguf_model):
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", str(tiny_gguf_model("llama")), "--port",
                        str(free_port()), "--max-model-len", "999999"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenmill: error: max_model_len (999999)") and "Traceback" not in r.stderr


def test_stream_lines_split_only_where_events_end(server, model_name):
    """Python's str.splitlines (and so httpx's iter_lines) also ends a line at U+0085, U+2028 and
    U+2029, which a JSON string may hold raw: the stream escapes them, so a text that holds them (here
    echoed; a sampled token can make one too) does not cut a `data:` line in two for such clients."""
    prompt = "one\u2028two\u2029three\x85four"
    body = {"model": model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c, c.stream("POST", server.base + "/v1/completions", json=body,
                                                 headers=auth(KEY)) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines), lines
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks).startswith(prompt)
