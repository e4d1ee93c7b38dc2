"""PipelinedEngine: the Engine under pipeline parallelism, with pipeline_parallel_size steps in flight.

A step's next tokens are known only after its last stage, so one scheduler cannot feed a pipeline: with one step in
flight, stage 1 idles while stage 0 works and the other way round. Here the engine holds one slot per stage (vLLM's
"virtual engines"): each slot is an Engine core with its own scheduler over its own range of the KV blocks (and of
the host blocks), its own requests and their text state, all over ONE PipelineParallelRunner. step() submits the
next step of every idle slot (stage 0 runs it and passes it on, returning at once), then collects the oldest step in
flight: while the last stage finishes slot A's step, stage 0 already computes slot B's.

A request lives in one slot for its whole life: a new one goes to the slot with the fewest unfinished requests, an
abort to the slot that holds it. Stats are summed over the slots. The PP=1 path never comes here (engine_for).

What several slots cannot do yet is refused at construction or at add_request, never half done: speculative
decoding (a proposal is verified against tokens another step may still be computing), prompt_logprobs (refused
under any PP by Engine.add_request: the last stage returns sampled rows only). The step-time model still sizes
chunks under max_step_ms, but it is not refitted from measured steps: a collected step's duration includes the
time it waited behind the other slot's step, not what its own batch cost.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

from paceline.config import EngineConfig
from paceline.core.outputs import SchedulerOutput, StepResult
from paceline.core.scheduler import Scheduler, SchedulerStats
from paceline.engine.engine import Engine, RequestOutput, StepStats
from paceline.engine.faults import run_isolated
from paceline.parallel.executor import InFlight, PipelineParallelRunner
from paceline.request import Request
from paceline.sampling import SamplingParams
from paceline.spec_config import SpeculativeConfig


@dataclass
class _Slot:
    core: Engine  # shares the runner, tokenizer and config; owns its scheduler, text states and aborts
    block_offset: int  # where its device blocks start in the runner's KV cache
    host_offset: int  # where its host blocks start
    busy: bool = False  # a step of this slot is in flight


@dataclass
class _Submitted:
    slot: int
    out: SchedulerOutput
    handle: InFlight | None
    num_decode: int  # composition, read before update() moves the requests on
    num_prefill: int
    predicted: float


class _SlotExecutor:
    """ModelRunner's execute() for one slot, synchronously: what run_isolated reruns a failed step's requests with.
    Only valid while no other step is in flight (the caller drains the pipeline first)."""

    def __init__(self, runner: PipelineParallelRunner, slot: _Slot):
        self.runner, self.slot = runner, slot

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.runner.collect(self.runner.submit(_host_shifted(out, self.slot.host_offset),
                                                      block_offset=self.slot.block_offset))


def _host_shifted(out: SchedulerOutput, host_offset: int) -> SchedulerOutput:
    """The step with its host block ids moved to the slot's range (submit shifts device ids, not host ids)."""
    if not host_offset or not (out.blocks_to_swap_out or out.blocks_to_swap_in):
        return out
    return dataclasses.replace(out, blocks_to_swap_out=[(d, h + host_offset) for d, h in out.blocks_to_swap_out],
                               blocks_to_swap_in=[(h + host_offset, d) for h, d in out.blocks_to_swap_in])


