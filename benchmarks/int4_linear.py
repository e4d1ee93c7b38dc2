"""int4 matmul for few rows: torch's `_weight_int4pack_mm_for_cpu` against paceline's C++ op (int4_kernel.py), one
linear at a time at the bundled model's shapes, then whole runner steps (one decode; one decode verifying j
proposals) of the bundled model in the default mode (int4), the two ops in two models in this one process. All
timings interleaved (A, B, A, B, ...), median of the repeats.

    python benchmarks/int4_linear.py --rows 1,2,4,5,8 --repeats 200 --step-repeats 15

`--sweep` instead: the same four linears at many row counts, paceline's int4 op against the float32 copy that
serves wide steps (prepacked oneDNN, `Linear`) and, with `--before REV`, the int4 op as it was at git revision
REV (its source built under its own name), all in this one process, interleaved:

    python benchmarks/int4_linear.py --sweep --rows 1,4,8,16,32,64,96,128,256,512 --before 98a8064

`--w4a8` instead: the int4-weight x int8-activation op (w4a8_kernel.py; codes as bytes or as nibbles, R rows per
micro-kernel pass) against the float32 copy and the int4 op, at the model's shapes and the LM head's (the LM head
with int4 codes of a random matrix: the bundled model's head is not int4; it is here for its size), interleaved:

    python benchmarks/int4_linear.py --w4a8 --rows 1,6,32,64,256,512 --w4a8-variants b4,n4,b6,n5

With `--w4a8-before REV` the w4a8 op as it was at git revision REV (built under its own name) runs beside it, every
variant with either op, and `--bf16` feeds bfloat16 rows (as the int4 model serves them) instead of float32:

    python benchmarks/int4_linear.py --w4a8 --rows 7,12,32,64 --w4a8-variants n0 --w4a8-before 413c79c --bf16

`--w4a8-numerics` instead: the VNNI build's activation numerics side by side (w4a8_kernel.numerics(): "block",
"row", or "row:K:F" for the row numerics with K taken-out inputs and block refinement up to 2^F, each built under
its own name), one layer's four linears on bfloat16 rows with a few large channels (as the model's inputs have:
every 150th channel x30; the row numerics' per-tile table of taken-out inputs depends on how many differ), ms per
layer, best of 3 interleaved rounds:

    python benchmarks/int4_linear.py --w4a8-numerics block,row,row:0:0 --rows 12,32,128,512
"""
from __future__ import annotations

import argparse
import os
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from paceline.model import int4_kernel
from paceline.model.llama import INT4_GROUP, Int4Linear, Linear, int4_codes


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


