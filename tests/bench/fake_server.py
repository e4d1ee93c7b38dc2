"""A tiny OpenAI-compatible streaming server with a known token timeline, run by uvicorn in a thread.

Every request streams max_tokens tokens, one per SSE chunk: the first `ttft` seconds after the request, then one
every `gap` seconds; a request whose priority is `stall_priority` pauses `stall` seconds after its 3rd token.
/metrics exposes the counters and the queue-time histogram the paceline server has, with fixed values.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from paceline.bench.peers import free_port


def build_app(ttft: float, gap: float, stall: float, stall_priority: int, seen: list[dict]) -> FastAPI:
    app = FastAPI()
    scrapes = {"n": 0}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        # each scrape advances the counters by a fixed amount: 30 decode and 70 prefill tokens over 10 steps
        n = scrapes["n"]
        scrapes["n"] += 1
        lines = [f"paceline:step_decode_tokens_total{{model_name=\"fake\"}} {30.0 * n}",
                 f"paceline:step_prefill_tokens_total{{model_name=\"fake\"}} {70.0 * n}",
                 f"paceline:engine_steps_total{{model_name=\"fake\"}} {10.0 * n}"]
        # queue time: before the first scrape's successor, 4 requests at <=0.1 s and 4 at <=0.3 s
        counts = {"0.1": 4 * min(n, 1), "0.3": 8 * min(n, 1), "+Inf": 8 * min(n, 1)}
        for le, c in counts.items():
            lines.append(f'paceline:request_queue_time_seconds_bucket{{le="{le}",model_name="fake"}} {float(c)}')
        lines.append(f"paceline:request_queue_time_seconds_count{{model_name=\"fake\"}} {8.0 * min(n, 1)}")
        lines.append(f"paceline:request_queue_time_seconds_sum{{model_name=\"fake\"}} {1.0 * min(n, 1)}")
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        body = await request.json()
        seen.append(body)
        if body.get("max_tokens", 0) < 1:
            return JSONResponse({"error": {"message": "max_tokens must be >= 1"}}, status_code=400)
        n = body["max_tokens"]
        prompt = body["prompt"]
        prompt_len = len(prompt) if isinstance(prompt, list) else len(prompt.split())

        async def stream():
            for i in range(n):
                due = t0 + ttft + i * gap + (stall if body.get("priority") == stall_priority and i >= 3 else 0.0)
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                last = i == n - 1
                chunk = {"id": "x", "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if last else None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
                yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


class FakeServer:
    def __init__(self, ttft: float = 0.1, gap: float = 0.03, stall: float = 0.3, stall_priority: int = 7):
        self.seen: list[dict] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = build_app(ttft, gap, stall, stall_priority, self.seen)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


if __name__ == "__main__":  # `python fake_server.py PORT`: as a separate process, for peers.Server tests
    import sys

    app = build_app(0.05, 0.01, 0.0, -1, [])
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
