"""`auto` batch settings (core/auto_batch.py): seats and token budget chosen before each step from a step-time
model and the step-time target, so the step the scheduler builds stays under the target as the load changes."""
from __future__ import annotations

import pytest

from sched_util import make_request, make_scheduler, step

from paceline.config import AUTO_MAX_NUM_BATCHED_TOKENS, AUTO_MAX_NUM_SEQS, CacheConfig, SchedulerConfig, int_or_auto
from paceline.core.auto_batch import auto_limits
from paceline.core.batch_shape import BatchShape
from paceline.core.scheduler import Scheduler


def toy_step_time(s: BatchShape) -> float:
    """10 ms a step, 1 ms a decode plus 1 us per token of its context, 0.2 ms a prompt token."""
    return 0.010 + 0.001 * s.num_decodes + 1e-6 * s.decode_context + 0.0002 * s.num_prefill_tokens


def test_seats_follow_the_context_and_the_budget_what_the_decodes_leave():
    # nothing running, short prompts: (100 ms - 10 ms - one 16-token block's 3.2 ms) / 1.1 ms = 78 seats
    seats, budget = auto_limits(toy_step_time, 0.100, [], 100, 16)
    assert seats == 78
    assert budget == 8192  # nothing runs: no stream waits on the step, so the cap, not the time
    assert auto_limits(toy_step_time, 0.100, [100], 100, 16)[1] == 1 + 444  # (100 - 10 - 1.1) ms / 0.2 ms
    # long contexts cost more per decode: fewer seats
    long_seats, _ = auto_limits(toy_step_time, 0.100, [], 4000, 16)
    assert long_seats == 17  # (100 - 10 - 3.2) / (1 + 4) ms
    # 40 decodes running at context 500: 10 + 40 * 1.5 = 70 ms, so 30 ms (150 tokens) of prompt
    seats, budget = auto_limits(toy_step_time, 0.100, [500] * 40, 500, 16)
    assert budget == 40 + 150 and seats == 40 + 17  # (100 - 70 - 3.2) / 1.5 = 17.9 newcomers
    # over the target already: no newcomer, and a prompt still gets its one block (it must progress)
    seats, budget = auto_limits(toy_step_time, 0.100, [1000] * 60, 1000, 16)
    assert seats == 60 and budget == 60 + 16
    # a target nothing fits: one seat (and one block beside a running decode)
    assert auto_limits(toy_step_time, 0.001, [], 100, 16)[0] == 1
    assert auto_limits(toy_step_time, 0.001, [100], 100, 16) == (1, 1 + 16)
    # a cheap machine: the caps
    assert auto_limits(lambda s: 0.0, 0.100, [], 100, 16) == (AUTO_MAX_NUM_SEQS, 8192)


def test_the_scheduler_admits_while_the_target_allows_and_keeps_the_callers_config():
    cfg = SchedulerConfig(max_num_seqs="auto", max_num_batched_tokens="auto", max_step_ms=100.0)
    assert cfg.auto_max_num_seqs and cfg.auto_max_num_batched_tokens and cfg.max_num_seqs == AUTO_MAX_NUM_SEQS
    sched = Scheduler(cfg, CacheConfig(), 4000, step_time=toy_step_time)
    for i in range(150):
        sched.add_request(make_request(i, 16, max_tokens=200))
    running = []
    for t in range(60):
        v = step(sched, float(t))
        running.append(len(sched.running))
        # every step with decodes stays under the target (give or take the one-block floor of a prompt chunk);
        # the first, with none, is bounded by the budget alone
        if v.shape[0]:
            assert v.out.predicted_step_s <= 0.100 + 0.0002 * 16
    # seats up to what decodes at 16 tokens of context allow: (90 - 3.2) ms / 1.016 ms = 85 (admitted in the
    # first step, whose prompts have no decode to wait on them); not the 150 waiting, not the 256 cap. They
    # stay taken as contexts grow: seats gate admission, never cut a running request
    assert running[0] == max(running) == running[-1] == 85
    assert v.shape == (85, 0) and sched.num_waiting == 150 - 85
    # the scheduler's limits moved; the config it was given did not
    assert cfg.max_num_seqs == AUTO_MAX_NUM_SEQS and cfg.max_num_batched_tokens == AUTO_MAX_NUM_BATCHED_TOKENS
    # only what was asked for is automatic
    fixed_budget = make_scheduler(max_seqs="auto", budget=64, max_step_ms=100.0, step_time=toy_step_time)
    step(fixed_budget, 0.0)
    assert fixed_budget.config.max_num_batched_tokens == 64 and fixed_budget.config.max_num_seqs < AUTO_MAX_NUM_SEQS


def test_auto_needs_a_step_time_target_and_the_stall_free_scheduler():
    with pytest.raises(ValueError, match="step-time target"):
        make_scheduler(max_seqs="auto")
    with pytest.raises(ValueError, match="stall-free"):
        SchedulerConfig(policy="orca", max_num_seqs="auto")
    assert int_or_auto("auto") == "auto" and int_or_auto("12") == 12
    with pytest.raises(ValueError):
        int_or_auto("many")
