"""How a checkpoint is cut across ranks: which heads, MLP columns and layers each rank holds, and its weights.

Everything here works on Hugging Face-named tensors, before LlamaModel.from_weights: a rank's slice is an ordinary
(smaller) checkpoint, and from_weights builds the rank's model from it with a per-rank ModelArch. Slicing whole heads
commutes with from_weights' per-head RoPE row permutation, so the sharded model is the unsharded one, cut.

Tensor parallel (Megatron): q/k/v and gate/up are split by output rows (column-parallel), o and down by input
columns (row-parallel; their partial outputs are summed by one all-reduce each). KV heads are split as evenly as they
go, earlier ranks taking the extra one, and each query head goes with its KV head: so SmolLM2-135M's 9 query / 3 KV
heads run at TP=2 as 6+3 / 2+1 (vLLM requires equal splits; uneven ones cost nothing here but balance).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from paceline.model.arch import ModelArch


def even_split(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """(start, count) of `parts` contiguous pieces of range(n), in whole `unit`s, earlier pieces taking the extra."""
    if n % unit:
        raise ValueError(f"{n} is not a multiple of {unit}")
    units = n // unit
    if parts < 1 or parts > units:
        raise ValueError(f"cannot split {units} units of {unit} into {parts} non-empty parts")
    out, start = [], 0
    for r in range(parts):
        count = (units // parts + (1 if r < units % parts else 0)) * unit
        out.append((start, count))
        start += count
    return out


@dataclass
class TPShard:
    """What rank `rank` of a tensor-parallel group holds."""
    rank: int
    size: int
    q_heads: tuple[int, int]  # (first, count)
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]  # (first, count) of intermediate features


def tp_shards(arch: ModelArch, size: int, quantization: str = "none") -> list[TPShard]:
    """Every rank's part; a ValueError when the model cannot be cut `size` ways."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size > arch.num_kv_heads:
        # more ranks than KV heads would need KV heads replicated across ranks; not done here
        raise ValueError(f"tensor_parallel_size {size} exceeds the model's {arch.num_kv_heads} KV heads")
    group = arch.num_heads // arch.num_kv_heads
    # int4 packs 32 input features per scale: down's input slice must stay whole groups
    unit = 32 if quantization == "int4" else 1
    if arch.intermediate_size % unit or arch.intermediate_size // unit < size:
        raise ValueError(f"intermediate size {arch.intermediate_size} cannot be split {size} ways in groups of {unit}")
    kv = even_split(arch.num_kv_heads, size)
    mlp = even_split(arch.intermediate_size, size, unit)
    return [TPShard(r, size, (kv[r][0] * group, kv[r][1] * group), kv[r], mlp[r]) for r in range(size)]


def tp_arch(arch: ModelArch, shard: TPShard) -> ModelArch:
    """The ModelArch a rank's LlamaModel is built with: its own head counts and MLP width."""
    return dataclasses.replace(arch, num_heads=shard.q_heads[1], num_kv_heads=shard.kv_heads[1],
                               intermediate_size=shard.mlp[1])


def _rows(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return t[first:first + count]


def tp_weights(arch: ModelArch, weights: dict[str, torch.Tensor], shard: TPShard,
               keep_lm_head: bool = True) -> dict[str, torch.Tensor]:
    """The rank's Hugging Face-named tensors. Embedding and norms are replicated (every rank embeds its input);
    keep_lm_head=False replaces an untied LM head by a one-row stand-in on ranks that never compute logits."""
    d = arch.head_dim
    (q0, qn), (k0, kn), (m0, mn) = shard.q_heads, shard.kv_heads, shard.mlp
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        part = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else None
        if part == "q_proj":
            out[name] = _rows(t, q0 * d, qn * d)
        elif part in ("k_proj", "v_proj"):
            out[name] = _rows(t, k0 * d, kn * d)
        elif part == "o_proj":
            out[name] = t[:, q0 * d:(q0 + qn) * d]
        elif part in ("gate_proj", "up_proj"):
            out[name] = _rows(t, m0, mn)
        elif part == "down_proj":
            out[name] = t[:, m0:m0 + mn]
        elif name == "lm_head.weight" and not keep_lm_head:
            out[name] = t[:1]
        else:
            out[name] = t
    return out


def pp_stages(arch: ModelArch, size: int) -> list[tuple[int, int]]:
    """(first layer, count) of each pipeline stage. The first stage also embeds, computes logits and samples
    (and its process runs the scheduler), so the extra layers of an uneven split go to the last stages."""
    if size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {size}")
    if size > arch.num_layers:
        raise ValueError(f"pipeline_parallel_size {size} exceeds the model's {arch.num_layers} layers")
    return [(arch.num_layers - s - c, c) for s, c in reversed(even_split(arch.num_layers, size))]


def pp_arch(arch: ModelArch, layers: tuple[int, int]) -> ModelArch:
    return dataclasses.replace(arch, num_layers=layers[1])


def pp_weights(arch: ModelArch, weights: dict[str, torch.Tensor], layers: tuple[int, int],
               first: bool) -> dict[str, torch.Tensor]:
    """The stage's layers renumbered from 0. Only the first stage embeds and computes logits; the others get
    one-row stand-ins for the embedding and an untied LM head (from_weights wants them, nothing reads them)."""
    start, count = layers
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            if start <= int(i) < start + count:
                out[f"model.layers.{int(i) - start}.{rest}"] = t
        elif name in ("model.embed_tokens.weight", "lm_head.weight") and not first:
            out[name] = t[:1]
        else:
            out[name] = t
    return out
