"""EngineMetrics from step stats, scheduler stats and request timelines."""
from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from paceline.engine.metrics import EngineMetrics
from paceline.request import Request
from paceline.sampling import SamplingParams


def samples(m: EngineMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            reason = s.labels.get("finished_reason")
            out[s.name + (f"{{{reason}}}" if reason else "")] = s.value
    return out


def stats(**kw) -> SimpleNamespace:
    base = dict(num_running=1, num_waiting=0, num_swapped=0, num_blocks=10, num_used_blocks=2, kv_usage=0.2,
                prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0)
    return SimpleNamespace(**{**base, **kw})


def output(req: Request, new: int, finished: bool = False) -> SimpleNamespace:
    return SimpleNamespace(request_id=req.request_id, request=req, new_token_ids=[1] * new, finished=finished,
                           finish_reason="length" if finished else None, num_prompt_tokens=req.num_prompt_tokens,
                           num_output_tokens=req.num_output_tokens)


def test_timeline_histograms_counters_and_stalls():
    m = EngineMetrics("m")
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=4), arrival_time=10.0)
    req.first_scheduled_time = 10.5
    decode = SimpleNamespace(num_decode_tokens=1, num_prefill_tokens=0, duration=0.01)
    engine = SimpleNamespace(last_step=decode, stats=lambda: stats())
    for _ in range(5):
        m.on_step(engine, [], True)  # median decode step: 10 ms, so a gap over 50 ms is a stall
    for t in (11.0, 11.01, 11.02):
        req.append_token(1, t)
    m.on_step(engine, [output(req, 3)], True)
    req.append_token(1, 11.2)  # a 180 ms gap
    req.finish_time = 11.2
    m.on_step(SimpleNamespace(last_step=None, stats=lambda: stats(num_running=0, num_used_blocks=0, kv_usage=0.0,
                                                                   num_preemptions=2)),
              [output(req, 1, finished=True)], True)
    s = samples(m)
    assert s["paceline:time_to_first_token_seconds_count"] == 1
    assert abs(s["paceline:time_to_first_token_seconds_sum"] - 1.0) < 1e-9
    assert s["paceline:inter_token_latency_seconds_count"] == 3
    assert s["paceline:stalls_total"] == 1 and abs(s["paceline:stall_seconds_total"] - 0.18) < 1e-9
    assert abs(s["paceline:request_queue_time_seconds_sum"] - 0.5) < 1e-9
    assert abs(s["paceline:e2e_request_latency_seconds_sum"] - 1.2) < 1e-9
    assert s["paceline:prompt_tokens_total"] == 3 and s["paceline:generation_tokens_total"] == 4
    assert s["paceline:request_success_total{length}"] == 1
    assert s["paceline:step_decode_tokens_total"] == 6 and s["paceline:engine_steps_total"] == 6
    assert s["paceline:num_preemptions_total"] == 2  # running totals become counter increments
    assert s["paceline:kv_cache_used_blocks"] == 0 and s["paceline:num_requests_running"] == 0


def test_idle_update_does_not_count_the_last_step_again():
    m = EngineMetrics("m")
    step = SimpleNamespace(num_decode_tokens=2, num_prefill_tokens=30, duration=0.05)
    engine = SimpleNamespace(last_step=step, stats=lambda: stats())
    m.on_step(engine, [], True)
    m.on_step(engine, [], False)
    s = samples(m)
    assert s["paceline:iteration_tokens_total_count"] == 1 and s["paceline:iteration_tokens_total_sum"] == 32
    assert s["paceline:step_prefill_tokens_total"] == 30
