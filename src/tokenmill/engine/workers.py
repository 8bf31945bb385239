"""Tensor-parallel worker processes: ranks 1..N-1 of a model whose rank 0 runs in the engine's process.

The scheduler stays in the engine. The workers are spawned by it, join a gloo process group
(`torch.distributed`, TCP rendezvous on a free loopback port), each load their own part of the
model (tokenmill/parallel.py) and their slice of every layer's paged KV pool (their KV heads; the
block tables are the engine's, the same on every rank). Then, once per step, rank 0 broadcasts the
step's packed batch (token ids, positions, attention metadata: built once, by ModelRunner.prepare)
and every rank runs the same forward; the layers' all-reduces and the LM head's gather are the only
other traffic, and only rank 0 gets logits and samples.

    engine (rank 0)                         worker (rank r)
    start(): spawn -> init group            init group -> load part r
    load part 0; plan the KV pool
    broadcast (blocks, KV dtype)  ------->  allocate its KV slice
    gather ready / error          <------>  report ready / its load error
    each step: broadcast batch    ------->  forward (all-reduce / gather with rank 0)
    shutdown: broadcast None      ------->  leave the group, exit

Failure: a worker that dies (or stops answering within `COLLECTIVE_TIMEOUT_S`) breaks the group; the
next collective raises parallel.ParallelError, and the engine fails its requests and stops (it never
retries a step then: the ranks would no longer agree on what runs). Each step first checks that every
worker is alive, so a dead one is found before anything is sent. A worker exits when its stdin (a
pipe the engine holds open) closes, so an engine process that dies, even by SIGKILL, leaves no
worker behind.
"""

from __future__ import annotations

import logging
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill import parallel
from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)

# A collective that waits longer than this fails: a hung (not dead) worker ends the engine in
# bounded time. Loading a part of the model happens before the first collective that waits on it.
COLLECTIVE_TIMEOUT_S = 600
JOIN_TIMEOUT_S = 10
LOOPBACK = "127.0.0.1"
WORKER_MODULE = "tokenmill.engine.worker_process"   # a worker's main()
EXIT_WAIT_S = 1.0   # a collective's peer closed its connection: how long to wait for its exit status


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its rank (picklable: it crosses into a spawned process)."""
    checkpoint: Path
    config: object          # the engine's EngineConfig
    dtype: torch.dtype
    device: str
    threads: int
    host: str               # where rank 0 listens for the group's rendezvous
    port: int
    world_size: int


@dataclass(frozen=True)
class KVPlan:
    """Rank 0's memory plan, which every rank allocates its KV slice by."""
    num_blocks: int
    block_size: int
    dtype: torch.dtype


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPWorkers:
    """The worker processes of one tensor-parallel engine (and its process group)."""

    def __init__(self, checkpoint: Path, config: object, dtype: torch.dtype, device: torch.device, size: int,
                 threads: int):
        port = free_port()
        spec = WorkerSpec(checkpoint, config, dtype, str(device), threads, LOOPBACK, port, size)
        # Fresh interpreters running this module (not multiprocessing's spawn, which would import the
        # caller's main module again: a script without an `if __name__ == "__main__"` guard would
        # start a second engine in every worker).
        self.procs = [subprocess.Popen([sys.executable, "-c", f"import {WORKER_MODULE} as w; w.main()", str(rank)],
                                       stdin=subprocess.PIPE) for rank in range(1, size)]
        for p in self.procs:   # stdin stays open: a worker exits when it closes (the engine's process died)
            p.stdin.write(pickle.dumps(spec))
            p.stdin.flush()
        groups: list[parallel.TensorParallel] = []
        # (also at exit: an engine never shut down stops its workers and closes its group then)
        self._finalizer = weakref.finalize(self, _stop, list(self.procs), groups)
        try:
            self.tp = parallel.connect(LOOPBACK, port, 0, size, COLLECTIVE_TIMEOUT_S)
        except parallel.ParallelError:
            self._finalizer()
            raise
        groups.append(self.tp)
        self.closed = False

    def check_alive(self) -> None:
        dead = [(rank, p) for rank, p in enumerate(self.procs, 1) if p.poll() is not None]
        if dead:
            raise parallel.ParallelError("; ".join(f"the tensor-parallel worker of rank {rank} (pid {p.pid}) "
                                                   f"{_exit_reason(p.returncode)}" for rank, p in dead))

    def explain(self, error: parallel.ParallelError) -> parallel.ParallelError:
        """A clearer error for a failed collective: which worker exited, if one did (waiting briefly
        for it to be reaped), else `error`."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while time.monotonic() < deadline:
            try:
                self.check_alive()
            except parallel.ParallelError as found:
                return found
            time.sleep(0.05)
        return error

    def ready(self, plan: KVPlan) -> None:
        """Send the KV plan; raise the first worker's load error, if any."""
        self.check_alive()
        parallel.broadcast_object(plan, self.tp)
        errors = parallel.gather_objects(None, self.tp)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed:
            raise TokenmillError(f"tensor parallel: rank {failed[0][0]} failed to load: {failed[0][1]}")

    def step(self, batch: tuple) -> None:
        """Send one step's batch (the arguments of ModelRunner.run) to every worker."""
        self.check_alive()
        parallel.broadcast_object(batch, self.tp)

    def shutdown(self) -> None:
        """Stop the workers (politely if the group still works) and leave the group."""
        if self.closed:
            return
        self.closed = True
        try:
            self.check_alive()
            parallel.broadcast_object(None, self.tp)
            for p in self.procs:
                p.wait(JOIN_TIMEOUT_S)
        except (parallel.ParallelError, subprocess.TimeoutExpired):
            pass
        self._finalizer()


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _stop(procs: list[subprocess.Popen], groups: list[parallel.TensorParallel]) -> None:
    """Kill the workers still running, close the group."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stdin.close()
    for tp in groups:
        parallel.close(tp)
