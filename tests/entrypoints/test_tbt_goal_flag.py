"""`paceline serve --tbt-goal-ms`: the TBT goal that the default step-time target derives from, as a flag."""
import pytest

from paceline.config import DEFAULT_TBT_GOAL_MS, step_target_ms
from paceline.entrypoints.cli import build_parser
from paceline.entrypoints.server import engine_config_from_args


def config(*flags: str):
    return engine_config_from_args(build_parser().parse_args(["serve", *flags]))


def test_the_step_target_follows_the_tbt_goal_flag_unless_given_itself() -> None:
    assert config().tbt_goal_ms == DEFAULT_TBT_GOAL_MS
    assert config().scheduler.max_step_ms == step_target_ms(DEFAULT_TBT_GOAL_MS)
    assert config("--tbt-goal-ms", "120").scheduler.max_step_ms == step_target_ms(120)
    assert config("--tbt-goal-ms", "0").scheduler.max_step_ms == 0  # no goal: no target
    assert config("--tbt-goal-ms", "120", "--max-step-ms", "50").scheduler.max_step_ms == 50
    # other schedulers have no chunks to cut, whatever the goal
    assert config("--tbt-goal-ms", "120", "--scheduler", "prefill-first").scheduler.max_step_ms == 0


def test_the_short_step_target_follows_the_goal_unless_given() -> None:
    from paceline.config import SHORT_STEP_FRACTION
    assert config().scheduler.short_step_ms == step_target_ms(DEFAULT_TBT_GOAL_MS) * SHORT_STEP_FRACTION
    assert config("--short-step-ms", "40").scheduler.short_step_ms == 40
    assert config("--short-step-ms", "0").scheduler.short_step_ms == 0  # off: every chunk may fill the target
    assert config("--max-step-ms", "150").scheduler.short_step_ms == 0  # a target given by name stays exact


def test_a_negative_tbt_goal_is_a_plain_error() -> None:
    with pytest.raises(ValueError, match="tbt_goal_ms must be >= 0"):
        config("--tbt-goal-ms", "-5")
