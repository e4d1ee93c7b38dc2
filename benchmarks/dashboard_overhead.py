"""What the live dashboard costs the step loop. Two measurements:

1. in process: EngineMetrics.on_step per step with and without the StepLog (and the requests snapshot a connected
   page adds, amortized over its 0.25 s interval), against the server's own measured step time;
2. end to end: the same fixed workload (16 concurrent greedy requests, ignore_eos) against a real server with the
   bundled model, --no-dashboard vs dashboard with no page vs one event-stream reader vs a headless Chromium page
   (when playwright and chromium are installed), interleaved over rounds; step count and wall time per step.

    flock -x /tmp/paceline-cpu.lock python benchmarks/dashboard_overhead.py --rounds 3

Only ratios from one run mean anything: the host is shared and its speed drifts.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import httpx

from paceline.engine.engine import StepStats
from paceline.engine.metrics import EngineMetrics
from paceline.engine.step_log import snapshot_requests
from paceline.request import Request, RequestStatus
from paceline.sampling import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper and the sea at night."


# ---- 1. in process ---------------------------------------------------------------------------------------------

def fake_engine(num_requests: int) -> tuple[SimpleNamespace, list]:
    reqs = []
    for i in range(num_requests):
        r = Request(f"cmpl-{i:032x}-0-0", list(range(100)), SamplingParams(max_tokens=10**6), 0.0, priority=i % 3)
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = 100
        reqs.append(r)
    stats = SimpleNamespace(num_running=num_requests, num_waiting=0, num_swapped=0, num_blocks=1000,
                            num_used_blocks=200, num_free_blocks=800, kv_usage=0.2, prefix_cache_queries=0,
                            prefix_cache_hits=0, num_preemptions=0, num_cached_blocks=50)
    engine = SimpleNamespace(last_step=StepStats(num_requests, 0, num_requests, 0.02), stats=lambda: stats,
                             model_name="m", config=None, scheduler=SimpleNamespace(requests={r.request_id: r for r in reqs}))
    return engine, reqs


def on_step_cost_us(step_log: bool, num_requests: int, steps: int = 3000) -> float:
    """Mean µs of EngineMetrics.on_step for a step where every running request got one token."""
    m = EngineMetrics("m", step_log=step_log)
    engine, reqs = fake_engine(num_requests)
    outs = [SimpleNamespace(request_id=r.request_id, request=r, new_token_ids=[1], finished=False, finish_reason=None,
                            num_prompt_tokens=100, num_output_tokens=0) for r in reqs]
    t = 0.0
    total = 0.0
    for _ in range(steps):
        t += 0.02
        for r in reqs:
            r.append_token(1, t)
        t0 = time.perf_counter()
        m.on_step(engine, outs, True)
        total += time.perf_counter() - t0
    return total / steps * 1e6


def snapshot_cost_us(num_requests: int, reps: int = 200) -> float:
    engine, reqs = fake_engine(num_requests)
    t0 = time.perf_counter()
    for _ in range(reps):
        snapshot_requests(reqs, 1.0)
    return (time.perf_counter() - t0) / reps * 1e6


# ---- 2. end to end ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, dashboard: bool, extra: list[str]) -> None:
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="paceline-dash-bench-", suffix=".log", delete=False)
        args = [sys.executable, "-m", "paceline.entrypoints.server", "--port", str(port), *extra]
        if not dashboard:
            args.append("--no-dashboard")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(open(self.log.name).read())
            time.sleep(0.2)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def workload(url: str, n: int, max_tokens: int) -> float:
    def one() -> None:
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text

    threads = [threading.Thread(target=one) for _ in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


class SSEReader:
    """A page's feed without a browser: reads and parses every message."""

    def __init__(self, url: str) -> None:
        self.stop = threading.Event()
        self.messages = 0
        self.thread = threading.Thread(target=self.run, args=(url,), daemon=True)
        self.thread.start()
        time.sleep(1.0)

    def run(self, url: str) -> None:
        import json
        with httpx.stream("GET", url + "/dashboard/events", timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    self.messages += 1
                if self.stop.is_set():
                    return

    def close(self) -> None:
        self.stop.set()


class ChromiumPage:
    def __init__(self, url: str) -> None:
        from playwright.sync_api import sync_playwright
        self.pw = sync_playwright().start()
        self.browser = self.pw.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        self.page = self.browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.goto(url + "/dashboard")
        self.page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=60_000)

    def close(self) -> None:
        print(f"    page: {self.page.text_content('#steps-drawn')}")
        self.browser.close()
        self.pw.stop()


