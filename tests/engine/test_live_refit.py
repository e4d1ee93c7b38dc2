"""The engine feeds the steps it runs to its refitted step-time model (core/step_time.LiveStepTime), and steps that
run while the KV pool is still being made resident beside them (a prefault the engine does not pace) train neither
the refit nor the tail factor. Tiny random model,
a profile file (no start-up profiling)."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.core.batch_shape import BatchShape
from paceline.core.step_time import ProfiledCostModel
from paceline.engine.engine import Engine
from paceline.model.loader import write_hf_folder
from paceline.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from _tiny_checkpoints import tiny_checkpoint  # noqa: E402

# priced far above what a tiny model's step costs, so every measured step is "fast" against it
PROFILE = {"constant": 0.05, "requests": 0.001, "prefill_tokens": 0.001, "decodes": 0.001,
           "prefill_attn_pairs": 1e-7, "decode_context": 1e-6, "sampled": 0.0}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    write_hf_folder(tiny_checkpoint("llama", seed=5), path)
    ProfiledCostModel(PROFILE).save(path / "profile.json")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    config = EngineConfig(model=str(path), dtype="float32", device="cpu", cache=CacheConfig(num_blocks=64),
                          step_profile=str(path / "profile.json"),
                          scheduler=SchedulerConfig(max_step_ms=40, max_num_batched_tokens=64, max_model_len=256))
    yield Engine(config)
    torch.set_num_threads(before)


def _run(engine: Engine, n: int, tag: str, max_tokens: int = 8) -> None:
    for i in range(n):
        engine.add_request(f"{tag}{i}", "The capital of France is " * (3 + i),
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def test_steps_feed_the_refit_except_while_the_kv_pool_is_made_resident(engine):
    live = engine.live_step_time
    assert live is not None and engine.scheduler.step_time == live.step_time
    if engine.runner.prefault is not None:
        engine.runner.prefault.join()

    release = threading.Event()
    engine.runner.prefault = threading.Thread(target=release.wait, daemon=True)  # a prefault still running
    engine.runner.prefault.start()
    try:
        _run(engine, 4, "warm")
        assert live.num_samples == 0 and engine.scheduler.step_time_scale == 1.0
    finally:
        release.set()
        engine.runner.prefault.join()

    _run(engine, 6, "live", max_tokens=32)
    assert live.num_samples > 16 and live.num_refits >= 1
    # the tiny model's steps take a few ms against a profile pricing them at 50+ ms: the refit comes down, and the
    # tail factor, trained by the steps with a prompt chunk, falls below 1
    probe = engine.scheduler.step_time
    shape = BatchShape.build([(0, 16)], [40] * 2)
    assert probe(shape) < ProfiledCostModel(PROFILE).step_time(shape) / 1.5
    assert engine.scheduler.step_time_scale < 1.0


def test_a_prefault_the_engine_paces_waits_while_it_steps_and_its_steps_are_learned_from(engine):
    """The engine's own prefault (started under paced_by(engine.prefault_go)) populates only while the engine is
    idle, so steps that run while it is still alive do not share the cores with it and do train the refit."""
    live = engine.live_step_time
    while live.num_samples:  # a fresh window: what this test's steps add is all it holds
        live._x.pop(), live._y.pop()
    saw_closed = []
    release = threading.Event()
    thread = threading.Thread(target=release.wait, daemon=True)
    thread.paced_by = engine.prefault_go  # as populate_in_background marks a thread started under paced_by
    engine.runner.prefault = thread
    thread.start()
    try:
        assert engine.prefault_go.is_set()  # idle: the prefault may run
        engine.add_request("paced", "The capital of France is " * 4,
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        while engine.has_unfinished():
            saw_closed.append(not engine.prefault_go.is_set())
            engine.step()
        assert saw_closed and all(saw_closed)  # held while any request was unfinished
        assert engine.prefault_go.is_set()  # and free again once all were done
        assert live.num_samples >= 8  # learned from although the prefault thread was alive
    finally:
        release.set()
        thread.join()
