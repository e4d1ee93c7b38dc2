"""Capacity probes at chosen rates on several workloads, one server start per system (see
paceline/bench/probe_plan.py). Issue 13's capacity check against vLLM CPU, one invocation (and one exclusive lock
hold) per system, each server and the client at autogroup nice -10 (benchmarks/summaries/vs_vllm.md, 2026-11-24
02:55 UTC; vLLM then again with --vllm-budgets 512 and 256):

    flock -x /tmp/paceline-cpu.lock setsid --wait sh -c 'echo -10 > /proc/self/autogroup; exec env PYTHONPATH=. \\
        python benchmarks/capacity_probes.py --threads 2 --no-progress --server-nice -10 --probe-timeout 60 \\
        --systems paceline-stall-free --stall-free-budgets 512 --probe chat:190:16:1.0,1.25 \\
        --probe long-prompt:171:8:0.15,0.2'
    flock -x /tmp/paceline-cpu.lock setsid --wait sh -c 'echo -10 > /proc/self/autogroup; exec env PYTHONPATH=. \\
        python benchmarks/capacity_probes.py --threads 2 --no-progress --server-nice -10 --probe-timeout 60 \\
        --systems vllm-cpu-fp32 --vllm-budgets 2048 --probe chat:190:16:0.75 --probe long-prompt:171:8:0.1,0.15'

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
