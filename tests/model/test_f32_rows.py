"""f32_rows_kernel: float32 products of a few rows on the plain weight. Right to float32 rounding against a float64
reference (K not a multiple of 16, biases, strided rows), a row's output the same bits whatever the other rows of
the call, and the model's plumbing: which Linears keep their plain weight, which steps the op serves, the switch."""
from __future__ import annotations

import pytest
import torch

from paceline.model import f32_rows_kernel, layer_loop
from paceline.model.llama import Linear, LlamaModel, wide_linear
from paceline.model.loader import pack_linears

op = f32_rows_kernel.op()
pytestmark = pytest.mark.skipif(op is None, reason="the float32 few-row op needs AVX-512 and a compiler")


@pytest.mark.parametrize("n,k", [(5, 3), (70, 40), (96, 64), (100, 17), (33, 1536), (130, 576)])
def test_products_match_float64(n, k):
    g = torch.Generator().manual_seed(n * k)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for m in range(0, 7):
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.double().t()
        y = op(x, w, b)
        assert y.shape == (m, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref + b.double(), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(op(x, w, None).double(), ref, atol=1e-4, rtol=1e-5)
        for r in range(m):  # batch-invariant: one row alone gives the same bits
            assert torch.equal(op(x[r:r + 1], w, b)[0], y[r])


def test_strided_rows_and_bad_input():
    w = torch.randn(64, 600)
    x = torch.randn(3, 1200)[:, ::2]  # not unit stride along K: copied first
    torch.testing.assert_close(op(x, w, None), x @ w.t(), atol=1e-4, rtol=1e-5)
    rows = torch.randn(6, 600)[::2]  # row stride 1200
    torch.testing.assert_close(op(rows, w, None), rows @ w.t(), atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), w, None)
    with pytest.raises(RuntimeError, match="K"):
        op(torch.randn(2, 599), w, None)
    with pytest.raises(RuntimeError, match="bias"):
        op(rows, w, torch.randn(63))


def test_linear_keeps_its_plain_weight_and_serves_few_rows_with_the_op(monkeypatch):
    w, b = torch.randn(96, 64), torch.randn(96)
    lin = Linear(w, b)
    assert lin.keep_plain and lin.weight is not None
    calls = []
    real = f32_rows_kernel.op

    def spy():
        calls.append(1)
        return real()

    monkeypatch.setattr(f32_rows_kernel, "op", spy)
    for m in (1, 2, f32_rows_kernel.MAX_ROWS + 1, 9):
        x = torch.randn(m, 64)
        calls.clear()
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)
        assert bool(calls) == (m <= f32_rows_kernel.MAX_ROWS), m
    # copies that serve only wide steps, and non-float32 weights, drop or never keep a plain copy for the op
    assert not wide_linear(w.bfloat16(), None, True, "fp32").keep_plain
    assert not Linear(w.bfloat16()).keep_plain
    # packing later (deferred packing) keeps it too
    late = Linear(w, None, pack=False)
    pack_linears([late])
    assert late.keep_plain and late.weight is not None


def test_switched_off_the_packed_copy_replaces_the_plain_one(monkeypatch):
    monkeypatch.setenv("PACELINE_F32_ROWS", "0")
    lin = Linear(torch.randn(32, 64))
    assert not lin.keep_plain and (lin.packed is None or lin.weight is None)
    assert f32_rows_kernel.build_key() == "off"
    monkeypatch.setenv("PACELINE_F32_ROWS", "yes")
    with pytest.raises(ValueError, match="PACELINE_F32_ROWS"):
        f32_rows_kernel.enabled()


@pytest.mark.skipif(layer_loop.load() is None, reason="the C++ layer loop is not available here")
def test_the_layer_loop_runs_float32_steps_of_few_rows_on_the_op(tiny):
    hf = tiny.make_hf_model("qwen2", hidden_size=64, intermediate_size=128)  # qwen2: q/k/v biases
    model = LlamaModel.from_weights(tiny.arch_of(hf), {k: v.float() for k, v in hf.state_dict().items()})
    loop = layer_loop.for_model(model)
    assert loop is not None
    for rows in range(1, f32_rows_kernel.MAX_ROWS + 1):
        assert loop.paths(rows, torch.float32) == (layer_loop.F32_ROWS,) * 4
    assert loop.paths(f32_rows_kernel.MAX_ROWS + 1, torch.float32) == (layer_loop.DENSE,) * 4


def test_an_unpacked_float32_linear_runs_onednn_on_its_plain_weight(monkeypatch):
    """A Linear not yet packed (deferred packing: a model loaded on demand) runs oneDNN's product on the plain float32
    weight for wide steps (PACELINE_PLAIN_ONEDNN), aten's when switched off; a bfloat16 weight stays on aten's."""
    from paceline.model import llama

    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    with llama.deferred_packing():
        lin = Linear(w, b)
    assert lin.packed is None and lin.onednn_weight() is lin.weight
    x = torch.randn(8, 64)
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[1]) or real(*a))
    got = lin(x)
    assert len(calls) == 1 and calls[0] is lin.weight
    torch.testing.assert_close(got, x @ w.T + b, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(llama, "PLAIN_ONEDNN", False)
    assert lin.onednn_weight() is None and torch.equal(lin(x), torch.nn.functional.linear(x, w, b))
    monkeypatch.setattr(llama, "PLAIN_ONEDNN", True)
    with llama.deferred_packing():
        half = Linear(w.bfloat16(), None)
    assert half.onednn_weight() is None
