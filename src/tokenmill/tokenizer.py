"""Text <-> token ids: the tokenizer, the streaming detokenizer and chat templates.

`load_tokenizer(path)` reads either a GGUF file (its tokenizer rebuilt to match llama.cpp, see
`tokenizer_gguf`) or a Hugging Face folder (`tokenizer.json` plus the config files beside it).
Both become one `Tokenizer` over an HF `tokenizers.Tokenizer`, so encoding, decoding and special
tokens behave the same whatever the checkpoint format.

`IncrementalDetokenizer` turns the ids a request generates into text deltas for streaming; chat
templates render in a sandboxed Jinja environment configured like transformers'.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, get_args

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox
import tokenizers
from tokenizers import processors

from tokenmill.checkpoint.gguf import GGUFCheckpoint
from tokenmill.errors import CheckpointError, TokenmillError
from tokenmill.tokenizer_gguf import TokenizerParts, gguf_tokenizer_parts

_SURROGATE = re.compile("[\ud800-\udfff]")
_BYTE_PIECE = re.compile("<0x([0-9A-Fa-f]{2})>")   # a SentencePiece byte-fallback token


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte in such a vocabulary
    (printable Latin-1 bytes stand for themselves, the others for 256 + their rank among them)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTE_LEVEL = _byte_level_alphabet()


class Tokenizer:
    """Encode, decode and chat-format text for one model.

    `eos_token_ids` is every id that ends generation: for GGUF files llama.cpp's end-of-generation
    set (EOS, EOT, EOM and known end-of-turn tokens such as "<|im_end|>"); for HF folders the
    tokenizer's EOS plus `generation_config.json`'s `eos_token_id`s.
    """

    def __init__(self, parts: TokenizerParts, source: str):
        self._backend = parts.backend
        self.source = source  # the file or folder it was read from, for messages
        self.vocab_size: int = parts.backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = parts.bos_token_id
        self.eos_token_id: int | None = parts.eos_token_id
        self.eos_token_ids: frozenset[int] = parts.eos_token_ids
        self.pad_token_id: int | None = parts.pad_token_id
        self.chat_template: str | None = parts.chat_template
        added = parts.backend.get_added_tokens_decoder()
        self._special_ids = frozenset(tid for tid, token in added.items() if token.special)
        self._added_ids = frozenset(added)   # (their vocabulary entries are text, not a model's pieces)
        self._compiled: tuple[str, jinja2.Template] | None = None  # (source text, compiled)
        self._token_bytes: dict[int, bytes] = {}   # token_bytes' answers so far
        self._decoders: set[str] | None = None      # the decoder's step types, once token_bytes needs them
        self._template_origin = f"the chat template of {source}"  # where chat_template came from, for messages

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token text in it ("<|im_start|>") becomes that token;
        `add_special_tokens` adds the BOS/EOS the model declares. Text that is not valid Unicode
        (a lone surrogate such as "\\ud800", which JSON can carry) is a TokenmillError."""
        try:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            if isinstance(text, str) and _SURROGATE.search(text):
                raise TokenmillError("the text contains a lone surrogate (U+D800-U+DFFF), which is not valid "
                                     "Unicode") from None
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; bytes that do not form UTF-8 become U+FFFD. Ids beyond the vocabulary
        (a model's padded embedding rows) decode to nothing."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of `token_id`, as stored (e.g. "Ġthe" in a byte-level vocabulary)."""
        token = self._backend.id_to_token(token_id)
        if token is None:
            raise TokenmillError(f"token id {token_id} is outside the vocabulary of {self.source} ({self.vocab_size})")
        return token

    def token_bytes(self, token_id: int, first: bool = False) -> bytes:
        """The bytes `token_id` adds to a text that goes on before it (llama.cpp's token_to_piece;
        a logprob's `bytes` in OpenAI's API): decode([token_id]) gives U+FFFD for a token that is part
        of a UTF-8 character, and drops the space of a SentencePiece token ("▁the" -> "the")
        since it decodes as the start of a text. `first`: as the start of a text (that space dropped)."""
        piece = self._token_bytes.get(token_id)
        if piece is None:
            piece = self._token_bytes[token_id] = self._piece_bytes(token_id)
        if first:   # decode's text where it is whole characters (the piece ends with it, less what a decoder drops)
            alone = self.decode([token_id])
            if "\ufffd" not in alone and piece.endswith(alone.encode()):
                return alone.encode()
        return piece

    def token_text(self, token_id: int) -> str:
        """token_bytes as text (U+FFFD for the bytes of a character split over tokens): a logprob's token."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self._backend.id_to_token(token_id)
        if piece is None or token_id in self._added_ids:   # (beyond the vocabulary: nothing, as decode)
            return self.decode([token_id]).encode()
        if "ByteLevel" in self._decoder_steps() and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        if "ByteFallback" in self._decoder_steps() and (byte := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(byte[1], 16)])
        # Any other token: what it adds after another token (decoders strip or join at a text's start).
        context = self.encode("a", add_special_tokens=False)
        before, after = self.decode(context), self.decode([*context, token_id])
        return (after[len(before):] if context and after.startswith(before) else self.decode([token_id])).encode()

    def _decoder_steps(self) -> set[str]:
        """The types of the decoder's steps (read once)."""
        if self._decoders is None:
            decoder = json.loads(self.backend_json()).get("decoder")
            self._decoders = _step_types(decoder) if decoder is not None else set()
        return self._decoders

    def vocabulary_difference(self, other: Tokenizer) -> str | None:
        """None when `other` maps the same tokens to the same ids (speculative decoding's draft must:
        its token ids are the target's), else the first difference, for a message."""
        mine, theirs = self._backend.get_vocab(with_added_tokens=True), other._backend.get_vocab(with_added_tokens=True)
        if mine == theirs:
            return None
        for token, token_id in sorted(mine.items(), key=lambda item: item[1]):
            if theirs.get(token) != token_id:
                return f"token {token!r} is id {token_id} in {self.source} but {theirs.get(token)} in {other.source}"
        return f"{other.source} has {len(theirs) - len(mine)} more tokens than {self.source}"

    def backend_json(self) -> str:
        """The tokenizer as Hugging Face `tokenizers` JSON: what grammar engines (llguidance) read."""
        return self._backend.to_str()

    def is_special(self, token_id: int) -> bool:
        """Whether `decode(..., skip_special_tokens=True)` leaves this token out (control tokens)."""
        return token_id in self._special_ids

    def set_chat_template(self, template: str, origin: str) -> None:
        """Use `template` instead of the model's; compiled and tried now on a user message (and, if
        that fails, on a system message before it, which some templates require), so a syntax
        error or a template that cannot render (an empty file, a raise_exception it always
        reaches) names `origin` ("the chat_template setting") at load, not as every chat
        request's error."""
        compiled = compile_chat_template(template, origin)
        previous = self._compiled, self.chat_template, self._template_origin
        self._compiled, self.chat_template, self._template_origin = (template, compiled), template, origin
        user = {"role": "user", "content": "Hello"}
        try:
            try:
                text = self.apply_chat_template([user])
            except TokenmillError:
                text = self.apply_chat_template([{"role": "system", "content": "Be brief."}, user])
            if not text.strip():
                raise TokenmillError(f"{origin} renders a conversation as no text")
        except TokenmillError as e:
            self._compiled, self.chat_template, self._template_origin = previous
            raise TokenmillError(f"{e} (tried at load on a short conversation)") from e

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template (the prompt text, or its ids when
        `tokenize`; the template writes any BOS itself, so none is added)."""
        if self.chat_template is None:
            raise TokenmillError(
                f"{self.source} has no chat template (tokenizer.chat_template in a GGUF file, "
                "chat_template in tokenizer_config.json or chat_template.jinja in a folder)"
            )
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, compile_chat_template(self.chat_template, self._template_origin))
        special = {
            name: self._backend.id_to_token(tid)
            for name, tid in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id))
            if tid is not None
        }
        text = render_chat_template(
            self._compiled[1], self._template_origin,
            **special, **template_kwargs, messages=messages, add_generation_prompt=add_generation_prompt,
        )  # fmt: skip
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _step_types(decoder: dict[str, Any]) -> set[str]:
    """The types of a decoder's steps, from its JSON (a Sequence's, recursively)."""
    return {decoder["type"]}.union(*(_step_types(step) for step in decoder.get("decoders", ())))


def load_tokenizer(path: str | os.PathLike | GGUFCheckpoint) -> Tokenizer:
    """The tokenizer of a `.gguf` file (vocab-only files included) or a Hugging Face folder.

    An already opened GGUFCheckpoint is accepted too, so that a model's file is parsed once."""
    if isinstance(path, GGUFCheckpoint):
        return Tokenizer(gguf_tokenizer_parts(path.metadata, path.path), str(path.path))
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"tokenizer path does not exist: {p}")
    if p.is_dir():
        return Tokenizer(_hf_folder_parts(p), str(p))
    return Tokenizer(gguf_tokenizer_parts(GGUFCheckpoint(p).metadata, p), str(p))


