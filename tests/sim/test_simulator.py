"""The event loop driving the real Scheduler: ordering, exact timelines, routing, no change to core/."""
import subprocess
import sys

import pytest

from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.scheduler import Scheduler
from paceline.sim import simulator as simmod
from paceline.sim.cost_model import FEATURES, BatchShape, ProfiledCostModel
from paceline.sim.simulator import ARRIVAL, STEP_DONE, Simulator
from paceline.sim.workloads import SimRequest


class ConstantCost:
    def __init__(self, d: float) -> None:
        self.d = d

    def step_time(self, s: BatchShape) -> float:
        return self.d


def linear_cost() -> ProfiledCostModel:
    coef = dict.fromkeys(FEATURES, 0.0)
    coef.update(constant=0.003, requests=1e-4, prefill_tokens=2e-5, decodes=5e-5, prefill_attn_pairs=1e-8, decode_context=3e-7, sampled=1e-5)
    return ProfiledCostModel(coef)


def make_sim(cost, budget=512, replicas=1, router="round-robin", num_blocks=1024, policy="stall-free"):
    return Simulator(cost, SchedulerConfig(policy=policy, max_num_batched_tokens=budget), CacheConfig(),
                     num_blocks, num_replicas=replicas, router=router)


def test_single_request_timeline_is_the_cost_models_sums():
    cost = linear_cost()
    prompt, out, budget = 100, 5, 32
    result = make_sim(cost, budget=budget).run([SimRequest(0, 0.0, prompt, out)])
    rec = result.requests[0]
    # prompt in chunks of the budget, the last chunk samples the first token; then one decode per token
    t, start = 0.0, 0
    while start < prompt:
        c = min(budget, prompt - start)
        s = BatchShape()
        s.add_chunk(start, c, sampled=start + c == prompt)
        t += cost.step_time(s)
        start += c
    expected = [t]
    for i in range(1, out):
        s = BatchShape()
        s.add_decode(prompt + i)  # the decode of output token i attends to the prompt and i tokens so far
        t += cost.step_time(s)
        expected.append(t)
    assert rec.token_times == expected  # exact: the same float sums in the same order
    assert rec.first_scheduled_s == 0.0
    assert rec.end_s == expected[-1]
    assert [st.num_prefill_tokens for st in result.steps] == [32, 32, 32, 4, 0, 0, 0, 0]


def test_events_in_time_order_with_deterministic_ties():
    def run():
        sim = make_sim(ConstantCost(1.0))
        sim.event_log = []
        # request 1 arrives exactly when the first step ends: the completion is handled first
        sim.run([SimRequest(0, 0.0, 20, 3), SimRequest(1, 1.0, 20, 2), SimRequest(2, 2.5, 20, 2), SimRequest(3, 2.5, 20, 1)])
        return sim.event_log

    log = run()
    times = [t for t, _, _ in log]
    assert times == sorted(times)
    assert log[:3] == [(0.0, ARRIVAL, "0"), (1.0, STEP_DONE, "replica0"), (1.0, ARRIVAL, "1")]
    same = [e for e in log if e[0] == 2.5]
    assert [e[2] for e in same] == ["2", "3"]  # equal arrival times: workload order
    assert log == run()


def test_arrival_at_step_end_joins_the_next_step():
    result = make_sim(ConstantCost(1.0)).run([SimRequest(0, 0.0, 20, 3), SimRequest(1, 1.0, 20, 2)])
    r0, r1 = result.requests
    assert r0.token_times == [1.0, 2.0, 3.0]
    assert r1.first_scheduled_s == 1.0 and r1.token_times == [2.0, 3.0]
    assert [(s.start, s.num_decode_tokens, s.num_prefill_tokens) for s in result.steps][:2] == [(0.0, 0, 20), (1.0, 1, 20)]


def test_round_robin_splits_arrivals_in_turn():
    reqs = [SimRequest(i, 0.1 * i, 30, 4) for i in range(12)]
    result = make_sim(ConstantCost(0.01), replicas=4).run(reqs)
    assert [r.replica for r in result.requests] == [i % 4 for i in range(12)]
    assert all(r.ok and len(r.token_times) == 4 for r in result.requests)
    assert {s.replica for s in result.steps} == {0, 1, 2, 3}


def test_least_outstanding_avoids_the_busy_replica():
    # request 0 is long and keeps replica 0 busy; short requests arrive one at a time and finish before the next
    reqs = [SimRequest(0, 0.0, 30, 1000)] + [SimRequest(i, 1.0 * i, 30, 2) for i in range(1, 6)]
    result = make_sim(ConstantCost(0.01), replicas=2, router="least-outstanding").run(reqs)
    assert [r.replica for r in result.requests] == [0, 1, 1, 1, 1, 1]
    rr = make_sim(ConstantCost(0.01), replicas=2, router="round-robin").run(reqs)
    assert [r.replica for r in rr.requests] == [0, 1, 0, 1, 0, 1]


def test_request_larger_than_the_cache_is_rejected_not_hung():
    result = make_sim(ConstantCost(0.01), num_blocks=4).run([SimRequest(0, 0.0, 100, 10), SimRequest(1, 0.0, 20, 5)])
    assert [r.ok for r in result.requests] == [False, True]
    assert result.requests[0].error.startswith("rejected")


def test_every_policy_finishes_every_request():
    reqs = [SimRequest(i, 0.05 * i, 40 + 13 * i, 3 + i % 4, priority=i % 2) for i in range(20)]
    for policy in ("stall-free", "prefill-first", "orca", "static"):
        result = make_sim(linear_cost(), budget=64, policy=policy, num_blocks=64).run(reqs)
        assert all(len(r.token_times) == r.output_tokens for r in result.requests), policy


def test_drives_the_real_scheduler_unmodified():
    assert simmod.Scheduler is Scheduler
    sim = make_sim(ConstantCost(0.01))
    sim.run([SimRequest(0, 0.0, 10, 2)])
    assert type(sim.replicas[0].scheduler) is Scheduler
    for name in ("schedule", "update", "add_request", "has_unfinished"):
        assert getattr(Scheduler, name).__module__ == "paceline.core.scheduler"


def test_core_and_sim_do_not_import_torch():
    code = ("import sys, paceline.core.scheduler, paceline.sim.simulator, paceline.sim.cost_model, paceline.sim.cli; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_arguments_raise_value_error():
    with pytest.raises(ValueError):
        make_sim(ConstantCost(1.0), router="random")
    with pytest.raises(ValueError):
        make_sim(ConstantCost(1.0), replicas=0)


def test_max_step_ms_keeps_simulated_steps_under_the_limit_and_its_work_done():
    cost = linear_cost()
    workload = [SimRequest(i, 0.02 * i, 1500 + 100 * i, 40) for i in range(6)]  # overlapping: chunks beside decodes
    plain = make_sim(cost, budget=1024).run(workload)
    cfg = SchedulerConfig(policy="stall-free", max_num_batched_tokens=1024, max_step_ms=12.0)
    timed = Simulator(cost, cfg, CacheConfig(), 1024).run(workload)
    assert max(s.duration for s in plain.steps) > 0.012
    # predicted by the same model that times them; steps of prompt chunks alone keep only the token budget
    assert max(s.duration for s in timed.steps if s.num_decode_tokens) <= 0.012 + 1e-12
    assert max(s.duration for s in timed.steps if s.num_decode_tokens) < max(s.duration for s in plain.steps if s.num_decode_tokens)
    assert sum(s.num_prefill_tokens for s in timed.steps) == sum(s.num_prefill_tokens for s in plain.steps)
    assert [len(r.token_times) for r in timed.requests] == [40] * 6
