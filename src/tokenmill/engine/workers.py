"""Tensor-parallel workers: ranks 1..N-1 of a model whose rank 0 runs in the engine's process.

The scheduler stays in the engine. The workers join a gloo process group with it (torch.distributed
over TCP: tokenmill/parallel.py), each load their own part of the model and their slice of every
layer's paged KV pool (their KV heads; the block tables are the engine's, the same on every rank).
Then, once per step, rank 0 broadcasts the step's packed batch (token ids, positions, attention
metadata: built once, by ModelRunner.prepare) and every rank runs the same forward; the layers'
all-reduces and the LM head's gather are the only other traffic, and only rank 0 gets logits and
samples.

    engine (rank 0)                         worker (rank r)
    start workers (or wait for them)        join the group
    broadcast the WorkerSpec      ------->  load part r
    load part 0; plan the KV pool
    broadcast the KVPlan          ------->  allocate its KV slice
    gather ready / error          <-------  its load error, if any
    each step: its batch          ------->  forward (all-reduce / gather with rank 0)
    shutdown: None                ------->  leave the group, exit

Where the ranks run. By default the engine starts them on this machine: fresh interpreters
(`python -c`, not multiprocessing's spawn, which would import the caller's main module again, so a
script without an `if __name__ == "__main__"` guard would start an engine in every worker), meeting
on a free loopback port. Across machines, torchrun's variables say where to meet: an engine started
with MASTER_ADDR, MASTER_PORT, RANK=0 and WORLD_SIZE=N (N = tensor_parallel_size) starts no worker
and waits for ranks 1..N-1, each started with the same variables and its RANK as `tokenmill worker`
on its machine (the model path must exist there too; every setting comes from the engine).

Failure: a worker that dies (or stops answering within `COLLECTIVE_TIMEOUT_S`) breaks the group; the
next collective raises parallel.ParallelError, and the engine fails its requests and stops (it never
retries a step then: the ranks would no longer agree on what runs). Each step first checks that every
local worker is alive, so a dead one is found before anything is sent. A local worker exits when its
stdin (a pipe the engine holds open) closes, so an engine process that dies, even by SIGKILL, leaves
no worker behind; a remote one exits when the group breaks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenmill import parallel
from tokenmill.cache import SHARED_MEMORY_DIR
from tokenmill.config import MAX_PORT, MAX_PROCESSES
from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)

# Rank 0's waits (the rendezvous, every collective: a step's, or the workers' loads) fail past this:
# a hung (not dead) worker ends the engine in bounded time; a dead one is found at once. Workers wait
# without limit (an idle engine sends nothing), and exit when the engine's process is gone; but a
# worker started by hand waits for its engine's rendezvous no longer than COLLECTIVE_TIMEOUT_S.
COLLECTIVE_TIMEOUT_S = 600
WORKER_TIMEOUT_S = 365 * 24 * 3600   # gloo needs a number
JOIN_TIMEOUT_S = 10
LOOPBACK = "127.0.0.1"
WORKER_MODULE = "tokenmill.engine.worker_process"   # a worker's main()
EXIT_WAIT_S = 1.0   # a collective's peer closed its connection: how long to wait for its exit status


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its rank (sent by rank 0 once the group is up)."""
    checkpoint: Path
    config: object          # the engine's EngineConfig
    dtype: torch.dtype
    device: str
    threads: int
    shm: Path | None        # ranks on one machine: the shared mapping their collectives go through


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's ranks meet (rank 0 listens there) and how many they are."""
    host: str
    port: int
    world_size: int

    @staticmethod
    def from_env(env: Mapping[str, str]) -> tuple[Rendezvous, int] | None:
        """torchrun's MASTER_ADDR / MASTER_PORT / WORLD_SIZE and this process's RANK, if set."""
        names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
        if not all(env.get(n) for n in names):
            return None
        try:
            port, size, rank = int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), int(env["RANK"])
        except ValueError as e:
            raise TokenmillError(f"MASTER_PORT, WORLD_SIZE and RANK must be integers: {e}") from e
        if not 1 <= port <= MAX_PORT:
            raise TokenmillError(f"MASTER_PORT must be a TCP port (1..{MAX_PORT}), got {port}")
        if size > MAX_PROCESSES:
            raise TokenmillError(f"WORLD_SIZE must be at most {MAX_PROCESSES}, got {size}")
        if not (0 <= rank < size):
            raise TokenmillError(f"RANK {rank} is not one of WORLD_SIZE {size}'s ranks 0..{size - 1}")
        host = env["MASTER_ADDR"]
        try:   # a name no resolver could ever take (a label empty or too long), without a lookup: one
            host.encode("idna")   # that does not resolve yet is the group's store's to retry (and log)
        except UnicodeError as e:
            raise TokenmillError(f"MASTER_ADDR {host!r} is not an address ({e})") from e
        return Rendezvous(host, port, size), rank


