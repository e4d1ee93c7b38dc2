"""stall-free under max_step_ms: prompt chunks cut to what a step-time model allows."""
from __future__ import annotations

import pytest

from sched_util import make_request, make_scheduler, step

from paceline.core.batch_shape import BatchShape


def linear_model(s: BatchShape) -> float:
    """10 ms a step, 1 ms a prompt token, 1 us a causal query-key pair, 2 ms a decode (+ 1 us of context)."""
    return 0.010 + 0.001 * s.num_prefill_tokens + 1e-6 * s.prefill_attn_pairs + 0.002 * s.num_decodes \
        + 1e-6 * s.decode_context


def chunk_cost(start: int, k: int) -> float:
    return 0.001 * k + 1e-6 * (k * start + k * (k + 1) / 2)


def decoding(sched, n: int, prompt: int, max_tokens: int) -> float:
    """n requests stepped until all are past their prompts; returns the clock."""
    for i in range(n):
        sched.add_request(make_request(f"d{i}", prompt, max_tokens=max_tokens))
    t = 1.0
    while sched.num_waiting or not all(r.is_decoding for r in sched.running):
        t += 1
        step(sched, t)
    return t


def test_chunks_shrink_with_depth_and_each_is_the_largest_that_fits() -> None:
    sched = make_scheduler("stall-free", budget=512, step_time=linear_model, max_step_ms=150)
    t = decoding(sched, 4, prompt=8, max_tokens=400)
    sched.add_request(make_request("long", 3000, max_tokens=2, arrival=t))
    chunks = []
    while sched.get_request("long").num_output_tokens == 0:
        t += 1
        before = sched.get_request("long").num_computed_tokens
        v = step(sched, t)
        assert v.decodes[:4] == [True] * 4
        n = dict(v.batch)["long"]
        assert v.out.predicted_step_s == pytest.approx(linear_model(_shape(v)))
        assert v.out.predicted_step_s <= 0.150 + 1e-12
        if before + n < 3000:  # not the last chunk: one more token would have broken the limit
            decodes = [s for s, d in zip(v.out.scheduled, v.decodes) if d]
            base = 0.010 + sum(0.002 + 1e-6 * (s.start + 1) for s in decodes)
            assert base + chunk_cost(before, n + 1) > 0.150
        chunks.append(n)
    assert sum(chunks) == 3000
    assert chunks[0] > 2 * chunks[-2], chunks  # deep chunks pay for attention over the whole prefix
    assert chunks == sorted(chunks, reverse=True)[:len(chunks) - 1] + chunks[-1:]


def _shape(v) -> BatchShape:
    s = BatchShape()
    for item, decode in zip(v.out.scheduled, v.decodes):  # as scheduled: update() has appended tokens since
        if decode:
            s.add_decode(item.start + 1)
        else:
            s.add_chunk(item.start, item.num_tokens, sampled=False)
    return s


def test_a_prompt_still_moves_when_the_decodes_alone_fill_the_time() -> None:
    sched = make_scheduler("stall-free", budget=512, step_time=linear_model, max_step_ms=20)
    t = decoding(sched, 8, prompt=4, max_tokens=300)  # 10 + 8 * 2 ms > 20 ms before any prompt token
    sched.add_request(make_request("p", 100, max_tokens=2, arrival=t))
    sizes = []
    while sched.get_request("p").num_output_tokens == 0:
        t += 1
        sizes.append(dict(step(sched, t).batch)["p"])
    assert sizes == [16] * 6 + [4]  # one block's worth per step, never starved


def test_measured_over_predicted_scale_tightens_the_chunks() -> None:
    def first_chunk(scale: float):
        sched = make_scheduler("stall-free", budget=2048, step_time=linear_model, max_step_ms=200)
        t = decoding(sched, 1, prompt=4, max_tokens=50)  # one stream decoding: the limit applies
        sched.step_time_scale = scale
        sched.add_request(make_request("p", 1000, max_tokens=2, arrival=t))
        v = step(sched, t + 1)
        return dict(v.batch)["p"], v
    assert first_chunk(1.0)[0] > first_chunk(2.0)[0] > first_chunk(4.0)[0] >= 16
    # the step (10 ms + one decode + k ms + k(k+1)/2 us) fits 200 / 2 ms, and one token more would not
    k, v = first_chunk(2.0)
    assert v.out.predicted_step_s <= 0.100 < v.out.predicted_step_s + chunk_cost(0, k + 1) - chunk_cost(0, k)


def test_a_step_without_decodes_is_bounded_by_the_budget_only() -> None:
    """No stream waits on a step of prompt chunks alone, so the limit does not cut it: a lone long prompt runs in
    budget-sized chunks, and the limit comes back as soon as a decode shares the step."""
    sched = make_scheduler("stall-free", budget=512, step_time=linear_model, max_step_ms=100)
    sched.add_request(make_request("long", 1500, max_tokens=2))
    v = step(sched, 1.0)
    assert v.batch == [("long", 512)] and v.out.predicted_step_s > 0.100
    sched.add_request(make_request("short", 8, max_tokens=50, arrival=1.5))
    t = 2.0
    while not sched.get_request("short").is_decoding:
        t += 1
        step(sched, t)
    while sched.get_request("long").num_output_tokens == 0:  # now the long prompt shares steps with a decode
        t += 1
        v = step(sched, t)
        if any(v.decodes):
            assert v.out.predicted_step_s <= 0.100 + 1e-12 or dict(v.batch)["long"] <= 16


def test_no_limit_without_max_step_ms_and_a_limit_needs_a_model() -> None:
    sched = make_scheduler("stall-free", budget=256, step_time=linear_model)
    sched.add_request(make_request("p", 1000, max_tokens=2))
    v = step(sched, 1.0)
    assert v.batch == [("p", 256)] and v.out.predicted_step_s == 0.0
    with pytest.raises(ValueError, match="step-time model"):
        make_scheduler("stall-free", max_step_ms=100)
    with pytest.raises(ValueError, match="max_step_ms"):
        make_scheduler("stall-free", step_time=linear_model, max_step_ms=-1)
    with pytest.raises(ValueError, match="stall-free scheduler only"):
        make_scheduler("prefill-first", step_time=linear_model, max_step_ms=100)
