import math

import numpy as np
import pytest

from paceline.bench.metrics import RequestRecord, all_decoding_gaps, meets_slo, stats, summarize
from paceline.bench.server_metrics import (histogram, histogram_quantile, parse_prometheus, scheduling_delay,
                                           step_composition)


def rec(i, sent, times, prio=0, out=None, prompt=10, error=None):
    return RequestRecord(i, prompt, out or len(times), prio, sent, sent, list(times), (times[-1] if times else sent),
                         None, None, error)


def test_one_request_timeline():
    r = rec(0, 1.0, [1.5, 1.6, 1.7, 2.5, 2.6])
    assert r.ttft == pytest.approx(0.5)
    assert r.gaps == pytest.approx([0.1, 0.1, 0.8, 0.1])
    assert r.e2e == pytest.approx(1.6)
    assert r.tpot == pytest.approx((1.6 - 0.5) / 4)
    assert r.normalized_latency == pytest.approx(1.6 / 5)
    assert rec(1, 0.0, [0.3]).tpot is None


def test_stats_percentiles_by_linear_interpolation():
    s = stats(list(range(1, 101)))
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert s["max"] == 100 and s["count"] == 100
    assert stats([]) is None
    assert stats([7.0])["p99"] == 7.0


def test_summary_stalls_throughput_and_goodput():
    a = rec(0, 0.0, [0.5, 0.6, 0.7, 1.5, 1.6])  # one 0.8 s gap: a stall (median gap 0.1 -> threshold 0.5)
    b = rec(1, 1.0, [4.0, 4.1, 4.2, 4.3])  # TTFT 3 s
    s = summarize([a, b], ttft_slo=1.0, tbt_slo=0.5)
    assert s["completed"] == 2 and s["failed"] == 0
    assert s["duration_s"] == pytest.approx(4.3)
    assert s["ttft"]["mean"] == pytest.approx(1.75)
    assert s["tbt"]["count"] == 7
    assert s["tbt"]["p50"] == pytest.approx(0.1)
    assert s["stall_threshold_s"] == pytest.approx(0.5)
    assert s["stalls"] == {"count": 1, "total_s": pytest.approx(0.8)}
    assert s["output_throughput"] == pytest.approx(9 / 4.3)
    assert s["input_throughput"] == pytest.approx(20 / 4.3)
    assert s["request_throughput"] == pytest.approx(2 / 4.3)
    # a fails the TBT SLO (its p99 gap is its max, 0.8), b fails the TTFT SLO
    assert s["goodput"] == 0.0
    assert summarize([a, b], ttft_slo=1.0)["goodput"] == pytest.approx(1 / 4.3)
    assert summarize([a, b], tbt_slo=0.5)["goodput"] == pytest.approx(1 / 4.3)
    assert summarize([a, b])["goodput"] is None
    assert summarize([a, b], stall_threshold_s=0.05)["stalls"]["count"] == 7


def test_failed_requests_count_but_add_no_samples():
    good = rec(0, 0.0, [0.2, 0.3])
    bad = rec(1, 0.0, [], error="HTTP 500: boom")
    bad.end_s = None
    s = summarize([good, bad])
    assert s["completed"] == 1 and s["failed"] == 1
    assert s["errors"] == ["HTTP 500: boom"]
    assert s["ttft"]["count"] == 1 and s["tbt"]["count"] == 1


def test_incomplete_outputs_are_flagged():
    r = rec(0, 0.0, [0.2, 0.3], out=5)
    assert summarize([r])["incomplete_outputs"] == 1
    r.usage_completion_tokens = 5  # the server says it made 5: chunks merged tokens
    assert summarize([r])["incomplete_outputs"] == 0


def test_per_priority_breakdown_shares_the_run_duration():
    rs = [rec(0, 0.0, [0.1, 0.2], prio=0), rec(1, 0.0, [1.0, 2.0], prio=10), rec(2, 0.0, [1.0, 4.0], prio=10)]
    s = summarize(rs)
    per = s["per_priority"]
    assert set(per) == {"0", "10"}
    assert per["0"]["completed"] == 1 and per["10"]["completed"] == 2
    assert per["10"]["ttft"]["p50"] == pytest.approx(1.0)
    assert per["0"]["duration_s"] == per["10"]["duration_s"] == s["duration_s"] == pytest.approx(4.0)
    assert per["0"]["request_throughput"] + per["10"]["request_throughput"] == pytest.approx(s["request_throughput"])


