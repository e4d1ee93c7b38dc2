"""Data-parallel replicas on Ray Serve (`pip install 'paceline[ray]'`): one paceline engine per replica behind an
OpenAI-compatible ingress that picks the replica itself (routing.Router: round-robin, least outstanding, prefix).

Each replica is its own one-replica deployment, so the ingress can address it: Ray Serve's own router picks among
the replicas of one deployment by load only, and prefix affinity needs to name the replica. A replica runs paceline's
own HTTP app (entrypoints.server.build_app) in-process, so the API, its validation and its error bodies are the
server's; the ingress forwards the request body and returns the reply whole (a streamed reply arrives as one piece).
A replica that fails is passed over and its request retried on the next one; Ray Serve restarts the dead actor.

    python -m paceline.entrypoints.ray_serve --replicas 2 --policy prefix --port 8000
"""
from __future__ import annotations

import argparse
import json
import os
import time

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from paceline.parallel.routing import Router


@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=1, health_check_timeout_s=10)
class EngineReplica:
    """One paceline engine; `engine_kwargs` as LLM(...) takes them."""

    def __init__(self, engine_kwargs: dict, threads: int = 1):
        import httpx
        import torch

        from paceline.engine.async_engine import AsyncEngine
        from paceline.engine.engine import Engine
        from paceline.entrypoints.llm import _split_kwargs
        from paceline.entrypoints.server import build_app

        torch.set_num_threads(threads)
        config = _split_kwargs(dict(engine_kwargs))
        self.engine = AsyncEngine(lambda: Engine(config))
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(self.engine)),
                                        base_url="http://replica", timeout=None)

    async def handle(self, method: str, path: str, body: bytes, content_type: str) -> tuple[int, str, bytes]:
        r = await self.client.request(method, path, content=body, headers={"content-type": content_type})
        return r.status_code, r.headers.get("content-type", "application/json"), r.content

    def stats(self) -> dict:
        s = self.engine.engine.stats()
        return {"prefix_cache_queries": s.prefix_cache_queries, "prefix_cache_hits": s.prefix_cache_hits,
                "num_running": s.num_running, "num_waiting": s.num_waiting, "pid": os.getpid()}

    def die(self) -> None:
        """Test hook: the replica's process exits as a crash would."""
        os._exit(1)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Ingress:
    """Takes every HTTP request (Serve hands `__call__` the Starlette request) and forwards it to a replica."""

    def __init__(self, replicas: list, policy: str = "prefix", router_kwargs: dict | None = None):
        self.replicas = replicas
        self.router = Router(len(replicas), policy, **(router_kwargs or {}))
        self.failovers = [0] * len(replicas)  # per replica: requests it dropped that another one then served

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/paceline/replicas":
            return JSONResponse(await self.replica_stats())
        body = await request.body()
        try:
            parsed = json.loads(body) if body else {}
        except ValueError:
            parsed = {}
        content_type = request.headers.get("content-type", "application/json")
        for replica in self.router.order(parsed if isinstance(parsed, dict) else {}):
            self.router.outstanding[replica] += 1
            try:
                status, media, content = await self.replicas[replica].handle.remote(
                    request.method, request.url.path, body, content_type)
            except Exception:  # noqa: BLE001 - the replica died or is unreachable: the next one takes it
                self.router.mark_down(replica)
                self.failovers[replica] += 1
                continue
            finally:
                self.router.outstanding[replica] -= 1
            self.router.mark_up(replica)
            return Response(content, status_code=status, media_type=media)
        return JSONResponse({"error": {"message": "no replica could serve the request", "type": "server_error",
                                       "param": None, "code": None}}, status_code=503)

    async def replica_stats(self) -> list[dict]:
        out = []
        for i, handle in enumerate(self.replicas):
            try:
                out.append({"replica": i, "outstanding": self.router.outstanding[i],
                            "routed": self.router.routed[i], "failovers": self.failovers[i],
                            **await handle.stats.remote()})
            except Exception as e:  # noqa: BLE001 - a dead replica is reported, not raised
                out.append({"replica": i, "failovers": self.failovers[i], "error": type(e).__name__})
        return out


def build(num_replicas: int, engine_kwargs: dict, policy: str = "prefix", threads: int = 1,
          router_kwargs: dict | None = None):
    """The Serve application: `num_replicas` engines and the ingress in front of them (`router_kwargs`: the
    Router's other settings, say min_match_fraction)."""
    replicas = [EngineReplica.options(name=f"engine-{i}").bind(engine_kwargs, threads) for i in range(num_replicas)]
    return Ingress.bind(replicas, policy, router_kwargs)


def run(num_replicas: int, engine_kwargs: dict, policy: str, host: str = "127.0.0.1", port: int = 8000,
        threads: int = 1) -> None:
    serve.start(http_options={"host": host, "port": port})
    serve.run(build(num_replicas, engine_kwargs, policy, threads), name="paceline", route_prefix="/")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="paceline replicas on Ray Serve (OpenAI-compatible ingress)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policy", default="prefix", choices=["round_robin", "least_outstanding", "prefix"])
    p.add_argument("--model", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    args = p.parse_args(argv)
    import ray

    ray.init(include_dashboard=False)
    run(args.replicas, {"model": args.model}, args.policy, args.host, args.port, args.threads)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()


if __name__ == "__main__":
    main()
