"""What the server says about itself: Prometheus /metrics snapshots, differenced over a run.

Used for the scheduling delay (paceline:request_queue_time_seconds, a histogram) and the step composition
over time (paceline:step_decode_tokens_total vs paceline:step_prefill_tokens_total). A server without these
metrics (or without /metrics at all) simply yields nothing, and the report leaves those columns out.
"""
from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field

import httpx

QUEUE_TIME = "paceline:request_queue_time_seconds"
# vLLM's histogram of the same thing (arrival to first scheduled, observed when a request finishes), so a
# comparison judges its 2 s rule on the server's own figure, as it does paceline's, not on a TTFT estimate
PEER_QUEUE_TIMES = ("vllm:request_queue_time_seconds",)
DECODE_TOKENS = "paceline:step_decode_tokens_total"
PREFILL_TOKENS = "paceline:step_prefill_tokens_total"
STEP_COUNTERS = ("paceline:steps_total", "paceline:step_duration_seconds_count", "paceline:engine_steps_total")

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, float]:
    """'name{a="x",le="0.5"}' -> value, labels sorted so keys are stable; samples of one name with different
    labels other than `le` are summed under the name alone too (e.g. per-model series)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        try:
            v = float(value)
        except ValueError:
            continue
        pairs = dict(_LABEL.findall(labels))
        le = pairs.pop("le", None)
        key = name + (f'{{le="{le}"}}' if le is not None else "")
        out[key] = out.get(key, 0.0) + v
    return out


def histogram(snapshot: dict[str, float], name: str) -> list[tuple[float, float]]:
    """Cumulative (upper bound, count) buckets of a histogram, sorted; [] when absent."""
    prefix = f'{name}_bucket{{le="'
    buckets = [(float(k[len(prefix):-2].replace("+Inf", "inf")), v) for k, v in snapshot.items() if k.startswith(prefix)]
    return sorted(buckets)


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus-style: linear interpolation inside the bucket holding the q-th observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound  # the best we can say: above the last finite bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def scheduling_delay(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """Median, p99 and mean queueing time of the requests that started during the run; None if not exposed."""
    d = diff(after, before)
    for name in (QUEUE_TIME, *PEER_QUEUE_TIMES):
        buckets = histogram(d, name)
        count = d.get(f"{name}_count", 0.0)
        if buckets and count > 0:
            return {"p50": histogram_quantile(buckets, 0.5), "p99": histogram_quantile(buckets, 0.99),
                    "mean": d.get(f"{name}_sum", 0.0) / count, "count": int(count)}
    return None


def speculation(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """Speculative decoding over the run, from the counters paceline and vLLM both expose (vLLM's names, under
    `paceline:` or `vllm:`): proposals, accepted ones, acceptance rate and mean accepted length per verification.
    None when the server exposes none or proposed nothing."""
    d = diff(after, before)
    for prefix in ("paceline:", "vllm:"):
        drafts = d.get(f"{prefix}spec_decode_num_drafts_total", 0.0)
        proposed = d.get(f"{prefix}spec_decode_num_draft_tokens_total", 0.0)
        if drafts > 0 and proposed > 0:
            accepted = d.get(f"{prefix}spec_decode_num_accepted_tokens_total", 0.0)
            return {"draft_tokens": proposed, "accepted_tokens": accepted, "acceptance_rate": accepted / proposed,
                    "mean_accepted_length": accepted / drafts}
    return None


@dataclass
class Scraper:
    """Polls /metrics every `interval` seconds while a run is going; keeps (time, snapshot) pairs."""
    url: str
    interval: float = 0.5
    t0: float = 0.0  # the run's clock origin (time.perf_counter())
    snapshots: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    available: bool = True

    async def scrape(self, client: httpx.AsyncClient) -> dict[str, float] | None:
        if not self.available:
            return None
        try:
            r = await client.get(self.url.rstrip("/") + "/metrics", timeout=5.0)
            if r.status_code != 200:
                self.available = False
                return None
            snap = parse_prometheus(r.text)
        except (httpx.HTTPError, OSError):
            self.available = False
            return None
        self.snapshots.append((time.perf_counter() - self.t0, snap))
        return snap

    async def run(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set() and self.available:
            await self.scrape(client)
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass


# name in the report -> the counters servers expose it under (paceline's, vLLM's)
PREEMPTION_COUNTERS = {
    "preemptions": ("paceline:num_preemptions_total", "vllm:num_preemptions_total"),
    "time_slice_preemptions": ("paceline:num_time_slice_preemptions_total",),
    "recomputed_tokens": ("paceline:num_recomputed_tokens_total",),
}


def preemption_counts(snapshots: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """How much each preemption counter rose between the first and the last scrape; absent ones left out."""
    if len(snapshots) < 2:
        return {}
    first, last = snapshots[0][1], snapshots[-1][1]
    out = {}
    for name, keys in PREEMPTION_COUNTERS.items():
        key = next((k for k in keys if k in last), None)
        if key is not None:
            out[name] = last[key] - first.get(key, 0.0)
    return out


def step_composition(snapshots: list[tuple[float, dict[str, float]]]) -> list[dict]:
    """Per scrape interval: decode and prompt-chunk tokens run (and per step, when a step counter is exposed)."""
    out = []
    for (t0, a), (t1, b) in zip(snapshots, snapshots[1:]):
        if DECODE_TOKENS not in b and PREFILL_TOKENS not in b:
            continue
        dec = b.get(DECODE_TOKENS, 0.0) - a.get(DECODE_TOKENS, 0.0)
        pre = b.get(PREFILL_TOKENS, 0.0) - a.get(PREFILL_TOKENS, 0.0)
        row = {"t": t1, "dt": t1 - t0, "decode_tokens": dec, "prefill_tokens": pre}
        steps = next((b[k] - a.get(k, 0.0) for k in STEP_COUNTERS if k in b), None)
        if steps is not None:
            row["steps"] = steps
            row["decode_per_step"] = dec / steps if steps else 0.0
            row["prefill_per_step"] = pre / steps if steps else 0.0
        out.append(row)
    return out
