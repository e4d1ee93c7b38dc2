"""Step time from a batch's shape, fitted by least squares on timings of this machine (`paceline profile`).

It lives in core, below both users: the engine predicts step times with it (max_step_ms), the simulator times its
steps with it. numpy only: core never imports torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from paceline.core.batch_shape import BatchShape

# wide_rows: 1 for a step of more rows than the model's few-row product serves (`few_rows`; 0: it has none, and the
# feature is 0 everywhere). A float32 model reads its plain weights for steps of up to 2 rows and oneDNN's packed
# ones above (model/f32_rows_kernel.py): one decode took 21 ms and three 29 ms where the rows' own costs are ~1 ms,
# a step up no line through the rows can follow (a scale fitted over both then put one-decode steps at ~2x)
FEATURES = ("constant", "requests", "prefill_tokens", "decodes", "prefill_attn_pairs", "decode_context", "sampled",
            "wide_rows")
OPTIONAL = {"wide_rows": 0.0}  # coefficients a profile written before them may lack


def wide_rows(s: BatchShape, few_rows: int) -> bool:
    """Whether a step of shape s has more rows than the model's few-row product serves (none when few_rows is 0)."""
    return bool(few_rows) and s.num_prefill_tokens + s.num_decodes > few_rows


def features(s: BatchShape, few_rows: int = 0) -> list[float]:
    return [1.0, s.num_requests, s.num_prefill_tokens, s.num_decodes, s.prefill_attn_pairs, s.decode_context,
            s.num_sampled, float(wide_rows(s, few_rows))]


def linear_step_time(c: list[float], s: BatchShape, swap_s_per_block: float, mask_s_per_row: float,
                     few_rows: int = 0) -> float:
    """Seconds for a step of shape s under coefficients c (in FEATURES order), plus the terms timed apart."""
    wide = c[7] if wide_rows(s, few_rows) else 0.0
    return (c[0] + c[1] * s.num_requests + c[2] * s.num_prefill_tokens + c[3] * s.num_decodes
            + c[4] * s.prefill_attn_pairs + c[5] * s.decode_context + c[6] * s.num_sampled + wide
            + swap_s_per_block * s.num_swapped_blocks + mask_s_per_row * s.num_masked)


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
    few_rows: int = 0  # steps of up to this many rows run the model's few-row product (FEATURES' wide_rows)

    kind = "profiled"

    def __post_init__(self) -> None:
        missing = [f for f in FEATURES if f not in self.coefficients and f not in OPTIONAL]
        if missing:
            raise ValueError(f"profile lacks coefficients for {', '.join(missing)}")
        self._coef = [float(self.coefficients.get(f, OPTIONAL.get(f, 0.0))) for f in FEATURES]

    def step_time(self, s: BatchShape) -> float:
        return linear_step_time(self._coef, s, self.swap_s_per_block, self.mask_s_per_row, self.few_rows)

    @classmethod
    def fit(cls, shapes: list[BatchShape], times: list[float], meta: dict | None = None,
            few_rows: int = 0) -> "ProfiledCostModel":
        if len(shapes) != len(times) or len(shapes) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} (shape, time) pairs of equal count, got {len(shapes)} and {len(times)}")
        x = np.array([features(s, few_rows) for s in shapes], dtype=np.float64)
        y = np.array(times, dtype=np.float64)
        # relative error matters (a 1 ms decode step and a 1 s prefill alike), so weight rows by 1/time
        w = 1.0 / np.maximum(y, 1e-6)
        coef = fit_nonnegative(x * w[:, None], y * w)
        pred = x @ coef
        rel = np.abs(pred - y) / y
        meta = dict(meta or {})
        meta.update(num_samples=len(y), median_rel_error=float(np.median(rel)), max_rel_error=float(rel.max()))
        return cls(dict(zip(FEATURES, coef.tolist())), meta=meta, few_rows=few_rows)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": self.kind, "coefficients": self.coefficients,
                                          "swap_s_per_block": self.swap_s_per_block,
                                          "mask_s_per_row": self.mask_s_per_row, "few_rows": self.few_rows,
                                          "meta": self.meta}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ProfiledCostModel":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None
        if d.get("kind") != "profiled":
            raise ValueError(f"{path} is not a paceline profile (kind={d.get('kind')!r})")
        return cls(d["coefficients"], d.get("swap_s_per_block", 0.0), d.get("mask_s_per_row", 0.0), d.get("meta", {}),
                   int(d.get("few_rows", 0)))


