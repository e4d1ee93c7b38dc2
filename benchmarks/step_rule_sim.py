"""The stall-free step-time rules on issue 13's probes, in the simulator (virtual time; the real Scheduler; no CPU
lock needed): what a rule gives the stall probe's largest gap, the 32-stream probe's tok/s and chat's TTFT / TBT
before a real run is spent on it.

Probes, as benchmarks/vs_vllm.py sends them (the client's max_tokens = the output length):
  stall   6 streams of 100 prompt / 160 output tokens at 0 s, a 1,500-token prompt (1 token out) at 1.5 s,
          token budget 64: the largest gap of the 6 after it arrives
  tput    32 requests of 100 prompt / 64 output tokens arriving over ~0.4 s, budget 512: generated tok/s
  chat    the `chat` workload at 0.5 req/s for 90 s (seed 7), budget 512: TTFT p50 / p99, TBT p99 / max
Rules (--rules, comma-separated):
  full      every chunk may fill max_step_ms (short_step_ms 0; the rule before 2026-11-24)
  value     the default: a chunk whose prompt costs more per token it can bring than a decode costs now is held to
            short_step_ms (Scheduler.step_target_ms); valueF: the same with short_step_ms at F x max_step_ms
  shortN    every chunk held to N ms (max_step_ms N): a smaller TBT goal
The cost model is a step-time profile (default: the newest one the engine cached at start-up) times --speed (this
host's steps run slower than a profile taken on an idle machine: the served steps' p98 over the prediction).

    python benchmarks/step_rule_sim.py --rules full,value,short75
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paceline.config import SHORT_STEP_FRACTION, CacheConfig, SchedulerConfig  # noqa: E402
from paceline.core.batch_shape import BatchShape  # noqa: E402
from paceline.core.step_time import ProfiledCostModel  # noqa: E402
from paceline.model.cache_dir import cache_root  # noqa: E402
from paceline.sim.simulator import Simulator  # noqa: E402
from paceline.sim.workloads import SimRequest, requests_for  # noqa: E402


class Scaled:
    """A profile whose every step takes `speed` times longer."""

    def __init__(self, base: ProfiledCostModel, speed: float) -> None:
        self.base, self.speed = base, speed

    def step_time(self, s: BatchShape) -> float:
        return self.base.step_time(s) * self.speed


def config_for(rule: str, budget: int, max_step_ms: float) -> SchedulerConfig:
    if rule == "full":
        return SchedulerConfig(max_num_batched_tokens=budget, max_step_ms=max_step_ms, short_step_ms=0.0)
    if rule.startswith("value"):  # valueF: the short target at fraction F of the full one (default the serving one)
        fraction = float(rule[5:]) if rule[5:] else SHORT_STEP_FRACTION
        return SchedulerConfig(max_num_batched_tokens=budget, max_step_ms=max_step_ms,
                               short_step_ms=max_step_ms * fraction)
    if rule.startswith("short"):
        return SchedulerConfig(max_num_batched_tokens=budget, max_step_ms=float(rule[5:]), short_step_ms=0.0)
    raise SystemExit(f"unknown rule {rule!r}")


def simulate(cost, rule: str, budget: int, max_step_ms: float, work: list[SimRequest]):
    return Simulator(cost, config_for(rule, budget, max_step_ms), CacheConfig(), 20000).run(work)


def gaps(rec) -> list[tuple[float, float]]:
    return [(a, b) for a, b in zip(rec.token_times, rec.token_times[1:])]


def stall(cost, rule: str, max_step_ms: float) -> str:
    work = [SimRequest(i, 0.0, 100, 160) for i in range(6)] + [SimRequest(6, 1.5, 1500, 1)]
    res = simulate(cost, rule, 64, max_step_ms, work)
    recs = sorted(res.requests, key=lambda r: r.index)
    after = [b - a for r in recs[:6] for a, b in gaps(r) if b >= 1.5]
    return f"gap {1e3 * max(after):.0f} ms, long TTFT {recs[6].ttft:.2f} s"


def tput(cost, rule: str, max_step_ms: float) -> str:
    work = [SimRequest(i, 0.012 * i, 100, 64) for i in range(32)]
    res = simulate(cost, rule, 512, max_step_ms, work)
    end = max(r.token_times[-1] for r in res.requests)
    tokens = sum(len(r.token_times) for r in res.requests)
    g = sorted(b - a for r in res.requests for a, b in gaps(r))
    return f"{tokens / end:.1f} tok/s, {len(res.steps)} steps, TBT p99 {1e3 * g[int(0.99 * len(g))]:.0f} ms"


def chat(cost, rule: str, max_step_ms: float) -> str:
    work = requests_for("chat", 0.5, 45, seed=7)
    res = simulate(cost, rule, 512, max_step_ms, work)
    ttft = sorted(r.ttft for r in res.requests if r.ttft is not None)
    g = sorted(b - a for r in res.requests for a, b in gaps(r))
    return (f"TTFT p50 {1e3 * statistics.median(ttft):.0f} / p99 {1e3 * ttft[int(0.99 * len(ttft))]:.0f} ms, "
            f"TBT p99 {1e3 * g[int(0.99 * len(g))]:.0f} / max {1e3 * g[-1]:.0f} ms")


def newest_profile() -> Path:
    found = sorted((cache_root() / "step-profiles").glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit("no cached step-time profile: pass --profile")
    return found[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, default=None, help="a step-time profile (default: the newest cached)")
    p.add_argument("--speed", type=float, default=1.2, help="measured / profiled step time of the host")
    p.add_argument("--max-step-ms", type=float, default=150.0)
    p.add_argument("--rules", default="full,value,short75")
    p.add_argument("--probes", default="stall,tput,chat")
    args = p.parse_args()
    path = args.profile or newest_profile()
    cost = Scaled(ProfiledCostModel.load(path), args.speed)
    print(f"profile {path} x {args.speed}, max_step_ms {args.max_step_ms}")
    probes = {"stall": stall, "tput": tput, "chat": chat}
    for rule in args.rules.split(","):
        for name in args.probes.split(","):
            print(f"{rule:8s} {name:5s} {probes[name](cost, rule, args.max_step_ms)}", flush=True)


if __name__ == "__main__":
    main()
