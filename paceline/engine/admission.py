"""Admission by queueing delay (`--max-queue-delay-s`): say "overloaded" early instead of timing everyone out.

Two checks, both against the same limit S:
- at arrival, on the event loop (no round trip to the engine thread, so a rejection is answered at once): the
  predicted wait is the requests ahead of this one divided by the rate at which requests have recently left the
  queue (got their first token). Over S: QueueDelayError, a 503 with Retry-After.
- while waiting: a request that has waited S without being scheduled is taken out (its KV was never touched) and
  its client gets the same 503; a stream learns it before any token. A request that started and was preempted
  back into the queue has already streamed tokens, so it is never expired.

The prediction is Little's law on the recent past, not a model of the batch: it needs no knowledge of prompt
lengths or step times, and when the recent rate is unknown (a cold start) it admits and leaves the deadline to
catch a wrong guess. A deadline that fired is itself evidence: while a request expired less than S ago, an arrival
with anyone waiting ahead of it is rejected at once. Without that, a server too slow to start MIN_STARTS requests
in the window never has a rate, so it admitted everyone and answered every one of them 503 only after S (measured:
benchmarks/overload.py, 228 of 232 requests at 3x capacity); now only the queue that was there when the first one
expired waits S, and arrivals are admitted again once it has drained.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any

from paceline.request import RequestStatus

RATE_WINDOW_S = 10.0  # how far back the start rate looks
MIN_STARTS = 4  # fewer starts in the window: the rate is unknown and arrivals are admitted
SWEEP_EVERY_S = 0.05  # how often the engine thread looks for expired waiting requests


class QueueDelayError(RuntimeError):
    """The request would wait (or has waited) longer than max_queue_delay_s; the server answers 503 with
    Retry-After. Nothing of it runs."""

    def __init__(self, message: str, retry_after_s: int, reason: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason  # "queue_delay_predicted" | "queue_delay_expired" (the metrics label)


class AdmissionControl:
    def __init__(self, max_queue_delay_s: float, window_s: float = RATE_WINDOW_S) -> None:
        if max_queue_delay_s <= 0:
            raise ValueError(f"max_queue_delay_s must be > 0, got {max_queue_delay_s}")
        self.max_delay = max_queue_delay_s
        self.window = window_s
        self._starts: deque[float] = deque()  # when recent requests got their first token (engine thread appends)
        self._next_sweep = 0.0
        self._last_expiry = -math.inf  # when a waiting request last expired (engine thread writes, event loop reads)

    # ---- the start rate (fed on the engine thread) ---------------------------------------------------------

    def observe(self, outputs: list, now: float) -> None:
        for out in outputs:
            # a request's first delta: every output token it has came in this one (spec decoding may bring several)
            if out.new_token_ids and out.num_output_tokens == len(out.new_token_ids):
                self._starts.append(now)
        cutoff = now - self.window
        while self._starts and self._starts[0] < cutoff:
            self._starts.popleft()

    def start_rate(self, now: float) -> float | None:
        """Requests per second that left the queue over the window; None while too few did to say."""
        starts = list(self._starts)  # a copy: the engine thread may append while the event loop reads
        recent = [t for t in starts if t >= now - self.window]
        if len(recent) < MIN_STARTS:
            return None
        span = max(now - recent[0], 1e-3)
        return len(recent) / span

    # ---- at arrival (event loop) ---------------------------------------------------------------------------

    def predicted_wait(self, num_ahead: int, now: float) -> float:
        if num_ahead <= 0:
            return 0.0
        rate = self.start_rate(now)
        wait = 0.0 if rate is None else (num_ahead + 1) / rate
        if now - self._last_expiry < self.max_delay:  # the queue just proved slower than the limit
            wait = max(wait, math.nextafter(self.max_delay, math.inf))
        return wait

    def check(self, num_ahead: int, now: float) -> None:
        wait = self.predicted_wait(num_ahead, now)
        if wait > self.max_delay:
            why = (f"the predicted wait of {wait:.1f} s" if wait > math.nextafter(self.max_delay, math.inf) else
                   "a request waiting as long a moment ago expired, so the predicted wait")
            raise QueueDelayError(
                f"the server is overloaded: {num_ahead} requests are waiting and {why} "
                f"exceeds the limit of {self.max_delay:g} s (--max-queue-delay-s); retry later",
                retry_after_s=max(1, math.ceil(wait - self.max_delay)), reason="queue_delay_predicted")

    # ---- while waiting (engine thread) ---------------------------------------------------------------------

    def expired(self, engine: Any, now: float) -> list[str]:
        """Ids of requests that have waited longer than the limit and never run; at most every SWEEP_EVERY_S."""
        if now < self._next_sweep:
            return []
        self._next_sweep = now + SWEEP_EVERY_S
        scheduler = getattr(engine, "scheduler", None)
        requests = getattr(scheduler, "requests", None)
        if requests is None:  # an engine without a paceline scheduler: only the arrival check applies
            return []
        cutoff = now - self.max_delay
        expired = [rid for rid, r in requests.items() if r.status is RequestStatus.WAITING
                   and r.first_scheduled_time is None and r.arrival_time < cutoff]
        if expired:
            self._last_expiry = now
        return expired

    def expired_error(self) -> QueueDelayError:
        return QueueDelayError(f"the request waited longer than {self.max_delay:g} s (--max-queue-delay-s) without "
                               "being scheduled: the server is overloaded; retry later",
                               retry_after_s=max(1, math.ceil(self.max_delay)), reason="queue_delay_expired")
