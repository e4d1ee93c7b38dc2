"""`paceline simulate`, `paceline simulate capacity` and `paceline profile`."""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from paceline.bench.capacity import MAX_DELAY_S
from paceline.config import (PREEMPTION_MODES, SCHEDULERS, SCHEDULING_POLICIES, CacheConfig, SchedulerConfig,
                             int_or_auto, scheduler_name)
from paceline.sim.hardware import GPUS
from paceline.sim.router import ROUTERS


def _common_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--workload", default="chat", help="chat | long-prompt | bursty-priority | sharegpt | arxiv | path.yaml | trace.csv")
    g.add_argument("--rate", type=float, default=1.0, help="requests per second")
    g.add_argument("--num-requests", type=int, default=1000)
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("device and model")
    g.add_argument("--cost-model", default="roofline", help="roofline | path to a `paceline profile` JSON")
    g.add_argument("--gpu", default="a100", choices=sorted(GPUS))
    g.add_argument("--model-config", default="mistral-7b", help="bundled name (mistral-7b, llama-3-8b, llama-2-7b, llama-3-70b, qwen2-72b) or config.json path")
    g.add_argument("--tp", type=int, default=1)
    g.add_argument("--pp", type=int, default=1)
    g.add_argument("--pp-microbatches", type=int, default=None,
                   help="virtual engines per replica whose steps overlap in the pipeline (default: --pp; 1: the "
                        "stages run one after another)")
    g.add_argument("--step-overhead-ms", type=float, default=2.0, help="roofline: CPU time per step")
    g.add_argument("--efficiency", action="append", default=[], metavar="CLASS=F",
                   help="roofline: fraction of peak for gemm | attn_prefill | attn_decode | elementwise (repeatable)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache blocks per replica, overriding the sizing")
    g.add_argument("--num-blocks", dest="num_kv_blocks", type=int, default=None, help=argparse.SUPPRESS)  # old name
    g.add_argument("--kv-cache-memory-gb", type=float, default=CacheConfig.kv_cache_memory_gb, help="profiled: KV memory, as the server's flag")
    g.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    g.add_argument("--swap-space-gb", type=float, default=CacheConfig.swap_space_gb)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of shared prompt prefixes (default: on)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help=argparse.SUPPRESS)  # the old spelling
    g = p.add_argument_group("fleet and scheduler")
    g.add_argument("--replicas", type=int, default=1)
    g.add_argument("--router", default="round-robin", choices=ROUTERS,
                   help="as the Ray Serve ingress routes (python -m paceline.entrypoints.ray_serve --policy)")
    g.add_argument("--router-min-match-fraction", type=float, default=None,
                   help="prefix router: follow a replica's cached prefix only if it covers this share of the prompt "
                        "(default 0.5, as the ingress)")
    g.add_argument("--scheduler", default=SchedulerConfig.policy, choices=SCHEDULERS, type=scheduler_name)
    g.add_argument("--scheduling-policy", default=SchedulerConfig.scheduling_policy, choices=SCHEDULING_POLICIES)
    g.add_argument("--max-num-batched-tokens", type=int_or_auto, default=SchedulerConfig.max_num_batched_tokens,
                   help="a number, or auto (what fits --max-step-ms each step)")
    g.add_argument("--max-num-seqs", type=int_or_auto, default=SchedulerConfig.max_num_seqs,
                   help="a number, or auto (as many as --max-step-ms allows each step)")
    g.add_argument("--max-model-len", type=int, default=None, help="default: the workload's (8192 unless it says)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0)
    g.add_argument("--max-num-partial-prefills", type=int, default=0)
    g.add_argument("--preemption-mode", default=SchedulerConfig.preemption_mode, choices=PREEMPTION_MODES)
    g.add_argument("--priority-aging-s", type=float, default=0.0)
    g.add_argument("--max-batch-wait-ms", type=float, default=0.0)
    g.add_argument("--time-slice-tokens", type=int, default=0,
                   help="preempt a decoding request after this many output tokens when queued work waits (0: off)")
    g.add_argument("--time-slice-ms", type=float, default=0.0, help="the same in ms of residency (0: off)")
    g.add_argument("--level-aging-s", type=float, default=SchedulerConfig.level_aging_s,
                   help="time slices: a request demoted to level L queues as if it arrived L x this after (0: strict levels)")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding as the server takes it, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
                        "a proposal is accepted with the workload's spec_acceptance")
    g.add_argument("--max-step-ms", type=float, default=0.0,
                   help="stall-free: cut prompt chunks so the cost model's step time stays under it (0: off)")


