"""Fuzz of the HTTP API: one hostile request must never hurt another.

One real `tokenmill serve` runs on the tiny random llama model. While a *victim* thread keeps
streaming the same greedy completion, the test sends POST /v1/completions, /v1/chat/completions,
/tokenize and /detokenize bodies of two kinds:

1. a sweep: a small valid body per endpoint with ONE field (top-level, or the first message's
   content) replaced by each hostile value of its JSON type: extreme numbers (1e-46, 5e-324, -0.0,
   1e308, float32's limits, 2**63, 2**64, -2**63-1, 10**30, a 400-digit integer, NaN, Infinity,
   1e400 as raw JSON), odd strings (lone surrogates, NUL, RTL marks, emoji, 100 kB strings, special
   tokens), out-of-vocabulary / negative / huge token ids. One change at a time takes each value
   past every other check, as deep into the server as it goes; the sweep is deterministic, so every
   such value is tried on every run;
2. hypothesis: bodies generated from the server's own schema (`Model.model_json_schema()` of the
   pydantic request models in `tokenmill.server.protocol`, compiled to strategies by `from_schema`
   below, so a field added to a model is fuzzed without touching this file). Most take "tame"
   values (the ranges `SamplingParams` accepts, max_tokens <= 8, token ids in the vocabulary) so
   they run in the engine next to the victim; the rest take any value of the schema's types. Most
   are then mutated (a field replaced by a hostile value of any type, unknown fields added, a field
   removed, hostile token ids) and a few are not a JSON object at all (invalid JSON or UTF-8, deep
   nesting, a bare list).

What must hold, whatever was sent:

- no response is a 5xx, and no stream carries an error event or ends without [DONE];
- every non-2xx response is OpenAI's error body {"error": {"message", "type", "param", "code"}};
- every victim completion equals the victim's text run alone, and none fails;
- afterwards no KV block is held, nothing runs or waits, no request ended as "error", the server
  process is alive and its log holds no traceback.

Problems are collected rather than raised (no shrinking: each request is sent once) and reported
together, grouped by endpoint, status, message and where the server raised (the traceback it logged
meanwhile), each with bodies that caused it. Each request has a connection of its own, so none
fails for what the one before it did to the connection. The server runs under an 8 GiB address-space
limit: a request that makes it allocate without bound fails as a MemoryError (reported) instead of
sending the machine to the OOM killer.

Hypothesis is derandomized and keeps no example database, so a run is reproducible: ~4,300
requests (1,300 sweep + 3,000 hypothesis) in ~30 s on 2 cores. For a longer hunt, set
TOKENMILL_FUZZ_EXAMPLES (e.g. 20000) and TOKENMILL_FUZZ_SEED (any int: other bodies than the
derandomized ones).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import resource
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import hypothesis
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_server import Server, running, wait_for
from tiny_models import TOKENIZER_VOCAB_SIZE

from tokenmill.server.protocol import (
    NO_OP_VALUES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

MODEL_NAME = "tiny"
VOCAB = TOKENIZER_VOCAB_SIZE          # the tiny llama's vocabulary: valid token ids are [0, VOCAB)
MAX_MODEL_LEN = 128                   # (a request without max_tokens runs to it: keep it short)
EXAMPLES = int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "3000"))   # hypothesis requests (more: a longer hunt)
SEED = os.environ.get("TOKENMILL_FUZZ_SEED")                         # unset: derandomized (the same every run)
REQUEST_TIMEOUT_S = 120
SERVER_MEMORY_LIMIT = 8 << 30         # address space (RLIMIT_AS); the tiny server uses ~1 GiB
VICTIM_BODY = {"model": MODEL_NAME, "prompt": "The cat sat on the warm window and", "max_tokens": 48,
               "temperature": 0, "ignore_eos": True, "stream": True}

ENDPOINTS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
SCHEMAS = {path: model.model_json_schema() for path, model in ENDPOINTS.items()}


# ---- JSON with raw literals -------------------------------------------------------------------------

class Raw(str):
    """A JSON literal sent verbatim (`1e400`, `-0`): json.dumps cannot write these."""


def to_json(value: Any) -> str:
    """JSON text of `value`; Python floats nan/inf become NaN/Infinity, lone surrogates \\ud800."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {to_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(to_json(v) for v in value) + "]"
    return json.dumps(value)


