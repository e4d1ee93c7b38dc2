"""How fast the simulator runs: 10,000 requests through the real scheduler, wall-clock seconds.

    .venv/bin/python benchmarks/sim_speed.py [--num-requests 10000]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import platform
import time

from paceline.config import CacheConfig, SchedulerConfig
from paceline.sim.cost_model import roofline_from_names
from paceline.sim.deploy import Deployment
from paceline.sim.metrics import summarize
from paceline.sim.workloads import generate, load_workload

CASES = [  # (workload, rate, replicas, policy, budget): a loaded single GPU and a small fleet
    ("sharegpt", 1.5, 1, "stall-free", 512),
    ("chat", 40.0, 4, "stall-free", 512),
    ("arxiv", 0.6, 1, "stall-free", 2048),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--profile", action="store_true", help="print where the time goes")
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}\n")
    print("| workload | rate (req/s) | replicas | scheduler | requests | steps | simulated s | wall s | steps/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for wl, rate, replicas, policy, budget in CASES:
        dep = Deployment(roofline_from_names("mistral-7b", "a100"),
                         SchedulerConfig(policy=policy, max_num_batched_tokens=budget, max_model_len=16384),
                         CacheConfig(), num_replicas=replicas, router="least-outstanding")
        reqs = generate(load_workload(wl), rate, args.num_requests, seed=0)
        sim = dep.simulator()
        prof = cProfile.Profile() if args.profile else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        result = sim.run(reqs)
        if prof:
            prof.disable()
        wall = time.perf_counter() - t0
        s = summarize(result)
        print(f"| {wl} | {rate} | {replicas} | {policy}/{budget} | {s['completed']} | {len(result.steps)} | "
              f"{s['duration_s']:.0f} | {wall:.1f} | {len(result.steps) / wall:.0f} |", flush=True)
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(15)


if __name__ == "__main__":
    main()
