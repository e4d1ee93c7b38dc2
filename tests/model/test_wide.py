"""Wide steps: a bfloat16 model that runs steps of many tokens in float32 (LlamaModel.wide_above) matches the same
model run all in bfloat16 and the float32 reference, within bfloat16 tolerance, alone and mixed with decodes."""
from __future__ import annotations

import pytest
import torch

from paceline.engine.runner import ModelRunner
from paceline.model.attention import SeqSlice
from paceline.model.llama import WIDE_ABOVE, Int4Linear, LlamaModel, cpu_has_bf16_math


def _runner(tiny, hf, dtype=torch.bfloat16, **kw) -> ModelRunner:
    arch = tiny.arch_of(hf)
    weights = {k: v.float() for k, v in hf.state_dict().items()}
    model = LlamaModel.from_weights(arch, weights, "cpu", dtype, **kw)
    return ModelRunner(model, arch, 64, 4, dtype=dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_auto_turns_wide_steps_on_only_for_bf16_on_a_cpu_without_bf16_math(tiny, hf_llama):
    assert _runner(tiny, hf_llama, torch.float32).model.wide_above is None
    expected = None if cpu_has_bf16_math() else WIDE_ABOVE
    assert _runner(tiny, hf_llama).model.wide_above == expected
    assert _runner(tiny, hf_llama, wide_above=None).model.wide_above is None
    assert _runner(tiny, hf_llama, wide_above=3).model.wide_above == 3


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_wide_prefill_matches_bf16_and_float32(tiny, quantization, monkeypatch):
    monkeypatch.setenv("PACELINE_W4A8_LINEARS", "")  # the dense float32 wide path, not the int4 x int8 op
    # hidden 64 = 2 int4 groups; wide_above=4: chunks of 16 run wide, single tokens in bfloat16
    hf = tiny.make_hf_model("llama", hidden_size=64, intermediate_size=128)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _runner(tiny, hf, torch.float32).prefill_logits(ids)
    narrow = _runner(tiny, hf, quantization=quantization, wide_above=None)
    wide = _runner(tiny, hf, quantization=quantization, wide_above=4, wide_linears="fp32")  # int8: test_int8.py
    if quantization == "int4":
        assert isinstance(wide.model.layers[0].qkv, Int4Linear)
        assert wide.model.layers[0].qkv.dense.dtype == torch.float32
    for chunk in (None, 16, 1):
        got, base = wide.prefill_logits(ids, chunk), narrow.prefill_logits(ids, chunk)
        assert got.dtype == torch.float32
        assert _rel(got, base) < 0.03, chunk  # bf16 rounding of activations is the only difference
        if quantization == "none":
            # float32 activations over bf16 weights sit at least as close to the reference as all-bf16 does
            assert _rel(got, ref) < 0.03 and _rel(got, ref) <= _rel(base, ref) * 1.5 + 1e-3, chunk
    # single tokens stay narrow: identical to the all-bf16 model
    assert torch.equal(wide.prefill_logits(ids, 1), narrow.prefill_logits(ids, 1))


def test_wide_step_mixing_a_chunk_with_decodes_equals_each_alone(tiny, hf_llama):
    """A prompt chunk and decodes in one wide step give each the logits it gets in its own wide step."""
    runner = _runner(tiny, hf_llama, wide_above=4, wide_linears="fp32")
    g = torch.Generator().manual_seed(2)
    a = torch.randint(0, 96, (20,), generator=g).tolist()  # the chunk: tokens 8..19 of a, after 0..7
    b, c = torch.randint(0, 96, (9,), generator=g).tolist(), torch.randint(0, 96, (13,), generator=g).tolist()
    ta, tb, tc = [0, 1, 2, 3, 4], [10, 11, 12], [20, 21, 22, 23]
    runner.forward_tokens(a[:8], list(range(8)), [SeqSlice(0, 8, ta)], [])
    runner.forward_tokens(b[:8], list(range(8)), [SeqSlice(0, 8, tb)], [])
    runner.forward_tokens(c[:12], list(range(12)), [SeqSlice(0, 12, tc)], [])
    # alone: chunk a (12 rows, wide); decodes b and c each with a copy of a's chunk so their step is wide too
    alone_a = runner.forward_tokens(a[8:], list(range(8, 20)), [SeqSlice(8, 12, ta)], [11])
    mixed = runner.forward_tokens(a[8:] + [b[8], c[12]], list(range(8, 20)) + [8, 12],
                                  [SeqSlice(8, 12, ta), SeqSlice(8, 1, tb), SeqSlice(12, 1, tc)], [11, 12, 13])
    assert torch.allclose(mixed[0], alone_a[0], atol=1e-4)
    b_alone = runner.forward_tokens(a[8:] + [b[8]], list(range(8, 20)) + [8],
                                    [SeqSlice(8, 12, ta), SeqSlice(8, 1, tb)], [12])
    assert torch.allclose(mixed[1], b_alone[0], atol=1e-4)


def test_bundled_model_wide_bf16_stays_close_to_float32():
    from paceline.model.loader import load_checkpoint

    ckpt = load_checkpoint(None, "float32")
    ids = ckpt.tokenizer.encode("The history of the printing press begins in East Asia, where woodblock "
                                "printing spread long before movable type reached Europe. In the fifteenth century")
    f32 = ModelRunner(LlamaModel.from_weights(ckpt.arch, ckpt.weights), ckpt.arch, 16, 16).prefill_logits(ids)
    for quantization, wide_linears in (("none", "fp32"), ("int4", "fp32"), ("int4", "int8")):
        model = LlamaModel.from_weights(ckpt.arch, ckpt.weights, dtype=torch.bfloat16, quantization=quantization,
                                        wide_above=4, wide_linears=wide_linears)
        got = ModelRunner(model, ckpt.arch, 16, 16, dtype=torch.bfloat16).prefill_logits(ids, chunk=16)
        agree = (got.argmax(-1) == f32.argmax(-1)).float().mean()
        cos = torch.nn.functional.cosine_similarity(got, f32, dim=-1)
        if wide_linears == "int8":  # opt-in: its 8-bit activations cost quality (benchmarks/summaries/int8_wide.md)
            assert agree >= 0.85 and cos.median() > 0.98, (agree, cos.median())
        else:
            assert agree >= 0.9 and cos.min() > 0.99, (quantization, wide_linears, agree, cos.min())
