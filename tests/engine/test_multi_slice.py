"""Layer-sliced steps: one model's step suspended between two layers while another model's step runs whole, then
resumed. Same tokens as uninterrupted serving, the other model's step really inside, durations of its own work only,
and the KV pools whole at the end."""
from __future__ import annotations

import math
import time

import pytest
import torch

from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.engine import multi as multi_module
from paceline.engine.engine import Engine, StepStats
from paceline.engine.faults import FaultInjector
from paceline.engine.multi import MultiEngine, has_streams, sliceable
from paceline.engine.runner import ModelRunner
from paceline.sampling import SamplingParams

PROMPTS = ["the cat sat on the mat and", "hello there, in the", "a b c d e f g h i j", "then the end"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# lanes split the CPU's cores (MultiEngine._lane_mode): where torch sees a GPU these engines run on it, without lanes
CPU_LANES = pytest.mark.skipif(torch.cuda.is_available(), reason="lanes run on the CPU only; the engines here are on CUDA")

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny_dirs and one_torch_thread: conftest.py


@pytest.fixture(autouse=True)
def rotation(monkeypatch):
    """These tests are about the rotation's slicing: two busy models would otherwise run in lanes (LANES), which
    the lanes test turns back on for itself."""
    monkeypatch.setattr(multi_module, "LANES", False)


def engine(path: str, name: str) -> Engine:
    return Engine(EngineConfig(model=path, dtype="float32", tbt_goal_ms=0, served_model_name=name,
                               cache=CacheConfig(num_blocks=64, block_size=4, swap_space_gb=0),
                               scheduler=SchedulerConfig(max_num_batched_tokens=16)))


def always_preempt(multi: MultiEngine) -> list[tuple[str, str]]:
    """Make every other streaming model due at every layer boundary (the policy aside: the mechanism under test);
    the (suspended, preemptor) pairs are recorded."""
    seen: list[tuple[str, str]] = []

    def preemptors(name: str, busy: list[str], own_s: float | None = None) -> list[tuple[float, str]]:
        found = [(-math.inf, o) for o in busy
                 if o != name and o not in multi._inflight and has_streams(multi.engines[o])]
        seen.extend((name, o) for _, o in found[:1])
        return found

    multi._preemptors = preemptors
    return seen


def serve(multi_or_engine, requests: list[tuple[str, str, str | None]]) -> dict[str, list[int]]:
    for rid, prompt, model in requests:
        kw = {"model": model} if model is not None else {}
        multi_or_engine.add_request(rid, prompt, GREEDY, **kw)
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    while multi_or_engine.has_unfinished():
        for out in multi_or_engine.step():
            got[out.request_id] += out.new_token_ids
    return got


def test_suspended_steps_resumed_later_give_the_tokens_of_single_model_serving(tiny_dirs):
    alone = {kind: serve(engine(path, kind), [(f"{kind}-{i}", p, None) for i, p in enumerate(PROMPTS)])
             for kind, path in tiny_dirs.items()}
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    seen = always_preempt(multi)
    got = serve(multi, [(f"{kind}-{i}", p, kind) for i, p in enumerate(PROMPTS) for kind in tiny_dirs])
    for kind in tiny_dirs:
        assert {k: v for k, v in got.items() if k.startswith(kind)} == alone[kind]
    assert set(seen) == {("llama", "qwen2"), ("qwen2", "llama")}  # each suspended the other
    assert not multi._inflight and multi._owner == {}
    for e in engines.values():  # every block back in the pool: nothing leaked by a suspension
        assert e.scheduler.stats().num_used_blocks == 0


def test_the_other_models_step_runs_inside_the_suspended_one(tiny_dirs):
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    always_preempt(multi)
    serve(multi, [("a", PROMPTS[0], "llama"), ("b", PROMPTS[1], "qwen2")])
    steps = list(multi.recent_steps)  # (model, start, end, ...) in the order the steps ended
    nested = [(outer, inner) for outer in steps for inner in steps
              if inner[0] != outer[0] and outer[1] < inner[1] and inner[2] < outer[2]]
    assert nested  # a step of one model started after and ended before a step of the other
    outer, inner = nested[0]
    assert steps.index(inner) < steps.index(outer)  # its outputs came back first


def test_a_suspended_steps_duration_counts_only_its_own_layers(tiny_dirs, monkeypatch):
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    slow = engines["qwen2"].runner
    real, real_whole = slow.execute_iter, ModelRunner.execute

    def slow_step(out):  # the other model's every step takes 50 ms more, sliced or in one piece
        time.sleep(0.05)
        return (yield from real(out))

    def slow_whole(self, out):  # on the class: a runner whose own `execute` is replaced is not sliceable
        if self is slow:
            time.sleep(0.05)
        return real_whole(self, out)

    slow.execute_iter = slow_step
    monkeypatch.setattr(ModelRunner, "execute", slow_whole)
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    always_preempt(multi)
    multi.add_request("q", "x y", GREEDY, model="qwen2")
    while not has_streams(engines["qwen2"]):
        multi.step()
    observed = []
    multi.add_request("l", PROMPTS[0], GREEDY, model="llama")
    while multi.has_unfinished():
        multi.step()
        if multi.last_model == "llama":
            name, start, end, *_ = multi.recent_steps[-1]
            observed.append((end - start, engines["llama"].last_step.duration))
    spans_with_a_slow_step_inside = [(span, own) for span, own in observed if span >= 0.05]
    assert spans_with_a_slow_step_inside
    # StepStats.duration is the StepResult's: what the step-time refit and the scale learn from
    assert all(own < span - 0.045 for span, own in spans_with_a_slow_step_inside)


def test_an_abort_while_its_step_is_suspended_waits_for_the_step(tiny_dirs):
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    always_preempt(multi)
    multi.add_request("q", "x y", GREEDY, model="qwen2")
    while not has_streams(engines["qwen2"]):
        multi.step()
    multi.add_request("l", PROMPTS[0], GREEDY, model="llama")
    for _ in range(4):  # llama's prompt step is suspended for qwen2's decode, whose outputs come back
        multi.step()
        if "llama" in multi._inflight:
            break
    assert multi.last_model == "qwen2" and "llama" in multi._inflight
    multi.abort("l")
    assert engines["llama"].scheduler.get_request("l") is not None  # not yet: its blocks are in the batch
    finished = {}
    while multi.has_unfinished():
        for out in multi.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished["l"] == "abort" and finished["q"] == "length"
    assert all(e.scheduler.stats().num_used_blocks == 0 for e in engines.values())


def test_slicing_is_off_where_it_cannot_apply(tiny_dirs, monkeypatch):
    plain = engine(tiny_dirs["llama"], "llama")
    assert sliceable(plain)
    hooked = engine(tiny_dirs["qwen2"], "qwen2")
    FaultInjector(hooked).install()  # wraps step and execute: it must see whole steps
    assert not sliceable(hooked)
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), {"llama": plain, "qwen2": hooked})
    seen = always_preempt(multi)
    serve(multi, [("a", PROMPTS[0], "llama"), ("b", PROMPTS[1], "qwen2")])
    assert seen == []  # one unsliceable busy model: every step whole
    monkeypatch.setattr(multi_module, "SLICE", False)  # PACELINE_SLICE=0: the same for any models
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), {k: engine(p, k) for k, p in tiny_dirs.items()})
    seen = always_preempt(multi)
    serve(multi, [("a", PROMPTS[0], "llama"), ("b", PROMPTS[1], "qwen2")])
    assert seen == []


