"""The step-time model refitted to live steps (core/step_time.LiveStepTime): it learns what the steps measured,
keeps the profile where no live step says otherwise, and a one-off slow step moves it by a bounded amount."""
import numpy as np

from paceline.core.batch_shape import BatchShape
from paceline.core.step_time import FEATURES, LiveStepTime, ProfiledCostModel

# a profile that overprices decode context ~6x against the "machine" below, as the quick profile of 2026-11-23 did
PROFILE = {"constant": 0.028, "requests": 0.0086, "prefill_tokens": 0.0011, "decodes": 0.0,
           "prefill_attn_pairs": 2e-6, "decode_context": 1.8e-5, "sampled": 0.0}
TRUTH = {**PROFILE, "requests": 0.004, "decode_context": 3e-6, "prefill_attn_pairs": 5e-7}


def _true_time(s: BatchShape) -> float:
    return ProfiledCostModel(TRUTH).step_time(s)


def _live_shapes(rng: np.random.Generator, n: int) -> list[BatchShape]:
    """What a server under streams runs: a few decodes at a few hundred tokens, now and then a short chunk."""
    shapes = []
    for _ in range(n):
        d = int(rng.integers(1, 12))
        chunks = [(int(rng.integers(0, 1200)), int(rng.integers(8, 48)))] if rng.random() < 0.6 else []
        shapes.append(BatchShape.build(chunks, [int(rng.integers(100, 800)) for _ in range(d)]))
    return shapes


def test_refit_learns_the_measured_steps_and_keeps_the_profile_elsewhere() -> None:
    base = ProfiledCostModel(PROFILE)
    live = LiveStepTime(base, window=128, refit_every=16)
    rng = np.random.default_rng(0)
    shapes = _live_shapes(rng, 400)
    for s in shapes:
        live.observe(s, _true_time(s))
    assert live.num_refits == 400 // 16
    held_out = _live_shapes(np.random.default_rng(1), 50)
    err_before = np.median([abs(base.step_time(s) / _true_time(s) - 1) for s in held_out])
    err_after = np.median([abs(live.step_time(s) / _true_time(s) - 1) for s in held_out])
    assert err_before > 0.5 and err_after < 0.1
    # a shape no live step resembles (a whole 512-token prompt, no decode) keeps roughly the profile's price
    big = BatchShape.build([(0, 512)], [])
    assert 0.7 < live.step_time(big) / base.step_time(big) < 1.3
    assert set(FEATURES) == set(PROFILE) | {"wide_rows"}  # wide_rows: optional (0 for a model without few-row steps)


def test_a_one_off_slow_step_moves_the_fit_by_a_bounded_amount_and_a_lasting_change_is_followed() -> None:
    base = ProfiledCostModel(TRUTH)
    live = LiveStepTime(base, window=256, refit_every=8)
    s = BatchShape.build([(0, 32)], [300] * 6)
    for _ in range(255):
        live.observe(s, _true_time(s))
    live.observe(s, 50 * _true_time(s))  # a step 50x slower than the rest, the last of the window
    assert live.step_time(s) < 1.1 * _true_time(s)
    for _ in range(256):  # the machine is now 1.8x slower, for good: the fit follows, short of the anchors' pull
        live.observe(s, 1.8 * _true_time(s))
    assert 1.6 < live.step_time(s) / _true_time(s) <= 1.8


def test_steps_with_terms_the_refit_does_not_cover_are_left_out() -> None:
    live = LiveStepTime(ProfiledCostModel(TRUTH), window=16, refit_every=1)
    swapped = BatchShape.build([], [100], num_swapped_blocks=3)
    live.observe(swapped, 10.0)
    live.observe(BatchShape.build([], [100]), 0.0)
    assert live.num_refits == 0
