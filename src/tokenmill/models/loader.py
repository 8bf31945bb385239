"""Build a model from a checkpoint and fill its parameters, one checkpoint tensor at a time.

Every model class provides:
  - `config_from_hf(fields)` / `config_from_gguf(ckpt, fields)` -> ModelConfig (ConfigFields: typed
    reads whose errors name the file and key)
  - `model.checkpoint_tensors(ckpt)` -> iterator of (hf_style_name, tensor): GGUF names are mapped onto
    HF names (and llama.cpp's layout changes undone) by the model file, so the loader sees one
    naming scheme
  - `stacked_params`: HF projection name -> (fused module name, shard index), e.g. q_proj ->
    (qkv_proj, 0); the shard is copied into its rows of the fused weight
  - `ignored_tensors`: names in checkpoints that carry nothing we need (e.g. cached rotary buffers)

The loader checks that every checkpoint tensor was used and every parameter (every shard) filled.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from tokenmill.checkpoint import GGUFCheckpoint, HFCheckpoint
from tokenmill.config import ConfigFields, ModelConfig
from tokenmill.errors import CheckpointError
from tokenmill.layers.linear import Linear
from tokenmill.models import get_model_class


def load_model(ckpt: GGUFCheckpoint | HFCheckpoint, dtype: torch.dtype, device: torch.device,
               show_progress: bool = False) -> tuple[nn.Module, ModelConfig]:
    cls = get_model_class(ckpt.architecture)
    if isinstance(ckpt, GGUFCheckpoint):
        config = cls.config_from_gguf(ckpt, ConfigFields(ckpt.metadata, str(ckpt.path), f"{ckpt.architecture}."))
    else:
        config = cls.config_from_hf(ConfigFields(ckpt.config, str(ckpt.path / "config.json")))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    fill_parameters(model, model.checkpoint_tensors(ckpt), len(ckpt.tensor_names()),
                    str(ckpt.path), show_progress)
    model.eval()
    return model, config


def fill_parameters(model: nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], total: int,
                    source: str, show_progress: bool) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    shard_counts = {f"{name}.{leaf}": len(mod.shard_sizes)
                    for name, mod in model.named_modules() if isinstance(mod, Linear)
                    for leaf in ("weight", "bias") if getattr(mod, leaf) is not None}
    filled: dict[str, set[int]] = {}
    ignored = [re.compile(p) for p in model.ignored_tensors]
    stacked: dict[str, tuple[str, int]] = model.stacked_params
    for name, tensor in tqdm(tensors, total=total, desc="Loading weights", unit="tensor",
                             disable=not show_progress, leave=False):
        if any(p.fullmatch(name) for p in ignored):
            continue
        module_path, _, leaf = name.rpartition(".")
        parent, _, proj = module_path.rpartition(".")
        shard = 0
        if proj in stacked:
            fused, shard = stacked[proj]
            target = f"{parent}.{fused}.{leaf}"
        else:
            target = name
        param = params.get(target)
        if param is None:
            raise CheckpointError(f"{source}: tensor {name!r} does not match any parameter of "
                                  f"{type(model).__name__}")
        if target in shard_counts:
            sizes = _module_of(model, target).shard_sizes
            offset = sum(sizes[:shard])
            dest = param.data.narrow(0, offset, sizes[shard])
        else:
            dest = param.data
        if tuple(dest.shape) != tuple(tensor.shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        filled.setdefault(target, set()).add(shard)
    missing = [n for n in params if len(filled.get(n, ())) < shard_counts.get(n, 1)]
    if missing:
        raise CheckpointError(f"{source}: checkpoint has no values for {', '.join(sorted(missing)[:8])}"
                              + (" ..." if len(missing) > 8 else ""))


def _module_of(model: nn.Module, param_name: str) -> Linear:
    return model.get_submodule(param_name.rpartition(".")[0])
