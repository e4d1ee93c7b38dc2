"""--speculative-config reaches the engine from serve's flags, `paceline generate` and LLM(...); bad JSON is a plain
ValueError before any model loads."""
from __future__ import annotations

import argparse

import pytest

from paceline.config import EngineConfig
from paceline.entrypoints.cli import build_parser
from paceline.entrypoints.server import add_serve_args, engine_config_from_args
from paceline.spec_config import SpeculativeConfig

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'


def test_serve_flag_reaches_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    config = engine_config_from_args(parser.parse_args(["--speculative-config", NGRAM]))
    assert SpeculativeConfig.parse(config.speculative_config) == SpeculativeConfig("ngram", 3, 3, 1)
    assert engine_config_from_args(parser.parse_args([])).speculative_config is None


def test_generate_takes_the_flag() -> None:
    args = build_parser().parse_args(["generate", "--speculative-config", NGRAM, "hi"])
    assert args.speculative_config == NGRAM


def test_bad_speculative_config_is_a_plain_error() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig(speculative_config="{bad")
    with pytest.raises(ValueError, match="unknown speculative method"):
        EngineConfig(speculative_config={"method": "eagle"})


def test_speculation_counters_reach_prometheus_as_increases() -> None:
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from paceline.engine.metrics import EngineMetrics

    metrics = EngineMetrics("m", step_log=False)

    def stats(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> SimpleNamespace:
        return SimpleNamespace(num_running=0, num_waiting=0, kv_usage=0.0, num_used_blocks=0, num_blocks=1,
                               spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=draft_tokens,
                               spec_decode_num_accepted_tokens=accepted,
                               spec_decode_num_accepted_tokens_per_pos=per_pos)

    metrics.observe_stats(stats(2, 6, 4, [2, 1, 1]))
    metrics.observe_stats(stats(3, 9, 5, [3, 1, 1]))  # running totals: counters take the increase
    text = generate_latest(metrics.registry).decode()
    assert 'paceline:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'paceline:spec_decode_num_draft_tokens_total{model_name="m"} 9.0' in text
    assert 'paceline:spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in text
    assert 'paceline:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 3.0' in text