# ---------------------------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------------------------


def _hf_folder_parts(folder: Path) -> TokenizerParts:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise CheckpointError(
            f"{folder} has no tokenizer.json (tokenmill reads the `tokenizers` file, not tokenizer.model "
            "or vocab files; save the tokenizer with transformers to create it)"
        )
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise CheckpointError(f"{tokenizer_file} is not a readable tokenizer.json ({e})") from e
    config = _read_json(folder / "tokenizer_config.json")

    def token_id(field: str) -> int | None:
        value = config.get(field)
        text = value.get("content") if isinstance(value, dict) else value
        if text is None:
            return None
        tid = backend.token_to_id(text)
        if tid is None:
            raise CheckpointError(f"{folder / 'tokenizer_config.json'}: {field} {text!r} is not in the vocabulary")
        return tid

    bos, eos, pad = token_id("bos_token"), token_id("eos_token"), token_id("pad_token")
    if "add_bos_token" in config or "add_eos_token" in config:
        # Explicit flags replace tokenizer.json's post-processor, as transformers'
        # TokenizersBackend.update_post_processor (and v4's Llama and Gemma tokenizers) do.
        first = [bos] if config.get("add_bos_token") and bos is not None else []
        last = [eos] if config.get("add_eos_token") and eos is not None else []
        names = [f"<tokenmill_{i}>" for i in range(len(first) + len(last))]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([*names[: len(first)], "$A", *names[len(first) :]]),
            special_tokens=list(zip(names, [*first, *last], strict=True)),  # type: ignore[arg-type]
        )
    generation = _read_json(folder / "generation_config.json").get("eos_token_id")
    extra_eos = [int(t) for t in (generation if isinstance(generation, list) else [generation]) if t is not None]
    if eos is None and extra_eos:
        eos = extra_eos[0]
    eos_ids = {*extra_eos, *([] if eos is None else [eos])}
    return TokenizerParts(
        backend=backend,
        bos_token_id=bos,
        eos_token_id=eos,
        eos_token_ids=frozenset(eos_ids),
        pad_token_id=pad,
        chat_template=_hf_chat_template(folder, config),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} should hold a JSON object, not {type(data).__name__}")
    return data


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """As transformers: chat_template.jinja, else chat_template.json, else tokenizer_config.json.
    A list of named templates gives its "default" one."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): renders
    the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    # transformers' version: unlike Jinja's own, it does not HTML-escape
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _ChatSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox already refuses unsafe attributes and range() over 100k items; this also bounds
    the two operators that make one huge value out of small ones (`10 ** 10 ** 9` would run for
    hours, `"x" * 10 ** 10` would take 10 GB), so no template can stall or exhaust the server."""

    intercepted_binops = frozenset(["**", "*"])
    MAX_POWER_BITS = 4096
    MAX_REPEATED_ITEMS = 1 << 20

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and all(isinstance(x, int) for x in (left, right)) and abs(left) > 1 and \
                right * math.log2(abs(left)) > self.MAX_POWER_BITS:
            raise jinja2.sandbox.SecurityError(f"{left} ** {right} has more than {self.MAX_POWER_BITS} bits")
        if operator == "*":
            for items, count in ((left, right), (right, left)):
                if isinstance(items, (str, list, tuple)) and isinstance(count, int) and \
                        len(items) * count > self.MAX_REPEATED_ITEMS:
                    raise jinja2.sandbox.SecurityError(f"repeating {len(items)} items {count} times is too long")
        return super().call_binop(context, operator, left, right)


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = _ChatSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """A conversation checked and normalized for a chat template, the same for the Python API and
    the server: each message a dict with a role in CHAT_ROLES and a content that is a string or a
    list of {"type": "text", "text": ...} parts (joined into one string), or None in an assistant
    message that has `tool_calls` (then ""). "developer" (OpenAI's
    newer name for the system role) becomes "system", the name templates know. Other keys pass
    through to the template."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TokenmillError("messages: expected a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TokenmillError(f"messages[{i}]: expected a dict with 'role' and 'content', got "
                                 f"{type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise TokenmillError(f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, got {role!r:.40}")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                             isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if content is None and role == "assistant" and message.get("tool_calls"):
            content = ""   # (an assistant turn that only calls tools)
        if not isinstance(content, str):
            raise TokenmillError(f"messages[{i}].content: must be a string or a list of text parts, got "
                                 f"{type(content).__name__}")
        out.append({**message, "role": "system" if role == "developer" else role, "content": content})
    return out


_END_MARK = "\u2063<end of the final message>\u2063"   # (U+2063: no template writes it)


def end_at_final_message(render: Callable[[list[dict[str, Any]]], str], conversation: list[dict[str, Any]]) -> str:
    """The conversation as `render` writes it, up to where its final message's text ends: what the
    template writes after it (the end of the turn) left out, so that a model goes on with that
    message. Found by rendering the conversation again with a mark after that text (the text itself
    can also occur in the template's markup: a prefill "<" in "<|im_end|>"). A template that trims
    the message gives the trimmed end (as transformers' continue_final_message); one that loses the
    mark or repeats it is read as transformers reads every template, at the text's last occurrence."""
    content = conversation[-1]["content"]
    if not content.strip():
        raise TokenmillError("continue_final_message: the final message is empty: nothing to continue (a new turn "
                             "is add_generation_prompt's)")
    whole = render(conversation)
    marked = render([*conversation[:-1], {**conversation[-1], "content": content + _END_MARK}])
    if marked.count(_END_MARK) == 1:
        cut = marked[:marked.index(_END_MARK)]
        return cut.rstrip() if not whole.startswith(cut) and whole.startswith(cut.rstrip()) else cut
    trimmed = content.strip()
    at = whole.rfind(trimmed)
    if at < 0:
        raise TokenmillError("continue_final_message: the chat template does not write the final message's text as "
                             "it is, so there is no end of it to continue from")
    end = at + len(trimmed)
    tail = content[len(content.rstrip()):]   # (the message's trailing whitespace, where the template kept it)
    return whole[:end + len(tail) if whole.startswith(tail, end) else end]


def read_chat_template(template: str) -> str:
    """A chat template given on the command line or to LLM(chat_template=...): the path of a file
    holding one, or the template itself (vLLM's --chat-template takes both)."""
    path = Path(template).expanduser()
    if "{" not in template and path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenmillError(f"chat_template: cannot read {path}: {e}") from e
    if "{" not in template:
        raise TokenmillError(f"chat_template: {template!r} is neither a file nor a Jinja template")
    return template


# Template variables tokenmill sets itself, plus apply_chat_template's own `tokenize` argument (as
# vLLM refuses it): extra template variables may not replace them, or a caller could render another
# conversation than the one checked, or get ids where text is expected.
RESERVED_TEMPLATE_VARIABLES: tuple[str, ...] = ("messages", "add_generation_prompt", "bos_token", "eos_token",
                                                "tokenize", "tools")


def check_chat_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """Extra chat-template variables (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    `{"enable_thinking": False}`) checked: None or a dict with string keys, none of them in
    RESERVED_TEMPLATE_VARIABLES. Variables a template does not use change nothing."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TokenmillError(f"chat_template_kwargs: expected a dict with string keys, got {kwargs!r:.80}")
    reserved = [k for k in kwargs if k in RESERVED_TEMPLATE_VARIABLES]
    if reserved:
        raise TokenmillError(f"chat_template_kwargs: {reserved[0]!r} is set by tokenmill and cannot be overridden "
                             f"(reserved: {', '.join(RESERVED_TEMPLATE_VARIABLES)})")
    return dict(kwargs)


def compile_chat_template(template: str, origin: str) -> jinja2.Template:
    """Compile a chat template in the sandbox; a syntax error names its `origin` ("the chat template
    of model.gguf")."""
    try:
        return _chat_environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenmillError(f"{origin} is not valid Jinja (line {e.lineno}: {e.message})") from e


def render_chat_template(template: jinja2.Template, origin: str, **variables: Any) -> str:
    """Render a compiled chat template. Whatever goes wrong (a `raise_exception` in the template,
    a missing field, an unsafe attribute the sandbox refuses) is a TokenmillError naming it."""
    try:
        return template.render(**variables)
    except jinja2.sandbox.SecurityError as e:
        raise TokenmillError(f"{origin} tried an unsafe operation: {e}") from e
    except jinja2.TemplateError as e:
        raise TokenmillError(f"{origin} failed: {e}") from e
    except Exception as e:  # e.g. non-string message content, a recursive macro, an int too long for str()
        raise TokenmillError(f"{origin} failed on these messages: {type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns generated ids into text deltas, one step at a time.

    Invariant: the deltas of every `step` plus `flush` concatenate to
    `tokenizer.decode(output_ids, skip_special_tokens)` when there is no prompt; with `prompt_ids`
    they are the text the output adds after the prompt, i.e. `decode(prompt + output)` minus
    `decode(prompt)` (so a SentencePiece "▁Hello" right after the prompt gives " Hello").

    How: keep a short window of ids, of which the first `read_offset` were emitted last time (the
    context: decoding them alone gives `prefix_text`); decode the whole window and emit what it adds
    beyond `prefix_text`. A window whose text ends in U+FFFD ends inside a UTF-8 sequence (a character
    split over byte tokens), so it is held back until more ids complete it.

        window:  | emitted last step (context) | new ids ... |
                 0                         read_offset
    """

    _PROMPT_CONTEXT = 6  # prompt ids decoded with the first step, so the output is not "first"

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window = list(prompt_ids[-self._PROMPT_CONTEXT :]) if prompt_ids else []
        self._read_offset = len(self._window)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """The text `new_token_ids` add; "" while they end inside an incomplete character."""
        self._window.extend(new_token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever was held back (U+FFFD for bytes never completed)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._window):
            return ""
        prefix_text = self.tokenizer.decode(self._window[: self._read_offset], self.skip_special_tokens)
        text = self.tokenizer.decode(self._window, self.skip_special_tokens)
        # A decoder that rewrites across tokens (WordPiece's clean-up) can change the context's text:
        # wait for the end then, and emit from where the two texts part.
        if not final and (text.endswith("\ufffd") or not text.startswith(prefix_text)):
            return ""
        delta = text[len(os.path.commonprefix([prefix_text, text])) :]
        if delta:
            # The ids just emitted become the context. (Not ids that rendered nothing, e.g. skipped
            # special tokens: the context must hold text, or SentencePiece's strip of the first space
            # would land on a different token in `text` than in `prefix_text`.)
            del self._window[: self._read_offset]
            self._read_offset = len(self._window)
        return delta
