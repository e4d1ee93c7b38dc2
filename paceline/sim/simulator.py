"""Discrete-event simulation: the real Scheduler per replica, steps that last what the cost model says.

With pipeline parallelism (a roofline cost model with pp > 1) a replica runs `pipeline_microbatches` virtual
engines, as vLLM does: each its own scheduler and share of the KV blocks, so while one micro-batch is in stage 2
the next one's step can start in stage 1. A virtual engine starts a step only when stage 1 is free; each stage
takes the micro-batch when it is done with the one before (`_Pipeline`). The bubble fraction is the stages' idle
share of the time steps were in flight. With one micro-batch the stages run one after another, as a single
engine under PP does.

Events live in one heap keyed (time, kind, seq): at equal times step completions come before arrivals,
and within a kind the order they were pushed, so a run is deterministic. After all events of one instant
are applied, every idle replica with work starts its next step at that instant; an arrival therefore joins
a step that starts at its own arrival time.
"""
from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from paceline.bench.metrics import RequestRecord
from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.batch_shape import BatchShape, batch_shape
from paceline.core.outputs import SchedulerOutput, StepResult
from paceline.core.scheduler import Scheduler
from paceline.request import Request
from paceline.sampling import SamplingParams
from paceline.sim.router import Router
from paceline.sim.workloads import SimRequest
from paceline.spec_config import SpeculativeConfig

STEP_DONE, ARRIVAL, POLL = 0, 1, 2  # tie order at one instant
SHARED_PREFIX_TOKEN = 7


class CostModel(Protocol):
    def step_time(self, s: BatchShape) -> float: ...


@dataclass
class StepRecord:
    replica: int
    start: float
    duration: float
    num_decode_tokens: int
    num_prefill_tokens: int
    num_requests: int
    # the scheduler's state once the step is chosen, as the server's step log records it (the static report)
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_used_blocks: int = 0
    num_free_blocks: int = 0
    num_preempted: int = 0  # preemptions this step's choice made


REJECTED = "rejected: longer than the context or the KV cache"


@dataclass
class SimResult:
    requests: list[RequestRecord]  # the records a benchmark client would have taken, in arrival order
    steps: list[StepRecord]
    wall_s: float  # real seconds the simulation took
    num_replicas: int
    bubble_fraction: float | None = None  # pipeline parallel: idle share of stage-time while steps were in flight
    preemptions: dict[str, float] = field(default_factory=dict)  # the schedulers' counts, as /metrics names them
    prefix_cache_queries: int = 0  # prompt tokens looked up in the replicas' prefix caches at admission
    prefix_cache_hits: int = 0  # of those, tokens found

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def finished(self) -> list[RequestRecord]:
        return [r for r in self.requests if r.ok]

    @property
    def makespan(self) -> float:
        ends = [r.end_s for r in self.requests if r.end_s is not None]
        return max(ends) - min(r.sent_s for r in self.requests) if ends else 0.0


@dataclass
class _Replica:
    index: int
    scheduler: Scheduler
    busy: bool = False
    in_flight: SchedulerOutput | None = None
    in_flight_duration: float = 0.0
    poll_pending: bool = False
    preemptions_seen: int = 0
    physical: int = 0  # the replica (router's index) this virtual engine belongs to
    pipeline: _Pipeline | None = None  # the stages it shares with its replica's other virtual engines


@dataclass
class _Pipeline:
    """One replica's pipeline stages: when each is next free, how long they computed, when work began and ended."""
    stage_free: list[float]
    busy_s: float = 0.0
    first_start: float | None = None
    last_end: float = 0.0

    def run(self, now: float, stage_times: list[float]) -> float:
        """A micro-batch entering stage 1 at `now`; returns when it leaves the last stage."""
        t = now
        for k, st in enumerate(stage_times):
            t = max(t, self.stage_free[k]) + st
            self.stage_free[k] = t
        self.busy_s += sum(stage_times)
        self.first_start = now if self.first_start is None else self.first_start
        self.last_end = max(self.last_end, t)
        return t


