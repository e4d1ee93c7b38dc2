"""Reports: one JSON with every sample, a markdown table, and (via plots.py) PNGs.

A *run* is one workload at one rate against one system; its dict (see `run_dict`) holds the summary and every
request's timeline, so any metric can be recomputed from the JSON alone.
"""
from __future__ import annotations

import json
import platform
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from paceline.bench.metrics import RunResult, summarize
from paceline.bench.server_metrics import preemption_counts, speculation, step_composition


def run_dict(system: str, workload: str, rate: float | None, result: RunResult, *, ttft_slo: float | None = None,
             tbt_slo: float | None = None, stall_threshold_s: float | None = None, extra: dict | None = None) -> dict:
    summary = summarize(result.records, ttft_slo=ttft_slo, tbt_slo=tbt_slo, stall_threshold_s=stall_threshold_s)
    summary["scheduling_delay"] = result.scheduling_delay
    snaps = result.metric_snapshots
    summary["speculation"] = speculation(snaps[0][1], snaps[-1][1]) if len(snaps) >= 2 else None
    counts = preemption_counts(result.metric_snapshots)
    if counts:  # per second of the run, as the server counted them (a simulator passes its own in `extra`)
        summary["preemptions"] = {**counts, "per_s": counts.get("preemptions", 0.0) / max(summary["duration_s"], 1e-9)}
    return {
        "system": system,
        "workload": workload,
        "rate": rate,
        "started_at": result.started_at,
        "summary": summary,
        "step_composition": step_composition(result.metric_snapshots),
        "requests": [asdict(r) for r in result.records],
        **(extra or {}),
    }


def output_dir(arg: str | None, workload: str) -> Path:
    """--output-dir, or bench-results/<workload>-<time>."""
    return Path(arg) if arg else Path("bench-results") / f"{Path(workload).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def environment() -> dict:
    """Where and from what the numbers came."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                                  cwd=Path(__file__).parent).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            return None
    cpu = None
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), None)
    except OSError:
        pass
    import os
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "-uno")),
            "machine": platform.machine(), "cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version()}


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=float))


def _ms(x: float | None) -> str:
    return "–" if x is None else (f"{x * 1e3:.0f}" if x * 1e3 >= 10 else f"{x * 1e3:.1f}")


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _get(d: dict | None, key: str) -> float | None:
    return None if d is None else d.get(key)


TABLE_HEADER = ["system", "rate (req/s)", "done", "req/s", "out tok/s", "TTFT p50 (ms)", "TTFT p99", "TBT p50",
                "TBT p99", "TBT max", "TPOT p50", "e2e p50 (s)", "sched p50 (ms)", "stalls (n / s)", "goodput (req/s)"]


def table_row(run: dict) -> list[str]:
    s = run["summary"]
    if run.get("skipped"):
        return [run["system"], "–", f"skipped: {run['skipped']}"] + [""] * (len(TABLE_HEADER) - 3)
    return [
        run["system"],
        _num(run.get("rate")) if run.get("rate") is not None else "max",
        f"{s['completed']}/{s['num_requests']}",
        _num(s["request_throughput"]),
        _num(s["output_throughput"], ".1f"),
        _ms(_get(s["ttft"], "p50")), _ms(_get(s["ttft"], "p99")),
        _ms(_get(s["tbt"], "p50")), _ms(_get(s["tbt"], "p99")), _ms(_get(s["tbt"], "max")),
        _ms(_get(s["tpot"], "p50")),
        _num(_get(s["e2e"], "p50")),
        _ms(_get(s.get("scheduling_delay"), "p50")),
        f"{s['stalls']['count']} / {s['stalls']['total_s']:.2f}",
        _num(s.get("goodput")),
    ]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def runs_table(runs: list[dict]) -> str:
    return markdown_table(TABLE_HEADER, [table_row(r) for r in runs])


def priority_table(run: dict) -> str | None:
    per = run["summary"].get("per_priority")
    if not per:
        return None
    header = ["priority", "done", "TTFT p50 (ms)", "TTFT p99", "TBT p99", "e2e p50 (s)", "norm. latency p50 (ms/tok)",
              "goodput (req/s)"]
    rows = [[p, f"{s['completed']}/{s['num_requests']}", _ms(_get(s["ttft"], "p50")), _ms(_get(s["ttft"], "p99")),
             _ms(_get(s["tbt"], "p99")), _num(_get(s["e2e"], "p50")), _ms(_get(s["normalized_latency"], "p50")),
             _num(s.get("goodput"))] for p, s in per.items()]
    return markdown_table(header, rows)


def client_table(run: dict) -> str | None:
    """Per client: throughput, its share of a max-min fair split, TTFT and TBT; then Jain's index."""
    s = run["summary"]
    per, fair = s.get("per_client"), s.get("fairness")
    if not per or not fair:
        return None
    header = ["client", "done", "out tok/s (window)", "of fair share", "TTFT p50 (ms)", "TTFT p99", "TBT p50",
              "TBT p99", "e2e p50 (s)"]
    rows = [[c or "(none)", f"{x['completed']}/{x['num_requests']}", _num(fair["tokens_per_s"].get(c), ".1f"),
             _num(fair["share_ratio"].get(c)), _ms(_get(x["ttft"], "p50")), _ms(_get(x["ttft"], "p99")),
             _ms(_get(x["tbt"], "p50")), _ms(_get(x["tbt"], "p99")), _num(_get(x["e2e"], "p50"))]
            for c, x in per.items()]
    p = s.get("preemptions") or (run.get("simulation") or {}).get("preemption_counts") or {}
    line = f"Jain's fairness index over the {fair['window_s']:.0f} s arrival window: {_num(fair['jain_index'], '.3f')}"
    if p:
        line += (f"; preemptions {p.get('preemptions', 0):.0f} ({p['per_s']:.2f}/s)"
                 + (f", by time slice {p['time_slice_preemptions']:.0f}" if "time_slice_preemptions" in p else "")
                 + (f", recomputed tokens {p['recomputed_tokens']:.0f}" if "recomputed_tokens" in p else ""))
    return markdown_table(header, rows) + "\n\n" + line


