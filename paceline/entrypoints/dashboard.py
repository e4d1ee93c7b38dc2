"""GET /dashboard: one self-contained page that draws the scheduler at work; GET /dashboard/events: its live feed
(server-sent events) from the StepLogs the engine thread fills; GET /dashboard/steps: the whole ring as JSON, for
a benchmark's static report. No build step, no CDN: static/charts.js (plain
canvas) is inlined into static/dashboard.html when the routes are added.

Feed: one `data:` JSON message per model per tick, {"model", "now", "steps": [step records since the last
message], "state": requests snapshot or null, "latency": last minute's TTFT/TBT histograms or null, "info" on the
first}. Every step record carries its model too, so one page shows one row per model."""
from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from paceline.engine.step_log import StepLog
from paceline.entrypoints.protocol import APIError

STATIC = Path(__file__).parent / "static"
TICK_S = 0.25  # a page gets at most four messages a second per model: smooth enough, cheap to send
LATENCY_EVERY_S = 1.0  # the histograms cover a minute; once a second is plenty
BACKLOG_S = 60.0  # a page that connects gets this much history at once


def charts_js() -> str:
    """The chart code alone, for a static page: embed it and call PacelineCharts.drawSteps(container, steps)."""
    return (STATIC / "charts.js").read_text()


def page_html() -> str:
    return (STATIC / "dashboard.html").read_text().replace("/*CHARTS_JS*/", charts_js())


def check_key(request: Request, api_key: str | None) -> None:
    """The page's key check: `Authorization: Bearer <key>` (scripts) or HTTP Basic with the key as password
    (a browser asks once, then sends it with the page's own event-stream request too)."""
    if not api_key:
        return
    given = request.headers.get("authorization", "")
    scheme, _, value = given.partition(" ")
    secret = value
    if scheme.lower() == "basic":
        try:
            secret = base64.b64decode(value, validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            secret = ""
    elif scheme.lower() != "bearer":
        secret = ""
    if not hmac.compare_digest(secret.encode(), api_key.encode()):
        raise APIError(401, "invalid or missing API key; send `Authorization: Bearer <key>`, or any user name and "
                            "the key as password", code="invalid_api_key",
                       headers={"WWW-Authenticate": 'Basic realm="paceline dashboard", charset="UTF-8"'})


def add_dashboard_routes(app: FastAPI, logs: Sequence[StepLog], api_key: str | None = None,
                         is_open: Callable[[], bool] = lambda: True, tick_s: float = TICK_S) -> None:
    """Register GET /dashboard, GET /dashboard/events and GET /dashboard/steps. is_open() turning false ends every feed, so a server
    that shuts down is not held by an open page (uvicorn waits for streaming responses to end)."""
    html = page_html()

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> HTMLResponse:
        check_key(request, api_key)
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(request: Request) -> StreamingResponse:
        check_key(request, api_key)
        return StreamingResponse(feed(logs, is_open, tick_s), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    @app.get("/dashboard/steps", include_in_schema=False)
    async def dashboard_steps(request: Request) -> JSONResponse:
        """Every step record still in the ring, per model, for a benchmark's static report (`--html`): the
        client reads `num_steps` before its run and keeps the records numbered after it."""
        check_key(request, api_key)
        return JSONResponse({"models": [{"model": log.model, "info": log.info_dict(), "num_steps": log.num_steps,
                                         "steps": log.steps_since(0)} for log in logs]},
                            headers={"Cache-Control": "no-store"})


def _message(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def feed(logs: Sequence[StepLog], is_open: Callable[[], bool], tick_s: float = TICK_S) -> AsyncIterator[str]:
    """The page's event stream; ends when is_open() turns false or the client leaves (Starlette cancels it)."""
    for log in logs:
        log.subscribers += 1  # only the event loop writes this; the engine thread reads it
    try:
        now = time.monotonic()
        last_seq: dict[int, int] = {}
        last_snapshot: dict[int, object] = {}
        last_info: dict[int, object] = {}
        yield "retry: 1000\n\n"  # EventSource reconnects after a second if the stream drops
        for i, log in enumerate(logs):
            steps = [s for s in log.steps_since(0) if s["t"] >= now - BACKLOG_S]
            last_seq[i] = steps[-1]["seq"] if steps else log.num_steps
            last_snapshot[i] = log.snapshot
            last_info[i] = log.info
            yield _message({"model": log.model, "now": now, "info": log.info_dict(),
                            "steps": steps, "state": log.snapshot, "latency": log.latency(now)})
        next_latency = now + LATENCY_EVERY_S
        while is_open():
            await asyncio.sleep(tick_s)
            now = time.monotonic()
            with_latency = now >= next_latency
            if with_latency:
                next_latency = now + LATENCY_EVERY_S
            for i, log in enumerate(logs):
                steps = log.steps_since(last_seq[i])
                if steps:
                    last_seq[i] = steps[-1]["seq"]
                snapshot = log.snapshot
                fresh = snapshot is not last_snapshot[i]
                last_snapshot[i] = snapshot
                message = {"model": log.model, "now": now, "steps": steps, "state": snapshot if fresh else None,
                           "latency": log.latency(now) if with_latency else None}
                if log.info is not last_info[i]:  # the engine reported after the page connected
                    last_info[i] = log.info
                    message["info"] = log.info_dict()
                # an idle server still says `now` each tick, so the page's time axis keeps moving
                yield _message(message)
    finally:
        for log in logs:
            log.subscribers -= 1

