"""paceline from this checkout in one or more configurations, back to back in one process, on vs_vllm.py's probes,
with each server's step log read back: a before/after of a scheduler change in one run.

    flock -x /tmp/paceline-cpu.lock python benchmarks/step_target_ab.py tput,stall --config "" --config "--max-num-batched-tokens 2048"
    flock -x /tmp/paceline-cpu.lock python benchmarks/step_target_ab.py tput,stall --rounds 2 --config "" --config "--tbt-goal-ms 100"
    flock -x /tmp/paceline-cpu.lock python benchmarks/step_target_ab.py tput,stall,chat --config "--max-step-ms 150" --config ""

(The last: the short target against none. A target given by --max-step-ms bounds every chunk alike, which is what
the default did before the short target; `@DIR` before the flags freezes the code a run serves, e.g. a copy of
the checkout, so editing it while a long run waits for the lock changes nothing.)

Probes (comma-separated): `tput` = (a) 32 streams and (d) a lone 1,500-token prompt (median of 2); `stall` = (e) 6
streams, then a 1,500-token prompt, on a server with `--max-num-batched-tokens 64` added (as vs_vllm.py runs it);
`chat` = vs_vllm.py's chat probe (`paceline bench serve --workload chat --rate 0.5 --duration 90 ...`, ~2 min).
Each --config is extra `paceline serve` flags (default: one config, no flags: the serving defaults), optionally
after `@DIR`: that checkout's paceline (e.g. an exported older commit) instead of this one. For each
probe the step log says where the time went: how full the steps that carry decodes were against the step-time
target, measured / predicted step time, the time between steps (the engine thread's own work, and whatever holds
the GIL), and for the stall probe the longest steps and gaps. To compare two checkouts, run it from each in turn.
"""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_vllm as V  # noqa: E402
from paceline.bench.peers import paceline_system  # noqa: E402
from paceline.bench.prompts import PromptSource, bundled_gguf, load_tokenizer  # noqa: E402


def steps_since(url: str, n0: int) -> list[dict]:
    return [s for s in httpx.get(url + "/dashboard/steps").json()["models"][0]["steps"] if s["seq"] > n0]


