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


def test_bench_spec_runs_the_modes_in_turn_within_each_repeat(monkeypatch):
    """On a machine whose speed drifts, each mode's runs must meet the same drift: every mode's
    engine is loaded first, then repeat r of every mode runs before repeat r + 1 of any."""
    import argparse

    import tokenmill
    from tokenmill.bench import spec

    calls = []

    class FakeLLM:
        def __init__(self, model, **kwargs):
            self.mode = "ngram" if kwargs["speculative_config"] else "off"

    def fake_run(llm, batch, workload, run, max_tokens):
        calls.append((llm.mode, batch, workload, run))
        return {"output_tok_s": 1.0, "decode_tok_s": 1.0, "output_tokens": 1, "acceptance_rate": None,
                "mean_accepted_per_step": None, "row_cost": None, "proposal_cost": None, "token_ids": [1]}

    monkeypatch.setattr(tokenmill, "LLM", FakeLLM)
    monkeypatch.setattr(spec, "_tokenmill_run", fake_run)
    args = argparse.Namespace(modes=["off", "ngram"], batch_sizes=[1, 4], workloads=["grounded", "free"], repeats=2,
                              max_tokens=4, num_speculative_tokens=3, disable_by_batch_size=None,
                              prompt_lookup_min=None)
    report = {"tokenmill": {}}
    spec.tokenmill_modes(args, "model.gguf", {}, report, lambda: None)
    timed = [c for c in calls if c[3] != 9999]   # (the warm-ups)
    assert timed == [(mode, batch, workload, spec.run_tag(workload, rep)) for batch in (1, 4)
                     for workload in ("grounded", "free") for rep in range(2) for mode in ("off", "ngram")]
    assert set(report["tokenmill"]["ngram"]) == {"grounded/1", "free/1", "grounded/4", "free/4"}
    assert len(report["tokenmill"]["off"]["free/4"]["runs"]) == 2
