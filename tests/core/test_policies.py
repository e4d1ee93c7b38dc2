"""Each batch-building policy on hand-built scenarios."""
from __future__ import annotations

import pytest

from sched_util import make_request, make_scheduler, step

from paceline.request import RequestStatus


def ten_decoding(sched, max_tokens: int = 200) -> float:
    """Ten running requests past their prompts; returns the clock."""
    for i in range(10):
        sched.add_request(make_request(f"d{i}", 4, max_tokens=max_tokens, arrival=i * 0.001))
    t = 0.0
    while not all(r.is_decoding for r in sched.running) or sched.num_running < 10:
        t += 1
        step(sched, t)
    return t


def test_sarathi_fills_the_budget_decodes_first_with_prompt_chunks() -> None:
    sched = make_scheduler("stall-free", budget=64)
    t = ten_decoding(sched)
    sched.add_request(make_request("long", 500, max_tokens=4, arrival=t))
    shapes = []
    while sched.get_request("long").num_output_tokens == 0:
        t += 1
        v = step(sched, t)
        shapes.append(v.shape)
        assert v.decodes[:10] == [True] * 10
    # 500 = 9 * 54 + 14: ten decodes and a 54-token chunk each step, the rest in the last one
    assert shapes == [(10, 54)] * 9 + [(10, 14)]
    t += 1
    v = step(sched, t)
    assert v.shape == (11, 0)


def test_sarathi_long_prefill_threshold_and_partial_prefill_limit() -> None:
    sched = make_scheduler("stall-free", budget=64, long_prefill_token_threshold=20, max_num_partial_prefills=1)
    sched.add_request(make_request("a", 100, arrival=0.0))
    sched.add_request(make_request("b", 100, arrival=0.1))
    v = step(sched, 1.0)
    # one prompt at a time, at most 20 tokens each step
    assert v.batch == [("a", 20)]
    for t in range(2, 6):
        v = step(sched, t)
        assert v.batch == [("a", 20)]
    v = step(sched, 6)
    assert v.batch == [("a", 1), ("b", 20)]


def test_sarathi_chunks_many_prompts_and_respects_max_num_seqs() -> None:
    sched = make_scheduler("stall-free", budget=64, max_seqs=3)
    for i in range(5):
        sched.add_request(make_request(i, 30, arrival=i))
    v = step(sched, 1.0)
    assert v.batch == [("0", 30), ("1", 30), ("2", 4)]
    v = step(sched, 2.0)
    assert v.batch == [("0", 1), ("1", 1), ("2", 26)]
    assert sched.num_running == 3 and sched.num_waiting == 2


def test_vllm_runs_a_long_prompt_alone_and_whole() -> None:
    sched = make_scheduler("prefill-first", budget=64)
    t = ten_decoding(sched)
    sched.add_request(make_request("long", 500, max_tokens=4, arrival=t))
    v = step(sched, t + 1)
    assert v.shape == (0, 500) and len(v.batch) == 1
    v = step(sched, t + 2)
    assert v.shape == (11, 0)


def test_vllm_batches_prompts_that_fit_and_stalls_decodes() -> None:
    sched = make_scheduler("prefill-first", budget=64)
    t = ten_decoding(sched)
    for i in range(4):
        sched.add_request(make_request(f"p{i}", 30, arrival=t + i * 0.01))
    v = step(sched, t + 1)
    assert v.shape == (0, 60)  # two 30-token prompts fit 64, the decodes wait
    v = step(sched, t + 2)
    assert v.shape == (0, 60)
    v = step(sched, t + 3)
    assert v.shape == (14, 0)


def test_orca_mixes_whole_prompts_with_decodes() -> None:
    sched = make_scheduler("orca", budget=64)
    t = ten_decoding(sched)
    sched.add_request(make_request("long", 500, arrival=t))
    sched.add_request(make_request("short", 20, arrival=t + 0.01))
    v = step(sched, t + 1)
    assert v.shape == (10, 500)  # the first prompt runs whole even over the budget; the next one waits
    v = step(sched, t + 2)
    assert v.shape == (11, 20)


def test_static_waits_for_the_batch_to_fill_then_finishes_it_before_the_next() -> None:
    sched = make_scheduler("static", budget=512, max_seqs=3, max_batch_wait_ms=100)
    sched.add_request(make_request("a", 10, max_tokens=3, arrival=0.0))
    v = step(sched, 0.05)
    assert v.out.is_empty and sched.wake_time == pytest.approx(0.1)
    sched.add_request(make_request("b", 10, max_tokens=5, arrival=0.06))
    v = step(sched, 0.11)  # the wait is over: a batch of two
    assert set(v.ids) == {"a", "b"}
    sched.add_request(make_request("c", 10, max_tokens=2, arrival=0.12))
    t, seen = 0.12, []
    while sched.get_request("b") is not None:
        t += 0.01
        v = step(sched, t)
        seen.extend(v.ids)
    assert "c" not in seen  # joins only after the whole batch is done
    v = step(sched, t + 1)  # c waited more than max_batch_wait_ms already
    assert v.ids == ["c"]


def test_static_full_batch_starts_at_once() -> None:
    sched = make_scheduler("static", budget=512, max_seqs=2, max_batch_wait_ms=10_000)
    for i in range(3):
        sched.add_request(make_request(i, 10, max_tokens=2, arrival=0.0))
    v = step(sched, 0.0)
    assert v.ids == ["0", "1"]


@pytest.mark.parametrize("policy", ["stall-free", "prefill-first", "orca", "static"])
def test_every_policy_finishes_every_request_with_its_length(policy: str) -> None:
    sched = make_scheduler(policy, budget=48, max_seqs=4, num_blocks=64)
    lengths = {}
    for i in range(12):
        r = make_request(i, 5 + 7 * i, max_tokens=1 + i % 5, arrival=i * 0.5)
        lengths[r.request_id] = r
        sched.add_request(r)
    t = 0.0
    while sched.has_unfinished():
        t += 1
        step(sched, t)
        assert t < 500
    for r in lengths.values():
        assert r.status is RequestStatus.FINISHED and r.finish_reason == "length"
        assert r.num_output_tokens == r.sampling_params.max_tokens
        assert r.first_scheduled_time is not None and r.finish_time == r.token_times[-1]
    assert sched.stats().num_used_blocks == 0
