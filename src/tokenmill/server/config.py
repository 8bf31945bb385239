"""The server's own settings (the engine's are tokenmill.config.EngineConfig), in a module of their
own so that the command's flags (command.py) and the app (app.py) share them without importing
each other, and `tokenmill --help` imports no FastAPI."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_QUEUED_REQUESTS = 256
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0


@dataclass
class ServerConfig:
    model: str                          # a .gguf file or HF folder
    served_model_name: str              # the name clients pass as `model`
    engine_args: dict[str, Any] = field(default_factory=dict)   # LLM(...) keyword arguments
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S   # seconds for headers, and for a body
    allow_burst: bool = False           # POST /engine/burst (the engine page's "break it" panel)
    # CORS: the origins whose web pages a browser lets call this server ([]: none but its own
    # pages; "*": any); with the methods and request headers such a page may use, and whether with
    # the browser's cookies and credentials
    allowed_origins: list[str] = field(default_factory=list)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
