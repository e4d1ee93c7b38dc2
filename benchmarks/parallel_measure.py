"""Measurements for docs/scaling.md: TP=2's per-step communication and PP=2's bubble, on the bundled model.

    python benchmarks/parallel_measure.py tp   # step time and time in collectives, TP=2 vs one process
    python benchmarks/parallel_measure.py pp   # PP=2 Engine (1, 2 slots) vs one process: overhead, bubble; chunked, whole
    python benchmarks/parallel_measure.py ray  # prefix-cache hit rate over 2 Ray Serve replicas, by routing policy
    python benchmarks/parallel_measure.py replay  # the same without Ray or a model: the real Router and KV cache
    python benchmarks/parallel_measure.py sim  # the same through the simulator: hit rates per routing policy
    python benchmarks/parallel_measure.py overhead  # one process vs TP=2 vs PP=2, same steps: compute vs waiting
    python benchmarks/parallel_measure.py allreduce  # microseconds per gloo all-reduce between 2 processes

Every rank runs one thread (the driver too). On a machine with fewer cores than ranks nothing can get faster; the
figures say what the communication and the idle stages cost, and only ratios from one run mean anything.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import urllib.request

import torch

from paceline.bench import host_cpu
from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.engine.engine import Engine
from paceline.engine.pipelined import PipelinedEngine
from paceline.model.loader import load_checkpoint
from paceline.parallel.executor import build_runner
from paceline.parallel.pipeline import run_pipelined
from paceline.core.kv_cache import KVCacheManager
from paceline.parallel.routing import (Router, agent_rounds, common_preamble_chats, multi_turn_chats,
                                       shared_prefix_workload)
from paceline.request import Request
from paceline.sampling import SamplingParams

BLOCK_SIZE = 16


def down(x: float, digits: int = 4) -> float:
    """x cut to `digits` decimals, never rounded up (figures in the docs are not)."""
    return math.floor(x * 10 ** digits) / 10 ** digits


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


def engine_run(pp: int, sched: SchedulerConfig, prompts: dict[str, list[int]], params: SamplingParams,
               arrive_every_tokens: int, num_slots: int = 1):
    """The prompts through a real Engine (float32, token budget only: no step-time target, so the schedule does not
    depend on timing) with `num_slots` steps in flight under PP (engine/pipelined.py), every rank one thread.
    Request i is added once i * k tokens have run (k = 0: all at once). Returns the engine (still open, for its
    runner) and the run's figures."""
    torch.set_num_threads(1)
    config = EngineConfig(dtype="float32", quantization="none", tbt_goal_ms=0, pipeline_parallel_size=pp,
                          cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=512, swap_space_gb=0),
                          scheduler=dataclasses.replace(sched))
    engine = PipelinedEngine(config, num_slots=num_slots) if pp > 1 else Engine(config)
    torch.set_num_threads(1)  # build_runner shares the host's cores among the ranks: 1 each on 2 cores
    if pp > 1:
        engine.runner.collect_stats()  # timers from here
    ids = list(prompts)
    outputs: dict[str, list[int]] = {}
    steps: list[tuple[int, int, float]] = []  # (prefill tokens, decode tokens, seconds)
    added = submitted = 0
    t0 = time.perf_counter()
    while True:
        while added < len(ids) and added * arrive_every_tokens <= submitted:
            engine.add_request(ids[added], prompts[ids[added]], params)
            added += 1
        if not engine.has_unfinished():
            if added < len(ids):  # idle until the next arrival: let it come now
                submitted = added * arrive_every_tokens
                continue
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        s = engine.last_step
        if s is not None:
            steps.append((s.num_prefill_tokens, s.num_decode_tokens, s.duration))
            submitted += s.num_prefill_tokens + s.num_decode_tokens
    wall = time.perf_counter() - t0
    run = {"wall_s": wall, "steps": steps, "outputs": outputs, "threads": torch.get_num_threads()}
    if pp > 1:
        timers = engine.runner.collect_stats()
        run["bubble_fraction"] = 1.0 - sum(t.forward_s for t in timers) / (len(timers) * wall)
        run["compute_s_per_rank"] = [round(t.forward_s, 2) for t in timers]
        run["waiting_s_per_rank"] = [round(t.comm_s, 2) for t in timers]
    return engine, run


