"""Interleaved A/B of a C kernel change, in one process.

On a shared machine whose speed drifts by tens of percent over minutes, two runs of a benchmark,
one per build, measure the drift as much as the change. This builds a copy of the kernels' sources
(a directory holding every .c and .h of src/tokenmill/kernels, with the change) next to the
installed build, and calls both on the same data in turn, so that both meet the same drift:

  cp -r src/tokenmill/kernels /tmp/variant && <edit /tmp/variant/...>
  python scripts/kernel-ab.py /tmp/variant decode --context 8192 --batch 1
  python scripts/kernel-ab.py /tmp/variant matmul --rows 1

`decode`: paged_decode over `--layers` distinct layers' caches (cold, as in a decode step), by
default of the default model's attention shape (9 heads, 3 kv heads, head_dim 64; blocks of 16),
blocks in random order (`--order sequential`: one after another). `prefill`: paged_prefill of the
last `--rows` query rows of a `--context`-token request, `--layers` times over one cache. `matmul`:
quant_matmul over the default model's 30 layers of 4-bit weights (with offsets, or `--symmetric`).
Prints each build's median step, the variant's speed relative to the installed build, and the
largest output difference (0 for a value-neutral change). Run it once on an unchanged copy first:
what that A/A reports is the noise floor (a few percent at the default repeats; more with fewer).
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from pathlib import Path

import torch

from tokenmill import kernels
from tokenmill.layers.attention import quantize_kv
from tokenmill.layers.quant import BlockQuant, QuantWeight, quantize

BLOCK = 16
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # SmolLM2-135M: qkv, o, gate_up, down


def build(sources: Path, out: Path) -> ctypes.CDLL:
    """The variant's sources built as the package builds its own (kernels.build), loaded."""
    kernels.build(kernels.compiler(), sorted(sources.glob("*.c")), out)
    lib = ctypes.CDLL(str(out))
    kernels.declare(lib)
    return lib


