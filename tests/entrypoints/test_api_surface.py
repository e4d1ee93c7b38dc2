"""The request schema as clients meet it (fake engine): one rule for unknown fields, unsupported OpenAI fields
named in a 400, caps, malformed bodies that used to answer 500, and an /openapi.json that declares it all."""
from __future__ import annotations

import pytest
from test_server_fake import error, make_client


@pytest.fixture
def client():
    with make_client() as c:
        yield c


def test_unknown_fields_are_rejected_by_name(client):
    msg = error(client.post("/v1/completions", json={"prompt": "x", "temprature": 0.5}), 400, "temprature")
    assert "temprature" in msg
    error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x", "colour": 1}]}),
          400, "messages.0.colour")


@pytest.mark.parametrize("field,value", [("audio", {"voice": "alloy"}), ("functions", []), ("prediction", {}),
                                         ("web_search_options", {}), ("reasoning_effort", "low"), ("metadata", {}),
                                         ("verbosity", "low"), ("store", True),
                                         ("modalities", ["audio"]), ("service_tier", "flex")])
def test_unsupported_openai_fields_are_named(client, field, value):
    body = {"messages": [{"role": "user", "content": "x"}], field: value}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == field
    assert field in r.json()["error"]["message"]


def test_completion_only_unsupported_fields(client):
    error(client.post("/v1/completions", json={"prompt": "x", "suffix": "y"}), 400, "suffix")
    error(client.post("/v1/completions", json={"prompt": "x", "best_of": 3}), 400, "best_of")
    assert client.post("/v1/completions", json={"prompt": "x", "best_of": 1, "max_tokens": 2}).status_code == 200


def test_accepted_no_op_fields(client):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "store": False, "user": "u",
            "service_tier": "auto", "modalities": ["text"], "safety_identifier": "s", "prompt_cache_key": "k"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_bodies_that_used_to_answer_500(client):
    r = client.post("/v1/completions", content=b'{"prompt": "\\ud800 x"}', headers={"content-type": "application/json"})
    assert error(r, 400, "prompt", "invalid_unicode")
    error(client.post("/v1/completions", content=b"[" * 100_000 + b"]" * 100_000), 400, None, "invalid_json")
    error(client.post("/v1/completions", content=b'{"prompt": ' + b"[" * 70 + b"]" * 70 + b"}"), 400, "prompt",
          "invalid_json")
    error(client.post("/v1/completions", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"}), 400,
          None, "invalid_content_type")
    error(client.post("/v1/completions", json={"prompt": "x", "seed": 2**70}), 400, "seed")
    error(client.post("/v1/completions", json={"prompt": "x", "logit_bias": {"abc": 1}}), 400, "logit_bias")
    error(client.post("/v1/completions", json={"prompt": "x", "logit_bias": {"5": 101}}), 400, "logit_bias")
    error(client.post("/v1/completions", json={"prompt": "x", "logit_bias": {"256": 1}}), 400, "logit_bias")
    # and the server still answers
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 3}).json()["choices"][0]["text"] == "abc"


def test_caps(client):
    error(client.post("/v1/completions", json={"prompt": "x", "n": 10_000}), 400, "n")
    error(client.post("/v1/completions", json={"prompt": ["x"] * 1000, "max_tokens": 1}), 400, "prompt")
    error(client.post("/v1/completions", json={"prompt": "x", "n": 16, "max_tokens": 5000}), 400, "max_tokens")
    error(client.post("/v1/completions", json={"prompt": "x", "logprobs": 10**6}), 400, "logprobs")
    error(client.post("/v1/completions", json={"prompt": "x", "stop": ["s"] * 10_000}), 400, "stop")
    error(client.post("/v1/completions", json={"prompt": "x", "stop": "s" * 10_000}), 400, "stop")


def test_limits_are_configurable():
    from paceline.entrypoints.protocol import Limits
    with make_client(limits=Limits(max_n=2)) as c:
        error(c.post("/v1/completions", json={"prompt": "x", "n": 3}), 400, "n")
        assert c.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 1}).status_code == 200


def test_openapi_declares_bodies_ranges_and_errors(client):
    doc = client.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["required"]
        assert {"200", "400", "413"} <= set(op["responses"])
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert chat["additionalProperties"] is False
    assert chat["properties"]["top_p"]["exclusiveMinimum"] == 0 and chat["properties"]["top_p"]["maximum"] == 1
    assert chat["properties"]["top_logprobs"]["anyOf"][0]["maximum"] == 20
    assert "tools" in chat["properties"] and "response_format" in chat["properties"]


def test_echo_leads_with_the_prompt(client):
    r = client.post("/v1/completions", json={"prompt": ["hi", "yo"], "max_tokens": 2, "echo": True}).json()
    assert [c["text"] for c in r["choices"]] == ["hiab", "yoab"]
    r = client.post("/v1/completions", json={"prompt": [120, 121], "max_tokens": 2, "echo": True}).json()
    assert r["choices"][0]["text"] == "xyab"
    with client.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": True,
                                                         "stream": True}) as s:
        texts = [__import__("json").loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                 if line.startswith("data: {")]
    assert "".join(texts) == "hiab" and texts[0] == "hi"


def test_echo_with_logprobs_and_prompt_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": [120, 121, 122], "max_tokens": 2, "echo": True,
                                             "logprobs": 1}).json()["choices"][0]
    lp = r["logprobs"]
    assert r["text"] == "xyzab" and lp["tokens"] == ["x", "y", "z", "a", "b"]
    assert lp["token_logprobs"] == [None, -1.0, -1.0, -0.5, -0.5] and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    with client.stream("POST", "/v1/completions", json={"prompt": [120, 121], "max_tokens": 2, "echo": True,
                                                         "logprobs": 0, "stream": True}) as s:
        chunks = [__import__("json").loads(line[6:])["choices"][0] for line in s.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[0]["text"] == "xy" and chunks[0]["logprobs"]["token_logprobs"] == [None, -1.0]
    r = client.post("/v1/completions", json={"prompt": [120, 121], "max_tokens": 1, "prompt_logprobs": 1}).json()
    assert r["choices"][0]["prompt_logprobs"] == [None, {"121": {"logprob": -1.0, "rank": 1, "decoded_token": "y"}}]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                                  "prompt_logprobs": 0}).json()
    assert r["prompt_logprobs"][0] is None and len(r["prompt_logprobs"]) > 1
    error(client.post("/v1/completions", json={"prompt": "hi", "prompt_logprobs": 1, "stream": True}), 400,
          "prompt_logprobs")
    error(client.post("/v1/completions", json={"prompt": "hi", "prompt_logprobs": 21}), 400, "prompt_logprobs")


def test_whole_numbers_in_integer_fields_are_integers(client):
    # JSON Schema's `integer` includes 2.0, so a client generated from the document (schemathesis did) sends it
    r = client.post("/v1/completions", json={"prompt": [97.0, 98.0], "max_tokens": 3.0, "n": 1.0, "top_k": -1.0,
                                             "seed": 7.0, "stop_token_ids": [0.0]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert client.post("/detokenize", json={"tokens": [97.0, 98]}).json()["prompt"] == "ab"
    for bad in (2.5, "2", True):  # a fraction, a string and a boolean are still not integers
        error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": bad}), 400, "max_tokens")
    error(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0.0}), 400, "max_tokens")  # ranges hold


def test_the_document_states_the_completion_only_rules(client):
    props = client.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["suffix"]["maxLength"] == 0 and "not supported" in props["best_of"]["description"]
    assert props["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1}  # a range stays a JSON Schema range
