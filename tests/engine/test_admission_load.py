"""Admission from the load (engine/admission.py `Load`): the engine thread's snapshot of what runs and waits, and
the wait it predicts for a newcomer: refused at arrival when it would be seated beyond the seats that keep the
step-time target, or would wait past the limit for a seat or for the prompts ahead. A real Scheduler with a toy
step-time model; explicit times, no clock."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.batch_shape import BatchShape
from paceline.core.outputs import StepResult
from paceline.core.scheduler import Scheduler
from paceline.engine.admission import AdmissionControl, Load, QueueDelayError
from paceline.request import Request
from paceline.sampling import SamplingParams


def toy_step_time(s: BatchShape) -> float:
    """10 ms a step, 1 ms a decode plus 1 us per token of its context, 0.2 ms a prompt token."""
    return 0.010 + 0.001 * s.num_decodes + 1e-6 * s.decode_context + 0.0002 * s.num_prefill_tokens


def scheduler(max_num_seqs: int | str = 128) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, max_step_ms=100.0)
    return Scheduler(cfg, CacheConfig(block_size=16), 4000, step_time=toy_step_time)


def add(sched: Scheduler, n: int, prompt: int = 16, max_tokens: int = 100, start: int = 0) -> None:
    for i in range(start, start + n):
        base = 1000 * (i + 1)  # distinct prompts: no prefix cache hits
        sched.add_request(Request(str(i), list(range(base, base + prompt)),
                                  SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0))


def run_step(sched: Scheduler, now: float) -> None:
    out = sched.schedule(now)
    sched.update(out, StepResult({s.request.request_id: 7 for s in out.scheduled if s.needs_sample}), now)


def test_fixed_seats_beyond_what_keeps_the_step_target_are_refused_at_arrival():
    # 128 fixed seats, but at 100 ms a step the toy model fits (100 - 10 - 3.2) / 1.017 = 85 decodes: a newcomer
    # the scheduler would seat as the 86th slows every stream past the target, so it is refused, cold start or not
    sched = scheduler(128)
    add(sched, 84)
    for t in range(3):
        run_step(sched, float(t))
    assert len(sched.running) == 84
    engine = SimpleNamespace(scheduler=sched)
    a = AdmissionControl(5.0)
    a.sweep(engine, now=3.0)  # the engine thread's look before a step
    assert a.start_rate(3.0) is None  # no start rate to go by: the load decides
    assert a.load.tbt_seats == 85 and a.load.seats == 128 and a.load.running_left == (97,) * 84  # 3 steps, 3 tokens out
    a.check(num_ahead=0, now=3.0)  # the 85th fits
    with pytest.raises(QueueDelayError, match="larger than the 85 that keep") as e:
        a.check(num_ahead=1, now=3.0)  # one waits ahead already: this one would be the 86th
    assert e.value.reason == "queue_delay_predicted" and e.value.retry_after_s >= 1


def test_auto_seats_predict_the_wait_for_a_seat_from_the_running_budgets():
    # under --max-num-seqs auto the scheduler keeps a newcomer waiting for a seat: the wait is played out from
    # the running requests' remaining budgets at the measured step time
    sched = scheduler("auto")
    add(sched, 90, max_tokens=40)
    a = AdmissionControl(5.0)
    engine = SimpleNamespace(scheduler=sched)
    for t in range(3):
        a.sweep(engine, now=0.5 * t)  # looks 0.5 s apart while requests run: a step is measured at 0.5 s
        run_step(sched, 0.5 * t)
    a.sweep(engine, now=1.5)
    load = a.load
    assert load.step_s == pytest.approx(0.5) and len(load.running_left) == load.seats == 85
    # all 85 seated in the first step (no decode waits on it), 3 tokens out since
    assert load.waiting_left == (40,) * 5 and load.running_left == (37,) * 85
    # 5 wait ahead and the seats are full: they take the first 5 seats to free, the newcomer the 6th, all after
    # 37 steps x 0.5 s = 18.5 s: over the limit, refused at arrival
    assert a.predicted_wait(5, now=1.5) == pytest.approx(18.5)
    with pytest.raises(QueueDelayError, match="predicted wait of 18.5 s"):
        a.check(num_ahead=5, now=1.5)
    patient = AdmissionControl(30.0)
    patient.load = load
    patient.check(num_ahead=5, now=1.5)  # the same wait under a 30 s limit: admitted


def test_the_seat_wait_plays_out_who_finishes_when():
    load = Load(running_left=(10, 100), waiting_prompt=(50,), waiting_left=(50,), seats=2, tbt_seats=None,
                step_s=0.1, prefill_tok_s=None)
    a = AdmissionControl(5.0)
    # the one ahead takes the seat freed at step 10 and holds it to 60; the newcomer gets it then: 6 s
    assert a.load_wait(load, 1) == (pytest.approx(6.0), "")
    # a burst since the snapshot (2 ahead, 1 seen): the unseen one counts as the average waiting request, and
    # takes the seat freed at 60 up to 110; the newcomer gets the other at 100: 10 s
    assert a.load_wait(load, 2)[0] == pytest.approx(10.0)
    a.load = load
    with pytest.raises(QueueDelayError, match="predicted wait of 6.0 s") as e:
        a.check(num_ahead=1, now=0.0)
    assert e.value.retry_after_s == 1
    # free seats: no wait for one; prompts ahead at the prefill rate the model gives beside the decodes
    roomy = Load(running_left=(10,), waiting_prompt=(3000, 3000), waiting_left=(5, 5), seats=8, tbt_seats=8,
                 step_s=0.1, prefill_tok_s=1000.0)
    assert a.load_wait(roomy, 2)[0] == pytest.approx(6.0)
    # a seat is held for the prompt's prefill too: the one ahead gets the seat at 1 s, prefills 1,000 tokens in
    # 1 s, decodes 10 tokens in 1 s; the newcomer starts at 3 s
    one_seat = Load(running_left=(10,), waiting_prompt=(1000,), waiting_left=(10,), seats=1, tbt_seats=None,
                    step_s=0.1, prefill_tok_s=1000.0)
    assert a.load_wait(one_seat, 1)[0] == pytest.approx(3.0)


def test_a_load_it_cannot_read_never_stops_the_engine_thread():
    class Broken:
        requests: dict = {}

        @property
        def running(self):
            raise RuntimeError("a scheduler this code does not know")

    a = AdmissionControl(5.0)
    assert a.sweep(SimpleNamespace(scheduler=Broken()), now=1.0) == []
    assert a.load is None  # back to the start rate, which is unknown here: admitted
    a.check(num_ahead=50, now=1.0)


def test_the_prediction_learns_its_error_from_the_requests_that_started():
    # the load predicts 2 s for a newcomer (the one seat frees after 20 steps of 0.1 s), but each admitted request
    # then waits 6 s for its first step: the margin learns the ratio and the same load is refused afterwards
    slow = Load(running_left=(20,), waiting_prompt=(), waiting_left=(), seats=1, tbt_seats=None, step_s=0.1,
                prefill_tok_s=None)
    requests: dict = {}
    engine = SimpleNamespace(scheduler=SimpleNamespace(requests=requests, running=[],
                                                       config=SimpleNamespace(max_num_seqs=1)))
    a = AdmissionControl(30.0)  # a patient limit while it learns, so every one is admitted
    for i in range(20):
        now = 10.0 * i
        a.load = slow
        assert a.predicted_wait(0, now) == pytest.approx(2.0 * a.margin)
        a.check(num_ahead=0, now=now, request_id=f"r{i}")  # admitted
        r = Request(f"r{i}", [1, 2], SamplingParams(), now)
        r.first_scheduled_time = now + 6.0
        requests[r.request_id] = r
        a.sweep(engine, now=now + 6.5)  # the engine thread sees it started
    assert a.margin == pytest.approx((6.0 + 0.5) / (2.0 + 0.5), rel=0.25)
    assert not a._promised  # every admitted request's prediction was used once and forgotten
    a.load = slow
    a.max_delay = 5.0  # 2 s by the load, about 5.2 s with the margin: refused at a 5 s limit, admitted before it
    with pytest.raises(QueueDelayError, match="predicted wait"):
        a.check(num_ahead=0, now=300.0, request_id="late")
    assert "late" not in a._promised
    # a prediction never lowered below the load's own: waits shorter than predicted leave the margin at 1
    quick = AdmissionControl(5.0)
    requests.clear()
    for i in range(20):
        quick.load = slow
        quick.check(num_ahead=0, now=10.0 * i, request_id=f"q{i}")
        r = Request(f"q{i}", [1, 2], SamplingParams(), 10.0 * i)
        r.first_scheduled_time = 10.0 * i + 0.1
        requests[r.request_id] = r
        quick.sweep(engine, now=10.0 * i + 1)
    assert quick.margin == 1.0
    # an admitted request that never starts (aborted before its add was applied) is forgotten after a second
    quick.load = slow
    quick.check(num_ahead=0, now=500.0, request_id="gone")
    quick.sweep(engine, now=500.5)
    assert "gone" in quick._promised
    quick.sweep(engine, now=502.0)
    assert "gone" not in quick._promised
