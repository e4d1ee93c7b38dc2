"""Side by side: start each system, run the same workload at the same rates, search capacity under the SLOs, stop it;
one table and one set of plots for all. Also `paceline bench capacity` against one running server."""
from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
import time
from pathlib import Path

from paceline.bench.calibrate import calibrate_decode_step, measure_prefill_rate
from paceline.bench.capacity import CapacityResult, capacity_from_probes, parse_slo, search_capacity, ttft_excess
from paceline.bench.client import Endpoint, run, warmup
from paceline.bench.prompts import PromptSource, build_prompts, bundled_gguf, load_tokenizer
from paceline.bench.report import environment, markdown_table, output_dir, run_dict, runs_table, write_json
from paceline.bench.workload import RequestSpec, WorkloadSpec, generate, load_workload
from paceline.config import SCHEDULERS, STALL_FACTOR, scheduler_name

ALL_SYSTEMS = ("paceline-stall-free", "paceline-prefill-first", "paceline-orca", "paceline-static", "llama-server-np8",
               "llama-server-np32", "transformers-cb", "vllm-cpu", "vllm-cpu-fp32")


def _csv(s: str | None, cast=str) -> list:
    return [cast(x) for x in s.split(",") if x.strip()] if s else []


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="chat", help="chat | long-prompt | bursty-priority | a YAML path | a trace CSV")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="default: the model's (the bundled GGUF)")
    p.add_argument("--slo", default="strict,relaxed", help="comma list of TBT SLOs: strict, relaxed, or ms numbers")
    p.add_argument("--decode-step-ms", type=float, default=None,
                   help="skip calibration: the median decode step at batch 16 that strict/relaxed scale")
    p.add_argument("--probe-requests", type=int, default=16, help="requests per capacity probe")
    p.add_argument("--probe-seconds", type=float, default=0.0,
                   help="also send at least RATE x this many requests per probe, so that every probe is a sustained "
                        "load of this many seconds, not a burst the server absorbs and then drains (0: off)")
    p.add_argument("--max-probes", type=int, default=5, help="probes per system and SLO (shared probes are free)")
    p.add_argument("--start-rate", type=float, default=0.5, help="first rate the capacity search tries")
    p.add_argument("--probe-rates", default="",
                   help="comma list of rates to probe instead of searching (e.g. one rate a peer should fail and 1.3x "
                        "it, which ours should pass): each is judged under every SLO, the capacity over all of them")
    p.add_argument("--probe-timeout", type=float, default=90.0, help="s after the last arrival before a probe fails")
    p.add_argument("--delay-rule", choices=("ttft-excess", "ttft"), default="ttft-excess",
                   help="for servers that do not expose their scheduling delay, judge the 2 s rule on TTFT minus the "
                        "prompt's own prefill time (measured alone), or on the raw median TTFT")
    p.add_argument("--output-dir", default=None)
    p.add_argument("--no-progress", action="store_true")


def add_compare_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--model", default=None, help="GGUF every system serves (default: the bundled SmolLM2-135M)")
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma list of {', '.join(ALL_SYSTEMS)}")
    p.add_argument("--stall-free-budgets", default="256,1024",
                   help="token budgets of the paceline-stall-free runs; BUDGET:MS also sets --max-step-ms MS, "
                        "BUDGET:gMS --tbt-goal-ms MS (the step targets derived from it, as a user with that SLO sets)")
    p.add_argument("--sarathi-budgets", dest="stall_free_budgets", help=argparse.SUPPRESS)  # the old name
    p.add_argument("--budget", type=int, default=1024,
                   help="token budget of the other paceline schedulers, llama-server -b/-ub, transformers cb")
    p.add_argument("--vllm-budgets", default="",
                   help="token budgets of the vllm-cpu(-fp32) runs, one server each, as --stall-free-budgets does for "
                        "paceline (vLLM's own default on CPU is 2048); default: --budget")
    p.add_argument("--server-nice", type=int, default=None,
                   help="scheduler autogroup nice of every server's session (-20..19; negative needs root): under a "
                        "benchmark lock, -10 keeps work that runs outside it (at autogroup nice 0) off the cores")
    p.add_argument("--rates", default="", help="comma list of fixed rates every system runs (besides capacity)")
    p.add_argument("--num-requests", type=int, default=32, help="requests per fixed-rate run")
    p.add_argument("--no-capacity", action="store_true", help="only the fixed-rate runs")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads every server may use (torch: OMP_NUM_THREADS; llama-server: -t/-tb). On a machine "
                        "busy with other work use 1: llama.cpp's spinning threads collapse when a core is taken "
                        "(measured here: 7 tok/s with -t 2 vs 67 with -t 1 for one stream, load average 8 on 2 cores)")
    p.set_defaults(func=cmd_compare)


