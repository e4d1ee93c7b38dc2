"""The int8 x int8 linear (w8a8_kernel.py, llama.W8A8Linear, PACELINE_INT4_WIDE=int8): its quantizer and product
against the torch definition and an fp32 reference at odd shapes, a row's result independent of the other rows of
its step (bit for bit), Int4Linear's routing with it, the bundled model's whole step against the bf16 copy, and
the torch fallback where the op cannot build."""
from __future__ import annotations

import pytest
import torch

from paceline.engine.runner import ModelRunner
from paceline.model import int4_kernel, llama, w8a8_kernel
from paceline.model.llama import Int4Linear, LlamaModel, W8A8Linear, int4_wide_choice

HAS_OP = w8a8_kernel.load() is not None
BUILDS = [pytest.param(b, marks=pytest.mark.skipif(
    not HAS_OP or (b == "avx512" and w8a8_kernel.isa() != "avx512"), reason=f"no {b} build of the w8a8 op here"))
    for b in w8a8_kernel.ISAS]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("build", BUILDS)
def test_quantizer_equals_the_definition_exactly(build):
    quantize = w8a8_kernel.load_quantize(build)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 83, generator=g) * 3  # K not a multiple of 16: the masked tail
    x[5] = 0  # a row of zeros: scale 0, codes 0
    s = torch.rand(83, generator=g) + 0.5
    for xin, inv in ((x, None), (x.to(torch.bfloat16), None), (x, s)):
        xq, a, _, _ = quantize(xin, inv, 0)
        xf = xin.float() if inv is None else xin.float() * inv
        amax = xf.abs().amax(1, keepdim=True)
        inv_amax = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        want = torch.round(xf * inv_amax).to(torch.int8)
        assert torch.equal(xq, want) and torch.equal(a, (amax / 127)[:, 0])
        assert int(xq.abs().max()) == 127 and not xq[5].any()


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (17, 576, 1536), (33, 577, 97), (130, 96, 40)])
def test_product_matches_definition_and_fp32(build, m, k, n):
    op = w8a8_kernel.op_for(build)
    g = torch.Generator().manual_seed(m + k + n)
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    wq, cs = w8a8_kernel.quantize_weight(w)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = op(xd, wq, cs, bias, None, 0)
        assert got.dtype == dtype and got.shape == (m, n)
        # the torch definition: the same integer sums, float32 scaling in another order (within a bf16 step)
        torch.testing.assert_close(got.float(), w8a8_kernel.reference(xd, wq, cs, bias).float(),
                                   rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
        # fp32: per-row int8 activations and per-channel int8 weights cost ~1-2 % of the product's norm
        assert _rel(got, xd.float() @ w.T + bias) < 0.03
    # smoothing: x * s against weight columns / s is the same product
    s = torch.rand(k, generator=g) + 0.5
    wq_s, cs_s = w8a8_kernel.quantize_weight(w / s)
    assert _rel(op(x, wq_s, cs_s, bias, s, 0), x @ w.T + bias) < 0.03


@pytest.mark.parametrize("build", BUILDS)
def test_row_result_independent_of_other_rows(build):
    op = w8a8_kernel.op_for(build)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 320, generator=g)
    wq, cs = w8a8_kernel.quantize_weight(w)
    x = torch.randn(45, 320, generator=g).to(torch.bfloat16)
    alone = {t: op(x[7:8], wq, cs, None, None, t) for t in (0, 4)}
    loud = x.clone()
    loud[0] *= 1000  # a row with huge values beside it changes nothing for row 7
    for batch in (x, loud, x[3:20]):
        row = 7 if batch.shape[0] != 17 else 4
        for t in (0, 4):
            assert torch.equal(op(batch, wq, cs, None, None, t)[row], alone[t][0])