@dataclass
class Sent:
    """One request: its endpoint, body and how it was made."""

    path: str
    body: bytes
    notes: list[str]

    def show(self, limit: int = 500) -> str:
        text = self.body.decode("utf-8", "backslashreplace")
        text = text if len(text) <= limit else f"{text[:limit]}... ({len(self.body)} bytes)"
        return f"POST {self.path} {text}" + (f"   [{'; '.join(self.notes)}]" if self.notes else "")


# ---- hostile values ---------------------------------------------------------------------------------

HUGE_INTS = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**31) - 1, -(2**63) - 1, -(2**64), 10**30,
             -(10**30), 10**400]
INT_EXTREMES = [-1, 0, 1, 2, 64, 2**31 - 1, *HUGE_INTS, Raw("-0")]
NUMBER_EXTREMES = [
    1e-46, 5e-324, -5e-324, 1e-300, 1e-38, 1.1754943508222875e-38, 1.401298464324817e-45, 3.4028234663852886e38,
    3.5e38, 65520.0, 1e308, -1e308, 1.7976931348623157e308, -0.0, 0.0, -1.0, 0.5, 0.9999999999999999, 1.0000001,
    2.0000001, 100.0, 100.00000000000001, math.nan, math.inf, -math.inf, Raw("1e400"), Raw("-1e400"),
    Raw("1e-400"), Raw("-0"), Raw("1E+2"), *HUGE_INTS]
ODD_STRINGS = [
    "\ud800", "\udfff", "a\ud800b", "\udc00\ud800", "\x00", "a\x00b", "\u202e\u200f\u200e", "\ufeff",
    "\U0001f642" * 8, "\U0010ffff", "\ufffd", "\u0301", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    "\r\n\t\x1b[31m", "\\u0000", "ＡＢＣ", "١٢٣", "", " ", "x" * 100_000, "\u00e9" * 40_000,
    "\U0001f642" * 20_000, "a " * 50_000]
WRONG_TYPES = ["", "1", "0.5", "true", "null", "NaN", [], [1], [None], {}, {"a": 1}, True, False, None, [[[]]],
               [""], [{}]]
HOSTILE_IDS = [[-1], [VOCAB], [VOCAB + 1], [2**31 - 1], *([x] for x in HUGE_INTS), [0, -1, 1], [1, VOCAB, 2],
               [True], [1.0], [Raw("-0")], []]
HOSTILE_KEYS = ["-1", str(VOCAB), "1e3", "0x10", " 1", "1 ", "١", "", "NaN", str(2**63), str(10**40), "1.0", "+1",
                "\ud800", "01", "0" * 400 + "1"]


# ---- the JSON schema: field types, and strategies ---------------------------------------------------

def resolve(schema: dict, defs: dict) -> list[dict]:
    """The alternatives of a schema: $ref followed, anyOf flattened, null left out."""
    if "$ref" in schema:
        return resolve(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in schema:
        return [alt for s in schema["anyOf"] for alt in resolve(s, defs)]
    return [] if schema.get("type") == "null" else [schema]


def hostile_for(schema: dict, defs: dict) -> list[Any]:
    """The sweep's values for a field: the hostile values of each of its JSON types."""
    values: list[Any] = []
    for alt in resolve(schema, defs) or [{}]:
        kind = alt.get("type")
        items = resolve(alt.get("items", {}), defs) if kind == "array" else []
        if kind == "integer":
            values += INT_EXTREMES
        elif kind == "number":
            values += NUMBER_EXTREMES
        elif kind == "string":
            values += ODD_STRINGS
        elif kind == "array" and items and items[0].get("type") == "integer":
            values += HOSTILE_IDS
        elif kind == "object" and "properties" not in alt:       # a map: logit_bias
            values += [{key: 1.0} for key in HOSTILE_KEYS] + [{"1": v} for v in NUMBER_EXTREMES]
        elif kind is None:                                     # any JSON: the completion prompt
            values += ODD_STRINGS + HOSTILE_IDS + [[ids] for ids in HOSTILE_IDS] + [[s] for s in ODD_STRINGS[:8]]
    return values


TEXT = st.text(max_size=24)           # any code point but surrogates: NUL, RTL marks, emoji included
ANY_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                        max_leaves=8)
TOKEN_ID = st.integers(0, VOCAB - 1)
SHORT_TEXT = st.text(min_size=1, max_size=24)
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant"]),
    "content": SHORT_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                                     min_size=1, max_size=2)})
