"""The serving defaults: a step-time target derived from the TBT goal, and the numeric mode picked by device and file."""
from __future__ import annotations

import logging

import pytest
import torch

from paceline.config import DEFAULT_TBT_GOAL_MS, CacheConfig, EngineConfig, SchedulerConfig, step_target_ms
from paceline.engine.engine import Engine, is_4bit_gguf, numeric_mode
from paceline.model.loader import default_model_path


def test_the_step_target_is_on_by_default_for_stall_free_and_derived_from_the_tbt_goal() -> None:
    assert 0 < step_target_ms(DEFAULT_TBT_GOAL_MS) < DEFAULT_TBT_GOAL_MS
    assert EngineConfig().scheduler.max_step_ms == step_target_ms(DEFAULT_TBT_GOAL_MS)
    assert EngineConfig(tbt_goal_ms=100).scheduler.max_step_ms == step_target_ms(100)
    # given by name, even 0 (off), it stays; other policies have no chunks to cut; a scheduler alone has no goal
    assert EngineConfig(scheduler=SchedulerConfig(max_step_ms=0)).scheduler.max_step_ms == 0
    assert EngineConfig(scheduler=SchedulerConfig(max_step_ms=90)).scheduler.max_step_ms == 90
    assert EngineConfig(scheduler=SchedulerConfig(policy="vllm")).scheduler.max_step_ms == 0
    assert EngineConfig(tbt_goal_ms=0).scheduler.max_step_ms == 0
    assert SchedulerConfig().max_step_ms == 0
    with pytest.raises(ValueError, match="tbt_goal_ms"):
        EngineConfig(tbt_goal_ms=-1)


def test_numeric_mode_auto_is_int4_for_a_4bit_gguf_on_cpu_else_bfloat16() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert is_4bit_gguf(None) and is_4bit_gguf(default_model_path())  # the bundled Q4_1 file
    assert numeric_mode(None, cpu, "auto", "auto") == ("bfloat16", "int4")
    assert numeric_mode(None, cuda, "auto", "auto") == ("bfloat16", "none")  # int4 runs on CPU only
    assert numeric_mode("/some/hf-folder", cpu, "auto", "auto") == ("bfloat16", "none")
    assert numeric_mode(None, cpu, "auto", "none") == ("bfloat16", "none")
    # float32 by name (the exactness reference) is never changed
    config = EngineConfig(dtype="float32")
    assert (config.dtype, config.quantization) == ("float32", "none")
    assert numeric_mode(None, cpu, config.dtype, config.quantization) == ("float32", "none")
    assert EngineConfig(quantization="int4").dtype == "bfloat16"


def test_an_engine_too_small_for_the_start_up_profile_serves_without_the_default_target(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="paceline"):
        engine = Engine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=24)))
    assert engine.config.scheduler.max_step_ms == 0 and engine.scheduler.step_time is None
    assert "no step-time target" in caplog.text
    with pytest.raises(ValueError, match="too small"):  # asked for by name, it is an error
        Engine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=24), scheduler=SchedulerConfig(max_step_ms=100)))


def _fake_start_up_profile(monkeypatch, tmp_path, constant_s: float, median_rel_error: float) -> list[int]:
    """The quick start-up profile (~10-30 s for real) replaced by a constant one, the cache put in tmp_path; the
    list it returns grows by one entry each time a profile is taken."""
    from paceline.core.step_time import FEATURES, ProfiledCostModel

    taken = []

    def quick(runner, vocab_size, block_size, num_blocks, max_len, *rest):
        taken.append(num_blocks)
        return ProfiledCostModel(dict.fromkeys(FEATURES, 0.0) | {"constant": constant_s},
                                 meta={"median_rel_error": median_rel_error})

    monkeypatch.setattr("paceline.engine.profile.quick_step_time_model", quick)
    monkeypatch.setattr("paceline.engine.engine.cache_root", lambda: tmp_path)
    return taken


def test_the_start_up_profile_is_kept_on_disk_per_setup(monkeypatch, tmp_path) -> None:
    taken = _fake_start_up_profile(monkeypatch, tmp_path, 0.01, 0.0)
    config = dict(dtype="float32", cache=CacheConfig(kv_cache_memory_gb=0.05))
    first = Engine(EngineConfig(**config))
    assert len(taken) == 1 and len(list((tmp_path / "step-profiles").glob("*.json"))) == 1
    second = Engine(EngineConfig(**config))  # the same setup: read back, not taken again
    assert len(taken) == 1 and second.scheduler.step_time is not None
    assert first._profile_cache_path() == second._profile_cache_path()
    Engine(EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_gb=0.06)))  # another cache shape
    assert len(taken) == 2
    second._profile_cache_path().write_text("{torn")  # a broken file is profiled again, not an error
    Engine(EngineConfig(**config))
    assert len(taken) == 3


def test_a_start_up_profile_that_fits_badly_serves_but_is_not_cached(monkeypatch, tmp_path) -> None:
    taken = _fake_start_up_profile(monkeypatch, tmp_path, 0.117, 0.7)  # as one taken on a busy machine
    config = dict(dtype="float32", cache=CacheConfig(kv_cache_memory_gb=0.05))
    first = Engine(EngineConfig(**config))
    assert first.scheduler.step_time is not None and not list(tmp_path.glob("step-profiles/*.json"))
    Engine(EngineConfig(**config))  # profiled again rather than read back
    assert len(taken) == 2
