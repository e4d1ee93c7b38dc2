"""CPU time of Scheduler.schedule() + Scheduler.update() per step, with 256 running and 10,000 waiting requests.

Fake executor: every chunk that reaches the end of its request gets a random token. Building the StepResult and
topping the waiting queue back up to 10,000 are outside the timed region. Target: under 1 ms per step.

    .venv/bin/python benchmarks/scheduler_overhead.py [--steps 2000] [--scheduler stall-free] [--scheduling-policy fcfs]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.outputs import StepResult
from paceline.core.scheduler import Scheduler
from paceline.request import Request
from paceline.sampling import SamplingParams

VOCAB = range(32000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--running", type=int, default=256)
    ap.add_argument("--waiting", type=int, default=10_000)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--scheduler", "--policy", dest="policy", default="stall-free")
    ap.add_argument("--scheduling-policy", default="fcfs")
    ap.add_argument("--preemption-mode", default="recompute")
    ap.add_argument("--num-kv-blocks", "--num-blocks", dest="num_blocks", type=int, default=0, help="0: room for every running request")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    block_size = 16
    prompt_len, output_len = (32, 512), (64, 512)
    num_blocks = args.num_blocks or args.running * (prompt_len[1] + output_len[1]) // block_size + 64
    sched = Scheduler(
        SchedulerConfig(policy=args.policy, scheduling_policy=args.scheduling_policy, max_num_seqs=args.running,
                        max_num_batched_tokens=args.budget, preemption_mode=args.preemption_mode),
        CacheConfig(block_size=block_size), num_blocks, num_host_blocks=num_blocks)
    shared_prefix = rng.choices(VOCAB, k=64)  # a system prompt some requests share
    counter = 0
    clock = [0.0]

    def new_request() -> Request:
        nonlocal counter
        counter += 1
        n = rng.randint(*prompt_len)
        prompt = rng.choices(VOCAB, k=n)
        if counter % 4 == 0:
            prompt = shared_prefix + prompt
        params = SamplingParams(max_tokens=rng.randint(*output_len), ignore_eos=True)
        return Request(f"req-{counter}", prompt, params, arrival_time=clock[0] + counter * 1e-6,
                       priority=rng.randint(0, 3))

    def top_up() -> None:
        while sched.num_waiting < args.waiting:
            sched.add_request(new_request())

    top_up()
    times, batch_sizes, decodes = [], [], []
    for step in range(args.warmup + args.steps):
        clock[0] += 0.02
        t0 = time.perf_counter()
        out = sched.schedule(clock[0])
        t1 = time.perf_counter()
        num_decodes = out.num_decode_tokens
        result = StepResult({s.request.request_id: rng.randrange(32000) for s in out.scheduled if s.needs_sample})
        t2 = time.perf_counter()
        sched.update(out, result, clock[0])
        t3 = time.perf_counter()
        if step >= args.warmup:
            times.append((t1 - t0) + (t3 - t2))
            batch_sizes.append(len(out.scheduled))
            decodes.append(num_decodes)
        top_up()

    ms = sorted(t * 1e3 for t in times)
    st = sched.stats()
    print(f"policy {args.policy}/{args.scheduling_policy}: {args.steps} steps, {st.num_running} running, "
          f"{st.num_waiting} waiting, {num_blocks} blocks ({st.kv_usage:.0%} used), budget {args.budget}")
    print(f"batch: mean {statistics.mean(batch_sizes):.1f} requests, {statistics.mean(decodes):.1f} decodes; "
          f"preemptions {st.num_preemptions}, prefix hits {st.prefix_cache_hits}/{st.prefix_cache_queries} tokens")
    print(f"schedule()+update() per step: mean {statistics.mean(ms):.3f} ms, p50 {ms[len(ms) // 2]:.3f} ms, "
          f"p99 {ms[int(len(ms) * 0.99)]:.3f} ms, max {ms[-1]:.3f} ms (target < 1 ms)")


if __name__ == "__main__":
    main()
