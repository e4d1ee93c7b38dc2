"""Batch settings that follow the load (`--max-num-seqs auto`, `--max-num-batched-tokens auto`): before each
step the scheduler asks `auto_limits` how many requests may hold a seat and how many tokens the step may take,
from the step-time model and the step-time target (max_step_ms, which the engine derives from the TBT goal).

- Seats: as many as keep a step of every running request's decode, plus the decodes of the newcomers, plus one
  block of prompt (the least a prompt chunk gets), under the target. While steps are far under it (short
  contexts, a light load) that is many; as contexts grow it shrinks, so the TBT goal holds without a hand-picked
  number. Seats only gate admission: a running request is never cut for them (the count falls as requests end).
- Token budget: the decodes of the next step plus the most fresh prompt tokens one step can add under the
  target (at least one block); with no request decoding, the cap: a step without decodes has no time limit
  (chunk_within_step_time does not cut one either), and a prompt mid-prefill is not a decode. Counting it as
  one held every later chunk of a lone long prompt to what fits beside a phantom decode: on long-prompt
  (simulated at this machine's speed, 2026-11-24) prompt-only steps ran 70 tokens where a fixed budget of 512
  ran 512, and auto's capacity fell below the fixed setting's. The stall-free scheduler then cuts each chunk to
  the time left (chunk_within_step_time); the budget no longer stops a step that the time would allow, nor lets
  one run past it.

A fixed setting is right for one load; these follow the batch actually running. Both stay within [floor, cap]:
the floor keeps a slow machine serving (one request, one block), the cap bounds the bisection.

The seats judge the prediction by the *median* measured/predicted ratio of the recent steps that ran a decode
(`StepRatio`), not by the engine's step_time_scale. That scale is the 98th percentile of chunk-carrying steps
only, the right guard for sizing a chunk, the wrong one for seats: on the real server (2026-11-23,
benchmarks/auto_batch_trace.py) host stalls of 0.5-1.8 s pushed it to 3.4 within seconds, which left room for
no seat beyond the running ones; with every seat taken no prompt was admitted, so no step carried a chunk and the
scale never came back down: one request ran while 28 waited, on 20-40 ms decode steps under a 150 ms target.
A seat is held for a whole generation, so it follows the typical step; the chunk cutter keeps the tail bound.
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from statistics import median
from typing import TYPE_CHECKING, Callable, Iterable

from paceline.config import AUTO_MAX_NUM_BATCHED_TOKENS, AUTO_MAX_NUM_SEQS
from paceline.core.batch_shape import BatchShape

if TYPE_CHECKING:
    from paceline.core.outputs import SchedulerOutput
    from paceline.core.scheduler import Scheduler

RATIO_WINDOW = 64  # recent steps whose measured / predicted ratio the seats follow (~5 s at 12 steps a second)


class StepRatio:
    """Measured / predicted step time over the last RATIO_WINDOW steps that ran a decode, decode-only steps
    included (the seats are about decodes; a step of prompts alone, with no stream waiting on it, is timed by
    the budget, not the target). The median: one stalled step moves it no more than any other."""

    def __init__(self, window: int = RATIO_WINDOW) -> None:
        self.ratios: deque[float] = deque(maxlen=window)

    def observe(self, output: SchedulerOutput, duration: float) -> None:
        if output.predicted_step_s > 0 and duration > 0 and any(s.is_decode for s in output.scheduled):
            self.ratios.append(duration / output.predicted_step_s)

    @property
    def value(self) -> float:
        """1.0 (the profile as it is) until a step has been seen."""
        return median(self.ratios) if self.ratios else 1.0


def largest_that_fits(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest k in [lo, hi] with fits(k), fits being monotone (true, then false); lo if none."""
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo) is assumed (or lo is the floor); not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def auto_limits(step_time: Callable[[BatchShape], float], max_step_s: float, decode_contexts: Iterable[int],
                new_context: int, block_size: int, max_seqs_cap: int = AUTO_MAX_NUM_SEQS,
                max_tokens_cap: int = AUTO_MAX_NUM_BATCHED_TOKENS,
                seats_step_s: float | None = None, prefill_contexts: Iterable[int] = ()) -> tuple[int, int]:
    """(seats, token budget) for the next step.

    decode_contexts: the context each decoding request's next token attends to; prefill_contexts: the running
    requests still in their prompts (each will decode at about that context: they count for the seats, not for
    the budget); new_context: what a newcomer's is assumed to be (the waiting head's prompt, or the running
    requests' mean); max_step_s: the predicted time the budget must fit (the target over the tail scale);
    seats_step_s: the one the seats must fit (the target over the typical ratio; default max_step_s)."""
    seats_limit = max_step_s if seats_step_s is None else seats_step_s
    decodes = list(decode_contexts)
    running = BatchShape.build(decode_contexts=decodes + list(prefill_contexts))
    n = running.num_decodes

    def seats_fit(k: int) -> bool:
        shape = replace(running)
        extra = k - n  # k - n newcomers' decodes, as add_decode would count them
        shape.num_decodes += extra
        shape.num_requests += extra
        shape.num_sampled += extra
        shape.decode_context += extra * new_context
        shape.add_chunk(0, block_size, sampled=False)
        return step_time(shape) <= seats_limit

    seats = largest_that_fits(seats_fit, max(1, n), max(max_seqs_cap, n)) if n < max_seqs_cap else n

    stepping = BatchShape.build(decode_contexts=decodes)
    d = stepping.num_decodes

    def tokens_fit(k: int) -> bool:
        shape = replace(stepping)
        shape.add_chunk(0, k, sampled=True)
        return step_time(shape) <= max_step_s

    if d == 0:  # nothing decodes, so no stream waits on the step: the time limit does not apply, nor does this
        return seats, max_tokens_cap
    # at least one block: the least a prompt chunk gets (chunk_within_step_time's floor)
    tokens = largest_that_fits(tokens_fit, block_size, max(block_size, max_tokens_cap - d))
    return seats, min(max_tokens_cap, d + tokens)


def apply_auto_limits(sched: Scheduler) -> tuple[int, int]:
    """Set the scheduler's seats and/or token budget (whichever the config asked `auto` for) for the next step,
    from what runs now; returns (seats, budget). The scheduler holds its own copy of the config under auto."""
    cfg = sched.config
    contexts = [r.num_tokens for r in sched.running]  # each decode attends to its whole sequence
    decoding = [r.num_tokens for r in sched.running if r.is_decoding]
    prefilling = [r.num_tokens for r in sched.running if not r.is_decoding]
    head = sched.waiting.peek()
    if head is not None:
        new_context = head.num_tokens
    else:
        new_context = sum(contexts) // len(contexts) if contexts else sched.block_size
    target = cfg.max_step_ms / 1000.0
    ratio = sched.auto_ratio.value if sched.auto_ratio is not None else sched.step_time_scale
    seats, budget = auto_limits(sched.step_time, target / sched.step_time_scale, decoding, new_context,
                                sched.block_size, seats_step_s=target / ratio, prefill_contexts=prefilling)
    if cfg.auto_max_num_seqs:
        cfg.max_num_seqs = seats
    if cfg.auto_max_num_batched_tokens:
        cfg.max_num_batched_tokens = budget
    return seats, budget
