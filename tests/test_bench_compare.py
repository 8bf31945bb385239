"""`tokenmill bench compare` end to end on a tiny GGUF model, and the peers' bookkeeping.

No timing assertions: every engine that runs must produce a positive rate for every row, the
llama.cpp column must say "not installed" / "not built" when the peer is absent (and the command
still succeed), and a present peer must produce numbers and ratios. The llama.cpp peers are an
optional install (scripts/install-peers.sh), so the test with them present skips without them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tokenmill.bench import compare, peers
from tokenmill.bench import serve as bench_serve
from tokenmill.cache import CACHE_DIR_ENV
from tokenmill.cli import main

ROOT = Path(__file__).resolve().parents[1]

# Small enough for the tiny model's 256-token context and a run of a few tens of seconds.
# One thread: on a loaded 2-core machine, two threads per engine mostly wait for each other.
SMALL = ["--threads", "1", "--dtype", "float32", "--device", "cpu", "--prefill-lens", "16", "64",
         "--decode-tokens", "8", "--repeats", "1", "--num-requests", "4", "--input-len-range", "4", "16",
         "--output-len-range", "2", "8", "--decode-heavy-concurrency", "2", "--sampled-concurrency",
         "--concurrent-repeats", "2"]


def _missing(name: str, detail: str) -> peers.PeerStatus:
    return peers.PeerStatus(name, False, None, None, detail)


def _rows(report: dict) -> dict[str, dict]:
    return {r["metric"]: r for r in report["table"]}


def test_compare_without_llama_cpp_still_runs_the_others(tiny_gguf_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(peers, "llama_cpp_python_status", lambda: _missing(
        "llama.cpp (llama_cpp)", f"not installed: install it with {peers.INSTALL_HINT}"))
    monkeypatch.setattr(peers, "llama_server_status", lambda explicit=None: _missing(
        "llama.cpp (llama-server)", f"not built (/nowhere): build it with {peers.SERVER_HINT}"))
    sent = []   # the sampling fields of each run of requests (None: greedy)
    run_level = bench_serve.run_level

    async def recording(*args, **kwargs):
        sent.append(args[9])
        return await run_level(*args, **kwargs)

    monkeypatch.setattr(bench_serve, "run_level", recording)
    out = tmp_path / "compare.json"
    rc = main(["bench", "compare", "--model", str(tiny_gguf_model("llama")), *SMALL, "--concurrency", "2", "4",
               "--sampled-concurrency", "2", "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    rows = _rows(report)
    assert list(rows) == ["prefill_16_tok_s", "prefill_64_tok_s", "decode_tok_s", "concurrent_2_out_tok_s",
                          "concurrent_4_out_tok_s", "decode_heavy_2_out_tok_s", "sampled_2_out_tok_s",
                          "batch1_peak_rss_mib", "concurrent_peak_rss_mib"]
    for key, row in rows.items():
        assert isinstance(row["tokenmill"], float) and row["tokenmill"] > 0, (key, row["tokenmill"])
        if key.startswith(("decode_heavy", "sampled")):
            assert row["transformers"] is None   # (no server: it runs the mixed workload only)
        else:
            assert isinstance(row["transformers"], float) and row["transformers"] > 0, (key, row["transformers"])
        served = key.startswith(("concurrent", "decode_heavy", "sampled"))
        assert row["llama.cpp"] == ("not built" if served else "not installed"), key
        assert row["ratio"] is None and row["met"] is None
        assert (row["spreads"]["tokenmill"] is not None) == (served and "rss" not in key), key
    assert rows["decode_tok_s"]["target"] == 1.0 and rows["prefill_16_tok_s"]["target"] is None
    # the table, the missing peers and how to install them, the load average before each run
    assert "tm/llama.cpp" in printed and "not installed" in printed and "scripts/install-peers.sh" in printed
    assert ">= 1x (no llama.cpp number)" in printed
    # before each of the 4 runs (tokenmill and transformers, batch 1 and concurrent) and each served run
    # (4 levels, 2 repeats each)
    assert printed.count("[load average") == 12
    assert set(report["load_average_before"]) == {"tokenmill batch 1", "transformers batch 1 (float32)",
                                                  "tokenmill serve", "transformers static batches of [2, 4]"}

    # every request completed with exactly its output length, at each level, in every run, through the server
    served = report["results"]["tokenmill"]["concurrent"]["levels"]
    assert set(served) == {"mixed/2", "mixed/4", "decode-heavy/2", "sampled/2"}
    # the warm-up and 3 levels x 2 runs greedy, then the sampled level's 2 runs with llama.cpp's filters
    assert sent == [None] * 7 + [compare.SAMPLING] * 2
    assert compare.SAMPLING == {"temperature": 1.0, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
    assert report["config"]["sampling"] == compare.SAMPLING and "top_k 40" in printed
    for name, level in served.items():
        assert level["failed"] == 0 and level["short_outputs"] == 0 and len(level["runs"]) == 2
        for run in level["runs"]:
            asked = sum(report["output_lens"]) if name.startswith("mixed") else 4 * 128
            assert run["completed"] == 4 and run["output_tokens"] == asked
    hf = report["results"]["transformers"]["concurrent"]
    assert sorted(r["batch_size"] for r in hf["per_batch_size"]) == [2, 4]
    # same prompt ids, same fp32 weights: the same greedy tokens (the model parity tests' claim)
    assert report["greedy_agreement"] == {"transformers": 8}
    assert "transformers 8/8" in printed
    b1 = report["results"]["tokenmill"]["batch1"]
    assert b1["threads"] == 1 and b1["dtype"] == "float32"
    assert report["results"]["transformers"]["batch1"]["threads"] == 1


def test_transformers_peer_runs_the_dense_dtype(tiny_gguf_model, tmp_path):
    """With --dtype auto, tokenmill runs a quantized GGUF in float32 (its kernels' dtype) while the
    transformers peer, dense, gets its best dtype here (bf16 where the CPU has bf16 units, else float32:
    PyTorch emulates bf16 matmuls there)."""
    from tokenmill.config import cpu_has_fast_bf16

    out = tmp_path / "compare.json"
    args = [a if a != "float32" else "auto" for a in SMALL]
    assert main(["bench", "compare", "--model", str(tiny_gguf_model("llama", "Q4_1")), *args, "--concurrency",
                 "--peers", "transformers", "--output", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert results["tokenmill"]["batch1"]["dtype"] == "float32"
    assert results["transformers"]["batch1"]["dtype"] == ("bfloat16" if cpu_has_fast_bf16() else "float32")


@pytest.mark.skipif(not (peers.llama_cpp_python_status().available and peers.llama_server_status().available),
                    reason="the llama.cpp peers are not installed (scripts/install-peers.sh)")
def test_compare_with_llama_cpp(tiny_gguf_model, tmp_path, capsys):
    out = tmp_path / "compare.json"
    # (outputs of 8+ tokens: a random model's 2 tokens may decode to no text, which the load generator
    # cannot time, and counts as failed)
    small = [*SMALL[:SMALL.index("--output-len-range")], "--output-len-range", "8", "12",
             *SMALL[SMALL.index("--output-len-range") + 3:]]
    rc = main(["bench", "compare", "--model", str(tiny_gguf_model("llama")), *small, "--concurrency", "2",
               "--sampled-concurrency", "2", "--peers", "llama.cpp", "--output", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    for key, row in _rows(report).items():
        assert row["transformers"] is None   # not asked for
        assert isinstance(row["llama.cpp"], float) and row["llama.cpp"] > 0, key
        assert row["ratio"] == pytest.approx(row["tokenmill"] / row["llama.cpp"])
        if row["target"] is not None:
            assert row["met"] == (row["ratio"] >= row["target"])
    assert "met" in printed and "llama-server -np 2" in printed
    level = report["results"]["llama.cpp"]["concurrent"]["levels"]["mixed/2"]
    assert all(run["completed"] == 4 and run["output_tokens"] == sum(report["output_lens"]) for run in level["runs"])
    assert report["results"]["llama.cpp"]["batch1"]["version"] == peers.LLAMA_CPP_PYTHON_VERSION
    assert 1 <= report["greedy_agreement"]["llama.cpp"] <= 8   # at least the first token: the same model


def test_compare_needs_a_gguf_file(tiny_hf_model, tmp_path, capsys):
    rc = main(["bench", "compare", "--model", str(tiny_hf_model("llama")), "--output", str(tmp_path / "c.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "needs a .gguf file" in err and "Traceback" not in err
    assert not (tmp_path / "c.json").exists()


def test_the_peers_extra_pins_the_version_the_server_is_built_from():
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["peers"]
    assert f"llama-cpp-python=={peers.LLAMA_CPP_PYTHON_VERSION}" in extra
    script = (ROOT / "scripts" / "install-peers.sh").read_text()
    assert "tokenmill.bench.peers version" in script and "build-llama-server" in script


def test_llama_server_status_cache_and_override(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(peers.LLAMA_SERVER_ENV, raising=False)
    status = peers.llama_server_status()
    assert not status.available and "not built" in status.detail and "build-llama-server" in status.detail
    assert str(tmp_path / "cache" / "peers" / f"llama.cpp-{peers.LLAMA_CPP_PYTHON_VERSION}") in status.detail

    binary = peers.cached_llama_server()
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    assert not peers.llama_server_status().available   # not executable
    binary.chmod(0o755)
    (binary.parent.parent / "build-info.json").write_text(json.dumps({"llama_cpp_python_version": "9.9.9"}))
    status = peers.llama_server_status()
    assert status.available and status.where == str(binary) and status.version == "9.9.9"

    monkeypatch.setenv(peers.LLAMA_SERVER_ENV, str(tmp_path / "nope"))
    status = peers.llama_server_status()
    assert not status.available and peers.LLAMA_SERVER_ENV in status.detail
    status = peers.llama_server_status(str(binary))   # --llama-server wins over the environment
    assert status.available and status.detail == f"{binary} (given by --llama-server)"


def test_peers_command_status_exit_code(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(peers.LLAMA_SERVER_ENV, raising=False)
    assert peers.main(["status"]) == 1
    assert "MISSING" in capsys.readouterr().out
    assert peers.main(["version"]) == 0
    assert capsys.readouterr().out.strip() == peers.LLAMA_CPP_PYTHON_VERSION


# Stands in for llama-cpp-python: the next token is the last one + 1 (mod its vocabulary). It refuses
# to run in a process that has loaded torch or tokenmill, and takes its model params from its C API
# module's defaults as the real one does (its version says whether they repack weights).
FAKE_LLAMA_CPP = """
import ctypes, sys

from llama_cpp import llama_cpp as c_api

__version__ = "fake"
N_VOCAB = 8


class Llama:
    def __init__(self, model, n_ctx, **kwargs):
        loaded = [m for m in ("torch", "tokenmill") if m in sys.modules]
        if loaded:
            raise RuntimeError(f"the llama.cpp process has loaded {loaded}")
        global __version__
        __version__ = f"fake, extra buffers {c_api.llama_model_default_params().use_extra_bufts}"
        self.ctx = self
        self.logits = (ctypes.c_float * N_VOCAB)()

    def n_vocab(self):
        return N_VOCAB

    def reset(self):
        pass

    def eval(self, ids):
        for i in range(N_VOCAB):
            self.logits[i] = float(i == (ids[-1] + 1) % N_VOCAB)


def llama_get_logits_ith(ctx, i):
    return ctx.logits
"""
FAKE_LLAMA_CPP_C_API = """
class Params:
    use_extra_bufts = True


def llama_model_default_params():
    return Params()
"""


@pytest.mark.parametrize("repack", ["0", "1"])
def test_llama_cpp_batch1_runs_in_a_process_without_torch(tiny_gguf_model, tmp_path, monkeypatch, capsys, repack):
    """compare's llama.cpp batch-1 row, through a fake llama_cpp module: it runs in an interpreter
    that loaded neither torch nor tokenmill (their memory would count as llama.cpp's) and lands in
    the table next to tokenmill's row; with repacking off (peers.llama_repack), its model params say
    so and the report tells."""
    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    (tmp_path / "fake" / "llama_cpp" / "llama_cpp.py").write_text(FAKE_LLAMA_CPP_C_API)
    monkeypatch.setenv(peers.REPACK_ENV, repack)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(peers, "llama_cpp_python_status", lambda: peers.PeerStatus(
        "llama.cpp (llama_cpp)", True, "fake", str(tmp_path / "fake"), "fake"))
    monkeypatch.setattr(peers, "llama_server_status", lambda explicit=None: _missing(   # (the concurrent rows')
        "llama.cpp (llama-server)", "not built (/nowhere)"))
    out = tmp_path / "compare.json"
    assert main(["bench", "compare", "--model", str(tiny_gguf_model("llama")), *SMALL, "--concurrency",
                 "--peers", "llama.cpp", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    row = report["results"]["llama.cpp"]["batch1"]
    assert row["version"] == f"fake, extra buffers {repack == '1'}" and row["repack"] == (repack == "1")
    assert row["threads"] == 1 and row["peak_rss_mib"] > 0
    assert ("weight repacking off" in capsys.readouterr().out) == (repack == "0")
    first = row["greedy_tokens"][0]   # the fake's greedy tokens, one eval after the other
    assert row["greedy_tokens"] == [(first + i) % 8 for i in range(8)]
    for key, table_row in _rows(report).items():
        if key.startswith(("decode_heavy", "concurrent")):   # llama-server's
            assert table_row["llama.cpp"] == "not built", key
            continue
        assert isinstance(table_row["llama.cpp"], float) and table_row["llama.cpp"] > 0, key
        assert table_row["ratio"] == pytest.approx(table_row["tokenmill"] / table_row["llama.cpp"])


def test_llama_peers_repack_weights_except_on_cpus_with_amx(monkeypatch, tmp_path):
    """llama.cpp's repacked (AMX) weights crash on CPUs with AMX: the peers run without repacking
    there, llama-server with --no-repack; TOKENMILL_LLAMA_REPACK decides instead when set."""
    from tokenmill import kernels
    from tokenmill.bench import serve

    monkeypatch.delenv(peers.REPACK_ENV, raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags\t: fpu avx512f avx512_vnni amx_bf16 amx_int8 amx_tile")
    assert not peers.llama_repack()
    commands = []
    monkeypatch.setattr(serve.subprocess, "Popen", lambda command, **kw: commands.append(command))
    serve.start_llama_server("llama-server", "m.gguf", 2, 256, "-fa on", tmp_path / "log")
    monkeypatch.setenv(peers.REPACK_ENV, "1")
    assert peers.llama_repack()
    serve.start_llama_server("llama-server", "m.gguf", 2, 256, "", tmp_path / "log")
    assert "--no-repack" in commands[0] and commands[0][-2:] == ["-fa", "on"] and "--no-repack" not in commands[1]
    monkeypatch.delenv(peers.REPACK_ENV)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags\t: fpu avx512f avx512_vnni avx512_bf16")
    assert peers.llama_repack()
    monkeypatch.setenv(peers.REPACK_ENV, "0")
    assert not peers.llama_repack()


def test_the_llama_cpp_process_files_import_only_the_standard_library():
    """batch1.py and procs.py are loaded into the llama.cpp batch-1 process, which must not load
    torch: running them loads neither torch nor tokenmill."""
    import subprocess

    from tokenmill.bench import batch1, procs

    for module in (batch1, procs):
        code = (f"import runpy, sys; runpy.run_path({module.__file__!r}); "
                "print('torch' in sys.modules, 'tokenmill' in sys.modules)")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["False", "False"], module.__name__


FAKE_QUANTIZE = """#!{python}
import shutil, sys, json, pathlib
args = sys.argv[1:]
pathlib.Path({log!r}).open("a").write(json.dumps(args) + "\\n")
if args[3] == "Q6_K":
    sys.exit("unknown type")
shutil.copyfile(args[1], args[2])
"""


def test_compare_quant_types_run_batch1_on_each_llama_quantize_copy(tiny_gguf_model, tmp_path, monkeypatch, capsys):
    """--quant-types: each type's file made once by llama-quantize (here a fake that copies and logs
    its arguments), tokenmill's batch-1 rows on it under the type's name with the batch-1 targets,
    and a type llama-quantize refuses is a cell saying so: the other types still run, and the command
    fails at the end (as for any error cell)."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    log = tmp_path / "quantize.log"
    fake = peers.peers_dir() / "bin" / "llama-quantize"
    fake.parent.mkdir(parents=True)
    fake.write_text(FAKE_QUANTIZE.format(python=sys.executable, log=str(log)))
    fake.chmod(0o755)
    model = str(tiny_gguf_model("llama"))
    out = tmp_path / "compare.json"
    argv = ["bench", "compare", "--model", model, *SMALL, "--concurrency", "--decode-heavy-concurrency", "--peers",
            "--quant-types", "Q8_0", "Q6_K", "--output", str(out)]
    assert main(argv) == 1
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c[0] for c in calls] == ["--allow-requantize"] * 2 and [c[1] for c in calls] == [model] * 2
    assert [c[3:] for c in calls] == [["Q8_0", "1"], ["Q6_K", "1"]]   # type, threads
    assert Path(calls[0][2]).name.endswith(".tmp")   # written aside, then renamed
    rows = _rows(json.loads(out.read_text()))
    for key in ("Q8_0/prefill_16_tok_s", "Q8_0/prefill_64_tok_s", "Q8_0/decode_tok_s"):
        assert rows[key]["tokenmill"] > 0
    assert rows["Q8_0/decode_tok_s"]["target"] == 1.0 and rows["Q6_K/decode_tok_s"]["tokenmill"] == "error"
    assert "llama-quantize Q6_K failed" in capsys.readouterr().out
    report = json.loads(out.read_text())
    made = peers.derived_gguf(model, "quant-types", "Q8_0")
    assert report["results"]["tokenmill"]["types"]["Q8_0"]["greedy_tokens"] and made.is_file()
    assert main(argv) == 1 and len(log.read_text().splitlines()) == 3   # Q8_0 made once; Q6_K tried again


def test_compare_long_contexts_adds_bench_longctx_rows(tiny_gguf_model, tmp_path, capsys):
    """--long-contexts: bench longctx's batch-1 rows in compare's table (the decode ratio's target at
    every length), and tokenmill's decode there against the bandwidth bound."""
    out = tmp_path / "compare.json"
    assert main(["bench", "compare", "--model", str(tiny_gguf_model("llama")), *SMALL, "--concurrency",
                 "--decode-heavy-concurrency", "--peers", "--long-contexts", "48", "32", "--long-decode-tokens", "4",
                 "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = _rows(report)
    for n in (32, 48):
        assert rows[f"long_{n}_prefill_tok_s"]["tokenmill"] > 0 and rows[f"long_{n}_prefill_tok_s"]["target"] is None
        assert rows[f"long_{n}_decode_tok_s"]["tokenmill"] > 0 and rows[f"long_{n}_decode_tok_s"]["target"] == 3.0
    assert [r["context"] for r in report["long_roofline"]] == [32, 48]
    assert all(0 < r["fraction"] and r["met"] == (r["fraction"] >= 0.85) for r in report["long_roofline"])
    assert report["config"]["long"]["decode_tokens"] == 4
    assert "32-token prompt decode: " in capsys.readouterr().out
