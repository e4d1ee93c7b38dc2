"""StepLog: what the dashboard shows, kept in process. A ring buffer of the last steps (composition, duration and
prediction, queue sizes, KV blocks, preemptions, stalls), per-second TTFT / TBT histograms of the last minute, and,
only while a page is connected, a few-times-a-second snapshot of the requests in flight.

Written on the engine thread after every step (EngineMetrics.on_step), read on the event loop. The step loop pays
one tuple and one deque append per step; anything that walks the requests is rate-limited and skipped while no
page is connected. Every record names its model, so several engines can feed one page."""
from __future__ import annotations

import time
from bisect import bisect_right
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Iterable

RING_STEPS = 8192  # ~2.5 min at 50 steps/s on CPU; a fast GPU wraps sooner, the charts show the last minute
LATENCY_WINDOW_S = 60
SNAPSHOT_INTERVAL_S = 0.25
MAX_TABLE_ROWS = 200  # requests listed in the table; the counts by priority cover all of them

# upper edges (seconds) of the latency histograms; the last bucket takes everything above
TTFT_EDGES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
TBT_EDGES = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)

# one step record: a plain tuple on the hot path, a dict (these keys, plus "model") for the page
# ctx / dctx: KV rows the step's prompt chunks / decodes read (one chunk: the depth it ends at); target: the
# smallest step-time target (ms) a chunk was sized to, 0 if none; scale: the measured / predicted factor the target
# was divided by (pred already includes it). The last four are read from the scheduler's stats (0 without
# max_step_ms): with them a long step can be explained from the log alone (benchmarks/vs_vllm.py's stall probe)
STEP_FIELDS = ("seq", "t", "dur", "pred", "decode", "prefill", "reqs", "running", "waiting", "swapped",
               "kv_used", "kv_cached", "kv_free", "preempted", "swapped_out", "stalls", "ctx", "dctx", "target",
               "scale")


@dataclass
class EngineInfo:
    """What the page needs once per model: the limits the charts draw against."""
    model: str
    max_step_ms: float = 0.0
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    num_blocks: int = 0
    block_size: int = 0
    policy: str = ""

    @classmethod
    def of(cls, engine: Any, model: str) -> EngineInfo:
        sched = getattr(getattr(engine, "config", None), "scheduler", None)
        return cls(model, getattr(sched, "max_step_ms", 0.0), getattr(sched, "max_num_batched_tokens", 0),
                   getattr(sched, "max_num_seqs", 0), getattr(engine, "num_blocks", 0),
                   getattr(engine, "block_size", 0), getattr(sched, "policy", ""))


class LatencyBins:
    """Counts per (second, bucket); the last minute's histogram is the sum of the bins still in the window."""

    def __init__(self, edges: tuple[float, ...], window_s: int = LATENCY_WINDOW_S) -> None:
        self.edges = edges
        self.window_s = window_s
        self._bins: deque[tuple[int, list[int]]] = deque(maxlen=window_s + 1)

    def add(self, values: list[float], t: float) -> None:
        """Samples taken at time t (seconds, any clock the reader's `now` shares)."""
        second = int(t)
        bins = self._bins
        if not bins or bins[-1][0] != second:
            bins.append((second, [0] * (len(self.edges) + 1)))
        counts, edges = bins[-1][1], self.edges
        for v in values:
            counts[bisect_right(edges, v)] += 1

    def histogram(self, now: float) -> list[int]:
        counts = [0] * (len(self.edges) + 1)
        oldest = int(now) - self.window_s
        for second, bin_counts in tuple(self._bins):  # tuple(): one C call, so the engine thread cannot interleave
            if second > oldest:
                for i, c in enumerate(bin_counts):
                    counts[i] += c
        return counts