def llama_streaming(tiny_dirs) -> tuple[dict, MultiEngine]:
    """Both tiny models in one MultiEngine (no step-time target), the llama one with a stream decoding."""
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    engines["llama"].add_request("s", "x y", GREEDY)
    while not has_streams(engines["llama"]):
        engines["llama"].step()
    return engines, multi


def test_another_model_is_due_once_its_streams_waited_its_last_step(tiny_dirs, monkeypatch):
    monkeypatch.setattr(multi_module, "SLICE_SHORTER", False)  # any streaming model may preempt: not what this tests
    monkeypatch.setattr(multi_module, "SLICE_DUE", 1.0)
    engines, multi = llama_streaming(tiny_dirs)
    engines["qwen2"].add_request("p", PROMPTS[0], GREEDY)  # a prompt only: no stream of its own
    engines["llama"].last_step = StepStats(1, 30, 2, duration=0.070)  # a long step: the other gets as long
    multi._since = {"llama": 10.0, "qwen2": 10.0}
    busy = ["llama", "qwen2"]
    assert multi._preemptors("qwen2", busy) == [(pytest.approx(10.070), "llama")]
    assert multi._preemptors("llama", busy) == []  # qwen2 has no stream waiting
    multi._inflight["llama"] = object()  # its own step suspended: it resumes after, it does not preempt
    assert multi._preemptors("qwen2", busy) == []


def test_a_debut_step_lets_the_other_streams_wait_debut_due_times_their_step(tiny_dirs, monkeypatch):
    monkeypatch.setattr(multi_module, "SLICE_DUE", 1.0)
    monkeypatch.setattr(multi_module, "DEBUT_DUE", 4.0)
    engines, multi = llama_streaming(tiny_dirs)
    engines["llama"].last_step = StepStats(1, 0, 1, duration=0.010)
    multi._since = {"llama": 10.0, "qwen2": 10.0}
    busy = ["llama", "qwen2"]
    assert multi._preemptors("qwen2", busy) == [(pytest.approx(10.010), "llama")]
    multi._debut["qwen2"] = multi_module.LoadTimeline(start=9.0)  # qwen2 was loaded on demand: its first step
    assert multi._preemptors("qwen2", busy) == [(pytest.approx(10.040), "llama")]


def test_a_debut_lets_the_other_streams_wait_only_as_long_as_its_first_token_needs(tiny_dirs, monkeypatch):
    """DEBUT_BY_S: qwen2's first prompt (request at 9.8, 50 ms of its own predicted) beside llama's 10 ms steps
    (1 ms of loop each round): with 0.4 s to its first token and 0.2 s gone, g >= 50 x 11 / 150 = 3.7 ms, so
    SLICE_DUE's 5 ms; with 0.3 s gone, 50 x 11 / 50 = 11 ms; with 0.35 s gone, capped at DEBUT_DUE x 10 ms. The
    layers run so far count when they say more is left than the prediction: 30 ms for 5 of 30 layers, 26 to go."""
    monkeypatch.setattr(multi_module, "SLICE_DUE", 0.5)
    monkeypatch.setattr(multi_module, "DEBUT_DUE", 4.0)
    monkeypatch.setattr(multi_module, "DEBUT_BY_S", 0.4)
    engines, multi = llama_streaming(tiny_dirs)
    engines["llama"].last_step = StepStats(1, 0, 1, duration=0.010)
    multi._since = {"llama": 10.0}
    multi._loop_s = 0.001
    multi._debut["qwen2"] = multi_module.LoadTimeline(start=9.8)
    watch = multi._preemptors("qwen2", ["llama", "qwen2"])
    run = multi_module._Run(iter(()), True, 10.0, predicted_s=0.050)

    def due(now: float, own_s: float = 0.0) -> float:
        return multi._later_due("qwen2", run, watch, now, own_s)[0][0]

    assert due(10.0) == pytest.approx(10.0 + 0.001 + 0.005)
    assert due(10.1) == pytest.approx(10.0 + 0.001 + 0.011)
    assert due(10.15) == pytest.approx(10.0 + 0.001 + 0.040)
    monkeypatch.setattr(multi, "_layer_count", lambda name: 30)
    run.boundaries = 5
    assert due(10.0, own_s=0.030) == pytest.approx(10.0 + 0.001 + 0.156 * 0.011 / (0.2 - 0.156))
    run.predicted_s = None  # no step-time model yet (a model just loaded): the layers run so far alone
    assert due(10.0, own_s=0.030) == pytest.approx(10.0 + 0.001 + 0.156 * 0.011 / (0.2 - 0.156))
    run.boundaries = 0  # and before its first layer, nothing to judge by: DEBUT_DUE
    assert due(10.0) == pytest.approx(10.040)
    monkeypatch.setattr(multi_module, "DEBUT_BY_S", 0.0)  # off: DEBUT_DUE alone, as before
    assert due(10.0) == pytest.approx(10.040)


