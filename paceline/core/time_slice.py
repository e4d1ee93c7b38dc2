"""Time slices (`--time-slice-tokens N`, `--time-slice-ms MS`): a decoding request that has used its slice since
it was last admitted yields its seat to queued work, through the scheduler's own preemption (swap or recompute).

- A slice counts a request's output tokens (or time) since it was last admitted or swapped in, and ends only once
  the request has made a token in it (a re-prefill after recompute makes none); a prompt being
  prefilled is never cut by a slice. Only queued work that would not get a seat otherwise takes one this way:
  with free seats nothing is cut, however long the queue (what holds it then is memory or the token budget).
- With fcfs or priority order the slices are a multi-level feedback queue between all requests (FastServe's
  skip-join MLFQ preempts the same way): a cut request is demoted one level, and level L's slice is 2**L times
  the first, so a long generation is preempted about log2(length / slice) times, not length / slice times.
  Hysteresis: a queued request takes a victim's seat only if it ranks strictly before the victim *after* the
  victim's demotion, so two requests at one level do not trade places every step.
- Under `fair` the slices serve the shares between clients, not an MLFQ: only a request of a less-served client
  (at the victim's priority) or of a higher priority takes a seat this way, once the victim has run its first
  slice (the minimum residency), and the victim is not demoted. One client's requests never cut one another: such
  a cut moves nothing between clients but costs a swap or a recompute, and a demoted victim let the client's
  fresh requests (a prompt to prefill each) pass its already computed context. See preempt_used_slices.
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
    if r.num_output_tokens <= r.slice_mark:
        # no token yet in this residency (a recomputed request's re-prefill makes none): cut now, it would lose
        # that work and could come back only to be cut the same way, two clients trading a seat forever (the state
        # machine found it: fair, recompute, one seat, ms slices no longer than the re-prefill)
        return False
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
    """At the start of a step: preempt running requests whose slice is used, one for each queued request that
    ranks before it and would find no free seat. Returns how many were preempted.

    Under `fair` the victim must be owed to the queued request (`_owed`) and has run only its first slice; a less-
    served client does not wait for a heavy client's long slices, and the counters bound the churn instead (a
    client served now is soon no longer the less served). In the simulated two-tenants run (300 s, this machine's
    int4 speed, recompute) the cuts within one client that the MLFQ made were two thirds of all preemptions and
    cost 1.7 % of the output tokens; demoting the victims cost more in a 40 s window (fresh prompts of the heavy
    client passed its swapped-out decodes): benchmarks/summaries/fairness.md."""
    if len(sched.running) < sched.config.max_num_seqs:
        # a free seat: the queue, if any, is held by memory or the token budget, not seats, and a cut would free a
        # seat nobody lacks and the victim's progress (the state machine found recompute thrash that way: 4 free
        # seats, 7 queued, a request one token from its end cut for the 5th, which got no KV anyway)
        return 0
    fair = sched.fair
    resident = [r for r in sched.running if r.is_decoding and slice_used(sched, r, step.now, doubled=fair is None)]
    if not resident:
        return 0
    k = len(resident)
    rank = sched.rank
    queued = sorted(sched.waiting.first(k) + sched.swapped.first(k), key=rank)[:k]
    # (the rank a queued request must beat, the victim's rank now, request); under fair no demotion, and _owed
    # implies the queued request ranks first (a higher priority, or the same and a lower counter)
    victims = [(rank(r) if fair is not None else _rank_demoted(sched, r, step.now), rank(r), r) for r in resident]
    preempted = 0
    for q in queued:
        q_rank = rank(q)
        beaten = [v for v in victims if q_rank < v[0] and (fair is None or _owed(sched, q, v[2]))]
        if not beaten:
            break  # the later queued requests rank no better (under fair: no higher priority, no lower counter)
        victim = max(beaten, key=lambda v: v[1])  # the worst-ranked: under fair, the most-served client's
        victims.remove(victim)
        r = victim[2]
        if fair is None:
            _demote(r, step.now)
        sched.preempt(step, r)
        preempted += 1
    sched.num_slice_preemptions += preempted
    return preempted


def _owed(sched: Scheduler, q: Request, victim: Request) -> bool:
    """Under fair: whether queued q may take victim's seat by a slice: a higher priority, or a less-served client."""
    return q.priority < victim.priority or _less_served(sched, q, victim)


def _less_served(sched: Scheduler, q: Request, victim: Request) -> bool:
    counters = sched.fair.counters
    return (q.priority == victim.priority and q.client_id != victim.client_id
            and counters.get(q.client_id, 0.0) < counters.get(victim.client_id, 0.0))
