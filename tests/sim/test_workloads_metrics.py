"""Workload shapes, metric math on hand-made timelines, capacity search, and the CLI end to end."""
import argparse
import json

import numpy as np
import pytest

from paceline.bench.capacity import judge, search_capacity
from paceline.bench.metrics import RequestRecord, RunResult
from paceline.bench.report import run_dict
from paceline.config import CacheConfig, SchedulerConfig
from paceline.sim.metrics import sim_run_dict
from paceline.sim.simulator import SimResult, Simulator, StepRecord
from paceline.sim.workloads import generate, load_workload, requests_for


def test_datacenter_workload_lengths_follow_their_median_and_p90():
    reqs = generate(load_workload("sharegpt"), 5.0, 4000, seed=3)
    p = np.array([r.prompt_len for r in reqs])
    o = np.array([r.output_len for r in reqs])
    assert np.median(p) == pytest.approx(1730, rel=0.06)
    assert np.percentile(p, 90) == pytest.approx(5696, rel=0.08)
    assert np.median(o) == pytest.approx(415, rel=0.06)
    assert (p + o <= 16384).all()
    gaps = np.diff([0.0] + [r.arrival for r in reqs])
    assert gaps.mean() == pytest.approx(1 / 5.0, rel=0.06)
    arxiv = generate(load_workload("arxiv"), 1.0, 2000, seed=3)
    assert np.median([r.prompt_len for r in arxiv]) == pytest.approx(7059, rel=0.06)


def test_benchmark_workloads_give_the_benchmarks_requests():
    from paceline.bench import workload as bw
    ours = requests_for("chat", 2.0, 50, seed=7)
    theirs = bw.generate(bw.load_workload("chat"), rate=2.0, num_requests=50, seed=7)
    assert [(r.arrival, r.prompt_len, r.output_len, r.priority) for r in ours] == \
        [(t.arrival_s, t.prompt_tokens, t.output_tokens, t.priority) for t in theirs]
    assert {r.priority for r in requests_for("bursty-priority", 2.0, 200)} == {0, 10}
    with pytest.raises(ValueError):
        load_workload("nope")


def record(index, arrival, prompt, out, first_scheduled, token_times):
    """A simulated request's record: sent at its arrival, ended with its last token."""
    return RequestRecord(index, prompt, out, scheduled_s=arrival, sent_s=arrival, token_times=token_times,
                         end_s=token_times[-1], first_scheduled_s=first_scheduled)


def test_metrics_on_a_hand_made_timeline():
    recs = [record(0, 0.0, 10, 4, 0.5, [1.0, 1.1, 1.2, 2.2]), record(1, 1.0, 10, 2, 1.0, [1.5, 1.6])]
    steps = [StepRecord(0, 0.0, 0.1, 2, 0, 2)] * 3 + [StepRecord(0, 0.0, 0.5, 1, 100, 2)]
    run = sim_run_dict(SimResult(recs, steps, 0.01, 1), tbt_slo=0.5)
    s = run["summary"]
    assert s["ttft"]["p50"] == pytest.approx(0.75) and s["ttft"]["max"] == pytest.approx(1.0)
    assert s["tbt"]["count"] == 4 and s["tbt"]["max"] == pytest.approx(1.0)
    assert s["tpot"]["mean"] == pytest.approx(((2.2 - 1.0) / 3 + 0.1) / 2)
    assert s["scheduling_delay"]["p50"] == pytest.approx(0.25)
    assert run["simulation"]["median_decode_step_s"] == pytest.approx(0.1)
    assert s["stalls"]["count"] == 1 and s["stalls"]["total_s"] == pytest.approx(1.0)  # the 1.0 s gap > 5 x 0.1 s
    assert s["goodput"] == pytest.approx(1 / 2.2)  # only b kept every gap within 0.5 s
    assert not judge(1.0, s, 0.5).passed and judge(1.0, s, 1.0).passed


