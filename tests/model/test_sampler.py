"""Sampler: each parameter's effect, seeds, logprobs, min_tokens."""
from __future__ import annotations

import pytest
import torch

from paceline.model.sampler import SampleRow, Sampler
from paceline.sampling import SamplingParams

V = 50


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


def _row(prompt=(), output=(), eos=None, **sp) -> SampleRow:
    return SampleRow(SamplingParams(**sp), list(prompt), list(output), eos)


def _draws(logits: torch.Tensor, n: int, **sp) -> list[int]:
    sampler = Sampler(seed=1)
    tokens, _ = sampler(logits.expand(n, V).contiguous(), [_row(**sp) for _ in range(n)])
    return tokens


def test_greedy_is_argmax():
    logits = _logits(4)
    tokens, lps = Sampler()(logits, [_row(temperature=0.0) for _ in range(4)])
    assert tokens == logits.argmax(-1).tolist() and lps == [None] * 4


def test_temperature_sampling_follows_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-30.0] * (V - 3)])
    counts = torch.bincount(torch.tensor(_draws(logits, 4000, temperature=1.0)), minlength=V).float() / 4000
    expected = torch.softmax(logits[0], -1)
    assert (counts[:3] - expected[:3]).abs().max() < 0.03
    # a high temperature flattens, a low one sharpens
    hot = torch.bincount(torch.tensor(_draws(logits, 2000, temperature=5.0)), minlength=V)[0] / 2000
    cold = torch.bincount(torch.tensor(_draws(logits, 2000, temperature=0.2)), minlength=V)[0] / 2000
    assert cold > expected[0] > hot


def test_top_k_top_p_min_p_limit_the_support():
    logits = _logits()
    order = logits[0].argsort(descending=True).tolist()
    assert set(_draws(logits, 400, top_k=3)) <= set(order[:3])
    assert len(set(_draws(logits, 400, top_k=3))) == 3
    probs = torch.softmax(logits[0], -1)
    cum = probs[order].cumsum(0)
    keep = order[: int((cum < 0.6).sum()) + 1]
    assert set(_draws(logits, 400, top_p=0.6)) <= set(keep)
    allowed = {i for i in range(V) if probs[i] >= 0.3 * probs.max()}
    assert set(_draws(logits, 400, min_p=0.3)) <= allowed
    assert _draws(logits, 5, top_k=1) == [order[0]] * 5


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 4], logits[0, 5] = 4.0, -2.0, 3.9
    s = Sampler()
    tok, _ = s(logits, [_row(prompt=[3], output=[], temperature=0.0, repetition_penalty=2.0)])
    assert tok == [5]  # 4.0 / 2 < 3.9
    pen = s._apply_penalties(logits.clone(), [_row(prompt=[4], output=[3], temperature=0.0, repetition_penalty=2.0)])
    assert pen[0, 3] == 2.0 and pen[0, 4] == -4.0 and pen[0, 5] == 3.9


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(1, V)
    row = _row(prompt=[7, 7], output=[1, 1, 1, 2], temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)
    pen = Sampler()._apply_penalties(logits.clone(), [row])
    assert pen[0, 1] == pytest.approx(-1.75) and pen[0, 2] == pytest.approx(-0.75)
    assert pen[0, 7] == 0.0 and pen[0, 0] == 0.0


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, V)
    logits[0, 9], logits[0, 8], logits[0, 6] = 10.0, 9.0, 8.0
    s = Sampler()
    early = _row(output=[1], eos=9, temperature=0.0, min_tokens=3, stop_token_ids=[8])
    assert s(logits, [early])[0] == [6]
    done = _row(output=[1, 2, 3], eos=9, temperature=0.0, min_tokens=3, stop_token_ids=[8])
    assert s(logits, [done])[0] == [9]
    # sampling rows are masked too
    assert set(_draws(logits, 50, temperature=1.0, min_tokens=1, stop_token_ids=[9, 8])) <= set(range(V)) - {8, 9}


def test_seed_gives_same_tokens_whatever_the_batch():
    logits = _logits(1, seed=3)
    mine = _row(output=[1, 2], temperature=1.0, seed=1234)
    alone, _ = Sampler(seed=0)(logits, [mine])
    others = _logits(5, seed=4)
    batch = torch.cat([others[:2], logits, others[2:]])
    rows = [_row(temperature=0.7) for _ in range(2)] + [mine] + [_row(temperature=1.0, seed=9) for _ in range(3)]
    mixed, _ = Sampler(seed=99)(batch, rows)
    assert mixed[2] == alone[0]
    # the draw depends on the output position, so a recomputed request replays the same stream
    flat = torch.zeros(1, V)
    by_position = [Sampler()(flat, [_row(output=[0] * i, temperature=1.0, seed=5)])[0][0] for i in range(12)]
    assert by_position == [Sampler(seed=7)(flat, [_row(output=[0] * i, temperature=1.0, seed=5)])[0][0] for i in range(12)]
    assert len(set(by_position)) > 3
    other_seed = [Sampler()(flat, [_row(output=[0] * i, temperature=1.0, seed=6)])[0][0] for i in range(12)]
    assert other_seed != by_position


