"""Queue order, priorities, preemption (victim choice, recompute, swap, auto, thrash guard), prefix hits,
aborts and early finishes through the scheduler."""
from __future__ import annotations

import pytest

from sched_util import make_request, make_scheduler, step

from paceline.core.queues import RequestQueue, rank_function
from paceline.request import RequestStatus


def test_fcfs_queue_orders_by_arrival_and_a_preempted_request_goes_back_ahead() -> None:
    q = RequestQueue(rank_function("fcfs"))
    a, b, c = (make_request(x, 4, arrival=t) for x, t in (("a", 1.0), ("b", 2.0), ("c", 3.0)))
    for r in (b, c, a):
        q.push(r)
    assert q.pop() is a
    q.push(a)  # back after a preemption: still first
    assert [r.request_id for r in q] == ["a", "b", "c"]
    assert q.remove("b") is b and q.remove("b") is None
    assert [q.pop().request_id for _ in range(len(q))] == ["a", "c"]
    with pytest.raises(ValueError, match="already queued"):
        q.push(c) or q.push(c)


def test_priority_queue_lower_value_first_ties_by_arrival() -> None:
    q = RequestQueue(rank_function("priority"))
    reqs = [make_request("late-urgent", 4, arrival=5.0, priority=-1), make_request("bulk", 4, arrival=0.0, priority=2),
            make_request("normal-2", 4, arrival=2.0), make_request("normal-1", 4, arrival=1.0)]
    for r in reqs:
        q.push(r)
    assert [r.request_id for r in q] == ["late-urgent", "normal-1", "normal-2", "bulk"]
    assert [r.request_id for r in q.first(2)] == ["late-urgent", "normal-1"]


def test_priority_aging_lets_an_old_request_overtake() -> None:
    q = RequestQueue(rank_function("priority", priority_aging_s=10.0))
    q.push(make_request("old-bulk", 4, arrival=0.0, priority=2))  # gains a level every 10 s
    q.push(make_request("new-normal", 4, arrival=25.0, priority=0))
    assert q.peek().request_id == "old-bulk"  # 25 s older: 2.5 levels gained
    q2 = RequestQueue(rank_function("priority", priority_aging_s=10.0))
    q2.push(make_request("old-bulk", 4, arrival=0.0, priority=2))
    q2.push(make_request("new-normal", 4, arrival=15.0, priority=0))
    assert q2.peek().request_id == "new-normal"


def run_until_decoding(sched, t: float = 0.0) -> float:
    while not (sched.running and all(r.is_decoding for r in sched.running)):
        t += 1
        step(sched, t)
    return t


def test_out_of_blocks_preempts_the_latest_arrival_under_fcfs_and_keeps_its_tokens() -> None:
    # 3 requests of 8 prompt tokens, block size 4: each needs a third block at its 9th token; 7 blocks in all
    sched = make_scheduler(num_blocks=7, block_size=4)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=6, arrival=float(i)))
    t = run_until_decoding(sched)
    v = step(sched, t + 1)
    assert v.out.preempted_ids == ["r2"]
    r2 = sched.get_request("r2")
    assert r2.status is RequestStatus.WAITING and r2.num_computed_tokens == 0 and r2.num_preemptions == 1
    assert r2.preemption_times == [t + 1] and sched.stats().num_preemptions == 1
    kept = list(r2.token_ids)
    assert len(kept) == 9  # its sampled token is kept and will be recomputed with the prompt
    t += 1
    while sched.has_unfinished():
        t += 1
        step(sched, t)
    assert r2.token_ids[:9] == kept and r2.num_output_tokens == 6


def test_priority_victim_is_the_lowest_priority_then_latest_arrival() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, scheduling_policy="priority")
    sched.add_request(make_request("urgent-late", 8, max_tokens=6, arrival=2.0, priority=0))
    sched.add_request(make_request("bulk-early", 8, max_tokens=6, arrival=0.0, priority=5))
    sched.add_request(make_request("normal", 8, max_tokens=6, arrival=1.0, priority=1))
    t = run_until_decoding(sched)
    v = step(sched, t + 1)
    assert v.out.preempted_ids == ["bulk-early"]