# Shapes that anchor a live refit where the live steps say nothing (a server that has only run short decodes has
# not measured a deep prompt chunk): the profile's own predictions at these shapes enter the fit as samples.
# (decodes, decode context, prompt chunk tokens, chunk start) each; the spread of a quick profile's grid
ANCHOR_SHAPES = ((1, 128, 0, 0), (8, 512, 0, 0), (32, 1024, 0, 0), (64, 256, 0, 0), (4, 2048, 0, 0),
                 (0, 0, 16, 0), (0, 0, 128, 1024), (0, 0, 512, 0), (0, 0, 512, 1536), (0, 0, 64, 1536),
                 (8, 300, 32, 0), (16, 512, 64, 1024), (4, 1024, 256, 256))


def anchor_shapes() -> list[BatchShape]:
    return [BatchShape.build([(start, c)] if c else [], [ctx] * d) for d, ctx, c, start in ANCHOR_SHAPES]


class LiveStepTime:
    """A profiled model refitted, every `refit_every` steps, to the last `window` steps this engine measured.

    Why: the engine's profile is a quick grid timed once at start-up (or a file from another day), and its fit errs
    by shape, not by one factor: on 2026-11-23 the cached quick profile (19 shapes, median error 20 %) predicted the
    stall probe's steps of 6 decodes at ~4x their measured time and its steps of 6 decodes and a 16-token chunk at
    depth ~1,000 at ~2.3x, so the step-time target cut every chunk to one block while the steps used ~60 % of it
    (benchmarks/summaries/vs_vllm.md). One scale cannot correct errors that differ by shape. The refit is the same
    non-negative least squares on relative error as the profile's, over the live steps plus the profile's
    predictions at ANCHOR_SHAPES (each weighted as `anchor_weight` live steps), so features that no live step
    exercised keep the profile's values. A live time is clipped to [1/CLIP, CLIP] x the current
    prediction before it counts: a step slowed by a one-off (a first call of a shape, the host's noise) pulls the
    fit by at most CLIP, while a lasting change still moves it there within a few refits."""

    CLIP = 2.0

    def __init__(self, base: ProfiledCostModel, window: int = 256, refit_every: int = 16, anchor_weight: float = 2.0):
        self.base = base
        self.window, self.refit_every = window, refit_every
        self.coef = list(base._coef)
        self._x: list[list[float]] = []  # features of the live steps, oldest first (at most `window`)
        self._y: list[float] = []
        self._since_refit = 0
        self.num_refits = 0
        anchors = anchor_shapes()
        ax = np.array([features(s, base.few_rows) for s in anchors], dtype=np.float64)
        ay = np.array([base.step_time(s) for s in anchors], dtype=np.float64)
        self._anchor_rows = ax / ay[:, None] * math.sqrt(anchor_weight)  # relative error, as the profile's fit
        self._anchor_rhs = np.full(len(anchors), math.sqrt(anchor_weight))

    @property
    def num_samples(self) -> int:
        """Live steps in the window."""
        return len(self._y)

    def step_time(self, s: BatchShape) -> float:
        return linear_step_time(self.coef, s, self.base.swap_s_per_block, self.base.mask_s_per_row, self.base.few_rows)

    def observe(self, s: BatchShape, seconds: float) -> None:
        """One executed step's shape and measured time; refits every refit_every observations."""
        if seconds <= 0 or s.num_swapped_blocks or s.num_masked:  # terms the refit does not cover: leave them out
            return
        predicted = self.step_time(s)
        if predicted > 0:
            seconds = min(max(seconds, predicted / self.CLIP), predicted * self.CLIP)
        self._x.append(features(s, self.base.few_rows))
        self._y.append(seconds)
        if len(self._y) > self.window:
            del self._x[0], self._y[0]
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self.refit()

    def refit(self) -> None:
        self._since_refit = 0
        if not self._y:
            return
        x = np.array(self._x, dtype=np.float64)
        y = np.array(self._y, dtype=np.float64)
        rows = np.vstack([x / y[:, None], self._anchor_rows])
        rhs = np.concatenate([np.ones(len(y)), self._anchor_rhs])
        coef = fit_nonnegative(rows, rhs)
        if np.isfinite(coef).all() and coef.any():
            self.coef = coef.tolist()
            self.num_refits += 1
