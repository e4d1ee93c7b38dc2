"""Admission by queueing delay (engine/admission.py): the predicted wait from the recent start rate, which waiting
requests expire (only without a load to read) or are overdue (admitted, waiting past the limit, still served).
Pure bookkeeping with explicit times: no clock, no model."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from paceline.engine.admission import AdmissionControl, QueueDelayError
from paceline.request import Request, RequestStatus
from paceline.sampling import SamplingParams


def first_delta(n_tokens: int = 1) -> SimpleNamespace:
    return SimpleNamespace(new_token_ids=[7] * n_tokens, num_output_tokens=n_tokens)


def later_delta() -> SimpleNamespace:
    return SimpleNamespace(new_token_ids=[7], num_output_tokens=5)


def test_unknown_rate_admits_and_known_rate_predicts():
    a = AdmissionControl(2.0, window_s=10.0)
    a.check(num_ahead=1000, now=0.0)  # no starts seen yet: nothing to predict with, admit
    for t in (1.0, 1.5, 2.0, 2.5):
        a.observe([first_delta(), later_delta()], t)  # later deltas are not starts
    a.observe([first_delta(3)], 3.0)  # speculative decoding: a first delta with several tokens is one start
    rate = a.start_rate(3.0)
    assert rate == pytest.approx(5 / 2.0)
    assert a.predicted_wait(0, 3.0) == 0.0
    assert a.predicted_wait(4, 3.0) == pytest.approx(5 / rate)
    a.check(num_ahead=4, now=3.0)  # 2.0 s: at the limit, admitted
    with pytest.raises(QueueDelayError) as e:
        a.check(num_ahead=9, now=3.0)  # 4.0 s predicted
    assert e.value.reason == "queue_delay_predicted" and e.value.retry_after_s == 2
    assert "predicted wait of 4.0 s" in str(e.value)


def test_old_starts_leave_the_window():
    a = AdmissionControl(1.0, window_s=10.0)
    for t in range(4):
        a.observe([first_delta()], float(t))
    assert a.start_rate(4.0) is not None
    a.observe([], 30.0)
    assert a.start_rate(30.0) is None  # nothing recent: unknown again, so admit
    a.check(num_ahead=500, now=30.0)


def test_without_a_load_expired_are_waiting_requests_that_never_ran():
    def req(rid: str, arrival: float, status=RequestStatus.WAITING, first=None) -> Request:
        r = Request(rid, [1, 2], SamplingParams(), arrival)
        r.status, r.first_scheduled_time = status, first
        return r

    requests = {r.request_id: r for r in [
        req("old", 0.0), req("young", 4.5),
        req("preempted", 0.0, first=1.0),  # ran, streamed, was preempted back: never expired
        req("running", 0.0, RequestStatus.RUNNING, first=0.1)]}
    engine = SimpleNamespace(scheduler=SimpleNamespace(requests=requests))
    a = AdmissionControl(3.0)
    assert a.sweep(engine, now=5.0) == ["old"]
    assert a.sweep(engine, now=5.01) == []  # swept a moment ago
    assert a.sweep(SimpleNamespace(), now=10.0) == []  # no paceline scheduler: only the arrival check
    err = a.expired_error()
    assert err.reason == "queue_delay_expired" and err.retry_after_s == 3


def test_an_expiry_rejects_arrivals_behind_a_queue_until_it_has_drained():
    # a server too slow to start MIN_STARTS requests per window has no rate: before, it admitted everyone and
    # expired each one S later; a deadline that fired is now taken as the prediction
    stale = Request("stale", [1, 2], SamplingParams(), 0.0)
    stale.status = RequestStatus.WAITING
    engine = SimpleNamespace(scheduler=SimpleNamespace(requests={"stale": stale}))
    a = AdmissionControl(5.0)
    a.check(num_ahead=50, now=5.5)  # no rate, nothing expired yet: admitted
    assert a.sweep(engine, now=6.0) == ["stale"]
    with pytest.raises(QueueDelayError) as e:
        a.check(num_ahead=1, now=6.5)  # someone waits ahead, and the queue just proved slower than 5 s
    assert e.value.reason == "queue_delay_predicted"
    a.check(num_ahead=0, now=6.5)  # nobody ahead: admitted (it starts at the next free slot)
    a.check(num_ahead=3, now=11.0)  # the expiry is S old: the rate (unknown here) decides again


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="max_queue_delay_s"):
        AdmissionControl(0.0)


def test_with_a_load_an_admitted_request_past_the_limit_is_served_and_counted_not_expired():
    from paceline.config import CacheConfig, SchedulerConfig
    from paceline.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(max_num_seqs=4), CacheConfig(block_size=16), 100)
    sched.add_request(Request("slow", list(range(1, 17)), SamplingParams(max_tokens=4), 0.0))
    engine = SimpleNamespace(scheduler=sched)
    a = AdmissionControl(3.0)
    assert a.sweep(engine, now=1.0) == [] and a.num_overdue == 0
    a.check(num_ahead=1, now=1.0)  # a free seat, nothing running: predicted 0 s, admitted
    assert a.sweep(engine, now=4.0) == []  # waited past 3 s: it stays queued (it was admitted) ...
    assert a.num_overdue == 1  # ... and is counted
    assert a.sweep(engine, now=4.1) == [] and a.num_overdue == 1  # once, however many sweeps see it
    with pytest.raises(QueueDelayError, match="has waited longer than the limit") as e:
        a.check(num_ahead=1, now=4.1)  # the load predicts no wait, but the queue proved slower: refused
    assert e.value.reason == "queue_delay_predicted"
    sched.schedule(5.0)  # it runs at last: no longer overdue
    assert a.sweep(engine, now=5.0) == [] and a.num_overdue == 1
    with pytest.raises(QueueDelayError):
        a.check(num_ahead=1, now=6.0)  # within 3 s of the last sighting: still not trusted
    a.check(num_ahead=1, now=8.2)  # S after: the load decides again