def test_unseeded_requests_follow_the_engine_generator():
    logits = torch.zeros(8, V)
    rows = [_row(temperature=1.0) for _ in range(8)]
    assert Sampler(seed=3)(logits, rows)[0] == Sampler(seed=3)(logits, rows)[0]
    assert Sampler(seed=3)(logits, rows)[0] != Sampler(seed=4)(logits, rows)[0]


def test_logprobs_are_raw_log_softmax():
    logits = _logits(2)
    rows = [_row(temperature=0.5, logprobs=4, repetition_penalty=1.5, prompt=[0, 1]), _row(temperature=0.0)]
    tokens, lps = Sampler()(logits, rows)
    ref = torch.log_softmax(logits[0], -1)
    assert lps[1] is None
    assert lps[0].logprob == pytest.approx(ref[tokens[0]].item(), abs=1e-6)
    top_v, top_i = ref.topk(4)
    assert [t for t, _ in lps[0].top] == top_i.tolist()
    assert [v for _, v in lps[0].top] == pytest.approx(top_v.tolist(), abs=1e-6)
    _, lp0 = Sampler()(logits[:1], [_row(temperature=0.0, logprobs=0)])
    assert lp0[0].top == [] and lp0[0].logprob == pytest.approx(ref.max().item(), abs=1e-6)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(min_p=1.5),
                                 dict(repetition_penalty=0.0), dict(presence_penalty=3.0), dict(logprobs=99),
                                 dict(min_tokens=5, max_tokens=2), dict(seed="x")])
def test_invalid_params_are_value_errors(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_row_count_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, V), [_row(temperature=0.0)])


def test_logit_bias_bans_and_forces_tokens():
    logits = _logits(3)
    best = int(logits[0].argmax())
    # -100 bans the greedy choice; +100 forces a token however unlikely, sampled or greedy
    tokens, _ = Sampler()(logits, [_row(temperature=0.0, logit_bias={best: -100.0}),
                                   _row(temperature=0.0, logit_bias={7: 100.0}),
                                   _row(temperature=1.0, seed=3, logit_bias={9: 100.0})])
    assert tokens[0] != best and tokens[0] == int(logits[0].topk(2).indices[1])
    assert tokens[1:] == [7, 9]
    # logprobs stay the model's own
    _, lps = Sampler()(logits[:1], [_row(temperature=0.0, logprobs=0, logit_bias={7: 100.0})])
    assert lps[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[7]), abs=1e-5)


# the fused draw (fused_kernel.sample_rows) serves plain-temperature rows of float32 CPU logits whose vocabulary is a
# multiple of 8; V = 50 above keeps torch's path, these use 64
def _fused():
    from paceline.model import fused_kernel
    ops = fused_kernel.load()
    if ops is None:
        pytest.skip("the fused kernels cannot be built here")
    return ops.sample_rows


def test_fused_draw_follows_softmax_and_never_draws_minus_inf():
    _fused()
    logits = torch.tensor([[2.0, 1.0, 0.0, float("-inf")] + [-30.0] * 60])
    sampler = Sampler(seed=3)
    tokens, _ = sampler(logits.expand(4000, 64).contiguous(), [_row(temperature=1.0) for _ in range(4000)])
    counts = torch.bincount(torch.tensor(tokens), minlength=64).float() / 4000
    assert (counts[:3] - torch.softmax(logits[0], -1)[:3]).abs().max() < 0.03 and counts[3] == 0


def test_fused_draw_is_the_inverse_cdf():
    op = _fused()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 64, generator=g) * 3
    x[:, 10] = float("-inf")
    inv_t = torch.rand(300, generator=g) + 0.5
    u = torch.rand(300, generator=g)
    cdf = torch.softmax(x.double() * inv_t[:, None].double(), -1).cumsum(-1)
    ref = torch.searchsorted(cdf, u[:, None].double() * cdf[:, -1:], right=True).squeeze(1)
    got = op(x, inv_t, u)
    # float32 weights against float64 ones: a u within rounding of a boundary may land on the neighbour
    assert (got == ref).float().mean() > 0.99 and not (got == 10).any()
    assert op(torch.full((1, 64), float("nan")), inv_t[:1], u[:1]).item() == -1  # the caller keeps its argmax


def test_fused_and_filtered_rows_keep_their_seeded_tokens_in_one_batch():
    _fused()
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)) * 2
    rows = [_row(temperature=0.9, seed=11), _row(temperature=0.9, top_k=5, seed=12), _row(temperature=0.0)]
    together, _ = Sampler()(logits.clone(), rows)
    alone = [Sampler()(logits[i:i + 1].clone(), [rows[i]])[0][0] for i in range(3)]
    assert together == alone and together[2] == int(logits[2].argmax())
