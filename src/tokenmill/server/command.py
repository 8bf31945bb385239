"""`tokenmill serve [MODEL]`: the server's own flags and the command (FastAPI is imported only here,
when the command runs, so other subcommands start fast)."""

from __future__ import annotations

import argparse
import json
import os
import re
import ssl
from pathlib import Path
from typing import Any

from tokenmill.config import MAX_PORT, MAX_PROCESSES, EngineConfig, cores_per_process, resolve_device, resolve_dtype
from tokenmill.errors import TokenmillError
from tokenmill.server.config import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_REQUEST_READ_TIMEOUT_S,
    ServerConfig,
    TLSConfig,
)

API_KEY_ENV = "TOKENMILL_API_KEY"
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")
METHOD = re.compile(r"[A-Za-z]+")
HEADER = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")   # (RFC 9110's token)
ROOT_PATH = re.compile(r"(/[A-Za-z0-9._~!$&'()*+,;=:@-]+)+")   # (RFC 3986's segments, no escapes)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                   "0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: the model file or folder name)")
    g.add_argument("--api-key", default=None, help=f"require `Authorization: Bearer KEY` on /v1 routes (or set "
                   f"{API_KEY_ENV}; the flag wins)")
    g.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                   help="sequences allowed to wait beyond --max-num-seqs; past it, 429 with Retry-After")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies are refused with 413")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let requests in flight finish before ending them with an error")
    g.add_argument("--request-read-timeout", type=float, default=DEFAULT_REQUEST_READ_TIMEOUT_S,
                   help="seconds a client has to send a request's headers (else the connection is closed) and "
                   "then its body (else 408)")
    g.add_argument("--allow-burst", action="store_true",
                   help="let the engine page (/engine) send bursts of generated requests (its \"break it\" panel); "
                   "for a local server: anyone who can reach it can load it")
    g.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                   help="origins (scheme://host[:port]) whose web pages may call this server from a browser (CORS), "
                   "or * for any: comma-separated or, as vLLM takes them, a JSON list; repeatable. Default: none "
                   "(a page elsewhere could otherwise use this server through its visitor's browser)")
    g.add_argument("--allowed-methods", action="append", default=None, metavar="METHODS",
                   help="with --allowed-origins: the HTTP methods such pages may use, as --allowed-origins takes "
                   "them (default *: any)")
    g.add_argument("--allowed-headers", action="append", default=None, metavar="HEADERS",
                   help="with --allowed-origins: the request headers such pages may send, as --allowed-origins "
                   "takes them (default *: any)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="with --allowed-origins: let such pages send the browser's cookies and credentials")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM, its chain after it; "
                   "the private key too unless --ssl-keyfile)")
    g.add_argument("--ssl-keyfile", default=None, help="with --ssl-certfile: the certificate's private key (PEM, "
                   "unencrypted)")
    g.add_argument("--ssl-ca-certs", default=None, help="with --ssl-certfile: the CAs (PEM) whose client "
                   "certificates --ssl-cert-reqs checks")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="with --ssl-ca-certs: client certificates 0 not asked for, 1 checked when sent, 2 required")
    g.add_argument("--root-path", default="", help="the path prefix a reverse proxy serves this server under, "
                   "stripping it before it forwards (e.g. /llm); the web pages work under any prefix")
    g.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=False,
                   help="log each request when received (its prompt, sampling parameters and prompt token ids) and "
                   "when it ends (logger tokenmill.server.requests)")
    g.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                   help="no such log (the default)")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests: the most characters of a prompt, and of its token ids, logged "
                   "(default: all)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no stats line every 5 s while the engine is busy (logger tokenmill.server.stats)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request from uvicorn")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice \"auto\", accepted so that its command lines run: tokenmill "
                   "always serves it (the model's syntax from --tool-call-parser or its chat template)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas, each a process with its own KV cache, behind this server's one port; "
                   "requests go where their prompt's prefix is cached, else to the least loaded replica. Without "
                   "--threads, each replica gets an equal share of the cores")
    g.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def list_flag(flag: str, values: list[str] | None, default: list[str]) -> list[str]:
    """A list flag's values (`default` when not given): each use one value, comma-separated or, as
    vLLM takes it, a JSON list (one value each, so that the flag never takes MODEL after it)."""
    if values is None:
        return default
    out = []
    for value in values:
        if value.lstrip().startswith("["):
            try:
                items = json.loads(value)
            except json.JSONDecodeError as e:
                raise TokenmillError(f"{flag}: {value!r} is not a JSON list ({e.msg})") from None
            if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
                raise TokenmillError(f"{flag}: the JSON list must hold strings only")
        else:
            items = value.split(",")
        out += [item.strip() for item in items]
    return out


