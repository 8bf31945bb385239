"""Exceptions that tokenmill raises for bad input.

Every error a user can cause (a bad path, a corrupt file, an out-of-range parameter) is one of
these, with a message that names the file or field. The CLI prints the message on one line and
exits non-zero; the server maps them to HTTP 400.
"""


class TokenmillError(ValueError):
    """Base class: a problem with what the user asked for, not a bug in tokenmill."""


class CheckpointError(TokenmillError):
    """A model path that is missing, unreadable, corrupt or of an unsupported kind."""


class UnsupportedModelError(CheckpointError):
    """A readable checkpoint whose architecture or tensor type tokenmill cannot run."""


class SamplingParamsError(TokenmillError):
    """An out-of-range or ill-typed sampling parameter; `field` names it (OpenAI's `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field


class EngineDeadError(RuntimeError):
    """Not bad input: the engine cannot go on (a tensor-parallel worker died or stopped answering).
    Every request in flight fails with it and the engine takes no more; the server exits non-zero."""
