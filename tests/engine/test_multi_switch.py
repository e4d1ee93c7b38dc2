"""Switching to a model loaded on demand: the load's timeline (request to first token), the step a debuting
model's first prompt may take beside other models' streams, and what waits for its first token (the KV pool's
prefault)."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.engine.engine import Engine, StepStats
from paceline.engine import multi as multi_module
from paceline.engine.multi import LoadTimeline, LoadTurns, MultiEngine
from paceline.engine.prefault import held_until, populate_in_background
from paceline.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny_dirs and one_torch_thread: conftest.py


def engine(path: str, name: str, **kw) -> Engine:
    return Engine(EngineConfig(model=path, dtype="float32", tbt_goal_ms=0, served_model_name=name,
                               cache=CacheConfig(num_blocks=64, block_size=4, swap_space_gb=0),
                               scheduler=SchedulerConfig(**{"max_num_batched_tokens": 64, **kw})))


def tokens_alone(path: str, prompt: list[int]) -> list[int]:
    e = engine(path, "alone")
    e.add_request("r", prompt, GREEDY)
    out: list[int] = []
    while e.has_unfinished():
        for o in e.step():
            out += o.new_token_ids
    return out


def test_timeline_marks_a_debut_from_joining_to_first_token_once(tiny_dirs):
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), {"llama": engine(tiny_dirs["llama"], "llama")})
    calls = []
    timeline = LoadTimeline(start=0.0, on_first_token=lambda: calls.append("first"))
    multi.add_model("qwen2", engine(tiny_dirs["qwen2"], "qwen2"), timeline)
    multi.add_request("s", "a b c", GREEDY, model="llama")
    multi.add_request("q", "the cat sat on", GREEDY, model="qwen2")
    while multi.has_unfinished():
        multi.step()
    split = timeline.split()
    assert list(split) == ["joined", "request_added", "first_step_start", "first_step_end", "first_token"]
    assert calls == ["first"]  # once, not per token
    assert "qwen2" not in multi._debut
    # a later request of the same model marks nothing more
    multi.add_request("q2", "x y", GREEDY, model="qwen2")
    while multi.has_unfinished():
        multi.step()
    assert timeline.split() == split and calls == ["first"]


def test_a_model_unloaded_before_its_first_token_releases_what_waited_for_it(tiny_dirs):
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0))
    calls = []
    multi.add_model("llama", engine(tiny_dirs["llama"], "llama"), LoadTimeline(0.0, on_first_token=lambda: calls.append(1)))
    multi.remove_model("llama")
    assert calls == [1]


def llama_streaming_qwen2_ready(tiny_dirs, max_tokens: int) -> tuple[dict, MultiEngine]:
    """llama serving one stream past its first token, qwen2 built but not added; both with a step-time model of 1 ms
    a token and a 20 ms target (10 ms each while both are busy)."""
    engines = {"llama": engine(tiny_dirs["llama"], "llama"), "qwen2": engine(tiny_dirs["qwen2"], "qwen2")}
    for e in engines.values():
        e.scheduler.step_time = lambda shape: 1e-3 * shape.num_tokens
        e.scheduler.config.max_step_ms = 20.0
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), {"llama": engines["llama"]})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    multi.add_request("stream", "a b", params, model="llama")
    while not engines["llama"].scheduler.running or not engines["llama"].scheduler.running[0].num_output_tokens:
        multi.step()
    return engines, multi


@pytest.mark.parametrize("debut_step", ["whole", "fit", "sliced"])
def test_a_debut_prompt_beside_streams_gives_the_tokens_it_gives_alone(tiny_dirs, monkeypatch, debut_step):
    # whole and fit: steps unsliced (PACELINE_SLICE=0); sliced (the default): the other model's streams wait for
    # one layer of the debut's step, so it runs with its own target and budget, whole
    monkeypatch.setattr(multi_module, "SLICE", debut_step == "sliced")
    monkeypatch.setattr(multi_module, "DEBUT_STEP", debut_step)
    engines, multi = llama_streaming_qwen2_ready(tiny_dirs, max_tokens=60)
    prompt = list(range(5, 65))
    multi.add_model("qwen2", engines["qwen2"], LoadTimeline(0.0))
    multi.add_request("long", prompt, GREEDY, model="qwen2")
    got: list[int] = []
    chunks = []
    while multi.has_unfinished():
        for o in multi.step():
            if o.request_id == "long":
                got += o.new_token_ids
        if multi.last_model == "qwen2" and multi.last_step.num_prefill_tokens:
            chunks.append(multi.last_step.num_prefill_tokens)
    assert sum(chunks) == len(prompt)
    if debut_step != "fit":  # one step, though another model streams and the 20 ms target fits ~10-20 tokens
        assert chunks == [len(prompt)]
    else:  # never past the whole target (plus a block)
        assert max(chunks) <= 20 + 4
    assert got == tokens_alone(tiny_dirs["qwen2"], prompt)


def test_prefault_held_until_its_gate_opens():
    pool = torch.frombuffer(bytearray(8 * 2**20), dtype=torch.float32)
    gate = threading.Event()
    with held_until(gate):
        held = populate_in_background(pool)
    free = populate_in_background(pool)  # outside the block: not held
    free.join(30)
    held.join(0.3)
    assert held.is_alive() and not free.is_alive()  # it cannot finish before the gate opens, however fast
    gate.set()
    held.join(30)
    assert not held.is_alive()


def test_a_model_built_on_the_loader_thread_gets_the_profile_its_setup_cached(tiny_dirs, monkeypatch, tmp_path):
    """The profile's key holds torch's thread count, which is 1 on the loader thread: the lookup happens when the
    model joins, on the engine thread (here the test's), where a start-up load of the same setup cached it."""
    from paceline.core.step_time import FEATURES, ProfiledCostModel
    from paceline.engine.residency import _build_engine, _install

    monkeypatch.setattr("paceline.engine.engine.cache_root", lambda: tmp_path)
    torch.set_num_threads(2)
    config = EngineConfig(model=tiny_dirs["llama"], dtype="float32", tbt_goal_ms=0,
                          cache=CacheConfig(num_blocks=64, block_size=4, swap_space_gb=0),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_step_ms=50.0))
    with concurrent.futures.ThreadPoolExecutor(1) as loader:
        built, step_ms = loader.submit(_build_engine, config).result()
    assert step_ms == 50.0 and built.scheduler.step_time is None  # no profile taken on the loader thread
    path = built._profile_cache_path()
    path.parent.mkdir(parents=True)
    ProfiledCostModel(dict.fromkeys(FEATURES, 0.0) | {"constant": 0.01}).save(path)
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0))
    _install(multi, "m", built, step_ms)
    assert built.scheduler.step_time is not None and built.config.scheduler.max_step_ms == 50.0
    assert multi.engines["m"] is built


