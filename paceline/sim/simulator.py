"""Discrete-event simulation: the real Scheduler per replica, steps that last what the cost model says.

Events live in one heap keyed (time, kind, seq): at equal times step completions come before arrivals,
and within a kind the order they were pushed, so a run is deterministic. After all events of one instant
are applied, every idle replica with work starts its next step at that instant; an arrival therefore joins
a step that starts at its own arrival time.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass
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


class Simulator:
    def __init__(self, cost_model: CostModel, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, num_host_blocks: int = 0, num_replicas: int = 1, router: str = "round-robin",
                 scheduler_factory: Callable[..., Scheduler] = Scheduler) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.cost_model = cost_model
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.num_blocks = num_blocks
        self.router = Router(router, num_replicas)
        # under max_step_ms the scheduler predicts with the very model that times the simulated steps
        step_time = cost_model.step_time if scheduler_config.max_step_ms > 0 else None
        self.replicas = [_Replica(i, scheduler_factory(scheduler_config, cache_config, num_blocks, num_host_blocks,
                                                       step_time=step_time))
                         for i in range(num_replicas)]
        # a request longer than the context or the whole cache could never finish: rejected, as the engine does
        self.max_request_tokens = min(scheduler_config.max_model_len, num_blocks * cache_config.block_size)
        self.event_log: list[tuple[float, int, str]] | None = None  # (time, kind, id), when a test asks for it

    def run(self, workload: list[SimRequest], shared_prefix_tokens: int = 0) -> SimResult:
        t_wall = time.perf_counter()
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
                    rec = self._arrive(payload, shared_prefix_tokens, now)
                    records.append(rec)
                    if rec.error is None:
                        by_id[str(rec.index)] = rec
                    if log is not None:
                        log.append((now, kind, str(rec.index)))
                elif kind == STEP_DONE:
                    rep = self.replicas[payload]
                    self._complete(rep, now, by_id)
                    if log is not None:
                        log.append((now, kind, f"replica{rep.index}"))
                else:
                    self.replicas[payload].poll_pending = False
            for rep in self.replicas:
                if rep.busy or not rep.scheduler.has_unfinished():
                    continue
                out = rep.scheduler.schedule(now)
                if out.is_empty:
                    self._idle_with_work(rep, now, heap, seq)
                    seq += 1
                    continue
                shape = batch_shape(out)
                d = cost(shape)
                rep.busy, rep.in_flight, rep.in_flight_duration = True, out, d
                sched = rep.scheduler
                pool = sched.kv.pool
                preempted = sched.num_preemptions - rep.preemptions_seen
                rep.preemptions_seen = sched.num_preemptions
                steps.append(StepRecord(rep.index, now, d, shape.num_decodes, shape.num_prefill_tokens, shape.num_requests,
                                        len(sched.running), len(sched.waiting), len(sched.swapped), pool.num_used,
                                        pool.num_free, preempted))
                heapq.heappush(heap, (now + d, STEP_DONE, seq, rep.index))
                seq += 1
        stuck = [rep.index for rep in self.replicas if rep.scheduler.has_unfinished()]
        if stuck:
            raise RuntimeError(f"replicas {stuck} hold unfinished requests that the scheduler will not run")
        return SimResult(records, steps, time.perf_counter() - t_wall, len(self.replicas))

    def _arrive(self, r: SimRequest, shared_prefix: int, now: float) -> RequestRecord:
        rid = str(r.index)
        # sent at its arrival: the simulated client has no network between it and the server
        rec = RequestRecord(r.index, r.prompt_len, r.output_len, r.priority, scheduled_s=r.arrival, sent_s=r.arrival)
        if r.prompt_len + r.output_len > self.max_request_tokens:
            rec.error, rec.replica = REJECTED, -1
            return rec
        rec.replica = self.router.route()
        # distinct fake ids per request, so the prefix cache only hits what the workload really shares
        n_shared = min(shared_prefix, r.prompt_len - 1)
        prompt = [SHARED_PREFIX_TOKEN] * n_shared + [1000 + r.index] * (r.prompt_len - n_shared)
        req = Request(rid, prompt, SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0),
                      arrival_time=r.arrival, priority=r.priority)
        self.replicas[rec.replica].scheduler.add_request(req)
        return rec

    def _complete(self, rep: _Replica, now: float, by_id: dict[str, RequestRecord]) -> None:
        out = rep.in_flight
        assert out is not None
        result = StepResult(token_ids={s.request.request_id: 0 for s in out.scheduled if s.needs_sample},
                            duration=rep.in_flight_duration)
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

    def _idle_with_work(self, rep: _Replica, now: float, heap: list, seq: int) -> None:
        """Nothing could be scheduled. If the scheduler names a time when that changes (the static policy
        waiting to fill a batch), look again then; otherwise only a new arrival can change it."""
        wake = getattr(rep.scheduler, "wake_time", None)
        if wake is not None and not rep.poll_pending:
            rep.poll_pending = True
            heapq.heappush(heap, (max(wake, now + 1e-9), POLL, seq, rep.index))
