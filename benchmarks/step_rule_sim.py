"""What the stall-free step-time rule costs vs_vllm.py's 32-stream probe, and what other rules would give, in the
simulator (virtual time; the real Scheduler; no CPU lock needed).

The probe: 32 requests of 100 prompt tokens and 64 output tokens arriving over ~0.4 s (as the HTTP client's do).
The cost model is a hand-set line fitted to this machine's wide steps (the server's step log of 2026-11-23 12:53
and benchmarks/profile_step.py's rows sweep): a fixed cost per step (--step-ms) plus a cost per row (--row-ms).
Rules compared:
  base     today's: a step that carries a decode is cut to max_step_ms (150 ms)
  queue    no cut while more prompts wait (or are mid-prefill) than decodes run
  scaleK   the cut scaled by waiting / decodes, at most K times max_step_ms
  nocap    no step-time target at all (token budget only), budgets 512 and 2048: vLLM's way

    python benchmarks/step_rule_sim.py --step-ms 48 --row-ms 1.9
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paceline.config import CacheConfig, SchedulerConfig  # noqa: E402
from paceline.core.scheduler import Scheduler  # noqa: E402
from paceline.core.step_time import ProfiledCostModel  # noqa: E402
from paceline.sim.simulator import Simulator  # noqa: E402
from paceline.sim.workloads import SimRequest  # noqa: E402


def scheduler_with(rule: str) -> type[Scheduler]:
    class RuleScheduler(Scheduler):
        def chunk_within_step_time(self, step, request, start, n):
            shape = step.shape
            if rule == "base" or shape is None or shape.num_decodes == 0:
                return super().chunk_within_step_time(step, request, start, n)
            prompts = len(self.waiting) + sum(1 for r in self.running if r.num_computed_tokens < r.num_prompt_tokens)
            if rule == "queue":
                return n if prompts > shape.num_decodes else super().chunk_within_step_time(step, request, start, n)
            factor = min(max(1.0, prompts / shape.num_decodes), float(rule[len("scale"):]))
            before = self.config.max_step_ms
            self.config.max_step_ms = before * factor
            try:
                return super().chunk_within_step_time(step, request, start, n)
            finally:
                self.config.max_step_ms = before
    return RuleScheduler


def run(cost: ProfiledCostModel, rule: str, budget: int, max_step_ms: float) -> str:
    work = [SimRequest(i, 0.012 * i, 100, 64) for i in range(32)]
    config = SchedulerConfig(max_num_batched_tokens=budget, max_step_ms=max_step_ms, max_num_seqs=256)
    res = Simulator(cost, config, CacheConfig(), 5000, scheduler_factory=scheduler_with(rule)).run(work)
    end = max(r.token_times[-1] for r in res.requests)
    tokens = sum(len(r.token_times) for r in res.requests)
    gaps = sorted(b - a for r in res.requests for a, b in zip(r.token_times, r.token_times[1:]))
    return (f"| {rule} | {budget} | {len(res.steps)} | {end:.2f} | {tokens / end:.0f} | "
            f"{gaps[int(0.99 * len(gaps))] * 1e3:.0f} | {gaps[-1] * 1e3:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=48.0, help="fixed cost of a step")
    p.add_argument("--row-ms", type=float, default=1.9, help="cost per row (prompt token or decode)")
    p.add_argument("--max-step-ms", type=float, default=150.0)
    args = p.parse_args()
    r = args.row_ms / 1e3
    cost = ProfiledCostModel(dict(constant=args.step_ms / 1e3, requests=0.0, prefill_tokens=r, decodes=r,
                                  prefill_attn_pairs=2e-8, decode_context=2e-7, sampled=0.0004))
    print(f"step {args.step_ms} ms + {args.row_ms} ms a row, max_step_ms {args.max_step_ms}\n")
    print("| rule | budget | steps | span s | tok/s | TBT p99 ms | TBT max ms |\n|---|---:|---:|---:|---:|---:|---:|")
    for rule in ("base", "queue", "scale2", "scale4"):
        print(run(cost, rule, 512, args.max_step_ms))
    for budget in (512, 2048):
        print(run(cost, "base", budget, 0.0).replace("| base |", "| nocap |", 1))


if __name__ == "__main__":
    main()
