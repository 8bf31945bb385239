"""Tensor parallelism: which part of each weight a rank holds, and the collectives that join them.

Megatron's layout. A column-parallel Linear keeps some of the checkpoint's output rows (q/k/v of its
heads, its slice of gate/up, of the vocabulary); a row-parallel one keeps the matching input
columns (o, down), and its outputs are summed over the ranks by one all-reduce. Heads are split by
KV-head groups, so that a rank's query heads attend to its own KV heads: with 9 query heads over
3 KV heads (SmolLM2) on 2 ranks, rank 0 holds KV heads 0-1 and query heads 0-5, rank 1 the rest.
With fewer KV heads than ranks, each KV head is replicated on `ranks / kv_heads` ranks (as in
vLLM), which split its query heads. Intermediate and column splits are whole groups of 32 inputs,
so a quantized weight splits along whole quantization groups (the activation quantization is per
group too, so each partial product is the one a single rank would compute; only the summation
order of the all-reduce differs).

A model is built for the ranks that `building()` declares (layers read `current()` in their
constructors, as vLLM's layers read its parallel state); outside it everything is one rank, so a
draft model or a test model built in the same process stays whole.

The collectives raise `ParallelError` when a peer is gone (gloo reports a closed connection) or
does not answer within the group's timeout: the engine treats that as fatal, never as one
request's failure, since the ranks would no longer run the same steps.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import pickle
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tokenmill import kernels
from tokenmill.errors import EngineDeadError, TokenmillError

logger = logging.getLogger(__name__)

QUANT_GROUP = 32   # inputs per quantization group (layers/quant.py GROUP_SIZE): the unit of a column split


class ParallelError(EngineDeadError):
    """A rank failed or stopped answering: the tensor-parallel group is broken."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None   # None for one rank
    shm: SharedExchange | None = None        # ranks on one machine: the collectives go through it


SHM_SLOT_BYTES = 4 << 20   # per rank and parity; a larger transfer takes several exchanges


class SharedExchange:
    """Tensor-parallel ranks of one machine exchanging through a shared file mapping
    (kernels/shm_exchange.c has the layout and the protocol). gloo's collectives cost 0.1-1.5 ms each
    here, more than a decode step's compute, so ranks on one machine use this once the group is up
    (vLLM's CPU backend also all-reduces through shared memory); gloo stays for setup and for ranks
    on several machines. Rank 0 creates the file (`create`), the others map it; rank 0 removes the
    name once every rank has it mapped (`unlink`). `watch(pids)`: processes whose death ends a wait
    (rank 0 watches its workers; a worker exits by itself when the engine's process is gone)."""

    def __init__(self, path: Path, rank: int, size: int, timeout_s: float | None):
        """`timeout_s`: how long a wait may last (None: as long as it takes)."""
        lib = kernels.load()
        if lib is None:
            raise TokenmillError("tensor parallel: the C kernels (shm_exchange.c) cannot be built here")
        self.lib, self.path, self.rank, self.size = lib, path, rank, size
        self.header_bytes = lib.shm_header_bytes()
        self.region = torch.from_file(str(path), shared=True, size=shm_bytes(size), dtype=torch.uint8)
        self.seq = torch.zeros(1, dtype=torch.int64)   # exchanges so far (C advances it)
        self.pids = torch.zeros(0, dtype=torch.int64)
        self.stats = torch.zeros(2, dtype=torch.int64)   # exchanges, microseconds in them (C counts)
        self.plan = kernels.ShmPlan(self.region.data_ptr(), SHM_SLOT_BYTES, self.seq.data_ptr(), None, 0,
                                    0 if timeout_s is None else int(timeout_s * 1e6), self.stats.data_ptr(), rank,
                                    size)

    @classmethod
    def create(cls, path: Path, size: int, timeout_s: float | None) -> SharedExchange | None:
        """Rank 0's mapping, or None where the C kernels cannot be built (the group then uses gloo)."""
        if kernels.load() is None:
            return None
        with open(path, "xb") as f:   # zeroed: every rank's sequence number starts at 0
            f.truncate(shm_bytes(size))
        return cls(path, 0, size, timeout_s)

    def time_spent(self) -> float:
        """Seconds this rank has spent in exchanges (waiting for the others included)."""
        return int(self.stats[1]) / 1e6

    def watch(self, pids: list[int]) -> None:
        self.pids = torch.tensor(pids, dtype=torch.int64)
        self.plan.peer_pids, self.plan.num_peer_pids = self.pids.data_ptr(), len(pids)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def check(self, status: int, what: str) -> None:
        if status:
            why = {-1: "did not answer in time", -2: "died"}.get(status, "fell out of step (another size)")
            raise ParallelError(f"tensor parallel {what} failed: a rank {why}")

    def exchange(self, data: torch.Tensor) -> list[torch.Tensor]:
        """Publish `data` (uint8, at most SHM_SLOT_BYTES) and return every rank's, in rank order
        (views of the mapping, valid until the next exchange)."""
        data = data.contiguous()
        self.check(self.lib.shm_exchange(ctypes.byref(self.plan), data.data_ptr(), data.numel()), "exchange")
        parity = int(self.seq) % 2
        lengths = self.region[:self.size * self.header_bytes].view(torch.int64).view(self.size, -1)[:, 1 + parity]
        base = self.size * self.header_bytes + parity * self.size * SHM_SLOT_BYTES
        return [self.region[base + r * SHM_SLOT_BYTES:base + r * SHM_SLOT_BYTES + n]
                for r, n in enumerate(lengths.tolist())]

    def all_reduce(self, x: torch.Tensor) -> None:
        """x (float32 or bfloat16, contiguous) = the sum of every rank's x, added in rank order."""
        self.check(self.lib.shm_all_reduce(ctypes.byref(self.plan), x.data_ptr(), x.numel(),
                                           int(x.dtype == torch.bfloat16)), "all-reduce")

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (the same shape and dtype on every rank), in rank order."""
        flat = x.contiguous().view(-1).view(torch.uint8)
        parts: list[list[torch.Tensor]] = [[] for _ in range(self.size)]
        for start in range(0, flat.numel(), SHM_SLOT_BYTES):
            for r, got in enumerate(self.exchange(flat[start:start + SHM_SLOT_BYTES])):
                parts[r].append(got.clone())
        return [torch.cat(p).view(x.dtype).view(x.shape) for p in parts]

    def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` on every rank (the others pass None); the first exchange carries its length."""
        mine = b"" if payload is None else struct.pack("<q", len(payload)) + payload
        received: list[bytes] = []
        offset, length = 0, None
        while length is None or sum(map(len, received)) < 8 + length:
            chunk = mine[offset:offset + SHM_SLOT_BYTES]
            data = torch.frombuffer(bytearray(chunk), dtype=torch.uint8) if chunk else torch.empty(0, dtype=torch.uint8)
            received.append(self.exchange(data)[0].numpy().tobytes())
            offset += SHM_SLOT_BYTES
            if length is None:
                length = struct.unpack("<q", received[0][:8])[0]
        return b"".join(received)[8:8 + length]


