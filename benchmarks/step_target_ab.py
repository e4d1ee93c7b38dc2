"""paceline from this checkout in one or more configurations, back to back in one process, on vs_vllm.py's probes,
with each server's step log read back: a before/after of a scheduler change in one run.

    flock -x /tmp/paceline-cpu.lock python benchmarks/step_target_ab.py tput,stall --config "" --config "--max-num-batched-tokens 2048"
    flock -x /tmp/paceline-cpu.lock python benchmarks/step_target_ab.py tput,stall --rounds 2 --config "" --config "--tbt-goal-ms 100"
    flock -x /tmp/paceline-cpu.lock python benchmarks/step_target_ab.py tput,stall,chat --config "--max-step-ms 150" --config ""

(The last: the short target against none. A target given by --max-step-ms bounds every chunk alike, which is what
the default did before the short target; `@DIR` before the flags freezes the code a run serves, e.g. a copy of
the checkout, so editing it while a long run waits for the lock changes nothing.)

Probes (comma-separated): `tput` = (a) 32 streams and (d) a lone 1,500-token prompt (median of 2); `stall` = (e) 6
streams, then a 1,500-token prompt, on a server with `--max-num-batched-tokens 64` added (as vs_vllm.py runs it),
after a short warm-up or, with `--stall-after tput`, after the 32-stream probe on the same server (vs_vllm.py's
order; the warm-up order runs while the KV pool's prefault still runs, whose steps the step-time target does not
learn from); its largest gap is printed beside the steps around it (vs_vllm.explain_gap);
`chat` = vs_vllm.py's chat probe (`paceline bench serve --workload chat --rate 0.5 --duration 90 ...`, ~2 min).
Each --config is extra `paceline serve` flags (default: one config, no flags: the serving defaults), optionally
after `@DIR`: that checkout's paceline (e.g. an exported older commit) instead of this one, and after that
NAME=VALUE words: the server's environment (e.g. `--config "OMP_PROC_BIND=close OMP_PLACES=cores"`). For each
probe the step log says where the time went: how full the steps that carry decodes were against the step-time
target, measured / predicted step time, the time between steps (the engine thread's own work, and whatever holds
the GIL), and for the stall probe the longest steps and gaps. To compare two checkouts, run it from each in turn.
"""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_vllm as V  # noqa: E402
from paceline.bench.peers import paceline_system  # noqa: E402
from paceline.bench.prompts import PromptSource, bundled_gguf, load_tokenizer  # noqa: E402


def print_steps(steps: list[dict], every: int = 0) -> None:
    every = every or max(1, len(steps) // 30)
    for s in steps[::every]:
        print("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items() if k not in ("t", "model")})


def run_config(config: str, probes: list[str], prompts: V.Prompts, model: str, verbose: bool,
               stall_after: str = "warm") -> dict:
    flags = shlex.split(config)
    checkout = flags.pop(0)[1:] if flags and flags[0].startswith("@") else None
    env = {}  # leading NAME=VALUE words: the server's environment (e.g. OMP_PROC_BIND=close)
    while flags and "=" in flags[0] and not flags[0].startswith("-"):
        name, value = flags.pop(0).split("=", 1)
        env[name] = value
    row: dict = {"flags": config}
    for probe in probes:
        extra = flags + (["--max-num-batched-tokens", str(V.SMALL_BUDGET)] if probe == "stall" else [])
        sysm = V.this_checkout(paceline_system("sarathi", 0, model, 2, extra=extra))
        i = sysm.argv.index("--scheduler")
        del sysm.argv[i:i + 4]  # no scheduler flags unless asked: config.py decides
        if checkout:  # another checkout's paceline: -P keeps the working directory's copy off sys.path
            sysm.argv.insert(1, "-P")
            sysm.env["PYTHONPATH"] = str(Path(checkout).resolve())
        sysm.env.update(env)
        print(f"[{row['flags'] or 'defaults'}] {probe}: {' '.join(sysm.argv)}", flush=True)
        srv, _ = V.start(sysm, Path(tempfile.gettempdir()) / f"paceline-step-ab-{probe}.log")
        try:
            ep = sysm.endpoint(srv.url)
            target = httpx.get(srv.url + "/dashboard/steps").json()["models"][0]["info"].get("max_step_ms")
            n0 = V.num_steps(srv.url)
            if probe == "tput":
                row["throughput"] = V.probe_throughput(ep, prompts)
                st = V.steps_since(srv.url, n0)
                row["throughput_steps"] = V.analyse(st, target)
                row["throughput_step_log"] = st  # raw, for --json: where the probe's wall time went, step by step
                if verbose:
                    print_steps(st)
                n0 = V.num_steps(srv.url)
                row["prefill"] = V.probe_prefill(ep, prompts, repeats=2)
                st = V.steps_since(srv.url, n0)
                row["prefill_steps"] = V.analyse(st, target)
                if verbose:
                    print_steps(st, every=1)
            elif probe == "chat":  # the issue's chat command against this server (vs_vllm.py's probe)
                row["chat"] = V.probe_chat(srv.url, "paceline", Path(tempfile.mkdtemp(prefix="step-ab-chat-")),
                                           sysm.send_priority)
                st = V.steps_since(srv.url, n0)
                row["chat_steps"] = V.analyse(st, target)
                row["chat_step_log"] = st
            else:
                # warm it first: the first seconds after a start are slower than the rest (engine._warming_up).
                # --stall-after tput: vs_vllm.py's order, the 32-stream probe on the same budget-64 server first
                if stall_after == "tput":
                    row["throughput_small"] = V.probe_throughput(ep, prompts)
                else:
                    V.run_requests(ep, [V.RequestSpec(i, 0.0, 100, 24) for i in range(8)],
                                   [prompts(100) for _ in range(8)])
                row["stall"], extra = V.stall_with_steps(ep, srv.url, prompts)
                row.update(extra)
                if verbose:
                    print_steps(extra.get("stall_step_log", []))
        finally:
            srv.stop()
        print(json.dumps({k: v for k, v in V.brief(row).items() if k != "flags"}, default=float), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("probes", help="tput, stall or tput,stall")
    ap.add_argument("--config", action="append", default=None, help="extra serve flags of one configuration; repeat")
    ap.add_argument("--verbose", action="store_true", help="print every n-th step of the log")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configurations this many times, alternating (A B A B): the host drifts within a run")
    ap.add_argument("--stall-after", choices=("warm", "tput"), default="warm",
                    help="what the stall probe's server runs first: a short warm-up (8 requests), or vs_vllm.py's "
                         "32-stream probe on the same budget-64 server (its order)")
    ap.add_argument("--json", default=None, help="write every row (step logs included) to this file")
    args = ap.parse_args()
    # killed by a timeout: unwind, so the finally blocks stop the server in flight
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = bundled_gguf()
    prompts = V.Prompts(PromptSource(load_tokenizer(model)), 0)
    rows = [run_config(c, args.probes.split(","), prompts, model, args.verbose, args.stall_after)
            for _ in range(args.rounds) for c in (args.config or [""])]
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1, default=float))
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
