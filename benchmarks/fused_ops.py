"""The layer's elementwise ops (paceline/model/fused_kernel.py: rms_norm, add_rms_norm, rope, silu_mul) on
SmolLM2-135M's shapes, this tree's build against the same ops at a git revision (--before, built under its own
name), interleaved in one process so machine noise hits both alike. Median of --repeats calls each, warm caches
(the op's inputs were just touched, as in a step where the linear before it wrote them).

    flock -x /tmp/paceline-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/fused_ops.py --before HEAD~1
    flock -x /tmp/paceline-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/fused_ops.py --rows 1500,32 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.int4_linear import kernel_module_at
from paceline.model import fused_kernel

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def calls(ops, rows: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(rows)
    h, r = torch.randn(rows, HIDDEN, generator=g).to(dtype), torch.randn(rows, HIDDEN, generator=g).to(dtype)
    w = torch.randn(HIDDEN, generator=g).to(dtype)
    gu = torch.randn(rows, 2 * INTER, generator=g).to(dtype) * 3
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g).to(dtype)
    rot = torch.randn(rows, HEAD_DIM // 2, 2, generator=g)
    return {"rms_norm": lambda: ops.rms_norm(h, w, 1e-5),
            "add_rms_norm": lambda: ops.add_rms_norm(h, r, w, 1e-5),
            "rope": lambda: ops.rope(qkv, rot, HEADS + KV_HEADS, HEAD_DIM),
            "silu_mul": lambda: ops.silu_mul(gu)}


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="", help="a git revision whose fused_kernel.py to time beside this tree's")
    ap.add_argument("--rows", default="1500,512,32")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=101)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    builds = {"now": fused_kernel.load()}
    if args.before:
        builds = {args.before: kernel_module_at(args.before, "fused_kernel").load(), **builds}
    if any(b is None for b in builds.values()):
        raise SystemExit("the fused ops cannot be built here")
    dtype = getattr(torch, args.dtype)
    print(f"threads={torch.get_num_threads()} dtype={args.dtype}; ms, median of {args.repeats} (interleaved)")
    print("| op | rows | " + " | ".join(builds) + " |")
    print("|---|---:|" + "---:|" * len(builds))
    for rows in (int(x) for x in args.rows.split(",")):
        fns = {name: calls(ops, rows, dtype) for name, ops in builds.items()}
        for op in fns["now"]:
            for name in builds:
                fns[name][op]()  # warm-up (and the build's first call)
            times = {name: [] for name in builds}
            for _ in range(args.repeats):  # interleaved: one call of each build in turn
                for name in builds:
                    times[name].append(median_ms(fns[name][op], 1))
            print(f"| {op} | {rows} | " + " | ".join(f"{sorted(t)[len(t) // 2]:.3f}" for t in times.values()) + " |")


if __name__ == "__main__":
    main()