def test_sliced_step_targets_count_the_other_models_steps_run_inside(tiny_dirs, monkeypatch):
    monkeypatch.setattr(multi_module, "SLICE_DUE", 0.5)
    monkeypatch.setattr(multi_module, "SLICE_TAIL", True)  # the default; set here: the rule itself
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    multi._step_ms = {"llama": 150.0, "qwen2": 120.0}  # each model's own target (no profile for the tiny models)
    engines["llama"].add_request("s", "x y", GREEDY)
    while not has_streams(engines["llama"]):
        engines["llama"].step()
    engines["qwen2"].add_request("p", PROMPTS[0], GREEDY)
    busy = ["llama", "qwen2"]
    multi._share_step_target(busy)  # unsliced: one share per busy model
    assert [engines[k].scheduler.config.max_step_ms for k in busy] == [pytest.approx(75.0), pytest.approx(60.0)]
    # sliced: a step also holds one step of the other per SLICE_DUE of its own: 1 + 1 / 0.5 = 3 shares; and a
    # step's tail, suspended before when the other comes due during it, waits for one more step of the other
    # streaming model (llama's 30 ms; qwen2 has no stream yet)
    engines["llama"].last_step = StepStats(1, 0, 1, duration=0.030)
    multi._share_step_target(busy, sliced=True)
    assert [engines[k].scheduler.config.max_step_ms for k in busy] == [pytest.approx(50.0), pytest.approx(30.0)]
    monkeypatch.setattr(multi_module, "SLICE_TAIL", False)  # the A/B: tails judged by their layer, shares alone
    multi._share_step_target(busy, sliced=True)
    assert [engines[k].scheduler.config.max_step_ms for k in busy] == [pytest.approx(50.0), pytest.approx(40.0)]


def test_while_a_model_loads_a_step_leaves_room_for_its_turn_in_the_streams_gap(tiny_dirs, monkeypatch):
    """A load's turns run between a busy model's steps: its step-time target is its share, but never more than its
    streams' gap alone (its whole target here: no calm target) less the last turn."""
    monkeypatch.setattr(multi_module, "LOAD_TURN_TARGET", True)
    engines, multi = llama_streaming(tiny_dirs)
    multi._step_ms["llama"] = 100.0
    config = engines["llama"].scheduler.config
    multi._share_step_target(["llama"])
    assert config.max_step_ms == pytest.approx(100.0)  # nothing loads: its whole target
    multi.turns.pending = True
    multi._share_step_target(["llama"])
    assert config.max_step_ms == pytest.approx(50.0)  # one share of two; the first turn guessed at 40 ms
    multi._turn_s = 0.070  # a long turn measured
    multi._share_step_target(["llama"])
    assert config.max_step_ms == pytest.approx(30.0)
    monkeypatch.setattr(multi_module, "LOAD_TURN_TARGET", False)  # the A/B: the shares alone
    multi._share_step_target(["llama"])
    assert config.max_step_ms == pytest.approx(50.0)


@pytest.mark.parametrize("ahead, layers", [(True, 1), (False, 2)])
def test_a_step_is_suspended_at_the_last_boundary_before_the_other_is_due(tiny_dirs, monkeypatch, ahead, layers):
    monkeypatch.setattr(multi_module, "SLICE_AHEAD", ahead)
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), {k: engine(p, k) for k, p in tiny_dirs.items()})
    ran = []

    def step():  # five "layers" of 50 ms each
        for i in range(5):
            time.sleep(0.05)
            ran.append(i)
            yield
        return []

    due = time.monotonic() + 0.08  # inside the second layer
    monkeypatch.setattr(multi, "_preemptors", lambda name, busy, *_: [(due, "qwen2")])
    run = multi_module._Run(step(), True, time.monotonic())
    # ahead: the second layer would end past the due time, so the step stops after the first
    assert multi._advance("llama", run, ["llama", "qwen2"]) == "qwen2"
    assert len(ran) == layers
    monkeypatch.setattr(multi, "_preemptors", lambda name, busy, *_: [])  # nothing due: to the end
    assert multi._advance("llama", run, ["llama", "qwen2"]) is None and len(ran) == 5


def test_a_sliced_step_of_prompts_alone_is_cut_to_its_whole_target_while_another_model_streams(tiny_dirs):
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    sched = engines["qwen2"].scheduler
    sched.step_time = lambda shape: 1e-3 * shape.num_prefill_tokens  # 1 ms a prompt token
    multi._step_ms["qwen2"] = 150.0
    multi._budget["qwen2"] = own_budget = 512
    busy = ["llama", "qwen2"]
    assert multi._sliced_budget("qwen2", busy) == own_budget  # no other model streams: its own budget
    engines["llama"].add_request("s", "x y", GREEDY)
    while not has_streams(engines["llama"]):
        engines["llama"].step()
    cut = multi._sliced_budget("qwen2", busy)
    assert 150 - sched.block_size <= cut <= 150  # 1 ms a token: the whole target's tokens, not the budget
    multi._step_ms["qwen2"] = 0.0  # no target of its own: nothing to cut to
    assert multi._sliced_budget("qwen2", busy) == own_budget


