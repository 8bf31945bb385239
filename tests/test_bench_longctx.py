"""`tokenmill bench longctx` end to end on the default model at short lengths (no timing assertions),
and the long-context copy of a GGUF that both engines run past the model's trained length."""

from __future__ import annotations

import json

import numpy as np
from gguf import GGUFReader

from tokenmill import LLM
from tokenmill.bench import peers
from tokenmill.bench.longctx import long_context_copy
from tokenmill.cli import main


def test_bench_longctx_tiny_run(default_gguf_path, tmp_path, capsys):
    out = tmp_path / "longctx.json"
    rc = main(["--log-level", "WARNING", "bench", "longctx", str(default_gguf_path), "--threads", "1",
               "--contexts", "64", "160", "--repeats", "1", "--decode-tokens", "4", "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["config"]["run_model"] == str(default_gguf_path)   # within the model's context: no copy
    peer_ran = peers.llama_cpp_python_status().available
    assert [row["context"] for row in report["table"]] == [64, 160]
    for row in report["table"]:
        tm = row["tokenmill"]
        assert tm["prefill_tok_s"] > 0 and tm["decode_tok_s"] > 0 and tm["decode_bound_tok_s"] > 0
        assert row["decode_roofline_fraction"] == tm["decode_tok_s"] / tm["decode_bound_tok_s"]
        assert (row["decode_ratio"] is not None) == peer_ran
        assert set(row["targets"]) == {"decode ratio", "decode roofline fraction"}   # prefill's is at 8192
        assert f"decode ratio at {row['context']} >= 3: " in printed
    if peer_ran:
        assert report["results"]["llama.cpp"]["flash_attn"] is True
        assert report["results"]["llama.cpp"]["kv_type"] == "f16"   # tokenmill's bf16 cache, the same bytes


def test_long_context_copy_changes_only_the_context_length(default_gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    assert long_context_copy(str(default_gguf_path), 4096) == str(default_gguf_path)   # long enough already
    copy = long_context_copy(str(default_gguf_path), 9216)
    assert copy.startswith(str(tmp_path)) and long_context_copy(str(default_gguf_path), 9216) == copy   # made once
    source, longer = GGUFReader(default_gguf_path), GGUFReader(copy)
    assert longer.fields["llama.context_length"].contents() == 9216
    assert source.fields["llama.context_length"].contents() == 8192
    assert set(source.fields) == set(longer.fields)
    for name in source.fields:
        if name != "llama.context_length":
            assert np.array_equal(source.fields[name].parts[-1], longer.fields[name].parts[-1]), name
    for a, b in zip(source.tensors, longer.tensors, strict=True):
        assert a.name == b.name and np.array_equal(a.data, b.data)
    llm = LLM(copy, max_model_len=9216, num_kv_blocks=8)   # past the trained length: accepted by the copy
    assert llm.engine.model_config.max_position_embeddings == 9216
