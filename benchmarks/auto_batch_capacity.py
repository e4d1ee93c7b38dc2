"""`--max-num-seqs auto --max-num-batched-tokens auto` against fixed settings on the real server (issue 15): the
strict capacity of each, searched by the benchmark's own capacity search (paceline.bench.compare), one server
after another in one process, the same requests and prompts for every setting.

    flock -x /tmp/paceline-cpu.lock .venv/bin/python benchmarks/auto_batch_capacity.py --workload chat \\
        --settings auto/auto,128/512,16/512 --max-step-ms 112 --slo 150 --max-probes 4

Each setting is SEATS/BUDGET ("auto" for either); every server gets the same --max-step-ms. Only the ratios
between settings of one run mean anything on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paceline.bench.client import warmup  # noqa: E402
from paceline.bench.compare import Bench, add_common_args  # noqa: E402
from paceline.bench.peers import Server, paceline_system  # noqa: E402
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--settings", default="auto/auto,128/512", help="comma list of SEATS/BUDGET")
    p.add_argument("--max-step-ms", type=float, default=112.0, help="the step-time target every server gets")
    args = p.parse_args()
    # a `timeout` around the run sends SIGTERM: exit through the `with Server` blocks so no server is left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spec = load_workload(args.workload)
    bench = Bench(args, spec, PromptSource(load_tokenizer(args.tokenizer)))
    model = bundled_gguf()
    out = output_dir(args.output_dir, f"auto-batch-{spec.name}")
    for item in args.settings.split(","):
        seats, budget = setting(item)
        system = paceline_system("stall-free", budget, model, extra=["--max-num-seqs", seats],  # type: ignore[arg-type]
                                 max_step_ms=args.max_step_ms)
        system.name = f"paceline seats {seats}, budget {budget}, {args.max_step_ms:g} ms"
        system.env["PYTHONPATH"] = str(ROOT)  # this checkout's paceline
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
