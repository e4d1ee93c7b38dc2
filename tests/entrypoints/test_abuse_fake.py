"""Faults and overload through the HTTP layer over a fake engine (fast, no model): an engine thread that dies turns
/health red and ends every stream with an error; steps that keep failing count as a dead engine; one request that
fails inside the engine gets a 500 body while the others finish; the predicted-queueing-delay check answers 503
with Retry-After before anything runs, and the metrics count it."""
from __future__ import annotations

import json
import threading

from fake_engine import FakeEngine, FakeOutput
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from test_server_fake import make_client

from paceline.engine.faults import EngineCrash


class FaultyFake(FakeEngine):
    """fail: request ids whose next delta carries an error (as Engine does for a failed request); crash: the next
    step raises a BaseException, as a bug in the loop itself would; broken: every step raises."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.fail: set[str] = set()
        self.crash = threading.Event()
        self.broken = False

    def step(self) -> list:
        if self.crash.is_set():
            raise EngineCrash("injected")
        if self.broken:
            raise RuntimeError("the device is gone")
        outputs = super().step()
        for i, out in enumerate(outputs):
            if any(out.request_id.startswith(f) for f in self.fail) and not out.finished:
                self.abort(out.request_id)
                outputs[i] = FakeOutput(out.request_id, [], "", out.text, True, "error", None, [], 0, 0, 0,
                                        out.request, error="ValueError: injected")
        return outputs


def error_of(r) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_one_failed_request_gets_a_500_body_and_the_others_finish():
    engine = FaultyFake(step_s=0.001)
    with make_client(engine) as c:
        engine.fail.add("cmpl-")  # every completion request from now on fails on its first token
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
        assert r.status_code == 500 and error_of(r)["type"] == "server_error" and "injected" in error_of(r)["message"]
        engine.fail.clear()
        ok = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5, "stream": True})
        events = [e for e in ok.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "error" not in ok.text
        assert c.get("/health").status_code == 200
        assert labelled(c, "paceline:request_success_total", "finished_reason", "error") == 1


def test_a_stream_that_fails_midway_ends_with_an_error_event():
    engine = FaultyFake(step_s=0.001)
    with make_client(engine) as c:
        engine.fail.add("cmpl-")
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 50, "stream": True})
        assert r.status_code == 200  # no queue-delay limit: the stream had already started
        events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"


def test_engine_thread_death_turns_health_red_and_ends_streams():
    engine = FaultyFake(step_s=0.01)
    with make_client(engine) as c:
        assert c.get("/health").status_code == 200
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 10_000 // 100,
                                                       "ignore_eos": True, "stream": True}) as s:
            lines = s.iter_lines()
            assert next(lines).startswith("data: ")
            engine.crash.set()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["message"].startswith("the engine stopped after an internal error")
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and "must be restarted" in error_of(r)["message"]


def test_steps_that_keep_failing_mean_a_dead_engine():
    engine = FaultyFake(step_s=0.001)
    with make_client(engine) as c:
        engine.broken = True
        for _ in range(3):  # each failed step fails the requests in flight with a 500, never a hang
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            if r.status_code == 503:
                break
            assert r.status_code == 500 and error_of(r)["type"] == "server_error"
        assert c.get("/health").status_code == 503


def test_predicted_queueing_delay_is_a_503_at_once_and_counted():
    engine = FakeEngine(step_s=0.001)
    engine.config.scheduler.max_queue_delay_s = 0.5
    with make_client(engine) as c:
        for _ in range(4):  # four starts: the recent start rate is known
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        engine.extra_waiting = 100_000  # a queue far longer than 0.5 s at that rate
        # decided from the last load snapshot: the engine thread may or may not have taken one since (a race on a
        # busy host), so this one request may see the old queue or the new; the ones below see the new
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code in (200, 503)
        for stream in (False, True):
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": stream})
            assert r.status_code == 503, r.text  # a stream too: a plain 503, no 200 stream that breaks
            err = error_of(r)
            assert err["code"] == "server_overloaded" and "--max-queue-delay-s" in err["message"]
            assert int(r.headers["retry-after"]) >= 1
        assert rejected(c, "queue_delay_predicted") == 2
        assert not engine.waiting and not engine.running  # nothing of them reached the engine


def labelled(c: TestClient, name: str, label: str, value: str) -> float:
    for family in text_string_to_metric_families(c.get("/metrics").text):
        for s in family.samples:
            if s.name == name and s.labels[label] == value:
                return s.value
    raise KeyError((name, value))


def rejected(c: TestClient, reason: str) -> float:
    return labelled(c, "paceline:request_rejected_total", "reason", reason)


def test_sse_events_survive_every_line_splitter():
    """A model may print U+2028, U+2029 or NEL; httpx (the openai client's transport) splits lines on them."""
    from httpx._decoders import LineDecoder

    from paceline.entrypoints.server import sse

    obj = {"text": "a\u2028b\u2029c\x85d\x1ce\nf\rg"}
    lines = [line for line in LineDecoder().decode(sse(obj)) if line]
    assert len(lines) == 1 and json.loads(lines[0][len("data: "):]) == obj


def test_chat_template_kwargs_that_are_no_names_are_a_400():
    with make_client(FakeEngine(step_s=0.001)) as c:  # schemathesis once sent {"": ...}: a TypeError, then a 500
        for kwargs in ({"": 1}, {"add_generation_prompt": False}):
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                     "chat_template_kwargs": kwargs})
            assert r.status_code == 400 and error_of(r)["param"] == "chat_template_kwargs", r.text
        ok = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200
