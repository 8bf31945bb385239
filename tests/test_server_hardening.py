"""The server under misbehaving code, clients and shutdowns: a 500 keeps the connection open, a
SIGTERM drains streams cleanly, client disconnects are quiet, slow clients time out, odd paths and
methods get OpenAI error bodies.

Three servers: one in this process (the tiny random model served by `create_app(..., loaded=...)`
under uvicorn in a thread, so tests can monkeypatch what a route calls and read the log records),
one subprocess on the tiny model with `--request-read-timeout 1`, and one subprocess on the default
model for the SIGTERM drain (the tiny model would finish any request before the drain's timeout).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from test_server import Server, check_error, running, wait_for

from tokenmill.bench.serve import free_port, stop_process
from tokenmill.cli import main
from tokenmill.engine.input import load_engine
from tokenmill.server import serving
from tokenmill.server.app import HeaderTimeoutH11Protocol, ServerConfig, create_app, draining_server
from tokenmill.server.async_engine import AsyncEngine
from tokenmill.server.command import API_KEY_ENV

CPU_FLAGS = ["--dtype", "float32", "--device", "cpu"]
READ_TIMEOUT_S = 1.0          # the subprocess server's --request-read-timeout
CLOSE_DEADLINE_S = 15.0       # generous: how long a test waits for the server to act on that timeout


class ThreadServer:
    """A uvicorn server run in a thread of this process (its log records reach caplog)."""

    def __init__(self, app, **config):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # log_config=None: uvicorn's loggers keep propagating to the root logger (and to caplog).
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None,
                                                    log_level="info", access_log=False, **config))
        self.app = app
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.server.started, 60), "the in-process server did not start"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


@pytest.fixture(scope="module")
def inproc(tiny_gguf_model):
    path = tiny_gguf_model("llama")
    engine, inputs = load_engine(str(path), dtype="float32", device="cpu")
    s = ThreadServer(create_app(ServerConfig(model=str(path), served_model_name="tiny"), loaded=(engine, inputs)))
    s.inputs = inputs
    try:
        assert wait_for(lambda: httpx.get(s.base + "/health").status_code == 200, 60)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def timeout_server(tiny_gguf_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("hardening") / "timeouts.log"
    s = Server([str(tiny_gguf_model("llama")), *CPU_FLAGS, "--request-read-timeout", str(READ_TIMEOUT_S)], log)
    with running(s, None):
        yield s


# ---- raw HTTP ------------------------------------------------------------------------------------

def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=CLOSE_DEADLINE_S)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One response (Content-Length framed) from `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a response body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def closed_by_server(sock: socket.socket, drip: bytes = b"", every: float = 0.3) -> bool:
    """True once the server closes `sock` (within CLOSE_DEADLINE_S), sending `drip` one byte every
    `every` seconds meanwhile, as a slowloris client does."""
    deadline = time.monotonic() + CLOSE_DEADLINE_S
    sock.settimeout(every)
    i = 0
    while time.monotonic() < deadline:
        try:
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            pass
        except ConnectionResetError:
            return True
        if drip:
            try:
                sock.sendall(drip[i % len(drip):i % len(drip) + 1])
            except (BrokenPipeError, ConnectionResetError):
                return True
            i += 1
    return False


def request_head(method: str, path: str, content_length: int | None = None) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    if content_length is not None:
        head += f"Content-Length: {content_length}\r\n"
    return (head + "\r\n").encode()


# ---- an unhandled error is a 500 body on a connection kept open --------------------------------------

def boom(*args, **kwargs):
    raise ValueError("boom")


async def boom_async(*args, **kwargs):
    raise ValueError("boom")


@pytest.mark.parametrize("where", ["route", "stream setup", "tokenize"])
def test_unhandled_error_is_a_500_body_logged_once_and_the_connection_stays_open(inproc, monkeypatch, caplog,
                                                                                  where):
    if where == "route":
        monkeypatch.setattr(serving, "prepare_completion", boom)
        path, body = "/v1/completions", {"prompt": "x", "max_tokens": 2}
    elif where == "stream setup":
        monkeypatch.setattr(AsyncEngine, "add_request", boom_async)
        path, body = "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}
    else:
        monkeypatch.setattr(inproc.inputs.tokenizer, "encode", boom)
        path, body = "/tokenize", {"prompt": "x"}

    conn = http.client.HTTPConnection("127.0.0.1", inproc.port, timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        first = conn.getresponse()
        error = json.loads(first.read())["error"]
        assert first.status == 500 and first.getheader("content-type") == "application/json"
        assert error == {"message": "internal error: ValueError", "type": "server_error", "param": None,
                         "code": None}
        assert first.getheader("connection") is None
        conn.auto_open = 0      # no silent reconnection: the next request must go on the same connection
        conn.request("GET", "/health")
        second = conn.getresponse()
        assert second.status == 200 and json.loads(second.read()) == {"status": "ok"}
    finally:
        conn.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert errors[0].name == "tokenmill.server.app" and errors[0].exc_info is not None
    assert path in errors[0].getMessage()


def test_request_log_and_the_log_switches(tiny_gguf_model, inproc, monkeypatch, caplog):
    path = tiny_gguf_model("llama")
    config = ServerConfig(model=str(path), served_model_name="tiny", log_requests=True, max_log_len=6,
                          log_stats=False, access_log=False)
    s = ThreadServer(create_app(config, loaded=load_engine(str(path), dtype="float32", device="cpu")))
    caplog.set_level(logging.INFO, logger="tokenmill.server.requests")
    try:
        assert wait_for(lambda: httpx.get(s.base + "/health").status_code == 200, 60)
        r = httpx.post(s.base + "/v1/completions", json={"prompt": "Hello there, friend", "max_tokens": 3,
                                                         "ignore_eos": True}, timeout=60)
        assert r.status_code == 200
        with httpx.Client(timeout=60) as c, c.stream("POST", s.base + "/v1/completions", json={
                "prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}) as stream:
            next(stream.iter_lines())   # (then the client goes away)
        assert wait_for(lambda: any(m.startswith("aborted request") for m in caplog.messages), 60), caplog.messages
        assert s.app.state.tokenmill.engine.stats_log_interval is None
    finally:
        s.stop()
    logged = [r.getMessage() for r in caplog.records if r.name == "tokenmill.server.requests"]
    received = re.fullmatch(r"received request (\S+): prompt: 'Hello ', params: SamplingParams\(n=1, max_tokens=3, "
                            r".*\), prompt_token_ids: \[([\d, ]+)\]", logged[0])
    assert received is not None and len(received.group(2).split(",")) == 6, logged
    assert logged[1] == f"finished request {received.group(1)}: finish_reason length; " \
        f"{r.json()['usage']['prompt_tokens']} prompt and 3 output tokens in " + logged[1].rsplit(" in ")[1]
    assert logged[2].startswith("received request ") and logged[3].startswith("aborted request "), logged
    # the defaults: stats lines every 5 s while busy, uvicorn's access log, no request log
    assert inproc.app.state.tokenmill.engine.stats_log_interval == 5.0
    assert not inproc.app.state.tokenmill.engine.log_requests
    assert draining_server(s.app, config, "127.0.0.1", 1, "info", 1, lambda: None, lambda: None).config.access_log \
        is False


def test_serve_flags_reach_the_server_config(tiny_gguf_model, monkeypatch):
    import tokenmill.server.app
    configs = []
    monkeypatch.setattr(tokenmill.server.app, "run_server", lambda config, *args: configs.append(config) or 0)
    model = str(tiny_gguf_model("llama"))
    assert main(["serve", model]) == 0
    assert main(["serve", model, "--enable-log-requests", "--max-log-len", "7", "--disable-log-stats",
                 "--disable-uvicorn-access-log", "--root-path", "/llm/"]) == 0
    assert main(["serve", model, "--enable-log-requests", "--disable-log-requests"]) == 0
    fields = [(c.log_requests, c.max_log_len, c.log_stats, c.access_log, c.root_path, c.tls) for c in configs]
    assert fields == [(False, None, True, True, "", None), (True, 7, False, False, "/llm", None),
                      (False, None, True, True, "", None)]


# ---- paths, methods, empty messages ------------------------------------------------------------------

def test_trailing_slash_is_a_404_naming_the_route(inproc):
    r = httpx.post(inproc.base + "/v1/completions/", json={"prompt": "x"})
    message = check_error(r, 404, None, None)["message"]
    assert re.search(r"did you mean /v1/completions(?!/)", message), message
    r = httpx.get(inproc.base + "/v1/models/")   # (not taken for GET /v1/models/{model} with an empty name)
    assert "did you mean /v1/models" in check_error(r, 404, None, None)["message"]
    r = httpx.post(inproc.base + "/v1/nothing-here/", json={"prompt": "x"})
    assert "did you mean" not in check_error(r, 404, None, None)["message"]


def test_head_health_and_metrics_answer_like_get(inproc):
    r = httpx.head(inproc.base + "/health")
    assert r.status_code == 200 and r.content == b""
    assert r.headers["content-type"] == "application/json"
    r = httpx.head(inproc.base + "/metrics")
    assert r.status_code == 200 and r.content == b"" and r.headers["content-type"].startswith("text/plain")


def test_a_long_unknown_path_is_not_echoed_back(inproc):
    r = httpx.get(inproc.base + "/x" * 5_000)   # (under h11's 16 KB head limit, which would refuse it first)
    assert "no route GET /x/x" in check_error(r, 404, None, None)["message"] and len(r.content) < 1024


def test_tokenize_refuses_empty_messages(inproc):
    check_error(httpx.post(inproc.base + "/tokenize", json={"messages": []}), 400, "messages", None)


# ---- flags -------------------------------------------------------------------------------------------

def test_serve_refuses_bad_server_flags(capsys, default_gguf_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "a key")
    for args, words in ((["--port", "70000"], "--port: must be between 1 and 65535, got 70000"),
                        (["--port", "0"], "--port: must be between 1 and 65535"),
                        (["--served-model-name", ""], "--served-model-name: must not be empty"),
                        (["--model", ""], "model must not be empty"),
                        # an unset variable (`--host "$HOST"`) would have listened on every interface,
                        (["--host", ""], "--host: must not be empty"),
                        # and (`--api-key "$KEY"`) served without a key, though TOKENMILL_API_KEY is set
                        (["--api-key", ""], "--api-key: must not be empty or begin or end with spaces"),
                        (["--api-key", " "], "--api-key: must not be empty"),
                        (["--api-key", "key "], "--api-key: must not be empty or begin or end with spaces"),
                        # before the socket opens (they failed once the engine loaded, after "serving")
                        (["--dtype", "foo"], "dtype: 'foo' is not supported"),
                        (["--dtype", "float16", "--device", "cpu"], "dtype: float16 is not supported on CPU"),
                        (["--device", "tpu"], "device: 'tpu' is not a valid torch device"),
                        (["--max-log-len", "-1"], "--max-log-len: must be >= 0, got -1"),
                        (["--max-log-len", "5"], "--max-log-len: needs --enable-log-requests")):
        assert main(["serve", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tokenmill: error: {words}") and "Traceback" not in err, err
    for value in (" key", ""):   # (no client could send it; exported empty, it served without a key)
        monkeypatch.setenv(API_KEY_ENV, value)
        assert main(["serve"]) == 2
        assert capsys.readouterr().err.startswith(f"tokenmill: error: {API_KEY_ENV}: must not be empty or begin")


def test_serve_on_a_port_in_use_or_a_foreign_address_is_one_error_before_loading(default_gguf_path):
    """The socket is bound before the model loads: a port in use is exit 2 at once with one line
    naming --port, never "serving" announced and then uvicorn's exit 3."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, words in (([default_gguf_path, "--port", str(port)], f"--port: cannot listen on 127.0.0.1:{port}"),
                            ([default_gguf_path, "--host", "192.0.2.1"], "--host: cannot listen on 192.0.2.1"),
                            ([default_gguf_path, "--host", "no-such-host.invalid"], "--host: 'no-such-host.invalid'"),
                            # (names the IDNA codec refuses: a UnicodeError traceback before)
                            ([default_gguf_path, "--host", "a" * 64], "--host: 'aaaa"),
                            ([default_gguf_path, "--host", "a..b"], "--host: 'a..b' is not an address")):
            r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", *map(str, args)], capture_output=True,
                               text=True, timeout=120)
            assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
            errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
            assert len(errors) == 1 and errors[0].startswith(f"tokenmill: error: {words}"), r.stderr
            assert "serving" not in r.stderr and "memory plan" not in r.stderr