OMIT = st.nothing()                   # as a TAME value: leave the field out

# Values the engine accepts (SamplingParams' ranges), by field name: a body drawn with these mostly
# runs. max_tokens is always given (a request without it runs to the context limit).
TAME: dict[str, st.SearchStrategy] = {
    "model": st.sampled_from([MODEL_NAME, None]),
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": OMIT,    # (chat: not with max_tokens)
    "min_tokens": st.integers(0, 2),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0, 2, exclude_min=True),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(TOKEN_ID.map(str), st.floats(-100, 100), max_size=3),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": SHORT_TEXT | st.lists(SHORT_TEXT, max_size=3),
    "stop_token_ids": st.lists(TOKEN_ID, max_size=3),
    "logprobs": st.integers(0, 5),    # (chat: a bool, see tame_for)
    "top_logprobs": st.integers(0, 5),
    "prompt": (SHORT_TEXT | st.lists(SHORT_TEXT, min_size=1, max_size=3)
               | st.lists(TOKEN_ID, min_size=1, max_size=16)
               | st.lists(st.lists(TOKEN_ID, min_size=1, max_size=8), min_size=1, max_size=3)),
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "tokens": st.lists(TOKEN_ID, max_size=16),
    # the unimplemented OpenAI fields, with the values the server accepts because they change nothing
    **{name: st.sampled_from([None, *rule.values]) for name, rule in NO_OP_VALUES.items()},
}


def tame_for(model: type) -> list[dict[str, st.SearchStrategy]]:
    """TAME adapted to the model: a list of kinds of tame bodies (drawn evenly)."""
    if model is ChatCompletionRequest:
        return [{**TAME, "logprobs": st.booleans()}]
    if model is TokenizeRequest:      # exactly one of prompt and messages
        return [{**TAME, "prompt": TEXT, "messages": OMIT}, {**TAME, "prompt": OMIT}]
    return [TAME]


