"""What the OS says about this process's memory (Linux's /proc/self)."""

from __future__ import annotations

import torch


def resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def advised_huge(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte carries MADV_HUGEPAGE ("hg" in its VmFlags)."""
    address, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
