"""Int8 wide steps: Int8Linear (int8 weights per output channel, activations quantized per row at each call) against
F.linear, and a bfloat16 / int4 model whose wide steps run it against the float32 reference, on tiny random models."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paceline.config import EngineConfig
from paceline.engine.runner import ModelRunner
from paceline.model.attention import SeqSlice
from paceline.model.llama import (AUTO_WIDE_LINEARS, OUTLIER_CHANNELS, Calibrating, Int4Linear, Int8Linear, Linear,
                                  LlamaModel, wide_linear)

pytestmark = pytest.mark.skipif(not Int8Linear.supports(torch.zeros(1)), reason="no x86 quantized engine in torch")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("rows", [1, 9, 64])
def test_int8_linear_is_close_to_float32(rows):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g) * 0.1, torch.randn(96, generator=g)
    x = torch.randn(rows, 64, generator=g)
    got = Int8Linear(w, b)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    # 8-bit weights and 7-bit activations: about 1-2 % of the output's norm on Gaussian data
    assert _rel(got, F.linear(x, w, b)) < 0.04
    # any leading shape, as F.linear
    assert torch.equal(Int8Linear(w, b)(x.view(1, rows, 64)).view(rows, 96), got)


def test_int8_linear_row_does_not_depend_on_the_other_rows():
    """Each row is quantized on its own scale: a row with huge values in the same call changes no other row."""
    g = torch.Generator().manual_seed(1)
    lin = Int8Linear(torch.randn(48, 64, generator=g), torch.randn(48, generator=g))
    x = torch.randn(12, 64, generator=g)
    alone = lin(x)
    loud = torch.cat([x[:5], 1e4 * torch.randn(3, 64, generator=g), x[5:]])
    mixed = lin(loud)
    assert torch.equal(mixed[:5], alone[:5]) and torch.equal(mixed[8:], alone[5:])
    assert torch.equal(lin(x[3:4]), alone[3:4])


def test_int8_linear_cannot_saturate_with_8_bit_activations():
    """The worst case for fbgemm's 16-bit pair sums on AVX2: every activation at the top of its range and every
    weight at its largest magnitude, with the same sign. 8-bit activations with 7-bit weights stay exact there
    (8-bit weights would clip each pair at 32767 and lose ~half the output)."""
    k = 256
    w = torch.cat([torch.ones(1, k), -torch.ones(1, k), torch.linspace(-1, 1, k)[None]])
    x = torch.cat([torch.ones(1, k), -torch.ones(1, k), torch.linspace(-1, 1, k).flip(0)[None]])
    assert _rel(Int8Linear(w)(x), F.linear(x, w)) < 0.01


def test_int8_linear_outlier_channels_run_in_float32():
    """A few input channels 100x larger than the rest: with them taken out of the int8 product (chosen from the
    calibration magnitudes) the error falls several times; the chosen ones are the loud ones."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g) * 0.1
    loud = torch.tensor([5, 77, 100])
    x = torch.randn(32, 128, generator=g)
    x[:, loud] *= 100
    ref = F.linear(x, w)
    absmax = x.abs().amax(0)
    plain = _rel(Int8Linear(w, input_absmax=absmax)(x), ref)
    split = Int8Linear(w, input_absmax=absmax, outliers=3)
    assert set(split.outlier_idx.tolist()) == set(loud.tolist())
    assert _rel(split(x), ref) < plain / 3 and _rel(split(x), ref) < 0.01
    # rows stay independent of each other with outliers too (up to float32 rounding: the small float32 matmul's
    # summation order may follow the row count; the int8 part stays bit-equal)
    assert torch.allclose(split(x[7:9]), split(x)[7:9], rtol=1e-5, atol=1e-4)


def test_int8_linear_zero_rows_give_the_bias():
    b = torch.arange(8, dtype=torch.float32)
    got = Int8Linear(torch.randn(8, 16), b)(torch.zeros(3, 16))
    assert torch.equal(got, b.expand(3, 8))


def test_wide_linear_falls_back_to_float32_without_the_engine(monkeypatch):
    w = torch.randn(16, 32)
    stand_in = wide_linear(w, None, True, "int8")
    assert isinstance(stand_in, Calibrating) and isinstance(stand_in.int8(), Int8Linear)
    fp32 = wide_linear(w, None, True, "fp32")
    assert isinstance(fp32, Linear) and fp32.dtype == torch.float32
    monkeypatch.setattr(Int8Linear, "supports", staticmethod(lambda weight: False))
    fallback = wide_linear(w, None, True, "int8")
    assert isinstance(fallback, Linear) and fallback.dtype == torch.float32


def _runner(tiny, hf, dtype=torch.bfloat16, **kw) -> ModelRunner:
    arch = tiny.arch_of(hf)
    weights = {k: v.float() for k, v in hf.state_dict().items()}
    return ModelRunner(LlamaModel.from_weights(arch, weights, "cpu", dtype, **kw), arch, 64, 4, dtype=dtype)


