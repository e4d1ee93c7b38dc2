"""The flags of issue 15's later parts, spelled alike in `serve` and `simulate`: `--level-aging-s`, and `auto` for
`--max-num-seqs` / `--max-num-batched-tokens`."""
import pytest

from paceline.entrypoints.cli import build_parser
from paceline.entrypoints.server import engine_config_from_args


def test_serve_takes_auto_and_level_aging():
    parser = build_parser()
    cfg = engine_config_from_args(parser.parse_args(["serve", "--max-num-seqs", "auto", "--max-num-batched-tokens",
                                                     "auto", "--level-aging-s", "2.5", "--time-slice-tokens", "16"]))
    s = cfg.scheduler
    assert s.auto_max_num_seqs and s.auto_max_num_batched_tokens and s.level_aging_s == 2.5
    assert s.max_step_ms == 120.0  # auto follows the step-time target the TBT goal sets
    fixed = engine_config_from_args(parser.parse_args(["serve", "--max-num-seqs", "12"])).scheduler
    assert fixed.max_num_seqs == 12 and not fixed.auto_max_num_seqs and fixed.level_aging_s == 5.0
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-num-seqs", "many"])


def test_simulate_takes_the_same():
    args = build_parser().parse_args(["simulate", "--max-num-seqs", "auto", "--max-num-batched-tokens", "auto",
                                      "--level-aging-s", "0"])
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.level_aging_s) == ("auto", "auto", 0.0)