def from_schema(schema: dict, defs: dict, tame: dict[str, st.SearchStrategy], always: set[str]) -> st.SearchStrategy:
    """A strategy for JSON values valid against `schema` (the subset pydantic writes: $ref, anyOf,
    const, enum, object, array, string, integer, number, boolean, null; {} is any JSON). Object
    properties named in `tame` draw from it instead; those in `always` are always present."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, tame, always)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs, tame, always) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties")
        if props is None:
            return st.dictionaries(TEXT, from_schema(schema.get("additionalProperties", {}), defs, tame, always),
                                   max_size=3)

        def field(name: str) -> st.SearchStrategy:
            return tame[name] if name in tame else from_schema(props[name], defs, tame, always)

        names = [k for k in props if tame.get(k) is not OMIT]
        required = set(schema.get("required", [])) | always
        return st.fixed_dictionaries({k: field(k) for k in names if k in required},
                                     optional={k: field(k) for k in names if k not in required})
    if kind == "array":
        min_size = schema.get("minItems", 0)
        return st.lists(from_schema(schema.get("items", {}), defs, tame, always), min_size=min_size,
                        max_size=min_size + 3)
    if kind == "string":
        return TEXT
    if kind == "integer":
        return st.integers()
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False) | st.integers()
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON


def body_strategies(path: str) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """(tame bodies, any schema-valid bodies) for one endpoint."""
    schema = SCHEMAS[path]
    defs = schema.get("$defs", {})
    kinds = tame_for(ENDPOINTS[path])
    always = [{k for k in ("max_tokens", "prompt", "messages") if t[k] is not OMIT} for t in kinds]
    tame = st.one_of([from_schema(schema, defs, t, a) for t, a in zip(kinds, always, strict=True)])
    return tame, from_schema(schema, defs, {}, set())


BODIES = {path: body_strategies(path) for path in ENDPOINTS}


# ---- 1. the sweep: one hostile value in one field of a small valid body ---------------------------------

BASES = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 1},
    "/v1/chat/completions": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1},
    "/tokenize": {"model": MODEL_NAME, "prompt": "Hello there"},
    "/detokenize": {"model": MODEL_NAME, "tokens": [72, 101, 108]},
}
NESTED = [   # (endpoint, base body, path, values): places the top-level sweep does not reach
    ("/v1/chat/completions", BASES["/v1/chat/completions"], ("messages", 0, "content"), ODD_STRINGS),
    ("/v1/chat/completions", BASES["/v1/chat/completions"], ("messages", 0, "role"), ODD_STRINGS[:8]),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}, ("messages", 0, "content"), ODD_STRINGS),
]


def sweep() -> list[Sent]:
    out = []
    for path, schema in SCHEMAS.items():
        for name, field_schema in schema["properties"].items():
            for value in hostile_for(field_schema, schema.get("$defs", {})):
                body = {**BASES[path], name: value}
                if path == "/tokenize" and name == "messages":
                    del body["prompt"]
                out.append(Sent(path, to_json(body).encode(), [f"sweep {name}"]))
    for path, base, where, values in NESTED:
        for value in values:
            body = copy.deepcopy(base)
            set_at(body, where, value)
            out.append(Sent(path, to_json(body).encode(), [f"sweep {show_path(where)}"]))
    return out


# ---- 2. hypothesis: schema bodies, mutated -------------------------------------------------------------

def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """One of the strategies, picked with the given integer weights."""
    return st.sampled_from([s for weight, s in choices for _ in range(weight)]).flatmap(lambda s: s)


HOSTILE = weighted((2, st.sampled_from(NUMBER_EXTREMES + INT_EXTREMES)), (2, st.sampled_from(WRONG_TYPES)),
                   (2, st.sampled_from(ODD_STRINGS)), (1, st.integers()), (1, st.floats()),
                   (1, ANY_JSON)).map(copy.deepcopy)      # (a later mutation may edit the value in place)
HOSTILE_ID = st.sampled_from([-1, VOCAB, VOCAB + 1, 2**31 - 1, *HUGE_INTS]) | st.integers()
HOSTILE_ID_LIST = st.lists(weighted((2, HOSTILE_ID), (1, TOKEN_ID)), min_size=1, max_size=4)
UNKNOWN_NAMES = st.sampled_from(["tools", "functions", "best_of", "suffix", "__proto__", "", "\x00", "Max_Tokens",
                                 "max_tokens ", "\ud800"]) | TEXT
ID_FIELDS = {"/v1/completions": ["prompt", "stop_token_ids", "logit_bias"],
             "/v1/chat/completions": ["stop_token_ids", "logit_bias"], "/tokenize": ["prompt"],
             "/detokenize": ["tokens"]}
RAW_BODIES = [
    b"", b"null", b"[]", b"[{}]", b'"prompt"', b"1", b"{", b'{"prompt": "x"', b'{"prompt": "\xff\xfe"}',
    b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 1}', b'{"prompt": "x", "prompt": 5}',
    b'{"prompt": "x", "max_tokens": 1}' + b" " * 100, b'{"tokens": [1, 2,]}', b"{'prompt': 'x'}",
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b'{"messages": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
    b'{"prompt": "\\ud800", "max_tokens": 1}', b'{"prompt": "\\u0000", "max_tokens": 1}',
    b'{"prompt": "x", "max_tokens": 1e400}', b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "x", "max_tokens": 1}\x00', b"\x00" * 64, b'{"prompt": "' + b"x" * (1 << 20) + b'"}']


def paths_in(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place inside a JSON value: (key or index, ...) paths to dict values and list items."""
    out = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += [(*prefix, k), *paths_in(v, (*prefix, k))]
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += [(*prefix, i), *paths_in(v, (*prefix, i))]
    return out


