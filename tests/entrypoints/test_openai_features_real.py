"""Structured outputs and tool calls through a real server on the bundled model, with the official openai client."""
from __future__ import annotations

import json

import jsonschema_rs
import pytest
from json_schemas import SCHEMAS
from test_server_real import Server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    s = Server("--kv-cache-memory-gb", "0.1", "--api-key", "test-key").wait_ready()
    s.openai = s.openai.with_options(timeout=600)  # a shared 2-core machine can be slow; no timing is tested here
    s.http.timeout = 600
    yield s
    s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format(server, stream):
    schema = SCHEMAS["weather_call"][0]
    kw = dict(model="x", messages=[{"role": "user", "content": "Weather for Paris as JSON"}], max_tokens=60,
              temperature=1.0, seed=3, n=2,
              response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}})
    kw.pop("model")
    if stream:
        texts = ["", ""]
        for chunk in server.openai.chat.completions.create(model=server.openai.models.list().data[0].id, stream=True,
                                                           **kw):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
    else:
        r = server.openai.chat.completions.create(model=server.openai.models.list().data[0].id, **kw)
        texts = [c.message.content for c in r.choices]
    for t in texts:
        jsonschema_rs.validate(schema, json.loads(t))


def test_structured_outputs_extras_and_bad_constraints(server):
    r = server.http.post("/v1/completions", json={"prompt": "Pick:", "max_tokens": 10, "temperature": 1.0,
                                                  "structured_outputs": {"choice": ["red", "green"]}})
    assert r.json()["choices"][0]["text"] in ("red", "green")
    r = server.http.post("/v1/completions", json={"prompt": "Code:", "max_tokens": 10,
                                                  "structured_outputs": {"regex": "[A-Z]{3}[0-9]"}})
    assert len(r.json()["choices"][0]["text"]) == 4
    r = server.http.post("/v1/completions", json={"prompt": "x", "structured_outputs": {"regex": "(("}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", [
    "required",  # with parallel_tool_calls=false (below): left free, the 135M model listed calls past max_tokens
    {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_round_trip(server, stream, choice):
    client = server.openai
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=model, tools=[WEATHER], tool_choice=choice, max_tokens=60, temperature=0)
    if choice == "required":  # one call: left free, this small model lists calls until max_tokens
        kw["parallel_tool_calls"] = False
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(messages=messages, stream=True, **kw):
            for c in chunk.choices:
                for tc in c.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls"
        call = calls[0]
    else:
        r = client.chat.completions.create(messages=messages, **kw)
        assert r.choices[0].finish_reason == "tool_calls"
        tc = r.choices[0].message.tool_calls[0]
        call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
    assert call["name"] == "get_weather"
    args = json.loads(call["arguments"])
    assert set(args) == {"city", "unit"}
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                      {"id": call["id"], "type": "function",
                       "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                 {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature": 18, "sky": "clear"}'}]
    if stream:  # the answer streamed too, gathered by the client's own accumulator
        with client.chat.completions.stream(model=model, messages=messages, tools=[WEATHER], max_tokens=30,
                                            temperature=0) as s:
            answer = s.get_final_completion()
    else:
        answer = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=30,
                                                temperature=0)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_streamed_tool_call_deltas_through_the_clients_accumulator(server):
    """The openai client's stream helper rebuilds the message from our deltas (index, id, type, name, arguments)
    and fires its tool-call events: the shape is the one it expects, not just parseable JSON."""
    client = server.openai
    events = []
    with client.chat.completions.stream(model=client.models.list().data[0].id, max_tokens=60, temperature=0,
                                        messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER],
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}}) as s:
        for event in s:
            events.append(event.type)
        final = s.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert final.choices[0].finish_reason == "tool_calls" and call.id and call.type == "function"
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "unit"}
    assert "tool_calls.function.arguments.done" in events


def test_parallel_tool_calls_caps_the_calls(server):
    """required + parallel_tool_calls: false is at most one call; true lets the model list several (the grammar
    still closes the list before max_tokens, so every call is whole)."""
    client = server.openai
    model = client.models.list().data[0].id
    second = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                               "parameters": {"type": "object", "additionalProperties": False,
                                                              "properties": {"city": {"type": "string",
                                                                                      "maxLength": 20}},
                                                              "required": ["city"]}}}
    kw = dict(model=model, messages=[{"role": "user", "content": "Weather and time in Paris, Rome and Oslo?"}],
              tools=[WEATHER, second], tool_choice="required", max_tokens=120, temperature=1.0, seed=11, n=3)
    one = client.chat.completions.create(parallel_tool_calls=False, **kw)
    many = client.chat.completions.create(parallel_tool_calls=True, **kw)
    assert [len(c.message.tool_calls) for c in one.choices] == [1, 1, 1]
    counts = [len(c.message.tool_calls) for c in many.choices]
    assert all(k >= 1 for k in counts) and max(counts) > 1, counts
    for c in one.choices + many.choices:
        assert c.finish_reason == "tool_calls"
        for tc in c.message.tool_calls:
            assert tc.function.name in ("get_weather", "get_time") and isinstance(json.loads(tc.function.arguments), dict)


def test_chat_n_seed_stop_streamed_equal_whole(server):
    """n, seed and stop through the openai client on chat: a seeded n=2 sample is the same streamed and whole,
    and again; the stop string ends the choice that meets it, and is not in its text."""
    client = server.openai
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=[{"role": "user", "content": "Tell me a short story about a cat."}],
              max_tokens=24, temperature=1.0, seed=1234, n=2)
    whole = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    texts = [c.message.content for c in whole.choices]
    assert texts == [c.message.content for c in again.choices] and texts[0] != texts[1]
    streamed = ["", ""]
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts
    stop = texts[0].split()[3]  # a word the seeded first choice writes
    cut = client.chat.completions.create(stop=[stop], **kw)
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].message.content
    assert texts[0].startswith(cut.choices[0].message.content)


def test_tool_choice_none_and_logit_bias(server):
    model = server.openai.models.list().data[0].id
    r = server.openai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    base = server.http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 1,
                                                     "temperature": 0, "logprobs": 0}).json()["choices"][0]
    first = server.http.post("/tokenize", json={"prompt": base["text"], "add_special_tokens": False}).json()["tokens"][0]
    banned = server.http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 1,
                                                       "temperature": 0, "logit_bias": {str(first): -100}}).json()
    assert banned["choices"][0]["text"] != base["text"]


def test_echo_with_logprobs_and_prompt_logprobs(server):
    """echo + logprobs through the openai client: the prompt's tokens lead with their logprobs (the first null),
    the same numbers prompt_logprobs gives (vLLM's extra, asked with extra_body)."""
    model = server.openai.models.list().data[0].id
    prompt = "The capital of France is"
    ids = server.http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    r = server.openai.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                         logprobs=2)
    c = r.choices[0]
    assert c.text.startswith(prompt) and len(c.logprobs.tokens) == len(ids) + 3
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    p = server.openai.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 1})
    plp = p.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i, tid in enumerate(ids[1:], 1):
        assert abs(plp[i][str(tid)]["logprob"] - c.logprobs.token_logprobs[i]) < 1e-2
        assert plp[i][str(tid)]["rank"] >= 1
