"""Speculation under load: the same Poisson run (requests, prompts, arrival times) served in-process by an engine
without speculation, with n-gram speculation at a fixed k, and with adaptive k; generated tok/s, TBT p50/p99 and
acceptance. Engines are built once; the runs alternate by configuration within each rate and workload.

    python benchmarks/spec_load.py --workloads quote,chat --rates 0.3 --num-requests 16
    python benchmarks/spec_load.py --workloads chat --rates 0.5 --num-requests 16 --repeats 2

With --repeats N the configurations run N times in turn, the order reversed every other time (A B C, C B A, ...)
so that a drifting machine does not always favour the one that runs first; each repeat sends new prompts (another
prompt epoch: no prefix-cache hits from the previous repeat) at the same arrival times. Each run is printed, then
the mean over the repeats.
"""
from __future__ import annotations

import argparse
import statistics
import time

from paceline.bench.prompts import PromptSource, build_prompts
from paceline.bench.workload import generate, load_workload
from paceline.config import EngineConfig
from paceline.engine.engine import Engine
from paceline.sampling import SamplingParams
from paceline.spec_config import SpeculativeConfig


def run(engine: Engine, requests, prompts, tag: str) -> dict:
    before = engine.stats()
    t0 = time.monotonic()
    pending = sorted(zip(requests, prompts), key=lambda rp: rp[0].arrival_s)
    live = []
    while pending or engine.has_unfinished():
        now = time.monotonic() - t0
        while pending and pending[0][0].arrival_s <= now:
            r, p = pending.pop(0)
            live.append(engine.add_request(f"{tag}-{r.index}", p, SamplingParams(
                temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True), arrival_time=t0 + r.arrival_s))
        if engine.has_unfinished():
            engine.step()
        elif pending:
            time.sleep(max(0.0, pending[0][0].arrival_s - (time.monotonic() - t0)))
    end = max(r.finish_time for r in live)
    gaps = sorted(b - a for r in live for a, b in zip(r.token_times, r.token_times[1:]))
    tokens = sum(r.num_output_tokens for r in live)
    after = engine.stats()
    drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    verifies = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1) for r in live if len(r.token_times) > 1]
    return {"tok_s": tokens / (end - t0), "tpot": statistics.mean(tpot) * 1e3, "tbt_p50": gaps[len(gaps) // 2] * 1e3,
            "tbt_p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1e3,
            "ttft_p50": statistics.median(r.token_times[0] - r.arrival_time for r in live) * 1e3,
            "drafts": drafts, "acceptance": accepted / drafts if drafts else float("nan"),
            "mean_accepted": accepted / verifies if verifies else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="quote,chat")
    p.add_argument("--rates", default="0.3")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtype", default="auto", help="auto: the default mode (int4 on this CPU); float32")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    configs = {"plain": None,
               f"fixed k={args.k}": SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=3, adaptive=False),
               f"adaptive k<={args.k}": SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_max=3)}
    engines = {name: Engine(EngineConfig(dtype=args.dtype), speculative_config=spec) for name, spec in configs.items()}
    source = PromptSource(next(iter(engines.values())).tokenizer)
    print("| workload | rate req/s | configuration | generated tok/s | TPOT mean ms | TBT p50 / p99 ms | TTFT p50 ms | "
          "acceptance | mean accepted / verify |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    epoch = 0
    for wl in args.workloads.split(","):
        spec = load_workload(wl)
        for rate in map(float, args.rates.split(",")):
            epoch += 1
            reqs = generate(spec, rate=rate, num_requests=args.num_requests, seed=args.seed)
            runs: dict[str, list[dict]] = {name: [] for name in engines}
            for rep in range(args.repeats):
                prompts = build_prompts(source, reqs, args.seed, as_text=False, epoch=epoch + 1000 * rep,
                                        style=spec.prompt_style)
                names = list(engines) if rep % 2 == 0 else list(reversed(engines))
                for name in names:
                    m = run(engines[name], reqs, prompts, f"{wl}{rate}r{rep}")
                    runs[name].append(m)
                    label = name if args.repeats == 1 else f"{name} (run {rep + 1})"
                    print(row(wl, rate, label, m), flush=True)
            if args.repeats > 1:
                for name, ms in runs.items():
                    mean = {key: statistics.mean(m[key] for m in ms) for key in ms[0]}
                    print(row(wl, rate, f"{name}, mean of {args.repeats}", mean), flush=True)


def row(wl: str, rate: float, name: str, m: dict) -> str:
    return (f"| {wl} | {rate:g} | {name} | {m['tok_s']:.1f} | {m['tpot']:.1f} | {m['tbt_p50']:.0f} / {m['tbt_p99']:.0f} | "
            f"{m['ttft_p50']:.0f} | {m['acceptance']:.0%} | {m['mean_accepted']:.2f} |")

if __name__ == "__main__":
    main()
