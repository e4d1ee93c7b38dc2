"""MultiEngine: several models in one step loop; the model specs and keep-alive spellings; residency sizes."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.engine.engine import Engine
from paceline.engine.model_specs import (FOREVER, ModelSpec, estimate_bytes, load_models_config, parse_keep_alive,
                                         parse_model_flag)
from paceline.engine import multi as multi_module
from paceline.engine.multi import MultiEngine
from paceline.engine import residency
from paceline.model import f32_rows_kernel
from paceline.engine.residency import _build_engine, _pack_slowly, drop_plain_weights, engine_bytes, unpacked_linears
from paceline.sampling import SamplingParams

PROMPTS = ["the cat sat on", "hello there, in the", "a b c d e f", "then the end"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny_dirs and one_torch_thread: conftest.py


def config(path: str, **kw) -> EngineConfig:
    return EngineConfig(model=path, dtype="float32", tbt_goal_ms=0, served_model_name=kw.pop("name", None),
                        cache=CacheConfig(num_blocks=64, block_size=4, swap_space_gb=0),
                        scheduler=SchedulerConfig(**{"max_num_batched_tokens": 16, **kw}))


def run_all(engine, requests: list[tuple[str, str, str | None]], max_tokens: int = 12) -> tuple[dict, list]:
    """Add every (id, prompt, model) at once, step to the end; the token ids per id and the order models ran."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt, model in requests:
        kw = {"model": model} if model is not None else {}
        engine.add_request(rid, prompt, params, **kw)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    order = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        order.append(getattr(engine, "last_model", None))
    return tokens, order


def test_greedy_outputs_per_model_equal_single_model(tiny_dirs):
    single = {}
    for kind, path in tiny_dirs.items():
        single[kind], _ = run_all(Engine(config(path)), [(f"{kind}-{i}", p, None) for i, p in enumerate(PROMPTS)])
    multi = MultiEngine(config(None), {kind: Engine(config(path, name=kind)) for kind, path in tiny_dirs.items()})
    # interleaved arrivals; chunked prefill (16-token budget) and decodes of both models share the loop
    requests = [(f"{kind}-{i}", p, kind) for i, p in enumerate(PROMPTS) for kind in tiny_dirs]
    got, order = run_all(multi, requests)
    for kind in tiny_dirs:
        assert {k: v for k, v in got.items() if k.startswith(kind)} == single[kind]
    assert set(order) == set(tiny_dirs)
    assert not multi.has_unfinished() and multi._owner == {}


def test_busy_models_alternate_step_by_step(tiny_dirs, monkeypatch):
    monkeypatch.setattr(multi_module, "SLICE", False)  # the pick alone (sliced, a due model preempts: test_multi_slice)
    monkeypatch.setattr(multi_module, "LANES", False)  # the rotation's pick (in lanes both run at once)
    multi = MultiEngine(config(None), {kind: Engine(config(path, name=kind)) for kind, path in tiny_dirs.items()})
    _, order = run_all(multi, [("a", "x y", "llama"), ("b", "x y", "qwen2")], max_tokens=10)
    both = order[:2 * 10]  # while both have streams, neither runs twice in a row
    assert all(a != b for a, b in zip(both, both[1:])), order


def test_priority_first_but_waiting_streams_are_not_starved(tiny_dirs):
    multi = MultiEngine(config(None), {kind: Engine(config(path, name=kind, scheduling_policy="priority"))
                                       for kind, path in tiny_dirs.items()})
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    multi.add_request("low", "a b", params, priority=5, model="qwen2")
    multi.add_request("high", "a b", params, priority=0, model="llama")
    multi.risk_s = math.inf  # nothing is ever at risk: strict priority
    picks = [multi.pick(["llama", "qwen2"], 0.0) for _ in range(3)]
    assert picks == ["llama"] * 3
    multi.risk_s = 0.05  # the low-priority model's streams waited past the risk: it runs
    multi._since = {"llama": 1.0, "qwen2": 0.97}
    assert multi.pick(["llama", "qwen2"], 1.0) == "llama"
    assert multi.pick(["llama", "qwen2"], 1.2) == "qwen2"


