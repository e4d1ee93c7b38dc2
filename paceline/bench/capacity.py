"""Capacity under an SLO: the highest request rate at which p99 TBT <= the TBT SLO and the median scheduling delay
(median TTFT when the server does not expose scheduling) <= 2 s, found by a bounded bisection on the rate.

SLOs are given in ms, or as `strict` (5x) / `relaxed` (25x) the median decode-only step time at batch 16,
measured once at the start of a run (calibrate.py) and then held fixed for every system.

Pure functions of run summaries: the benchmark's probes are runs against a server, the simulator's are simulated
runs; both are judged here, the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from paceline.bench.metrics import stats

SLO_FACTORS = {"strict": 5.0, "relaxed": 25.0}
MAX_DELAY_S = 2.0


def parse_slo(value: str, decode_step_s: float | None) -> tuple[str, float]:
    """'strict' | 'relaxed' | a number of ms -> (name, seconds)."""
    if value in SLO_FACTORS:
        if decode_step_s is None:
            raise ValueError(f"a {value} SLO needs the decode step measured first")
        return value, SLO_FACTORS[value] * decode_step_s
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(f"an SLO is strict, relaxed or a number of ms, got {value!r}") from None
    if ms <= 0:
        raise ValueError(f"an SLO must be > 0 ms, got {ms}")
    return f"{ms:g}ms", ms / 1e3


def ttft_excess(records, prefill_rate: float) -> dict | None:
    """TTFT minus the time the prompt alone takes: an estimate of the scheduling delay, so servers that do not expose
    theirs are judged on waiting, as paceline is, and not on prefill speed twice (p99 TBT already covers that)."""
    return stats([max(0.0, r.ttft - (r.usage_prompt_tokens or r.prompt_tokens) / prefill_rate)
                  for r in records if r.ok])


@dataclass
class Verdict:
    rate: float
    passed: bool
    p99_tbt_s: float | None
    delay_s: float | None  # median scheduling delay, or median TTFT
    delay_source: str  # "scheduling" (the server's) | "ttft-excess" (TTFT - prompt/prefill rate) | "ttft"
    failed_requests: int


def judge(rate: float, summary: dict, tbt_slo_s: float, max_delay_s: float = MAX_DELAY_S) -> Verdict:
    """Does one probe's summary meet the SLO? Any failed request fails the probe (overload shows as timeouts)."""
    tbt = summary.get("tbt") or {}
    sched = summary.get("scheduling_delay")
    if sched and sched.get("p50") is not None:
        delay, source = sched["p50"], "scheduling"
    elif summary.get("ttft_excess"):
        delay, source = summary["ttft_excess"]["p50"], "ttft-excess"
    else:
        delay, source = (summary.get("ttft") or {}).get("p50"), "ttft"
    p99 = tbt.get("p99")
    ok = (summary.get("failed", 0) == 0 and p99 is not None and p99 <= tbt_slo_s
          and delay is not None and delay <= max_delay_s)
    return Verdict(rate, ok, p99, delay, source, summary.get("failed", 0))


@dataclass
class CapacityResult:
    slo_name: str
    tbt_slo_s: float
    capacity: float  # req/s; 0 when even the lowest probe failed
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def is_lower_bound(self) -> bool:
        """Every probe passed (the probe budget ran out first): the capacity is at least this."""
        return self.capacity > 0 and all(v.passed for v in self.verdicts)


def search_capacity(probe: Callable[[float], dict], tbt_slo_s: float, *, start_rate: float, max_probes: int = 8,
                    rel_tol: float = 0.1, min_rate: float = 0.01, max_delay_s: float = MAX_DELAY_S,
                    slo_name: str = "", cache: dict[float, dict] | None = None) -> CapacityResult:
    """Double (or halve) from start_rate until the SLO flips, then bisect until the bracket is within rel_tol.
    `probe(rate)` returns a summary (metrics.summarize, plus scheduling_delay); `cache` maps rate -> summary so
    several SLOs can share probes. Assumes latency grows with the rate."""
    if start_rate <= 0:
        raise ValueError(f"start_rate must be > 0, got {start_rate}")
    cache = {} if cache is None else cache
    lo: float | None = None  # highest rate that passed
    hi: float | None = None  # lowest rate that failed
    rate = start_rate
    verdicts: list[Verdict] = []
    fresh = 0
    for _ in range(4 * max_probes + 64):  # cached probes cost nothing but must not loop forever
        if fresh >= max_probes:
            break
        key = round(rate, 6)
        if key not in cache:
            cache[key] = probe(rate)
            fresh += 1
        v = judge(rate, cache[key], tbt_slo_s, max_delay_s)
        verdicts.append(v)
        if v.passed:
            lo = rate
        else:
            hi = rate
        if lo is not None and hi is not None:
            if hi - lo <= rel_tol * hi:
                break
            rate = (lo + hi) / 2
        elif lo is None:
            rate /= 2
            if rate < min_rate:
                break
        else:
            rate *= 2
    return CapacityResult(slo_name, tbt_slo_s, lo or 0.0, verdicts)


def capacity_from_probes(summaries: dict[float, dict], tbt_slo_s: float, *, slo_name: str = "",
                         max_delay_s: float = MAX_DELAY_S) -> CapacityResult:
    """Every probe run for one system (rate -> summary) judged against one SLO: the highest passing rate below the
    lowest failing one. The searches for several SLOs share probes, so the later search's probes can move the
    earlier one's answer: a strict search that stopped at 0.5 req/s when the relaxed search then passed 0.9 with a
    p99 under the strict SLO too. Assumes, as the search does, that latency grows with the rate."""
    verdicts = [judge(rate, summaries[rate], tbt_slo_s, max_delay_s) for rate in sorted(summaries)]
    first_failure = min((v.rate for v in verdicts if not v.passed), default=math.inf)
    capacity = max((v.rate for v in verdicts if v.passed and v.rate < first_failure), default=0.0)
    return CapacityResult(slo_name, tbt_slo_s, capacity, verdicts)
