"""Latency and throughput from per-request token timelines, as the architecture map defines them: the one
measurement library of the benchmark client and the simulator (which emits these same records).

Every time here is in seconds since the start of the run, on the client's clock. A request's arrival is the
moment the client sent it. Chunks that carry several tokens contribute one timestamp per token (the gaps
between tokens of one chunk are 0: that is what the reader of the stream sees).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from paceline.config import STALL_FACTOR


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int  # what was asked (token-id prompts: exact; text prompts: about)
    output_tokens: int  # max_tokens, with ignore_eos: what every system must generate
    priority: int = 0
    scheduled_s: float = 0.0  # when the workload said it arrives
    sent_s: float = 0.0  # when the client sent it
    token_times: list[float] = field(default_factory=list)
    end_s: float | None = None  # when the response ended
    usage_prompt_tokens: int | None = None  # as the server reported them
    usage_completion_tokens: int | None = None
    error: str | None = None
    # what only the server knows; the simulator fills these in, a benchmark client leaves them as they are
    # (it reads the scheduling delay from the server's /metrics instead, see RunResult.scheduling_delay)
    first_scheduled_s: float | None = None
    num_preemptions: int = 0
    replica: int = 0
    client: str = ""  # the workload class's client (sent as `user`)
    model: str | None = None  # which model served it (a several-model workload); None: the endpoint's

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and len(self.token_times) > 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent_s

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.sent_s

    @property
    def gaps(self) -> list[float]:
        t = self.token_times
        return [t[i + 1] - t[i] for i in range(len(t) - 1)]

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def normalized_latency(self) -> float:
        return self.e2e / len(self.token_times)

    @property
    def num_output_tokens(self) -> int:
        """Tokens the stream delivered; the server's count when it reported one (chunks may merge tokens)."""
        return self.usage_completion_tokens if self.usage_completion_tokens is not None else len(self.token_times)


@dataclass
class RunResult:
    """One run of a workload: every request's record, and what the server said about itself."""
    records: list[RequestRecord]
    duration_s: float  # first send to last response end
    started_at: float  # wall clock (time.time()) at the start
    metric_snapshots: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (t, /metrics sample)
    scheduling_delay: dict | None = None  # from the server's histogram, when it exposes one


def stats(values: list[float] | np.ndarray) -> dict[str, float] | None:
    """mean, p50, p90, p99, max (percentiles by linear interpolation between closest ranks); None when empty."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return None
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max()),
            "count": int(a.size)}


def stall_threshold(records: list[RequestRecord], median_decode_step: float | None = None) -> float | None:
    """5 x the median decode step; without a measured step, 5 x the median gap of this run."""
    if median_decode_step is None:
        gaps = [g for r in records if r.ok for g in r.gaps]
        if not gaps:
            return None
        median_decode_step = float(np.median(gaps))
    return STALL_FACTOR * median_decode_step


def run_span(records: list[RequestRecord]) -> float:
    """From the first send to the last token or response end."""
    done = [r for r in records if r.token_times or r.end_s is not None]
    if not done:
        return 0.0
    start = min(r.sent_s for r in records)
    end = max(max(r.token_times[-1] if r.token_times else 0.0, r.end_s or 0.0) for r in done)
    return max(end - start, 1e-9)


def meets_slo(r: RequestRecord, ttft_slo: float | None, tbt_slo: float | None) -> bool:
    """TTFT within its SLO, and the request's p99 gap (nearest rank, so its max for < 100 gaps) within the TBT SLO."""
    if not r.ok:
        return False
    if ttft_slo is not None and r.ttft > ttft_slo:
        return False
    gaps = r.gaps
    if tbt_slo is not None and gaps:
        rank = max(0, int(np.ceil(0.99 * len(gaps))) - 1)
        if sorted(gaps)[rank] > tbt_slo:
            return False
    return True


