"""Step time from a batch's shape, fitted by least squares on timings of this machine (`paceline profile`).

It lives in core, below both users: the engine predicts step times with it (max_step_ms), the simulator times its
steps with it. numpy only: core never imports torch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from paceline.core.batch_shape import BatchShape

FEATURES = ("constant", "requests", "prefill_tokens", "decodes", "prefill_attn_pairs", "decode_context", "sampled")


def features(s: BatchShape) -> list[float]:
    return [1.0, s.num_requests, s.num_prefill_tokens, s.num_decodes, s.prefill_attn_pairs, s.decode_context, s.num_sampled]


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a negative per-token cost is a fitting artefact, not physics.
    Drop the most negative coefficient and refit until none is left (enough for 7 columns)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            return coef
        del active[int(np.argmin(sol))]
    return coef


@dataclass
class ProfiledCostModel:
    coefficients: dict[str, float]
    swap_s_per_block: float = 0.0
    # a grammar mask per constrained row (fill + apply), timed apart: the grid's batches are unconstrained
    mask_s_per_row: float = 0.0
    meta: dict = field(default_factory=dict)  # machine, model, dtype, fit error: what the numbers mean

    kind = "profiled"

    def __post_init__(self) -> None:
        missing = [f for f in FEATURES if f not in self.coefficients]
        if missing:
            raise ValueError(f"profile lacks coefficients for {', '.join(missing)}")
        self._coef = [float(self.coefficients[f]) for f in FEATURES]

    def step_time(self, s: BatchShape) -> float:
        c = self._coef
        return (c[0] + c[1] * s.num_requests + c[2] * s.num_prefill_tokens + c[3] * s.num_decodes
                + c[4] * s.prefill_attn_pairs + c[5] * s.decode_context + c[6] * s.num_sampled
                + self.swap_s_per_block * s.num_swapped_blocks + self.mask_s_per_row * s.num_masked)

    @classmethod
    def fit(cls, shapes: list[BatchShape], times: list[float], meta: dict | None = None) -> "ProfiledCostModel":
        if len(shapes) != len(times) or len(shapes) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} (shape, time) pairs of equal count, got {len(shapes)} and {len(times)}")
        x = np.array([features(s) for s in shapes], dtype=np.float64)
        y = np.array(times, dtype=np.float64)
        # relative error matters (a 1 ms decode step and a 1 s prefill alike), so weight rows by 1/time
        w = 1.0 / np.maximum(y, 1e-6)
        coef = fit_nonnegative(x * w[:, None], y * w)
        pred = x @ coef
        rel = np.abs(pred - y) / y
        meta = dict(meta or {})
        meta.update(num_samples=len(y), median_rel_error=float(np.median(rel)), max_rel_error=float(rel.max()))
        return cls(dict(zip(FEATURES, coef.tolist())), meta=meta)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": self.kind, "coefficients": self.coefficients,
                                          "swap_s_per_block": self.swap_s_per_block,
                                          "mask_s_per_row": self.mask_s_per_row, "meta": self.meta}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ProfiledCostModel":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None
        if d.get("kind") != "profiled":
            raise ValueError(f"{path} is not a paceline profile (kind={d.get('kind')!r})")
        return cls(d["coefficients"], d.get("swap_s_per_block", 0.0), d.get("mask_s_per_row", 0.0), d.get("meta", {}))
