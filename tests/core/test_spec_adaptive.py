"""Adaptive speculation (core/spec_adaptive.py): k per request from acceptance and the step-time model; fades under
load; shadow proposals keep the acceptance of a request that stopped speculating up to date."""
from __future__ import annotations

from sched_util import make_request, make_scheduler

from paceline.core.batch_shape import BatchShape
from paceline.core.outputs import StepResult
from paceline.core.spec_adaptive import Acceptance, Candidate, Speculator, decode_to_verify
from paceline.spec_config import SpeculativeConfig


def _cpu_like(s: BatchShape) -> float:
    """A weight-streaming CPU: 40 ms a step, 4 ms a request, 2 ms a verified or prompt token."""
    return 0.040 + 0.004 * s.num_requests + 0.002 * s.num_prefill_tokens


class _Slot:  # what plan() reads of a ScheduledRequest
    def __init__(self, start: int) -> None:
        self.start = start


def _plan(rates: list[float], num_decodes: int, k: int = 4, adaptive: bool = True, limit: float | None = None,
          budget: int = 1000) -> list[int]:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=k, adaptive=adaptive), _cpu_like)
    shape = BatchShape.build(decode_contexts=[100] * num_decodes)
    cands = [Candidate(i, _Slot(99), [5] * k, r) for i, r in enumerate(rates)]
    spec.plan(cands, shape, num_decodes, budget, limit)
    return [c.taken for c in cands]


def test_acceptance_rate_learns_and_decays_to_the_prior() -> None:
    a = Acceptance()
    assert a.rate(0.5) == 0.5
    for _ in range(10):
        a.decay()
        a.observe(4, 4)
    assert a.rate(0.5) > 0.9
    for _ in range(10):
        a.decay()
        a.observe(0, 4)  # the first proposal rejected: one position tried
    assert a.rate(0.5) < 0.3
    for _ in range(60):
        a.decay()
    assert abs(a.rate(0.5) - 0.5) < 0.05


def test_one_stream_speculates_by_acceptance() -> None:
    assert _plan([0.95], 1) == [4]
    assert _plan([0.02], 1) == [0]
    mid = _plan([0.3], 1)[0]
    assert 0 < mid < 4  # a few proposals pay, the later ones (0.3^j) do not


def test_load_fades_speculation_where_fixed_k_does_not() -> None:
    # 16 decodes: a step yields 16 tokens in ~0.1 s, so one more verified row must be nearly sure to pay
    assert _plan([0.6] * 16, 16) == [0] * 16
    assert sum(_plan([0.99] * 16, 16)) > 0
    assert _plan([0.6] * 16, 16, adaptive=False) == [4] * 16
    # the better request gets the proposals first
    taken = _plan([0.3, 0.95], 2)
    assert taken[1] >= taken[0] and taken[1] == 4


def test_hard_limits_hold_for_adaptive_and_fixed() -> None:
    for adaptive in (True, False):
        assert sum(_plan([0.99] * 3, 3, adaptive=adaptive, budget=5)) == 5
        one = _cpu_like(BatchShape.build(decode_contexts=[100]))
        assert _plan([0.99], 1, adaptive=adaptive, limit=one + 0.0065) == [2]  # the first costs 4 ms (two chunk rows), the next 2


def test_decode_to_verify_counts_a_k_plus_one_chunk() -> None:
    s = BatchShape.build(decode_contexts=[50, 100])
    decode_to_verify(s, 99, 3)
    want = BatchShape.build(chunks=[(99, 4)], decode_contexts=[50])
    want.num_sampled += 4
    assert s == want


def _run_copying(sched, r, steps: int, token_for) -> list[int]:
    """Steps of one decoding request whose next token is token_for(position); returns proposals per step."""
    taken = []
    for t in range(steps):
        out = sched.schedule(float(t))
        tokens, verified = {}, {}
        for s in out.scheduled:
            rid = s.request.request_id
            if s.spec_token_ids:
                base = s.request.num_tokens
                target = [token_for(base + i) for i in range(len(s.spec_token_ids) + 1)]
                n = 0
                while n < len(s.spec_token_ids) and s.spec_token_ids[n] == target[n]:
                    n += 1
                verified[rid] = target[:n + 1]
            elif s.needs_sample:
                tokens[rid] = token_for(s.request.num_tokens)
        taken.append(sum(len(s.spec_token_ids) for s in out.scheduled))
        sched.update(out, StepResult(tokens, verified_token_ids=verified), float(t))
    return taken


def test_a_request_stops_speculating_when_its_output_stops_copying_and_resumes_when_it_copies_again() -> None:
    period = list(range(100, 108))
    sched = make_scheduler(budget=64, speculative=SpeculativeConfig(num_speculative_tokens=4), step_time=_cpu_like)
    r = make_request("a", period * 3, max_tokens=400)
    sched.add_request(r)
    # copying phase: the output repeats the prompt's period; then noise nobody can predict; then copying again
    noise = [200 + (i * 7919) % 97 for i in range(1000)]

    copy = _run_copying(sched, r, 20, lambda pos: period[pos % 8])
    assert sum(copy[-10:]) >= 30, copy  # near k=4 every step
    noisy = _run_copying(sched, r, 40, lambda pos: noise[pos % 1000])
    assert sum(noisy[-20:]) <= 4, noisy  # speculation all but stops
    # back to copying: shadow proposals notice without anything being verified
    again = _run_copying(sched, r, 30, lambda pos: period[pos % 8])
    assert sum(again[-10:]) >= 30, again
