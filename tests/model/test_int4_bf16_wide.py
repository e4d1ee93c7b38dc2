"""int4 models' wide bfloat16 steps on a dense bfloat16 copy (llama.INT4_BF16_FROM_ROWS, PACELINE_INT4_WIDE): steps
of that many rows and more read the dequantized codes as a bf16 matrix, fewer keep the int4 op (and the w4a8 op in
between); every route stays within bfloat16 rounding of the float32 product. The bf16 route is forced here
(int4_wide="bf16"), so it runs on any CPU; only the "auto" default depends on the CPU's native bf16 math."""
from __future__ import annotations

import pytest
import torch

from paceline.engine.runner import ModelRunner
from paceline.model import int4_kernel, llama, w4a8_kernel
from paceline.model.llama import (INT4_BF16_FROM_ROWS, int4_bf16_from_rows, INT4_GROUP, W4A8_FROM_ROWS, Int4Linear, Linear, LlamaModel,
                                  int4_codes, int4_wide_choice)

pytestmark = pytest.mark.skipif(int4_kernel.load() is None, reason="the C++ int4 kernel is not available here")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _dequantized(w: torch.Tensor) -> torch.Tensor:
    codes, scale, lo = int4_codes(w)
    n = w.shape[0]
    return (lo[..., None] + codes.view(n, -1, INT4_GROUP) * scale[..., None]).view(n, -1)