def step_overhead(one: list[tuple[int, int, float]], pp: list[tuple[int, int, float]]) -> dict:
    """PP=2's extra time per step over one process, step by step (the same schedule in both runs): with one step in
    flight the two stages run one after the other, so the difference is what the pipeline adds (sending the step,
    the hidden states and the logits rows; waking the other process), not compute."""
    if [s[:2] for s in one] != [s[:2] for s in pp]:
        return {"error": "the two runs scheduled different steps"}
    out = {}
    for kind, keep in (("all steps", lambda s: True), ("steps with prefill", lambda s: s[0] > 0),
                       ("decode-only steps", lambda s: s[0] == 0)):
        pairs = [(a[2], b[2]) for a, b in zip(one, pp) if keep(a)]
        if not pairs:
            continue
        extra = [b - a for a, b in pairs]
        out[kind] = {"steps": len(pairs), "one_process_ms_mean": round(1e3 * statistics.mean(a for a, _ in pairs), 2),
                     "pp2_ms_mean": round(1e3 * statistics.mean(b for _, b in pairs), 2),
                     "extra_ms_mean": round(1e3 * statistics.mean(extra), 2),
                     "extra_ms_median": round(1e3 * statistics.median(extra), 2),
                     "extra_share_of_pp2_time": round(sum(extra) / sum(b for _, b in pairs), 4)}
    return out


def measure_pp(args) -> dict:
    """PP=2 on the real Engine against one process, chunked vs whole-prompt scheduling: one slot (one step in
    flight: the per-step overhead and the bubble), then two slots (two steps in flight, engine/pipelined.py), then
    the second engine's runner with two steps in flight through run_pipelined."""
    torch.set_num_threads(1)
    vocab = load_checkpoint(None).arch.vocab_size
    lengths = prompt_lengths(args.requests, 16, args.max_prompt)
    prompts = {f"r{i}": p for i, p in enumerate(prompts_of(lengths, vocab))}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    cache = CacheConfig(block_size=BLOCK_SIZE)
    out: dict = {"prompt_tokens": sum(lengths), "output_tokens_each": args.max_tokens, "cpu_count": os.cpu_count()}
    schedulers = {"chunked": SchedulerConfig("stall-free", max_num_batched_tokens=args.budget),
                  "whole": SchedulerConfig("prefill-first", max_num_batched_tokens=args.max_prompt)}
    reference = None
    for every in [int(x) for x in str(args.arrive_every_tokens).split(",")]:
        pattern: dict = {}
        for name, sched in schedulers.items():
            one_engine, one = engine_run(1, sched, prompts, params, every)
            del one_engine
            engine, pp = engine_run(2, sched, prompts, params, every, num_slots=1)
            engine.runner.close()
            engine, slots2 = engine_run(2, sched, prompts, params, every, num_slots=2)
            try:
                two = run_pipelined(engine.runner, prompts, params, dataclasses.replace(sched), cache, num_slots=2,
                                    arrive_every_tokens=every)
            finally:
                engine.runner.close()
            reference = reference or one["outputs"]
            pattern[name] = {
                "one process": {"wall_s": round(one["wall_s"], 2), "steps": len(one["steps"])},
                "PP=2, Engine (1 step in flight)": {
                    "wall_s": round(pp["wall_s"], 2), "steps": len(pp["steps"]),
                    "bubble_fraction": round(pp["bubble_fraction"], 4), "compute_s_per_rank": pp["compute_s_per_rank"],
                    "waiting_s_per_rank": pp["waiting_s_per_rank"], "threads_rank0": pp["threads"],
                    "per_step_overhead": step_overhead(one["steps"], pp["steps"])},
                "PP=2, Engine (2 slots: 2 steps in flight)": {
                    "wall_s": round(slots2["wall_s"], 2), "steps": len(slots2["steps"]),
                    "bubble_fraction": round(slots2["bubble_fraction"], 4),
                    "compute_s_per_rank": slots2["compute_s_per_rank"],
                    "waiting_s_per_rank": slots2["waiting_s_per_rank"]},
                "PP=2, 2 steps in flight (run_pipelined)": {
                    "wall_s": round(two.wall_s, 2), "steps": two.num_steps,
                    "bubble_fraction": round(two.bubble_fraction, 4),
                    "compute_s_per_rank": [round(t.forward_s, 2) for t in two.timers]},
                "same_tokens": (one["outputs"] == reference and pp["outputs"] == reference
                                and slots2["outputs"] == reference and two.outputs == reference)}
        c, w = pattern["chunked"], pattern["whole"]
        key = "PP=2, Engine (1 step in flight)"
        pattern["ratios whole / chunked"] = {
            "bubble, 1 in flight": round(w[key]["bubble_fraction"] / c[key]["bubble_fraction"], 3),
            "bubble, Engine 2 slots": round(w["PP=2, Engine (2 slots: 2 steps in flight)"]["bubble_fraction"]
                                            / c["PP=2, Engine (2 slots: 2 steps in flight)"]["bubble_fraction"], 3),
            "bubble, 2 in flight": round(w["PP=2, 2 steps in flight (run_pipelined)"]["bubble_fraction"]
                                         / c["PP=2, 2 steps in flight (run_pipelined)"]["bubble_fraction"], 3),
            "overhead per step, ms": round(w[key]["per_step_overhead"]["all steps"]["extra_ms_mean"]
                                           / c[key]["per_step_overhead"]["all steps"]["extra_ms_mean"], 3),
            "overhead share of step time": round(w[key]["per_step_overhead"]["all steps"]["extra_share_of_pp2_time"]
                                                 / c[key]["per_step_overhead"]["all steps"]["extra_share_of_pp2_time"], 3)}
        out[f"arrivals every {every} tokens" if every else "all at once"] = pattern
    return out


