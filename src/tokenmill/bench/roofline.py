"""`tokenmill bench roofline [MODEL]`: how fast a step could be on this machine, and how fast it is.

A decode step of a batch of B requests reads every weight once (the LM head included) plus each
request's cached K/V, and does ~2 FLOPs per weight per row plus the attention's 4 FLOPs per
(query head dim x context token). Its time is at least max(bytes / bandwidth, FLOPs / matmul peak);
the bound in tokens/s is B over that. The machine's read bandwidth and matmul peak are measured
here, in this process, with torch's threads: the peak of the matmul the weights run on (torch's in
the compute dtype, or for quantized weights tokenmill's int4/int8 kernel, in float-equivalent FLOPs),
and the bytes are those held (packed weights, the KV cache in its own dtype). The engine then runs
the same step and the table shows the measured tokens/s as a fraction of the bound. Prefill (one
prompt) is the same sum with T rows.

Batch 1 (decode at batch 1, and the prefill row) is measured as `bench latency` and `bench
compare` measure it (`batch1.measure`: greedy through `LLM.stream`, the median over fresh
prompts), so the three agree on the same model and flags; larger decode batches are timed over
engine steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tokenmill.bench import batch1, output_file
from tokenmill.bench.latency import stream_gen
from tokenmill.bench.workload import batch1_prompts
from tokenmill.config import ModelConfig


@dataclass
class Machine:
    threads: int
    read_gb_s: float          # sum over a buffer far larger than the caches (the highest of read_samples)
    matmul_gflop_s: float     # a large square matmul, of the kind the model's weights run on
    matmul: str               # which: torch's in the compute dtype, or tokenmill's quantized kernel
    read_samples: tuple[float, ...] = ()   # every buffer's rate measured (before the runs, after them)


def _best_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth_gb_s(buffer_bytes: int = 1 << 30, repeats: int = 5, buffers: int = 2) -> tuple[float, ...]:
    """GB/s of a sum over each of `buffers` buffers far larger than the caches, held at once, with
    torch's threads (each the best of `repeats`). On a shared VM the rate moves with time (other
    tenants' traffic): an AVX-512 EPYC read 33-37 GB/s for a minute, then 62-67. A bound is the
    machine's rate, the highest seen; the benchmarks measure again after their runs
    (`StepCost.remeasured`), since a bound taken in a slow spell would flatter every fraction of it."""
    held = [torch.ones(buffer_bytes // 4, dtype=torch.float32) for _ in range(buffers)]
    return tuple(buffer_bytes / _best_time(buf.sum, repeats) / 1e9 for buf in held)


def describe_read(read_gb_s: float, samples: tuple[float, ...] | list[float]) -> str:
    """The read bandwidth a bound used, and the samples it is the highest of, for a report's header."""
    return (f"{read_gb_s:.1f} GB/s (the highest of {', '.join(f'{r:.0f}' for r in samples)}: buffers before and "
            f"after the runs)")


def measure_machine(dtype: torch.dtype, bits: int | None = None, buffer_bytes: int = 1 << 30, n: int = 2048,
                    repeats: int = 5) -> Machine:
    """Read bandwidth, and the matmul peak of dense `dtype` weights as a model's many-row products run
    them (`dense_linear`: float32 for bf16 where the CPU has no bf16 units) or, for weights held in
    `bits` (4 or 8), of the quantized kernel (float-equivalent FLOPs: 2 per weight per row, as the rows count them)."""
    def best(fn) -> float:
        return _best_time(fn, repeats)

    samples = read_bandwidth_gb_s(buffer_bytes, repeats)
    read = max(samples)
    if bits is None:
        from tokenmill.layers.linear import dense_linear, dense_matmul_dtype

        a = torch.randn(n, n).to(dtype)
        flops = 2 * n**3 / best(lambda: dense_linear(a, a, kernel=False)) / 1e9
        weights, compute = (str(t).removeprefix("torch.") for t in (dtype, dense_matmul_dtype(a)))
        name = weights if compute == weights else f"{weights} weights, {compute}"
        return Machine(torch.get_num_threads(), read, flops, f"{name} matmul (torch)", samples)
    from tokenmill.layers.quant import QuantWeight, quantize

    weight, x = QuantWeight(quantize(torch.randn(n, n), bits), torch.float32), torch.randn(n, n)
    flops = 2 * n**3 / best(lambda: weight.matmul(x)) / 1e9
    return Machine(torch.get_num_threads(), read, flops, f"int{bits} quantized kernel (float32 activations)", samples)


