"""The HTTP layer over a fake engine (no model): formats, validation, errors, auth, limits, aborts, metrics."""
from __future__ import annotations

import json
import time

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from paceline.engine.async_engine import AsyncEngine
from paceline.engine.metrics import EngineMetrics
from paceline.entrypoints.server import ServerSettings, build_app


def make_client(engine: FakeEngine | None = None, **settings) -> TestClient:
    engine = engine or FakeEngine()
    metrics = EngineMetrics(engine.model_name)
    app = build_app(AsyncEngine(engine, on_step=metrics.on_step), metrics, ServerSettings(**settings))
    return TestClient(app)


@pytest.fixture(scope="module")
def client():
    with make_client(max_body_bytes=4096) as c:
        yield c


def metric(client: TestClient, name: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise KeyError(name)


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_text_usage_and_finish(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "seed": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "abcde"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_n_seeds_and_batch(client):
    r = client.post("/v1/completions", json={"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 3, "seed": 1})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # choice i of each prompt runs with seed + i
    assert [c["text"] for c in body["choices"]] == ["bcd", "cde", "bcd", "cde"]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 12


def test_completion_token_id_prompt(client):
    r = client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2


def test_stream_matches_non_stream_with_usage(client):
    req = {"prompt": "hi", "max_tokens": 6, "seed": 3, "stop": ["h"]}
    whole = client.post("/v1/completions", json=req).json()
    r = client.post("/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole["choices"][0]["text"] == "defg"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert all(e["usage"] is None for e in events[:-1])


def test_a_token_whose_text_is_held_back_still_gets_its_chunk():
    # as vLLM streams it: a client counting tokens by chunk sees every step (the stall probe's gap), the text is whole
    engine = FakeEngine()
    engine.hold_back = {ord("e")}
    with make_client(engine) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "seed": 3, "stream": True})
    texts = [ch["text"] for e in sse_events(r.text) for ch in e["choices"]]
    assert texts == ["d", "", "ef", "g"]


def test_chat_and_chat_stream(client):
    req = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}
    body = client.post("/v1/chat/completions", json=req).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abcd"}
    events = sse_events(client.post("/v1/chat/completions", json={**req, "stream": True}).text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "abcd"
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_logprobs_shapes(client):
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                     "logprobs": True, "top_logprobs": 1}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["a", "b"] and len(content[0]["top_logprobs"]) == 1
    comp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 1}).json()
    lp = comp["choices"][0]["logprobs"]
    assert lp["tokens"] == ["a", "b"] and lp["text_offset"] == [0, 1] and lp["token_logprobs"] == [-0.5, -0.5]


def test_side_endpoints(client):
    assert client.get("/health").status_code == 200
    assert "version" in client.get("/version").json()
    assert client.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    tok = client.post("/tokenize", json={"prompt": "abc"}).json()
    assert tok["tokens"] == [97, 98, 99] and tok["count"] == 3
    assert client.post("/detokenize", json={"tokens": [97, 98]}).json() == {"prompt": "ab"}
    assert "paceline:num_requests_running" in client.get("/metrics").text


def error(r, status: int, param=None, code=None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and err["code"] == code
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return err["message"]


BAD = [
    ({"prompt": "x", "temperature": "hot"}, "temperature", None),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", None),
    ({"prompt": "x", "n": True}, "n", None),
    ({"prompt": 5}, "prompt", None),
    ({}, "prompt", None),
    ({"prompt": "x", "temperature": -1}, "temperature", None),
    ({"prompt": "x", "top_p": 0}, "top_p", None),
    ({"prompt": "x", "top_k": -2}, "top_k", None),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", None),
    ({"prompt": "x", "logprobs": 21}, "logprobs", None),
    ({"prompt": "x", "n": 0}, "n", None),
    ({"prompt": "x", "priority": 1001}, "priority", None),
    ({"prompt": ""}, "prompt", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": "x", "max_tokens": 1000}, "prompt", "context_length_exceeded"),
]


@pytest.mark.parametrize("body,param,code", BAD)
def test_bad_completion_requests(client, body, param, code):
    error(client.post("/v1/completions", json=body), 400, param, code)


def test_bad_chat_requests(client):
    error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    error(client.post("/v1/chat/completions", json={"messages": [{"role": "pirate", "content": "x"}]}), 400,
          "messages.0.role")
    error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "top_logprobs": 2}), 400, "top_logprobs")


