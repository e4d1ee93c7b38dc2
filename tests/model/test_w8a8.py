"""The int8 x int8 linear (w8a8_kernel.py, llama.W8A8Linear, PACELINE_INT4_WIDE=int8): its quantizer and product
against the torch definition and an fp32 reference at odd shapes, a row's result independent of the other rows of
its step (bit for bit), Int4Linear's routing with it, the bundled model's whole step against the bf16 copy, and
the torch fallback where the op cannot build."""
from __future__ import annotations

import pytest
import torch

from paceline.engine.runner import ModelRunner
from paceline.model import fused_kernel, int4_kernel, llama, w8a8_kernel
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


def _first_on_tie_definition(x: torch.Tensor, outliers: int):
    """The quantizer's definition written as its first version ran it: `outliers` times the first index of the
    largest |x| left, taken out (0 in its place); then the rest's scale and codes."""
    xf = x.float().clone()
    idx = torch.zeros(x.shape[0], 8, dtype=torch.int32)
    val = torch.zeros(x.shape[0], 8)
    for m in range(x.shape[0]):
        for t in range(outliers):
            at = int((xf[m].abs() == xf[m].abs().max()).nonzero()[0])
            idx[m, t], val[m, t] = at, xf[m, at]
            xf[m, at] = 0
    amax = xf.abs().amax(1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv).to(torch.int8), (amax / 127)[:, 0], idx, val


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("k", [9, 16, 83, 576])
def test_outlier_search_equals_the_first_version_on_ties(build, k):
    """The threshold search (a candidate pass, then a choice among the few values at or above the threshold) and
    its fallback give the first index on a tie, exactly as the plain search: rows of ties, of zeros, of more
    candidates than the fast path keeps, tails below 16 columns."""
    quantize = w8a8_kernel.load_quantize(build)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(12, k, generator=g)
    x[0, min(3, k - 1)] *= 40
    x[1] = 0
    x[2] = 1.5  # every value tied: more candidates than the fast path keeps
    x[3] = torch.randint(-2, 3, (k,), generator=g).float()  # a few values, many ties among the largest
    x[4, : k // 2] = 0
    x[5, :5] = 9.0  # a tie at the top, and the fifth value equal to the four taken
    x[6] = x[6].abs().round()
    x[7, -1] = 50.0  # the largest value in the last (masked) vector
    for xin in (x, x.to(torch.bfloat16)):
        for t in (0, 1, 4, 8):
            if t >= k:
                continue
            got = quantize(xin, None, t)
            want = _first_on_tie_definition(xin, t)
            for name, a, b in zip(("xq", "a", "idx", "val"), got, want):
                assert torch.equal(a, b), (name, t)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (17, 576, 3072), (33, 83, 74), (131, 96, 40)])
