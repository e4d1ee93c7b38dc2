"""Every overload decision is made at arrival (AsyncEngine.add_request, on the event loop) from the engine thread's
last snapshot, never on the engine thread: a 503 is raised while a step is still in flight, and a request that
was admitted is served, not dropped later. A real Scheduler with a toy step-time model behind Engine's surface,
whose step waits on a gate the test opens: the ordering ("answered before the engine took its next step") is
asserted, never a duration."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.batch_shape import BatchShape
from paceline.core.outputs import StepResult
from paceline.core.scheduler import Scheduler
from paceline.engine.admission import QueueDelayError
from paceline.engine.async_engine import AsyncEngine, QueueFullError
from paceline.request import Request
from paceline.sampling import SamplingParams


def toy_step_time(s: BatchShape) -> float:
    """10 ms a step, 1 ms a decode, 0.2 ms a prompt token (test_admission_load.py's model, without context)."""
    return 0.010 + 0.001 * s.num_decodes + 0.0002 * s.num_prefill_tokens


class GatedEngine:
    """Engine's surface over a real Scheduler; each step blocks until the test lets one through (`release`)."""

    def __init__(self, max_num_seqs: int = 1, max_queue_delay_s: float = 5.0, max_waiting: int = 0) -> None:
        cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, max_step_ms=100.0,
                              max_queue_delay_s=max_queue_delay_s, max_waiting_requests=max_waiting)
        self.scheduler = Scheduler(cfg, CacheConfig(block_size=16), 4000, step_time=toy_step_time)
        self.config = SimpleNamespace(scheduler=cfg)
        self.permits = threading.Semaphore(0)
        self.in_step = threading.Event()  # set while a step waits for its permit
        self.steps_done = 0
        self.added: list[str] = []

    def release(self, steps: int = 1) -> None:
        for _ in range(steps):
            self.permits.release()

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, client_id: str = "") -> None:
        self.scheduler.add_request(Request(request_id, list(prompt), params, arrival_time or time.monotonic()))
        self.added.append(request_id)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_waiting=self.scheduler.num_waiting)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list:
        self.in_step.set()
        self.permits.acquire()
        self.in_step.clear()
        now = time.monotonic()
        out = self.scheduler.schedule(now)
        changed = self.scheduler.update(
            out, StepResult({s.request.request_id: 7 for s in out.scheduled if s.needs_sample}), now)
        self.steps_done += 1
        return [SimpleNamespace(request_id=r.request_id, new_token_ids=[7], num_output_tokens=r.num_output_tokens,
                                finished=r.is_finished, error=None) for r in changed]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


async def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.002)


async def drain(stream) -> int:
    n = 0
    async for _ in stream:
        n += 1
    return n


def test_a_rejection_leaves_while_the_step_is_still_in_flight():
    async def main() -> None:
        engine = GatedEngine(max_num_seqs=1, max_queue_delay_s=5.0)
        ae = AsyncEngine(engine)
        try:
            long = await ae.add_request("long", list(range(1, 17)), params(1000))
            for _ in range(3):  # three steps, let through 50 ms apart: the measured step time is about that
                engine.release(1)
                await asyncio.sleep(0.05)
            await wait_for(lambda: engine.steps_done == 3 and engine.in_step.is_set())
            # the fourth step is in flight and stays there: the one seat is held for ~997 more tokens
            steps = engine.steps_done
            with pytest.raises(QueueDelayError, match="predicted wait"):
                await ae.add_request("late", list(range(100, 116)), params(4))
            assert engine.steps_done == steps and engine.in_step.is_set()  # answered before the step ended
            assert "late" not in engine.added  # nothing of it reached the engine
            long.abort()
            engine.release(10)
        finally:
            engine.release(100)
            await ae.shutdown()

    asyncio.run(main())


def test_the_waiting_cap_is_counted_at_arrival_with_the_adds_not_yet_applied():
    # three arrive while a step is in flight: the engine thread has applied none of them, yet the third is over
    # the cap of 2 and is refused at once (before, it waited for the step and was refused by the engine thread)
    async def main() -> None:
        engine = GatedEngine(max_num_seqs=1, max_queue_delay_s=0.0, max_waiting=2)
        ae = AsyncEngine(engine)
        try:
            first = await ae.add_request("first", list(range(1, 17)), params(8))
            engine.release(1)  # its first step; the engine thread recounts the queue after it (0 waiting)
            await wait_for(lambda: engine.steps_done == 1 and engine.in_step.is_set())  # the second is in flight
            adds = [asyncio.ensure_future(ae.add_request(f"w{i}", list(range(50 + 20 * i, 66 + 20 * i)), params(2)))
                    for i in range(2)]
            await asyncio.sleep(0)  # both submitted, neither applied (the engine thread is inside the step)
            with pytest.raises(QueueFullError):
                await ae.add_request("third", list(range(200, 216)), params(2))
            assert engine.steps_done == 1 and "third" not in engine.added
            engine.release(100)
            streams = await asyncio.gather(*adds)
            counts = await asyncio.gather(drain(first), *(drain(s) for s in streams))
            assert counts == [8, 2, 2]  # every admitted request served to its end
        finally:
            engine.release(1000)
            await ae.shutdown()

    asyncio.run(main())


def test_an_admitted_request_is_served_even_when_it_waits_past_the_limit():
    # the limit is 0.05 s and the one seat is busy for 40 steps that the test holds back: the request admitted at
    # arrival (nothing measured yet, so its predicted wait was short) waits past the limit; it is served to its
    # end, counted as overdue once, and an arrival behind it meanwhile is refused at arrival
    async def main() -> None:
        engine = GatedEngine(max_num_seqs=1, max_queue_delay_s=0.05)
        ae = AsyncEngine(engine)
        try:
            busy = await ae.add_request("busy", list(range(1, 17)), params(40))
            await wait_for(lambda: engine.in_step.is_set())  # busy's first step is in flight
            adding = asyncio.ensure_future(ae.add_request("patient", list(range(100, 116)), params(3)))
            await asyncio.sleep(0.2)  # admitted at arrival; past the limit before the engine thread even takes it
            engine.release(1)
            await wait_for(lambda: ae.admission.num_overdue == 1)  # the sweep before the next step saw it
            patient = await adding
            with pytest.raises(QueueDelayError):
                await ae.add_request("behind", list(range(300, 316)), params(3))
            engine.release(1000)
            assert await drain(busy) == 40 and await drain(patient) == 3
            assert ae.admission.num_overdue == 1  # counted once, however many sweeps saw it
        finally:
            engine.release(1000)
            await ae.shutdown()

    asyncio.run(main())
