"""models/huge_pages.py: a CPU model's weights moved into one mapping advised for transparent huge
pages, the same values, the same sharing between tensors, and the same outputs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from tokenmill import LLM, SamplingParams
from tokenmill.models import huge_pages, loader
from tokenmill.models.huge_pages import place_in_huge_pages, thp_mode

THP = thp_mode() in ("always", "madvise")
needs_thp = pytest.mark.skipif(not THP, reason="this kernel has no transparent huge pages (mode never or absent)")


def mapping_of(address: int) -> tuple[int, int]:
    """The [start, end) of the mapping in /proc/self/maps that holds `address`."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return start, end
    raise AssertionError(f"{address:#x} is in no mapping")


def thp_eligible(start: int) -> bool:
    """/proc/self/smaps's THPeligible flag of the mapping that starts at `start`."""
    text = Path("/proc/self/smaps").read_text()
    block = text.split(f"{start:x}-", 1)[1].split("VmFlags", 1)[0]
    found = re.search(r"THPeligible:\s+(\d)", block)
    if found is None:
        pytest.skip("this kernel's smaps has no THPeligible field")
    return found.group(1) == "1"


def test_thp_mode_reads_the_chosen_word(tmp_path, monkeypatch):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_ENABLED", tmp_path / "enabled")
    assert thp_mode() == "madvise"
    monkeypatch.setattr(huge_pages, "THP_ENABLED", tmp_path / "absent")
    assert thp_mode() == ""


def test_nothing_is_moved_without_transparent_huge_pages(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    layer = nn.Linear(64, 64)
    before = layer.weight.data_ptr()
    assert place_in_huge_pages(layer) == 0
    assert layer.weight.data_ptr() == before


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.head = nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight           # one Parameter in two modules
        self.norm = nn.Parameter(torch.randn(64, dtype=torch.float64))
        packed = torch.randint(0, 64, (4096,), dtype=torch.uint8)   # (as float16: no NaN)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", packed[1024:3072].view(torch.float16))   # a view of another tensor
        self.odd = nn.Parameter(torch.randn(7, 5).t(), requires_grad=False)  # not contiguous


@needs_thp
def test_every_tensor_moves_into_one_advised_mapping_with_its_values_and_sharing():
    torch.manual_seed(0)
    model = Tied()
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    values = {name: t.detach().clone() for name, t in tensors.items()}
    old = {name: t.data_ptr() for name, t in tensors.items()}
    moved = place_in_huge_pages(model)
    assert moved > 0
    start, end = mapping_of(model.embed.weight.data_ptr())
    for name, t in (dict(model.named_parameters()) | dict(model.named_buffers())).items():
        assert t.data_ptr() != old[name], name
        assert start <= t.data_ptr() < end, f"{name} is outside the arena"
        assert t.data_ptr() % 64 == old[name] % 64, f"{name} lost its alignment"
        assert torch.equal(t, values[name]), name
    assert thp_eligible(start)
    assert model.head.weight is model.embed.weight
    assert model.odd.stride() == (1, 5)
    model.packed[1024:1026] = 0          # the view still reads its base's memory
    assert model.scales[0].item() == 0
    assert isinstance(model.norm, nn.Parameter) and model.norm.dtype == torch.float64


@needs_thp
def test_views_far_apart_in_a_large_storage_are_copied_alone():
    big = torch.zeros(1 << 22, dtype=torch.uint8)      # (a whole checkpoint file, say)
    module = nn.Module()
    module.register_buffer("a", big[64:64 + 1024])
    module.register_buffer("b", big[(1 << 22) - 2048:(1 << 22) - 1024])
    moved = place_in_huge_pages(module)
    assert moved <= 4096, "the storage between the two views was copied"
    assert module.a.data_ptr() != big.data_ptr() + 64


@needs_thp
def test_a_loaded_model_runs_from_huge_pages_with_the_same_outputs(tiny_gguf_model, monkeypatch):
    path = str(tiny_gguf_model("llama", "Q4_0"))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    placed = LLM(model=path, threads=2)
    model = placed.engine.runner.model
    start, end = mapping_of(next(model.parameters()).data_ptr())
    assert all(start <= t.data_ptr() < end for t in [*model.parameters(), *model.buffers()])
    assert thp_eligible(start)
    monkeypatch.setattr(loader, "place_in_huge_pages", lambda module: 0)
    plain = LLM(model=path, threads=2)
    assert not start <= next(plain.engine.runner.model.parameters()).data_ptr() < end
    a, b = (llm.generate(["Hello there"], params)[0].outputs[0] for llm in (placed, plain))
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs
