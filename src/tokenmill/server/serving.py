"""/v1/completions and /v1/chat/completions: request -> prompts + SamplingParams -> OpenAI JSON.

Shapes follow OpenAI's API exactly (ids `cmpl-...` / `chatcmpl-...`, `object`, `created`,
`choices[i].index` and `finish_reason`, `usage` with `prompt_tokens_details.cached_tokens`).
Streaming sends Server-Sent Events: one `data: {chunk}` per change, a last chunk with usage
(`choices: []`) when `stream_options.include_usage`, then `data: [DONE]`. With vLLM's
`stream_options.continuous_usage_stats` every chunk also carries the usage so far.

A completion request may hold several prompts: each is its own engine request; its choices are
numbered `prompt_index * n + sample_index`, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tokenmill.engine.input import InputProcessor, ToolPlan
from tokenmill.errors import TokenmillError
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling import SamplingParams, SamplingParamsError
from tokenmill.sampling.structured import StructuredOutputsParams
from tokenmill.server.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorBody
from tokenmill.tool_calls import arguments_schema

# Sampling fields that keep the model's default (generation_config.json) when the request omits them.
_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_RETRY_AFTER_S = 1
GRAMMAR_COMPILE_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)
T = TypeVar("T")
_Token = tuple[str, bytes]   # a logprob's token: its text and its bytes (which, unlike text, hold part of a character)


@dataclasses.dataclass
class Prepared:
    """A validated request, ready for the engine."""

    kind: str                                  # "completion" | "chat"
    prompts: list[tuple[str | None, list[int]]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    token_bytes: Callable[[int], bytes]         # a token's bytes (Tokenizer.token_bytes), for its logprobs
    priority: int                               # lower runs first
    continuous_usage: bool = False              # usage so far on every chunk
    echo: bool = False
    # echo with max_tokens 0: the prompt alone (with logprobs, scored); the one token the engine
    # samples after it is not part of the answer
    score_only: bool = False
    # with echo: each prompt's first token (id, text, bytes), as the start of the text
    first_tokens: list[tuple[int, str, bytes]] = dataclasses.field(default_factory=list)
    prompt_logprobs: bool = False    # vLLM's prompt_logprobs field: the answer carries them in its form
    renames: dict[str, str] = dataclasses.field(default_factory=dict)   # SamplingParams field -> request field
    tools: ToolPlan | None = None               # chat with tools: outputs are parsed for tool calls
    tokens_as_ids: bool = False                 # vLLM's return_tokens_as_token_ids: logprob tokens "token_id:<id>"
    reply_start: str = ""                       # chat echo: the text a reply begins with (the final message's)


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(req: CompletionRequest | ChatCompletionRequest,
                       renames: dict[str, str]) -> dict[str, Any] | None:
    """The request's output constraint as StructuredOutputsParams fields, from whichever one field
    gives it (`response_format` on chat requests, vLLM's `structured_outputs`, or its older
    `guided_*` fields); `renames` learns which request field a constraint error should name."""
    given: dict[str, dict[str, Any]] = {}
    if req.structured_outputs is not None:
        given["structured_outputs"] = dict(req.structured_outputs)
    for name, form in _GUIDED.items():
        if getattr(req, name) is not None:
            given[name] = {form: getattr(req, name)}
            renames[f"structured_outputs.{form}"] = name
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            given["response_format"] = spec
            renames["structured_outputs.json"] = "response_format.json_schema.schema"
            renames["structured_outputs.json_object"] = "response_format"
    if len(given) > 1:
        first, second = list(given)[:2]
        raise ErrorBody(400, f"{second}: give one output constraint, not both {first} and {second}", param=second)
    return next(iter(given.values()), None)


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's response_format as StructuredOutputsParams fields (None for plain text). `strict` may
    be true or false: the schema is enforced either way (every token is masked by it)."""
    def bad(message: str, param: str = "response_format") -> ErrorBody:
        return ErrorBody(400, f"{param}: {message}", param=param)

    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return {"json_object": True}
    if kind != "json_schema":
        raise bad(f"type must be text, json_object or json_schema, got {json.dumps(kind)[:40]}"
                  if kind not in ("text", "json_object") else f"unexpected fields with type {kind}: "
                  f"{', '.join(sorted(set(value) - {'type'}))}")
    if set(value) != {"type", "json_schema"} or not isinstance(value["json_schema"], dict):
        raise bad("type json_schema needs exactly a json_schema object ({\"name\", \"schema\", \"strict\", "
                  "\"description\"})")
    spec = value["json_schema"]
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise bad(f"unknown field {sorted(unknown)[0]!r}", "response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", spec["name"]):
        raise bad("is required: a name of at most 64 letters, digits, _ or -", "response_format.json_schema.name")
    if spec.get("strict") not in (None, True, False):
        raise bad("must be a bool", "response_format.json_schema.strict")
    schema = spec.get("schema", {})   # (OpenAI: absent means any JSON)
    if not isinstance(schema, dict):
        raise bad("must be a JSON schema object", "response_format.json_schema.schema")
    return {"json": schema}


