"""PNG plots of a simulated run: TBT CDF, tokens completed over time (stalls show as flat steps), step composition."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from paceline.sim.simulator import SimResult


def write_plots(result: SimResult, out_dir: str | Path, label: str = "simulated") -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    done = result.finished
    gaps = np.sort([b - a for r in done for a, b in zip(r.token_times, r.token_times[1:])])
    fig, ax = plt.subplots(figsize=(6, 4))
    if gaps.size:
        ax.plot(gaps * 1e3, np.arange(1, gaps.size + 1) / gaps.size, label=label)
    ax.set(xlabel="time between tokens (ms)", ylabel="fraction of gaps", xscale="log", title="TBT CDF")
    ax.legend()
    paths.append(out / "tbt_cdf.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    times = np.sort([t for r in done for t in r.token_times])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(times, np.arange(1, times.size + 1), label=label)
    ax.set(xlabel="simulated time (s)", ylabel="tokens completed", title="tokens over time")
    ax.legend()
    paths.append(out / "tokens_over_time.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)

    steps = [s for s in result.steps if s.replica == 0]
    fig, ax = plt.subplots(figsize=(8, 4))
    if steps:
        t = np.array([s.start for s in steps])
        ax.fill_between(t, [s.num_decode_tokens for s in steps], step="post", alpha=0.7, label="decode tokens")
        ax.fill_between(t, [s.num_decode_tokens for s in steps],
                        [s.num_decode_tokens + s.num_prefill_tokens for s in steps], step="post", alpha=0.7, label="prompt tokens")
    ax.set(xlabel="simulated time (s)", ylabel="tokens per step", title="step composition (replica 0)")
    ax.legend()
    paths.append(out / "step_composition.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths
