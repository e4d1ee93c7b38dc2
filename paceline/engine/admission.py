"""Admission by queueing delay (`--max-queue-delay-s`): say "overloaded" early instead of timing everyone out.

The decision is made once, at arrival, on the event loop (no round trip to the engine thread, so a rejection
is answered at once, however long the step in flight): the predicted wait of this request against the limit S.
Over S: QueueDelayError, a 503 with Retry-After. A request that was admitted is then served, however long it
ends up waiting: a prediction that was too short costs that request a longer wait, never a late 503 (the late
503s were 5 % of all 503s at 3x capacity, 2026-11-23, benchmarks/summaries/soak.md section 3). Such a request is
counted (`num_overdue`: admitted, then waited more than S without being scheduled), and while one is overdue (and
for S seconds after) an arrival with anyone waiting ahead is refused at once: the queue has proved slower than
predicted, so the prediction is not trusted until it has drained. Only an engine with no load to read (no
paceline scheduler, e.g. several models) still takes a waiting request out after S (`queue_delay_expired`),
since there the start-rate prediction may know nothing and admit everyone.

The prediction is from the load, snapshotted on the engine thread before every step (`Load`): the requests
running and how many tokens each has left to generate, the waiting requests' prompt tokens and output budgets,
the scheduler's seats, and the step-time model (scaled by the engine's running correction):
- TBT seats: how many requests can decode in one step, beside one block of prompt, within the step-time target
  (core/auto_batch.py's rule). A newcomer the scheduler would seat at once beyond them (fixed --max-num-seqs
  larger than they are) would slow every admitted stream past the TBT goal: refused at arrival.
- The wait for a seat: with the seats full, the newcomer starts when enough running requests have finished,
  played out step by step from their remaining output budgets (the requests ahead of it take the first seats
  that free, and hold them for their own budgets), at the measured step time.
- The wait for the prompts ahead: their tokens at the prefill rate the model gives a step beside the decodes.
Both are known from the first request on, so an overloaded server refuses at arrival from the start. The load
prediction is then multiplied by a margin learned from the admitted requests once they start (MARGIN_*): what
it leaves out (steps with a prompt chunk run longer than the mean step, a busy machine) shows up as measured waits
longer than predicted.

Before (measured 2026-11-23, benchmarks/summaries/soak.md section 3) the prediction was Little's law on the
recent start rate; a server slow enough to start fewer than MIN_STARTS requests in the window had no rate, so it
admitted, and 22-24 % of the 503s came only after the S wait. That rule remains for an engine without a paceline
scheduler (no load to read).
"""
from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable

from paceline.core.auto_batch import auto_limits
from paceline.core.batch_shape import BatchShape
from paceline.engine.engine import track_quantile
from paceline.request import RequestStatus

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0  # how far back the start rate looks
MIN_STARTS = 4  # fewer starts in the window: the rate is unknown and arrivals are admitted
SWEEP_EVERY_S = 0.05  # how often the engine thread looks for waiting requests past the limit
LOG_EVERY_S = 60.0  # at most one warning a minute about admitted requests waiting past the limit
# The load prediction's error, learned from admitted requests once they start: a high quantile of
# (measured wait + FLOOR) / (predicted + FLOOR), tracked by its side only (one wild sample moves it no more than any
# other), and applied as a factor of at least 1. FLOOR keeps waits much shorter than any limit from counting as
# large ratios. At 3x capacity (2026-11-24) 10 of 54 admitted requests waited past a 5 s limit without it.
MARGIN_QUANTILE = 0.9
MARGIN_RATE = 0.2  # a sample above the estimate raises it 20 %, one below lowers it 2 %
MARGIN_FLOOR_S = 0.5
STEP_EMA = 0.2  # weight of the newest step in the measured step time
DEFAULT_OUTPUT_TOKENS = 256  # a request's output budget when it set none (max_tokens None: up to the context)


