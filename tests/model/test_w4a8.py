"""The int4 x int8 op (w4a8_kernel.py): its activation quantizer equals a torch emulation bit for bit, its product
equals the integer emulation of the same quantization within float32 rounding at any shape, rows and layout (the
block numerics of both builds, and the VNNI build's row numerics), a row's result does not depend on the other rows
of its step or the thread count, and Int4Linear / the model serve with it (no dense copy) close to the float
reference, on tiny random models and the bundled one."""
from __future__ import annotations

import pytest
import torch

from paceline.engine.runner import ModelRunner
from paceline.model import int4_kernel, w4a8_kernel
from paceline.model.llama import INT4_GROUP, W4A8_FROM_ROWS, Int4Linear, LlamaModel, int4_codes

pytestmark = pytest.mark.skipif(w4a8_kernel.load() is None, reason="the C++ w4a8 kernel is not available here")

HAS_VNNI = w4a8_kernel.has_vnni()
# every build this CPU can run: the AVX2 one everywhere, the VNNI one where the CPU has it (isa() picks it then)
BUILDS = ["avx2", pytest.param("vnni", marks=pytest.mark.skipif(not HAS_VNNI, reason="this CPU has no AVX512-VNNI"))]


def _quantize(x: torch.Tensor):
    """The op's activation quantization in torch: per row and block of 32, the largest |x| (first of equals) taken
    out (its index `top` and value `xo`, a 0 in its place), then a = max|rest| / 127, xq = round(rest * (127 /
    max|rest|)) half to even, s = a * sum xq (float32 throughout, as the op computes it)."""
    m, k = x.shape
    xb = x.float().reshape(m, k // INT4_GROUP, INT4_GROUP).clone()
    top = xb.abs().argmax(-1)
    xo = xb.gather(-1, top[..., None])[..., 0]
    xb.scatter_(-1, top[..., None], 0.0)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None])
    a = amax / 127
    return xq.to(torch.int8).view(m, k), a, a * xq.sum(-1), top.int(), xo


def _emulate(x, codes, scale, lo, bias=None) -> torch.Tensor:
    """y in float64 from the exact integer dot products of the codes and the quantized activations, plus each
    block's taken-out element times its dequantized weights."""
    xq, a, s, top, xo = _quantize(x)
    n, k = codes.shape
    g = k // INT4_GROUP
    dots = torch.einsum("mgk,ngk->mng", xq.view(-1, g, INT4_GROUP).long(), codes.view(n, g, INT4_GROUP).long())
    y = (dots.double() * scale.double()[None] * a.double()[:, None]).sum(-1) + s.double() @ lo.double().T
    w = (lo[..., None] + codes.view(n, g, INT4_GROUP) * scale[..., None]).double()  # [n, g, 32]
    w_top = w[:, torch.arange(g)[None, :], top.long()]  # [n, m, g]: each row's taken-out input's weights
    y = y + torch.einsum("nmg,mg->mn", w_top, xo.double())
    return y if bias is None else y + bias.double()


