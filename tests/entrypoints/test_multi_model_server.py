"""Several models in one real server on 127.0.0.1, driven by the official openai client: routing by name, 404 for
an unknown model, load on demand and LRU eviction under --max-loaded-models, 503 + Retry-After when memory cannot
be had, keep_alive, requests arriving while a model loads, and greedy outputs equal to one-model serving."""
from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from _tiny_checkpoints import tiny_checkpoint

from paceline.config import CacheConfig, EngineConfig
from paceline.engine.engine import Engine
from paceline.model.loader import write_hf_folder
from paceline.sampling import SamplingParams

PROMPTS = ["the cat sat on the", "hello there"]


class Server:
    def __init__(self, *args: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="paceline-multi-", suffix=".log", delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        self.proc = subprocess.Popen([sys.executable, "-m", "paceline.entrypoints.server", "--port", str(self.port),
                                      *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def states(self) -> dict[str, str]:
        return {m["id"]: m["state"] for m in self.http.get("/v1/models").json()["data"]}

    def metric(self, name: str, model: str) -> float:
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in family.samples:
                if s.name == name and s.labels.get("model_name") == model:
                    return s.value
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def greedy(engine: Engine, prompt: str, max_tokens: int) -> list[int]:
    engine.add_request("ref", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def completion_text(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, **extra) -> str:
    """A greedy completion's text, checked to come from `model` and to have max_tokens tokens."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                  extra_body={"ignore_eos": True, **extra})
    assert r.model == model and r.usage.completion_tokens == max_tokens
    return r.choices[0].text


# ---- tiny random checkpoints: routing, residency ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    for kind, seed in (("llama", 1), ("qwen2", 2), ("mistral", 3)):
        write_hf_folder(tiny_checkpoint(kind, seed=seed), root / kind)
    (root / "models.yaml").write_text(f"""models:
  - {{name: a, path: {root / 'llama'}, pinned: true}}
  - {{name: b, path: {root / 'qwen2'}}}
  - {{name: c, path: {root / 'mistral'}, load: lazy}}
  - {{name: big, path: {root / 'llama'}, load: lazy, kv_cache_memory_gb: 1.0}}
""")
    server = Server("--models-config", str(root / "models.yaml"), "--max-loaded-models", "2",
                    "--memory-budget-gb", "0.25", "--max-step-ms", "0", "--swap-space-gb", "0", "--num-kv-blocks",
                    "64", "--dtype", "float32", "--no-dashboard")
    yield server, root
    server.stop()


def tiny_engine(path: Path) -> Engine:
    return Engine(EngineConfig(model=str(path), dtype="float32", tbt_goal_ms=0,
                               cache=CacheConfig(num_blocks=64, swap_space_gb=0)))


def test_routes_by_name_and_lists_the_models_with_their_state(tiny):
    server, root = tiny
    assert server.states() == {"a": "loaded", "b": "loaded", "c": "unloaded", "big": "unloaded"}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, kind in (("a", "llama"), ("b", "qwen2")):
            engine = tiny_engine(root / kind)
            want = engine.tokenizer.decode(greedy(engine, PROMPTS[0], 8))
            assert completion_text(server.openai, name, PROMPTS[0], 8) == want
    finally:
        torch.set_num_threads(before)
    assert server.metric("paceline:generation_tokens_total", "a") >= 8
    assert server.metric("paceline:generation_tokens_total", "b") >= 8
    # the server's threads take turns in the GIL every 0.5 ms, not Python's 5 (multi.GIL_SWITCH_S)
    assert "interpreter switch interval 0.50 ms" in server.output()


def test_unknown_model_is_404_with_an_openai_error(tiny):
    server, _ = tiny
    with pytest.raises(openai.NotFoundError) as e:
        server.openai.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "Served: a, b, c, big" in e.value.body["message"]
    r = server.http.post("/tokenize", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert server.http.post("/tokenize", json={"model": "b", "prompt": "hi"}).json()["count"] == 2


def test_a_model_too_big_for_the_budget_is_503_and_the_server_goes_on(tiny):
    server, _ = tiny
    r = server.http.post("/v1/completions", json={"model": "big", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "model_not_loaded" and "budget" in r.json()["error"]["message"]
    assert server.states()["big"] == "unloaded"
    assert server.openai.completions.create(model="a", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def _stream(server: Server, model: str, max_tokens: int) -> int:
    """A streamed completion; the tokens it generated, as its usage chunk says (a random model's byte tokens may
    be held back as incomplete UTF-8, so chunks with text undercount)."""
    stream = server.openai.completions.create(model=model, prompt="a long story", max_tokens=max_tokens,
                                              temperature=0.0, stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True})
    return [chunk.usage.completion_tokens for chunk in stream if chunk.usage is not None][-1]


def test_loading_evicts_the_lru_idle_model_while_requests_arrive_and_streams_go_on(tiny):
    server, _ = tiny
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        long_a = pool.submit(_stream, server, "a", 200)  # a stream of the pinned model runs through the load
        time.sleep(0.3)
        # four requests for the unloaded model at once: one load, b (idle, unpinned, least recently used) evicted
        for_c = [pool.submit(server.openai.completions.create, model="c", prompt=p, max_tokens=4)
                 for p in ["one", "two", "three", "four"]]
        assert all(f.result().usage.completion_tokens == 4 for f in for_c)
        assert server.states() == {"a": "loaded", "b": "unloaded", "c": "loaded", "big": "unloaded"}
        assert server.metric("paceline:model_loads", "c") == 1.0
        # the load's timeline, request to first token, in the order things must happen (no warm-up forwards)
        card = next(m for m in server.http.get("/v1/models").json()["data"] if m["id"] == "c")
        marks = [m for m in card["last_load"] if not m.startswith("piece")]
        assert marks == ["lock", "estimated", "room", "build_start", "engine_built", "mapped", "loaded", "joined",
                         "request_added", "first_step_start", "first_step_end", "first_token"], card["last_load"]
        # the load's pieces (residency turns): each ends after the build started and before the pages are mapped
        pieces = [v for m, v in card["last_load"].items() if m.startswith("piece")]
        assert pieces and all(card["last_load"]["build_start"] <= v <= card["last_load"]["mapped"] for v in pieces)
        # two loaded, a pinned and streaming, c streaming: nothing can be evicted for b, so 503 + Retry-After
        # b's request goes out once c's stream has its first token, so c is surely busy however fast the machine
        long_c = server.openai.completions.create(model="c", prompt="a long story", max_tokens=200, temperature=0.0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        chunks = iter(long_c)
        next(chunks)
        r = server.http.post("/v1/completions", json={"model": "b", "prompt": "hi", "max_tokens": 2})
        c_tokens = [chunk.usage.completion_tokens for chunk in chunks if chunk.usage is not None][-1]
        if r.status_code == 200:
            # the tiny model can finish c's 200 tokens before b's request lands (c is idle then, and b may evict
            # it); what must never happen is a stream cut by an eviction
            assert c_tokens == 200, (r.text, c_tokens)
        else:
            assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
            assert "none of them is idle and unpinned" in r.json()["error"]["message"]
        assert long_a.result() == 200 and c_tokens == 200
    # now c is idle: b loads again, evicting c
    assert server.openai.completions.create(model="b", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    assert server.states()["c"] == "unloaded" and server.metric("paceline:model_loads", "b") == 2.0


def test_keep_alive_zero_unloads_once_idle(tiny):
    server, _ = tiny
    r = server.openai.completions.create(model="b", prompt="hi", max_tokens=2, extra_body={"keep_alive": 0})
    assert r.usage.completion_tokens == 2
    deadline = time.monotonic() + 5
    while server.states()["b"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.states()["b"] == "unloaded"
    bad = server.http.post("/v1/completions", json={"model": "a", "prompt": "hi", "keep_alive": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"


# ---- the bundled model under two names and numeric modes --------------------------------------------------------

def test_bundled_model_as_fp32_and_int4_in_one_server_equals_one_model_serving(tmp_path):
    (tmp_path / "models.yaml").write_text("models:\n  - {name: smol-fp32, dtype: float32}\n"
                                          "  - {name: smol-int4, quantization: int4}\n")
    server = Server("--models-config", str(tmp_path / "models.yaml"), "--max-step-ms", "0", "--kv-cache-memory-gb",
                    "0.1", "--swap-space-gb", "0", "--no-dashboard")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one request of each model in flight at once
            got = {(name, p): pool.submit(completion_text, server.openai, name, p, 16)
                   for p in PROMPTS for name in ("smol-fp32", "smol-int4")}
            got = {k: f.result() for k, f in got.items()}
    finally:
        server.stop()
    for name, kw in (("smol-fp32", {"dtype": "float32"}), ("smol-int4", {"quantization": "int4"})):
        engine = Engine(EngineConfig(tbt_goal_ms=0, cache=CacheConfig(kv_cache_memory_gb=0.1, swap_space_gb=0), **kw))
        for p in PROMPTS:
            assert got[(name, p)] == engine.tokenizer.decode(greedy(engine, p, 16)), (name, p)
    assert got[("smol-fp32", PROMPTS[0])] != "" and got[("smol-int4", PROMPTS[0])] != ""
