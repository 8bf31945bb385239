"""GGUF files: metadata, tensors of every GGML type, converted to torch tensors one at a time.

The `gguf` package memory-maps the file; `load_tensor` dequantizes a single tensor, so loading a
model never holds two full copies of the weights. `load_raw` returns a quantized tensor's blocks
as they are stored (`GGUFBlocks`), for layers that run them without dequantizing. Shapes are
returned in torch order (GGUF stores dimensions innermost-first, i.e. reversed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.errors import CheckpointError, UnsupportedModelError

# GGML types we can turn into a torch tensor: plain floats and the common block quantizations.
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
SUPPORTED_QUANT_TYPES = frozenset(
    ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
     "IQ4_NL", "IQ4_XS"]
)


@dataclass(frozen=True)
class GGUFBlocks:
    """A quantized 2-D GGUF tensor as stored: `data[n]` holds row n's blocks (uint8, row-major).

    Every row is a whole number of blocks, so row operations (stacking fused projections, llama.cpp's
    Q/K row permutation) work on `data` directly, without dequantizing.
    """

    qtype: str                     # GGML type name, e.g. "Q4_1"
    shape: tuple[int, int]         # (rows, columns) of the dequantized tensor, torch order
    data: torch.Tensor             # uint8 [rows, bytes per row]

    def take_rows(self, index: torch.Tensor) -> GGUFBlocks:
        return GGUFBlocks(self.qtype, (len(index), self.shape[1]), self.data[index])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference dequantization (the `gguf` package's), as a [rows, columns] tensor."""
        import gguf

        values = gguf.quants.dequantize(self.data.numpy(), gguf.GGMLQuantizationType[self.qtype])
        return torch.from_numpy(values).reshape(self.shape).to(dtype)


def _why_unreadable(path: Path) -> str:
    """The user-level reason the GGUF reader failed (its own errors are numpy internals)."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        return f"it cannot be opened ({e.strerror})"
    if not magic:
        return "the file is empty"
    if magic != b"GGUF":
        return "it does not start with the GGUF magic bytes (too short, or not a GGUF file)"
    return "it is truncated or corrupt"


class GGUFCheckpoint:
    """A GGUF file opened for reading.

    `metadata` maps every key to a plain Python value (str, int, float, bool, or a list of them).
    """

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file not found: {self.path}")
        try:
            reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises assorted errors on truncated or foreign files
            raise CheckpointError(f"{self.path} is not a readable GGUF file: {_why_unreadable(self.path)} "
                                  f"({type(e).__name__}: {e})") from e
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception as e:
                raise CheckpointError(f"{self.path}: cannot read metadata key {key!r} ({e})") from e
        # Only the tensors are kept (views of the mapped file): the reader's fields, a numpy array per
        # string of the vocabulary and merges, hold ~100 MiB that the metadata above no longer needs.
        self._tensors = {t.name: t for t in reader.tensors}
        self._check_extent()

    def _check_extent(self) -> None:
        size = os.path.getsize(self.path)
        for t in self._tensors.values():
            if t.data_offset + int(t.n_bytes) > size:
                raise CheckpointError(
                    f"{self.path} is truncated: tensor {t.name!r} ends at byte "
                    f"{t.data_offset + int(t.n_bytes)} but the file has {size} bytes"
                )

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path}: metadata has no general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}`, e.g. arch_get("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in torch order (outermost first)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def load_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Read (and dequantize) one tensor into a new torch tensor of `dtype`."""
        tensor = self.load_raw(name, dtype)
        return tensor.dequantize(dtype) if isinstance(tensor, GGUFBlocks) else tensor

    def _copy(self, t: Any) -> np.ndarray:
        """A private copy of a tensor's data, read from the file rather than through the reader's
        memory map: the map's touched pages would stay resident (the whole file) while the
        checkpoint is open."""
        out = np.empty(t.data.shape, t.data.dtype)
        with open(self.path, "rb") as f:
            f.seek(t.data_offset)
            if f.readinto(memoryview(out).cast("B")) != out.nbytes:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} is cut short")
        return out

    def load_raw(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor | GGUFBlocks:
        """One tensor: a float type as a torch tensor of `dtype`; a quantized 2-D one as its blocks
        (copied out of the memory map), other quantized ones dequantized."""
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        t = self._tensors[name]
        qtype = t.tensor_type.name
        shape = self.tensor_shape(name)
        if qtype in FLOAT_TYPES:
            data = self._copy(t)
            if qtype == "BF16":
                raw = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
            else:
                raw = torch.from_numpy(data)
            return raw.reshape(shape).to(dtype)
        if qtype not in SUPPORTED_QUANT_TYPES:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} has GGML type {qtype}, which tokenmill does not support "
                f"(supported: {', '.join(sorted([*FLOAT_TYPES, *SUPPORTED_QUANT_TYPES]))})"
            )
        rows = int(np.prod(shape[:-1]))
        blocks = GGUFBlocks(qtype, (rows, shape[-1]), torch.from_numpy(self._copy(t).reshape(rows, -1)))
        if len(shape) == 2:
            return blocks
        return blocks.dequantize(dtype).reshape(shape)
