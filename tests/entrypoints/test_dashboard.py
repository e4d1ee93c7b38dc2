"""The live dashboard: the step log the engine thread fills, the event feed, the page's chart code (run under node
when node is present), and the page itself in headless Chromium over a real server with the bundled model (run
when playwright and a chromium binary are present: `pip install playwright`, `apt-get install chromium`)."""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from paceline.engine.async_engine import AsyncEngine
from paceline.engine.engine import StepStats
from paceline.engine.metrics import EngineMetrics
from paceline.engine.step_log import LatencyBins, StepLog
from paceline.entrypoints.dashboard import charts_js, feed
from paceline.entrypoints.server import ServerSettings, add_serve_args, build_app
from paceline.request import Request
from paceline.sampling import SamplingParams

CHARTS_JS = Path(__file__).parents[2] / "paceline" / "entrypoints" / "static" / "charts.js"
KEY = "dash-key"


class TableFakeEngine(FakeEngine):
    """The fake plus the one thing the request table reads of the real engine: scheduler.requests."""

    @property
    def scheduler(self) -> SimpleNamespace:
        return SimpleNamespace(requests={r.request_id: r for r in self.waiting + self.running})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def live_server(engine: FakeEngine, **settings):
    """A real uvicorn server on 127.0.0.1 in a thread (the test client cannot stream an endless response)."""
    metrics = EngineMetrics(engine.model_name)
    app = build_app(AsyncEngine(engine, on_step=metrics.on_step), metrics, ServerSettings(**settings))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", metrics
    finally:
        server.should_exit = True
        thread.join(20)


