"""Which data-parallel replica gets a request: round-robin, least outstanding requests, or by prompt prefix.

Prefix routing sends a prompt to the replica that most recently saw the longest common start of it (at least
`min_match_chars` characters), so that replica's prefix cache already holds the shared blocks; with no such match
it goes to the least busy replica (ties: the one given the fewest requests so far), which then becomes the home of
that prefix. A matching replica that has
`max_imbalance` more requests in flight than the least busy one is passed over: load beats affinity then. Matching
is on text (the ingress has not tokenized yet), over the last `history` prompts each replica took.
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_outstanding", "prefix")


def prompt_text(body: dict) -> str:
    """What a completion or chat request's prompt starts with, as text."""
    if "messages" in body:
        return json.dumps(body.get("messages"), ensure_ascii=False)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


@dataclass
class Router:
    num_replicas: int
    policy: str = "least_outstanding"
    min_match_chars: int = 64
    max_imbalance: int = 4
    history: int = 512
    retry_after_s: float = 5.0  # a failed replica is tried first again after this long (it may have restarted)
    outstanding: list[int] = field(default_factory=list)
    down: dict[int, float] = field(default_factory=dict)  # replica -> when it failed; tried last meanwhile
    seen: list[deque] = field(default_factory=list)  # per replica: the prompts it took lately
    routed: list[int] = field(default_factory=list)  # per replica: requests it was the first choice for
    _next: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        self.outstanding = [0] * self.num_replicas
        self.seen = [deque(maxlen=self.history) for _ in range(self.num_replicas)]
        self.routed = [0] * self.num_replicas

    def order(self, body: dict) -> list[int]:
        """Replicas to try for this request, best first: live ones by the policy, then the ones marked down.
        Under the prefix policy the first choice remembers the prompt."""
        now = time.monotonic()
        for r, since in list(self.down.items()):
            if now - since > self.retry_after_s:
                del self.down[r]
        live = [r for r in range(self.num_replicas) if r not in self.down]
        # ties (say, requests sent one at a time) go to the replica that was given the fewest so far: by index alone
        # every request of a sequential client would land on replica 0
        by_load = sorted(live, key=lambda r: (self.outstanding[r], self.routed[r], r))
        if self.policy == "round_robin":
            start = self._next % self.num_replicas
            self._next += 1
            ranked = sorted(live, key=lambda r: (r - start) % self.num_replicas)
        elif self.policy == "least_outstanding":
            ranked = by_load
        else:
            text = prompt_text(body)
            match = {r: max((len(os.path.commonprefix([text, p])) for p in self.seen[r]), default=0) for r in live}
            best = max(live, key=lambda r: (match[r], -self.outstanding[r]), default=None)
            ranked = by_load
            if (best is not None and match[best] >= self.min_match_chars
                    and self.outstanding[best] - self.outstanding[by_load[0]] <= self.max_imbalance):
                ranked = [best] + [r for r in by_load if r != best]
            if ranked:
                self.seen[ranked[0]].append(text)
        ranked = ranked + sorted(self.down)
        if ranked:
            self.routed[ranked[0]] += 1
        return ranked

    def mark_down(self, replica: int) -> None:
        self.down[replica] = time.monotonic()

    def mark_up(self, replica: int) -> None:
        self.down.pop(replica, None)


def shared_prefix_workload(groups: int, per_group: int, seed: int = 0) -> list[str]:
    """`groups` long system prompts, `per_group` questions under each, in a shuffled order."""
    import random

    topics = ["cooking", "chess", "tax law", "gardening", "astronomy", "poetry", "sailing", "databases", "music",
              "geology", "knitting", "cycling"]
    prompts = [f"You are an assistant who knows {topics[g % len(topics)]} (desk {g}) well and answers briefly. " * 8
               + f"Question {j}: name one fact." for g in range(groups) for j in range(per_group)]
    random.Random(seed).shuffle(prompts)
    return prompts
