"""Overload with and without `--max-queue-delay-s`: the `chat` workload at a multiple of its capacity, the same
requests (same seed) against a fresh paceline server per configuration, one after the other in one process.

Reported per configuration: admitted streams (finished with every token) and their TBT p50/p99/max and TTFT
p50/p99; requests answered 503, split into those rejected at arrival (predicted wait over the limit) and those
that waited the limit out, with how long the client waited for the 503 (send to answer); any other error. A
configuration's requests that have not finished `--grace-s` after the last arrival are cancelled and counted as
unfinished (without admission control the queue only grows, so it would never drain in a bounded run).

    python benchmarks/overload.py --rate 2.8 --seconds 90 --configs off,5 --output /tmp/overload.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from paceline.bench.client import Endpoint, send_one
from paceline.bench.metrics import RequestRecord
from paceline.bench.peers import Server, System
from paceline.bench.prompts import PromptSource, build_prompts, load_tokenizer
from paceline.bench.workload import generate, load_workload


def pct(xs: list[float], q: float) -> float | None:
    return round(1000 * float(np.percentile(xs, q)), 1) if xs else None


async def drive(url: str, requests, prompts, grace_s: float) -> tuple[list[RequestRecord], dict[int, float]]:
    ep = Endpoint(url, send_priority=False)
    records = [RequestRecord(r.index, r.prompt_tokens, r.output_tokens, scheduled_s=r.arrival_s) for r in requests]
    answered: dict[int, float] = {}  # index -> seconds from send to the end of the response (errors included)
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=30)) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()

        async def one(spec, prompt, rec) -> None:
            await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - t0)))
            await send_one(client, ep, model, spec, prompt, rec, t0)
            answered[rec.index] = time.perf_counter() - t0 - rec.sent_s

        tasks = [asyncio.create_task(one(s, p, r)) for s, p, r in zip(requests, prompts, records)]
        end = max(r.arrival_s for r in requests) + grace_s
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, end - (time.perf_counter() - t0)))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for rec in records:
            if rec.index not in answered:
                rec.error = rec.error or "unfinished"
    return records, answered


def summarize(records: list[RequestRecord], answered: dict[int, float], tbt_slo_ms: float) -> dict:
    ok = [r for r in records if r.ok and r.num_output_tokens == r.output_tokens]
    gaps = [g for r in ok for g in r.gaps]
    r503 = [r for r in records if r.error and r.error.startswith("HTTP 503")]
    expired = [r for r in r503 if "waited longer" in r.error]
    at_arrival = [r for r in r503 if r not in expired]
    other = [r for r in records if r.error and r not in r503]
    return {
        "requests": len(records), "admitted_complete": len(ok),
        "tbt_ms": {"n": len(gaps), "p50": pct(gaps, 50), "p99": pct(gaps, 99), "max": pct(gaps, 100)},
        "tbt_p99_under_slo": bool(gaps) and pct(gaps, 99) < tbt_slo_ms,
        "ttft_ms": {"p50": pct([r.ttft for r in ok], 50), "p99": pct([r.ttft for r in ok], 99)},
        "rejected_at_arrival": {"n": len(at_arrival), "answer_ms_p50": pct([answered[r.index] for r in at_arrival], 50),
                                "answer_ms_p99": pct([answered[r.index] for r in at_arrival], 99),
                                "answer_ms_max": pct([answered[r.index] for r in at_arrival], 100)},
        "expired_in_queue": {"n": len(expired), "answer_ms_p50": pct([answered[r.index] for r in expired], 50),
                             "answer_ms_max": pct([answered[r.index] for r in expired], 100)},
        "other_errors": len(other), "other_error_examples": sorted({(r.error or "")[:120] for r in other})[:5],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="chat")
    p.add_argument("--rate", type=float, required=True, help="requests per second (e.g. 3x the chat capacity)")
    p.add_argument("--seconds", type=float, default=90.0, help="arrivals for this long")
    p.add_argument("--grace-s", type=float, default=30.0, help="then wait this long before cancelling the rest")
    p.add_argument("--configs", default="off,5", help="comma list: off, or a --max-queue-delay-s value")
    p.add_argument("--tbt-slo-ms", type=float, default=190.0, help="the strict TBT SLO (benchmarks/summaries/chat.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    p.add_argument("server_args", nargs="*", help="more `paceline serve` flags for every configuration (after --)")
    args = p.parse_args()
    spec = load_workload(args.workload)
    requests = generate(spec, rate=args.rate, duration_s=args.seconds, seed=args.seed)
    prompts = build_prompts(PromptSource(load_tokenizer()), requests, seed=args.seed, as_text=False)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
              "workload": args.workload, "rate": args.rate, "tbt_slo_ms": args.tbt_slo_ms, "configs": {}}
    for config in args.configs.split(","):
        flags = [] if config == "off" else ["--max-queue-delay-s", config]
        argv = [sys.executable, "-m", "paceline.entrypoints.cli", "--log-level", "WARNING", "serve", "--host",
                "127.0.0.1", "--port", "{port}", *flags, *args.server_args]
        with Server(System(f"paceline-{config}", argv), Path(f"/tmp/paceline-overload-{config}.log")) as server:
            httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=120)
            records, answered = asyncio.run(drive(server.url, requests, prompts, args.grace_s))
        report["configs"][config] = summarize(records, answered, args.tbt_slo_ms)
        print(config, json.dumps(report["configs"][config]), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
