"""Replay a workload's arrivals through an in-process Engine (no HTTP, no client) with the stall-free scheduler and
`--max-step-ms`, and report every step's measured vs predicted time: what the step-time limit does when
nothing but the engine runs.

    .venv/bin/python benchmarks/step_replay.py --workload chat --rate 0.5 --seconds 90 --max-step-ms 150
    .venv/bin/python benchmarks/step_replay.py --workload long-prompt --rate 0.15 --seconds 120 --max-step-ms 140

Prints step-time percentiles, measured/(predicted x correction) over steps with a prompt chunk, the correction
over time, and the slowest steps. --rerun-slower-than MS re-executes the first step slower than that (after
--rerun-after s) three times, to tell a slow shape from a slow moment. --quantile overrides the quantile the
engine tracks.
"""
from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import torch

import paceline.engine.engine as engine_module
from paceline.bench.workload import generate, load_workload
from paceline.config import EngineConfig
from paceline.core.batch_shape import batch_shape
from paceline.engine.engine import Engine
from paceline.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--seconds", type=float, default=90.0, help="arrival window")
    ap.add_argument("--max-step-ms", type=float, default=150.0)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--quantile", type=float, default=None)
    ap.add_argument("--rerun-slower-than", type=float, default=0.0, metavar="MS")
    ap.add_argument("--rerun-after", type=float, default=30.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quantile is not None:  # the engine looks the tracker up by name at every step
        engine_module.track_quantile = functools.partial(engine_module.track_quantile, quantile=args.quantile)

    config = EngineConfig()
    config.scheduler.policy, config.scheduler.max_num_batched_tokens = "stall-free", args.budget
    config.scheduler.max_step_ms = args.max_step_ms
    engine = Engine(config)
    specs = generate(load_workload(args.workload), rate=args.rate, num_requests=max(1, round(args.rate * args.seconds)),
                     seed=args.seed)
    rng = np.random.default_rng(args.seed)
    sched = engine.scheduler
    schedule = sched.schedule
    seen: dict = {}

    def recording(now: float):  # what the step looked like before update() moves its requests on
        out = schedule(now)
        seen.update(out=out, scale=sched.step_time_scale, shape=None if out.is_empty else batch_shape(out))
        return out
    sched.schedule = recording

    rows, i, rerun_done = [], 0, False
    t0 = time.monotonic()
    while i < len(specs) or engine.has_unfinished():
        now = time.monotonic() - t0
        while i < len(specs) and specs[i].arrival_s <= now:
            s = specs[i]
            engine.add_request(f"r{i}", rng.integers(100, 40000, s.prompt_tokens).tolist(),
                               SamplingParams(max_tokens=s.output_tokens, ignore_eos=True, temperature=0.0))
            i += 1
        engine.step()
        shape = seen.get("shape")
        if shape is None or engine.last_step is None:
            time.sleep(0.002)
            continue
        out, measured = seen["out"], engine.last_step.duration
        rows.append((now, measured, out.predicted_step_s, seen["scale"], shape.num_decodes, shape.num_prefill_tokens,
                     shape.decode_context))
        seen["shape"] = None
        if (args.rerun_slower_than and not rerun_done and now > args.rerun_after
                and measured * 1e3 > args.rerun_slower_than):
            rerun_done = True
            again = []
            for _ in range(3):
                t1 = time.perf_counter()
                engine.runner.execute(out)  # same KV writes, same tokens: harmless to repeat
                again.append(f"{(time.perf_counter() - t1) * 1e3:.0f}")
            print(f"step at {now:.1f} s took {measured * 1e3:.0f} ms ({shape.num_decodes} decodes, "
                  f"{shape.num_prefill_tokens} prompt tokens, predicted {out.predicted_step_s * 1e3:.0f} ms raw); "
                  f"re-run: {', '.join(again)} ms")

    t, ms, pred, scale, dec, pre, dctx = (np.array(c) for c in zip(*rows))
    ms *= 1e3
    chunked = pre > 0
    ratio = ms[chunked] / (pred[chunked] * 1e3 * scale[chunked])
    print(f"{len(rows)} steps, last at {t[-1]:.1f} s; step p50/p90/p99/max "
          f"{' / '.join(f'{v:.0f}' for v in np.percentile(ms, [50, 90, 99, 100]))} ms; steps with a chunk: p98 "
          f"{np.percentile(ms[chunked], 98):.0f}, p99 {np.percentile(ms[chunked], 99):.0f} ms")
    print("measured / (predicted x correction), steps with a chunk, p50/p90/p98/p99: "
          + " / ".join(f"{v:.2f}" for v in np.percentile(ratio, [50, 90, 98, 99])))
    print("correction over time: " + " ".join(f"{v:.2f}" for v in scale[::max(1, len(scale) // 12)]))
    print("slowest steps:")
    for k in np.argsort(-ms)[:8]:
        print(f"  {t[k]:6.1f} s  {ms[k]:6.1f} ms  predicted {pred[k] * 1e3:5.1f} ms raw x {scale[k]:.2f}  "
              f"{dec[k]} decodes (context {dctx[k]})  {pre[k]} prompt tokens")


if __name__ == "__main__":
    main()
