"""The simulator's pipeline parallelism: a replica's stages overlap the steps of its virtual engines (micro-batches),
and the run reports the stages' bubble fraction."""
from __future__ import annotations

import pytest

from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.batch_shape import BatchShape
from paceline.sim.cost_model import roofline_from_names
from paceline.sim.deploy import Deployment
from paceline.sim.simulator import Simulator
from paceline.sim.workloads import SimRequest


def deployment(pp: int, microbatches: int | None, policy: str = "stall-free", budget: int = 512) -> Deployment:
    cost = roofline_from_names("llama-3-70b", "h100", tp=4, pp=pp)
    return Deployment(cost, SchedulerConfig(policy=policy, max_num_batched_tokens=budget, max_model_len=4096),
                      CacheConfig(), pipeline_microbatches=microbatches)


# 64 requests arriving together: the replica never idles, so any bubble is the pipeline's own
BURST = [SimRequest(i, 0.0, 200 + 37 * (i % 9), 48) for i in range(64)]


@pytest.mark.parametrize("pp", [2, 4])
def test_stage_times_add_up_to_the_step(pp):
    cost = roofline_from_names("llama-3-70b", "h100", tp=4, pp=pp)
    for shape in (BatchShape(num_decodes=32, decode_context=32 * 500, num_requests=32, num_sampled=32),
                  BatchShape(num_prefill_tokens=512, prefill_attn_pairs=512 * 513 // 2,
                             prefill_kv_tokens=512, num_requests=1, num_sampled=1)):
        stages = cost.stage_times(shape)
        assert len(stages) == pp and all(t > 0 for t in stages)
        assert sum(stages) == pytest.approx(cost.step_time(shape), rel=1e-12)


def test_one_microbatch_leaves_half_the_stages_idle_and_two_overlap():
    one = deployment(2, 1).simulator().run(BURST)
    two = deployment(2, 2).simulator().run(BURST)
    for result in (one, two):
        assert len(result.finished) == len(BURST)
        assert sum(len(r.token_times) for r in result.requests) == 64 * 48
    # one step in flight: each stage waits for the other, exactly half the stage-time is bubble
    assert one.bubble_fraction == pytest.approx(0.5, abs=1e-9)
    # two virtual engines keep both stages busy most of the time, and the work ends sooner
    assert two.bubble_fraction < 0.35 and two.makespan < 0.8 * one.makespan


def test_no_pipeline_no_bubble_and_the_old_timeline():
    pp1 = deployment(1, None).simulator()
    assert pp1.pipeline_microbatches == 1
    result = pp1.run(BURST[:8])
    assert result.bubble_fraction is None and len(result.finished) == 8


def test_microbatches_need_a_per_stage_cost_model():
    class Flat:
        def step_time(self, s):
            return 0.01
    with pytest.raises(ValueError, match="per-stage cost model"):
        Simulator(Flat(), SchedulerConfig(), CacheConfig(), num_blocks=100, pipeline_microbatches=2)
    with pytest.raises(ValueError, match="cannot be shared"):
        Simulator(roofline_from_names("llama-3-70b", "h100", tp=4, pp=2), SchedulerConfig(), CacheConfig(),
                  num_blocks=1, pipeline_microbatches=2)
