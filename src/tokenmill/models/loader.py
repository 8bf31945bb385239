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

Quantization (`EngineConfig.quantization`, CPU only). The weights of Linear and Embedding layers are
collected shard by shard (GGUF quantized tensors as their blocks, `GGUFBlocks`) and, once a layer
has all its shards, turned into one weight by `build_weight`:

  None (default)  GGUF Q4_0/Q4_1/Q4_K -> 4 bits per value; Q5_0/Q5_1/Q5_K/Q8_0 -> 8 bits, both in
                  groups of 32 (layers/gguf_quant.py); other quantized types -> requantized to 8 bits
                  per group of 32; float tensors stay dense
  "none"          everything dequantized to the compute dtype (the reference)
  "int8" | "int4" as None, and float tensors are quantized too: 8 or 4 bits per group of 32
A fused layer takes the widest form among its shards (4 < 8 bits); a layer mixing a dense shard with
quantized ones stays dense (modes int8/int4 quantize that shard too).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from tokenmill import memory, parallel
from tokenmill.checkpoint import GGUFBlocks, GGUFCheckpoint, HFCheckpoint
from tokenmill.checkpoint.gguf import FLOAT_TYPES
from tokenmill.config import ConfigFields, ModelConfig
from tokenmill.errors import CheckpointError, TokenmillError
from tokenmill.layers.gguf_quant import FOUR_BIT_TYPES, gguf_to_blocks
from tokenmill.layers.linear import Embedding, Linear
from tokenmill.layers.quant import GROUP_SIZE, BlockQuant, QuantWeight, kernel_available, quantize
from tokenmill.models import get_model_class, weight_cache

logger = logging.getLogger(__name__)

Shard = torch.Tensor | GGUFBlocks | BlockQuant   # BlockQuant: a quantized matrix cut by tensor parallelism


def checkpoint_config(ckpt: GGUFCheckpoint | HFCheckpoint) -> tuple[type, ModelConfig]:
    """The model class of a checkpoint and its config (read from its metadata; no weights loaded)."""
    architecture = ckpt.architecture
    if isinstance(ckpt, GGUFCheckpoint) and architecture == "llama" and ckpt.metadata.get("llama.expert_count"):
        architecture = "mixtral"  # llama.cpp converts Mixtral as a llama with experts
    cls = get_model_class(architecture)
    if isinstance(ckpt, GGUFCheckpoint):
        return cls, cls.config_from_gguf(ckpt, ConfigFields(ckpt.metadata, str(ckpt.path), f"{ckpt.architecture}."))
    return cls, cls.config_from_hf(ConfigFields(ckpt.config, str(ckpt.path / "config.json")))


def load_model(ckpt: GGUFCheckpoint | HFCheckpoint, dtype: torch.dtype, device: torch.device,
               show_progress: bool = False, quantization: str | None = None,
               max_model_len: int | None = None, use_weight_cache: bool = False,
               tp: parallel.TensorParallel = parallel.SINGLE,
               int8_activations: bool = False) -> tuple[nn.Module, ModelConfig]:
    """The model and its config. `max_model_len` below the checkpoint's context builds the model for
    that context: rotary tables of that length, and the rope choices that depend on it (longrope's
    factor set, dynamic NTK) made for it, as llama.cpp makes them for its context size.
    `use_weight_cache`: read quantized weights converted by an earlier load of the same checkpoint,
    or keep them for the next one (models/weight_cache.py); CPU quantized loads only.
    `tp`: build and fill rank `tp.rank`'s part of the model (tokenmill/parallel.py).
    `int8_activations`: every quantized weight rounds its activations to int8 (QuantWeight)."""
    quantization = _check_quantization(quantization, device)
    cls, config = checkpoint_config(ckpt)
    if max_model_len is not None and max_model_len < config.max_position_embeddings:
        config = dataclasses.replace(config, max_position_embeddings=max_model_len)

    def build() -> nn.Module:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device), parallel.building(tp):
                return cls(config)
        finally:
            torch.set_default_dtype(previous)

    model = build()
    entry = None
    if use_weight_cache and device.type == "cpu" and quantization != "none":
        part = "" if tp.size == 1 else f"-tp{tp.rank}of{tp.size}"   # (each rank caches its own part)
        entry = weight_cache.entry_path(ckpt.path, cls.__name__ + part, quantization, dtype)
    cached = entry is not None and entry.exists()
    if cached and not weight_cache.load(model, entry, dtype):
        cached, model = False, build()   # (the failed read may have changed it)
    if not cached:
        fill_parameters(model, model.checkpoint_tensors(ckpt), len(ckpt.tensor_names()),
                        str(ckpt.path), show_progress, quantization, dtype)
        if entry is not None and weight_forms(model).keys() - {"dense"}:
            weight_cache.save(model, entry)
        if device.type == "cpu":   # (a cache hit's tensors were read onto huge pages)
            memory.move_weights_to_huge_pages(model)
    for module in model.modules():
        if isinstance(module, QuantWeight):
            module.int8_activations = int8_activations
    model.set_up(ckpt)
    model.eval()
    logger.info("weights (quantization %s%s%s): %s", quantization, ", int8 activations" if int8_activations else "",
                f", read from {entry}" if cached else "",
                ", ".join(f"{form} x{count}" for form, count in weight_forms(model).items()))
    return model, config


