"""Fixtures shared by the several-model tests (test_multi_*.py). Nothing here is autouse: a module that wants
one torch thread says so (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`, tests/conftest.py), the other
engine tests keep torch's default."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from _tiny_checkpoints import tiny_checkpoint  # noqa: E402

from paceline.model.loader import write_hf_folder  # noqa: E402


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    """Two tiny random-weight checkpoints as Hugging Face folders: {"llama": path, "qwen2": path}."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for kind, seed in (("llama", 1), ("qwen2", 2)):
        write_hf_folder(tiny_checkpoint(kind, seed=seed), root / kind)
        out[kind] = str(root / kind)
    return out
