"""float32 x float32 products of a few rows (decode steps) on the plain weight: y = x W^T (+ b), AVX-512.

Why: a float32 decode step streams every weight once (the bundled model: 540 MB), so its time is memory bandwidth,
and oneDNN's prepacked float32 linear reads it well below what the cores can pull at one or two rows: whole decode
steps of the bundled model took 31.7 / 34.4 ms (1 / 2 rows) on oneDNN's packed weights and 21.1 / 25.1 ms here
(benchmarks/summaries/f32_rows.md has the command). A first version that read four weight rows side by side was
slower than one row at a time: the hardware prefetcher keeps up with one stream a thread, not four. From three rows
on, oneDNN's blocked kernel is as fast or faster (it reuses each loaded weight vector across rows without reloading
the rows' inputs), so the model sends steps of up to MAX_ROWS rows here and the rest to oneDNN (Linear.__call__,
layer_loop's F32_ROWS path).

How: each thread takes one contiguous range of output features (so it reads one sequential stretch of the
weight) and, for each output, the dot products of its weight row with every input row, four rows per pass (a
weight row is 2.3 KB at K = 576: the passes after the first read it from L1). A dot product runs over K in
vectors of 16 with two accumulators (k mod 32 < 16 and >= 16; the last partial vector masked), summed and reduced
at the end, then the bias added: the same operations in the same order for a row whatever the other rows of the
call, so a position's output does not depend on its batch (bitwise). Against oneDNN's order the results differ by
float32 rounding (~1e-6 relative; the model's exactness tests hold to 1e-4 and greedy equals transformers).

The plain weight it reads: a float32 Linear that may serve few-row steps keeps its plain weight beside the packed
copy (llama.Linear; a model mapped from its runtime snapshot maps it from the file, and a tied LM head's plain
weight is the embedding). Only a CPU where torch reports AVX-512; elsewhere op() is None and oneDNN serves every
step. Built once with the system compiler and cached (int4_kernel.load_op). `PACELINE_F32_ROWS=0` switches it off
for models built afterwards (A/B runs).
"""
from __future__ import annotations

import hashlib
import os
from typing import Callable

import torch

from paceline.model import int4_kernel

MAX_ROWS = 2  # steps of up to this many rows run here (see the docstring; benchmarks/summaries/f32_rows.md)

SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace {

constexpr int MAX_R = 4;  // rows per pass: two accumulators each

// y[r * ldy + n] for n in [n0, n1) and R rows of x (row stride ldx); w [N, K] row-major
template <int R>
inline void rows_pass(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
                      int64_t ldy, int64_t n) {
  const float* wr = w + n * K;
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 w0 = _mm512_loadu_ps(wr + k), w1 = _mm512_loadu_ps(wr + k + 16);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * ldx + k), a0[r]);
      a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * ldx + k + 16), a1[r]);
    }
  }
  if (k + 16 <= K) {
    const __m512 w0 = _mm512_loadu_ps(wr + k);
    for (int r = 0; r < R; ++r) a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * ldx + k), a0[r]);
    k += 16;
  }
  if (k < K) {  // the last partial vector: masked loads read nothing past the row
    const __mmask16 m = __mmask16((1u << (K - k)) - 1);
    const __m512 w1 = _mm512_maskz_loadu_ps(m, wr + k);
    for (int r = 0; r < R; ++r) a1[r] = _mm512_fmadd_ps(w1, _mm512_maskz_loadu_ps(m, x + r * ldx + k), a1[r]);
  }
  const float b = bias != nullptr ? bias[n] : 0.0f;
  for (int r = 0; r < R; ++r) y[r * ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r])) + b;
}

at::Tensor f32_rows_mm(const at::Tensor& x_in, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == x_in.size(1),
              "w must be a contiguous float32 [N, K] with x's K");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
              bias->numel() == w.size(0)), "bias must be a contiguous float32 [N]");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias.has_value() ? y.copy_(bias->expand({M, N})) : y.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int workers = int(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / 64)));
  // schedule(static) without a chunk: each thread one contiguous range of outputs, one sequential weight stream
#pragma omp parallel for num_threads(workers) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; m += MAX_R) {
      const float* xr = xp + m * ldx;
      float* yr = yp + m * N;
      switch (std::min<int64_t>(MAX_R, M - m)) {
        case 1: rows_pass<1>(xr, ldx, wp, K, bp, yr, N, n); break;
        case 2: rows_pass<2>(xr, ldx, wp, K, bp, yr, N, n); break;
        case 3: rows_pass<3>(xr, ldx, wp, K, bp, yr, N, n); break;
        default: rows_pass<4>(xr, ldx, wp, K, bp, yr, N, n); break;
      }
    }
  return y;
}

}  // namespace

TORCH_LIBRARY(NAMESPACE, m) { m.def("f32_rows_mm(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("f32_rows_mm", &f32_rows_mm); }
"""

SWITCH = "PACELINE_F32_ROWS"


def enabled() -> bool:
    """PACELINE_F32_ROWS (default 1): whether float32 models built afterwards serve few-row steps with this op."""
    value = os.environ.get(SWITCH, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{SWITCH} must be 0 or 1, got {value!r}")
    return value == "1"


def supported() -> bool:
    """Whether this CPU runs the op's build (torch sees AVX-512)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def build_key() -> str:
    """For the keys of runtime snapshots and measured step times: whether float32 models keep plain weights for
    this op ("on") or not ("off")."""
    return "on" if enabled() and supported() else "off"


def _library():
    from paceline.model.cache_dir import cache_root
    flags = int4_kernel._flags() + ["-mavx512f"]
    key = hashlib.sha256("\n".join([SOURCE, torch.__version__, *flags]).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"f32_rows_mm-{key}.so", f"paceline_f32rows_{key}", flags


_op: list = []  # op()'s answer, found once per process (finding it hashes the source)


def op() -> Callable | None:
    """The op `(x [M, K], w [N, K], bias or None) -> float32 [M, N]` whatever the switch says (a model built with
    it keeps using it), building it first if needed; None where the CPU has no AVX-512 or it cannot be built."""
    if not _op:
        found = None
        if supported():
            path, namespace, flags = _library()
            found = int4_kernel.load_op(path, namespace, flags, SOURCE, "f32_rows_mm",
                                        "CPU float32 few-row kernel unavailable, using oneDNN's")
        _op.append(found)
    return _op[0]


def keeps_plain(weight: torch.Tensor) -> bool:
    """Whether a Linear of this weight keeps its plain copy beside the packed one for the op: a contiguous float32
    CPU weight, the switch on and the op available here."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous() and enabled()
            and op() is not None)
