"""paceline's request router inside Ray Serve (parallel.ray_router), driven as Serve drives it, without a cluster.
Runs where Ray imports; skipped otherwise."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve.request_router", reason="Ray Serve with custom request routers is not installed: "
                                                        "pip install 'paceline[ray]'")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from paceline.parallel.ray_router import ROUTERS, PrefixRequestRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="test-app")


def make_router(**kwargs) -> PrefixRequestRouter:
    router = PrefixRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    return router


def replica(name: str) -> SimpleNamespace:
    """What choose_replicas reads of Serve's RunningReplica: its id."""
    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT))


def request(i: int, prompt: str) -> PendingRequest:
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    return PendingRequest(args=["POST", "/v1/completions", body, "application/json"], kwargs={},
                          metadata=RequestMetadata(request_id=str(i), internal_request_id=f"internal-{i}"),
                          future=None)  # Serve sets it when routing; the router never reads it


def route(router: PrefixRequestRouter, replicas: list, pr: PendingRequest) -> str:
    """Serve's part: ask for ranks, send to the first replica of the first rank, tell the router."""
    ranks = asyncio.run(router.choose_replicas(replicas, pr))
    chosen = ranks[0][0].replica_id
    router.on_request_routed(pr, chosen, result=None)
    return chosen.unique_id


def system(topic: str) -> str:
    return f"You are a careful assistant who answers questions about {topic}. " * 3


def test_a_prefix_stays_on_its_replica_and_new_ones_are_spread() -> None:
    router, replicas = make_router(policy="prefix"), [replica("a"), replica("b")]
    assert ROUTERS[("test-app", "EngineReplica")] is router  # the ingress finds it to report per replica
    homes = {t: route(router, replicas, request(i, system(t) + "first?")) for i, t in enumerate(["chess", "tax"])}
    assert sorted(homes.values()) == ["a", "b"]
    for i, t in enumerate(["chess", "tax", "chess"]):
        assert route(router, replicas, request(10 + i, system(t) + f"question {i}?")) == homes[t]
    # asking again for one request (Serve does when its choice is full or slow to answer) records nothing twice;
    # the first choice alone is offered 3 times, then all replicas, best first
    pr = request(20, system("chess") + "again?")
    for _ in range(3):
        assert [[r.replica_id.unique_id for r in rank] for rank in asyncio.run(router.choose_replicas(replicas, pr))] \
            == [[homes["chess"]]]
    assert len(asyncio.run(router.choose_replicas(replicas, pr))) == 2
    assert route(router, replicas, pr) == homes["chess"]
    state = {r["replica_id"]: r for r in router.replicas()}
    assert state[homes["chess"]]["routed"] == 4 and state[homes["tax"]]["routed"] == 2
    assert state[homes["chess"]]["outstanding"] == 4  # nothing completed yet


def test_in_flight_counts_end_with_the_request_and_a_rejected_attempt_does_not_count() -> None:
    router, replicas = make_router(policy="least_outstanding"), [replica("a"), replica("b")]
    first = request(0, "x")
    assert route(router, replicas, first) == "a"
    assert route(router, replicas, request(1, "y")) == "b"
    router.on_request_completed(ReplicaID(unique_id="b", deployment_id=DEPLOYMENT), "internal-0")  # not routed there
    assert [r["outstanding"] for r in router.replicas()] == [1, 1]
    router.on_request_completed(ReplicaID(unique_id="a", deployment_id=DEPLOYMENT), "internal-0")
    assert [r["outstanding"] for r in router.replicas()] == [0, 1]
    assert route(router, replicas, request(2, "z")) == "a"  # the less busy one


def test_a_burst_asked_for_before_any_is_routed_is_spread() -> None:
    # Serve ranks every request of a burst before it reports any of them routed
    router, replicas = make_router(policy="least_outstanding"), [replica("a"), replica("b")]
    burst = [request(i, f"List {i} colours:") for i in range(4)]
    firsts = [asyncio.run(router.choose_replicas(replicas, pr))[0][0].replica_id for pr in burst]
    assert sorted(r.unique_id for r in firsts) == ["a", "a", "b", "b"]
    asyncio.run(router.choose_replicas(replicas, burst[0]))  # asked again: its earlier choice is replaced, not added
    assert sum(r["outstanding"] for r in router.replicas()) == 4
    for pr, chosen in zip(burst, firsts):
        router.on_request_routed(pr, chosen, result=None)
    assert [r["outstanding"] for r in router.replicas()] == [2, 2]
    router.on_request_completed(ReplicaID(unique_id="zz", deployment_id=DEPLOYMENT), "never-routed")  # ignored


def test_a_replica_that_joins_gets_new_prefixes_and_a_dead_one_is_forgotten() -> None:
    router = make_router(policy="prefix")
    a, b, c = replica("a"), replica("b"), replica("c")
    for i, t in enumerate(["chess", "tax", "poetry", "chess"]):
        home = route(router, [a, b], request(i, system(t) + "?"))
        router.on_request_completed(ReplicaID(unique_id=home, deployment_id=DEPLOYMENT), f"internal-{i}")
    # autoscaling added c; nothing is in flight anywhere, but c's index is empty: the next new prefix goes there
    assert route(router, [a, b, c], request(3, system("sailing") + "?")) == "c"
    home = route(router, [a, b, c], request(4, system("chess") + "more?"))
    router.on_replica_actor_died(ReplicaID(unique_id=home, deployment_id=DEPLOYMENT))
    rest = [r for r in (a, b, c) if r.replica_id.unique_id != home]
    assert route(router, rest, request(5, system("chess") + "and more?")) != home
    assert next(r for r in router.replicas() if r["replica_id"] == home)["live"] is False


def test_unknown_policy_and_bad_bodies() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_router(policy="random")
    with pytest.raises(ValueError, match="affinity_tries"):
        make_router(policy="prefix", affinity_tries=0)
    router, replicas = make_router(policy="prefix"), [replica("a"), replica("b")]
    bad = PendingRequest(args=["POST", "/v1/completions", b"{not json", "application/json"], kwargs={},
                         metadata=RequestMetadata(request_id="9", internal_request_id="internal-9"), future=None)
    assert route(router, replicas, bad) in ("a", "b")  # the replica's own validation answers it with a 400


def test_the_app_takes_a_replica_count_or_autoscaling_bounds_and_says_what_is_wrong() -> None:
    from paceline.entrypoints import ray_serve

    with pytest.raises(ValueError, match="unknown routing policy"):
        ray_serve.build(2, {}, "random")
    with pytest.raises(ValueError, match="either num_replicas or autoscaling"):
        ray_serve.build(2, {}, autoscaling={"min_replicas": 1, "max_replicas": 2})
    with pytest.raises(ValueError, match="either num_replicas or autoscaling"):
        ray_serve.build(None, {})
    ray_serve.build(None, {}, "prefix", autoscaling={"min_replicas": 1, "max_replicas": 3})  # builds, deploys nothing
    for argv in (["--replicas", "2", "--max-replicas", "3"], ["--min-replicas", "3", "--max-replicas", "2"],
                 ["--replicas", "0"], ["--policy", "random"]):
        with pytest.raises(SystemExit) as exit_:
            ray_serve.main(argv)
        assert exit_.value.code == 2  # argparse's usage error, before Ray starts
