"""paceline against vLLM's CPU backend (and llama-server when built), back to back in one run, same HTTP client.

    flock -x /tmp/paceline-cpu.lock /work/main/.venv/bin/python benchmarks/vs_vllm.py

With vLLM's ~110 s start per server a whole run takes 7-10 min; to stay within 8-minute holds, run it in parts and
merge them (same system names, probes from each):

    flock -x /tmp/paceline-cpu.lock python benchmarks/vs_vllm.py --modes default --peers vllm-cpu-fp32 --no-chat --small-only --output-dir R/small
    flock -x /tmp/paceline-cpu.lock python benchmarks/vs_vllm.py --modes default --peers vllm-cpu-fp32 --no-chat --defaults-only --output-dir R/defaults
    flock -x /tmp/paceline-cpu.lock python benchmarks/vs_vllm.py --modes default --peers vllm-cpu-fp32 --chat-only --output-dir R/chat
    python benchmarks/vs_vllm.py --merge R/small/vs_vllm.json R/defaults/vs_vllm.json R/chat/vs_vllm.json

The probes of issue 13, each system at its defaults unless a probe says otherwise:
  (a) 32 concurrent streams, 100-token prompts, 64 tokens out: generated tok/s (median of 3 bursts since 2026-11-24
      22:30 UTC, every burst in gen_tok_s_runs; one burst before)
  (b) the same with a token budget of 64 (--max-num-batched-tokens 64 on both)
  (c) one stream, 256 tokens out: decode tok/s (tokens after the first / time after the first)
  (d) a lone 1,500-token prompt, 1 token out: TTFT, and prefill tok/s = 1,500 / TTFT (median of 3)
  (e) stall probe, budget 64 on both: 6 streams decoding, then a 1,500-token prompt arrives: the largest gap
      between two tokens of the 6 streams
  (f) start-up to first answer: from starting the process to the first completed request, caches warm (every
      system is started once with budget 64 before the timed start at its defaults)
  chat: `paceline bench serve --workload chat --rate 0.5 --duration 90 --seed 7 --tbt-slo 190` against each system
      at its defaults (only the paceline default mode and vLLM, unless --chat-all)

paceline runs in each numeric mode asked (--modes): fp32, bf16, int4 and `default` (no dtype flags: what
`paceline serve` does out of the box). Every prompt is fresh token ids from the corpus, never repeated within a
server's life, so no prefix cache helps. Prints one markdown table; writes JSON under benchmarks/results/.
Timings are absolute figures from a shared 2-core machine: only ratios from one run mean anything.
"""
from __future__ import annotations

import argparse
import gc
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paceline.bench.client import Endpoint, run  # noqa: E402
from paceline.bench.metrics import summarize  # noqa: E402
from paceline.bench.peers import (Server, System, llama_server_system, paceline_system,  # noqa: E402
                                  vllm_cpu_system)
from paceline.bench.prompts import PromptSource, bundled_gguf, load_tokenizer  # noqa: E402
from paceline.bench.server_metrics import diff, histogram, histogram_quantile, parse_prometheus  # noqa: E402
from paceline.bench.workload import RequestSpec  # noqa: E402

MODES = {"fp32": ["--dtype", "float32", "--quantization", "none"],
         "bf16": ["--dtype", "bfloat16", "--quantization", "none"],
         "int4": ["--quantization", "int4"],
         "default": [],
         "w4a8": [],  # the int4 x int8 op on every layer linear (the default since 2026-11-24)
         "int4-op": [],  # the default without it: the int4 op and the float32 copy (the default before)
         "fp32-onednn": ["--dtype", "float32", "--quantization", "none"]}  # fp32 without the few-row op
MODE_ENV = {"w4a8": {"PACELINE_W4A8_LINEARS": "all"}, "int4-op": {"PACELINE_W4A8_LINEARS": ""},
            "fp32-onednn": {"PACELINE_F32_ROWS": "0"}}
QUEUE_TIMES = ("paceline:request_queue_time_seconds", "vllm:request_queue_time_seconds")
CHAT_ARGS = ["--workload", "chat", "--rate", "0.5", "--duration", "90", "--seed", "7", "--tbt-slo", "190"]
SMALL_BUDGET = 64
LONG_PROMPT = 1500
THROUGHPUT_REPEATS = 3  # the 32-stream burst, median of this many (probe_throughput)


