"""The server's own settings (the engine's are tokenmill.config.EngineConfig), in a module of their
own so that the command's flags (command.py) and the app (app.py) share them without importing
each other, and `tokenmill --help` imports no FastAPI."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_QUEUED_REQUESTS = 256
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TLSConfig:
    """HTTPS: the server's certificate chain and key (PEM; the key may be in the certificate's
    file), and for client certificates, the CAs that sign them and whether one is required."""

    certfile: str
    keyfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = 0   # ssl.VerifyMode: 0 no client certificate, 1 optional, 2 required


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
    # HTTPS when set; and the path prefix a reverse proxy serves this server under, stripping it
    # before it forwards a request (ASGI's root_path, as vLLM's --root-path)
    tls: TLSConfig | None = None
    root_path: str = ""
    # Logs: a line per request received and ended (its prompt and token ids cut at max_log_len
    # characters and ids; None: whole), the engine's stats line while busy, uvicorn's access log
    log_requests: bool = False
    max_log_len: int | None = None
    log_stats: bool = True
    access_log: bool = True
