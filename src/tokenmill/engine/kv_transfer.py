"""Prefill/decode disaggregation: a request's prompt K/V handed from the engine that prefilled it
(the producer) to the engine that decodes it (the consumer), through shared memory.

The producer runs the request as usual (the front end asks it for one token); once its prompt is
computed, before its blocks go back to the pool, every layer's K/V of the prompt's tokens is
copied into a file in /dev/shm (tmpfs: memory, not disk) named `tokenmill-kv-<hex>`, with the
token ids, and the request's output names the file (`kv_transfer_params`: {"remote_kv": name}).
The consumer, given that name with the same request, reads the file (and deletes it), checks that
the token ids are a prefix of its prompt and that the shapes and dtype are its own, and its
scheduler admits the request with those tokens already computed: its blocks are allocated as for
a prefix-cache hit and the K/V written into them before the step runs. One token is always left
to compute (the last prompt position gives the first sampled token's logits), so the consumer
samples every output token itself: seeds and greedy outputs are those of a colocated run.

A file that no consumer collects is deleted: by the front end once the decode request is over
(whatever its outcome), by the producer's next export after `EXPORT_TTL_S`, by a producer starting
(any transfer file older than that), and by the producer's shutdown (its own). A file left by a
producer killed outright stays until the next producer starts. Each side's blocks are its own: the
producer's go back to its pool when its one-token request ends, the consumer's when its request
ends. The consumer reads the file when the request arrives and holds its K/V in memory (outside
the KV pool) until the request is admitted.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.cache import SHARED_MEMORY_DIR
from tokenmill.engine.block_table import BlockTable
from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)

KV_DIR = SHARED_MEMORY_DIR   # (a name of this module's: tests point it elsewhere)
NAME = re.compile(r"tokenmill-kv-[0-9a-f]{32}")
EXPORT_TTL_S = 300.0


@dataclass
class LoadedKV:
    """K/V received for a request: the first `num_tokens` of its prompt, every layer."""

    token_ids: list[int]
    kv: torch.Tensor   # [layers, 2, num_tokens, kv_heads, row], the cache's dtype and rows (int8: with scales)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def slots(block_ids: list[int], block_size: int, start: int, end: int) -> tuple[slice, torch.Tensor, torch.Tensor]:
    """The index of positions [start, end) of a request with this block table in a layer's
    [2, blocks, block_size, heads, dim] cache: (K and V, their blocks, their offsets in them)."""
    positions = torch.arange(start, end)
    return slice(None), torch.tensor(block_ids, dtype=torch.long)[positions // block_size], positions % block_size


def transfer_path(name: str) -> Path:
    """Where the transfer `name` lives; refuses anything but a transfer's name (it comes from a request)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise TokenmillError(f"kv_transfer_params.remote_kv: {str(name)[:60]!r} is not a KV transfer's name")
    return KV_DIR / name


class KVExporter:
    """The producer's side: writes a request's prompt K/V to a file; deletes uncollected ones."""

    def __init__(self) -> None:
        self.exported: deque[tuple[float, Path]] = deque()
        cutoff = time.time() - EXPORT_TTL_S   # left by a producer that did not shut down
        for path in KV_DIR.glob("tokenmill-kv-*"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
            except OSError:
                pass

    def export(self, caches: list[torch.Tensor], tables: list[BlockTable], block_size: int,
               token_ids: list[int]) -> str | None:
        """The name the K/V of `token_ids` is written under (each layer's from its block table,
        `tables`; zeros where a sliding layer gave its blocks back); None if it could not be written
        (the consumer then computes the prompt: a full /dev/shm fails one transfer, not the engine)."""
        now = time.monotonic()
        while self.exported and self.exported[0][0] < now - EXPORT_TTL_S:
            self.exported.popleft()[1].unlink(missing_ok=True)
        kv = torch.stack([cache[slots(table.block_ids, block_size, 0, len(token_ids))]
                          for cache, table in zip(caches, tables, strict=True)])
        for layer, table in enumerate(tables):
            kv[layer, :, :table.num_released * block_size] = 0
        name = f"tokenmill-kv-{uuid.uuid4().hex}"
        path = KV_DIR / name
        try:
            torch.save({"token_ids": torch.tensor(token_ids, dtype=torch.long), "kv": kv}, path)
        except Exception as e:
            path.unlink(missing_ok=True)
            logger.warning("could not export a prompt's K/V to %s (%s: %s); the decode engine will compute it",
                           path, type(e).__name__, e)
            return None
        self.exported.append((now, path))
        return name

    def close(self) -> None:
        """Delete every export still there (collected ones are gone already)."""
        while self.exported:
            self.exported.popleft()[1].unlink(missing_ok=True)


def read_kv(name: object) -> LoadedKV | None:
    """The K/V the producer wrote under `name`, the file then deleted; None when it is gone
    (collected already: by an earlier child of an n > 1 request, or expired) or unreadable."""
    path = transfer_path(name)
    try:
        data = torch.load(path, weights_only=True)
        token_ids, kv = data["token_ids"], data["kv"]
        if not isinstance(token_ids, torch.Tensor) or not isinstance(kv, torch.Tensor) or token_ids.dim() != 1:
            raise ValueError("not a K/V transfer's content")
        return LoadedKV(token_ids.tolist(), kv)
    except FileNotFoundError:
        return None
    except Exception as e:
        logger.warning("kv_transfer_params: %s is unreadable (%s: %s); computing the prompt", name,
                       type(e).__name__, e)
        return None
    finally:
        path.unlink(missing_ok=True)


def check_loaded(loaded: LoadedKV, prompt_token_ids: list[int], caches: list[torch.Tensor]) -> str | None:
    """Why `loaded` cannot serve this request in this engine, or None if it can."""
    n = loaded.num_tokens
    if prompt_token_ids[:n] != loaded.token_ids:
        return "its token ids are not a prefix of this request's prompt"
    expected = (len(caches), 2, n, *caches[0].shape[3:])
    if tuple(loaded.kv.shape) != expected or loaded.kv.dtype != caches[0].dtype:
        return (f"its K/V is {tuple(loaded.kv.shape)} {loaded.kv.dtype}, this engine's would be {expected} "
                f"{caches[0].dtype} (start both with the same settings)")
    return None


def write_kv(caches: list[torch.Tensor], tables: list[BlockTable], block_size: int, loaded: LoadedKV, start: int,
             end: int) -> None:
    """Positions [start, end) of `loaded` into each layer's blocks (`tables`: its block table), those
    before a sliding layer's window left out (it holds no blocks there)."""
    for layer, (cache, table) in enumerate(zip(caches, tables, strict=True)):
        first = max(start, table.num_released * block_size)
        cache[slots(table.block_ids, block_size, first, end)] = loaded.kv[layer, :, first:end]