def timed_steps(tp: int, pp: int, prompts: list[list[int]], max_tokens: int, budget: int) -> dict:
    """The prompts through a real Engine (float32, token budget only, so every layout runs the same steps), every
    rank one thread. Per step: the step's time, rank 0's time inside the model call (forward_tokens: for TP=2 and
    PP=2 it includes sending the step and waiting for the other rank), and each rank's timers (compute, waiting),
    read after the step so that reading them is not timed."""
    torch.set_num_threads(1)
    config = EngineConfig(dtype="float32", quantization="none", tbt_goal_ms=0, tensor_parallel_size=tp,
                          pipeline_parallel_size=pp, cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=256,
                                                                       swap_space_gb=0),
                          scheduler=SchedulerConfig("stall-free", max_num_batched_tokens=budget))
    # the plain Engine even at PP=2 (Engine() would give the pipelined one): one runner.execute per step is what
    # the per-step split into compute and waiting is read from
    engine = object.__new__(Engine)
    engine.__init__(config)
    torch.set_num_threads(1)
    runner = engine.runner
    parallel = tp * pp > 1
    if parallel:
        runner.collect_stats()
    model_s = [0.0]
    forward = runner.forward_tokens

    def timed_forward(*a, **kw):
        t0 = time.perf_counter()
        try:
            return forward(*a, **kw)
        finally:
            model_s[0] += time.perf_counter() - t0

    runner.forward_tokens = timed_forward
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    steps, outputs = [], {}
    while engine.has_unfinished():
        model_s[0] = 0.0
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        s = engine.last_step
        if s is None:
            continue
        step = {"prefill": s.num_prefill_tokens, "decode": s.num_decode_tokens, "step_s": s.duration,
                "model_s": model_s[0]}
        if parallel:
            step["ranks"] = [(t.forward_s, t.comm_s) for t in runner.collect_stats()]
        steps.append(step)
    if parallel:
        runner.close()
    return {"steps": steps, "outputs": outputs}


def breakdown(tp: int, pp: int, steps: list[dict]) -> dict:
    """Mean ms per step of each part. TP: the all-reduces run inside the layers, so a rank's compute is its model
    time less its time in collectives (rank 0's also counts broadcasting the step); PP with one step in flight:
    the stages run one after the other, so rank 0's model call minus both stages' compute is the time the step
    spent on neither: sending the step, the hidden states and the logits rows, and waking the other process."""
    n = len(steps)
    ms = lambda xs: round(1e3 * sum(xs) / n, 2)  # noqa: E731
    out = {"steps": n, "step_ms": ms(s["step_s"] for s in steps), "model_call_ms": ms(s["model_s"] for s in steps)}
    if tp > 1:
        out["rank0_compute_ms"] = ms(s["model_s"] - s["ranks"][0][1] for s in steps)
        out["rank0_in_collectives_ms"] = ms(s["ranks"][0][1] for s in steps)
        out["rank1_compute_ms"] = ms(s["ranks"][1][0] - s["ranks"][1][1] for s in steps)
        out["rank1_in_collectives_ms"] = ms(s["ranks"][1][1] for s in steps)
    elif pp > 1:
        out["stage0_compute_ms"] = ms(s["ranks"][0][0] for s in steps)
        out["stage1_compute_ms"] = ms(s["ranks"][1][0] for s in steps)
        out["neither_stage_computing_ms"] = ms(s["model_s"] - s["ranks"][0][0] - s["ranks"][1][0] for s in steps)
    return out


