"""Sharded models against the unsharded one, in one process: each rank of a tensor-parallel group runs in a thread
and a barrier stands in for the all-reduce, so the sharding itself is checked apart from torch.distributed."""
from __future__ import annotations

import threading

import pytest
import torch

from paceline.engine.runner import ModelRunner
from paceline.model.arch import ModelArch
from paceline.model.attention import SeqSlice
from paceline.model.llama import LlamaModel
from paceline.model.loader import expected_weight_names
from paceline.parallel.comm import Forward
from paceline.parallel.rank import stage_forward, stage_metadata
from paceline.parallel.shard import even_split, pp_arch, pp_stages, pp_weights, tp_arch, tp_shards, tp_weights

BLOCKS, BS = 24, 4


def random_checkpoint(arch: ModelArch, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    shapes = {"q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h), "o_proj": (h, q),
              "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i), "embed_tokens": (arch.vocab_size, h),
              "lm_head": (arch.vocab_size, h), "norm": (h,)}
    return {n: torch.randn(next(s for k, s in shapes.items() if k in n), generator=g) * 0.2
            + (1.0 if "norm" in n else 0.0) for n in expected_weight_names(arch)}


def arch_with(num_heads: int, num_kv_heads: int, bias: bool = False, layers: int = 3) -> ModelArch:
    return ModelArch("qwen2" if bias else "llama", vocab_size=97, hidden_size=48, intermediate_size=80,
                     num_layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=8,
                     rms_norm_eps=1e-6, max_position_embeddings=128, attention_bias=bias)


class ThreadAllReduce:
    """Sums each rank's tensor in rank order; every rank gets the same sum."""

    def __init__(self, size: int):
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size)

    def __call__(self, rank: int, y: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = y
        self.barrier.wait()
        total = sum(self.parts[1:], self.parts[0].clone())
        self.barrier.wait()  # nobody overwrites a part before everyone has summed
        return total


def tp_runners(arch: ModelArch, weights, size: int) -> list[ModelRunner]:
    reduce = ThreadAllReduce(size)
    runners = []
    for shard in tp_shards(arch, size):
        rank_arch = tp_arch(arch, shard)
        model = LlamaModel.from_weights(rank_arch, tp_weights(arch, weights, shard))
        for layer in model.layers:
            for name in ("o", "down"):
                inner = getattr(layer, name)
                setattr(layer, name, lambda x, inner=inner, r=shard.rank: reduce(r, inner(x)))
        runners.append(ModelRunner(model, rank_arch, BLOCKS, BS))
    return runners


def on_every_rank(runners: list[ModelRunner], fn):
    results: list = [None] * len(runners)
    errors: list = []

    def run(r: int) -> None:
        try:
            results[r] = fn(runners[r])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(runners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_even_split_and_uneven_heads() -> None:
    assert even_split(5, 2) == [(0, 3), (3, 2)]
    assert even_split(96, 2, unit=32) == [(0, 64), (64, 32)]
    shards = tp_shards(arch_with(9, 3), 2)  # SmolLM2-135M's heads
    assert [(s.q_heads, s.kv_heads) for s in shards] == [((0, 6), (0, 2)), ((6, 3), (2, 1))]
    assert pp_stages(arch_with(4, 2, layers=5), 2) == [(0, 2), (2, 3)]  # the extra layer away from rank 0


@pytest.mark.parametrize("bad", [lambda: tp_shards(arch_with(4, 2), 3), lambda: pp_stages(arch_with(4, 2), 4),
                                 lambda: tp_shards(arch_with(4, 2), 2, quantization="int4")])
def test_impossible_splits_are_value_errors(bad) -> None:
    with pytest.raises(ValueError):
        bad()


@pytest.mark.parametrize("heads,kv_heads,bias,size", [(4, 2, False, 2), (6, 3, True, 2), (6, 3, False, 3)])
def test_tensor_parallel_equals_unsharded(heads: int, kv_heads: int, bias: bool, size: int) -> None:
    arch = arch_with(heads, kv_heads, bias)
    weights = random_checkpoint(arch)
    full = ModelRunner(LlamaModel.from_weights(arch, weights), arch, BLOCKS, BS)
    runners = tp_runners(arch, weights, size)
    prompt = [(5 * j + 1) % arch.vocab_size for j in range(23)]
    want = full.prefill_logits(prompt, chunk=6)  # chunked: later chunks read the sharded cache
    for got in on_every_rank(runners, lambda r: r.prefill_logits(prompt, chunk=6)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    want_tokens, want_logits = full.generate_greedy(prompt[:7], 6, first_block=12)
    for tokens, logits in on_every_rank(runners, lambda r: r.generate_greedy(prompt[:7], 6, first_block=12)):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.stack(logits), torch.stack(want_logits), atol=1e-5, rtol=0)
    # each rank's cache holds only its KV heads
    assert [r.kv_cache.shape[-2] for r in runners] == [s.kv_heads[1] for s in tp_shards(arch, size)]


@pytest.mark.parametrize("size", [2, 3])
def test_pipeline_stages_chain_to_the_unsharded_model(size: int) -> None:
    arch = arch_with(4, 2, layers=5)
    weights = random_checkpoint(arch, seed=1)
    full = ModelRunner(LlamaModel.from_weights(arch, weights), arch, BLOCKS, BS)
    stages = []
    for r, layers in enumerate(pp_stages(arch, size)):
        model = LlamaModel.from_weights(pp_arch(arch, layers), pp_weights(arch, weights, layers, first=r == 0))
        stages.append(ModelRunner(model, pp_arch(arch, layers), BLOCKS, BS))
    prompt = [(3 * j + 2) % arch.vocab_size for j in range(17)]
    table = list(range(5))
    got = []
    for start in range(0, len(prompt), 5):  # chunked
        n = min(5, len(prompt) - start)
        f = Forward(prompt[start:start + n], list(range(start, start + n)), [SeqSlice(start, n, table)], [])
        h = None
        for r, stage in enumerate(stages):
            h = stage_forward(stage.model, stage.kv_cache, stage_metadata(stage, f), f, h, last=r == size - 1)
        got.append(stages[0].model.compute_logits(h))
    torch.testing.assert_close(torch.cat(got), full.prefill_logits(prompt, chunk=5), atol=1e-5, rtol=0)
    assert sum(s.kv_cache.shape[0] for s in stages) == arch.num_layers