def test_a_load_turn_runs_its_piece_while_the_engine_thread_waits_and_is_bounded():
    turns = LoadTurns()
    order: list[str] = []

    def piece(seconds: float) -> None:
        with turns.take(timeout_s=5.0):
            order.append("piece start")
            time.sleep(seconds)
            order.append("piece end")

    with concurrent.futures.ThreadPoolExecutor(1) as loader:
        assert turns.serve(1.0) == 0.0  # nobody asked: no wait
        done = loader.submit(piece, 0.05)
        while not turns.is_asked():
            time.sleep(0.001)
        waited = turns.serve(5.0)
        order.append("engine goes on")
        done.result()
        assert order == ["piece start", "piece end", "engine goes on"] and waited >= 0.05
        order.clear()
        done = loader.submit(piece, 0.5)
        while not turns.is_asked():
            time.sleep(0.001)
        waited = turns.serve(0.05)  # the limit passes first: the piece goes on beside the engine thread
        order.append("engine goes on")
        done.result()
        assert order == ["piece start", "engine goes on", "piece end"] and waited < 0.5


def test_a_load_in_pieces_chains_them_into_one_turn_until_it_has_lasted_chain_s():
    turns = LoadTurns()
    ran: list[tuple[int, int]] = []  # (turn, piece)
    turn = [0]

    def load(pieces: int, seconds: float) -> None:
        with turns.take(timeout_s=5.0) as next_turn:
            for i in range(pieces):
                if i:
                    next_turn()
                ran.append((turn[0], i))
                time.sleep(seconds)

    with concurrent.futures.ThreadPoolExecutor(1) as loader:
        done = loader.submit(load, 6, 0.01)
        while not done.done():
            if turns.is_asked():
                turns.serve(5.0, chain_s=0.025)  # pieces of ~10 ms: three to a turn
                turn[0] += 1
            time.sleep(0.001)
        done.result()
    by_turn = [sum(1 for t, _ in ran if t == k) for k in range(turn[0])]
    assert [piece for _, piece in ran] == list(range(6)) and len(by_turn) >= 2 and max(by_turn) >= 2, ran
    assert all(n <= 4 for n in by_turn), ran  # a turn stops taking pieces once it has lasted chain_s