@dataclass(frozen=True)
class Load:
    """What runs and waits, as the engine thread saw it before its last step (read whole by the event loop)."""
    running_left: tuple[int, ...]  # output tokens each running request may still generate
    waiting_prompt: tuple[int, ...]  # prompt tokens each waiting request still has to prefill
    waiting_left: tuple[int, ...]  # each waiting request's output budget
    seats: int  # the scheduler's seat limit (max_num_seqs; under auto, its latest value)
    tbt_seats: int | None  # seats that keep a step within the step-time target; None without a model or target
    step_s: float | None  # measured seconds per step (running average), None before any
    prefill_tok_s: float | None  # prompt tokens per second a step adds beside the running decodes

    @property
    def num_waiting(self) -> int:
        return len(self.waiting_prompt)


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
        self._last_late = -math.inf  # when a waiting request was last seen past S (engine thread writes, loop reads)
        self._overdue: set[str] = set()  # admitted requests waiting past S now (engine thread only)
        self.num_overdue = 0  # admitted requests that waited past S before their first step, since start
        self._last_log = -math.inf
        self.load: Load | None = None  # the engine thread replaces it whole before every step; None: no scheduler
        self._step_s: float | None = None
        self._last_look: tuple[float, bool] | None = None  # (when, whether anything ran) at the previous look
        self._load_failed = False
        self.margin = 1.0  # the factor load predictions are multiplied by (the engine thread writes it)
        self._ratio = 1.0  # the tracked quantile of measured / predicted (may fall below 1; margin does not)
        self._promised: dict[str, tuple[float, float]] = {}  # request id -> (arrival, unscaled prediction)

    # ---- the load (snapshotted on the engine thread) -------------------------------------------------------

    def look(self, engine: Any, now: float) -> None:
        """Snapshot the load before a step. Never raises: a bug here must not stop the engine thread, it only
        sends admission back to the start rate."""
        try:
            self.load = self._snapshot(engine, now)
        except Exception:
            if not self._load_failed:
                log.exception("admission: could not read the load; using the start rate")
            self._load_failed, self.load = True, None

    def _snapshot(self, engine: Any, now: float) -> Load | None:
        sched = getattr(engine, "scheduler", None)
        if sched is None or not hasattr(sched, "running") or not hasattr(sched, "requests"):
            return None  # an engine without a paceline scheduler: only the start rate applies
        running = list(sched.running)
        running_ids = {id(r) for r in running}
        waiting = [r for r in sched.requests.values() if r.status is not RequestStatus.RUNNING
                   and not r.is_finished and id(r) not in running_ids]
        # the gap between two looks with work on hand is one step (with its bookkeeping): what a stream sees. The
        # first request's first step (its prefill) counts too, so a wait is predicted from the second look on,
        # not left at 0 until two steps have run (a newcomer arriving then was admitted on a guess of 0)
        if self._last_look is not None and self._last_look[1]:
            gap = now - self._last_look[0]
            self._step_s = gap if self._step_s is None else (1 - STEP_EMA) * self._step_s + STEP_EMA * gap
        self._last_look = (now, bool(running or waiting))
        cfg = sched.config
        seats = max(1, int(cfg.max_num_seqs))
        step_time: Callable[[BatchShape], float] | None = getattr(sched, "step_time", None)
        target_s = (getattr(cfg, "max_step_ms", 0.0) or 0.0) / 1000.0
        tbt_seats = prefill_tok_s = None
        step_s = self._step_s
        contexts = [r.num_tokens for r in running]
        if step_time is not None and target_s > 0:
            scale = getattr(sched, "step_time_scale", 1.0) or 1.0
            prompts = [r.num_prompt_tokens for r in waiting]
            new_context = (sum(prompts) // len(prompts) if prompts else
                           sum(contexts) // len(contexts) if contexts else sched.block_size)
            tbt_seats, budget = auto_limits(step_time, target_s / scale, contexts, new_context, sched.block_size)
            decodes = BatchShape.build(decode_contexts=contexts)
            chunk = max(sched.block_size, budget - len(running)) if running else \
                max(sched.block_size, min(budget, new_context))
            with_chunk = replace(decodes)
            with_chunk.add_chunk(0, chunk, sampled=False)
            prefill_tok_s = chunk / max(1e-6, scale * step_time(with_chunk))
            if step_s is None and running:
                step_s = scale * step_time(decodes)
        return Load(running_left=tuple(_left(r) for r in running),
                    waiting_prompt=tuple(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in waiting),
                    waiting_left=tuple(_left(r) for r in waiting), seats=seats, tbt_seats=tbt_seats,
                    step_s=step_s, prefill_tok_s=prefill_tok_s)

    def load_wait(self, load: Load, num_ahead: int) -> tuple[float, str]:
        """(predicted seconds before a newcomer starts, why): "" for a plain wait, or "tbt" when it would be seated
        beyond the TBT seats (infinite: it must not start at all now). `num_ahead` beyond the snapshot's waiting
        count are arrivals since (a burst): they count as the average waiting request."""
        prompts, lefts = list(load.waiting_prompt), list(load.waiting_left)
        extra = max(0, num_ahead - len(prompts))
        if extra:
            known = prompts or [0]
            prompts += [sum(known) // len(known)] * extra
            lefts += [sum(lefts) // len(lefts) if lefts else DEFAULT_OUTPUT_TOKENS] * extra
        demand = len(load.running_left) + len(prompts) + 1
        seats = load.seats
        if load.tbt_seats is not None:
            if demand > load.tbt_seats and seats >= demand:
                return math.inf, "tbt"
            seats = min(seats, load.tbt_seats)
        step_s = load.step_s or 0.0
        prefill_s = (lambda tokens: tokens / load.prefill_tok_s) if load.prefill_tok_s else (lambda tokens: 0.0)
        seat_wait = 0.0
        if demand > seats:  # the seats are full: play out who finishes when (seconds from now)
            left = sorted(load.running_left)
            free = left[len(left) - seats:] if len(left) >= seats else left + [0] * (seats - len(left))
            free = [steps * step_s for steps in free]
            heapq.heapify(free)
            for prompt, budget in zip(prompts, lefts):  # those ahead take the first seats that free, and hold
                heapq.heappush(free, heapq.heappop(free) + prefill_s(prompt) + budget * step_s)  # them this long
            seat_wait = free[0]
        prefill_wait = prefill_s(sum(prompts))
        return max(seat_wait, prefill_wait), ""

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
        return self._predict(num_ahead, now)[0]

    def _predict(self, num_ahead: int, now: float) -> tuple[float, str, float | None]:
        """(predicted wait, why, the load's own prediction before the margin or None without a load)."""
        load = self.load  # one read: the engine thread swaps in a new snapshot whole
        why, raw = "", None
        if load is not None:
            num_ahead = max(num_ahead, load.num_waiting)
            raw, why = self.load_wait(load, num_ahead)
            wait = raw * self.margin
        elif num_ahead <= 0:
            return 0.0, "", None
        else:
            rate = self.start_rate(now)
            wait = 0.0 if rate is None else (num_ahead + 1) / rate
        # the queue has proved slower than predicted (an admitted request waits, or waited a moment ago, past S)
        if num_ahead > 0 and (self._overdue or now - self._last_late < self.max_delay):
            wait = max(wait, math.nextafter(self.max_delay, math.inf))
        return wait, why, raw

    def check(self, num_ahead: int, now: float, request_id: str | None = None) -> None:
        """Raise QueueDelayError for a request that would wait too long; an admitted `request_id` is remembered
        with its prediction, to learn the prediction's error when it starts."""
        wait, why, raw = self._predict(num_ahead, now)
        if wait <= self.max_delay:
            if request_id is not None and raw is not None:
                self._promised[request_id] = (now, raw)
            return
        load = self.load
        if why == "tbt" and load is not None:
            # retry when the first running request may have finished
            soonest = (load.step_s or 0.0) * min(load.running_left, default=0)
            raise QueueDelayError(
                f"the server is overloaded: {len(load.running_left)} requests are running and {load.num_waiting} "
                f"waiting, and one more would make the batch larger than the {load.tbt_seats} that keep every "
                "stream within the step-time target; retry later", retry_after_s=max(1, math.ceil(soonest)),
                reason="queue_delay_predicted")
        text = (f"the predicted wait of {wait:.1f} s" if wait > math.nextafter(self.max_delay, math.inf) else
                "a request admitted a while ago has waited longer than the limit, so the predicted wait")
        raise QueueDelayError(
            f"the server is overloaded: {num_ahead} requests are waiting and {text} "
            f"exceeds the limit of {self.max_delay:g} s (--max-queue-delay-s); retry later",
            retry_after_s=max(1, math.ceil(wait - self.max_delay)), reason="queue_delay_predicted")

    # ---- while waiting (engine thread) ---------------------------------------------------------------------

    def sweep(self, engine: Any, now: float) -> list[str]:
        """The engine thread calls it before every step: it takes the load snapshot, and at most every
        SWEEP_EVERY_S looks for waiting requests that have waited past the limit without running. With a load
        (a paceline scheduler) they stay queued and are counted as overdue; without one, their ids are returned
        to be taken out with a 503 (the only rejection made after arrival)."""
        self.look(engine, now)
        if now < self._next_sweep:
            return []
        self._next_sweep = now + SWEEP_EVERY_S
        scheduler = getattr(engine, "scheduler", None)
        requests = getattr(scheduler, "requests", None)
        if requests is None:  # an engine that shows no requests: only the arrival check applies
            return []
        if self._promised:
            self._learn(requests, now)
        cutoff = now - self.max_delay
        late = [rid for rid, r in requests.items() if r.status is RequestStatus.WAITING
                and r.first_scheduled_time is None and r.arrival_time < cutoff]
        if late:
            self._last_late = now
        if self.load is None:
            return late
        new = sum(1 for rid in late if rid not in self._overdue)
        self.num_overdue += new
        if new and now - self._last_log >= LOG_EVERY_S:  # a misprediction says so in the log, not in every line
            self._last_log = now
            log.warning(
                "admission: %d admitted request(s) have waited more than %g s without running (%d since start); "
                "they are served, and arrivals with a queue ahead are refused until the queue drains",
                len(late), self.max_delay, self.num_overdue)
        self._overdue = set(late)  # only those still waiting: the set stays as small as the queue
        return []

    def _learn(self, requests: dict, now: float) -> None:
        """The margin from the admitted requests that have started since the last sweep."""
        for rid, (arrival, raw) in list(self._promised.items()):  # a copy: the event loop adds while we read
            r = requests.get(rid)
            if r is None:  # not added yet (the add is queued), or gone without starting (aborted, refused)
                if now - arrival > 1.0:
                    self._promised.pop(rid, None)
                continue
            if r.first_scheduled_time is None:
                continue
            self._promised.pop(rid, None)
            measured = max(0.0, r.first_scheduled_time - r.arrival_time)
            ratio = (measured + MARGIN_FLOOR_S) / (raw + MARGIN_FLOOR_S)
            self._ratio = track_quantile(self._ratio, ratio, MARGIN_QUANTILE, MARGIN_RATE)
            self.margin = max(1.0, self._ratio)

    def expired_error(self) -> QueueDelayError:
        return QueueDelayError(f"the request waited longer than {self.max_delay:g} s (--max-queue-delay-s) without "
                               "being scheduled: the server is overloaded; retry later",
                               retry_after_s=max(1, math.ceil(self.max_delay)), reason="queue_delay_expired")


def _left(request: Any) -> int:
    """Output tokens a request may still generate (its budget; a stop or EOS may end it sooner)."""
    budget = request.sampling_params.max_tokens
    return max(1, (DEFAULT_OUTPUT_TOKENS if budget is None else budget) - request.num_output_tokens)
