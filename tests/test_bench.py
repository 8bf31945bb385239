"""`tokenmill bench throughput` and `bench latency` end to end on a tiny model: every row is there
with positive rates, every tokenmill row generated exactly the requested output tokens, and the
engine flags reach the engine. No timing assertions."""

from __future__ import annotations

import json

import pytest

from tokenmill.cli import build_parser, main


def test_throughput_bench_writes_every_row(tiny_hf_model, tmp_path, capsys):
    out = tmp_path / "throughput.json"
    rc = main(["bench", "throughput", "--model", str(tiny_hf_model("llama")), "--dtype", "float32",
               "--device", "cpu", "--num-requests", "6", "--input-len-range", "4", "16", "--output-len-range",
               "2", "8", "--max-num-seqs", "4", "--hf-batch-size", "2", "4", "--output", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "tokenmill/transformers" in printed and "leave-one-out" in printed

    output_lens, input_lens = report["output_lens"], report["input_lens"]
    assert len(output_lens) == len(input_lens) == 6
    assert all(2 <= n <= 8 for n in output_lens) and all(4 <= n <= 16 for n in input_lens)
    rows = {(r["engine"], r["config"]): r for r in report["results"]}
    configs = [c for e, c in rows if e == "tokenmill"]
    assert configs == ["all on", "no continuous batching", "no chunked prefill", "no prefix caching"]
    assert [e for e, _ in rows].count("transformers") == 1
    for (engine, config), row in rows.items():
        for key in ("requests_per_s", "output_tok_s", "total_tok_s", "elapsed_s", "cpu_share", "peak_rss_mib"):
            assert row[key] > 0, (engine, config, key)
        if engine == "tokenmill":
            assert row["generated_tokens"] == output_lens, config
            assert row["num_requests"] == 6
            assert 0.0 <= row["prefix_hit_rate"] <= 1.0 and row["num_preemptions"] >= 0
            assert row["rss_after_warmup_mib"] > 0 and row["rss_samples_s_mib"]
        else:
            assert sorted(r["batch_size"] for r in row["per_batch_size"]) == [2, 4]
            assert all(r["output_tok_s"] > 0 for r in row["per_batch_size"])
    assert rows["tokenmill", "no continuous batching"]["static_batch_size"] == 4
    all_on = rows["tokenmill", "all on"]
    assert all_on["output_tok_s"] * all_on["elapsed_s"] == pytest.approx(sum(output_lens))


def test_throughput_bench_refuses_a_feature_flag_it_would_override(tiny_hf_model, tmp_path, capsys):
    rc = main(["bench", "throughput", "--model", str(tiny_hf_model("llama")), "--no-enable-prefix-caching",
               "--output", str(tmp_path / "t.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--skip-ablations" in err and "Traceback" not in err
    assert not (tmp_path / "t.json").exists()


def test_latency_bench_rows_and_engine_flags(tiny_hf_model, tmp_path, capsys):
    out = tmp_path / "latency.json"
    rc = main(["bench", "latency", "--model", str(tiny_hf_model("llama")), "--dtype", "float32", "--device", "cpu",
               "--threads", "1", "--max-num-seqs", "3", "--prompt-lens", "8", "16", "--decode-tokens", "4",
               "--repeats", "2", "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ttft_16_s" in printed and "ratio" in printed
    report = json.loads(out.read_text())
    assert report["config"]["engine_args"]["max_num_seqs"] == 3
    tm, hf = report["results"]
    assert (tm["engine"], hf["engine"]) == ("tokenmill", "transformers")
    for row in (tm, hf):
        for key in ("load_s", "ttft_8_s", "ttft_16_s", "prefill_16_tok_s", "decode_tok_s", "peak_rss_mib"):
            assert row[key] > 0, (row["engine"], key)
        assert row["threads"] == 1, row["engine"]   # --threads reached the engine (and the peer)
        assert row["dtype"] == "float32"
    # the same prompt ids and fp32 weights: the same greedy tokens (the model parity tests' claim)
    assert tm["greedy_tokens"] == hf["greedy_tokens"] and len(tm["greedy_tokens"]) == 4


@pytest.mark.parametrize(("argv", "words"), [
    (["quality", "--chunk-size", "0"], "argument --chunk-size: must be >= 1, got 0"),   # (range() step 0)
    (["replicas", "--num-requests", "0"], "argument --num-requests: must be >= 1, got 0"),   # (max() of nothing)
    (["replicas", "--concurrency", "0"], "argument --concurrency: must be >= 1, got 0"),   # (was: unlimited)
    (["parallel", "--steps", "0"], "argument --steps: must be >= 1, got 0"),   # (a division by zero)
    (["parallel", "--batch-sizes", "8", "-1"], "argument --batch-sizes: must be >= 1, got -1"),
    (["serve", "--timeout", "nan"], "argument --timeout: must be a finite number of seconds > 0, got nan"),
    (["spec", "--timeout", "0"], "argument --timeout: must be a finite number of seconds > 0, got 0"),
    (["monitor", "--interval", "-1"], "argument --interval: must be a finite number of seconds > 0, got -1"),
    (["replicas", "--repeats", "x"], "argument --repeats: not an integer: 'x'"),
])
def test_bench_counts_and_time_limits_are_refused_when_the_flags_are_read(argv, words, capsys):
    """Before anything loads: these failed with a traceback after the model had loaded, or ran
    with a meaning of their own."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.rstrip().endswith(words) and "Traceback" not in err, err


@pytest.mark.parametrize("command", ["latency", "throughput", "quality", "roofline", "spec", "compare"])
def test_bench_output_is_checked_when_the_flags_are_read(command, tmp_path, capsys):
    """A folder given as --output failed with a traceback once the benchmark had run (its results lost)."""
    with pytest.raises(SystemExit) as exit_:
        main(["bench", command, "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.rstrip().endswith(f"argument --output: {tmp_path} is a folder, not a file")
    nested = tmp_path / "new" / "folder" / "out.json"   # (its folder is made then)
    args = build_parser().parse_args(["bench", command, "--output", str(nested)])
    assert args.output == str(nested) and nested.parent.is_dir()
