"""Which data-parallel replica gets a request: round-robin, least outstanding requests, or by prompt prefix.

Prefix routing keeps, per replica, an index of the prompt prefixes it was sent: the prompt's text cut into
`chunk_chars`-character chunks, each chunk keyed by a hash chained over every chunk before it (the engine's own
prefix cache chains its block hashes the same way, so a key stands for the whole start of a prompt, and finding the
longest match costs one dict lookup per chunk, not a scan of past prompts). A prompt goes to the replica holding the
longest chain of its chunks, if that chain covers at least `min_match_fraction` of the prompt's chunks; otherwise it
counts as new and goes to the least busy replica, ties going to the one whose index holds the fewest chunks
(spreading the prefixes, so the replicas' caches together hold more of them), then to the one given the fewest
requests. The share matters where every prompt starts alike (a chat's JSON and a stock "You are a helpful
assistant." fill the first chunk): following any match sent every new conversation to the replica that saw the first
one, one cache for all of them. A matching replica with `max_imbalance` more requests in flight than the least busy
one is passed over: load beats affinity then.

The index mirrors what a replica's prefix cache can still hold, approximately: each replica's is bounded to
`capacity_chunks` and evicted least recently used, tail chunks before the start they extend (as the engine frees a
sequence tail first); a replica marked down forgets its index, since the one Ray Serve restarts begins with an empty
cache. Matching is on text (the ingress has not tokenized yet).
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_outstanding", "prefix")


def prompt_text(body: dict) -> str:
    """What a completion or chat request's prompt starts with, as text."""
    if "messages" in body:
        return json.dumps(body.get("messages"), ensure_ascii=False)
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def prompt_of(body: dict) -> str | list[int]:
    """The prompt to match: its token ids when the request gives one prompt as ids, else its text."""
    prompt = body.get("prompt")
    if "messages" not in body and isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    return prompt_text(body)


def chunk_keys(prompt: str | Sequence[int], chunk: int) -> list[int]:
    """One key per whole chunk of the prompt (characters of a text, or token ids); key k stands for
    prompt[:(k + 1) * chunk] (up to hash collisions, which only cost a misrouted request). Python's str hash is
    salted per process: keys live in the ingress (or the simulation) only."""
    keys: list[int] = []
    parent = 0
    text = isinstance(prompt, str)
    for start in range(0, len(prompt) - chunk + 1, chunk):
        piece = prompt[start:start + chunk]
        parent = hash((parent, piece if text else tuple(piece)))
        keys.append(parent)
    return keys


