"""GGUF files: metadata, tensors of every GGML type, converted to torch tensors one at a time.

The `gguf` package memory-maps the file; `load_tensor` dequantizes a single tensor, so loading a
model never holds two full copies of the weights. Shapes are returned in torch order (GGUF stores
dimensions innermost-first, i.e. reversed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.errors import CheckpointError, UnsupportedModelError

# GGML types we can turn into a torch tensor: plain floats and the common block quantizations.
_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
SUPPORTED_QUANT_TYPES = frozenset(
    ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
     "IQ4_NL", "IQ4_XS"]
)


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
            self._reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises assorted errors on truncated or foreign files
            raise CheckpointError(f"{self.path} is not a readable GGUF file: {_why_unreadable(self.path)} "
                                  f"({type(e).__name__}: {e})") from e
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            try:
                self.metadata[key] = field.contents()
            except Exception as e:
                raise CheckpointError(f"{self.path}: cannot read metadata key {key!r} ({e})") from e
        self._tensors = {t.name: t for t in self._reader.tensors}
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
        import gguf

        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        t = self._tensors[name]
        qtype = t.tensor_type.name
        shape = self.tensor_shape(name)
        if qtype in _FLOAT_TYPES:
            data = np.array(t.data)  # a private copy: the memory map is read-only
            if qtype == "BF16":
                raw = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
            else:
                raw = torch.from_numpy(data)
            return raw.reshape(shape).to(dtype)
        if qtype not in SUPPORTED_QUANT_TYPES:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} has GGML type {qtype}, which tokenmill does not support "
                f"(supported: {', '.join(sorted([*_FLOAT_TYPES, *SUPPORTED_QUANT_TYPES]))})"
            )
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(values).reshape(shape).to(dtype)
