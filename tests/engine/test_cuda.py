"""The CUDA path. CI has no GPU: there the script that checks it (benchmarks/cuda_check.py) is kept working on CPU;
where torch sees a GPU the same check runs on it, with the runner's CUDA settings."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


def _cuda_check():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "cuda_check.py"
    spec = importlib.util.spec_from_file_location("cuda_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cuda_check_runs_on_cpu(one_torch_thread):
    pytest.importorskip("transformers")
    result = _cuda_check().check_tiny("cpu")
    assert result["ok"], result


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_forward_on_cuda_without_cudnn_attention():
    pytest.importorskip("transformers")
    torch.backends.cuda.enable_cudnn_sdp(True)
    result = _cuda_check().check_tiny("cuda")  # builds a ModelRunner on the device
    assert result["ok"], result
    assert not torch.backends.cuda.cudnn_sdp_enabled()  # the runner turned it off (runner.py says why)