def add_capacity_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--url", required=True)
    p.add_argument("--label", default=None)
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    p.add_argument("--no-priority", action="store_true")
    p.set_defaults(func=cmd_capacity)


class Bench:
    """The fixed parts of one comparison: workload, prompts, SLOs, and every run so far."""

    def __init__(self, args: argparse.Namespace, spec: WorkloadSpec, source: PromptSource):
        self.args = args
        self.spec = spec
        self.source = source
        # lengths, priorities and prompts do not depend on the rate: generate at rate 1, rescale arrivals
        n = max(args.probe_requests, getattr(args, "num_requests", 0) or 0)
        self.base = generate(spec, rate=1.0, num_requests=n, seed=args.seed)
        self.longer_bases: dict[int, list[RequestSpec]] = {}  # for probes longer than base, by length
        self.epochs: dict[str, int] = {}  # runs so far per system: each run gets fresh prompts (see build_prompts)
        self.runs: list[dict] = []
        self.decode_step_s: float | None = args.decode_step_ms / 1e3 if args.decode_step_ms else None
        self.slos: list[tuple[str, float]] = []
        self.capacities: list[dict] = []
        self.prefill_rates: dict[str, float] = {}  # prompt tok/s of one request alone, per system

    def requests(self, rate: float, n: int) -> list[RequestSpec]:
        base = self.base
        if n > len(base):  # the same n gives every system the same requests
            if n not in self.longer_bases:
                self.longer_bases[n] = generate(self.spec, rate=1.0, num_requests=n, seed=self.args.seed)
            base = self.longer_bases[n]
        return [dataclasses.replace(r, arrival_s=r.arrival_s / rate) for r in base[:n]]

    def probe_size(self, rate: float) -> int:
        return max(self.args.probe_requests, math.ceil(rate * getattr(self.args, "probe_seconds", 0.0)))

    def prompts(self, requests: list[RequestSpec], fmt: str, epoch: int) -> list[list[int] | str]:
        return build_prompts(self.source, requests, self.args.seed, fmt == "text", epoch, self.spec.prompt_style)

    def set_slos(self, ep: Endpoint | None) -> None:
        names = _csv(self.args.slo)
        if self.decode_step_s is None and any(n in ("strict", "relaxed") for n in names) and ep is not None:
            self.decode_step_s = calibrate_decode_step(ep, self.source, seed=self.args.seed,
                                                       progress=not self.args.no_progress)
            print(f"median decode step at batch 16: {self.decode_step_s * 1e3:.1f} ms")
        self.slos = [parse_slo(n, self.decode_step_s) for n in names]

    def run_at(self, system: str, ep: Endpoint, rate: float, n: int, probe: bool) -> dict:
        reqs = self.requests(rate, n)
        deadline = reqs[-1].arrival_s + self.args.probe_timeout
        epoch = self.epochs[system] = self.epochs.get(system, 0) + 1  # the k-th run of every system: same prompts
        result = run(ep, reqs, self.prompts(reqs, ep.prompt_format, epoch), progress=not self.args.no_progress,
                     deadline_s=deadline, label=f"{system} @ {rate:.2f}/s", in_flight_caps=self.spec.in_flight_caps())
        strict = self.slos[0][1] if self.slos else None
        stall = STALL_FACTOR * self.decode_step_s if self.decode_step_s else None
        r = run_dict(system, self.spec.name, rate, result, tbt_slo=strict, stall_threshold_s=stall,
                     extra={"probe": probe})
        if system in self.prefill_rates and self.args.delay_rule == "ttft-excess":
            r["summary"]["ttft_excess"] = ttft_excess(result.records, self.prefill_rates[system])
        self.runs.append(r)
        s = r["summary"]
        print(f"  {system} @ {rate:.3f} req/s: {s['completed']}/{s['num_requests']} done, "
              f"p99 TBT {((s['tbt'] or {}).get('p99') or 0) * 1e3:.0f} ms, "
              f"median TTFT {((s['ttft'] or {}).get('p50') or 0):.2f} s")
        return r

    def capacity(self, system: str, ep: Endpoint) -> list[CapacityResult]:
        fixed = _csv(getattr(self.args, "probe_rates", ""), float)
        if any(rate <= 0 for rate in fixed):
            raise ValueError(f"a probe rate must be > 0, got {self.args.probe_rates!r}")
        if self.args.delay_rule == "ttft-excess" and system not in self.prefill_rates:  # once per server
            self.prefill_rates[system] = measure_prefill_rate(ep, self.source, seed=self.args.seed)
            print(f"  {system}: one prompt alone prefills at {self.prefill_rates[system]:.0f} tok/s")
        cache: dict[float, dict] = {}
        searched: list[CapacityResult | None] = [None] * len(self.slos)
        if fixed:  # the rates were chosen by hand: probe each once (a repeated rate too), judge them all below
            for rate in fixed:
                if round(rate, 6) not in cache:
                    cache[round(rate, 6)] = self.run_at(system, ep, rate, self.probe_size(rate), True)["summary"]
        for i, (name, slo_s) in enumerate(self.slos if not fixed else []):
            searched[i] = res = search_capacity(lambda rate: self.run_at(system, ep, rate, self.probe_size(rate), True)["summary"],
                                  slo_s, start_rate=self.args.start_rate, max_probes=self.args.max_probes,
                                  slo_name=name, cache=cache)
            print(f"  {system}: capacity under the {name} SLO ({slo_s * 1e3:.0f} ms), this search: "
                  f"{'>=' if res.is_lower_bound else '='} {res.capacity:.3f} req/s")
        return self.judge_probes(system, cache, searched)

    def judge_probes(self, system: str, probes: dict[float, dict],
                     searched: list[CapacityResult | None] | None = None) -> list[CapacityResult]:
        """One system's capacity under each SLO over every probe it ran (rate -> summary), whichever search or
        fixed rate ran it; printed and added to self.capacities. `searched`: each SLO's own search, if one ran."""
        out = []
        for (name, slo_s), res in zip(self.slos, searched or [None] * len(self.slos)):
            final = capacity_from_probes(probes, slo_s, slo_name=name)
            out.append(final)
            for v in final.verdicts:
                print(f"  {system} @ {v.rate:.3f} req/s, {name} SLO {slo_s * 1e3:.0f} ms: "
                      f"{'passed' if v.passed else 'failed'} (p99 TBT {(v.p99_tbt_s or 0) * 1e3:.0f} ms, median "
                      f"{v.delay_source} delay {v.delay_s if v.delay_s is None else round(v.delay_s, 2)} s, "
                      f"{v.failed_requests} failed requests)")
            self.capacities.append({"system": system, "slo": final.slo_name, "tbt_slo_s": final.tbt_slo_s,
                                    "capacity": final.capacity, "searched_capacity": res.capacity if res else None,
                                    "prefill_rate": self.prefill_rates.get(system), "lower_bound": final.is_lower_bound,
                                    "verdicts": [dataclasses.asdict(v) for v in final.verdicts]})
            print(f"  {system}: capacity under the {final.slo_name} SLO over every probe "
                  f"{'>=' if final.is_lower_bound else '='} {final.capacity:.3f} req/s")
        return out

    def skip(self, system: str, reason: str) -> None:
        print(f"  {system}: skipped: {reason}")
        self.runs.append({"system": system, "workload": self.spec.name, "rate": None, "skipped": reason, "summary": {}})
        for name, slo_s in self.slos or [(n, None) for n in _csv(self.args.slo)]:
            self.capacities.append({"system": system, "slo": name, "tbt_slo_s": slo_s, "capacity": None,
                                    "skipped": reason})

    def featured_runs(self) -> list[dict]:
        """One line per system in the CDF and timeline plots: the fixed-rate runs when there are some, else each
        system's probe at the highest rate that met the first SLO (its lowest probe when none did)."""
        runs = [r for r in self.runs if not r.get("skipped")]
        fixed = [r for r in runs if not r.get("probe")]
        if fixed:
            return fixed
        out = []
        for system in dict.fromkeys(r["system"] for r in runs):
            cap = next((c["capacity"] for c in self.capacities if c["system"] == system and c.get("capacity")), None)
            mine = sorted((r for r in runs if r["system"] == system), key=lambda r: r["rate"])
            best = [r for r in mine if cap is not None and r["rate"] <= cap + 1e-9]
            out.append(best[-1] if best else mine[0])
        return out

    def write(self, out: Path, command: str) -> str:
        env = environment()
        payload = {"environment": env, "command": command, "workload": dataclasses.asdict(self.spec),
                   "decode_step_s": self.decode_step_s, "slos": self.slos, "capacities": self.capacities,
                   "runs": self.runs}
        write_json(out / "results.json", payload)
        md = [f"Workload `{self.spec.name}`, {time.strftime('%Y-%m-%d')}, {env['cpu']} ({env['cpus']} CPUs), "
              f"commit {env['commit']}{' (dirty)' if env['dirty'] else ''}. Command: `{command}`"]
        if self.decode_step_s:
            md.append(f"Median decode-only step at batch 16: {self.decode_step_s * 1e3:.1f} ms; SLOs: "
                      + ", ".join(f"{n} = {s * 1e3:.0f} ms" for n, s in self.slos))
        if self.capacities:
            md.append(capacity_table(self.capacities))
        fixed = [r for r in self.runs if not r.get("probe")]
        if fixed:
            md.append(runs_table(fixed))
        text = "\n\n".join(md) + "\n"
        (out / "results.md").write_text(text)
        from paceline.bench import plots  # matplotlib: the [bench] extra
        plots.all_plots(self.runs, out, self.slos[0][1] if self.slos else None, featured=self.featured_runs())
        return text


