"""Tiny random checkpoints on disk (workers load their model from a path) and a one-thread driver."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from _tiny_checkpoints import tiny_checkpoint

from paceline.model.loader import write_hf_folder


@pytest.fixture(autouse=True)
def _one_thread():
    """Every rank runs one thread (workers are told so); the driver here too, as the issue's target says."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> str:
    """A 2-layer Llama with 4 query / 2 KV heads, as a Hugging Face folder."""
    path = tmp_path_factory.mktemp("tiny-llama")
    write_hf_folder(tiny_checkpoint("llama", seed=3), path)
    return str(path)
