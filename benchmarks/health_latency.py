"""Is the HTTP event loop responsive while the model runs? 32 concurrent streaming clients (greedy, ignore_eos)
against a server while a separate thread polls /health every 20 ms; prints /health latency p50/p99/max and
checks every client's output (full length, identical to a reference run of the same greedy request).

    python benchmarks/health_latency.py --url http://127.0.0.1:8000            # a server you started
    python benchmarks/health_latency.py --start-server -- --kv-cache-memory-gb 0.5   # start one here
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

PROMPT = "Write a short story about a lighthouse keeper."


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def poll_health(url: str, every_s: float, stop: threading.Event, out: list[float], errors: list[str]) -> None:
    """Its own thread and connection, so the clients' event loop does not delay the measurement."""
    with httpx.Client(base_url=url, timeout=10) as client:
        next_at = time.perf_counter()
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                r = client.get("/health")
                if r.status_code != 200:
                    errors.append(f"status {r.status_code}")
            except httpx.HTTPError as e:
                errors.append(repr(e))
            out.append(time.perf_counter() - t0)
            next_at += every_s
            time.sleep(max(0.0, next_at - time.perf_counter()))


async def stream_one(client: httpx.AsyncClient, body: dict) -> dict:
    t0 = time.perf_counter()
    text, reason, usage, first = "", None, None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"status {r.status_code}: {(await r.aread()).decode()[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            for c in chunk["choices"]:
                if c["text"] and first is None:
                    first = time.perf_counter() - t0
                text += c["text"]
                reason = c["finish_reason"] or reason
            usage = chunk.get("usage") or usage
    return {"text": text, "finish_reason": reason, "usage": usage, "ttft": first, "e2e": time.perf_counter() - t0}


async def run(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600, limits=limits) as client:
        reference = await stream_one(client, body)  # alone: also warms the server up
        if "error" in reference:
            print("reference request failed:", reference["error"])
            return 1
        idle: list[float] = []
        stop, errors = threading.Event(), []
        poller = threading.Thread(target=poll_health, args=(args.url, args.poll_ms / 1000, stop, idle, errors))
        poller.start()
        await asyncio.sleep(1.0)  # a baseline with the server idle
        n_idle = len(idle)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, body) for _ in range(args.clients)))
        wall = time.perf_counter() - t0
        stop.set()
        poller.join()
    busy = idle[n_idle:]
    idle = idle[:n_idle]
    ok = [r for r in results if "error" not in r and r["text"] == reference["text"]
          and r["finish_reason"] == "length" and r["usage"]["completion_tokens"] == args.max_tokens]
    ms = lambda x: f"{1000 * x:7.1f} ms"  # noqa: E731
    print(f"{args.clients} streaming clients x {args.max_tokens} tokens (greedy, ignore_eos) in {wall:.2f} s "
          f"= {args.clients * args.max_tokens / wall:.0f} output tok/s")
    print(f"clients correct: {len(ok)}/{args.clients} (full length and identical to the reference text)")
    for r in results:
        if r not in ok:
            print("  bad client result:", {k: v for k, v in r.items() if k != "text"} | {"text": r.get("text", "")[:60]})
    print(f"TTFT p50 {ms(statistics.median(r['ttft'] for r in ok))}   e2e p50 "
          f"{ms(statistics.median(r['e2e'] for r in ok))}" if ok else "no correct clients")
    print(f"/health while idle ({len(idle)} polls):  p50 {ms(percentile(idle, 50))}  p99 {ms(percentile(idle, 99))}  "
          f"max {ms(max(idle))}")
    print(f"/health under load ({len(busy)} polls): p50 {ms(percentile(busy, 50))}  p99 {ms(percentile(busy, 99))}  "
          f"max {ms(max(busy))}   {'OK' if percentile(busy, 99) <= 0.1 else 'OVER'} (target p99 <= 100 ms)")
    if errors:
        print(f"/health errors: {len(errors)}, first: {errors[0]}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"clients": args.clients, "max_tokens": args.max_tokens, "wall_s": wall,
                       "clients_correct": len(ok), "health_busy_s": busy, "health_idle_s": idle,
                       "health_p50_s": percentile(busy, 50), "health_p99_s": percentile(busy, 99),
                       "health_max_s": max(busy)}, f, indent=1)
    return 0 if len(ok) == args.clients and not errors else 1


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "paceline.entrypoints.server", "--port", str(port), *extra],
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--poll-ms", type=float, default=20.0)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--api-key", default=None)
    p.add_argument("--json-out", default=None)
    p.add_argument("--start-server", action="store_true", help="start `python -m paceline.entrypoints.server` "
                   "on a free port with the arguments after `--`")
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    proc = None
    if args.start_server:
        proc, args.url = start_server(extra)
    try:
        code = asyncio.run(run(args))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    sys.exit(code)


if __name__ == "__main__":
    main()
