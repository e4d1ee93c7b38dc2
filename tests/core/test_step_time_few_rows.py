"""The step-time model's wide_rows feature: a model whose steps of up to `few_rows` rows run a cheaper product
(a float32 model's plain-weight kernel) costs a step more above it, which a line through the rows cannot follow."""
from __future__ import annotations

import json

from paceline.core.batch_shape import BatchShape
from paceline.core.step_time import FEATURES, LiveStepTime, ProfiledCostModel


def measured(s: BatchShape) -> float:
    """20 ms a step, 1 ms a decode, 1.2 ms a prompt token, 10 ms more from 3 rows on."""
    rows = s.num_prefill_tokens + s.num_decodes
    return 0.020 + 0.001 * s.num_decodes + 0.0012 * s.num_prefill_tokens + (0.010 if rows > 2 else 0.0)


def grid() -> list[BatchShape]:
    shapes = [BatchShape.build([], [ctx] * b) for b in (1, 2, 3, 4, 8, 16, 32) for ctx in (128, 1024)]
    shapes += [BatchShape.build([(start, c)], []) for c in (16, 64, 256) for start in (0, 512)]
    shapes += [BatchShape.build([(256, c)], [512] * b) for b in (1, 4) for c in (16, 128)]
    return shapes


def worst_error(model) -> float:
    return max(abs(model.step_time(s) - measured(s)) / measured(s) for s in grid())


def test_the_fit_follows_the_step_up_only_when_told_where_it_is() -> None:
    shapes = grid()
    times = [measured(s) for s in shapes]
    told = ProfiledCostModel.fit(shapes, times, few_rows=2)
    blind = ProfiledCostModel.fit(shapes, times)
    assert worst_error(told) < 0.01
    assert worst_error(blind) > 0.1  # a line through both sides errs by a step's fifth
    one, three = BatchShape.build([], [128]), BatchShape.build([], [128] * 3)
    assert abs(told.step_time(one) - 0.021) < 1e-4 and abs(told.step_time(three) - 0.033) < 1e-4


def test_saved_and_loaded_with_its_few_rows_and_old_profiles_still_load(tmp_path) -> None:
    model = ProfiledCostModel.fit(grid(), [measured(s) for s in grid()], few_rows=2)
    model.save(tmp_path / "p.json")
    back = ProfiledCostModel.load(tmp_path / "p.json")
    assert back.few_rows == 2 and worst_error(back) < 0.01
    old = {"kind": "profiled", "coefficients": {f: 0.001 for f in FEATURES if f != "wide_rows"}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    loaded = ProfiledCostModel.load(tmp_path / "old.json")
    assert loaded.few_rows == 0 and loaded.step_time(BatchShape.build([], [128] * 3)) > 0


def test_the_live_refit_keeps_the_feature() -> None:
    # refitted on live steps with the feature, the fit stays as exact as the profile's (without it: ~18 % off)
    base = ProfiledCostModel.fit(grid(), [measured(s) for s in grid()], few_rows=2)
    live = LiveStepTime(base, refit_every=8)
    for s in grid() * 3:
        live.observe(s, measured(s))
    assert live.num_refits > 0
    assert max(abs(live.step_time(s) - measured(s)) / measured(s) for s in grid()) < 0.01