def test_the_boundary_after_the_last_layer_is_judged_by_the_models_last_tail(tiny_dirs, monkeypatch):
    """A float32 step's tail (final norm, lm_head over the whole vocabulary, sampling, update) is several of its
    layers long: judged by the layer just run, the step ran on into it past another model's due time. Waited out for
    a model with shorter steps only: a short step suspended before its tail would wait for a whole long one."""
    engines = {k: engine(p, k) for k, p in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    ran = []

    def step():  # five "layers" of 20 ms, then an 80 ms tail
        for i in range(5):
            time.sleep(0.02)
            ran.append(i)
            yield
        time.sleep(0.08)
        ran.append("tail")
        return []

    busy = ["llama", "qwen2"]
    monkeypatch.setattr(multi, "_preemptors", lambda name, busy, *_: [])
    assert multi._advance("llama", multi_module._Run(step(), True, time.monotonic()), busy) is None
    assert multi._layers["llama"] == 5 and 0.075 <= multi._tail_s["llama"] < 0.2  # learned from the whole step
    engines["llama"].last_step = StepStats(1, 0, 1, duration=0.180)
    for tail_rule, other_step_s, suspended in [(True, 0.010, True), (True, 0.300, False), (False, 0.010, False)]:
        monkeypatch.setattr(multi_module, "SLICE_TAIL", tail_rule)
        engines["qwen2"].last_step = StepStats(1, 0, 1, duration=other_step_s)
        ran.clear()
        start = time.monotonic()
        due = start + 0.145  # inside the tail: after the five layers (100 ms), before the step's end (180 ms)
        monkeypatch.setattr(multi, "_preemptors", lambda name, busy, *_, due=due: [(due, "qwen2")])
        got = multi._advance("llama", multi_module._Run(step(), True, start), busy)
        if suspended:  # stopped at the last boundary: the tail runs once the other model's step has ended
            assert got == "qwen2" and ran == [0, 1, 2, 3, 4]
        else:  # judged by a 20 ms layer, the 80 ms tail looked like it fit (or the other's steps are the longer)
            assert got is None and ran[-1] == "tail"


def test_streams_given_their_first_token_by_a_prompt_step_are_due_by_a_decode_step(tiny_dirs, monkeypatch):
    monkeypatch.setattr(multi_module, "SLICE_DUE", 0.5)
    monkeypatch.setattr(multi_module, "SLICE_STREAM_DUE", True)  # the default; set here: the rule itself
    engines, multi = llama_streaming(tiny_dirs)
    engines["qwen2"].add_request("p", PROMPTS[0], GREEDY)
    multi._since = {"llama": 10.0, "qwen2": 10.0}
    busy = ["llama", "qwen2"]
    sched = engines["llama"].scheduler
    sched.step_time = lambda shape: 0.004 + 0.002 * shape.num_decodes  # no profile for the tiny model: a stand-in
    sched.step_time_scale = 1.5
    engines["llama"].last_step = StepStats(0, 30, 1, duration=0.200)  # the prompt step that gave the first token
    # no decode step of its own yet: the step-time model's decode step for its one stream, scaled
    assert multi._preemptors("qwen2", busy) == [(pytest.approx(10.0 + 0.5 * 1.5 * 0.006), "llama")]
    multi._decode_s["llama"] = 0.010  # its last step of decodes alone
    assert multi._preemptors("qwen2", busy) == [(pytest.approx(10.005), "llama")]
    engines["llama"].last_step = StepStats(1, 30, 2, duration=0.080)  # a decode beside a prompt chunk: that step
    assert multi._preemptors("qwen2", busy) == [(pytest.approx(10.040), "llama")]
    engines["llama"].last_step = StepStats(0, 30, 1, duration=0.200)
    monkeypatch.setattr(multi_module, "SLICE_STREAM_DUE", False)  # the A/B: half of the prompt step
    assert multi._preemptors("qwen2", busy) == [(pytest.approx(10.100), "llama")]


def test_the_last_step_of_decodes_alone_is_recorded_and_a_prompt_step_leaves_it(tiny_dirs):
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    multi.add_request("a", PROMPTS[0], GREEDY, model="llama")
    while not has_streams(engines["llama"]):  # its prompt, in chunks of 16 tokens
        multi.step()
    assert "llama" not in multi._decode_s
    multi.step()
    decode = engines["llama"].last_step
    assert decode.num_prefill_tokens == 0 and multi._decode_s["llama"] == decode.duration
    multi.add_request("b", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), model="llama")
    multi.step()  # b's prompt beside a's decode
    assert engines["llama"].last_step.num_prefill_tokens > 0 and multi._decode_s["llama"] == decode.duration


def both_streaming(tiny_dirs) -> tuple[dict, MultiEngine]:
    """Both tiny models in one MultiEngine (no step-time target), each with one stream decoding."""
    engines, multi = llama_streaming(tiny_dirs)
    engines["qwen2"].add_request("q", "x y", GREEDY)
    while not has_streams(engines["qwen2"]):
        engines["qwen2"].step()
    return engines, multi


def test_a_step_that_would_outlast_its_target_lets_the_other_model_wait_longer(tiny_dirs, monkeypatch):
    """SLICE_SPAN: qwen2's step (predicted 45 ms of its own) beside llama's 10 ms steps; qwen2's streams last ended
    50 ms ago, its whole target is 120 ms: 70 ms left for 45 ms of its own, so each llama round (10 ms step + 1 ms of
    loop) must leave it g >= 45 x 11 / 25 = 19.8 ms, capped at SLICE_DUE_MAX x 10 ms."""
    monkeypatch.setattr(multi_module, "SLICE_SHORTER", False)  # any streaming model may preempt: not what this tests
    monkeypatch.setattr(multi_module, "SLICE_DUE", 0.5)
    monkeypatch.setattr(multi_module, "SLICE_DUE_MAX", 0.8)
    engines, multi = both_streaming(tiny_dirs)
    engines["llama"].last_step = StepStats(1, 0, 1, duration=0.010)
    multi._step_ms["qwen2"] = 120.0
    multi._since = {"llama": 10.0, "qwen2": 9.95}
    multi._loop_s = 0.001
    busy = ["llama", "qwen2"]
    watch = multi._preemptors("qwen2", busy)
    assert watch == [(pytest.approx(10.005), "llama")]  # SLICE_DUE: half llama's step
    run = multi_module._Run(iter(()), True, 9.99, predicted_s=0.045)

    def due(predicted_s: float, own_s: float = 0.0) -> float:
        run.predicted_s = predicted_s
        return multi._span_due("qwen2", run, watch, 10.0, own_s)[0][0]

    assert due(0.045) == pytest.approx(10.0 + 0.001 + 0.008)  # capped: llama's gap stays its step + 9 ms
    assert due(0.020) == pytest.approx(10.0 + 0.001 + 0.020 * 0.011 / 0.050)  # between: 4.4 ms each round
    assert due(0.010) == pytest.approx(10.005)  # fits beside SLICE_DUE's rounds: unchanged
    assert due(0.045, own_s=0.040) == pytest.approx(10.005)  # nearly done: 5 ms of 70 left
    multi._step_ms["qwen2"] = 0.0  # no target of its own: nothing to aim at
    assert due(0.045) == pytest.approx(10.005)
    multi._step_ms["qwen2"] = 120.0
    engines["qwen2"].abort("q")  # no stream of its own waits on this step
    engines["qwen2"].step()
    assert not has_streams(engines["qwen2"]) and due(0.045) == pytest.approx(10.005)


