"""What verifying draft tokens costs: measured step time of b decodes with j proposals each, against the step-time
model's prediction (the engine's own start-up profile), in float32 and the default mode.

    python benchmarks/spec_cost.py --modes float32,default
"""
from __future__ import annotations

import argparse
import time

from paceline.config import CacheConfig, EngineConfig
from paceline.core.batch_shape import batch_shape
from paceline.core.outputs import ScheduledRequest, SchedulerOutput
from paceline.core.spec_adaptive import decode_to_verify
from paceline.engine.engine import Engine
from paceline.request import Request
from paceline.sampling import SamplingParams


def build(b: int, j: int, ctx: int, bs: int) -> SchedulerOutput:
    sp = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    out, block = SchedulerOutput(), 0
    for i in range(b):
        r = Request(f"d{i}", [(3 * k + i) % 1000 for k in range(ctx - 1)], sp, 0.0)
        r.token_ids.append(1)
        r.num_computed_tokens = ctx - 1
        nb = -(-(ctx + j) // bs)
        out.scheduled.append(ScheduledRequest(r, ctx - 1, 1 + j, list(range(block, block + nb)), [5] * j))
        block += nb
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="float32,default")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--drafts", default="0,1,2,4")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    print("| mode | decodes | proposals each | measured ms | predicted ms | measured / plain |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        eng = Engine(EngineConfig(dtype="float32" if mode == "float32" else "auto", cache=CacheConfig(kv_cache_memory_gb=0.6)))
        model = eng.scheduler.step_time
        for b in map(int, args.batches.split(",")):
            plain = None
            for j in map(int, args.drafts.split(",")):
                out = build(b, j, args.ctx, eng.block_size)
                eng.runner.execute(out)
                ts = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    eng.runner.execute(out)
                    ts.append(time.perf_counter() - t0)
                t = sorted(ts)[len(ts) // 2]
                plain = plain or t
                shape = batch_shape(build(b, 0, args.ctx, eng.block_size))
                if j:
                    for s in out.scheduled:
                        decode_to_verify(shape, s.start, j)
                print(f"| {mode} | {b} | {j} | {t * 1e3:.1f} | {model(shape) * 1e3:.1f} | {t / plain:.2f} |", flush=True)


if __name__ == "__main__":
    main()
