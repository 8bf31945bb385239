"""`tokenmill bench monitor` end to end on the default model, tiny: batch sizes 1 and 2, one repeat,
short outputs. No timing assertions: the report must have every mode's row with positive rates,
frames only where a subscriber watched, the costs measured, and the bare mode's patches undone."""

from __future__ import annotations

import json

from tokenmill.cli import main
from tokenmill.engine import engine as engine_module
from tokenmill.engine.snapshot import scheduled_rows, step_record
from tokenmill.server.monitor import EngineMonitor


def test_bench_monitor_tiny_run(default_gguf_path, tmp_path, capsys):
    hooks = (EngineMonitor.after_step, EngineMonitor.between_steps)
    out = tmp_path / "monitor.json"
    rc = main(["--log-level", "WARNING", "bench", "monitor", str(default_gguf_path), "--threads", "1",
               "--batch-sizes", "1", "2", "--repeats", "1", "--max-tokens", "16", "--interval", "0.01",
               "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    for batch in (1, 2):
        assert f"target batch {batch} watched: feed time < 2% of step time" in printed
        assert f"target batch {batch} unwatched: cost < 0.1% of step time" in printed
    report = json.loads(out.read_text())
    rows = {(r["batch"], r["mode"]): r for r in report["table"]}
    assert set(rows) == {(b, m) for b in (1, 2) for m in ("bare", "unwatched", "watched")}
    for (batch, mode), row in rows.items():
        assert row["tok_s"] > 0 and row["step_ms"] > 0
        assert (row["frames"] > 0) == (mode == "watched")
        assert (row["overhead"] is not None) == (mode == "watched")
        assert (row["unwatched_cost"] is not None) == (mode == "unwatched")
        run = report["runs"][str(batch)][mode][0]
        assert run["tokens"] == 16 * batch
    assert rows[1, "watched"]["overhead"] > 0 and rows[1, "unwatched"]["unwatched_cost"] > 0
    # bare mode patched the engine module and the monitor's hooks only while it ran
    assert (engine_module.scheduled_rows, engine_module.step_record) == (scheduled_rows, step_record)
    assert (EngineMonitor.after_step, EngineMonitor.between_steps) == hooks
