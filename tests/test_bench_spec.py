"""`tokenmill bench spec` end to end on the default model, tiny: off and ngram, batch sizes 1 and 2,
one repeat, short outputs, no peers. No timing assertions: the report must have its keys, positive
rates, acceptance in [0, 1], and ngram's outputs must be off's (greedy, the same prompts)."""

from __future__ import annotations

import json

from tokenmill.cli import main


def test_bench_spec_tiny_run(default_gguf_path, tmp_path, capsys):
    out = tmp_path / "spec.json"
    rc = main(["--log-level", "WARNING", "bench", "spec", str(default_gguf_path), "--threads", "1",
               "--modes", "off", "ngram", "--batch-sizes", "1", "2", "--workloads", "grounded", "--repeats", "1",
               "--max-tokens", "24", "--peers", "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "target ngram, grounded, batch 1 decode >= 2.00x" in printed
    assert "target ngram, free, batch 1 decode >= 0.95x: not measured" in printed
    assert "llama-server: not run" in printed and "outputs differ" not in printed

    report = json.loads(out.read_text())
    assert report["partial"] is False
    assert set(report["tokenmill"]) == {"off", "ngram"}
    for mode in ("off", "ngram"):
        assert set(report["tokenmill"][mode]) == {"grounded/1", "grounded/2"}
        for cell in report["tokenmill"][mode].values():
            assert cell["output_tok_s"]["median"] > 0 and cell["output_tokens"]["median"] > 0
    assert report["tokenmill"]["off"]["grounded/1"]["decode_tok_s"]["median"] > 0
    ngram = report["tokenmill"]["ngram"]["grounded/1"]
    assert 0.0 <= ngram["acceptance_rate"]["median"] <= 1.0
    assert ngram["runs"][0]["draft_tokens"] > 0
    rows = {(r["mode"], r["batch"]): r for r in report["table"]}
    assert rows["ngram", 1]["same_tokens"] is True and rows["ngram", 2]["same_tokens"] is True
    assert rows["ngram", 1]["speedup"] > 0 and rows["off", 1]["speedup"] is None
