"""The engine's correction of predicted step times under max_step_ms: a tracked quantile of measured / predicted."""
import math

import numpy as np

from paceline.engine.engine import STEP_TIME_QUANTILE, track_quantile


def _run(samples, start: float = 1.0, **kw) -> float:
    estimate = start
    for x in samples:
        estimate = track_quantile(estimate, float(x), **kw)
    return estimate


def test_settles_at_the_quantile_of_a_noisy_ratio() -> None:
    # step times that vary like this machine's: lognormal around 1.3x the prediction
    samples = np.random.default_rng(0).lognormal(math.log(1.3), 0.15, 20000)
    estimate = _run(samples)
    below = float(np.mean(samples[-5000:] <= estimate))
    assert abs(below - STEP_TIME_QUANTILE) < 0.015
    assert abs(_run(samples, quantile=0.5) - float(np.median(samples))) < 0.05


def test_one_wild_step_moves_it_no_more_than_any_other_and_it_stays_bounded() -> None:
    assert track_quantile(1.0, 1.01) == track_quantile(1.0, 1000.0) < 1.06
    assert _run([100.0] * 1000) == 4.0
    assert _run([0.001] * 100000) == 0.25
    # and it comes back down when the machine speeds up
    slow_then_fast = [2.0] * 400 + [1.0] * 6000
    assert 0.95 < _run(slow_then_fast) < 1.1
