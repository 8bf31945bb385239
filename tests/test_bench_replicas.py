"""`tokenmill bench replicas` end to end on a tiny GGUF model, tiny workloads (no timing
assertions): every configuration served and measured, nothing failed or cut short, the router's
cache routing and the disaggregated ITL reported, the JSON written."""

from __future__ import annotations

import json

import pytest

from tokenmill.cli import main


@pytest.mark.slow
def test_bench_replicas_tiny_run(tiny_gguf_model, tmp_path, capsys):
    out = tmp_path / "replicas.json"
    rc = main(["--log-level", "WARNING", "bench", "replicas", str(tiny_gguf_model("llama", "Q4_0")),
               "--num-requests", "6", "--concurrency", "3", "--input-len", "24", "--output-len", "6",
               "--prefix-groups", "2", "--group-size", "3", "--prefix-len", "64", "--streams", "2",
               "--stream-output-len", "12", "--long-prompts", "2", "--long-len", "96", "--repeats", "1",
               "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    dp = report["dp"]
    for workload in ("uniform", "prefix_heavy"):
        assert set(dp[workload]) == {"DP=1", "DP=2"}
        for rows in dp[workload].values():
            assert [(r["failed"], r["short_outputs"], r["completed"]) for r in rows] == [(0, 0, r["num_requests"])
                                                                                      for r in rows]
    # each group's first request goes by load (nothing cached), the two others follow it (3 in flight at
    # most: never out of balance)
    assert dp["prefix_heavy"]["DP=2"][0]["routed_by_cache"] == pytest.approx(2 / 3)
    assert "routed_by_cache" not in dp["prefix_heavy"]["DP=1"][0]   # (one engine: no router)
    pd = report["pd"]
    assert set(pd["rows"]) == {"colocated", "disaggregated"}
    assert all(r["failed"] == 0 and r["itl_p99_ms"] > 0 for rows in pd["rows"].values() for r in rows)
    printed = capsys.readouterr().out
    assert "DP=2 / DP=1 output tok/s" in printed and "ITL p99 colocated / disaggregated" in printed