def capacity_table(caps: list[dict]) -> str:
    slos = list(dict.fromkeys(c["slo"] for c in caps))
    systems = list(dict.fromkeys(c["system"] for c in caps))
    by = {(c["system"], c["slo"]): c for c in caps}
    header = ["system"] + [f"capacity, {s} SLO (req/s)" for s in slos] + ["2 s rule judged on", "prefill alone (tok/s)"]
    rows = []
    for sys_name in systems:
        row = [sys_name]
        verdicts = [v for s in slos for v in (by.get((sys_name, s)) or {}).get("verdicts", [])]
        rate = next((c.get("prefill_rate") for (n, _), c in by.items() if n == sys_name and c.get("prefill_rate")), None)
        for s in slos:
            c = by.get((sys_name, s))
            if c is None:
                row.append("–")
            elif c.get("skipped"):
                row.append(f"skipped: {c['skipped']}")
            else:
                probes = len({v['rate'] for v in c["verdicts"]})
                searched = c.get("searched_capacity")
                also = f"its own search {searched:.3f}; " if searched is not None and abs(searched - c["capacity"]) > 1e-9 else ""
                # a capacity is a bracket: name the lowest failing rate above it, which bounds it from above
                fails = [v["rate"] for v in c["verdicts"] if not v.get("passed", True) and v["rate"] > c["capacity"]]
                below = f"fails at {min(fails):.3f}; " if fails else ""
                value = f"< {min(fails):.3f}" if not c["capacity"] and fails else f"{c['capacity']:.3f}"
                row.append(f"{'≥ ' if c.get('lower_bound') else ''}{value} ({also}{below}{probes} rates tried)")
        sources = sorted({v["delay_source"] for v in verdicts})
        row += [", ".join(sources) or "–", f"{rate:.0f}" if rate else "–"]
        rows.append(row)
    return markdown_table(header, rows)


