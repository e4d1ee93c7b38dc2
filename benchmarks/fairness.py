"""Fair share and time slices, measured (issue 15): the same two-tenants run (a heavy client keeping 16 long
generations in flight, twice the 8 seats, and a light client sending short requests) against paceline with
fcfs, fair, and fair + time slices, and vLLM's CPU server (fcfs) beside them; one table (run 1 of
benchmarks/summaries/fairness.md):

    flock -x /tmp/paceline-cpu.lock .venv/bin/python benchmarks/fairness.py --duration 75 --rate 5.5

Each system: started on 127.0.0.1 with --max-num-seqs 8, warmed up with one request, sent the same requests
with the same prompts (each carrying its client as the OpenAI `user` field), stopped. Only the ratios between
systems of one run mean anything on a shared machine.

Throughput against fcfs, measured so that one host stall cannot decide it (issue 15's tok/s target; run 7 of
benchmarks/summaries/fairness.md, rounds 1-2, then round 3 in a later lock hold with `--first-round 3 --rounds 1`):

    flock -x /tmp/paceline-cpu.lock setsid .venv/bin/python benchmarks/fairness.py --duration 60 --drain-s 3 \\
        --rounds 2 --systems fcfs,fair,fair-slice --time-slice-tokens 16 --persistent-servers --server-nice -10 \\
        --steady-skip-s 30

--rounds N runs the systems N times in a rotating order (round_order), each round on fresh requests (seed +
round - 1) that every system of the round gets alike; --first-round continues such a run in a later lock hold.
The rounds table prints every run's total output tok/s against fcfs of its round, over the arrival window and
from --steady-skip-s on, with the CPU other processes and the hypervisor took meanwhile (from /proc), then each
system's median ratio over the rounds.

`--simulate PROFILE` runs the same requests through the simulator instead (the servers' settings: 8 seats,
budget 512, a 150 ms step target; `--sim-slowdown F` multiplies the profile's costs, e.g. a float32 profile to
this machine's int4 speed), with the same table; vLLM is skipped there.
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
from paceline.bench.client import run, warmup  # noqa: E402
from paceline.bench.peers import Server, paceline_system, set_autogroup_nice, vllm_cpu_system  # noqa: E402
from paceline.bench.prompts import PromptSource, build_prompts, bundled_gguf, load_tokenizer  # noqa: E402
from paceline.bench.report import client_table, environment, markdown_table, run_dict  # noqa: E402
from paceline.bench.workload import generate, load_workload  # noqa: E402

SEATS = 8


def step_summary(url: str, since: int) -> dict:
    """What the server's own step log (GET /dashboard/steps) says about the run: how many steps, how long they
    took against the prediction, how often a step ran with a seat free while work waited, and the preemptions."""
    body = httpx.get(url + "/dashboard/steps", timeout=30.0).json()["models"][0]
    steps = [s for s in body["steps"] if s["seq"] > since]
    if not steps:
        return {"steps": 0}
    dur = [s["dur"] for s in steps]
    span = steps[-1]["t"] - steps[0]["t"] + steps[-1]["dur"]
    return {"steps": len(steps), "span_s": span, "steps_per_s": len(steps) / max(span, 1e-9),
            "dur_p50_ms": statistics.median(dur) * 1e3, "dur_p90_ms": sorted(dur)[int(0.9 * (len(dur) - 1))] * 1e3,
            "pred_p50_ms": statistics.median(s["pred"] for s in steps) * 1e3,
            "busy_fraction": sum(dur) / max(span, 1e-9),  # the rest is the engine between steps, or idle
            "seat_free_while_waiting": sum(1 for s in steps if s["running"] < SEATS and s["waiting"] > 0),
            # what the server computed, whoever it was for: a fair order runs the light client's prompts (4 prompt
            # tokens per output token) where fcfs runs heavy decodes, so output tokens alone understate its work
            "decode_per_s": sum(s["decode"] for s in steps) / max(span, 1e-9),
            "prefill_per_s": sum(s["prefill"] for s in steps) / max(span, 1e-9),
            "preempted": sum(s["preempted"] for s in steps), "records": steps}


def window_steps(records: list[dict], duration: float) -> list[dict]:
    """The steps that started within the arrival window (from the run's first step): every system is then
    compared over the same span, not over a drain that one of them may still be in."""
    if not records:
        return []
    t0 = records[0]["t"]
    return [s for s in records if s["t"] - t0 < duration]


def _shape_features(s: dict) -> list[float]:
    # what a step costs on this CPU, to first order: a fixed part, every row (decode or prompt token) through the
    # int4 matmuls, and a prompt chunk's own attention path
    return [1.0, float(s["decode"]), float(s["prefill"]), 1.0 if s["prefill"] else 0.0]


def shape_model(runs: list[list[dict]], rounds: int = 20):
    """One step-cost model for every run of a benchmark, each run with its own speed factor: dur = speed(run) x
    (features . coef), fitted by alternating least squares. Why pooled: one run's own fit swings with its host
    stalls (on 2026-11-23 one fcfs run put 102 ms on a prompt chunk, the next -13 ms), while the shapes of all
    runs together pin the costs and leave the host's share to the speed factors."""
    import numpy as np

    xs = [np.array([_shape_features(s) for s in r]) for r in runs]
    ds = [np.array([s["dur"] for s in r]) for r in runs]
    speeds = [1.0] * len(runs)
    coef = np.zeros(4)
    for _ in range(rounds):
        coef, *_ = np.linalg.lstsq(np.vstack(xs), np.concatenate([d / v for d, v in zip(ds, speeds)]), rcond=None)
        speeds = [float(d @ (x @ coef) / max((x @ coef) @ (x @ coef), 1e-18)) for x, d in zip(xs, ds)]
    return coef


def step_split(records: list[dict], coef) -> dict:
    """Where a system's decode throughput goes, from its step log: decode tok/s = decodes per step x steps per
    second, steps per second = busy share / mean step time, and the step time = its shape (shape_model's cost of
    these steps) x the speed the host gave the run (measured / shape). A scheduling order changes the first
    three; a busier host the last."""
    import numpy as np

    span = records[-1]["t"] - records[0]["t"] + records[-1]["dur"]
    dur = np.array([s["dur"] for s in records])
    shape = np.array([_shape_features(s) for s in records]) @ coef
    n = len(records)
    return {"steps": n, "steps_per_s": n / max(span, 1e-9), "busy": float(dur.sum()) / max(span, 1e-9),
            "decode_per_step": sum(s["decode"] for s in records) / n,
            "prefill_per_step": sum(s["prefill"] for s in records) / n,
            "prompt_step_share": sum(1 for s in records if s["prefill"]) / n,
            "dur_mean_ms": float(dur.mean()) * 1e3, "shape_ms": float(shape.mean()) * 1e3,
            "speed": float(dur.mean() / shape.mean()),
            "seat_free_while_waiting": sum(1 for s in records if s["running"] < SEATS and s["waiting"] > 0),
            "preempted": sum(s["preempted"] for s in records)}


def split_table(runs: list[dict], duration: float) -> str:
    """step_split of every run's steps in the arrival window, each against the fcfs run of its round, as one
    table. The last column is what the order itself cost: the decode tok/s ratio at the speed fcfs had."""
    windows = {id(r): window_steps((r.get("steps") or {}).get("records") or [], duration) for r in runs}
    if not all(windows.values()):
        return ""
    coef = shape_model(list(windows.values()))
    split = {k: step_split(v, coef) for k, v in windows.items()}
    rows = []
    for r in runs:
        base = next((b for b in runs if b["system"].startswith("paceline-fcfs") and b["round"] == r["round"]), None)
        if base is None:
            continue
        x, b = split[id(r)], split[id(base)]
        ratios = (x["decode_per_step"] / b["decode_per_step"], x["busy"] / b["busy"], x["shape_ms"] / b["shape_ms"],
                  x["speed"] / b["speed"])
        measured = x["decode_per_step"] * x["steps_per_s"] / max(b["decode_per_step"] * b["steps_per_s"], 1e-9)
        rows.append([r["system"], str(r["round"]), str(x["steps"]), f"{x['decode_per_step']:.2f}",
                     f"{x['prefill_per_step']:.2f}", f"{x['prompt_step_share']:.3f}", f"{x['busy']:.3f}",
                     f"{x['dur_mean_ms']:.1f}", f"{x['shape_ms']:.1f}", f"{ratios[3]:.3f}",
                     str(x["seat_free_while_waiting"]), str(x["preempted"]), f"{measured:.3f}x",
                     "{:.3f} x {:.3f} / {:.3f} / {:.3f}".format(*ratios),
                     f"{ratios[0] * ratios[1] / ratios[2]:.3f}x"])
    names = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in zip(("fixed", "decode", "prompt token", "prompt chunk"), coef))
    return markdown_table(["system", "round", "steps (window)", "decodes / step", "prompt tokens / step",
                           "steps with a prompt chunk", "busy", "step mean (ms)", "its shape (ms)",
                           "host speed vs fcfs", "seat free while waiting", "preempted", "decode tok/s vs fcfs",
                           "= decodes/step x busy / shape / speed", "at fcfs's speed"], rows) + \
        f"\n\nStep cost model pooled over these runs (ms): {names}\n"


