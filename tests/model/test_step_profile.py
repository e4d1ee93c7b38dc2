"""The start-up profile max_step_ms predicts with, taken on a live runner."""
from __future__ import annotations

import pytest

from paceline.core.batch_shape import BatchShape
from paceline.sim.profile import quick_step_time_model


def test_quick_profile_of_a_runner_predicts_growing_step_times(tiny) -> None:
    runner = tiny.make_runner(tiny.make_hf_model("llama"), num_blocks=1000, block_size=16)
    model = quick_step_time_model(runner, runner.arch.vocab_size, block_size=16, num_blocks=1000,
                                  max_len=runner.arch.max_position_embeddings)
    assert model.meta["num_samples"] >= 8
    small, big = BatchShape.build([(0, 32)]), BatchShape.build([(0, 512)], [128] * 8)
    assert 0 < model.step_time(small) < model.step_time(big)
    with pytest.raises(ValueError, match="too small"):
        quick_step_time_model(runner, runner.arch.vocab_size, block_size=16, num_blocks=48)
