"""The keep-alive race without the model: does a server keep-alive timeout no longer than the client pool's expiry
reset requests? A trivial ASGI app under uvicorn (in a thread), and N httpx clients, each on one pooled connection,
sending every `expiry - U(0, 30 ms)`: just inside the client's expiry, where the server may be closing.

    python benchmarks/keepalive_race.py SERVER_KEEP_ALIVE_S CLIENT_EXPIRY_S SECONDS CLIENTS
    python benchmarks/keepalive_race.py 0.5 0.5 40 40    # equal: resets (httpx.ReadError with an empty message)
    python benchmarks/keepalive_race.py 5 0.5 40 40      # the server's longer: none

Prints the count of answers and of each httpx error, with the first error's message and its cause.
"""
from __future__ import annotations

import asyncio
import random
import socket
import sys
import threading
import time

import httpx
import uvicorn


async def app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def serve(port: int, keep_alive_s: float) -> None:
    uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                  timeout_keep_alive=keep_alive_s, lifespan="off")).run()


async def client(url: str, expiry_s: float, seconds: float, counts: dict) -> None:
    limits = httpx.Limits(max_keepalive_connections=1, max_connections=1, keepalive_expiry=expiry_s)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=10) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                await c.get("/")
                counts["ok"] += 1
            except httpx.HTTPError as e:
                name = type(e).__name__
                counts[name] = counts.get(name, 0) + 1
                counts.setdefault(f"first {name}", f"{str(e)!r}, cause {e.__context__!r}")
            await asyncio.sleep(expiry_s - random.uniform(0, 0.03))


async def run(url: str, expiry_s: float, seconds: float, clients: int) -> dict:
    counts = {"ok": 0}
    await asyncio.gather(*(client(url, expiry_s, seconds, counts) for _ in range(clients)))
    return counts


def main() -> None:
    keep_alive_s, expiry_s, seconds, clients = (float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]),
                                                int(sys.argv[4]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threading.Thread(target=serve, args=(port, keep_alive_s), daemon=True).start()
    time.sleep(1.5)  # uvicorn up
    counts = asyncio.run(run(f"http://127.0.0.1:{port}", expiry_s, seconds, clients))
    print(f"server keep-alive {keep_alive_s} s, client expiry {expiry_s} s: {counts}")


if __name__ == "__main__":
    main()