def test_waiting_request_that_outranks_preempts_for_a_seat() -> None:
    sched = make_scheduler(max_seqs=2, scheduling_policy="priority")
    sched.add_request(make_request("bulk-a", 8, max_tokens=20, arrival=0.0, priority=3))
    sched.add_request(make_request("bulk-b", 8, max_tokens=20, arrival=1.0, priority=3))
    t = run_until_decoding(sched)
    sched.add_request(make_request("vip", 8, max_tokens=2, arrival=t, priority=0))
    v = step(sched, t + 1)
    assert v.out.preempted_ids == ["bulk-b"] and "vip" in v.ids
    # an equal priority never preempts
    sched.add_request(make_request("bulk-c", 8, max_tokens=2, arrival=t, priority=3))
    v = step(sched, t + 2)
    assert not v.out.preempted_ids and "bulk-c" not in v.ids


def test_fcfs_never_preempts_for_admission() -> None:
    sched = make_scheduler(max_seqs=1)
    sched.add_request(make_request("a", 8, max_tokens=20, arrival=0.0, priority=3))
    t = run_until_decoding(sched)
    sched.add_request(make_request("b", 8, max_tokens=2, arrival=t, priority=0))
    v = step(sched, t + 1)
    assert v.ids == ["a"] and not v.out.preempted_ids


def test_waiting_request_that_outranks_preempts_for_memory() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, scheduling_policy="priority")
    sched.add_request(make_request("bulk", 15, max_tokens=4, arrival=0.0, priority=2))
    t = run_until_decoding(sched)
    sched.add_request(make_request("vip", 12, max_tokens=2, arrival=t, priority=0))
    v = step(sched, t + 1)
    assert v.out.preempted_ids == ["bulk"] and v.ids == ["vip"]


def test_swap_mode_swaps_out_and_back_in_before_new_admissions() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, host_blocks=8, preemption_mode="swap")
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=6, arrival=float(i)))
    t = run_until_decoding(sched)
    v = step(sched, t + 1)
    r2 = sched.get_request("r2")
    assert v.out.swapped_out_ids == ["r2"] and r2.status is RequestStatus.SWAPPED and r2.num_swaps == 1
    assert len(v.out.blocks_to_swap_out) == 2 and r2.num_computed_tokens == 8
    host_of_r2 = [h for _, h in v.out.blocks_to_swap_out]
    assert sched.kv.host_tables["r2"] == host_of_r2
    sched.add_request(make_request("new", 4, max_tokens=2, arrival=t + 1))
    t += 1
    swapped_in_at = None
    while sched.get_request("r2") is not None:
        t += 1
        v = step(sched, t)
        if "r2" in v.out.swapped_in_ids and swapped_in_at is None:
            swapped_in_at = t
            pairs = dict(v.out.blocks_to_swap_in)
            assert set(host_of_r2) <= set(pairs)
            assert [pairs[h] for h in host_of_r2] == sched.kv.tables["r2"][:2]  # same order, new device blocks
        if "new" in v.ids:
            assert swapped_in_at is not None, "a new request was admitted before the swapped one came back"
    assert r2.num_output_tokens == 6 and r2.num_preemptions == 1
    assert sched.stats().num_swaps >= 1 and sched.stats().num_used_host_blocks == 0


def test_swap_falls_back_to_recompute_without_host_room() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, host_blocks=1, preemption_mode="swap")
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=6, arrival=float(i)))
    t = run_until_decoding(sched)
    v = step(sched, t + 1)
    assert v.out.preempted_ids == ["r2"] and not v.out.swapped_out_ids


@pytest.mark.parametrize("budget,expect_swap", [(4, True), (64, False)])
def test_auto_mode_swaps_only_kv_bigger_than_a_step_budget(budget: int, expect_swap: bool) -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, host_blocks=8, preemption_mode="auto")
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=6, arrival=float(i)))
    t = run_until_decoding(sched)
    sched.config.max_num_batched_tokens = budget  # r2 holds 8 computed tokens
    v = step(sched, t + 1)
    assert bool(v.out.swapped_out_ids) == expect_swap and bool(v.out.preempted_ids) != expect_swap


def test_a_request_resumed_this_step_is_not_preempted_again() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_seqs=4, scheduling_policy="priority")
    sched.add_request(make_request("bulk", 4, max_tokens=12, arrival=0.0, priority=5))
    t = run_until_decoding(sched)
    # the newcomer outranks bulk and is admitted with bulk's blocks; then bulk (if readmitted in the same
    # step) must not be chosen again by anyone
    sched.add_request(make_request("vip", 11, max_tokens=1, arrival=t, priority=0))
    v = step(sched, t + 1)
    assert v.out.preempted_ids.count("bulk") <= 1
    for _ in range(30):
        t += 1
        v = step(sched, t)
        assert len(v.out.preempted_ids) == len(set(v.out.preempted_ids))
        assert not set(v.out.preempted_ids) & set(v.ids)
    assert not sched.has_unfinished()


