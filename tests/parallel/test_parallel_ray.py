"""Data-parallel replicas on Ray Serve: 2 paceline engines on 127.0.0.1 behind the OpenAI-compatible ingress.
Runs where Ray is installed (`pip install 'paceline[ray]'`); skipped otherwise."""
from __future__ import annotations

import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'paceline[ray]'")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'paceline[ray]'")

from openai import OpenAI  # noqa: E402  (after the importorskips)

from paceline.entrypoints import ray_serve  # noqa: E402
from paceline.parallel.comm import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENGINE = {"kv_cache_memory_gb": 0.05, "block_size": 16, "served_model_name": "m"}


@pytest.fixture(scope="module")
def cluster():
    # Ray's workers must import this checkout's paceline, and whatever put Ray on this process's path
    path = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
    ray.shutdown()


def replica_stats(port: int) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/paceline/replicas").read())


def live(port: int) -> list[dict]:
    return [r for r in replica_stats(port)["replicas"] if r["live"]]


def test_two_replicas_serve_the_openai_api_and_survive_a_killed_replica(cluster) -> None:
    serve.run(ray_serve.build(2, ENGINE, "least_outstanding"), name="paceline", route_prefix="/")
    # one deployment of 2 engines, routed by paceline's request router in the ingress
    client = OpenAI(base_url=f"http://127.0.0.1:{cluster}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="m", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert out.choices[0].text and out.usage.completion_tokens == 4
    chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert chat.choices[0].message.content is not None
    with pytest.raises(Exception) as err:  # the replica's own validation, OpenAI-style
        client.completions.create(model="m", prompt="x", max_tokens=-1)
    assert getattr(err.value, "status_code", None) == 400
    assert len(live(cluster)) == 2 and all(r["routed"] >= 1 for r in live(cluster))  # spread, one at a time

    # requests in flight on both replicas when replica 0's process dies: its share is retried on replica 1
    def ask(i: int):
        return client.completions.create(model="m", prompt=f"List {i} colours:", max_tokens=32, temperature=0,
                                         extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, i) for i in range(4)]
        deadline = time.monotonic() + 60
        while not (len(live(cluster)) == 2 and all(r["outstanding"] >= 1 for r in live(cluster))):
            assert time.monotonic() < deadline, "the requests never reached both replicas"
            time.sleep(0.05)
        victim = live(cluster)[0]
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)  # as a crash would
        replies = [f.result(timeout=120) for f in futures]
    assert [r.usage.completion_tokens for r in replies] == [32] * 4
    assert replica_stats(cluster)["failovers"] >= 1  # at least one was on the dead replica and was sent again

    for i in range(4):  # the app keeps serving while Serve restarts the dead replica
        r = client.completions.create(model="m", prompt=f"Count to {i}:", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
    deadline = time.monotonic() + 120
    while True:  # and Serve replaces the dead replica: a new one that the router sends work to
        client.completions.create(model="m", prompt="Again:", max_tokens=1, temperature=0)
        now = live(cluster)
        if len(now) == 2 and victim["replica_id"] not in {r["replica_id"] for r in now} \
                and all(r["routed"] >= 1 for r in now):
            break
        assert time.monotonic() < deadline, f"no second replica came back: {replica_stats(cluster)}"
        time.sleep(0.5)
    serve.delete("paceline")


def test_prefix_routing_raises_the_cache_hit_rate(cluster) -> None:
    from paceline.parallel.routing import shared_prefix_workload

    rates = {}
    for policy in ("round_robin", "prefix"):
        # autoscaling bounds (requests one at a time never ask for the third replica)
        scale = {"min_replicas": 2, "max_replicas": 3, "target_ongoing_requests": 8}
        serve.run(ray_serve.build(None, {**ENGINE, "num_blocks": 64}, policy, autoscaling=scale), name="paceline",
                  route_prefix="/")
        client = OpenAI(base_url=f"http://127.0.0.1:{cluster}/v1", api_key="unused", max_retries=0)
        for prompt in shared_prefix_workload(groups=6, per_group=3):
            client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0)
        stats = live(cluster)
        assert len(stats) == 2 and all(s["routed"] == 9 for s in stats)  # 6 prefixes x 3, split evenly by both
        rates[policy] = sum(s["prefix_cache_hits"] for s in stats) / sum(s["prefix_cache_queries"] for s in stats)
        serve.delete("paceline")
    assert rates["prefix"] > rates["round_robin"]
