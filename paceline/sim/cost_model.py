"""Step time as a function of the batch: a least-squares fit of this machine's profile, or a GPU roofline.

Both models see a batch only through BatchShape, the handful of sums that decide its cost: tokens by kind,
attention work of prompt chunks (query-key pairs) and of decodes (context lengths), requests, sampled tokens.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from paceline.core.batch_shape import BatchShape, batch_shape  # noqa: F401  (re-exported: the sim's callers)
from paceline.model.arch import ModelArch
from paceline.sim.hardware import GPU, GiB
from paceline.sim.models import num_parameters


# ---------------------------------------------------------------- profiled: fitted on this machine

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
                + self.swap_s_per_block * s.num_swapped_blocks)

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
                                          "swap_s_per_block": self.swap_s_per_block, "meta": self.meta}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ProfiledCostModel":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None
        if d.get("kind") != "profiled":
            raise ValueError(f"{path} is not a paceline profile (kind={d.get('kind')!r})")
        return cls(d["coefficients"], d.get("swap_s_per_block", 0.0), d.get("meta", {}))


# ---------------------------------------------------------------- roofline: a GPU from its datasheet

# Fractions of peak that each operator class reaches; rough figures in line with what Vidur and the
# FlashAttention papers measure on A100/H100 (large GEMMs 70-80 % of peak, FA2 forward 50-70 %,
# paged decode attention and elementwise kernels 60-80 % of HBM bandwidth).
DEFAULT_EFFICIENCY = {"gemm": 0.7, "attn_prefill": 0.5, "attn_decode": 0.6, "elementwise": 0.7}


@dataclass
class RooflineCostModel:
    arch: ModelArch
    gpu: GPU
    tp: int = 1
    pp: int = 1
    dtype_bytes: int = 2  # bf16 weights, activations and KV
    efficiency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    # CPU time per step that the GPU waits on (scheduling, input preparation, launches); vLLM-era
    # engines spend a few ms here, which is why it is an explicit knob rather than zero
    step_overhead_s: float = 0.002
    per_request_s: float = 10e-6

    kind = "roofline"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={self.tp}, pp={self.pp}")
        a = self.arch
        if a.num_kv_heads % self.tp and self.tp % a.num_kv_heads:
            raise ValueError(f"tp={self.tp} does not divide {a.num_kv_heads} KV heads")
        if a.num_layers % self.pp:
            raise ValueError(f"pp={self.pp} does not divide {a.num_layers} layers")
        for k in DEFAULT_EFFICIENCY:
            e = self.efficiency.setdefault(k, DEFAULT_EFFICIENCY[k])
            if not 0 < e <= 1:
                raise ValueError(f"efficiency[{k}] must be in (0, 1], got {e}")
        tp = self.tp
        self._q = a.num_heads * a.head_dim / tp
        self._kv = max(a.num_kv_heads / tp, 1) * a.head_dim
        self._inter = a.intermediate_size / tp
        h = a.hidden_size
        self._gemms = [(h, self._q + 2 * self._kv), (self._q, h), (h, 2 * self._inter), (self._inter, h)]  # (k, n)

    def _op(self, flops: float, nbytes: float, eff: float) -> float:
        g = self.gpu
        return max(flops / (g.peak_flops * eff), nbytes / (g.mem_bandwidth * eff))

    def _allreduce(self, nbytes: float) -> float:
        if self.tp == 1:
            return 0.0
        return 2 * (self.tp - 1) / self.tp * nbytes / self.gpu.link_bandwidth + self.gpu.link_latency_s

    def layer_time(self, s: BatchShape) -> float:
        """One transformer layer on one GPU of the TP group."""
        a, b, e = self.arch, self.dtype_bytes, self.efficiency
        t = s.num_tokens
        if t == 0:
            return 0.0
        total = 0.0
        for k, n in self._gemms:
            total += self._op(2.0 * t * k * n, b * (k * n + t * k + t * n), e["gemm"])
        heads = self._q / a.head_dim
        if s.num_prefill_tokens:
            flops = 4.0 * a.head_dim * heads * s.prefill_attn_pairs
            nbytes = b * (2 * s.num_prefill_tokens * self._q + 2 * s.prefill_kv_tokens * self._kv)
            total += self._op(flops, nbytes, e["attn_prefill"])
        if s.num_decodes:
            flops = 4.0 * a.head_dim * heads * s.decode_context
            nbytes = b * (2 * s.num_decodes * self._q + 2 * s.decode_context * self._kv)
            total += self._op(flops, nbytes, e["attn_decode"])
        # norms and residual adds (~8 passes over hidden), rope on q/k, silu*mul (3 passes), KV-cache write
        elem = t * (8 * a.hidden_size + 2 * (self._q + self._kv) + 3 * self._inter + 2 * self._kv)
        total += self._op(0.0, b * elem, e["elementwise"])
        total += 2 * self._allreduce(b * t * a.hidden_size)
        return total

    def step_time(self, s: BatchShape) -> float:
        a, b = self.arch, self.dtype_bytes
        if s.num_tokens == 0 and not s.num_swapped_blocks:
            return self.step_overhead_s
        layers = a.num_layers * self.layer_time(s)  # the pp stages run one after another for one batch
        if self.pp > 1:
            layers += (self.pp - 1) * (b * s.num_tokens * a.hidden_size / self.gpu.link_bandwidth + self.gpu.link_latency_s)
        vocab = a.vocab_size / self.tp
        head = self._op(2.0 * s.num_sampled * a.hidden_size * vocab,
                        b * (a.hidden_size * vocab + s.num_sampled * (a.hidden_size + vocab)), self.efficiency["gemm"])
        swap = s.num_swapped_blocks * self.kv_bytes_per_token() * 16 / self.gpu.pcie_bandwidth
        return self.step_overhead_s + self.per_request_s * s.num_requests + layers + head + swap

    # ---- memory

    def kv_bytes_per_token(self) -> float:
        """KV bytes one token takes on one GPU (its share of layers and KV heads)."""
        a = self.arch
        return 2 * (a.num_layers / self.pp) * self._kv * self.dtype_bytes

    def weight_bytes_per_gpu(self) -> float:
        return num_parameters(self.arch) * self.dtype_bytes / (self.tp * self.pp)

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9, reserve_bytes: float = 2 * GiB) -> int:
        """(memory x utilization - weights - reserve for activations/CUDA context) / KV bytes per token."""
        free = self.gpu.memory_bytes * gpu_memory_utilization - self.weight_bytes_per_gpu() - reserve_bytes
        if free <= 0:
            raise ValueError(f"{self.arch.architecture} does not fit on {self.gpu.name} with tp={self.tp}, pp={self.pp}")
        return int(free // self.kv_bytes_per_token())

    def describe(self) -> dict:
        return {"kind": self.kind, "gpu": self.gpu.name, "tp": self.tp, "pp": self.pp, "efficiency": self.efficiency,
                "step_overhead_s": self.step_overhead_s, "weights_gb_per_gpu": self.weight_bytes_per_gpu() / 1e9,
                "kv_capacity_tokens": self.kv_capacity_tokens()}


def roofline_from_names(model: str, gpu: str, tp: int = 1, pp: int = 1, **kw) -> RooflineCostModel:
    from paceline.sim.hardware import get_gpu
    from paceline.sim.models import load_model_config
    return RooflineCostModel(load_model_config(model), get_gpu(gpu), tp=tp, pp=pp, **kw)
