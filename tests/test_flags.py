"""One flag vocabulary: a setting that `serve`, `simulate` and `generate` share is spelled the same in each, old
spellings and scheduler names still work (hidden, with a warning for the names)."""
import argparse

import pytest

from paceline.entrypoints.cli import build_parser
from paceline.entrypoints.server import engine_config_from_args

SHARED = ["--scheduler", "--scheduling-policy", "--max-num-batched-tokens", "--max-num-seqs", "--max-model-len",
          "--block-size", "--kv-cache-memory-gb", "--num-kv-blocks", "--swap-space-gb", "--enable-prefix-caching",
          "--preemption-mode", "--long-prefill-token-threshold", "--max-num-partial-prefills", "--priority-aging-s",
          "--max-batch-wait-ms", "--max-step-ms", "--time-slice-tokens", "--time-slice-ms"]


def options(parser: argparse.ArgumentParser, command: str) -> set[str]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {s for a in sub._actions if a.help is not argparse.SUPPRESS for s in a.option_strings}


def test_serve_and_simulate_spell_the_shared_settings_alike():
    parser = build_parser()
    serve, simulate = options(parser, "serve"), options(parser, "simulate")
    assert [f for f in SHARED if f not in serve] == [] and [f for f in SHARED if f not in simulate] == []
    for shown in (serve, simulate):  # the old spellings are not shown
        assert not shown & {"--swap-space", "--num-blocks", "--no-prefix-caching"}
    assert {"--workload", "--rate", "--num-requests", "--seed", "--ttft-slo", "--tbt-slo", "--output-dir",
            "--no-plots"} <= simulate
    assert "--scheduler" in options(parser, "generate")


def test_old_spellings_still_work():
    parser = build_parser()
    new = engine_config_from_args(parser.parse_args(["serve", "--swap-space-gb", "3", "--scheduler", "prefill-first"]))
    with pytest.warns(FutureWarning, match="now called 'prefill-first'"):
        old = engine_config_from_args(parser.parse_args(["serve", "--swap-space", "3", "--scheduler", "vllm"]))
    assert old == new and new.cache.swap_space_gb == 3.0 and new.scheduler.policy == "prefill-first"
    a = parser.parse_args(["simulate", "--num-kv-blocks", "50", "--no-enable-prefix-caching"])
    b = parser.parse_args(["simulate", "--num-blocks", "50", "--no-prefix-caching"])
    assert (a.num_kv_blocks, a.enable_prefix_caching) == (b.num_kv_blocks, b.enable_prefix_caching) == (50, False)
    with pytest.warns(FutureWarning, match="now called 'stall-free'"):
        assert parser.parse_args(["simulate", "--scheduler", "sarathi"]).scheduler == "stall-free"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--scheduler", "fastest"])


def test_scheduler_names_in_the_config():
    from paceline.config import SchedulerConfig
    assert SchedulerConfig().policy == "stall-free"
    with pytest.warns(FutureWarning):
        assert SchedulerConfig(policy="sarathi").policy == "stall-free"
    with pytest.raises(ValueError, match="unknown scheduler"):
        SchedulerConfig(policy="fastest")
