"""Could a float32 model of a 4-bit GGUF run its layers from the file's codes? Two facts, measured:

    python benchmarks/f32_from_codes.py [--threads 1]

1. exact: every layer weight of the bundled Q4_1 GGUF, dequantized to float32 by the loader, equals
   code * d + m bit for bit, with the codes and minimum int4_codes recovers and its scale rounded to float16 (Q4_1's
   own d): so float32 steps could read 0.625 bytes a weight instead of 4 and compute with the very same weights.
2. speed: the 120 layer linears of SmolLM2-135M's shapes (random weights on Q4_1's grid) at 1, 2 and 4 rows: a
   float32 Linear (oneDNN packed, the few-row op) against paceline's int4 op given float32 inputs, on the codes with
   float32 scales and zeros (int4_kernel.pack(exact=True), what Int4Linear.exact holds; the max abs difference
   between the two is printed: float32 rounding). Before 2026-11-29 23:20 UTC the op held bfloat16 scales only.
Why it matters for several models in one server: a float32 decode step streams ~540 MB of weights, and beside it an
int4 lane's steps ran 10-14 ms against 9.4 predicted (run VVVV, benchmarks/summaries/multi_model.md).
"""
from __future__ import annotations

import argparse
import time

import torch

from paceline.model import int4_kernel
from paceline.model.llama import Linear, exact_int4_codes, q4_1_grid
from paceline.model.loader import load_checkpoint


def exact_tensors() -> tuple[int, int]:
    ckpt = load_checkpoint(None, "float32")
    same = differ = 0
    for name, w in ckpt.weights.items():
        if w.dim() != 2 or "embed" in name or "lm_head" in name:
            continue
        if exact_int4_codes(w.float()) is not None:  # what a float32 model's make_linear asks
            same += 1
        else:
            differ += 1
    return same, differ


def speed() -> None:
    op = int4_kernel.load()
    if op is None:
        print("the int4 op does not build here")
        return
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    g = torch.Generator().manual_seed(0)
    dense, packed = [], []
    for s in shapes:
        codes, scale, lo, deq = q4_1_grid(torch.randn(s, generator=g) * 0.05)  # scale: Q4_1's d
        dense.append(Linear(deq.contiguous(), None))
        packed.append(int4_kernel.pack(codes, scale, lo + 8 * scale, exact=True))
    for rows in (1, 2, 4):
        xs = [torch.randn(rows, s[1]) for s in shapes]
        diff = max((op(x, p, s[0], None) - lin(x)).abs().max().item()
                   for p, lin, x, s in zip(packed, dense, xs, shapes))
        runs = {"float32 Linear": lambda xs=xs: [lin(x) for lin, x in zip(dense, xs)],
                "int4 op, float32 x": lambda xs=xs: [op(x, p, s[0], None) for p, x, s in zip(packed, xs, shapes)]}
        for name, run in runs.items():
            best = float("inf")
            for _ in range(20):
                t = time.perf_counter()
                run()
                best = min(best, time.perf_counter() - t)
            print(f"rows {rows}: {name} {best * 1e3:.2f} ms for the 120 linears (max abs difference {diff:.2e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    same, differ = exact_tensors()
    print(f"layer weights equal to code * d + m (d as float16): {same} of {same + differ}")
    speed()


if __name__ == "__main__":
    main()
