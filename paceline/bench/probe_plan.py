"""Capacity probes at chosen rates on several workloads, with one start of each server for all of them.

A server that takes ~100 s to start (vLLM CPU) would otherwise pay that once per workload; and a ratio of
capacities needs only a bracket's ends: a rate where the peer fails and 1.3x it where ours passes (or the
reverse). Each `--probe WORKLOAD:STRICT_MS:REQUESTS:RATES` fixes that workload's strict TBT SLO, so separate
invocations (one per system, each within one lock hold) judge every system against the same SLO and, with the
same seed and request count, send it the same requests.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from paceline.bench.capacity import SLO_FACTORS
from paceline.bench.client import warmup
from paceline.bench.compare import Bench, _csv, add_compare_args, systems_for, the_command
from paceline.bench.prompts import PromptSource, bundled_gguf, load_tokenizer
from paceline.bench.workload import generate, load_workload


@dataclasses.dataclass
class ProbePlan:
    workload: str
    strict_ms: float
    requests: int
    rates: list[float]


def parse_probe_plan(item: str) -> ProbePlan:
    """'chat:190:16:0.75,1.0' -> ProbePlan('chat', 190.0, 16, [0.75, 1.0]); a workload path may hold ':'."""
    parts = item.rsplit(":", 3)
    if len(parts) != 4 or not parts[0]:
        raise ValueError(f"a probe is WORKLOAD:STRICT_MS:REQUESTS:RATE[,RATE...], got {item!r}")
    workload, slo, n, rates = parts
    try:
        plan = ProbePlan(workload, float(slo), int(n), _csv(rates, float))
    except ValueError:
        raise ValueError(f"a probe is WORKLOAD:STRICT_MS:REQUESTS:RATE[,RATE...] with numbers, got {item!r}") from None
    if plan.strict_ms <= 0 or plan.requests < 1 or not plan.rates or any(r <= 0 for r in plan.rates):
        raise ValueError(f"a probe needs an SLO > 0 ms, >= 1 request and rates > 0, got {item!r}")
    return plan


def add_probe_plan_args(p: argparse.ArgumentParser) -> None:
    add_compare_args(p)
    p.add_argument("--probe", action="append", type=parse_probe_plan, required=True,
                   help="WORKLOAD:STRICT_MS:REQUESTS:RATE[,RATE...], repeatable: the strict SLO in ms (the decode "
                        "step is taken as a fifth of it), requests per probe, the rates to probe")
    p.set_defaults(func=cmd_probe_plan)


def bench_for(args: argparse.Namespace, plan: ProbePlan, source: PromptSource) -> Bench:
    wargs = argparse.Namespace(**vars(args))
    wargs.workload, wargs.slo = plan.workload, "strict"
    wargs.decode_step_ms = plan.strict_ms / SLO_FACTORS["strict"]
    wargs.probe_requests, wargs.probe_rates = plan.requests, ",".join(f"{r:g}" for r in plan.rates)
    bench = Bench(wargs, load_workload(plan.workload), source)
    bench.set_slos(None)  # fixed by the plan: no calibration
    return bench


def cmd_probe_plan(args: argparse.Namespace) -> int:
    from paceline.bench.peers import Server
    model = args.model or bundled_gguf()
    source = PromptSource(load_tokenizer(args.tokenizer or model))
    benches = [bench_for(args, plan, source) for plan in args.probe]
    out = Path(args.output_dir or Path("bench-results") / f"probes-{time.strftime('%Y%m%d-%H%M%S')}")
    command = the_command()
    # llama-server sizes its context per slot from the workload with the longest requests
    longest = max((b.spec for b in benches), key=lambda s: max(r.prompt_tokens + r.output_tokens for r in
                                                             generate(s, rate=1.0, num_requests=500, seed=args.seed)))
    for system in systems_for(args, longest, model):
        print(f"== {system.name}")
        if system.skip:
            for b in benches:
                b.skip(system.name, system.skip)
            continue
        try:
            with Server(system, out / "logs" / f"{system.name}.log", args.server_nice) as srv:
                ep = system.endpoint(srv.url)
                warmup(ep, benches[0].prompts(benches[0].base[:1], ep.prompt_format, epoch=0)[0])
                for b in benches:
                    print(f"-- {system.name} on {b.spec.name}")
                    if system.name in benches[0].prefill_rates:  # measured once per server
                        b.prefill_rates[system.name] = benches[0].prefill_rates[system.name]
                    b.capacity(system.name, ep)
        except RuntimeError as e:  # failed to start or to answer: report it, go on with the next
            for b in benches:
                b.skip(system.name, str(e)[:300])
        for b in benches:  # after every system, so a long run leaves results behind
            b.write(out / b.spec.name, command)
    for b in benches:
        print(b.write(out / b.spec.name, command))
    print(f"wrote {out}")
    return 0
