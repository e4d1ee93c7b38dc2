"""Which replica gets an arriving request."""
from __future__ import annotations

ROUTERS = ("round-robin", "least-outstanding")


class Router:
    """round-robin: replica i takes arrivals i, i+n, ...; least-outstanding: the replica with the fewest
    unfinished requests, lowest index on ties (so a run is reproducible)."""

    def __init__(self, policy: str, num_replicas: int) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"unknown router {policy!r}; choose one of {', '.join(ROUTERS)}")
        if num_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {num_replicas}")
        self.policy = policy
        self.outstanding = [0] * num_replicas
        self._next = 0

    def route(self) -> int:
        if self.policy == "round-robin":
            i = self._next
            self._next = (i + 1) % len(self.outstanding)
        else:
            i = min(range(len(self.outstanding)), key=self.outstanding.__getitem__)
        self.outstanding[i] += 1
        return i

    def finished(self, replica: int) -> None:
        self.outstanding[replica] -= 1
