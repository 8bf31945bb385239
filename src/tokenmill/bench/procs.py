"""Processes and memory for the benchmarks: each engine runs in a fresh process of its own, one
after the other, so the peak resident memory of a row is that engine's alone; the system load is
read around each run, since other work on the cores slows every rate.

Standard library only (this file is a leaf): `run_bare` runs it as a script in an interpreter that
must not load torch, and importing anything of tokenmill would (tokenmill/__init__.py imports it).
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

Row = dict[str, Any]


# ---- memory -------------------------------------------------------------------------------------

def vm_hwm_mib(pid: int | str) -> float | None:
    """A live process's peak resident memory (Linux /proc; None elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """This process's peak resident memory. Linux's VmHWM, not getrusage's ru_maxrss: ru_maxrss
    survives exec, so a child started from a big parent (one that had loaded torch reports >= ~230
    MiB whatever it did) would report the parent's peak."""
    hwm = vm_hwm_mib("self")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """Current resident memory (Linux /proc); elsewhere the peak so far, the closest portable value."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return peak_rss_mib()


class RSSSampler:
    """Samples this process's resident memory every `interval` seconds on a background thread."""

    def __init__(self, interval: float):
        self.interval = interval
        self.samples: list[tuple[float, float]] = []   # (seconds since start, MiB)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        start = time.perf_counter()
        while True:
            self.samples.append((time.perf_counter() - start, rss_mib()))
            if self._stop.wait(self.interval):
                break

    def __enter__(self) -> RSSSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((self.samples[-1][0] if self.samples else 0.0, rss_mib()))


# ---- load ---------------------------------------------------------------------------------------

def load_average() -> float | None:
    """The 1-minute system load average (None where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def print_load(what: str) -> None:
    """`[load average 1.23] what ...`, printed before a run starts."""
    load = load_average()
    print(f"[load average {'-' if load is None else f'{load:.2f}'}] {what} ...", flush=True)


# ---- timing a command ------------------------------------------------------------------------------------

def timed_command(cfg: Row) -> Row:
    """Runs cfg["command"] (with cfg["env"] added to the environment) to its end: seconds from its
    start to its first byte on stdout, to its exit, and its peak resident memory (its own rusage:
    run it from a small process, e.g. through run_bare, since a child's ru_maxrss starts at its
    parent's size when it was forked)."""
    env = {**os.environ, **cfg.get("env", {})}
    start = time.perf_counter()
    proc = subprocess.Popen(cfg["command"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    first_output_s = time.perf_counter() - start if first else None
    stderr = []
    reader = threading.Thread(target=lambda: stderr.append(proc.stderr.read()), daemon=True)
    reader.start()
    output = first + proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    reader.join()
    return {"first_output_s": first_output_s, "wall_s": time.perf_counter() - start,
            "child_peak_rss_mib": usage.ru_maxrss / 1024, "returncode": proc.returncode,
            "stdout_tail": output.decode(errors="replace")[-300:],
            "stderr_tail": b"".join(stderr).decode(errors="replace")[-2000:]}


# ---- running a function in a fresh process ------------------------------------------------------------

def _with_peak_rss(fn: Callable[..., Row], *args: Any) -> Row:
    """fn's row and the peak resident memory of the process that ran it (run at the end of the process's one job)."""
    return {**fn(*args), "peak_rss_mib": peak_rss_mib()}


def run_spawned(fn: Callable[..., Row], *args: Any) -> Row:
    """fn(*args) in a fresh spawned interpreter (a worker that dies raises instead of hanging). The
    row gets that process's peak resident memory and the system load before and after the run."""
    load_before = load_average()
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        row = pool.submit(_with_peak_rss, fn, *args).result()
    return {**row, "load_avg_before": load_before, "load_avg_after": load_average()}


def run_bare(fn: Callable[[Row], Row], cfg: Row, timeout: float) -> Row:
    """fn(cfg) in a fresh interpreter that holds nothing but what fn loads: fn's file is loaded by
    path, outside the tokenmill package, so it must import only the standard library at module
    level (like this one). The row gets the process's peak resident memory; cfg and the row go
    through JSON files."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out_path = Path(tmp) / "cfg.json", Path(tmp) / "out.json"
        cfg_path.write_text(json.dumps(cfg))
        command = [sys.executable, os.path.abspath(__file__), fn.__code__.co_filename, fn.__name__, str(cfg_path),
                   str(out_path)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"{fn.__name__} failed (status {proc.returncode}): {proc.stderr[-2000:]}")
        return json.loads(out_path.read_text())


def _bare_main(file: str, name: str, cfg_path: str, out_path: str) -> None:
    spec = importlib.util.spec_from_file_location(Path(file).stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = json.loads(Path(cfg_path).read_text())
    Path(out_path).write_text(json.dumps(_with_peak_rss(getattr(module, name), cfg)))


if __name__ == "__main__":   # run_bare's interpreter
    _bare_main(*sys.argv[1:])