@pytest.mark.parametrize("build", BUILDS)
def test_outliers_taken_out_of_each_row(build):
    """The 4 largest |x| of each row leave the int8 product (the quantizer reports them, first index on a tie, and
    scales the rest) and multiply the int8 weight rows in float32: the op equals its torch definition, and a row
    with one huge channel loses far less than without them."""
    quantize, op = w8a8_kernel.load_quantize(build), w8a8_kernel.op_for(build)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(19, 83, generator=g)
    x[:, 10] *= 50  # a large channel, as a transformer's residual stream has
    x[2] = 0  # zeros: nothing taken out changes anything
    xq, a, idx, val = quantize(x, None, 4)
    top = x.abs().topk(4, dim=1)
    for m in (0, 1, 7, 18):
        assert sorted(idx[m, :4].tolist()) == sorted(top.indices[m].tolist())
        assert torch.equal(val[m, :4].abs().sort().values, top.values[m].sort().values)
        rest = x[m].clone()
        rest[idx[m, :4].long()] = 0
        assert torch.equal(a[m], rest.abs().max() / 127)
    assert not xq[2].any() and not val[2].any()
    w, bias = torch.randn(97, 83, generator=g), torch.randn(97, generator=g)
    wq, cs = w8a8_kernel.quantize_weight(w)
    exact = x @ w.T + bias
    for dtype in (torch.float32, torch.bfloat16):
        got = op(x.to(dtype), wq, cs, bias, None, 4)
        torch.testing.assert_close(got.float(), w8a8_kernel.reference(x.to(dtype), wq, cs, bias, None, 4).float(),
                                   rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)
    assert _rel(op(x, wq, cs, bias, None, 4), exact) < 0.5 * _rel(op(x, wq, cs, bias, None, 0), exact)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(x, wq.t().contiguous().t(), cs, bias, None, 4)


def test_w8a8_linear_falls_back_to_torch_when_the_op_is_off(monkeypatch):
    g = torch.Generator().manual_seed(4)
    w, bias = torch.randn(64, 96, generator=g), torch.randn(64, generator=g)
    x = torch.randn(40, 96, generator=g).to(torch.bfloat16)
    monkeypatch.setenv("PACELINE_W8A8_KERNEL", "0")
    lin = W8A8Linear(w, bias, torch.bfloat16)
    assert lin.op is None
    got = lin(x)
    torch.testing.assert_close(got, w8a8_kernel.reference(x, lin.wq, lin.col_scale, lin.bias))
    assert _rel(got, x.float() @ w.T + bias) < 0.03
    if HAS_OP:
        monkeypatch.delenv("PACELINE_W8A8_KERNEL")
        torch.testing.assert_close(W8A8Linear(w, bias, torch.bfloat16)(x).float(), got.float(), rtol=1e-2, atol=1e-3)


def test_int4_wide_choice_int8(monkeypatch):
    monkeypatch.delenv("PACELINE_INT4_WIDE", raising=False)
    assert int4_wide_choice("int8") == "int8"
    monkeypatch.setenv("PACELINE_INT4_WIDE", "int8")
    assert int4_wide_choice() == "int8"


@pytest.mark.skipif(int4_kernel.load() is None, reason="the C++ int4 kernel is not available here")
def test_int4_linear_routes_many_rows_to_w8a8():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 128, generator=g)
    lin = Int4Linear(w, None, torch.bfloat16, kernel_rows=256, w4a8=True, bf16_from=24, dense="int8")
    assert isinstance(lin.dense, W8A8Linear)
    for rows in (3, 23, 24, 100):
        x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        got = lin(x)
        assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
        if rows >= 24:  # the int8 op, exactly; fewer rows the w4a8 or the int4 op
            assert torch.equal(got, lin.dense(x))
        assert _rel(got, x.float() @ w.T) < 0.2  # int4 codes of a random weight: coarse, but the same matrix


