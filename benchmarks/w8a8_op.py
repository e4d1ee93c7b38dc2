"""The int8 x int8 op (paceline/model/w8a8_kernel.py) alone at the bundled model's o [576 -> 576] and gate_up
[576 -> 3072] shapes, bfloat16 activations with one large channel, 4 outliers a row: the op of git revision
--before (built under its own name) against this tree's, and for gate_up the product followed by silu_mul
(fused_kernel.py) against the gated op (SiLU * up in the epilogue; rounded: the unfused path's bits, f32: from
the float32 values). One process, interleaved, median of --repeats.

    python benchmarks/w8a8_op.py --before 17f0c28 --rows 160,512,1500
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.int4_linear import kernel_module_at
from paceline.model import fused_kernel, w8a8_kernel


def per_call_us(fn, iters: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e6


def variants(name: str, before: str, old, new, gated, silu_mul, x, wq, cs) -> dict:
    """What runs for one shape: the two revisions' op, and for gate_up with silu_mul / gated."""
    if name != "gate_up":
        return {before: lambda: old(x, wq, cs, None, None, 4), "now": lambda: new(x, wq, cs, None, None, 4)}
    return {f"{before} + silu_mul": lambda: silu_mul(old(x, wq, cs, None, None, 4)),
            "now + silu_mul": lambda: silu_mul(new(x, wq, cs, None, None, 4)),
            "gated rounded": lambda: gated(x, wq, cs, None, None, 4, True),
            "gated f32": lambda: gated(x, wq, cs, None, None, 4, False)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="git revision of the op to compare against")
    p.add_argument("--rows", default="160,512,1500")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(2)
    old, new, gated, f = (kernel_module_at(args.before, "w8a8_kernel").load(), w8a8_kernel.load(),
                          w8a8_kernel.load_gated(), fused_kernel.load())
    if None in (old, new, gated, f):
        raise SystemExit("the w8a8 ops (both revisions) and the fused ops must build here")
    g = torch.Generator().manual_seed(0)
    for name, n, k in (("o", 576, 576), ("gate_up", 3072, 576)):
        wq, cs = w8a8_kernel.quantize_weight(torch.randn(n, k, generator=g) * 0.05)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            x[:, 7] *= 30  # a large channel, as the residual stream has
            iters = max(4, 12000 // m) if name == "gate_up" else max(8, 48000 // m)  # ~30 ms a sample
            fns = variants(name, args.before, old, new, gated, f.silu_mul, x, wq, cs)
            times: dict[str, list[float]] = {key: [] for key in fns}
            for _ in range(args.repeats):
                for key, fn in fns.items():
                    times[key].append(per_call_us(fn, iters))
            print(f"{name} {m} rows: " + ", ".join(f"{key} {sorted(v)[len(v) // 2]:.0f}" for key, v in times.items())
                  + " us", flush=True)


if __name__ == "__main__":
    main()