def test_a_load_turn_that_nobody_serves_runs_after_its_timeout():
    turns = LoadTurns()
    start = time.monotonic()
    nudged = []
    with turns.take(nudge=lambda: nudged.append(1), timeout_s=0.05):
        pass
    assert nudged == [1] and 0.05 <= time.monotonic() - start < 5.0


def test_a_turn_asked_just_after_one_is_served_when_the_busy_models_then_finish(tiny_dirs):
    """One turn per rotation: a piece asking right after a turn waits for the busy model's step. If that step
    finishes the model's last request, the loop still has work (the ask) and its next call serves the turn; before,
    the idle loop left the load waiting out its timeout (5.22 s, switch run WWW, 2026-11-29)."""
    streaming = engine(tiny_dirs["llama"], "llama")
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), {"llama": streaming})
    multi.add_request("s", "a b", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), model="llama")
    multi.step()  # its prompt (a step of prompts alone would make way for a turn: LONE_SLICED); one decode left
    ran = threading.Event()

    def piece() -> None:
        with multi.turns.take(timeout_s=5.0):
            ran.set()

    multi._turn_since_step = True  # a turn was just served: the busy model steps first
    with concurrent.futures.ThreadPoolExecutor(1) as loader:
        done = loader.submit(piece)
        while not multi.turns.is_asked():
            time.sleep(0.001)
        multi.serve_load_turn()  # the nudge's call: skipped, one turn per rotation
        assert not ran.is_set()
        while streaming.has_unfinished():
            multi.step()
        assert multi.has_unfinished()  # nothing busy, but the ask is work for the loop
        start = time.monotonic()
        multi.step()
        done.result(timeout=5.0)
        assert ran.is_set() and time.monotonic() - start < 1.0 and not multi.has_unfinished()

def test_a_load_on_demand_builds_in_turns_between_the_other_models_steps(tiny_dirs):
    from paceline.engine.residency import _build_engine, _install

    streaming = engine(tiny_dirs["llama"], "llama")
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), {"llama": streaming})
    streams = iter(range(10_000))
    timeline = LoadTimeline(time.monotonic())
    config = EngineConfig(model=tiny_dirs["qwen2"], dtype="float32", tbt_goal_ms=0,
                          cache=CacheConfig(num_blocks=64, block_size=4, swap_space_gb=0))
    multi.turns.pending = True
    with concurrent.futures.ThreadPoolExecutor(1) as loader:
        built = loader.submit(_build_engine, config, timeline, None, multi.turns)
        while not built.done():
            if not streaming.has_unfinished():  # keep a stream running until the load is done
                multi.add_request(f"s{next(streams)}", "a b", SamplingParams(temperature=0.0, max_tokens=200,
                                                                               ignore_eos=True), model="llama")
            multi.step()
        new, step_ms = built.result()
    loads = [(a, b) for name, a, b, *_ in multi.recent_steps if name == "(load)"]
    # the build's pieces (checkpoint, model, runner, the rest: loader.piece_break) and the page mapping; a tiny
    # model's pieces are short and chain into as little as one turn (LOAD_TURN_CHAIN_S)
    assert 1 <= len(loads) <= 5, loads
    marks = timeline.marks
    assert marks["build_start"] <= loads[0][0]
    assert marks["piece1"] < marks["engine_built"]  # each piece's end is marked
    for mark in ("engine_built", "mapped"):  # each piece ran while the loop waited
        assert any(a <= marks[mark] <= b for a, b in loads), mark
    for (_, end), (start, _) in zip(loads, loads[1:]):  # a step of the others between every two turns
        assert any(s[0] == "llama" and end <= s[1] <= start for s in multi.recent_steps)
    _install(multi, "qwen2", new, step_ms, timeline)
    assert not multi.turns.pending and "qwen2" in multi.engines


