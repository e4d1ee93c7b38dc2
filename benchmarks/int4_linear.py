"""int4 matmul for few rows: torch's `_weight_int4pack_mm_for_cpu` against paceline's C++ op (int4_kernel.py), one
linear at a time at the bundled model's shapes, then whole runner steps (one decode; one decode verifying j
proposals) of the bundled model in the default mode (int4), the two ops in two models in this one process. All
timings interleaved (A, B, A, B, ...), median of the repeats.

    python benchmarks/int4_linear.py --rows 1,2,4,5,8 --repeats 200 --step-repeats 15
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from paceline.model import int4_kernel
from paceline.model.llama import INT4_GROUP, Int4Linear, int4_codes


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_linears(shapes: list[tuple[str, int, int]], rows: list[int], repeats: int) -> None:
    op = int4_kernel.load()
    print("| linear (N x K) | rows | torch int4 us | paceline int4 us | speed-up | torch: vs first rows | paceline: vs first rows |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, n, k in shapes:
        codes, scale, lo = int4_codes(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)))
        sz = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        tpack = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        ppack = int4_kernel.pack(codes, scale, lo + 8 * scale)
        first: dict[str, float] = {}
        for m in rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            fns = {"torch": lambda x=x, tpack=tpack, sz=sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, tpack, INT4_GROUP, sz),
                   "paceline": lambda x=x, ppack=ppack, n=n: op(x, ppack, n, None)}
            for f in fns.values():
                timed(f, 5)
            ts = {name_: [] for name_ in fns}
            for _ in range(repeats // 10):  # interleaved in rounds of 10 calls
                for name_, f in fns.items():
                    ts[name_] += timed(f, 10)
            med = {name_: statistics.median(v) * 1e6 for name_, v in ts.items()}
            base = first = first or med  # the first row count (1 by default) is the unit
            print(f"| {name} ({n} x {k}) | {m} | {med['torch']:.1f} | {med['paceline']:.1f} | "
                  f"{med['torch'] / med['paceline']:.2f}x | {med['torch'] / base['torch']:.2f} | "
                  f"{med['paceline'] / base['paceline']:.2f} |", flush=True)


def bench_steps(drafts: list[int], repeats: int, ctx: int) -> None:
    from benchmarks.spec_cost import build
    from paceline.config import CacheConfig, EngineConfig
    from paceline.engine.engine import Engine

    engines = {}
    for name, flag in (("torch int4", "0"), ("paceline int4", "1")):
        os.environ["PACELINE_INT4_KERNEL"] = flag  # read when the model's Int4Linears are built
        engines[name] = Engine(EngineConfig(cache=CacheConfig(kv_cache_memory_gb=0.3)))
        lin = engines[name].runner.model.layers[0].qkv
        assert isinstance(lin, Int4Linear) and (lin.kernel is not None) == (flag == "1"), name
    os.environ.pop("PACELINE_INT4_KERNEL")
    print("\n| step (ctx %d) | torch int4 ms | paceline int4 ms | speed-up | torch: step / decode | paceline: step / decode |" % ctx)
    print("|---|---:|---:|---:|---:|---:|")
    plain = {}
    for j in drafts:
        outs = {name: build(1, j, ctx, e.block_size) for name, e in engines.items()}
        for name, e in engines.items():
            e.runner.execute(outs[name])
        ts = {name: [] for name in engines}
        for _ in range(repeats):
            for name, e in engines.items():
                ts[name] += timed(lambda e=e, batch=outs[name]: e.runner.execute(batch), 1)
        med = {name: statistics.median(v) * 1e3 for name, v in ts.items()}
        if j == 0:
            plain = med
        label = "one decode" if j == 0 else f"verify 1 + {j} rows"
        a, b = med["torch int4"], med["paceline int4"]
        print(f"| {label} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {a / plain['torch int4']:.2f} | "
              f"{b / plain['paceline int4']:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,4,5,8")
    p.add_argument("--repeats", type=int, default=200, help="calls per linear and row count, per op")
    p.add_argument("--step-repeats", type=int, default=15)
    p.add_argument("--drafts", default="0,1,2,4,7")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--skip-steps", action="store_true")
    args = p.parse_args()
    if int4_kernel.load() is None:
        raise SystemExit("the C++ int4 kernel cannot be built here")
    # SmolLM2-135M: hidden 576, 9 + 3 + 3 heads of 64 (fused q/k/v), intermediate 1536 (fused gate/up)
    shapes = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
    bench_linears(shapes, [int(r) for r in args.rows.split(",")], args.repeats)
    if not args.skip_steps:
        bench_steps([int(j) for j in args.drafts.split(",")], args.step_repeats, args.ctx)


if __name__ == "__main__":
    main()
