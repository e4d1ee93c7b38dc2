"""The short step target (short_step_ms): a chunk whose prompt costs more per token it can bring than a decode
costs now is held to it; prompts that pay for the time keep max_step_ms."""
from __future__ import annotations

import pytest

from sched_util import make_request, make_scheduler, step

from paceline.config import DEFAULT_TBT_GOAL_MS, SHORT_STEP_FRACTION, EngineConfig, SchedulerConfig, step_target_ms
from paceline.core.batch_shape import BatchShape


def linear_model(s: BatchShape) -> float:
    """10 ms a step, 1 ms a prompt token, 1 us a causal query-key pair, 2 ms a decode (+ 1 us of context)."""
    return 0.010 + 0.001 * s.num_prefill_tokens + 1e-6 * s.prefill_attn_pairs + 0.002 * s.num_decodes \
        + 1e-6 * s.decode_context


def streams(sched, n: int, max_tokens: int = 400) -> float:
    """n requests of 8 prompt tokens stepped until all decode; returns the clock."""
    for i in range(n):
        sched.add_request(make_request(f"d{i}", 8, max_tokens=max_tokens))
    t = 1.0
    while sched.num_waiting or not all(r.is_decoding for r in sched.running):
        t += 1
        step(sched, t)
    return t


def chunks_of(sched, rid: str, t: float, steps: int) -> list[tuple[int, float]]:
    """(chunk tokens, predicted step seconds) of `rid` over the next steps."""
    got = []
    for _ in range(steps):
        t += 1
        v = step(sched, t)
        got.append((dict(v.batch).get(rid, 0), v.out.predicted_step_s))
    return got


def scheduler(short_step_ms: float):
    return make_scheduler("stall-free", budget=512, step_time=linear_model, max_step_ms=150,
                          short_step_ms=short_step_ms)


def test_a_long_prompt_with_little_output_beside_streams_gets_the_short_target() -> None:
    # 6 decodes cost 10 + 12 ms = 22 ms, 3.7 ms a token; the rest of a 1,500-token prompt costs ~2.6 s for one token
    sched = scheduler(75)
    t = streams(sched, 6)
    sched.add_request(make_request("long", 1500, max_tokens=1, arrival=t))
    got = chunks_of(sched, "long", t, 5)
    assert all(0 < n for n, _ in got)
    assert all(pred <= 0.075 + 1e-12 for _, pred in got), got
    # each chunk the largest under 75 ms: one token more would not fit
    # 22.1 ms of decodes + 51 x 1 ms + 1.3 ms of pairs = 74.4 ms; with 52 tokens 75.4 ms
    assert got[0][0] == 51
    off = scheduler(0)  # the rule off: the same prompt fills the full target
    t = streams(off, 6)
    off.add_request(make_request("long", 1500, max_tokens=1, arrival=t))
    full = chunks_of(off, "long", t, 5)
    assert all(pred <= 0.150 + 1e-12 for _, pred in full) and max(pred for _, pred in full) > 0.140
    assert full[0][0] > 2 * got[0][0]


def test_short_prompts_that_will_decode_for_a_while_keep_the_full_target() -> None:
    # 32 waiting prompts of 100 tokens, 64 tokens out each: ~0.11 s of prefill for 64 tokens (1.7 ms a token)
    # against 3.7 ms a decode token now: worth a full step
    sched = scheduler(75)
    t = streams(sched, 6)
    for i in range(32):
        sched.add_request(make_request(f"p{i}", 100, max_tokens=64, arrival=t))
    t += 1
    v = step(sched, t)
    assert v.shape[1] > 100 and 0.140 < v.out.predicted_step_s <= 0.150 + 1e-12


def test_the_rule_weighs_what_is_left_of_the_prompt_and_of_its_output() -> None:
    # the same 600-token prompt: with 1 token to come it is held short; with 1,000 tokens to come it pays
    for max_tokens, limit in ((1, 0.075), (1000, 0.150)):
        sched = scheduler(75)
        t = streams(sched, 6)
        sched.add_request(make_request("p", 600, max_tokens=max_tokens, arrival=t))
        n, pred = chunks_of(sched, "p", t, 1)[0]
        assert limit - 0.01 < pred <= limit + 1e-12, (max_tokens, n, pred)