def sampling_params(req: CompletionRequest | ChatCompletionRequest, defaults: SamplingParams, max_tokens: int | None,
                    logprobs: int | None, renames: dict[str, str],
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """The request's SamplingParams over the model's defaults (`prompt_logprobs`: as the request's
    field unless given)."""
    values: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop, seed=req.seed,
        logit_bias=req.logit_bias, ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens,
        logprobs=logprobs, prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        structured_outputs=structured_outputs(req, renames),
        kv_transfer_params=req.kv_transfer_params)
    values.update({name: getattr(req, name) for name in _DEFAULTED if getattr(req, name) is not None})
    try:
        return dataclasses.replace(defaults, **values)
    except SamplingParamsError as e:
        raise engine_error(e, renames) from None


def engine_error(e: TokenmillError, renames: dict[str, str]) -> ErrorBody:
    """A 400 naming the request field behind a SamplingParams or engine error ("prompt: ..." style
    messages name their field before the colon)."""
    message = str(e)
    if isinstance(e, SamplingParamsError):
        field = e.field
    else:
        head = message.split(":", 1)[0]
        field = head if re.fullmatch(r"[a-z_]+(\[\d+\]|\.[a-z_]+)*", head) else None
    return _field_error(field, message, renames)


def _field_error(field: str | None, message: str, renames: dict[str, str], counted: bool = False) -> ErrorBody:
    """A 400 naming `field` (a SamplingParams field, renamed to the request's field, in `message` too
    when it begins with it), or naming none when `field` is None; `counted` as ErrorBody's."""
    if field is not None:
        root = field.split("[", 1)[0]
        if root in renames:
            new_root = renames[root]
            message = new_root + message[len(root):] if message.startswith(root) else message
            field = new_root + field[len(root):]
    code = "context_length_exceeded" if "max_model_len" in message else None
    return ErrorBody(400, message, param=field, code=code, counted=counted)