def test_the_span_rule_aims_at_the_calm_target_while_no_other_prompt_of_its_model_queues(tiny_dirs, monkeypatch):
    """SLICE_CALM: served alone, a model whose queue holds at most one prompt runs calm steps (core/scheduler.py), so
    its streams' gap alone is about its calm target, and the span rule aims at that: qwen2 (whole target 120 ms, calm
    72 ms) with 20 ms of its own to run, 50 ms after its streams' last step, 22 ms left: each llama round must leave it
    g >= 20 x 11 / 2 ms, capped at SLICE_DUE_MAX x 10 ms; against the whole target (70 ms left) g = 20 x 11 / 50 ms.
    With two prompts of its own queued, its steps alone would fill the whole target: that is the bound again."""
    monkeypatch.setattr(multi_module, "SLICE_SHORTER", False)  # any streaming model may preempt: not what this tests
    monkeypatch.setattr(multi_module, "SLICE_DUE", 0.5)
    monkeypatch.setattr(multi_module, "SLICE_DUE_MAX", 0.8)
    engines, multi = both_streaming(tiny_dirs)
    engines["llama"].last_step = StepStats(1, 0, 1, duration=0.010)
    multi._step_ms["qwen2"], engines["qwen2"].scheduler.config.calm_step_ms = 120.0, 72.0
    multi._since = {"llama": 10.0, "qwen2": 9.95}
    multi._loop_s = 0.001
    watch = multi._preemptors("qwen2", ["llama", "qwen2"])
    run = multi_module._Run(iter(()), True, 9.99, predicted_s=0.020)
    calm_due = multi._span_due("qwen2", run, watch, 10.0, 0.0)[0][0]
    assert calm_due == pytest.approx(10.0 + 0.001 + 0.008)
    monkeypatch.setattr(multi_module, "SLICE_CALM", False)
    assert multi._span_due("qwen2", run, watch, 10.0, 0.0)[0][0] == pytest.approx(10.0 + 0.001 + 0.020 * 0.011 / 0.050)
    monkeypatch.setattr(multi_module, "SLICE_CALM", True)
    for rid in ("q2", "q3"):  # two prompts queued behind the stream
        engines["qwen2"].add_request(rid, "a b c", GREEDY)
    assert engines["qwen2"].scheduler.others_queued()
    assert multi._span_due("qwen2", run, watch, 10.0, 0.0)[0][0] == pytest.approx(10.0 + 0.001 + 0.020 * 0.011 / 0.050)


def test_a_sliced_step_learns_its_predicted_time_once_scheduled(tiny_dirs, monkeypatch):
    monkeypatch.setattr(multi_module, "SLICE_SPAN", True)
    engines, multi = both_streaming(tiny_dirs)
    sched = engines["qwen2"].scheduler
    sched.step_time = lambda shape: 0.004 + 0.002 * shape.num_decodes  # no profile for the tiny model: a stand-in
    sched.step_time_scale = 1.5
    multi._step_ms["qwen2"] = sched.config.max_step_ms = 120.0
    judged = []
    real = multi._span_due
    monkeypatch.setattr(multi, "_span_due", lambda *a: judged.append(a[1].predicted_s) or real(*a))
    monkeypatch.setattr(multi, "_preemptors", lambda name, busy, *_: [(time.monotonic() + 100.0, "llama")])
    busy = ["llama", "qwen2"]
    run = multi._start("qwen2", busy, True)
    assert run.predicted_s is None
    assert multi._advance("qwen2", run, busy) is None  # nothing came due: the step ran to its end
    assert run.predicted_s == pytest.approx(1.5 * 0.006) and judged == [run.predicted_s]


def test_a_step_whose_prediction_leaves_no_model_to_watch_runs_on(tiny_dirs, monkeypatch):
    """Once scheduled, SLICE_SHORTER drops every model whose streams' step is longer than the step's prediction;
    when that leaves none, the step runs to its end. A regression: the due times were then not judged again, the
    dropped model's (already past) stood, and the boundary raised ValueError on an empty list, failing every request
    in flight (served one-loop run, 2026-11-29 12:54 UTC)."""
    monkeypatch.setattr(multi_module, "SLICE_SHORTER", True)
    engines, multi = both_streaming(tiny_dirs)
    sched = engines["qwen2"].scheduler
    sched.step_time = lambda shape: 0.004 + 0.002 * shape.num_decodes  # predicted ~6 ms
    multi._step_ms["qwen2"] = sched.config.max_step_ms = 120.0
    engines["llama"].last_step = StepStats(1, 0, 1, duration=0.050)  # llama's streams' step: longer
    monkeypatch.setattr(multi, "_preemptors", lambda name, busy, *_: [(time.monotonic() - 1.0, "llama")])
    busy = ["llama", "qwen2"]
    run = multi._start("qwen2", busy, True)
    assert multi._advance("qwen2", run, busy) is None and run.predicted_s == pytest.approx(0.006)


def test_an_idle_models_kv_prefault_waits_while_another_model_runs(tiny_dirs):
    """An Engine paces its pool's prefault by its own requests only: the loop holds every model's back while any
    model has work (beside the other model's steps it slowed them), and lets them all go once nothing runs."""
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    assert all(e.prefault_go.is_set() for e in engines.values())
    multi.add_request("a", PROMPTS[0], GREEDY, model="llama")
    assert not engines["qwen2"].prefault_go.is_set()  # qwen2 is idle, but llama's steps are coming
    multi.step()
    assert not any(e.prefault_go.is_set() for e in engines.values())
    while multi.has_unfinished():
        multi.step()
    assert all(e.prefault_go.is_set() for e in engines.values())


