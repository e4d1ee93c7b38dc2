"""Fair share between clients and time slices, in hand-built scenarios: counters charged with what steps ran,
lifting of a newly backlogged client, admission of the least-served client, the most-served client's victim,
priorities before fairness, demotion by a used slice, and the hysteresis that keeps two requests from trading
places every step."""
from __future__ import annotations

import pytest

from sched_util import make_request, make_scheduler, step

from paceline.config import SchedulerConfig
from paceline.core.fair import FairQueue, FairShare
from paceline.core.queues import rank_function
from paceline.request import RequestStatus


def req(rid, prompt, max_tokens=8, client="", arrival=0.0, priority=0):
    r = make_request(rid, prompt, max_tokens=max_tokens, arrival=arrival, priority=priority)
    r.client_id = client
    return r


def run(sched, now, until, limit=500):
    """Step until `until()` holds; returns the time of the last step."""
    for _ in range(limit):
        if until():
            return now
        now += 1.0
        step(sched, now)
    raise AssertionError("condition not reached")


def test_counters_charge_prompt_tokens_once_and_decodes_twice():
    sched = make_scheduler(scheduling_policy="fair", budget=64)
    sched.add_request(req("a", 10, max_tokens=3, client="a"))
    step(sched, 1.0)  # the 10-token prompt
    assert sched.fair.counter("a") == 10
    step(sched, 2.0)  # a decode weighs 2
    assert sched.fair.counter("a") == 12
    step(sched, 3.0)
    assert sched.fair.counter("a") == 14 and not sched.has_unfinished()


def test_a_newly_backlogged_client_is_lifted_to_the_lowest_backlogged_counter():
    fair = FairShare()
    fair.arrive("a")
    fair.arrive("b")
    fair.counters.update(a=100.0, b=40.0)
    fair.arrive("c")  # new: lifted to min(100, 40), so idling banked nothing
    assert fair.counter("c") == 40.0
    fair.leave("c")
    fair.counters["c"] = 70.0  # served more than b meanwhile: a return keeps its own, higher counter
    fair.arrive("c")
    assert fair.counter("c") == 70.0
    for c in ("a", "b", "c"):
        fair.leave(c)
    fair.arrive("d")  # nobody backlogged: lifted to the highest counter
    assert fair.counter("d") == 100.0


def test_lifting_in_the_scheduler_uses_what_steps_charged():
    sched = make_scheduler(scheduling_policy="fair", budget=64)
    sched.add_request(req("a1", 20, max_tokens=30, client="a"))
    now = run(sched, 0.0, lambda: sched.requests["a1"].num_output_tokens >= 5)
    served = sched.fair.counter("a")
    assert served == 20 + 2 * 4  # the prompt, then four decodes
    sched.add_request(req("b1", 4, client="b", arrival=now))
    assert sched.fair.counter("b") == served - 4  # less the prompt that brings it: its one prompt of credit


def test_a_returning_client_keeps_one_prompt_of_credit_and_no_more():
    """Strict VTC lifts a returning client to the lowest backlogged counter, so a client returning with a burst
    is the more served once its first prompt has run, and the rest of its burst waits (the light client's slow
    TTFTs on two-tenants). The prompt that brings it back is credited; only going idle gives it, once."""
    fair = FairShare()
    fair.arrive("heavy")
    fair.counters["heavy"] = 500.0
    fair.arrive("light", prompt_tokens=60)
    assert fair.counter("light") == 440.0
    fair.arrive("light", prompt_tokens=90)  # already backlogged: the rest of a burst gets no credit
    assert fair.counter("light") == 440.0
    fair.leave("light")
    fair.leave("light")
    fair.counters["light"] = 480.0  # served meanwhile: a return lifts it to 500 - 60 at most, never lowers it
    fair.arrive("light", prompt_tokens=60)
    assert fair.counter("light") == 480.0
    fair.leave("light")
    fair.counters["light"] = 400.0
    fair.arrive("light", prompt_tokens=1000)  # credit never lowers a counter either: idling banks nothing
    assert fair.counter("light") == 400.0
    half = FairShare(input_weight=0.5)  # the credit is the prompt's weighted cost
    half.arrive("a")
    half.counters["a"] = 100.0
    half.arrive("b", prompt_tokens=10)
    assert half.counter("b") == 95.0