def _quantize_row(x: torch.Tensor, topk: int = w4a8_kernel.ROW_TOPK, fmax: int = w4a8_kernel.ROW_FMAX):
    """The row numerics' quantization in torch (float32 as the op computes it): NaNs out (the row's unit u NaN),
    the row's `topk` largest |x| taken out one by one (first of equals; index `tidx`, value `tval`, a 0 in its
    place), A = max|rest|, per block f in 0..fmax the largest with max|block| * 2^f <= A (fmax for an all-zero
    block), xq = round(rest * (127 / A) * 2^f) half to even; u = A / 127 / 2^fmax."""
    m, k = x.shape
    xr = x.float().clone()
    nan = xr.isnan().any(-1)
    xr = torch.where(xr.isnan(), torch.zeros_like(xr), xr)
    tidx, tval = torch.zeros(m, topk, dtype=torch.long), torch.zeros(m, topk)
    for j in range(topk):
        t = xr.abs().argmax(-1)  # the first of equal maxima
        tidx[:, j], tval[:, j] = t, xr.gather(-1, t[:, None])[:, 0]
        xr.scatter_(-1, t[:, None], 0.0)
    amax = xr.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xb = xr.view(m, k // INT4_GROUP, INT4_GROUP)
    bmax = xb.abs().amax(-1)
    f = torch.zeros_like(bmax, dtype=torch.long)
    for step in range(fmax):
        f += ((f == step) & ((bmax == 0) | (bmax * 2.0 ** (step + 1) <= amax[:, None]))).long()
    xq = torch.round(xb * (inv[:, None] * torch.exp2(f.float()))[..., None])
    u = amax / 127 / 2.0 ** fmax
    u = torch.where(nan, torch.full_like(u, float("nan")), u)
    return xq.long(), fmax - f, u, tidx, tval


def _emulate_row(x, codes, scale, lo, bias=None) -> torch.Tensor:
    """y in float64 from the row numerics: u * sum_b (c_b * 2^sh_b * d + m * S_b) with the exact integer block dot
    products c_b and sums, plus each taken-out input times its dequantized weights."""
    xq, sh, u, tidx, tval = _quantize_row(x)
    n, k = codes.shape
    g = k // INT4_GROUP
    dots = torch.einsum("mgk,ngk->mng", xq, codes.view(n, g, INT4_GROUP).long()).double() * torch.exp2(sh.double())[:, None]
    sums = xq.sum(-1).double() * torch.exp2(sh.double())  # S [m, g]
    y = u.double()[:, None] * ((dots * scale.double()[None]).sum(-1) + sums @ lo.double().T)
    w = (lo[..., None] + codes.view(n, g, INT4_GROUP) * scale[..., None]).double().view(n, k)
    y = y + torch.einsum("nmj,mj->mn", w[:, tidx], tval.double())
    return y if bias is None else y + bias.double()


def _emulate_default(x, codes, scale, lo, bias=None) -> torch.Tensor:
    """The emulation of the numerics the default op (w4a8_kernel.op()) runs here."""
    return (_emulate_row if w4a8_kernel.numerics() == "row" else _emulate)(x, codes, scale, lo, bias)


def _weight(n: int, k: int, seed: int):
    return int4_codes(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("build", BUILDS)
def test_quantizer_equals_the_emulation_exactly(build):
    quantize = w4a8_kernel.load_quantize(build)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 288, generator=g) * 4
    x[3, :32] = 0  # an all-zero block: scale 0, codes 0
    x[5, 40] = 1e4  # one outlier owns its block's scale
    got, want = quantize(x), _quantize(x)
    assert got[0].dtype == torch.int8 and torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1]) and torch.equal(got[3], want[3]) and torch.equal(got[4], want[4])
    torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-6)  # float32 sums, another order
    assert got[0][3, :32].abs().sum() == 0 and got[1][3, 0] == 0
    assert got[0].abs().max() == 127
    # the outlier is taken out whole: the block's other 31 values keep their own scale
    assert got[3][5, 1] == 8 and got[4][5, 1] == 1e4 and got[0][5, 40] == 0 and got[1][5, 1] < 1


@pytest.mark.parametrize("n,k", [(16, 32), (45, 288), (160, 576), (37, 1536)])
@pytest.mark.parametrize("nibbles", [True, False])
@pytest.mark.parametrize("build", BUILDS)
def test_op_equals_the_integer_emulation(n, k, nibbles, build):
    """45 and 37 outputs end in a partial tile; 300 rows span three row chunks of 128; pass widths 1-6 (and the
    VNNI build's 12), and 0: the build's own choice."""
    op = w4a8_kernel.op_for(build, "block")
    codes, scale, lo = _weight(n, k, n * k)
    packed = w4a8_kernel.pack(codes, scale, lo, nibbles)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    g = torch.Generator().manual_seed(k)
    for m in (1, 3, 7, 33, 300):
        x = torch.randn(m, k, generator=g) * 3
        want = _emulate(x, codes, scale, lo, bias)
        for r in ((1, 4, 6) + ((12,) if build == "vnni" else ()) if m < 300 else (0,)):
            got = op(x, packed, n, bias, nibbles, r)
            assert got.dtype == torch.float32 and got.shape == (m, n)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


ROW_ONLY = pytest.mark.skipif(not HAS_VNNI, reason="the row numerics need the VNNI build")