def test_gated_product_matches_definition_and_the_unfused_path(build, m, k, n):
    """silu(gate) * up in the epilogue (n / 2 = 37: a masked tail) against its torch definition; rounded (the
    default) gives the unfused path's bits on the AVX-512 build (silu_mul over the op's bfloat16 product), the
    float32 form stays within bfloat16 rounding of it."""
    op, gated = w8a8_kernel.op_for(build), w8a8_kernel.gated_op_for(build)
    silu_mul = fused_kernel.load().silu_mul if fused_kernel.load() is not None and n % 32 == 0 else None
    g = torch.Generator().manual_seed(m * k + n)
    w, bias = torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g) * 2
    x[:, 1] *= 30
    wq, cs = w8a8_kernel.quantize_weight(w)
    for dtype in (torch.float32, torch.bfloat16):
        for t, b in ((0, None), (4, None), (4, bias)):
            xd = x.to(dtype)
            y = op(xd, wq, cs, b, None, t)
            unfused = (torch.nn.functional.silu(y[:, : n // 2].float()) * y[:, n // 2:].float()).to(dtype)
            for rounded in (True, False):
                got = gated(xd, wq, cs, b, None, t, rounded)
                assert got.dtype == dtype and got.shape == (m, n // 2)
                want = w8a8_kernel.reference_gated(xd, wq, cs, b, None, t, rounded)
                torch.testing.assert_close(got.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 2e-5,
                                           atol=1e-4)
                torch.testing.assert_close(got.float(), unfused.float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-4,
                                           rtol=3e-2 if dtype == torch.bfloat16 else 1e-4)
                if rounded and build == "avx512" and silu_mul is not None:
                    assert torch.equal(got, silu_mul(y))
    with pytest.raises(RuntimeError, match="even N"):
        gated(x, *w8a8_kernel.quantize_weight(torch.randn(n + 1, k, generator=g)), None, None, 0, True)
    assert gated(x[:0], wq, cs, None, None, 4, True).shape == (0, n // 2)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("rounded", [True, False])
def test_gated_row_independent_of_other_rows(build, rounded):
    gated = w8a8_kernel.gated_op_for(build)
    g = torch.Generator().manual_seed(8)
    wq, cs = w8a8_kernel.quantize_weight(torch.randn(192, 320, generator=g))
    x = torch.randn(77, 320, generator=g).to(torch.bfloat16)
    alone = gated(x[9:10], wq, cs, None, None, 4, rounded)[0]
    loud = x.clone()
    loud[0] *= 1000
    for batch, row in ((x, 9), (loud, 9), (x[5:80], 4), (x[9:], 0)):
        assert torch.equal(gated(batch, wq, cs, None, None, 4, rounded)[row], alone)


@pytest.mark.skipif(not HAS_OP or int4_kernel.load() is None, reason="needs the int4 and w8a8 ops")
def test_int4_gate_up_fuses_silu_only_on_the_int8_path(monkeypatch):
    """Int4Linear.gated: the W8A8 steps (>= bf16_from rows, bfloat16) give the fused product, the unfused path's
    bits by default, fewer rows None (the caller's silu_mul); PACELINE_W8A8_FUSED_SILU picks the form for linears
    built afterwards, 0 turns it off, anything else is an error."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(192, 128, generator=g) / 11
    monkeypatch.delenv("PACELINE_W8A8_FUSED_SILU", raising=False)
    lin = Int4Linear(w, None, torch.bfloat16, kernel_rows=256, w4a8=True, bf16_from=24, dense="int8")
    f = fused_kernel.load()
    for rows in (23, 24, 75):
        x = torch.randn(rows, 128, generator=g).to(torch.bfloat16)
        got = lin.gated(x)
        if rows < 24:
            assert got is None
            continue
        assert got.shape == (rows, 96)
        if f is not None and w8a8_kernel.isa() == "avx512":
            assert torch.equal(got, f.silu_mul(lin(x)))
    assert lin.gated(torch.randn(40, 128, generator=g)) is None  # float32 steps never take the int8 path
    monkeypatch.setenv("PACELINE_W8A8_FUSED_SILU", "f32")
    f32 = Int4Linear(w, None, torch.bfloat16, kernel_rows=256, w4a8=True, bf16_from=24, dense="int8")
    x = torch.randn(40, 128, generator=g).to(torch.bfloat16)
    assert not f32.dense.gated_rounded and torch.equal(f32.gated(x), w8a8_kernel.load_gated()(
        x, f32.dense.wq, f32.dense.col_scale, None, None, f32.dense.outliers, False))
    assert llama.w8a8_build().endswith(":silu32")
    monkeypatch.setenv("PACELINE_W8A8_FUSED_SILU", "0")
    off = Int4Linear(w, None, torch.bfloat16, kernel_rows=256, w4a8=True, bf16_from=24, dense="int8")
    assert off.dense.gated_build is None and off.gated(x) is None
    assert llama.w8a8_build().endswith(":nosilu")
    monkeypatch.setenv("PACELINE_W8A8_FUSED_SILU", "yes")
    with pytest.raises(ValueError, match="PACELINE_W8A8_FUSED_SILU"):
        Int4Linear(w, None, torch.bfloat16, kernel_rows=256, w4a8=True, bf16_from=24, dense="int8")


@pytest.mark.skipif(not HAS_OP or int4_kernel.load() is None, reason="needs the int4 and w8a8 ops")
def test_bundled_model_fused_silu_against_unfused(monkeypatch):
    """The bundled model's int8 step with SiLU * up in the epilogue against silu_mul after the op
    (PACELINE_W8A8_FUSED_SILU=0): the default form gives the same logits bit for bit on the AVX-512 build; the
    float32 form reads float32 gate/up values instead of their bf16 rounding, so its logits differ, slightly."""
    from paceline.model.loader import load_checkpoint

    ckpt = load_checkpoint(None, "float32")
    ids = ckpt.tokenizer.encode("A lighthouse keeper on a rocky island kept a journal of every ship that passed, "
                                "noting the weather, the colour of the sea and the songs the sailors sang at night "
                                "while the lamp turned slowly above the dark water and the gulls slept on the rocks")

    def logits(fused: str) -> torch.Tensor:
        monkeypatch.setenv("PACELINE_W8A8_FUSED_SILU", fused)
        m = LlamaModel.from_weights(ckpt.arch, ckpt.weights, dtype=torch.bfloat16, quantization="int4",
                                    wide_above=None, int4_wide="int8", int4_bf16_from=16)
        assert (m.layers[0].gate_up.dense.gated_build is not None) == (fused != "0")
        return ModelRunner(m, ckpt.arch, 16, 16, dtype=torch.bfloat16).prefill_logits(ids)

    default, f32, unfused = logits("1"), logits("f32"), logits("0")
    if w8a8_kernel.isa() == "avx512":
        assert torch.equal(default, unfused)
    assert not torch.equal(f32, unfused)  # the float32 form ran
    cos = torch.nn.functional.cosine_similarity(f32, unfused, dim=-1)
    agree = (f32.argmax(-1) == unfused.argmax(-1)).float().mean()
    # measured 2026-11-24 23:15 UTC: cosine min 0.987 (one position), the rest >= 0.997; top-1 agreement 98 %
    assert cos.mean() > 0.998 and cos.min() > 0.98 and agree >= 0.9, (cos.mean(), cos.min(), agree)


@pytest.mark.skipif(not HAS_OP or w8a8_kernel.isa() != "avx512" or fused_kernel.load() is None,
                    reason="needs the w8a8 op's AVX-512 build and the fused ops")
def test_rounded_gated_silu_equals_silu_mul_for_every_bfloat16_gate():
    """The rounded form's SiLU (its own e^x and division, 16 lanes): for every finite bfloat16 gate value, the
    only gates it sees in a bf16 step, silu_mul's bits. Gates and ups come in exactly as the bias (zero weights);
    the output in float32 shows silu(g) * u unrounded, so the quotient must match, not just its bf16 rounding."""
    g = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = g[torch.isfinite(g)]
    g = torch.cat([g, torch.zeros((-g.numel()) % 16)])
    i = g.numel()
    gated, silu_mul = w8a8_kernel.gated_op_for("avx512"), fused_kernel.load().silu_mul
    x, wq, cs = torch.ones(1, 16), torch.zeros(16, 2 * i, dtype=torch.int8), torch.ones(2 * i)
    for u in (1.0, -0.7):
        both = torch.cat([g, torch.full((i,), u)])
        assert torch.equal(gated(x, wq, cs, both, None, 0, True)[0], silu_mul(both[None])[0])