@pytest.mark.parametrize("policy, expected", [("fcfs", ["a1", "a2", "a3", "b1"]), ("fair", ["a1", "b1", "a2", "a3"])])
def test_admission_picks_the_least_served_clients_oldest_request(policy, expected):
    sched = make_scheduler(scheduling_policy=policy, budget=64, max_seqs=1)
    for i in (1, 2, 3):
        sched.add_request(req(f"a{i}", 6, max_tokens=4, client="a", arrival=0.0))
    step(sched, 1.0)
    sched.add_request(req("b1", 6, max_tokens=4, client="b", arrival=1.5))  # later than a2, a3
    run(sched, 1.0, lambda: not sched.has_unfinished())
    assert sorted(["a1", "a2", "a3", "b1"], key=lambda rid: first_scheduled[rid]) == expected


first_scheduled: dict[str, float] = {}


@pytest.fixture(autouse=True)
def _record_first_scheduled(monkeypatch):
    """Note each request's first scheduled time as the scheduler sets it (requests leave the scheduler when done)."""
    from paceline.core import scheduler as mod
    original = mod.Scheduler.add_scheduled
    first_scheduled.clear()

    def add_scheduled(self, st, request, n):
        first_scheduled.setdefault(request.request_id, st.now)
        return original(self, st, request, n)
    monkeypatch.setattr(mod.Scheduler, "add_scheduled", add_scheduled)


@pytest.mark.parametrize("policy, victim", [("fcfs", "b1"), ("fair", "a1")])
def test_preemption_takes_the_most_served_clients_request(policy, victim):
    sched = make_scheduler(scheduling_policy=policy, budget=64, num_blocks=12, block_size=4)
    # both backlogged from the start; a's longer prompt makes it the more served, b1 is the later arrival
    a1 = req("a1", 16, max_tokens=24, client="a", arrival=0.0)
    b1 = req("b1", 4, max_tokens=24, client="b", arrival=0.1)
    sched.add_request(a1)
    sched.add_request(b1)
    run(sched, 0.0, lambda: a1.num_preemptions + b1.num_preemptions > 0)
    assert {"a1": a1, "b1": b1}[victim].num_preemptions == 1
    run(sched, 100.0, lambda: not sched.has_unfinished())


def test_priority_comes_before_fairness():
    sched = make_scheduler(scheduling_policy="fair", budget=64, max_seqs=1)
    sched.add_request(req("a1", 6, max_tokens=6, client="a"))
    now = run(sched, 0.0, lambda: sched.requests["a1"].num_output_tokens >= 3)
    sched.add_request(req("b1", 6, max_tokens=2, client="b", arrival=now, priority=5))
    sched.add_request(req("a2", 6, max_tokens=2, client="a", arrival=now + 0.5, priority=0))
    run(sched, now, lambda: not sched.has_unfinished())
    assert first_scheduled["a2"] < first_scheduled["b1"]  # a is more served, but a2 outranks b1


def test_fair_queue_hands_out_the_least_served_clients_best_request():
    fair = FairShare()
    q = FairQueue(fair, rank_function("fair"))
    for rid, client, t in (("a1", "a", 0.0), ("a2", "a", 1.0), ("b1", "b", 2.0), ("c1", "c", 3.0)):
        q.push(req(rid, 4, client=client, arrival=t))
    fair.counters.update(a=5.0, b=1.0, c=3.0)
    assert [r.request_id for r in q] == ["b1", "c1", "a1", "a2"]
    assert q.pop().request_id == "b1"
    fair.counters["a"] = 0.0
    assert q.peek().request_id == "a1" and len(q) == 3
    assert q.remove("a1").request_id == "a1" and "a1" not in q
    assert [r.request_id for r in q.first(5)] == ["a2", "c1"]


def _resident(sched) -> list[str]:
    return [r.request_id for r in sched.running]