def read_feed(url: str, until, timeout: float = 30.0, headers: dict | None = None) -> list[dict]:
    """Feed messages until until(messages) holds (or the timeout: the caller's asserts then say what is missing)."""
    messages: list[dict] = []
    deadline = time.monotonic() + timeout
    with httpx.stream("GET", url + "/dashboard/events", headers=headers, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                messages.append(json.loads(line[len("data: "):]))
                if until(messages) or time.monotonic() > deadline:
                    break
    return messages


def post_completions(url: str, jobs: list[tuple[str, int, int]], headers: dict | None = None) -> list[dict]:
    """(prompt, max_tokens, priority) each in its own thread, all at once; the responses' usage in order."""
    usage: list[dict] = [{}] * len(jobs)

    def one(i: int, prompt: str, max_tokens: int, priority: int) -> None:
        r = httpx.post(url + "/v1/completions", headers=headers, timeout=120, json={
            "prompt": prompt, "max_tokens": max_tokens, "priority": priority, "ignore_eos": True})
        usage[i] = r.json()["usage"]

    threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return usage


def steps_of(messages: list[dict]) -> list[dict]:
    return [s for m in messages for s in m["steps"]]


def idle_after_traffic(messages: list[dict]) -> bool:
    """The requests came and went, and a latency message followed the idle snapshot (so it counts them all)."""
    busy, idle_at = False, None
    for i, m in enumerate(messages):
        if m["state"] and m["state"]["num_requests"]:
            busy, idle_at = True, None
        elif m["state"] and busy and idle_at is None:
            idle_at = i
    return idle_at is not None and any(m["latency"] for m in messages[idle_at:])


# six requests, two seats: some wait, at three priorities; 20 ms steps so a 4 Hz snapshot sees it
JOBS = [("abcdefgh" * (1 + i % 3), 12 + i, i % 3) for i in range(6)]


@pytest.fixture(scope="module")
def fake_run():
    """One fake-engine server, one page's feed while traffic runs: (messages, usage of each request)."""
    engine = TableFakeEngine(max_num_seqs=2, step_s=0.02)
    with live_server(engine) as (url, metrics):
        usage: list[dict] = []

        def traffic() -> None:
            time.sleep(0.5)  # the page is connected first, so its snapshots see the queue fill
            usage.extend(post_completions(url, JOBS))

        t = threading.Thread(target=traffic)
        t.start()
        messages = read_feed(url, idle_after_traffic)
        t.join()
        deadline = time.monotonic() + 5
        while metrics.step_log.subscribers and time.monotonic() < deadline:
            time.sleep(0.05)
        left = metrics.step_log.subscribers  # the page left: the engine thread stops snapshotting
        yield messages, usage, left


def test_feed_carries_every_step_once_with_true_composition(fake_run):
    messages, usage, _ = fake_run
    assert messages[0]["info"]["model"] == "fake-model" and messages[0]["info"]["started"] > 0
    steps = steps_of(messages)
    assert [s["seq"] for s in steps] == list(range(1, len(steps) + 1))  # none lost, none twice
    assert all(s["model"] == "fake-model" for s in steps)
    assert all(m["model"] == "fake-model" for m in messages)
    # the fake runs a whole prompt in a request's first step and one decode token per later step
    assert sum(s["prefill"] for s in steps) == sum(u["prompt_tokens"] for u in usage)
    assert sum(s["decode"] for s in steps) == sum(u["completion_tokens"] - 1 for u in usage)
    assert max(s["reqs"] for s in steps) == 2 and max(s["waiting"] for s in steps) >= 1
    assert all(abs(s["dur"] - 0.02) < 1e-9 and s["pred"] == 0 for s in steps)
    info = next(m["info"] for m in messages if "info" in m and "max_num_seqs" in m["info"])
    assert info["max_num_seqs"] == 2 and info["num_blocks"] == 1024


def test_feed_snapshots_requests_by_priority_and_empties_when_idle(fake_run):
    messages, _, left = fake_run
    states = [m["state"] for m in messages if m["state"]]
    busy = [s for s in states if s["num_requests"]]
    assert busy and states[-1] == {**states[-1], "num_requests": 0, "requests": []}
    priorities = {p for s in busy for p in s["by_priority"]}
    assert priorities <= {"0", "1", "2"} and len(priorities) >= 2
    for s in busy:
        rows = s["requests"]
        assert len(rows) == s["num_requests"] == sum(sum(c.values()) for c in s["by_priority"].values())
        assert sum(r["state"] == "running" for r in rows) <= 2
        ranks = [(r["state"] != "running", r["priority"]) for r in rows]
        assert ranks == sorted(ranks)  # running first, then by priority
        assert all(r["id"].startswith("cmpl-") and 0 <= r["out"] <= r["max_out"] and r["age"] >= 0 for r in rows)
    assert any(c["waiting"] for s in busy for c in s["by_priority"].values())
    assert left == 0


def test_feed_latency_histograms_count_every_first_token_and_gap(fake_run):
    messages, usage, _ = fake_run
    lat = [m["latency"] for m in messages if m["latency"]][-1]
    assert sum(lat["ttft"]["counts"]) == len(JOBS)
    assert sum(lat["tbt"]["counts"]) == sum(u["completion_tokens"] - 1 for u in usage)
    assert len(lat["tbt"]["counts"]) == len(lat["tbt"]["edges"]) + 1 and lat["window_s"] == 60
    # the fake's gaps are its 20 ms steps (a little more, for the event loop): bucket (0.02, 0.03] or next ones
    assert sum(lat["tbt"]["counts"][:3]) == 0


def test_step_log_ring_wraps_and_resumes_from_a_seq():
    log = StepLog("m", capacity=4)
    stats = SimpleNamespace(num_running=1, num_waiting=0, num_swapped=0, num_used_blocks=3, num_blocks=10,
                            num_free_blocks=7, num_cached_blocks=2)
    for i in range(10):
        log.record(StepStats(1, i, 1, 0.01, predicted_s=0.02), stats, 0, float(i))
    assert [s["seq"] for s in log.steps_since(0)] == [7, 8, 9, 10]
    assert [s["prefill"] for s in log.steps_since(8)] == [8, 9]
    assert log.steps_since(10) == []
    s = log.steps_since(9)[0]
    assert s == {"model": "m", "seq": 10, "t": 9.0, "dur": 0.01, "pred": 0.02, "decode": 1, "prefill": 9, "reqs": 1,
                 "running": 1, "waiting": 0, "swapped": 0, "kv_used": 3, "kv_cached": 2, "kv_free": 7,
                 "preempted": 0, "swapped_out": 0, "stalls": 0, "ctx": 0, "dctx": 0, "target": 0.0, "scale": 0.0}


def test_step_log_records_what_explains_a_step():
    # the scheduler's stats after a step name its chunk's depth, the decodes' context, the target and the scale
    log = StepLog("m")
    stats = SimpleNamespace(num_running=7, num_waiting=0, num_swapped=0, num_used_blocks=3, num_blocks=10,
                            num_free_blocks=7, num_cached_blocks=2, last_step_context=1216,
                            last_step_decode_context=1400, last_step_target_ms=67.5, last_step_scale=1.1)
    log.record(StepStats(6, 16, 7, 0.07, predicted_s=0.066), stats, 0, 1.0)
    s = log.steps_since(0)[0]
    assert (s["ctx"], s["dctx"], s["target"], s["scale"]) == (1216, 1400, 67.5, 1.1)


def test_latency_bins_keep_only_the_last_minute():
    bins = LatencyBins((0.1, 1.0))
    bins.add([0.05], 100.2)
    bins.add([0.5], 100.7)
    bins.add([5.0], 130.0)
    assert bins.histogram(130.5) == [1, 1, 1]
    assert bins.histogram(160.5) == [0, 0, 1]  # second 100 is more than 60 s back
    assert bins.histogram(500.0) == [0, 0, 0]


def test_metrics_feed_the_step_log_stalls_and_snapshots_only_while_watched():
    m = EngineMetrics("m")
    log = m.step_log
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=8), arrival_time=10.0, priority=2)
    decode = StepStats(1, 0, 1, 0.01, num_preempted=1, predicted_s=0.012)
    stats = SimpleNamespace(num_running=1, num_waiting=0, num_swapped=0, num_blocks=10, num_used_blocks=2,
                            num_free_blocks=8, kv_usage=0.2, prefix_cache_queries=0, prefix_cache_hits=0,
                            num_preemptions=0)
    engine = SimpleNamespace(last_step=decode, stats=lambda: stats, model_name="m", config=None,
                             scheduler=SimpleNamespace(requests={"r": req}))
    out = SimpleNamespace(request_id="r", request=req, new_token_ids=[1], finished=False, finish_reason=None,
                          num_prompt_tokens=3, num_output_tokens=0)
    for _ in range(5):
        m.on_step(engine, [], True)  # median decode step 10 ms: a gap over 50 ms is a stall
    assert log.snapshot is None  # nobody watches: the requests are not walked
    for t in (11.0, 11.01, 11.3):  # the second gap, 290 ms, is a stall
        req.append_token(1, t)
    log.subscribers = 1
    m.on_step(engine, [out], True)
    steps = log.steps_since(0)
    assert len(steps) == 6 and steps[-1]["stalls"] == 1 and steps[0]["stalls"] == 0
    assert steps[-1]["pred"] == 0.012 and steps[-1]["preempted"] == 1
    assert log.snapshot["by_priority"] == {"2": {"running": 0, "waiting": 1, "swapped": 0}}
    assert log.snapshot["requests"][0]["id"] == "r" and log.snapshot["requests"][0]["out"] == 3
    lat = log.latency(11.5)
    assert sum(lat["ttft"]["counts"]) == 1 and sum(lat["tbt"]["counts"]) == 2
    assert EngineMetrics("m", step_log=False).step_log is None


