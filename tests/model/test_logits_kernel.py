"""paceline's few-row LM-head op (logits_kernel.py): the float64 product of the bfloat16 inputs within float32
rounding; each row's logits bitwise the same whatever rows share the call (a decode and a verification of the same
position agree exactly); plain errors on bad input; a bfloat16 model on a CPU without bf16 math uses it for few rows
and oneDNN's matmul when it is switched off."""
from __future__ import annotations

import pytest
import torch

from paceline.model import logits_kernel
from paceline.model.llama import LlamaModel, cpu_has_bf16_math

pytestmark = pytest.mark.skipif(logits_kernel.load() is None, reason="the C++ logits kernel is not available here")


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("n,k", [(1, 8), (37, 64), (1001, 576)])
def test_op_equals_float64_product(n, k):
    op = logits_kernel.load()
    w = _bf16(n, k, seed=n)
    for m in (1, 2, 5, 6, 7, 8, 13):
        x = _bf16(m, k, seed=m)
        got = op(x, w)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        ref = x.double() @ w.double().T  # bfloat16 products are exact in float32: only the sums round
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_each_row_is_bitwise_the_same_whatever_rows_share_the_call():
    op = logits_kernel.load()
    w = _bf16(203, 96, seed=1)
    x = _bf16(13, 96, seed=2)
    whole = op(x, w)
    for i in range(13):
        assert torch.equal(op(x[i:i + 1], w)[0], whole[i])
    assert torch.equal(op(x[3:8], w), whole[3:8])
    assert op(x[:0], w).shape == (0, 203)


def test_bad_input_is_a_plain_error():
    op = logits_kernel.load()
    w = _bf16(16, 64, seed=3)
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(torch.randn(2, 64), w)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        op(_bf16(2, 60, seed=4), _bf16(16, 60, seed=5))
    with pytest.raises(RuntimeError, match="K as x's"):
        op(_bf16(2, 32, seed=6), w)
    with pytest.raises(ValueError, match="bfloat16"):
        logits_kernel.FewRowLogits(torch.randn(16, 64), op)


@pytest.mark.skipif(cpu_has_bf16_math(), reason="the op serves CPUs without native bf16 math only")
def test_bf16_model_uses_the_op_for_few_rows_and_onednn_when_switched_off(tiny, hf_llama, monkeypatch):
    arch = tiny.arch_of(hf_llama)
    weights = {k: v.float() for k, v in hf_llama.state_dict().items()}
    fast = LlamaModel.from_weights(arch, weights, "cpu", torch.bfloat16)
    monkeypatch.setenv("PACELINE_LOGITS_KERNEL", "0")
    slow = LlamaModel.from_weights(arch, weights, "cpu", torch.bfloat16)
    assert fast.few_row_logits is not None and slow.few_row_logits is None
    h = _bf16(5, arch.hidden_size, seed=7)
    with torch.inference_mode():
        five = fast.compute_logits(h)
        assert five.dtype == torch.float32
        for i in range(5):  # a one-row decode and row i of a five-row verification: the same logits exactly
            assert torch.equal(fast.compute_logits(h[i:i + 1])[0], five[i])
        # oneDNN rounds its result to bfloat16: the same up to that rounding
        torch.testing.assert_close(five, slow.compute_logits(h), rtol=2 ** -7, atol=1e-2)
        many = _bf16(40, arch.hidden_size, seed=8)  # a wide step: the float32 copy, not the op
        torch.testing.assert_close(fast.compute_logits(many), slow.compute_logits(many))
