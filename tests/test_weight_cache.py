"""The converted-weights cache (models/weight_cache.py) on the default model (a Q4_1 GGUF whose
blocks are repacked at load): a second load reads what the first converted and holds the same
tensors, bit for bit, generating the same tokens; a torn entry is discarded and rebuilt; the key
follows the quantization mode and the file's version; nothing is cached when switched off or for a
checkpoint too small to be worth it. Each test has a cache folder of its own."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.models import loader, weight_cache

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "weights"
    monkeypatch.setattr(weight_cache, "cache_dir", lambda: folder)
    return folder


@pytest.fixture
def conversions(monkeypatch):
    """How many times the loader converted a checkpoint (filled the model from it)."""
    calls = []
    fill = loader.fill_parameters
    monkeypatch.setattr(loader, "fill_parameters", lambda *a, **k: (calls.append(1), fill(*a, **k))[1])
    return calls


def tensors(llm: LLM) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in llm.engine.model.named_parameters()}


def generate(llm: LLM) -> list[int]:
    return llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def entries(folder) -> list:
    return sorted(folder.glob("*.safetensors")) if folder.exists() else []


def test_the_second_load_reads_what_the_first_converted(default_gguf_path, cache, conversions):
    first = LLM(str(default_gguf_path))
    assert len(conversions) == 1 and len(entries(cache)) == 1
    second = LLM(str(default_gguf_path))
    assert len(conversions) == 1, "the second load converted again"
    reference = LLM(str(default_gguf_path), weight_cache=False)
    assert len(conversions) == 2 and len(entries(cache)) == 1
    a, b, c = tensors(first), tensors(second), tensors(reference)
    assert a.keys() == b.keys() == c.keys() and any(".qweight.packed" in name for name in a)
    for name in a:
        assert torch.equal(b[name], c[name]) and b[name].dtype == c[name].dtype, name
    assert generate(second) == generate(reference)


def test_symmetric_weights_come_back_without_offsets(tiny_gguf_model, cache, conversions, monkeypatch):
    """A Q8_0 file's weights are held without offsets (zero point 128); the cache keeps them so."""
    monkeypatch.setattr(weight_cache, "MIN_CACHED_BYTES", 0)
    path = str(tiny_gguf_model("llama", "Q8_0"))
    first, second = LLM(path, num_kv_blocks=64), LLM(path, num_kv_blocks=64)
    assert len(conversions) == 1 and len(entries(cache)) == 1
    held = [m.qweight for m in second.engine.model.modules() if getattr(m, "qweight", None) is not None]
    assert held and all(q.zero == 128 and q.offsets is None for q in held)
    a, b = tensors(first), tensors(second)
    assert a.keys() == b.keys() and not any(name.endswith(".offsets") for name in a)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert generate(first) == generate(second)


@pytest.mark.parametrize("kind", ["llama3", "phi3"])
def test_rope_factor_tensors_are_taken_on_a_cache_hit(kind, tiny_gguf_model, cache, conversions, monkeypatch):
    """rope_freqs (Llama 3) and rope_factors_long / _short (Phi-3's longrope) set the rotary tables up,
    not a parameter: a load from the cache takes them from the file too (it once ran without them:
    wrong rotations for Llama 3, every request refused for Phi-3)."""
    monkeypatch.setattr(weight_cache, "MIN_CACHED_BYTES", 0)
    path = str(tiny_gguf_model(kind, "Q8_0"))
    converted = LLM(path, num_kv_blocks=64)
    cached = LLM(path, num_kv_blocks=64)
    assert len(conversions) == 1
    tables = [llm.engine.model.model.rotary for llm in (converted, cached)]
    assert all(torch.equal(getattr(tables[0], b), getattr(tables[1], b)) for b in ("inv_freq", "cos", "sin"))
    assert generate(cached) == generate(converted)


def test_a_torn_entry_is_discarded_and_written_anew(default_gguf_path, cache, conversions, caplog):
    reference = generate(LLM(str(default_gguf_path)))
    [entry] = entries(cache)
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) // 2])
    llm = LLM(str(default_gguf_path))
    assert "unreadable" in caplog.text and len(conversions) == 2
    assert generate(llm) == reference
    assert entries(cache) == [entry] and entry.stat().st_size == len(data)


def test_the_key_follows_the_mode_and_the_files_version(default_gguf_path, cache, conversions, tmp_path):
    model = shutil.copy(default_gguf_path, tmp_path / "model.gguf")
    LLM(str(model))
    [default] = entries(cache)
    LLM(str(model), quantization="int8")   # (its float tensors quantized too: another conversion)
    assert len(conversions) == 2 and len(entries(cache)) == 2
    [int8] = set(entries(cache)) - {default}
    stat = os.stat(model)
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))   # the file "changed"
    LLM(str(model))
    assert len(conversions) == 3
    # The new version's entry replaces the old version's of the same settings; int8's stays.
    assert default not in entries(cache) and int8 in entries(cache) and len(entries(cache)) == 2


def test_nothing_is_cached_when_off_or_small(default_gguf_path, tiny_gguf_model, cache):
    LLM(str(default_gguf_path), weight_cache=False)
    LLM(str(tiny_gguf_model("llama", "Q8_0")))
    assert entries(cache) == []


def test_an_unwritable_cache_folder_leaves_the_load_alone(default_gguf_path, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(weight_cache, "cache_dir", lambda: blocker / "weights")
    llm = LLM(str(default_gguf_path))
    assert "could not write the converted-weights cache" in caplog.text
    assert len(generate(llm)) == GREEDY.max_tokens
