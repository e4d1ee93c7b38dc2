"""Soak: well-behaved streaming clients beside abusive ones, against a real server, then the books are checked.

Two phases of --phase-s seconds each on the same server: `clean` (only well-behaved streams, Poisson at --rate)
and `abuse` (the same streams plus abusers at --abuse-rate: clients that disconnect mid-stream, give up at once,
never read, send broken or oversized HTTP, invalid bodies, n>1 with stop strings and priorities, and prompts that
inject faults into the engine). Well-behaved streams are greedy with ignore_eos, so each must equal the reference
taken alone at the start (the server should run float32, where batched equals alone).

Reported: requests by outcome, unexpected 5xx (a 500 is expected only for an injected fault), lost or corrupted
well-behaved responses, KV blocks still used and request gauges once idle (must be 0), the server's RSS over time
(growth after the clean phase), p50/p99 TBT of the well-behaved streams in each phase.

    python benchmarks/soak.py --start-server --phase-s 120 --rate 1.0 --abuse-rate 2.0 \\
        -- --dtype float32 --max-queue-delay-s 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

PREFIX = ("You are a helpful assistant. Answer briefly and plainly, in one or two sentences, without lists. ")
QUESTIONS = ["Why is the sky blue?", "What is a prime number?", "How do bees make honey?",
             "What does a compiler do?", "Why do we have seasons?", "What is the capital of Italy?",
             "How does a bicycle stay upright?", "What is photosynthesis?"]
MAX_TOKENS = (16, 32, 48)
FAULTS = ("sampler", "nan", "detokenize", "stop")
AUTH: dict[str, str] = {}  # {"Authorization": "Bearer KEY"} for a server started with --api-key
CLIENT_TIMEOUT_S = [300.0]  # a well-behaved client's patience (--client-timeout-s); past it, its request is lost
CHAT_CAPACITY_RPS = 0.938  # chat workload, relaxed SLO, int4 (benchmarks/summaries/chat.md, 2026-11-22)
STOP_GRACE_S = 30.0  # after a stop (signal or --stop-by), in-flight requests get this long before they are cut off


@dataclass
class Book:
    outcomes: Counter = field(default_factory=Counter)  # (phase, kind, outcome) -> count
    unexpected_5xx: list[str] = field(default_factory=list)
    corrupted: list[str] = field(default_factory=list)
    gaps: dict[str, list[float]] = field(default_factory=lambda: {"clean": [], "abuse": []})
    rejected_s: list[float] = field(default_factory=list)  # how long a well-behaved request waited for its 503
    sent: dict[str, int] = field(default_factory=dict)  # phase -> well-behaved requests sent
    traffic_s: dict[str, float] = field(default_factory=dict)  # phase -> seconds of arrivals it actually had

    def add(self, phase: str, kind: str, outcome: str, n: int = 1) -> None:
        self.outcomes[(phase, kind, outcome)] += n


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


# ---- the well-behaved client ----------------------------------------------------------------------------------

async def reference(client: httpx.AsyncClient) -> dict[str, str]:
    refs = {}
    for q in QUESTIONS:
        r = await client.post("/v1/completions", json={"prompt": PREFIX + q, "max_tokens": max(MAX_TOKENS),
                                                      "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        refs[q] = r.json()["choices"][0]["text"]
    return refs


async def well_behaved(client: httpx.AsyncClient, book: Book, phase: str, refs: dict[str, str],
                       rng: random.Random, stream_share: float) -> None:
    q, max_tokens = rng.choice(QUESTIONS), rng.choice(MAX_TOKENS)
    if rng.random() >= stream_share:
        return await well_behaved_whole(client, book, phase, refs, q, max_tokens)
    body = {"prompt": PREFIX + q, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, times, finish, usage, done, status = "", [], None, None, False, None
    sent = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            status = r.status_code
            if r.status_code != 200:
                await r.aread()
                outcome = f"http {r.status_code}"
                if r.status_code == 503:
                    book.rejected_s.append(time.monotonic() - sent)
                book.add(phase, "good", outcome)
                if r.status_code >= 500 and r.status_code != 503:
                    book.unexpected_5xx.append(f"good: {r.status_code} {r.text[:200]}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    book.unexpected_5xx.append(f"good: stream error {event['error']['message'][:200]}")
                    break
                if event.get("usage"):
                    usage = event["usage"]
                for c in event["choices"]:
                    if c["text"]:
                        times.append(time.monotonic())
                        text += c["text"]
                    finish = c["finish_reason"] or finish
    except httpx.HTTPError as e:
        book.add(phase, "good", "transport error")
        book.corrupted.append(transport_error(e, sent, status, len(times)))
        return
    ok = done and finish == "length" and usage and usage["completion_tokens"] == max_tokens \
        and refs[q].startswith(text)
    book.add(phase, "good", "ok" if ok else "corrupted")
    if not ok:
        book.corrupted.append(f"{q!r} max_tokens={max_tokens} done={done} finish={finish} usage={usage} "
                              f"text={text[:80]!r} ref={refs[q][:80]!r}")
    book.gaps[phase].extend(b - a for a, b in zip(times, times[1:]))


def transport_error(e: httpx.HTTPError, sent: float, status: int | None, tokens: int) -> str:
    """What a lost request's record must say to find the cause: when (UTC, to match the server log), how far it
    got, and the socket error under httpx's (an empty ReadError over BrokenResourceError is a connection reset:
    e.g. a server closing an idle keep-alive connection as the request arrived on it)."""
    where = "before any status" if status is None else f"after status {status} and {tokens} tokens"
    return (f"{type(e).__name__}: {e} ({where}, {time.monotonic() - sent:.1f} s after sending, at "
            f"{time.strftime('%H:%M:%S', time.gmtime())} UTC; cause {e.__context__!r})")


async def well_behaved_whole(client: httpx.AsyncClient, book: Book, phase: str, refs: dict[str, str], q: str,
                             max_tokens: int) -> None:
    """The same check without streaming: one JSON answer that must be the reference's first max_tokens tokens."""
    sent = time.monotonic()
    try:
        r = await client.post("/v1/completions", json={"prompt": PREFIX + q, "max_tokens": max_tokens,
                                                       "temperature": 0, "ignore_eos": True})
    except httpx.HTTPError as e:
        book.add(phase, "good_whole", "transport error")
        book.corrupted.append("whole: " + transport_error(e, sent, None, 0))
        return
    if r.status_code != 200:
        if r.status_code == 503:
            book.rejected_s.append(time.monotonic() - sent)
        book.add(phase, "good_whole", f"http {r.status_code}")
        if r.status_code >= 500 and r.status_code != 503:
            book.unexpected_5xx.append(f"good_whole: {r.status_code} {r.text[:200]}")
        return
    body = r.json()
    choice, usage = body["choices"][0], body.get("usage") or {}
    ok = choice["finish_reason"] == "length" and usage.get("completion_tokens") == max_tokens \
        and refs[q].startswith(choice["text"]) and len(choice["text"]) > 0
    book.add(phase, "good_whole", "ok" if ok else "corrupted")
    if not ok:
        book.corrupted.append(f"whole {q!r} max_tokens={max_tokens} finish={choice['finish_reason']} "
                              f"usage={usage} text={choice['text'][:80]!r} ref={refs[q][:80]!r}")