def cors_settings(args: argparse.Namespace) -> dict[str, Any]:
    """ServerConfig's CORS fields from the flags, each value checked: an origin is what a browser
    sends (scheme://host[:port], lowercase, no path, no default port), so that a trailing slash, a
    path or ":443" on https, none of which would ever match, is an error or dropped here, and not a
    page that fails in the browser."""
    origins = []
    for value in list_flag("--allowed-origins", args.allowed_origins, []):
        origin = value.lower()
        if origin != "*" and not ORIGIN.fullmatch(origin):
            raise TokenmillError(f"--allowed-origins: {value!r} is not an origin: scheme://host[:port] with no path "
                                 "or trailing slash (e.g. http://localhost:3000), or * for any")
        for scheme, port in (("http://", ":80"), ("https://", ":443")):
            if origin.startswith(scheme) and origin.endswith(port):
                origin = origin[:-len(port)]   # (a browser leaves the scheme's default port out)
        origins.append(origin)
    if "*" in origins and args.allow_credentials:
        raise TokenmillError("--allow-credentials with --allowed-origins *: every site's pages could call this server "
                             "with their visitors' cookies and credentials; list the origins instead")
    lists = {}
    for name, token in (("allowed_methods", METHOD), ("allowed_headers", HEADER)):
        flag = "--" + name.replace("_", "-")
        lists[name] = list_flag(flag, getattr(args, name), ["*"])
        bad = [v for v in lists[name] if v != "*" and not token.fullmatch(v)]
        if bad:
            raise TokenmillError(f"{flag}: {bad[0]!r} is not a {'method' if token is METHOD else 'header name'} "
                                 "(or * for any)")
    return {"allowed_origins": origins, "allowed_methods": [m.upper() for m in lists["allowed_methods"]],
            "allowed_headers": lists["allowed_headers"], "allow_credentials": args.allow_credentials}


def tls_settings(args: argparse.Namespace) -> TLSConfig | None:
    """The HTTPS settings from the flags (None: plain HTTP), their files read now: a missing file, a
    key that is not the certificate's or a file that is not PEM is an error naming the flag here,
    and not a traceback once the model has loaded (uvicorn reads them when it starts serving)."""
    if args.ssl_certfile is None:
        given = [f for f in ("--ssl-keyfile", "--ssl-ca-certs") if getattr(args, f[2:].replace("-", "_"))]
        if given or args.ssl_cert_reqs:
            raise TokenmillError(f"{given[0] if given else '--ssl-cert-reqs'}: needs --ssl-certfile (HTTPS)")
        return None
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:
        raise TokenmillError(f"--ssl-cert-reqs {args.ssl_cert_reqs}: needs --ssl-ca-certs (the CAs whose client "
                             "certificates to accept)")
    if args.ssl_ca_certs is not None and not args.ssl_cert_reqs:
        raise TokenmillError("--ssl-ca-certs: needs --ssl-cert-reqs 1 (check client certificates when sent) or 2 "
                             "(require them)")
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path is not None:
            try:
                Path(path).read_bytes()
            except OSError as e:
                raise TokenmillError(f"{flag}: cannot read {path!r}: {e.strerror}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    def no_password() -> str:   # (else OpenSSL asks for one on the terminal)
        raise TokenmillError("--ssl-keyfile: the private key is encrypted; give it unencrypted (e.g. `openssl pkey "
                             "-in KEY -out PLAIN`)")

    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=no_password)
    except ssl.SSLError as e:
        what = "--ssl-certfile" + (" and --ssl-keyfile" if args.ssl_keyfile else "")
        raise TokenmillError(f"{what}: not a PEM certificate and its private key ({e.reason or e})") from None
    if args.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except ssl.SSLError as e:
            raise TokenmillError(f"--ssl-ca-certs: not PEM certificates ({e.reason or e})") from None
    return TLSConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)


def root_path(value: str) -> str:
    """--root-path as ASGI's root_path: "" or /segment[/segment...], a trailing slash dropped."""
    path = value.rstrip("/")
    if path and not ROOT_PATH.fullmatch(path):
        raise TokenmillError(f"--root-path: {value!r} is not a URL path such as /llm (it begins with /, and holds "
                             "no spaces, ? or #, no percent-escapes and no characters outside ASCII)")
    return path