def test_feed_ends_when_the_server_closes():
    log = StepLog("m")
    open_ = [True]

    async def run() -> list[str]:
        chunks = []
        async for chunk in feed([log], lambda: open_[0], tick_s=0.01):
            chunks.append(chunk)
            assert log.subscribers == 1
            if len(chunks) == 4:
                open_[0] = False
        return chunks

    chunks = asyncio.run(asyncio.wait_for(run(), 5))
    assert chunks[0].startswith("retry:") and len(chunks) == 4 and log.subscribers == 0  # no tick after close


def test_dashboard_needs_the_api_key_bearer_or_basic():
    engine = TableFakeEngine()
    metrics = EngineMetrics(engine.model_name)
    app = build_app(AsyncEngine(engine, on_step=metrics.on_step), metrics, ServerSettings(api_key=KEY))
    basic = "Basic " + base64.b64encode(f"anyone:{KEY}".encode()).decode()
    with TestClient(app) as c:
        for path in ("/dashboard", "/dashboard/events"):
            r = c.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert c.get(path, headers={"Authorization": "Basic !!notbase64"}).status_code == 401
        for auth in (f"Bearer {KEY}", basic):
            r = c.get("/dashboard", headers={"Authorization": auth})
            assert r.status_code == 200 and "PacelineCharts" in r.text and "/*CHARTS_JS*/" not in r.text


