"""Ops that have a fast kernel beside their plain PyTorch reference (vLLM's CustomOp shape).

Each op subclass has a plain PyTorch path (`forward_native`: the oracle every faster path is tested
against) and runs its kernel where `backend` is "auto" and the kernel applies: the op makes that
choice itself, in one place, never a global switch. `set_backend(model, "torch", OpType)` pins a
model's ops of one type to the reference: the engine does it for attention
(`EngineConfig.attention_backend`), tests do it to compare the two paths.
"""

from __future__ import annotations

from torch import nn

BACKENDS = ("auto", "torch")


class KernelOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backend = "auto"   # "torch": always forward_native


_generation = 0  # bumped by every set_backend and weight swap: plans built before are rebuilt


def backend_generation() -> int:
    return _generation


def invalidate_plans() -> None:
    """C plans built so far (they hold the ops' choices and raw pointers to their weights) are
    stale: the next step rebuilds them."""
    global _generation
    _generation += 1


def set_backend(model: nn.Module, backend: str,
                op_type: type[KernelOp] | tuple[type[KernelOp], ...] = KernelOp) -> None:
    """Run every `op_type` op of `model` with `backend` ("auto" or "torch")."""
    invalidate_plans()
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    for module in model.modules():
        if isinstance(module, op_type):
            module.backend = backend