@ROW_ONLY
def test_row_quantizer_emulation_matches_the_benchmark_emulation():
    """quality.py's emulation (w4a8_fake_quant "row k4 f3", which weighed these numerics) is these numerics."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from quality import w4a8_fake_quant

    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(1)) * 3
    x[2, 40] = 300.0
    xq, sh, u, tidx, tval = _quantize_row(x)
    deq = (xq.double() * torch.exp2(sh.double())[..., None]).view(9, -1) * u.double()[:, None]
    deq.scatter_(-1, tidx, tval.double())
    spec = f"row k{w4a8_kernel.ROW_TOPK} f{w4a8_kernel.ROW_FMAX}"
    torch.testing.assert_close(deq, w4a8_fake_quant(x, spec).double(), rtol=1e-6, atol=1e-6)


@ROW_ONLY
@pytest.mark.parametrize("n,k", [(16, 32), (45, 288), (160, 576), (37, 1536)])
@pytest.mark.parametrize("nibbles", [True, False])
def test_row_numerics_equal_their_emulation(n, k, nibbles):
    """Every shape and pass width, float32 and bfloat16 rows; rows of zeros, of fewer nonzero values than the
    taken-out count, with a huge channel, with blocks far below the row's largest (their power-of-two refinement),
    and with a NaN (that row all NaN, the others untouched)."""
    op = w4a8_kernel.op_for("vnni", "row")
    codes, scale, lo = _weight(n, k, n * k + 1)
    packed = w4a8_kernel.pack(codes, scale, lo, nibbles)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
    g = torch.Generator().manual_seed(k + 1)
    for m in (1, 3, 7, 13, 33, 300):
        x = torch.randn(m, k, generator=g) * 3 * torch.rand(1, k, generator=g)
        x[0, k // 2] = 500.0  # a huge channel: taken out
        if m > 2:
            x[1] = 0
            x[2] = 0
            x[2, 5] = -2.0  # fewer nonzero values than ROW_TOPK
        if m > 5:
            x[3, :k // 2] *= 1e-3  # blocks 2^-10 of the row's largest: refined by 2^ROW_FMAX at most
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            want = _emulate_row(xd.float(), codes, scale, lo, bias)
            for r in ((0, 1, 5, 12) if m < 300 else (0,)):
                got = op(xd, packed, n, bias, nibbles, r)
                assert got.dtype == dtype and got.shape == (m, n)
                tol = 1e-5 if dtype == torch.float32 else 2 ** -8
                torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    x = torch.randn(5, k, generator=g)
    x[2, 3] = float("nan")
    got = op(x, packed, n, bias, nibbles, 0)
    assert got[2].isnan().all() and not got[[0, 1, 3, 4]].isnan().any()
    torch.testing.assert_close(got[[0, 1, 3, 4]], op(x[[0, 1, 3, 4]], packed, n, bias, nibbles, 0), rtol=0, atol=0)


@ROW_ONLY
def test_row_numerics_rows_do_not_depend_on_the_step_or_the_threads():
    """A row's bits alone equal its bits in any step (speculative decoding scores drafts in one step and relies on
    it), whatever the other rows' taken-out channels (they share per-tile tables) and the thread count."""
    op = w4a8_kernel.op_for("vnni", "row")
    codes, scale, lo = _weight(200, 576, 8)
    packed = w4a8_kernel.pack(codes, scale, lo, True)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(300, 576, generator=g)
    x[::3, 17] *= 40  # most rows share a huge channel, some have their own
    x[5, 400] = 90.0
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            full = op(x.bfloat16(), packed, 200, None, True, 0)
            if nt == 1:
                ref = full
            assert torch.equal(full, ref), nt
            for i in (0, 5, 131, 299):
                assert torch.equal(op(x[i:i + 1].bfloat16(), packed, 200, None, True, 0)[0], ref[i])
                assert torch.equal(op(x[i:i + 9].bfloat16(), packed, 200, None, True, 0)[0], ref[i])
    finally:
        torch.set_num_threads(threads)


