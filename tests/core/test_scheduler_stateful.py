"""Hypothesis state machine: random arrivals (lengths, priorities, clients, shared prefixes, salts), steps with
random sampled tokens, random aborts and early finishes, on a pool small enough to force preemption by recompute
and by swap, under every scheduling order (fcfs, priority, fair) with and without time slices. Every step's
output and the block accounting are checked (sched_util); at the end every request not aborted or stopped early
has exactly its requested output, with every sampled token kept as sampled, and the queue drains within a bound
(no starvation)."""
from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sched_util import check_output, check_state, make_scheduler, stall_free_budget

from paceline.core.outputs import StepResult
from paceline.request import Request, RequestStatus
from paceline.sampling import SamplingParams
from paceline.spec_config import SpeculativeConfig

PREFIXES = [list(range(5000, 5040)), list(range(6000, 6040))]


def _toy_step_time(s) -> float:
    """10 ms a step, 1 ms a prompt token, 2 ms a decode, 0.1 ms a query-key pair: chunks shrink with depth."""
    return 0.010 + 0.001 * s.num_prefill_tokens + 0.002 * s.num_decodes + 1e-4 * s.prefill_attn_pairs


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["stall-free", "stall-free", "prefill-first", "orca", "static"]),
                scheduling=st.sampled_from(["fcfs", "priority", "fair"]),
                mode=st.sampled_from(["recompute", "swap", "auto"]),
                block_size=st.sampled_from([2, 4, 4, 8]),
                num_blocks=st.integers(6, 16),
                budget=st.integers(4, 48),
                max_seqs=st.integers(1, 6),
                host_blocks=st.integers(0, 16),
                threshold=st.sampled_from([0, 0, 5]),
                partial=st.sampled_from([0, 0, 1, 2]),
                aging=st.sampled_from([0.0, 0.0, 3.0]),
                wait_ms=st.sampled_from([0.0, 1500.0]),
                step_ms=st.sampled_from([0.0, 0.0, 30.0]),
                spec=st.sampled_from([None, None, (1, 1, True, "ngram"), (3, 2, False, "ngram"), (5, 3, True, "ngram"),
                                      (3, 1, True, "draft_model")]),
                slice_tokens=st.sampled_from([0, 0, 1, 3]),
                slice_ms=st.sampled_from([0.0, 0.0, 2000.0]),
                level_aging=st.sampled_from([0.0, 3.0]),
                short_step=st.booleans(), calm_step=st.booleans(), lone=st.sampled_from([0, 0, 16]))
    def setup(self, policy, scheduling, mode, block_size, num_blocks, budget, max_seqs, host_blocks, threshold,
              partial, aging, wait_ms, step_ms, spec=None, slice_tokens=0, slice_ms=0.0, level_aging=0.0,
              short_step=False, calm_step=False, lone=0) -> None:
        if policy == "static":
            slice_tokens, slice_ms = 0, 0.0
        self.sched = make_scheduler(policy, budget=budget, max_seqs=max_seqs, num_blocks=num_blocks,
                                    block_size=block_size, host_blocks=host_blocks, scheduling_policy=scheduling,
                                    preemption_mode=mode, long_prefill_token_threshold=threshold,
                                    max_num_partial_prefills=partial, priority_aging_s=aging,
                                    max_batch_wait_ms=wait_ms, max_step_ms=step_ms if policy == "stall-free" else 0.0,
                                    step_time=_toy_step_time if step_ms and policy == "stall-free" else None,
                                    speculative=SpeculativeConfig(spec[3], num_speculative_tokens=spec[0], prompt_lookup_max=spec[1],
                                                                  adaptive=spec[2])
                                    if spec else None, time_slice_tokens=slice_tokens, time_slice_ms=slice_ms,
                                    level_aging_s=level_aging,
                                    short_step_ms=step_ms / 2 if short_step and policy == "stall-free" else 0.0,
                                    calm_step_ms=step_ms * 0.7 if calm_step and policy == "stall-free" else 0.0,
                                    lone_prefill_tokens=lone)
        self.capacity = num_blocks * block_size
        self.now = 0.0
        self.count = 0
        self.all: dict[str, Request] = {}
        self.sampled: dict[str, list[int]] = {}  # every token handed to update(), per request
        self.ended_early: set[str] = set()

    @rule(prompt_len=st.integers(1, 30), max_tokens=st.integers(1, 40), priority=st.integers(0, 3),
          prefix=st.sampled_from([None, 0, 1]), salt=st.sampled_from([None, None, "x"]), seed=st.integers(0, 999),
          client=st.sampled_from(["", "a", "b"]))
    def arrive(self, prompt_len, max_tokens, priority, prefix, salt, seed, client="") -> None:
        rng = random.Random(seed)
        prompt = [rng.randrange(100) for _ in range(prompt_len)]
        if prefix is not None:
            prompt = PREFIXES[prefix][:rng.randrange(4, 24)] + prompt
        max_tokens = min(max_tokens, self.capacity - len(prompt))
        if max_tokens < 1:
            return
        self.count += 1
        rid = f"r{self.count}"
        r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=self.now,
                    priority=priority, cache_salt=salt, client_id=client)
        self.sched.add_request(r)
        self.all[rid] = r
        self.sampled[rid] = []

    @rule(seed=st.integers(0, 2**16), steps=st.integers(1, 4))
    def step(self, seed, steps) -> None:
        rng = random.Random(seed)
        for _ in range(steps):
            self.run_step(rng)

    @rule(hold=st.booleans())
    def hold_prompts(self, hold) -> None:
        """Several models' loop holds a streaming model's prompts while another model loads or debuts
        (SchedulerConfig.hold_prompts): steps with decodes then carry no prompt chunk."""
        self.sched.config.hold_prompts = hold

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(pick=st.integers(0, 10**6), how=st.sampled_from(["abort", "stop", None, None, None, None]))
    def end_one(self, pick, how) -> None:
        ids = sorted(self.sched.requests)
        rid = ids[pick % len(ids)]
        if how is None:  # keep ends rare, so that requests live long enough to crowd the pool
            return
        if how == "abort":
            r = self.sched.abort_request(rid, self.now)
            assert r is self.all[rid] and r.finish_reason == "abort"
        else:
            self.sched.finish_request(rid, "stop", self.now)
            assert self.all[rid].finish_reason == "stop"
        assert self.all[rid].status is RequestStatus.FINISHED
        self.ended_early.add(rid)

    def run_step(self, rng: random.Random) -> None:
        self.now += 1.0
        sched = self.sched
        running_before = {r.request_id for r in sched.running}
        out = sched.schedule(self.now)
        check_output(sched, out, running_before)
        assert not (set(out.preempted_ids) | set(out.swapped_out_ids)) & set(out.swapped_in_ids)
        for s in out.scheduled:  # a request resumed this step is not preempted in it
            assert s.request.request_id not in out.preempted_ids
        if sched.config.policy == "stall-free":
            assert out.num_batched_tokens <= stall_free_budget(sched.config, out)
            if sched.config.hold_prompts:  # no prompt chunk joins a step once it holds a decode (a stream readmitted
                # from the waiting queue may still follow a prompt admitted before it: the rule sees the step so far)
                decodes = [s.is_decode for s in out.scheduled]
                first = decodes.index(True) if True in decodes else len(decodes)
                assert all(decodes[first:]), "a prompt chunk joined decodes while held"
        tokens = {s.request.request_id: rng.randrange(100) for s in out.scheduled if s.needs_sample and not s.spec_token_ids}
        # a speculative decode: the target keeps a random prefix of the proposals (often all), then its own token
        verified = {s.request.request_id: s.spec_token_ids[:rng.choice([0, len(s.spec_token_ids), rng.randrange(len(s.spec_token_ids) + 1)])]
                    + [rng.randrange(100)] for s in out.scheduled if s.spec_token_ids}
        before = {rid: self.all[rid].num_output_tokens for rid in verified}
        changed = sched.update(out, StepResult(tokens, verified_token_ids=verified), self.now)
        for rid, tok in tokens.items():
            self.sampled[rid].append(tok)
        for rid, toks in verified.items():  # never cut: proposals stop one short of max_tokens
            self.sampled[rid].extend(toks)
            r = self.all[rid]
            assert r.num_output_tokens == before[rid] + len(toks)
            if r.status is RequestStatus.RUNNING:
                assert r.num_computed_tokens == r.num_tokens - 1, "KV of rejected proposals counted as computed"
        assert [r.request_id for r in changed] == [s.request.request_id for s in out.scheduled
                                                  if s.request.request_id in tokens or s.request.request_id in verified]
        del running_before

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "sched"):
            return
        check_state(self.sched)
        for rid, r in self.all.items():
            assert r.output_token_ids == self.sampled[rid], f"{rid}: tokens lost or changed"
        fair = self.sched.fair
        if fair is not None:  # backlogged clients: exactly those with unfinished requests
            per_client: dict[str, int] = {}
            for r in self.sched.requests.values():
                per_client[r.client_id] = per_client.get(r.client_id, 0) + 1
            assert fair.unfinished == per_client

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        rng = random.Random(0)
        # no starvation: the work left (every token to compute, twice over for recompute, plus what time slices
        # may preempt: each request O(log) times) drains within a bound linear in it
        left = sum(r.num_tokens + r.sampling_params.max_tokens for r in self.sched.requests.values())
        bound = 8 * left + 100
        for _ in range(bound):
            if not self.sched.has_unfinished():
                break
            self.run_step(rng)
            check_state(self.sched)
        assert not self.sched.has_unfinished(), f"requests not finished within {bound} steps"
        for rid, r in self.all.items():
            assert r.status is RequestStatus.FINISHED
            assert r.output_token_ids == self.sampled[rid]
            if rid not in self.ended_early:
                assert r.finish_reason == "length"
                assert r.num_output_tokens == r.sampling_params.max_tokens
        st = self.sched.stats()
        assert st.num_used_blocks == 0 and st.num_running == st.num_waiting == st.num_swapped == 0
        self.sched.schedule(self.now + 1)  # host blocks read by the last swap-ins come back
        assert self.sched.stats().num_used_host_blocks == 0