def systems_for(args: argparse.Namespace, spec: WorkloadSpec, model: str):
    from paceline.bench.peers import llama_server_system, paceline_system, transformers_system, vllm_cpu_system
    longest = max(r.prompt_tokens + r.output_tokens for r in generate(spec, rate=1.0, num_requests=500, seed=args.seed))
    ctx_per_slot = (longest // 256 + 2) * 256
    out = []
    for name in _csv(args.systems):
        if name.startswith("paceline-"):
            scheduler = scheduler_name(name.removeprefix("paceline-"))  # paceline-sarathi, -vllm: the old names
            if scheduler not in SCHEDULERS:
                raise ValueError(f"unknown system {name!r}; choose from {', '.join(ALL_SYSTEMS)}")
            name = f"paceline-{scheduler}"
        if name == "paceline-stall-free":
            for item in _csv(args.stall_free_budgets):
                budget, _, ms = item.partition(":")
                goal_ms = float(ms[1:]) if ms.startswith("g") else 0.0
                limit_ms = 0.0 if goal_ms else float(ms or 0)
                extra = ["--tbt-goal-ms", f"{goal_ms:g}"] if goal_ms else None
                system = paceline_system(scheduler, int(budget), model, args.threads, extra=extra,
                                         max_step_ms=limit_ms)
                # one name per budget (and step-time limit or TBT goal), as peers.py names its stall-free runs
                system.name = f"{name}-{budget}" + (f"-goal{goal_ms:g}ms" if goal_ms else
                                                    f"-{limit_ms:g}ms" if limit_ms else "")
                out.append(system)
        elif name.startswith("paceline-"):
            out.append(paceline_system(scheduler, args.budget, model, args.threads))
        elif name.startswith("llama-server-np"):
            out.append(llama_server_system(int(name.removeprefix("llama-server-np")), args.budget, model,
                                           ctx_per_slot, args.threads))
        elif name == "transformers-cb":
            out.append(transformers_system(model, args.budget, args.threads))
        elif name in ("vllm-cpu", "vllm-cpu-fp32"):  # fp32: the fair dtype on a CPU without native bf16 math
            for budget in _csv(getattr(args, "vllm_budgets", ""), int) or [args.budget]:
                out.append(vllm_cpu_system(model, budget, threads=args.threads,
                                           dtype="float32" if name.endswith("fp32") else "bfloat16"))
        else:
            raise ValueError(f"unknown system {name!r}; choose from {', '.join(ALL_SYSTEMS)}")
    return out


def the_command() -> str:
    """The command line that produced a report, as typed (benchmarks/compare.py ... or paceline bench ...)."""
    argv0 = Path(sys.argv[0])
    shown = argv0.name if argv0.name == "paceline" or argv0.is_absolute() else str(argv0)  # benchmarks/compare.py
    return " ".join([shown, *map(shlex.quote, sys.argv[1:])])


def cmd_compare(args: argparse.Namespace) -> int:
    from paceline.bench.peers import Server
    model = args.model or bundled_gguf()
    spec = load_workload(args.workload)
    bench = Bench(args, spec, PromptSource(load_tokenizer(args.tokenizer or model)))
    out = output_dir(args.output_dir, spec.name)
    rates = _csv(args.rates, float)
    command = the_command()
    for system in systems_for(args, spec, model):
        print(f"== {system.name}")
        if system.skip:
            bench.skip(system.name, system.skip)
            continue
        try:
            with Server(system, out / "logs" / f"{system.name}.log", args.server_nice) as srv:
                ep = system.endpoint(srv.url)
                warmup(ep, bench.prompts(bench.base[:1], ep.prompt_format, epoch=0)[0])
                if not bench.slos:
                    bench.set_slos(ep)
                for rate in rates:
                    bench.run_at(system.name, ep, rate, args.num_requests, probe=False)
                if not args.no_capacity:
                    bench.capacity(system.name, ep)
        except RuntimeError as e:  # failed to start, or calibration failed: report, go on with the next
            bench.skip(system.name, str(e)[:300])
        bench.write(out, command)  # after every system, so a long run leaves results behind
    print(bench.write(out, command))
    print(f"wrote {out}")
    return 0


def cmd_capacity(args: argparse.Namespace) -> int:
    spec = load_workload(args.workload)
    bench = Bench(args, spec, PromptSource(load_tokenizer(args.tokenizer)))
    ep = Endpoint(args.url, prompt_format=args.prompt_format, send_priority=not args.no_priority)
    bench.set_slos(ep)
    bench.capacity(args.label or ep.url, ep)
    out = output_dir(args.output_dir, spec.name)
    print(bench.write(out, the_command()))
    return 0