@pytest.mark.parametrize("sliced", [False, True])
def test_prompt_steps_are_cut_to_their_share_while_another_model_streams(tiny_dirs, monkeypatch, sliced):
    """Unsliced, the scheduler leaves a step of prompts alone uncut (no stream of its model waits on it); beside
    another model's streams it is a gap of theirs, so the loop lowers its token budget to what its share of the
    target fits. Sliced (the default), the other model's streams wait for one layer of it, which the step's whole
    target bounds: cut to that (multi._sliced_budget), not to the share."""
    monkeypatch.setattr(multi_module, "SLICE", sliced)
    monkeypatch.setattr(multi_module, "LANES", False)  # the rotation's budgets (a lane has its own, divided)
    engines = {kind: Engine(config(path, name=kind, max_num_batched_tokens=64)) for kind, path in tiny_dirs.items()}
    for engine in engines.values():  # a step-time model: 1 ms a token; a 20 ms target, 10 ms each for two models
        engine.scheduler.step_time = lambda shape: 1e-3 * shape.num_tokens
        engine.scheduler.config.max_step_ms = 20.0
    multi = MultiEngine(config(None), engines)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    multi.add_request("stream", "a b", params, model="llama")
    while not engines["llama"].scheduler.running or not multi.engines["llama"].scheduler.running[0].num_output_tokens:
        multi.step()
    multi.add_request("long", list(range(5, 65)), SamplingParams(temperature=0.0, max_tokens=2), model="qwen2")
    prompt_steps = []
    while multi.has_unfinished():
        multi.step()
        if multi.last_model == "qwen2" and multi.last_step.num_prefill_tokens:
            prompt_steps.append((multi.last_step.num_prefill_tokens, engines["llama"].has_unfinished()))
    beside = [n for n, streaming in prompt_steps if streaming]
    if sliced:
        assert beside and 10 + 4 < max(beside) <= 20  # its whole target (20 ms) fits 20 tokens; sliced between layers
    else:
        assert beside and max(beside) <= 10 + 4  # its share (10 ms) fits 10 tokens; the cap keeps a block of room
    assert sum(n for n, _ in prompt_steps) >= 60

    # alone again (fresh ids: a repeated prompt would be mostly a prefix-cache hit): its own budget
    multi.add_request("alone", list(range(70, 130)), SamplingParams(temperature=0.0, max_tokens=2), model="qwen2")
    multi.step()
    assert multi.last_step.num_prefill_tokens > 14 and engines["qwen2"].scheduler.config.max_num_batched_tokens == 64


def test_unknown_model_and_duplicate_id_are_plain_errors(tiny_dirs):
    multi = MultiEngine(config(None), {"a": Engine(config(tiny_dirs["llama"], name="a")),
                                       "b": Engine(config(tiny_dirs["qwen2"], name="b"))})
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="not loaded"):
        multi.add_request("r", "hi", params, model="c")
    with pytest.raises(ValueError, match="name the model"):
        multi.add_request("r", "hi", params)
    multi.add_request("r", "hi", params, model="a")
    with pytest.raises(ValueError, match="already in use"):
        multi.add_request("r", "hi", params, model="b")
    with pytest.raises(ValueError, match="in flight"):
        multi.remove_model("a")
    multi.abort("r")
    multi.step()
    assert isinstance(multi.remove_model("a"), Engine) and list(multi.engines) == ["b"]