def _output_args(p: argparse.ArgumentParser) -> None:
    """As `paceline bench serve` spells them."""
    g = p.add_argument_group("output")
    g.add_argument("--ttft-slo", type=float, default=None, help="TTFT SLO in ms, for goodput")
    g.add_argument("--tbt-slo", type=float, default=None, help="TBT SLO in ms, for goodput")
    g.add_argument("--output-dir", default=None,
                   help="write results.json (the summary, every request's timeline, every step), results.md and PNGs")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--html", default=None, metavar="PATH",
                   help="write the run as one HTML page drawn by the dashboard's charts ('auto': OUTPUT_DIR/report.html)")
    # the older spellings: the JSON alone to a file, the PNGs alone to a folder
    g.add_argument("--out", default=None, help=argparse.SUPPRESS)
    g.add_argument("--plots", default=None, help=argparse.SUPPRESS)


def deployment_from_args(args: argparse.Namespace):
    from paceline.sim.deploy import Deployment, cost_model_from_spec
    from paceline.sim.workloads import load_workload

    workload = load_workload(args.workload, args.max_model_len)
    eff = {}
    for item in args.efficiency:
        k, _, v = item.partition("=")
        try:
            eff[k] = float(v)
        except ValueError:
            raise ValueError(f"--efficiency wants CLASS=FRACTION, got {item!r}") from None
    kw = {"step_overhead_s": args.step_overhead_ms / 1e3, "block_size": args.block_size}
    if eff:
        from paceline.sim.cost_model import DEFAULT_EFFICIENCY
        kw["efficiency"] = {**DEFAULT_EFFICIENCY, **eff}
    cost = cost_model_from_spec(args.cost_model, args.model_config, args.gpu, args.tp, args.pp,
                                **(kw if args.cost_model == "roofline" else {}))
    max_len = workload.max_model_len
    sched = SchedulerConfig(policy=args.scheduler, scheduling_policy=args.scheduling_policy,
                            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                            max_model_len=max_len, long_prefill_token_threshold=args.long_prefill_token_threshold,
                            max_num_partial_prefills=args.max_num_partial_prefills, preemption_mode=args.preemption_mode,
                            priority_aging_s=args.priority_aging_s, max_batch_wait_ms=args.max_batch_wait_ms,
                            max_step_ms=args.max_step_ms, time_slice_tokens=args.time_slice_tokens,
                            time_slice_ms=args.time_slice_ms, level_aging_s=args.level_aging_s)
    cache = CacheConfig(block_size=args.block_size, num_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
                        swap_space_gb=args.swap_space_gb, enable_prefix_caching=args.enable_prefix_caching)
    from paceline.spec_config import SpeculativeConfig
    dep = Deployment(cost, sched, cache, args.replicas, args.router, args.gpu_memory_utilization,
                     getattr(args, "pp_microbatches", None),
                     speculative=SpeculativeConfig.parse(getattr(args, "speculative_config", None)),
                     router_options=({"min_match_fraction": args.router_min_match_fraction}
                                     if getattr(args, "router_min_match_fraction", None) is not None else None))
    return dep, workload