# ---- cross-origin requests (CORS) --------------------------------------------------------------------

APP_ORIGIN = "http://app.example:3000"


def preflight(base: str, origin: str, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.options(base + path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                               "Access-Control-Request-Headers": "authorization, content-type"})


@pytest.fixture(scope="module")
def cors_server(tiny_gguf_model):
    config = ServerConfig(model=str(tiny_gguf_model("llama")), served_model_name="tiny", api_key="k",
                          engine_args={"dtype": "float32", "device": "cpu"}, allowed_origins=[APP_ORIGIN])
    s = ThreadServer(create_app(config))
    try:
        assert wait_for(lambda: httpx.get(s.base + "/health").status_code == 200, 60)
        yield s
    finally:
        s.stop()


def test_no_cross_origin_access_unless_allowed(inproc):
    """By default a page of another origin gets no CORS header, so its visitor's browser neither
    sends its request (the preflight fails) nor lets it read an answer."""
    r = preflight(inproc.base, APP_ORIGIN)
    assert "access-control-allow-origin" not in r.headers and r.status_code == 405
    r = httpx.post(inproc.base + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                   headers={"Origin": APP_ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_allowed_origins_get_preflights_and_headers_on_every_answer(cors_server):
    base = cors_server.base
    # the preflight is answered without the key (a browser sends none with it), for the allowed origin only
    r = preflight(base, APP_ORIGIN)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "POST" in r.headers["access-control-allow-methods"]
    r = preflight(base, "http://elsewhere.example")
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    # answers carry the header: a stream, a list, and an error (so that the page can read why)
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body,
                      headers={"Origin": APP_ORIGIN, "Authorization": "Bearer k"}) as r:
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    r = httpx.get(base + "/v1/models", headers={"Origin": APP_ORIGIN, "Authorization": "Bearer k"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    r = httpx.post(base + "/v1/completions", json=body, headers={"Origin": APP_ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == APP_ORIGIN
    r = httpx.get(base + "/v1/models", headers={"Origin": "http://elsewhere.example", "Authorization": "Bearer k"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_flags_take_lists_or_json_lists_and_refuse_what_never_matches(capsys):
    from tokenmill.cli import build_parser
    from tokenmill.server.command import cors_settings

    def settings(*argv: str) -> dict:
        return cors_settings(build_parser().parse_args(["serve", *argv]))

    assert settings() == {"allowed_origins": [], "allowed_methods": ["*"], "allowed_headers": ["*"],
                          "allow_credentials": False}
    # a vLLM command line for tool calling and browsers parses (tool_choice "auto" needs no switch here)
    vllm = build_parser().parse_args(["serve", "m.gguf", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                      "--allowed-origins", '["*"]', "--allowed-headers", '["*"]'])
    assert vllm.tool_call_parser == "hermes" and cors_settings(vllm)["allowed_origins"] == ["*"]
    # one value a use (comma-separated), so that MODEL after the flag stays MODEL
    after = build_parser().parse_args(["serve", "--allowed-methods", "GET", "smollm"])
    assert after.model_path == "smollm" and cors_settings(after)["allowed_methods"] == ["GET"]
    # lowercase, and without the default port a browser leaves out
    assert settings("--allowed-origins", "http://a.example, HTTPS://B.example:8443", "--allowed-origins",
                    "https://c.example:443")["allowed_origins"] == [
        "http://a.example", "https://b.example:8443", "https://c.example"]
    as_vllm = settings("--allowed-origins", '["http://a.example"]', "--allowed-methods", '["get", "POST"]',
                       "--allowed-headers", "Authorization,Content-Type", "--allow-credentials")
    assert as_vllm == {"allowed_origins": ["http://a.example"], "allowed_methods": ["GET", "POST"],
                       "allowed_headers": ["Authorization", "Content-Type"], "allow_credentials": True}
    for argv, words in ((["--allowed-origins", "http://localhost:3000/"], "--allowed-origins: 'http://localhost:3000/'"
                                                                          " is not an origin"),
                        (["--allowed-origins", "localhost:3000"], "--allowed-origins: 'localhost:3000' is not an"),
                        (["--allowed-origins", "http://a.example/app"], "--allowed-origins: 'http://a.example/app'"),
                        (["--allowed-origins", '["http://a.example", 3]'], "--allowed-origins: the JSON list must"),
                        (["--allowed-origins", "[http://a.example]"], "--allowed-origins: '[http://a.example]' is "
                                                                       "not a JSON list"),
                        (["--allowed-origins", "*", "--allow-credentials"], "--allow-credentials with "
                                                                             "--allowed-origins *"),
                        (["--allowed-methods", "GET POST"], "--allowed-methods: 'GET POST' is not a method"),
                        (["--allowed-headers", "x header"], "--allowed-headers: 'x header' is not a header name")):
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tokenmill: error: {words}") and "Traceback" not in err, err


# ---- read timeouts -----------------------------------------------------------------------------------

def test_serve_refuses_bad_timeouts(capsys):
    for flag, value, words in (("--request-read-timeout", "0", "must be > 0"),
                               ("--request-read-timeout", "-1", "must be > 0"),
                               ("--request-read-timeout", "nan", "must be > 0"),
                               ("--shutdown-timeout", "nan", "must be >= 0")):
        assert main(["serve", "missing.gguf", flag, value]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tokenmill: error: {flag}: {words}") and "Traceback" not in err


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",   # bad chunk size
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",   # past h11's header limit
    b"NOT HTTP AT ALL\r\n\r\n",
], ids=["chunk-size", "content-length", "header-size", "request-line"])
def test_malformed_http_framing_is_a_json_400(timeout_server, request_bytes):
    with connect(timeout_server.port) as sock:
        # in two pieces: h11 holds a head to its size limit only while it is incomplete
        sock.sendall(request_bytes[:len(request_bytes) // 2])
        time.sleep(0.2)
        sock.sendall(request_bytes[len(request_bytes) // 2:])
        status, headers, body = read_response(sock)
    assert status == 400 and headers["content-type"] == "application/json", (headers, body)
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and "malformed" in error["message"]
    assert httpx.get(timeout_server.base + "/health").status_code == 200


def test_slow_request_headers_close_the_connection(timeout_server):
    with connect(timeout_server.port) as sock:    # a slowloris: the headers never end
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        assert closed_by_server(sock, drip=b"abcdefgh")
    with connect(timeout_server.port) as sock:    # connected, silent
        assert closed_by_server(sock)
    with connect(timeout_server.port) as sock:    # after a response on a kept-alive connection
        sock.sendall(request_head("GET", "/health"))
        assert read_response(sock)[0] == 200
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        assert closed_by_server(sock, drip=b"abcdefgh")
    assert "no complete request headers within 1 s" in timeout_server.log()
    assert httpx.get(timeout_server.base + "/health").status_code == 200


def test_a_stalled_body_is_a_408(timeout_server):
    with connect(timeout_server.port) as sock:
        sock.sendall(request_head("POST", "/v1/completions", content_length=100) + b'{"prompt": ')
        status, headers, body = read_response(sock)
        assert status == 408 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert closed_by_server(sock)


def test_normal_requests_are_not_cut_by_the_read_timeout(timeout_server):
    body = {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=timeout_server.base, timeout=60) as c:   # one kept-alive connection
        for _ in range(2):
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_header_timer_is_off_while_the_app_works():
    """A response slower than the timeout is not cut (the timer waits for headers only)."""

    async def slow_app(scope, receive, send):
        if scope["type"] != "http":
            return
        await asyncio.sleep(1.5)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    s = ThreadServer(slow_app, http=HeaderTimeoutH11Protocol.with_timeout(0.5), lifespan="off")
    try:
        with connect(s.port) as sock:
            sock.sendall(request_head("GET", "/"))
            status, _, body = read_response(sock)
            assert (status, body) == (200, b"ok")
    finally:
        s.stop()


# ---- client disconnects -------------------------------------------------------------------------------

def test_client_gone_while_uploading_is_one_info_line(timeout_server):
    with connect(timeout_server.port) as sock:
        sock.sendall(request_head("POST", "/v1/completions", content_length=100000) + b'{"prompt": "' + b"x" * 1000)
    assert wait_for(lambda: "disconnected while sending the body of POST /v1/completions" in timeout_server.log())
    log = timeout_server.log()
    assert "Traceback" not in log and "ERROR" not in log, log
    assert httpx.get(timeout_server.base + "/health").status_code == 200


# ---- SIGTERM past --shutdown-timeout: streams end with an error event and [DONE] ----------------------

def test_sigterm_past_the_shutdown_timeout_ends_streams_with_an_error_then_done(default_gguf_path, tmp_path):
    # (--max-num-seqs 4 keeps the default KV pool small: four full-length requests, not 4 GiB.)
    s = Server([str(default_gguf_path), *CPU_FLAGS, "--max-model-len", "4096", "--max-num-seqs", "4",
                "--shutdown-timeout", "1"], tmp_path / "drain.log")
    try:
        s.wait_ready(None)
        # 4000 tokens each: far more than the default model generates in the 1 s drain on a CPU.
        body = {"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True}
        started = threading.Barrier(4)

        def stream() -> list[str]:
            with httpx.Client(timeout=120) as c, c.stream("POST", s.base + "/v1/completions",
                                                         json={**body, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                data = [next(line for line in lines if line.startswith("data:"))]
                started.wait()
                return data + [line for line in lines if line.startswith("data:")]

        def whole() -> httpx.Response:
            started.wait()
            return httpx.post(s.base + "/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream) for _ in range(2)]
            plain = pool.submit(whole)
            started.wait(timeout=120)
            assert wait_for(lambda: s.metrics()["tokenmill_num_requests_running"] == 3)
            s.proc.send_signal(signal.SIGTERM)
            results = [f.result(timeout=120) for f in streams]
            response = plain.result(timeout=120)
        for lines in results:
            assert len(lines) >= 3 and lines[-1] == "data: [DONE]", lines[-3:]
            error = json.loads(lines[-2][5:])["error"]
            assert error["type"] == "server_error" and "shutting down" in error["message"]
            assert "finish_reason" in json.loads(lines[-3][5:])["choices"][0]   # a whole chunk before it
        assert check_error(response, 500, None, None)["type"] == "server_error"
        assert s.proc.wait(60) == 0
        log = s.log()
        assert "Traceback" not in log and "CancelledError" not in log, log
        assert "engine stopped" in log
    finally:
        stop_process(s.proc)



def test_server_status_says_what_the_server_is_doing(inproc):
    """/health's and the 503's words: loading, failed (the model did not load), shutting down (a
    drain included), ok."""
    from tokenmill.server.app import ServerState

    state = ServerState(ServerConfig(model="m", served_model_name="m"), None, None, None)
    assert state.status() == "loading"
    state.load_error = RuntimeError("no")
    assert state.status() == "failed"
    with pytest.raises(Exception, match="without a model"):
        state.ready_engine()
    state.stopping = True
    assert state.status() == "shutting down"
    assert httpx.get(inproc.base + "/health").json() == {"status": "ok"}