def test_a_used_slice_preempts_and_demotes_and_a_resumed_request_keeps_its_tokens():
    sched = make_scheduler(budget=64, max_seqs=1, time_slice_tokens=4, preemption_mode="swap", host_blocks=64)
    r1, r2 = req("r1", 4, max_tokens=30, arrival=0.0), req("r2", 4, max_tokens=30, arrival=0.5)
    sched.add_request(r1)
    step(sched, 1.0)
    sched.add_request(r2)
    now = run(sched, 1.0, lambda: r1.num_preemptions == 1)
    # r1 ran exactly its slice (4 output tokens), then gave its seat to r2 and went down one level
    assert r1.num_output_tokens == 4 and r1.slice_level == 1 and r1.status is RequestStatus.SWAPPED
    assert _resident(sched) == ["r2"] and sched.stats().num_slice_preemptions == 1
    # r2 at level 0 is not cut before its own slice is used, though r1 waits (hysteresis)
    now = run(sched, now, lambda: r2.num_preemptions == 1)
    assert r2.num_output_tokens == 4 and r2.slice_level == 1 and _resident(sched) == ["r1"]
    # r1 at level 1 has a slice twice as long
    run(sched, now, lambda: r2.status is RequestStatus.RUNNING)
    assert r1.num_output_tokens == 4 + 8 and r1.slice_level == 2
    run(sched, now, lambda: not sched.has_unfinished())
    assert r1.num_output_tokens == r2.num_output_tokens == 30
    assert r1.num_preemptions <= 3 and r2.num_preemptions <= 3  # O(log) preemptions each, not 30 / 4


def test_no_slice_preemption_while_a_seat_is_free_or_nothing_waits():
    sched = make_scheduler(budget=64, max_seqs=2, time_slice_tokens=2)
    sched.add_request(req("r1", 4, max_tokens=20))
    sched.add_request(req("r2", 4, max_tokens=20, arrival=0.5))
    run(sched, 0.0, lambda: not sched.has_unfinished())
    assert sched.num_preemptions == 0


def test_slices_in_milliseconds_and_recompute_counts_the_recomputed_tokens():
    sched = make_scheduler(budget=64, max_seqs=1, time_slice_ms=2500, preemption_mode="recompute", caching=False)
    r1, r2 = req("r1", 10, max_tokens=20), req("r2", 4, max_tokens=2, arrival=0.5)
    sched.add_request(r1)
    sched.add_request(r2)
    now = run(sched, 0.0, lambda: r1.num_preemptions == 1)
    assert now == 4.0  # admitted at 1, its 2.5 s slice used at 4
    computed = r1.num_tokens - 1  # the KV it held: prompt and output but the last token
    assert computed == 12
    run(sched, now, lambda: not sched.has_unfinished())
    assert sched.stats().num_recomputed_tokens == computed and r1.num_output_tokens == 20


def test_a_slice_never_ends_before_its_first_token_so_recomputed_requests_cannot_trade_a_seat_forever():
    # the state machine's case: two clients, one seat, recompute, 2 s slices; a resumed request spent its slice
    # on its re-prefill and was cut right before its next token, every time, each client's recompute making it
    # the more served one. Now a residency ends only after a token of its own
    sched = make_scheduler(scheduling_policy="fair", budget=4, max_seqs=1, num_blocks=6, block_size=2,
                           time_slice_ms=2000, preemption_mode="recompute")
    r1, r2 = req("r1", 1, max_tokens=11), req("r2", 3, max_tokens=9, client="a")
    sched.add_request(r1)
    sched.add_request(r2)
    tokens_at_cut = {}
    now = 0.0
    for _ in range(200):
        if not sched.has_unfinished():
            break
        now += 1.0
        marks = {r.request_id: r.slice_mark for r in sched.running}
        out = step(sched, now).out
        for rid in out.preempted_ids:
            tokens_at_cut.setdefault(rid, []).append(sched.requests[rid].num_output_tokens - marks[rid])
    assert not sched.has_unfinished() and r1.num_output_tokens == 11 and r2.num_output_tokens == 9
    assert tokens_at_cut and all(n >= 1 for cuts in tokens_at_cut.values() for n in cuts), tokens_at_cut


