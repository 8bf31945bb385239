"""Host memory the CPU path lays out itself: anonymous mappings (zero-filled by the OS when first
written: the KV pool, engine/kv_cache.py) and the model's weights moved into one mapping on 2 MB pages.

A decode step reads every weight once, spread over hundreds of tensors: on 4 KB pages that is a
TLB miss every 4 KB. On transparent huge pages (`MADV_HUGEPAGE`: Linux gives them where its setting is
`madvise` or `always`; elsewhere the advice is ignored and nothing changes) batch-1 decode runs
faster (ARCHITECTURE, "Weights on huge pages"). The weights are copied once, after loading: values,
dtypes, shapes, strides and sharing (a tied embedding, views of one tensor) stay what they were, so
no result changes.
"""

from __future__ import annotations

import ctypes
import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64   # each tensor's first byte on a cache line (the kernels' vectors are 64 bytes)
TRIM_EVERY = 8 << 20


def anonymous_bytes(nbytes: int, huge_pages: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` zeros in a private anonymous mapping: its pages become resident
    only when first written. `huge_pages`: advised for 2 MB pages and starting on a 2 MB boundary
    (the kernel backs only whole aligned 2 MB ranges with a huge page)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    pad = HUGE_PAGE if huge_pages else 0
    buffer = mmap.mmap(-1, nbytes + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):   # (Linux only)
        buffer.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(buffer, dtype=torch.uint8)   # (the tensor keeps the mapping alive)
    start = -whole.data_ptr() % HUGE_PAGE if huge_pages else 0
    return whole[start:start + nbytes]


def move_weights_to_huge_pages(model: nn.Module) -> int:
    """Copy every CPU parameter and buffer of `model` into one mapping advised for huge pages, freeing
    the memory each held as it goes (so the process holds about one copy at a time; tensors that share
    memory keep sharing it). Returns the bytes moved."""
    groups: dict[int, list[torch.Tensor]] = {}   # the tensors viewing each storage
    for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values():
        if t.device.type == "cpu" and t.numel():
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    sizes = {key: -(-views[0].untyped_storage().nbytes() // ALIGN) * ALIGN for key, views in groups.items()}
    total = sum(sizes.values())
    if total == 0:
        return 0
    arena = anonymous_bytes(total, huge_pages=True)
    at, freed = 0, 0   # (bytes into the arena; bytes freed since the last trim)
    for key in list(groups):
        views = groups.pop(key)
        old = torch.empty(0, dtype=torch.uint8).set_(views[0].untyped_storage())
        arena[at:at + old.numel()].copy_(old)
        start = arena.storage_offset() + at   # (in the mapping's storage, which the views index)
        for t in views:
            t.data = torch.empty(0, dtype=t.dtype).set_(arena.untyped_storage(), start // t.element_size()
                                                        + t.storage_offset(), t.shape, t.stride())
        at, freed = at + sizes[key], freed + old.numel()
        del views, old
        if freed >= TRIM_EVERY:   # (or the old copies would pile up in the allocator while the new fill in)
            _return_freed_memory()
            freed = 0
    _return_freed_memory()
    return total


def _return_freed_memory() -> None:
    """Hand the freed copies' pages back to the OS: glibc keeps freed memory below its mmap threshold
    in its heap, which would leave the process holding the weights twice."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: its allocator returns memory its own way
        pass