def shm_bytes(size: int) -> int:
    """The shared mapping's size for `size` ranks (the C kernels built)."""
    return size * (kernels.load().shm_header_bytes() + 2 * SHM_SLOT_BYTES)


SINGLE = TensorParallel()
_current = SINGLE


@contextlib.contextmanager
def building(tp: TensorParallel) -> Iterator[None]:
    """Build the layers created inside for rank `tp.rank` of `tp.size` (not nested: one model at a
    time)."""
    global _current
    assert _current is SINGLE, "parallel.building() is already active"
    _current = tp
    try:
        yield
    finally:
        _current = SINGLE


def current() -> TensorParallel:
    return _current


def split(total: int, parts: int, unit: int = 1) -> list[range]:
    """`total` split into `parts` contiguous ranges of whole `unit`s, sizes differing by at most one unit
    (the larger first)."""
    if total % unit:
        raise TokenmillError(f"tensor_parallel_size: a dimension of {total} cannot be split in units of {unit}")
    units = total // unit
    if units < parts:
        raise TokenmillError(f"tensor_parallel_size {parts}: a dimension of {total} has only {units} units of "
                             f"{unit} to split")
    sizes = [units // parts + (i < units % parts) for i in range(parts)]
    starts = [sum(sizes[:i]) for i in range(parts)]
    return [range(s * unit, (s + n) * unit) for s, n in zip(starts, sizes, strict=True)]


def mlp_slice(intermediate_size: int, tp: TensorParallel) -> range:
    """This rank's slice of an MLP's intermediate dimension (the down projection's input): whole
    quantization groups where the dimension has them."""
    unit = QUANT_GROUP if intermediate_size % QUANT_GROUP == 0 else 1
    return split(intermediate_size, tp.size, unit)[tp.rank]


@dataclass(frozen=True)
class HeadSlice:
    """A rank's query heads and KV heads (ranges of head indices)."""
    q: range
    kv: range


def head_slice(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadSlice:
    if tp.size == 1:
        return HeadSlice(range(num_heads), range(num_kv_heads))
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp.size:
        kv = split(num_kv_heads, tp.size)[tp.rank]
        return HeadSlice(range(kv.start * group, kv.stop * group), kv)
    if tp.size % num_kv_heads or group % (tp.size // num_kv_heads):
        raise TokenmillError(f"tensor_parallel_size {tp.size}: the model's {num_kv_heads} KV heads (each serving "
                             f"{group} query heads) cannot be spread over {tp.size} ranks: with fewer KV heads than "
                             f"ranks, the ranks must be a multiple of the KV heads and split each one's query heads "
                             f"evenly")
    replicas = tp.size // num_kv_heads
    kv_head, part = divmod(tp.rank, replicas)
    per_rank = group // replicas
    start = kv_head * group + part * per_rank
    return HeadSlice(range(start, start + per_rank), range(kv_head, kv_head + 1))


def kv_heads_per_rank(num_heads: int, num_kv_heads: int, size: int) -> list[int]:
    """How many KV heads each of `size` ranks holds (replicas included): their KV pools' shapes."""
    return [len(head_slice(num_heads, num_kv_heads, TensorParallel(rank, size)).kv) for rank in range(size)]


def scaled(r: range, factor: int) -> range:
    """Head indices -> the rows (or columns) of their values, `factor` per head."""
    return range(r.start * factor, r.stop * factor)


def connect(host: str, port: int, rank: int, size: int, timeout_s: float,
            join_timeout_s: float | None = None) -> TensorParallel:
    """Rank `rank` of a new gloo group of `size` ranks that meet at host:port (rank 0 listens there);
    `timeout_s` bounds this process's waits in it (every collective), `join_timeout_s` (default:
    the same) its wait for the rendezvous.

    The group is this engine's own (a ProcessGroupGloo over its own TCPStore), not torch.distributed's
    default group: a process may run several engines (a test, a server with a draft model), and
    nothing here depends on global state."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        join = timeout if join_timeout_s is None else datetime.timedelta(seconds=join_timeout_s)
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=join)
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    except (RuntimeError, ValueError, TypeError) as e:   # (TypeError: a port TCPStore cannot take)
        raise ParallelError(f"tensor parallel: rank {rank} could not join the group at {host}:{port}: {e}") from e
    return TensorParallel(rank, size, group)


def close(tp: TensorParallel) -> None:
    """Shut the group down now. Left to the garbage collector, a group whose peer died can be
    destroyed during interpreter exit, when gloo's threads abort the process."""
    if tp.group is not None:
        try:
            tp.group.shutdown()
        except RuntimeError as e:
            logger.warning("tensor parallel: shutting the group down: %s", e)


def _check(what: str, work) -> None:
    """Wait for a collective; a peer that is gone (gloo: "Connection closed by peer") or silent past
    the group's timeout raises ParallelError."""
    try:
        work().wait()
    except (RuntimeError, ValueError) as e:
        raise ParallelError(f"tensor parallel {what} failed (a worker died or stopped answering): {e}") from e


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum of `x` over the ranks (in place). Through shared memory, every rank adds the parts in
    rank order in float32 and rounds once to x's dtype: the same bits on every rank."""
    if tp.size == 1:
        return x
    if tp.shm is not None and x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16):
        tp.shm.all_reduce(x)
    else:
        _check("all-reduce", lambda: tp.group.allreduce([x]))
    return x


def _gather(x: torch.Tensor, tp: TensorParallel) -> list[torch.Tensor] | None:
    """Every rank's `x` (same shape and dtype everywhere), in rank order, on rank 0; None elsewhere."""
    if tp.shm is not None:
        parts = tp.shm.all_gather(x)
        return parts if tp.rank == 0 else None
    opts = dist.GatherOptions()
    opts.rootRank = 0
    parts = [[torch.empty_like(x) for _ in range(tp.size)]] if tp.rank == 0 else []
    _check("gather", lambda: tp.group.gather(parts, [x.contiguous()], opts))
    return parts[0] if parts else None


def gather_columns(x: torch.Tensor, sizes: list[int], tp: TensorParallel) -> torch.Tensor | None:
    """The ranks' [rows, sizes[rank]] parts side by side on rank 0 ([rows, sum(sizes)]); None on the
    others."""
    if tp.size == 1:
        return x
    parts = _gather(torch.nn.functional.pad(x, (0, max(sizes) - x.shape[1])), tp)
    if parts is None:
        return None
    return torch.cat([p[:, :n] for p, n in zip(parts, sizes, strict=True)], dim=1)


def broadcast_object(obj: object, tp: TensorParallel) -> object:
    """Rank 0's `obj` (pickled) on every rank."""
    if tp.shm is not None:
        received = tp.shm.broadcast(pickle.dumps(obj) if tp.rank == 0 else None)
        return obj if tp.rank == 0 else pickle.loads(received)
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if tp.rank == 0 else None
    size = torch.tensor([0 if data is None else data.numel()], dtype=torch.int64)
    _check("broadcast", lambda: tp.group.broadcast(size, 0))
    if data is None:
        data = torch.empty(int(size), dtype=torch.uint8)
    _check("broadcast", lambda: tp.group.broadcast(data, 0))
    return obj if tp.rank == 0 else pickle.loads(data.numpy().tobytes())


def gather_objects(obj: object, tp: TensorParallel) -> list[object] | None:
    """Every rank's `obj` (pickled), in rank order, on rank 0; None elsewhere."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = _gather(torch.tensor([data.numel()], dtype=torch.int64), tp)
    width = torch.tensor([0 if sizes is None else int(max(sizes))], dtype=torch.int64)
    _check("broadcast", lambda: tp.group.broadcast(width, 0))
    parts = _gather(torch.nn.functional.pad(data, (0, int(width) - data.numel())), tp)
    if parts is None:
        return None
    return [pickle.loads(p[:int(n)].numpy().tobytes()) for p, n in zip(parts, sizes, strict=True)]