@dataclass
class Router:
    num_replicas: int
    policy: str = "least_outstanding"
    chunk_chars: int = 64  # the shortest prefix worth following; ~16 tokens of English, one KV block of 16
    chunk_tokens: int = 16  # the same for a prompt given as token ids: one KV block
    max_imbalance: int = 4
    # below this share of the prompt a match is more likely a preamble every prompt shares than this prompt's own
    # history: spreading new prefixes over the caches is worth more. Not higher: a chat's second turn holds its first
    # (a short question) and a long reply, so 0.5 split conversations at turn 2 (SGLang's router has the same knob,
    # --cache-threshold)
    min_match_fraction: float = 0.3
    capacity_chunks: int = 16384  # per replica: ~1M characters, ~250k tokens of prompt
    retry_after_s: float = 5.0  # a failed replica is tried first again after this long (it may have restarted)
    outstanding: list[int] = field(default_factory=list)
    down: dict[int, float] = field(default_factory=dict)  # replica -> when it failed; tried last meanwhile
    index: list[OrderedDict] = field(default_factory=list)  # per replica: chunk key -> None, least recent first
    routed: list[int] = field(default_factory=list)  # per replica: requests it was the first choice for
    _next: int = 0

    def __post_init__(self) -> None:
        self.policy = self.policy.replace("-", "_")  # the simulator's spelling (round-robin) works too
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.chunk_chars < 1 or self.chunk_tokens < 1 or self.capacity_chunks < 1:
            raise ValueError("chunk_chars, chunk_tokens and capacity_chunks must be >= 1")
        if not 0.0 < self.min_match_fraction <= 1.0:
            raise ValueError(f"min_match_fraction must be in (0, 1], got {self.min_match_fraction}")
        self.outstanding = [0] * self.num_replicas
        self.index = [OrderedDict() for _ in range(self.num_replicas)]
        self.routed = [0] * self.num_replicas

    def order(self, body: dict) -> list[int]:
        """Replicas to try for this OpenAI request body, best first (see order_prompt)."""
        return self.order_prompt(prompt_of(body) if self.policy == "prefix" else "")

    def order_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Replicas to try for a request with this prompt (text or token ids), best first: live ones by the policy,
        then the ones marked down. The first choice is taken as the request's replica (`record`). The caller counts
        the request in `outstanding` while the replica works on it."""
        now = time.monotonic()
        for r, since in list(self.down.items()):
            if now - since > self.retry_after_s:
                del self.down[r]
        live = [r for r in range(self.num_replicas) if r not in self.down]
        keys = self.keys(prompt)
        ranked = self.rank(keys, live) + sorted(self.down)
        if ranked:
            self.record(ranked[0], keys)
        return ranked

    def keys(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's chunk keys (none unless the policy is prefix: the others never read them)."""
        if self.policy != "prefix":
            return []
        return chunk_keys(prompt, self.chunk_chars if isinstance(prompt, str) else self.chunk_tokens)

    def rank(self, keys: list[int], live: Sequence[int]) -> list[int]:
        """The `live` replicas best first for a prompt with these chunk keys; changes nothing, so a caller that
        may ask again for the same request (Ray Serve's request router retries when its choice is full) records
        only the replica the request went to."""
        # ties (say, requests sent one at a time) go to the replica given the fewest so far: by index alone every
        # request of a sequential client would land on replica 0
        by_load = sorted(live, key=lambda r: (self.outstanding[r], self.routed[r], r))
        if self.policy == "round_robin":
            start = self._next % self.num_replicas
            return sorted(live, key=lambda r: (r - start) % self.num_replicas)
        if self.policy == "least_outstanding":
            return by_load
        return self._by_prefix(keys, list(live), by_load)

    def record(self, replica: int, keys: list[int]) -> None:
        """The request with these chunk keys went to `replica`: its index learns the prompt."""
        self._next += 1
        self.routed[replica] += 1
        if self.policy == "prefix" and replica not in self.down:  # a down replica comes back with an empty cache
            self._remember(replica, keys)

    def add_replica(self) -> int:
        """A replica that joined (autoscaling): its number, with an empty index and nothing in flight."""
        self.num_replicas += 1
        self.outstanding.append(0)
        self.index.append(OrderedDict())
        self.routed.append(0)
        return self.num_replicas - 1

    def matched_chunks(self, replica: int, keys: list[int]) -> int:
        """How many leading chunks of the prompt the replica's index holds."""
        n = 0
        for key in keys:
            if key not in self.index[replica]:
                break
            n += 1
        return n

    def _by_prefix(self, keys: list[int], live: list[int], by_load: list[int]) -> list[int]:
        if not live:
            return []
        least = self.outstanding[by_load[0]]
        match = {r: self.matched_chunks(r, keys) for r in live}
        enough = max(1.0, self.min_match_fraction * len(keys))
        eligible = [r for r in live if match[r] >= enough and self.outstanding[r] - least <= self.max_imbalance]
        if eligible:
            best = max(eligible, key=lambda r: (match[r], -self.outstanding[r], -len(self.index[r])))
            return [best] + [r for r in by_load if r != best]
        # no replica holds enough of the prompt (or those that do are too busy): it gets a home, preferably the
        # emptier cache
        return sorted(live, key=lambda r: (self.outstanding[r], len(self.index[r]), self.routed[r], r))

    def _remember(self, replica: int, keys: list[int]) -> None:
        index = self.index[replica]
        for key in reversed(keys):  # the start most recent: the tail goes first, as the engine evicts
            index[key] = None
            index.move_to_end(key)
        while len(index) > self.capacity_chunks:
            index.popitem(last=False)

    def mark_down(self, replica: int) -> None:
        self.down[replica] = time.monotonic()
        self.index[replica].clear()  # Ray Serve restarts it with an empty prefix cache

    def mark_up(self, replica: int) -> None:
        self.down.pop(replica, None)