def get_at(value: Any, path: tuple) -> Any:
    for part in path:
        value = value[part]
    return value


def set_at(body: dict, path: tuple, value: Any) -> None:
    get_at(body, path[:-1])[path[-1]] = value


def show_path(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" if i else str(p) for i, p in enumerate(path)) or "."


@st.composite
def mutation(draw, path: str, body: dict) -> str:
    """Apply one hostile change to `body` (in place); returns what it did."""
    kind = draw(st.sampled_from(["replace"] * 5 + ["ids"] * 2 + ["unknown", "remove"]))
    if kind == "replace":      # mostly a top-level field of the schema, given or not; else anything inside
        nested = paths_in(body)
        if nested and draw(st.integers(0, 2)) == 0:
            where = draw(st.sampled_from(nested))
        else:
            where = (draw(st.sampled_from(sorted(SCHEMAS[path]["properties"]))),)
        set_at(body, where, draw(HOSTILE))
        return f"replaced {show_path(where)}"
    if kind == "ids":
        field = draw(st.sampled_from(ID_FIELDS[path]))
        if field == "logit_bias":
            body[field] = {draw(st.sampled_from(HOSTILE_KEYS) | HOSTILE_ID.map(str)): draw(st.floats(-100, 100))}
        elif field == "prompt" and path == "/v1/completions" and draw(st.booleans()):
            body[field] = draw(st.lists(HOSTILE_ID_LIST, min_size=1, max_size=2))
        else:
            body[field] = draw(HOSTILE_ID_LIST)
        return f"hostile token ids in {field}"
    if kind == "unknown":
        where = draw(st.sampled_from([()] + [p for p in paths_in(body) if isinstance(get_at(body, p), dict)]))
        name = draw(UNKNOWN_NAMES)
        set_at(body, (*where, name), draw(HOSTILE))
        return f"unknown field {show_path((*where, name))}"
    if not body:
        return "nothing to remove"
    name = draw(st.sampled_from(sorted(body)))
    del body[name]
    return f"removed {name}"


@st.composite
def requests(draw) -> Sent:
    """5% raw bodies; 15% any schema-valid body, mutated 0-2 times; 25% tame bodies as they are;
    55% tame bodies with one hostile change (a quarter of them with a second one)."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    choice = draw(st.integers(0, 19))
    if choice == 0:
        return Sent(path, draw(st.sampled_from(RAW_BODIES)), ["raw body"])
    tame, anything = BODIES[path]
    if choice <= 3:
        body, notes, changes = draw(anything), ["schema-valid, untamed"], draw(st.integers(0, 2))
    else:
        body, notes, changes = draw(tame), [], 0 if choice <= 8 else draw(st.sampled_from([1, 1, 1, 2]))
    notes += [draw(mutation(path, body)) for _ in range(changes)]
    return Sent(path, to_json(body).encode(), notes)


# ---- judging --------------------------------------------------------------------------------------------

def strict_json(text: str) -> Any:
    """JSON as any client parses it: NaN / Infinity are not JSON."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")
    return json.loads(text, parse_constant=refuse)


def sse_events(text: str) -> list[Any]:
    """The data of each Server-Sent Event; fails unless the stream ends with [DONE]."""
    data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    if not data or data[-1] != "[DONE]":
        raise ValueError("the stream did not end with data: [DONE]")
    return [strict_json(d) for d in data[:-1]]


def problem_with(r: httpx.Response) -> tuple[str, str] | None:
    """(kind, message) of what is wrong with a response, or None."""
    if r.status_code >= 500:
        try:
            message = r.json()["error"]["message"]
        except Exception:
            message = r.text[:200]
        return f"{r.status_code}", message
    if not 200 <= r.status_code < 300:
        try:
            error = strict_json(r.text)["error"]
            assert set(error) == {"message", "type", "param", "code"}, sorted(error)
            assert isinstance(error["message"], str) and error["message"], error
        except Exception as e:
            return f"{r.status_code} not an OpenAI error body", f"{type(e).__name__}: {e}; body {r.text[:200]!r}"
        return None
    try:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            for event in sse_events(r.text):
                if "error" in event:
                    return f"{r.status_code} stream error event", str(event["error"].get("message"))
        else:
            strict_json(r.text)
    except Exception as e:
        return f"{r.status_code} malformed response", f"{type(e).__name__}: {e}"
    return None