# ---- the abusers ----------------------------------------------------------------------------------------------

async def raw_http(host: str, port: int, data: bytes, read_s: float = 5.0, read: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        if not read:
            return b""
        out = b""
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), read_s):
                out += chunk
        except asyncio.TimeoutError:
            pass
        return out
    finally:
        writer.close()


def head(path: str, length: int | None, content_type: str = "application/json", extra: str = "") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: soak", f"Content-Type: {content_type}", "Connection: close",
             *(f"{k}: {v}" for k, v in AUTH.items())]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + extra + "\r\n\r\n").encode()


INVALID = [
    {"prompt": "hi", "max_tokens": "ten"}, {"prompt": "hi", "n": 10_000}, {"prompt": "hi", "logprobs": 10**6},
    {"prompt": "hi", "temperature": -1}, {"prompt": "", "max_tokens": 4}, {"prompt": "hi", "model": "nope"},
    {"prompt": "hi", "stop": ["s"] * 10_000}, {"prompt": [[1] * 3] * 10_000}, {"prompt": "hi", "max_tokens": 10**12},
    {"messages": "not a list"}, {"prompt": "hi", "priority": 10**9}, {"prompt": "hi", "echo": True},
]


async def abuser(client: httpx.AsyncClient, host: str, port: int, book: Book, rng: random.Random) -> None:
    kind = rng.choice(["disconnect", "give_up", "slow_reader", "invalid", "broken_http", "too_large", "fault",
                       "n_stop_priority"])
    prompt = PREFIX + rng.choice(QUESTIONS)
    try:
        if kind == "disconnect":  # reads a few tokens, then leaves
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if n >= rng.randint(1, 6):
                        break
            outcome = f"left after tokens ({r.status_code})"
        elif kind == "give_up":  # sends, then gives up before anything comes back
            try:
                await client.post("/v1/chat/completions", timeout=rng.uniform(0.01, 0.3), json={
                    "messages": [{"role": "user", "content": prompt}], "max_tokens": 100})
                outcome = "finished before giving up"
            except httpx.TimeoutException:
                outcome = "gave up"
        elif kind == "slow_reader":  # a stream nobody reads for a while, then closed
            body = json.dumps({"prompt": prompt, "max_tokens": 64, "ignore_eos": True, "stream": True}).encode()
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(head("/v1/completions", len(body)) + body)
            await writer.drain()
            await asyncio.sleep(rng.uniform(2, 8))
            writer.close()
            outcome = "closed unread"
        elif kind == "invalid":
            r = await client.post(rng.choice(["/v1/completions", "/v1/chat/completions"]), json=rng.choice(INVALID))
            outcome = f"http {r.status_code}"
            if r.status_code >= 500 and r.status_code != 503:  # 503: overloaded (Retry-After), a clean answer
                book.unexpected_5xx.append(f"invalid: {r.status_code} {r.text[:200]}")
        elif kind == "broken_http":
            data = rng.choice([head("/v1/completions", 100) + b'{"prompt": "x", "max',  # cut short
                               head("/v1/completions", 9) + b"not json!",
                               head("/v1/completions", 10, "text/plain") + b'{"a": "b"}',
                               head("/v1/completions", 15) + b'{"prompt": "\xff\xfe"}',
                               head("/v1/completions", 5000) + b"[" * 5000])
            answer = await raw_http(host, port, data, read_s=2.0)
            status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "no answer"
            outcome = f"http {status}"
            if status.startswith("5"):
                book.unexpected_5xx.append(f"broken_http: {answer[:200]!r}")
        elif kind == "too_large":
            r = await client.post("/v1/completions", content=b'{"prompt": "' + b"x" * (5 * 2**20) + b'"}',
                                  headers={"content-type": "application/json"})
            outcome = f"http {r.status_code}"
        elif kind == "fault":
            stage = rng.choice(FAULTS)
            r = await client.post("/v1/completions", json={"prompt": f"{prompt} PACELINE_FAULT:{stage}",
                                                           "max_tokens": 24, "ignore_eos": True,
                                                           "stream": rng.random() < 0.5})
            failed = r.status_code == 500 or (r.status_code == 200 and '"error"' in r.text)
            outcome = "failed as injected" if failed else f"http {r.status_code} (not failed?)"
        else:  # valid but heavy: n > 1, stop strings, a priority
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "n": 2,
                                                           "temperature": 0.8, "stop": [".", "\n"],
                                                           "priority": rng.randint(-5, 5)})
            outcome = f"http {r.status_code}"
            if r.status_code >= 500 and r.status_code != 503:
                book.unexpected_5xx.append(f"n_stop_priority: {r.status_code} {r.text[:200]}")
    except httpx.HTTPError as e:
        outcome = f"transport {type(e).__name__}"
    except OSError as e:
        outcome = f"socket {type(e).__name__}"
    book.add("abuse", kind, outcome)