def distribution_table(summary: dict) -> str:
    """Every latency of one run: mean, p50, p90, p99, max in ms."""
    rows = [("TTFT", "ttft"), ("TBT", "tbt"), ("TPOT", "tpot"), ("end-to-end", "e2e"),
            ("scheduling delay", "scheduling_delay"), ("normalized latency (per token)", "normalized_latency")]
    body = [[name] + [_ms(_get(summary.get(key), q)) for q in ("mean", "p50", "p90", "p99", "max")]
            for name, key in rows if summary.get(key)]
    return markdown_table(["metric (ms)", "mean", "p50", "p90", "p99", "max"], body)


def run_markdown(run: dict) -> str:
    s = run["summary"]
    parts = [runs_table([run])]
    notes = []
    if s["failed"]:
        notes.append(f"{s['failed']} requests failed: {'; '.join(s['errors'])}")
    if s["incomplete_outputs"]:
        notes.append(f"{s['incomplete_outputs']} requests returned fewer tokens than max_tokens (ignore_eos not honoured?)")
    if s["stall_threshold_s"] is not None:
        notes.append(f"stall = a gap > {s['stall_threshold_s'] * 1e3:.0f} ms")
    if s.get("tbt_slo_s") or s.get("ttft_slo_s"):
        notes.append(f"goodput SLOs: TTFT {_ms(s.get('ttft_slo_s'))} ms, TBT {_ms(s.get('tbt_slo_s'))} ms")
    if s.get("scheduling_delay") is None:
        notes.append("scheduling delay: not exposed by this server")
    spec = s.get("speculation")
    if spec:
        notes.append(f"speculative decoding: {spec['acceptance_rate']:.0%} of {spec['draft_tokens']:.0f} proposed tokens "
                     f"accepted, {spec['mean_accepted_length']:.2f} accepted per verification")
    if notes:
        parts.append("\n".join(f"- {n}" for n in notes))
    pt = priority_table(run)
    if pt:
        parts.append(pt)
    ct = client_table(run)
    if ct:
        parts.append(ct)
    return "\n\n".join(parts)