def num_steps(url: str) -> int:
    return httpx.get(url + "/dashboard/steps").json()["models"][0]["num_steps"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def analyse(steps: list[dict], target_ms: float | None) -> dict:
    """Where a probe's time went, from the step log ("t": when a step was recorded, after it ran)."""
    if not steps:
        return {}
    busy = sum(s["dur"] for s in steps)
    span = steps[-1]["t"] - steps[0]["t"] + steps[0]["dur"]
    between = [b["t"] - b["dur"] - a["t"] for a, b in zip(steps, steps[1:])]  # from one step's end to the next's start
    mixed = [s for s in steps if s["decode"] and s["prefill"]]  # the steps the step-time target sizes
    ratio = [s["dur"] / s["pred"] for s in mixed if s["pred"]]
    out = {"steps": len(steps), "span_s": span, "outside_execute_pct": 100 * (1 - busy / span),
           "rows_mean": statistics.mean(s["decode"] + s["prefill"] for s in steps),
           "between_ms_p50": 1e3 * pct(between, 0.5), "between_ms_max": 1e3 * max(between, default=0.0),
           "mixed_steps": len(mixed), "decode_only_steps": sum(1 for s in steps if s["decode"] and not s["prefill"]),
           "prefill_only_steps": sum(1 for s in steps if s["prefill"] and not s["decode"])}
    if mixed:
        durs = [1e3 * s["dur"] for s in mixed]
        out.update(mixed_dur_ms_p50=pct(durs, 0.5), mixed_dur_ms_p90=pct(durs, 0.9), mixed_dur_ms_max=max(durs),
                   mixed_pred_ms_p50=1e3 * pct([s["pred"] for s in mixed], 0.5),
                   mixed_prefill_tokens_mean=statistics.mean(s["prefill"] for s in mixed),
                   measured_over_predicted_p50=pct(ratio, 0.5), measured_over_predicted_p98=pct(ratio, 0.98))
        if target_ms:
            out["mixed_dur_over_target_pct"] = 100 * sum(d > target_ms for d in durs) / len(durs)
    return out


def steps_around(steps: list[dict], stall: dict) -> dict:
    """The steps the stall probe's largest gap spans (its ends on the monotonic clock the step log also uses), and
    the longest interval between two decode-carrying steps' ends after the long prompt arrived: the gap as the
    engine made it. The client's gap less that interval is what HTTP, the client and the GIL added."""
    at, sent = stall.get("max_gap_at"), stall.get("long_sent_at")
    if not at or sent is None:
        return {}
    a, b = at
    # "t" is stamped after the step's update and metrics; a step ran from about t - dur
    inside = [s for s in steps if s["t"] >= a - 0.02 and s["t"] - s["dur"] <= b + 0.02]
    rows = [{"end_ms": round(1e3 * (s["t"] - a), 1), "dur_ms": round(1e3 * s["dur"], 1),
             "pred_ms": round(1e3 * s["pred"], 1), "decode": s["decode"], "prefill": s["prefill"],
             "running": s["running"], "waiting": s["waiting"]} for s in inside]
    dec = [s for s in steps if s["decode"] and s["t"] >= sent]
    intervals = [(b_["t"] - a_["t"], a_, b_) for a_, b_ in zip(dec, dec[1:])]
    out = {"gap_ms": round(1e3 * (b - a), 1), "gap_start_after_long_sent_ms": round(1e3 * (a - sent), 1),
           "steps_in_gap": rows}
    if intervals:
        iv, s0, s1 = max(intervals, key=lambda x: x[0])
        out.update(engine_interval_max_ms=round(1e3 * iv, 1), engine_interval_step_dur_ms=round(1e3 * s1["dur"], 1),
                   engine_interval_step=(s1["decode"], s1["prefill"]),
                   engine_interval_at_after_long_sent_ms=round(1e3 * (s0["t"] - sent), 1))
    return out


def print_steps(steps: list[dict], every: int = 0) -> None:
    every = every or max(1, len(steps) // 30)
    for s in steps[::every]:
        print("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items() if k not in ("t", "model")})


def run_config(config: str, probes: list[str], prompts: V.Prompts, model: str, verbose: bool) -> dict:
    flags = shlex.split(config)
    checkout = flags.pop(0)[1:] if flags and flags[0].startswith("@") else None
    row: dict = {"flags": config}
    for probe in probes:
        extra = flags + (["--max-num-batched-tokens", str(V.SMALL_BUDGET)] if probe == "stall" else [])
        sysm = V.this_checkout(paceline_system("sarathi", 0, model, 2, extra=extra))
        i = sysm.argv.index("--scheduler")
        del sysm.argv[i:i + 4]  # no scheduler flags unless asked: config.py decides
        if checkout:  # another checkout's paceline: -P keeps the working directory's copy off sys.path
            sysm.argv.insert(1, "-P")
            sysm.env["PYTHONPATH"] = str(Path(checkout).resolve())
        print(f"[{row['flags'] or 'defaults'}] {probe}: {' '.join(sysm.argv)}", flush=True)
        srv, _ = V.start(sysm, Path(tempfile.gettempdir()) / f"paceline-step-ab-{probe}.log")
        try:
            ep = sysm.endpoint(srv.url)
            target = httpx.get(srv.url + "/dashboard/steps").json()["models"][0]["info"].get("max_step_ms")
            n0 = num_steps(srv.url)
            if probe == "tput":
                row["throughput"] = V.probe_throughput(ep, prompts)
                st = steps_since(srv.url, n0)
                row["throughput_steps"] = analyse(st, target)
                if verbose:
                    print_steps(st)
                n0 = num_steps(srv.url)
                row["prefill"] = V.probe_prefill(ep, prompts, repeats=2)
                row["prefill_steps"] = analyse(steps_since(srv.url, n0), target)
            elif probe == "chat":  # the issue's chat command against this server (vs_vllm.py's probe)
                row["chat"] = V.probe_chat(srv.url, "paceline", Path(tempfile.mkdtemp(prefix="step-ab-chat-")),
                                           sysm.send_priority)
                row["chat_steps"] = analyse(steps_since(srv.url, n0), target)
            else:
                # warm it first, as vs_vllm.py does (its budget-64 server runs the 32-stream probe before this one):
                # the first seconds after a start are slower than the rest (engine._warming_up)
                V.run_requests(ep, [V.RequestSpec(i, 0.0, 100, 24) for i in range(8)], [prompts(100) for _ in range(8)])
                n0 = num_steps(srv.url)
                row["stall"] = V.probe_stall(ep, prompts)
                st = steps_since(srv.url, n0)
                row["stall_steps"] = analyse(st, target)
                row["stall_longest_steps"] = sorted(st, key=lambda s: -s["dur"])[:5]
                row["stall_gap"] = steps_around(st, row["stall"])
                if verbose:
                    print_steps(st)
        finally:
            srv.stop()
        print(json.dumps({k: v for k, v in row.items() if k != "flags"}, default=float), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("probes", help="tput, stall or tput,stall")
    ap.add_argument("--config", action="append", default=None, help="extra serve flags of one configuration; repeat")
    ap.add_argument("--verbose", action="store_true", help="print every n-th step of the log")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configurations this many times, alternating (A B A B): the host drifts within a run")
    args = ap.parse_args()
    # killed by a timeout: unwind, so the finally blocks stop the server in flight
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = bundled_gguf()
    prompts = V.Prompts(PromptSource(load_tokenizer(model)), 0)
    rows = [run_config(c, args.probes.split(","), prompts, model, args.verbose)
            for _ in range(args.rounds) for c in (args.config or [""])]
    print("\n| config | 32 streams tok/s | p99 TBT ms | steps | lone 1,500 TTFT ms | stall gap ms | engine's part ms "
          "| chat TTFT p50 / p99 ms | chat TBT p99 / max ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        tp, pf, st = r.get("throughput", {}), r.get("prefill", {}), r.get("stall", {})
        cells = [V.fmt(tp.get("gen_tok_s"), ".1f"), V.fmt(tp.get("tbt_p99_s"), ".0f", 1e3),
                 V.fmt(r.get("throughput_steps", {}).get("steps"), ".0f"), V.fmt(pf.get("ttft_s"), ".0f", 1e3),
                 V.fmt(st.get("max_gap_s"), ".0f", 1e3),
                 V.fmt(r.get("stall_gap", {}).get("engine_interval_max_ms"), ".0f")]
        ch = r.get("chat", {})
        cells += [f'{V.fmt(ch.get("ttft_p50_s"), ".0f", 1e3)} / {V.fmt(ch.get("ttft_p99_s"), ".0f", 1e3)}',
                  f'{V.fmt(ch.get("tbt_p99_s"), ".0f", 1e3)} / {V.fmt(ch.get("tbt_max_s"), ".0f", 1e3)}']
        print(f"| {r['flags'] or 'defaults'} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