def end_to_end(rounds: int, n: int, max_tokens: int, reps: int, extra: list[str]) -> dict[str, list[float]]:
    conditions = ["no-dashboard", "dashboard, no page", "dashboard + event-stream reader"]
    try:
        import playwright  # noqa: F401
        if shutil.which("chromium"):
            conditions.append("dashboard + headless Chromium page")
    except ImportError:
        pass
    per_step: dict[str, list[float]] = {c: [] for c in conditions}
    exec_ms: dict[str, list[float]] = {c: [] for c in conditions}
    for rnd in range(rounds):
        for dashboard in (False, True):
            server = Server(dashboard, extra)
            try:
                workload(server.url, n, 4)  # warm-up
                for cond in conditions:
                    if (cond == "no-dashboard") == dashboard:
                        continue
                    watcher = (SSEReader(server.url) if "reader" in cond else
                               ChromiumPage(server.url) if "Chromium" in cond else None)
                    try:
                        for _ in range(reps):
                            s0 = server.metric("paceline:engine_steps_total")
                            d0 = server.metric("paceline:step_duration_seconds_sum")
                            wall = workload(server.url, n, max_tokens)
                            steps = server.metric("paceline:engine_steps_total") - s0
                            dur = server.metric("paceline:step_duration_seconds_sum") - d0
                            per_step[cond].append(wall / steps * 1000)
                            exec_ms[cond].append(dur / steps * 1000)
                            print(f"  round {rnd} {cond:36s} {steps:.0f} steps, wall/step {wall / steps * 1000:6.2f} ms, "
                                  f"measured step {dur / steps * 1000:6.2f} ms", flush=True)
                    finally:
                        if watcher is not None:
                            watcher.close()
            finally:
                server.stop()
    print("\nend to end, medians over every workload run:")
    base = statistics.median(per_step["no-dashboard"])
    for cond in conditions:
        med, ex = statistics.median(per_step[cond]), statistics.median(exec_ms[cond])
        print(f"  {cond:36s} wall/step {med:6.2f} ms ({(med / base - 1) * 100:+5.1f} %), measured step {ex:6.2f} ms, "
              f"runs {len(per_step[cond])}")
    return per_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=2, help="workload runs per condition per round")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--skip-end-to-end", action="store_true")
    p.add_argument("server_args", nargs="*", help="after --: extra flags for the server")
    args = p.parse_args()

    print("in process, EngineMetrics.on_step per step (one token for each of N running requests):")
    for n in (1, 16, 64):
        off, on = on_step_cost_us(False, n), on_step_cost_us(True, n)
        snap = snapshot_cost_us(n)
        print(f"  N={n:3d}: without step log {off:7.1f} µs, with {on:7.1f} µs (+{on - off:5.1f} µs); "
              f"requests snapshot {snap:6.1f} µs every 0.25 s while a page is connected")
    if not args.skip_end_to_end:
        print(f"\nend to end: {args.requests} concurrent requests x {args.max_tokens} tokens, {args.reps} runs per "
              f"condition per round, {args.rounds} rounds")
        end_to_end(args.rounds, args.requests, args.max_tokens, args.reps, args.server_args)


if __name__ == "__main__":
    main()