class PipelinedEngine(Engine):
    def __init__(self, config: EngineConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None, num_slots: int | None = None) -> None:
        """num_slots: steps in flight, pipeline_parallel_size by default (one per stage keeps every stage busy);
        1 runs the pipeline one step at a time, what the measurement compares against."""
        config = config or EngineConfig()
        num_slots = config.pipeline_parallel_size if num_slots is None else num_slots
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if config.pipeline_parallel_size < 2:
            raise ValueError(f"PipelinedEngine needs pipeline_parallel_size >= 2, got {config.pipeline_parallel_size}")
        if speculative_config is not None or config.speculative_config is not None:
            # checked before the workers start: verifying proposals needs the tokens of the step still in flight
            raise ValueError("speculative decoding is not supported with pipeline_parallel_size > 1")
        super().__init__(config)  # loads the model into the workers, sizes the pool, profiles step time if asked
        per_slot, per_host = self.num_blocks // num_slots, self.num_host_blocks // num_slots
        if per_slot < 1:
            raise ValueError(f"{self.num_blocks} KV blocks cannot be split among {num_slots} pipeline slots")
        step_time = self.scheduler.step_time
        del self.scheduler  # the whole-pool scheduler Engine built: each slot schedules its own part instead
        self.slots: list[_Slot] = []
        for i in range(num_slots):
            core = Engine.__new__(Engine)
            core.__dict__.update(self.__dict__)  # the runner, tokenizer, config, limits: shared
            core.scheduler = Scheduler(config.scheduler, config.cache, per_slot, per_host, step_time=step_time)
            core.num_blocks, core.num_host_blocks = per_slot, per_host  # add_request's fit check is per slot
            core._text, core._aborted, core.live_step_time = {}, [], None
            self.slots.append(_Slot(core, i * per_slot, i * per_host))
        self._owner: dict[str, int] = {}  # request id -> slot
        self._in_flight: deque[_Submitted] = deque()

    # ---- the Engine interface (LLM, AsyncEngine, the server) -------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, client_id: str = "") -> Request:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        # the least loaded slot: the fewest unfinished requests, the first such slot between equals
        i = min(range(len(self.slots)), key=lambda k: len(self.slots[k].core.scheduler.requests))
        request = self.slots[i].core.add_request(request_id, prompt, params, priority, arrival_time, client_id)
        self._owner[request_id] = i
        return request

    def abort(self, request_id: str) -> None:
        # at once, even while the request's step is in flight: its blocks are freed, but only its own slot could
        # hand them out again, and that slot schedules nothing before the step is collected; update() skips it
        i = self._owner.get(request_id)
        if i is not None:
            self.slots[i].core.abort(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._in_flight) or any(s.core.has_unfinished() for s in self.slots)

    def stats(self) -> SchedulerStats:
        parts = [s.core.scheduler.stats() for s in self.slots]
        total = dataclasses.replace(parts[0])
        for f in dataclasses.fields(SchedulerStats):
            # spec decoding is refused under PP: its per-position counts stay empty; kv_usage is derived below
            if f.name not in ("kv_usage", "spec_decode_num_accepted_tokens_per_pos"):
                setattr(total, f.name, sum(getattr(p, f.name) for p in parts))
        total.kv_usage = total.num_used_blocks / total.num_blocks
        return total

    def step(self) -> list[RequestOutput]:
        """Submit a step for every idle slot that has work, then finish the oldest step in flight."""
        outputs: list[RequestOutput] = []
        for i, slot in enumerate(self.slots):
            core = slot.core
            outputs += core._drain_aborted()
            if slot.busy or not core.scheduler.has_unfinished():
                continue
            out = core.scheduler.schedule(time.monotonic())
            if out.is_empty:
                continue
            num_decode = out.num_decode_tokens
            predicted = out.predicted_step_s * core.scheduler.step_time_scale
            step = _Submitted(i, out, None, num_decode, out.num_batched_tokens - num_decode, predicted)
            try:
                step.handle = self.runner.submit(_host_shifted(out, slot.host_offset), block_offset=slot.block_offset)
            except Exception as e:  # nothing of this step was sent on (stage 0 sends after its forward)
                outputs += self._isolate(step, e)
                continue
            self._in_flight.append(step)
            slot.busy = True
        if self._in_flight:
            outputs += self._collect(self._in_flight.popleft())
        elif not outputs:
            self.last_step = None
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    # ---- one collected step ---------------------------------------------------------------------------------------

    def _collect(self, step: _Submitted) -> list[RequestOutput]:
        try:
            result = self.runner.collect(step.handle)
        except Exception as e:  # the sampler (a grammar, a NaN row) or the logits: the rows had come back
            return self._isolate(step, e)
        return self._finish(step, result, {})

    def _isolate(self, step: _Submitted, error: Exception) -> list[RequestOutput]:
        """One request's row may have failed the step: with the pipeline drained, rerun the step one request at a
        time as the Engine does (engine/faults.py) and fail only the culprits; raises if that cannot help."""
        outputs = []
        while self._in_flight:  # the other slots' steps (each slot has at most one in flight)
            outputs += self._collect(self._in_flight.popleft())
        result, failed = run_isolated(_SlotExecutor(self.runner, self.slots[step.slot]), step.out, error)
        return outputs + self._finish(step, result, failed)

    def _finish(self, step: _Submitted, result: StepResult, failed: dict[str, str]) -> list[RequestOutput]:
        """Engine.step's second half for one slot: update its scheduler, turn tokens into text deltas."""
        slot = self.slots[step.slot]
        slot.busy = False
        core, out = slot.core, step.out
        outputs = [core._error_output(rid, message) for rid, message in failed.items()]
        updated = core.scheduler.update(out, result, time.monotonic())
        self.last_step = StepStats(step.num_decode, step.num_prefill, len(out.scheduled), result.duration,
                                   len(out.preempted_ids), len(out.swapped_out_ids), step.predicted)
        return outputs + core._text_outputs(updated, result)


def engine_for(config: EngineConfig | None = None, speculative_config: SpeculativeConfig | None = None) -> Engine:
    """The engine a caller (LLM, serve, Ray Serve) should run: under pipeline parallelism the one that keeps a step in
    flight per stage, else the plain Engine, untouched."""
    if config is not None and config.pipeline_parallel_size > 1:
        return PipelinedEngine(config, speculative_config)
    return Engine(config, speculative_config)
