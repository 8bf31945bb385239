"""Engine replicas behind one front end (server/frontend.py): each replica is a whole `tokenmill
serve` (its engine, its KV cache, its HTTP server) in a process of its own, on a loopback port.

A replica is a fresh interpreter (`python -c`), sent its ServerConfig as one JSON line on stdin;
the front end keeps that pipe open, and a replica whose stdin closes drains and exits (SIGTERM to
itself), so a front end that dies, even by SIGKILL, leaves no replica behind. Replicas run in a
session of their own: a Ctrl-C in the terminal reaches the front end only, which stops them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time

from tokenmill.engine.workers import free_port, on_stdin_closed
from tokenmill.errors import TokenmillError
from tokenmill.server.config import ServerConfig

logger = logging.getLogger(__name__)

# Restarting a replica that keeps dying waits longer each time, up to this.
MAX_RESTART_DELAY_S = 30.0


class Replica:
    """One replica process as the front end sees it: where it listens, whether it is in rotation,
    the requests the front end has in flight there."""

    def __init__(self, index: int, config: ServerConfig, role: str, shutdown_timeout: float, log_level: str):
        self.index = index
        self.config = config
        self.role = role             # "both" (a data-parallel replica), "prefill" or "decode"
        self.shutdown_timeout = shutdown_timeout
        self.log_level = log_level
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.up = False              # answered /health with 200 since it (re)started
        self.ever_up = False
        self.in_flight = 0
        self.restarts = 0
        self.consecutive_deaths = 0  # deaths since it was last up
        self.next_start = 0.0        # monotonic time before which a dead replica is not restarted

    @property
    def name(self) -> str:
        return f"replica {self.index}" + (f" ({self.role})" if self.role != "both" else "")

    def start(self) -> None:
        self.up = False
        spec = {"config": dataclasses.asdict(self.config), "port": self.port, "index": self.index,
                "role": self.role, "shutdown_timeout": self.shutdown_timeout, "log_level": self.log_level}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "import tokenmill.server.replicas as r; r.replica_main()"],
            stdin=subprocess.PIPE, start_new_session=True)
        self.process.stdin.write((json.dumps(spec) + "\n").encode())
        self.process.stdin.flush()

    def exit_code(self) -> int | None:
        """None while the process runs (or before it started)."""
        return None if self.process is None else self.process.poll()

    def died(self) -> None:
        """Its process exited: out of rotation, restarted after a delay (none the first time; then
        doubling while it keeps dying before it is up again)."""
        self.up = False
        delay = min(MAX_RESTART_DELAY_S, 2.0 ** self.consecutive_deaths) if self.consecutive_deaths else 0.0
        self.next_start = time.monotonic() + delay
        self.consecutive_deaths += 1
        self.restarts += 1
        if self.process is not None and self.process.stdin is not None:
            self.process.stdin.close()
        self.process = None

    def terminate(self) -> None:
        """Ask it to drain and exit (SIGTERM: its requests in flight finish, for up to its
        shutdown_timeout, as a single server's would)."""
        self.up = False
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Wait for it to exit, then kill it."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit within %.0f s; killing it", self.name, timeout)
            self.process.kill()
            self.process.wait()
        if self.process.stdin is not None:
            self.process.stdin.close()


def replica_main() -> None:
    """A replica's process: its spec from stdin's first line, then `tokenmill serve` on loopback."""
    from tokenmill.server.app import REPLICA_HEAD_LIMIT, run_server

    spec = json.loads(sys.stdin.buffer.readline())
    logging.basicConfig(level=logging.WARNING,
                        format=f"tokenmill-{spec['role'] if spec['role'] != 'both' else 'replica'}{spec['index']} "
                               "%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tokenmill").setLevel(spec["log_level"])
    on_stdin_closed(lambda: os.kill(os.getpid(), signal.SIGTERM))
    config = ServerConfig(**spec["config"])
    try:
        code = run_server(config, "127.0.0.1", spec["port"], spec["shutdown_timeout"], "warning", announce=False,
                          head_limit=REPLICA_HEAD_LIMIT)
    except TokenmillError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)
