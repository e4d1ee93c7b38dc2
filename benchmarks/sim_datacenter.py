"""Datacenter-scale capacity with the roofline model: Mistral-7B on one A100-80GB, ShareGPT-shaped and
arxiv-summarization-shaped load, p99 TBT SLO 100 ms (strict) and 500 ms (relaxed), stall-free at budgets 512
and 2048 against the prefill-first baseline (vLLM's original scheduler) (the setup of the Sarathi-Serve paper, Fig. 1/Table 4).

    .venv/bin/python benchmarks/sim_datacenter.py [--num-requests 1000] [--workloads sharegpt arxiv]
"""
from __future__ import annotations

import argparse
import subprocess
import time

from paceline.config import CacheConfig, SchedulerConfig
from paceline.bench.capacity import capacity_from_probes, search_capacity
from paceline.sim.cost_model import roofline_from_names
from paceline.sim.deploy import Deployment
from paceline.sim.metrics import summarize
from paceline.sim.workloads import generate, load_workload

MAX_MODEL_LEN = 16384
SLOS_MS = (100.0, 500.0)
# prefill-first runs whole prompts; its budget only caps how many prompts share a step (vLLM's own default is
# max_model_len)
SYSTEMS = [("stall-free", 512), ("stall-free", 2048), ("prefill-first", MAX_MODEL_LEN)]


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

            def run_at(rate: float, dep=dep, wl=wl):  # bound now: the loop moves on
                return summarize(dep.simulator().run(generate(wl, rate, args.num_requests, args.seed)))

            for slo in SLOS_MS:
                search_capacity(run_at, slo / 1e3, start_rate=1.0, rel_tol=args.rel_tol, max_probes=24, min_rate=1e-3,
                                cache=cache)
                r = capacity_from_probes(cache, slo / 1e3)  # over every probe, as the benchmark judges
                caps[(policy, budget, slo)] = r.capacity
                at = cache.get(round(r.capacity, 6)) if r.capacity else None
                rows.append((wl_name, f"{policy}/{budget}", slo, r.capacity, at["tbt"]["p99"] * 1e3 if at else float("nan"),
                             at["scheduling_delay"]["p50"] if at else float("nan"),
                             at["ttft"]["p50"] if at else float("nan")))
                print(f"| {' | '.join(_fmt(x) for x in rows[-1])} |  ({len(cache)} runs, {time.perf_counter() - t0:.0f} s)", flush=True)
        for slo in SLOS_MS:
            v = caps[("prefill-first", MAX_MODEL_LEN, slo)]
            for budget in (512, 2048):
                s = caps[("stall-free", budget, slo)]
                ratio = f"{s / v:.2f}x" if v > 0 else "inf (prefill-first meets no rate)"
                print(f"  {wl_name} SLO {slo:g} ms: stall-free/{budget} over prefill-first = {ratio}")
    print("\n| workload | scheduler/budget | p99 TBT SLO (ms) | capacity (req/s) | p99 TBT at capacity (ms) | median sched delay (s) | median TTFT (s) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {' | '.join(_fmt(x) for x in row)} |")


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)


if __name__ == "__main__":
    main()
