"""Reading checkpoint files, nothing else.

Two formats: a GGUF file (metadata, tensors in any GGML type, tokenizer data) and a Hugging Face
folder (config.json, safetensors shards, tokenizer files). Both the tokenizer and the models are
built on top of these readers. `open_checkpoint` picks the reader from the path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.checkpoint.gguf import GGUFBlocks, GGUFCheckpoint
from tokenmill.checkpoint.hf import HFCheckpoint
from tokenmill.errors import CheckpointError

__all__ = ["GGUFBlocks", "GGUFCheckpoint", "HFCheckpoint", "open_checkpoint", "split_rows"]


def split_rows(tensor: torch.Tensor | GGUFBlocks, sizes: list[int]) -> list[torch.Tensor | GGUFBlocks]:
    """A fused checkpoint matrix (Phi-3's qkv_proj, an expert's gate_up_proj) cut into its shards
    along the rows; quantized GGUF blocks stay blocks (whole rows)."""
    if isinstance(tensor, GGUFBlocks):
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [tensor.take_rows(torch.arange(start, start + size)) for start, size in zip(starts, sizes, strict=True)]
    return list(tensor.split(sizes))


def open_checkpoint(path: str | Path) -> GGUFCheckpoint | HFCheckpoint:
    """Open a `.gguf` file or a Hugging Face folder, with an error naming the path otherwise."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"model path does not exist: {p}")
    if p.is_dir():
        return HFCheckpoint(p)
    if p.suffix.lower() == ".gguf" or _has_gguf_magic(p):
        return GGUFCheckpoint(p)
    raise CheckpointError(
        f"{p} is neither a .gguf file nor a Hugging Face model folder (config.json + *.safetensors)"
    )


def _has_gguf_magic(p: Path) -> bool:
    try:
        with p.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