def weight_bytes_per_step(model: torch.nn.Module, vocab_size: int) -> int:
    """Bytes of every weight a step reads: all parameters and buffers once, except embedding tables
    and rotary caches (a step reads only its rows of those), plus a tied LM head's table."""
    from tokenmill.layers.linear import Embedding
    from tokenmill.layers.rotary import RotaryEmbedding

    skipped: set[int] = set()
    tied = getattr(model, "lm_head", "absent") is None
    extra = 0
    for module in model.modules():
        if isinstance(module, (Embedding, RotaryEmbedding)):
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                skipped.add(t.data_ptr())
                if tied and isinstance(module, Embedding) and t.shape[0] == vocab_size:
                    extra += t.numel() * t.element_size()
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        ptr = t.data_ptr()
        if ptr in seen or ptr in skipped:
            continue
        seen.add(ptr)
        total += t.numel() * t.element_size()
    return total + extra


def matmul_flops_per_row(cfg: ModelConfig) -> int:
    """2 x the multiply-adds of the dense projections and the LM head, for one token."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    gated = cfg.architecture != "gpt2"
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + \
        (3 if gated else 2) * cfg.hidden_size * cfg.intermediate_size
    return 2 * (cfg.num_layers * per_layer + cfg.hidden_size * cfg.vocab_size)


def attention_flops(cfg: ModelConfig, queries: int, context: int) -> int:
    """QK^T and PV for `queries` rows that each see `context` tokens."""
    return 4 * queries * context * cfg.num_heads * cfg.head_dim * cfg.num_layers


@dataclass
class Row:
    name: str
    tokens: int               # tokens produced (decode) or processed (prefill) per step
    bytes: int
    flops: int
    bound_by: str
    bound_tok_s: float
    measured_tok_s: float

    @property
    def fraction(self) -> float:
        return self.measured_tok_s / self.bound_tok_s


def bound(name: str, tokens: int, nbytes: int, flops: int, machine: Machine, measured_tok_s: float) -> Row:
    t_mem, t_flop = nbytes / (machine.read_gb_s * 1e9), flops / (machine.matmul_gflop_s * 1e9)
    return Row(name, tokens, nbytes, flops, "memory" if t_mem >= t_flop else "compute",
               tokens / max(t_mem, t_flop), measured_tok_s)


@dataclass
class StepCost:
    """What a step's bound needs: this machine's rates, and the engine's bytes and FLOPs per step."""
    machine: Machine
    weight_bytes: int       # every weight a step reads
    kv_bytes_per_token: int
    flops_per_row: int      # the projections' and the LM head's
    model_config: ModelConfig

    @classmethod
    def of(cls, engine: Any) -> StepCost:
        """The engine's costs, and the machine measured for the matmul its weights run on: torch's
        in the compute dtype, or the quantized kernel of the form most layers hold."""
        from tokenmill.engine.kv_cache import kv_bytes_per_token
        from tokenmill.models.loader import weight_forms

        cfg = engine.model_config
        forms = weight_forms(engine.model)
        most = max(forms, key=forms.__getitem__)   # "dense", "int4" or "int8"
        machine = measure_machine(engine.dtype, None if most == "dense" else int(most.removeprefix("int")))
        return cls(machine, weight_bytes_per_step(engine.model, cfg.vocab_size),
                   kv_bytes_per_token(cfg, engine.kv_dtype), matmul_flops_per_row(cfg), cfg)

    def remeasured(self) -> StepCost:
        """These costs with the read bandwidth measured again (after the runs), the highest rate kept."""
        samples = (*self.machine.read_samples, *read_bandwidth_gb_s())
        return replace(self, machine=replace(self.machine, read_gb_s=max(samples), read_samples=samples))

    def decode(self, batch: int, context: int, measured_tok_s: float) -> Row:
        """A decode step of `batch` requests of `context` cached tokens."""
        return bound(f"decode batch {batch}, context {context}", batch,
                     self.weight_bytes + batch * (context + 1) * self.kv_bytes_per_token,
                     batch * self.flops_per_row + attention_flops(self.model_config, batch, context + 1), self.machine,
                     measured_tok_s)

    def prefill(self, n: int, measured_tok_s: float) -> Row:
        """One prompt of n tokens."""
        return bound(f"prefill {n} tokens", n, self.weight_bytes + n * self.kv_bytes_per_token,
                     n * self.flops_per_row + attention_flops(self.model_config, n, (n + 1) // 2), self.machine,
                     measured_tok_s)


def decode_tokens_per_request(batch: int, context: int, steps: int, max_num_batched_tokens: int) -> int:
    """measure_decode's max_tokens: the timed steps, the warm-up, and the tokens the first requests
    decode while the batch's last prompts are still being prefilled (a step takes at most
    max_num_batched_tokens prompt tokens), so that none finishes before the timed steps end."""
    return steps + 4 + -(-batch * context // max_num_batched_tokens)


def measure_decode(llm, batch: int, context: int, steps: int) -> float:
    """Tokens/s of decode steps of `batch` requests whose context is about `context` tokens: the
    tokens the steps generated (the engine's counter, not batch x steps: a pool or a max_num_seqs
    too small for the batch runs fewer at once, and must not count as faster)."""
    start_decode(llm, batch, context, steps)
    tokens, elapsed = time_decode(llm, steps)
    return tokens / elapsed


def start_decode(llm, batch: int, context: int, steps: int) -> None:
    """Add `batch` requests of `context` random tokens (room for `steps` decode steps each), prefill
    them and run the first all-decode step (a warm-up)."""
    from tokenmill import SamplingParams

    engine = llm.engine
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=decode_tokens_per_request(batch, context, steps,
                                                                 engine.config.max_num_batched_tokens),
                            temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(context)], params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    engine.step()


def time_decode(llm, steps: int) -> tuple[int, float]:
    """(tokens generated, seconds) of `steps` engine steps after start_decode; the requests are
    aborted after."""
    engine = llm.engine
    before, start = engine.num_generation_tokens, time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed, tokens = time.perf_counter() - start, engine.num_generation_tokens - before
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return tokens, elapsed


def run_roofline(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill import LLM
    from tokenmill.config import engine_args
    from tokenmill.errors import TokenmillError

    if any(b < 1 for b in args.batch_size) or min(args.context, args.prefill_len, args.steps, args.repeats) < 1:
        raise TokenmillError("--batch-size, --context, --prefill-len, --steps and --repeats must be >= 1")
    # every engine flag as given, but room for the largest decode batch and the prefill row in one step
    llm = LLM(args.model, **{**engine_args(args), "max_num_seqs": max(args.max_num_seqs, *args.batch_size),
                             "max_num_batched_tokens": max(args.max_num_batched_tokens, args.prefill_len)})
    engine = llm.engine
    if engine.device.type != "cpu":
        raise TokenmillError("bench roofline measures this CPU; run it with --device cpu")
    dtype = engine.dtype
    cost = StepCost.of(engine)
    work = {**batch1_prompts(llm.tokenizer, [args.prefill_len], args.context, args.repeats, seed=0),
            "decode_tokens": args.steps + 1}   # steps decode steps after the first token
    at_batch1 = batch1.measure(stream_gen(llm), work)
    measured = [(b, at_batch1["decode_tok_s"] if b == 1 else measure_decode(llm, b, args.context, args.steps))
                for b in args.batch_size]
    cost = cost.remeasured()
    machine, weights, kv_token = cost.machine, cost.weight_bytes, cost.kv_bytes_per_token
    rows = [cost.decode(batch, args.context, tok_s) for batch, tok_s in measured]
    rows.append(cost.prefill(args.prefill_len, at_batch1[f"prefill_{args.prefill_len}_tok_s"]))

    print(f"model: {llm.engine.config.model}  dtype: {str(dtype).removeprefix('torch.')}  "
          f"weights read per step: {weights / 2**20:.1f} MiB  KV ({str(engine.kv_dtype).removeprefix('torch.')}): "
          f"{kv_token} B/token")
    print(f"machine ({machine.threads} threads): "
          f"read bandwidth {describe_read(machine.read_gb_s, machine.read_samples)}, "
          f"{machine.matmul} {machine.matmul_gflop_s:.0f} GFLOP/s "
          f"(load average {os.getloadavg()[0]:.1f}: other work on the cores lowers both)")
    print(f"\n{'step':<32}{'MiB/step':>10}{'GFLOP/step':>12}{'bound by':>10}{'bound tok/s':>13}"
          f"{'measured':>10}{'fraction':>10}")
    for r in rows:
        print(f"{r.name:<32}{r.bytes / 2**20:>10.1f}{r.flops / 1e9:>12.2f}{r.bound_by:>10}{r.bound_tok_s:>13.1f}"
              f"{r.measured_tok_s:>10.1f}{r.fraction:>9.0%}")
    report = {"model": llm.engine.config.model, "dtype": str(dtype), "machine": asdict(machine),
              "weight_bytes_per_step": weights, "kv_bytes_per_token": kv_token,
              "rows": [{**asdict(r), "fraction": r.fraction} for r in rows]}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return report


def add_roofline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, action="append", default=None,
                   help="decode batch size (repeatable; default 1 and 32)")
    p.add_argument("--context", type=int, default=256, help="cached tokens per request during decode")
    p.add_argument("--prefill-len", type=int, default=512, help="prompt length of the prefill row")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    p.add_argument("--repeats", type=int, default=3, help="batch-1 repeats (prefill, decode; the median is reported)")
    p.add_argument("--output", type=output_file, default="bench-results/roofline.json")


def cmd_roofline(args: argparse.Namespace) -> int:
    args.model = args.model_path or args.model
    args.batch_size = args.batch_size or [1, 32]
    run_roofline(args)
    return 0
