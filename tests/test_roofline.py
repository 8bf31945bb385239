"""`tokenmill bench roofline`: its byte and FLOP counts against transformers' parameter lists, and
the command end to end on a tiny model (no timing assertions)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import make_engine
from transformers import AutoModelForCausalLM

from tokenmill.bench import roofline
from tokenmill.bench.roofline import Machine, StepCost, matmul_flops_per_row, weight_bytes_per_step
from tokenmill.cli import main

EMBEDDINGS = ("embed_tokens", "wte", "wpe")


@pytest.mark.parametrize("kind", ["llama", "smollm", "qwen2", "gpt2"])
def test_bytes_and_flops_match_the_reference_parameter_list(kind, tiny_hf_model):
    path = tiny_hf_model(kind)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tied = hf.config.tie_word_embeddings
    named = dict(hf.named_parameters())     # a tied LM head is listed once, as the embedding
    embed = hf.get_input_embeddings().weight
    read = [p for n, p in named.items() if not any(e in n for e in EMBEDDINGS)] + ([embed] if tied else [])
    engine = make_engine(path)
    cfg = engine.model_config
    assert weight_bytes_per_step(engine.model, cfg.vocab_size) == 4 * sum(p.numel() for p in read)
    matrices = [p for p in read if p.dim() == 2]
    assert matmul_flops_per_row(cfg) == 2 * sum(p.numel() for p in matrices)


def test_roofline_command_end_to_end(tiny_hf_model, tmp_path, capsys):
    out = tmp_path / "roofline.json"
    rc = main(["bench", "roofline", str(tiny_hf_model("smollm")), "--dtype", "float32", "--device", "cpu",
               "--batch-size", "1", "--batch-size", "3", "--context", "20", "--prefill-len", "24", "--steps", "2",
               "--repeats", "1", "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "read bandwidth" in printed and "fraction" in printed
    report = json.loads(out.read_text())
    names = [r["name"] for r in report["rows"]]
    assert names == ["decode batch 1, context 20", "decode batch 3, context 20", "prefill 24 tokens"]
    assert report["machine"]["read_gb_s"] > 0 and report["machine"]["matmul_gflop_s"] > 0
    assert len(report["machine"]["read_samples"]) == 4   # two buffers before the runs, two after
    assert report["machine"]["read_gb_s"] == max(report["machine"]["read_samples"])
    for row in report["rows"]:
        assert row["bound_tok_s"] > 0 and row["measured_tok_s"] > 0
        assert row["bound_by"] in ("memory", "compute")
        assert row["fraction"] == pytest.approx(row["measured_tok_s"] / row["bound_tok_s"])
    batch1, batch3 = report["rows"][0], report["rows"][1]
    assert batch3["bytes"] - batch1["bytes"] == 2 * 21 * report["kv_bytes_per_token"]


def test_roofline_of_a_quantized_model_uses_its_kernel_and_cache(tiny_gguf_model, tmp_path, capsys):
    """A Q4_1 GGUF runs on the 4-bit kernel with a bf16 KV cache (the auto defaults): the compute
    peak is that kernel's, and the KV bytes are the cache's, not the model dtype's."""
    from tokenmill.engine.kv_cache import kv_bytes_per_token

    path = tiny_gguf_model("llama", "Q4_1")
    out = tmp_path / "roofline.json"
    assert main(["bench", "roofline", str(path), "--device", "cpu", "--batch-size", "2", "--context", "20",
                 "--prefill-len", "24", "--steps", "2", "--repeats", "1", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    engine = make_engine(path, "auto", num_kv_blocks=8)
    assert engine.dtype == torch.float32 and engine.kv_dtype == torch.bfloat16
    assert report["kv_bytes_per_token"] == kv_bytes_per_token(engine.model_config, torch.bfloat16)
    assert report["machine"]["matmul"] == "int4 quantized kernel (float32 activations)"
    assert "int4 quantized kernel" in capsys.readouterr().out


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_dense_bf16_peak_is_measured_as_the_model_runs_it(fast_bf16, monkeypatch):
    """A bf16 model's many-row products run in float32 on a CPU without bf16 units (Linear.dense):
    the measured peak is that matmul's, not PyTorch's emulated bf16 one (tens of times slower there,
    which made every large batch look compute-bound)."""
    import tokenmill.layers.linear as linear
    from tokenmill.bench.roofline import measure_machine

    monkeypatch.setattr(linear, "cpu_has_fast_bf16", lambda: fast_bf16)
    calls = []
    def linear_seen(x, w, b=None):
        calls.append((x.dtype, w.dtype))
        return x @ w.t()

    monkeypatch.setattr(torch.nn.functional, "linear", linear_seen)
    machine = measure_machine(torch.bfloat16, buffer_bytes=1 << 20, n=256, repeats=1)
    expected = torch.bfloat16 if fast_bf16 else torch.float32
    assert set(calls) == {(expected, expected)}
    assert machine.matmul == ("bfloat16 matmul (torch)" if fast_bf16 else "bfloat16 weights, float32 matmul (torch)")


@pytest.mark.parametrize("after", [20.0, 5.0])
def test_the_bound_takes_the_higher_bandwidth_of_before_and_after_the_runs(after, monkeypatch):
    # a bandwidth measured at a slow moment (other tenants' traffic) must not lower the bound
    shape = SimpleNamespace(num_heads=1, head_dim=1, num_layers=1)   # (attention's FLOPs: a memory-bound step)
    cost = StepCost(Machine(2, 10.0, 100.0, "test", (10.0,)), 10**9, 1000, 10**6, shape)
    monkeypatch.setattr(roofline, "read_bandwidth_gb_s", lambda: (after, 1.0))
    again = cost.remeasured()
    assert again.machine.read_samples == (10.0, after, 1.0)
    assert again.machine.read_gb_s == max(10.0, after)
    row = again.decode(1, 0, 1.0)
    assert row.bound_tok_s == pytest.approx(max(10.0, after) * 1e9 / (10**9 + 1000))
