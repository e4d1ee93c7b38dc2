"""Speculation planned in the simulator: plain, fixed k and adaptive k on a workload at several rates, with a
proposal accepted with probability `--acceptance` per position (default: the workload's spec_acceptance), costed by a
step-time profile of this machine. The same scheduler code as the server; virtual time, so no lock is needed.

    python benchmarks/spec_sim.py --workload quote --rates 0.5,2,4 --profile benchmarks/summaries/profile.json
"""
from __future__ import annotations

import argparse
import dataclasses

from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.step_time import ProfiledCostModel
from paceline.sim.simulator import Simulator
from paceline.sim.workloads import generate, load_workload
from paceline.spec_config import SpeculativeConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="quote")
    p.add_argument("--rates", default="0.5,2,4")
    p.add_argument("--acceptance", type=float, default=None)
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--profile", default="benchmarks/summaries/profile.json")
    p.add_argument("--max-step-ms", type=float, default=150.0)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    cost = ProfiledCostModel.load(args.profile)
    spec = load_workload(args.workload)
    if args.acceptance is not None:
        spec = dataclasses.replace(spec, spec_acceptance=args.acceptance)
    configs = {"plain": None, f"fixed k={args.k}": SpeculativeConfig(num_speculative_tokens=args.k, adaptive=False),
               f"adaptive k<={args.k}": SpeculativeConfig(num_speculative_tokens=args.k)}
    print(f"| workload (acceptance {spec.spec_acceptance:g}) | rate req/s | configuration | out tok/s | TPOT mean ms | "
          "TBT p99 ms | TTFT p50 ms |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for rate in map(float, args.rates.split(",")):
        reqs = generate(spec, rate, args.num_requests, seed=0)
        for name, sc in configs.items():
            sim = Simulator(cost, SchedulerConfig(max_step_ms=args.max_step_ms), CacheConfig(), 4000, speculative=sc)
            res = sim.run(reqs)
            done = [r for r in res.requests if r.ok and len(r.token_times) > 1]
            gaps = sorted(b - a for r in done for a, b in zip(r.token_times, r.token_times[1:]))
            tpot = sum((r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in done) / len(done)
            ttft = sorted(r.token_times[0] - r.sent_s for r in done)
            tokens = sum(len(r.token_times) for r in done)
            print(f"| {spec.name} | {rate:g} | {name} | {tokens / res.makespan:.1f} | {tpot * 1e3:.1f} | "
                  f"{gaps[int(0.99 * len(gaps))] * 1e3:.0f} | {ttft[len(ttft) // 2] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
