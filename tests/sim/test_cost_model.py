"""Cost models: the fit recovers known coefficients, the roofline obeys its own formulas."""
import numpy as np
import pytest

from paceline.config import CacheConfig, SchedulerConfig
from paceline.core.outputs import ScheduledRequest, SchedulerOutput
from paceline.request import Request
from paceline.sampling import SamplingParams
from paceline.sim.cost_model import FEATURES, BatchShape, ProfiledCostModel, RooflineCostModel, batch_shape, roofline_from_names
from paceline.sim.deploy import Deployment
from paceline.sim.hardware import GPUS, GiB, get_gpu
from paceline.sim.models import list_model_configs, load_model_config, num_parameters


def synthetic_shapes(rng):
    shapes = []
    for _ in range(60):
        s = BatchShape.build(decode_contexts=[int(rng.integers(1, 3000)) for _ in range(rng.integers(0, 40))])
        for _ in range(rng.integers(0, 3)):  # some chunks end their prompt (sampled), some do not
            s.add_chunk(int(rng.integers(0, 2000)), int(rng.integers(1, 512)), sampled=bool(rng.integers(0, 2)))
        if s.num_tokens:
            shapes.append(s)
    return shapes


def test_fit_recovers_known_coefficients():
    truth = ProfiledCostModel(dict(zip(FEATURES, [4e-3, 2e-4, 3e-5, 6e-5, 2e-9, 4e-7, 1e-4, 5e-3])), few_rows=2)
    shapes = synthetic_shapes(np.random.default_rng(0))
    fitted = ProfiledCostModel.fit(shapes, [truth.step_time(s) for s in shapes], few_rows=2)
    for k in FEATURES:
        assert fitted.coefficients[k] == pytest.approx(truth.coefficients[k], rel=1e-6, abs=1e-12)
    assert fitted.meta["median_rel_error"] < 1e-9


def test_fit_with_noise_keeps_coefficients_nonnegative_and_close(tmp_path):
    rng = np.random.default_rng(1)
    truth = ProfiledCostModel(dict(zip(FEATURES, [4e-3, 0.0, 3e-5, 6e-5, 2e-9, 4e-7, 0.0])))
    shapes = synthetic_shapes(rng)
    times = [truth.step_time(s) * rng.normal(1.0, 0.03) for s in shapes]
    fitted = ProfiledCostModel.fit(shapes, times, meta={"machine": "test"})
    assert all(v >= 0 for v in fitted.coefficients.values())
    assert fitted.meta["median_rel_error"] < 0.05
    path = tmp_path / "p.json"
    fitted.save(path)
    again = ProfiledCostModel.load(path)
    assert again.coefficients == fitted.coefficients and again.meta["machine"] == "test"
    for s in shapes[:5]:
        assert again.step_time(s) == fitted.step_time(s)


def test_load_rejects_non_profiles(tmp_path):
    (tmp_path / "x.json").write_text('{"kind": "other"}')
    with pytest.raises(ValueError):
        ProfiledCostModel.load(tmp_path / "x.json")
    with pytest.raises(ValueError):
        ProfiledCostModel.load(tmp_path / "missing.json")


def test_batch_shape_of_a_scheduler_output():
    sp = SamplingParams(max_tokens=4)
    dec = Request("d", [1] * 10, sp, 0.0)
    dec.token_ids.append(5)  # one output token whose KV is missing: a decode over 11 positions
    pre = Request("p", [2] * 100, sp, 0.0)
    out = SchedulerOutput([ScheduledRequest(dec, 10, 1, [0]), ScheduledRequest(pre, 32, 40, [1, 2, 3, 4, 5])])
    s = batch_shape(out)
    assert (s.num_decodes, s.decode_context, s.num_prefill_tokens, s.num_requests, s.num_sampled) == (1, 11, 40, 2, 1)
    assert s.prefill_attn_pairs == 40 * 32 + 40 * 41 / 2
    assert s.prefill_kv_tokens == 72


