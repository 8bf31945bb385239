"""Tensor parallelism (tokenmill/parallel.py, engine/workers.py): TP=2 == TP=1.

Megatron sharding is exact up to summation order: the row-parallel layers' all-reduce adds the
ranks' partial sums, so logits differ from one rank's by float rounding (float32 here: log-
probabilities within LOGPROB_TOL) and greedy tokens are identical. Every engine feature runs on
the sharded model unchanged (the scheduler, block tables and sampling stay on rank 0), which the
workload test checks against the same workload on one rank. Each TP engine starts one worker
process (a fresh interpreter), so these tests are a few seconds each.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from engine_helpers import make_engine
from test_server import Server, running, wait_for

from tokenmill import LLM, parallel
from tokenmill.config import EngineConfig
from tokenmill.engine import engine as engine_module
from tokenmill.engine import workers
from tokenmill.engine.workers import free_port
from tokenmill.errors import TokenmillError
from tokenmill.parallel import ParallelError, TensorParallel
from tokenmill.sampling import SamplingParams
from tokenmill.sampling.structured import StructuredOutputsParams

LOGPROB_TOL = 1e-4     # float32 activations: all-reduce order only
# Quantized weights: the next layer's activation rounding (two int8 planes per group of 32: steps of
# 1/32258 of the group's largest value) turns a last-bit difference of a reordered sum into a whole
# rounding step now and then, so the two runs agree to that rounding, not to float32's.
QUANT_LOGPROB_TOL = 2e-2
# The default model's bfloat16 KV cache rounds K and V to 8 bits of mantissa: the same flips, larger.
BF16_KV_LOGPROB_TOL = 1e-1
PROMPTS = [list(range(5, 40)), [7, 7, 7, 9, 11, 200, 3], list(range(100, 180, 3))]


def children(pid: int) -> list[int]:
    """Live child processes of `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def run_greedy(engine, prompts=PROMPTS, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_blocks == engine.pool.num_blocks
    return [r.output_token_ids for r in requests], [[lp for lp, _ in r.logprobs] for r in requests], \
        [[top for _, top in r.logprobs] for r in requests]


def assert_same_run(a, b, tol):
    assert a[0] == b[0]
    worst = max(abs(x - y) for ra, rb in zip(a[1], b[1], strict=True) for x, y in zip(ra, rb, strict=True))
    assert worst <= tol, worst
    # The top-3 alternatives too: the same best token, and every alternative both runs list (a near-tie
    # may swap the others) within twice the bound: an alternative's log-probability carries its own
    # logit's rounding and the normalizer's (measured: up to 0.022 on the tiny Q4_K model, 0.0064 for
    # the sampled tokens).
    for ra, rb in zip(a[2], b[2], strict=True):
        for ta, tb in zip(ra, rb, strict=True):
            top_a, top_b = dict(ta), dict(tb)
            assert ta[0][0] == tb[0][0]
            assert all(abs(top_a[t] - top_b[t]) <= 2 * tol for t in top_a.keys() & top_b.keys()), (ta, tb)


def tp_engine(path, **kwargs):
    return make_engine(path, tensor_parallel_size=2, threads=1, **kwargs)


# ---- the partition ------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,kv_heads,size", [(9, 3, 2), (4, 2, 2), (8, 2, 4), (12, 12, 5), (8, 1, 2), (4, 4, 3),
                                                 (32, 8, 3)])
def test_every_query_head_lands_on_a_rank_with_its_kv_head(heads, kv_heads, size):
    group = heads // kv_heads
    seen = []
    for rank in range(size):
        s = parallel.head_slice(heads, kv_heads, TensorParallel(rank, size))
        assert len(s.q) > 0 and len(s.kv) > 0
        assert all(h // group in s.kv for h in s.q)
        seen += list(s.q)
    assert sorted(seen) == list(range(heads))   # each query head on exactly one rank
    # each KV head on one rank, or (fewer KV heads than ranks) one replica per rank
    assert sum(parallel.kv_heads_per_rank(heads, kv_heads, size)) == max(kv_heads, size)


@pytest.mark.parametrize("heads,kv_heads,size", [(6, 2, 4), (4, 2, 3), (2, 1, 4)])
def test_head_counts_that_cannot_be_spread_are_refused(heads, kv_heads, size):
    with pytest.raises(TokenmillError, match="cannot be spread"):
        for rank in range(size):
            parallel.head_slice(heads, kv_heads, TensorParallel(rank, size))


def test_split_takes_whole_units_and_refuses_what_it_cannot_cut():
    assert parallel.split(1536, 2, 32) == [range(0, 768), range(768, 1536)]
    assert [len(r) for r in parallel.split(96, 2, 32)] == [64, 32]   # uneven, in whole groups
    assert parallel.mlp_slice(100, TensorParallel(1, 2)) == range(50, 100)   # no groups: any column
    with pytest.raises(TokenmillError, match="units"):
        parallel.split(32, 2, 32)


def test_an_engine_whose_heads_cannot_be_spread_is_refused_and_leaves_no_worker(tiny_hf_model, monkeypatch):
    before = set(children(os.getpid()))   # (other tests' helpers may live on)
    with pytest.raises(TokenmillError, match="cannot be spread"):   # 2 KV heads on 3 ranks
        make_engine(tiny_hf_model("llama"), tensor_parallel_size=3, threads=1)
    assert wait_for(lambda: not set(children(os.getpid())) - before, 10), set(children(os.getpid())) - before
    # refused before any rank's process starts (-tp 16 used to start 15 workers first)
    started = []
    monkeypatch.setattr(engine_module, "TPWorkers", lambda *args: started.append(args))
    with pytest.raises(TokenmillError, match="cannot be spread"):
        make_engine(tiny_hf_model("llama"), tensor_parallel_size=16, threads=1)
    assert not started


# ---- TP=2 == TP=1 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,ftype", [("llama", None), ("qwen3", None), ("gpt2", None), ("gemma2", None),
                                        ("mixtral", None), ("llama", "Q4_0"), ("llama256", "Q4_K")])
def test_tp2_matches_tp1(kind, ftype, tiny_hf_model, tiny_gguf_model):
    path = tiny_hf_model(kind) if ftype is None else tiny_gguf_model(kind, ftype)
    one = run_greedy(make_engine(path, threads=1))
    engine = tp_engine(path)
    try:
        two = run_greedy(engine)
    finally:
        engine.shutdown()
    assert_same_run(one, two, LOGPROB_TOL if ftype is None else QUANT_LOGPROB_TOL)


@pytest.mark.parametrize("kv_cache_dtype,tol", [("float32", QUANT_LOGPROB_TOL), ("auto", BF16_KV_LOGPROB_TOL)])
def test_default_model_tp2_matches_tp1(default_gguf_path, kv_cache_dtype, tol):
    """SmolLM2: 9 query heads over 3 KV heads, split unevenly (rank 0: KV heads 0-1, query heads 0-5)."""
    settings = dict(dtype="auto", threads=1, kv_cache_dtype=kv_cache_dtype)
    one = run_greedy(make_engine(default_gguf_path, **settings), max_tokens=16)
    engine = make_engine(default_gguf_path, tensor_parallel_size=2, **settings)
    try:
        assert [a.num_kv_heads for a in engine.model.modules() if hasattr(a, "kv_cache")][0] == 2
        two = run_greedy(engine, max_tokens=16)
    finally:
        engine.shutdown()
    assert_same_run(one, two, tol)


def test_decode_stack_under_tp_gives_the_layer_loops_bits(tiny_gguf_model):
    """The C decode stack all-reduces the row-parallel outputs itself (kernels.c, shm_exchange.c).
    Rank 0 on the layer loop (Linear's all-reduces from Python) and rank 1 on the stack must give
    the bits of both ranks on the stack: rank 0's part (residual added there) and the order of the
    sum are the same either way. (A worker's stack that got it wrong fails the parity tests above.)
    Prefix caching is off, so that both runs prefill alike (a hit in the second would compute a
    prompt's last row with the decode kernel instead of the prefill's SDPA on builds without AVX-512)."""
    engine = tp_engine(tiny_gguf_model("llama", "Q4_0"), enable_prefix_caching=False)
    try:
        both = run_greedy(engine)
        stack = engine.model.model
        assert stack._plan not in (None, False), "the decode stack did not run"
        stack.use_decode_stack = False
        mixed = run_greedy(engine)
    finally:
        engine.shutdown()
    assert both == mixed


def workload(engine) -> tuple[list, object]:
    """Long prompts in chunks (max_num_batched_tokens 32), a shared prefix, seeded sampling, a
    pool small enough to preempt, one request aborted midway; the outputs and the engine's stats."""
    prefix = list(range(10, 58))
    prompts = [prefix + [60 + i] * (i + 1) for i in range(4)] + [list(range(200, 270)), [5, 6, 7]]
    requests = [engine.add_request(p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
                for p in prompts]
    requests.append(engine.add_request(prefix, SamplingParams(max_tokens=16, temperature=0.9, seed=7,
                                                              ignore_eos=True)))
    doomed = engine.add_request(list(range(30, 60)), SamplingParams(max_tokens=40, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 4:
            engine.abort(doomed.request_id)
    assert doomed.finish_reason == "abort"
    assert engine.num_free_blocks == engine.pool.num_blocks
    return [r.output_token_ids for r in requests], engine.stats()


def test_engine_features_under_tp2(tiny_hf_model):
    path = tiny_hf_model("llama")
    settings = dict(max_num_batched_tokens=32, num_kv_blocks=14, block_size=8, max_num_seqs=6)
    one, stats_one = workload(make_engine(path, threads=1, **settings))
    engine = tp_engine(path, **settings)
    try:
        two, stats = workload(engine)
        alone = run_greedy(engine, [PROMPTS[1]])[0]            # batch independence: alone ...
        batched = run_greedy(engine, PROMPTS)[0][1]            # ... and in a batch
    finally:
        engine.shutdown()
    assert two == one
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert alone[0] == batched


def test_structured_output_and_parallel_sampling_under_tp2(tiny_gguf_model):
    """Through the LLM API (tokenizer, grammar, n > 1): the same outputs on one rank and on two."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = [SamplingParams(max_tokens=40, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(max_tokens=12, temperature=0.8, seed=3, n=2)]
    path = str(tiny_gguf_model("llama"))

    def outputs(**kwargs):
        llm = LLM(path, dtype="float32", threads=1, **kwargs)
        try:
            return [[o.text for o in r.outputs] for r in llm.generate(["A person:", "Once upon"], params,
                                                                         use_tqdm=False)]
        finally:
            llm.engine.shutdown()

    one = outputs()
    assert one[0][0].lstrip().startswith("{"), one[0][0]   # the grammar ran
    assert outputs(tensor_parallel_size=2) == one


def test_draft_model_speculation_under_tp2(tiny_gguf_model):
    """The draft runs on rank 0 alone (its engine is built with one rank); the target on two."""
    path = str(tiny_gguf_model("llama"))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def texts(**kwargs):
        llm = LLM(path, dtype="float32", threads=1, **kwargs)
        try:
            out = [r.outputs[0].text for r in llm.generate(["Once upon a time", "The cat sat"], params, use_tqdm=False)]
            return out, llm.engine.stats().spec_num_draft_tokens
        finally:
            llm.engine.shutdown()

    plain, _ = texts()
    spec, drafted = texts(tensor_parallel_size=2, speculative_config={"model": path, "num_speculative_tokens": 3})
    assert spec == plain and drafted > 0


def test_speculation_under_tp2(tiny_hf_model):
    path = tiny_hf_model("llama")
    prompts = [[5, 6, 7, 8] * 6, list(range(40, 70))]
    plain = run_greedy(make_engine(path, threads=1), prompts, 24)[0]
    engine = tp_engine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        assert run_greedy(engine, prompts, 24)[0] == plain
        assert engine.stats().spec_num_draft_tokens > 0
    finally:
        engine.shutdown()


# ---- ranks started elsewhere -----------------------------------------------------------------------

def test_ranks_started_elsewhere_join_through_torchrun_variables(tiny_hf_model, monkeypatch):
    """Two "machines" on loopback: the engine as RANK 0 and `tokenmill worker` as RANK 1 of a group
    named by torchrun's variables; all traffic over gloo (no shared mapping between machines)."""
    path = tiny_hf_model("llama")
    one = run_greedy(make_engine(path, threads=1))
    meet = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    worker = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "worker"],
                              env={**os.environ, **meet, "RANK": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        for name, value in {**meet, "RANK": "0"}.items():
            monkeypatch.setenv(name, value)
        engine = tp_engine(path)
        try:
            assert engine.workers.procs == [] and engine.workers.tp.shm is None
            two = run_greedy(engine)
        finally:
            engine.shutdown()
        assert worker.wait(30) == 0, worker.stderr.read()
    finally:
        worker.kill()
    assert_same_run(one, two, LOGPROB_TOL)


@pytest.mark.parametrize("env,message", [({}, "set MASTER_ADDR"), ({"RANK": "0"}, "RANK=0 is the engine's"),
                                         ({"RANK": "2"}, "not one of WORLD_SIZE 2's ranks"),
                                         ({"RANK": "1", "MASTER_PORT": "99999"}, "MASTER_PORT must be a TCP port"),
                                         ({"RANK": "1", "MASTER_PORT": "-1"}, "MASTER_PORT must be a TCP port"),
                                         # (a traceback from the group's store, then waited out its join timeout)
                                         ({"RANK": "1", "WORLD_SIZE": str(2**63)}, "WORLD_SIZE must be at most 512"),
                                         ({"RANK": "1", "MASTER_ADDR": "a..b"}, "MASTER_ADDR 'a..b' is not an")])
def test_worker_command_refuses_a_missing_or_wrong_rank(env, message):
    meet = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "2"} if env else {}
    clean = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")}
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "worker"], env={**clean, **meet, **env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_worker_whose_engine_never_comes_gives_up_after_the_join_timeout(monkeypatch):
    # (a worker started by hand with a wrong MASTER_ADDR once waited a year; its collectives still may)
    from tokenmill.engine import worker_process
    monkeypatch.setattr(worker_process, "COLLECTIVE_TIMEOUT_S", 2)
    start = time.monotonic()
    with pytest.raises(ParallelError, match="rank 1 could not join the group"):
        worker_process.worker_main(1, workers.Rendezvous("127.0.0.1", free_port(), 2))
    assert time.monotonic() - start < 30


def test_an_engine_rank_that_is_not_zero_is_refused(tiny_hf_model, monkeypatch):
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "WORLD_SIZE": "2", "RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(TokenmillError, match="tokenmill worker"):
        tp_engine(tiny_hf_model("llama"))


# ---- failure --------------------------------------------------------------------------------------

def test_a_dead_worker_fails_the_step_in_bounded_time_and_leaves_no_process(tiny_hf_model):
    before = set(children(os.getpid()))
    engine = tp_engine(tiny_hf_model("llama"))
    try:
        for p in PROMPTS:
            engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True))
        engine.step()
        worker = engine.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(ParallelError, match="rank 1 .* was killed by SIGKILL"):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < 30
    finally:
        engine.shutdown()
    assert worker.poll() is not None
    assert wait_for(lambda: not set(children(os.getpid())) - before, 10), set(children(os.getpid())) - before


def test_workers_exit_when_the_engine_process_is_killed(tiny_hf_model):
    script = ("import sys, time; sys.path.insert(0, 'tests'); from engine_helpers import make_engine; "
              f"e = make_engine({str(tiny_hf_model('llama'))!r}, tensor_parallel_size=2, threads=1); "
              "print(e.workers.procs[0].pid, flush=True); time.sleep(600)")
    engine_proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(engine_proc.stdout.readline())
        engine_proc.kill()   # SIGKILL: no cleanup runs in the engine's process
        engine_proc.wait(30)
        assert wait_for(lambda: not Path(f"/proc/{worker}").exists() or
                        Path(f"/proc/{worker}/stat").read_text().split(")")[1].split()[0] == "Z", 15)
    finally:
        engine_proc.kill()


def test_a_worker_that_dies_while_starting_fails_the_engine_at_once(tiny_hf_model, monkeypatch):
    monkeypatch.setattr(workers, "WORKER_MODULE", "tokenmill.no_such_module")
    start = time.monotonic()
    with pytest.raises(ParallelError, match="rank 1 .* exited with code 1"):
        tp_engine(tiny_hf_model("llama"))
    assert time.monotonic() - start < 60   # (the rendezvous itself would wait COLLECTIVE_TIMEOUT_S)


def test_an_idle_worker_sleeps(tiny_hf_model):
    """Between requests a worker waits for the next batch without a time limit and without
    spinning a core."""
    engine = tp_engine(tiny_hf_model("llama"))
    try:
        run_greedy(engine, PROMPTS[:1], 4)
        stat = Path(f"/proc/{engine.workers.procs[0].pid}/stat")

        def cpu_seconds() -> float:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        time.sleep(0.5)
        before = cpu_seconds()
        time.sleep(2.0)
        assert cpu_seconds() - before < 0.5
        assert run_greedy(engine, PROMPTS[:1], 4)[0]   # and it still answers
    finally:
        engine.shutdown()


def test_serve_fails_requests_and_exits_nonzero_when_a_worker_dies(tiny_gguf_model, tmp_path):
    s = Server([str(tiny_gguf_model("llama")), "--dtype", "float32", "--device", "cpu", "--threads", "1",
                "--tensor-parallel-size", "2"], tmp_path / "tp.log")
    with running(s, None):
        body = {"prompt": "Once upon a time", "max_tokens": 8}
        assert httpx.post(s.base + "/v1/completions", json=body, timeout=60).status_code == 200
        workers = children(s.proc.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        r = httpx.post(s.base + "/v1/completions", json=body, timeout=60)
        assert r.status_code in (500, 503), r.text
        assert s.proc.wait(60) != 0
    assert "killed by SIGKILL" in s.log()
    assert not Path(f"/proc/{workers[0]}/stat").exists() or \
        (Path(f"/proc/{workers[0]}/stat").read_text().split(")")[1].split()[0] == "Z")


def test_tensor_parallel_size_must_be_positive_and_bounded(tiny_hf_model):
    with pytest.raises(TokenmillError, match="tensor_parallel_size"):
        make_engine(tiny_hf_model("llama"), tensor_parallel_size=0)
    # (2**63 was an OverflowError sizing the ranks' shared memory, after creating its file)
    with pytest.raises(TokenmillError, match="tensor_parallel_size must be at most 512, got 9223372036854775808"):
        EngineConfig(tensor_parallel_size=2**63)


@pytest.mark.parametrize("size", [2, 0])
def test_pipeline_parallelism_is_refused_with_the_reason(tiny_hf_model, size):
    with pytest.raises(TokenmillError, match="pipeline parallelism is not supported.*tensor_parallel_size"):
        make_engine(tiny_hf_model("llama"), pipeline_parallel_size=size)
