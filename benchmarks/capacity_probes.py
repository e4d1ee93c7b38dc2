"""Capacity probes at chosen rates on several workloads, one server start per system (see
paceline/bench/probe_plan.py). Issue 13's capacity check against vLLM CPU, one invocation per system:

    flock -x /tmp/paceline-cpu.lock python benchmarks/capacity_probes.py --systems paceline-stall-free \
        --stall-free-budgets 512 --threads 2 --probe chat:190:16:1.0 --probe long-prompt:171:8:0.2
    flock -x /tmp/paceline-cpu.lock python benchmarks/capacity_probes.py --systems vllm-cpu-fp32 \
        --vllm-budgets 256 --threads 2 --probe chat:190:16:0.75 --probe long-prompt:171:8:0.15

Results: bench-results/probes-<time>/<workload>/results.{md,json}, logs/<system>.log.
"""
import argparse
import sys

from paceline.bench.probe_plan import add_probe_plan_args

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="benchmarks/capacity_probes.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_probe_plan_args(parser)
    args = parser.parse_args()
    sys.exit(args.func(args))
