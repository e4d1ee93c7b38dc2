"""A real server process on 127.0.0.1 with the bundled model, driven by the official openai client and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"


class Server:
    def __init__(self, *args: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="paceline-server-", suffix=".log", delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        self.proc = subprocess.Popen([sys.executable, "-m", "paceline.entrypoints.server", "--port", str(self.port),
                                      *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.http = httpx.Client(base_url=self.url, headers=AUTH, timeout=60)
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def wait_ready(self) -> Server:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """Samples by name, with the finished_reason label folded into the name."""
        out = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for s in family.samples:
                reason = s.labels.get("finished_reason")
                out[s.name + (f"{{{reason}}}" if reason else "")] = s.value
        return out

    def wait_idle(self, timeout: float = 5.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["paceline:num_requests_running"] == 0 and m["paceline:num_requests_waiting"] == 0
            if (idle and m["paceline:kv_cache_used_blocks"] == 0) or time.monotonic() > deadline:
                return m
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


@pytest.fixture(scope="module")
def servers():
    """Every configuration this module needs, launched at once so their model loads overlap."""
    launched = {
        # float32: this module checks batched and chunked outputs against one request alone, a float32 guarantee
        "main": Server("--kv-cache-memory-gb", "0.25", "--api-key", KEY, "--dtype", "float32"),
        # 24 blocks x 16 tokens: 16 requests of ~50 tokens need ~64 blocks, so the cache fills and some wait
        "priority": Server("--scheduling-policy", "priority", "--num-kv-blocks", "24", "--block-size", "16",
                           "--no-enable-prefix-caching", "--api-key", KEY, "--max-step-ms", "0", "--dtype", "float32"),
        "queue": Server("--max-num-seqs", "1", "--max-waiting-requests", "1", "--kv-cache-memory-gb", "0.1",
                        "--graceful-shutdown-s", "0.5", "--max-step-ms", "0"),
    }
    yield launched
    codes = {name: s.stop() for name, s in launched.items()}  # stop every server before judging any
    assert all(c == 0 for c in codes.values()), {n: launched[n].output() for n, c in codes.items() if c}


@pytest.fixture(scope="module")
def server(servers):
    return servers["main"].wait_ready()


def model_id(server: Server) -> str:
    return server.openai.models.list().data[0].id


# ---- the API as clients use it -------------------------------------------------------------------------------

def test_completion_stream_equals_non_stream(server):
    model = model_id(server)
    whole = server.openai.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.choices[0].text
    chunks = list(server.openai.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == server.http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_chat_stream_equals_non_stream(server):
    model = model_id(server)
    messages = [{"role": "user", "content": "Name one color."}]
    whole = server.openai.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    stream = server.openai.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0,
                                                   stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n2_and_seeds(server):
    model = model_id(server)
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2)
    a = server.openai.completions.create(seed=7, **kw)
    b = server.openai.completions.create(seed=7, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same text
    # the prompt counts once, the completions of both choices add up
    assert a.usage.prompt_tokens == server.http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["count"]
    assert 2 <= a.usage.completion_tokens <= 24


def test_stop_string(server):
    model = model_id(server)
    full = server.openai.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    cut = server.openai.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.index(stop)]


def test_logprobs(server):
    model = model_id(server)
    chat = server.openai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(abs(t.logprob - t.top_logprobs[0].logprob) < 1e-4 for t in content)
    comp = server.openai.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 3 for t in lp.top_logprobs)


def test_prefix_cache_shows_in_usage(server):
    model = model_id(server)
    prompt = "Here is a long shared system preamble that repeats. " * 6
    server.openai.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    again = server.openai.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_32_concurrent_streams_while_health_answers(server):
    model = model_id(server)
    reference = server.openai.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                                 extra_body={"ignore_eos": True}).choices[0].text

    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

        async def one() -> str:
            stream = await client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def health(done: asyncio.Event) -> list[int]:
            codes = []
            async with httpx.AsyncClient(base_url=server.url) as h:
                while not done.is_set():
                    codes.append((await h.get("/health", timeout=5)).status_code)
                    await asyncio.sleep(0.05)
            return codes

        done = asyncio.Event()
        poller = asyncio.ensure_future(health(done))
        texts = await asyncio.gather(*(one() for _ in range(32)))
        done.set()
        return texts, await poller

    texts, codes = asyncio.run(main())
    assert texts == [reference] * 32
    assert codes and set(codes) == {200}


# ---- bad input ------------------------------------------------------------------------------------------------

def expect_error(r: httpx.Response, status: int, param=None, code=None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error" if status < 500 else "server_error", param, code), err


def test_bad_input_suite_leaves_server_healthy(server):
    post = server.http.post
    good = {"prompt": PROMPT, "max_tokens": 4}
    msg = [{"role": "user", "content": "Hi"}]
    # malformed JSON, wrong shapes and types
    expect_error(post("/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}),
                 400, None, "invalid_json")
    expect_error(post("/v1/completions", json=["not", "an", "object"]), 400, None, "invalid_json")
    expect_error(post("/v1/completions", json={**good, "temperature": "warm"}), 400, "temperature")
    expect_error(post("/v1/completions", json={**good, "max_tokens": 2.5}), 400, "max_tokens")
    expect_error(post("/v1/chat/completions", json={"messages": "Hi"}), 400, "messages")
    expect_error(post("/v1/chat/completions", json={"messages": [{"role": "user", "content": 3}]}), 400,
                 "messages.0.content")
    expect_error(post("/v1/completions", json={"max_tokens": 4}), 400, "prompt")
    # unknown model
    expect_error(post("/v1/completions", json={**good, "model": "gpt-4o"}), 404, "model", "model_not_found")
    expect_error(post("/v1/chat/completions", json={"messages": msg, "model": "nope"}), 404, "model", "model_not_found")
    # out-of-range sampling values
    for field, value in [("temperature", -0.1), ("top_p", 1.5), ("top_k", -5), ("min_p", 2.0),
                         ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
                         ("max_tokens", 0), ("n", 0), ("logprobs", 50), ("min_tokens", -1)]:
        expect_error(post("/v1/completions", json={**good, field: value}), 400, field)
    expect_error(post("/v1/chat/completions", json={"messages": msg, "logprobs": True, "top_logprobs": 99}), 400,
                 "top_logprobs")
    # priority out of range
    expect_error(post("/v1/completions", json={**good, "priority": 10**6}), 400, "priority")
    # empty prompt, in every form
    expect_error(post("/v1/completions", json={"prompt": ""}), 400, "prompt")
    expect_error(post("/v1/completions", json={"prompt": []}), 400, "prompt")
    expect_error(post("/v1/completions", json={"prompt": [[]]}), 400, "prompt")
    expect_error(post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    # prompt token outside the vocabulary
    expect_error(post("/v1/completions", json={"prompt": [10**9]}), 400, "prompt")
    # prompt + max_tokens over the context length: an error, never silent truncation
    ctx = server.http.get("/v1/models").json()["data"][0]["max_model_len"]
    expect_error(post("/v1/completions", json={"prompt": PROMPT, "max_tokens": ctx}), 400, "prompt",
                 "context_length_exceeded")
    expect_error(post("/v1/chat/completions", json={"messages": msg, "max_completion_tokens": ctx}), 400, "messages",
                 "context_length_exceeded")
    # auth and size
    expect_error(httpx.post(server.url + "/v1/completions", json=good), 401, None, "invalid_api_key")
    expect_error(httpx.post(server.url + "/v1/completions", json=good, headers={"Authorization": "Bearer nope"}),
                 401, None, "invalid_api_key")
    expect_error(post("/v1/completions", json={"prompt": "x" * (5 * 2**20)}), 413, None, "request_too_large")
    # a batch with one bad prompt adds nothing
    expect_error(post("/v1/completions", json={"prompt": [PROMPT, ""], "max_tokens": 4}), 400, "prompt")

    m = server.wait_idle()
    assert m["paceline:kv_cache_used_blocks"] == 0 and m["paceline:num_requests_running"] == 0
    r = post("/v1/completions", json={**good, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_disconnect_mid_stream_frees_blocks(server):
    before = server.wait_idle()
    body = {"prompt": PROMPT, "max_tokens": 500, "temperature": 0, "ignore_eos": True, "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        tokens = 0
        while tokens < 3:
            line = next(lines)
            tokens += bool(line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"])
        running = server.metrics()
        assert running["paceline:kv_cache_used_blocks"] > 0 and running["paceline:num_requests_running"] == 1
        lines.close()  # closing the iterator mid-body closes the connection: the client is gone
    closed_at = time.monotonic()
    after = server.wait_idle(timeout=2.0)
    assert time.monotonic() - closed_at < 2.0
    assert after["paceline:kv_cache_used_blocks"] == 0 and after["paceline:num_requests_running"] == 0
    assert after["paceline:request_success_total{abort}"] == before.get("paceline:request_success_total{abort}", 0) + 1
    # one request makes one token per step: it ran at most the step in flight when it left, plus one
    produced = after["paceline:generation_tokens_total"] - before["paceline:generation_tokens_total"]
    assert produced <= running["paceline:generation_tokens_total"] - before["paceline:generation_tokens_total"] + 2


# ---- priorities under a full KV cache -------------------------------------------------------------------------

LOW_TOKENS = 40
LOW_PROMPTS = ["Write a story about a dragon.", "Describe the ocean at night.", "Explain how a bicycle works.",
               "List facts about the moon."]


def test_high_priority_overtakes_a_full_cache(servers):
    s = servers["priority"].wait_ready()
    model = model_id(s)

    async def main():
        client = openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        low_first_token = asyncio.Event()
        low_done: list[float] = []

        async def low(prompt: str) -> tuple[str, str, int]:
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=LOW_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "priority": 10})
            text, reason, n = "", None, 0
            async for c in stream:
                if c.choices:
                    text += c.choices[0].text
                    low_first_token.set()
                    reason = c.choices[0].finish_reason or reason
                if c.usage:
                    n = c.usage.completion_tokens
            low_done.append(time.monotonic())
            return text, reason, n

        async def high() -> float:
            stream = await client.completions.create(model=model, prompt="Say hello.", max_tokens=4,
                                                     temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True, "priority": -10})
            first = None
            async for c in stream:
                if first is None and c.choices and c.choices[0].text:
                    first = time.monotonic()
            return first

        lows = [asyncio.ensure_future(low(LOW_PROMPTS[i % 4])) for i in range(16)]
        await low_first_token.wait()
        # the lows grow until the cache is full: some get preempted or wait for blocks
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            full = await asyncio.to_thread(s.metrics)
            if full["paceline:num_requests_waiting"] > 0 or full["paceline:num_preemptions_total"] > 0:
                break
            await asyncio.sleep(0.02)
        high_first = await high()
        results = await asyncio.gather(*lows)
        return full, high_first, min(low_done), results

    full, high_first, first_low_finish, results = asyncio.run(main())
    # when the high-priority request came, the cache was full: requests were waiting for blocks
    assert full["paceline:num_requests_waiting"] > 0 or full["paceline:num_preemptions_total"] > 0
    assert full["paceline:kv_cache_usage_perc"] > 0.5
    assert high_first < first_low_finish
    # the same prompts again, four at a time (the cache holds them all): the references
    batch = s.openai.completions.create(model=model, prompt=LOW_PROMPTS, max_tokens=LOW_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
    references = {LOW_PROMPTS[c.index]: c.text for c in batch.choices}
    for i, (text, reason, n) in enumerate(results):
        assert (reason, n) == ("length", LOW_TOKENS)
        assert text == references[LOW_PROMPTS[i % 4]], i
    assert s.wait_idle()["paceline:kv_cache_used_blocks"] == 0


# ---- overload and shutdown ------------------------------------------------------------------------------------

def test_full_queue_then_clean_shutdown(servers):
    s = servers["queue"].wait_ready()
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(base_url=s.url, timeout=60) as a, httpx.Client(base_url=s.url, timeout=60) as b:
            with a.stream("POST", "/v1/completions", json=body) as running:
                # keep the iterator: dropping a half-read httpx iterator closes the connection (a disconnect)
                lines = running.iter_lines()
                while not next(lines).startswith("data: "):
                    pass
                with b.stream("POST", "/v1/completions", json=body) as waiting:
                    assert waiting.status_code == 200
                    deadline = time.monotonic() + 10
                    while s.metrics()["paceline:num_requests_waiting"] < 1 and time.monotonic() < deadline:
                        time.sleep(0.02)
                    r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                    expect_error(r, 503, None, "server_overloaded")
                    assert int(r.headers["retry-after"]) >= 1
                    # Ctrl-C with two requests in flight: both streams end properly (finished or aborted)
                    s.proc.send_signal(signal.SIGINT)
                    for stream_lines in (lines, waiting.iter_lines()):
                        events = [line for line in stream_lines if line.startswith("data: ")]
                        assert events[-1] == "data: [DONE]"
                        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("abort", "length")
        assert s.proc.wait(30) == 0, s.output()
    finally:
        s.stop()


def test_disconnect_while_waiting_for_a_whole_response(server):
    before = server.wait_idle()
    body = {"prompt": PROMPT, "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json=body, timeout=1.0)
    after = server.wait_idle(timeout=2.0)
    assert after["paceline:kv_cache_used_blocks"] == 0 and after["paceline:num_requests_running"] == 0
    assert after["paceline:request_success_total{abort}"] == before.get("paceline:request_success_total{abort}", 0) + 1
