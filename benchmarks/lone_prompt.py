"""A served lone prompt, taken apart: TTFT at the client, the step's own duration from the server's step log
(`GET /dashboard/steps`), the time before and after that step, and the server process's minor page faults per
request. With several `--variant` the servers run one after another, in rounds, so that an A/B shares the host's
mood.

    flock -x /tmp/paceline-cpu.lock env PYTHONPATH=. .venv/bin/python benchmarks/lone_prompt.py \
        --variant PACELINE_KEEP_HEAP=1 --variant PACELINE_KEEP_HEAP=0 --rounds 2

A variant is environment settings (KEY=VAL, joined by '+'; '' for none) for the server; `--serve-args` are passed to
every `paceline serve`. Token ids are fresh random ones per request, so no prefix is cached. The first request of
each server is reported apart (cold: the first step of that size maps its memory and builds oneDNN's primitives). RSS: the server's resident
memory after its last request (the KV pool's prefault included).
"""
from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def minor_faults(pid: int) -> int:
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[7])
        except (OSError, IndexError):  # a thread that ended meanwhile
            pass
    return total


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_server(env_text: str, serve_args: list[str], tokens: int, requests: int, settle_s: float) -> list[dict]:
    env = dict(os.environ)
    env.update(kv.split("=", 1) for kv in env_text.split("+") if kv)
    port = free_port()
    paceline = os.path.join(os.path.dirname(sys.executable), "paceline")
    server = subprocess.Popen([paceline, "--log-level", "WARNING", "serve", "--host", "127.0.0.1", "--port", str(port),
                               *serve_args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        client = httpx.Client(timeout=300)
        while True:
            try:
                if client.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                if server.poll() is not None:
                    raise RuntimeError(f"server exited with {server.returncode}") from None
            time.sleep(0.2)
        time.sleep(settle_s)  # the KV pool's background prefault runs while the engine is idle
        model = client.get(base + "/v1/models").json()["data"][0]["id"]
        rng = random.Random(0)
        rows = []
        for _ in range(requests):
            ids = [rng.randrange(200, 40000) for _ in range(tokens)]
            faults, sent = minor_faults(server.pid), time.monotonic()
            first = None
            with client.stream("POST", base + "/v1/completions",
                               json={"model": model, "prompt": ids, "max_tokens": 1, "stream": True}) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("data:") and '"text"' in line:
                        first = time.monotonic()
            rows.append({"sent": sent, "ttft": first - sent, "faults": minor_faults(server.pid) - faults})
            time.sleep(0.5)
        rows[-1]["rss_mb"] = rss_mb(server.pid)
        steps = client.get(base + "/dashboard/steps").json()["models"][0]["steps"]
        big = [s for s in steps if s["prefill"] >= tokens]
        for row, step in zip(rows, big):  # one step per lone prompt (the lone-prefill budget takes it whole)
            row.update(step=step["dur"], before=step["t"] - step["dur"] - row["sent"], after=row["ttft"] + row["sent"]
                       - step["t"])
        return rows
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", default=None, help="server environment, KEY=VAL joined by '+'")
    p.add_argument("--serve-args", default="", help="extra arguments for every paceline serve")
    p.add_argument("--tokens", type=int, default=1500)
    p.add_argument("--requests", type=int, default=6, help="per server; the first is reported apart")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--settle", type=float, default=5.0, help="seconds between a server's start and its first request")
    args = p.parse_args()
    variants = args.variant or [""]
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for rnd in range(args.rounds):
        for v in variants:
            rows = run_server(v, args.serve_args.split(), args.tokens, args.requests, args.settle)
            print(f"round {rnd + 1} [{v or 'default'}] cold: TTFT {rows[0]['ttft'] * 1e3:.1f} ms, "
                  f"{rows[0]['faults']} faults; warm TTFT ms {[round(r['ttft'] * 1e3, 1) for r in rows[1:]]}; "
                  f"RSS at the end {rows[-1]['rss_mb']:.0f} MB",
                  flush=True)
            results[v] += rows[1:]
    print(f"\n{args.tokens}-token lone prompts, warm requests ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")
    print("| variant | TTFT median (min-max) ms | step ms | before step ms | after step ms | minor faults a request |")
    print("|---|---:|---:|---:|---:|---:|")
    def med(rows: list[dict], key: str, scale: float = 1e3) -> str:
        vals = [r[key] * scale for r in rows if key in r]
        return f"{statistics.median(vals):.1f}" if vals else "-"

    for v, rows in results.items():
        ttft = [r["ttft"] * 1e3 for r in rows]
        print(f"| {v or 'default'} | {statistics.median(ttft):.1f} ({min(ttft):.1f}-{max(ttft):.1f}) | {med(rows, 'step')} | "
              f"{med(rows, 'before')} | {med(rows, 'after')} | {med(rows, 'faults', 1)} |")


if __name__ == "__main__":
    main()
