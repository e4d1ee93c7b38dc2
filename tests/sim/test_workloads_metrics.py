"""Workload shapes, metric math on hand-made timelines, capacity search, and the CLI end to end."""
import argparse
import json

import numpy as np
import pytest

from paceline.sim.capacity import search_capacity
from paceline.sim.metrics import summarize
from paceline.sim.simulator import RequestRecord, SimResult, StepRecord
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


def test_metrics_on_a_hand_made_timeline():
    recs = [RequestRecord("a", 0, 0.0, 10, 4, first_scheduled=0.5, token_times=[1.0, 1.1, 1.2, 2.2], finish_time=2.2, finish_reason="length"),
            RequestRecord("b", 0, 1.0, 10, 2, first_scheduled=1.0, token_times=[1.5, 1.6], finish_time=1.6, finish_reason="length")]
    steps = [StepRecord(0, 0.0, 0.1, 2, 0, 2)] * 3 + [StepRecord(0, 0.0, 0.5, 1, 100, 2)]
    s = summarize(SimResult(recs, steps, 0.01, 1), tbt_slo_s=0.5)
    assert s.ttft["p50"] == pytest.approx(0.75) and s.ttft["max"] == pytest.approx(1.0)
    assert s.tbt["n"] == 4 and s.tbt["max"] == pytest.approx(1.0)
    assert s.tpot["mean"] == pytest.approx(((2.2 - 1.0) / 3 + 0.1) / 2)
    assert s.scheduling_delay["p50"] == pytest.approx(0.25)
    assert s.median_decode_step_s == pytest.approx(0.1)
    assert s.num_stalls == 1 and s.stall_time_s == pytest.approx(1.0)  # the 1.0 s gap > 5 x 0.1 s
    assert s.goodput == pytest.approx(1 / 2.2)  # only b kept every gap within 0.5 s
    assert not s.meets(0.5) and s.meets(1.0)


def test_capacity_search_brackets_the_threshold():
    class Fake:
        def __init__(self, rate):
            self.rate = rate

        def meets(self, slo, delay):
            return self.rate <= 3.7 * slo

    calls = []
    res = search_capacity(lambda r: calls.append(r) or Fake(r), 1.0, start_rate=1.0, rel_tol=0.01)
    assert 3.7 * 0.99 <= res.capacity <= 3.7
    assert len(calls) == len(set(calls))
    cache = {}
    search_capacity(lambda r: Fake(r), 1.0, cache=cache)
    n = len(cache)
    search_capacity(lambda r: Fake(r), 1.0, cache=cache)
    assert len(cache) == n  # the second search reuses every run
    assert search_capacity(lambda r: Fake(0 * r + 1e9), 1.0).capacity == 0.0


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


def test_bench_summary_agrees_with_ours():
    from paceline.sim.metrics import bench_summary
    recs = [RequestRecord("0", 0, 0.0, 10, 4, first_scheduled=0.5, token_times=[1.0, 1.1, 1.2, 2.2], finish_time=2.2, finish_reason="length"),
            RequestRecord("1", 0, 1.0, 10, 2, first_scheduled=1.0, token_times=[1.5, 1.6], finish_time=1.6, finish_reason="length")]
    result = SimResult(recs, [StepRecord(0, 0.0, 0.1, 2, 0, 2)], 0.01, 1)
    ours, theirs = summarize(result), bench_summary(result)
    assert theirs["completed"] == 2
    for k in ("ttft", "tbt"):
        assert theirs[k]["p50"] == pytest.approx(getattr(ours, k)["p50"])
    assert theirs["stalls"]["count"] == ours.num_stalls == 1
