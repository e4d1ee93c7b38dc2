"""routing.Router as Ray Serve's request router, so that one deployment of engines (with `num_replicas` or
`autoscaling_config` bounds) routes by prefix: Ray Serve's own routers pick by load only.

Ray Serve runs one instance per deployment handle, in the process that calls the handle (here the ingress). It asks
`choose_replicas` for ranks of replicas, best first, and takes the first replica of a rank whose queue is not full
(`max_ongoing_requests`), so a full preferred replica passes the request to the next rank: load then beats
affinity, as `max_imbalance` does in the Router. It may ask again for the same request (after a rejection), so
ranking records nothing; `on_request_routed` records the replica the request went to, and `on_request_completed`
ends its count in `outstanding`. Replicas that join (autoscaling) get the next number, with an empty index;
one that dies is never a candidate again (the one Serve starts in its place is a new replica, with an empty cache).

Needs Ray Serve with custom request routers (`ray.serve.request_router`, Ray >= 2.46; measured on 2.60.0).
"""
from __future__ import annotations

import json
import time

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from paceline.parallel.routing import Router, prompt_of

# The routers in this process by (application, deployment), so that the ingress (which owns the handle, and so the
# router) can report per-replica state: Ray Serve gives no way back from a handle to its router.
ROUTERS: dict[tuple[str, str], PrefixRequestRouter] = {}


def body_of(pending_request: PendingRequest | None) -> dict:
    """The OpenAI request body of a call `handle.remote(method, path, body, content_type)`, parsed ({} if none)."""
    if pending_request is None or len(pending_request.args) < 3:
        return {}
    try:
        body = json.loads(pending_request.args[2] or b"{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class PrefixRequestRouter(RequestRouter):
    """Not FIFO: the replica chosen for a request is the one that request goes to (Serve's default matching)."""

    def initialize_state(self, policy: str = "prefix", affinity_tries: int = 3, **router_kwargs) -> None:
        """`affinity_tries`: how often Serve is offered only the prefix policy's first choice before the others.
        Serve passes over a replica whose queue length it cannot fetch within its deadline (0.1 s, growing), and a
        replica busy with a long prefill is slow to answer: without a few tries its prompts would scatter exactly
        under load. A replica that is gone is dropped by Serve, and the next ranking goes without it."""
        if affinity_tries < 1:
            raise ValueError(f"affinity_tries must be >= 1, got {affinity_tries}")
        self.router = Router(1, policy, **router_kwargs)
        self.affinity_tries = affinity_tries
        self.tries: dict[str, int] = {}  # internal request id -> times ranked, until routed
        self.router.num_replicas = 0  # replicas are numbered as they appear (Router wants >= 1 at construction)
        self.router.outstanding, self.router.index, self.router.routed = [], [], []
        self.numbers: dict[ReplicaID, int] = {}  # replica -> its number in the Router
        self.in_flight: dict[str, int] = {}  # internal request id -> the replica number it was routed to
        # internal request id -> (replica number, when) of its latest first choice, until Serve reports it routed.
        # Counted in `outstanding` meanwhile: Serve asks for the requests of a burst before any is routed, and by the
        # routed counts alone all of them would pick the same replica
        self.chosen: dict[str, tuple[int, float]] = {}
        # through the module: Serve may ship this class by value (cloudpickle), and then a bare ROUTERS would be
        # the copy's own dict, which the ingress never sees
        import paceline.parallel.ray_router as module

        module.ROUTERS[(self._deployment_id.app_name, self._deployment_id.name)] = self

    def number(self, replica_id: ReplicaID) -> int:
        if replica_id not in self.numbers:
            self.numbers[replica_id] = self.router.add_replica()
        return self.numbers[replica_id]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_number = {self.number(r.replica_id): r for r in candidate_replicas}
        keys = self.router.keys(prompt_of(body_of(pending_request)))
        rid = pending_request.metadata.internal_request_id if pending_request is not None else None
        self._unchoose(rid)  # this request's own earlier choice does not count against its replica
        self._expire_choices()
        ranked = self.router.rank(keys, sorted(by_number))
        if rid is not None:
            pending_request.routing_context.should_backoff = True  # every rank full: wait before asking again
            if len(self.tries) > 100_000:  # requests cancelled before they were routed leave their count behind
                self.tries.clear()
            self.tries[rid] = self.tries.get(rid, 0) + 1
            if self.router.policy == "prefix" and self.tries[rid] <= self.affinity_tries:
                ranked = ranked[:1]
            if ranked:
                self.chosen[rid] = (ranked[0], time.monotonic())
                self.router.outstanding[ranked[0]] += 1
        return [[by_number[n]] for n in ranked]

    def _unchoose(self, rid: str | None) -> None:
        if rid in self.chosen:
            self.router.outstanding[self.chosen.pop(rid)[0]] -= 1

    def _expire_choices(self, max_age_s: float = 30.0) -> None:
        """A request cancelled while Serve was routing it is never reported: its choice stops counting after a while."""
        now = time.monotonic()
        for rid in [rid for rid, (_, since) in self.chosen.items() if now - since > max_age_s]:
            self._unchoose(rid)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        rid = pending_request.metadata.internal_request_id
        self.tries.pop(rid, None)
        self._unchoose(rid)
        n = self.number(replica_id)
        self.router.record(n, self.router.keys(prompt_of(body_of(pending_request))))
        self.router.outstanding[n] += 1
        self.in_flight[rid] = n

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # also called for an attempt the replica rejected (never routed there): only the routed one counts
        n = self.in_flight.get(internal_request_id)
        if n is not None and n == self.numbers.get(replica_id):
            self.router.outstanding[self.in_flight.pop(internal_request_id)] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if replica_id in self.numbers:
            self.router.index[self.numbers[replica_id]].clear()

    def replicas(self) -> list[dict]:
        """Per replica ever seen: its number, Serve's id, whether it is routable, requests in flight and routed."""
        live = set(self.curr_replicas)
        return [{"replica": n, "replica_id": rid.unique_id, "actor_name": rid.to_full_id_str(), "live": rid in live,
                 "outstanding": self.router.outstanding[n], "routed": self.router.routed[n]}
                for rid, n in sorted(self.numbers.items(), key=lambda item: item[1])]