def test_numerics_choice_and_switch(monkeypatch):
    """row on the VNNI build, block on the AVX2 build (it has only those); PACELINE_W4A8_NUMERICS=block gives the VNNI
    build the block numerics; row on the AVX2 build and unknown values are plain errors; the two never share a
    library."""
    monkeypatch.delenv("PACELINE_W4A8_NUMERICS", raising=False)
    assert w4a8_kernel.numerics("avx2") == "block"
    assert w4a8_kernel.numerics("vnni") == "row"
    assert w4a8_kernel._library("vnni", "row")[1] != w4a8_kernel._library("vnni", "block")[1]
    monkeypatch.setenv("PACELINE_W4A8_NUMERICS", "block")
    assert w4a8_kernel.numerics("vnni") == "block"
    assert w4a8_kernel.build_key().endswith(":block")
    monkeypatch.setenv("PACELINE_W4A8_NUMERICS", "row")
    with pytest.raises(ValueError, match="needs the VNNI build"):
        w4a8_kernel.numerics("avx2")
    monkeypatch.setenv("PACELINE_W4A8_NUMERICS", "fast")
    with pytest.raises(ValueError, match="PACELINE_W4A8_NUMERICS"):
        w4a8_kernel.numerics()
    with pytest.raises(ValueError, match="not available"):
        w4a8_kernel.build_flags("avx2", "row")


def test_auto_serves_every_int4_row_with_the_op_where_it_runs_the_row_numerics(monkeypatch):
    from paceline.model import llama

    monkeypatch.delenv("PACELINE_INT4_WIDE", raising=False)
    monkeypatch.delenv("PACELINE_W4A8_NUMERICS", raising=False)
    if HAS_VNNI and llama.cpu_has_bf16_math():
        assert llama.w4a8_serves_every_row()
        # with bf16 tiles (AMX) the dense bf16 copy serves the many-row steps instead (INT4_BF16_FROM_ROWS_AMX)
        assert llama.int4_wide_choice() == ("bf16" if llama.cpu_has_amx_bf16() else "w4a8")
    monkeypatch.setenv("PACELINE_W4A8_NUMERICS", "block")  # the dense copies from 72 rows, as before
    assert not llama.w4a8_serves_every_row()
    if llama.cpu_has_bf16_math():
        assert llama.int4_wide_choice() in ("int8", "bf16")


def test_rows_are_independent_and_inputs_may_be_strided_or_bfloat16():
    op = w4a8_kernel.load()
    codes, scale, lo = _weight(64, 576, 3)
    packed = w4a8_kernel.pack(codes, scale, lo, True)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(130, 576, generator=g)
    full = op(x, packed, 64, None, True, 4)
    for i in (0, 77, 129):  # the same bits alone as in any step: a request's result does not depend on its batch
        assert torch.equal(op(x[i:i + 1], packed, 64, None, True, 4)[0], full[i])
    wide = torch.randn(130, 1000, generator=g)
    strided = wide[:, 100:676]
    assert torch.equal(op(strided, packed, 64, None, True, 4), op(strided.contiguous(), packed, 64, None, True, 4))
    got = op(x.to(torch.bfloat16), packed, 64, None, True, 4)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), op(x.to(torch.bfloat16).float(), packed, 64, None, True, 4),
                               rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("nibbles", [True, False])
def test_bfloat16_rows_give_the_float32_bits_rounded(build, nibbles):
    """bfloat16 rows are read in place and the sums written as bfloat16 tile by tile: the bits of the float32 path
    on the same (widened) inputs, then rounded as Tensor.to rounds, at any rows, a partial last tile and a row
    stride; the quantizer alone sees the same activations."""
    op, quantize = w4a8_kernel.op_for(build), w4a8_kernel.load_quantize(build)
    codes, scale, lo = _weight(40, 576, 5)  # 40 outputs: the last tile holds 8
    packed = w4a8_kernel.pack(codes, scale, lo, nibbles)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(6))
    wide = (torch.randn(45, 700, generator=torch.Generator().manual_seed(7)) * 3).to(torch.bfloat16)
    for x in (wide[:1, :576], wide[:13, :576], wide[:, 50:626]):
        want = op(x.float(), packed, 40, bias, nibbles, 0).to(torch.bfloat16)
        got = op(x, packed, 40, bias, nibbles, 0)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
        for q_bf16, q_f32 in zip(quantize(x), quantize(x.float())):
            assert torch.equal(q_bf16, q_f32)


