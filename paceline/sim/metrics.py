"""Metrics of a simulated run, as ../shared/architecture.md defines them (TTFT, TBT, TPOT, stalls, capacity).

A small stand-in for paceline.bench.report computed from the same kind of input, per-request token timelines,
so the simulator's numbers and the benchmark's mean the same thing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from paceline.sim.simulator import RequestRecord, SimResult, StepRecord

PCTS = (50, 90, 99)


def dist(samples) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
    d = {"mean": float(a.mean())}
    d.update({f"p{p}": float(v) for p, v in zip(PCTS, np.percentile(a, PCTS))})
    d.update(max=float(a.max()), n=int(a.size))
    return d


def median_decode_step(steps: list[StepRecord]) -> float:
    """Median duration of decode-only steps (all steps when there are none): the yardstick for stalls."""
    d = [s.duration for s in steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    d = d or [s.duration for s in steps]
    return float(np.median(d)) if d else 0.0


@dataclass
class Summary:
    num_requests: int
    num_finished: int
    num_rejected: int
    duration_s: float  # first arrival to last finish, simulated
    ttft: dict
    tbt: dict
    tpot: dict
    e2e: dict
    scheduling_delay: dict
    normalized_latency: dict
    step_time: dict
    median_decode_step_s: float
    num_stalls: int
    stall_time_s: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    goodput: float | None
    num_preemptions: int
    wall_s: float
    per_priority: dict = field(default_factory=dict)

    def meets(self, tbt_slo_s: float, max_scheduling_delay_s: float = 2.0) -> bool:
        """Capacity criterion: p99 TBT within the SLO and median scheduling delay within 2 s, with every
        request finished (a run that cannot finish its requests is over capacity by definition)."""
        return (self.num_finished == self.num_requests - self.num_rejected and self.num_finished > 0
                and self.tbt["p99"] <= tbt_slo_s and self.scheduling_delay["p50"] <= max_scheduling_delay_s)


def _timeline_metrics(recs: list[RequestRecord]) -> dict:
    ttft, tbt, tpot, e2e, delay, norm = [], [], [], [], [], []
    for r in recs:
        tt = r.token_times
        if not tt:
            continue
        ttft.append(tt[0] - r.arrival)
        tbt.extend(b - a for a, b in zip(tt, tt[1:]))
        end = r.finish_time if r.finish_time is not None else tt[-1]
        e2e.append(end - r.arrival)
        if len(tt) > 1:
            tpot.append((end - r.arrival - (tt[0] - r.arrival)) / (len(tt) - 1))
        if r.first_scheduled is not None:
            delay.append(r.first_scheduled - r.arrival)
        norm.append((end - r.arrival) / len(tt))
    return {"ttft": ttft, "tbt": tbt, "tpot": tpot, "e2e": e2e, "delay": delay, "norm": norm}


def summarize(result: SimResult, ttft_slo_s: float | None = None, tbt_slo_s: float | None = None,
              stall_factor: float = 5.0) -> Summary:
    recs = result.requests
    done = result.finished
    m = _timeline_metrics(done)
    med = median_decode_step(result.steps)
    stalls = [g for g in m["tbt"] if med and g > stall_factor * med]
    start = min((r.arrival for r in recs), default=0.0)
    end = max((r.finish_time for r in done), default=start)
    span = max(end - start, 1e-9)
    goodput = None
    if ttft_slo_s is not None or tbt_slo_s is not None:
        ok = 0
        for r in done:
            tt = r.token_times
            good_ttft = ttft_slo_s is None or (tt and tt[0] - r.arrival <= ttft_slo_s)
            good_tbt = tbt_slo_s is None or all(b - a <= tbt_slo_s for a, b in zip(tt, tt[1:]))
            ok += bool(good_ttft and good_tbt)
        goodput = ok / span
    per_priority = {}
    for p in sorted({r.priority for r in done}):
        pm = _timeline_metrics([r for r in done if r.priority == p])
        per_priority[p] = {"ttft": dist(pm["ttft"]), "tbt": dist(pm["tbt"]), "num": sum(r.priority == p for r in done)}
    return Summary(
        num_requests=len(recs), num_finished=len(done), num_rejected=sum(r.finish_reason == "rejected" for r in recs),
        duration_s=span, ttft=dist(m["ttft"]), tbt=dist(m["tbt"]), tpot=dist(m["tpot"]), e2e=dist(m["e2e"]),
        scheduling_delay=dist(m["delay"]), normalized_latency=dist(m["norm"]),
        step_time=dist([s.duration for s in result.steps]), median_decode_step_s=med,
        num_stalls=len(stalls), stall_time_s=float(sum(stalls)),
        request_throughput=len(done) / span, input_throughput=sum(r.prompt_len for r in done) / span,
        output_throughput=sum(len(r.token_times) for r in done) / span, goodput=goodput,
        num_preemptions=sum(r.num_preemptions for r in done), wall_s=result.wall_s, per_priority=per_priority)


def markdown(s: Summary, title: str = "simulated") -> str:
    ms = lambda d, k: f"{d[k] * 1e3:.1f}"  # noqa: E731
    rows = [("TTFT", s.ttft), ("TBT", s.tbt), ("TPOT", s.tpot), ("end-to-end", s.e2e),
            ("scheduling delay", s.scheduling_delay), ("normalized latency (per token)", s.normalized_latency),
            ("step time", s.step_time)]
    lines = [f"### {title}", "",
             f"{s.num_finished}/{s.num_requests} requests finished ({s.num_rejected} rejected) in {s.duration_s:.1f} simulated s "
             f"({s.wall_s:.2f} s wall); {s.request_throughput:.2f} req/s, {s.input_throughput:.0f} input tok/s, "
             f"{s.output_throughput:.0f} output tok/s; {s.num_preemptions} preemptions; "
             f"{s.num_stalls} stalls (> 5x median decode step {s.median_decode_step_s * 1e3:.1f} ms) totalling {s.stall_time_s:.2f} s"
             + (f"; goodput {s.goodput:.2f} req/s" if s.goodput is not None else ""), "",
             "| metric (ms) | mean | p50 | p90 | p99 | max |", "|---|---|---|---|---|---|"]
    for name, d in rows:
        lines.append(f"| {name} | {ms(d, 'mean')} | {ms(d, 'p50')} | {ms(d, 'p90')} | {ms(d, 'p99')} | {ms(d, 'max')} |")
    if len(s.per_priority) > 1:
        lines += ["", "| priority | requests | TTFT p50 | TTFT p99 | TBT p50 | TBT p99 |", "|---|---|---|---|---|---|"]
        for p, d in s.per_priority.items():
            lines.append(f"| {p} | {d['num']} | {ms(d['ttft'], 'p50')} | {ms(d['ttft'], 'p99')} | {ms(d['tbt'], 'p50')} | {ms(d['tbt'], 'p99')} |")
    return "\n".join(lines)


def bench_records(result: SimResult) -> list:
    """The run as paceline.bench.metrics records (arrival = sent time), for the benchmark's own summary and report."""
    from paceline.bench.metrics import RequestRecord as BenchRecord
    out = []
    for r in result.requests:
        rec = BenchRecord(int(r.request_id), r.prompt_len, r.output_len, r.priority, scheduled_s=r.arrival, sent_s=r.arrival,
                          token_times=list(r.token_times), end_s=r.finish_time)
        if r.finish_reason == "rejected":
            rec.error = "rejected: longer than the context or the KV cache"
        out.append(rec)
    return out


def bench_summary(result: SimResult, **kw) -> dict:
    """paceline.bench.metrics.summarize over the simulated timelines, with the stall threshold from the simulated
    median decode step, as the server's metrics would give it."""
    from paceline.bench.metrics import summarize as bench_summarize
    med = median_decode_step(result.steps)
    kw.setdefault("stall_threshold_s", 5.0 * med if med else None)
    return bench_summarize(bench_records(result), **kw)