class Prompts:
    """Fresh corpus token ids for every request: a new random offset each time, so no two prompts share a prefix
    (beyond chance) and no server's prefix cache helps."""

    def __init__(self, source: PromptSource, seed: int):
        self.source = source
        self.rng = np.random.default_rng(seed)

    def __call__(self, n: int) -> list[int]:
        return self.source.token_ids(n, self.rng)


def run_requests(ep: Endpoint, specs: list[RequestSpec], prompts: list[list[int]]):
    res = run(ep, specs, prompts, progress=False, scrape_interval=None)
    bad = [r.error for r in res.records if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(specs)} requests failed: {bad[0]}")
    return res


def probe_throughput(ep: Endpoint, prompts: Prompts, repeats: int = 1) -> dict:
    """32 streams at once; with repeats > 1 the run of median tok/s, every run's figure in gen_tok_s_runs. Why
    repeats: one burst lasts ~4-9 s, and on this shared host one burst's figure moved 333-396 tok/s for the same
    server between side-by-side runs (2026-11-24); the median of three, taken the same way for every system, is
    steadier than any one burst."""
    runs = []
    for _ in range(repeats):
        specs = [RequestSpec(i, 0.0, 100, 64) for i in range(32)]
        res = run_requests(ep, specs, [prompts(100) for _ in specs])
        s = summarize(res.records)
        runs.append({"gen_tok_s": s["output_throughput"], "tokens": s["total_output_tokens"], "span_s": s["duration_s"],
                     "tbt_p99_s": s["tbt"]["p99"] if s["tbt"] else None})
    out = sorted(runs, key=lambda r: r["gen_tok_s"])[(len(runs) - 1) // 2]
    return {**out, "gen_tok_s_runs": [r["gen_tok_s"] for r in runs]} if repeats > 1 else out


def probe_decode(ep: Endpoint, prompts: Prompts) -> dict:
    res = run_requests(ep, [RequestSpec(0, 0.0, 32, 256)], [prompts(32)])
    t = res.records[0].token_times
    # a chunk may carry several tokens at one timestamp; tokens after the first over the time after the first
    return {"decode_tok_s": (len(t) - 1) / (t[-1] - t[0]), "tokens": len(t)}


def probe_prefill(ep: Endpoint, prompts: Prompts, repeats: int = 3) -> dict:
    ttfts = []
    for _ in range(repeats):
        res = run_requests(ep, [RequestSpec(0, 0.0, LONG_PROMPT, 1)], [prompts(LONG_PROMPT)])
        ttfts.append(res.records[0].ttft)
    ttft = statistics.median(ttfts)
    return {"ttft_s": ttft, "prefill_tok_s": LONG_PROMPT / ttft, "ttfts_s": ttfts}


class GcWatch:
    """This (the client's) process's garbage collections while a probe runs, on the monotonic clock: a full
    collection stops the client's event loop, and every token read after it starts looks late. The client holds
    ~180,000 tracked objects (httpx, numpy, the tokenizer), whose full collection took 153 ms (2026-11-24 05:49 UTC,
    one `flock -s` run of gc.collect(2) after the imports and the tokenizer's load)."""

    def __init__(self) -> None:
        self.spans: list[tuple[float, float, int]] = []  # (start, end, generation)
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.spans.append((self._start, time.perf_counter(), info.get("generation", -1)))

    def __enter__(self) -> "GcWatch":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def within(self, a: float, b: float, min_ms: float = 1.0) -> list[list[float]]:
        """Collections of at least min_ms overlapping [a, b]: [start, end, generation] each."""
        return [[s, e, g] for s, e, g in self.spans if s <= b and e >= a and (e - s) * 1e3 >= min_ms]


def probe_stall(ep: Endpoint, prompts: Prompts, arrive_s: float = 1.5) -> dict:
    """6 streams start together; the long prompt arrives once they decode. The largest gap of the 6 after it."""
    specs = [RequestSpec(i, 0.0, 100, 160) for i in range(6)] + [RequestSpec(6, arrive_s, LONG_PROMPT, 1)]
    with GcWatch() as watch:
        res = run_requests(ep, specs, [prompts(s.prompt_tokens) for s in specs])
    streams, long = res.records[:6], res.records[6]
    gaps_after = [t1 - t0 for r in streams for t0, t1 in zip(r.token_times, r.token_times[1:]) if t1 >= long.sent_s]
    still = all(r.token_times[-1] >= long.token_times[0] for r in streams)  # did the streams outlast the prefill?
    # where the largest gap lies on the machine's monotonic clock (perf_counter is CLOCK_MONOTONIC on Linux, as a
    # server's time.monotonic()), so a server's step log can be laid beside it (stall_steps below)
    t0 = res.started_at - (time.time() - time.perf_counter())
    window = max(((t1 - t0_, t0 + t0_, t0 + t1, i) for i, r in enumerate(streams)
                  for t0_, t1 in zip(r.token_times, r.token_times[1:]) if t1 >= long.sent_s), default=None)
    out = {"max_gap_s": max(gaps_after) if gaps_after else None,
           "max_gap_any_s": max(g for r in streams for g in r.gaps),
           "long_ttft_s": long.ttft, "streams_outlasted_prefill": still,
           "max_gap_at": list(window[1:3]) if window else None, "long_sent_at": t0 + long.sent_s,
           "long_first_token_at": t0 + long.token_times[0] if long.token_times else None}
    if window:
        # every stream's token times from 0.3 s before the gap to 0.1 s after it, in ms from the gap's start: whether
        # the others saw the same gap (a step) or not (one stream's delivery)
        a, b = window[1:3]
        out["max_gap_stream"] = window[3]
        # the client's own collections in the gap: a pause of the reader, not of the server (ms from the gap's start)
        out["client_gc_in_gap_ms"] = [[round(1e3 * (s - a), 1), round(1e3 * (e - a), 1), g] for s, e, g in watch.within(a, b)]
        out["tokens_near_gap_ms"] = [[round(1e3 * (t0 + t - a), 1) for t in r.token_times if a - 0.3 <= t0 + t <= b + 0.1]
                                     for r in streams]
    # every collection of 5 ms or more during the probe: [start in s after the long prompt was sent, ms, generation]
    sent = t0 + long.sent_s
    out["client_gc_pauses"] = [[round(s - sent, 3), round(1e3 * (e - s), 1), g] for s, e, g in watch.spans
                               if (e - s) * 1e3 >= 5]
    return out


# ---- the paceline server's step log (GET /dashboard/steps, the dashboard's ring buffer), laid beside a probe ----

def server_steps(url: str) -> dict | None:
    """The first model's step log: {"info", "num_steps", "steps"}; None for a server without one (vLLM, llama)."""
    try:
        r = httpx.get(url + "/dashboard/steps", timeout=30.0)
        return r.json()["models"][0] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def steps_since(url: str, n0: int) -> list[dict]:
    log = server_steps(url)
    return [s for s in log["steps"] if s["seq"] > n0] if log else []


def num_steps(url: str) -> int | None:
    log = server_steps(url)
    return log["num_steps"] if log else None


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


def step_row(s: dict, origin: float) -> dict:
    """One step record for a report: its end in ms from `origin`, measured / predicted ms, composition, context."""
    return {"end_ms": round(1e3 * (s["t"] - origin), 1), "dur_ms": round(1e3 * s["dur"], 1),
            "pred_ms": round(1e3 * s["pred"], 1), "decode": s["decode"], "prefill": s["prefill"],
            "ctx": s.get("ctx", 0), "dctx": s.get("dctx", 0), "target_ms": s.get("target", 0.0),
            "scale": round(s.get("scale", 0.0), 3), "running": s["running"], "waiting": s["waiting"]}


def steps_around(steps: list[dict], stall: dict) -> dict:
    """The steps the stall probe's largest gap spans (its ends on the monotonic clock the step log also uses), and
    the longest interval between two decode-carrying steps' ends after the long prompt arrived: the gap as the
    engine made it. The client's gap less that interval is what HTTP, the client and the GIL added."""
    at, sent = stall.get("max_gap_at"), stall.get("long_sent_at")
    if not at or sent is None:
        return {}
    a, b = at
    # "t" is stamped after the step's update and metrics; a step ran from about t - dur. The step before the gap
    # (which delivered its first token) and the one after it come along
    inside = [s for s in steps if s["t"] >= a - 0.15 and s["t"] - s["dur"] <= b + 0.02]
    dec = [s for s in steps if s["decode"] and s["t"] >= sent]
    intervals = [(b_["t"] - a_["t"], a_, b_) for a_, b_ in zip(dec, dec[1:])]
    prefill = [s for s in steps if s["prefill"] and sent <= s["t"] <= (stall.get("long_first_token_at") or 1e18)]
    out = {"gap_ms": round(1e3 * (b - a), 1), "gap_start_after_long_sent_ms": round(1e3 * (a - sent), 1),
           "steps_in_gap": [step_row(s, a) for s in inside],
           # the steps that carried the long prompt's chunks: how deep each was and how well it was predicted
           "long_prefill_steps": [step_row(s, sent) for s in prefill]}
    if stall.get("long_first_token_at") is not None:
        out["gap_start_before_long_first_token_ms"] = round(1e3 * (stall["long_first_token_at"] - a), 1)
    if intervals:
        iv, s0, s1 = max(intervals, key=lambda x: x[0])
        out.update(engine_interval_max_ms=round(1e3 * iv, 1), engine_interval_step_dur_ms=round(1e3 * s1["dur"], 1),
                   engine_interval_step=(s1["decode"], s1["prefill"]),
                   engine_interval_at_after_long_sent_ms=round(1e3 * (s0["t"] - sent), 1))
    return out


def explain_gap(stall: dict, gap: dict) -> str:
    """Where the stall probe's largest gap lies: the client's token times beside the server's steps."""
    if not gap:
        return "  (no step log: not a paceline server, or the gap was not found)"
    lines = [f"  largest gap {gap['gap_ms']:.0f} ms (stream {stall.get('max_gap_stream')}), "
             f"{gap['gap_start_after_long_sent_ms'] / 1e3:.2f} s after the long prompt was sent"
             + (f", {gap['gap_start_before_long_first_token_ms'] / 1e3:.2f} s before its first token"
                if "gap_start_before_long_first_token_ms" in gap else "")
             + f"; the engine's longest interval between decode steps: {fmt(gap.get('engine_interval_max_ms'), '.1f')} ms",
             "  steps around it (end ms from the gap's start; measured / predicted ms; decodes + prompt tokens; "
             "prompt context; decode context; target ms; scale):"]
    for r in gap["steps_in_gap"]:
        lines.append(f"    {r['end_ms']:+8.1f}  {r['dur_ms']:6.1f} / {r['pred_ms']:6.1f}  {r['decode']:2d} + {r['prefill']:3d}"
                     f"  ctx {r['ctx']:5d}  dctx {r['dctx']:5d}  target {r['target_ms']:5.1f}  scale {r['scale']:.3f}")
    chunks = gap.get("long_prefill_steps") or []
    if chunks:
        lines.append("  the long prompt's mixed steps by the depth their chunk ends at (count; median measured / predicted "
                     "ms, measured over predicted, prompt tokens; the longest):")
        for lo in range(0, LONG_PROMPT, 500):
            part = [r for r in chunks if r["decode"] and lo < r["ctx"] <= lo + 500]
            if part:
                ratio = [r["dur_ms"] / r["pred_ms"] for r in part if r["pred_ms"]]
                lines.append(f"    ctx {lo:4d}-{lo + 500:4d}: {len(part):3d} steps, {pct([r['dur_ms'] for r in part], 0.5):5.1f} / "
                             f"{pct([r['pred_ms'] for r in part], 0.5):5.1f} ms, x{pct(ratio, 0.5):.2f}, "
                             f"{pct([r['prefill'] for r in part], 0.5):3.0f} tokens; longest "
                             f"{max(r['dur_ms'] for r in part):.1f} ms")
    lines.append(f"  the client's own garbage collections in the gap (start / end ms, generation): "
                 f"{stall.get('client_gc_in_gap_ms') or 'none'}; of 5 ms or more during the probe (s after the long "
                 f"prompt was sent, ms, generation): {stall.get('client_gc_pauses') or 'none'}")
    lines.append("  client token times near it, ms from the gap's start, per stream:")
    for i, ts in enumerate(stall.get("tokens_near_gap_ms") or []):
        lines.append(f"    s{i}: " + " ".join(f"{t:+.0f}" for t in ts))
    return "\n".join(lines)


def stall_with_steps(ep: Endpoint, url: str, prompts: Prompts) -> tuple[dict, dict]:
    """The stall probe, and for a paceline server its step log read back around the largest gap (printed)."""
    n0 = num_steps(url)
    stall = probe_stall(ep, prompts)
    if n0 is None:
        return stall, {}
    log = server_steps(url) or {}
    steps = [s for s in log.get("steps", []) if s["seq"] > n0]
    target = (log.get("info") or {}).get("max_step_ms")
    extra = {"stall_steps": analyse(steps, target), "stall_gap": steps_around(steps, stall),
             "stall_longest_steps": sorted(steps, key=lambda s: -s["dur"])[:5], "stall_step_log": steps}
    print(explain_gap(stall, extra["stall_gap"]), flush=True)
    return stall, extra


def scrape(url: str) -> dict[str, float] | None:
    try:
        r = httpx.get(url + "/metrics", timeout=10.0)
        return parse_prometheus(r.text) if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def queue_time(before: dict | None, after: dict | None) -> dict | None:
    """Scheduling delay (p50/p99/mean) from whichever queue-time histogram the server exports."""
    if before is None or after is None:
        return None
    d = diff(after, before)
    for name in QUEUE_TIMES:
        buckets, count = histogram(d, name), d.get(f"{name}_count", 0.0)
        if buckets and count > 0:
            return {"metric": name, "p50_s": histogram_quantile(buckets, 0.5), "p99_s": histogram_quantile(buckets, 0.99),
                    "mean_s": d.get(f"{name}_sum", 0.0) / count, "count": int(count)}
    return None


def probe_chat(url: str, label: str, out_dir: Path, send_priority: bool) -> dict:
    """The issue's chat command, as a user types it, against the running server; its JSON summary."""
    out = out_dir / f"chat-{label}"
    argv = [sys.executable, "-m", "paceline.bench.cli", "serve", "--url", url, "--label", label, *CHAT_ARGS,
            "--output-dir", str(out), "--no-progress", "--no-plots"]
    if not send_priority:
        argv.append("--no-priority")
    before = scrape(url)
    subprocess.run(argv, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    s = json.loads((out / "results.json").read_text())["runs"][0]["summary"]
    return {"ttft_p50_s": s["ttft"]["p50"], "ttft_p99_s": s["ttft"]["p99"], "tbt_p99_s": s["tbt"]["p99"],
            "tbt_max_s": s["tbt"]["max"], "stalls": s["stalls"]["count"], "goodput": s["goodput"],
            "completed": s["completed"], "num_requests": s["num_requests"],
            "scheduling_delay": queue_time(before, scrape(url)), "command": "paceline bench serve " + " ".join(CHAT_ARGS)}


def this_checkout(system: System) -> System:
    """Run the paceline of this checkout: the venv's `paceline` script imports whichever copy is installed."""
    i = system.argv.index("--log-level")
    system.argv[:i] = [sys.executable, "-m", "paceline.entrypoints.cli"]
    system.env = {**system.env, "PYTHONPATH": str(ROOT)}
    return system


def start(system: System, log: Path) -> tuple[Server, float]:
    """Start it and send one short request; seconds from launch to that answer."""
    t0 = time.perf_counter()
    srv = Server(system, log).__enter__()
    try:
        ep = system.endpoint(srv.url)
        run_requests(ep, [RequestSpec(0, 0.0, 8, 2)], [[1, 2, 3, 4, 5, 6, 7, 8]])
    except BaseException:
        srv.stop()
        raise
    return srv, time.perf_counter() - t0


def measure(name: str, small: System | None, default: System | None, prompts: Prompts, out_dir: Path, chat: bool,
            chat_only: bool = False) -> dict:
    """small None (--defaults-only): skip the budget-64 server, its probes (b) and (e), and the warming start.
    default None (--small-only): only the budget-64 server and its probes.
    chat_only: the default server and the chat probe alone (a second, shorter exclusive hold)."""
    row: dict = {"system": name}
    if chat_only:
        print(f"[{name}] defaults, chat only: {' '.join(default.argv)}", flush=True)
        # its own key: merged after a --defaults-only run, this start must not replace the one measured there
        srv, row["startup_chat_s"] = start(default, out_dir / f"{name}-default.log")
        try:
            row["chat"] = probe_chat(srv.url, name, out_dir, default.send_priority)
        finally:
            srv.stop()
        print(f"[{name}] {json.dumps(row, default=float)}", flush=True)
        return row
    if small is not None:
        print(f"[{name}] budget {SMALL_BUDGET}: {' '.join(small.argv)}", flush=True)
        srv, row["startup_small_s"] = start(small, out_dir / f"{name}-small.log")  # also warms compile caches
        try:
            ep = small.endpoint(srv.url)
            n0 = num_steps(srv.url)
            row["throughput_small"] = probe_throughput(ep, prompts)
            if n0 is not None:
                target = ((server_steps(srv.url) or {}).get("info") or {}).get("max_step_ms")
                row["throughput_small_steps"] = analyse(steps_since(srv.url, n0), target)
            row["stall"], extra = stall_with_steps(ep, srv.url, prompts)
            row.update(extra)
        finally:
            srv.stop()
    if default is None:
        print(f"[{name}] {json.dumps(brief(row), default=float)}", flush=True)
        return row
    print(f"[{name}] defaults: {' '.join(default.argv)}", flush=True)
    srv, row["startup_s"] = start(default, out_dir / f"{name}-default.log")
    try:
        ep = default.endpoint(srv.url)
        row["throughput"] = probe_throughput(ep, prompts, repeats=THROUGHPUT_REPEATS)
        row["decode"] = probe_decode(ep, prompts)
        row["prefill"] = probe_prefill(ep, prompts)
        if chat:
            try:
                row["chat"] = probe_chat(srv.url, name, out_dir, default.send_priority)
            except (subprocess.CalledProcessError, OSError, KeyError, ValueError, TypeError) as e:
                row["chat_error"] = str(e)[:200]  # the other probes' numbers stand
                print(f"[{name}] chat probe failed: {e}", flush=True)
    finally:
        srv.stop()
    print(f"[{name}] {json.dumps(brief(row), default=float)}", flush=True)
    return row


def brief(row: dict) -> dict:
    """A row as printed: without the step records (they stay in the JSON file)."""
    return {k: v for k, v in row.items() if k not in ("stall_step_log", "stall_gap", "stall_longest_steps")
            and not k.endswith("_step_log")}


def fmt(x, spec: str = ".0f", scale: float = 1.0) -> str:
    return "–" if x is None else format(x * scale, spec)


def table(rows: list[dict]) -> str:
    names = [r["system"] for r in rows]
    get = lambda r, *keys: _dig(r, keys)  # noqa: E731
    lines = ["| probe | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    spec = [
        ("32 streams x 64 tokens, defaults: generated tok/s", ("throughput", "gen_tok_s"), ".0f", 1),
        (f"same, budget {SMALL_BUDGET}: generated tok/s", ("throughput_small", "gen_tok_s"), ".0f", 1),
        ("one stream, 256 tokens: decode tok/s", ("decode", "decode_tok_s"), ".1f", 1),
        (f"lone {LONG_PROMPT:,}-token prompt: TTFT (ms)", ("prefill", "ttft_s"), ".0f", 1e3),
        (f"lone {LONG_PROMPT:,}-token prompt: prefill tok/s", ("prefill", "prefill_tok_s"), ".0f", 1),
        (f"6 streams + {LONG_PROMPT:,}-token prompt, budget {SMALL_BUDGET}: largest gap (ms)", ("stall", "max_gap_s"), ".0f", 1e3),
        ("start-up to first answer, warm (s)", ("startup_s",), ".1f", 1),
        ("chat 0.5 req/s: TTFT p50 (ms)", ("chat", "ttft_p50_s"), ".0f", 1e3),
        ("chat: TTFT p99 (ms)", ("chat", "ttft_p99_s"), ".0f", 1e3),
        ("chat: TBT p99 (ms)", ("chat", "tbt_p99_s"), ".0f", 1e3),
        ("chat: TBT max (ms)", ("chat", "tbt_max_s"), ".0f", 1e3),
        ("chat: stalls", ("chat", "stalls"), ".0f", 1),
        ("chat: goodput, TBT 190 ms (req/s)", ("chat", "goodput"), ".2f", 1),
        ("chat: scheduling delay p50 / p99 (ms)", None, "", 1),
    ]
    for label, keys, f, scale in spec:
        if keys is None:
            cells = [(f"{fmt(d['p50_s'], '.0f', 1e3)} / {fmt(d['p99_s'], '.0f', 1e3)}"
                      if (d := get(r, "chat", "scheduling_delay")) else "–") for r in rows]
        else:
            cells = [r["skipped"] if "skipped" in r else fmt(get(r, *keys), f, scale) for r in rows]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _dig(d, keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def targets(rows: list[dict], mode: str = "default") -> list[str]:
    """The issue's targets, judged on paceline's `mode` row against the best vLLM configuration for each probe
    (every vLLM row at its defaults: bf16, and fp32 where asked)."""
    p = next((r for r in rows if r["system"] == f"paceline-{mode}" and "skipped" not in r), None)
    vs = [r for r in rows if r["system"].startswith("vllm-cpu") and "skipped" not in r]
    if p is None or not vs:
        return ["targets not judged: paceline's default or every vLLM configuration did not run"]
    out = []

    def check(text: str, ok: bool | None) -> None:
        out.append(f"- {'holds' if ok else 'does not hold' if ok is not None else 'not measured'}: {text}")

    def ratio(keys: tuple, higher: bool) -> tuple[float, float, str] | None:
        """paceline's value, the best vLLM value and which vLLM row; None where either was not measured."""
        a = _dig(p, keys)
        vals = [(v, r["system"]) for r in vs if (v := _dig(r, keys)) is not None]
        if a is None or not vals:
            return None
        b, who = max(vals) if higher else min(vals)
        return a, b, who

    if (t := ratio(("throughput", "gen_tok_s"), True)) is None:
        check("32 streams at defaults >= 1.3x vLLM", None)
    else:
        a, b, who = t
        check(f"32 streams at defaults >= 1.3x vLLM ({who}): {a:.0f} vs {b:.0f} tok/s = {a / b:.2f}x", a / b >= 1.3)
    if (t := ratio(("prefill", "ttft_s"), False)) is None:
        check("lone 1,500-token TTFT <= 0.8x vLLM", None)
    else:
        a, b, who = t
        check(f"lone 1,500-token TTFT <= 0.8x vLLM ({who}): {a * 1e3:.0f} vs {b * 1e3:.0f} ms = {a / b:.2f}x",
              a / b <= 0.8)
    if (t := ratio(("stall", "max_gap_s"), False)) is None:
        check("stall probe (not run: --defaults-only or --chat-only)", None)
    else:
        a, b, who = t
        check(f"stall probe gap <= vLLM's ({who}) and <= 0.10 s: {a * 1e3:.0f} vs {b * 1e3:.0f} ms = {a / b:.2f}x",
              a <= b and a <= 0.10)
    if (t := ratio(("decode", "decode_tok_s"), True)) is None:
        check("one stream decode >= 2x vLLM", None)
    else:
        a, b, who = t
        check(f"one stream decode >= 2x vLLM ({who}): {a:.1f} vs {b:.1f} tok/s = {a / b:.2f}x", a / b >= 2.0)
    pc = p.get("chat")
    chats = [(r["chat"], r["system"]) for r in vs if r.get("chat")]
    if pc and chats:
        (tbt, who1), (ttft, who2) = min((c["tbt_p99_s"], w) for c, w in chats), min((c["ttft_p50_s"], w) for c, w in chats)
        r1, r2 = pc["tbt_p99_s"] / tbt, pc["ttft_p50_s"] / ttft
        check(f"chat p99 TBT <= 0.6x vLLM ({who1}): {pc['tbt_p99_s'] * 1e3:.0f} vs {tbt * 1e3:.0f} ms = {r1:.2f}x",
              r1 <= 0.6)
        check(f"chat p50 TTFT <= vLLM's ({who2}): {pc['ttft_p50_s'] * 1e3:.0f} vs {ttft * 1e3:.0f} ms = {r2:.2f}x",
              r2 <= 1.0)
    else:
        check("chat probe", None)
    if p.get("startup_s") is None:
        check("start-up to first answer <= 10 s (warm)", None)  # --chat-only or --small-only
    else:
        check(f"start-up to first answer <= 10 s (warm): {p['startup_s']:.1f} s", p["startup_s"] <= 10.0)
    check("capacity under the strict SLO on chat and long-prompt >= 1.3x the best vLLM configuration "
          "(benchmarks/compare.py, not this script)", None)
    return out


def merge_rows(runs: list[list[dict]]) -> list[dict]:
    """One row per system from several runs' rows, in first-seen order; a later run's probes add to (and, where
    both measured one, replace) an earlier run's. A row that failed or was skipped adds nothing."""
    merged: dict[str, dict] = {}
    for rows in runs:
        for r in rows:
            if "skipped" in r and r["system"] in merged:
                continue
            base = merged.setdefault(r["system"], {"system": r["system"]})
            if "skipped" in r:
                base.setdefault("skipped", r["skipped"])
                continue
            base.pop("skipped", None)
            base.update({k: v for k, v in r.items() if k != "system"})
    return list(merged.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="fp32,bf16,int4,default",
                    help=f"paceline modes: {', '.join(MODES)} (default is int4 where auto picks int4: drop one)")
    ap.add_argument("--peers", default="vllm-cpu,vllm-cpu-fp32,llama-server",
                    help="vllm-cpu (bf16), vllm-cpu-fp32, llama-server")
    ap.add_argument("--no-chat", action="store_true", help="skip the 90 s chat probe")
    ap.add_argument("--chat-all", action="store_true", help="the chat probe for every paceline mode and llama-server too")
    ap.add_argument("--defaults-only", action="store_true",
                    help="only each system at its defaults (probes a, c, d, f): no budget-64 server, so no (b) and "
                         "no stall probe (e); start-up is warm only if the system was started before (~half the time)")
    ap.add_argument("--chat-only", action="store_true",
                    help="only the chat probe, each system at its defaults (paceline's default mode and vLLM): the "
                         "rest of the run in one exclusive hold, this in a second")
    ap.add_argument("--small-only", action="store_true",
                    help="only the budget-64 servers (probes b and e): with --defaults-only in another exclusive hold, "
                         "the whole run in two holds of ~4 min instead of one of 7-10")
    ap.add_argument("--merge", nargs="+", metavar="VS_VLLM_JSON", default=None,
                    help="measure nothing: merge the rows of earlier runs' vs_vllm.json (same system, probes from "
                         "each) and print the table and the targets")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads each server may use")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's temperature (default greedy; 1.0: the OpenAI API's default, sampled)")
    ap.add_argument("--output-dir", default=None, help="default benchmarks/results/vs_vllm-<time>")
    args = ap.parse_args()
    # killed (a timeout, Ctrl-C in another shell): unwind, so every server started so far is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.merge:
        rows = merge_rows([json.loads(Path(f).read_text())["rows"] for f in args.merge])
        print(table(rows) + "\n\n" + "\n".join(targets(rows)))
        return 0
    model = bundled_gguf()
    out_dir = Path(args.output_dir or ROOT / "benchmarks" / "results" / f"vs_vllm-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = Prompts(PromptSource(load_tokenizer(model)), args.seed)

    plan: list[tuple[str, System, System, bool]] = []
    for mode in [m for m in args.modes.split(",") if m]:
        extra = MODES[mode]
        small = this_checkout(paceline_system("sarathi", SMALL_BUDGET, model, args.threads, extra=extra))
        # paceline's defaults: no scheduler flags at all, so config.py decides (budget, step-time target)
        default = this_checkout(paceline_system("sarathi", 0, model, args.threads, extra=extra))
        for system in (small, default):
            system.env = {**system.env, **MODE_ENV.get(mode, {})}
        i = default.argv.index("--scheduler")
        assert default.argv[i:i + 4] == ["--scheduler", "sarathi", "--max-num-batched-tokens", "0"]
        del default.argv[i:i + 4]
        wants_chat = not args.no_chat and (args.chat_all or mode == "default")
        if wants_chat or not args.chat_only:
            plan.append((f"paceline-{mode}", small, default, wants_chat))
    for peer in [p for p in args.peers.split(",") if p]:
        if peer in ("vllm-cpu", "vllm-cpu-fp32"):
            dtype = "float32" if peer.endswith("fp32") else "bfloat16"
            plan.append((peer, vllm_cpu_system(model, SMALL_BUDGET, threads=args.threads, dtype=dtype),
                         vllm_cpu_system(model, threads=args.threads, dtype=dtype), not args.no_chat))
        elif peer == "llama-server":
            # its defaults: -np 32 slots (so 32 streams run at once), its default -b/-ub 2048 budget
            ctx = 2048
            plan.append(("llama-server", llama_server_system(32, SMALL_BUDGET, model, ctx, args.threads),
                         llama_server_system(32, 2048, model, ctx, args.threads), not args.no_chat and args.chat_all))
        else:
            raise SystemExit(f"unknown peer {peer!r}")

    for _, small, default, _ in plan:
        for system in (small, default):
            system.endpoint_options = {**system.endpoint_options, "temperature": args.temperature}
    rows = []
    for name, small, default, chat in plan:
        if default.skip:
            rows.append({"system": name, "skipped": f"skipped: {default.skip}"})
            print(f"[{name}] skipped: {default.skip}", flush=True)
            continue
        try:
            if args.chat_only and not chat:
                continue
            rows.append(measure(name, None if args.defaults_only else small, None if args.small_only else default,
                                prompts, out_dir, chat and not args.small_only, chat_only=args.chat_only))
        except Exception as e:  # one system failing must not lose the others' numbers
            print(f"[{name}] failed: {e}", flush=True)
            rows.append({"system": name, "skipped": f"failed: {str(e)[:80]}", "error": str(e)})
        (out_dir / "vs_vllm.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1,
                                                         default=float))
    md = table(rows) + "\n\n" + "\n".join(targets(rows))
    (out_dir / "vs_vllm.md").write_text(md + "\n")
    print("\n" + md)
    print(f"\nwrote {out_dir}/vs_vllm.json and vs_vllm.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