def test_a_models_prompts_may_wait_for_room_only_while_another_model_streams(tiny_dirs):
    engines, multi = llama_streaming(tiny_dirs)
    engines["qwen2"].add_request("q", "x y", GREEDY)
    busy = ["llama", "qwen2"]
    multi._start("qwen2", busy, sliced=True)
    assert engines["qwen2"].scheduler.config.defer_prompt_s == multi_module.SLICE_DEFER_S > 0  # llama streams
    multi._start("llama", busy, sliced=True)
    assert engines["llama"].scheduler.config.defer_prompt_s == 0.0  # qwen2 has no stream yet
    multi.turns.pending = True  # a third model loads on demand: it will stream next
    multi._start("llama", busy, sliced=True)
    assert engines["llama"].scheduler.config.defer_prompt_s == multi_module.SLICE_DEFER_S
    multi.turns.pending = False
    multi._debut["qwen2"] = multi_module.LoadTimeline(start=0.0)  # loaded, its first prompt still to run
    multi._start("llama", busy, sliced=True)
    assert engines["llama"].scheduler.config.defer_prompt_s == multi_module.SLICE_DEFER_S


@pytest.mark.parametrize("hold", [True, False])
def test_a_streaming_models_prompts_wait_while_another_model_loads_or_debuts(tiny_dirs, monkeypatch, hold):
    """HOLD_PROMPTS: beside a load or another model's first prompt, a streaming model's steps run its decodes only,
    and its streams' due time counts its decode step, not the chunk step before; PACELINE_HOLD_PROMPTS=0: chunks
    as before (the A/B)."""
    monkeypatch.setattr(multi_module, "HOLD_PROMPTS", hold)
    engines, multi = llama_streaming(tiny_dirs)
    engines["llama"].add_request("p", PROMPTS[0], GREEDY)  # a prompt that chunks beside the stream
    engines["qwen2"].add_request("q", "x y", GREEDY)
    busy = ["llama", "qwen2"]
    multi._debut["qwen2"] = multi_module.LoadTimeline(start=0.0)  # loaded, its first prompt still to run
    run = multi._start("llama", busy, sliced=False)
    assert engines["llama"].scheduler.config.hold_prompts is hold
    while next(run.gen, "done") != "done":
        pass
    last = engines["llama"].last_step
    assert (last.num_decode_tokens, last.num_prefill_tokens > 0) == (1, not hold)
    multi._start("qwen2", busy, sliced=False)
    assert not engines["qwen2"].scheduler.config.hold_prompts  # the debut itself: no stream of its own
    multi._decode_s["llama"] = 0.010
    engines["llama"].last_step = StepStats(1, 30, 2, duration=0.080)  # a chunk step from before the hold
    assert multi._stream_step_s("llama") == (0.010 if hold else 0.080)
    del multi._debut["qwen2"]
    multi.turns.pending = True  # a load under way holds them too
    multi._start("llama", busy, sliced=False)
    assert engines["llama"].scheduler.config.hold_prompts is hold
    multi.turns.pending = False
    multi._start("llama", busy, sliced=False)
    assert not engines["llama"].scheduler.config.hold_prompts
    assert multi._stream_step_s("llama") == 0.080


@pytest.mark.parametrize("whole", [True, False])
def test_a_step_nothing_could_preempt_runs_in_one_piece(tiny_dirs, monkeypatch, whole):
    """The preemptor's step (the other model's step is suspended, so it is due to no one) runs the runner's plain
    execute, one C++ call for every layer; PACELINE_SLICE_WHOLE=0 slices it like the rest (the A/B)."""
    monkeypatch.setattr(multi_module, "SLICE_WHOLE", whole)
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    seen = always_preempt(multi)
    inside = {"whole": 0, "sliced": 0}  # steps run while the other model's step is suspended
    real, real_iter = ModelRunner.execute, ModelRunner.execute_iter
    in_whole = []  # execute drains execute_iter itself: those are not sliced steps

    def counted(self, out):  # on the class: a runner whose own `execute` is replaced is not sliceable
        inside["whole"] += bool(multi._inflight)
        in_whole.append(1)
        try:
            return real(self, out)
        finally:
            in_whole.pop()

    def counted_iter(self, out):
        inside["sliced"] += bool(multi._inflight) and not in_whole
        return (yield from real_iter(self, out))

    monkeypatch.setattr(ModelRunner, "execute", counted)
    monkeypatch.setattr(ModelRunner, "execute_iter", counted_iter)
    alone = {kind: serve(engine(path, kind), [(f"{kind}-0", PROMPTS[0], None)]) for kind, path in tiny_dirs.items()}
    got = serve(multi, [(f"{kind}-0", PROMPTS[0], kind) for kind in tiny_dirs])
    assert got == {**alone["llama"], **alone["qwen2"]} and seen  # same tokens; steps were suspended
    if whole:
        assert inside["whole"] > 0 and inside["sliced"] == 0, inside
    else:
        assert inside["whole"] == 0 and inside["sliced"] > 0, inside


def test_only_a_model_with_shorter_steps_preempts_the_running_one(tiny_dirs, monkeypatch):
    """SLICE_SHORTER: llama's decode steps take 10 ms, qwen2's 30 ms. qwen2's streams may not preempt llama's
    decode step (they would make llama's streams wait 30 ms), llama's may preempt qwen2's; a step that may hold a
    prompt chunk (its length unknown until scheduled) may be preempted by either; once scheduled, the prediction
    decides."""
    monkeypatch.setattr(multi_module, "SLICE_DUE", 0.5)
    engines, multi = both_streaming(tiny_dirs)
    engines["llama"].last_step = StepStats(1, 0, 1, duration=0.010)
    engines["qwen2"].last_step = StepStats(1, 0, 1, duration=0.030)
    multi._since = {"llama": 10.0, "qwen2": 10.0}
    busy = ["llama", "qwen2"]
    assert multi._preemptors("llama", busy) == []
    assert multi._preemptors("qwen2", busy) == [(pytest.approx(10.005), "llama")]
    assert multi._preemptors("llama", busy, own_s=0.050) == [(pytest.approx(10.015), "qwen2")]  # a 50 ms step
    engines["llama"].add_request("p", PROMPTS[0], GREEDY)  # a prompt may join llama's next step
    assert multi._preemptors("llama", busy) == [(pytest.approx(10.015), "qwen2")]
    monkeypatch.setattr(multi_module, "SLICE_SHORTER", False)
    engines["llama"].abort("p")
    assert multi._preemptors("llama", busy) == [(pytest.approx(10.015), "qwen2")]


