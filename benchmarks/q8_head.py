"""The LM head alone: the Q8_0 op (paceline/model/q8_kernel.py) against the bf16 head it replaces, on the bundled
model's head (the tied embedding, 49152 x 576), interleaved call by call in one process; median ms per call.

    flock -x /tmp/paceline-cpu.lock env PYTHONPATH=. python benchmarks/q8_head.py --rows 1,2,5,8,32,64

"bf16": what LlamaModel.compute_logits ran without the op on a CPU with native bf16 math (oneDNN's prepacked bf16
matmul, its output widened to float32); "q8": the op as the model runs it (float32 logits, each block's largest
activation taken out: the default); "q8 t0": the op with the outliers left in (PACELINE_Q8_HEAD_OUTLIERS=0).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # paceline, and benchmarks/ as a package

from paceline.model import q8_kernel  # noqa: E402
from paceline.model.llama import Linear  # noqa: E402
from paceline.model.loader import load_checkpoint  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,5,8,32,64")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--before", default=None, help="also the op as it was at this git revision")
    args = ap.parse_args()
    weight = load_checkpoint(None, "float32").weights["model.embed_tokens.weight"]
    head = q8_kernel.Q8Head.from_weight(weight)
    if head is None or q8_kernel.op() is None:
        print("the bundled head is not Q8_0 codes, or the op does not load here")
        return 1
    head_t0 = q8_kernel.Q8Head.from_weight(weight, outliers=False)
    bf16 = Linear(weight.to(torch.bfloat16).contiguous(), None, True)
    fns = {"bf16": lambda x: bf16(x).float(), "q8": head, "q8 t0": head_t0}
    if args.before:  # the op of another revision, under its own name (benchmarks/int4_linear.py)
        from benchmarks.int4_linear import kernel_module_at
        old = kernel_module_at(args.before, "q8_kernel")
        old_op = old.op()
        codes, scales = q8_kernel.q8_codes(weight)
        old_packed = old.pack(codes, scales)
        fns[f"q8 {args.before}"] = lambda x: old_op(x, old_packed, weight.shape[0], True)
        fns[f"q8 t0 {args.before}"] = lambda x: old_op(x, old_packed, weight.shape[0], False)
    print(f"torch threads {torch.get_num_threads()}, {args.calls} calls each, median ms\n")
    print("| rows | " + " | ".join(fns) + " | bf16 / q8 |")
    print("|---:|" + "---:|" * (len(fns) + 1))
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, weight.shape[1], generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
            times: dict[str, list[float]] = {k: [] for k in fns}
            for f in fns.values():  # warm up
                f(x)
            for _ in range(args.calls):
                for name, f in fns.items():
                    t0 = time.perf_counter()
                    f(x)
                    times[name].append(1e3 * (time.perf_counter() - t0))
            med = {k: statistics.median(v) for k, v in times.items()}
            ratio = math.floor(100 * med["bf16"] / med["q8"]) / 100  # truncated, never rounded up
            print(f"| {m} | " + " | ".join(f"{med[k]:.3f}" for k in fns) + f" | {ratio:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
