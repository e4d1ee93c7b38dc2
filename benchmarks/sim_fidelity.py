"""Fidelity: the simulator with this machine's profile against the real server, same workload, rate and seed.

For each workload and rate, runs the benchmark client against a live paceline server (started here, or --url),
then simulates the same requests with the profiled cost model and the same scheduler settings, and prints
measured vs simulated: median step time (target within 10 %), p50/p99 TTFT and TBT (within 15 %).

    .venv/bin/paceline profile --out profile.json            # once, with nothing else running
    .venv/bin/python benchmarks/sim_fidelity.py --profile profile.json [--url http://127.0.0.1:8000]

The measured median step time comes from the server's paceline:step_duration_seconds histogram (interpolated
inside its bucket, so it is only as fine as the buckets); the simulated one is exact.
"""
from __future__ import annotations

import argparse
import contextlib
import subprocess
from pathlib import Path

from paceline.bench.client import Endpoint, run
from paceline.bench.metrics import summarize as bench_summarize
from paceline.bench.prompts import PromptSource, build_prompts, bundled_gguf, load_tokenizer
from paceline.bench.server_metrics import diff, histogram, histogram_quantile
from paceline.bench.workload import generate as bench_generate
from paceline.config import CacheConfig, SchedulerConfig
from paceline.sim.cost_model import ProfiledCostModel
from paceline.sim.deploy import Deployment
from paceline.sim.metrics import summarize as sim_summarize
from paceline.sim.workloads import SimRequest, load_workload

DEFAULT_RATES = {"chat": (0.3, 0.8), "long-prompt": (0.05, 0.15)}
STEP_HIST = "paceline:step_duration_seconds"


def measured_step_median(result) -> float | None:
    snaps = result.metric_snapshots
    if len(snaps) < 2:
        return None
    return histogram_quantile(histogram(diff(snaps[-1][1], snaps[0][1]), STEP_HIST), 0.5)


@contextlib.contextmanager
def server(args):
    if args.url:
        yield args.url
        return
    from paceline.bench.peers import Server, paceline_system
    system = paceline_system(args.scheduler, args.max_num_batched_tokens, bundled_gguf(), threads=args.threads,
                             extra=["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)])
    with Server(system, Path(args.log_dir) / "server.log") as s:
        yield s.url


def err(sim: float | None, real: float | None) -> str:
    if sim is None or real is None or real == 0:
        return "n/a"
    return f"{(sim - real) / real * 100:+.1f} %"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", required=True, help="a `paceline profile` JSON of this machine")
    ap.add_argument("--url", default=None, help="a running paceline server (default: start one here)")
    ap.add_argument("--workloads", nargs="+", default=["chat", "long-prompt"])
    ap.add_argument("--rates", nargs="+", type=float, default=None, help="default: two per workload, see DEFAULT_RATES")
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scheduler", default="stall-free")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=CacheConfig.kv_cache_memory_gb)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-dir", default="/tmp/paceline-fidelity")
    args = ap.parse_args()

    cost = ProfiledCostModel.load(args.profile)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"profile {args.profile} ({cost.meta.get('machine')}, fit median error "
          f"{cost.meta.get('median_rel_error', float('nan')) * 100:.1f} %); {args.scheduler} budget "
          f"{args.max_num_batched_tokens}; {args.num_requests} requests per run, seed {args.seed}; commit {commit}\n")
    source = PromptSource(load_tokenizer())
    rows = []
    with server(args) as url:
        ep = Endpoint(url)
        epoch = 0
        for wl_name in args.workloads:
            spec = load_workload(wl_name)
            for rate in args.rates or DEFAULT_RATES.get(wl_name, (0.2, 0.5)):
                reqs = bench_generate(spec, rate=rate, num_requests=args.num_requests, seed=args.seed)
                # fresh prompts per run: the server's prefix cache would serve repeats, the simulator's would not
                epoch += 1
                prompts = build_prompts(source, reqs, args.seed, as_text=False, epoch=epoch)
                real = run(ep, reqs, prompts, progress=False, label=f"{wl_name}@{rate}")
                real_sum = bench_summarize(real.records)
                real_step = measured_step_median(real)

                dep = Deployment(cost, SchedulerConfig(policy=args.scheduler, max_num_batched_tokens=args.max_num_batched_tokens,
                                                       max_model_len=spec.max_model_len),
                                 CacheConfig(kv_cache_memory_gb=args.kv_cache_memory_gb))
                sim_res = dep.simulator().run([SimRequest(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens, r.priority) for r in reqs])
                sim_sum = sim_summarize(sim_res)
                sim_step = sorted(s.duration for s in sim_res.steps)[len(sim_res.steps) // 2] if sim_res.steps else None
                pairs = [("median step time", real_step, sim_step, 10)]
                for m in ("ttft", "tbt"):
                    for q in ("p50", "p99"):
                        pairs.append((f"{q} {m.upper()}", (real_sum[m] or {}).get(q), (sim_sum[m] or {}).get(q), 15))
                for name, r, s, tol in pairs:
                    ok = r is not None and s is not None and abs(s - r) <= tol / 100 * r
                    rows.append((wl_name, rate, name, r, s, err(s, r), "yes" if ok else "no"))
                    print(rows[-1], flush=True)
    print("\n| workload | rate (req/s) | metric | measured (ms) | simulated (ms) | error | within target |")
    print("|---|---|---|---|---|---|---|")
    for wl, rate, name, r, s, e, ok in rows:
        f = lambda x: f"{x * 1e3:.1f}" if x is not None else "n/a"  # noqa: E731
        print(f"| {wl} | {rate:g} | {name} | {f(r)} | {f(s)} | {e} | {ok} |")


if __name__ == "__main__":
    main()
