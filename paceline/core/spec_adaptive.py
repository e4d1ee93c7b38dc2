"""How many proposed tokens each decode verifies this step: adaptive speculation.

Each request keeps a running acceptance rate a (the chance that a proposal is accepted given that the ones before it
were). Under that geometric model the j-th proposal of a request adds a^j expected tokens. Adding it makes the step
longer by what the step-time model says one more verified row costs. A step yields about N tokens (one per request in
it, plus what the proposals so far are expected to add) in T seconds; a proposal is worth verifying when it raises
that rate: a^j / dT >= N / T. Proposals are considered best first, so a step picks, per request, k from 0 (plain
decoding) to num_speculative_tokens. One stream with a cheap verify row speculates even at modest acceptance; many
decodes in a step (large N / T) need acceptance near 1, so under load speculation fades to plain decoding by itself.
The step-time limit (max_step_ms), the token budget and free blocks stay hard limits.

The acceptance rate is learnt from what is verified and, for the n-gram proposer whose proposals cost nothing, also
from "shadow" proposals that are made but not verified: the tokens the request then generates tell whether they
would have been accepted. So a request that stopped speculating notices when its output starts copying again.
Counts decay, so the rate follows the latest part of the output (a copy that ends, a quotation that starts).

Pure Python: core never imports torch.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Callable

from paceline.core.batch_shape import BatchShape
from paceline.core.spec_ngram import propose_ngram
from paceline.spec_config import SpeculativeConfig

DRAFT_SLOT = -1  # a proposal the runner's draft model fills in during the step (method draft_model)
# A request's rate starts at the pooled rate of all requests, worth two observed positions. The pool starts where a
# method usually is: n-gram proposals are often wrong outside a copy (its shadows correct a request within a few
# steps), a draft model is picked because it agrees with the target (and has no free shadows to learn from).
PRIOR_WEIGHT = 2.0
POOL_START = {"ngram": 0.5, "draft_model": 0.9}
POOL_DECAY = 0.99  # per observation: the pool follows the traffic over a few hundred proposals
DECAY = 0.75  # per step: the counts of ~2.5 steps back weigh half; an unobserved request drifts back to the prior


def nominal_step_time(s: BatchShape) -> float:
    """Step time for a scheduler without a profile (unit tests, a scheduler used alone): the float32 shape of the
    bundled model on this 2-core VM (benchmarks/spec_cost.py, 2026-11-23): ~46 ms a step, ~5 ms a decode, ~3 ms a
    verified or prompt token at short context. Only the ratios matter to the speculation decision."""
    return 0.046 + 0.005 * s.num_requests + 0.003 * s.num_prefill_tokens + 1e-6 * s.prefill_attn_pairs


@dataclass
class Acceptance:
    """Decayed counts of proposal positions tried and accepted, with a prior."""
    accepted: float = 0.0
    tried: float = 0.0

    def rate(self, prior: float) -> float:
        return (self.accepted + PRIOR_WEIGHT * prior) / (self.tried + PRIOR_WEIGHT)

    def decay(self, factor: float = DECAY) -> None:
        self.accepted *= factor
        self.tried *= factor

    def observe(self, num_accepted: int, num_proposed: int) -> None:
        # positions tried: each accepted one, and the first rejected one if any (later ones were never reached)
        self.accepted += num_accepted
        self.tried += min(num_accepted + 1, num_proposed)


@dataclass
class Candidate:
    index: int  # in the step's schedule order
    scheduled: object  # ScheduledRequest
    drafts: list[int]
    rate: float
    taken: int = 0


@dataclass
class Speculator:
    """Proposes, picks k per request per step, and learns acceptance. The scheduler owns one when speculation is on.

    draft_cost: seconds one draft-model step of one request adds, as a fraction of a decode step (method
    draft_model; 0 for n-gram, whose lookup costs nothing next to a forward pass)."""
    config: SpeculativeConfig
    step_time: Callable[[BatchShape], float] | None = None
    draft_cost: float = 0.0
    propose_fn: Callable[[list[int], int], list[int]] | None = None  # the simulator's stand-in proposer
    rates: dict[str, Acceptance] = field(default_factory=dict)
    pool: Acceptance = field(default_factory=Acceptance)  # every request's observations
    shadows: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # rid -> (position, proposals)

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        if self.propose_fn is not None:
            return self.propose_fn(token_ids, k)
        if self.config.method == "draft_model":
            return [DRAFT_SLOT] * k
        return propose_ngram(token_ids, k, self.config.prompt_lookup_max, self.config.prompt_lookup_min)

    def rate(self, rid: str) -> float:
        prior = self.pool.rate(POOL_START[self.config.method])
        return self.rates[rid].rate(prior) if rid in self.rates else prior

    def _observe(self, acc: Acceptance, num_accepted: int, num_proposed: int) -> None:
        acc.observe(num_accepted, num_proposed)
        self.pool.decay(POOL_DECAY)
        self.pool.observe(num_accepted, num_proposed)

    def plan(self, candidates: list[Candidate], shape: BatchShape, num_in_step: int, budget: int,
             limit_s: float | None) -> None:
        """Set each candidate's `taken`: how many of its drafts to verify. shape: the step so far (the policy's
        batch); num_in_step: requests in it; limit_s: the step-time limit (None: none)."""
        cost = self.step_time or nominal_step_time
        adaptive = self.config.adaptive
        t = cost(shape)
        gain = float(num_in_step)
        depth = 0  # draft-model steps needed so far: the deepest proposal taken
        one_decode = cost(BatchShape(num_decodes=1, num_requests=1, num_sampled=1)) if self.draft_cost else 0.0
        # best first: a fixed k (not adaptive) takes every proposal in schedule order
        heap = [(-(c.rate if adaptive else 1.0), c.index, c) for c in candidates if c.drafts]
        heapq.heapify(heap)
        while heap and budget > 0:
            neg_value, _, c = heapq.heappop(heap)
            trial = replace(shape)
            add_verified_token(trial, c.scheduled.start, c.taken)
            t_new = cost(trial)
            if self.draft_cost:  # a new draft step for the whole batch, or one more row in an existing one
                t_new += self.draft_cost * one_decode * (1.0 if c.taken + 1 > depth else 0.25)
            if limit_s is not None and t_new > limit_s:
                continue
            value = -neg_value
            if adaptive and value * t < gain * (t_new - t):
                continue  # later proposals of this request are worth less and cost as much: drop it
            shape, t, gain = trial, t_new, gain + value
            c.taken += 1
            depth = max(depth, c.taken)
            budget -= 1
            if c.taken < len(c.drafts):
                heapq.heappush(heap, (neg_value * (c.rate if adaptive else 1.0), c.index, c))

    def remember_shadow(self, rid: str, position: int, drafts: list[int]) -> None:
        """Proposals made but not verified: judged later against the tokens the request generates (n-gram only:
        a draft model's proposals are not free to make)."""
        if drafts and drafts[0] != DRAFT_SLOT and rid not in self.shadows:
            self.shadows[rid] = (position, list(drafts))

    def observe(self, scheduled: list, requests: dict) -> None:
        """After update(): learn from each verified decode (its proposals against the tokens kept) and from the
        shadow proposals whose tokens have arrived. scheduled: the step's ScheduledRequests; requests: the
        scheduler's unfinished ones (anything else is forgotten)."""
        for s in scheduled:
            r = s.request
            rid = r.request_id
            if rid not in requests:
                self.rates.pop(rid, None)
                self.shadows.pop(rid, None)
                continue
            acc = self.rates.get(rid)
            if acc is None:
                acc = self.rates[rid] = Acceptance()
            if not s.is_decode and not s.spec_token_ids:
                continue
            acc.decay()
            if s.spec_token_ids:
                first = s.start + s.num_known_tokens
                self._observe(acc, _common_prefix(s.spec_token_ids, r.token_ids[first:]), len(s.spec_token_ids))
            shadow = self.shadows.get(rid)
            if shadow is not None:
                position, drafts = shadow
                arrived = r.token_ids[position:position + len(drafts)]
                m = _common_prefix(drafts, arrived)
                if m < len(arrived) or len(arrived) == len(drafts):  # a mismatch seen, or all of them arrived
                    self._observe(acc, m, len(drafts))
                    del self.shadows[rid]
        if len(self.rates) > 2 * len(requests) + 64:  # aborted requests never come back through a step
            for rid in [rid for rid in self.rates if rid not in requests]:
                self.rates.pop(rid)
                self.shadows.pop(rid, None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def add_verified_token(shape: BatchShape, start: int, num_drafts: int) -> None:
    """Count one more proposal for the decode at `start` that already carries num_drafts: the first turns the decode
    into a verification (k + 1 query tokens of one request over its context, as the runner runs it: a causal chunk,
    every position reaching the LM head); each further one adds a query token and a sampled row."""
    if num_drafts == 0:
        shape.num_decodes -= 1
        shape.num_requests -= 1
        shape.num_sampled -= 1
        shape.decode_context -= start + 1
        shape.add_chunk(start, 2, sampled=True)
        shape.num_sampled += 1
        return
    c = num_drafts + 1  # the chunk's length before this token
    shape.num_prefill_tokens += 1
    shape.prefill_attn_pairs += start + c + 1
    shape.prefill_kv_tokens += 1
    shape.num_sampled += 1


def decode_to_verify(shape: BatchShape, start: int, k: int) -> None:
    """Recount a decode at `start` as the verification of k proposals."""
    for j in range(k):
        add_verified_token(shape, start, j)