def tracebacks_in(log: str) -> list[str]:
    """Each traceback in a server log as "Error: message (at tokenmill/file.py:line in function)",
    the deepest tokenmill frame; chained exceptions count one each."""
    out = []
    for frames, error in re.findall(r"^Traceback \(most recent call last\):\n((?:[ \t].*\n)*)(.*)", log, re.M):
        ours = re.findall(r'File ".*?/(tokenmill/[^"]+)", line (\d+), in (\S+)', frames)
        out.append(f"{error[:200]} (at {ours[-1][0]}:{ours[-1][1]} in {ours[-1][2]})" if ours else error[:200])
    return out


def log_since(path: Path, start: int) -> str:
    """The log from byte `start` on, once it has stopped growing (uvicorn logs an unhandled error a
    second time after the response is sent)."""
    size, deadline = -1, time.monotonic() + 2
    while size != path.stat().st_size and time.monotonic() < deadline:
        size = path.stat().st_size
        time.sleep(0.05)
    with open(path, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace")


def victim_text(base: str) -> str:
    r = httpx.post(base + "/v1/completions", json=VICTIM_BODY, timeout=REQUEST_TIMEOUT_S)
    if r.status_code != 200:
        raise AssertionError(f"victim got {r.status_code}: {r.text[:300]}")
    text = ""
    for event in sse_events(r.text):
        if "error" in event:
            raise AssertionError(f"victim stream error event: {event['error']}")
        text += "".join(c["text"] for c in event["choices"])
    return text


class Victim(threading.Thread):
    """Streams VICTIM_BODY over and over until stopped; records each text or error."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.base = base
        self.stop = threading.Event()
        self.texts: list[str] = []
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.texts.append(victim_text(self.base))
            except Exception as e:
                self.errors.append(f"{type(e).__name__}: {e}"[:500])
                time.sleep(0.5)        # (the server may be gone: do not spin)


@pytest.fixture(scope="module")
def fuzz_server(tiny_gguf_model, tmp_path_factory) -> Server:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    s = Server([str(tiny_gguf_model("llama")), "--dtype", "float32", "--device", "cpu", "--max-model-len",
                str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--served-model-name", MODEL_NAME], log)
    # A request that makes the server allocate without bound (n=2**31 once built a list of n items)
    # must fail there, as a MemoryError this test reports, not take the whole machine to the OOM killer.
    if hasattr(resource, "prlimit"):
        resource.prlimit(s.proc.pid, resource.RLIMIT_AS, (SERVER_MEMORY_LIMIT, SERVER_MEMORY_LIMIT))
    with running(s, None):
        yield s


@pytest.mark.slow
def test_hostile_requests_never_hurt_the_server_or_other_requests(fuzz_server):
    base = fuzz_server.base
    solo = victim_text(base)
    assert len(solo) > 0 and victim_text(base) == solo      # greedy: the same text every time, alone

    problems: dict[tuple[str, str, str, str], list[Sent]] = defaultdict(list)
    statuses: Counter[str] = Counter()
    slowest: list[tuple[float, str]] = []       # (seconds, request): the 3 slowest, for the summary
    # A new connection per request: after a 500 the server may close its connection, and a request
    # reusing it would fail for what the one before it did.
    client = httpx.Client(timeout=REQUEST_TIMEOUT_S, headers={"Content-Type": "application/json"},
                          limits=httpx.Limits(max_keepalive_connections=0))

    def send(req: Sent) -> None:
        if fuzz_server.proc.poll() is not None:     # (reported below; the rest would only be refused)
            statuses["server gone"] += 1
            return
        log_start = fuzz_server.log_path.stat().st_size
        start = time.monotonic()
        try:
            r = client.post(base + req.path, content=req.body)
            problem = problem_with(r)
            statuses[str(r.status_code)] += 1
        except httpx.HTTPError as e:
            problem = "no response", f"{type(e).__name__}: {e}"
            statuses["none"] += 1
        slowest[:] = sorted([*slowest, (time.monotonic() - start, req.show(120))], reverse=True)[:3]
        if problem is not None:
            # One cause, many bodies: group by the message with its numbers masked, and by where the
            # server raised (the traceback it logged while answering, if any).
            raised = "; ".join(dict.fromkeys(tracebacks_in(log_since(fuzz_server.log_path, log_start))))
            problems[req.path, problem[0], re.sub(r"\d+", "N", problem[1])[:200], raised or "no traceback"].append(req)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=SEED is None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(req=requests())
    def fuzz(req: Sent) -> None:
        send(req)

    if SEED is not None:
        fuzz = hypothesis.seed(int(SEED))(fuzz)

    victim = Victim(base)
    victim.start()
    started = time.monotonic()
    swept = 0.0
    try:
        for req in sweep():
            send(req)
        swept = time.monotonic() - started
        fuzz()
    finally:
        victim.stop.set()
        victim.join(REQUEST_TIMEOUT_S)
        client.close()
    elapsed = time.monotonic() - started

    report, every = [], []
    for (path, kind, message, raised), reqs in sorted(problems.items()):
        head = f"{path} -> {kind}: {message}  ({len(reqs)} requests)\n    server: {raised}"
        report.append(head + "\n    e.g.")
        distinct = list({tuple(r.notes): r for r in reqs}.values())      # differently made ones first
        report += [f"    {r.show()}" for r in (distinct + [r for r in reqs if r not in distinct])[:4]]
        every += [head, *(f"    {r.show(limit=10_000)}" for r in reqs)]
    if every:
        every_path = fuzz_server.log_path.with_name("problems.txt")
        every_path.write_text("\n".join(every) + "\n", errors="backslashreplace")
        report.append(f"(every failing request: {every_path})")
    wrong = [t for t in victim.texts if t != solo]
    if victim.errors or wrong:
        report.append(f"victim: {len(victim.texts)} completions, {len(wrong)} differ from the solo text {solo!r}, "
                      f"{len(victim.errors)} failed")
        report += [f"    differs: {t!r}" for t in wrong[:3]] + [f"    failed: {e}" for e in victim.errors[:5]]

    def idle() -> bool:
        m = fuzz_server.metrics()
        return (m["tokenmill_kv_blocks_used"] == 0 and m["tokenmill_num_requests_running"] == 0
                and m["tokenmill_num_requests_waiting"] == 0)

    if fuzz_server.proc.poll() is not None:
        report.append(f"the server exited with {fuzz_server.proc.returncode}")
    else:
        if not wait_for(idle):
            report.append(f"the server did not go idle: {fuzz_server.metrics()}")
        errors = fuzz_server.metrics()['tokenmill_requests_total{status="error"}']
        if errors:
            report.append(f"{errors:g} requests ended with status \"error\" (an engine step failed)")
    logged = Counter(tracebacks_in(fuzz_server.log()))
    if logged:
        report.append(f"the server log has tracebacks of {len(logged)} kinds:")
        report += [f"    {line}" for line, _ in logged.most_common(30)]

    if len(victim.texts) < 3:
        report.append(f"the victim ran only {len(victim.texts)} times: it did not run next to the fuzz")

    summary = "\n".join([
        f"{sum(statuses.values())} requests in {elapsed:.0f} s (sweep {swept:.0f} s), by status "
        f"{dict(sorted(statuses.items()))}; victim ran {len(victim.texts)} + {len(victim.errors)} times; "
        f"server log: {fuzz_server.log_path}; slowest:", *(f"    {t:.2f} s {r}" for t, r in slowest)])
    print(summary)
    if report:
        pytest.fail(summary + "\n" + "\n".join(report), pytrace=False)
