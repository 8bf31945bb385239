"""GGUF files: metadata, tensors of every GGML type, converted to torch tensors one at a time.

The header (metadata and tensor infos) is parsed here, in one pass over the mapped file: the `gguf`
package's GGUFReader makes two numpy arrays per string, which for a 49k-token vocabulary and its
merges took ~2.0 s and ~160 MiB (the default model's load was 2.4 s, mostly that). The `gguf`
package stays the authority for GGML type ids, block sizes and dequantization, and
tests/test_gguf_checkpoint.py holds this parser to GGUFReader on every key and tensor.
`load_tensor` reads and dequantizes a single tensor, so loading a model never holds two full
copies of the weights. `load_raw` returns a quantized tensor's blocks as they are stored
(`GGUFBlocks`), for layers that run them without dequantizing; `load_stacked` does so for each
matrix of a 3-D tensor (llama.cpp's stacked MoE experts). Shapes are returned in torch order
(GGUF stores dimensions innermost-first, i.e. reversed).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
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
    """The user-level reason the header could not be parsed (the parser's errors name byte-level causes)."""
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


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: str                     # GGML type name, e.g. "Q4_1"
    shape: tuple[int, ...]         # torch order
    offset: int                    # of its data, from the start of the file
    n_bytes: int


# GGUF value types (the spec's gguf_type): scalars by struct format; 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class _Cursor:
    """Little-endian reads from a buffer, advancing a position; past the end raises struct.error."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise struct.error(f"a string of {n} bytes runs past the end of the file")
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: one loop, without a call per string)."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = _U64.unpack_from
        for _ in range(count):
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                raise struct.error(f"a string of {n} bytes runs past the end of the file")
            out.append(buf[pos:pos + n].decode("utf-8"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("I"), self.scalar("Q")
            if etype in _SCALARS:   # numbers in one call
                fmt = _SCALARS[etype]
                if count > (len(self.buf) - self.pos) // struct.calcsize(fmt):
                    raise struct.error(f"an array of {count} values runs past the end of the file")
                values = np.frombuffer(self.buf, "<" + fmt if fmt != "?" else np.bool_, count, self.pos)
                self.pos += values.nbytes
                return values.tolist()
            if etype == _STRING:
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self.scalar(_SCALARS[vtype])


def _read_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """The metadata (key -> str, int, float, bool or a list of them, nested for arrays of arrays,
    which GGUFReader flattens) and tensor infos of a GGUF file (versions 2 and 3, little-endian), as
    the GGUF spec lays them out."""
    import gguf

    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        cur.pos = 4
        version = cur.scalar("I")
        if version & 0xFFFF == 0 and version:
            raise UnsupportedModelError(f"{path}: big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (2 or 3, "
                                        "little-endian)")
        n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            if key in metadata:
                raise ValueError(f"metadata key {key!r} appears twice")
            metadata[key] = cur.value(cur.scalar("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
            qtype = gguf.GGMLQuantizationType(cur.scalar("I"))   # ValueError for an unknown id
            offset = cur.scalar("Q")
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            if dims and dims[0] % block:   # GGML stores whole blocks along a row, as GGUFReader checks too
                raise ValueError(f"tensor {name!r} ({qtype.name}): row length {dims[0]} is not a multiple of the "
                                 f"type's block size {block}")
            infos.append((name, qtype.name, tuple(reversed(dims)), offset, math.prod(dims) // block * block_bytes))
        if len({info[0] for info in infos}) < len(infos):
            raise ValueError("a tensor name appears twice")
        alignment = metadata.get("general.alignment", 32)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-cur.pos // alignment) * alignment
    return metadata, [TensorInfo(n, q, shape, start + off, size) for n, q, shape, off, size in infos]


class GGUFCheckpoint:
    """A GGUF file opened for reading.

    `metadata` maps every key to a plain Python value (str, int, float, bool, or a (nested) list of them).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"GGUF file not found: {self.path}")
        try:
            self.metadata, tensors = _read_header(self.path)
        except UnsupportedModelError:   # a TokenmillError, hence a ValueError: not "unreadable"
            raise
        except (OSError, ValueError, struct.error, IndexError, KeyError) as e:
            raise CheckpointError(f"{self.path} is not a readable GGUF file: {_why_unreadable(self.path)} "
                                  f"({type(e).__name__}: {e})") from e
        self._tensors = {t.name: t for t in tensors}
        self._check_extent()

    def _check_extent(self) -> None:
        size = os.path.getsize(self.path)
        for t in self._tensors.values():
            if t.offset + t.n_bytes > size:
                raise CheckpointError(
                    f"{self.path} is truncated: tensor {t.name!r} ends at byte "
                    f"{t.offset + t.n_bytes} but the file has {size} bytes"
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
        return self._tensors[name].qtype

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in torch order (outermost first)."""
        return self._tensors[name].shape

    def load_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Read (and dequantize) one tensor into a new torch tensor of `dtype`."""
        tensor = self.load_raw(name, dtype)
        return tensor.dequantize(dtype) if isinstance(tensor, GGUFBlocks) else tensor

    def _read(self, t: TensorInfo) -> np.ndarray:
        """A tensor's bytes, read from the file (uint8)."""
        out = np.empty(t.n_bytes, np.uint8)
        with open(self.path, "rb") as f:
            f.seek(t.offset)
            if f.readinto(memoryview(out)) != t.n_bytes:
                raise CheckpointError(f"{self.path}: tensor {t.name!r} is cut short")
        return out

    def _info(self, name: str) -> TensorInfo:
        if name not in self._tensors:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        t = self._tensors[name]
        if t.qtype not in FLOAT_TYPES and t.qtype not in SUPPORTED_QUANT_TYPES:
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} has GGML type {t.qtype}, which tokenmill does not support "
                f"(supported: {', '.join(sorted([*FLOAT_TYPES, *SUPPORTED_QUANT_TYPES]))})"
            )
        return t

    def _float(self, t: TensorInfo, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(self._read(t)).view(FLOAT_TYPES[t.qtype]).reshape(t.shape).to(dtype)

    def load_raw(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor | GGUFBlocks:
        """One tensor: a float type as a torch tensor of `dtype`; a quantized 2-D one as its blocks
        (read from the file), other quantized ones dequantized."""
        t = self._info(name)
        qtype, shape = t.qtype, t.shape
        if qtype in FLOAT_TYPES:
            return self._float(t, dtype)
        rows = int(np.prod(shape[:-1]))
        blocks = GGUFBlocks(qtype, (rows, shape[-1]), torch.from_numpy(self._read(t).reshape(rows, -1)))
        if len(shape) == 2:
            return blocks
        return blocks.dequantize(dtype).reshape(shape)

    def load_stacked(self, name: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor | GGUFBlocks]:
        """A 3-D tensor [n, rows, columns] as its n 2-D matrices, each as `load_raw` returns a 2-D
        tensor: quantized ones as their blocks, float ones in `dtype`. llama.cpp stacks the experts
        of a mixture-of-experts layer this way (`ffn_gate_exps`, ...); a row's blocks never span two
        matrices, so each matrix's blocks are a slice of the stored bytes and experts stay quantized."""
        t = self._info(name)
        if len(t.shape) != 3:
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {t.shape}, not [n, rows, columns]")
        n, rows, cols = t.shape
        if t.qtype in FLOAT_TYPES:
            return list(self._float(t, dtype).unbind(0))
        data = torch.from_numpy(self._read(t).reshape(n, rows, -1))
        return [GGUFBlocks(t.qtype, (rows, cols), data[i]) for i in range(n)]
