"""A loaded CPU model's weights moved into one arena backed by transparent huge pages.

Why: a decode step streams every weight from memory once. On 4 KB pages each page of a weight is a
TLB miss, and the CPU's hardware prefetchers stop at every page boundary; on 2 MB pages both nearly
vanish. Linux backs anonymous memory with huge pages only where madvise(MADV_HUGEPAGE) asks for it
in its default "madvise" mode, and the allocator behind PyTorch's tensors does not ask, so the
weights are copied once, after loading, into an anonymous mapping that does. (In "always" mode the
kernel would use huge pages anyway for large enough allocations, but only for their 2 MB-aligned
parts; in "never" mode nothing is done.)

Every parameter and buffer keeps its Python object (`tensor.data` is swapped), so modules, tied
weights and anything else holding the tensors see the moved memory. Tensors that share a storage
keep sharing it: their storage's span is copied once and each is re-viewed at its offset in the
copy. The kernels' plans read the tensors' addresses when they are built, after this.
"""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64   # each copied span starts on a cache line (the kernels' loads assume no more)
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent huge page mode: "always", "madvise", "never", or "" where it has none."""
    try:
        text = THP_ENABLED.read_text()
    except OSError:
        return ""
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else ""


def _spans(tensors: list[torch.Tensor]) -> list[tuple[int, int, list[torch.Tensor]]]:
    """The byte spans [start, end) of storage to copy for `tensors` (which share one storage), each
    with the tensors inside it: one span covering them all, unless they lie far apart in a larger
    storage (views into a whole checkpoint file) without overlapping, then one span per distinct view.
    A span starts a multiple of ALIGN bytes into the storage, so in the copy each tensor keeps its
    alignment (a multiple of its element size, and of the storage's own alignment up to ALIGN)."""
    base = tensors[0].untyped_storage().data_ptr()

    def extent(t: torch.Tensor) -> tuple[int, int]:
        start = t.data_ptr()
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
        return start, start + (last + 1) * t.element_size() if t.numel() else start

    views: dict[tuple[int, int], list[torch.Tensor]] = {}
    for t in tensors:
        views.setdefault(extent(t), []).append(t)
    ordered = sorted(views)
    start, end = ordered[0][0], max(e for _, e in ordered)
    used = sum(e - s for s, e in ordered)
    overlapping = any(ordered[i][1] > ordered[i + 1][0] for i in range(len(ordered) - 1))
    if overlapping or end - start <= 2 * used:
        return [(start - (start - base) % ALIGN, end, tensors)]
    return [(s - (s - base) % ALIGN, e, views[(s, e)]) for s, e in ordered]


def place_in_huge_pages(model: nn.Module) -> int:
    """Move `model`'s CPU parameters and buffers into one arena advised for huge pages (see the module
    docstring); returns the bytes moved (0 where the kernel has no transparent huge pages, or there
    is nothing on the CPU to move)."""
    if thp_mode() not in ("always", "madvise"):
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "cpu" and t.numel() and id(t) not in seen:
            seen.add(id(t))
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    spans = [span for tensors in by_storage.values() for span in _spans(tensors)]
    offsets, total = [], 0
    for start, end, _ in spans:
        offsets.append(total)
        total += -(-(end - start) // ALIGN) * ALIGN
    if total == 0:
        return 0
    # whole huge pages from a 2 MB boundary on (the kernel backs only those with huge pages), and
    # room to find that boundary in a mapping that starts on a 4 KB one
    region = mmap.mmap(-1, -(-total // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)   # before the first write: pages are backed when first touched
    arena = torch.frombuffer(region, dtype=torch.uint8)   # (its storage keeps the mapping alive)
    base = -arena.data_ptr() % HUGE_PAGE
    storage = arena.untyped_storage()
    for (start, end, tensors), offset in zip(spans, offsets, strict=True):
        at = base + offset
        source = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
        begin = start - source.data_ptr()
        arena[at:at + end - start].copy_(source[begin:begin + end - start])
        for t in tensors:
            elem = t.element_size()
            moved = torch.empty(0, dtype=t.dtype).set_(storage, (at + t.data_ptr() - start) // elem, t.shape,
                                                       t.stride())
            t.data = moved
    logger.debug("weights moved to huge pages: %.1f MiB", total / 2**20)
    return total
