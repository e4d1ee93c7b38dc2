"""Load generator for any OpenAI-compatible server: open-loop arrivals, streaming, one timestamp per token.

Each request is sent at its arrival time (open loop: a slow server does not slow the arrivals) with
`stream: true`, `ignore_eos: true` and `max_tokens` = the target output length, so every system does the
same work. The client counts tokens per SSE chunk (a chunk's `token_ids` when the server sends them, else one
token per chunk that carries text) and asks for `stream_options.include_usage` to check the count.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from paceline.bench.metrics import RequestRecord, RunResult
from paceline.bench.server_metrics import Scraper, scheduling_delay
from paceline.bench.workload import RequestSpec

logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would drown the progress bar


@dataclass
class Endpoint:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str | None = None  # None: the first id of /v1/models
    api: str = "completions"  # completions | chat
    prompt_format: str = "ids"  # ids: token-id prompts (exact lengths) | text
    send_priority: bool = True  # vLLM-style `priority` field; servers that reject unknown fields need False
    send_user: bool = True  # the OpenAI `user` field, for requests whose workload class names a client
    include_usage: bool = True
    send_ignore_eos: bool = True  # False for servers that reject the field (they get the same effect via extra_body)
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 600.0
    model_urls: dict[str, str] = field(default_factory=dict)  # a model served elsewhere (one server per model)

    def __post_init__(self) -> None:
        if self.api not in ("completions", "chat"):
            raise ValueError(f"api must be completions or chat, got {self.api!r}")
        if self.prompt_format not in ("ids", "text"):
            raise ValueError(f"prompt_format must be ids or text, got {self.prompt_format!r}")
        if self.api == "chat" and self.prompt_format == "ids":
            raise ValueError("the chat API takes text prompts; use prompt_format='text'")
        self.url = self.url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]


def request_body(ep: Endpoint, model: str, spec: RequestSpec, prompt: list[int] | str) -> dict:
    body: dict = {"model": model, "max_tokens": spec.output_tokens, "stream": True, "temperature": ep.temperature}
    if ep.send_ignore_eos:
        body["ignore_eos"] = True
    if ep.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ep.include_usage:
        body["stream_options"] = {"include_usage": True}
    if ep.send_priority:
        body["priority"] = spec.priority
    if ep.send_user and spec.client:
        body["user"] = spec.client
    body.update(ep.extra_body)
    return body


def tokens_in_chunk(chunk: dict, api: str) -> int:
    """How many output tokens one SSE chunk delivers."""
    n = 0
    for choice in chunk.get("choices") or []:
        if isinstance(choice.get("token_ids"), list):
            n += len(choice["token_ids"])
            continue
        text = choice.get("text") if api == "completions" else (choice.get("delta") or {}).get("content")
        if text:
            n += 1
        elif api == "completions" and text == "" and choice.get("finish_reason") is None:
            n += 1  # a token whose text is held back (an incomplete UTF-8 sequence) still arrived
    return n


async def discover_model(client: httpx.AsyncClient, url: str) -> str:
    try:
        r = await client.get(f"{url}/v1/models", timeout=10.0)
        data = r.json().get("data") or []
        if data:
            return data[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    return "default"


async def send_one(client: httpx.AsyncClient, ep: Endpoint, model: str, spec: RequestSpec, prompt: list[int] | str,
                   rec: RequestRecord, t0: float, on_tokens=None) -> None:
    path = "/v1/chat/completions" if ep.api == "chat" else "/v1/completions"
    model = spec.model or model  # a several-model workload names each request's model
    url = ep.model_urls.get(model, ep.url).rstrip("/")
    rec.sent_s = time.perf_counter() - t0
    try:
        async with client.stream("POST", url + path, json=request_body(ep, model, spec, prompt)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:200]}"
                return
            async for line in resp.aiter_lines():
                now = time.perf_counter() - t0
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    continue
                if "error" in chunk and not chunk.get("choices"):
                    rec.error = f"stream error: {str(chunk['error'])[:200]}"
                    return
                n = tokens_in_chunk(chunk, ep.api)
                if n:
                    rec.token_times.extend([now] * n)
                    if on_tokens:
                        on_tokens(rec, n)
                usage = chunk.get("usage")
                if usage:
                    rec.usage_prompt_tokens = usage.get("prompt_tokens")
                    rec.usage_completion_tokens = usage.get("completion_tokens")
        rec.end_s = time.perf_counter() - t0
        if not rec.token_times:
            rec.error = "no tokens in the stream"
    except (httpx.HTTPError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]


class _Live:
    """Running totals for the progress bar."""

    def __init__(self) -> None:
        self.tokens = 0
        self.gaps: list[float] = []
        self.last: dict[int, float] = {}

    def on_tokens(self, rec: RequestRecord, n: int) -> None:
        self.tokens += n
        t = rec.token_times
        if len(t) > n:
            self.gaps.append(t[-n] - t[-n - 1])
        self.gaps.extend([0.0] * (n - 1))

    def p99_ms(self) -> float:
        return float(np.percentile(self.gaps[-20000:], 99)) * 1e3 if self.gaps else 0.0


async def run_async(ep: Endpoint, requests: list[RequestSpec], prompts: list[list[int] | str], *,
                    progress: bool = True, deadline_s: float | None = None, max_concurrency: int | None = None,
                    scrape_interval: float | None = 0.5, label: str = "",
                    in_flight_caps: dict[str, int] | None = None) -> RunResult:
    """Send every request at its arrival time; wait for all (or until deadline_s after the start, then cancel the
    rest and mark them failed). Scrapes /metrics every scrape_interval seconds (None: only before and after).
    in_flight_caps: client -> most requests in flight; such a client's request waits for a slot, and one still
    waiting when the last arrival is due is never sent (and left out of the result)."""
    if len(prompts) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(prompts)} prompts")
    limits = httpx.Limits(max_connections=max(1024, len(requests)), max_keepalive_connections=256)
    timeout = httpx.Timeout(ep.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = ep.model or await discover_model(client, ep.url)
        records = [RequestRecord(r.index, r.prompt_tokens, r.output_tokens, r.priority, r.arrival_s, client=r.client,
                                 model=r.model)
                   for r in requests]
        slots = {c: asyncio.Semaphore(n) for c, n in (in_flight_caps or {}).items()}
        window_end = max((r.arrival_s for r in requests), default=0.0)
        unsent: set[int] = set()
        live = _Live()
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        t0 = time.perf_counter()
        started_at = time.time()
        scraper = Scraper(ep.url, scrape_interval or 1e9, t0)
        before = await scraper.scrape(client)
        stop = asyncio.Event()
        scrape_task = asyncio.create_task(scraper.run(client, stop)) if scrape_interval and before is not None else None

        async def one(spec: RequestSpec, prompt, rec: RequestRecord) -> None:
            delay = spec.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            slot = slots.get(spec.client)
            if slot is not None:
                try:  # a closed-loop client: wait for one of its own to finish, but not past the arrival window
                    await asyncio.wait_for(slot.acquire(), max(0.0, window_end - (time.perf_counter() - t0)) + 1e-3)
                except asyncio.TimeoutError:
                    unsent.add(rec.index)
                    return
            try:
                if sem:
                    async with sem:
                        await send_one(client, ep, model, spec, prompt, rec, t0, live.on_tokens)
                else:
                    await send_one(client, ep, model, spec, prompt, rec, t0, live.on_tokens)
            finally:
                if slot is not None:
                    slot.release()

        tasks = [asyncio.create_task(one(s, p, r)) for s, p, r in zip(requests, prompts, records)]
        bar = _progress_bar(label) if progress else None
        try:
            if bar:
                bar.start()
                task_id = bar.add_task(label or "bench", total=len(tasks), stats="")
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(pending, timeout=0.5)
                elapsed = time.perf_counter() - t0
                if bar:
                    bar.update(task_id, completed=len(tasks) - len(pending),
                               stats=f"{live.tokens / max(elapsed, 1e-9):6.1f} tok/s  p99 TBT {live.p99_ms():6.0f} ms  "
                                     f"{sum(1 for r in records if r.token_times and r.end_s is None)} streaming")
                if deadline_s is not None and elapsed > deadline_s and pending:
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    for r in records:
                        if r.end_s is None and r.error is None:
                            r.error = f"unfinished at the {deadline_s:.0f} s deadline"
                    break
        finally:
            if bar:
                bar.stop()
            stop.set()
            if scrape_task:
                await scrape_task
        duration = time.perf_counter() - t0
        after = await scraper.scrape(client) if before is not None else None
        delay = scheduling_delay(before, after) if before is not None and after is not None else None
        records = [r for r in records if r.index not in unsent]
        return RunResult(records, duration, started_at, scraper.snapshots, delay)


def _progress_bar(label: str):
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:  # the [bench] extra is not installed: run without a progress bar
        return None
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[stats]}"), transient=True)


def warmup(ep: Endpoint, prompt: list[int] | str, max_tokens: int = 4) -> None:
    """One small request, so lazy model loading and first-call costs stay out of the measurements."""
    res = run(ep, [RequestSpec(0, 0.0, 1, max_tokens)], [prompt], progress=False, scrape_interval=None)
    if not res.records[0].ok:
        raise RuntimeError(f"warm-up request failed: {res.records[0].error}")


def run(ep: Endpoint, requests: list[RequestSpec], prompts: list[list[int] | str], **kwargs) -> RunResult:
    return asyncio.run(run_async(ep, requests, prompts, **kwargs))
