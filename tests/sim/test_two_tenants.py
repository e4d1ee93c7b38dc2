"""The two-tenants workload (issue 15): clients on the requests, the heavy client's in-flight cap kept by the
simulator as the benchmark client keeps it, the fairness numbers of the report, and the point of it all: fair
share with time slices gives the light client its first token far sooner than fcfs does."""
from __future__ import annotations

import pytest

from paceline.bench.client import Endpoint, request_body
from paceline.bench.metrics import RequestRecord, fairness, jain_index, max_min_shares
from paceline.bench.report import client_table
from paceline.bench.workload import RequestSpec
from paceline.config import CacheConfig, SchedulerConfig
from paceline.sim.metrics import sim_run_dict
from paceline.sim.simulator import Simulator
from paceline.sim.workloads import generate, load_workload


class Cost:
    """20 ms a step plus a little per token: a few seats decoding long outputs keep the light client waiting."""

    def step_time(self, s) -> float:
        return 0.02 + 1e-4 * s.num_tokens


def test_the_workload_names_its_clients_and_caps_the_heavy_one():
    spec = load_workload("two-tenants")
    assert spec.in_flight_caps() == {"heavy": 16}
    reqs = generate(spec, 11.0, 1100, seed=0)
    heavy = [r for r in reqs if r.client == "heavy"]
    light = [r for r in reqs if r.client == "light"]
    assert len(heavy) + len(light) == 1100 and 8 <= len(heavy) / len(light) <= 12.5  # 10x the request rate
    assert min(r.output_len for r in heavy) > max(r.output_len for r in light)
    body = request_body(Endpoint("http://x"), "m", RequestSpec(0, 0.0, 4, 4, client="light"), [1, 2])
    assert body["user"] == "light"
    assert "user" not in request_body(Endpoint("http://x"), "m", RequestSpec(0, 0.0, 4, 4), [1, 2])


def run(policy: str, **kw) -> dict:
    spec = load_workload("two-tenants")
    sim = Simulator(Cost(), SchedulerConfig(max_num_seqs=4, scheduling_policy=policy, **kw), CacheConfig(),
                    num_blocks=2000, num_host_blocks=2000)
    result = sim.run(generate(spec, 2.2, 66, seed=1), in_flight_caps=spec.in_flight_caps())
    # the cap: never more than 16 heavy requests between send and end
    events = sorted([(r.sent_s, 1) for r in result.requests if r.client == "heavy"]
                    + [(r.end_s, -1) for r in result.requests if r.client == "heavy"])
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak == 16
    return sim_run_dict(result, workload=spec.name)


def test_fair_with_time_slices_serves_the_light_client_first_tokens_sooner():
    fcfs = run("fcfs")
    fair = run("fair", time_slice_tokens=16, preemption_mode="swap")
    light = [x["summary"]["per_client"]["light"]["ttft"]["p99"] for x in (fcfs, fair)]
    assert light[1] < 0.25 * light[0]
    assert fair["simulation"]["preemption_counts"]["time_slice_preemptions"] > 0
    assert fcfs["simulation"]["preemption_counts"]["preemptions"] == 0
    table = client_table(fair)
    assert "Jain's fairness index" in table and "| light |" in table and "by time slice" in table


def test_max_min_shares_and_jain():
    assert max_min_shares(100.0, {"light": 10.0, "heavy": 500.0}) == {"light": 10.0, "heavy": 90.0}
    assert max_min_shares(100.0, {"a": 80.0, "b": 80.0}) == {"a": 50.0, "b": 50.0}
    assert jain_index([1.0, 1.0]) == 1.0
    assert jain_index([1.0, 0.0]) == pytest.approx(0.5)


def test_fairness_of_a_starved_light_client():
    # the light client asked for 20 tokens in the window and got 5; the heavy client took the rest of 100
    heavy = RequestRecord(0, 10, 200, 0, 0.0, 0.0, [0.1 * i for i in range(1, 96)], 20.0, client="heavy")
    light = RequestRecord(1, 10, 20, 0, 0.0, 9.6, [9.7, 9.8, 9.9, 10.0, 10.0], 12.0, client="light")
    light.token_times += [10.5] * 15  # after the window (it ends at the last send, 9.6 s)
    f = fairness([heavy, light])
    assert f["share_ratio"]["light"] == 0.0  # nothing of it arrived by 9.6 s
    assert f["jain_index"] == pytest.approx(0.5)
