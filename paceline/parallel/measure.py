"""Measurements for docs/scaling.md: TP=2's per-step communication and PP=2's bubble, on the bundled model.

    python -m paceline.parallel.measure tp   # step time and time in collectives, TP=2 vs one process
    python -m paceline.parallel.measure pp   # bubble fraction at PP=2: chunked vs whole prompts, 1 vs 2 steps in flight

Every rank runs one thread (the driver too). On a machine with fewer cores than ranks nothing can get faster; the
figures say what the communication and the idle stages cost, and only ratios from one run mean anything.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.engine.engine import Engine
from paceline.model.loader import load_checkpoint
from paceline.parallel.executor import build_runner
from paceline.parallel.pipeline import run_pipelined
from paceline.sampling import SamplingParams

BLOCK_SIZE = 16


def prompt_lengths(n: int, low: int, high: int) -> list[int]:
    """A fixed spread of lengths (no randomness: the same workload every run)."""
    return [low + (i * 7919) % (high - low + 1) for i in range(n)]


def prompts_of(lengths: list[int], vocab: int) -> list[list[int]]:
    return [[(97 * i + 31 * j) % (vocab - 300) + 200 for j in range(n)] for i, n in enumerate(lengths)]


def engine_steps(runner_layout: tuple[int, int] | None, threads: int, prompts: list[list[int]], max_tokens: int,
                 budget: int) -> dict:
    """Run the prompts through an Engine; per-step times by kind, and rank 0's timers when parallel."""
    torch.set_num_threads(threads)
    config = EngineConfig(cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=256, swap_space_gb=0),
                          scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    engine = Engine(config)
    if runner_layout is not None:
        ckpt = load_checkpoint(None)
        engine.runner = build_runner(ckpt.arch, ckpt.weights, model=None, num_blocks=engine.num_blocks,
                                     block_size=BLOCK_SIZE, tensor_parallel_size=runner_layout[0],
                                     pipeline_parallel_size=runner_layout[1], threads_per_rank=1)
        engine.runner.collect_stats()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    prefill, decode = [], []
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        s = engine.last_step
        if s is not None:
            (prefill if s.num_prefill_tokens else decode).append(s.duration)
    result = {"prefill_steps": len(prefill), "prefill_step_ms": 1e3 * statistics.mean(prefill),
              "decode_steps": len(decode), "decode_step_ms": 1e3 * statistics.median(decode), "outputs": outputs}
    if runner_layout is not None:
        ranks = engine.runner.collect_stats()
        result["rank0_comm_ms_per_step"] = 1e3 * ranks[0].comm_s / ranks[0].steps
        result["rank1_comm_ms_per_step"] = 1e3 * ranks[1].comm_s / ranks[1].steps
        engine.runner.close()
    return result


def measure_tp(args) -> dict:
    vocab = load_checkpoint(None).arch.vocab_size
    prompts = prompts_of(prompt_lengths(args.requests, 8, args.max_prompt), vocab)
    runs = {"one process, 1 thread": engine_steps(None, 1, prompts, args.max_tokens, args.budget),
            "one process, 2 threads": engine_steps(None, 2, prompts, args.max_tokens, args.budget),
            "TP=2, 1 thread per rank": engine_steps((2, 1), 1, prompts, args.max_tokens, args.budget)}
    same = len({json.dumps(r.pop("outputs"), sort_keys=True) for r in runs.values()}) == 1
    return {"runs": runs, "greedy_outputs_identical": same}


def measure_pp(args) -> dict:
    torch.set_num_threads(1)
    ckpt = load_checkpoint(None)
    lengths = prompt_lengths(args.requests, 16, args.max_prompt)
    prompts = {f"r{i}": p for i, p in enumerate(prompts_of(lengths, ckpt.arch.vocab_size))}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    cache = CacheConfig(block_size=BLOCK_SIZE)
    out: dict = {"prompt_tokens": sum(lengths), "output_tokens_each": args.max_tokens}
    schedulers = {f"chunked (sarathi, {args.budget}-token steps)": SchedulerConfig("sarathi", max_num_batched_tokens=args.budget),
                  f"whole prompts (vllm, {args.max_prompt}-token budget)": SchedulerConfig("vllm", max_num_batched_tokens=args.max_prompt)}
    with build_runner(ckpt.arch, ckpt.weights, model=None, num_blocks=512, block_size=BLOCK_SIZE,
                      pipeline_parallel_size=2, threads_per_rank=1) as runner:
        reference = None
        for slots in (1, 2):
            for name, sched in schedulers.items():
                t0 = time.perf_counter()
                run = run_pipelined(runner, prompts, params, sched, cache, num_slots=slots)
                reference = reference or run.outputs
                out[f"{slots} in flight, {name}"] = {
                    "bubble_fraction": round(run.bubble_fraction, 4), "wall_s": round(run.wall_s, 2),
                    "steps": run.num_steps, "step_tokens_max": max(run.step_tokens),
                    "compute_s_per_rank": [round(t.forward_s, 2) for t in run.timers],
                    "same_tokens_as_first_run": run.outputs == reference, "elapsed_s": round(time.perf_counter() - t0, 2)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["tp", "pp"])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--budget", type=int, default=64, help="token budget of a step (the chunk size under sarathi)")
    args = p.parse_args(argv)
    result = measure_tp(args) if args.what == "tp" else measure_pp(args)
    print(json.dumps({"what": args.what, "args": vars(args), **result}, indent=2))


if __name__ == "__main__":
    main()
