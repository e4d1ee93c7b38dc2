"""The fused norm / RoPE / SiLU ops (fused_kernel.py) against torch's eager ops, in float32 and bfloat16, at one row
and at many (threaded) rows; a tiny model runs the same with them as without; bad shapes are plain errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paceline.engine.runner import ModelRunner
from paceline.model import fused_kernel
from paceline.model.llama import LlamaModel

OPS = fused_kernel.load()
pytestmark = pytest.mark.skipif(OPS is None, reason="the fused C++ ops are not available here")


def _tol(dtype: torch.dtype) -> dict:
    # float32: only the order of the sum of squares differs; bfloat16: one rounding of the result
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -8, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_ops_equal_torch_eager(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    h, r = torch.randn(rows, 576, generator=g).to(dtype), torch.randn(rows, 576, generator=g).to(dtype)
    for wdtype in (torch.float32, torch.bfloat16):
        w = torch.randn(576, generator=g).to(wdtype)
        got = OPS.rms_norm(h, w, 1e-5)
        assert got.dtype == dtype and got.shape == h.shape
        torch.testing.assert_close(got.float(), F.rms_norm(h.float(), (576,), w.float(), 1e-5), **_tol(dtype))
        s, x = OPS.add_rms_norm(h, r, w, 1e-5)
        assert torch.equal(s, h + r)  # the residual sum rounded to the input dtype, as `h + r` is
        torch.testing.assert_close(x.float(), F.rms_norm(s.float(), (576,), w.float(), 1e-5), **_tol(dtype))
    gu = torch.randn(rows, 3072, generator=g).to(dtype) * 6  # wide range: exp of large and small arguments
    gate, up = gu.float().chunk(2, -1)
    # bfloat16 on AVX-512: the shorter arithmetic's < 1.3e-4 (fused_kernel.SILU_BF16_AVX512) before the rounding
    tol = _tol(dtype) if dtype == torch.float32 else dict(rtol=2 ** -8 + 2 ** -12, atol=1e-5)
    torch.testing.assert_close(OPS.silu_mul(gu).float(), F.silu(gate) * up, **tol)
    qkv = torch.randn(rows, 960, generator=g).to(dtype)
    pos = torch.randint(0, 4000, (rows,), generator=g)
    freqs = torch.outer(pos.float(), 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
    rope = torch.polar(torch.ones_like(freqs), freqs).unsqueeze(1)  # [T, 1, d/2], as LlamaModel passes it
    ref = torch.view_as_real(torch.view_as_complex(qkv[:, :768].float().view(rows, 12, 32, 2)) * rope)
    got = OPS.rope(qkv, torch.view_as_real(rope), 12, 64)  # row-strided input: the first 12 heads of each row
    assert got.shape == (rows, 12, 64) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.view(rows, 12, 64), **_tol(dtype))


def test_bad_shapes_are_plain_errors():
    with pytest.raises(RuntimeError, match="multiple of 8"):
        OPS.rms_norm(torch.randn(2, 12), torch.randn(12), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        OPS.silu_mul(torch.randn(2, 32).half())
    with pytest.raises(RuntimeError, match="one shape"):
        OPS.add_rms_norm(torch.randn(2, 16), torch.randn(3, 16), torch.randn(16), 1e-5)
    with pytest.raises(RuntimeError, match="rot"):
        OPS.rope(torch.randn(2, 64), torch.randn(2, 16), 1, 64)


@pytest.mark.parametrize("dtype,quantization", [(torch.float32, "none"), (torch.bfloat16, "none"),
                                                (torch.bfloat16, "int4")])
def test_tiny_model_matches_with_and_without_the_ops(tiny, monkeypatch, dtype, quantization):
    hf = tiny.make_hf_model("llama", hidden_size=64, intermediate_size=128)
    arch = tiny.arch_of(hf)
    weights = {k: v.float() for k, v in hf.state_dict().items()}
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("PACELINE_FUSED_KERNEL", flag)
        model = LlamaModel.from_weights(arch, weights, "cpu", dtype, quantization=quantization)
        assert (model.layers[0].fused is not None) == (flag == "1")
        runner = ModelRunner(model, arch, 64, 4, dtype=dtype)
        out[flag] = [runner.prefill_logits(ids, chunk) for chunk in (None, 3)]  # wide, then narrow steps
    for got, want in zip(out["1"], out["0"]):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        else:  # bfloat16 activations: a rounding flipped here and there moves a logit by a few bf16 steps
            assert float((got - want).norm() / want.norm()) < 0.02


def test_no_compiler_means_torch_ops(monkeypatch, tmp_path):
    """Nothing built and no compiler: load() gives None (one warning) and the layers keep torch's ops."""
    from paceline.model import int4_kernel

    monkeypatch.setenv("PACELINE_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(int4_kernel, "_loaded", {})
    assert fused_kernel.load() is None


def test_argmax_rows_equals_torch_argmax():
    """The first index of the largest value per row, a NaN counting as the largest, at any width (tails of fewer
    than 8), on ties, all -inf rows, -0.0 against 0.0, a row stride; the sampler's greedy path uses it."""
    from paceline.model.sampler import greedy_tokens

    g = torch.Generator().manual_seed(0)
    for v in (1, 7, 8, 13, 49152):
        x = torch.randn(33, v, generator=g)
        assert torch.equal(OPS.argmax_rows(x), x.argmax(-1))
    x = torch.randn(6, 50, generator=g)
    x[0, [3, 17, 49]] = 100.0  # ties: the first
    x[1] = float("-inf")
    x[2, [5, 30]] = float("nan")  # NaN wins, the first one
    x[3, 44] = float("nan")  # in the tail
    x[4] = -1.0
    x[4, 9], x[4, 2] = 0.0, -0.0
    x[5, 48] = 1e30  # the largest in the tail
    assert torch.equal(OPS.argmax_rows(x), x.argmax(-1))
    assert OPS.argmax_rows(x).tolist()[:4] == [3, 0, 5, 44]
    wide = torch.randn(4, 300, generator=g)
    assert torch.equal(OPS.argmax_rows(wide[:, 100:200]), wide[:, 100:200].argmax(-1))
    assert torch.equal(greedy_tokens(wide[:, 100:200]), wide[:, 100:200].argmax(-1))
    assert torch.equal(greedy_tokens(wide.double()), wide.double().argmax(-1))  # not float32: torch's
    with pytest.raises(RuntimeError, match="float32"):
        OPS.argmax_rows(wide.to(torch.bfloat16))


def test_bfloat16_silu_mul_is_within_its_error_bound_everywhere():
    """Every bfloat16 gate in [-30, 30) (past both ends of the sigmoid's useful range) against silu(g) * u in
    float64: within one bfloat16 rounding plus the AVX-512 arithmetic's 1.3e-4 (the float32 path's error is far
    smaller, so this holds on every build)."""
    g = torch.arange(-30, 30, 2 ** -8, dtype=torch.float32).bfloat16().unique()
    g = g[: g.numel() // 8 * 8]
    u = torch.full_like(g, 1.5)
    gu = torch.cat([g, u]).view(1, -1)
    got = OPS.silu_mul(gu)[0].double()
    ref = F.silu(g.double()) * 1.5
    rel = ((got - ref).abs() / ref.abs().clamp_min(1e-30))
    assert rel.max() <= 2 ** -8 + 1.3e-4, f"largest relative error {rel.max():.3e} at g={g[rel.argmax()]}"
