"""Where a verification step's time goes: one decode (1 row) against one decode verifying k proposals (k + 1 rows),
same request, same context, in one process. Prints the whole runner step, the model's forward, the LM head, the
sampler, and torch's profiler's largest ops for each, so that the part that grows with the rows shows.

    python benchmarks/spec_step_profile.py --mode default --k 4 --ctx 320
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from paceline.config import CacheConfig, EngineConfig, SchedulerConfig
from paceline.core.outputs import ScheduledRequest, SchedulerOutput
from paceline.engine.engine import Engine
from paceline.model.attention import SeqSlice
from paceline.model.spec_verify import verify_rows
from paceline.request import Request
from paceline.sampling import SamplingParams


def step(ctx: int, k: int, block_size: int) -> SchedulerOutput:
    """One request with ctx - 1 tokens in the cache, its last known token and k proposals to run."""
    sp = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    r = Request("r", [(7 * i) % 5000 + 10 for i in range(ctx - 1)], sp, 0.0)
    r.token_ids.append(11)
    r.num_computed_tokens = ctx - 1
    blocks = list(range(-(-(ctx + k) // block_size)))
    out = SchedulerOutput()
    out.scheduled.append(ScheduledRequest(r, ctx - 1, 1 + k, blocks, [12 + j for j in range(k)]))
    return out


def median_ms(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


@torch.inference_mode()
def measure(runner, out: SchedulerOutput, repeats: int) -> dict[str, float]:
    """Median ms of the whole step and of its parts, for the one request of `out`."""
    model = runner.model
    s = out.scheduled[0]
    rows = s.num_tokens
    ids = s.request.token_ids[s.start:s.start + 1] + s.spec_token_ids
    pos = list(range(s.start, s.start + rows))
    seqs = [SeqSlice(s.start, rows, s.block_table)]
    h = torch.randn(rows, model.arch.hidden_size).to(model.dtype)
    logits = torch.randn(rows, model.arch.vocab_size)
    sample_rows = verify_rows(s)
    fns = {
        "runner step (all)": lambda: runner.execute(out),
        "forward + logits": lambda: runner.forward_tokens(ids, pos, seqs, list(range(rows))),
        "LM head": lambda: model.compute_logits(h),
        "sampler": lambda: runner.sampler(logits, sample_rows),
    }
    if model.lm_head.wide is not None:  # the float32 copy the wide steps read
        fns["LM head, float32 copy"] = lambda: model.lm_head.wide(h.float())
    return {name: median_ms(fn, repeats) for name, fn in fns.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="default", help="default (int4) or float32")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--ctx", type=int, default=320)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--top", type=int, default=12, help="profiler rows to print per step (0: no profile)")
    args = p.parse_args()
    eng = Engine(EngineConfig(dtype="float32" if args.mode == "float32" else "auto",
                              cache=CacheConfig(kv_cache_memory_gb=0.2), scheduler=SchedulerConfig(max_step_ms=0)))
    runner, model = eng.runner, eng.runner.model
    print(f"mode {args.mode}, context {args.ctx}, torch threads {torch.get_num_threads()}, "
          f"wide_above {model.wide_above}")
    print("| part | 1 row ms | %d rows ms | ratio |" % (args.k + 1))
    print("|---|---:|---:|---:|")
    outs = {rows: step(args.ctx, rows - 1, eng.block_size) for rows in (1, args.k + 1)}
    parts: dict[str, dict[int, float]] = {}
    for rows, out in outs.items():
        for name, ms in measure(runner, out, args.repeats).items():
            parts.setdefault(name, {})[rows] = ms
    for name, by_rows in parts.items():
        a, b = by_rows[1], by_rows[args.k + 1]
        print(f"| {name} | {a:.2f} | {b:.2f} | {b / a:.2f} |", flush=True)
    if args.top:
        for rows, out in outs.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    runner.execute(out)
            print(f"\n{rows} row(s), 10 steps:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
