"""The step-time model charges each row sampled under a grammar mask (structured outputs), so the stall-free
scheduler's step-time target leaves room for it: the same prompt gets a smaller chunk beside constrained decodes."""
from __future__ import annotations

from sched_util import make_request, make_scheduler, step

from paceline.core.batch_shape import BatchShape
from paceline.core.step_time import FEATURES, ProfiledCostModel
from paceline.sampling import StructuredOutputs

COEF = dict.fromkeys(FEATURES, 0.0) | {"constant": 0.010, "prefill_tokens": 0.001, "decodes": 0.002}


def constrained(rid: str, prompt: int, max_tokens: int):
    r = make_request(rid, prompt, max_tokens=max_tokens)
    r.sampling_params.structured = StructuredOutputs(json_object=True)
    return r


def test_masked_rows_are_counted_and_charged(tmp_path) -> None:
    model = ProfiledCostModel(COEF, mask_s_per_row=0.003)
    free, masked = make_request("a", 8), constrained("b", 8, 4)
    shape = BatchShape()
    shape.add_slice(free, 0, 8)  # whole prompts: both rows are sampled
    shape.add_slice(masked, 0, 8)
    assert shape.num_masked == 1
    part = BatchShape()
    part.add_slice(masked, 0, 4)  # a chunk that does not end the prompt samples nothing: no mask
    assert part.num_masked == 0
    assert model.step_time(shape) == ProfiledCostModel(COEF).step_time(shape) + 0.003
    model.save(tmp_path / "p.json")
    assert ProfiledCostModel.load(tmp_path / "p.json").mask_s_per_row == 0.003


def test_constrained_decodes_leave_a_smaller_chunk() -> None:
    chunks = {}
    for kind in ("free", "constrained"):
        model = ProfiledCostModel(COEF, mask_s_per_row=0.005)
        sched = make_scheduler("stall-free", budget=512, step_time=model.step_time, max_step_ms=100)
        for i in range(4):
            sched.add_request(constrained(f"d{i}", 8, 50) if kind == "constrained" else make_request(f"d{i}", 8, 50))
        t = 1.0
        while sched.num_waiting or not all(r.is_decoding for r in sched.running):
            t += 1
            step(sched, t)
        sched.add_request(make_request("long", 1000, max_tokens=2, arrival=t))
        v = step(sched, t + 1)
        assert v.out.predicted_step_s <= 0.100 + 1e-12
        chunks[kind] = dict(v.batch)["long"]
    # 4 masks at 5 ms take the time of 20 prompt tokens at 1 ms
    assert chunks["free"] - chunks["constrained"] == 20, chunks