def _check_stream_options(req: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(include_usage, continuous usage): as vLLM, the usage on every chunk needs both
    include_usage and continuous_usage_stats."""
    if req.stream_options is None:
        return False, False
    if not req.stream:
        raise ErrorBody(400, "stream_options: only allowed when stream is true", param="stream_options")
    include_usage = bool(req.stream_options.include_usage)
    return include_usage, include_usage and bool(req.stream_options.continuous_usage_stats)


def _check_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.prompt_logprobs is not None and req.stream:
        raise ErrorBody(400, "prompt_logprobs: not available on a stream (the whole response has them; on "
                        "/v1/completions, echo with logprobs streams them)", param="prompt_logprobs")


def check_export(params: SamplingParams, stream: bool, num_prompts: int) -> None:
    """A request exporting its prompt's K/V (prefill/decode disaggregation) gets the name back in
    its one answer: one prompt (n = 1: SamplingParams), not streamed."""
    if params.kv_transfer_params == {"do_remote_decode": True} and (stream or num_prompts > 1):
        raise ErrorBody(400, "kv_transfer_params: do_remote_decode needs one prompt and stream false (the answer "
                        "names the exported K/V)", param="kv_transfer_params")


def prepare_completion(req: CompletionRequest, inputs: InputProcessor) -> Prepared:
    include_usage, continuous_usage = _check_stream_options(req)
    _check_prompt_logprobs(req)
    renames: dict[str, str] = {}
    score_only = req.max_tokens == 0
    if score_only and not req.echo:
        raise ErrorBody(400, "max_tokens: must be >= 1 (0 only with echo: the prompt returned, with logprobs scored, "
                        "and nothing generated)", param="max_tokens")
    if score_only and req.min_tokens:
        raise ErrorBody(400, f"min_tokens: must be 0 with max_tokens 0, got {req.min_tokens}", param="min_tokens")
    # (echo with logprobs: the echoed prompt's tokens get theirs too)
    scored = max(req.logprobs, req.prompt_logprobs or 0) if req.echo and req.logprobs is not None else \
        req.prompt_logprobs
    params = sampling_params(req, inputs.default_sampling_params(), 1 if score_only else req.max_tokens,
                             req.logprobs, renames, prompt_logprobs=scored)
    prompt = req.prompt
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        prompt = [prompt]
    prompts = []
    for i, p in enumerate(prompt):
        try:
            text, ids = inputs.tokenize_prompt(p)
        except TokenmillError as e:
            raise ErrorBody(400, f"prompt[{i}]: {e}", param="prompt") from None
        prompts.append((text if text is not None else inputs.tokenizer.decode(ids), ids))
    check_export(params, req.stream, len(prompts))
    first_tokens = [(ids[0], inputs.tokenizer.decode(ids[:1]), inputs.tokenizer.token_bytes(ids[0], first=True))
                    for _, ids in prompts] if params.prompt_logprobs is not None and req.echo else []
    return Prepared("completion", prompts, params, req.stream, include_usage, inputs.tokenizer.token_bytes,
                    req.priority, continuous_usage, echo=req.echo, score_only=score_only, first_tokens=first_tokens,
                    prompt_logprobs=req.prompt_logprobs is not None, renames=renames,
                    tokens_as_ids=req.return_tokens_as_token_ids)


def chat_error_param(message: str) -> str:
    """The field a chat prompt's error is about: a message's (messages[i]...), continue_final_message,
    or the conversation's (messages)."""
    return message.split(":", 1)[0] if message.startswith(("messages[", "continue_final_message:")) else "messages"


def prepare_chat(req: ChatCompletionRequest, inputs: InputProcessor) -> Prepared:
    include_usage, continuous_usage = _check_stream_options(req)
    _check_prompt_logprobs(req)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise ErrorBody(400, "max_completion_tokens: give max_tokens or max_completion_tokens, not both",
                        param="max_completion_tokens")
    if req.top_logprobs and not req.logprobs:    # (top_logprobs 0 asks for nothing: a no-op)
        raise ErrorBody(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    renames = {"logprobs": "top_logprobs", "prompt": "messages"}
    if req.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, inputs.default_sampling_params(), max_tokens, logprobs, renames)
    try:
        tools = inputs.tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls is not False)
        params = tools.sampling_params(params)
    except TokenmillError as e:
        raise engine_error(e, {}) from None
    if tools.grammar is not None:
        renames["structured_outputs.grammar"] = "tools"
    messages = [m.for_template() for m in req.messages]
    try:
        text, ids = inputs.chat_prompt(messages, add_generation_prompt=req.add_generation_prompt,
                                       chat_template_kwargs=req.chat_template_kwargs, tools=tools,
                                       continue_final_message=req.continue_final_message)
    except TokenmillError as e:
        message = str(e)
        param = chat_error_param(message)
        raise ErrorBody(400, message if param != "messages" else f"messages: {e}", param=param) from None
    check_export(params, req.stream, 1)
    return Prepared("chat", [(text, ids)], params, req.stream, include_usage, inputs.tokenizer.token_bytes,
                    req.priority, continuous_usage, renames=renames,
                    tools=tools if req.tools is not None and tools.parses_output else None,
                    prompt_logprobs=req.prompt_logprobs is not None, tokens_as_ids=req.return_tokens_as_token_ids,
                    reply_start=(messages[-1]["content"] or "") if req.echo and messages[-1]["role"] == "assistant"
                    else "")


