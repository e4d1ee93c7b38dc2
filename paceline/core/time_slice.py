"""Time slices (`--time-slice-tokens N`, `--time-slice-ms MS`): a decoding request that has used its slice since
it was last admitted yields its seat to queued work, through the scheduler's own preemption (swap or recompute),
and is demoted one level, like a multi-level feedback queue (FastServe's skip-join MLFQ preempts the same way).

- A slice counts a request's output tokens (or time) since it was last admitted or swapped in; a prompt being
  prefilled is never cut by a slice. Level L's slice is 2**L times the first: a long generation is preempted
  about log2(length / slice) times, not length / slice times.
- Only queued work that would not get a seat otherwise takes one this way: with free seats nothing is cut.
- Under `fair`, a less-served client's request needs only the victim's first slice used (see
  preempt_used_slices): the light client does not wait for a heavy client's doubled slices.
- Hysteresis: a queued request takes a victim's seat only if it ranks strictly before the victim *after* the
  victim's demotion (its priority first, then under `fair` its client's counter, then the level, then the
  arrival), so two requests at one level do not trade places every step, and a victim must have run its whole
  slice since it was last resumed (the slice is also the minimum residency).
- Level aging (`--level-aging-s`): a demoted request queues as if it had arrived L * level_aging_s after its
  demotion to level L (queues.py), so under sustained load it gets its seat back within a bound instead of
  waiting behind every fresh request.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from paceline.request import Request

if TYPE_CHECKING:
    from paceline.core.scheduler import Scheduler, Step


def slice_used(sched: Scheduler, r: Request, now: float, doubled: bool = True) -> bool:
    """Whether r has run its slice since it was last admitted: level L's (2**L times the first) when `doubled`,
    else the first one (the minimum residency)."""
    cfg = sched.config
    scale = 1 << min(r.slice_level, 30) if doubled else 1
    if cfg.time_slice_tokens and r.num_output_tokens - r.slice_mark >= cfg.time_slice_tokens * scale:
        return True
    return bool(cfg.time_slice_ms) and (now - r.slice_since) * 1e3 >= cfg.time_slice_ms * scale


def _rank_demoted(sched: Scheduler, r: Request, now: float) -> tuple:
    since = r.slice_since
    _demote(r, now)
    try:
        return sched.rank(r)
    finally:
        r.slice_level -= 1
        r.slice_since = since


def _demote(r: Request, now: float) -> None:
    """One level down; under level aging the demotion time is what its queue key counts from (queues.py).
    slice_since is free for that while the request is queued: admission sets it again."""
    r.slice_level += 1
    r.slice_since = now


def preempt_used_slices(sched: Scheduler, step: Step) -> int:
    """At the start of a step: preempt (and demote) running requests whose slice is used, one for each queued
    request that ranks before it and would find no free seat. Returns how many were preempted.

    Under `fair`, a queued request of a less-served client than the victim's (at the same priority) needs only
    the victim's first slice to be used, not its level's: the doubling keeps one client's long generations from
    trading seats too often, but it must not make a light client wait for a heavy client's long slices (the
    counters bound that churn instead: a client served now is soon no longer the less served)."""
    fair = sched.fair
    resident = [r for r in sched.running if r.is_decoding and slice_used(sched, r, step.now, doubled=fair is None)]
    if not resident:
        return 0
    free_seats = max(0, sched.config.max_num_seqs - len(sched.running))
    k = len(resident) + free_seats
    rank = sched.rank
    queued = sorted(sched.waiting.first(k) + sched.swapped.first(k), key=rank)[free_seats:k]
    # (rank after demotion, rank now, whether its level's slice is used, request)
    victims = [(_rank_demoted(sched, r, step.now), rank(r), fair is None or slice_used(sched, r, step.now), r) for r in resident]
    preempted = 0
    for q in queued:
        q_rank = rank(q)
        beaten = [v for v in victims if q_rank < v[0] and (v[2] or _less_served(sched, q, v[3]))]
        if not beaten:
            break  # the later queued requests rank no better
        victim = max(beaten, key=lambda v: v[1])  # the worst-ranked: under fair, the most-served client's
        victims.remove(victim)
        r = victim[3]
        _demote(r, step.now)
        sched.preempt(step, r)
        preempted += 1
    sched.num_slice_preemptions += preempted
    return preempted


def _less_served(sched: Scheduler, q: Request, victim: Request) -> bool:
    counters = sched.fair.counters
    return (q.priority == victim.priority and q.client_id != victim.client_id
            and counters.get(q.client_id, 0.0) < counters.get(victim.client_id, 0.0))
