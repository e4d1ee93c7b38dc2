"""A simulated run as the benchmark reports a measured one: the same records, summary, report and plots.

The simulator emits the records a benchmark client takes (paceline.bench.metrics.RequestRecord), so everything
here is paceline.bench: what this module adds is only what a real server would tell the client about itself
(the scheduling delay, the step composition over time) and the simulated decode step that sets the stall
threshold, as the server's /metrics and the benchmark's calibration do.
"""
from __future__ import annotations

import numpy as np

from paceline.bench.metrics import RunResult, stats
from paceline.bench.report import run_dict
from paceline.bench.server_metrics import DECODE_TOKENS, PREFILL_TOKENS
from paceline.config import STALL_FACTOR
from paceline.sim.simulator import SimResult, StepRecord

STEPS = "paceline:steps_total"


def median_decode_step(steps: list[StepRecord]) -> float:
    """Median duration of decode-only steps (all steps when there are none): the yardstick for stalls."""
    d = [s.duration for s in steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    d = d or [s.duration for s in steps]
    return float(np.median(d)) if d else 0.0


def scheduling_delay(result: SimResult) -> dict | None:
    """Arrival to first scheduled, of every request that was scheduled: what the server's queue-time histogram
    gives a benchmark run, here exact."""
    return stats([r.first_scheduled_s - r.sent_s for r in result.requests if r.first_scheduled_s is not None])


def counter_snapshots(steps: list[StepRecord], points: int = 200) -> list[tuple[float, dict[str, float]]]:
    """Replica 0's step counters sampled at `points` instants, as a benchmark scrapes /metrics during a run."""
    mine = [s for s in steps if s.replica == 0]
    if not mine:
        return []
    ends = np.array([s.start + s.duration for s in mine])
    dec = np.cumsum([s.num_decode_tokens for s in mine])
    pre = np.cumsum([s.num_prefill_tokens for s in mine])
    out = [(0.0, {DECODE_TOKENS: 0.0, PREFILL_TOKENS: 0.0, STEPS: 0.0})]
    for t in np.linspace(ends[-1] / points, ends[-1], points):
        n = int(np.searchsorted(ends, t, side="right"))  # steps finished by t
        out.append((float(t), {DECODE_TOKENS: float(dec[n - 1]) if n else 0.0,
                               PREFILL_TOKENS: float(pre[n - 1]) if n else 0.0, STEPS: float(n)}))
    return out


def sim_run_dict(result: SimResult, *, system: str = "simulated", workload: str = "", rate: float | None = None,
                 ttft_slo: float | None = None, tbt_slo: float | None = None, extra: dict | None = None) -> dict:
    """paceline.bench.report.run_dict of the simulated run; the stall threshold is STALL_FACTOR x the simulated
    median decode step (as a benchmark comparison takes it from its calibrated decode step)."""
    med = median_decode_step(result.steps)
    run = RunResult(result.requests, result.makespan, 0.0, counter_snapshots(result.steps), scheduling_delay(result))
    sim = {"median_decode_step_s": med, "step_time": stats([s.duration for s in result.steps]),
           "num_steps": len(result.steps), "num_preemptions": sum(r.num_preemptions for r in result.requests),
           "num_replicas": result.num_replicas, "wall_s": result.wall_s,
           "pipeline_bubble_fraction": result.bubble_fraction}
    return run_dict(system, workload, rate, run, ttft_slo=ttft_slo, tbt_slo=tbt_slo,
                    stall_threshold_s=STALL_FACTOR * med if med else None, extra={"simulation": sim, **(extra or {})})


def summarize(result: SimResult, *, ttft_slo: float | None = None, tbt_slo: float | None = None) -> dict:
    """The benchmark's summary (paceline.bench.metrics.summarize, plus the scheduling delay) of a simulated run."""
    return sim_run_dict(result, ttft_slo=ttft_slo, tbt_slo=tbt_slo)["summary"]
