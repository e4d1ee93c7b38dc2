import json

import pytest
from fake_server import FakeServer

from paceline.bench.client import Endpoint, request_body, run, tokens_in_chunk
from paceline.bench.metrics import summarize
from paceline.bench.workload import RequestSpec

TTFT, GAP, STALL = 0.1, 0.03, 0.3


@pytest.fixture(scope="module")
def server():
    with FakeServer(ttft=TTFT, gap=GAP, stall=STALL, stall_priority=7) as s:
        yield s


def test_client_records_the_servers_timeline(server):
    reqs = [RequestSpec(0, 0.0, 12, 10, 0), RequestSpec(1, 0.05, 8, 6, 7), RequestSpec(2, 0.1, 5, 1, 0)]
    res = run(Endpoint(server.url), reqs, [[1] * 12, [2] * 8, [3] * 5], progress=False, scrape_interval=0.1)
    a, b, c = res.records
    assert all(r.ok for r in res.records)
    assert [len(r.token_times) for r in res.records] == [10, 6, 1]
    assert [r.usage_completion_tokens for r in res.records] == [10, 6, 1]
    assert [r.usage_prompt_tokens for r in res.records] == [12, 8, 5]
    assert b.sent_s == pytest.approx(0.05, abs=0.05)  # sent at its arrival time
    for r in res.records:
        assert r.ttft == pytest.approx(TTFT, abs=0.06)
    assert sum(a.gaps) == pytest.approx(9 * GAP, abs=0.06)
    assert max(b.gaps) == pytest.approx(GAP + STALL, abs=0.06)  # the injected stall, between tokens 3 and 4
    s = summarize(res.records, stall_threshold_s=0.2)
    assert s["stalls"]["count"] == 1
    assert s["tbt"]["p50"] == pytest.approx(GAP, abs=0.02)
    assert s["total_output_tokens"] == 17
    # what the server saw: same work everywhere
    bodies = sorted(server.seen[-3:], key=lambda x: x["max_tokens"])
    assert [x["max_tokens"] for x in bodies] == [1, 6, 10]
    assert all(x["ignore_eos"] and x["stream"] and x["stream_options"] == {"include_usage": True} for x in bodies)
    assert bodies[0]["model"] == "fake-model"  # discovered from /v1/models
    assert bodies[1]["priority"] == 7 and bodies[1]["prompt"] == [2] * 8
    # /metrics: scheduling delay from the histogram delta, step composition from the counters
    assert res.scheduling_delay["count"] == 8
    assert res.scheduling_delay["p50"] == pytest.approx(0.1)
    assert len(res.metric_snapshots) >= 3


def test_http_errors_are_recorded_not_raised(server):
    res = run(Endpoint(server.url, model="m"), [RequestSpec(0, 0.0, 4, 1)], [[1] * 4], progress=False,
              scrape_interval=None)
    ok = res.records[0]
    assert ok.ok
    bad = run(Endpoint("http://127.0.0.1:9", model="m"), [RequestSpec(0, 0.0, 4, 1)], [[1] * 4], progress=False)
    assert not bad.records[0].ok and bad.records[0].error
    assert bad.scheduling_delay is None


def test_deadline_cancels_the_rest(server):
    reqs = [RequestSpec(0, 0.0, 4, 3), RequestSpec(1, 0.0, 4, 200)]  # the second needs ~6 s
    res = run(Endpoint(server.url, model="m"), reqs, [[1] * 4] * 2, progress=False, deadline_s=0.8,
              scrape_interval=None)
    assert res.records[0].ok
    assert not res.records[1].ok and "deadline" in res.records[1].error
    assert res.duration_s < 3.0


def test_text_prompts_and_no_priority():
    ep = Endpoint("http://h:1/v1/", prompt_format="text", send_priority=False, include_usage=False,
                  extra_body={"top_k": 1})
    assert ep.url == "http://h:1"
    body = request_body(ep, "m", RequestSpec(0, 0.0, 3, 5, 9), "a b c")
    assert body["prompt"] == "a b c" and "priority" not in body and "stream_options" not in body
    assert body["top_k"] == 1 and body["max_tokens"] == 5 and body["ignore_eos"] is True
    chat = request_body(Endpoint("http://h", api="chat", prompt_format="text"), "m", RequestSpec(0, 0, 3, 5), "hi")
    assert chat["messages"] == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError):
        Endpoint("http://h", api="chat")  # chat cannot take token ids


@pytest.mark.parametrize("chunk,api,n", [
    ({"choices": [{"text": "a", "finish_reason": None}]}, "completions", 1),
    ({"choices": [{"text": "", "finish_reason": "length"}]}, "completions", 0),  # llama-server's closing chunk
    ({"choices": [{"text": "", "finish_reason": None}]}, "completions", 1),
    ({"choices": [{"text": "ab", "token_ids": [1, 2, 3]}]}, "completions", 3),
    ({"choices": [], "usage": {"completion_tokens": 5}}, "completions", 0),
    ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, "chat", 0),
    ({"choices": [{"delta": {"content": "x"}}]}, "chat", 1),
    ({"choices": [{"delta": {"content": None}, "finish_reason": "length"}]}, "chat", 0),
])
def test_tokens_in_chunk(chunk, api, n):
    assert tokens_in_chunk(json.loads(json.dumps(chunk)), api) == n