def test_wide_linears_knob(tiny, hf_llama):
    int8 = _runner(tiny, hf_llama, wide_above=4, wide_linears="int8").model
    assert int8.wide_linears == "int8"
    assert isinstance(int8.layers[0].qkv.wide, Int8Linear) and isinstance(int8.lm_head.wide, Int8Linear)
    # `down` stays float32 in int8 mode (token outliers in its input)
    assert type(int8.layers[0].down.wide) is Linear and int8.layers[0].down.wide.dtype == torch.float32
    fp32 = _runner(tiny, hf_llama, wide_above=4, wide_linears="fp32").model
    assert type(fp32.layers[0].down.wide) is Linear and fp32.layers[0].down.wide.dtype == torch.float32
    assert _runner(tiny, hf_llama, wide_above=4).model.wide_linears == AUTO_WIDE_LINEARS
    # no wide steps (a float32 model, or wide_above None): nothing is built for them
    assert _runner(tiny, hf_llama, torch.float32, wide_linears="int8").model.wide_linears is None
    plain = _runner(tiny, hf_llama, wide_above=None, wide_linears="int8").model
    assert plain.wide_linears is None and plain.layers[0].qkv.wide is None
    with pytest.raises(ValueError, match="wide_linears"):
        _runner(tiny, hf_llama, wide_linears="int3")
    with pytest.raises(ValueError, match="wide_linears"):
        EngineConfig(wide_linears="int3")


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_int8_wide_prefill_stays_close_to_float32(tiny, quantization):
    hf = tiny.make_hf_model("llama", hidden_size=64, intermediate_size=128)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _runner(tiny, hf, torch.float32).prefill_logits(ids)
    # int4_rows=0: the wide steps take the int8 / float32 copies (by default the int4 codes serve up to INT4_KERNEL_ROWS)
    fp32_wide = _runner(tiny, hf, quantization=quantization, wide_above=4, wide_linears="fp32", int4_rows=0)
    int8_wide = _runner(tiny, hf, quantization=quantization, wide_above=4, wide_linears="int8", int4_rows=0)
    if quantization == "int4":
        assert isinstance(int8_wide.model.layers[0].gate_up, Int4Linear)
        assert isinstance(int8_wide.model.layers[0].gate_up.dense, Int8Linear)
    for chunk in (None, 16):
        got, fp32_got = int8_wide.prefill_logits(ids, chunk), fp32_wide.prefill_logits(ids, chunk)
        assert got.dtype == torch.float32
        # ~1-2 % per linear compounds over 9 linears of a 64-wide model with large random weights to ~8 % of the
        # logits' norm (measured 7.5-7.7 %); a wrong scale or transposed weight gives ~100 %
        assert _rel(got, fp32_got) < 0.12, chunk
        # random logits over 96 tokens are nearly flat, so argmax is fragile here (the bundled model: test_wide.py)
        assert (got.argmax(-1) == fp32_got.argmax(-1)).float().mean() >= 0.8, chunk
        if quantization == "none":
            assert _rel(got, ref) < 0.12, chunk
    # single tokens stay narrow: the int8 copies never serve them
    assert torch.equal(int8_wide.prefill_logits(ids, 1), fp32_wide.prefill_logits(ids, 1))


def test_int8_wide_step_mixing_a_chunk_with_decodes_equals_each_alone(tiny, hf_llama):
    """Per-row activation scales: a request's logits in a wide int8 step do not depend on the others in it."""
    runner = _runner(tiny, hf_llama, wide_above=4, wide_linears="int8")
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 96, (20,), generator=g).tolist()
    b = torch.randint(0, 96, (9,), generator=g).tolist()
    ta, tb = [0, 1, 2, 3, 4], [10, 11, 12]
    runner.forward_tokens(a[:8], list(range(8)), [SeqSlice(0, 8, ta)], [])
    runner.forward_tokens(b[:8], list(range(8)), [SeqSlice(0, 8, tb)], [])
    alone_a = runner.forward_tokens(a[8:], list(range(8, 20)), [SeqSlice(8, 12, ta)], [11])
    mixed = runner.forward_tokens(a[8:] + [b[8]], list(range(8, 20)) + [8],
                                  [SeqSlice(8, 12, ta), SeqSlice(8, 1, tb)], [11, 12])
    assert torch.allclose(mixed[0], alone_a[0], atol=1e-4)


def test_engine_config_reaches_the_model():
    from paceline.config import CacheConfig
    from paceline.engine.engine import Engine

    engine = Engine(EngineConfig(wide_linears="int8", tbt_goal_ms=0, cache=CacheConfig(kv_cache_memory_gb=0.05)))
    model = engine.runner.model
    if model.wide_above is None:
        pytest.skip("this CPU has native bf16 math: no wide steps")
    assert model.wide_linears == "int8" and isinstance(model.lm_head.wide, Int8Linear)
    # the bundled model's layers are int4 (a Q4_1 GGUF): their wide copies are the int8 ones, but for `down`
    assert isinstance(model.layers[0].gate_up.dense, Int8Linear)
    assert model.layers[0].gate_up.dense.outlier_idx.numel() == OUTLIER_CHANNELS
    assert type(model.layers[0].down.dense) is Linear and model.layers[0].down.dense.dtype == torch.float32