TOPICS = ["cooking", "chess", "tax law", "gardening", "astronomy", "poetry", "sailing", "databases", "music", "geology",
          "knitting", "cycling"]


def _desk_prompt(desk: int, question: int) -> str:
    """Desk `desk`'s long system prompt (the shared prefix), then question `question`."""
    return (f"You are an assistant who knows {TOPICS[desk % len(TOPICS)]} (desk {desk}) well and answers briefly. " * 8
            + f"Question {question}: name one fact.")


def shared_prefix_workload(groups: int, per_group: int, seed: int = 0) -> list[str]:
    """`groups` long system prompts, `per_group` questions under each, in a shuffled order."""
    import random

    prompts = [_desk_prompt(g, j) for g in range(groups) for j in range(per_group)]
    random.Random(seed).shuffle(prompts)
    return prompts


def agent_rounds(agents: int, rounds: int, seed: int = 0) -> list[str]:
    """`agents` long system prompts (the same text as shared_prefix_workload's) taking turns: every round each
    agent sends one request, in an order shuffled afresh each round. Multi-agent loops, an evaluation pass that runs
    every example under each of several prompt templates, or periodic jobs have this shape: each prefix comes back
    only after most of the others have. That is the order a least-recently-used cache handles worst (a fixed order
    of more prefixes than fit is never hit at all), while in a uniformly random order LRU keeps its share of them."""
    import random

    rng = random.Random(seed)
    out = []
    for r in range(rounds):
        order = list(range(agents))
        rng.shuffle(order)
        out += [_desk_prompt(g, r) for g in order]
    return out


def common_preamble_chats(groups: int, per_group: int, seed: int = 0) -> list[list[dict]]:
    """Chat requests that all begin alike (the stock system prompt) and then share a document by group:
    `groups` documents, `per_group` questions on each, in a shuffled order."""
    import random

    chats = [[{"role": "system", "content": "You are a helpful assistant."},
              {"role": "user", "content": f"My notes on {TOPICS[g % len(TOPICS)]} (file {g}), keep them in mind. " * 7
               + f"Question {j}: name one fact."}] for g in range(groups) for j in range(per_group)]
    random.Random(seed).shuffle(chats)
    return chats


WORDS = ("the", "a", "river", "question", "table", "light", "small", "because", "over", "number", "engine", "green",
         "garden", "history", "window", "quickly", "paper", "market", "under", "simple", "winter", "cable", "story",
         "north", "careful", "bridge", "signal", "between", "orange", "music", "letter", "station", "bright", "plan")


def _words(rng, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def multi_turn_chats(conversations: int, turns: int, seed: int = 0) -> list[tuple[int, list[dict]]]:
    """(conversation, messages) for every turn of `conversations` chats of `turns` turns: each request carries the
    whole conversation so far (the stock system prompt, then alternating user and assistant messages), so turn k+1's
    prompt starts with all of turn k's. The turns of different chats interleave in a shuffled order (users come and
    go independently), each chat's own turns in order. The text of a chat does not depend on the seed, only the
    order does. The assistant messages are fixed text standing in for the replies (a user message ~20-45 words,
    a reply ~50-90: replies run longer than questions)."""
    import random

    chats = []
    for c in range(conversations):
        rng = random.Random(1_000_003 * c + 17)
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        turns_of_c = []
        for k in range(turns):
            messages = messages + [{"role": "user", "content": f"Chat {c}, turn {k}: {_words(rng, 20, 45)}?"}]
            turns_of_c.append(messages)
            messages = messages + [{"role": "assistant", "content": _words(rng, 50, 90) + "."}]
        chats.append(turns_of_c)
    order = [c for c in range(conversations) for _ in range(turns)]
    random.Random(seed).shuffle(order)
    next_turn = [0] * conversations
    out = []
    for c in order:
        out.append((c, chats[c][next_turn[c]]))
        next_turn[c] += 1
    return out
