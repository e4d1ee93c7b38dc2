"""How much one batch shape's step time varies on this machine: the bundled model's runner executes the same
prompt chunk N times, then a bare matmul loop of similar size runs N times. Prints p50/p90/p99 and p99/p50.

    .venv/bin/python benchmarks/step_jitter.py --repeats 150

This is the spread `--max-step-ms` has to budget for: the engine tracks a high quantile of measured/predicted
step time because the same work does not take the same time twice on a shared VM.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from paceline.config import EngineConfig
from paceline.engine.engine import Engine
from paceline.sim.profile import GridPoint, build_output

SHAPES = [(1500, 60), (200, 100), (2500, 40)]  # (chunk start, chunk tokens): deep and shallow prompt chunks


def _timings_ms(fn, repeats: int, warmup: int = 5) -> np.ndarray:
    out = []
    for _ in range(repeats + warmup):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return np.array(out[warmup:]) * 1e3


def _line(name: str, ms: np.ndarray) -> str:
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return f"{name:<28} p50 {p50:7.1f}  p90 {p90:7.1f}  p99 {p99:7.1f} ms   p90/p50 {p90 / p50:.2f}  p99/p50 {p99 / p50:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=150)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig())
    for start, c in SHAPES:
        out = build_output(GridPoint([(start, c, True)], []), engine.arch.vocab_size, block_size=engine.block_size)
        print(_line(f"chunk of {c} at token {start}", _timings_ms(lambda out=out: engine.runner.execute(out), args.repeats)))
    a, w = torch.randn(60, 576), torch.randn(576, 3072)
    y = torch.empty(60, 3072)
    print(_line("100 matmuls 60x576x3072", _timings_ms(lambda: [torch.mm(a, w, out=y) for _ in range(100)],
                                                       args.repeats)))


if __name__ == "__main__":
    main()
