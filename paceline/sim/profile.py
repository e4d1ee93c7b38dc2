"""`paceline profile`: time the real executor over the full grid of batch shapes (engine/profile.py), fit the
step-time model and save it for the simulator (and for the server's --step-profile).
"""
from __future__ import annotations

import platform
import time

from paceline.core.step_time import ProfiledCostModel
from paceline.engine.profile import (BLOCK_SIZE, GridPoint, build_output, few_rows_of, grid,  # noqa: F401  (re-exported)
                                     mask_cost,
                                     quick_step_time_model, time_grid)


def run_profile(out_path: str, model: str | None = None, dtype: str = "float32", quick: bool = False,
                threads: int = 2, repeats: int = 3, max_kv_tokens: int = 12288) -> ProfiledCostModel:
    import torch

    from paceline.engine.engine import resolve_device
    from paceline.engine.runner import ModelRunner
    from paceline.model.llama import LlamaModel
    from paceline.model.loader import DTYPES, load_checkpoint

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    torch.set_num_threads(threads)
    device = resolve_device("auto")
    torch_dtype = DTYPES[dtype]
    ckpt = load_checkpoint(model, dtype)
    arch = ckpt.arch
    net = LlamaModel.from_weights(arch, ckpt.weights, device=device, dtype=torch_dtype)
    num_blocks = max_kv_tokens // BLOCK_SIZE + 64
    runner = ModelRunner(net, arch, num_blocks, BLOCK_SIZE, num_host_blocks=0, device=device, dtype=torch_dtype, seed=0)

    points = grid(quick, max_kv_tokens)
    shapes, times = time_grid(runner, arch.vocab_size, points, repeats, BLOCK_SIZE)

    bytes_per_token = ModelRunner.bytes_per_block(arch, BLOCK_SIZE, torch_dtype) / BLOCK_SIZE
    meta = {"machine": platform.processor() or platform.machine(), "device": str(device), "threads": threads,
            "model": model or "bundled SmolLM2-135M-Instruct", "dtype": dtype, "kv_bytes_per_token": bytes_per_token,
            "quick": quick, "grid": [[p.chunks, p.decode_contexts] for p in points], "times_s": times}
    fitted = ProfiledCostModel.fit(shapes, times, meta, few_rows_of(runner))
    fitted.swap_s_per_block = _swap_time_per_block(bytes_per_token * BLOCK_SIZE)
    fitted.mask_s_per_row = mask_cost(ckpt.tokenizer, arch.vocab_size)
    fitted.save(out_path)
    return fitted


def _swap_time_per_block(block_bytes: float) -> float:
    """A swap is a memory copy of whole blocks; on CPU, host memory to host memory."""
    import torch

    n = 64
    src = torch.empty(int(block_bytes * n) // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return (time.perf_counter() - t0) / 5 / n
