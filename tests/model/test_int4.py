"""int4 weights: a Q4_1 GGUF's own codes come back exactly, the int4 matmul equals its dequantized weights, and the
bundled model under int4 stays close to float32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from paceline.config import EngineConfig
from paceline.model.llama import INT4_GROUP, Int4Linear, LlamaModel, int4_codes

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="this torch has no CPU int4 matmul")


def _raw_q4_1(path: str, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes [N, K], d and m [N, K/32] of one Q4_1 tensor, read straight from the file's bytes."""
    import gguf

    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    assert tensor.tensor_type.name == "Q4_1"
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    nibbles = blocks[:, 4:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1)  # low nibbles are values 0..15 of a block
    n = tensor.shape[1] if len(tensor.shape) > 1 else 1  # gguf lists dims innermost first
    return codes.reshape(int(n), -1), d.reshape(int(n), -1), m.reshape(int(n), -1)


def test_q4_1_codes_come_back_exactly_from_the_dequantized_gguf():
    from paceline.model.loader import default_model_path, load_gguf

    path = default_model_path()
    weights = load_gguf(path).weights
    for gguf_name, hf_name in [("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                               ("blk.7.attn_v.weight", "model.layers.7.self_attn.v_proj.weight")]:
        codes, d, m = _raw_q4_1(path, gguf_name)
        got_codes, scale, lo = int4_codes(weights[hf_name])
        assert np.array_equal(got_codes.numpy(), codes)
        assert np.array_equal(lo.numpy(), m)
        nonconstant = d > 0
        np.testing.assert_allclose(scale.numpy()[nonconstant], d[nonconstant], rtol=1e-6)


def test_int4_linear_equals_its_dequantized_weight():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 4 * INT4_GROUP, generator=g)
    bias = torch.randn(96, generator=g)
    codes, scale, lo = int4_codes(w)
    deq = (lo[..., None] + codes.view(96, 4, INT4_GROUP) * scale[..., None]).view(96, -1)
    assert (deq - w).abs().max() <= scale.max() / 2 + 1e-6  # round to nearest: within half a step
    lin = Int4Linear(w, bias.to(torch.bfloat16), torch.bfloat16)
    for rows in (1, Int4Linear.DENSE_ABOVE, Int4Linear.DENSE_ABOVE + 1, 40):  # int4 kernel, then the dense copy
        x = torch.randn(rows, 4 * INT4_GROUP, generator=g)
        got = lin(x.to(torch.bfloat16)).float()
        ref = x @ deq.T + bias
        assert ((got - ref).norm() / ref.norm()) < 0.01, rows  # bfloat16 activations and scales


def test_unsupported_int4_settings_are_plain_errors():
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(quantization="int4", dtype="float32")
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="int3")
    assert EngineConfig(quantization="int4").dtype == "bfloat16"
    assert EngineConfig().dtype == "auto"  # resolved when the engine sees the checkpoint and the device


def test_bundled_model_under_int4_stays_close_to_float32():
    from paceline.engine.runner import ModelRunner
    from paceline.model.loader import load_checkpoint

    ckpt = load_checkpoint(None, "float32")
    ids = ckpt.tokenizer.encode("The history of the printing press begins in East Asia, where woodblock "
                                "printing spread long before movable type reached Europe. In the fifteenth century")
    f32 = ModelRunner(LlamaModel.from_weights(ckpt.arch, ckpt.weights), ckpt.arch, 16, 16).prefill_logits(ids)
    q = LlamaModel.from_weights(ckpt.arch, ckpt.weights, dtype=torch.bfloat16, quantization="int4")
    assert isinstance(q.layers[0].gate_up, Int4Linear)
    int4 = ModelRunner(q, ckpt.arch, 16, 16, dtype=torch.bfloat16).prefill_logits(ids)
    # the weights are the same 4-bit values; only bfloat16 activations and scales differ
    agree = (int4.argmax(-1) == f32.argmax(-1)).float().mean()
    cos = torch.nn.functional.cosine_similarity(int4, f32, dim=-1)
    assert agree >= 0.9 and cos.min() > 0.99, (agree, cos.min())


def test_engine_serves_the_bundled_model_under_int4():
    from paceline import LLM, SamplingParams

    llm = LLM(quantization="int4", kv_cache_memory_gb=0.05, swap_space_gb=0)
    assert llm.engine.config.dtype == "bfloat16"
    assert isinstance(llm.engine.runner.model.layers[0].qkv, Int4Linear)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text.strip()