class StepLog:
    def __init__(self, model: str, capacity: int = RING_STEPS) -> None:
        self.model = model
        self.started = time.time()  # tells a page that reconnects whether this is still the same server
        self.info: EngineInfo | None = None  # set from the engine on its first report (EngineMetrics.on_step)
        self.steps: deque[tuple] = deque(maxlen=capacity)
        self.ttft = LatencyBins(TTFT_EDGES)
        self.tbt = LatencyBins(TBT_EDGES)
        self.num_steps = 0
        self.subscribers = 0  # connected pages; the snapshot of requests is taken only while there are some
        self.snapshot: dict | None = None  # replaced whole, never mutated: readers on other threads see one or the other
        self._next_snapshot = 0.0

    # ---- engine thread ----------------------------------------------------------------------------------------

    def record(self, step: Any, stats: Any, num_stalls: int, t: float) -> None:
        """One step that ran (Engine.last_step), the scheduler's stats after it, TBT stalls its outputs showed."""
        self.num_steps += 1
        num_cached = getattr(stats, "num_cached_blocks", 0)
        num_free = getattr(stats, "num_free_blocks", stats.num_blocks - stats.num_used_blocks)
        # getattr with defaults: engines other than paceline's (tests' fakes) may report less
        self.steps.append((self.num_steps, t, step.duration, getattr(step, "predicted_s", 0.0),
                           step.num_decode_tokens, step.num_prefill_tokens, getattr(step, "num_requests", 0),
                           stats.num_running, stats.num_waiting, getattr(stats, "num_swapped", 0),
                           stats.num_used_blocks, num_cached, num_free,
                           getattr(step, "num_preempted", 0), getattr(step, "num_swapped_out", 0), num_stalls,
                           getattr(stats, "last_step_context", 0), getattr(stats, "last_step_decode_context", 0),
                           getattr(stats, "last_step_target_ms", 0.0), getattr(stats, "last_step_scale", 0.0)))

    def observe_ttft(self, value: float, t: float) -> None:
        self.ttft.add((value,), t)

    def observe_tbt(self, values: list[float], t: float) -> None:
        """One step's TBT gaps, in one call: a per-token call would cost the step loop a microsecond a token."""
        self.tbt.add(values, t)

    def maybe_snapshot(self, engine: Any, now: float, force: bool = False) -> None:
        """The requests in flight, at most every SNAPSHOT_INTERVAL_S, only while a page listens. `force`: the
        engine went idle (the table must empty even if the last snapshot was moments ago)."""
        if not self.subscribers or (now < self._next_snapshot and not force):
            return
        self._next_snapshot = now + SNAPSHOT_INTERVAL_S
        self.snapshot = snapshot_requests(_live_requests(engine), now)

    # ---- event loop -----------------------------------------------------------------------------------------

    def info_dict(self) -> dict:
        info = asdict(self.info) if self.info is not None else {"model": self.model}
        return {**info, "model": self.model, "started": self.started}

    def steps_since(self, seq: int) -> list[dict]:
        """Step records newer than `seq` as dicts, oldest first."""
        ring = tuple(self.steps)  # one C call: a consistent copy while the engine thread appends
        if not ring or ring[-1][0] <= seq:
            return []
        start = max(0, len(ring) - (ring[-1][0] - seq))
        model = self.model
        return [{"model": model, **dict(zip(STEP_FIELDS, r))} for r in ring[start:]]

    def latency(self, now: float) -> dict:
        return {"model": self.model, "window_s": LATENCY_WINDOW_S,
                "ttft": {"edges": list(TTFT_EDGES), "counts": self.ttft.histogram(now)},
                "tbt": {"edges": list(TBT_EDGES), "counts": self.tbt.histogram(now)}}


def _live_requests(engine: Any) -> Iterable[Any]:
    sched = getattr(engine, "scheduler", None)
    return tuple(sched.requests.values()) if sched is not None else ()


def snapshot_requests(requests: Iterable[Any], now: float) -> dict:
    """Counts by (state, priority) and the table rows: running first, then by priority and arrival."""
    by_priority: dict[str, dict[str, int]] = {}
    rows = []
    for r in requests:
        state = r.status.value
        counts = by_priority.setdefault(str(r.priority), {"running": 0, "waiting": 0, "swapped": 0})
        if state in counts:
            counts[state] += 1
        rows.append((state != "running", r.priority, r.arrival_time, r))
    rows.sort(key=lambda row: row[:3])
    table = [{"id": r.request_id, "priority": r.priority, "state": r.status.value,
              "prompt_done": min(r.num_computed_tokens, r.num_prompt_tokens), "prompt": r.num_prompt_tokens,
              "out": r.num_output_tokens, "max_out": r.sampling_params.max_tokens,
              "age": round(max(0.0, now - r.arrival_time), 3), "preemptions": r.num_preemptions}
             for *_, r in rows[:MAX_TABLE_ROWS]]
    return {"t": now, "by_priority": by_priority, "requests": table, "num_requests": len(rows)}
