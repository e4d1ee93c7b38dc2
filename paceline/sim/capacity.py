"""Capacity: the highest request rate whose run keeps p99 TBT within the SLO and the median scheduling
delay within 2 s, by bracketing then bisecting on the rate."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from paceline.sim.metrics import Summary


@dataclass
class CapacityResult:
    capacity: float  # req/s; 0.0 when even the lowest rate tried fails
    tbt_slo_s: float
    tried: dict[float, bool] = field(default_factory=dict)  # rate -> met the SLO
    at_capacity: Summary | None = None


def search_capacity(run_at: Callable[[float], Summary], tbt_slo_s: float, start_rate: float = 1.0,
                    max_scheduling_delay_s: float = 2.0, rel_tol: float = 0.03, max_runs: int = 24,
                    cache: dict[float, Summary] | None = None) -> CapacityResult:
    """run_at(rate) simulates one run; pass the same `cache` to searches under several SLOs to reuse runs."""
    if tbt_slo_s <= 0 or start_rate <= 0:
        raise ValueError("tbt_slo_s and start_rate must be > 0")
    cache = {} if cache is None else cache
    res = CapacityResult(0.0, tbt_slo_s)

    def ok(rate: float) -> bool:
        if rate not in cache:
            cache[rate] = run_at(rate)
        good = cache[rate].meets(tbt_slo_s, max_scheduling_delay_s)
        res.tried[rate] = good
        return good

    lo, hi, runs = None, None, 0
    rate = start_rate
    while runs < max_runs and (lo is None or hi is None):
        runs += 1
        if ok(rate):
            lo = rate
            rate *= 2
        else:
            hi = rate
            rate /= 2
        if rate < 1e-3:
            return res
    if lo is None:
        return res
    while hi is not None and runs < max_runs and hi - lo > rel_tol * lo:
        runs += 1
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    res.capacity = lo
    res.at_capacity = cache[lo]
    return res