# ---- driving it ------------------------------------------------------------------------------------------------

def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def memory_mb(pid: int | None) -> dict[str, float]:
    """Where the RSS is: anonymous vs file-backed pages (/proc/<pid>/status; the model file's mapped pages are
    file-backed), and the largest anonymous mapping's resident part, which is the KV pool (smaps; the kernel may
    merge the pool with its host-swap neighbour, so its size is shown too)."""
    out: dict[str, float] = {}
    if pid is None:
        return out
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    out[line.split(":")[0][3:].lower()] = int(line.split()[1]) / 1024
        size = rss = 0
        with open(f"/proc/{pid}/smaps") as f:
            cur = None
            for line in f:
                parts = line.split()
                if "-" in parts[0] and not parts[0].endswith(":"):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    cur = hi - lo if len(parts) == 5 else None  # anonymous: no path
                elif parts[0] == "Rss:" and cur is not None and cur > size:
                    size, rss = cur, int(parts[1]) * 1024
        out["largest_anon_map"] = size / 2**20
        out["largest_anon_map_rss"] = rss / 2**20
    except OSError:
        pass
    return {k: round(v, 1) for k, v in out.items()}


def metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            label = s.labels.get("finished_reason") or s.labels.get("reason")
            out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


async def phase(name: str, url: str, seconds: float, rate: float, abuse_rate: float, refs: dict[str, str],
                book: Book, rng: random.Random, stream_share: float, stop: asyncio.Event | None = None) -> None:
    """Arrivals for `seconds` (fewer if `stop` is set), then waits for the requests in flight. After a stop, those
    get STOP_GRACE_S and the rest are cancelled and counted as cut off: a stopped run still writes its books."""
    stop = stop or asyncio.Event()
    host, port = url.split("//")[1].split(":")
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=50)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S[0], limits=limits, headers=AUTH) as client:
        tasks = []
        t0 = time.monotonic()
        end = t0 + seconds

        async def arrivals(r: float, make) -> None:
            while (now := time.monotonic()) < end and not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), min(rng.expovariate(r), max(0.0, end - now)))
                except asyncio.TimeoutError:
                    pass
                if time.monotonic() < end and not stop.is_set():
                    tasks.append(asyncio.ensure_future(make()))

        def sent_good():
            book.sent[name] = book.sent.get(name, 0) + 1
            return well_behaved(client, book, name, refs, rng, stream_share)

        feeds = [arrivals(rate, sent_good)]
        if abuse_rate > 0:
            feeds.append(arrivals(abuse_rate, lambda: abuser(client, host, int(port), book, rng)))
        await asyncio.gather(*feeds)
        book.traffic_s[name] = time.monotonic() - t0
        everything = asyncio.ensure_future(asyncio.gather(*tasks, return_exceptions=True))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([everything, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():  # stopped while requests were in flight
            await asyncio.wait([everything], timeout=STOP_GRACE_S)
            cut = [t for t in tasks if not t.done()]
            for t in cut:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if cut:
                book.add(name, "any", "cut off by the stop", len(cut))
        stopped.cancel()


async def sampler(url: str, pid: int | None, samples: list, stop: asyncio.Event, every_s: float,
                  partial: str | None = None, books=None) -> None:
    """Samples /metrics and the memory every every_s; every minute the samples and the books so far (`books()`)
    also go to `partial`, so a run killed outright still leaves its memory curve and counts."""
    t0 = time.monotonic()
    next_dump = t0 + 60
    while not stop.is_set():
        if partial and time.monotonic() >= next_dump:
            next_dump += 60
            with open(partial, "w") as f:
                json.dump({"books_so_far": books() if books else None, "samples": samples}, f)
        try:
            m = await asyncio.to_thread(metrics, url)
            samples.append({"t": time.monotonic() - t0, "rss_mb": rss_mb(pid), "memory_mb": memory_mb(pid),
                            "used_blocks": m.get("paceline:kv_cache_used_blocks"),
                            "running": m.get("paceline:num_requests_running"),
                            "waiting": m.get("paceline:num_requests_waiting")})
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass


def stop_on(stop: asyncio.Event, stop_by_utc: str | None) -> list:
    """Sets `stop` on SIGTERM / SIGINT and at the wall-clock time `stop_by_utc` ("HH:MM", today, UTC): the run then
    winds down and writes its books instead of dying with them. Returns what to undo."""
    loop = asyncio.get_running_loop()
    undo = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
        undo.append(lambda sig=sig: loop.remove_signal_handler(sig))
    if stop_by_utc:
        hh, mm = (int(x) for x in stop_by_utc.split(":"))
        now = time.time()
        day = now - now % 86400
        left = day + hh * 3600 + mm * 60 - now
        if left < 0:
            raise SystemExit(f"--stop-by {stop_by_utc} UTC has passed")
        handle = loop.call_later(left, stop.set)
        undo.append(handle.cancel)
    return undo


async def main_async(args: argparse.Namespace, pid: int | None) -> dict:
    rng = random.Random(args.seed)
    book = Book()
    stop = asyncio.Event()
    undo = stop_on(stop, getattr(args, "stop_by", None)) if getattr(args, "handle_stop", False) else []
    samples: list = []
    sampling_done = asyncio.Event()
    started = time.monotonic()
    clean_s = args.phase_s if args.clean_s is None else args.clean_s
    abuse_s = args.phase_s if args.abuse_s is None else args.abuse_s
    marks: dict = {"rss_after_clean": None, "reference_s": None}

    def books(m: dict | None = None) -> dict:
        return write_books(args, book, samples, m, pid, marks, stop.is_set(), time.monotonic() - started)

    output = getattr(args, "output", None)
    watch = asyncio.ensure_future(sampler(args.url, pid, samples, sampling_done, args.sample_s,
                                          output + ".partial" if output else None, books))
    try:
        async with httpx.AsyncClient(base_url=args.url, timeout=CLIENT_TIMEOUT_S[0], headers=AUTH) as c:
            getting = asyncio.ensure_future(reference(c))
            stopped = asyncio.ensure_future(stop.wait())
            await asyncio.wait([getting, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not getting.done():
                getting.cancel()
            refs = None if getting.cancelled() else getting.result()
        marks["reference_s"] = time.monotonic() - started
        if refs is not None:
            await phase("clean", args.url, clean_s, args.rate, 0.0, refs, book, rng, args.stream_share, stop)
            marks["rss_after_clean"] = rss_mb(pid)
            if not stop.is_set():
                await phase("abuse", args.url, abuse_s, args.rate, args.abuse_rate, refs, book, rng,
                            args.stream_share, stop)
        # idle: every gauge back to zero, every block free (a minute for the aborts of cut-off requests to land)
        deadline = time.monotonic() + 60
        while True:
            try:
                m = await asyncio.to_thread(metrics, args.url)
            except httpx.HTTPError as e:  # the server is gone or hung: the books say so instead of being lost
                m = {"metrics_error": f"{type(e).__name__}: {e}"}
            if idle(m) or "metrics_error" in m or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    finally:
        sampling_done.set()
        await watch
        for u in undo:
            u()
    return books(m)


def idle(m: dict) -> bool:
    return (m.get("paceline:num_requests_running", 0) == m.get("paceline:num_requests_waiting", 0)
            == m.get("paceline:num_requests_swapped", 0) == 0 and m.get("paceline:kv_cache_used_blocks", 0) == 0)


def write_books(args: argparse.Namespace, book: Book, samples: list, m: dict | None, pid: int | None, marks: dict,
                stopped: bool, elapsed: float) -> dict:
    """The run's books from what it has so far: at the end (`m`, the idle /metrics), or part way (m None: the
    idle checks are not made then)."""
    final = m is not None
    rss_end = rss_mb(pid)
    health = None
    if final:
        try:
            health = httpx.get(args.url + "/health", timeout=10).status_code
        except httpx.HTTPError as e:
            health = f"no answer: {type(e).__name__}"
    outcomes = [{"phase": p, "kind": k, "outcome": o, "count": n} for (p, k, o), n in sorted(book.outcomes.items())]
    rss = [s["rss_mb"] for s in samples if s["rss_mb"] is not None]
    # the baseline is the first sample after the warm-up (allocator pools, compiled paths and caches filled)
    warm = next((s["rss_mb"] for s in samples if s["t"] >= args.warmup_s and s["rss_mb"] is not None), None)
    good = [(p, k, o, n) for (p, k, o), n in book.outcomes.items() if k.startswith("good")]
    rss_after_clean = marks["rss_after_clean"]
    planned = {"clean": args.phase_s if args.clean_s is None else args.clean_s,
               "abuse": args.phase_s if args.abuse_s is None else args.abuse_s}
    # what it sustained: the well-behaved requests sent and completed per second of traffic, beside the rate asked
    # for and 1.5x the chat capacity (which is of chat-sized requests on a quiet machine; these are shorter)
    sustained = {p: {"planned_s": planned[p], "traffic_s": round(book.traffic_s.get(p, 0.0), 1),
                     "sent": book.sent.get(p, 0),
                     "sent_per_s": round(book.sent.get(p, 0) / book.traffic_s[p], 3) if book.traffic_s.get(p) else None,
                     "ok_per_s": round(sum(n for q, k, o, n in good if q == p and o == "ok") / book.traffic_s[p], 3)
                     if book.traffic_s.get(p) else None}
                 for p in ("clean", "abuse")}
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:], "elapsed_s": elapsed,
        "final": final, "stopped_early": stopped, "metrics_error": (m or {}).get("metrics_error"), "reference_s": marks["reference_s"],
        "rate_asked": args.rate, "rate_1_5x_chat_capacity": round(1.5 * CHAT_CAPACITY_RPS, 3),
        "sustained": sustained,
        "requests": sum(book.outcomes.values()), "outcomes": outcomes,
        "unexpected_5xx": len(book.unexpected_5xx), "unexpected_5xx_examples": book.unexpected_5xx[:10],
        "good_ok": sum(n for p, k, o, n in good if o == "ok"),
        "good_503": sum(n for p, k, o, n in good if o == "http 503"),
        "good_total": sum(n for p, k, o, n in good),
        "cut_off_by_stop": sum(n for (p, k, o), n in book.outcomes.items() if o == "cut off by the stop"),
        "corrupted": len(book.corrupted), "corrupted_examples": book.corrupted[:10],
        "idle": {"used_blocks": m.get("paceline:kv_cache_used_blocks"),
                 "running": m.get("paceline:num_requests_running"), "waiting": m.get("paceline:num_requests_waiting"),
                 "swapped": m.get("paceline:num_requests_swapped")} if final else None,
        "health_after": health,
        "rss_mb": {"first": rss[0] if rss else None, "after_warmup": warm, "after_clean": rss_after_clean,
                   "end": rss_end, "max": max(rss) if rss else None,
                   "growth_after_warmup_pct": 100 * (rss_end - warm) / warm if rss_end and warm else None,
                   "max_growth_after_warmup_pct": 100 * (max(rss) - warm) / warm if rss and warm else None,
                   "growth_after_clean_pct": 100 * (rss_end - rss_after_clean) / rss_after_clean
                   if rss_end and rss_after_clean else None,
                   "every_5_min": [round(s["rss_mb"], 1) for s in samples if s["rss_mb"] is not None
                                   and int(s["t"] // 300) != int((s["t"] - args.sample_s) // 300)],
                   "split_every_5_min": [{"t": round(s["t"]), **s["memory_mb"]} for s in samples
                                         if int(s["t"] // 300) != int((s["t"] - args.sample_s) // 300)],
                   "split_end": memory_mb(pid)},
        "max_used_blocks": max((s["used_blocks"] or 0 for s in samples), default=None),
        "max_running": max((s["running"] or 0 for s in samples), default=None),
        "max_waiting": max((s["waiting"] or 0 for s in samples), default=None),
        "tbt_ms": {p: {"n": len(g), "p50": _ms(percentile(g, 50)), "p99": _ms(percentile(g, 99))}
                   for p, g in book.gaps.items()},
        "rejected_503_ms": {"n": len(book.rejected_s), "p50": _ms(percentile(book.rejected_s, 50)),
                            "p99": _ms(percentile(book.rejected_s, 99)), "max": _ms(max(book.rejected_s, default=None))},
        "server_counters": {k: v for k, v in (m or {}).items()
                            if k.startswith(("paceline:request_success_total", "paceline:request_rejected_total"))},
        "samples": list(samples) if final else [],  # part way, the samples are written beside the books
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def start_server(server_args: list[str], timeout_s: float = 300.0) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PACELINE_FAULT_INJECTION": "1"}
    log = open(f"/tmp/paceline-soak-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "paceline.entrypoints.server", "--port", str(port), *server_args],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not start; see {log.name}")


def main() -> None:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (with PACELINE_FAULT_INJECTION=1 for the faults)")
    p.add_argument("--start-server", action="store_true", help="start `paceline serve` with the args after --")
    p.add_argument("--phase-s", type=float, default=120.0, help="seconds of each phase (clean, then abuse)")
    p.add_argument("--clean-s", type=float, default=None, help="seconds of the clean phase (default --phase-s)")
    p.add_argument("--abuse-s", type=float, default=None, help="seconds of the abuse phase (default --phase-s)")
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS growth is measured from this many seconds in")
    p.add_argument("--stream-share", type=float, default=0.7, help="share of well-behaved requests that stream")
    p.add_argument("--rate", type=float, default=1.0, help="well-behaved streams per second (Poisson)")
    p.add_argument("--abuse-rate", type=float, default=2.0, help="abusive requests per second in the abuse phase")
    p.add_argument("--sample-s", type=float, default=2.0, help="how often /metrics and the RSS are sampled")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--client-timeout-s", type=float, default=300.0,
                   help="how long a client waits for an answer (a niced run on a busy machine is slow, not broken)")
    p.add_argument("--start-timeout-s", type=float, default=300.0,
                   help="how long the started server may take to answer /health (a niced run on a busy machine)")
    p.add_argument("--stop-by", default=None, metavar="HH:MM",
                   help="UTC time at which the run stops its traffic and writes its books (also on SIGTERM/SIGINT)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the full JSON here")
    args = p.parse_args(argv)
    args.handle_stop = True
    if args.api_key:
        AUTH["Authorization"] = f"Bearer {args.api_key}"
    CLIENT_TIMEOUT_S[0] = args.client_timeout_s
    proc = None
    if args.start_server:
        proc, args.url = start_server(server_args, args.start_timeout_s)
    if args.url is None:
        raise SystemExit("give --url or --start-server")
    try:
        report = asyncio.run(main_async(args, proc.pid if proc else None))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)
    summary = {k: v for k, v in report.items() if k not in ("samples", "outcomes")}
    print(json.dumps(summary, indent=1))
    for o in report["outcomes"]:
        print(f"{o['phase']:6} {o['kind']:16} {o['outcome']:32} {o['count']}")


if __name__ == "__main__":
    main()
