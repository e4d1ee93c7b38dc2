"""The simulator plans with speculation: verified rows are charged by the cost model, and a workload's acceptance
decides what speculation gains. Adaptive k never costs much where proposals fail; a fixed k does."""
from __future__ import annotations

from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.batch_shape import batch_shape
from paceline.core.outputs import ScheduledRequest, SchedulerOutput
from paceline.core.step_time import ProfiledCostModel
from paceline.request import Request
from paceline.sampling import SamplingParams
from paceline.sim.simulator import Simulator
from paceline.sim.workloads import SimRequest
from paceline.spec_config import SpeculativeConfig

# a weight-streaming CPU: 40 ms a step, 4 ms a request, 2 ms a prompt or verified token, 0.5 ms an LM-head row
CPU = ProfiledCostModel({"constant": 0.040, "requests": 0.004, "prefill_tokens": 0.002, "decodes": 0.0,
                         "prefill_attn_pairs": 0.0, "decode_context": 0.0, "sampled": 0.0005})


def test_batch_shape_counts_a_verification_as_k_plus_one_sampled_rows() -> None:
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=9), 0.0)
    r.append_token(4, 0.0)
    r.num_computed_tokens = 3
    out = SchedulerOutput([ScheduledRequest(r, 3, 4, [0], spec_token_ids=[5, 6, 7])])
    s = batch_shape(out)
    assert (s.num_prefill_tokens, s.num_decodes, s.num_sampled, s.num_requests) == (4, 0, 4, 1)


def _run(acceptance: float, spec: SpeculativeConfig | None, n: int = 6, rate: float = 0.5) -> tuple[float, float]:
    sim = Simulator(CPU, SchedulerConfig(max_num_batched_tokens=256), CacheConfig(), 4000, speculative=spec)
    reqs = [SimRequest(i, i / rate, 200, 120, acceptance=acceptance) for i in range(n)]
    res = sim.run(reqs)
    assert all(r.ok and len(r.token_times) == 120 for r in res.requests)
    gaps = sorted(b - a for r in res.requests for a, b in zip(r.token_times, r.token_times[1:]))
    decode_s = sum(r.token_times[-1] - r.token_times[0] for r in res.requests)
    return 119 * n / decode_s, gaps[int(0.99 * len(gaps))]


def test_speculation_pays_where_proposals_are_accepted_and_adaptive_k_does_not_lose_where_they_are_not() -> None:
    fixed = SpeculativeConfig(num_speculative_tokens=4, adaptive=False)
    adaptive = SpeculativeConfig(num_speculative_tokens=4)
    plain_hi, _ = _run(0.9, None)
    assert _run(0.9, fixed)[0] > 1.8 * plain_hi
    assert _run(0.9, adaptive)[0] > 1.8 * plain_hi
    plain_lo, _ = _run(0.05, None)
    assert _run(0.05, fixed)[0] < 0.9 * plain_lo  # every proposal verified for nothing
    assert _run(0.05, adaptive)[0] > 0.97 * plain_lo


def test_under_load_adaptive_k_keeps_throughput_and_tail_where_fixed_k_loses_both() -> None:
    # 40 requests at 4 req/s: ~30 decodes a step; proposals accepted half the time
    plain = _run(0.5, None, n=40, rate=4.0)
    fixed = _run(0.5, SpeculativeConfig(num_speculative_tokens=4, adaptive=False), n=40, rate=4.0)
    adaptive = _run(0.5, SpeculativeConfig(num_speculative_tokens=4), n=40, rate=4.0)
    assert fixed[0] < 0.8 * plain[0] and fixed[1] > plain[1]
    assert adaptive[0] >= 0.97 * plain[0] and adaptive[1] <= 1.03 * plain[1]
