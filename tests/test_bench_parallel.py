"""`tokenmill bench parallel` end to end on a tiny GGUF model (no timing assertions): every
configuration measured at every batch size, TP=2's communication share and its worker's memory
reported, the JSON written."""

from __future__ import annotations

import json

from tokenmill.cli import main


def test_bench_parallel_tiny_run(tiny_gguf_model, tmp_path, capsys):
    out = tmp_path / "parallel.json"
    rc = main(["--log-level", "WARNING", "bench", "parallel", str(tiny_gguf_model("llama", "Q4_0")),
               "--batch-sizes", "1", "2", "--context", "16", "--steps", "2", "--repeats", "1", "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [(r["tensor_parallel_size"], r["threads"]) for r in report["rows"]] == [(1, 1), (1, 2), (2, 1)]
    for row in report["rows"]:
        assert [p["batch"] for p in row["points"]] == [1, 2]
        assert all(p["tok_s"] > 0 and p["step_ms"] > 0 for p in row["points"])
        tp2 = row["tensor_parallel_size"] == 2
        assert all(("comm_share" in p) == tp2 for p in row["points"])
        assert len(row["worker_peak_rss_mib"]) == (1 if tp2 else 0)
    shares = [p["comm_share"] for p in report["rows"][2]["points"]]
    assert all(0 < s < 1 for s in shares), shares   # rank 0 does communicate, and computes too
    printed = capsys.readouterr().out
    assert "TP=2 communication" in printed and f"wrote {out}" in printed
