"""Converted weights kept on disk, so that the next load of the same checkpoint reads them instead of
converting again.

Converting is most of a quantized load: GGUF blocks are repacked for the C kernel, other types
requantized, float weights quantized in modes int8 / int4 (loader.py). The result, every parameter
of the loaded model, is written once as a safetensors file under the cache folder
(tokenmill/cache.py: weights/), with a list of the layers that hold a QuantWeight and their shapes;
a later load with the same key builds the model's modules and takes the tensors from the file.

The key: the checkpoint's resolved path, the size and modification time of each of its files, the
model class, the quantization mode, the compute dtype, and WEIGHT_FORMAT (bumped whenever a
converted form changes: quant.py's packing, gguf_quant.py's conversions). A checkpoint changed in
place gets a new key; writing an entry removes those of the other versions of the same path with
the same settings.
Only checkpoints whose converted weights hold at least MIN_CACHED_BYTES are cached (a small model
converts in less time than the file takes to read). A file that cannot be read is discarded and the
load converts as if there were none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from tokenmill import memory
from tokenmill.cache import cache_root
from tokenmill.layers.linear import Embedding, Linear
from tokenmill.layers.quant import QuantWeight

logger = logging.getLogger(__name__)

WEIGHT_FORMAT = 2
MIN_CACHED_BYTES = 16 << 20
QUANTIZED_KEY = "tokenmill.quantized"   # safetensors metadata: {module path: [out, in, bits, zero point]}


def cache_dir() -> Path:
    return cache_root() / "weights"


def _checkpoint_files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())


def entry_path(checkpoint: Path, model_class: str, quantization: str, dtype: torch.dtype) -> Path:
    """The cache file for these inputs (it may not exist)."""
    checkpoint = checkpoint.resolve()
    files = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in _checkpoint_files(checkpoint)]
    # <checkpoint>-<settings>-<version of its files>: a new version replaces the entry of its settings
    parts = (str(checkpoint), [WEIGHT_FORMAT, model_class, quantization, str(dtype)], files)
    return cache_dir() / ("-".join(_digest(p) for p in parts) + ".safetensors")


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def _quantized_modules(model: nn.Module) -> dict[str, QuantWeight]:
    return {name: m.qweight for name, m in model.named_modules()
            if isinstance(m, (Linear, Embedding)) and m.qweight is not None}


def load(model: nn.Module, entry: Path, dtype: torch.dtype) -> bool:
    """Fill `model` (built, not filled) from `entry`. False where the entry cannot be read or does
    not fit the model: the entry is then deleted, and `model` may be half changed (build it anew)."""
    try:
        tensors, metadata = read_entry(entry)
        quantized = json.loads(metadata[QUANTIZED_KEY])
        modules = dict(model.named_modules())
        for name, (out_features, in_features, bits, zero) in quantized.items():
            prefix = f"{name}.qweight."
            offsets = None if zero is not None else tensors[prefix + "offsets"]
            modules[name].set_quantized(QuantWeight.from_packed(
                tensors[prefix + "packed"], tensors[prefix + "scales"], offsets, zero,
                out_features, in_features, bits, dtype))
        params = dict(model.named_parameters())
        if set(params) != set(tensors):
            raise ValueError(f"its tensors are not the model's: {sorted(set(params) ^ set(tensors))[:4]}")
        for name, param in params.items():
            if param.shape != tensors[name].shape or param.dtype != tensors[name].dtype:
                raise ValueError(f"{name}: {tuple(tensors[name].shape)} {tensors[name].dtype} in the file, "
                                 f"{tuple(param.shape)} {param.dtype} in the model")
            param.data = tensors[name]
    except Exception as e:   # a torn or foreign file: convert instead (and write it anew)
        logger.warning("converted-weights cache %s unreadable (%s); converting the checkpoint", entry, e)
        entry.unlink(missing_ok=True)
        return False
    return True


# safetensors' dtype names (its format's documentation) of the tensors a model holds
DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
          "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
          "BOOL": torch.bool}


def read_entry(entry: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An entry's tensors and metadata, read into one mapping on huge pages (memory.py: a decode step
    reads every weight). The safetensors library maps the file or copies each tensor into memory of its
    own; this reads the format's header (8 bytes of length, then JSON: each tensor's dtype, shape and
    byte range in the data that follows) and the data in one piece into the mapping, of which the
    tensors are views. ValueError where the file is not a whole entry."""
    with entry.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= size - 8:
            raise ValueError(f"header length {length} in a file of {size} bytes")
        header = json.loads(f.read(length))
        data = memory.anonymous_bytes(size - 8 - length, huge_pages=True)
        view, done = memoryview(data.numpy()), 0
        while done < len(view):   # (a read returns at most ~2 GB)
            got = f.readinto(view[done:])
            if not got:
                raise ValueError(f"the file ends {len(view) - done} bytes early")
            done += got
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        dtype, shape, (begin, end) = DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
        if not (0 <= begin <= end <= len(view) and end - begin == math.prod(shape) * dtype.itemsize
                and begin % dtype.itemsize == 0):
            raise ValueError(f"{name}: bytes [{begin}, {end}) for {info['dtype']} {shape}")
        tensors[name] = data[begin:end].view(dtype).view(shape)
    return tensors, metadata


def save(model: nn.Module, entry: Path) -> None:
    """Write `model`'s parameters as `entry` (atomically: a reader never sees a partial file) and
    remove the entries of other versions of the same checkpoint."""
    quantized = _quantized_modules(model)
    tensors = {name: p.data.contiguous() for name, p in model.named_parameters()}
    if sum(t.numel() * t.element_size() for t in tensors.values()) < MIN_CACHED_BYTES:
        return
    metadata = {QUANTIZED_KEY: json.dumps({name: [q.out_features, q.in_features, q.bits, q.zero]
                                           for name, q in quantized.items()})}
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=entry.stem, suffix=".tmp")
        os.close(fd)
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, entry)
    except OSError as e:   # (a full disk or a read-only cache: the load itself succeeded)
        logger.warning("could not write the converted-weights cache %s: %s", entry, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return
    checkpoint_and_settings = entry.name.rsplit("-", 1)[0]
    for old in entry.parent.glob(f"{checkpoint_and_settings}-*.safetensors"):
        if old != entry:
            old.unlink(missing_ok=True)
    logger.info("converted weights cached in %s", entry)
