"""Why `--max-num-seqs auto` admits what it admits: the engine in process (the bundled model, the serving
defaults), one workload at one Poisson rate, and every step's seats and budget as `auto` chose them, beside the
measured and predicted step time, the engine's measured/predicted factor and the queue. One setting after another
on the same requests and prompts.

    flock -x /tmp/paceline-cpu.lock .venv/bin/python benchmarks/auto_batch_trace.py --workload chat --rate 1.0 \\
        --seconds 40 --settings auto/auto,128/512

Prints one summary line per setting and writes the steps as JSON (--out). A diagnosis, not a capacity search:
benchmarks/auto_batch_capacity.py measures that.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paceline.bench.prompts import PromptSource, build_prompts, bundled_gguf, load_tokenizer  # noqa: E402
from paceline.bench.workload import generate, load_workload  # noqa: E402
from paceline.config import EngineConfig, SchedulerConfig, int_or_auto  # noqa: E402
from paceline.engine.engine import Engine  # noqa: E402
from paceline.sampling import SamplingParams  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run_setting(seats: str, budget: str, args: argparse.Namespace, reqs, prompts) -> dict:
    cfg = EngineConfig(model=bundled_gguf(), scheduler=SchedulerConfig(
        max_num_seqs=int_or_auto(seats), max_num_batched_tokens=int_or_auto(budget), max_step_ms=args.max_step_ms))
    engine = Engine(cfg)
    sched = engine.scheduler
    engine.add_request("warm", prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    t0 = time.monotonic()
    arrival: dict[str, float] = {}
    first_sched: dict[str, float] = {}
    first_token: dict[str, float] = {}
    steps = []
    i = 0
    deadline = reqs[-1].arrival_s + args.drain_s
    while True:
        now = time.monotonic() - t0
        while i < len(reqs) and reqs[i].arrival_s <= now:
            rid = f"r{i}"
            engine.add_request(rid, prompts[i], SamplingParams(max_tokens=reqs[i].output_tokens, ignore_eos=True),
                               arrival_time=t0 + reqs[i].arrival_s)
            arrival[rid] = reqs[i].arrival_s
            i += 1
        if not engine.has_unfinished():
            if i >= len(reqs):
                break
            time.sleep(min(0.01, max(0.0, reqs[i].arrival_s - now)))
            continue
        if now > deadline:
            break
        waiting_before = len(sched.waiting)
        outs = engine.step()
        t = time.monotonic() - t0
        for r in sched.running:
            first_sched.setdefault(r.request_id, now)
        for o in outs:
            if o.request_id in arrival and o.request_id not in first_token:
                first_token[o.request_id] = t
        st = engine.last_step
        if st is None:
            continue
        steps.append({"t": now, "dur": st.duration, "pred_scaled": st.predicted_s, "scale": sched.step_time_scale,
                      "seats": sched.config.max_num_seqs, "budget": sched.config.max_num_batched_tokens,
                      "running": len(sched.running), "waiting": len(sched.waiting), "waiting_before": waiting_before,
                      "decode": st.num_decode_tokens, "prefill": st.num_prefill_tokens})
    delays = [first_sched[r] - arrival[r] for r in arrival if r in first_sched]
    ttfts = [first_token[r] - arrival[r] for r in arrival if r in first_token]
    durs = [s["dur"] for s in steps if s["decode"] > 0]
    bound = [s for s in steps if s["waiting_before"] > 0 and s["running"] >= s["seats"]]
    summary = {
        "setting": f"{seats}/{budget}", "requests": len(arrival), "admitted": len(first_sched),
        "first_token": len(first_token), "sched_delay_p50_s": statistics.median(delays) if delays else None,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "step_with_decode_p50_ms": pct(durs, 0.5) * 1e3, "step_with_decode_p99_ms": pct(durs, 0.99) * 1e3,
        "running_p50": pct([s["running"] for s in steps], 0.5), "running_max": max((s["running"] for s in steps), default=0),
        "seats_p50": pct([s["seats"] for s in steps], 0.5), "seats_min": min((s["seats"] for s in steps), default=0),
        "steps": len(steps), "seat_bound_steps": len(bound),
        "scale_p50": pct([s["scale"] for s in steps], 0.5), "scale_last": steps[-1]["scale"] if steps else None,
        "profile": getattr(getattr(sched.step_time, "__self__", None), "coefficients", None)}
    return {"summary": summary, "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="chat")
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=40.0, help="arrivals for this long")
    p.add_argument("--drain-s", type=float, default=10.0, help="then at most this long more")
    p.add_argument("--settings", default="auto/auto,128/512", help="comma list of SEATS/BUDGET")
    p.add_argument("--max-step-ms", type=float, default=150.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/auto_batch_trace.json")
    args = p.parse_args()
    spec = load_workload(args.workload)
    reqs = generate(spec, rate=args.rate, duration_s=args.seconds, seed=args.seed)
    source = PromptSource(load_tokenizer(None))
    results = []
    for n, item in enumerate(args.settings.split(",")):
        seats, _, budget = item.partition("/")
        # a fresh epoch per setting: no prefix-cache hit from the previous one (each is a new engine anyway)
        prompts = build_prompts(source, reqs, args.seed, False, n + 1, spec.prompt_style)
        res = run_setting(seats, budget, args, reqs, prompts)
        print(json.dumps(res["summary"]), flush=True)
        results.append(res)
    Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
