"""dtype 'auto' follows the hardware: bf16 only where the CPU multiplies bf16 natively, and float32 for
quantized execution on a CPU (its kernels take float32 activations)."""

from __future__ import annotations

import pytest
import torch

from tokenmill import TokenmillError, config


@pytest.mark.parametrize("fast_bf16, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cpu_follows_bf16_support(monkeypatch, fast_bf16, expected):
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: fast_bf16)
    assert config.resolve_dtype("auto", torch.device("cpu")) == expected


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
