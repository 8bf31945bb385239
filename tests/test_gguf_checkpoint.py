"""Reading GGUF tensors of every supported GGML type into torch tensors of the right shape."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenmill.checkpoint import GGUFCheckpoint
from tokenmill.errors import CheckpointError, UnsupportedModelError

QUANTIZABLE = {"Q4_0": 0.3, "Q4_1": 0.25, "Q5_0": 0.15, "Q5_1": 0.12, "Q8_0": 0.02}  # max abs error, N(0,1) data
# Where each K-quant block keeps its fp16 super-block scale(s): (byte offset, count).
K_QUANT_SCALES = {"Q2_K": (-4, 2), "Q3_K": (-2, 1), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (-2, 1)}


def _write(path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _random_k_blocks(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rng) -> np.ndarray:
    """Random K-quant blocks with small finite scales (`gguf` cannot quantize K types)."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, block_bytes), dtype=np.uint8)
    offset, count = K_QUANT_SCALES[qtype.name]
    scales = np.frombuffer(np.full(count, 0.01, dtype=np.float16).tobytes(), dtype=np.uint8)
    raw[..., offset:offset + 2 * count or None] = scales
    return raw.reshape(rows, -1)


def test_float_types_round_trip(tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 5, 32)).astype(np.float32)
    _write(tmp_path / "f.gguf", {"f32": (x, None), "f16": (x.astype(np.float16), None)})
    ckpt = GGUFCheckpoint(tmp_path / "f.gguf")
    assert ckpt.tensor_shape("f32") == (3, 5, 32)
    torch.testing.assert_close(ckpt.load_tensor("f32"), torch.from_numpy(x), atol=0, rtol=0)
    torch.testing.assert_close(ckpt.load_tensor("f16"), torch.from_numpy(x.astype(np.float16)).float())
    assert ckpt.load_tensor("f32", torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("qname", sorted(QUANTIZABLE))
def test_quantized_types_dequantize_close_to_source(tmp_path, qname):
    qtype = gguf.GGMLQuantizationType[qname]
    x = np.random.default_rng(1).standard_normal((6, 128)).astype(np.float32)
    _write(tmp_path / "q.gguf", {"w": (gguf.quants.quantize(x, qtype), qtype)})
    ckpt = GGUFCheckpoint(tmp_path / "q.gguf")
    assert ckpt.tensor_type("w") == qname and ckpt.tensor_shape("w") == (6, 128)
    got = ckpt.load_tensor("w")
    assert got.shape == (6, 128)
    assert (got - torch.from_numpy(x)).abs().max() < QUANTIZABLE[qname]
    # Rows are not mixed up: each row correlates with its own source row.
    assert torch.corrcoef(torch.cat([got, torch.from_numpy(x)]))[:6, 6:].argmax(1).tolist() == list(range(6))


@pytest.mark.parametrize("qname", sorted(K_QUANT_SCALES))
def test_k_quant_types_load_with_torch_shape(tmp_path, qname):
    qtype = gguf.GGMLQuantizationType[qname]
    raw = _random_k_blocks(qtype, 3, 512, np.random.default_rng(2))
    _write(tmp_path / "k.gguf", {"a": (raw, qtype), "b": (raw[::-1].copy(), qtype)})
    ckpt = GGUFCheckpoint(tmp_path / "k.gguf")
    assert ckpt.tensor_shape("a") == (3, 512)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    a, b = ckpt.load_tensor("a"), ckpt.load_tensor("b")
    assert torch.isfinite(a).all() and a.abs().sum() > 0
    torch.testing.assert_close(a, ref, atol=0, rtol=0)
    torch.testing.assert_close(b, ref.flip(0), atol=0, rtol=0)


def test_unsupported_type_is_a_clear_error(tmp_path):
    qtype = gguf.GGMLQuantizationType.TQ1_0
    x = np.random.default_rng(3).standard_normal((2, 256)).astype(np.float32)
    _write(tmp_path / "t.gguf", {"w": (gguf.quants.quantize(x, qtype), qtype)})
    with pytest.raises(UnsupportedModelError, match="TQ1_0"):
        GGUFCheckpoint(tmp_path / "t.gguf").load_tensor("w")


def test_truncated_file_is_a_clear_error(tmp_path):
    x = np.ones((64, 64), dtype=np.float32)
    _write(tmp_path / "full.gguf", {"w": (x, None)})
    data = (tmp_path / "full.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated|not a readable"):
        GGUFCheckpoint(tmp_path / "cut.gguf")
    (tmp_path / "header.gguf").write_bytes(data[:40])
    with pytest.raises(CheckpointError, match="header.gguf"):
        GGUFCheckpoint(tmp_path / "header.gguf")


@pytest.mark.parametrize(("kind", "ftype"), [("llama", "F32"), ("smollm", "Q8_0"), ("qwen2", "Q5_0"), ("gpt2", "Q4_0"),
                                             ("llama256", "Q4_K"), ("llama3", "Q8_0"), ("default", None)])
def test_header_and_data_equal_the_gguf_reader(kind, ftype, tiny_gguf_model, request):
    """tokenmill's own header parser (checkpoint/gguf.py) against the gguf package's GGUFReader:
    every metadata value, every tensor's type, shape, data offset and size, and every tensor's bytes."""
    path = request.getfixturevalue("default_gguf_path") if kind == "default" else tiny_gguf_model(kind, ftype)
    reader = gguf.GGUFReader(path)
    ckpt = GGUFCheckpoint(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(ckpt.metadata) == list(expected)
    assert ckpt.metadata == expected
    assert ckpt.tensor_names() == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ckpt._tensors[t.name]
        assert (info.qtype, info.shape, info.offset, info.n_bytes) == (
            t.tensor_type.name, tuple(reversed(t.shape.tolist())), t.data_offset, int(t.n_bytes))
        assert ckpt._read(info).tobytes() == t.data.tobytes()