def test_malformed_json_unknown_model_and_size(client):
    msg = error(client.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}),
                400, None, "invalid_json")
    assert "JSON" in msg
    error(client.post("/v1/completions", content=b"[1, 2]"), 400, None, "invalid_json")
    error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model", "model_not_found")
    error(client.post("/v1/completions", json={"prompt": "x" * 5000}), 413, None, "request_too_large")
    assert client.get("/no/such/path").json()["error"]["message"] == "Not Found"
    # the server still serves and holds nothing
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert metric(client, "paceline:kv_cache_used_blocks") == 0


def test_api_key():
    with make_client(api_key="sekret") as c:
        error(c.post("/v1/completions", json={"prompt": "x"}), 401, None, "invalid_api_key")
        error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401, None, "invalid_api_key")
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/health").status_code == 200  # only /v1 is guarded


def test_full_queue_answers_503_with_retry_after():
    engine = FakeEngine(max_waiting_requests=2)
    with make_client(engine) as c:
        engine.extra_waiting = 1
        assert c.post("/v1/completions", json={"prompt": "c", "max_tokens": 2}).status_code == 200
        engine.extra_waiting = 2  # behind the engine thread's back: its count is from before
        for _ in range(2):  # refused by the engine thread's own check, then at arrival from its recount
            r = c.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})
            error(r, 503, None, "server_overloaded")
            assert r.headers["retry-after"] == "1"


def test_engine_failure_fails_requests_in_flight_but_server_survives():
    engine = FakeEngine(step_s=0.005)
    with make_client(engine) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 100, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            engine.fail_next_step = True
            rest = [line for line in lines if line.startswith("data: ")]
        assert "simulated device failure" in rest[-2] and rest[-1] == "data: [DONE]"
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"


def test_closing_a_stream_aborts_its_request():
    engine = FakeEngine(step_s=0.005)
    with make_client(engine) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 200, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
        deadline = time.monotonic() + 2
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished()
        assert metric(c, "paceline:request_success_total") >= 0
        aborted = [s for f in text_string_to_metric_families(c.get("/metrics").text) for s in f.samples
                   if s.name == "paceline:request_success_total" and s.labels["finished_reason"] == "abort"]
        assert aborted[0].value == 1
        assert metric(c, "paceline:kv_cache_used_blocks") == 0


def test_engine_built_by_a_function_runs_on_the_engine_thread():
    import threading

    built_on = []

    def build() -> FakeEngine:
        built_on.append(threading.current_thread().name)
        return FakeEngine()

    async_engine = AsyncEngine(build)
    assert built_on == ["paceline-engine"] and isinstance(async_engine.engine, FakeEngine)
    metrics = EngineMetrics(async_engine.engine.model_name)
    with TestClient(build_app(async_engine, metrics, ServerSettings())) as c:
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"


def test_engine_builder_error_is_raised_to_the_caller():
    def build() -> FakeEngine:
        raise ValueError("no such model file: /nope.gguf")

    with pytest.raises(ValueError, match="no such model file"):
        AsyncEngine(build)


def test_the_client_id_comes_from_the_x_client_id_header_or_the_user_field():
    engine = FakeEngine()
    seen = []
    add = engine.add_request

    def recording_add(*args, **kw):
        request = add(*args, **kw)
        seen.append(request.client_id)
        return request
    engine.add_request = recording_add
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    with make_client(engine) as c:
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "user": "alice"}).status_code == 200
        assert c.post("/v1/chat/completions", json=chat, headers={"X-Client-Id": "gw-7"}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "user": "alice"},
                      headers={"X-Client-Id": "bob"}).status_code == 200  # a gateway's header wins
        assert c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200
        message = error(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "user": "u" * 257}), 400, "user")
        assert "257 characters" in message
    assert seen == ["alice", "gw-7", "bob", ""]