def weight_forms(model: nn.Module) -> dict[str, int]:
    """How many Linear/Embedding layers hold each weight form: dense, int4, int8."""
    forms: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (Linear, Embedding)):
            q = module.qweight
            form = "dense" if q is None else f"int{q.bits}"
            forms[form] = forms.get(form, 0) + 1
    return dict(sorted(forms.items()))


def runs_quantized(ckpt: GGUFCheckpoint | HFCheckpoint, quantization: str | None, device: torch.device) -> bool:
    """Whether load_model will hold weights quantized: modes int8/int4, or a GGUF with quantized types
    in the default mode (known before loading, so that the compute dtype can follow it). For a GGUF it
    is a forecast from the tensor types: a file whose only quantized tensors stay dense (a fused layer
    mixing dense and quantized shards) gets float32 where bf16 would do, which is always correct."""
    mode = _check_quantization(quantization, device)
    if mode != "auto":
        return mode != "none"
    return isinstance(ckpt, GGUFCheckpoint) and any(
        ckpt.tensor_type(name) not in FLOAT_TYPES for name in ckpt.tensor_names())


def _check_quantization(quantization: str | None, device: torch.device) -> str:
    """The effective mode: the quantized kernel runs on CPU only; elsewhere None means "none"."""
    if device.type != "cpu" or not kernel_available():
        if quantization in ("int8", "int4"):
            where = "on CPU only" if device.type != "cpu" else "with the C kernel only (no C compiler here?)"
            raise TokenmillError(f"quantization: {quantization!r} runs {where}")
        return "none"
    return "auto" if quantization is None else quantization


def fill_parameters(model: nn.Module, tensors: Iterator[tuple[str, Shard]], total: int,
                    source: str, show_progress: bool, quantization: str = "none",
                    dtype: torch.dtype = torch.float32) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = {name: mod for name, mod in model.named_modules() if isinstance(mod, (Linear, Embedding))}
    shard_counts = {f"{name}.{leaf}": len(mod.shard_sizes)
                    for name, mod in model.named_modules() if isinstance(mod, Linear)
                    for leaf in ("weight", "bias") if getattr(mod, leaf) is not None}
    # weights that may be quantized: collected until every shard is there, then built at once
    quantizable = {} if quantization == "none" else {
        f"{name}.weight": mod for name, mod in model.named_modules()
        if isinstance(mod, (Linear, Embedding)) and not mod.keep_dense}
    staged: dict[str, dict[int, Shard]] = {}
    filled: dict[str, set[int]] = {}
    ignored = [re.compile(p) for p in model.ignored_tensors]
    stacked: dict[str, tuple[str, int]] = model.stacked_params
    # disable=None: no bar when stderr is not a terminal, where its \r frames would only clutter a
    # server's or CI's log.
    for name, tensor in tqdm(tensors, total=total, desc="Loading weights", unit="tensor",
                             disable=None if show_progress else True, leave=False):
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
        owner = modules.get(target.rpartition(".")[0])
        if owner is not None and (owner.rows is not None or owner.cols is not None):
            tensor = _rank_part(owner, target.rpartition(".")[2], shard, tensor, quantization, f"{source}: {name}")
            if tensor is None:   # a row-parallel layer's bias, held by rank 0
                continue
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
        filled.setdefault(target, set()).add(shard)
        if target in quantizable:
            staged.setdefault(target, {})[shard] = tensor
            if len(staged[target]) == shard_counts.get(target, 1):
                shards = staged.pop(target)
                _set_weight(quantizable[target], param, [shards[i] for i in range(len(shards))],
                            quantization, dtype)
            continue
        dest.copy_(_dense(tensor))
    missing = [n for n in params if len(filled.get(n, ())) < shard_counts.get(n, 1)]
    if missing:
        raise CheckpointError(f"{source}: checkpoint has no values for {', '.join(sorted(missing)[:8])}"
                              + (" ..." if len(missing) > 8 else ""))