# CI runs the same 80 examples every time; PACELINE_HYPOTHESIS_EXAMPLES=3000 runs that many fresh random ones
# (about 5 minutes), which is how the two replays below were found
_LONG_RUN = int(os.environ.get("PACELINE_HYPOTHESIS_EXAMPLES", "0"))
SchedulerMachine.TestCase.settings = settings(max_examples=_LONG_RUN or 80, stateful_step_count=60 if _LONG_RUN else 50,
                                              derandomize=not _LONG_RUN, database=None, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestScheduler = SchedulerMachine.TestCase


def test_found_by_a_longer_run_a_resumed_decode_after_a_resumed_chunk() -> None:
    """A longer randomized run found this: under max_step_ms a swapped-out request coming back with one output
    token to compute was sized as a prompt token though the step counts it as a decode, so the step broke its limit."""
    m = SchedulerMachine()
    m.setup(policy="stall-free", scheduling="priority", mode="swap", block_size=4, num_blocks=14, budget=15, max_seqs=5,
            host_blocks=5, threshold=5, partial=0, aging=0.0, wait_ms=0.0, step_ms=30.0)
    for max_tokens, priority, prompt_len in [(7, 0, 4), (5, 0, 11), (1, 1, 21), (6, 0, 9)]:
        m.arrive(max_tokens=max_tokens, prefix=None, priority=priority, prompt_len=prompt_len, salt=None, seed=0)
    m.step(seed=0, steps=1)
    m.step(seed=0, steps=2)
    m.arrive(max_tokens=3, prefix=None, priority=1, prompt_len=1, salt=None, seed=0)
    m.step(seed=0, steps=3)
    m.arrive(max_tokens=1, prefix=None, priority=0, prompt_len=1, salt=None, seed=0)
    m.end_one(how="abort", pick=1)
    m.step(seed=0, steps=1)
    m.teardown()


def test_found_by_a_longer_run_a_readmitted_request_that_looks_like_a_decode() -> None:
    """Recomputed after a preemption with all but its last token in the prefix cache, a re-admitted request has one
    token to compute, like a decode; it is a new admission and may follow the chunks in flight."""
    m = SchedulerMachine()
    m.setup(policy="stall-free", scheduling="fcfs", mode="recompute", block_size=4, num_blocks=11, budget=14, max_seqs=3,
            host_blocks=0, threshold=5, partial=0, aging=0.0, wait_ms=0.0, step_ms=0.0)
    m.arrive(max_tokens=1, prefix=None, priority=0, prompt_len=1, salt=None, seed=0)
    m.end_one(how="abort", pick=0)
    m.step(seed=0, steps=1)
    for max_tokens, prefix, prompt_len, seed in [(1, 0, 5, 0), (1, None, 1, 0), (1, 0, 1, 0), (2, 0, 1, 158)]:
        m.arrive(max_tokens=max_tokens, prefix=prefix, priority=0, prompt_len=prompt_len, salt=None, seed=seed)
    m.step(seed=0, steps=1)
    m.step(seed=0, steps=1)
    m.step(seed=0, steps=3)
    m.teardown()


def test_found_by_a_longer_run_a_static_batch_member_swapped_out_under_fair():
    """A longer randomized run found this: under fair, a swapped-out member of a static batch waited for waiting
    requests that rank first, but static admits only its members, so nothing ran again."""
    m = SchedulerMachine()
    m.setup(policy='static', wait_ms=0.0, mode='swap', slice_ms=0.0, max_seqs=6, num_blocks=14, spec=None, partial=0, slice_tokens=0, block_size=4, budget=36, aging=0.0, threshold=0, step_ms=0.0, scheduling='fair', host_blocks=4)
    m.arrive(client='a', max_tokens=24, prefix=None, priority=0, prompt_len=14, salt=None, seed=128)
    m.arrive(client='', max_tokens=12, prefix=None, priority=0, prompt_len=30, salt=None, seed=963)
    m.end_one(how=None, pick=145872)
    m.arrive(client='b', max_tokens=4, prefix=None, priority=2, prompt_len=24, salt=None, seed=274)
    m.arrive(client='b', max_tokens=39, prefix=0, priority=0, prompt_len=19, salt=None, seed=505)
    m.end_one(how='abort', pick=25)
    m.end_one(how=None, pick=1446)
    m.arrive(client='', max_tokens=15, prefix=None, priority=0, prompt_len=17, salt=None, seed=175)
    m.end_one(how=None, pick=2745)
    m.arrive(client='a', max_tokens=4, prefix=0, priority=1, prompt_len=16, salt='x', seed=722)
    m.arrive(client='b', max_tokens=15, prefix=None, priority=2, prompt_len=19, salt=None, seed=107)
    m.arrive(client='', max_tokens=13, prefix=0, priority=1, prompt_len=17, salt=None, seed=11)
    m.arrive(client='b', max_tokens=15, prefix=None, priority=1, prompt_len=11, salt=None, seed=418)
    m.end_one(how=None, pick=37860)
    m.end_one(how=None, pick=274)
    m.end_one(how='stop', pick=295152)
    m.end_one(how=None, pick=11966)
    m.arrive(client='', max_tokens=8, prefix=None, priority=2, prompt_len=11, salt=None, seed=720)
    m.end_one(how=None, pick=342)
    m.end_one(how='abort', pick=77)
    m.arrive(client='', max_tokens=36, prefix=1, priority=1, prompt_len=23, salt=None, seed=248)
    m.arrive(client='', max_tokens=29, prefix=1, priority=0, prompt_len=28, salt='x', seed=512)
    m.arrive(client='a', max_tokens=4, prefix=None, priority=1, prompt_len=11, salt=None, seed=330)
    m.arrive(client='a', max_tokens=13, prefix=None, priority=2, prompt_len=22, salt=None, seed=38)
    m.end_one(how=None, pick=343)
    m.end_one(how=None, pick=949)
    m.arrive(client='a', max_tokens=6, prefix=None, priority=2, prompt_len=16, salt=None, seed=96)
    m.arrive(client='a', max_tokens=19, prefix=1, priority=3, prompt_len=6, salt=None, seed=699)
    m.arrive(client='a', max_tokens=17, prefix=None, priority=0, prompt_len=10, salt=None, seed=203)
    m.end_one(how='abort', pick=11784)
    m.arrive(client='', max_tokens=25, prefix=0, priority=3, prompt_len=29, salt='x', seed=25)
    m.end_one(how=None, pick=654)
    m.end_one(how=None, pick=917)
    m.arrive(client='a', max_tokens=34, prefix=None, priority=0, prompt_len=15, salt=None, seed=275)
    m.arrive(client='a', max_tokens=20, prefix=1, priority=3, prompt_len=5, salt=None, seed=452)
    m.end_one(how=None, pick=14414)
    m.arrive(client='', max_tokens=24, prefix=1, priority=1, prompt_len=10, salt='x', seed=282)
    m.arrive(client='', max_tokens=19, prefix=None, priority=3, prompt_len=12, salt=None, seed=745)
    m.arrive(client='a', max_tokens=38, prefix=1, priority=3, prompt_len=18, salt='x', seed=154)
    m.end_one(how='stop', pick=107275)
    m.end_one(how=None, pick=159)
    m.arrive(client='b', max_tokens=10, prefix=0, priority=3, prompt_len=12, salt='x', seed=709)
    m.end_one(how=None, pick=16)
    m.end_one(how='abort', pick=1)
    m.teardown()


def test_found_by_a_longer_run_a_swapped_in_decode_after_a_swapped_in_chunk() -> None:
    """A longer randomized run found this (2026-11-24, also on 93b966a): under max_step_ms a swapped-out prompt
    coming back was sized with no decode in the step (only the token budget bounds such a step), then a swapped-out
    request one token from its end came back after it as a decode, and the step broke its limit (90 ms for 30)."""
    m = SchedulerMachine()
    m.setup(policy="stall-free", scheduling="fcfs", mode="auto", block_size=8, num_blocks=11, budget=20, max_seqs=4,
            host_blocks=8, threshold=0, partial=0, aging=0.0, wait_ms=0.0, step_ms=30.0)
    for max_tokens, prefix, prompt_len in [(33, None, 6), (1, 1, 1), (25, 1, 1), (35, 0, 11), (19, None, 13),
                                           (1, 1, 1), (1, 0, 19)]:
        m.arrive(max_tokens=max_tokens, prefix=prefix, priority=0, prompt_len=prompt_len, salt=None, seed=0)
    m.teardown()


# Recompute thrash with a KV cache of a few blocks: long randomized runs (PACELINE_HYPOTHESIS_EXAMPLES=600, about one
# run in three, 2026-11-24) found these; shrunk (by removing rules while the old code still failed) from the
# recorded examples. Before the anchor (Scheduler.anchor) their drains ran 562-1,026 preemptions and hit the step
# bound; now each drains in under 80 steps.

def test_found_by_a_longer_run_fair_evicted_the_request_that_got_furthest() -> None:
    """fair, no slices: a running request's client becomes the more served as it runs, so the victim of the other
    client's growth was always the request that had got furthest, by recompute; two clients traded the cache."""
    m = SchedulerMachine()
    m.setup(policy="stall-free", scheduling="fair", mode="recompute", block_size=2, num_blocks=14, budget=36,
            max_seqs=5, host_blocks=0, threshold=5, partial=0, aging=0.0, wait_ms=0.0, step_ms=0.0, calm_step=True)
    m.arrive(client="", max_tokens=38, prefix=None, priority=0, prompt_len=6, salt=None, seed=498)
    m.arrive(client="a", max_tokens=12, prefix=None, priority=3, prompt_len=3, salt=None, seed=65)
    m.step(seed=19227, steps=1)
    m.step(seed=0, steps=1)
    m.arrive(client="a", max_tokens=13, prefix=None, priority=2, prompt_len=12, salt=None, seed=984)
    m.arrive(client="b", max_tokens=35, prefix=1, priority=2, prompt_len=2, salt=None, seed=0)
    m.step(seed=11955, steps=4)
    m.arrive(client="a", max_tokens=16, prefix=None, priority=2, prompt_len=10, salt=None, seed=0)
    m.arrive(client="b", max_tokens=26, prefix=1, priority=2, prompt_len=12, salt="x", seed=319)
    m.teardown()


def test_found_by_a_longer_run_admissions_took_the_blocks_of_a_request_near_its_end() -> None:
    """fcfs, token slices (prompts mid-prefill run in rank order after the waiting prompts that rank before them):
    four equal-ranked prompts; each step a waiting one was admitted first and took the free blocks, and the running
    one, 3 tokens from its end, found nobody to evict but itself (admissions are not preempted in their step)."""
    m = SchedulerMachine()
    m.setup(policy="stall-free", scheduling="fcfs", mode="recompute", block_size=2, num_blocks=16, budget=22,
            max_seqs=3, host_blocks=0, threshold=5, partial=0, aging=0.0, wait_ms=0.0, step_ms=0.0, slice_tokens=3)
    m.arrive(client="", max_tokens=1, prefix=0, priority=0, prompt_len=1, salt=None, seed=1)
    m.arrive(client="", max_tokens=34, prefix=None, priority=0, prompt_len=12, salt=None, seed=512)
    m.arrive(client="", max_tokens=1, prefix=None, priority=0, prompt_len=21, salt=None, seed=0)
    m.arrive(client="", max_tokens=1, prefix=None, priority=0, prompt_len=21, salt=None, seed=0)
    m.teardown()


def test_found_by_a_longer_run_two_prompts_that_fit_only_one_at_a_time() -> None:
    """fcfs, 1-token slices, 7 blocks of 8: a 42- and a 33-token prompt each fit alone, not together; the waiting
    one, admitted first with its prefix-cache hit, took the running one's blocks every step, and they swapped
    places forever (1,026 preemptions in 1,052 steps)."""
    m = SchedulerMachine()
    m.setup(policy="stall-free", scheduling="fcfs", mode="recompute", block_size=8, num_blocks=7, budget=45,
            max_seqs=5, host_blocks=0, threshold=5, partial=0, aging=0.0, wait_ms=0.0, step_ms=0.0, slice_tokens=1)
    m.arrive(client="", max_tokens=34, prefix=1, priority=0, prompt_len=3, salt=None, seed=0)
    m.arrive(client="", max_tokens=1, prefix=0, priority=0, prompt_len=19, salt=None, seed=0)
    m.arrive(client="", max_tokens=1, prefix=0, priority=0, prompt_len=11, salt="x", seed=0)
    m.teardown()


def test_found_by_a_longer_run_a_stream_readmitted_after_a_held_prompt() -> None:
    """hold_prompts, recompute, 2-token blocks: a stream preempted with its prompt cached is readmitted from the
    waiting queue as a one-token decode after a fresh prompt admitted in the same step; the hold sees the step's
    decodes so far, so that prompt ran (the machine's check: no chunk joins a step after a decode)."""
    m = SchedulerMachine()
    m.setup(policy="stall-free", scheduling="fcfs", mode="recompute", block_size=2, num_blocks=14, budget=4,
            max_seqs=2, host_blocks=0, threshold=0, partial=0, aging=0.0, wait_ms=0.0, step_ms=0.0)
    m.hold_prompts(hold=True)
    m.arrive(client="", max_tokens=2, prefix=None, priority=0, prompt_len=25, salt=None, seed=0)
    m.arrive(client="", max_tokens=2, prefix=None, priority=0, prompt_len=2, salt=None, seed=0)
    m.arrive(client="", max_tokens=1, prefix=None, priority=0, prompt_len=1, salt=None, seed=0)
    m.teardown()
