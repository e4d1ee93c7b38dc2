"""The calm step target (calm_step_ms): a chunk worth a full step is held to it when no other prompt is queued
behind it (waiting, swapped or mid-prefill); with others queued it keeps max_step_ms."""
from __future__ import annotations

import pytest

from sched_util import make_request, make_scheduler, step
from test_short_step_target import chunks_of, linear_model, streams

from paceline.config import (CALM_STEP_FRACTION, DEFAULT_TBT_GOAL_MS, LONE_PREFILL_TOKENS, EngineConfig,
                             SchedulerConfig, step_target_ms)


def scheduler(calm_step_ms: float, short_step_ms: float = 45):
    return make_scheduler("stall-free", budget=512, step_time=linear_model, max_step_ms=150,
                          short_step_ms=short_step_ms, calm_step_ms=calm_step_ms)


def test_a_prompt_alone_in_the_queue_gets_the_calm_target_and_one_with_others_behind_it_the_full_one() -> None:
    # 600 prompt tokens, 1,000 to come: worth a full step (test_short_step_target's rule) beside 6 streams
    sched = scheduler(90)
    t = streams(sched, 6)
    sched.add_request(make_request("p", 600, max_tokens=1000, arrival=t))
    got = chunks_of(sched, "p", t, 3)
    assert all(0.080 < pred <= 0.090 + 1e-12 for _, pred in got), got
    # the same prompt with a second one waiting behind it: the full target
    sched = scheduler(90)
    t = streams(sched, 6)
    sched.add_request(make_request("p", 600, max_tokens=1000, arrival=t))
    sched.add_request(make_request("q", 600, max_tokens=1000, arrival=t + 0.5))
    n, pred = chunks_of(sched, "p", t, 1)[0]
    assert 0.140 < pred <= 0.150 + 1e-12 and n > 100, (n, pred)


def test_the_last_prompt_of_a_burst_falls_to_the_calm_target_once_the_others_are_in() -> None:
    sched = scheduler(90)
    t = streams(sched, 6)
    for i in range(3):
        sched.add_request(make_request(f"p{i}", 200, max_tokens=500, arrival=t))
    preds, alone = [], []
    while any(not r.is_decoding for r in sched.running) or sched.num_waiting:
        queued = sched.num_waiting + sum(1 for r in sched.running if not r.is_decoding)
        t += 1
        v = step(sched, t)
        (alone if queued == 1 else preds).append(v.out.predicted_step_s)
    assert preds and max(preds) > 0.140  # two or three prompts queued: full steps
    assert alone and max(alone) <= 0.090 + 1e-12  # the last one alone: calm steps


def test_a_chunk_not_worth_a_step_stays_short_and_no_calm_target_means_the_full_one() -> None:
    sched = scheduler(90)  # 1,500 tokens for one token out: the short target wins over the calm one
    t = streams(sched, 6)
    sched.add_request(make_request("long", 1500, max_tokens=1, arrival=t))
    assert all(pred <= 0.045 + 1e-12 for _, pred in chunks_of(sched, "long", t, 3))
    for calm in (0, 150, 400):  # off, or not below max_step_ms: max_step_ms
        sched = scheduler(calm)
        t = streams(sched, 6)
        sched.add_request(make_request("p", 600, max_tokens=1000, arrival=t))
        assert 0.140 < chunks_of(sched, "p", t, 1)[0][1] <= 0.150 + 1e-12, calm


def test_no_decode_means_no_time_limit_even_alone() -> None:
    sched = scheduler(90)
    sched.add_request(make_request("p", 1500, max_tokens=1000))
    assert step(sched, 1.0).batch == [("p", 512)]


def lone(tokens: int):
    return make_scheduler("stall-free", budget=512, step_time=linear_model, max_step_ms=150, calm_step_ms=90,
                          lone_prefill_tokens=tokens)


def test_a_step_no_stream_waits_on_takes_the_lone_budget() -> None:
    for tokens, chunk in ((2048, 1500), (1024, 1024), (0, 512)):
        sched = lone(tokens)
        sched.add_request(make_request("p", 1500, max_tokens=1000))
        assert step(sched, 1.0).batch == [("p", chunk)]


def test_the_lone_budget_ends_once_a_stream_runs() -> None:
    sched = lone(2048)
    sched.add_request(make_request("a", 40, max_tokens=50))
    step(sched, 1.0)  # "a" prefilled whole: a stream from now on
    sched.add_request(make_request("p", 3000, max_tokens=10))
    chunk = dict(step(sched, 1.1).batch)
    assert chunk["a"] == 1 and chunk["p"] <= 512  # the step budget and the step-time target again


def test_the_serving_default_derives_the_lone_budget_and_a_named_one_is_kept() -> None:
    assert EngineConfig().scheduler.lone_prefill_tokens == LONE_PREFILL_TOKENS
    assert SchedulerConfig().lone_prefill_tokens == 0  # a scheduler alone: off
    big = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=4096)).scheduler
    assert big.lone_prefill_tokens == 4096  # never below the step budget
    assert EngineConfig(scheduler=SchedulerConfig(lone_prefill_tokens=0)).scheduler.lone_prefill_tokens == 0
    assert EngineConfig(tbt_goal_ms=0).scheduler.lone_prefill_tokens == 0
    with pytest.raises(ValueError, match="lone_prefill_tokens"):
        SchedulerConfig(lone_prefill_tokens=-1)


def test_the_serving_default_derives_the_calm_target_and_a_named_one_is_kept() -> None:
    full = step_target_ms(DEFAULT_TBT_GOAL_MS)
    assert EngineConfig().scheduler.calm_step_ms == full * CALM_STEP_FRACTION
    assert EngineConfig().scheduler.short_step_ms < EngineConfig().scheduler.calm_step_ms < full
    assert EngineConfig(scheduler=SchedulerConfig(calm_step_ms=0)).scheduler.calm_step_ms == 0
    assert EngineConfig(scheduler=SchedulerConfig(calm_step_ms=80)).scheduler.calm_step_ms == 80
    assert EngineConfig(scheduler=SchedulerConfig(max_step_ms=150)).scheduler.calm_step_ms == 0
    assert EngineConfig(tbt_goal_ms=0).scheduler.calm_step_ms == 0
    with pytest.raises(ValueError, match="calm_step_ms"):
        SchedulerConfig(calm_step_ms=-1)
