"""Step time as a function of the batch: a GPU roofline here; the least-squares fit of this machine's profile
lives in paceline.core.step_time, below the engine, which predicts with it too (both re-exported here).

Both models see a batch only through BatchShape, the handful of sums that decide its cost: tokens by kind,
attention work of prompt chunks (query-key pairs) and of decodes (context lengths), requests, sampled tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from paceline.config import CacheConfig
from paceline.core.batch_shape import BatchShape, batch_shape  # noqa: F401  (re-exported: the sim's callers)
from paceline.core.step_time import FEATURES, ProfiledCostModel, features, fit_nonnegative  # noqa: F401  (same)
from paceline.model.arch import ModelArch
from paceline.sim.hardware import GPU, GiB
from paceline.sim.models import num_parameters


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
    block_size: int = CacheConfig.block_size  # tokens per KV block: what one swapped block moves

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
        layers = a.num_layers * self.layer_time(s)  # one batch passes the pp stages one after another
        if self.pp > 1:
            layers += (self.pp - 1) * (b * s.num_tokens * a.hidden_size / self.gpu.link_bandwidth + self.gpu.link_latency_s)
        vocab = a.vocab_size / self.tp
        head = self._op(2.0 * s.num_sampled * a.hidden_size * vocab,
                        b * (a.hidden_size * vocab + s.num_sampled * (a.hidden_size + vocab)), self.efficiency["gemm"])
        swap = s.num_swapped_blocks * self.kv_bytes_per_token() * self.block_size / self.gpu.pcie_bandwidth
        return self.step_overhead_s + self.per_request_s * s.num_requests + layers + head + swap

    def stage_times(self, s: BatchShape) -> list[float]:
        """step_time cut into the pp stages a micro-batch passes through, in order; they sum to step_time. The first
        stage pays the step's CPU overhead, every stage but the last sends its hidden states on, the last computes
        the logits (and any swap is charged there)."""
        total = self.step_time(s)
        if self.pp == 1 or s.num_tokens == 0:
            return [total] + [0.0] * (self.pp - 1)
        a = self.arch
        layers = a.num_layers / self.pp * self.layer_time(s)
        send = self.dtype_bytes * s.num_tokens * a.hidden_size / self.gpu.link_bandwidth + self.gpu.link_latency_s
        first = self.step_overhead_s + self.per_request_s * s.num_requests + layers + send
        middle = [layers + send] * (self.pp - 2)
        return [first, *middle, total - first - sum(middle)]

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