def test_fair_with_slices_gives_the_light_client_a_heavy_clients_seat():
    sched = make_scheduler(scheduling_policy="fair", budget=64, max_seqs=2, time_slice_tokens=4,
                           preemption_mode="swap", host_blocks=200)
    for i in range(4):
        sched.add_request(req(f"h{i}", 8, max_tokens=40, client="heavy", arrival=i * 0.1))
    now = run(sched, 0.0, lambda: sched.fair.counter("heavy") > 100)
    light = req("l1", 8, max_tokens=4, client="light", arrival=now)
    sched.add_request(light)
    # the heavy requests are at level 1 (8-token slices) but have run 4: the light client needs only that first
    # slice used once it is the less served, which it is at once (lifted to heavy's counter less its 8-token
    # prompt; strict VTC made it tie, and it waited a step for heavy's decodes)
    run(sched, now, lambda: light.is_finished, limit=7)
    assert light.first_scheduled_time == now + 1 and sched.num_slice_preemptions >= 1


def test_under_fair_one_clients_requests_never_cut_one_another():
    """Under fair a slice moves seats between clients only: a client's own queued request waits for a seat as
    under fcfs (no MLFQ within the client), and no victim is demoted."""
    sched = make_scheduler(scheduling_policy="fair", budget=64, max_seqs=1, time_slice_tokens=2,
                           preemption_mode="swap", host_blocks=64)
    r1, r2 = req("r1", 4, max_tokens=12, client="heavy"), req("r2", 4, max_tokens=12, client="heavy", arrival=0.5)
    sched.add_request(r1)
    sched.add_request(r2)
    run(sched, 0.0, lambda: not sched.has_unfinished())
    assert sched.num_preemptions == 0 and r2.first_scheduled_time > r1.finish_time - 1.0


def test_under_fair_a_victim_keeps_its_level_and_resumes_before_its_clients_later_requests():
    """The light client's request takes the heavy one's seat once it has run its first slice; the heavy victim is
    not demoted, so when the seat frees it comes back (swapped in, its context kept) before a heavy request that
    arrived after it and would need its whole prompt computed."""
    sched = make_scheduler(scheduling_policy="fair", budget=64, max_seqs=1, time_slice_tokens=2,
                           preemption_mode="swap", host_blocks=64)
    h1 = req("h1", 8, max_tokens=20, client="heavy")
    sched.add_request(h1)
    now = run(sched, 0.0, lambda: h1.num_output_tokens >= 3)
    h2 = req("h2", 8, max_tokens=20, client="heavy", arrival=now)
    light = req("l", 4, max_tokens=2, client="light", arrival=now)
    sched.add_request(h2)
    sched.add_request(light)
    now = run(sched, now, lambda: light.status is RequestStatus.RUNNING)
    assert h1.status is RequestStatus.SWAPPED and h1.slice_level == 0 and sched.num_slice_preemptions == 1
    run(sched, now, lambda: light.is_finished)
    run(sched, now, lambda: h1.status is RequestStatus.RUNNING)
    assert h2.status is RequestStatus.WAITING and h2.num_computed_tokens == 0
    run(sched, now, lambda: not sched.has_unfinished())
    assert sched.num_preemptions == 1  # h2 never cut h1, nor h1 h2


def _prefill_time(shape) -> float:
    return 0.010 + 0.001 * shape.num_prefill_tokens + 0.001 * shape.num_decodes


