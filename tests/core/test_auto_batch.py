"""`auto` batch settings (core/auto_batch.py): seats and token budget chosen before each step from a step-time
model and the step-time target, so the step the scheduler builds stays under the target as the load changes."""
from __future__ import annotations

import pytest

from sched_util import fake_result, make_request, make_scheduler, step

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


def run_measured(sched: Scheduler, steps: int, measured_over_predicted: float) -> list[tuple[int, int, float]]:
    """Steps whose measured time is the prediction times a fixed ratio; (running, waiting, measured s of a step
    that ran a decode, else 0) each."""
    seen = []
    for t in range(steps):
        out = sched.schedule(float(t))
        result = fake_result(out)
        result.duration = measured_over_predicted * out.predicted_step_s
        decoded = out.num_decode_tokens > 0  # before update(), which moves what counts as a decode
        sched.update(out, result, float(t))
        seen.append((len(sched.running), sched.num_waiting, result.duration if decoded else 0.0))
    return seen


def test_seats_follow_the_measured_steps_not_a_tail_scale_that_no_step_can_lower():
    # The real server's lock-in (2026-11-23, benchmarks/auto_batch_trace.py): host stalls pushed the engine's
    # 98th-percentile scale to 3.4; only steps that carry a prompt chunk move it, and with every seat the scale
    # allowed taken, none did. Here it is frozen at 3.4 while each step really takes 0.6x its prediction.
    def auto_scheduler() -> Scheduler:
        sched = Scheduler(SchedulerConfig(max_num_seqs="auto", max_num_batched_tokens="auto", max_step_ms=100.0),
                          CacheConfig(), 8000, step_time=toy_step_time)
        sched.step_time_scale = 3.4
        for i in range(200):
            sched.add_request(make_request(i, 16, max_tokens=300))
        return sched

    old = auto_scheduler()
    old.auto_ratio = None  # the rule before: seats judged by the tail scale
    locked = run_measured(old, 40, 0.6)
    # (100 / 3.4 - 10 - 3.2) ms / 1.016 ms = 15.96: 15 seats, taken in the first step; never one more, while
    # 185 wait on steps measured at ~15 ms against a 100 ms target
    assert {r for r, _, _ in locked} == {15} and locked[-1][1] == 185
    assert 0 < max(d for _, _, d in locked) < 0.016

    new = auto_scheduler()
    seen = run_measured(new, 40, 0.6)
    assert new.auto_ratio is not None and new.auto_ratio.value == pytest.approx(0.6)
    # the first step knows no ratio yet (the profile as it is: 85 seats, as in the test above); then the seats
    # follow what steps measure: (100 / 0.6 - 13.2) ms / 1.02 ms, about 150, a little fewer as contexts grow
    assert seen[0][0] == 85 and 145 <= new.config.max_num_seqs <= 151
    # the seats no longer bind: one request joins per step, paced by the one block of prompt the frozen scale
    # still allows beside the decodes (the chunk cutter's own tail bound, which the budget shares)
    assert [r for r, _, _ in seen[1:]] == list(range(85, 85 + 39))
    # and the steps still keep the target as measured (give or take a prompt's one-block floor)
    assert 0.080 < max(d for _, _, d in seen) <= 0.100 + 0.6 * 0.0002 * 16


def test_step_ratio_is_the_median_of_recent_decode_steps():
    from paceline.core.auto_batch import StepRatio
    from paceline.core.outputs import SchedulerOutput
    ratio = StepRatio(window=4)
    assert ratio.value == 1.0
    sched = make_scheduler(max_step_ms=100.0, step_time=toy_step_time)
    sched.add_request(make_request(0, 16, max_tokens=50))
    prompt_only = sched.schedule(0.0)
    ratio.observe(prompt_only, 9.0 * prompt_only.predicted_step_s)  # no decode in it: not a seat's business
    assert ratio.value == 1.0
    sched.update(prompt_only, fake_result(prompt_only), 0.0)
    decode = sched.schedule(1.0)
    for r in (0.5, 0.7, 40.0, 0.6, 0.8):  # one stall among them moves the median no more than any other step
        ratio.observe(decode, r * decode.predicted_step_s)
    assert ratio.value == pytest.approx(0.75)  # the last 4: 0.7, 40, 0.6, 0.8
    ratio.observe(SchedulerOutput(), 1.0)  # nothing predicted: ignored
    assert len(ratio.ratios) == 4


def test_a_prompt_mid_prefill_is_not_a_decode_for_the_budget():
    # a running request still in its prompt decodes nothing this step: it holds a seat, but takes no time from
    # the budget; with nothing decoding there is no time limit at all (as chunk_within_step_time has none)
    assert auto_limits(toy_step_time, 0.100, [], 100, 16, prefill_contexts=[3000])[1] == 8192
    assert auto_limits(toy_step_time, 0.100, [100], 100, 16, prefill_contexts=[3000])[1] == 1 + 444
    # the seats still count it as a decode to come: (90 - 3.2) ms less its 4 ms and the decode's 1.1 ms
    assert auto_limits(toy_step_time, 0.100, [100], 100, 16, prefill_contexts=[3000])[0] == \
        auto_limits(toy_step_time, 0.100, [100, 3000], 100, 16)[0]


def test_a_lone_long_prompt_finishes_in_one_step_once_the_decode_beside_it_ends():
    # long-prompt's shape: a 3,000-token prompt admitted beside another request's last decodes gets chunks the
    # step time allows; once that request ends, nothing decodes, so the rest runs at once (under the rule before,
    # the prompt counted as a decode and got ~430 tokens a step for 6 more steps)
    sched = Scheduler(SchedulerConfig(max_num_seqs="auto", max_num_batched_tokens="auto", max_step_ms=100.0),
                      CacheConfig(), 4000, step_time=toy_step_time)
    sched.add_request(make_request("short", 16, max_tokens=3))
    step(sched, 0.0)  # its prompt, alone: the cap
    sched.add_request(make_request("long", 3000, max_tokens=4))
    shapes = [step(sched, t).shape for t in (1.0, 2.0, 3.0, 4.0)]
    # beside "short"'s two remaining decodes the long prompt gets what fits 100 ms, then all that is left
    assert shapes[0][0] == 1 and 0 < shapes[0][1] < 500 and shapes[1][0] == 1 and 0 < shapes[1][1] < 500
    assert shapes[2] == (0, 3000 - shapes[0][1] - shapes[1][1])
    assert shapes[3] == (1, 0) and sched.get_request("long").num_output_tokens == 2