def decode_step(args: argparse.Namespace):
    blocks = -(-args.context // BLOCK)
    pool = blocks * args.batch + 1

    def cache() -> torch.Tensor:
        x = torch.randn(pool, BLOCK, args.kv_heads, args.head_dim)
        return {"f32": x, "bf16": x.bfloat16(), "int8": quantize_kv(x)}[args.kv]

    layers = [(cache(), cache()) for _ in range(args.layers)]
    order = torch.randperm(pool - 1) if args.order == "random" else torch.arange(pool - 1)
    # each request as --verify-rows entries over its table, at consecutive lengths (a verify step's rows)
    tables = order[:blocks * args.batch].view(args.batch, blocks).repeat_interleave(args.verify_rows, 0).contiguous()
    lens = (torch.arange(args.context - args.verify_rows + 1, args.context + 1)).repeat(args.batch)
    entries = len(lens)
    q = torch.randn(entries, args.heads, args.head_dim)
    threads = torch.get_num_threads()

    def step(lib: ctypes.CDLL) -> torch.Tensor:
        out = torch.empty_like(q)
        for k, v in layers:
            lib.paged_decode(q.data_ptr(), k.data_ptr(), v.data_ptr(), kernels.KV_TYPES[k.dtype], tables.data_ptr(),
                             blocks, lens.data_ptr(), out.data_ptr(), entries, args.heads, args.kv_heads,
                             args.head_dim, BLOCK, k.stride(0), args.head_dim**-0.5, 0, 0.0, threads, 0)
        return out
    return step


def prefill_step(args: argparse.Namespace):
    """One prompt chunk's attention: the last --rows positions of a --context-token request."""
    blocks = -(-args.context // BLOCK)
    x = torch.randn(blocks + 1, BLOCK, args.kv_heads, args.head_dim)
    k, v = ({"f32": t, "bf16": t.bfloat16(), "int8": quantize_kv(t)}[args.kv] for t in (x, torch.randn_like(x)))
    table = torch.randperm(blocks)[:blocks].contiguous()
    q = torch.randn(args.rows, args.heads, args.head_dim)
    threads = torch.get_num_threads()

    def step(lib: ctypes.CDLL) -> torch.Tensor:
        out = torch.empty_like(q)
        for _ in range(args.layers):
            lib.paged_prefill(q.data_ptr(), k.data_ptr(), v.data_ptr(), kernels.KV_TYPES[k.dtype], table.data_ptr(),
                              args.context, args.rows, out.data_ptr(), args.heads, args.kv_heads, args.head_dim, BLOCK,
                              k.stride(0), args.head_dim**-0.5, 0, 0.0, threads)
        return out
    return step


def matmul_step(args: argparse.Namespace):
    def weight(n: int, k: int) -> QuantWeight:
        q = quantize(torch.randn(n, k), 4)
        if args.symmetric:   # Q4_0's form: offsets -8 d, which the kernel derives rather than reads
            q = BlockQuant(q.u, q.d, -8 * q.d, 4)
        w = QuantWeight(q, torch.float32)
        w.int8_activations = args.int8_activations
        return w

    weights = [weight(n, k) for _ in range(30) for n, k in LAYER_SHAPES]
    plans = [w.plan() for w in weights]
    xs = {k: torch.randn(args.rows, k) for _, k in LAYER_SHAPES}
    threads = torch.get_num_threads()

    # the outputs allocated once: fresh ones per call would time their page faults along with the kernel
    outs = [torch.empty(args.rows, p.out_features) for p in plans]

    def step(lib: ctypes.CDLL) -> list[torch.Tensor]:
        for p, _, y in zip(plans, weights, outs, strict=True):   # (the plans point into the weights: kept alive)
            lib.quant_matmul(xs[p.in_features].data_ptr(), args.rows, ctypes.byref(p), 0, None, 0.0, None,
                             y.data_ptr(), 0, threads)
        return outs
    return step


def flat(result: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """A step's output(s) as one new tensor (a copy: a later step may overwrite them)."""
    return torch.cat([t.flatten() for t in (result if isinstance(result, list) else [result])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variant", type=Path, help="a directory with the changed kernel sources")
    parser.add_argument("kernel", choices=["decode", "prefill", "matmul"])
    parser.add_argument("--context", type=int, default=8192, help="decode and prefill: tokens in the cache")
    parser.add_argument("--batch", type=int, default=1, help="decode: requests in the step")
    parser.add_argument("--verify-rows", type=int, default=1,
                        help="decode: query rows per request (a speculative verify step's k + 1)")
    parser.add_argument("--layers", type=int, default=30, help="decode and prefill: calls per step")
    parser.add_argument("--heads", type=int, default=9, help="decode and prefill")
    parser.add_argument("--kv-heads", type=int, default=3, help="decode and prefill")
    parser.add_argument("--head-dim", type=int, default=64, help="decode and prefill")
    parser.add_argument("--kv", choices=["f32", "bf16", "int8"], default="bf16", help="decode and prefill: cache type")
    parser.add_argument("--rows", type=int, default=None,
                        help="activation rows (matmul, default 1) / the chunk's query rows (prefill, default 512)")
    parser.add_argument("--order", choices=["random", "sequential"], default="random",
                        help="decode: the requests' blocks in random cache order (a long-running server's), or "
                             "one after another (a fresh engine's)")
    parser.add_argument("--symmetric", action="store_true",
                        help="matmul: symmetric 4-bit weights (Q4_0's form) instead of ones with offsets (Q4_1's)")
    parser.add_argument("--int8-activations", action="store_true",
                        help="matmul: the weights round activations to one int8 plane (activation_precision int8)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.rows is None:
        args.rows = 512 if args.kernel == "prefill" else 1
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if kernels.load() is None:
            raise SystemExit("the installed kernels did not build (see the warning above)")
        libs = {"installed": kernels.load(), "variant": build(args.variant, Path(tmp) / "variant.so")}
        step = {"decode": decode_step, "prefill": prefill_step, "matmul": matmul_step}[args.kernel](args)
        first = {name: flat(step(lib)) for name, lib in libs.items()}
        times: dict[str, list[float]] = {name: [] for name in libs}
        for _ in range(args.repeats):
            for name, lib in libs.items():
                start = time.perf_counter()
                step(lib)
                times[name].append(time.perf_counter() - start)
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:9s} median {median[name] * 1e3:8.3f} ms   min {min(t) * 1e3:8.3f} ms")
    print(f"variant speed: {median['installed'] / median['variant']:.3f}x of installed; largest output difference "
          f"{(first['installed'] - first['variant']).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
