"""One rank's model and cache, built the same way in the driver (rank 0) and in each worker."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from paceline.model.arch import ModelArch
from paceline.model.attention import build_metadata
from paceline.model.llama import LlamaModel
from paceline.model.loader import DTYPES
from paceline.parallel.comm import Forward
from paceline.parallel.shard import pp_arch, pp_stages, pp_weights, tp_arch, tp_shards, tp_weights


@dataclass
class ParallelSpec:
    """Everything a worker needs to build its rank; plain values, so it pickles across `spawn`."""
    model: str | None  # what load_checkpoint takes: workers load the checkpoint themselves
    dtype: str = "float32"
    quantization: str = "none"
    device: str = "cpu"  # "cpu" or "cuda" (rank r then uses cuda:r)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_blocks: int = 1
    block_size: int = 16
    num_host_blocks: int = 0
    seed: int = 0
    threads_per_rank: int | None = None  # None: this machine's cores shared evenly over the ranks (workers only)
    timeout_s: float = 600.0  # a collective that waits longer than this fails instead of hanging

    def __post_init__(self) -> None:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp < 1 or pp < 1:
            raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1, got {tp} and {pp}")
        if tp > 1 and pp > 1:
            raise ValueError("tensor and pipeline parallelism together are not supported yet; set one of them to 1")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"parallel execution runs on cpu or cuda, got device {self.device!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def rank_device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device == "cuda" else torch.device("cpu")

    def worker_threads(self) -> int:
        return self.threads_per_rank or max(1, (os.cpu_count() or 1) // self.world_size)


def validate(spec: ParallelSpec, arch: ModelArch) -> None:
    """The ValueError a bad split gives, before any process is started."""
    tp_shards(arch, spec.tensor_parallel_size, spec.quantization)
    pp_stages(arch, spec.pipeline_parallel_size)


def build_rank_model(spec: ParallelSpec, rank: int, arch: ModelArch,
                     weights: dict[str, torch.Tensor]) -> tuple[LlamaModel, ModelArch]:
    """The rank's LlamaModel and the ModelArch it (and its KV cache) has: fewer heads under TP, fewer layers under PP."""
    if spec.tensor_parallel_size > 1:
        shard = tp_shards(arch, spec.tensor_parallel_size, spec.quantization)[rank]
        rank_arch, w = tp_arch(arch, shard), tp_weights(arch, weights, shard, keep_lm_head=rank == 0)
    else:
        layers = pp_stages(arch, spec.pipeline_parallel_size)[rank]
        rank_arch, w = pp_arch(arch, layers), pp_weights(arch, weights, layers, first=rank == 0)
    model = LlamaModel.from_weights(rank_arch, w, device=spec.rank_device(rank), dtype=DTYPES[spec.dtype],
                                    quantization=spec.quantization)
    return model, rank_arch


def stage_forward(model: LlamaModel, kv_cache: torch.Tensor, meta, f: Forward, hidden: torch.Tensor | None,
                  last: bool) -> torch.Tensor:
    """A pipeline stage: LlamaModel.forward over this stage's layers only. The first stage (hidden None) embeds;
    the last one applies the final norm. (LlamaModel.forward does all three at once, so it cannot serve a stage.)"""
    device = model.device
    if hidden is None:
        hidden = F.embedding(torch.tensor(f.ids, dtype=torch.long, device=device), model.embed)
    rope = model.rope[torch.tensor(f.positions, dtype=torch.long, device=device)].unsqueeze(1)
    for i, layer in enumerate(model.layers):
        hidden = layer(hidden, rope, meta, kv_cache[i, 0], kv_cache[i, 1])
    if last:
        hidden = F.rms_norm(hidden, (hidden.shape[-1],), model.norm, model.arch.rms_norm_eps)
    return hidden


def stage_metadata(runner, f: Forward):
    return build_metadata(f.seqs, runner.block_size, runner.device, runner.workspace)