async def compile_constraint(prepared: Prepared, inputs: InputProcessor) -> None:
    """Compile the request's output constraint (or find it in the cache) before anything runs, so
    that an invalid one is a 400 naming its field, and one that takes too long to compile is
    refused instead of holding up the engine."""
    spec = prepared.params.structured_outputs
    if spec is None:
        return
    try:
        await asyncio.wait_for(asyncio.to_thread(inputs.grammars.compile, spec), GRAMMAR_COMPILE_TIMEOUT_S)
    except asyncio.TimeoutError:   # (TimeoutError itself from Python 3.11)
        raise engine_error(SamplingParamsError(spec.field, f"took more than {GRAMMAR_COMPILE_TIMEOUT_S:g} s to "
                                               "compile; simplify it"), prepared.renames) from None
    except SamplingParamsError as e:
        culprit = None
        if prepared.tools is not None and prepared.tools.grammar is not None:   # (then it is the tools' grammar)
            deadline = time.monotonic() + GRAMMAR_COMPILE_TIMEOUT_S
            culprit = await asyncio.to_thread(_failing_tool, prepared.tools, inputs, deadline)
        raise (culprit or engine_error(e, prepared.renames)) from None


def _failing_tool(tools: ToolPlan, inputs: InputProcessor, deadline: float) -> ErrorBody | None:
    """A 400 naming the first tool in the grammar whose arguments schema does not compile by itself,
    if one does not (each checked without caching it, until `deadline`)."""
    for tool in tools.parser.called_tools(tools.choice):
        if time.monotonic() > deadline:
            return None
        try:
            inputs.grammars.compile(StructuredOutputsParams(json=arguments_schema(tool)), cache=False)
        except SamplingParamsError as e:
            name = f"tools[{tools.parser.tools.index(tool)}].function.parameters"
            return _field_error(e.field, str(e), {e.field: name})
    return None


# ---- running -----------------------------------------------------------------------------------

async def _submit(engine: AsyncEngine, request_id: str, prepared: Prepared) -> list[RequestStream]:
    num_prompts, n = len(prepared.prompts), prepared.params.n
    streams: list[RequestStream] = []
    try:
        if n <= engine.capacity:   # (n alone past it: add_request names n)
            engine.check_capacity("prompt", f"{num_prompts} prompts x n={n} ({num_prompts * n} sequences)",
                                  num_prompts * n)
        for i, (text, ids) in enumerate(prepared.prompts):
            streams.append(await engine.add_request(f"{request_id}-{i}", text, ids, prepared.params,
                                                    prepared.priority))
    except BaseException as e:
        for s in streams:
            engine.abort(s.request_id)
        if isinstance(e, QueueFullError):
            raise ErrorBody(429, str(e), type_="rate_limit_error", code="queue_full",
                            headers={"Retry-After": str(_RETRY_AFTER_S)}) from None
        if isinstance(e, EngineStoppedError):
            raise ErrorBody(503, str(e), type_="server_error", code="unavailable") from None
        if isinstance(e, TokenmillError):
            raise engine_error(e, prepared.renames) from None
        raise
    return streams