def simulate(args: argparse.Namespace, spec, requests) -> list[dict]:
    """The paceline systems of --systems, simulated on the same requests: the same table, virtual time."""
    from paceline.config import CacheConfig, SchedulerConfig
    from paceline.core.step_time import ProfiledCostModel
    from paceline.sim.deploy import Deployment
    from paceline.sim.metrics import sim_run_dict
    from paceline.sim.workloads import SimRequest

    base = ProfiledCostModel.load(args.simulate)
    f = args.sim_slowdown
    cost = ProfiledCostModel({k: v * f for k, v in base.coefficients.items()}, base.swap_s_per_block * f,
                             base.mask_s_per_row * f, base.meta)
    sim_requests = [SimRequest(r.index, r.arrival_s, r.prompt_tokens, r.output_tokens, r.priority, r.client)
                    for r in requests]
    runs = []
    for name in args.systems.split(","):
        if name == "vllm-cpu":
            continue
        slices = {"time_slice_tokens": args.time_slice_tokens, "preemption_mode": args.preemption_mode} \
            if name == "fair-slice" else {}
        if name not in ("fcfs", "fair", "fair-slice"):
            raise SystemExit(f"unknown system {name!r}")
        sched = SchedulerConfig(max_num_seqs=SEATS, max_num_batched_tokens=512, max_step_ms=150.0,
                                scheduling_policy="fcfs" if name == "fcfs" else "fair", **slices)
        result = Deployment(cost, sched, CacheConfig()).simulator().run(sim_requests,
                                                                        in_flight_caps=spec.in_flight_caps())
        r = sim_run_dict(result, system=f"paceline-{name} (simulated)", workload=spec.name, rate=args.rate,
                         extra={"round": 1})
        r["summary"]["preemptions"] = r["simulation"]["preemption_counts"]
        steps = result.steps
        span = max(steps[-1].start + steps[-1].duration - steps[0].start, 1e-9) if steps else 1.0
        dur = sorted(x.duration for x in steps)
        r["steps"] = {"steps": len(steps), "dur_p50_ms": dur[len(dur) // 2] * 1e3 if dur else 0.0,
                      "pred_p50_ms": dur[len(dur) // 2] * 1e3 if dur else 0.0,
                      "decode_per_s": sum(x.num_decode_tokens for x in steps) / span,
                      "prefill_per_s": sum(x.num_prefill_tokens for x in steps) / span,
                      # the server's step-log fields, so step_split reads a simulated run like a served one
                      "records": [{"t": x.start, "dur": x.duration, "pred": x.duration, "decode": x.num_decode_tokens,
                                   "prefill": x.num_prefill_tokens, "running": x.num_running,
                                   "waiting": x.num_waiting, "preempted": x.num_preempted} for x in steps]}
        runs.append(r)
        print(client_table(r), flush=True)
    return runs


def round_order(items: list, round_: int) -> list:
    """The systems' order in round `round_` (0-based): rotated by the round, and reversed every other pass of
    len(items) rounds (A B C, B C A, C A B, C B A, A C B, B A C; with two: A B, B A, B A, A B), so each system runs
    first, middle and last equally often and a host that drifts steadily loads none of them more than the others."""
    k = round_ % len(items)
    order = items[k:] + items[:k]
    return order[::-1] if (round_ // len(items)) % 2 else order


def serve(args: argparse.Namespace, out: Path) -> list[dict]:
    """Every round: the same requests (seed + round - 1, fresh prompts per round) to each system in round_order.
    --persistent-servers starts each server once for all rounds (no start-up between runs, a warm step-time
    scale); otherwise each run gets a fresh server."""
    model = bundled_gguf()
    spec = load_workload("two-tenants")
    source = PromptSource(load_tokenizer(None))
    deadline = args.duration + args.drain_s if args.drain_s is not None else None
    runs: list[dict] = []
    if args.server_nice is not None and os.getsid(0) == os.getpid():  # a session of its own: set its autogroup
        set_autogroup_nice(os.getpid(), args.server_nice)
    with contextlib.ExitStack() as stack:
        kept: dict[str, Server] = {}

        def start(system, round_: int) -> Server:
            srv = Server(system, out / "logs" / f"{system.name.split()[0]}-{round_ + 1}.log")
            srv.__enter__()
            stack.callback(srv.__exit__, None, None, None)
            if args.server_nice is not None:
                set_autogroup_nice(srv.proc.pid, args.server_nice)
            return srv

        all_systems = [s for s in systems(args, model) if not s.skip]
        for s in systems(args, model):
            if s.skip:
                print(f"== {s.name}: skipped: {s.skip}")
        if args.persistent_servers:
            for system in all_systems:
                kept[system.name] = start(system, args.first_round - 1)
        for round_ in range(args.first_round - 1, args.first_round - 1 + args.rounds):
            requests = generate(spec, rate=args.rate, duration_s=args.duration, seed=args.seed + round_)
            for system in round_order(all_systems, round_):
                print(f"== {system.name} (round {round_ + 1}) {time.strftime('%H:%M:%S', time.gmtime())} UTC",
                      flush=True)
                srv = kept.get(system.name) or start(system, round_)
                ep = system.endpoint(srv.url)
                text = ep.prompt_format == "text"
                warmup(ep, build_prompts(source, requests[:1], args.seed, text, 99)[0])
                steps_before = _num_steps(srv.url) if system.is_paceline else 0
                prompts = build_prompts(source, requests, args.seed, text, round_)
                with host_cpu.watch(srv.proc.pid) as host:
                    result = run(ep, requests, prompts, progress=False, label=system.name,
                                 in_flight_caps=spec.in_flight_caps(), deadline_s=deadline)
                steps = step_summary(srv.url, steps_before) if system.is_paceline else None
                if system.name not in kept:
                    srv.__exit__(None, None, None)  # its stack callback then finds it stopped
                r = run_dict(system.name, spec.name, args.rate, result,
                             extra={"round": round_ + 1, "steps": steps, "host": host,
                                    "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(result.started_at))})
                runs.append(r)
                print(client_table(r), flush=True)
                print("host: " + ", ".join(f"{k} {v:.2f}" for k, v in host.items()), flush=True)
                if steps and steps["steps"]:
                    print("steps: " + ", ".join(f"{k} {v:.3g}" for k, v in steps.items() if k != "records"), flush=True)
                out.mkdir(parents=True, exist_ok=True)  # after every run, so a cut-short run leaves its results
                (out / "results.json").write_text(json.dumps({"environment": environment(), "args": vars(args),
                                                              "runs": runs}, default=float))
    return runs


def steady_tokens_per_s(r: dict, skip_s: float) -> float:
    """Output tokens per second from skip_s after the first send to the last send. fcfs serves the light client's
    requests ~20 s after they arrive, fair at once, so over the whole window fcfs leaves its last 20 s of light
    prompts (4 prompt tokens per output token) past the window's end and fair does not; from skip_s on both do
    the same kind of work, each one window's worth."""
    reqs = r["requests"]
    start = min(q["sent_s"] for q in reqs) + skip_s
    end = max(q["sent_s"] for q in reqs)
    n = sum(1 for q in reqs for t in q["token_times"] if start <= t <= end)
    return n / max(end - start, 1e-9)


def rounds_table(runs: list[dict], skip_s: float) -> str:
    """Each run's total output tok/s against fcfs in its round (over the window, and from skip_s on), with the
    CPU that other processes and the hypervisor took during it, then each system's median ratio over the rounds."""
    rows, ratios = [], {}
    for r in runs:
        base = next((b for b in runs if b["system"].startswith("paceline-fcfs") and b["round"] == r["round"]), None)
        total = sum(r["summary"]["fairness"]["tokens_per_s"].values())
        steady = steady_tokens_per_s(r, skip_s)
        h = r.get("host") or {}
        cells = [r["system"], str(r["round"]), r.get("utc", "–"), f"{total:.1f}", "–", f"{steady:.1f}", "–"]
        if base is not None:
            b_total = sum(base["summary"]["fairness"]["tokens_per_s"].values())
            b_steady = steady_tokens_per_s(base, skip_s)
            x, y = total / max(b_total, 1e-9), steady / max(b_steady, 1e-9)
            cells[4], cells[6] = f"{x:.3f}x", f"{y:.3f}x"
            ratios.setdefault(r["system"], []).append((x, y))
        cells += [f"{h['other_cores']:.2f}" if h else "–", f"{h['steal_cores']:.2f}" if h else "–",
                  f"{h['server_cores']:.2f}" if h else "–"]
        rows.append(cells)
    text = markdown_table(["system", "round", "started (UTC)", "out tok/s (window)", "vs fcfs",
                           f"out tok/s (from {skip_s:g} s)", "vs fcfs", "other processes (cores)",
                           "stolen (cores)", "server (cores)"], rows)
    med = []
    for name, xs in ratios.items():
        if name.startswith("paceline-fcfs"):
            continue
        w, st = [x for x, _ in xs], [y for _, y in xs]
        med.append([name, str(len(xs)), f"{statistics.median(w):.3f}x", f"{min(w):.3f}-{max(w):.3f}",
                    f"{statistics.median(st):.3f}x", f"{min(st):.3f}-{max(st):.3f}",
                    f"{sum(1 for v in w if v >= 0.95)}/{len(w)}"])
    if med:
        text += "\n\n" + markdown_table(["system", "rounds", "median vs fcfs (window)", "range",
                                          f"median vs fcfs (from {skip_s:g} s)", "range", "rounds >= 0.95x (window)"],
                                         med)
    return text


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
    p.add_argument("--time-slice-tokens", type=int, default=16)
    p.add_argument("--preemption-mode", default="swap")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the systems this many times, interleaved (fcfs, fair, then fair, fcfs, ...): the host's "
                        "drift then spreads over every system instead of landing on one")
    p.add_argument("--first-round", type=int, default=1,
                   help="number the rounds from this one (its seed and place in the order): to continue a run")
    p.add_argument("--persistent-servers", action="store_true",
                   help="start each server once and keep it for every round (default: a fresh server per run)")
    p.add_argument("--server-nice", type=int, default=None,
                   help="autogroup nice for each server's session (and this benchmark's, when it runs in a session of "
                        "its own, e.g. under setsid): below 0, processes outside the lock at nice 0 take less from it")
    p.add_argument("--steady-skip-s", type=float, default=15.0,
                   help="the rounds table's second tok/s column counts from this long after the first send")
    p.add_argument("--drain-s", type=float, default=None,
                   help="after the arrival window, wait at most this long for the requests still running, then cancel "
                        "them (counted as not done); default: wait for all")
    p.add_argument("--table-only", metavar="RESULTS_JSON", default=None,
                   help="print the table of an earlier run's results.json and run nothing")
    p.add_argument("--output", default="bench-results/fairness")
    p.add_argument("--simulate", metavar="PROFILE", default=None,
                   help="simulate the paceline systems with this `paceline profile` JSON instead of serving")
    p.add_argument("--sim-slowdown", type=float, default=1.0, help="--simulate: multiply the profile's costs by this")
    args = p.parse_args()
    # a `timeout` around the run sends SIGTERM: exit through the `with Server` blocks so no server is left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if args.table_only:
        saved = json.loads(Path(args.table_only).read_text())
        runs = saved["runs"]
        for k, v in saved["args"].items():  # the header names the run's own settings
            if k not in ("table_only", "steady_skip_s"):
                setattr(args, k, v)
        out = Path(args.table_only).parent
    elif args.simulate:
        spec = load_workload("two-tenants")
        runs = simulate(args, spec, generate(spec, rate=args.rate, duration_s=args.duration, seed=args.seed))
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
    else:
        out = Path(args.output)
        runs = serve(args, out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"environment": environment(), "args": vars(args), "runs": runs},
                                                     default=float))
    rows = []

    def q(d: dict | None, key: str, scale: float = 1.0, fmt: str = ".0f") -> str:
        return f"{d[key] * scale:{fmt}}" if d else "–"  # None: no request of that kind finished
    for r in runs:
        base = next((b for b in runs if b["system"].startswith("paceline-fcfs") and b["round"] == r["round"]), None)
        s, f = r["summary"], r["summary"]["fairness"]
        light, heavy = s["per_client"]["light"]["ttft"], s["per_client"]["heavy"]["ttft"]
        base_light = base["summary"]["per_client"]["light"]["ttft"] if base else None
        pre = s.get("preemptions") or {}
        total = sum(f["tokens_per_s"].values())  # delivered within the arrival window: the same span for every system
        base_total = sum(base["summary"]["fairness"]["tokens_per_s"].values()) if base else 0.0
        st = r.get("steps") or {}
        done = s["per_client"]["light"]
        rows.append([r["system"], str(r["round"]), q(light, "p50", 1e3), q(light, "p99", 1e3),
                     f"{light['p99'] / base_light['p99']:.3f}x" if light and base_light else "–",
                     q(heavy, "p50", 1.0, ".1f"), q(s["tbt"], "p99", 1e3),
                     f"{f['jain_index']:.3f}", f"{total:.1f}", f"{total / base_total:.3f}x" if base_total else "–",
                     f"{pre.get('per_s', 0):.2f}" if pre else "–", f"{pre.get('recomputed_tokens', 0):.0f}" if pre else "–",
                     f"{done['completed']}/{done['num_requests']}", f"{s['completed']}/{s['num_requests']}",
                     f"{st['dur_p50_ms']:.0f} / {st['pred_p50_ms']:.0f}" if st.get("steps") else "–",
                     f"{st['decode_per_s']:.1f} / {st['prefill_per_s']:.1f}" if st.get("decode_per_s") is not None else "–"])
    table = markdown_table(["system", "round", "light TTFT p50 (ms)", "light TTFT p99 (ms)", "vs fcfs", "heavy TTFT p50 (s)",
                            "TBT p99 (ms)", "Jain", "out tok/s (window)", "vs fcfs", "preemptions/s",
                            "recomputed tokens", "light done", "all done", "step p50 ms, measured / predicted",
                            "server decode / prompt tok/s (run)"], rows)
    env = environment()
    text = (f"two-tenants, rate {args.rate}, {args.duration:.0f} s window, seed {args.seed}, {time.strftime('%Y-%m-%d')}, "
            f"{env['cpu']} ({env['cpus']} CPUs), commit {env['commit']}{' (dirty)' if env['dirty'] else ''}\n\n{table}\n")
    text += ("\nEvery round's total output tok/s against fcfs of its round, and what else used the CPU meanwhile:"
             f"\n\n{rounds_table(runs, args.steady_skip_s)}\n")
    split = split_table(runs, args.duration)
    if split:
        text += ("\nWhere the decode throughput went (steps of the arrival window, each against fcfs of its round):"
                 f"\n\n{split}\n")
    (out / "results.md").write_text(text)
    print(text)


def _num_steps(url: str) -> int:
    return int(httpx.get(url + "/dashboard/steps", timeout=30.0).json()["models"][0]["num_steps"])


if __name__ == "__main__":
    main()
