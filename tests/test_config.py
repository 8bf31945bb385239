"""dtype 'auto' follows the hardware: bf16 for dense weights (on a CPU without bf16 units too: a decode
step reads half the bytes, and the many-row products run in float32), and float32 for quantized
execution on a CPU (its kernels take float32 activations)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill import TokenmillError, config
from tokenmill.layers import linear


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_auto_dtype_on_cpu_is_bf16_for_dense_weights(monkeypatch, fast_bf16):
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert config.resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_bf16_prefill_products_run_in_float32_without_bf16_units(monkeypatch, fast_bf16):
    """A bf16 CPU weight's many-row product: PyTorch's bf16 matmul where the CPU has bf16 units, else
    (where PyTorch emulates it, several times slower) float32 products of the same bf16 values, exact,
    rounded once to bf16: the same values as PyTorch's emulation, which also sums in float32."""
    monkeypatch.setattr(linear, "cpu_has_fast_bf16", lambda: fast_bf16)
    g = torch.Generator().manual_seed(0)
    layer = linear.Linear(96, 40, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=g))
        layer.bias.copy_(torch.randn(40, generator=g))
    x = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float(), layer.bias.float()).to(torch.bfloat16)
    real, dtypes = F.linear, []
    monkeypatch.setattr(F, "linear", lambda *a: dtypes.append(a[1].dtype) or real(*a))
    got = layer.dense(x, layer.weight, layer.bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert dtypes == [torch.bfloat16 if fast_bf16 else torch.float32]


def test_auto_dtype_is_float32_for_quantized_execution_on_cpu(monkeypatch):
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: True)
    assert config.resolve_dtype("auto", torch.device("cpu"), quantized=True) == torch.float32
    assert config.resolve_dtype("auto", torch.device("cpu"), quantized=False) == torch.bfloat16
    assert config.resolve_dtype("bfloat16", torch.device("cpu"), quantized=True) == torch.bfloat16


def test_auto_dtype_on_cuda_is_bf16_where_native(monkeypatch):
    """bf16 on the device asked for when it is Ampere or newer, else fp16 (a V100 beside an A100)."""
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: False)
    capability = {0: (8, 0), 1: (7, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[device.index or 0])
    assert config.resolve_dtype("auto", torch.device("cuda:0")) == torch.bfloat16
    assert config.resolve_dtype("auto", torch.device("cuda:1")) == torch.float16
    assert config.resolve_dtype("auto", torch.device("cuda:1"), quantized=True) == torch.float16


def test_cuda_device_index_is_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert config.resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(TokenmillError, match=r"'cuda:2' does not exist \(this machine has 2 CUDA device"):
        config.resolve_device("cuda:2")


def test_explicit_dtype_wins_and_fp16_is_refused_on_cpu():
    assert config.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(TokenmillError, match="float16 is not supported on CPU"):
        config.resolve_dtype("float16", torch.device("cpu"))
