"""One request's fault stays that request's: find which request made a step fail, and a test hook that injects
faults into chosen requests of a running server.

run_isolated: when a batched step raises, the engine cannot tell whose row did it (a grammar, a logits processor,
a NaN logit row). It runs the step again one request at a time, without the step's swaps (they already ran), and
the requests that fail alone are the culprits: they end with an error, the others get their tokens. A forward pass
writes the same KV values into the same slots however often it runs, and the sampler draws a seeded request's
token from (seed, position) only, so the others' outputs are the ones the batched step would have given (greedy and
seeded exactly: batched equals alone is one of the project's exactness guarantees). Costs one forward per request,
and only on the step that failed.

FaultInjector (PACELINE_FAULT_INJECTION=1, never on by default): a request whose prompt holds
`PACELINE_FAULT:<stage>` fails at that stage — the tests and benchmarks/soak.py use it against a real server.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any

from paceline.core.outputs import SchedulerOutput, StepResult

log = logging.getLogger("paceline.faults")

FAULT_ENV = "PACELINE_FAULT_INJECTION"
MARKER = "PACELINE_FAULT:"
# sampler: execute raises while the request is in the batch; nan: its logit row is NaN; detokenize / stop: its
# detokenizer / stop-string matcher raises on the 3rd token; crash: the engine thread dies (BaseException)
STAGES = ("sampler", "nan", "detokenize", "stop", "crash")
_MARKED = re.compile(re.escape(MARKER) + r"([a-z]+)")


def run_isolated(runner: Any, out: SchedulerOutput, error: Exception) -> tuple[StepResult, dict[str, str]]:
    """The step `out` raised `error`: run its requests one by one. Returns the merged result of those that ran and
    {request id: message} of those that failed alone. Raises `error` when isolation cannot help: the step swapped
    blocks (running them again could copy blocks the failed attempt already reused), or every one of two or more
    requests alone fails with the very error of the batch (the engine is broken, not a request). Requests that all fail alone, each its
    own way, fail each of them and nothing else: faulty requests that arrive together often make up a whole step,
    and failing every request in flight for them would let them harm the others."""
    if out.blocks_to_swap_in or out.blocks_to_swap_out or len(out.scheduled) < 1:
        raise error
    merged, failed = StepResult(), {}
    for s in out.scheduled:
        alone = dataclasses.replace(out, scheduled=[s], blocks_to_swap_in=[], blocks_to_swap_out=[])
        try:
            r = runner.execute(alone)
        except Exception as e:  # noqa: BLE001 - any error of one request's processing is that request's
            failed[s.request.request_id] = f"{type(e).__name__}: {e}"
            continue
        merged.token_ids.update(r.token_ids)
        merged.verified_token_ids.update(r.verified_token_ids)
        merged.logprobs.update(r.logprobs)
        merged.duration += r.duration
    batched = f"{type(error).__name__}: {error}"
    # every one of several requests alone fails exactly as the batch did: the engine is broken, not a request. A
    # step of one request proves nothing either way (the soak met many: a NaN-row request alone in its step), so
    # that request fails alone; a broken engine still fails the next step of two and then turns /health red.
    if len(out.scheduled) > 1 and len(failed) == len(out.scheduled) and all(m == batched for m in failed.values()):
        raise error
    log.warning("step failed (%s: %s); isolated to %d of %d requests: %s", type(error).__name__, error,
                len(failed), len(out.scheduled), ", ".join(failed))
    return merged, failed


# ---- the test hook ----------------------------------------------------------------------------------------------

class InjectedFault(RuntimeError):
    """A fault the FaultInjector raised on purpose."""


class EngineCrash(BaseException):
    """Injected: escapes the engine loop's `except Exception`, as a bug in the loop itself would."""


@dataclasses.dataclass
class FaultInjector:
    engine: Any
    stages: dict[str, str] = dataclasses.field(default_factory=dict)  # request id -> stage
    fail_after_tokens: int = 3

    def install(self) -> FaultInjector:
        engine, runner = self.engine, self.engine.runner
        add, execute, step = engine.add_request, runner.execute, engine.step
        forward = getattr(runner, "_forward", None)  # the single-process runner's; parallel runners: no nan stage

        def add_request(request_id: str, prompt: Any, params: Any, *args: Any, **kw: Any) -> Any:
            request = add(request_id, prompt, params, *args, **kw)
            text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(list(prompt))
            found = _MARKED.search(text)
            if found and found.group(1) in STAGES:
                self.stages[request_id] = found.group(1)
                self._arm_text_fault(request_id, found.group(1))
            return request

        def faulty(out: SchedulerOutput, stage: str) -> list[str]:
            return [s.request.request_id for s in out.scheduled
                    if self.stages.get(s.request.request_id) == stage and s.needs_sample]

        def execute_hook(out: SchedulerOutput) -> StepResult:
            if faulty(out, "sampler"):
                raise InjectedFault(f"injected sampler fault in {', '.join(faulty(out, 'sampler'))}")
            return execute(out)

        def forward_hook(order: list, *rest: Any) -> Any:  # rest: the runner's StepResult, where it takes one
            # a generator, as ModelRunner._forward is (it yields between layers: engine/multi.py slices steps)
            logits, sampled = yield from forward(order, *rest)
            for row, s in enumerate(sampled):
                if self.stages.get(s.request.request_id) == "nan" and not s.spec_token_ids:
                    logits[row] = float("nan")
            return logits, sampled

        def step_hook() -> Any:
            for rid in [rid for rid in self.stages if engine.scheduler.get_request(rid) is None]:
                del self.stages[rid]  # finished or failed: forget it
            crash = [rid for rid, st in self.stages.items() if st == "crash"
                     and engine.scheduler.get_request(rid) is not None]
            if crash:
                raise EngineCrash(f"injected engine-thread crash by {crash[0]}")
            return step()

        engine.add_request, runner.execute, engine.step = add_request, execute_hook, step_hook
        if forward is not None:
            runner._forward = forward_hook
        log.warning("fault injection is ON (%s): prompts holding %s<stage> fail on purpose", FAULT_ENV, MARKER)
        return self

    def _arm_text_fault(self, request_id: str, stage: str) -> None:
        state = self.engine._text.get(request_id)
        if state is None or stage not in ("detokenize", "stop"):
            return
        obj, name = (state.detok, "add") if stage == "detokenize" else (state.matcher, "feed")
        real, calls = getattr(obj, name), [0]

        def broken(*args: Any) -> Any:
            calls[0] += 1
            if calls[0] >= self.fail_after_tokens:
                raise InjectedFault(f"injected {stage} fault in {request_id}")
            return real(*args)

        setattr(obj, name, broken)


def maybe_install(engine: Any) -> Any:
    """The engine, with the fault injector installed when PACELINE_FAULT_INJECTION=1."""
    if os.environ.get(FAULT_ENV) == "1":
        FaultInjector(engine).install()
    return engine