def replica_roles(data_parallel_size: int, config: EngineConfig) -> list[str]:
    """One role per replica process ("both": data parallel; "prefill" + "decode": disaggregated);
    [] for a single engine in this process."""
    if data_parallel_size < 1:
        raise TokenmillError(f"--data-parallel-size: must be >= 1, got {data_parallel_size}")
    if data_parallel_size > MAX_PROCESSES:
        raise TokenmillError(f"--data-parallel-size: must be at most {MAX_PROCESSES}, got {data_parallel_size}")
    kv = config.kv_transfer_config
    if kv is None or kv.kv_role is not None:   # (an engine in one role: someone else's proxy pairs it)
        return ["both"] * data_parallel_size if data_parallel_size > 1 else []
    if data_parallel_size > 1:
        raise TokenmillError("--kv-transfer-config without a kv_role runs one prefill and one decode engine; it "
                             f"does not combine with --data-parallel-size {data_parallel_size}")
    return ["prefill", "decode"]


def serve(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from tokenmill.checkpoint import open_checkpoint
    from tokenmill.hub import default_model_path, resolve_model
    from tokenmill.server.app import run_server
    from tokenmill.server.frontend import run_frontend

    if args.model_path is not None and args.model is not None and args.model_path != args.model:
        raise TokenmillError(f"MODEL: given twice ({args.model_path!r} and --model {args.model!r})")
    model = args.model_path if args.model_path is not None else args.model
    if model is None:
        model = default_model_path()
    if not 1 <= args.port <= MAX_PORT:
        raise TokenmillError(f"--port: must be between 1 and {MAX_PORT}, got {args.port}")
    for name in ("max_queued_requests", "max_body_bytes"):
        value = getattr(args, name)
        if value < (1 if name != "max_queued_requests" else 0):
            raise TokenmillError(f"--{name.replace('_', '-')}: must be >= {1 if name != 'max_queued_requests' else 0},"
                                 f" got {value}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise TokenmillError("--served-model-name: must not be empty")
    if not args.host.strip():   # (an unset variable, `--host "$HOST"`, would otherwise open every interface)
        raise TokenmillError("--host: must not be empty (0.0.0.0 listens on every interface)")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        # empty (`--api-key "$UNSET"`, or the variable exported empty) would serve without a key;
        # spaces around it: no client could send it
        where = "--api-key" if args.api_key is not None else API_KEY_ENV
        raise TokenmillError(f"{where}: must not be empty or begin or end with spaces (unset {API_KEY_ENV} and "
                             f"give no --api-key to serve without a key)")
    if not args.shutdown_timeout >= 0:   # (written so that NaN is refused too)
        raise TokenmillError(f"--shutdown-timeout: must be >= 0, got {args.shutdown_timeout}")
    if not args.request_read_timeout > 0:
        raise TokenmillError(f"--request-read-timeout: must be > 0, got {args.request_read_timeout}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise TokenmillError(f"--max-log-len: must be >= 0, got {args.max_log_len}")
    if args.max_log_len is not None and not args.log_requests:
        raise TokenmillError("--max-log-len: needs --enable-log-requests (it cuts that log's prompts)")
    cors = cors_settings(args)
    tls = tls_settings(args)
    prefix = root_path(args.root_path)
    # Check what can be checked fast, before the socket opens: the flags and the checkpoint's header
    # (a hub id is looked up, or downloaded, now).
    engine_config = EngineConfig(model=model, **engine_args)
    resolve_dtype(engine_config.dtype, resolve_device(engine_config.device))   # (the engine resolves them again)
    roles = replica_roles(args.data_parallel_size, engine_config)
    if roles and engine_config.threads is None:
        engine_args = {**engine_args, "threads": cores_per_process(len(roles))}
    path = resolve_model(model)
    open_checkpoint(path)
    # a file or folder by its name, a hub id as given (as vLLM names it)
    served_name = args.served_model_name or (Path(model).name if Path(model).expanduser().exists() else model)
    config = ServerConfig(model=path, served_model_name=served_name,
                          engine_args=engine_args, max_queued_requests=args.max_queued_requests, api_key=api_key,
                          max_body_bytes=args.max_body_bytes, request_read_timeout=args.request_read_timeout,
                          allow_burst=args.allow_burst, tls=tls, root_path=prefix,
                          log_requests=args.log_requests, max_log_len=args.max_log_len,
                          log_stats=not args.disable_log_stats, access_log=not args.disable_uvicorn_access_log,
                          **cors)
    if roles:
        return run_frontend(config, roles, args.host, args.port, args.shutdown_timeout, args.uvicorn_log_level,
                            args.log_level)
    return run_server(config, args.host, args.port, args.shutdown_timeout, args.uvicorn_log_level)