def test_a_lone_prompt_step_makes_way_for_a_load_turn_and_then_a_newcomers_first_prompt(tiny_dirs, monkeypatch):
    """LONE_SLICED: the only busy model's step of prompts alone is suspended at a layer boundary when a load asks
    for a turn (the turn runs, the step waits in _inflight) and, once resumed, when a model just loaded has its
    first prompt waiting (that prompt runs first); the prompt's tokens are those it gets alone."""
    prompt = list(range(3, 60))  # 57 tokens, one step of prompts alone (budget 64)
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), {"llama": engine(tiny_dirs["llama"], "llama")})
    multi.add_request("long", prompt, GREEDY, model="llama")
    ran = threading.Event()

    def piece() -> None:
        with multi.turns.take():
            ran.set()

    loader = threading.Thread(target=piece)
    loader.start()
    while not multi.turns.is_asked():
        time.sleep(0.001)
    multi._turn_since_step = True  # a turn just ran: this step goes first (one turn per rotation)
    assert multi.step() == []  # the next turn ran inside the prompt's step
    loader.join(5)
    assert ran.is_set() and "llama" in multi._inflight and multi._inflight["llama"].boundaries == 1
    assert [r[0] for r in multi.recent_steps] == ["(load)"]
    # the load is done: the newcomer's first prompt runs before the rest of the long one
    multi.add_model("qwen2", engine(tiny_dirs["qwen2"], "qwen2"), LoadTimeline(start=time.monotonic()))
    multi.add_request("first", "the cat sat on", GREEDY, model="qwen2")
    monkeypatch.setattr(multi, "pick", lambda busy, now: "llama")  # the suspended step resumes first
    outputs = multi.step()
    assert {o.request_id for o in outputs} == {"first"} and "llama" in multi._inflight
    monkeypatch.undo()
    tokens: dict[str, list[int]] = {"long": [], "first": outputs[0].new_token_ids}
    while multi.has_unfinished():
        for o in multi.step():
            tokens[o.request_id] += o.new_token_ids
    assert tokens["long"] == tokens_alone(tiny_dirs["llama"], prompt)


def test_without_lone_slicing_a_load_waits_for_the_whole_prompt_step(tiny_dirs, monkeypatch):
    monkeypatch.setattr(multi_module, "LONE_SLICED", False)
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), {"llama": engine(tiny_dirs["llama"], "llama")})
    multi.add_request("long", list(range(3, 60)), GREEDY, model="llama")
    multi.turns._state = "asked"  # a piece asks right after a turn; the step runs whole, its first token out
    multi._turn_since_step = True
    assert [o.request_id for o in multi.step()] == ["long"] and not multi._inflight


def test_a_load_turn_chains_no_longer_than_the_busy_models_shortest_decode_step(tiny_dirs, monkeypatch):
    engines = {"llama": engine(tiny_dirs["llama"], "llama"), "qwen2": engine(tiny_dirs["qwen2"], "qwen2")}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    busy = ["llama", "qwen2"]
    assert multi._turn_chain_s(busy) == multi_module.LOAD_TURN_CHAIN_S  # no decode step seen yet
    multi._decode_s["llama"] = 0.007
    assert multi._turn_chain_s(busy) == pytest.approx(0.007)  # a model with no decode step yet does not count
    multi._decode_s["qwen2"] = 0.004
    assert multi._turn_chain_s(busy) == pytest.approx(0.004)
    assert multi._turn_chain_s(["llama"]) == pytest.approx(0.007)  # only the busy models
    multi._decode_s["llama"], multi._decode_s["qwen2"] = 0.05, 0.09
    assert multi._turn_chain_s(busy) == multi_module.LOAD_TURN_CHAIN_S  # never longer than the fixed chain
    monkeypatch.setattr(multi_module, "LOAD_TURN_BY_DECODE", False)
    multi._decode_s["qwen2"] = 0.004
    assert multi._turn_chain_s(busy) == multi_module.LOAD_TURN_CHAIN_S


def test_a_debut_step_fits_the_target_beside_the_others_next_step(tiny_dirs):
    engines = {"llama": engine(tiny_dirs["llama"], "llama"), "qwen2": engine(tiny_dirs["qwen2"], "qwen2")}
    multi = MultiEngine(EngineConfig(tbt_goal_ms=0), engines)
    for name in engines:
        multi._step_ms[name] = 100.0
    engines["llama"].last_step = StepStats(num_decode_tokens=1, num_prefill_tokens=0, num_requests=1, duration=0.02)
    # the other model only decodes: the target less its last step (20 ms)
    assert multi._foreign_step_s("qwen2", ["llama", "qwen2"]) == pytest.approx(0.08)
    # a prompt of its own waits for a chunk: its next step may take its share (50 ms)
    engines["llama"].add_request("p", "the cat sat on", GREEDY)
    assert multi._foreign_step_s("qwen2", ["llama", "qwen2"]) == pytest.approx(0.05)
    # a load's turn beside both: never less than one share of three
    engines["llama"].last_step = StepStats(num_decode_tokens=1, num_prefill_tokens=0, num_requests=1, duration=0.09)
    assert multi._foreign_step_s(None, ["llama", "qwen2"]) == pytest.approx(0.1 / 3)
