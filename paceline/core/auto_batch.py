"""Batch settings that follow the load (`--max-num-seqs auto`, `--max-num-batched-tokens auto`): before each
step the scheduler asks `auto_limits` how many requests may hold a seat and how many tokens the step may take,
from the step-time model and the step-time target (max_step_ms, which the engine derives from the TBT goal).

- Seats: as many as keep a step of every running request's decode, plus the decodes of the newcomers, plus one
  block of prompt (the least a prompt chunk gets), under the target. While steps are far under it (short
  contexts, a light load) that is many; as contexts grow it shrinks, so the TBT goal holds without a hand-picked
  number. Seats only gate admission: a running request is never cut for them (the count falls as requests end).
- Token budget: the running decodes plus the most fresh prompt tokens one step can add under the target (at
  least one block); with nothing running, the cap (a step without decodes has no time limit either). The stall-free scheduler then cuts each chunk to the time left (chunk_within_step_time); the
  budget no longer stops a step that the time would allow, nor lets one run past it.

A fixed setting is right for one load; these follow the batch actually running. Both stay within [floor, cap]:
the floor keeps a slow machine serving (one request, one block), the cap bounds the bisection.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterable

from paceline.config import AUTO_MAX_NUM_BATCHED_TOKENS, AUTO_MAX_NUM_SEQS
from paceline.core.batch_shape import BatchShape

if TYPE_CHECKING:
    from paceline.core.scheduler import Scheduler


def _largest(fits: Callable[[int], bool], lo: int, hi: int) -> int:
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
                max_tokens_cap: int = AUTO_MAX_NUM_BATCHED_TOKENS) -> tuple[int, int]:
    """(seats, token budget) for the next step.

    decode_contexts: the context each running request's next token attends to; new_context: what a newcomer's is
    assumed to be (the waiting head's prompt, or the running requests' mean)."""
    running = BatchShape.build(decode_contexts=decode_contexts)
    n = running.num_decodes

    def seats_fit(k: int) -> bool:
        shape = replace(running)
        extra = k - n  # k - n newcomers' decodes, as add_decode would count them
        shape.num_decodes += extra
        shape.num_requests += extra
        shape.num_sampled += extra
        shape.decode_context += extra * new_context
        shape.add_chunk(0, block_size, sampled=False)
        return step_time(shape) <= max_step_s

    seats = _largest(seats_fit, max(1, n), max(max_seqs_cap, n)) if n < max_seqs_cap else n

    def tokens_fit(k: int) -> bool:
        shape = replace(running)
        shape.add_chunk(0, k, sampled=True)
        return step_time(shape) <= max_step_s

    if n == 0:  # nothing runs, so no stream waits on the step: the time limit does not apply, nor does this
        return seats, max_tokens_cap
    # at least one block: the least a prompt chunk gets (chunk_within_step_time's floor)
    tokens = _largest(tokens_fit, block_size, max(block_size, max_tokens_cap - n))
    return seats, min(max_tokens_cap, n + tokens)


def apply_auto_limits(sched: Scheduler) -> tuple[int, int]:
    """Set the scheduler's seats and/or token budget (whichever the config asked `auto` for) for the next step,
    from what runs now; returns (seats, budget). The scheduler holds its own copy of the config under auto."""
    cfg = sched.config
    contexts = [r.num_tokens for r in sched.running]  # each decode attends to its whole sequence
    head = sched.waiting.peek()
    if head is not None:
        new_context = head.num_tokens
    else:
        new_context = sum(contexts) // len(contexts) if contexts else sched.block_size
    limit = cfg.max_step_ms / 1000.0 / sched.step_time_scale
    seats, budget = auto_limits(sched.step_time, limit, contexts, new_context, sched.block_size)
    if cfg.auto_max_num_seqs:
        cfg.max_num_seqs = seats
    if cfg.auto_max_num_batched_tokens:
        cfg.max_num_batched_tokens = budget
    return seats, budget
