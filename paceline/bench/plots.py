"""PNG plots from run dicts (report.run_dict, of a measured or a simulated run): TBT CDF, tokens over time,
latency vs rate, step composition. matplotlib comes with the [bench] extra; the server does without it."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

try:
    import matplotlib
except ImportError:  # pragma: no cover - depends on the install
    raise ImportError("plots need matplotlib: pip install 'paceline[bench]' (or pass --no-plots)") from None
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _label(run: dict, with_rate: bool) -> str:
    return f"{run['system']} @ {run['rate']:.2f} req/s" if with_rate and run.get("rate") else run["system"]


def _gaps(run: dict) -> np.ndarray:
    return np.array([b - a for r in run["requests"] if r["error"] is None
                     for a, b in zip(r["token_times"], r["token_times"][1:])])


def tbt_cdf(runs: list[dict], path: Path, tbt_slo: float | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    with_rate = len({r.get("rate") for r in runs}) > 1
    for run in runs:
        g = np.sort(_gaps(run)) * 1e3
        if g.size:
            ax.plot(np.maximum(g, 1e-2), np.arange(1, g.size + 1) / g.size, label=_label(run, with_rate))
    if tbt_slo:
        ax.axvline(tbt_slo * 1e3, color="k", ls="--", lw=1, label="TBT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("time between tokens (ms)")
    ax.set_ylabel("fraction of gaps ≤ x")
    ax.set_title("TBT CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def tokens_over_time(runs: list[dict], path: Path) -> Path:
    """Cumulative output tokens delivered; a stall shows as a flat step."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    with_rate = len({r.get("rate") for r in runs}) > 1
    for run in runs:
        t = np.sort([x for r in run["requests"] for x in r["token_times"]])
        if t.size:
            ax.step(t, np.arange(1, t.size + 1), where="post", label=_label(run, with_rate))
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens delivered")
    ax.set_title("Tokens completed over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def latency_vs_rate(runs: list[dict], path: Path, tbt_slo: float | None = None) -> Path:
    by_system: dict[str, list[dict]] = defaultdict(list)
    for run in runs:
        if run.get("rate") and not run.get("skipped"):
            by_system[run["system"]].append(run)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for system, rs in by_system.items():
        rs = sorted(rs, key=lambda r: r["rate"])
        rates = [r["rate"] for r in rs]
        p99 = [(r["summary"]["tbt"] or {}).get("p99", np.nan) * 1e3 for r in rs]
        ttft = [(r["summary"]["ttft"] or {}).get("p50", np.nan) for r in rs]
        a1.plot(rates, p99, "o-", label=system)
        a2.plot(rates, ttft, "o-", label=system)
    if tbt_slo:
        a1.axhline(tbt_slo * 1e3, color="k", ls="--", lw=1, label="TBT SLO")
    a1.set(xlabel="request rate (req/s)", ylabel="p99 TBT (ms)", title="p99 time between tokens", yscale="log")
    a2.set(xlabel="request rate (req/s)", ylabel="median TTFT (s)", title="median time to first token", yscale="log")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    return _save(fig, path)


def step_composition(runs: list[dict], path: Path) -> Path | None:
    """Decode vs prompt-chunk tokens over time, from the server's counters (paceline only)."""
    runs = [r for r in runs if r.get("step_composition")]
    if not runs:
        return None
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.6 * len(runs)), squeeze=False, sharex=True)
    for ax, run in zip(axes[:, 0], runs):
        rows = run["step_composition"]
        t = [r["t"] for r in rows]
        per_step = all("steps" in r for r in rows)
        dec = [r["decode_per_step"] if per_step else r["decode_tokens"] / r["dt"] for r in rows]
        pre = [r["prefill_per_step"] if per_step else r["prefill_tokens"] / r["dt"] for r in rows]
        ax.stackplot(t, dec, pre, labels=["decode", "prompt chunks"], step="post", alpha=0.8)
        ax.set_ylabel("tokens / step" if per_step else "tokens / s")
        ax.set_title(_label(run, True), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since start (s)")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def all_plots(runs: list[dict], out_dir: Path, tbt_slo: float | None = None,
              featured: list[dict] | None = None) -> list[Path]:
    """Every plot. `featured` (default: all runs) are the runs drawn one line each in the CDF, tokens-over-time and
    step-composition plots; latency vs rate uses every run."""
    runs = [r for r in runs if not r.get("skipped")]
    featured = runs if featured is None else featured
    out = [tbt_cdf(featured, out_dir / "tbt_cdf.png", tbt_slo),
           tokens_over_time(featured, out_dir / "tokens_over_time.png")]
    if len({r.get("rate") for r in runs}) > 1:
        out.append(latency_vs_rate(runs, out_dir / "latency_vs_rate.png", tbt_slo))
    sc = step_composition(featured, out_dir / "step_composition.png")
    if sc:
        out.append(sc)
    return out