def kernel_module_at(rev: str, module: str = "int4_kernel"):
    """paceline/model/<module>.py as it was at git revision `rev`, imported under another name (its op builds
    under its own namespace, keyed by its source), for before/after runs in one process."""
    text = subprocess.run(["git", "show", f"{rev}:paceline/model/{module}.py"], capture_output=True, text=True,
                          check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    name = f"{module}_{rev}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    exec(compile(text, f"{rev}:{module}.py", "exec"), mod.__dict__)
    return mod


def bench_sweep(shapes: list[tuple[str, int, int]], rows: list[int], repeats: int, before: str | None) -> None:
    ops = {"int4": (int4_kernel.load(), int4_kernel.pack)}
    if before:
        old = kernel_module_at(before)
        if old.load() is None:
            raise SystemExit(f"the int4 op of {before} cannot be built here")
        ops = {f"int4 {before}": (old.load(), old.pack), **ops}
    names = [*ops, "int4 many-row path", "fp32 oneDNN"]
    print("| linear (N x K) | rows | " + " | ".join(f"{n} us" for n in names) + " | " +
          " | ".join(f"{n} GFLOP/s" for n in names) + " | fp32 / int4 |")
    print("|---|---:|" + "---:|" * (2 * len(names) + 1))
    totals = {r: {n: 0.0 for n in names} for r in rows}
    for name, n, k in shapes:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
        codes, scale, lo = int4_codes(w)
        packed = {key: pack(codes, scale, lo + 8 * scale) for key, (_, pack) in ops.items()}
        dense = Linear((lo[..., None] + codes.view(n, -1, INT4_GROUP) * scale[..., None]).view(n, k), None, True)
        for m in rows:
            x = torch.randn(m, k)
            fns = {key: (lambda op=op, p=packed[key], x=x, n=n: op(x, p, n, None)) for key, (op, _) in ops.items()}
            # the many-row (GEMM) path at any rows: few_rows=0
            fns["int4 many-row path"] = lambda op=ops["int4"][0], p=packed["int4"], x=x, n=n: op(x, p, n, None, 0)
            fns["fp32 oneDNN"] = lambda dense=dense, x=x: dense(x)
            for f in fns.values():
                timed(f, 3)
            ts = {key: [] for key in fns}
            calls = max(2, repeats // max(1, m // 8))  # fewer calls for the wide rows
            for _ in range(max(1, calls // 5)):  # interleaved in rounds of 5 calls
                for key, f in fns.items():
                    ts[key] += timed(f, 5)
            med = {key: statistics.median(v) * 1e6 for key, v in ts.items()}
            for key in names:
                totals[m][key] += med[key]
            gf = {key: 2 * m * n * k / med[key] / 1e3 for key in names}
            print(f"| {name} ({n} x {k}) | {m} | " + " | ".join(f"{med[c]:.1f}" for c in names) + " | " +
                  " | ".join(f"{gf[c]:.1f}" for c in names) + f" | {med['fp32 oneDNN'] / med['int4']:.2f}x |",
                  flush=True)
    print("\n| rows | " + " | ".join(f"{n}: one layer's 4 linears, us" for n in names) + " | fp32 / int4 |")
    print("|---:|" + "---:|" * (len(names) + 1))
    for m in rows:
        t = totals[m]
        print(f"| {m} | " + " | ".join(f"{t[c]:.1f}" for c in names) + f" | {t['fp32 oneDNN'] / t['int4']:.2f}x |")


def bench_w4a8(shapes: list[tuple[str, int, int]], rows: list[int], repeats: int, variants: list[str],
               before: str | None = None, bf16: bool = False) -> None:
    """variants: b<R> (codes as bytes) or n<R> (nibbles), R rows per micro-kernel pass (0: the build's best);
    before: also the w4a8 op of that git revision; bf16: bfloat16 rows in place of float32."""
    from paceline.model import w4a8_kernel
    op4, op8 = int4_kernel.load(), w4a8_kernel.load()
    if op8 is None:
        raise SystemExit("the C++ w4a8 kernel cannot be built here")
    builds = {"": (op8, w4a8_kernel.pack)}
    if before:
        old = kernel_module_at(before, "w4a8_kernel")
        old_op = old.op_for(old.isa())
        if old_op is None:
            raise SystemExit(f"the w4a8 op of {before} cannot be built here")
        builds = {f" @{before}": (old_op, old.pack), **builds}
    names = ["fp32 oneDNN", "int4 op", *(f"w4a8 {v}{tag}" for tag in builds for v in variants)]
    print("| linear (N x K) | rows | " + " | ".join(f"{n} us" for n in names) + " | " +
          " | ".join(f"{n} GFLOP/s" for n in names[2:]) + " | fp32 / best w4a8 |")
    print("|---|---:|" + "---:|" * (2 * len(names) - 1))
    totals = {r: {n: 0.0 for n in names} for r in rows}
    for name, n, k in shapes:
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
        codes, scale, lo = int4_codes(w)
        dense = Linear((lo[..., None] + codes.view(n, -1, INT4_GROUP) * scale[..., None]).view(n, k), None, True)
        p4 = int4_kernel.pack(codes, scale, lo + 8 * scale)
        p8 = {(tag, nib): pack(codes, scale, lo, nib) for tag, (_, pack) in builds.items() for nib in (False, True)}
        for m in rows:
            if name == "lm_head" and m > 64:
                continue  # a step samples few rows: the LM head never sees hundreds
            x = torch.randn(m, k)
            xw = x.to(torch.bfloat16) if bf16 else x  # the w4a8 ops' rows (the other two keep float32)
            fns = {"fp32 oneDNN": lambda x=x, dense=dense: dense(x),
                   "int4 op": lambda x=x, n=n, p4=p4: op4(x, p4, n, None)}
            for tag, (op, _) in builds.items():
                for v in variants:
                    nib, r = v[0] == "n", int(v[1:])
                    fns[f"w4a8 {v}{tag}"] = lambda op=op, x=xw, n=n, p=p8[tag, nib], nib=nib, r=r: op(x, p, n, None, nib, r)
            for f in fns.values():
                timed(f, 2)
            ts = {key: [] for key in fns}
            calls = max(3, repeats * 64 // max(64, m) * 3072 * 576 // (n * k))  # fewer calls for the big ones
            for _ in range(max(1, calls // 3)):  # interleaved in rounds of 3 calls
                for key, f in fns.items():
                    ts[key] += timed(f, 3)
            med = {key: statistics.median(v) * 1e6 for key, v in ts.items()}
            if name != "lm_head":
                for key in names:
                    totals[m][key] += med[key]
            best = min(med[key] for key in names[2:])
            print(f"| {name} ({n} x {k}) | {m} | " + " | ".join(f"{med[c]:.1f}" for c in names) + " | " +
                  " | ".join(f"{2 * m * n * k / med[c] / 1e3:.1f}" for c in names[2:]) +
                  f" | {med['fp32 oneDNN'] / best:.2f}x |", flush=True)
    # with --w4a8-before: each variant's time at REV over its time now, for one layer's four linears
    pairs = [(f"w4a8 {v} @{before}", f"w4a8 {v}") for v in variants] if before else []
    print("\n| rows | " + " | ".join(f"{n}: one layer's 4 linears, us" for n in names) +
          "".join(f" | {v}: before / now" for v in variants if before) + " |")
    print("|---:|" + "---:|" * (len(names) + len(pairs)))
    for m in rows:
        print(f"| {m} | " + " | ".join(f"{totals[m][c]:.1f}" for c in names) +
              "".join(f" | {totals[m][a] / totals[m][b]:.3f}x" for a, b in pairs) + " |")


def bench_numerics(variants: list[str], rows: list[int], shapes: list[tuple[str, int, int]]) -> None:
    """The w4a8 op's VNNI build with each of `variants`' numerics, one layer's linears, ms (see the docstring)."""
    from paceline.model import w4a8_kernel as wk
    if not wk.has_vnni() or wk.load() is None:
        raise SystemExit("the w4a8 op's VNNI build cannot run here")
    ops, saved = {}, (wk.ROW_TOPK, wk.ROW_FMAX)
    for v in variants:
        name, *params = v.split(":")
        if params:
            wk.ROW_TOPK, wk.ROW_FMAX = int(params[0]), int(params[1])
        ops[v] = wk.op_for("vnni", name)
        wk.ROW_TOPK, wk.ROW_FMAX = saved
    packs = [(n, wk.pack(*int4_codes(torch.randn(n, k)), nibbles=True), k) for _, n, k in shapes]
    g = torch.Generator().manual_seed(0)
    print("| rows | " + " | ".join(f"{v} ms" for v in variants) + " | " +
          " | ".join(f"{variants[0]} / {v}" for v in variants[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(variants) - 1))
    for m in rows:
        xs = {k: (torch.randn(m, k, generator=g) * torch.where(torch.arange(k) % 150 == 7, 30.0, 1.0)).to(torch.bfloat16)
              for k in {k for _, _, k in shapes}}
        reps, best = max(5, 2000 // m), {}
        for _ in range(3):
            for v, op in ops.items():
                for n, p, k in packs:
                    op(xs[k], p, n, None, True, 0)
                t0 = time.perf_counter()
                for _ in range(reps):
                    for n, p, k in packs:
                        op(xs[k], p, n, None, True, 0)
                best[v] = min(best.get(v, float("inf")), (time.perf_counter() - t0) / reps * 1e3)
        print(f"| {m} | " + " | ".join(f"{best[v]:.3f}" for v in variants) + " | " +
              " | ".join(f"{best[variants[0]] / best[v]:.3f}" for v in variants[1:]) + " |", flush=True)


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
    p.add_argument("--sweep", action="store_true", help="int4 op vs the float32 copy (and --before) over --rows")
    p.add_argument("--before", default=None, help="with --sweep: also the int4 op of this git revision")
    p.add_argument("--w4a8", action="store_true", help="the w4a8 op vs the float32 copy and the int4 op over --rows")
    p.add_argument("--w4a8-variants", default="b4,n4", help="with --w4a8: b<R> / n<R>, codes as bytes / nibbles")
    p.add_argument("--w4a8-before", default=None, help="with --w4a8: also the w4a8 op of this git revision")
    p.add_argument("--bf16", action="store_true", help="with --w4a8: bfloat16 rows for the w4a8 ops")
    p.add_argument("--w4a8-numerics", default="", help="the w4a8 op's VNNI numerics side by side: block,row,row:K:F")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if int4_kernel.load() is None:
        raise SystemExit("the C++ int4 kernel cannot be built here")
    # SmolLM2-135M: hidden 576, 9 + 3 + 3 heads of 64 (fused q/k/v), intermediate 1536 (fused gate/up)
    shapes = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
    if args.w4a8_numerics:
        bench_numerics(args.w4a8_numerics.split(","), [int(r) for r in args.rows.split(",")], shapes)
        return
    if args.w4a8:
        bench_w4a8(shapes + [("lm_head", 49152, 576)], [int(r) for r in args.rows.split(",")], args.repeats,
                   args.w4a8_variants.split(","), args.w4a8_before, args.bf16)
        return
    if args.sweep:
        bench_sweep(shapes, [int(r) for r in args.rows.split(",")], args.repeats, args.before)
        return
    bench_linears(shapes, [int(r) for r in args.rows.split(",")], args.repeats)
    if not args.skip_steps:
        bench_steps([int(j) for j in args.drafts.split(",")], args.step_repeats, args.ctx)


if __name__ == "__main__":
    main()