def _simulate(args: argparse.Namespace) -> None:
    from paceline.bench.report import distribution_table, run_markdown, write_json
    from paceline.sim.metrics import sim_run_dict
    from paceline.sim.workloads import generate

    try:
        dep, workload = deployment_from_args(args)
        reqs = generate(workload, args.rate, args.num_requests, args.seed)
        sim = dep.simulator()
    except ValueError as e:
        sys.exit(f"error: {e}")
    result = sim.run(reqs, in_flight_caps=workload.in_flight_caps())
    run = sim_run_dict(result, system=args.scheduler, workload=workload.name, rate=args.rate,
                       ttft_slo=args.ttft_slo / 1e3 if args.ttft_slo else None,
                       tbt_slo=args.tbt_slo / 1e3 if args.tbt_slo else None)
    s, m = run["summary"], run["simulation"]
    print(f"{workload.name} at {args.rate} req/s, {args.replicas} x {_device_name(args)}, {args.scheduler} "
          f"budget {args.max_num_batched_tokens}, {sim.num_blocks} KV blocks per replica"
          + (f" per virtual engine x {sim.pipeline_microbatches}" if sim.pipeline_microbatches > 1 else ""))
    print(f"{s['completed']}/{s['num_requests']} requests finished ({s['failed']} rejected) in {s['duration_s']:.1f} "
          f"simulated s ({m['wall_s']:.2f} s wall); {m['num_steps']} steps, median decode step "
          f"{m['median_decode_step_s'] * 1e3:.1f} ms; {m['num_preemptions']} preemptions; prefix-cache hit rate "
          f"{result.prefix_cache_hit_rate:.4f}"
          + (f"; pipeline bubble {m['pipeline_bubble_fraction']:.3f}" if m["pipeline_bubble_fraction"] is not None
             else "") + "\n")
    md = run_markdown(run) + "\n\n" + distribution_table(s)
    print(md)
    payload = {**run, "steps": [asdict(x) for x in result.steps]}
    out = Path(args.output_dir) if args.output_dir else None
    if out:
        write_json(out / "results.json", payload)
        (out / "results.md").write_text(md + "\n")
        print(f"wrote {out}/results.json, results.md")
    if args.out:
        write_json(Path(args.out), payload)
    if args.html:
        page = (out or Path(".")) / "report.html" if args.html == "auto" else Path(args.html)
        print(f"wrote {write_html(result, run, md, page, args)}")
    plot_dir = Path(args.plots) if args.plots else out if out and not args.no_plots else None
    if plot_dir:
        from paceline.bench.plots import all_plots  # matplotlib: the [bench] extra
        for p in all_plots([run], plot_dir, s["tbt_slo_s"]):
            print(f"wrote {p}")


def write_html(result, run: dict, md: str, path: Path, args: argparse.Namespace) -> Path:
    """The simulated run as the dashboard draws a server's: one row per replica, on the simulated clock."""
    from paceline.bench import html_report

    steps = []
    for i, s in enumerate(result.steps):
        steps.append(html_report.step_dict(
            f"replica {s.replica}", i + 1, t=s.start, dur=s.duration, pred=s.duration, decode=s.num_decode_tokens,
            prefill=s.num_prefill_tokens, reqs=s.num_requests, running=s.num_running, waiting=s.num_waiting,
            swapped=s.num_swapped, kv_used=s.num_used_blocks, kv_free=s.num_free_blocks, preempted=s.num_preempted))
    latency: dict[str, dict] = {}
    info: dict[str, dict] = {}
    for name in sorted({s["model"] for s in steps}):
        recs = [r for r in result.requests if f"replica {r.replica}" == name]
        latency[name] = html_report.latency_of(recs, name)
        info[name] = {"model": name, "policy": args.scheduler, "max_step_ms": args.max_step_ms,
                             "max_num_batched_tokens": args.max_num_batched_tokens}
    return html_report.write(path, f"paceline simulate: {run['workload']} at {args.rate} req/s", md, steps, latency,
                             info, note=f"{_device_name(args)}; simulated time")


def _device_name(args: argparse.Namespace) -> str:
    if args.cost_model == "roofline":
        return f"{args.model_config} on {args.gpu} tp{args.tp} pp{args.pp}"
    return f"profile {args.cost_model}"


def simulated_decode_step(dep) -> float:
    """The simulated twin of the benchmark's calibration (bench/calibrate.py: 16 requests of 16 prompt tokens
    decoding 96 tokens, median gap): one step of 16 decodes at the middle of that run's context."""
    from paceline.core.batch_shape import BatchShape
    return dep.cost_model.step_time(BatchShape.build(decode_contexts=[16 + 48] * 16))