def test_a_debut_may_be_preempted_by_a_model_with_longer_steps(tiny_dirs, monkeypatch):
    """SLICE_SHORTER keeps a short step's streams from waiting for a longer one; a debut's first prompt has no
    streams of its own, so the other model may preempt it whatever its step."""
    monkeypatch.setattr(multi_module, "SLICE_SHORTER", True)
    monkeypatch.setattr(multi_module, "SLICE_DUE", 0.5)
    engines, multi = llama_streaming(tiny_dirs)
    engines["llama"].last_step = StepStats(1, 0, 1, duration=0.050)
    multi._since = {"llama": 10.0}
    busy = ["llama", "qwen2"]
    assert multi._preemptors("qwen2", busy, own_s=0.030) == []  # a 30 ms step: llama's 50 ms one may not
    multi._debut["qwen2"] = multi_module.LoadTimeline(start=9.9)
    assert [o for _, o in multi._preemptors("qwen2", busy, own_s=0.030)] == ["llama"]


@pytest.mark.parametrize("lanes", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_under_every_slicing_rule_never_breaks_the_loop(tiny_dirs, monkeypatch, seed, lanes):
    """The loop's rules (SLICE_SHORTER, the span rule, a debut's first-token budget, the tail) run on time and on
    predictions; here both models get made-up step-time models and targets, layers of random length, and requests
    that arrive, and are aborted, at random steps. Nothing may raise (a stale due time once raised ValueError and
    failed every request in flight), every request that was not aborted gets the tokens of single-model serving,
    and every KV block comes back."""
    import random

    rng = random.Random(seed)
    monkeypatch.setattr(multi_module, "LANES", lanes)  # in lanes, until a model is idle or the debut is over
    for knob in ("SLICE_SHORTER", "SLICE_SPAN", "SLICE_TAIL", "SLICE_STREAM_DUE", "SLICE_AHEAD", "SLICE_WHOLE"):
        monkeypatch.setattr(multi_module, knob, rng.random() < 0.8)
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    for name, e in engines.items():
        base, per_token = rng.uniform(0.001, 0.02), rng.uniform(0.0001, 0.002)
        e.scheduler.step_time = lambda shape, b=base, p=per_token: b + p * (shape.num_decodes + shape.num_prefill_tokens)
        e.scheduler.config.max_step_ms = multi._step_ms[name] = rng.choice([5.0, 20.0, 120.0])
        real = e.runner.execute_iter

        def slow_iter(out, real=real):  # layers of random length: the rules' clocks see varied times
            gen = real(out)
            try:
                while True:
                    next(gen)
                    if rng.random() < 0.3:
                        time.sleep(rng.uniform(0.0, 0.004))
                    yield
            except StopIteration as done:
                return done.value
        monkeypatch.setattr(e.runner, "execute_iter", slow_iter)  # execute stays the class's: still sliceable
    if rng.random() < 0.5:  # the second model as if loaded on demand: its first prompt is a debut
        multi._debut["qwen2"] = multi_module.LoadTimeline(time.monotonic())
    plan = [(f"{kind}-{i}", PROMPTS[i % len(PROMPTS)], kind) for i in range(6) for kind in tiny_dirs]
    rng.shuffle(plan)
    alone = {kind: serve(engine(path, kind), [(rid, p, None) for rid, p, m in plan if m == kind])
             for kind, path in tiny_dirs.items()}
    got: dict[str, list[int]] = {}
    aborted: set[str] = set()
    while plan or multi.has_unfinished():
        if plan and rng.random() < 0.4:
            rid, prompt, model = plan.pop()
            multi.add_request(rid, prompt, GREEDY, model=model)
            got[rid] = []
        if got and rng.random() < 0.05:
            victim = rng.choice(sorted(got))
            multi.abort(victim)
            aborted.add(victim)
        for out in multi.step():
            got[out.request_id] += out.new_token_ids
    for kind in tiny_dirs:
        for rid, tokens in alone[kind].items():
            if rid not in aborted:
                assert got[rid] == tokens, rid
    assert not multi._inflight and multi._owner == {}
    for e in engines.values():
        assert e.scheduler.stats().num_used_blocks == 0


def served_alone(tiny_dirs, requests: list[tuple[str, str, str]]) -> dict[str, dict[str, list[int]]]:
    """Each model's requests of `requests` (id, prompt, model) served by an Engine of that model alone: its tokens."""
    return {kind: serve(engine(path, kind), [(r, p, None) for r, p, m in requests if m == kind])
            for kind, path in tiny_dirs.items()}


@CPU_LANES
def test_lanes_run_two_models_side_by_side_with_the_tokens_of_single_model_serving(tiny_dirs, monkeypatch):
    """LANES: while both models are busy each one's forward runs on a worker thread of its own, both at once; the
    tokens are those of single-model serving, an abort while its model's forward runs waits for the step, every
    block comes back, and once one model is idle the rotation runs on the engine thread's own threads again."""
    import threading

    monkeypatch.setattr(multi_module, "LANES", True)
    requests = [(f"{kind}-{i}", p, kind) for i, p in enumerate(PROMPTS) for kind in tiny_dirs]
    alone = served_alone(tiny_dirs, requests)
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    threads_before = multi_module.step_threads()
    on_workers, both_at_once = [], []
    for e in engines.values():
        real = type(e.runner).execute

        def execute(out, real=real, runner=e.runner):
            worker = threading.current_thread().name.startswith("paceline-lane")
            # on the engine thread only in the rotation, i.e. once the other model is idle
            on_workers.append(worker or sum(x.has_unfinished() for x in engines.values()) == 1)
            both_at_once.append(len(multi._lanes))
            time.sleep(0.002)  # long enough for the other lane's forward to overlap
            return real(runner, out)
        monkeypatch.setattr(e.runner, "execute", execute)
    monkeypatch.setattr(multi_module, "sliceable", lambda engine: True)  # the spy replaced execute
    for rid, prompt, model in requests:
        multi.add_request(rid, prompt, GREEDY, model=model)
    multi.add_request("gone", PROMPTS[0], GREEDY, model="qwen2")
    got = {rid: [] for rid, _, _ in requests}
    aborted = False
    while multi.has_unfinished():
        outputs = multi.step()
        if not aborted and "qwen2" in multi._lanes:  # its forward is under way: the abort waits for the step's end
            multi.abort("gone")
            assert multi._deferred_aborts["qwen2"] == ["gone"]
            aborted = True
        for out in outputs:
            if out.request_id != "gone":
                got[out.request_id] += out.new_token_ids
    for kind in tiny_dirs:
        assert {k: v for k, v in got.items() if k.startswith(kind)} == alone[kind]
    assert aborted and all(on_workers) and max(both_at_once) == 2
    assert not multi._lanes and multi._owner == {} and multi_module.step_threads() == threads_before
    for e in engines.values():
        assert e.scheduler.stats().num_used_blocks == 0


@CPU_LANES
@pytest.mark.parametrize("restart", [True, False])
def test_a_lane_sends_its_next_forward_before_its_outputs_go_out(tiny_dirs, monkeypatch, restart):
    """LANE_RESTART: once a lane's step has been updated, its next step is scheduled and its forward on the worker
    before step() hands the outputs over (the forward runs while they are sent); off, the next call starts it.
    Either way the tokens are those of single-model serving."""
    monkeypatch.setattr(multi_module, "LANES", True)
    monkeypatch.setattr(multi_module, "LANE_RESTART", restart)
    requests = [(f"{kind}-{i}", p, kind) for i, p in enumerate(PROMPTS[:2]) for kind in tiny_dirs]
    alone = served_alone(tiny_dirs, requests)
    engines = {kind: engine(path, kind) for kind, path in tiny_dirs.items()}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    for rid, prompt, model in requests:
        multi.add_request(rid, prompt, GREEDY, model=model)
    got = {rid: [] for rid, _, _ in requests}
    seen = []  # (whose tokens came out, whether that model's next forward was already under way)
    while multi.has_unfinished():
        outputs = multi.step()
        both = all(e.has_unfinished() for e in engines.values())
        for model in {rid.split("-")[0] for rid in (o.request_id for o in outputs if o.new_token_ids)}:
            if both:
                seen.append((model, model in multi._lanes))
        for out in outputs:
            got[out.request_id] += out.new_token_ids
    assert got == {**alone["llama"], **alone["qwen2"]}
    assert seen and {model for model, _ in seen} == set(tiny_dirs)
    assert all(under_way == restart for _, under_way in seen)


@CPU_LANES
def test_the_lane_lowered_is_the_one_with_the_longer_decode_steps_not_the_last_long_step(tiny_dirs, monkeypatch):
    """LANE_NICE: the lane of the model whose decode-only steps are the longer runs at the lowered priority, decided
    from decode steps only: a prompt step of the other model (however long) does not swap the roles, since a
    worker once lowered cannot be raised again without CAP_SYS_NICE; without a decode step of each, neither."""
    monkeypatch.setattr(multi_module, "LANES", True)
    engines, multi = both_streaming(tiny_dirs)
    nices = {}

    def lane_forward(runner, out, threads, nice):  # the worker's priority recorded, nothing lowered for real
        nices.setdefault(runner, nice)
        return runner.execute(out), 0.0, time.monotonic()
    monkeypatch.setattr(multi_module, "_lane_forward", lane_forward)
    multi._decode_s = {"llama": 0.040}
    assert not multi._longer_decodes("llama") and not multi._longer_decodes("qwen2")  # qwen2's is not known yet
    multi._decode_s = {"llama": 0.040, "qwen2": 0.010}
    engines["qwen2"].last_step = StepStats(0, 512, 1, duration=0.619)  # a long prompt step: decodes decide
    assert multi._longer_decodes("llama") and not multi._longer_decodes("qwen2")
    multi.step()
    assert nices == {engines["llama"].runner: multi_module.LANE_NICE, engines["qwen2"].runner: 0}


@CPU_LANES
def test_a_lane_divides_its_targets_by_what_one_thread_costs_and_teaches_no_step_times(tiny_dirs, monkeypatch):
    """A lane's step runs on one thread while the step-time model is of all threads: its max, calm and short
    targets are divided by the model's learned lane ratio (first LANE_RATIO_GUESS), learned from its lane steps
    with a prompt chunk, and the engine's refit and scale learn nothing from them; the rotation gets the model's own
    targets and learning back."""
    monkeypatch.setattr(multi_module, "LANES", True)
    # with LANE_RESTART a call that ends a lane's step starts its next, divided by the ratio just learned: off, what
    # the first step was divided by is still there to read
    monkeypatch.setattr(multi_module, "LANE_RESTART", False)
    engines, multi = both_streaming(tiny_dirs)
    sched, config = engines["qwen2"].scheduler, engines["qwen2"].scheduler.config
    sched.step_time = lambda shape: 0.001 * shape.num_tokens
    config.max_step_ms = multi._step_ms["qwen2"] = 120.0
    config.calm_step_ms, config.short_step_ms = 72.0, 42.0
    multi._calm["qwen2"] = (72.0, 42.0)
    engines["qwen2"].add_request("p", PROMPTS[0], GREEDY)  # a prompt: its lane steps carry chunks
    guess = multi_module.LANE_RATIO_GUESS
    multi.step()
    assert "qwen2" in multi._lanes or multi.last_model == "qwen2"
    assert (config.max_step_ms, config.calm_step_ms, config.short_step_ms) == pytest.approx(
        (120.0 / guess, 72.0 / guess, 42.0 / guess))
    assert engines["qwen2"].learn_steps is False
    while "qwen2" not in multi._lane_ratio:  # learned at the end of its first lane step with a chunk
        multi.step()
    last = engines["qwen2"].last_step
    assert last.num_prefill_tokens > 0
    assert multi._lane_ratio["qwen2"] == pytest.approx(guess + 0.2 * (last.duration / last.predicted_s - guess))
    while "llama" in multi._lanes:  # its stream was added to its Engine directly: aborted there, between steps
        multi.step()
    engines["llama"].abort("s")  # one busy model: the rotation, with the model's own targets and learning
    while multi._lanes or engines["llama"].has_unfinished():  # the abort goes out at llama's next (empty) step
        multi.step()
    engines["qwen2"].add_request("p2", PROMPTS[1], GREEDY)  # busy still, whatever ended meanwhile
    multi.step()
    assert (config.calm_step_ms, config.short_step_ms, config.max_step_ms) == (72.0, 42.0, 120.0)
    assert engines["qwen2"].learn_steps is True
