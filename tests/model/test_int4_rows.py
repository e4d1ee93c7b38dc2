"""Int4Linear's kernel_rows (LlamaModel int4_rows): steps of up to that many rows, float32 (wide) ones included, run
paceline's own int4 op on the 4-bit codes instead of the dense float32 copy; the two agree within the rounding of
the group scales to bfloat16, and larger steps still take the dense copy exactly."""
from __future__ import annotations

import pytest
import torch

from paceline.engine.runner import ModelRunner
from paceline.model import int4_kernel
from paceline.model.llama import Int4Linear, LlamaModel

pytestmark = pytest.mark.skipif(int4_kernel.load() is None, reason="the C++ int4 kernel is not available here")


@pytest.fixture(autouse=True)
def _without_w4a8(monkeypatch):
    """These route rows between the int4 op and the dense copy: the model's linears without the int4 x int8 op,
    which PACELINE_W4A8_LINEARS / llama.W4A8_LINEARS can put on steps of 7 rows and more (test_w4a8.py)."""
    monkeypatch.setenv("PACELINE_W4A8_LINEARS", "")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_kernel_rows_routes_float32_steps_to_the_int4_op():
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g).to(torch.bfloat16)
    dense = Int4Linear(w, bias, torch.bfloat16, wide="fp32")
    kernel = Int4Linear(w, bias, torch.bfloat16, wide="fp32", kernel_rows=32)
    assert dense.kernel_rows == Int4Linear.DENSE_ABOVE and kernel.kernel_rows == 32
    for rows in (Int4Linear.DENSE_ABOVE + 1, 32):
        x = torch.randn(rows, 64, generator=g)
        got = kernel(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 96)
        # the same op the few-row steps use, on float32 input
        torch.testing.assert_close(got, kernel.kernel(x, kernel.packed, 96, kernel.bias))
        assert _rel(got, dense(x)) < 1e-2  # only the bfloat16 group scales differ from the dense copy
    x = torch.randn(33, 64, generator=g)
    torch.testing.assert_close(kernel(x), dense(x), rtol=0, atol=0)  # past kernel_rows: the dense copy


def test_kernel_rows_below_dense_above_change_nothing():
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    assert Int4Linear(w, None, torch.bfloat16, wide="fp32", kernel_rows=3).kernel_rows == Int4Linear.DENSE_ABOVE


def test_int4_rows_model_matches_the_dense_wide_steps(tiny):
    hf = tiny.make_hf_model("llama", hidden_size=64, intermediate_size=128)
    arch = tiny.arch_of(hf)
    weights = {k: v.float() for k, v in hf.state_dict().items()}

    def runner(**kw) -> ModelRunner:
        model = LlamaModel.from_weights(arch, weights, "cpu", torch.bfloat16, quantization="int4", wide_above=4,
                                        wide_linears="fp32", **kw)
        return ModelRunner(model, arch, 64, 4, dtype=torch.bfloat16)

    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    base, fast = runner(int4_rows=0), runner(int4_rows=16)
    assert fast.model.layers[0].gate_up.kernel_rows == 16
    for chunk in (None, 16, 12):  # 40 rows: dense copy; 16 and 12: the int4 op in float32
        got, want = fast.prefill_logits(ids, chunk), base.prefill_logits(ids, chunk)
        assert got.dtype == torch.float32
        assert _rel(got, want) < 0.02, chunk
        if chunk is None:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
