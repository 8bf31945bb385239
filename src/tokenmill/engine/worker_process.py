"""A tensor-parallel worker process (rank 1..N-1): see engine/workers.py for the protocol."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import torch

from tokenmill import parallel
from tokenmill.checkpoint import open_checkpoint
from tokenmill.engine.kv_cache import allocate_kv_caches, kv_layout
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.workers import (
    COLLECTIVE_TIMEOUT_S,
    WORKER_TIMEOUT_S,
    Rendezvous,
    WorkerSpec,
    on_stdin_closed,
    receive_batch,
)
from tokenmill.models.loader import load_model

logger = logging.getLogger(__name__)


def worker_main(rank: int, meet: Rendezvous) -> None:
    """Rank `rank` of the group that meets at `meet`: receive the spec, build this rank, then run what
    rank 0 broadcasts until it sends None. Returns when the engine shut the group down; raises
    ParallelError if the group broke."""
    logging.basicConfig(level=logging.WARNING, format=f"tokenmill-tp{rank} %(levelname)s %(name)s: %(message)s")
    # (an engine that never comes, e.g. a wrong MASTER_ADDR, ends the wait in bounded time)
    tp = parallel.connect(meet.host, meet.port, rank, meet.world_size, WORKER_TIMEOUT_S, COLLECTIVE_TIMEOUT_S)
    try:
        spec = parallel.broadcast_object(None, tp)
        if spec.shm is not None:
            tp = dataclasses.replace(tp, shm=parallel.SharedExchange(spec.shm, rank, tp.size, None))
        _serve(tp, spec)
    finally:
        parallel.close(tp)


def _serve(tp: parallel.TensorParallel, spec: WorkerSpec) -> None:
    torch.set_num_threads(spec.threads)
    config = spec.config
    device = torch.device(spec.device)
    error = model = None
    try:
        model, model_config = load_model(open_checkpoint(spec.checkpoint), spec.dtype, device, False,
                                         config.quantization, config.max_model_len, config.weight_cache, tp,
                                         config.activation_precision == "int8")
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    plan = parallel.broadcast_object(None, tp)
    if plan is None:   # rank 0 failed to build and shut the group down
        return
    if error is None:
        try:
            kv_heads = parallel.kv_heads_per_rank(model_config.num_heads, model_config.num_kv_heads, tp.size)
            caches = allocate_kv_caches(model_config, plan.num_blocks, plan.block_size, plan.dtype, device,
                                        kv_heads[tp.rank])
            runner = ModelRunner(model, caches, plan.block_size, model_config.vocab_size, device,
                                 config.attention_backend, layer_groups=kv_layout(model_config).layer_group)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    parallel.gather_objects(error, tp)
    if error is not None:
        return
    while (batch := receive_batch(tp)) is not None:
        runner.run(*batch)   # (a failure ends this worker: rank 0 cannot tell how far this rank got)


def main() -> None:
    """A worker started by TPWorkers on this machine: rank, host, port and world size as arguments;
    it exits when its stdin closes (the engine's process is gone)."""
    rank, host, port, size = sys.argv[1:5]
    # (no cleanup when the engine is gone: the group's peer is gone, and the main thread may be inside a collective)
    on_stdin_closed(lambda: os._exit(1))
    try:
        worker_main(int(rank), Rendezvous(host, int(port), int(size)))
    except parallel.ParallelError as e:   # rank 0 is gone: nothing to do but exit
        logger.error("%s", e)
        sys.exit(1)
