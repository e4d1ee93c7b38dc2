"""Two models in one server (one step loop) against one `paceline serve` process per model on the same cores, same
traffic; each model alone at its own rate; and switching to a model that is not loaded.

    flock -x /tmp/paceline-cpu.lock python benchmarks/multi_model.py --rate 0.5 --seconds 60

Models: the bundled SmolLM2-135M as smol-fp32 (float32) and smol-int4 (int4), both with the default KV memory and
step-time target, so the step-time profiles that `paceline serve` caches for those setups serve every run here.
Traffic: the chat workload's lengths (outputs capped), Poisson arrivals, each request a model (50/50).
Every server gets the same requests at the same times; prompts are token ids, a fresh epoch per server.
Results as JSON under --out (not committed) and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np

from paceline.bench.client import Endpoint, run
from paceline.bench.metrics import summarize
from paceline.bench.peers import free_port
from paceline.bench.prompts import PromptSource, build_prompts, load_tokenizer
from paceline.bench.workload import LengthDist, ModelShare, RequestSpec, generate, load_workload

# seconds every server idles after it is up, before any traffic (--settle): its KV pools' prefault threads run then,
# not beside the first requests (a server holding two 2 GiB pools had its first ~12 s of steps 3-10x slower,
# 2026-11-24 08:20 UTC; docs in benchmarks/summaries/multi_model.md)
SETTLE_S = 0.0
STEP_LOGS = False  # --step-logs: servers keep their dashboard; each one-loop arm's step log lands in the output folder
SWITCH_SPACING_S = 6.0  # between two switches: the switched model's request ends and it unloads (keep_alive 0)
MODELS = {"smol-fp32": ["--dtype", "float32"], "smol-int4": ["--quantization", "int4"]}


class Served:
    def __init__(self, args: list[str], threads: int, log_dir: Path, label: str, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / f"{label}.log", "w")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
        dashboard = [] if STEP_LOGS else ["--no-dashboard"]
        self.proc = subprocess.Popen([sys.executable, "-m", "paceline.entrypoints.server", "--port", str(self.port),
                                      *dashboard, *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server {label} did not start; see {self.log.name}")
            time.sleep(0.2)
        time.sleep(SETTLE_S)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def per_model(records: list, duration: float) -> dict:
    out = {}
    for name in MODELS:
        recs = [r for r in records if r.model == name]
        if recs:
            s = summarize(recs, duration=duration, by_priority=False)
            # the largest gaps (8 requests a model: the p99 is about the fifth largest), each with the index of the
            # token that ended it (1: the gap after the first token) and when it ended (s after the first send)
            t0 = min(r.sent_s for r in records)
            gaps = sorted(((b - a, i + 1, b - t0) for r in recs for i, (a, b) in
                           enumerate(zip(r.token_times, r.token_times[1:]))), reverse=True)[:8]
            # p90 as well: ten times the gaps behind it, a steadier signal for an A/B than the p99
            out[name] = {"p99_tbt_ms": 1e3 * s["tbt"]["p99"], "p90_tbt_ms": 1e3 * s["tbt"]["p90"],
                         "p50_tbt_ms": 1e3 * s["tbt"]["p50"],
                         "p50_ttft_s": s["ttft"]["p50"], "tok_s": s["output_throughput"],
                         "completed": s["completed"], "failed": s["failed"],
                         "largest_gaps": [(round(1e3 * g, 1), i, round(at, 2)) for g, i, at in gaps]}
    s = summarize(records, duration=duration, by_priority=False)
    out["total"] = {"p99_tbt_ms": 1e3 * s["tbt"]["p99"], "tok_s": s["output_throughput"], "completed": s["completed"],
                    "failed": s["failed"]}
    return out


def decode_steps_beside(log: dict, window_s: float = 0.06) -> dict:
    """From a loop's step log (GET /dashboard/steps): each model's decode-only steps split by whether another
    model ran a decode step within `window_s` of it (its streams interleaved with this one's) or not: count and
    median duration in ms. Why: a step that follows another model's reads its weights back from farther away."""
    steps = [s for m in log["models"] for s in m["steps"] if s["decode"] > 0]
    out = {}
    for name in sorted({s["model"] for s in steps}):
        others = np.array(sorted(s["t"] for s in steps if s["model"] != name))
        split: dict[str, list[float]] = {"beside": [], "apart": []}
        for s in steps:
            if s["model"] == name and s["prefill"] == 0:
                i = np.searchsorted(others, s["t"] - window_s)
                near = i < len(others) and others[i] <= s["t"] + window_s
                split["beside" if near else "apart"].append(1e3 * s["dur"])
        out[name] = {k: {"steps": len(v), "median_ms": round(float(np.median(v)), 1) if v else None}
                     for k, v in split.items()}
    return out


def drive(ep: Endpoint, requests: list[RequestSpec], prompts: list, duration: float) -> dict:
    res = run(ep, requests, prompts, progress=False, scrape_interval=None, deadline_s=duration + 240)
    return per_model(res.records, res.duration_s)


def models_yaml(path: Path, lazy: set[str] = frozenset()) -> Path:
    """Both models; those in `lazy` load on their first request and unload as soon as they are idle."""
    lines = ["models:"]
    for name in MODELS:
        mode = "dtype: float32" if name == "smol-fp32" else "quantization: int4"
        lines.append(f"  - {{name: {name}, {mode}{', load: lazy, keep_alive: 0' if name in lazy else ''}}}")
    path.write_text("\n".join(lines) + "\n")
    return path


# Switch variants: the model loaded on demand, and the server's environment (the A/B knobs in residency.py and
# multi.py). "" loads smol-fp32 beside smol-int4 streams, "int4" the other way round.
SWITCH_VARIANTS = {
    "": ("smol-fp32", {}), "int4": ("smol-int4", {}),
    # as before 2026-11-24 03:00 UTC: the load beside the other model's steps, the first prompt whole in one step
    "before": ("smol-fp32", {"PACELINE_LOAD_TURNS": "0", "PACELINE_DEBUT_STEP": "whole"}),
    "int4-before": ("smol-int4", {"PACELINE_LOAD_TURNS": "0", "PACELINE_DEBUT_STEP": "whole"}),
    # sliced as before 2026-11-24 08:30 UTC: due after the other's whole last step, the first boundary after it, one
    # step-time share per busy model, prompts alone uncut, no longer wait for a debut's first step
    "sliced-before": ("smol-fp32", {"PACELINE_SLICE_DUE": "1.0", "PACELINE_SLICE_AHEAD": "0",
                                    "PACELINE_SLICE_SHARE": "0", "PACELINE_SLICE_PROMPT_CAP": "0",
                                    "PACELINE_DEBUT_DUE": "1.0"}),
    # every step whole, as before 2026-11-24 05:00 UTC (multi.py's layer-sliced steps off)
    "unsliced": ("smol-fp32", {"PACELINE_SLICE": "0"}), "int4-unsliced": ("smol-int4", {"PACELINE_SLICE": "0"}),
    # the load in turns, the first prompt whole in one step
    "turns-whole": ("smol-fp32", {"PACELINE_DEBUT_STEP": "whole"}),
    "int4-turns-whole": ("smol-int4", {"PACELINE_DEBUT_STEP": "whole"}),
    # as before 2026-11-24 13:10 UTC and the default of 14:20-16:00 UTC (ONE_LOOP_VARIANTS' one-loop-before-tail)
    "before-tail": ("smol-fp32", {"PACELINE_SLICE_TAIL": "0", "PACELINE_SLICE_STREAM_DUE": "0",
                                  "PACELINE_SLICE_SPAN": "0"}),
    "int4-before-tail": ("smol-int4", {"PACELINE_SLICE_TAIL": "0", "PACELINE_SLICE_STREAM_DUE": "0",
                                       "PACELINE_SLICE_SPAN": "0"}),
    # the rules of 13:10 UTC without the span rule (the code of 13:41-14:20 UTC)
    "tail-rules": ("smol-fp32", {"PACELINE_SLICE_TAIL": "1", "PACELINE_SLICE_STREAM_DUE": "1",
                                 "PACELINE_SLICE_SPAN": "0"}),
    # the default since 16:00 UTC, named (ONE_LOOP_VARIANTS' one-loop-span)
    "span": ("smol-fp32", {"PACELINE_SLICE_TAIL": "1", "PACELINE_SLICE_STREAM_DUE": "1", "PACELINE_SLICE_SPAN": "1"}),
    "pack-first": ("smol-fp32", {"PACELINE_DEFER_PACKING": "0"}),
    "nice19": ("smol-fp32", {"PACELINE_LOADER_NICE": "19"}),
    # the background packing at nice 19 with 2 ms pauses, as before 2026-11-29 17:00 UTC (residency.PACK_NICE)
    "pack19": ("smol-fp32", {"PACELINE_PACK_NICE": "19", "PACELINE_PACK_PAUSE_MS": "2"}),
    "int4-pack19": ("smol-int4", {"PACELINE_PACK_NICE": "19", "PACELINE_PACK_PAUSE_MS": "2"}),
    "warm-up": ("smol-fp32", {"PACELINE_LOAD_WARM_UP": "1"}),
    "whole": ("smol-fp32", {"PACELINE_DEBUT_STEP": "whole"}), "int4-whole": ("smol-int4", {"PACELINE_DEBUT_STEP": "whole"}),
    # the others' streams due after 2x (not 4x) their step while a newcomer's first prompt runs
    "debut2": ("smol-fp32", {"PACELINE_DEBUT_DUE": "2"}), "int4-debut2": ("smol-int4", {"PACELINE_DEBUT_DUE": "2"}),
    # a debut's others due after a fixed DEBUT_DUE x their step, as before 2026-11-29 10:40 UTC (DEBUT_BY_S off)
    "debut-fixed": ("smol-fp32", {"PACELINE_DEBUT_BY_S": "0"}),
    "int4-debut-fixed": ("smol-int4", {"PACELINE_DEBUT_BY_S": "0"}),
    # float32 products on plain (not yet packed) weights through aten's linear, as before 2026-11-29 11:45 UTC
    "plain-aten": ("smol-fp32", {"PACELINE_PLAIN_ONEDNN": "0"}),
    # while a model loads, the others' step-time targets one share each, as before 2026-11-29 10:10 UTC
    "turn-shares": ("smol-fp32", {"PACELINE_LOAD_TURN_TARGET": "0"}),
    "int4-turn-shares": ("smol-int4", {"PACELINE_LOAD_TURN_TARGET": "0"}),
    # the Engine's build and the page mapping one load turn each, as before 2026-11-29 12:40 UTC (PIECE_TURNS off)
    "one-turn": ("smol-fp32", {"PACELINE_PIECE_TURNS": "0"}),
    "int4-one-turn": ("smol-int4", {"PACELINE_PIECE_TURNS": "0"}),
    # the streaming model's prompts chunked beside its decodes during a load and a debut, as before 2026-11-29
    # 17:52 UTC (multi.HOLD_PROMPTS off)
    "unheld": ("smol-fp32", {"PACELINE_HOLD_PROMPTS": "0"}),
    "int4-unheld": ("smol-int4", {"PACELINE_HOLD_PROMPTS": "0"}),
    # a load's pieces chained into turns of 8 or 12 ms, not 20 (multi.LOAD_TURN_CHAIN_S)
    "chain8": ("smol-fp32", {"PACELINE_LOAD_TURN_CHAIN_MS": "8"}),
    "chain12": ("smol-fp32", {"PACELINE_LOAD_TURN_CHAIN_MS": "12"}),
    "int4-chain8": ("smol-int4", {"PACELINE_LOAD_TURN_CHAIN_MS": "8"}),
    # a load's pieces broken only between the larger ones, its turns chained up to 20 ms whatever the others' decode
    # steps, as before 2026-11-29 20:30 UTC (loader.PIECE_TICK_S and multi.LOAD_TURN_BY_DECODE off)
    "coarse": ("smol-fp32", {"PACELINE_PIECE_TICK_MS": "0", "PACELINE_LOAD_TURN_BY_DECODE": "0"}),
    "int4-coarse": ("smol-int4", {"PACELINE_PIECE_TICK_MS": "0", "PACELINE_LOAD_TURN_BY_DECODE": "0"}),
    # the packing beside two lanes: longer pauses between two Linears, or at the lowered lane's nice value (tried
    # 2026-11-29 20:49 UTC, run PPPP; not kept)
    "pack-pause60": ("smol-fp32", {"PACELINE_PACK_PAUSE_MS": "60"}),
    "pack-nice5": ("smol-fp32", {"PACELINE_PACK_NICE": "5"}),
    # the only busy model's step of prompts alone runs whole: a load waits for all of it, as before 2026-11-29
    # 21:00 UTC (multi.LONE_SLICED off)
    "lone-whole": ("smol-fp32", {"PACELINE_LONE_SLICED": "0"}),
    "int4-lone-whole": ("smol-int4", {"PACELINE_LONE_SLICED": "0"}),
}


# One-loop variants: the server's environment (multi.py's A/B knobs). one-loop-unsliced: every step whole, the A/B of
# layer-sliced steps; one-loop-sliced-before: sliced as before 2026-11-24 08:30 UTC (SWITCH_VARIANTS' sliced-before);
# one-loop-before-tail: as before 2026-11-24 13:10 UTC and the default of 14:20-16:00 UTC (the boundary after the
# last layer judged by that layer, and streams due after half their prompt step once it gave them their first
# token); one-loop-tail-rules: both rules of 13:10 UTC on; one-loop-tail-only: the first of them alone
ONE_LOOP_VARIANTS = {
    "one-loop": {}, "one-loop-gc-unpaced": {"PACELINE_GC_PACING": "0"},
    # two busy models' steps side by side on a worker thread each, one OpenMP thread each (multi.py LANES);
    # lanes are the default since 13:45 UTC: one-loop-rotation is every step in the rotation, as before (the A/B)
    "one-loop-rotation": {"PACELINE_LANES": "0"}, "one-loop-lanes-nice0": {"PACELINE_LANE_NICE": "0"},
    "one-loop-lanes-nice10": {"PACELINE_LANE_NICE": "10"},
    # a lane's next step started before its outputs go out, not on the engine loop's next call (multi.LANE_RESTART)
    "one-loop-restart": {"PACELINE_LANE_RESTART": "1"},
    # the interpreter's switch interval: Python's own 5 ms, as before 2026-11-29 22:40 UTC, or 1 ms (multi.GIL_SWITCH_S,
    # 0.5 ms by default); one-loop-gil-0.5 is the default by name
    "one-loop-gil-off": {"PACELINE_SWITCH_INTERVAL_MS": "0"}, "one-loop-gil-1": {"PACELINE_SWITCH_INTERVAL_MS": "1"},
    "one-loop-gil-0.5": {"PACELINE_SWITCH_INTERVAL_MS": "0.5"},
    # the float32 model on its float32 weights alone, as before 2026-11-29 23:20 UTC (llama.F32_CODES off)
    "one-loop-f32-plain": {"PACELINE_F32_CODES": "0"},
    "one-loop-unsliced": {"PACELINE_SLICE": "0"}, "one-loop-no-defer": {"PACELINE_SLICE_DEFER_S": "0"},
    "one-loop-sliced-all": {"PACELINE_SLICE_WHOLE": "0"}, "one-loop-any-preempts": {"PACELINE_SLICE_SHORTER": "0"},
    "one-loop-sliced-before": SWITCH_VARIANTS["sliced-before"][1],
    "one-loop-before-tail": SWITCH_VARIANTS["before-tail"][1],
    # the two rules of 13:10 UTC without the span rule (off 14:20-16:00 UTC): both, and the tail rule alone
    "one-loop-tail-rules": SWITCH_VARIANTS["tail-rules"][1],
    "one-loop-tail-only": {"PACELINE_SLICE_TAIL": "1", "PACELINE_SLICE_STREAM_DUE": "0", "PACELINE_SLICE_SPAN": "0"},
    # another model's streams due after 0.6x / 0.7x their own last step (PACELINE_SLICE_DUE; the default 0.5)
    "one-loop-due-0.6": {"PACELINE_SLICE_DUE": "0.6"}, "one-loop-due-0.7": {"PACELINE_SLICE_DUE": "0.7"},
    "one-loop-due-0.4": {"PACELINE_SLICE_DUE": "0.4"},
    # the span rule (PACELINE_SLICE_SPAN) with both rules of 13:10 UTC: the default since 2026-11-24 16:00 UTC;
    # before-span: the default of 14:20-16:00 UTC (all three off); span-only: without the two rules of 13:10 UTC
    "one-loop-span": SWITCH_VARIANTS["span"][1],
    "one-loop-before-span": SWITCH_VARIANTS["before-tail"][1],
    "one-loop-span-only": {**SWITCH_VARIANTS["before-tail"][1], "PACELINE_SLICE_SPAN": "1"},
    # each model's KV prefault paced by its own requests only, as before 2026-11-24 16:00 UTC
    "one-loop-own-prefault": {"PACELINE_LOOP_PREFAULT": "0"},
    # the span rule's cap on the other models' wait, 0.8x / 0.85x their step (PACELINE_SLICE_DUE_MAX; the default 0.9)
    "one-loop-due-max-0.8": {"PACELINE_SLICE_DUE_MAX": "0.8"},
    "one-loop-due-max-0.85": {"PACELINE_SLICE_DUE_MAX": "0.85"},
    "one-loop-due-max-0.6": {"PACELINE_SLICE_DUE_MAX": "0.6"},
    "one-loop-due-max-0.5": {"PACELINE_SLICE_DUE_MAX": "0.5"},
    "one-loop-due-max-1.3": {"PACELINE_SLICE_DUE_MAX": "1.3"},
    # the span rule bounded by the whole step-time target, not the calm one (PACELINE_SLICE_CALM; the default on)
    "one-loop-no-calm": {"PACELINE_SLICE_CALM": "0"},
}


def switch_run(args: argparse.Namespace, log_dir: Path, source: PromptSource, variant: str = "") -> dict:
    """Streams of one model run; requests for the other model, unloaded (keep_alive 0: it leaves once idle), arrive
    mid-run, up to --switches of them, each --switch-after (1 s) after one of the streaming model's arrivals (so
    that its streams run while the target loads) and at least SWITCH_SPACING_S after the one before. Per switch: its
    TTFT (the load included), the server's split of it (seconds from the request to each mark,
    residency.LoadTimeline) and every step around it (PACELINE_LOG_SWITCH_STEPS), and the streaming model's largest
    gap while it ran, at the client and between two of its steps at the server, against their p99 outside every
    switch.
    The client's send time stands for the server's request mark (both on this machine, a few ms apart); the gaps
    are split at the `joined` mark into the load and the first prompt."""
    target, env = SWITCH_VARIANTS[variant]
    env = {**env, "PACELINE_LOG_SWITCH_STEPS": "1"}
    other = next(name for name in MODELS if name != target)
    label = f"switch{'-' + variant if variant else ''}"
    server = Served(["--models-config", str(models_yaml(log_dir / f"{label}.yaml", {target}))], args.threads,
                    log_dir, label, env)
    try:
        steady = generate(replace(load_workload("chat"), output_tokens=LengthDist("fixed", value=args.output_tokens),
                                  prompt_tokens=LengthDist("lognormal", median=300, sigma=0.8, min=16, max=1000)),
                          rate=args.rate / 2, duration_s=args.switch_seconds, seed=args.seed + 7)
        steady = [replace(r, model=other) for r in steady]
        times: list[float] = []
        for r in steady:
            at = r.arrival_s + args.switch_after
            if r.arrival_s >= 2.0 and len(times) < args.switches and (not times or at >= times[-1] + SWITCH_SPACING_S):
                times.append(at)
        # model= by name: before 2026-11-24 this was the sixth positional field (client), so the request went to
        # the first model served
        switches = [RequestSpec(len(steady) + i, at, 64, 16, 0, model=target) for i, at in enumerate(times)]
        requests = sorted(steady + switches, key=lambda r: r.arrival_s)
        prompts = build_prompts(source, requests, args.seed, as_text=False, epoch=9)
        res = run(Endpoint(server.url), requests, prompts, progress=False, scrape_interval=None,
                  deadline_s=args.switch_seconds + 240)
    finally:
        server.stop()
    log_text = (log_dir / f"{label}.log").read_text()
    loads = [json.loads(line.split("switch steps ", 1)[1]) for line in log_text.splitlines()
             if f"model {target}: switch steps " in line]
    mine = [rec for rec in res.records if rec.model == target]
    theirs = [rec for rec in res.records if rec.model != target]
    windows = [(rec.sent_s, rec.token_times[0] if rec.token_times else rec.sent_s) for rec in mine]
    inside = lambda a, b, w: b > w[0] and a < w[1]  # noqa: E731
    outside = [b - a for r in theirs for a, b in zip(r.token_times, r.token_times[1:])
               if not any(inside(a, b, w) for w in windows)]
    out = {"target": target, "other": other, "env": env,
           "others_p99_gap_elsewhere_ms": 1e3 * float(np.percentile(outside, 99)) if outside else None,
           "others_p50_gap_elsewhere_ms": 1e3 * float(np.percentile(outside, 50)) if outside else None,
           "switches": []}
    for i, (rec, window) in enumerate(zip(mine, windows)):
        load = loads[i] if i < len(loads) else {"split": {}, "steps": []}
        split = load["split"]
        joined = rec.sent_s + split["joined"] if "joined" in split else window[1]
        loading, prompting = [], []
        for r in theirs:
            for a, b in zip(r.token_times, r.token_times[1:]):
                if inside(a, b, window):
                    (loading if a < joined else prompting).append(b - a)
        # at the server: the streaming model's decode steps around the switch, end to end
        ends = [s[2] for s in load["steps"] if s[0] == other and s[4] > 0]
        server_gaps = [(b - a) for a, b in zip(ends, ends[1:]) if b > 0 and a < split.get("first_token", 0)]
        out["switches"].append({
            "sent_s": round(rec.sent_s, 3), "error": rec.error,
            "ttft_s": (window[1] - rec.sent_s) if rec.token_times else None, "split_s": split,
            "others_max_gap_ms": 1e3 * max(loading + prompting, default=0.0),
            "others_max_gap_loading_ms": 1e3 * max(loading, default=0.0),
            "others_max_gap_first_prompt_ms": 1e3 * max(prompting, default=0.0),
            "others_gaps": len(loading) + len(prompting),
            "server_max_decode_gap_ms": 1e3 * max(server_gaps, default=0.0),
            # where the client's window ends later than the server's first token: the steps just after it
            "steps": load["steps"], "steps_after": load.get("after", [])})
    return out


def print_switches(key: str, result: dict) -> None:
    print(f"{key}: {result['target']} loaded beside {result['other']} streams; their gaps elsewhere p99 "
          f"{result['others_p99_gap_elsewhere_ms']} ms, p50 {result['others_p50_gap_elsewhere_ms']} ms", flush=True)
    for i, sw in enumerate(result["switches"]):
        split = sw["split_s"]
        print(f"  #{i} at {sw['sent_s']:.1f} s: first token {sw['ttft_s']} s ({sw['error']}); others' max gap "
              f"{sw['others_max_gap_ms']:.1f} ms (loading {sw['others_max_gap_loading_ms']:.1f} / first prompt "
              f"{sw['others_max_gap_first_prompt_ms']:.1f}, {sw['others_gaps']} gaps; server decode gap "
              f"{sw['server_max_decode_gap_ms']:.1f}); split {split}", flush=True)
        for mark, steps in (("", sw["steps"]), ("after ", sw.get("steps_after", []))):
            for m, a, b, cpu, d, p in steps:
                if b > -0.2:
                    print(f"    {mark:6s}{m:10s} {a:7.3f}-{b:7.3f} {1e3 * (b - a):6.1f} ms cpu {1e3 * cpu:6.1f} "
                          f"decode {d:3d} prompt {p:4d}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=0.5, help="total requests per second, split 50/50")
    p.add_argument("--seconds", type=float, default=60.0, help="arrivals span this long")
    p.add_argument("--switch-seconds", type=float, default=30.0)
    p.add_argument("--switches", type=int, default=4, help="switches per switch run (the model unloads in between)")
    # 1 s: an int4 stream of 64 tokens has often ended by then, so a float32 load found no int4 stream to stall
    p.add_argument("--switch-after", type=float, default=1.0,
                   help="seconds after one of the streaming model's arrivals that a switch's request comes")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=0.0,
                   help="seconds each server idles once up before its traffic starts (its KV prefault runs then)")
    p.add_argument("--step-logs", action="store_true",
                   help="keep the servers' dashboards and save each one-loop arm's step log (<arm>-steps.json)")
    p.add_argument("--out", default=None, help="folder for logs and results.json (default: a temp folder)")
    one_loop = ", ".join(ONE_LOOP_VARIANTS)
    switches = ", ".join("switch" + (f"-{k}" if k else "") for k in SWITCH_VARIANTS)
    p.add_argument("--only", default="alone,one-loop,two-processes,switch",
                   help=f"comma-separated parts: alone, alone-half (on half the threads), one-loop variants "
                        f"(ONE_LOOP_VARIANTS, run in the order given: {one_loop}), two-processes (prepare: load "
                        f"both once, so that a switch finds their runtime snapshots and step-time profiles cached); switch variants (SWITCH_VARIANTS), run in the "
                        f"order given: {switches}")
    args = p.parse_args()
    global SETTLE_S, STEP_LOGS
    SETTLE_S, STEP_LOGS = args.settle, args.step_logs
    out = Path(args.out or tempfile.mkdtemp(prefix="multi-model-"))
    out.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(","))

    spec = replace(load_workload("chat"), output_tokens=LengthDist("fixed", value=args.output_tokens),
                   prompt_tokens=LengthDist("lognormal", median=300, sigma=0.8, min=16, max=1000),
                   models=[ModelShare("smol-fp32", 0.5), ModelShare("smol-int4", 0.5)])
    requests = generate(spec, rate=args.rate, duration_s=args.seconds, seed=args.seed)
    source = PromptSource(load_tokenizer())
    results: dict = {"rate": args.rate, "seconds": args.seconds, "num_requests": len(requests),
                     "output_tokens": args.output_tokens, "threads": args.threads,
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    epoch = 0

    def prompts_for(reqs: list[RequestSpec]) -> list:
        nonlocal epoch
        epoch += 1
        return build_prompts(source, reqs, args.seed, as_text=False, epoch=epoch)

    if "prepare" in only:  # both models loaded at start-up once: their snapshots and step-time profiles cached
        Served(["--models-config", str(models_yaml(out / "prepare.yaml"))], args.threads, out, "prepare").stop()
    # each model alone, its own share of the traffic at the same times; alone-half: on half the threads, the share
    # of the cores a lane has (a second baseline, reported beside the target's, which is alone on all of them)
    for key, threads in (("alone", args.threads), ("alone-half", max(1, args.threads // 2))):
        if key not in only:
            continue
        results[key.replace("-", "_")] = {}
        for name, flags in MODELS.items():
            server = Served(flags + ["--served-model-name", name], threads, out, f"{key}-{name}")
            try:
                mine = [r for r in requests if r.model == name]
                results[key.replace("-", "_")][name] = drive(Endpoint(server.url), mine, prompts_for(mine),
                                                             args.seconds)[name]
            finally:
                server.stop()
            print(name, key, results[key.replace("-", "_")][name], flush=True)
    repeats: dict[str, int] = {}
    for key in [k for k in args.only.split(",") if k in ONE_LOOP_VARIANTS]:  # in the order given
        env = ONE_LOOP_VARIANTS[key]
        # an arm given twice keeps its own results, log and step log: one-loop, one-loop.2, ...
        repeats[key] = repeats.get(key, 0) + 1
        label = key if repeats[key] == 1 else f"{key}.{repeats[key]}"
        server = Served(["--models-config", str(models_yaml(out / "models.yaml"))], args.threads, out, label, env)
        try:
            result = results[label.replace("-", "_")] = drive(Endpoint(server.url), requests, prompts_for(requests),
                                                              args.seconds)
            if STEP_LOGS:  # every model's step records (GET /dashboard/steps), to explain a gap from the steps
                log = httpx.get(server.url + "/dashboard/steps", timeout=30).json()
                (out / f"{label}-steps.json").write_text(json.dumps(log))
                result["decode_steps"] = decode_steps_beside(log)
        finally:
            server.stop()
        print(key, result, flush=True)
    if "two-processes" in only:  # the anchor: one `paceline serve` per model, both on the same cores
        servers = {}
        try:
            for name, flags in MODELS.items():
                servers[name] = Served(flags + ["--served-model-name", name], args.threads, out, f"proc-{name}")
            urls = {name: s.url for name, s in servers.items()}
            results["two_processes"] = drive(Endpoint(urls["smol-fp32"], model_urls=urls), requests,
                                             prompts_for(requests), args.seconds)
        finally:
            for s in servers.values():
                s.stop()
        print("two processes", results["two_processes"], flush=True)
    for key in args.only.split(","):  # in the order given: an A/B alternates its arms
        variant = key.removeprefix("switch").removeprefix("-")
        if key.startswith("switch") and variant in SWITCH_VARIANTS:
            results[key] = switch_run(args, out, source, variant)
            print_switches(key, results[key])
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