def test_bad_packs_and_inputs_are_plain_errors():
    op = w4a8_kernel.load()
    codes, scale, lo = _weight(32, 64, 5)
    with pytest.raises(ValueError, match="multiple of 32"):
        w4a8_kernel.pack(codes[:, :40], scale, lo, True)
    with pytest.raises(ValueError, match="0..15"):
        w4a8_kernel.pack(codes + 1, scale, lo, True)
    packed = w4a8_kernel.pack(codes, scale, lo, True)
    with pytest.raises(RuntimeError, match="packed"):
        op(torch.randn(2, 64), packed, 32, None, False, 4)  # a nibble pack read as bytes: wrong block size
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(torch.randn(2, 48), packed, 32, None, True, 4)
    with pytest.raises(RuntimeError, match="max_rows"):
        w4a8_kernel.op_for("avx2")(torch.randn(2, 64), packed, 32, None, True, 7)
    with pytest.raises(RuntimeError, match="max_rows"):
        op(torch.randn(2, 64), packed, 32, None, True, -1)
    if HAS_VNNI:
        with pytest.raises(RuntimeError, match="max_rows"):
            w4a8_kernel.op_for("vnni")(torch.randn(2, 64), packed, 32, None, True, 13)


@pytest.mark.skipif(not HAS_VNNI, reason="this CPU has no AVX512-VNNI")
@pytest.mark.parametrize("nibbles", [True, False])
def test_vnni_build_gives_the_avx2_builds_bits(nibbles):
    """The same integer block sums and the same float32 operations lane by lane, in the same order: every output
    bit equal at any pass width, partial tiles, row chunks, outliers and all-zero blocks; and the quantizers too."""
    avx2, vnni = w4a8_kernel.op_for("avx2"), w4a8_kernel.op_for("vnni", "block")
    g = torch.Generator().manual_seed(11)
    for n, k in ((16, 32), (45, 288), (160, 576), (37, 1536)):
        codes, scale, lo = _weight(n, k, n + k)
        packed, bias = w4a8_kernel.pack(codes, scale, lo, nibbles), torch.randn(n, generator=g)
        for m in (1, 5, 13, 130):
            x = torch.randn(m, k, generator=g) * 3
            x[0, :32] = 0
            x[-1, k - 1] = -1e4
            x[m // 2, 3:5] = 9.0  # a tie for the block's largest: the first is taken out in both
            want = avx2(x, packed, n, bias, nibbles, 4)
            for r in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12):
                assert torch.equal(vnni(x, packed, n, bias, nibbles, r), want), (n, k, m, r)
    x = torch.randn(77, 1536, generator=g) * 5
    x[3, 100] = 1e4
    for got, want in zip(w4a8_kernel.load_quantize("vnni")(x), w4a8_kernel.load_quantize("avx2")(x)):
        assert torch.equal(got, want)


@pytest.mark.skipif(not HAS_VNNI, reason="this CPU has no AVX512-VNNI")
def test_vnni_build_writes_bfloat16_as_the_avx2_build_and_torch_round():
    """The VNNI build writes bfloat16 sums straight from its registers (its own rounding), the AVX2 build through
    c10's scalar conversion: the same bits, and Tensor.to's, at ties (to even), overflow (to inf), infinities and
    subnormals; NaN stays NaN. All-zero codes, scales and minimums make y the bias exactly, so the bias picks the
    values rounded; then random bfloat16 rows (step-major quantization of bfloat16 inputs) at several widths."""
    avx2, vnni = w4a8_kernel.op_for("avx2"), w4a8_kernel.op_for("vnni", "block")
    special = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20, float("inf"), float("-inf"),
               3.4028234663852886e38, -3.4028234663852886e38, 1e-40, -1e-40, 0.0, 3.0, -2.5, 65504.0]
    bias = torch.cat([torch.tensor(special), torch.randn(45 - len(special), generator=torch.Generator().manual_seed(9))])
    zero_pack = w4a8_kernel.pack(torch.zeros(45, 64, dtype=torch.long), torch.zeros(45, 2), torch.zeros(45, 2), True)
    x = torch.zeros(13, 64, dtype=torch.bfloat16)
    want = bias.to(torch.bfloat16).expand(13, 45).view(torch.int16)
    for op in (avx2, vnni, w4a8_kernel.op_for("vnni", "row")):
        assert torch.equal(op(x, zero_pack, 45, bias, True, 0).view(torch.int16), want)
    nan_bias = bias.clone()
    nan_bias[7] = float("nan")
    got, ref = vnni(x, zero_pack, 45, nan_bias, True, 0), avx2(x, zero_pack, 45, nan_bias, True, 0)
    assert got[:, 7].isnan().all() and torch.equal(got.view(torch.int16), ref.view(torch.int16))
    g = torch.Generator().manual_seed(12)
    for n, k in ((45, 288), (160, 576), (37, 1536)):
        codes, scale, lo = _weight(n, k, n + k)
        for nibbles in (True, False):
            packed = w4a8_kernel.pack(codes, scale, lo, nibbles)
            for m in (1, 7, 12, 32, 71):
                xb = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
                got = vnni(xb, packed, n, None, nibbles, 0)
                assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16),
                                                                   avx2(xb, packed, n, None, nibbles, 0).view(torch.int16))


