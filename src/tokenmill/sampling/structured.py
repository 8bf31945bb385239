"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's names).

Exactly one form per request:

    json         a JSON schema (a dict, or its JSON text): the output is one JSON value valid against it
    json_object  True: the output is one JSON object (OpenAI's response_format {"type": "json_object"})
    regex        the output matches the regular expression (Rust `regex` syntax, anchored at both ends)
    choice       the output is exactly one of these strings
    grammar      a context-free grammar: Lark syntax, or llama.cpp's GBNF (recognized by its `::=` rules)

Only the shape is checked here; whether a schema, regex or grammar compiles is checked by the
engine's grammar compiler (engine/grammar.py) before the request runs, with an error naming the
field. The constraint is applied by masking the logits of every token that cannot continue a valid
output, so it holds whatever the sampling settings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import SamplingParamsError

MAX_SPEC_CHARS = 200_000
"""Longest schema / regex / grammar text (and all choices together) a request may send: grammar
compilation grows with it, and the cache keeps it."""

MAX_CHOICES = 1024

FORMS = ("json", "json_object", "regex", "choice", "grammar")


def _field(name: str) -> str:
    return f"structured_outputs.{name}"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match; exactly one field set. See the module docstring."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    """JSON forms only: no whitespace between tokens of the JSON text (compact output). By default
    whitespace is allowed, at most 20 characters between two tokens, so that a model that starts
    pretty-printing can, but cannot fill its output with newlines."""

    def __post_init__(self) -> None:
        given = [name for name in FORMS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs", f"must set exactly one of {', '.join(FORMS)}, got "
                                      f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise SamplingParamsError(_field("json"), f"is not valid JSON: {e}") from None
                except RecursionError:
                    raise SamplingParamsError(_field("json"), "is nested too deeply") from None
                object.__setattr__(self, "json", schema)
            if not isinstance(self.json, (dict, bool)):
                raise SamplingParamsError(_field("json"), f"must be a JSON schema (an object), got "
                                          f"{type(self.json).__name__}")
        if self.json_object not in (None, True, False):
            raise SamplingParamsError(_field("json_object"), f"must be a bool, got {self.json_object!r:.40}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(_field(name), "must be a non-empty string")
        if self.choice is not None:
            choices = self.choice
            if (not isinstance(choices, (list, tuple)) or not choices or
                    not all(isinstance(c, str) and c for c in choices)):
                raise SamplingParamsError(_field("choice"), "must be a non-empty list of non-empty strings")
            if len(choices) > MAX_CHOICES:
                raise SamplingParamsError(_field("choice"), f"must have at most {MAX_CHOICES} strings, "
                                          f"got {len(choices)}")
            object.__setattr__(self, "choice", list(choices))
        if not isinstance(self.disable_any_whitespace, bool):
            raise SamplingParamsError(_field("disable_any_whitespace"), "must be a bool")
        try:
            key = self.key()
        except RecursionError:
            raise SamplingParamsError(self.field, "is nested too deeply") from None
        except (TypeError, ValueError) as e:   # a Python value JSON has no form for, or a cycle
            raise SamplingParamsError(self.field, f"is not JSON data: {e}") from None
        if len(key) > MAX_SPEC_CHARS:
            raise SamplingParamsError(self.field, f"is longer than {MAX_SPEC_CHARS} characters")

    @property
    def form(self) -> str:
        """The one field that is set ("json", "regex", ...)."""
        return next(name for name in FORMS if getattr(self, name) not in (None, False))

    @property
    def field(self) -> str:
        """The set field's name as errors give it ("structured_outputs.json", ...)."""
        return _field(self.form)

    def key(self) -> str:
        """The constraint as canonical text: equal constraints have equal keys (the compile cache's)."""
        return json.dumps([self.form, getattr(self, self.form), self.disable_any_whitespace], sort_keys=True,
                          ensure_ascii=False)

    @classmethod
    def coerce(cls, value: object) -> StructuredOutputsParams:
        """A StructuredOutputsParams, or a dict of its fields (as JSON sends it)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(cls.__dataclass_fields__))
            if unknown:
                raise SamplingParamsError(_field(unknown[0]), "is not a structured output field (expected one "
                                          f"of {', '.join(cls.__dataclass_fields__)})")
            return cls(**value)
        raise SamplingParamsError("structured_outputs", f"must be a StructuredOutputsParams or a dict, got "
                                  f"{type(value).__name__}")
