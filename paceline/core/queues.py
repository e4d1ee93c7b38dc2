"""Queues of requests waiting to run (or to be swapped back in), ordered by a rank key: smaller runs first.

FCFS ranks by arrival; priority ranks by (priority, arrival), like vLLM's `priority` field. Because the key
holds the arrival time, a preempted request goes back ahead of every later arrival of its priority.

Aging (priority_aging_s > 0): a request gains one priority level per `priority_aging_s` seconds since it
arrived. Comparing `priority - (now - arrival) / aging_s` across requests at the same `now` is the same as
comparing `priority + arrival / aging_s`, so the rank stays a fixed key and the heap stays valid.
"""
from __future__ import annotations

import heapq
import itertools
import math
from typing import Callable, Iterator

from paceline.request import Request

RankKey = tuple


def rank_function(scheduling_policy: str, priority_aging_s: float = 0.0,
                  levels: bool = False, level_aging_s: float = 0.0) -> Callable[[Request], RankKey]:
    """The queue key. `levels` (time slices on): a request's MLFQ level goes between its priority and its
    arrival, so a request demoted by a used slice waits behind fresh work of its priority. Under `fair` this is
    each client's own order; core/fair.py puts the client's counter after the priority.

    Level aging (level_aging_s > 0): a request demoted to level L at time d queues as if it had arrived at
    d + L * level_aging_s, so it waits behind fresh work only for a while, not for as long as fresh work keeps
    coming (strict levels can starve it under sustained load). The key stays fixed (the heap stays valid): level
    0 keys by arrival, a demoted request by that virtual arrival; both are seconds, so they compare."""
    level = _level_key(level_aging_s) if levels else None
    if scheduling_policy == "fcfs":
        if level is not None:
            return lambda r: (level(r), r.arrival_time)
        return lambda r: (r.arrival_time,)
    if scheduling_policy not in ("priority", "fair"):
        raise ValueError(f"unknown scheduling policy {scheduling_policy!r}; choose fcfs, priority or fair")
    if priority_aging_s > 0:
        if level is not None:
            return lambda r: (r.priority + r.arrival_time / priority_aging_s, level(r), r.arrival_time)
        return lambda r: (r.priority + r.arrival_time / priority_aging_s, r.arrival_time)
    if level is not None:
        return lambda r: (r.priority, level(r), r.arrival_time)
    return lambda r: (r.priority, r.arrival_time)


def _level_key(level_aging_s: float) -> Callable[[Request], float]:
    if level_aging_s <= 0:
        return lambda r: r.slice_level
    # slice_since: when the request was demoted (time_slice.py sets it at the demotion; admission resets it)
    return lambda r: r.arrival_time if r.slice_level == 0 else r.slice_since + r.slice_level * level_aging_s


def effective_priority(request: Request, now: float, priority_aging_s: float) -> int:
    """Whole priority levels after aging: what 'outranks' compares, so equals never preempt each other."""
    if priority_aging_s <= 0:
        return request.priority
    return request.priority - math.floor(max(0.0, now - request.arrival_time) / priority_aging_s)


class RequestQueue:
    """A heap with lazy removal: remove() is O(1), pop/peek skip removed entries."""

    def __init__(self, rank: Callable[[Request], RankKey]) -> None:
        self.rank = rank
        self._heap: list[list] = []
        self._entries: dict[str, list] = {}
        self._counter = itertools.count()  # equal keys leave in insertion order

    def __len__(self) -> int:
        return len(self._entries)

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def push(self, request: Request) -> None:
        if request.request_id in self._entries:
            raise ValueError(f"request {request.request_id!r} is already queued")
        entry = [self.rank(request), next(self._counter), request]
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)

    def _drop_removed(self) -> None:
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)

    def peek(self) -> Request | None:
        self._drop_removed()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._drop_removed()
        entry = heapq.heappop(self._heap)
        del self._entries[entry[2].request_id]
        return entry[2]

    def remove(self, request_id: str) -> Request | None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return None
        request, entry[2] = entry[2], None
        return request

    def first(self, n: int) -> list[Request]:
        """The n best-ranked requests, best first, without removing them."""
        if n <= 0:
            return []
        return [e[2] for e in heapq.nsmallest(n + len(self._heap) - len(self._entries), self._heap)
                if e[2] is not None][:n]

    def __iter__(self) -> Iterator[Request]:
        """All queued requests in rank order (O(n log n); for tests and reports)."""
        return iter([e[2] for e in sorted(self._heap) if e[2] is not None])
