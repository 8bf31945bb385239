"""Weights on huge pages (tokenmill/memory.py): moving a model's tensors keeps every value, dtype,
shape, stride and alias, frees what they held, and puts them in a mapping advised for huge pages;
a loaded model's weights are there whether converted or read from the weight cache."""

from __future__ import annotations

import sys

import pytest
import torch
from memory_helpers import advised_huge
from torch import nn

from tokenmill import LLM, memory
from tokenmill.models import weight_cache

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")


def small_model() -> nn.Module:
    m = nn.Module()
    m.embed = nn.Embedding(50, 16)
    m.head = nn.Linear(16, 50, bias=False)
    m.head.weight = m.embed.weight                       # tied: one parameter in two modules
    m.proj = nn.Linear(16, 24)
    m.scale = nn.Parameter(torch.rand(7, dtype=torch.float16))
    m.register_buffer("table", torch.arange(96, dtype=torch.int64).view(8, 12))
    m.register_buffer("part", m.table[2:6, 3:9])         # a strided view of another buffer
    return m


def test_moving_keeps_values_strides_and_aliases():
    m = small_model()
    before = {name: (t.clone(), t.dtype, t.shape, t.stride())
              for name, t in (*m.named_parameters(), *m.named_buffers())}
    olds = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*m.parameters(), *m.buffers())}
    assert len(olds) == 5   # (embed = head, proj's weight and bias, scale, table = part)
    moved = memory.move_weights_to_huge_pages(m)
    assert moved == sum(-(-n // memory.ALIGN) * memory.ALIGN for n in olds.values())
    for name, t in (*m.named_parameters(), *m.named_buffers()):
        value, dtype, shape, stride = before[name]
        assert torch.equal(t, value) and (t.dtype, t.shape, t.stride()) == (dtype, shape, stride), name
        assert t.untyped_storage().data_ptr() not in olds, f"{name} was not moved"
    assert m.head.weight is m.embed.weight
    m.part[0, 0] = -1                                    # still a view of `table`
    assert m.table[2, 3] == -1
    assert isinstance(m.proj.weight, nn.Parameter) and m.proj(torch.ones(2, 16)).shape == (2, 24)


@linux_only
def test_moved_tensors_are_on_a_mapping_advised_for_huge_pages():
    # (the check itself tells the two apart; a malloc'd tensor is no control: in a long test session
    # one was once found inside a mapping advised for huge pages)
    assert advised_huge(memory.anonymous_bytes(4096, huge_pages=True))
    assert not advised_huge(memory.anonymous_bytes(4096))
    m = small_model()
    total = memory.move_weights_to_huge_pages(m)
    assert all(advised_huge(t) for t in (*m.parameters(), *m.buffers()))
    first = min(t.data_ptr() for t in (*m.parameters(), *m.buffers()))
    assert first % memory.HUGE_PAGE == 0   # (where the mapping's aligned part starts)
    assert all(first <= t.data_ptr() < first + total for t in (*m.parameters(), *m.buffers()))   # one mapping


@linux_only
@pytest.mark.parametrize("from_cache", [False, True])
def test_a_loaded_models_weights_are_on_huge_pages(from_cache, default_gguf_path, tmp_path, monkeypatch):
    monkeypatch.setattr(weight_cache, "cache_dir", lambda: tmp_path / "weights")
    if from_cache:
        LLM(str(default_gguf_path), num_kv_blocks=16)    # converts and writes the entry
        assert list((tmp_path / "weights").glob("*.safetensors"))
    llm = LLM(str(default_gguf_path), num_kv_blocks=16)
    params = list(llm.engine.model.parameters())
    assert params and all(advised_huge(p) for p in params)