class Simulator:
    def __init__(self, cost_model: CostModel, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, num_host_blocks: int = 0, num_replicas: int = 1, router: str = "round-robin",
                 scheduler_factory: Callable[..., Scheduler] = Scheduler, pipeline_microbatches: int = 1,
                 speculative: SpeculativeConfig | None = None, seed: int = 0,
                 router_options: dict | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        stages = getattr(cost_model, "pp", 1)
        if pipeline_microbatches < 1 or (pipeline_microbatches > 1 and not hasattr(cost_model, "stage_times")):
            raise ValueError(f"pipeline_microbatches must be >= 1 and > 1 only with a per-stage cost model, got "
                             f"{pipeline_microbatches}")
        if num_blocks // pipeline_microbatches < 1:
            raise ValueError(f"{num_blocks} KV blocks cannot be shared by {pipeline_microbatches} micro-batches")
        self.pipeline_microbatches = pipeline_microbatches
        # the virtual engines of one replica share its KV memory
        num_blocks, num_host_blocks = num_blocks // pipeline_microbatches, num_host_blocks // pipeline_microbatches
        self.cost_model = cost_model
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.num_blocks = num_blocks
        # router_options: the prefix router's settings (min_match_fraction, ...), as the Ray Serve ingress takes them
        self.router = Router(router, num_replicas, **(router_options or {}))
        self.router_size = num_replicas
        # under max_step_ms the scheduler predicts with the very model that times the simulated steps
        step_time = cost_model.step_time if scheduler_config.max_step_ms > 0 else None
        spec_kw = {"speculative": speculative} if speculative is not None else {}
        self.replicas = []
        for r in range(num_replicas):
            pipe = _Pipeline([0.0] * stages) if stages > 1 else None
            for _ in range(pipeline_microbatches):
                self.replicas.append(_Replica(len(self.replicas), scheduler_factory(
                    scheduler_config, cache_config, num_blocks, num_host_blocks, step_time=step_time, **spec_kw),
                    physical=r, pipeline=pipe))
        # Speculation: a request's tokens are 0 with its workload's acceptance a, else 1, independently, and the
        # proposer always proposes 0s; so a proposal is accepted with chance a per position (the geometric model
        # adaptive k assumes) and the cost model charges every verified row (batch_shape counts them)
        self.speculative = speculative
        self.rng = random.Random(seed)
        self.acceptance: dict[str, float] = {}
        if speculative is not None:
            for rep in self.replicas:
                rep.scheduler.speculator.step_time = cost_model.step_time
                rep.scheduler.speculator.propose_fn = lambda tokens, k: [0] * k
        # a request longer than the context or the whole cache could never finish: rejected, as the engine does
        self.max_request_tokens = min(scheduler_config.max_model_len, num_blocks * cache_config.block_size)
        self.event_log: list[tuple[float, int, str]] | None = None  # (time, kind, id), when a test asks for it

    def run(self, workload: list[SimRequest], shared_prefix_tokens: int = 0,
            in_flight_caps: dict[str, int] | None = None) -> SimResult:
        """in_flight_caps: client -> most requests in flight, as the benchmark client keeps them: a capped
        client's request arrives when one of its own finishes if it must, and not at all after the last arrival."""
        t_wall = time.perf_counter()
        caps = in_flight_caps or {}
        window_end = max((r.arrival for r in workload), default=0.0)
        in_flight: dict[str, int] = {}
        held: dict[str, list[SimRequest]] = {c: [] for c in caps}  # arrived, waiting for a slot, in arrival order
        heap: list[tuple[float, int, int, object]] = []
        seq = 0
        for r in workload:
            heap.append((r.arrival, ARRIVAL, seq, r))
            seq += 1
        heapq.heapify(heap)
        records: list[RequestRecord] = []
        by_id: dict[str, RequestRecord] = {}
        steps: list[StepRecord] = []
        log = self.event_log
        cost = self.cost_model.step_time

        while heap:
            now = heap[0][0]
            while heap and heap[0][0] == now:
                _, kind, _, payload = heapq.heappop(heap)
                if kind == ARRIVAL:
                    client = payload.client
                    if client in caps and payload.arrival == now and in_flight.get(client, 0) >= caps[client]:
                        held[client].append(payload)  # the client waits for one of its own to finish
                        continue
                    rec = self._arrive(payload, shared_prefix_tokens, now)
                    records.append(rec)
                    if rec.error is None:
                        by_id[str(rec.index)] = rec
                        in_flight[client] = in_flight.get(client, 0) + 1
                    if log is not None:
                        log.append((now, kind, str(rec.index)))
                elif kind == STEP_DONE:
                    rep = self.replicas[payload]
                    for client in self._complete(rep, now, by_id):
                        in_flight[client] -= 1
                        if held.get(client) and now <= window_end:  # its next request goes out now
                            r = held[client].pop(0)
                            heapq.heappush(heap, (now, ARRIVAL, seq, r))
                            seq += 1
                    if log is not None:
                        log.append((now, kind, f"replica{rep.index}"))
                else:
                    self.replicas[payload].poll_pending = False
            for rep in self.replicas:
                if rep.busy or not rep.scheduler.has_unfinished():
                    continue
                pipe = rep.pipeline
                if pipe is not None and pipe.stage_free[0] > now:  # stage 1 still busy with another micro-batch
                    if not rep.poll_pending:
                        rep.poll_pending = True
                        heapq.heappush(heap, (pipe.stage_free[0], POLL, seq, rep.index))
                        seq += 1
                    continue
                out = rep.scheduler.schedule(now)
                if out.is_empty:
                    self._idle_with_work(rep, now, heap, seq)
                    seq += 1
                    continue
                shape = batch_shape(out)
                d = pipe.run(now, self.cost_model.stage_times(shape)) - now if pipe is not None else cost(shape)
                rep.busy, rep.in_flight, rep.in_flight_duration = True, out, d
                sched = rep.scheduler
                pool = sched.kv.pool
                preempted = sched.num_preemptions - rep.preemptions_seen
                rep.preemptions_seen = sched.num_preemptions
                steps.append(StepRecord(rep.physical, now, d, shape.num_decodes, shape.num_prefill_tokens, shape.num_requests,
                                        len(sched.running), len(sched.waiting), len(sched.swapped), pool.num_used,
                                        pool.num_free, preempted))
                heapq.heappush(heap, (now + d, STEP_DONE, seq, rep.index))
                seq += 1
        stuck = [rep.index for rep in self.replicas if rep.scheduler.has_unfinished()]
        if stuck:
            raise RuntimeError(f"replicas {stuck} hold unfinished requests that the scheduler will not run")
        pipes = list({id(r.pipeline): r.pipeline for r in self.replicas if r.pipeline is not None}.values())
        stage_span = sum(len(p.stage_free) * (p.last_end - p.first_start) for p in pipes if p.first_start is not None)
        bubble = 1 - sum(p.busy_s for p in pipes) / stage_span if stage_span > 0 else None
        stats = [rep.scheduler.stats() for rep in self.replicas]
        preemptions = {"preemptions": sum(s.num_preemptions for s in stats),
                       "time_slice_preemptions": sum(s.num_slice_preemptions for s in stats),
                       "recomputed_tokens": sum(s.num_recomputed_tokens for s in stats)}
        return SimResult(records, steps, time.perf_counter() - t_wall, self.router_size, bubble, preemptions,
                         sum(s.prefix_cache_queries for s in stats), sum(s.prefix_cache_hits for s in stats))

    def _arrive(self, r: SimRequest, shared_prefix: int, now: float) -> RequestRecord:
        rid = str(r.index)
        # sent at its arrival: the simulated client has no network between it and the server
        # sent when it arrives here: at its arrival, or later when its client waited for a slot
        rec = RequestRecord(r.index, r.prompt_len, r.output_len, r.priority, scheduled_s=r.arrival, sent_s=now,
                            client=r.client)
        if r.prompt_len + r.output_len > self.max_request_tokens:
            rec.error, rec.replica = REJECTED, -1
            return rec
        if r.prompt is not None:
            prompt = list(r.prompt)
        else:  # distinct fake ids per request, so the prefix cache only hits what the workload really shares
            n_shared = min(shared_prefix, r.prompt_len - 1)
            prompt = [SHARED_PREFIX_TOKEN] * n_shared + [1000 + r.index] * (r.prompt_len - n_shared)
        rec.replica = self.router.route(prompt)
        # within the replica, the virtual engine with the fewest unfinished requests (vLLM's choice)
        slots = self.replicas[rec.replica * self.pipeline_microbatches:(rec.replica + 1) * self.pipeline_microbatches]
        slot = min(slots, key=lambda s: len(s.scheduler.requests))
        req = Request(rid, prompt, SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0),
                      arrival_time=now, priority=r.priority, client_id=r.client)
        slot.scheduler.add_request(req)
        self.acceptance[rid] = r.acceptance
        return rec

    def _complete(self, rep: _Replica, now: float, by_id: dict[str, RequestRecord]) -> list[str]:
        """Apply the step; returns the clients of the requests that finished."""
        finished = []
        out = rep.in_flight
        assert out is not None
        if self.speculative is None:
            result = StepResult(token_ids={s.request.request_id: 0 for s in out.scheduled if s.needs_sample},
                                duration=rep.in_flight_duration)
        else:
            result = self._speculative_result(out, rep.in_flight_duration)
        rep.busy, rep.in_flight = False, None
        for req in rep.scheduler.update(out, result, now):
            if req.is_finished:
                rec = by_id.pop(req.request_id, None)
                if rec is None:
                    continue
                rec.first_scheduled_s = req.first_scheduled_time
                rec.token_times = req.token_times
                rec.end_s = req.finish_time if req.finish_time is not None else now
                # what the server reports in `usage`, as paceline's does
                rec.usage_prompt_tokens, rec.usage_completion_tokens = len(req.prompt_token_ids), len(req.token_times)
                rec.num_preemptions = req.num_preemptions
                self.router.finished(rec.replica)
                finished.append(rec.client)
        return finished

    def _speculative_result(self, out: SchedulerOutput, duration: float) -> StepResult:
        result = StepResult(duration=duration)
        rng = self.rng
        for s in out.scheduled:
            rid = s.request.request_id
            a = self.acceptance.get(rid, 0.0)
            if s.spec_token_ids:  # accepted proposals (0s), then the target's own token
                tokens = []
                while len(tokens) < len(s.spec_token_ids) and rng.random() < a:
                    tokens.append(0)
                tokens.append(0 if len(tokens) == len(s.spec_token_ids) and rng.random() < a else 1)
                result.verified_token_ids[rid] = tokens
            elif s.needs_sample:
                result.token_ids[rid] = 0 if rng.random() < a else 1
        return result

    def _idle_with_work(self, rep: _Replica, now: float, heap: list, seq: int) -> None:
        """Nothing could be scheduled. If the scheduler names a time when that changes (the static policy
        waiting to fill a batch), look again then; otherwise only a new arrival can change it."""
        wake = getattr(rep.scheduler, "wake_time", None)
        if wake is not None and not rep.poll_pending:
            rep.poll_pending = True
            heapq.heappush(heap, (max(wake, now + 1e-9), POLL, seq, rep.index))
