"""Fuzzing the API (fake engine, so it stays fast): schemathesis from /openapi.json, and hypothesis-made raw
bodies nobody listed. Whatever comes in: no 5xx, every 4xx has the OpenAI error body, and the server still answers
a good request correctly afterwards. PACELINE_FUZZ_EXAMPLES raises the example counts for a longer run."""
from __future__ import annotations

import json
import os

import hypothesis.strategies as st
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from test_server_fake import make_client

EXAMPLES = int(os.environ.get("PACELINE_FUZZ_EXAMPLES", "40"))
SENT = {"requests": 0, "4xx": 0}


@pytest.fixture(scope="module")
def client():
    with make_client() as c:
        yield c


def assert_clean(r) -> None:
    SENT["requests"] += 1
    SENT["4xx"] += 400 <= r.status_code < 500
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text[:300]


def assert_still_serving(client) -> None:
    r = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"


# ---- schemathesis: every operation, bodies generated from the document -----------------------------------------

with make_client() as _c:
    _DOC = _c.get("/openapi.json").json()
_schema = schemathesis.openapi.from_dict(_DOC)


@_schema.include(method="POST").parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis(case, client):
    # small outputs: the caps keep generated n x max_tokens from making any request long
    if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int) and case.body["max_tokens"] > 8:
        case.body["max_tokens"] = 8
    kwargs = case.as_transport_kwargs(base_url="http://testserver")
    r = client.request(kwargs["method"], kwargs["url"], headers=kwargs.get("headers"),
                       content=kwargs.get("content"), json=kwargs.get("json"), params=kwargs.get("params"))
    assert_clean(r)


# ---- hypothesis: raw bodies of every wrong shape ------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
                    st.floats(allow_nan=False), st.text(max_size=20),
                    st.sampled_from(["\ud800", "x" * 100_000, "\x00", "<|im_end|>"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
FIELDS = ["prompt", "messages", "n", "max_tokens", "temperature", "top_p", "logprobs", "top_logprobs", "stop",
          "seed", "logit_bias", "stream", "response_format", "structured_outputs", "tools", "tool_choice", "echo",
          "best_of", "min_tokens", "stop_token_ids", "priority", "stream_options"]
NASTY = {"n": 10_000, "logprobs": 10**6, "top_logprobs": 10**6, "stop": ["s"] * 10_000, "max_tokens": 10**12,
         "prompt": [[1] * 3] * 10_000, "seed": 2**70, "logit_bias": {str(i): 1 for i in range(5000)}}
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=6),
    st.builds(lambda base, k: {**base, k: NASTY[k]}, st.dictionaries(st.sampled_from(FIELDS), values, max_size=3),
              st.sampled_from(sorted(NASTY))),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), body=bodies)
def test_raw_json_bodies(client, path, body):
    if path.startswith("/v1"):
        body.setdefault("max_tokens", 4) if isinstance(body.get("max_tokens", 4), int) else None
    assert_clean(client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.one_of(st.binary(max_size=200), st.just(b"[" * 50_000), st.just(b'{"prompt": "\xff\xfe"}'),
                     st.just(b'{"prompt": "x", "max_tokens": 2'), st.just(b'{"prompt": ' + b'{"a": ' * 200)),
       content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                     "application/json; charset=utf-8", None]))
def test_raw_bytes_and_content_types(client, raw, content_type):
    headers = {"content-type": content_type} if content_type else {}
    assert_clean(client.post("/v1/completions", content=raw, headers=headers))


def test_server_still_serves_after_fuzzing(client):
    assert_still_serving(client)
    print(f"fuzz: {SENT['requests']} generated requests, {SENT['4xx']} answered 4xx, 0 server errors")
