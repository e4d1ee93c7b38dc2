"""LlamaModel against transformers' own implementation, on tiny random Llama / Qwen2 / Mistral models."""
from __future__ import annotations

import pytest
import torch

from paceline.model.llama import LlamaModel, rope_inv_freq
from paceline.engine.runner import ModelRunner


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("kind,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("qwen2", {"num_key_value_heads": 1}),
    ("mistral", {"num_key_value_heads": 1}),
])
def test_logits_match_transformers(kind, overrides, tiny):
    hf = tiny.make_hf_model(kind, seed=3, **overrides)
    ids = torch.randint(0, 96, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    got = tiny.make_runner(hf).prefill_logits(ids)
    ref = _hf_logits(hf, ids)
    assert ref.std() > 0.5  # the logits carry real signal
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_qwen2_biases_matter(tiny):
    hf = tiny.make_hf_model("qwen2", seed=4)
    weights = dict(hf.state_dict())
    weights["model.layers.0.self_attn.k_proj.bias"] = torch.zeros_like(weights["model.layers.0.self_attn.k_proj.bias"])
    arch = tiny.arch_of(hf)
    ids = list(range(20))
    runner = ModelRunner(LlamaModel.from_weights(arch, weights), arch, 16, 4)
    assert (runner.prefill_logits(ids) - _hf_logits(hf, ids)).abs().max() > 1e-3


def test_bfloat16_close_to_float32(tiny):
    hf = tiny.make_hf_model("llama", seed=5)
    ids = list(range(1, 40))
    f32 = tiny.make_runner(hf).prefill_logits(ids)
    bf16 = tiny.make_runner(hf, dtype=torch.bfloat16).prefill_logits(ids)
    assert bf16.dtype == torch.float32  # logits are handed to the sampler in fp32 whatever the model dtype
    assert (bf16 - f32).abs().max() < 0.25
    assert (bf16.argmax(-1) == f32.argmax(-1)).float().mean() > 0.8


def test_unpacked_linear_matches_packed(tiny):
    hf = tiny.make_hf_model("llama", seed=6)
    arch = tiny.arch_of(hf)
    ids = list(range(30))
    a = ModelRunner(LlamaModel.from_weights(arch, hf.state_dict(), pack=False), arch, 16, 4).prefill_logits(ids)
    b = ModelRunner(LlamaModel.from_weights(arch, hf.state_dict(), pack=True), arch, 16, 4).prefill_logits(ids)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_missing_tensor_is_named(tiny):
    hf = tiny.make_hf_model("llama")
    weights = dict(hf.state_dict())
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LlamaModel.from_weights(tiny.arch_of(hf), weights)


def test_untied_model_needs_lm_head(tiny):
    hf = tiny.make_hf_model("llama")
    weights = dict(hf.state_dict())
    del weights["lm_head.weight"]
    with pytest.raises(ValueError, match="lm_head"):
        LlamaModel.from_weights(tiny.arch_of(hf), weights)


def test_unsupported_rope_scaling_is_a_value_error(tiny):
    arch = tiny.arch_of(tiny.make_hf_model("llama"))
    arch.rope_scaling = {"rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(arch)