def test_multi_token_chunks_give_zero_gaps():
    r = rec(0, 0.0, [0.5, 0.5, 0.5, 0.9])
    assert r.gaps == pytest.approx([0.0, 0.0, 0.4])


def test_meets_slo_uses_nearest_rank_p99_of_the_request():
    times = np.cumsum([0.1] + [0.01] * 199 + [1.0])  # 200 gaps: one 1.0 s gap is above the 99th percentile
    r = rec(0, 0.0, times.tolist())
    assert meets_slo(r, None, 0.02)
    times = np.cumsum([0.1] + [0.01] * 197 + [1.0, 1.0, 1.0])  # three long gaps reach the p99 rank
    assert not meets_slo(rec(0, 0.0, times.tolist()), None, 0.02)


def test_all_decoding_window():
    a = rec(0, 0.0, [1.0, 1.1, 1.2, 1.3, 1.4])
    b = rec(1, 0.0, [1.15, 1.25, 1.35, 1.45])  # all decoding from 1.15 to 1.4
    gaps = all_decoding_gaps([a, b])
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.1])  # a: 1.2-1.3, 1.3-1.4; b: 1.15-1.25, 1.25-1.35


PROM = """# HELP paceline:step_decode_tokens_total x
# TYPE paceline:step_decode_tokens_total counter
paceline:step_decode_tokens_total{model_name="m"} 120.0
paceline:request_queue_time_seconds_bucket{le="0.1",model_name="m"} 2.0
paceline:request_queue_time_seconds_bucket{le="0.5",model_name="m"} 6.0
paceline:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 8.0
paceline:request_queue_time_seconds_count{model_name="m"} 8.0
paceline:request_queue_time_seconds_sum{model_name="m"} 2.4
"""


def test_prometheus_parsing_and_histogram_quantiles():
    snap = parse_prometheus(PROM)
    assert snap["paceline:step_decode_tokens_total"] == 120.0
    b = histogram(snap, "paceline:request_queue_time_seconds")
    assert b == [(0.1, 2.0), (0.5, 6.0), (math.inf, 8.0)]
    assert histogram_quantile(b, 0.5) == pytest.approx(0.1 + 0.4 * (4 - 2) / 4)  # 4th of 8, inside (0.1, 0.5]
    assert histogram_quantile(b, 0.25) == pytest.approx(0.1)
    assert histogram_quantile(b, 0.99) == pytest.approx(0.5)  # in +Inf: the last finite bound
    delay = scheduling_delay({}, snap)
    assert delay["p50"] == pytest.approx(0.3) and delay["mean"] == pytest.approx(0.3) and delay["count"] == 8
    assert scheduling_delay(snap, snap) is None  # nothing new during the run
    assert scheduling_delay({}, {"other_total": 1.0}) is None
    vllm = parse_prometheus(PROM.replace("paceline:request_queue", "vllm:request_queue"))  # vLLM's own histogram
    assert scheduling_delay({}, vllm)["p50"] == pytest.approx(0.3)


def test_step_composition_differences_counters():
    snaps = [(0.0, {"paceline:step_decode_tokens_total": 10.0, "paceline:step_prefill_tokens_total": 0.0,
                    "paceline:engine_steps_total": 1.0}),
             (1.0, {"paceline:step_decode_tokens_total": 50.0, "paceline:step_prefill_tokens_total": 300.0,
                    "paceline:engine_steps_total": 11.0})]
    (row,) = step_composition(snaps)
    assert row["decode_tokens"] == 40 and row["prefill_tokens"] == 300
    assert row["decode_per_step"] == pytest.approx(4.0) and row["prefill_per_step"] == pytest.approx(30.0)
    assert step_composition([(0.0, {}), (1.0, {"x": 1.0})]) == []
