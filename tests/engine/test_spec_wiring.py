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