def test_no_dashboard_flag_and_setting():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(["--no-dashboard"]).no_dashboard and not parser.parse_args([]).no_dashboard
    engine = TableFakeEngine()
    metrics = EngineMetrics(engine.model_name)
    app = build_app(AsyncEngine(engine, on_step=metrics.on_step), metrics, ServerSettings(dashboard=False))
    with TestClient(app) as c:
        assert c.get("/dashboard").status_code == 404 and c.get("/dashboard/events").status_code == 404
        assert c.get("/health").status_code == 200


# ---- the page's chart code, without a browser ----------------------------------------------------------------------

NODE_SCRIPT = r"""
const C = require(process.argv[2]);
const msgs = JSON.parse(require("fs").readFileSync(process.argv[3], "utf8"));
const store = C.createStore();
for (const m of msgs) C.ingest(store, m);
const steps = store.models.get("fake-model").steps.length;
for (const m of msgs) C.ingest(store, m);  // a reconnect resends its backlog: nothing twice
const m = store.models.get("fake-model");
const again = m.steps.length;
const calls = {};
const ctx = new Proxy({}, {
  get: (t, k) => (k in t ? t[k] : (...a) => { calls[k] = (calls[k] || 0) + 1; return k === "measureText" ? { width: 30 } : undefined; }),
  set: (t, k, v) => { t[k] = v; return true; },
});
const contexts = {};
for (const p of ["composition", "duration", "queues", "kv", "ttft", "tbt"]) contexts[p] = { ctx, w: 480, h: 210 };
const drawn = C.drawModel(contexts, m, 60);
const col = C.columns(m.steps, m.now, 60);
const pc = C.priorityColumns(m.history, m.now, 60);
const lat = m.latency;
C.ingest(store, { model: "fake-model", now: 1, info: { model: "fake-model", started: -1 }, steps: [{ seq: 1, t: 1, dur: 0.1, pred: 0, decode: 1, prefill: 0 }] });
console.log(JSON.stringify({ steps, again, drawn, fillRect: calls.fillRect || 0, fill: calls.fill || 0,
  decode: col.decode.reduce((a, b) => a + b, 0), prefill: col.prefill.reduce((a, b) => a + b, 0),
  series: pc.series.map((s) => s.label), historyPoints: pc.x.length,
  ttft: lat.ttft.counts.reduce((a, b) => a + b, 0), afterRestart: store.models.get("fake-model").steps.length }));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the page's JS is tested in Chromium only")
def test_page_chart_code_under_node(fake_run, tmp_path):
    messages, usage, _ = fake_run
    (tmp_path / "messages.json").write_text(json.dumps(messages))
    (tmp_path / "check.js").write_text(NODE_SCRIPT)
    out = subprocess.run(["node", str(tmp_path / "check.js"), str(CHARTS_JS), str(tmp_path / "messages.json")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    steps = steps_of(messages)
    assert got["steps"] == got["again"] == got["drawn"] == len(steps)
    assert got["fillRect"] >= len(steps)  # a bar (two, where a step had both kinds) per step, plus dots
    assert got["fill"] > 0  # the stacked areas
    assert got["decode"] == sum(s["decode"] for s in steps) and got["prefill"] == sum(s["prefill"] for s in steps)
    # which priority is running or waiting at a 0.25 s snapshot depends on the machine's speed: ask only that both
    # states were drawn, each labelled with a priority
    labels = set(got["series"])
    assert any(s.startswith("running p") for s in labels) and any(s.startswith("waiting p") for s in labels), labels
    assert got["historyPoints"] == sum(1 for m in messages if m["state"])
    assert got["ttft"] == len(JOBS)
    assert got["afterRestart"] == 1  # another server (new `started`): the old steps are dropped


# ---- the page in headless Chromium, over a real server with the bundled model ------------------------------------

def chromium_path() -> str | None:
    for name in (os.environ.get("PACELINE_CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def playwright_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    if chromium_path() is None:
        return "no chromium binary (apt-get install chromium, or set PACELINE_CHROMIUM)"
    return None


class RealServer:
    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="paceline-dashboard-", suffix=".log", delete=False)
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        self.proc = subprocess.Popen([sys.executable, "-m", "paceline.entrypoints.server", "--port", str(self.port),
                                      *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{Path(self.log.name).read_text()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


AUTH = {"Authorization": f"Bearer {KEY}"}
# a small KV cache (16 blocks x 16 tokens) so six prompts cannot all run: some wait, some may be preempted
REAL_JOBS = [(f"Story {i}: write a long story about the sea and a lighthouse keeper. " * (1 + i % 3), 16, i % 2)
             for i in range(6)]


@pytest.fixture(scope="module")
def real_server():
    server = RealServer("--api-key", KEY, "--num-kv-blocks", "16", "--max-num-batched-tokens", "64")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_real_server_feed_matches_the_requests(real_server):
    url = real_server.url
    usage: list[dict] = []
    t = threading.Thread(target=lambda: (time.sleep(0.3), usage.extend(post_completions(url, REAL_JOBS, AUTH))))
    t.start()
    def done(ms: list[dict]) -> bool:
        states = [m["state"] for m in ms if m["state"]]
        return not t.is_alive() and bool(states) and states[-1]["num_requests"] == 0

    messages = read_feed(url, done, timeout=240, headers=AUTH)
    t.join()
    steps = steps_of(messages)
    assert steps and [s["seq"] for s in steps] == list(range(steps[0]["seq"], steps[0]["seq"] + len(steps)))
    # every prompt token not served by the prefix cache ran in some step's prompt chunk (a recomputed one again)
    prompt_tokens = sum(u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert sum(s["prefill"] for s in steps) >= prompt_tokens
    if not any(s["preempted"] for s in steps):
        assert sum(s["prefill"] for s in steps) == prompt_tokens
    assert max(s["prefill"] + s["decode"] for s in steps) <= 64 + max(s["decode"] for s in steps)
    assert max(s["kv_used"] for s in steps) <= 16 and all(s["kv_used"] + s["kv_free"] == 16 for s in steps)
    assert max(s["waiting"] for s in steps) >= 1
    info = next(m["info"] for m in messages if "info" in m and m["info"].get("num_blocks"))
    assert info["num_blocks"] == 16 and info["max_num_batched_tokens"] == 64 and info["policy"] == "stall-free"


@pytest.mark.slow
@pytest.mark.skipif(playwright_missing() is not None, reason=str(playwright_missing()))
def test_page_draws_live_steps_in_headless_chromium(real_server):
    from playwright.sync_api import sync_playwright

    url = real_server.url
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000},
                                    http_credentials={"username": "me", "password": KEY})
            page.goto(url + "/dashboard")
            page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=30_000)
            t = threading.Thread(target=post_completions, args=(url, REAL_JOBS, AUTH))
            t.start()
            page.wait_for_function("document.querySelector('table.requests tbody tr.running') !== null",
                                   timeout=120_000)
            t.join()
            page.wait_for_function("document.querySelector('table.requests tbody td.muted') !== null "
                                   "&& /no requests/.test(document.querySelector('table.requests tbody').textContent)",
                                   timeout=60_000)
            page.wait_for_timeout(1500)  # the next latency message (once a second)
            drawn = int(page.text_content("#steps-drawn").split()[0])
            store = page.evaluate("""() => { const m = [...window.pacelineDashboard.store.models.values()][0];
                return {steps: m.steps.length, prefill: m.steps.reduce((a, s) => a + s.prefill, 0),
                        ttft: m.latency.ttft.counts.reduce((a, b) => a + b, 0), history: m.history.length,
                        model: m.name, rows: document.querySelectorAll('section.model').length,
                        rowDrawn: Number(document.querySelector('section.model').dataset.stepsDrawn)}; }""")
            assert drawn > 0 and drawn == store["steps"] == store["rowDrawn"], (drawn, store)
            assert store["prefill"] > 0 and store["ttft"] >= len(REAL_JOBS) and store["history"] > 0
            assert store["rows"] == 1 and store["model"].startswith("SmolLM2")
            # the canvases hold pixels: the composition chart is not blank
            blank = page.evaluate("""() => { const c = document.querySelector('canvas.composition');
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let colored = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 3] && (d[i] !== d[i + 1] || d[i + 1] !== d[i + 2])) colored++;
                return colored; }""")
            assert blank > 100
            shot = os.environ.get("PACELINE_DASHBOARD_SCREENSHOT")
            if shot:
                page.screenshot(path=shot, full_page=True)

            # the same chart code on a static page (a report): drawSteps over step records
            steps = page.evaluate("() => [...window.pacelineDashboard.store.models.values()][0].steps")
            static = browser.new_page()
            static.set_content(f"<div id=c></div><script>{charts_js()}</script>")
            n = static.evaluate("steps => PacelineCharts.drawSteps(document.getElementById('c'), steps)", steps)
            assert n == len(steps) and static.locator("section.model canvas").count() == 6
        finally:
            browser.close()


# ---------------------------------------------------------------- static reports (`--html`)

def page_data(path: Path) -> dict:
    """The run data a static report embeds (what its charts draw)."""
    text = path.read_text()
    start = text.index('<script id="run-data" type="application/json">') + len('<script id="run-data" type="application/json">')
    return json.loads(text[start:text.index("</script>", start)])


def test_bench_serve_html_report_holds_the_runs_steps_only(tmp_path):
    from paceline.bench import cli as bench_cli

    engine = TableFakeEngine(max_num_seqs=2, step_s=0.005)
    with live_server(engine) as (url, metrics):
        post_completions(url, JOBS[:2])  # steps before the run: not the run's
        before = metrics.step_log.num_steps
        assert before > 0
        rc = bench_cli.main(["serve", "--url", url, "--workload", "chat", "--num-requests", "4", "--rate", "50",
                             "--max-model-len", "256", "--output-dir", str(tmp_path), "--no-plots", "--no-progress",
                             "--html"])
        assert rc == 0
        after = metrics.step_log.num_steps
        r = httpx.get(url + "/dashboard/steps")
        assert r.status_code == 200 and r.json()["models"][0]["num_steps"] == after
    data = page_data(tmp_path / "report.html")
    seqs = [s["seq"] for s in data["steps"]]
    assert seqs == list(range(before + 1, after + 1))  # exactly the steps the run made
    assert set(data["models"]) == {engine.model_name}  # one row: the latency joins the server's step log
    results = json.loads((tmp_path / "results.json").read_text())["runs"][0]
    assert sum(data["latency"][engine.model_name]["ttft"]["counts"]) == results["summary"]["completed"] == 4
    assert "</script" not in json.dumps(data)  # the payload cannot close its own element early


def test_static_report_steps_endpoint_needs_the_key():
    engine = TableFakeEngine()
    with live_server(engine, api_key=KEY) as (url, _):
        assert httpx.get(url + "/dashboard/steps").status_code == 401
        assert httpx.get(url + "/dashboard/steps", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


@pytest.mark.skipif(playwright_missing() is not None, reason=str(playwright_missing()))
def test_simulated_report_draws_in_headless_chromium(tmp_path):
    from playwright.sync_api import sync_playwright

    page_path = tmp_path / "sim.html"
    out = subprocess.run([sys.executable, "-m", "paceline.entrypoints.cli", "simulate", "--workload", "chat",
                          "--rate", "4", "--num-requests", "60", "--replicas", "2", "--no-plots", "--html",
                          str(page_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = page_data(page_path)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(page_path.as_uri())
            page.wait_for_function("document.body.dataset.stepsDrawn !== undefined", timeout=30_000)
            assert int(page.evaluate("document.body.dataset.stepsDrawn")) == len(data["steps"])
            assert page.evaluate("document.querySelectorAll('section.model').length") == 2
        finally:
            browser.close()