def measure_overhead(args) -> dict:
    """One process, TP=2 and PP=2 on the same steps, twice in turn (one, TP, PP, one, TP, PP) so that drift shows
    as a difference between the rounds; how much CPU other processes took meanwhile (the run is clean only if
    that is near 0)."""
    vocab = load_checkpoint(None).arch.vocab_size
    prompts = prompts_of(prompt_lengths(args.requests, 8, args.max_prompt), vocab)
    layouts = {"one process": (1, 1), "TP=2": (2, 1), "PP=2": (1, 2)}
    before = host_cpu.snapshot()
    rounds, reference = [], None
    for _ in range(args.rounds):
        result: dict = {}
        for name, (tp, pp) in layouts.items():
            run = timed_steps(tp, pp, prompts, args.max_tokens, args.budget)
            reference = reference or run["outputs"]
            kinds = {"prefill steps": [s for s in run["steps"] if s["prefill"]],
                     "decode-only steps": [s for s in run["steps"] if not s["prefill"]]}
            result[name] = {k: breakdown(tp, pp, v) for k, v in kinds.items() if v}
            result[name]["same_tokens"] = run["outputs"] == reference
            result[name]["schedule"] = [(s["prefill"], s["decode"]) for s in run["steps"]]
        same_steps = len({json.dumps(r["schedule"]) for r in result.values()}) == 1
        for r in result.values():
            del r["schedule"]
        result["same steps in every layout"] = same_steps
        rounds.append(result)
    used = host_cpu.between(before, host_cpu.snapshot())  # the TP/PP ranks count as ours once joined
    return {"rounds": rounds, "wall_s": round(used.wall_s, 1), "cpu_count": os.cpu_count(),
            "cpu_s_all_processes": round(used.all_s, 1), "cpu_s_this_benchmark": round(used.ours_s, 1),
            "other_processes_share_of_2_cores": round(used.other_cores / os.cpu_count(), 4)}


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
    request at a time (so the figures do not depend on timing); every policy at every cache size, in one run."""
    import pathlib

    import ray
    from openai import OpenAI
    from ray import serve

    from paceline.entrypoints import ray_serve
    from paceline.parallel.comm import free_port

    # the replicas must import this checkout's paceline, and whatever put Ray on this process's path
    root = str(pathlib.Path(__file__).resolve().parents[1])
    path = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    out: dict = {"groups": args.groups, "per_group": args.per_group, "seed": args.ray_seed}
    for workload in args.workload.split(","):
        bodies = workload_bodies(workload, args.groups, args.per_group, args.ray_seed)
        for blocks in [int(b) for b in str(args.replica_blocks).split(",")]:
            engine = {"block_size": BLOCK_SIZE, "num_blocks": blocks, "served_model_name": "m"}
            rates: dict = {}
            for name in (args.routers or "round_robin,least_outstanding,prefix").split(","):
                kwargs = dict(ROUTERS[name])
                t0 = time.perf_counter()
                serve.run(ray_serve.build(args.replicas, engine, kwargs.pop("policy"), router_kwargs=kwargs),
                          name="paceline", route_prefix="/")
                client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
                for b in bodies:
                    if "messages" in b:
                        client.chat.completions.create(model="m", messages=b["messages"], max_tokens=1, temperature=0)
                    else:
                        client.completions.create(model="m", prompt=b["prompt"], max_tokens=1, temperature=0)
                # every replica the router saw, live or not: one that Serve dropped or replaced served requests too
                stats = [r for r in json.loads(urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/paceline/replicas").read())["replicas"] if "prefix_cache_queries" in r]
                hits, queries = (sum(s["prefix_cache_hits"] for s in stats),
                                 sum(s["prefix_cache_queries"] for s in stats))
                rates[name] = {"hit_rate": down(hits / queries), "hit_tokens": hits, "prompt_tokens": queries,
                               "routed_per_replica": [s["routed"] for s in stats],
                               "elapsed_s": round(time.perf_counter() - t0, 1)}
                print(json.dumps({"workload": workload, "blocks": blocks, name: rates[name]}), file=sys.stderr,
                      flush=True)  # as it goes: a run cut short keeps what it measured
                serve.delete("paceline")
            if "prefix" in rates and "round_robin" in rates:
                rates["prefix / round_robin"] = down(rates["prefix"]["hit_tokens"] / rates["round_robin"]["hit_tokens"], 3)
            out[f"{workload}, {blocks} blocks per replica"] = rates
    serve.shutdown()
    ray.shutdown()
    return out


def workload_bodies(name: str, groups: int, per_group: int, seed: int) -> list[dict]:
    """The requests of a shared-prefix workload as OpenAI request bodies, each tagged with its group (`_group`,
    stripped before sending). system-prompts: completions under `groups` long system prompts, in a random order;
    agent-rounds: the same prompts, each once per round (`per_group` rounds); chat-preamble: chats
    that all start with the stock system prompt, then share a document by group; multi-turn: `groups` chats of
    `per_group` turns, turn k+1's prompt starting with all of turn k's."""
    if name == "system-prompts":
        return [{"prompt": p, "_group": p.split("(desk ")[1].split(")")[0]}
                for p in shared_prefix_workload(groups, per_group, seed)]
    if name == "agent-rounds":  # `groups` system prompts, each once per round, `per_group` rounds
        return [{"prompt": p, "_group": p.split("(desk ")[1].split(")")[0]}
                for p in agent_rounds(groups, per_group, seed)]
    if name == "chat-preamble":
        return [{"messages": m, "_group": m[1]["content"].split("(file ")[1].split(")")[0]}
                for m in common_preamble_chats(groups, per_group, seed)]
    if name == "multi-turn":  # `groups` conversations of `per_group` turns, each turn carrying the chat so far
        return [{"messages": m, "_group": str(c)} for c, m in multi_turn_chats(groups, per_group, seed)]
    raise ValueError(f"unknown workload {name!r}")


WORKLOADS = ("system-prompts", "agent-rounds", "chat-preamble", "multi-turn")


ROUTERS = {"round_robin": {"policy": "round_robin"}, "least_outstanding": {"policy": "least_outstanding"},
           "prefix": {"policy": "prefix"},
           # min_match_fraction before it became 0.3 (chats split at their second turn)
           "prefix_half": {"policy": "prefix", "min_match_fraction": 0.5},
           # the router before min_match_fraction: any match of a first chunk is followed
           "prefix_any_match": {"policy": "prefix", "min_match_fraction": 1e-9}}


def token_ids(bodies: list[dict], tokenizer) -> list[list[int]]:
    """The prompts as the server tokenizes them (a chat through the model's chat template)."""
    return [tokenizer.encode(tokenizer.apply_chat_template(b["messages"]), add_special_tokens=False)
            if "messages" in b else tokenizer.encode(b["prompt"]) for b in bodies]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def replay_hits(bodies: list[dict], router_kwargs: dict, blocks: int, tokenizer, replicas: int = 2) -> dict:
    """The bodies sent one at a time to `replicas` replicas, each with the engine's own KV cache manager of `blocks`
    blocks (prefix caching on, one output token, freed tail first as the engine does): the prefix-cache hit rate
    the Ray run measures, with no model and no Ray. Every miss of a shared block is put down to its cause: `cold`
    (the group's first request: no router avoids it), `split` (the earlier request of its group that shares the
    most with it went to another replica), `evicted` (this replica had those blocks and evicted them). A request
    misses when it is served fewer full blocks than it shares with an earlier request of its group (the first of a
    group: than the whole group shares)."""
    router = Router(replicas, **router_kwargs)
    kvs = [KVCacheManager(blocks, BLOCK_SIZE) for _ in range(replicas)]
    params = SamplingParams(max_tokens=1)
    ids = token_ids(bodies, tokenizer)
    shared: dict[str, list[int]] = {}  # group -> the token prefix all its requests share
    for b, t in zip(bodies, ids):
        s = shared.setdefault(b["_group"], t)
        shared[b["_group"]] = s[:common_prefix(s, t)]
    earlier: dict[str, list[tuple[list[int], int]]] = {}  # group -> (tokens, replica) of its requests so far
    misses = {"cold": 0, "split": 0, "evicted": 0}
    for i, (body, tokens) in enumerate(zip(bodies, ids)):
        r = router.order({k: v for k, v in body.items() if k != "_group"})[0]
        kv, req = kvs[r], Request(f"r{i}", tokens, params, 0.0)
        cached = kv.find_cached_prefix(req)
        assert kv.allocate(req, len(tokens) - len(cached) * BLOCK_SIZE, cached)
        kv.record_prefix_query(len(tokens), len(cached) * BLOCK_SIZE)
        req.num_computed_tokens = len(tokens)
        kv.register_computed(req)
        kv.free(req)
        kv.forget(req.request_id)
        group = body["_group"]
        before = earlier.setdefault(group, [])
        if not before:
            if len(cached) < min(len(shared[group]), len(tokens) - 1) // BLOCK_SIZE:
                misses["cold"] += 1
        else:
            common = [common_prefix(tokens, t) for t, _ in before]
            best = max(common)
            if len(cached) < min(best, len(tokens) - 1) // BLOCK_SIZE:
                homes = {rep for (_, rep), n in zip(before, common) if n == best}
                misses["evicted" if r in homes else "split"] += 1
        before.append((tokens, r))
    hits, queries = sum(k.prefix_hits for k in kvs), sum(k.prefix_queries for k in kvs)
    # what one replica with an unbounded cache would hit: every request its full blocks shared with an earlier one
    ceiling = sum(BLOCK_SIZE * (min(max([common_prefix(t, u) for u in ids[:i]], default=0), len(t) - 1) // BLOCK_SIZE)
                  for i, t in enumerate(ids))
    return {"hit_rate": down(hits / queries), "hit_tokens": hits, "prompt_tokens": queries,
            "ceiling_hit_rate": down(ceiling / queries),
            "requests_missing_shared_blocks": misses, "routed_per_replica": router.routed}


def measure_replay(args) -> dict:
    """Every router on every workload, cache size and shuffle (seed), by replay_hits: which misses each router has
    and why, and how far the prefix / round-robin ratio moves with the order the requests come in."""
    from paceline.bench.prompts import load_tokenizer

    tokenizer = load_tokenizer()
    out: dict = {"groups": args.groups, "per_group": args.per_group, "replicas": args.replicas}
    for workload in args.workload.split(","):
        for blocks in [int(b) for b in str(args.replica_blocks).split(",")]:
            runs, ratios = {}, []
            for seed in range(args.seeds):
                bodies = workload_bodies(workload, args.groups, args.per_group, seed)
                run = {name: replay_hits(bodies, ROUTERS[name], blocks, tokenizer, args.replicas)
                       for name in (args.routers or ",".join(ROUTERS)).split(",")}
                ratios.append(run["prefix"]["hit_tokens"] / run["round_robin"]["hit_tokens"])  # same prompt tokens
                run["prefix / round_robin"] = down(ratios[-1], 3)
                runs[f"seed {seed}"] = run
            runs["prefix / round_robin over the seeds"] = {
                "median": down(statistics.median(ratios), 3), "min": down(min(ratios), 3),
                "max": down(max(ratios), 3), "seeds at or above 2x": sum(r >= 2 for r in ratios)}
            out[f"{workload}, {blocks} blocks per replica"] = runs
    return out


def measure_sim(args) -> dict:
    """The same workloads through the simulator (paceline.sim): its router is the ingress's, each replica's prefix
    cache the real scheduler's. Two arrival patterns: `one at a time` (each request 1 token out, arriving after the
    last finished: what the Ray run and the replay send) and `poisson` (`--sim-rate` requests/s with `--max-tokens`
    out each, so several are in flight and least-outstanding differs from round-robin). Virtual time,
    deterministic; the cost model is the roofline of `--sim-model` on one `--sim-gpu` per replica (it sets only how
    long requests stay in flight)."""
    import random

    from paceline.bench.prompts import load_tokenizer
    from paceline.sim.cost_model import roofline_from_names
    from paceline.sim.simulator import Simulator
    from paceline.sim.workloads import SimRequest

    tokenizer = load_tokenizer()
    cost = roofline_from_names(args.sim_model, args.sim_gpu, 1, 1)
    sched = SchedulerConfig("stall-free", max_num_batched_tokens=512, max_model_len=4096)
    policies = {"round_robin": {}, "least_outstanding": {}, "prefix": {},
                "prefix, min_match_fraction 0.5": {"min_match_fraction": 0.5}}
    out: dict = {"groups": args.groups, "per_group": args.per_group, "replicas": args.sim_replicas,
                 "cost_model": f"roofline {args.sim_model} on {args.sim_gpu}"}
    for workload in args.workload.split(","):
        for blocks in [int(b) for b in str(args.replica_blocks).split(",")]:
            for pattern in ("one at a time", "poisson"):
                runs, ratios = {}, []
                for seed in range(args.seeds):
                    ids = token_ids(workload_bodies(workload, args.groups, args.per_group, seed), tokenizer)
                    rng, t = random.Random(seed), 0.0
                    reqs = []
                    for i, p in enumerate(ids):
                        t = 10.0 * i if pattern == "one at a time" else t + rng.expovariate(args.sim_rate)
                        reqs.append(SimRequest(i, t, len(p), 1 if pattern == "one at a time" else args.max_tokens,
                                               prompt=p))
                    run = {}
                    for name, options in policies.items():
                        sim = Simulator(cost, sched, CacheConfig(block_size=BLOCK_SIZE, num_blocks=blocks), blocks,
                                        num_replicas=args.sim_replicas, router=name.split(",")[0],
                                        router_options=options)
                        result = sim.run(reqs)
                        run[name] = {"hit_rate": down(result.prefix_cache_hit_rate),
                                     "hit_tokens": result.prefix_cache_hits,
                                     "requests_per_replica": [sum(r.replica == k for r in result.requests)
                                                              for k in range(args.sim_replicas)]}
                    ratios.append(run["prefix"]["hit_tokens"] / max(1, run["round_robin"]["hit_tokens"]))
                    run["prefix / round_robin"] = down(ratios[-1], 3)
                    runs[f"seed {seed}"] = run
                summary = {name: {"median": down(statistics.median(r[name]["hit_rate"] for r in runs.values())),
                                  "min": min(r[name]["hit_rate"] for r in runs.values()),
                                  "max": max(r[name]["hit_rate"] for r in runs.values())} for name in policies}
                summary["prefix / round_robin"] = {"median": down(statistics.median(ratios), 3),
                                                   "min": down(min(ratios), 3), "max": down(max(ratios), 3),
                                                   "seeds at or above 2x": sum(r >= 2 for r in ratios)}
                runs["over the seeds"] = summary
                out[f"{workload}, {blocks} blocks per replica, {pattern}"] = runs
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["tp", "pp", "overhead", "ray", "replay", "sim", "allreduce"])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--budget", type=int, default=64, help="token budget of a step (the chunk size under sarathi)")
    p.add_argument("--groups", type=int, default=12, help="ray: shared prefixes")
    p.add_argument("--per-group", type=int, default=4, help="ray: requests per shared prefix")
    p.add_argument("--replica-blocks", default="256", help="ray, replay: KV blocks per replica (comma-separated)")
    p.add_argument("--workload", default="system-prompts",
                   help=f"ray, replay, sim: of {', '.join(WORKLOADS)} (comma-separated)")
    p.add_argument("--routers", default=None,
                   help=f"ray, replay: which of {', '.join(ROUTERS)} (comma-separated; default: ray the first "
                        "three, replay all)")
    p.add_argument("--seeds", type=int, default=1, help="replay: shuffles of the workload, seeds 0..N-1")
    p.add_argument("--ray-seed", type=int, default=0, help="ray: the shuffle sent (replay's seed of the same number)")
    p.add_argument("--arrive-every-tokens", default="0",
                   help="pp: a new request each time this many more tokens have been run (0: all at once); "
                        "several, comma-separated, run one after another")
    p.add_argument("--rounds", type=int, default=2, help="overhead: times every layout runs, in turn")
    p.add_argument("--repeats", type=int, default=1000, help="allreduce: timed all-reduces per shape")
    p.add_argument("--replicas", type=int, default=2, help="ray, replay: replicas")
    p.add_argument("--sim-replicas", type=int, default=2, help="sim: replicas")
    p.add_argument("--sim-rate", type=float, default=4.0, help="sim: requests/s of the poisson pattern")
    p.add_argument("--sim-model", default="llama-3-8b", help="sim: the roofline's model config")
    p.add_argument("--sim-gpu", default="h100", help="sim: the roofline's GPU")
    args = p.parse_args(argv)
    result = {"tp": measure_tp, "pp": measure_pp, "overhead": measure_overhead, "ray": measure_ray, "replay": measure_replay,
              "sim": measure_sim, "allreduce": measure_allreduce}[args.what](args)
    print(json.dumps({"what": args.what, "args": vars(args), **result}, indent=2))


if __name__ == "__main__":
    main()
