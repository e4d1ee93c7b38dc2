"""Fair share between clients (`--scheduling-policy fair`): a virtual token counter per client, in the manner of
VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024), driving admission and preemption.

- A client's counter grows by the tokens its requests actually ran, step by step: a prompt-chunk token (or a
  token recomputed after a preemption) weighs 1, a decode 2 (an output token costs more than an input token).
- A client that becomes backlogged (its first unfinished request arrives) is lifted to the lowest counter of
  the clients already backlogged (with nobody backlogged, to the highest counter) less the weighted prompt of
  the request that brings it back, so idling banks no credit beyond that one prompt. Why the prompt: under
  strict VTC a client that returns with a burst is the more served as soon as its first prompt has run (a prompt
  is charged in a step or two, a backlogged client's decodes 2 a token), and the rest of the burst waits for the
  others to catch up. On two-tenants (simulated at this machine's speed, 300 s) that put the light client's p99
  TTFT at 1.125 s, every slow one the 3rd-5th request of a burst; with the credit 0.758 s, at the same Jain's
  index (1.000) and throughput (benchmarks/summaries/fairness.md). A client gains it only by going idle, so
  it cannot bank more than one prompt; the counters' bound grows by at most one prompt.
- The waiting and swapped queues hand out the least-served client's best request (`FairQueue`); a victim of
  preemption is the most-served client's worst request (the scheduler's rank does that, see `fair_rank`).
- Priorities come first: fairness orders requests within one priority level.
"""
from __future__ import annotations

from typing import Callable, Iterator

from paceline.core.outputs import SchedulerOutput
from paceline.core.queues import RankKey, RequestQueue
from paceline.request import Request

INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class FairShare:
    """The counters, and which clients are backlogged (hold an unfinished request)."""

    def __init__(self, input_weight: float = INPUT_WEIGHT, output_weight: float = OUTPUT_WEIGHT) -> None:
        self.input_weight, self.output_weight = input_weight, output_weight
        self.counters: dict[str, float] = {}
        self.unfinished: dict[str, int] = {}  # backlogged clients only: unfinished requests per client

    def counter(self, client: str) -> float:
        return self.counters.get(client, 0.0)

    def arrive(self, client: str, prompt_tokens: int = 0) -> None:
        """A request of `client` arrived; prompt_tokens: its prompt, the credit a client returning from idle keeps."""
        n = self.unfinished.get(client, 0)
        if n == 0:
            backlogged = [self.counters.get(c, 0.0) for c in self.unfinished]
            floor = min(backlogged) if backlogged else max(self.counters.values(), default=0.0)
            self.counters[client] = max(self.counters.get(client, 0.0), floor - self.input_weight * prompt_tokens)
        self.unfinished[client] = n + 1

    def leave(self, client: str) -> None:
        n = self.unfinished.get(client, 0) - 1
        if n > 0:
            self.unfinished[client] = n
            return
        self.unfinished.pop(client, None)
        # an idle client's counter matters only if it is above where a return would lift it: forget the rest, so
        # a server seeing many one-off users keeps no counter per user
        if self.unfinished and self.counters.get(client, 0.0) <= min(self.counters.get(c, 0.0) for c in self.unfinished):
            self.counters.pop(client, None)

    def charge(self, output: SchedulerOutput) -> None:
        """Charge each client the tokens its requests ran in this step (call before update() changes them)."""
        counters = self.counters
        for s in output.scheduled:
            client = s.request.client_id
            weight = self.output_weight if s.is_decode else self.input_weight
            counters[client] = counters.get(client, 0.0) + weight * s.num_tokens


def fair_rank(fair: FairShare, client_rank: Callable[[Request], RankKey]) -> Callable[[Request], RankKey]:
    """(priority, counter, rest of the client's own rank): smaller runs first, the largest is the victim."""
    counters = fair.counters

    def rank(r: Request) -> RankKey:
        k = client_rank(r)
        return (k[0], counters.get(r.client_id, 0.0), *k[1:])
    return rank


class FairQueue:
    """The RequestQueue interface over one queue per client: the head is the best request of the client whose own
    head ranks best, with the counter between priority and the rest (so the least-served client goes first)."""

    def __init__(self, fair: FairShare, client_rank: Callable[[Request], RankKey]) -> None:
        self.fair = fair
        self.client_rank = client_rank
        self.rank = fair_rank(fair, client_rank)
        self._queues: dict[str, RequestQueue] = {}
        self._client_of: dict[str, str] = {}  # request id -> client

    def __len__(self) -> int:
        return len(self._client_of)

    def __bool__(self) -> bool:
        return bool(self._client_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._client_of

    def push(self, request: Request) -> None:
        rid = request.request_id
        if rid in self._client_of:
            raise ValueError(f"request {rid!r} is already queued")
        q = self._queues.get(request.client_id)
        if q is None:
            q = self._queues[request.client_id] = RequestQueue(self.client_rank)
        q.push(request)
        self._client_of[rid] = request.client_id

    def _best(self) -> RequestQueue | None:
        best, best_key = None, None
        for q in self._queues.values():
            head = q.peek()
            key = self.rank(head)
            if best is None or key < best_key:
                best, best_key = q, key
        return best

    def peek(self) -> Request | None:
        q = self._best()
        return q.peek() if q is not None else None

    def pop(self) -> Request:
        q = self._best()
        if q is None:
            raise IndexError("pop from an empty queue")
        request = q.pop()
        self._forget(request)
        return request

    def remove(self, request_id: str) -> Request | None:
        client = self._client_of.get(request_id)
        if client is None:
            return None
        request = self._queues[client].remove(request_id)
        self._forget(request)
        return request

    def _forget(self, request: Request) -> None:
        del self._client_of[request.request_id]
        q = self._queues[request.client_id]
        if not q:
            del self._queues[request.client_id]

    def first(self, n: int) -> list[Request]:
        return list(self)[:max(n, 0)]

    def __iter__(self) -> Iterator[Request]:
        """Every queued request in the order the queue would hand them out if no counter moved."""
        return iter(sorted((r for q in self._queues.values() for r in q), key=self.rank))