def test_rows_route_to_int4_op_w4a8_then_dense_bf16(monkeypatch):
    monkeypatch.setenv("PACELINE_INT4_AMX", "0")  # where it builds, the AMX op takes the w4a8 op's rows: test_int4_amx.py
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(96, 128, generator=g), torch.randn(96, generator=g).to(torch.bfloat16)
    deq = _dequantized(w)
    lin = Int4Linear(w, bias, torch.bfloat16, kernel_rows=256, w4a8=True, bf16_from=16)
    assert lin.bf16_from == 16 and isinstance(lin.dense, Linear) and lin.dense.dtype == torch.bfloat16
    assert (lin.w4a8 is not None) == (w4a8_kernel.load() is not None)  # it serves rows W4A8_FROM_ROWS..15
    for rows in (1, W4A8_FROM_ROWS - 1, W4A8_FROM_ROWS, 15, 16, 40, 300):
        x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        got = lin(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        if rows >= 16:  # the dense bf16 copy, exactly
            torch.testing.assert_close(got, lin.dense(x), rtol=0, atol=0)
        elif rows < W4A8_FROM_ROWS or lin.w4a8 is None:  # the int4 op
            torch.testing.assert_close(got, lin.kernel(x, lin.packed, 96, lin.bias), rtol=0, atol=0)
        ref = x.double() @ deq.double().T + bias.double()
        assert _rel(got, ref) < 0.01, rows  # bfloat16 activations, outputs and (int4 op) scales


def test_bf16_from_at_or_below_w4a8_from_builds_no_w4a8_and_float32_steps_ignore_it():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    lin = Int4Linear(w, None, torch.bfloat16, kernel_rows=256, w4a8=True, bf16_from=W4A8_FROM_ROWS)
    assert lin.w4a8 is None and lin.dense.dtype == torch.bfloat16  # the dense copy serves every row it would
    x = torch.randn(W4A8_FROM_ROWS, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(lin(x), lin.dense(x), rtol=0, atol=0)
    # a model with float32 wide steps (CPUs without bf16 math) keeps its float32 copy: bf16_from does not apply
    wide = Int4Linear(w, None, torch.bfloat16, wide="fp32", kernel_rows=256, bf16_from=16)
    assert wide.bf16_from is None and wide.dense.dtype == torch.float32


def test_int4_wide_choice(monkeypatch):
    monkeypatch.delenv("PACELINE_INT4_WIDE", raising=False)
    monkeypatch.setattr(llama, "cpu_has_bf16_math", lambda: True)
    monkeypatch.setattr(llama, "cpu_has_amx_bf16", lambda: True)  # bf16 tiles: the dense copy before any int8 op
    monkeypatch.setattr(llama, "w4a8_serves_every_row", lambda: True)
    monkeypatch.setattr(llama, "int8_gemm_pays", lambda: True)
    assert int4_wide_choice() == "bf16" and int4_wide_choice("w4a8") == "w4a8"
    monkeypatch.setattr(llama, "cpu_has_amx_bf16", lambda: False)
    monkeypatch.setattr(llama, "w4a8_serves_every_row", lambda: True)  # the w4a8 op's VNNI build, row numerics
    assert int4_wide_choice() == "w4a8" and int4_wide_choice("bf16") == "bf16"
    monkeypatch.setattr(llama, "w4a8_serves_every_row", lambda: False)
    monkeypatch.setattr(llama, "int8_gemm_pays", lambda: False)
    assert int4_wide_choice() == "bf16" and int4_wide_choice("w4a8") == "w4a8"
    monkeypatch.setattr(llama, "int8_gemm_pays", lambda: True)  # AVX512-VNNI and the int8 op's AVX-512 build
    assert int4_wide_choice() == "int8" and int4_wide_choice("bf16") == "bf16"
    monkeypatch.setattr(llama, "cpu_has_bf16_math", lambda: False)
    assert int4_wide_choice() == "w4a8" and int4_wide_choice("bf16") == "bf16"  # forced: any CPU
    monkeypatch.setenv("PACELINE_INT4_WIDE", "bf16")
    assert int4_wide_choice() == "bf16" and int4_wide_choice("auto") == "w4a8"
    monkeypatch.setenv("PACELINE_INT4_WIDE", "fp8")
    with pytest.raises(ValueError, match="PACELINE_INT4_WIDE"):
        int4_wide_choice()


def test_tiny_model_bf16_wide_steps_stay_close_to_float32(tiny):
    hf = tiny.make_hf_model("llama", hidden_size=64, intermediate_size=128)
    arch = tiny.arch_of(hf)
    weights = {k: v.float() for k, v in hf.state_dict().items()}
    # the float32 reference on the same 4-bit values: only the int4 path's own rounding differs from it
    deq = {k: _dequantized(v) if v.dim() == 2 and k.startswith("model.layers.") else v for k, v in weights.items()}
    ref = ModelRunner(LlamaModel.from_weights(arch, deq), arch, 64, 4)

    def runner(int4_wide: str) -> ModelRunner:
        # the threshold pinned: beside the w4a8 op's VNNI build the default starts later than this 40-token prompt
        model = LlamaModel.from_weights(arch, weights, "cpu", torch.bfloat16, quantization="int4", wide_above=None,
                                        int4_wide=int4_wide, int4_bf16_from=INT4_BF16_FROM_ROWS)
        return ModelRunner(model, arch, 64, 4, dtype=torch.bfloat16)

    fast, base = runner("bf16"), runner("w4a8")
    assert fast.model.int4_bf16_from == INT4_BF16_FROM_ROWS and base.model.int4_bf16_from is None
    assert fast.model.layers[0].down.dense.dtype == torch.bfloat16 and base.model.layers[0].down.bf16_from is None
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    for chunk in (None, 20, INT4_BF16_FROM_ROWS, 8, 3):  # dense bf16 rows, w4a8 rows, int4-op rows
        want = ref.prefill_logits(ids, chunk)
        got = fast.prefill_logits(ids, chunk)
        assert _rel(got, want) < 0.03, chunk  # bfloat16 activations (and int8 ones on the w4a8 rows)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9, chunk
    # a float32 model is never touched, and a model with float32 wide steps keeps them
    assert LlamaModel.from_weights(arch, weights, int4_wide="bf16").int4_bf16_from is None
    wide = LlamaModel.from_weights(arch, weights, "cpu", torch.bfloat16, quantization="int4", wide_above=4,
                                   int4_wide="bf16")
    assert wide.int4_bf16_from is None and wide.layers[0].qkv.bf16_from is None


def test_bundled_model_bf16_wide_steps_agree_with_float32_and_generate(monkeypatch):
    from paceline import LLM, SamplingParams
    from paceline.model.loader import load_checkpoint

    ckpt = load_checkpoint(None, "float32")
    ids = ckpt.tokenizer.encode("The history of the printing press begins in East Asia, where woodblock "
                                "printing spread long before movable type reached Europe. In the fifteenth century")
    assert len(ids) >= INT4_BF16_FROM_ROWS
    f32 = ModelRunner(LlamaModel.from_weights(ckpt.arch, ckpt.weights), ckpt.arch, 16, 16).prefill_logits(ids)
    q = LlamaModel.from_weights(ckpt.arch, ckpt.weights, dtype=torch.bfloat16, quantization="int4", wide_above=None,
                                int4_wide="bf16", int4_bf16_from=INT4_BF16_FROM_ROWS)
    assert q.layers[0].gate_up.dense.dtype == torch.bfloat16
    got = ModelRunner(q, ckpt.arch, 16, 16, dtype=torch.bfloat16).prefill_logits(ids)
    agree = (got.argmax(-1) == f32.argmax(-1)).float().mean()
    cos = torch.nn.functional.cosine_similarity(got, f32, dim=-1)
    assert agree >= 0.9 and cos.min() > 0.99, (agree, cos.min())
    # served end to end with the switch forced: a prompt of wide steps, then greedy decodes on the int4 op
    monkeypatch.setenv("PACELINE_INT4_WIDE", "bf16")
    llm = LLM(quantization="int4", kv_cache_memory_gb=0.05, swap_space_gb=0)
    model = llm.engine.runner.model
    if model.wide_linears is None:  # no float32 wide steps on this CPU: the bf16 copy serves the prompt
        assert model.int4_bf16_from == int4_bf16_from_rows()
    prompt = ckpt.tokenizer.decode(ids)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text.strip()
    # the first token is the float32 model's greedy choice at the prompt's end
    assert out.outputs[0].token_ids[0] == int(f32[-1].argmax())


def test_int4_bf16_from_rows_follows_the_cpu(monkeypatch):
    monkeypatch.delenv("PACELINE_INT4_DENSE_FROM_ROWS", raising=False)
    monkeypatch.setattr(llama, "cpu_has_amx_bf16", lambda: True)
    assert llama.int4_bf16_from_rows() == llama.INT4_BF16_FROM_ROWS_AMX
    monkeypatch.setattr(llama, "cpu_has_amx_bf16", lambda: False)
    monkeypatch.setattr(llama.w4a8_kernel, "isa", lambda: "vnni")
    assert llama.int4_bf16_from_rows() == llama.INT4_BF16_FROM_ROWS_VNNI
    monkeypatch.setattr(llama.w4a8_kernel, "isa", lambda: "avx2")
    assert llama.int4_bf16_from_rows() == llama.INT4_BF16_FROM_ROWS
    monkeypatch.setenv("PACELINE_INT4_DENSE_FROM_ROWS", "40")
    assert llama.int4_bf16_from_rows() == 40


def test_amx_steps_of_many_decodes_run_the_dense_copy(monkeypatch):
    """With AMX bf16 tiles a step holding INT4_BF16_FROM_DECODES_AMX decodes runs the dense copy below
    INT4_BF16_FROM_ROWS_AMX rows; a step of prompt rows alone keeps the op (a chat prompt's logits must not depend on
    a prefix-cache hit). Without AMX the decodes change nothing. (Where the AMX int4 op builds it serves those
    steps first: tests/model/test_int4_amx.py; switched off here.)"""
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    monkeypatch.setenv("PACELINE_INT4_AMX", "0")
    monkeypatch.setattr(llama, "cpu_has_amx_bf16", lambda: True)
    amx = Int4Linear(w, None, torch.bfloat16, kernel_rows=256, w4a8=True, bf16_from=llama.INT4_BF16_FROM_ROWS_AMX)
    many = llama.INT4_BF16_FROM_DECODES_AMX
    assert amx.path(many + 5, torch.bfloat16, decodes=many) == "dense"
    assert amx.path(many + 5, torch.bfloat16) != "dense" and amx.path(many + 5, torch.bfloat16, many - 1) != "dense"
    assert amx.path(many, torch.float32, decodes=many) != "dense"  # bf16 steps only
    x = torch.randn(many, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(amx(x, decodes=many), amx.dense(x), rtol=0, atol=0)
    monkeypatch.setattr(llama, "cpu_has_amx_bf16", lambda: False)
    plain = Int4Linear(w, None, torch.bfloat16, kernel_rows=256, w4a8=True, bf16_from=llama.INT4_BF16_FROM_ROWS_AMX)
    assert plain.bf16_decodes_from is None and plain.path(many + 5, torch.bfloat16, decodes=64) != "dense"
