"""docs/dashboard.png: a server with the bundled model under mixed traffic (short and long prompts, three
priorities, a KV cache small enough to preempt), its /dashboard in headless Chromium, a screenshot.

    python benchmarks/dashboard_screenshot.py --out docs/dashboard.png --rate 2 -- --max-step-ms 150 \
        --scheduling-policy priority --num-kv-blocks 200

Needs playwright (pip) and a chromium binary (Debian: apt-get install chromium).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

STORY = "Write a long story about the sea, a lighthouse keeper and a storm that lasts three days. "


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="docs/dashboard.png")
    p.add_argument("--seconds", type=float, default=40.0, help="how long traffic runs before the screenshot")
    p.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson arrivals)")
    p.add_argument("server_args", nargs="*", help="after --: flags for the server")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    threads: list[threading.Thread] = []
    log = tempfile.NamedTemporaryFile("w+", prefix="paceline-dash-shot-", suffix=".log", delete=False)
    server = subprocess.Popen([sys.executable, "-m", "paceline.entrypoints.server", "--port", str(port),
                               *args.server_args], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(open(log.name).read())
            time.sleep(0.5)
        rng = random.Random(0)
        stop = threading.Event()

        def one(prompt: str, max_tokens: int, priority: int) -> None:
            try:
                httpx.post(url + "/v1/completions", timeout=600, json={
                    "prompt": prompt, "max_tokens": max_tokens, "priority": priority, "ignore_eos": True})
            except httpx.HTTPError:
                pass

        def arrivals() -> None:
            while not stop.is_set():
                long = rng.random() < 0.2
                prompt = STORY * (rng.randint(12, 20) if long else rng.randint(1, 3))
                t = threading.Thread(target=one, args=(prompt, rng.randint(24, 96), rng.choice((0, 1, 1, 2, 2, 2))))
                t.start()
                threads.append(t)
                stop.wait(rng.expovariate(args.rate))

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 1050})
            page.goto(url + "/dashboard")
            driver = threading.Thread(target=arrivals)
            driver.start()
            time.sleep(args.seconds)
            page.screenshot(path=args.out, full_page=False)
            print(page.text_content("#steps-drawn"), "->", args.out)
            stop.set()
            driver.join()
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
        for t in threads:
            t.join(0)


if __name__ == "__main__":
    main()