def test_no_decode_means_no_time_limit_and_a_short_target_above_the_full_one_is_ignored() -> None:
    sched = scheduler(75)
    sched.add_request(make_request("long", 1500, max_tokens=1))
    assert step(sched, 1.0).batch == [("long", 512)]  # a step without decodes: the token budget only
    big = scheduler(300)  # not shorter than max_step_ms: max_step_ms
    t = streams(big, 6)
    big.add_request(make_request("long", 1500, max_tokens=1, arrival=t))
    assert chunks_of(big, "long", t, 1)[0][1] <= 0.150 + 1e-12


def test_the_serving_default_derives_the_short_target_and_a_named_target_stays_exact() -> None:
    full = step_target_ms(DEFAULT_TBT_GOAL_MS)
    assert EngineConfig().scheduler.short_step_ms == full * SHORT_STEP_FRACTION < full
    assert EngineConfig(tbt_goal_ms=100).scheduler.short_step_ms == step_target_ms(100) * SHORT_STEP_FRACTION
    # --max-step-ms by name bounds every chunk alike, as before; short_step_ms by name is kept; no goal, no target
    assert EngineConfig(scheduler=SchedulerConfig(max_step_ms=150)).scheduler.short_step_ms == 0
    assert EngineConfig(scheduler=SchedulerConfig(short_step_ms=60)).scheduler.short_step_ms == 60
    assert EngineConfig(scheduler=SchedulerConfig(short_step_ms=0)).scheduler.short_step_ms == 0
    assert EngineConfig(tbt_goal_ms=0).scheduler.short_step_ms == 0
    assert SchedulerConfig().short_step_ms == 0
    with pytest.raises(ValueError, match="short_step_ms"):
        SchedulerConfig(short_step_ms=-1)


def test_stats_describe_the_last_step_for_the_step_log() -> None:
    # the step log records stats() after each step: the chunk's depth, the decodes' context, the target and scale
    sched = scheduler(75)
    t = streams(sched, 6)
    sched.step_time_scale = 1.25
    sched.add_request(make_request("long", 1500, max_tokens=1, arrival=t))
    v = step(sched, t + 1)
    n = dict(v.batch)["long"]
    st = sched.stats()
    assert st.last_step_context == n  # one chunk from 0: the depth it ends at
    assert st.last_step_decode_context == sum(len(r.token_ids) - 1 for r in sched.running if r.request_id != "long")
    assert st.last_step_target_ms == 75 and st.last_step_scale == 1.25
    v = step(sched, t + 2)
    assert sched.stats().last_step_context == n + dict(v.batch)["long"]
    # a step with no chunk sized (decodes only): no target
    while "long" in sched.requests:
        t += 1
        step(sched, t + 2)
    step(sched, t + 3)
    assert sched.stats().last_step_target_ms == 0 and sched.stats().last_step_context == 0
    plain = make_scheduler("stall-free")  # no max_step_ms: nothing to report
    plain.add_request(make_request("a", 8))
    step(plain, 1.0)
    assert plain.stats().last_step_context == 0 and plain.stats().last_step_scale == 0


def test_a_step_with_prompts_queued_is_sized_by_the_queued_scale() -> None:
    # the engine keeps two quantiles of measured / predicted step time; with a queue the lower one sizes the step
    def first_step(n_prompts: int, max_tokens: int) -> float:
        sched = scheduler(75)
        t = streams(sched, 6)
        sched.step_time_scale, sched.queued_step_time_scale = 1.5, 1.0
        for i in range(n_prompts):
            sched.add_request(make_request(f"p{i}", 600, max_tokens=max_tokens, arrival=t))
        return step(sched, t + 1).out.predicted_step_s  # the model's own prediction, before any scale

    queued = first_step(3, 1000)
    assert 0.140 < queued <= 0.150 + 1e-12  # 150 ms / 1.0
    alone = first_step(1, 1000)
    assert 0.090 < alone <= 0.100 + 1e-12  # alone: 150 ms / 1.5 (no calm target in this scheduler)
