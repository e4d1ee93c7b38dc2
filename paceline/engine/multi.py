"""MultiEngine: one step loop over several models, each with its own Engine (runner, KV pool, scheduler).

A step runs one model's batch: different weights cannot share a forward pass. Which model runs is decided here,
once per step, from every model's streams at once (two engines in two processes would instead both compute at
the same time and share the cores badly):

1. A model whose streams have waited at least half the TBT goal since its last step is at risk: the one that has
   waited longest runs. This is what keeps one model's decodes from starving behind another model's prompts or
   priorities: each stream's gap is bounded by one step of every other busy model.
2. Otherwise the model holding the most urgent request (lowest priority value) runs; between equals, the one
   that has waited longest. With equal priorities this alternates the busy models step by step, so every stream
   keeps a steady TBT.

While k models have unfinished requests and any of them has running streams, a stream waits for k steps
between two of its tokens, so each model's step-time target (`max_step_ms`, which cuts prompt chunks) is its own
target divided by k: a model that only has prompts waiting takes its turn too. The scheduler cuts only steps that
carry a decode of their own model (a step of prompts alone keeps no stream of that model waiting), so while
another model has streams, a model's token budget is also lowered to the prompt tokens its share of the target
predicts: without that, a model with only prompts runs a whole 512-token chunk inside a stream gap of the other
model (a 64-token prompt alone takes 180-270 ms for the bundled model in float32 on this 2-core VM, 2026-11-23).

With one model busy the pick is skipped: the single-model path costs one dict walk per step.
MultiEngine is not thread-safe; AsyncEngine calls it from its engine thread only, as it does an Engine.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from paceline.config import EngineConfig
from paceline.core.auto_batch import largest_that_fits
from paceline.core.batch_shape import BatchShape
from paceline.engine.engine import Engine, RequestOutput
from paceline.sampling import SamplingParams

# How a model loaded on demand runs its first prompt beside other models' streams: "whole" (its own token budget,
# uncapped: one step for a short prompt) or "left" (cut to what the others' last steps left of the step-time target,
# _debut_step_target). Whole by default: in four switches each (2026-11-24, docs/multi-model.md) cutting the prompt
# cost first-token time (0.557-0.994 s against 0.342-0.533 s) and did not keep the other streams' gaps down
# (largest gap during the first prompt 134.7-550.9 ms against 210.6-356.5 ms; their p99 122.9-176.3 ms).
DEBUT_STEP = os.environ.get("PACELINE_DEBUT_STEP", "whole")


@dataclass
class MultiStats:
    """The sums AsyncEngine reads (num_waiting against max_waiting_requests)."""
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0


@dataclass
class LoadTimeline:
    """When each part of a load on demand happened (time.monotonic), from the request that asked for the model to
    that request's first token: the split a switch's first-token time is judged by. The residency marks the load
    (size estimate, room made, Engine built, pages mapped, joined); MultiEngine marks the rest on the engine
    thread (request added, first step start and end, first token) and then calls on_first_token (the residency
    starts the work it held back: packing, the KV pool's prefault)."""
    start: float
    marks: dict[str, float] = field(default_factory=dict)
    on_first_token: Callable[[], None] | None = None

    def mark(self, what: str, when: float | None = None) -> None:
        self.marks.setdefault(what, time.monotonic() if when is None else when)  # the first time counts

    def split(self) -> dict[str, float]:
        """Seconds from the request to each mark, in the order they happened."""
        return {k: round(v - self.start, 4) for k, v in sorted(self.marks.items(), key=lambda kv: kv[1])}

    def finish(self) -> None:
        callback, self.on_first_token = self.on_first_token, None
        if callback is not None:
            callback()


class MultiEngine:
    def __init__(self, config: EngineConfig, engines: dict[str, Engine] | None = None) -> None:
        self.config = config  # the server's settings; AsyncEngine reads config.scheduler.max_waiting_requests
        self.engines: dict[str, Engine] = {}
        self._step_ms: dict[str, float] = {}  # each model's own max_step_ms, before the division by busy models
        self._budget: dict[str, int] = {}  # each model's own token budget, before a cap for the other's streams
        self._owner: dict[str, str] = {}  # request id -> model
        self._since: dict[str, float] = {}  # model -> when its streams started waiting for the loop
        self._debut: dict[str, LoadTimeline] = {}  # models loaded on demand that have not yet produced a token
        self.risk_s = config.tbt_goal_ms / 2000.0 if config.tbt_goal_ms > 0 else 0.1
        self.last_model: str | None = None
        self.last_step = None
        for name, engine in (engines or {}).items():
            self.add_model(name, engine)

    # ---- models in and out (engine thread) ----------------------------------------------------------------------

    def add_model(self, name: str, engine: Engine, timeline: LoadTimeline | None = None) -> None:
        if name in self.engines:
            raise ValueError(f"model {name!r} is already loaded")
        self.engines[name] = engine
        if timeline is not None:
            timeline.mark("joined")
            self._debut[name] = timeline
        self._step_ms[name] = engine.scheduler.config.max_step_ms
        self._budget[name] = engine.scheduler.config.max_num_batched_tokens

    def remove_model(self, name: str) -> Engine:
        """Take an idle model out of the loop; the caller drops the Engine to free its memory."""
        engine = self.engines.get(name)
        if engine is None:
            raise ValueError(f"model {name!r} is not loaded")
        if engine.has_unfinished():
            raise ValueError(f"model {name!r} still has requests in flight")
        del self.engines[name]
        debut = self._debut.pop(name, None)
        if debut is not None:  # it never produced a token: what waited for that goes on now
            debut.finish()
        self._step_ms.pop(name, None)
        self._budget.pop(name, None)
        self._since.pop(name, None)
        return engine

    def is_idle(self, name: str) -> bool:
        engine = self.engines.get(name)
        return engine is None or not engine.has_unfinished()

    # ---- the Engine interface AsyncEngine drives ----------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, model: str | None = None, client_id: str = "") -> Any:
        if model is None:
            if len(self.engines) != 1:
                raise ValueError("name the model: this server serves several")
            model = next(iter(self.engines))
        engine = self.engines.get(model)
        if engine is None:
            raise ValueError(f"model {model!r} is not loaded")
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        was_idle = not engine.has_unfinished()
        request = engine.add_request(request_id, prompt, params, priority=priority, arrival_time=arrival_time,
                                     client_id=client_id)
        self._owner[request_id] = model
        if model in self._debut:
            self._debut[model].mark("request_added")
        if was_idle:  # its streams' clock starts at this arrival, not at the model's last step long ago
            self._since[model] = request.arrival_time
        return request

    def abort(self, request_id: str) -> None:
        model = self._owner.get(request_id)
        if model is not None and model in self.engines:
            self.engines[model].abort(request_id)

    def has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.engines.values())

    def stats(self) -> MultiStats:
        total = MultiStats()
        for e in self.engines.values():
            s = e.stats()
            total.num_running += s.num_running
            total.num_waiting += s.num_waiting
            total.num_swapped += s.num_swapped
        return total

    def step(self) -> list[RequestOutput]:
        busy = [name for name, e in self.engines.items() if e.has_unfinished()]
        if not busy:
            self.last_model, self.last_step = None, None
            return []
        name = busy[0] if len(busy) == 1 else self.pick(busy, time.monotonic())
        engine = self.engines[name]
        if len(busy) > 1 or engine.scheduler.config.max_step_ms != self._step_ms[name]:
            self._share_step_target(busy)
        if name in self._debut and DEBUT_STEP == "whole":
            engine.scheduler.config.max_num_batched_tokens = self._budget[name]
        else:
            if name in self._debut:
                self._debut_step_target(name, busy)
            self._cap_budget(name, busy)
        debut = self._debut.get(name)
        if debut is not None:
            debut.mark("first_step_start")
        outputs = engine.step()
        self._since[name] = time.monotonic()
        self.last_model, self.last_step = name, engine.last_step
        if debut is not None:
            debut.mark("first_step_end", self._since[name])
            if any(out.new_token_ids for out in outputs):
                debut.mark("first_token", self._since[name])
                del self._debut[name]
                debut.finish()
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    # ---- the policy -----------------------------------------------------------------------------------------------

    def pick(self, busy: list[str], now: float) -> str:
        """The model whose batch runs next (see the module docstring)."""
        def key(name: str) -> tuple:
            waited = now - self._since.get(name, now)
            if waited >= self.risk_s:
                return (0, -waited)
            return (1, best_priority(self.engines[name]), -waited)
        return min(busy, key=key)

    def _share_step_target(self, busy: list[str]) -> None:
        # Every busy model counts, not only those with running streams: a model whose requests all still wait for
        # their first chunk takes a step in the rotation too, and with a whole target to itself that one step
        # (a prompt chunk) was what stretched the other models' gaps (p99 TBT 1.59x alone, 2026-11-23).
        # With no stream running anywhere there is no gap to protect: each model keeps its whole target.
        # The scheduler's own config: under auto batch settings it is a copy of the engine's.
        shares = len(busy) if any(self.engines[name].scheduler.running for name in busy) else 1
        for name in busy:
            config = self.engines[name].scheduler.config
            if self._step_ms[name] > 0:
                config.max_step_ms = self._step_ms[name] / shares

    def _debut_step_target(self, name: str, busy: list[str]) -> None:
        """Under PACELINE_DEBUT_STEP=left: a model loaded on demand, before its first token, takes what the other
        models' last steps left of the step-time target rather than only its 1/k share.

        The target is the gap budget of one rotation: another model's stream waits for one step of each busy
        model. A model with no stream of its own has no gap of its own to protect, so its step may be the target
        less the other streaming models' steps (their last ones, as measured), and the others' gaps stay within
        the target, which is what their own prompt chunks already make their usual p99. For the bundled model
        loaded in float32 beside int4 streams (~25-40 ms decode steps, 2026-11-23) that is ~110-125 ms of the
        150 ms target against a 75 ms share: a 64-token prompt in two chunks instead of three or four, each
        chunk costing the others one gap. Never less than the share. Only the debut: in steady traffic a model
        with only prompts keeps its share (the one-loop figures in docs/multi-model.md were measured so)."""
        own = self._step_ms[name]
        config = self.engines[name].scheduler.config
        streaming = [o for o in busy if o != name and has_streams(self.engines[o])]
        if own <= 0 or not streaming:
            return
        taken_ms = sum(1e3 * self.engines[o].last_step.duration if self.engines[o].last_step is not None
                       else own / len(busy) for o in streaming)
        config.max_step_ms = max(config.max_step_ms, own - taken_ms)

    def _cap_budget(self, name: str, busy: list[str]) -> None:
        """Lower `name`'s token budget for this step to the prompt tokens that fit its share of the step-time
        target while another busy model has streams (see the module docstring); its own budget otherwise."""
        sched = self.engines[name].scheduler
        config = sched.config
        if config.auto_max_num_batched_tokens:  # the scheduler sizes the budget from the (shared) target itself
            return
        own = self._budget[name]
        others_stream = any(has_streams(self.engines[other]) for other in busy if other != name)
        if not others_stream or config.max_step_ms <= 0 or sched.step_time is None:
            config.max_num_batched_tokens = own
            return
        # not cached: the limit moves with the step-time scale and the model is refitted live (a ~9-call bisection)
        fit = prompt_tokens_within(sched.step_time, config.max_step_ms / 1000.0 / sched.step_time_scale, own,
                                   sched.block_size)
        # the model's own decodes always fit in: the scheduler cuts its prompt chunks around them
        config.max_num_batched_tokens = min(own, max(fit, len(sched.running) + sched.block_size))


def has_streams(engine: Engine) -> bool:
    """Whether any request of the engine is past its prompt (a stream whose next token someone waits for)."""
    return any(r.num_output_tokens > 0 for r in engine.scheduler.running)


def prompt_tokens_within(step_time: Any, limit_s: float, most: int, least: int) -> int:
    """The most prompt tokens (one fresh chunk, between `least` and `most`) of a step predicted to take at most
    limit_s; `least` when even that does not fit (prompts must progress)."""
    return largest_that_fits(lambda k: step_time(BatchShape.build(chunks=[(0, k)])) <= limit_s, least, most)


def best_priority(engine: Engine) -> int:
    """The lowest priority value among a model's unfinished requests (lower runs first, as in vLLM)."""
    return min((r.priority for r in engine.scheduler.requests.values()), default=0)
