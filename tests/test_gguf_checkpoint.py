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


def _every_value_type(path, alignment: int | None = 64, nested: bool = False, extra=None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for i, (add, value) in enumerate([
        ("uint8", 255), ("int8", -128), ("uint16", 65535), ("int16", -32768), ("uint32", 2**32 - 1),
        ("int32", -2**31), ("uint64", 2**64 - 1), ("int64", -2**63), ("float32", 0.1), ("float64", 0.1),
        ("bool", True), ("string", "héllo ✓"),
    ]):
        getattr(writer, f"add_{add}")(f"t.scalar{i}", value)
    for i, values in enumerate([["a", "", "ü"], [True, False], [70000, -1], [-1, 2], [0.5, -2.25], []]):
        writer.add_array(f"t.array{i}", values)
    writer.add_key_value("t.u64s", [2**64 - 1, 0], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT64)
    writer.add_key_value("t.i8s", [-128, 127], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT8)
    if nested:
        writer.add_array("t.nested", [[1, 2], [3]])
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    x = np.arange(40 * 32, dtype=np.float32).reshape(40, 32)
    writer.add_tensor("a", x[:3])
    writer.add_tensor("b", gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 8, 64])
def test_every_value_type_and_alignment_equal_the_gguf_reader(tmp_path, alignment):
    path = tmp_path / "types.gguf"
    _every_value_type(path, alignment)
    reader = gguf.GGUFReader(path)
    ckpt = GGUFCheckpoint(path)
    assert ckpt.metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ckpt.metadata["t.scalar6"] == 2**64 - 1 and ckpt.metadata["t.array0"] == ["a", "", "ü"]
    assert ckpt.metadata["t.u64s"] == [2**64 - 1, 0] and ckpt.metadata["t.i8s"] == [-128, 127]
    for t in reader.tensors:
        info = ckpt._tensors[t.name]
        assert (info.offset, info.n_bytes) == (t.data_offset, int(t.n_bytes))
        assert ckpt._read(info).tobytes() == t.data.tobytes()
    torch.testing.assert_close(ckpt.load_tensor("a"), torch.arange(3 * 32, dtype=torch.float32).view(3, 32))


def test_nested_arrays_keep_their_nesting(tmp_path):
    path = tmp_path / "nested.gguf"
    _every_value_type(path, nested=True)
    assert GGUFCheckpoint(path).metadata["t.nested"] == [[1, 2], [3]]   # GGUFReader flattens them


@pytest.mark.parametrize(("damage", "reason"), [
    ("alignment 0", "general.alignment 0 is not a power of two"),
    ("alignment 3", "general.alignment 3 is not a power of two"),
    ("huge array", "runs past the end of the file"),
    ("big-endian", "big-endian"),
])
def test_corrupt_header_is_a_clear_error(tmp_path, damage, reason):
    path = tmp_path / "bad.gguf"
    _every_value_type(path, None, extra={"general.alignment": int(damage[-1])} if "alignment" in damage else None)
    data = bytearray(path.read_bytes())
    if damage == "huge array":   # t.array2's count: after its key, value type (9) and element type
        at = data.index(b"t.array2") + len(b"t.array2") + 8
        data[at:at + 8] = (2**64 - 1).to_bytes(8, "little")
    elif damage == "big-endian":
        data[4:8] = (3).to_bytes(4, "big")
    path.write_bytes(bytes(data))
    with pytest.raises((CheckpointError, UnsupportedModelError), match=reason) as e:
        GGUFCheckpoint(path)
    assert str(path) in str(e.value)
