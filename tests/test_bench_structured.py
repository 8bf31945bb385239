"""`tokenmill bench structured` end to end on the default model, tiny: batch sizes 1 and 2, two
schemas, one repeat, short outputs, no peers. No timing assertions: the report must have its keys,
positive token counts and rates, fractions in [0, 1], and the unconstrained run must have generated
exactly the constrained run's token count for each request."""

from __future__ import annotations

import json

from tokenmill.bench.schemas import SCHEMAS
from tokenmill.bench.structured import spread_stat, validate
from tokenmill.cli import main


def _fraction(x) -> bool:
    return x is None or 0.0 <= x <= 1.0


def test_bench_structured_tiny_run(default_gguf_path, tmp_path, capsys):
    out = tmp_path / "structured.json"
    rc = main(["--log-level", "WARNING", "bench", "structured", str(default_gguf_path), "--threads", "1",
               "--batch-sizes", "1", "2", "--num-schemas", "2", "--repeats", "1", "--max-tokens", "64", "--peers",
               "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tokenmill constrained tok/s" in printed and "batch 2" in printed
    assert "target: compile p50 < 50 ms" in printed and "not measured" in printed   # (no batch 32 here)
    assert "llama-server: not run" in printed

    report = json.loads(out.read_text())
    assert report["partial"] is False
    assert {"config", "compile", "tokenmill", "llama_server", "table"} <= set(report)
    assert report["config"]["schemas"] == [c.name for c in SCHEMAS[:2]]
    assert report["config"]["targets"] == {"ratio": 0.9, "ratio_batch_size": 32, "compile_p50_ms": 50.0}
    assert set(report["tokenmill"]) == {"1", "2"}
    for size, batch in report["tokenmill"].items():
        n = int(size)   # requests per run: the batch size (the schemas cycled to fill it)
        assert batch["requests_per_run"] == n and batch["repeats"] == 1
        for key in ("constrained_tok_s", "unconstrained_tok_s", "ratio", "output_tokens"):
            assert batch[key]["median"] > 0, key
        for key in ("forced_fraction", "steps_saved_fraction"):
            assert _fraction(batch[key]["median"]), key
        v = batch["validity"]
        assert v["outputs"] == n and _fraction(v["valid_fraction"]) and _fraction(v["valid_fraction_stopped"])
        assert v["valid_stopped"] == v["stopped"]   # a constrained output that finished is valid
        assert batch["short_outputs_unconstrained"] == 0
        run = batch["runs"][0]
        c, u = run["constrained"], run["unconstrained"]
        assert [o["tokens"] for o in c["outputs"]] == [o["tokens"] for o in u["outputs"]]
        assert c["output_tokens"] == u["output_tokens"] == c["engine_generation_tokens"] > 0
        assert 0 <= c["forced_tokens"] <= c["output_tokens"] and u["forced_tokens"] == 0
        assert 0 <= c["ended_without_eos"] <= n
    comp = report["compile"]
    assert comp["schemas"] == 2 and comp["tokenizer_setup_ms"]["median"] > 0
    for key in ("compile_ms", "first_mask_ms"):
        assert 0 < comp[key]["p50"] <= comp[key]["p90"] <= comp[key]["max"]
        assert set(comp[key]["per_schema_median"]) == {c.name for c in SCHEMAS[:2]}
    assert report["llama_server"] == {"status": None}
    assert [r["metric"] for r in report["table"]][:3] == ["tokenmill_constrained_tok_s",
                                                          "tokenmill_unconstrained_tok_s", "tokenmill_ratio"]


def test_spread_and_validation_helpers():
    s = spread_stat([2.0, 1.0, 4.0])
    assert (s["median"], s["min"], s["max"]) == (2.0, 1.0, 4.0) and s["spread"] == 1.5
    case = SCHEMAS[0]
    assert validate(json.dumps(case.example), case.schema) is None
    assert validate("{", case.schema).startswith("not JSON")
    assert validate("{}", case.schema).startswith("invalid")