def _capacity(args: argparse.Namespace) -> None:
    """The benchmark's capacity search (paceline.bench.capacity) with simulated probes; the answer for each SLO is
    judged over every probe, whichever search ran it, as `paceline bench compare` does."""
    from paceline.bench.capacity import capacity_from_probes, parse_slo, search_capacity
    from paceline.sim.metrics import summarize
    from paceline.sim.workloads import generate

    try:
        dep, workload = deployment_from_args(args)
        names = [f"{ms:g}" for ms in args.tbt_slo] if args.tbt_slo else [x for x in args.slo.split(",") if x.strip()]
        slos = [parse_slo(n.strip(), simulated_decode_step(dep)) for n in names]
    except ValueError as e:
        sys.exit(f"error: {e}")

    def probe(rate: float) -> dict:
        return summarize(dep.simulator().run(generate(workload, rate, args.num_requests, args.seed),
                                             in_flight_caps=workload.in_flight_caps()))

    cache: dict[float, dict] = {}
    start = args.start_rate or args.rate
    print(f"capacity of {workload.name}, {args.replicas} x {_device_name(args)}, {args.scheduler} budget {args.max_num_batched_tokens}")
    print("\n| TBT SLO (ms) | capacity (req/s) | p99 TBT (ms) | median sched delay (s) | runs |\n|---|---|---|---|---|")
    for _, slo_s in slos:
        search_capacity(probe, slo_s, start_rate=start, max_probes=args.max_probes, rel_tol=args.rel_tol,
                        min_rate=1e-3, max_delay_s=args.max_scheduling_delay, cache=cache)
    for name, slo_s in slos:
        r = capacity_from_probes(cache, slo_s, max_delay_s=args.max_scheduling_delay)
        at = cache.get(round(r.capacity, 6)) if r.capacity else None
        p99 = at["tbt"]["p99"] * 1e3 if at else float("nan")
        delay = at["scheduling_delay"]["p50"] if at else float("nan")
        label = f"{slo_s * 1e3:g}" if name.endswith("ms") else f"{name} ({slo_s * 1e3:.1f})"
        bound = "≥ " if r.is_lower_bound else ""  # every probe passed: the search ran out of probes first
        print(f"| {label} | {bound}{r.capacity:.3f} | {p99:.1f} | {delay:.2f} | {len(cache)} |")


def _profile(args: argparse.Namespace) -> None:
    from paceline.sim.profile import run_profile
    try:
        model = run_profile(args.out, model=args.model, dtype=args.dtype, quick=args.quick, threads=args.threads,
                            repeats=args.repeats)
    except ValueError as e:
        sys.exit(f"error: {e}")
    m = model.meta
    print(f"wrote {args.out}: {m['num_samples']} batch shapes, median error {m['median_rel_error'] * 100:.1f} %, "
          f"max {m['max_rel_error'] * 100:.1f} %")
    for k, v in model.coefficients.items():
        print(f"  {k:20s} {v:.3e}")


def add_parsers(subparsers) -> None:
    sim = subparsers.add_parser("simulate", help="simulate serving a workload in virtual time (`simulate capacity` to search the SLO capacity)")
    _common_args(sim)
    _output_args(sim)
    sim.set_defaults(func=_simulate)
    modes = sim.add_subparsers(dest="sim_mode")
    cap = modes.add_parser("capacity", help="highest request rate under a p99 TBT SLO")
    _common_args(cap)
    cap.add_argument("--slo", default="100,500",
                     help="comma list of p99 TBT SLOs: ms numbers, or strict / relaxed (5x / 25x the simulated decode "
                          "step of 16 requests, as `paceline bench` calibrates it)")
    cap.add_argument("--tbt-slo", type=float, nargs="+", default=None, help=argparse.SUPPRESS)  # old: ms numbers
    cap.add_argument("--start-rate", type=float, default=None, help="first rate the search tries (default: --rate)")
    cap.add_argument("--max-scheduling-delay", type=float, default=MAX_DELAY_S, help="seconds, median")
    cap.add_argument("--max-probes", type=int, default=24, help="simulated runs per SLO (shared runs are free)")
    # simulated probes cost little: the search narrows the bracket further than a measured one (0.1)
    cap.add_argument("--rel-tol", type=float, default=0.03, help="stop when the bracket is within this fraction")
    cap.set_defaults(func=_capacity)

    prof = subparsers.add_parser("profile", help="time the real executor over batch shapes and fit the simulator's cost model")
    prof.add_argument("--out", default="profile.json")
    prof.add_argument("--model", default=None, help="GGUF or HF folder (default: bundled SmolLM2-135M-Instruct)")
    prof.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    prof.add_argument("--quick", action="store_true", help="a small grid (about a minute)")
    prof.add_argument("--threads", type=int, default=2, help="torch threads (match the server's)")
    prof.add_argument("--repeats", type=int, default=4, help="timings per shape; the fastest is kept")
    prof.set_defaults(func=_profile)
