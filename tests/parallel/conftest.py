"""Tiny random checkpoints on disk (workers load their model from a path) and a one-thread driver."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from _tiny_checkpoints import tiny_checkpoint

from paceline.model.loader import write_hf_folder


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every rank runs one thread (workers are told so); the driver here too, as the issue's target says."""


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> str:
    """A 2-layer Llama with 4 query / 2 KV heads, as a Hugging Face folder."""
    path = tmp_path_factory.mktemp("tiny-llama")
    write_hf_folder(tiny_checkpoint("llama", seed=3), path)
    return str(path)
