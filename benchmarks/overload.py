"""Overload with and without `--max-queue-delay-s`: the `chat` workload at a multiple of its capacity, the same
requests (same seed) against a fresh paceline server per configuration, one after the other in one process.

Reported per configuration: admitted streams (finished with every token) and their TBT p50/p99/max and TTFT
p50/p99; requests answered 503, split into those rejected at arrival (predicted wait over the limit) and those
that waited the limit out, with how long the client waited for the 503 (send to answer); any other error. A
configuration's requests that have not finished `--grace-s` after the last arrival are cancelled and counted as
unfinished (without admission control the queue only grows, so it would never drain in a bounded run). The
server's running and waiting gauges are sampled every second (their peaks say where the load went).

A configuration is `off` (no limit) or a `--max-queue-delay-s` value, optionally with `+auto`, which adds
`--max-num-seqs auto` (seats that follow the step-time target, so the running batch keeps the TBT goal and the
rest queues, where the queue-delay limit sees it), and optionally `@DIR`: the server of the paceline checkout in
DIR (an A/B of two versions of the code on the same requests in one run, e.g. `5+auto@/work/main,5+auto`):

    python benchmarks/overload.py --rate 2.8 --seconds 90 --configs off,5,5+auto --output /tmp/overload.json
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
from paceline.bench.server_metrics import QUEUE_TIME, histogram, parse_prometheus
from paceline.bench.workload import generate, load_workload


def pct(xs: list[float], q: float) -> float | None:
    return round(1000 * float(np.percentile(xs, q)), 1) if xs else None


def config_flags(config: str) -> list[str]:
    """`off` | `S` | `S+auto` (optionally `@DIR`) -> the `paceline serve` flags of that configuration."""
    delay, _, extra = config.partition("@")[0].partition("+")
    if extra not in ("", "auto"):
        raise ValueError(f"unknown configuration {config!r}: off, S or S+auto")
    flags = [] if delay == "off" else ["--max-queue-delay-s", str(float(delay))]
    return flags + (["--max-num-seqs", "auto"] if extra else [])


def server_command(config: str) -> list[str]:
    """`python -m paceline.entrypoints.cli`, of this checkout or, for `CONFIG@DIR`, of the checkout in DIR (an A/B
    of two versions of the code in one run: the same requests, the same minutes of the machine)."""
    _, at, where = config.partition("@")
    if not at:
        return [sys.executable, "-m", "paceline.entrypoints.cli"]
    if not (Path(where) / "paceline" / "entrypoints" / "cli.py").is_file():
        raise ValueError(f"{where!r} is not a paceline checkout (in configuration {config!r})")
    boot = (f"import runpy, sys; sys.path.insert(0, {str(Path(where).resolve())!r}); sys.argv[0] = 'paceline'; "
            "runpy.run_module('paceline.entrypoints.cli', run_name='__main__')")
    return [sys.executable, "-c", boot]


async def gauges(client: httpx.AsyncClient, url: str, peaks: dict[str, float], stop: asyncio.Event) -> None:
    """The peaks of the running / waiting gauges, sampled every second."""
    while not stop.is_set():
        try:
            snapshot = parse_prometheus((await client.get(url + "/metrics", timeout=5)).text)
            for name in ("running", "waiting"):
                if f"paceline:num_requests_{name}" in snapshot:
                    peaks[name] = max(peaks.get(name, 0.0), snapshot[f"paceline:num_requests_{name}"])
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except asyncio.TimeoutError:
            pass


async def drive(url: str, requests, prompts, grace_s: float,
                peaks: dict[str, float]) -> tuple[list[RequestRecord], dict[int, float]]:
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

        stop = asyncio.Event()
        poll = asyncio.create_task(gauges(client, url, peaks, stop))
        tasks = [asyncio.create_task(one(s, p, r)) for s, p, r in zip(requests, prompts, records)]
        end = max(r.arrival_s for r in requests) + grace_s
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, end - (time.perf_counter() - t0)))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        stop.set()
        await poll
        for rec in records:
            if rec.index not in answered:
                rec.error = rec.error or "unfinished"
    return records, answered


def config_limit_s(config: str) -> float | None:
    delay = config.partition("@")[0].partition("+")[0]
    return None if delay == "off" else float(delay)


def summarize(records: list[RequestRecord], answered: dict[int, float], tbt_slo_ms: float,
              limit_s: float | None = None) -> dict:
    ok = [r for r in records if r.ok and r.num_output_tokens == r.output_tokens]
    gaps = [g for r in ok for g in r.gaps]
    r503 = [r for r in records if r.error and r.error.startswith("HTTP 503")]
    # taken out of the queue after waiting (admission.py's expired_error); "has waited longer" is an arrival refused
    # because an admitted request is overdue, which is answered at arrival like any other
    expired = [r for r in r503 if "without being scheduled" in r.error]
    at_arrival = [r for r in r503 if r not in expired]
    other = [r for r in records if r.error and r not in r503]
    every_503 = [answered[r.index] for r in r503]
    return {
        "requests": len(records), "admitted_complete": len(ok),
        # the target: every 503 answered within 50 ms of sending (expired ones included, which should be none)
        "rejected_all": {"n": len(r503), "answer_ms_p50": pct(every_503, 50), "answer_ms_p99": pct(every_503, 99),
                         "answer_ms_max": pct(every_503, 100), "within_50ms": sum(1 for x in every_503 if x <= 0.05)},
        # admitted requests whose first token came after the limit: their wait was mispredicted (TTFT includes
        # their own prefill, so this over-counts the waits past the limit)
        "admitted_ttft_over_limit": None if limit_s is None else sum(1 for r in ok if r.ttft > limit_s),
        "ttft_ms_max": pct([r.ttft for r in ok], 100),
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


def queued_past(url: str, limit_s: float | None) -> dict | None:
    """From the server's queue-time histogram (arrival to first scheduled, at finish): how many requests it
    finished and how many of them had waited longer than the limit (exact when the limit is a bucket edge)."""
    if limit_s is None:
        return None
    try:
        snapshot = parse_prometheus(httpx.get(url + "/metrics", timeout=30).text)
    except httpx.HTTPError:
        return None
    count = snapshot.get(QUEUE_TIME + "_count")
    within = dict(histogram(snapshot, QUEUE_TIME)).get(float(limit_s))
    if count is None or within is None:
        return None
    return {"finished": int(count), "waited_past_limit": int(count - within)}


def step_records(url: str) -> list[dict]:
    """The server's last steps (its dashboard ring): duration, prediction, decodes, prefill tokens, queue sizes."""
    try:
        models = httpx.get(url + "/dashboard/steps", timeout=30).json()["models"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return [s for m in models for s in m["steps"]]


def summarize_steps(steps: list[dict]) -> dict:
    """Where the long steps came from: steps over the SLO and what they held."""
    if not steps:
        return {}
    dur = [s["dur"] for s in steps]
    slow = [s for s in steps if s["dur"] * 1000 > 190]
    return {"n": len(steps), "dur_ms_p50": pct(dur, 50), "dur_ms_p99": pct(dur, 99), "dur_ms_max": pct(dur, 100),
            "max_decodes": max(s["decode"] for s in steps), "max_running": max(s["running"] for s in steps),
            "over_190ms": len(slow),
            "slowest": [{k: s.get(k) for k in ("dur", "pred", "decode", "prefill", "running", "waiting", "preempted")}
                        for s in sorted(steps, key=lambda s: -s["dur"])[:8]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="chat")
    p.add_argument("--rate", type=float, required=True, help="requests per second (e.g. 3x the chat capacity)")
    p.add_argument("--seconds", type=float, default=90.0, help="arrivals for this long")
    p.add_argument("--grace-s", type=float, default=30.0, help="then wait this long before cancelling the rest")
    p.add_argument("--configs", default="off,5", help="comma list: off, S (a --max-queue-delay-s value) or S+auto")
    p.add_argument("--tbt-slo-ms", type=float, default=190.0, help="the strict TBT SLO (benchmarks/summaries/chat.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    p.add_argument("--steps-output", default=None, help="write every step record here ({config} is replaced)")
    p.add_argument("server_args", nargs="*", help="more `paceline serve` flags for every configuration (after --)")
    args = p.parse_args()
    spec = load_workload(args.workload)
    requests = generate(spec, rate=args.rate, duration_s=args.seconds, seed=args.seed)
    prompts = build_prompts(PromptSource(load_tokenizer()), requests, seed=args.seed, as_text=False)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
              "workload": args.workload, "rate": args.rate, "tbt_slo_ms": args.tbt_slo_ms, "configs": {}}
    configs = args.configs.split(",")
    flags_of = {c: config_flags(c) for c in configs}  # a typo fails here, before any server starts
    for c in configs:
        server_command(c)
    for config in configs:
        flags = flags_of[config]
        argv = [*server_command(config), "--log-level", "WARNING", "serve", "--host",
                "127.0.0.1", "--port", "{port}", *flags, *args.server_args]
        with Server(System(f"paceline-{config}", argv), Path(f"/tmp/paceline-overload-{config.replace('/', '_')}.log")) as server:
            httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=120)
            peaks: dict[str, float] = {}
            records, answered = asyncio.run(drive(server.url, requests, prompts, args.grace_s, peaks))
            steps = step_records(server.url)
            queued = queued_past(server.url, config_limit_s(config))
        report["configs"][config] = {"flags": flags, **summarize(records, answered, args.tbt_slo_ms,
                                                                 config_limit_s(config)),
                                     "server_queue_time": queued,
                                     "peak_running": peaks.get("running"), "peak_waiting": peaks.get("waiting"),
                                     "steps": summarize_steps(steps)}
        if args.steps_output:  # every step record, for a closer look at what the engine did
            Path(args.steps_output.format(config=config.replace("/", "_"))).write_text(json.dumps(steps))
        print(config, json.dumps(report["configs"][config]), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
