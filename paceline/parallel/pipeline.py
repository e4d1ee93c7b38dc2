"""Several steps in flight through a pipeline, and how much of the time its stages sat idle (the bubble).

A step's next tokens are known only after its last stage, so one scheduler cannot feed a pipeline: one step at a
time, stage 1 idles while stage 0 works and the other way round. Here each of `num_slots`
schedulers owns a disjoint range of KV blocks and its own requests (vLLM's "virtual engines"), and the slots take
turns: stage 1 runs slot A's step while stage 0 runs slot B's next one. When consecutive steps differ in cost (a
whole 2,000-token prompt after a decode step) the cheaper stage waits anyway: that is the bubble Sarathi-Serve's
equal-sized chunks shrink.

Token ids in, token ids out (no detokenizing, no stop strings): what the measurement and the exactness tests need;
the serving engine does the same with text, aborts and stats (engine/pipelined.py).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.scheduler import Scheduler
from paceline.parallel.comm import Timers
from paceline.parallel.executor import PipelineParallelRunner
from paceline.request import Request
from paceline.sampling import SamplingParams


@dataclass
class PipelineRun:
    outputs: dict[str, list[int]]  # request id -> output token ids
    wall_s: float
    timers: list[Timers]  # per rank, rank 0 first
    num_steps: int
    num_preemptions: int
    step_tokens: list[int] = field(default_factory=list)  # tokens of each step, in submission order

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-seconds no stage computed: 1 - sum(compute) / (ranks x wall time). Rank 0's compute
        includes its logits and sampling; its scheduling and bookkeeping count as idle."""
        busy = sum(t.forward_s for t in self.timers)
        return 1.0 - busy / (len(self.timers) * self.wall_s)


def run_pipelined(runner: PipelineParallelRunner, prompts: dict[str, list[int]], params: SamplingParams,
                  scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_slots: int,
                  eos_token_id: int | None = None, arrive_every_tokens: int = 0) -> PipelineRun:
    """Run every prompt to completion with `num_slots` steps in flight. The runner's blocks are split evenly
    between the slots (each slot's scheduler sees blocks 0..n-1; the runner shifts them to the slot's range);
    requests go to slots in turn. No host blocks: preemption recomputes. arrive_every_tokens=k > 0 releases request
    i once i * k tokens have been submitted (prompts arriving while others decode; a clock in work done, the same
    for every policy), else all arrive at once."""
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    per_slot = runner.num_blocks // num_slots
    slots = [Scheduler(scheduler_config, cache_config, per_slot) for _ in range(num_slots)]
    requests = [Request(rid, list(prompt), params, 0.0, eos_token_id=eos_token_id) for rid, prompt in prompts.items()]
    arrived = 0

    def arrive(num_submitted: int) -> None:  # tokens submitted so far
        nonlocal arrived
        while arrived < len(requests) and arrived * arrive_every_tokens <= num_submitted:
            requests[arrived].arrival_time = time.monotonic()
            slots[arrived % num_slots].add_request(requests[arrived])
            arrived += 1
    runner.collect_stats()  # start the timers from here
    in_flight: deque = deque()
    busy = [False] * num_slots
    step_tokens: list[int] = []
    t0 = time.perf_counter()
    while True:
        arrive(sum(step_tokens))
        for i, sched in enumerate(slots):
            if busy[i] or not sched.has_unfinished():
                continue
            out = sched.schedule(time.monotonic())
            if out.is_empty:
                continue
            in_flight.append((i, out, runner.submit(out, block_offset=i * per_slot)))
            busy[i] = True
            step_tokens.append(out.num_batched_tokens)
        if not in_flight:
            if arrived < len(requests):  # idle until the next arrival: let it come now
                arrive(arrived * arrive_every_tokens)
                continue
            break
        i, out, step = in_flight.popleft()
        slots[i].update(out, runner.collect(step), time.monotonic())
        busy[i] = False
    wall = time.perf_counter() - t0
    stuck = [r.request_id for r in requests if not r.is_finished]
    if stuck:
        raise ValueError(f"requests {stuck} could not be scheduled (too few KV blocks per slot: {per_slot})")
    return PipelineRun({r.request_id: r.output_token_ids for r in requests}, wall, runner.collect_stats(),
                       len(step_tokens), sum(s.stats().num_preemptions for s in slots), step_tokens)