async def _merged(engine: AsyncEngine, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, latest output) as any of the streams changes, until all finished. Leaving
    early (the client went away) aborts the requests still running."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out, None))
        except Exception as e:
            await queue.put((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, error = await queue.get()
            if error is not None:
                raise error
            yield i, out
            remaining -= out.finished
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            if not s.finished:
                engine.abort(s.request_id)


class _Formatter:
    """Builds one request's JSON: chunks while streaming (tracking what each choice has been sent)
    and the full response."""

    def __init__(self, prepared: Prepared, request_id: str, model: str):
        self.p = prepared
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.chat = prepared.kind == "chat"
        self.object = "chat.completion" if self.chat else "text_completion"
        n = prepared.params.n
        self._sent_text = [0] * (len(prepared.prompts) * n)
        self._sent_tokens = [0] * len(self._sent_text)
        # (with echo, logprobs begin with the prompt's tokens: offsets count from the prompt's start either way)
        self._text_offset = [0] * len(self._sent_text)
        # the characters each choice's token bytes complete (a token can hold part of one)
        self._characters = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in self._sent_text]
        self._finished = [False] * len(self._sent_text)
        self._echoed = [False] * len(self._sent_text)
        # per choice, while streaming with tools: the incremental tool-call parser of its text
        self._tool_streams = [prepared.tools.parser.stream() for _ in self._sent_text] if prepared.tools else []

    def index(self, prompt_index: int, output: CompletionOutput) -> int:
        return prompt_index * self.p.params.n + output.index

    def prompt_index(self, choice: int) -> int:
        return choice // self.p.params.n

    def _shown(self, output: CompletionOutput) -> CompletionOutput:
        """The output as the answer shows it: with score_only, no tokens (the prompt alone)."""
        if not self.p.score_only:
            return output
        return dataclasses.replace(output, text="", token_ids=[], cumulative_logprob=None,
                                   logprobs=None if output.logprobs is None else [],
                                   finish_reason="length" if output.finish_reason in ("stop", "length") else
                                   output.finish_reason, stop_reason=None)

    def _echoed_prompt(self, out: RequestOutput) -> RequestOutput | None:
        """`out`, whose prompt's logprobs the choice's logprobs begin with: with echo only (vLLM's
        prompt_logprobs field alone puts them elsewhere)."""
        return out if self.p.echo and out.prompt_logprobs is not None else None

    # ---- logprobs ----

    def _logprobs(self, output: CompletionOutput, start: int, end: int, choice: int,
                  prompt: RequestOutput | None = None) -> Any:
        """The logprobs of output tokens start .. end - 1 of a choice, in the API's form; with
        `prompt` (echo), those of its prompt's tokens before them (the first token's are null)."""
        if output.logprobs is None:
            return None
        k = self.p.params.logprobs or 0
        entries: list[tuple[_Token, float | None, list[tuple[_Token, float]] | None]] = []
        if prompt is not None:
            entries.append((self._token(*self.p.first_tokens[self.prompt_index(choice)]), None, None))
            entries += [self._entry(token_id, entry, k)
                        for token_id, entry in zip(prompt.prompt_token_ids[1:], prompt.prompt_logprobs[1:],
                                                   strict=True)]
        entries += [self._entry(token_id, entry, k)
                    for token_id, entry in zip(output.token_ids[start:end], output.logprobs[start:end], strict=True)]
        if self.chat:
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(raw),
                                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for (t, b), v in top]}
                                for (tok, raw), lp, top in entries]}
        offsets = []
        for (_, raw), _, _ in entries:
            offsets.append(self._text_offset[choice])
            self._text_offset[choice] += len(self._characters[choice].decode(raw))
        return {"tokens": [tok for (tok, _), _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [None if top is None else {**{t: v for (t, _), v in top}, tok: lp}
                                 for (tok, _), lp, top in entries],
                "text_offset": offsets}

    def _entry(self, token_id: int, entry: dict[int, Logprob],
               k: int) -> tuple[_Token, float, list[tuple[_Token, float]]]:
        """(a token, its logprob, its position's k most likely tokens with theirs)."""
        ranked = sorted(((tid, lp) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                        key=lambda item: item[1].rank)
        return (self._token(token_id, entry[token_id].decoded_token or "", self.p.token_bytes(token_id)),
                _finite(entry[token_id].logprob),
                [(self._token(tid, lp.decoded_token or "", self.p.token_bytes(tid)), _finite(lp.logprob))
                 for tid, lp in ranked])

    def _token(self, token_id: int, text: str, raw: bytes) -> _Token:
        """A logprob's token as the answer names it (_token_name; return_tokens_as_token_ids: by its id)."""
        return f"token_id:{token_id}" if self.p.tokens_as_ids else _token_name(text, raw), raw

    # ---- streaming ----

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.id, "object": self.object + ".chunk" if self.chat else self.object,
                 "created": self.created, "model": self.model, "system_fingerprint": None, "choices": choices}
        if self.p.continuous_usage:
            # As vLLM: the tokens sent so far (all choices together, as the final usage counts them).
            prompt, completion = sum(len(ids) for _, ids in self.p.prompts), sum(self._sent_tokens)
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
        elif self.p.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunks(self) -> list[dict[str, Any]]:
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": self.p.reply_start},
                              "logprobs": None, "finish_reason": None}]) for i in range(len(self._sent_text))]

    def chunks(self, prompt_index: int, out: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        for o in map(self._shown, out.outputs):
            i = self.index(prompt_index, o)
            if self._finished[i]:
                continue
            text = o.text[self._sent_text[i]:]
            first = self.p.echo and not self._echoed[i]   # (a choice's first chunk may hold no token yet)
            if first and self.p.params.prompt_logprobs is not None and out.prompt_logprobs is None:
                continue   # (sample 0 scores the prompt: its echo waits for them)
            if first:
                text = self.p.prompts[prompt_index][0] + text
                self._echoed[i] = True
            logprobs = self._logprobs(o, self._sent_tokens[i], len(o.token_ids), i,
                                      self._echoed_prompt(out) if first else None)
            self._sent_text[i] = len(o.text)
            self._sent_tokens[i] = len(o.token_ids)
            self._finished[i] = o.finished
            if self.chat:
                stream = self._tool_streams[i] if self.p.tools is not None else None
                deltas = stream.feed(text, final=o.finished) if stream is not None else [{"content": text}] if text \
                    else []
                if not deltas and logprobs is not None and logprobs["content"]:
                    deltas = [{"content": ""}]
                for delta in deltas:
                    chunks.append(self._chunk([{"index": i, "delta": delta, "logprobs": logprobs,
                                                "finish_reason": None}]))
                    logprobs = None
                if o.finished:
                    called = stream is not None and bool(stream.tool_calls)
                    chunks.append(self._chunk([{"index": i, "delta": {}, "logprobs": None,
                                                "finish_reason": _finish_reason(o.finish_reason, called)}]))
            elif text or o.finished or logprobs is not None and logprobs["tokens"]:
                chunks.append(self._chunk([{"index": i, "text": text, "logprobs": logprobs,
                                            "finish_reason": o.finish_reason}]))
        return chunks

    def usage_chunk(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = self.usage(finals)
        return chunk

    # ---- whole response ----

    def usage(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        prompt = sum(len(ids) for _, ids in self.p.prompts)
        completion = sum(len(self._shown(o).token_ids) for out in finals.values() for o in out.outputs)
        cached = sum(out.num_cached_tokens for out in finals.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def response(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        choices = []
        for prompt_index in sorted(finals):
            out = finals[prompt_index]
            for o in map(self._shown, out.outputs):
                i = self.index(prompt_index, o)
                logprobs = self._logprobs(o, 0, len(o.token_ids), i, self._echoed_prompt(out))
                if self.chat:
                    message: dict[str, Any] = {"role": "assistant", "content": o.text, "refusal": None}
                    calls = []
                    if self.p.tools is not None:
                        parsed = self.p.tools.parser.parse(o.text)
                        message["content"], calls = parsed.content, parsed.tool_calls
                        if calls:
                            message["tool_calls"] = [call.to_openai() for call in calls]
                    if self.p.reply_start:
                        message["content"] = self.p.reply_start + (message["content"] or "")
                    choices.append({"index": i, "message": message, "logprobs": logprobs,
                                    "finish_reason": _finish_reason(o.finish_reason, bool(calls))})
                else:
                    text = (self.p.prompts[prompt_index][0] if self.p.echo else "") + o.text
                    choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": o.finish_reason,
                                    **({"prompt_logprobs": _vllm_prompt_logprobs(out)} if self.p.prompt_logprobs
                                       else {})})
        choices.sort(key=lambda c: c["index"])
        response = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                    "system_fingerprint": None, "choices": choices, "usage": self.usage(finals)}
        if self.chat and self.p.prompt_logprobs:   # (vLLM's place for them: one prompt)
            response["prompt_logprobs"] = _vllm_prompt_logprobs(finals[0])
        exported = [out.kv_transfer_params for out in finals.values() if out.kv_transfer_params is not None]
        if len(finals) == 1 and exported:   # (vLLM's field: where a decode engine finds the prompt's K/V)
            response["kv_transfer_params"] = exported[0]
        return response


def _vllm_prompt_logprobs(out: RequestOutput) -> list[dict[int, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: per prompt token (None for the first) its logprob and the top k at
    its position, by token id."""
    return [None if entry is None else {t: {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                            "decoded_token": lp.decoded_token} for t, lp in entry.items()}
            for entry in out.prompt_logprobs]


def _finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that ended by itself after calling tools."""
    return "tool_calls" if called_tools and reason == "stop" else reason


def _token_name(text: str, raw: bytes) -> str:
    """A logprob's token as the answer names it: its text, or for part of a character its escaped
    bytes ("bytes:\\xf0\\x9f"), so that no two tokens of a top_logprobs dict share a name (as U+FFFD,
    vLLM's name for them, they would)."""
    try:
        raw.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


def _finite(x: float) -> float:
    """JSON has no infinities: a -inf log-probability becomes -9999 (as OpenAI's API does)."""
    return x if math.isfinite(x) else -9999.0


# Characters that JSON keeps raw in a string but Python's str.splitlines (and so httpx's
# iter_lines, a common way to read a stream) ends a line at; SSE itself ends lines only at CR and LF.
_LINE_BREAKS_IN_JSON = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS_IN_JSON)}\n\n"


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> asyncio.Future[T] | None:
    """Run `work` (after the request's body was read) until it is done, its future returned (its
    result or its exception); None if the client went away first: `work` is then cancelled (and
    awaited), which for an engine request aborts it and for a relayed one closes the upstream
    connection (the replica then aborts it)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():   # the client went away (or this handler was cancelled)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task


async def run(engine: AsyncEngine, prepared: Prepared, model: str, request: Request) -> Response:
    """Submit the prepared request and answer it, streaming or not. The client going away aborts it."""
    request_id = f"{'chatcmpl' if prepared.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    fmt = _Formatter(prepared, request_id, model)
    streams = await _submit(engine, request_id, prepared)

    if prepared.stream:
        async def events() -> AsyncIterator[str]:
            finals: dict[int, RequestOutput] = {}
            merged = _merged(engine, streams)
            try:
                for chunk in fmt.first_chunks():
                    yield _sse(chunk)
                async for i, out in merged:
                    finals[i] = out
                    for chunk in fmt.chunks(i, out):
                        yield _sse(chunk)
                if prepared.include_usage:
                    yield _sse(fmt.usage_chunk(finals))
            except (EngineStoppedError, RequestFailedError) as e:
                yield _sse(_failure(e, prepared).body())
            except Exception as e:   # a bug while formatting: still end the stream properly
                logger.exception("request %s failed while streaming", request_id)
                yield _sse(ErrorBody(500, f"internal error: {type(e).__name__}", type_="server_error").body())
            finally:
                await merged.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect() -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        merged = _merged(engine, streams)
        try:
            async for i, out in merged:
                finals[i] = out
        finally:
            await merged.aclose()
        return finals

    work = await unless_disconnected(request, collect())
    if work is None:   # (the request was aborted)
        return Response(status_code=499)
    try:
        finals = work.result()
    except (EngineStoppedError, RequestFailedError) as e:
        raise _failure(e, prepared) from None
    return JSONResponse(fmt.response(finals))


def _failure(e: EngineStoppedError | RequestFailedError, prepared: Prepared) -> ErrorBody:
    """A request that failed once running: a 400 naming the field when its own input made it fail
    (a constraint past the grammar engine's limits), else a 500."""
    if isinstance(e, RequestFailedError) and e.param is not None:
        return _field_error(e.param, e.error, prepared.renames, counted=True)
    return ErrorBody(500, str(e), type_="server_error", counted=True)
