"""2 ranks in real processes (gloo on the loopback, one thread each): greedy output token for token equal to one
process, through the real Engine and scheduler, with chunked prefill and preemption."""
from __future__ import annotations

import pytest

from paceline import LLM, SamplingParams
from paceline.config import CacheConfig, SchedulerConfig
from paceline.model.loader import load_checkpoint
from paceline.parallel.executor import PipelineParallelRunner, TensorParallelRunner, build_runner
from paceline.parallel.pipeline import run_pipelined

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def host_blocks(runner) -> int:
    return 0 if runner.host_cache is None else runner.host_cache.shape[2]


def attach(llm: LLM, runner) -> LLM:
    """What the Engine hook does at construction: the engine's runner is the parallel one. A runner may serve one
    engine after another: a new engine's scheduler knows no cached blocks, so nothing old in the cache is read."""
    engine = llm.engine
    assert runner.num_blocks >= engine.num_blocks and host_blocks(runner) >= engine.num_host_blocks
    engine.runner = runner
    return llm


def runner_for(model: str | None, layout: str, num_blocks: int, num_host_blocks: int = 0):
    ckpt = load_checkpoint(model)
    tp, pp = LAYOUTS[layout]
    return build_runner(ckpt.arch, ckpt.weights, model=model, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                        num_host_blocks=num_host_blocks, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                        threads_per_rank=1)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ---------------------------------------------------------------- tiny random model
# every LLM here asks for float32 by name: token-for-token equality is a float32 guarantee, and the runners are float32

BLOCK_SIZE = 4
TINY_PROMPTS = [[(11 * i + 3 * j) % 250 + 3 for j in range(6 + 7 * i)] for i in range(6)]
# 6 requests of 6..41 prompt + 16 output tokens in blocks of 4: 24 blocks force preemption; 8-token steps chunk
TINY_ARGS = {"block_size": BLOCK_SIZE, "num_blocks": 24, "max_num_batched_tokens": 8, "swap_space_gb": 0.001}


@pytest.fixture(scope="module")
def tiny_reference(tiny_folder: str) -> list[list[int]]:
    llm = LLM(tiny_folder, dtype="float32", block_size=BLOCK_SIZE, num_blocks=256)
    return [token_ids(llm.generate(p, greedy(16)))[0] for p in TINY_PROMPTS]


@pytest.fixture(scope="module")
def tiny_runners(tiny_folder: str):
    """One 2-rank runner per layout for the whole module: starting ranks is what costs time here."""
    runners = {layout: runner_for(tiny_folder, layout, num_blocks=48, num_host_blocks=1024) for layout in LAYOUTS}
    yield runners
    for runner in runners.values():
        runner.close()
        assert not any(p.is_alive() for p in runner.workers.procs)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_model_equals_one_process_with_chunks_and_preemption(tiny_folder, tiny_reference, tiny_runners,
                                                                    layout, mode) -> None:
    runner = tiny_runners[layout]
    assert isinstance(runner, TensorParallelRunner if layout == "tp2" else PipelineParallelRunner)
    llm = attach(LLM(tiny_folder, dtype="float32", preemption_mode=mode, **TINY_ARGS), runner)
    runner.collect_stats()
    outputs = llm.generate(TINY_PROMPTS, greedy(16))
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and (mode == "recompute") == (stats.num_swaps == 0)
    assert token_ids(outputs) == tiny_reference
    ranks = runner.collect_stats()
    assert len(ranks) == 2 and all(r.steps > 0 for r in ranks)


def test_two_steps_in_flight_equal_one_process(tiny_reference, tiny_runners) -> None:
    prompts = {f"r{i}": p for i, p in enumerate(TINY_PROMPTS)}
    for policy, budget, arrivals in (("sarathi", 8, 0), ("vllm", 512, 0), ("sarathi", 8, 20)):
        run = run_pipelined(tiny_runners["pp2"], prompts, greedy(16),
                            SchedulerConfig(policy=policy, max_num_batched_tokens=budget),
                            CacheConfig(block_size=BLOCK_SIZE), num_slots=2, arrive_every_tokens=arrivals)
        assert [run.outputs[f"r{i}"] for i in range(len(TINY_PROMPTS))] == tiny_reference
        assert 0.0 <= run.bubble_fraction < 1.0


def test_a_worker_that_cannot_load_is_a_value_error(tiny_folder, tmp_path) -> None:
    ckpt = load_checkpoint(tiny_folder)
    with pytest.raises(ValueError, match="rank 1 could not build"):
        build_runner(ckpt.arch, ckpt.weights, model=str(tmp_path / "missing"), num_blocks=8, block_size=4,
                     tensor_parallel_size=2, threads_per_rank=1)


def test_bad_layouts_are_value_errors(tiny_folder) -> None:
    ckpt = load_checkpoint(tiny_folder)
    for tp, pp in ((3, 1), (2, 2), (1, 3)):  # 2 KV heads, 2 layers, TP x PP not supported
        with pytest.raises(ValueError):
            build_runner(ckpt.arch, ckpt.weights, model=tiny_folder, num_blocks=8, block_size=4,
                         tensor_parallel_size=tp, pipeline_parallel_size=pp)


# ---------------------------------------------------------------- the bundled model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three primary colors:"]


@pytest.fixture(scope="module")
def bundled_reference() -> list[list[int]]:
    return token_ids(LLM(dtype="float32", kv_cache_memory_gb=0.05).generate(PROMPTS, greedy(12)))


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bundled_model_equals_one_process_with_chunks_and_preemption(bundled_reference, layout) -> None:
    # ~8 prompt + 12 output tokens in blocks of 4: 12 blocks for 4 requests force preemption; 8-token steps chunk.
    # The LLM's own settings, as a user spells them: the engine spawns the workers itself.
    tp, pp = LAYOUTS[layout]
    llm = LLM(dtype="float32", block_size=BLOCK_SIZE, num_blocks=12, max_num_batched_tokens=8, swap_space_gb=0,
              tensor_parallel_size=tp, pipeline_parallel_size=pp)
    runner = llm.engine.runner
    try:
        assert isinstance(runner, TensorParallelRunner if tp > 1 else PipelineParallelRunner)
        outputs = llm.generate(PROMPTS, greedy(12))
        assert llm.engine.stats().num_preemptions > 0
        assert token_ids(outputs) == bundled_reference
        assert all(r.steps > 0 for r in runner.collect_stats())
    finally:
        runner.close()
    assert not any(p.is_alive() for p in runner.workers.procs)


def test_parallel_settings_are_checked_before_anything_loads() -> None:
    for kwargs in ({"tensor_parallel_size": 0}, {"pipeline_parallel_size": "2"},
                   {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}):
        with pytest.raises(ValueError, match="parallel"):
            LLM(**kwargs)
    from paceline.entrypoints.cli import build_parser
    from paceline.entrypoints.server import engine_config_from_args
    cfg = engine_config_from_args(build_parser().parse_args(["serve", "--tensor-parallel-size", "2"]))
    assert (cfg.tensor_parallel_size, cfg.pipeline_parallel_size) == (2, 1)
    args = build_parser().parse_args(["generate", "--pipeline-parallel-size", "2", "hi"])
    assert args.pipeline_parallel_size == 2
