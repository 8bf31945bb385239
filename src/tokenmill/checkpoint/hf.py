"""Hugging Face model folders: config.json, safetensors shards (memory-mapped), generation config.

Only safetensors are read; pickle files (`*.bin`, `*.pt`) are refused because loading them can run
arbitrary code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tokenmill.errors import CheckpointError


class HFCheckpoint:
    """A Hugging Face folder opened for reading. Tensors are read lazily, one at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = self._read_json("config.json", required=True)
        self.generation_config = self._read_json("generation_config.json", required=False)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
            hint = f" (found {', '.join(pickles)}: pickle checkpoints are not loaded, convert to safetensors)" \
                if pickles else ""
            raise CheckpointError(f"{self.path} has no *.safetensors weight files{hint}")
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        for f in files:
            handle = self._open(f)
            for name in handle.keys():
                self._file_of[name] = f

    def _read_json(self, name: str, required: bool) -> dict[str, Any]:
        p = self.path / name
        if not p.is_file():
            if required:
                raise CheckpointError(f"{self.path} has no {name}: not a Hugging Face model folder")
            return {}
        try:
            value = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{p} is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise CheckpointError(f"{p} must hold a JSON object")
        return value

    def _open(self, f: Path) -> Any:
        from safetensors import safe_open

        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors raises SafetensorError on corrupt headers or truncation
            raise CheckpointError(f"{f} is not a readable safetensors file ({e})") from e
        self._handles[f] = handle
        return handle

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        if not archs:
            raise CheckpointError(f"{self.path}/config.json has no 'architectures' entry")
        return str(archs[0])

    def tensor_names(self) -> list[str]:
        return list(self._file_of)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def load_tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if name not in self._file_of:
            raise CheckpointError(f"{self.path}: no tensor named {name!r}")
        f = self._file_of[name]
        try:
            t = self._handles[f].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{f}: cannot read tensor {name!r} ({e})") from e
        return t.to(dtype)