def test_isa_choice_and_switch(monkeypatch):
    """vnni only where /proc/cpuinfo says so; PACELINE_W4A8_ISA=avx2 forces the AVX2 build; the two builds never
    share a file or a namespace; bad values and a VNNI build on a CPU without it are plain errors."""
    monkeypatch.delenv("PACELINE_W4A8_ISA", raising=False)
    assert w4a8_kernel.isa() == ("vnni" if HAS_VNNI else "avx2")
    monkeypatch.setenv("PACELINE_W4A8_ISA", "avx2")
    assert w4a8_kernel.isa() == "avx2"
    assert w4a8_kernel._library()[1] == w4a8_kernel._library("avx2")[1] != w4a8_kernel._library("vnni")[1]
    assert "-mavx512vnni" in w4a8_kernel.build_flags("vnni") and not any("512" in f for f in w4a8_kernel.build_flags("avx2"))
    monkeypatch.setenv("PACELINE_W4A8_ISA", "avx512")
    with pytest.raises(ValueError, match="PACELINE_W4A8_ISA"):
        w4a8_kernel.isa()
    monkeypatch.setattr(int4_kernel, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"})
    assert not w4a8_kernel.has_vnni()
    monkeypatch.delenv("PACELINE_W4A8_ISA")
    assert w4a8_kernel.isa() == "avx2"  # an AVX-512 CPU without VNNI (e.g. Skylake-X) runs the AVX2 build
    monkeypatch.setenv("PACELINE_W4A8_ISA", "vnni")
    with pytest.raises(ValueError, match="does not report"):
        w4a8_kernel.isa()
    with pytest.raises(ValueError, match="no AVX512-VNNI"):
        w4a8_kernel.op_for("vnni")


def test_int4_linear_serves_every_row_count_with_the_op_and_no_dense_copy(monkeypatch):
    g = torch.Generator().manual_seed(6)
    w, bias = torch.randn(96, 128, generator=g), torch.randn(96, generator=g).to(torch.bfloat16)
    codes, scale, lo = int4_codes(w)
    deq = (lo[..., None] + codes.view(96, 4, INT4_GROUP) * scale[..., None]).view(96, -1).double()
    assert Int4Linear(w, bias, torch.bfloat16, wide="fp32").w4a8 is None  # models ask by name (W4A8_LINEARS)
    lin = Int4Linear(w, bias, torch.bfloat16, wide="fp32", kernel_rows=256, w4a8=True)
    assert lin.w4a8 is not None and lin.dense is None
    for rows in (1, W4A8_FROM_ROWS - 1, W4A8_FROM_ROWS, 9, 300):  # below W4A8_FROM_ROWS: the int4 op
        x = torch.randn(rows, 128, generator=g)
        want = _emulate_default(x, codes, scale, lo, bias.float())
        got = lin(x)
        if rows >= W4A8_FROM_ROWS:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        else:
            torch.testing.assert_close(got, lin.kernel(x, lin.packed, 96, lin.bias))
        ref = x.double() @ deq.T + bias.double()
        assert float((got.double() - ref).norm() / ref.norm()) < 0.01  # int8 activations: ~0.5 % here
        assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16
    monkeypatch.setenv("PACELINE_W4A8_KERNEL", "0")  # switched off: the int4 op and the dense copy, as before
    off = Int4Linear(w, bias, torch.bfloat16, wide="fp32", kernel_rows=256, w4a8=True)
    assert off.w4a8 is None and off.dense is not None
    x = torch.randn(9, 128, generator=g)
    torch.testing.assert_close(off(x), off.kernel(x, off.packed, 96, off.bias))


def test_tiny_model_with_the_op_stays_close_and_chunks_equal_whole(tiny, monkeypatch):
    hf = tiny.make_hf_model("llama", hidden_size=64, intermediate_size=128)
    arch = tiny.arch_of(hf)
    weights = {k: v.float() for k, v in hf.state_dict().items()}

    def runner(dtype=torch.bfloat16, quantization="int4") -> ModelRunner:
        model = LlamaModel.from_weights(arch, weights, "cpu", dtype, quantization=quantization, wide_above=4,
                                        wide_linears="fp32")
        return ModelRunner(model, arch, 64, 4, dtype=dtype)

    monkeypatch.delenv("PACELINE_W4A8_LINEARS", raising=False)
    assert runner().model.layers[0].qkv.w4a8 is not None  # the default, W4A8_LINEARS: all four
    monkeypatch.setenv("PACELINE_W4A8_LINEARS", "")
    assert runner().model.layers[0].qkv.w4a8 is None  # "": the float32 copy
    monkeypatch.setenv("PACELINE_W4A8_LINEARS", "all")
    fast = runner()
    assert fast.model.layers[0].qkv.w4a8 is not None and fast.model.layers[0].qkv.dense is None
    monkeypatch.setenv("PACELINE_W4A8_KERNEL", "0")
    base = runner()
    assert base.model.layers[0].qkv.w4a8 is None
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = fast.prefill_logits(ids)
    for chunk in (None, 16, 3):  # wide float32 steps, and narrow ones where the base runs bfloat16 activations
        got, want = fast.prefill_logits(ids, chunk), base.prefill_logits(ids, chunk)
        assert float((got - want).norm() / want.norm()) < 0.05, chunk  # int8 vs float32 / bfloat16 rounding
    # a row's linears do not depend on its step, so chunking changes only the attention's float rounding
    torch.testing.assert_close(fast.prefill_logits(ids, 16), whole, rtol=1e-4, atol=1e-4)


def test_w4a8_linears_switch(monkeypatch):
    from paceline.model import llama

    assert llama.w4a8_linears() == llama.W4A8_LINEARS
    monkeypatch.setenv("PACELINE_W4A8_LINEARS", "down:o")
    assert llama.w4a8_linears() == ("down", "o")
    monkeypatch.setenv("PACELINE_W4A8_LINEARS", "all")
    assert llama.w4a8_linears() == llama.ALL_LINEARS
    monkeypatch.setenv("PACELINE_W4A8_LINEARS", "")
    assert llama.w4a8_linears() == ()
    monkeypatch.setenv("PACELINE_W4A8_LINEARS", "qkv,lm_head")
    with pytest.raises(ValueError, match="unknown linear.*lm_head"):
        llama.w4a8_linears()


def test_bundled_model_with_the_op_stays_close_to_float32(monkeypatch):
    from paceline.model.loader import load_checkpoint

    monkeypatch.setenv("PACELINE_W4A8_LINEARS", "all")
    monkeypatch.setenv("PACELINE_INT4_WIDE", "w4a8")  # not a bf16 copy for the wide step (test_int4_bf16_wide.py)
    ckpt = load_checkpoint(None, "float32")
    ids = ckpt.tokenizer.encode("The history of the printing press begins in East Asia, where woodblock "
                                "printing spread long before movable type reached Europe. In the fifteenth century")
    f32 = ModelRunner(LlamaModel.from_weights(ckpt.arch, ckpt.weights), ckpt.arch, 16, 16).prefill_logits(ids)
    q = LlamaModel.from_weights(ckpt.arch, ckpt.weights, dtype=torch.bfloat16, quantization="int4")
    assert q.layers[0].gate_up.w4a8 is not None and q.layers[0].gate_up.dense is None
    runner = ModelRunner(q, ckpt.arch, 16, 16, dtype=torch.bfloat16)
    for chunk in (None, 1):  # one wide step, then one row a step (the decode path)
        got = runner.prefill_logits(ids, chunk)
        agree = (got.argmax(-1) == f32.argmax(-1)).float().mean()
        cos = torch.nn.functional.cosine_similarity(got, f32, dim=-1)
        assert agree >= 0.9 and cos.min() > 0.99, (chunk, agree, cos.min())


def test_op_is_found_once_per_process(monkeypatch):
    """Int4Linear asks for the op on every call of a many-row step: after the first, no source is hashed again."""
    first = w4a8_kernel.op()
    monkeypatch.setattr(w4a8_kernel, "_library", lambda: pytest.fail("op() looked for the library again"))
    assert w4a8_kernel.op() is first and w4a8_kernel.load() is first
