"""`tokenmill bench startup` end to end on the default model, tiny: one repeat, 4 tokens, without
the first-ever run (it compiles the kernels). No timing assertions: every row has a positive time
to first token no later than the process's exit, and a peak RSS of a process that loaded a model
(more than the launcher's own)."""

from __future__ import annotations

import json

from tokenmill.bench.procs import run_bare, timed_command
from tokenmill.cli import main


def test_timed_command_times_the_first_output_and_reads_the_childs_own_peak():
    row = run_bare(timed_command, {"command": ["sh", "-c", "sleep 0.3; echo hi; sleep 0.2"], "env": {}}, 60)
    assert row["returncode"] == 0 and row["stdout_tail"] == "hi\n"
    assert 0.3 <= row["first_output_s"] < row["wall_s"] and row["wall_s"] >= 0.5
    assert 0 < row["child_peak_rss_mib"] < 50   # a shell's, not the (bigger) launcher's


def test_bench_startup_tiny_run(default_gguf_path, tmp_path, capsys):
    out = tmp_path / "startup.json"
    assert main(["bench", "startup", str(default_gguf_path), "--repeats", "1", "--max-tokens", "4",
                 "--skip-first-ever", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "target tokenmill start to first token <= 1.5 s" in printed
    report = json.loads(out.read_text())
    assert {"tokenmill", "tokenmill, no weight cache"} <= set(report["rows"])
    for row in report["rows"].values():
        assert 0 < row["first_output_s"] <= row["wall_s"] and row["peak_rss_mib"] > 100
        assert row["runs"][0]["stdout_tail"].startswith("Once upon a time")
