"""Datacenter-scale capacity with the roofline model: Mistral-7B on one A100-80GB, ShareGPT-shaped and
arxiv-summarization-shaped load, p99 TBT SLO 100 ms (strict) and 500 ms (relaxed), sarathi at budgets 512
and 2048 against the vllm-style prefill-first baseline (the setup of the Sarathi-Serve paper, Fig. 1/Table 4).

    .venv/bin/python benchmarks/sim_datacenter.py [--num-requests 1000] [--workloads sharegpt arxiv]
"""
from __future__ import annotations

import argparse
import subprocess
import time

from paceline.config import CacheConfig, SchedulerConfig
from paceline.sim.capacity import search_capacity
from paceline.sim.cost_model import roofline_from_names
from paceline.sim.deploy import Deployment
from paceline.sim.metrics import summarize
from paceline.sim.workloads import generate, load_workload

MAX_MODEL_LEN = 16384
SLOS_MS = (100.0, 500.0)
# vllm runs whole prompts; its budget only caps how many prompts share a step (vLLM's own default is max_model_len)
SYSTEMS = [("sarathi", 512), ("sarathi", 2048), ("vllm", MAX_MODEL_LEN)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--workloads", nargs="+", default=["sharegpt", "arxiv"])
    ap.add_argument("--max-num-seqs", type=int, default=256, help="vLLM's default")
    ap.add_argument("--rel-tol", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cm = roofline_from_names("mistral-7b", "a100")
    print(f"Mistral-7B on 1 x A100-80GB (roofline, efficiency {cm.efficiency}, step overhead {cm.step_overhead_s * 1e3:.1f} ms); "
          f"KV capacity {cm.kv_capacity_tokens()} tokens; {args.num_requests} Poisson requests per run, seed {args.seed}; "
          f"max_num_seqs {args.max_num_seqs}; commit {commit}\n")
    rows = []
    for wl_name in args.workloads:
        wl = load_workload(wl_name)
        caps = {}
        for policy, budget in SYSTEMS:
            dep = Deployment(cm, SchedulerConfig(policy=policy, max_num_batched_tokens=budget, max_num_seqs=args.max_num_seqs,
                                                 max_model_len=MAX_MODEL_LEN), CacheConfig())
            t0 = time.perf_counter()
            cache: dict = {}

            def run_at(rate: float):
                return summarize(dep.simulator().run(generate(wl, rate, args.num_requests, args.seed)))

            for slo in SLOS_MS:
                r = search_capacity(run_at, slo / 1e3, start_rate=1.0, rel_tol=args.rel_tol, cache=cache)
                caps[(policy, budget, slo)] = r.capacity
                at = r.at_capacity
                rows.append((wl_name, f"{policy}/{budget}", slo, r.capacity, at.tbt["p99"] * 1e3 if at else float("nan"),
                             at.scheduling_delay["p50"] if at else float("nan"), at.ttft["p50"] if at else float("nan")))
                print(f"| {' | '.join(_fmt(x) for x in rows[-1])} |  ({len(cache)} runs, {time.perf_counter() - t0:.0f} s)", flush=True)
        for slo in SLOS_MS:
            v = caps[("vllm", MAX_MODEL_LEN, slo)]
            for budget in (512, 2048):
                s = caps[("sarathi", budget, slo)]
                ratio = f"{s / v:.2f}x" if v > 0 else "inf (vllm meets no rate)"
                print(f"  {wl_name} SLO {slo:g} ms: sarathi/{budget} over vllm = {ratio}")
    print("\n| workload | scheduler/budget | p99 TBT SLO (ms) | capacity (req/s) | p99 TBT at capacity (ms) | median sched delay (s) | median TTFT (s) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {' | '.join(_fmt(x) for x in row)} |")


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


if __name__ == "__main__":
    main()
