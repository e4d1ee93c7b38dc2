"""Data-parallel replicas on Ray Serve (`pip install 'paceline[ray]'`): one deployment of paceline engines, a fixed
number of replicas or autoscaling between bounds, behind an OpenAI-compatible ingress.

Ray Serve's request router runs in the ingress (the process that calls the engines' handle) and is paceline's own
(parallel.ray_router: routing.Router's round-robin, least outstanding or prefix policy), so requests that share a
prompt prefix go to the replica whose prefix cache holds it. A replica runs paceline's own HTTP app
(entrypoints.server.build_app) in-process, so the API, its validation and its error bodies are the server's; the
ingress forwards the request body and returns the reply whole (a streamed reply arrives as one piece). A request
whose replica dies is sent again, and the router routes it to a live one; Ray Serve replaces the dead replica.

    python -m paceline.entrypoints.ray_serve --replicas 2 --policy prefix --port 8000
    python -m paceline.entrypoints.ray_serve --min-replicas 1 --max-replicas 4 --port 8000   # autoscaling
"""
from __future__ import annotations

import argparse
import os
import time

from ray import serve
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from paceline.parallel.routing import POLICIES

ROUTER_CLASS = "paceline.parallel.ray_router.PrefixRequestRouter"  # by name: imported where the handle lives


# the engine batches what it is given (Serve's default max_ongoing_requests, 5, would queue); a replica busy with
# long steps on a loaded host can take more than 10 s to answer a health check
@serve.deployment(ray_actor_options={"num_cpus": 0}, health_check_period_s=1, health_check_timeout_s=30,
                  max_ongoing_requests=64)
class EngineReplica:
    """One paceline engine; `engine_kwargs` as LLM(...) takes them."""

    def __init__(self, engine_kwargs: dict, threads: int = 1):
        import httpx
        import torch

        from paceline.engine.async_engine import AsyncEngine
        from paceline.engine.pipelined import engine_for
        from paceline.entrypoints.llm import _split_kwargs
        from paceline.entrypoints.server import build_app

        torch.set_num_threads(threads)
        config = _split_kwargs(dict(engine_kwargs))
        self.engine = AsyncEngine(lambda: engine_for(config))
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(self.engine)),
                                        base_url="http://replica", timeout=None)

    async def handle(self, method: str, path: str, body: bytes, content_type: str) -> tuple[int, str, bytes, dict]:
        """The reply, and this replica's counters after it (the ingress reports them per replica: a deployment's
        handle cannot address one replica)."""
        r = await self.client.request(method, path, content=body, headers={"content-type": content_type})
        return r.status_code, r.headers.get("content-type", "application/json"), r.content, self.stats()

    def stats(self) -> dict:
        s = self.engine.engine.stats()
        return {"replica_id": self.replica_id, "pid": os.getpid(), "prefix_cache_queries": s.prefix_cache_queries,
                "prefix_cache_hits": s.prefix_cache_hits, "num_running": s.num_running, "num_waiting": s.num_waiting}


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)  # it only forwards
class Ingress:
    """Takes every HTTP request (Serve hands `__call__` the Starlette request) and forwards it to the engines."""

    def __init__(self, engines, attempts: int = 4):
        self.engines = engines
        self.attempts = attempts  # a request is sent again this often when its replica dies
        self.engine_stats: dict[str, dict] = {}  # replica id -> its counters as of its last reply
        self.failovers = 0  # requests whose replica failed and that were sent again

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/paceline/replicas":
            return JSONResponse(self.replica_stats())
        body = await request.body()
        content_type = request.headers.get("content-type", "application/json")
        for _ in range(self.attempts):
            try:
                status, media, content, stats = await self.engines.handle.remote(
                    request.method, request.url.path, body, content_type)
            except Exception:  # noqa: BLE001 - the replica died under the request: the router picks a live one
                self.failovers += 1
                continue
            self.engine_stats[stats["replica_id"]] = stats
            return Response(content, status_code=status, media_type=media)
        return JSONResponse({"error": {"message": "no replica could serve the request", "type": "server_error",
                                       "param": None, "code": None}}, status_code=503)

    def replica_stats(self) -> dict:
        """Every replica the router has seen (its number, Serve's id, live or not, requests in flight and routed)
        with its counters as of its last reply; the failovers."""
        from paceline.parallel.ray_router import ROUTERS

        router = ROUTERS.get((self.engines.app_name, self.engines.deployment_name))
        replicas = router.replicas() if router is not None else []
        for r in replicas:
            r.update(self.engine_stats.get(r["replica_id"], {}))
        return {"replicas": replicas, "failovers": self.failovers}


def build(num_replicas: int | None, engine_kwargs: dict, policy: str = "prefix", threads: int = 1,
          router_kwargs: dict | None = None, autoscaling: dict | None = None):
    """The Serve application: a deployment of engines, `num_replicas` of them or `autoscaling` (Serve's
    autoscaling_config: min_replicas, max_replicas, target_ongoing_requests, ...), routed by `policy` with the
    Router's other settings in `router_kwargs` (say min_match_fraction), and the ingress in front."""
    try:  # imported by name where the handle lives; fail here, in the driver, with the reason
        import ray.serve.request_router  # noqa: F401
    except ImportError as e:
        import ray

        raise ImportError(f"paceline's replicas need Ray Serve's custom request routers (ray.serve.request_router, "
                          f"tested on Ray 2.60.0); this is Ray {ray.__version__}") from e
    if policy.replace("-", "_") not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if (num_replicas is None) == (autoscaling is None):
        raise ValueError("give either num_replicas or autoscaling bounds, not both")
    router = RequestRouterConfig(request_router_class=ROUTER_CLASS,
                                 request_router_kwargs={"policy": policy, **(router_kwargs or {})})
    scale = {"num_replicas": num_replicas} if autoscaling is None else {"autoscaling_config": autoscaling}
    engines = EngineReplica.options(request_router_config=router, **scale).bind(engine_kwargs, threads)
    return Ingress.bind(engines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="paceline replicas on Ray Serve (OpenAI-compatible ingress)")
    p.add_argument("--replicas", type=int, default=None, help="a fixed number of replicas (default 2)")
    p.add_argument("--min-replicas", type=int, default=None, help="autoscaling: at least this many")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscaling: at most this many")
    p.add_argument("--target-ongoing-requests", type=float, default=8,
                   help="autoscaling: requests in flight per replica that Serve scales to")
    p.add_argument("--policy", default="prefix", choices=list(POLICIES))
    p.add_argument("--model", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    args = p.parse_args(argv)
    autoscaling = None
    if args.min_replicas is not None or args.max_replicas is not None:
        if args.replicas is not None:
            p.error("--replicas is a fixed count: give it or --min-replicas/--max-replicas, not both")
        low = 1 if args.min_replicas is None else args.min_replicas
        high = max(low, 1) if args.max_replicas is None else args.max_replicas
        if low < 0 or high < max(low, 1):
            p.error(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got {low} and {high}")
        autoscaling = {"min_replicas": low, "max_replicas": high,
                       "target_ongoing_requests": args.target_ongoing_requests}
    elif args.replicas is None:
        args.replicas = 2
    elif args.replicas < 1:
        p.error(f"--replicas must be >= 1, got {args.replicas}")
    import ray

    ray.init(include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build(args.replicas, {"model": args.model}, args.policy, args.threads, autoscaling=autoscaling),
              name="paceline", route_prefix="/")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()


if __name__ == "__main__":
    main()
