"""Which replica gets an arriving request: the Ray Serve ingress's own router (paceline.parallel.routing.Router),
driven by the simulated clock, so a fleet planned on paper runs with the settings it will be served with.

The policies and their parameters are the ingress's: round-robin; least-outstanding (the replica with the fewest
unfinished requests, ties to the one given the fewest so far); prefix (the replica whose index of past prompts holds
the longest start of this one, if that covers `min_match_fraction` of it, else the least busy one with the emptier
index; `max_imbalance`, `capacity_chunks` as there). The simulated prompts are token ids, matched in `chunk_tokens`
chunks (one KV block). The replicas' prefix caches themselves are simulated by each replica's real Scheduler and
KV cache manager: the router sees only its own index, as the ingress does, and the hit rate comes from the caches.
"""
from __future__ import annotations

from collections.abc import Sequence

from paceline.parallel.routing import POLICIES, Router as ReplicaRouter

ROUTERS = tuple(p.replace("_", "-") for p in POLICIES)  # round-robin, least-outstanding, prefix


class Router:
    """`policy` in either spelling (round-robin or round_robin); `options`: the ingress Router's other settings."""

    def __init__(self, policy: str, num_replicas: int, **options) -> None:
        if policy.replace("_", "-") not in ROUTERS:
            raise ValueError(f"unknown router {policy!r}; choose one of {', '.join(ROUTERS)}")
        if num_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {num_replicas}")
        self.policy = policy.replace("_", "-")
        self.router = ReplicaRouter(num_replicas, policy, **options)

    @property
    def outstanding(self) -> list[int]:
        return self.router.outstanding

    def route(self, prompt: Sequence[int] = ()) -> int:
        """The replica for a request with this prompt (token ids; only the prefix policy reads them). Nothing is
        ever marked down in a simulation, so the first choice is the one."""
        i = self.router.order_prompt(prompt if self.policy == "prefix" else ())[0]
        self.router.outstanding[i] += 1
        return i

    def finished(self, replica: int) -> None:
        self.router.outstanding[replica] -= 1