def _module_of(model: nn.Module, param_name: str) -> Linear:
    return model.get_submodule(param_name.rpartition(".")[0])


def _set_weight(module: Linear | Embedding, param: nn.Parameter, shards: list[Shard], quantization: str,
                dtype: torch.dtype) -> None:
    weight = build_weight(shards, quantization, dtype)
    if weight is None:
        param.data.copy_(torch.cat([_dense(s) for s in shards]))
    else:
        module.set_quantized(weight)


def _dense(shard: Shard) -> torch.Tensor:
    return shard if isinstance(shard, torch.Tensor) else shard.dequantize()


def _rank_part(module: Linear | Embedding, leaf: str, shard: int, tensor: Shard, quantization: str,
               what: str) -> Shard | None:
    """The part of a checkpoint tensor that this tensor-parallel rank holds (layers/linear.py's
    `rows` / `cols`); None where it holds none of it. A quantized matrix keeps its quantized form:
    rows are whole blocks; columns are cut along whole groups of 32, after conversion to BlockQuant
    (a K-quant's 256-value super-blocks do not always fall on the cut)."""
    if module.rows is not None:
        index = torch.cat([torch.arange(r.start, r.stop) for r in module.rows[shard]])
        return tensor.take_rows(index) if isinstance(tensor, GGUFBlocks) else tensor[index]
    cols = module.cols
    if leaf == "bias":
        return tensor if module.bias is not None else None
    if isinstance(tensor, GGUFBlocks):
        bits = _shard_bits(tensor, quantization)
        tensor = tensor.dequantize() if quantization == "none" or module.keep_dense else _shard_blocks(tensor, bits)
    if isinstance(tensor, torch.Tensor):
        return tensor[:, cols.start:cols.stop]
    if cols.start % GROUP_SIZE or cols.stop % GROUP_SIZE:
        raise CheckpointError(f"{what}: tensor parallelism cuts its columns at {cols.start}-{cols.stop}, not along "
                              f"its quantization groups of {GROUP_SIZE}")
    groups = slice(cols.start // GROUP_SIZE, cols.stop // GROUP_SIZE)
    return BlockQuant(tensor.u[:, cols.start:cols.stop], tensor.d[:, groups], tensor.m[:, groups], tensor.bits)


def _shard_bits(shard: Shard, quantization: str) -> int | None:
    """Bits per value a shard would be held in (4 or 8), or None: dense."""
    if isinstance(shard, BlockQuant):
        return shard.bits
    if isinstance(shard, GGUFBlocks):
        return 4 if shard.qtype in FOUR_BIT_TYPES else 8
    if quantization in ("int8", "int4") and shard.shape[-1] % GROUP_SIZE == 0:
        return 8 if quantization == "int8" else 4
    return None


def _shard_blocks(shard: Shard, bits: int) -> BlockQuant:
    if isinstance(shard, BlockQuant):
        return shard.widened(bits)
    if isinstance(shard, GGUFBlocks):
        q = gguf_to_blocks(shard)
        if q is None:  # no exact form (Q6_K, ...): 8 bits per group of 32
            q = quantize(shard.dequantize(), 8)
    else:
        q = quantize(shard, bits)
    return q.widened(bits)


def build_weight(shards: list[Shard], quantization: str, dtype: torch.dtype) -> QuantWeight | None:
    """One quantized weight for a layer's shards (stacked along rows), or None: keep it dense."""
    bits = [_shard_bits(s, quantization) for s in shards]
    if None in bits:
        return None
    return QuantWeight(BlockQuant.cat([_shard_blocks(s, max(bits)) for s in shards]), dtype)
