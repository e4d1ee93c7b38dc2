import pytest

from paceline.bench.capacity import capacity_from_probes, judge, parse_slo, search_capacity


def synthetic(knee: float, log: list):
    """A monotone system: p99 TBT 20 ms below the knee, growing fast above it; TTFT grows too."""
    def probe(rate: float) -> dict:
        log.append(rate)
        over = max(0.0, rate - knee)
        return {"failed": 0, "tbt": {"p99": 0.02 + 0.5 * over}, "ttft": {"p50": 0.2 + 3 * over},
                "scheduling_delay": None}
    return probe


@pytest.mark.parametrize("knee,start", [(1.3, 0.5), (0.2, 2.0), (3.7, 0.25)])
def test_capacity_converges_on_a_monotone_system(knee, start):
    log = []
    res = search_capacity(synthetic(knee, log), tbt_slo_s=0.1, start_rate=start, max_probes=12, rel_tol=0.05)
    # the SLO flips at knee + 0.16 (p99 TBT reaches 100 ms); the median-TTFT rule at knee + 0.6
    assert res.capacity <= knee + 0.16
    assert res.capacity >= (knee + 0.16) * 0.95 - 1e-9
    assert len(log) <= 12
    assert all(v.passed == (v.rate <= knee + 0.16) for v in res.verdicts)


def test_probe_budget_is_respected_and_probes_are_shared():
    log, cache = [], {}
    probe = synthetic(1.0, log)
    a = search_capacity(probe, 0.1, start_rate=0.5, max_probes=3, cache=cache)
    assert len(log) == 3 and a.capacity > 0
    again = search_capacity(probe, 0.1, start_rate=0.5, max_probes=2, cache=cache)
    assert log[:3] == [v.rate for v in again.verdicts[:3]]  # the same path again costs nothing...
    assert len(log) == 5  # ...and the budget buys 2 new probes beyond it
    assert again.capacity >= a.capacity
    b = search_capacity(probe, 1.0, start_rate=0.5, max_probes=6, cache=cache)
    assert b.capacity >= a.capacity  # a looser SLO never has less capacity


def test_capacity_over_every_probe_uses_the_other_searches_probes():
    """The chat-5 shape: the strict search stops at 0.5 (1.0 failed, on the 2 s rule), then the relaxed search's
    probes at 0.75-0.94 also meet the strict SLO; judged over every probe the strict capacity is 0.94."""
    def summary(p99: float, delay: float) -> dict:
        return {"failed": 0, "tbt": {"p99": p99}, "scheduling_delay": {"p50": delay}}
    probes = {0.25: summary(0.112, 0.1), 0.5: summary(0.137, 0.2), 1.0: summary(0.161, 5.0),
              0.75: summary(0.138, 0.5), 0.875: summary(0.156, 1.2), 0.9375: summary(0.161, 1.5)}
    strict = capacity_from_probes(probes, 0.190, slo_name="strict")
    assert strict.capacity == 0.9375 and not strict.is_lower_bound
    assert [v.rate for v in strict.verdicts] == sorted(probes)
    assert capacity_from_probes(probes, 0.150).capacity == 0.75  # 0.875 fails on TBT: nothing above it counts
    # a pass above a failure does not count: capacity is the highest pass below the lowest failure
    assert capacity_from_probes({0.5: summary(0.3, 0.1), 1.0: summary(0.1, 0.1)}, 0.19).capacity == 0.0
    assert capacity_from_probes({}, 0.19).capacity == 0.0


def test_zero_capacity_when_even_the_slowest_rate_fails():
    res = search_capacity(lambda r: {"failed": 0, "tbt": {"p99": 1.0}, "ttft": {"p50": 0.1}}, 0.1, start_rate=1.0,
                          max_probes=20, min_rate=0.1)
    assert res.capacity == 0.0 and all(not v.passed for v in res.verdicts) and not res.is_lower_bound
    always = search_capacity(lambda r: {"failed": 0, "tbt": {"p99": 0.01}, "ttft": {"p50": 0.1}}, 0.1, start_rate=1.0,
                             max_probes=3)
    assert always.capacity == 4.0 and always.is_lower_bound  # 1, 2, 4 all passed: at least 4


def test_judge_prefers_scheduling_delay_and_fails_on_errors():
    s = {"failed": 0, "tbt": {"p99": 0.05}, "ttft": {"p50": 5.0}, "scheduling_delay": {"p50": 1.0}}
    v = judge(1.0, s, 0.1)
    assert v.passed and v.delay_source == "scheduling" and v.delay_s == 1.0
    v = judge(1.0, {**s, "scheduling_delay": None}, 0.1)
    assert not v.passed and v.delay_source == "ttft"  # median TTFT 5 s > 2 s
    assert not judge(1.0, {**s, "failed": 1}, 0.1).passed
    assert not judge(1.0, {**s, "tbt": {"p99": 0.2}}, 0.1).passed


def test_parse_slo():
    assert parse_slo("strict", 0.04) == ("strict", pytest.approx(0.2))
    assert parse_slo("relaxed", 0.04) == ("relaxed", pytest.approx(1.0))
    assert parse_slo("250", None) == ("250ms", 0.25)
    for bad in ("fast", "-3", "0"):
        with pytest.raises(ValueError):
            parse_slo(bad, 0.04)
    with pytest.raises(ValueError):
        parse_slo("strict", None)


def test_ttft_excess_judges_waiting_not_prefill_speed():
    from paceline.bench.capacity import ttft_excess
    from paceline.bench.metrics import RequestRecord
    # 1000-token prompts on a server that prefills 250 tok/s alone: 4 s of every TTFT is the prompt itself
    recs = [RequestRecord(i, 1000, 2, 0, 0.0, 0.0, [4.0 + w, 4.1 + w], 4.1 + w) for i, w in enumerate([0.5, 1.0, 3.0])]
    ex = ttft_excess(recs, 250.0)
    assert ex["p50"] == pytest.approx(1.0)
    s = {"failed": 0, "tbt": {"p99": 0.05}, "ttft": {"p50": 5.0}, "scheduling_delay": None, "ttft_excess": ex}
    v = judge(1.0, s, 0.1)
    assert v.passed and v.delay_source == "ttft-excess" and v.delay_s == pytest.approx(1.0)