@dataclass(frozen=True)
class KVPlan:
    """Rank 0's memory plan, which every rank allocates its KV slice by."""
    num_blocks: int
    block_size: int
    dtype: torch.dtype


def on_stdin_closed(action: Callable[[], None]) -> None:
    """Run `action` (in a thread of its own) when stdin closes: a process's parent holds the pipe
    open for as long as it lives, so this is how a child learns that its parent is gone, even by
    SIGKILL. (Read from the descriptor, not sys.stdin: a thread blocked in the buffered reader
    stops the interpreter's own exit.)"""
    def watch() -> None:
        while os.read(0, 4096):
            pass
        action()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def free_port() -> int:
    """A TCP port free on loopback now (a rendezvous's, a local server's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPWorkers:
    """The workers of one tensor-parallel engine (and its process group)."""

    def __init__(self, checkpoint: Path, config: object, dtype: torch.dtype, device: torch.device, size: int,
                 threads: int, env: Mapping[str, str] = os.environ):
        """`env`: where torchrun-style variables may name a rendezvous for ranks started elsewhere."""
        external = Rendezvous.from_env(env)
        self.procs: list[subprocess.Popen] = []
        self.broken = False   # a collective failed: the group cannot be used, not even to say goodbye
        self.broadcast_s = 0.0
        if external is not None:
            meet, rank = external
            if rank != 0 or meet.world_size != size:
                raise TokenmillError(f"tensor_parallel_size {size} with RANK={rank}, WORLD_SIZE={meet.world_size}: "
                                     f"the engine is rank 0 of tensor_parallel_size ranks; start ranks 1.. with "
                                     f"`tokenmill worker`")
            logger.info("tensor parallel: waiting at %s:%d for ranks 1..%d (`tokenmill worker`)", meet.host,
                        meet.port, size - 1)
            shm = None
        else:
            meet = Rendezvous(LOOPBACK, free_port(), size)
            # ranks on this machine exchange through shared memory (parallel.SharedExchange)
            shm = parallel.SharedExchange.create(SHARED_MEMORY_DIR / f"tokenmill-tp-{os.getpid()}-{meet.port}", size,
                                                 COLLECTIVE_TIMEOUT_S)
        # (also at exit: an engine never shut down stops its workers, closes its group, removes the mapping)
        groups: list[parallel.TensorParallel] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, groups, shm)
        try:
            if external is None:   # stdin stays open: a worker exits when it closes (the engine's process died)
                self.procs += [subprocess.Popen([sys.executable, "-c", f"import {WORKER_MODULE} as w; w.main()",
                                                 str(rank), meet.host, str(meet.port), str(size)],
                                                stdin=subprocess.PIPE) for rank in range(1, size)]
            tp = self._connect(meet)
            groups.append(tp)
            spec = WorkerSpec(checkpoint, config, dtype, str(device), threads, None if shm is None else shm.path)
            parallel.broadcast_object(spec, tp)
        except parallel.ParallelError as e:
            self.broken = True
            error = self.explain(e)
            self._finalizer()
            raise error from e
        except BaseException:
            self._finalizer()
            raise
        if shm is not None:
            shm.watch([p.pid for p in self.procs])
        self.tp = dataclasses.replace(tp, shm=shm)
        self.closed = False

    def _connect(self, meet: Rendezvous) -> parallel.TensorParallel:
        """Rank 0 of the group. The rendezvous waits for every rank; while it waits, the local workers
        are watched, so one that dies while starting ends the wait at once (the waiting thread is
        left to its timeout)."""
        result: list = []
        thread = threading.Thread(target=lambda: result.append(_try(parallel.connect, meet.host, meet.port, 0,
                                                                    meet.world_size, COLLECTIVE_TIMEOUT_S)),
                                  name="tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            self.check_alive()
            thread.join(0.05)
        if isinstance(result[0], BaseException):
            raise result[0]
        return result[0]

    def check_alive(self) -> None:
        dead = [(rank, p) for rank, p in enumerate(self.procs, 1) if p.poll() is not None]
        if dead:
            raise parallel.ParallelError("; ".join(f"the tensor-parallel worker of rank {rank} (pid {p.pid}) "
                                                   f"{_exit_reason(p.returncode)}" for rank, p in dead))

    def explain(self, error: parallel.ParallelError) -> parallel.ParallelError:
        """A clearer error for a failed collective: which worker exited, if one did (waiting briefly
        for it to be reaped), else `error`. The group is broken from then on."""
        self.broken = True
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
        if self.tp.shm is not None:   # every rank has it mapped now
            self.tp.shm.unlink()
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed:
            raise TokenmillError(f"tensor parallel: rank {failed[0][0]} failed to load: {failed[0][1]}")

    def step(self, batch: tuple) -> None:
        """Send one step's batch (the arguments of ModelRunner.run) to every worker."""
        start = time.perf_counter()
        self.check_alive()
        parallel.broadcast_object(_arrays(batch, lambda t: t.numpy()), self.tp)
        self.broadcast_s += time.perf_counter() - start

    def comm_time(self) -> float:
        """Seconds rank 0 has spent communicating with the workers: step broadcasts and collectives
        (waits for a slower rank included). Shared-memory exchanges are timed in C; the gloo path
        (ranks on several machines) counts the broadcasts only. (With shared memory the broadcasts are
        exchanges too, already in the C timer: adding broadcast_s counted them twice.)"""
        return self.broadcast_s if self.tp.shm is None else self.tp.shm.time_spent()

    def shutdown(self) -> None:
        """Stop the workers (politely if the group still works) and leave the group."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.broken:
                raise parallel.ParallelError("broken")
            self.check_alive()
            parallel.broadcast_object(None, self.tp)
            for p in self.procs:
                p.wait(JOIN_TIMEOUT_S)
        except (parallel.ParallelError, subprocess.TimeoutExpired):
            pass
        self._finalizer()


def _arrays(value: object, convert: Callable) -> object:
    """`value` with every tensor (or array) in it, also inside tuples and dataclasses, converted: a
    step's batch crosses as numpy arrays, which pickle ten times faster than tensors."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return convert(value)
    if isinstance(value, tuple):
        return tuple(_arrays(v, convert) for v in value)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: _arrays(getattr(value, f.name), convert)
                                             for f in dataclasses.fields(value)})
    return value


def receive_batch(tp: parallel.TensorParallel) -> tuple | None:
    """A worker's side of TPWorkers.step: the next step's batch (ModelRunner.run's arguments), or
    None when the engine shuts the group down."""
    batch = parallel.broadcast_object(None, tp)
    return None if batch is None else _arrays(batch, torch.from_numpy)


def _try(fn: Callable, *args: object) -> object:
    """fn(*args), or the exception it raised (for a thread's result)."""
    try:
        return fn(*args)
    except BaseException as e:
        return e


def _exit_reason(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _stop(procs: list[subprocess.Popen], groups: list[parallel.TensorParallel],
          shm: parallel.SharedExchange | None) -> None:
    """Kill the workers still running, close the group, remove the shared mapping's name."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stdin.close()
    for tp in groups:
        parallel.close(tp)
    if shm is not None:
        shm.unlink()
