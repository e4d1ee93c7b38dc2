"""`--max-num-seqs auto --max-num-batched-tokens auto` against fixed settings on the real server (issue 15): the
strict capacity of each, searched by the benchmark's own capacity search (paceline.bench.compare), one server
after another in one process, the same requests and prompts for every setting.

    flock -x /tmp/paceline-cpu.lock .venv/bin/python benchmarks/auto_batch_capacity.py --workload chat \\
        --settings auto/auto,128/512,16/512 --max-step-ms 112 --slo 150 --max-probes 4

Each setting is SEATS/BUDGET ("auto" for either); every server gets the same --max-step-ms. Only the ratios
between settings of one run mean anything on a shared machine.

A bracket at fixed rates instead of a search per setting (long-prompt probes take minutes; 2026-11-24):

    flock -x /tmp/paceline-cpu.lock setsid .venv/bin/python benchmarks/auto_batch_capacity.py \
        --workload long-prompt --settings auto/auto,128/512 --rates 0.05,0.07 --max-step-ms 150 \
        --decode-step-ms 38.0 --slo strict --probe-requests 6 --probe-timeout 40 --server-nice -10
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paceline.bench import host_cpu  # noqa: E402
from paceline.bench.client import warmup  # noqa: E402
from paceline.bench.compare import Bench, add_common_args  # noqa: E402
from paceline.bench.peers import Server, paceline_system, set_autogroup_nice  # noqa: E402
from paceline.bench.prompts import PromptSource, bundled_gguf, load_tokenizer  # noqa: E402
from paceline.bench.report import output_dir  # noqa: E402
from paceline.bench.workload import load_workload  # noqa: E402


def setting(item: str) -> tuple[str, str]:
    seats, _, budget = item.partition("/")
    for v in (seats, budget):
        if v != "auto" and not v.isdigit():
            raise SystemExit(f"setting {item!r}: expected SEATS/BUDGET, each a number or auto")
    return seats, budget


def save_steps(url: str, path: Path) -> None:
    """The server's own step log (the last steps it kept): how many requests ran while others waited, what each
    step took and was predicted to take. One line of it is printed."""
    steps = httpx.get(url + "/dashboard/steps", timeout=30.0).json()["models"][0]["steps"]
    path.write_text(json.dumps(steps))
    if steps:
        queued = [s for s in steps if s["waiting"] > 0]
        print(f"  step log: {len(steps)} steps, running p50 {statistics.median(s['running'] for s in steps):.0f} "
              f"(max {max(s['running'] for s in steps)}), {len(queued)} steps with requests waiting "
              f"(running p50 {statistics.median(s['running'] for s in queued) if queued else 0:.0f} in them), "
              f"step p50 {statistics.median(s['dur'] for s in steps) * 1e3:.0f} ms", flush=True)


def server_system(item: str, model: str, max_step_ms: float):
    seats, budget = setting(item)
    system = paceline_system("stall-free", budget, model, extra=["--max-num-seqs", seats],  # type: ignore[arg-type]
                             max_step_ms=max_step_ms)
    system.name = f"paceline seats {seats}, budget {budget}, {max_step_ms:g} ms"
    system.env["PYTHONPATH"] = str(ROOT)  # this checkout's paceline
    return system


def bench_rates(args: argparse.Namespace, bench: Bench, model: str, out: Path) -> str:
    """Every setting probed at every rate of --rates, turn about, one server per setting kept up throughout; then
    each setting's capacity over its probes (the highest passing rate below its lowest failing one)."""
    rates = [float(x) for x in args.rates.split(",")]
    if args.server_nice is not None and os.getsid(0) == os.getpid():
        set_autogroup_nice(os.getpid(), args.server_nice)
    with contextlib.ExitStack() as stack:
        servers = []
        for item in args.settings.split(","):
            system = server_system(item, model, args.max_step_ms)
            seats, budget = setting(item)
            srv = stack.enter_context(Server(system, out / "logs" / f"{seats}-{budget}.log"))
            if args.server_nice is not None:
                set_autogroup_nice(srv.proc.pid, args.server_nice)
            ep = system.endpoint(srv.url)
            warmup(ep, bench.prompts(bench.base[:1], ep.prompt_format, epoch=0)[0])
            servers.append((system.name, ep, srv, f"{seats}-{budget}"))
        if not bench.slos:
            bench.set_slos(servers[0][1])
        probes: dict[str, dict[float, dict]] = {name: {} for name, *_ in servers}
        for i, rate in enumerate(rates):
            for name, ep, srv, _tag in (servers if i % 2 == 0 else servers[::-1]):
                print(f"== {name} @ {rate:g} req/s, {time.strftime('%H:%M:%S', time.gmtime())} UTC", flush=True)
                with host_cpu.watch(srv.proc.pid) as host:
                    probes[name][round(rate, 6)] = bench.run_at(name, ep, rate, bench.probe_size(rate),
                                                                True)["summary"]
                bench.runs[-1]["host"] = host
                print("  host: " + ", ".join(f"{k} {v:.2f}" for k, v in host.items()), flush=True)
                bench.write(out, " ".join(sys.argv))  # after every probe, so a cut-short run leaves results behind
        for _name, _ep, srv, tag in servers:
            save_steps(srv.url, out / "logs" / f"steps-{tag}.json")
    for name in probes:
        bench.judge_probes(name, probes[name])
    return bench.write(out, " ".join(sys.argv))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--settings", default="auto/auto,128/512", help="comma list of SEATS/BUDGET")
    p.add_argument("--max-step-ms", type=float, default=112.0, help="the step-time target every server gets")
    p.add_argument("--rates", default="",
                   help="comma list of rates: instead of a search per setting, probe every setting at each rate, the "
                        "settings' servers all up and taking turns (A B at the first rate, B A at the next), so a "
                        "drifting host loads them alike; each setting's capacity is then judged over these probes")
    p.add_argument("--server-nice", type=int, default=None,
                   help="--rates: autogroup nice for each server's session and this benchmark's (when it runs in a "
                        "session of its own, e.g. under setsid), as in fairness.py")
    args = p.parse_args()
    # a `timeout` around the run sends SIGTERM: exit through the `with Server` blocks so no server is left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spec = load_workload(args.workload)
    bench = Bench(args, spec, PromptSource(load_tokenizer(args.tokenizer)))
    model = bundled_gguf()
    out = output_dir(args.output_dir, f"auto-batch-{spec.name}")
    if args.rates:
        print(bench_rates(args, bench, model, out))
        return
    for item in args.settings.split(","):
        seats, budget = setting(item)
        system = server_system(item, model, args.max_step_ms)
        print(f"== {system.name}", flush=True)
        with Server(system, out / "logs" / f"{seats}-{budget}.log") as srv:
            ep = system.endpoint(srv.url)
            warmup(ep, bench.prompts(bench.base[:1], ep.prompt_format, epoch=0)[0])
            if not bench.slos:
                bench.set_slos(ep)
            bench.capacity(system.name, ep)
            save_steps(srv.url, out / "logs" / f"steps-{seats}-{budget}.json")
        bench.write(out, " ".join(sys.argv))  # after every setting, so a cut-short run leaves results behind
    print(bench.write(out, " ".join(sys.argv)))


if __name__ == "__main__":
    main()