def test_under_a_step_time_target_the_less_served_clients_prompt_gets_the_step_first():
    """The step's time, not a seat, is what runs out: a light client's prompt admitted while a heavy client's long
    prompt is mid-prefill takes its chunk before the heavy one's, not what the heavy one leaves (nothing). A third
    client's request decodes throughout, so the step-time limit applies (a step without decodes has none)."""
    sched = make_scheduler(scheduling_policy="fair", budget=512, max_seqs=4, max_step_ms=50.0,
                           step_time=_prefill_time)
    sched.add_request(req("d", 4, max_tokens=100, client="other"))
    step(sched, 1.0)
    sched.add_request(req("h", 400, max_tokens=4, client="heavy", arrival=1.5))
    v = step(sched, 2.0)
    assert v.batch == [("d", 1), ("h", 39)]  # 50 ms = 10 + 1 decode + 39 prompt tokens
    light = req("l", 30, max_tokens=4, client="light", arrival=2.5)
    sched.add_request(light)  # lifted to the lowest backlogged counter (other's), below heavy's
    v = step(sched, 3.0)
    assert v.batch == [("d", 1), ("l", 30), ("h", 9)] and light.num_output_tokens == 1


@pytest.mark.parametrize("aging", [0.0, 3.0])
def test_level_aging_brings_a_demoted_request_back_under_sustained_fresh_work(aging):
    """One seat, 2-token slices, a fresh request arriving every step: with strict levels the demoted r1 waits for
    every fresh (level 0) request and never comes back while they keep coming; with level aging it ranks as if it
    had arrived `aging` seconds after its demotion, so it resumes once the fresh work that arrived before then
    has had its slices."""
    sched = make_scheduler(budget=64, max_seqs=1, time_slice_tokens=2, preemption_mode="swap", host_blocks=500,
                           level_aging_s=aging)
    r1 = req("r1", 4, max_tokens=200, arrival=0.0)
    sched.add_request(r1)
    demoted_at = None
    now = 0.0
    for i in range(60):
        now += 1.0
        sched.add_request(req(f"f{i}", 4, max_tokens=200, arrival=now - 0.5))
        step(sched, now)
        if demoted_at is None and r1.slice_level == 1:
            demoted_at = now
        if demoted_at is not None and r1.status is RequestStatus.RUNNING:
            break
    assert demoted_at == 3.0  # admitted at 1, its 2 output tokens by 2, cut at the start of step 3
    if aging == 0.0:
        assert r1.status is RequestStatus.SWAPPED and now == 60.0  # starved for as long as fresh work came
    else:
        # fresh arrivals after demoted_at + aging rank behind it; the ones before (one a second, aging + 3 of them
        # counting those queued at the demotion) each get one slice: two steps (prompt and first token, one decode)
        assert r1.status is RequestStatus.RUNNING and now <= demoted_at + 2 * (aging + 3)
        assert r1.num_output_tokens >= 2


def test_config_checks():
    with pytest.raises(ValueError, match="level_aging_s"):
        SchedulerConfig(level_aging_s=-1.0)
    assert SchedulerConfig(scheduling_policy="fair").scheduling_policy == "fair"
    with pytest.raises(ValueError, match="static"):
        SchedulerConfig(policy="static", time_slice_tokens=8)
    with pytest.raises(ValueError, match="time_slice_tokens"):
        SchedulerConfig(time_slice_tokens=-1)
    with pytest.raises(ValueError, match="time_slice_ms"):
        SchedulerConfig(time_slice_ms=-1.0)


def test_no_slice_is_cut_while_a_seat_is_free():
    # memory, not seats, holds the queue: 1 request runs in 5 seats with its 1-token slice used and 6 wait. A cut
    # for the queue's 5th (beyond the 4 free seats) freed a seat nobody lacked and, under recompute, the victim's
    # progress: the long state-machine run found requests one token from their end cut that way, forever
    sched = make_scheduler(budget=64, max_seqs=5, num_blocks=6, block_size=4, time_slice_tokens=1,
                           preemption_mode="recompute")
    sched.add_request(req("big", 12, max_tokens=8))
    run(sched, 0.0, lambda: sched.requests["big"].num_output_tokens >= 2)
    for i in range(6):
        sched.add_request(req(f"w{i}", 12, max_tokens=4, arrival=0.5))
    out = step(sched, 50.0).out
    assert "big" not in out.preempted_ids and sched.num_slice_preemptions == 0
    assert sched.num_waiting >= 5  # the KV, not the seats, kept them out