def test_model_configs_have_the_published_sizes():
    sizes = {n: num_parameters(load_model_config(n)) / 1e9 for n in list_model_configs()}
    assert sizes["llama-2-7b"] == pytest.approx(6.74, abs=0.01)
    assert sizes["mistral-7b"] == pytest.approx(7.24, abs=0.01)
    assert sizes["llama-3-8b"] == pytest.approx(8.03, abs=0.01)
    assert sizes["llama-3-70b"] == pytest.approx(70.55, abs=0.05)
    assert sizes["qwen2-72b"] == pytest.approx(72.7, abs=0.1)
    with pytest.raises(ValueError):
        load_model_config("gpt-5")
    with pytest.raises(ValueError):
        get_gpu("tpu")


def test_kv_capacity_formula_mistral_on_a100():
    m = roofline_from_names("mistral-7b", "a100")
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert m.kv_bytes_per_token() == per_token
    expected = int((80 * GiB * 0.9 - num_parameters(m.arch) * 2 - 2 * GiB) // per_token)
    assert m.kv_capacity_tokens(0.9) == expected
    dep = Deployment(m, SchedulerConfig(), CacheConfig())
    assert dep.num_blocks() == expected // 16
    with pytest.raises(ValueError):
        roofline_from_names("llama-3-70b", "a100").kv_capacity_tokens()  # 141 GB of weights on 80 GB


def test_roofline_regimes():
    m = roofline_from_names("mistral-7b", "a100", step_overhead_s=0.0, per_request_s=0.0)
    gpu = GPUS["a100"]
    # a single decode is bound by reading the weights once (all but the embedding table, of which it reads one row)
    weights = num_parameters(m.arch) - m.arch.vocab_size * m.arch.hidden_size
    weights_time = weights * 2 / (gpu.mem_bandwidth * m.efficiency["gemm"])
    one = m.step_time(BatchShape.build(decode_contexts=[1]))
    assert weights_time < one < 1.2 * weights_time
    # a long prompt is bound by GEMM FLOPs: ~2 x params x tokens
    n = 4096
    big = m.step_time(BatchShape.build(chunks=[(0, n)]))
    assert big > 2 * num_parameters(m.arch) * n / (gpu.peak_flops * m.efficiency["gemm"])
    # more decodes or longer contexts never cost less
    times = [m.step_time(BatchShape.build(decode_contexts=[1000] * b)) for b in (1, 8, 64, 256)]
    assert times == sorted(times)
    assert m.step_time(BatchShape.build(decode_contexts=[4000] * 64)) > times[2]


def test_tensor_parallel_splits_work_and_pays_allreduce():
    shape = BatchShape.build(chunks=[(0, 2048)])
    t1 = roofline_from_names("llama-3-8b", "h100", tp=1).step_time(shape)
    t4 = roofline_from_names("llama-3-8b", "h100", tp=4)
    assert t4._allreduce(1e6) > 0 and roofline_from_names("llama-3-8b", "h100")._allreduce(1e6) == 0
    assert t4.step_time(shape) < t1
    assert t4.step_time(shape) > t1 / 4  # all-reduce and the unsplit LM-head share keep it above ideal
    with pytest.raises(ValueError):
        roofline_from_names("llama-3-8b", "h100", tp=3)


def test_pipeline_parallel_adds_transfers_and_halves_weights_per_gpu():
    shape = BatchShape.build(decode_contexts=[500] * 16)
    m1 = roofline_from_names("llama-3-70b", "h100", tp=4)
    m2 = roofline_from_names("llama-3-70b", "h100", tp=4, pp=2)
    assert m2.weight_bytes_per_gpu() == pytest.approx(m1.weight_bytes_per_gpu() / 2)
    assert m2.step_time(shape) > m1.step_time(shape)


def test_efficiency_must_be_a_fraction():
    with pytest.raises(ValueError):
        RooflineCostModel(load_model_config("mistral-7b"), GPUS["a100"], efficiency={"gemm": 1.5})
