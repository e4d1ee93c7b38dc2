"""Measurements for docs/scaling.md: TP=2's per-step communication and PP=2's bubble, on the bundled model.

    python benchmarks/parallel_measure.py tp   # step time and time in collectives, TP=2 vs one process
    python benchmarks/parallel_measure.py pp   # bubble fraction at PP=2: chunked vs whole prompts, 1 vs 2 steps in flight
    python benchmarks/parallel_measure.py ray  # prefix-cache hit rate over 2 Ray Serve replicas, by routing policy
    python benchmarks/parallel_measure.py allreduce  # microseconds per gloo all-reduce between 2 processes

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
from paceline.parallel.routing import shared_prefix_workload
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
                run = run_pipelined(runner, prompts, params, sched, cache, num_slots=slots,
                                    arrive_every_tokens=args.arrive_every_tokens)
                reference = reference or run.outputs
                out[f"{slots} in flight, {name}"] = {
                    "bubble_fraction": round(run.bubble_fraction, 4), "wall_s": round(run.wall_s, 2),
                    "steps": run.num_steps, "step_tokens_max": max(run.step_tokens),
                    "compute_s_per_rank": [round(t.forward_s, 2) for t in run.timers],
                    "same_tokens_as_first_run": run.outputs == reference, "elapsed_s": round(time.perf_counter() - t0, 2)}
    return out


def _allreduce_rank(rank: int, port: int, shapes: list[tuple[int, int]], repeats: int, results) -> None:
    from paceline.parallel.comm import init_groups

    torch.set_num_threads(1)
    groups = init_groups(rank, 2, port, torch.device("cpu"), 60.0)
    out = {}
    for shape in shapes:
        t = torch.ones(shape)
        for _ in range(10):  # warm-up
            groups.cpu.allreduce([t]).wait()
        t0 = time.perf_counter()
        for _ in range(repeats):
            groups.cpu.allreduce([t]).wait()
        out[f"{shape[0]}x{shape[1]}"] = 1e6 * (time.perf_counter() - t0) / repeats
    if rank == 0:
        results.put(out)


def measure_allreduce(args) -> dict:
    """Microseconds per gloo all-reduce between 2 processes on the loopback, at the shapes a step of the bundled
    model all-reduces (tokens x hidden 576), with nothing else running in the two ranks."""
    from paceline.parallel.comm import free_port

    ctx = torch.multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    shapes = [(1, 576), (8, 576), (64, 576), (512, 576)]
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, shapes, args.repeats, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    out = results.get(timeout=300)
    for p in procs:
        p.join()
    return {"us_per_allreduce": {k: round(v, 1) for k, v in out.items()}, "repeats": args.repeats}


def measure_ray(args) -> dict:
    """Prefix-cache hit rate over 2 replicas on Ray Serve, by routing policy, on a shared-prefix workload sent one
    request at a time (so the figures do not depend on timing)."""
    import urllib.request

    import ray
    from openai import OpenAI
    from ray import serve

    from paceline.entrypoints import ray_serve
    from paceline.parallel.comm import free_port

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = {"block_size": BLOCK_SIZE, "num_blocks": args.replica_blocks, "served_model_name": "m"}
    prompts = shared_prefix_workload(args.groups, args.per_group)
    out: dict = {"requests": len(prompts), "groups": args.groups, "blocks_per_replica": args.replica_blocks}
    for policy in ("round_robin", "least_outstanding", "prefix"):
        serve.run(ray_serve.build(2, engine, policy), name="paceline", route_prefix="/")
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        for p in prompts:
            client.completions.create(model="m", prompt=p, max_tokens=1, temperature=0)
        stats = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/paceline/replicas").read())
        hits, queries = sum(s["prefix_cache_hits"] for s in stats), sum(s["prefix_cache_queries"] for s in stats)
        out[policy] = {"hit_rate": round(hits / queries, 4), "hit_tokens": hits, "prompt_tokens": queries}
        serve.delete("paceline")
    serve.shutdown()
    ray.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["tp", "pp", "ray", "allreduce"])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--budget", type=int, default=64, help="token budget of a step (the chunk size under sarathi)")
    p.add_argument("--groups", type=int, default=12, help="ray: shared prefixes")
    p.add_argument("--per-group", type=int, default=4, help="ray: requests per shared prefix")
    p.add_argument("--replica-blocks", type=int, default=256, help="ray: KV blocks per replica")
    p.add_argument("--arrive-every-tokens", type=int, default=0,
                   help="pp: a new request each time this many more tokens have been run (0: all at once)")
    p.add_argument("--repeats", type=int, default=1000, help="allreduce: timed all-reduces per shape")
    args = p.parse_args(argv)
    result = {"tp": measure_tp, "pp": measure_pp, "ray": measure_ray, "allreduce": measure_allreduce}[args.what](args)
    print(json.dumps({"what": args.what, "args": vars(args), **result}, indent=2))


if __name__ == "__main__":
    main()