def test_a_model_loaded_beside_others_serves_unpacked_then_packs_with_the_same_tokens(tiny_dirs):
    want, _ = run_all(Engine(config(tiny_dirs["llama"])), [("r", PROMPTS[0], None)], max_tokens=16)
    engine, _ = _build_engine(config(tiny_dirs["llama"]))  # what the loader thread builds
    linears = unpacked_linears(engine)
    if not linears:
        pytest.skip("nothing to pack: no oneDNN linear packing in this torch build, or the model is not on the CPU")
    assert len(linears) == 4 * engine.arch.num_layers + 1 and all(lin.packed is None for lin in linears)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    engine.add_request("r", PROMPTS[0], params)
    got: list[int] = []
    for _ in range(3):
        got += [t for out in engine.step() for t in out.new_token_ids]
    nices, pauses = [], []
    with pytest.MonkeyPatch.context() as mp:  # its priority and pacing (residency.PACK_NICE, PACK_PAUSE_S)
        mp.setattr(residency, "set_nice", nices.append)
        mp.setattr(residency.time, "sleep", pauses.append)
        _pack_slowly(linears)  # between steps here; in a server, on the packer thread while the engine steps
    assert nices == [residency.PACK_NICE] == [0] and pauses == [residency.PACK_PAUSE_S] * len(linears)
    drop_plain_weights(linears)
    # the packed copy replaces the plain one, except where float32 steps of few rows read it (f32_rows_kernel)
    assert unpacked_linears(engine) == [] and all((lin.weight is None) != lin.keep_plain for lin in linears)
    while engine.has_unfinished():
        got += [t for out in engine.step() for t in out.new_token_ids]
    assert got == want["r"]


def test_estimate_is_close_to_what_a_loaded_model_holds(tiny_dirs):
    cfg = config(tiny_dirs["llama"])
    estimate = estimate_bytes(cfg)
    measured = engine_bytes(Engine(config(tiny_dirs["llama"])))
    assert 0.8 * measured <= estimate <= 1.25 * measured, (estimate, measured)


def test_estimate_counts_the_cpu_weight_copies_only_where_the_model_runs_on_the_cpu(tiny_dirs, monkeypatch):
    cfg = config(tiny_dirs["llama"])
    on_cpu = estimate_bytes(dataclasses.replace(cfg, device="cpu"))
    on_cuda = estimate_bytes(dataclasses.replace(cfg, device="cuda"))
    # the layers' plain float32 copies stay beside the packed ones only where the CPU's f32 rows op builds
    assert on_cuda < on_cpu if f32_rows_kernel.build_key() == "on" else on_cuda == on_cpu
    for available, want in ((True, on_cuda), (False, on_cpu)):  # "auto": CUDA where torch sees it
        monkeypatch.setattr(torch.cuda, "is_available", lambda available=available: available)
        assert estimate_bytes(cfg) == want


@pytest.mark.parametrize("value, seconds", [("5m", 300.0), ("30s", 30.0), ("1h30m", 5400.0), (10, 10.0), ("0", 0.0),
                                            (-1, FOREVER), ("-1m", FOREVER), ("250ms", 0.25), (2.5, 2.5)])
def test_keep_alive_as_ollama_spells_it(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", True, None, "m5"])
def test_bad_keep_alive_is_a_plain_error(value):
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)


def test_model_flags_and_config_file(tmp_path):
    assert parse_model_flag("smol=/models/smol.gguf") == ModelSpec("smol", "/models/smol.gguf")
    assert parse_model_flag("/models/smol.gguf").name == "smol"
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n  - {name: a, path: /x, dtype: float32, pinned: true}\n"
                   "  - {name: b, quantization: int4, keep_alive: 5m, load: lazy, kv_cache_memory_gb: 0.5}\n")
    a, b = load_models_config(cfg)
    assert (a.name, a.path, a.dtype, a.pinned, a.keep_alive) == ("a", "/x", "float32", True, FOREVER)
    assert (b.path, b.quantization, b.keep_alive, b.load) == (None, "int4", 300.0, "lazy")
    base = EngineConfig(cache=CacheConfig(kv_cache_memory_gb=2.0))
    eb = b.engine_config(base)
    assert (eb.quantization, eb.dtype, eb.cache.kv_cache_memory_gb, eb.served_model_name) == ("int4", "bfloat16", 0.5, "b")
    assert base.cache.kv_cache_memory_gb == 2.0  # each model its own copy
    for text, message in (("models: []", "non-empty"), ("models:\n  - {name: a, color: red}", "unknown keys"),
                          ("models:\n  - {name: a}\n  - {name: a}", "two models are named"),
                          ("models:\n  - {name: a, load: sometimes}", "eager or lazy"), ("{: :", "not valid YAML")):
        cfg.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_models_config(cfg)