def test_prefix_hit_through_the_scheduler_counts_tokens_and_never_covers_everything() -> None:
    sched = make_scheduler(block_size=4, budget=64)
    prompt = list(range(100, 112))  # 3 full blocks
    sched.add_request(make_request("a", prompt, max_tokens=2))
    t = 0.0
    while sched.has_unfinished():
        t += 1
        step(sched, t)
    sched.add_request(make_request("b", prompt, max_tokens=2, arrival=t))
    v = step(sched, t + 1)
    b = sched.get_request("b")
    assert v.batch == [("b", 4)] and b.num_cached_tokens == 8  # 12 tokens: 2 blocks hit, the last is computed
    st = sched.stats()
    assert st.prefix_cache_queries == 24 and st.prefix_cache_hits == 8


def test_recomputed_request_reuses_its_own_cached_blocks() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=6, arrival=float(i)))
    t = run_until_decoding(sched)
    step(sched, t + 1)  # r2 preempted; its two full prompt blocks stay cached while free
    r2 = sched.get_request("r2")
    t += 1
    while r2.status is not RequestStatus.RUNNING:
        t += 1
        step(sched, t)
    assert sched.stats().prefix_cache_hits >= 4 or r2.num_preemptions > 1


def test_abort_and_finish_free_everything_wherever_the_request_is() -> None:
    sched = make_scheduler(num_blocks=7, block_size=4, host_blocks=8, preemption_mode="swap", max_seqs=3)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 8, max_tokens=20, arrival=float(i)))
    t = run_until_decoding(sched)
    step(sched, t + 1)
    statuses = {r.request_id: r.status for r in sched.requests.values()}
    assert RequestStatus.SWAPPED in statuses.values() and RequestStatus.WAITING in statuses.values()
    for rid in list(statuses)[:3]:
        r = sched.abort_request(rid, now=t + 1)
        assert r.status is RequestStatus.FINISHED and r.finish_reason == "abort" and r.finish_time == t + 1
    assert sched.abort_request("r0") is None and sched.abort_request("nope") is None
    last = next(iter(sched.requests))
    sched.finish_request(last, "stop", t + 2)
    assert not sched.has_unfinished()
    st = sched.stats()
    assert st.num_used_blocks == 0 and st.num_used_host_blocks == 0 or sched.kv._host_to_release
    sched.schedule(t + 3)
    assert sched.stats().num_used_host_blocks == 0


def test_update_skips_a_request_aborted_after_schedule() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    out = sched.schedule(1.0)
    sched.abort_request("a")
    assert sched.update(out, __import__("sched_util").fake_result(out), 1.0) == []


def test_bad_input_is_a_value_error() -> None:
    sched = make_scheduler(num_blocks=2, block_size=4)
    sched.add_request(make_request("a", 4, max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="whole cache holds 8"):
        sched.add_request(make_request("big", 6, max_tokens=3))
    out = sched.schedule(0.0)
    from paceline.core.outputs import StepResult
    with pytest.raises(ValueError, match="no token"):
        sched.update(out, StepResult(), 0.0)


def test_a_request_preempted_before_is_not_held_against_a_higher_priority():
    """The anchor (Scheduler.anchor) is the first of all running requests: a low-priority request that went round
    before keeps no KV against a higher priority's growth (the first version held it, and evicted the higher one)."""
    sched = make_scheduler(scheduling_policy="priority", budget=64, num_blocks=9, block_size=4,
                           preemption_mode="recompute")
    low = make_request("low", 8, max_tokens=20, priority=3)
    high = make_request("high", 8, max_tokens=20, priority=0, arrival=1.0)
    sched.add_request(low)
    sched.add_request(high)
    step(sched, 0.0)
    assert low.status is RequestStatus.RUNNING and high.status is RequestStatus.RUNNING
    low.preemption_times.append(0.0)  # as if it had been recomputed once already
    assert sched.anchor() is None  # high ranks first and has not been preempted
    now = 1.0
    while low.num_preemptions == 1:
        step(sched, now)
        now += 1.0
    assert high.num_preemptions == 0 and low.status is RequestStatus.WAITING
    high.preemption_times.append(now)
    assert sched.anchor() is high
