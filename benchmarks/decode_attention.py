"""Decode-step time with the K/V gathers written three ways, interleaved on the same batches so machine noise
hits each alike: a new tensor per gather, one reused GatherWorkspace, and the workspace plus decode groups (the
default). Prints the median and minimum step time over --repeats rounds and the minor page faults per step.

    .venv/bin/python benchmarks/decode_attention.py --repeats 8

Shapes: decode batches at one context length, and batches mixing short and long contexts (which one padded
group would pad to the longest).
"""
from __future__ import annotations

import argparse
import resource
import time

import torch

import paceline.model.attention as attention
from paceline.config import EngineConfig
from paceline.engine.engine import Engine
from paceline.sim.profile import GridPoint, build_output

SHAPES = {
    "6 x 1900": [1900] * 6,
    "16 x 1000": [1000] * 16,
    "8 x 2000": [2000] * 8,
    "32 x 500": [500] * 32,
    "64 x 200": [200] * 64,
    "16 x 300": [300] * 16,
    "6 mixed 150..1900": [150, 250, 350, 450, 500, 1900],
    "16 mixed 100..1900": [100 + 100 * i for i in range(15)] + [1900],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(EngineConfig())
    runner, workspace = engine.runner, engine.runner.workspace
    one_group = 1 << 62
    variants = {  # name -> (workspace, group cost and size cap)
        "new tensor per gather": (None, one_group, one_group),
        "workspace, one group": (workspace, one_group, one_group),
        "workspace + groups": (workspace, attention.GROUP_COST_POSITIONS, attention.GROUP_MAX_BYTES),
    }
    group_cost, group_bytes = attention.GROUP_COST_POSITIONS, attention.GROUP_MAX_BYTES
    print(f"{'batch':20s}" + "".join(f"{v:>34s}" for v in variants))
    for name, contexts in SHAPES.items():
        out = build_output(GridPoint([], sorted(contexts)), engine.arch.vocab_size)
        times: dict[str, list[float]] = {v: [] for v in variants}
        faults: dict[str, int] = {v: 0 for v in variants}
        for _ in range(args.repeats):
            for v, (ws, cost, cap) in variants.items():
                runner.workspace, attention.GROUP_COST_POSITIONS, attention.GROUP_MAX_BYTES = ws, cost, cap
                runner.execute(out)  # warm: a grown workspace, a first-touch buffer
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                runner.execute(out)
                times[v].append((time.perf_counter() - t0) * 1e3)
                faults[v] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        attention.GROUP_COST_POSITIONS, attention.GROUP_MAX_BYTES = group_cost, group_bytes
        cells = [f"{sorted(t)[len(t) // 2]:7.1f} / {min(t):6.1f} ms {faults[v] // args.repeats:7d} flt"
                 for v, t in times.items()]
        print(f"{name:20s}" + "".join(f"{c:>34s}" for c in cells))
    print("each cell: median / min step ms over the rounds, minor page faults per step")


if __name__ == "__main__":
    main()
