"""Batch-building policies: which tokens of which requests run in one step.

Each policy is an object called as policy(scheduler, step) that fills step.out through the scheduler's mechanics
(run_running, resume_swapped, admit_waiting), and keeps whatever it needs between steps on itself. The scheduler
makes one from POLICIES by config.policy.

Budgets of the policies that never chunk (prefill-first, orca, static): a prompt runs whole. The first prompt of a step
is taken even when it is longer than the tokens left, so a prompt longer than max_num_batched_tokens still
runs; every later prompt of the step must fit. A step therefore holds at most the budget, or one prompt
over it (alone under prefill-first; with the running decodes under orca and static).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from paceline.request import RequestStatus

if TYPE_CHECKING:
    from paceline.core.scheduler import Scheduler, Step

RUNNING = RequestStatus.RUNNING


def _split_running(sched: Scheduler) -> tuple[list, list]:
    decodes, prefills = [], []
    for r in sched.running:
        # a decode: the only token without KV is the last sampled one
        if r.num_tokens - r.num_computed_tokens == 1 and len(r.token_ids) > len(r.prompt_token_ids):
            decodes.append(r)
        else:
            prefills.append(r)
    return decodes, prefills


def _run_decodes(sched: Scheduler, step: Step, decodes: list) -> None:
    run = sched.run_running
    for r in decodes:
        if step.budget < 1:
            break
        if r.status is RUNNING:  # not taken as a victim by an earlier one
            run(step, r, 1)


def _resume_whole(sched: Scheduler, step: Step) -> None:
    def whole(r) -> int:
        left = r.num_tokens - r.num_computed_tokens
        return left if left <= step.budget else 0
    sched.resume_swapped(step, whole)


def _whole_prompt_chunker(step: Step, first: list[bool]):
    """Whole prompts only; the first of the step may be longer than the tokens left."""
    def whole(r, left: int) -> int:
        if first[0] or left <= step.budget:
            first[0] = False
            return left
        return 0
    return whole


def _run_whole_prompts(sched: Scheduler, step: Step, prompts: list, first: list[bool]) -> None:
    """Whole remaining prompts of running requests (static batch members, re-prefills)."""
    for r in prompts:
        if r.status is not RUNNING:
            continue
        left = r.num_tokens - r.num_computed_tokens
        if not (first[0] or left <= step.budget):
            break
        first[0] = False
        sched.run_running(step, r, left)


class Policy:
    """`wake_time`: when an idle step would schedule something with no new arrival (static waiting for its batch
    to fill); None when only an arrival can change it. The scheduler clears it before each call."""
    wake_time: float | None = None

    def __call__(self, sched: Scheduler, step: Step) -> None:
        raise NotImplementedError


class StallFree(Policy):
    """Sarathi-Serve's stall-free batching: every running decode, then swapped requests coming back, then the next
    chunks of prompts already being prefilled, then new prompts' chunks, until the token budget or max_num_seqs.
    Under max_step_ms each chunk is also cut to what the predicted step time allows: at deep context a prompt
    token costs several times a fresh one (its attention reads the whole prefix), which a token count ignores."""

    def __call__(self, sched: Scheduler, step: Step) -> None:
        cfg = sched.config
        cap = cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens
        fit = sched.chunk_within_step_time
        decodes, prefills = _split_running(sched)
        _run_decodes(sched, step, decodes)
        if (cfg.max_step_ms > 0 and not decodes and not sched.swapped
                and cfg.lone_prefill_tokens > step.max_tokens and not cfg.auto_max_num_batched_tokens):
            # no stream waits on this step (SchedulerConfig.lone_prefill_tokens): prompts run in bigger chunks
            step.max_tokens = cfg.lone_prefill_tokens
            cap = cfg.long_prefill_token_threshold or cfg.lone_prefill_tokens
        ranked = sched.fair is not None or sched.slicing
        if ranked:
            # prompts mid-prefill share what the step's time leaves in rank order, not admission order, and a
            # waiting prompt that ranks before some of them is admitted before they run: a light client's prompt
            # must not wait for a heavy client's chunks to use the step (under a step-time target, the time, not
            # the seat, is what runs out)
            prefills.sort(key=sched.rank)
        sched.resume_swapped(step, lambda r: fit(step, r, r.num_computed_tokens,
                                                 min(r.num_tokens - r.num_computed_tokens, step.budget, cap)))
        head = sched.waiting.peek() if ranked else None
        ahead = len(prefills) if head is None else sum(1 for r in prefills if sched.rank(r) < sched.rank(head))

        def run_prefills(rs: list) -> None:
            for r in rs:
                n = fit(step, r, r.num_computed_tokens, min(r.num_tokens - r.num_computed_tokens, step.budget, cap))
                if n <= 0:
                    break
                if r.status is RUNNING:
                    sched.run_running(step, r, n)

        run_prefills(prefills[:ahead])
        limit = cfg.max_num_partial_prefills
        # prompts mid-prefill (running, not yet decoding) may not exceed the limit
        in_prefill = [len(_split_running(sched)[1])] if limit else [0]

        def chunk(r, left: int) -> int:
            if limit and in_prefill[0] >= limit:
                return 0
            n = fit(step, r, r.num_tokens - left, min(left, step.budget, cap))
            if n > 0:
                in_prefill[0] += 1
            return n
        sched.admit_waiting(step, chunk)
        run_prefills(prefills[ahead:])


class PrefillFirst(Policy):
    """vLLM's original scheduler: when prompts wait and can be admitted, the step runs whole prompts alone;
    otherwise it runs every decode. No chunking, so a long prompt stalls every decode."""

    def __call__(self, sched: Scheduler, step: Step) -> None:
        waiting, swapped = sched.waiting, sched.swapped
        if waiting and (not swapped or sched.queued_before(waiting.peek(), swapped.peek(), step.now)):
            if sched.admit_waiting(step, _whole_prompt_chunker(step, [True])):
                return
        decodes, prefills = _split_running(sched)
        _run_decodes(sched, step, decodes)
        _run_whole_prompts(sched, step, prefills, [not step.out.scheduled])
        _resume_whole(sched, step)


class Orca(Policy):
    """Iteration-level batching without chunking: every decode, plus whole prompts while they fit."""

    def __call__(self, sched: Scheduler, step: Step) -> None:
        decodes, prefills = _split_running(sched)
        _run_decodes(sched, step, decodes)
        first = [True]
        _run_whole_prompts(sched, step, prefills, first)
        _resume_whole(sched, step)
        sched.admit_waiting(step, _whole_prompt_chunker(step, first))


class Static(Policy):
    """Request-level batching: a batch of up to max_num_seqs requests is formed only when the last one has
    finished, waiting at most max_batch_wait_ms for it to fill; then its members run until all are done.
    Members run like orca: decodes plus whole prompts while they fit the budget."""

    def __init__(self) -> None:
        self.members: list = []  # the current batch

    def __call__(self, sched: Scheduler, step: Step) -> None:
        cfg = sched.config
        members = self.members
        members[:] = [r for r in members if r.status is not RequestStatus.FINISHED]
        if not members:
            if not sched.waiting:
                return
            head = sched.waiting.peek()
            deadline = head.arrival_time + cfg.max_batch_wait_ms / 1000.0
            if len(sched.waiting) < cfg.max_num_seqs and step.now < deadline:
                self.wake_time = deadline
                return
            members.extend(sched.waiting.first(cfg.max_num_seqs))

        decodes, prefills = _split_running(sched)
        _run_decodes(sched, step, decodes)
        first = [True]
        _run_whole_prompts(sched, step, prefills, first)
        _resume_whole(sched, step)
        # members not started yet, or preempted by recompute, are admitted from the queue; nobody else is
        whole = _whole_prompt_chunker(step, first)
        for r in sorted((r for r in members if r.status is RequestStatus.WAITING), key=sched.rank):
            if not sched.admit(step, r, whole):
                break


POLICIES: dict[str, type[Policy]] = {"stall-free": StallFree, "prefill-first": PrefillFirst, "orca": Orca,
                                     "static": Static}