def summarize(records: list[RequestRecord], *, duration: float | None = None, ttft_slo: float | None = None,
              tbt_slo: float | None = None, stall_threshold_s: float | None = None,
              by_priority: bool = True) -> dict:
    """Everything the report prints for one run. `duration` defaults to the run's span; per-priority summaries use
    the whole run's span so their throughputs add up."""
    duration = duration if duration is not None else run_span(records)
    ok = [r for r in records if r.ok]
    if stall_threshold_s is None:
        stall_threshold_s = stall_threshold(records)
    gaps = [g for r in ok for g in r.gaps]
    stalls = [g for g in gaps if stall_threshold_s is not None and g > stall_threshold_s]
    out_tokens = sum(r.num_output_tokens for r in ok)
    in_tokens = sum(r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_tokens for r in ok)
    short = [r.index for r in ok if r.num_output_tokens < r.output_tokens]
    summary = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "incomplete_outputs": len(short),  # fewer tokens than max_tokens: ignore_eos not honoured, or cut short
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": in_tokens / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft": stats([r.ttft for r in ok]),
        "tbt": stats(gaps),
        "tpot": stats([t for r in ok if (t := r.tpot) is not None]),
        "e2e": stats([r.e2e for r in ok]),
        "normalized_latency": stats([r.normalized_latency for r in ok]),
        "stall_threshold_s": stall_threshold_s,
        "stalls": {"count": len(stalls), "total_s": float(sum(stalls))},
        "ttft_slo_s": ttft_slo,
        "tbt_slo_s": tbt_slo,
        "goodput": None,
    }
    if ttft_slo is not None or tbt_slo is not None:
        good = sum(meets_slo(r, ttft_slo, tbt_slo) for r in ok)
        summary["goodput"] = good / duration if duration else 0.0
        summary["slo_attainment"] = good / len(records) if records else 0.0
    if by_priority:
        clients = sorted({r.client for r in records})
        if len(clients) > 1:
            summary["per_client"] = {
                c: summarize([r for r in records if r.client == c], duration=duration, ttft_slo=ttft_slo,
                             tbt_slo=tbt_slo, stall_threshold_s=stall_threshold_s, by_priority=False)
                for c in clients}
            summary["fairness"] = fairness(records)
        priorities = sorted({r.priority for r in records})
        if len(priorities) > 1:
            summary["per_priority"] = {
                str(p): summarize([r for r in records if r.priority == p], duration=duration, ttft_slo=ttft_slo,
                                  tbt_slo=tbt_slo, stall_threshold_s=stall_threshold_s, by_priority=False)
                for p in priorities}
    return summary


def max_min_shares(capacity: float, demands: dict[str, float]) -> dict[str, float]:
    """Max-min fair split of `capacity` (water-filling): a client asking less than an equal share gets what it
    asks, the rest is split equally among the others."""
    share, left, todo = {}, capacity, dict(demands)
    while todo:
        equal = left / len(todo)
        small = {c: d for c, d in todo.items() if d <= equal}
        if not small:
            share.update({c: equal for c in todo})
            break
        for c, d in small.items():
            share[c] = d
            left -= d
            del todo[c]
    return share


def jain_index(xs: list[float]) -> float | None:
    """(sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one takes everything."""
    sq = sum(x * x for x in xs)
    return sum(xs) ** 2 / (len(xs) * sq) if xs and sq > 0 else None


def fairness(records: list[RequestRecord]) -> dict:
    """Jain's index of the clients' output-token throughput over the arrival window (first to last arrival),
    each client's throughput divided by its max-min fair share of what all clients got in the window. A client's
    demand is the tokens its requests sent in the window asked for: one asking for less than an equal share
    (the light client) is entitled to all of it, a backlogged one (the heavy client) to the rest. 1.0: every
    client got its fair share; a starved light client pulls it down."""
    end = max((r.sent_s for r in records), default=0.0)
    start = min((r.sent_s for r in records), default=0.0)
    window = max(end - start, 1e-9)
    got: dict[str, float] = {}
    demand: dict[str, float] = {}
    for r in records:
        got[r.client] = got.get(r.client, 0.0) + sum(1 for t in r.token_times if t <= end)
        demand[r.client] = demand.get(r.client, 0.0) + r.output_tokens
    share = max_min_shares(sum(got.values()), demand)
    ratios = {c: got[c] / share[c] for c in got if share[c] > 0}
    return {"window_s": window, "jain_index": jain_index(list(ratios.values())),
            "tokens_per_s": {c: g / window for c, g in got.items()},
            "fair_share_per_s": {c: s / window for c, s in share.items()},
            "share_ratio": ratios}


def all_decoding_gaps(records: list[RequestRecord]) -> list[float]:
    """Gaps that fall entirely inside the window where every request has its first token and none has finished:
    with short prompts these are decode-only steps at the full batch size."""
    ok = [r for r in records if r.ok and len(r.token_times) > 1]
    if not ok:
        return []
    lo = max(r.token_times[0] for r in ok)
    hi = min(r.token_times[-1] for r in ok)
    return [t1 - t0 for r in ok for t0, t1 in zip(r.token_times, r.token_times[1:]) if t0 >= lo and t1 <= hi]