def test_capacity_search_brackets_the_threshold():
    def probe(rate):  # p99 TBT grows with the rate: the SLO of 1 s holds up to 3.7 req/s
        calls.append(rate)
        return {"failed": 0, "tbt": {"p99": rate / 3.7}, "scheduling_delay": {"p50": 0.0}}

    calls = []
    res = search_capacity(probe, 1.0, start_rate=1.0, rel_tol=0.01, max_probes=24)
    assert 3.7 * 0.99 <= res.capacity <= 3.7
    assert len(calls) == len(set(calls))
    cache = {}
    search_capacity(probe, 1.0, start_rate=1.0, cache=cache)
    n = len(cache)
    search_capacity(probe, 1.0, start_rate=1.0, cache=cache)
    assert len(cache) == n  # the second search reuses every run
    assert search_capacity(lambda r: probe(1e9), 1.0, start_rate=1.0).capacity == 0.0


def test_cli_simulate_and_capacity(tmp_path, capsys):
    from paceline.sim.cli import add_parsers
    parser = argparse.ArgumentParser()
    add_parsers(parser.add_subparsers(dest="command", required=True))
    out = tmp_path / "r.json"
    args = parser.parse_args(["simulate", "--workload", "chat", "--rate", "4", "--num-requests", "40", "--replicas", "2",
                              "--router", "least-outstanding", "--out", str(out), "--plots", str(tmp_path)])
    args.func(args)
    text = capsys.readouterr().out
    assert "40/40 requests finished" in text and "| TBT |" in text
    data = json.loads(out.read_text())
    assert len(data["requests"]) == 40 and {r["replica"] for r in data["requests"]} == {0, 1}
    assert (tmp_path / "tbt_cdf.png").stat().st_size > 0
    args = parser.parse_args(["simulate", "capacity", "--workload", "chat", "--num-requests", "40", "--tbt-slo", "100",
                              "--rate", "8", "--rel-tol", "0.25"])
    args.func(args)
    assert "| 100 |" in capsys.readouterr().out
    args = parser.parse_args(["profile", "--quick", "--out", str(tmp_path / "p.json")])
    assert args.quick and callable(args.func)


def test_simulator_and_benchmark_give_identical_summaries_of_one_timeline():
    """The simulator's report of a run equals the benchmark's report of a client that saw the same timeline:
    every field of the summary, per priority class included."""
    sim = Simulator(ConstantCostish(), SchedulerConfig(max_num_batched_tokens=256, scheduling_policy="priority"),
                    CacheConfig(), num_blocks=400)
    result = sim.run(requests_for("bursty-priority", 3.0, 40, seed=5))
    simulated = sim_run_dict(result, ttft_slo=2.0, tbt_slo=0.2)
    # the timeline as plain numbers, then the records a benchmark client builds from it (client.run_async)
    timeline = [(r.index, r.prompt_tokens, r.output_tokens, r.priority, r.sent_s, list(r.token_times), r.end_s,
                 r.first_scheduled_s) for r in result.requests]
    records = []
    for index, prompt, out, priority, arrival, times, end, _ in timeline:
        rec = RequestRecord(index, prompt, out, priority, arrival)
        rec.sent_s, rec.token_times, rec.end_s = arrival, times, end
        rec.usage_prompt_tokens, rec.usage_completion_tokens = prompt, len(times)  # the server's `usage`
        records.append(rec)
    # what the server's queue-time histogram would say, were it exact
    from paceline.bench.metrics import stats
    delay = stats([first - arrival for _, _, _, _, arrival, _, _, first in timeline if first is not None])
    measured = run_dict("simulated", "", None, RunResult(records, 0.0, 0.0, [], delay), ttft_slo=2.0, tbt_slo=0.2,
                        stall_threshold_s=simulated["summary"]["stall_threshold_s"])
    assert simulated["summary"]["completed"] == 40 and set(simulated["summary"]["per_priority"]) == {"0", "10"}
    assert simulated["summary"]["stalls"]["count"] > 0 and simulated["summary"]["goodput"] is not None
    assert measured["summary"] == simulated["summary"]


class ConstantCostish:
    """Steps cost a constant plus a little per token, so prompt chunks take longer than decodes (and stall)."""

    def step_time(self, s) -> float:
        return 0.01 + 2e-4 * s.num_tokens
