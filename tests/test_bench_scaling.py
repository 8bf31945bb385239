"""`tokenmill bench scaling` end to end on a tiny GGUF model (no timing assertions): every point of
both sweeps measured next to its bound, the JSON and both PNG plots written, and a context past the
model's trained length run on bench longctx's copy of the file."""

from __future__ import annotations

import json

from tokenmill.cache import CACHE_DIR_ENV
from tokenmill.cli import main


def test_bench_scaling_tiny_run(tiny_gguf_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    out = tmp_path / "scaling.json"
    rc = main(["--log-level", "WARNING", "bench", "scaling", str(tiny_gguf_model("llama")), "--threads", "1",
               "--batch-sizes", "2", "1", "--context", "16", "--contexts", "16", "300", "--context-batches", "1", "2",
               "--steps", "2", "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in report["batch_sweep"]] == [(1, 16), (2, 16)]
    assert [(r["batch"], r["context"]) for r in report["context_sweep"]] == [(1, 16), (1, 300), (2, 16), (2, 300)]
    assert str(tmp_path / "cache") in report["run_model"]   # 300 tokens: past the tiny model's 256
    for r in report["batch_sweep"] + report["context_sweep"]:
        assert r["measured_tok_s"] > 0 and r["bound_tok_s"] > 0 and r["bound_by"] in ("memory", "compute")
        assert r["fraction"] == r["measured_tok_s"] / r["bound_tok_s"]
        assert abs(r["step_ms"] * r["measured_tok_s"] - 1e3 * r["batch"]) < 1e-6 * r["step_ms"] * r["measured_tok_s"]
    # a longer context reads more K/V: its bound is lower
    by_context = {r["context"]: r for r in report["context_sweep"] if r["batch"] == 1}
    assert by_context[300]["bytes"] > by_context[16]["bytes"] and by_context[300]["bound_tok_s"] <= \
        by_context[16]["bound_tok_s"]
    printed = capsys.readouterr().out
    for name in ("batch", "context"):
        png = tmp_path / f"scaling-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert f"wrote {png}" in printed