@pytest.mark.skipif(int4_kernel.load() is None, reason="the C++ int4 kernel is not available here")
def test_bundled_model_int8_step_close_to_bf16_copy_and_fp32_untouched():
    from paceline.model.loader import load_checkpoint

    ckpt = load_checkpoint(None, "float32")
    ids = ckpt.tokenizer.encode("The history of the printing press begins in East Asia, where woodblock printing "
                                "spread long before movable type reached Europe. In the fifteenth century, a "
                                "goldsmith in Mainz combined a screw press with metal type cast in a hand mould")
    assert len(ids) >= 16  # the int8 op serves it whole (int4_bf16_from=16 below)

    def logits(choice: str) -> torch.Tensor:
        m = LlamaModel.from_weights(ckpt.arch, ckpt.weights, dtype=torch.bfloat16, quantization="int4",
                                    wide_above=None, int4_wide=choice, int4_bf16_from=16)
        assert (m.int4_dense, m.int4_bf16_from) == (choice, 16)
        assert isinstance(m.layers[0].gate_up.dense, W8A8Linear if choice == "int8" else llama.Linear)
        # int8 serves o and gate_up (INT4_INT8_LINEARS); qkv and down keep the bf16 copy, from its own row count
        assert isinstance(m.layers[0].qkv.dense, llama.Linear)
        assert m.layers[0].down.bf16_from == (llama.int4_bf16_from_rows() if choice == "int8" else 16)
        return ModelRunner(m, ckpt.arch, 16, 16, dtype=torch.bfloat16).prefill_logits(ids)

    int8, bf16 = logits("int8"), logits("bf16")
    cos = torch.nn.functional.cosine_similarity(int8, bf16, dim=-1)
    agree = (int8.argmax(-1) == bf16.argmax(-1)).float().mean()
    # int8 activations per row cost: 97.28 % top-1 against fp32 on held-out text with 4 outliers a row on o and
    # gate_up (91 % on every linear without them; benchmarks/summaries/w8a8.md)
    assert cos.mean() > 0.975 and cos.min() > 0.9 and agree >= 0.85, (cos.mean(), cos.min(), agree)
    # a float32 model never takes the int8 path
    assert LlamaModel.from_weights(ckpt.arch, ckpt.weights, int4_wide="int8").int4_bf16_from is None


def test_int4_int8_outliers_from_env(monkeypatch):
    monkeypatch.delenv("PACELINE_INT4_INT8_OUTLIERS", raising=False)
    assert llama.int4_int8_outliers() == llama.INT4_INT8_OUTLIERS
    monkeypatch.setenv("PACELINE_INT4_INT8_OUTLIERS", "8")
    assert llama.int4_int8_outliers() == 8
    assert llama.w8a8_build().endswith(":t8")
    for bad in ("9", "-1", "x"):
        monkeypatch.setenv("PACELINE_INT4_INT8_OUTLIERS", bad)
        with pytest.raises(ValueError, match="PACELINE_INT4_INT8_OUTLIERS"):
            llama.int4_int8_outliers()


def test_int4_dense_from_rows_env(monkeypatch):
    monkeypatch.delenv("PACELINE_INT4_DENSE_FROM_ROWS", raising=False)
    assert llama.int4_dense_from_rows("int8") == llama.INT4_INT8_FROM_ROWS
    assert llama.int4_dense_from_rows("bf16") == llama.int4_bf16_from_rows()
    monkeypatch.setenv("PACELINE_INT4_DENSE_FROM_ROWS", "256")  # every dense linear alike, qkv and down included
    assert llama.int4_dense_from_rows("int8") == llama.int4_dense_from_rows("bf16") == llama.int4_bf16_from_rows() == 256
    for bad in ("3", "x", "-5"):
        monkeypatch.setenv("PACELINE_INT4_DENSE_FROM_ROWS", bad)
        with pytest.raises(ValueError, match="PACELINE_INT4_DENSE_FROM_ROWS"):
            llama.int4_dense_from_rows("int8")
