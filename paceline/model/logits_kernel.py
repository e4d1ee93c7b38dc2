"""The LM head of a few rows on a CPU without native bfloat16 math: one C++ pass over the bfloat16 weight for all rows.

Why: the LM head is the largest matrix of a small model (SmolLM2-135M: 49152 x 576, 57 MB in bfloat16, more than all
its int4 layers together), and oneDNN's bfloat16 matmul on an AVX2-only CPU converts inside every call, so its cost
grows with the rows: measured here 5.6 ms for one row and 20.5 ms for five (`benchmarks/spec_step_profile.py`,
2026-11-23), which is most of what makes verifying four speculated tokens expensive in the default mode. Streaming
the weight once and applying each loaded vector to every row costs about one row's time up to six rows.

The op reads the weight in its plain row-major [N, K] layout (the tied embedding itself: no second copy), two output
rows at a time; x is bfloat16 [M, K] and widened to float32; products and sums are float32 (a bfloat16 times a
bfloat16 is exact in float32) and so is the result (no rounding of the logits to bfloat16). Each output (m, n) is
summed in the same order whatever M is and whichever thread computes it, so the logits of a position are bitwise
the same in a one-row decode and in a five-row verification: speculation cannot change a greedy token through the
LM head's rounding.

Built once with the system compiler and cached next to the int4 op (int4_kernel's build); no compiler or no AVX2:
load() gives None and the model keeps oneDNN's matmul. `PACELINE_LOGITS_KERNEL=0` switches it off (A/B runs).
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from paceline.model import int4_kernel

log = logging.getLogger("paceline.logits")

# The model sends at most this many rows through the op: each 6 rows re-read the weight, so from about three passes
# on oneDNN's blocked matmul (or the float32 copy a wide step reads) is the better deal; a decode or a verification
# of up to 7 proposals is far below it.
MAX_ROWS = 16

SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <immintrin.h>
#include <algorithm>
#include <vector>

namespace {

constexpr int MAX_R = 6;  // rows per pass: 2 outputs x 6 rows = 12 accumulators, 2 weight vectors, 1 x vector

inline __m256 bf16x8(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// fixed-order horizontal sum of 8 lanes
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[r][n], y[r][n + 1] for R rows (P = 2) or y[r][n] alone (P = 1); x rows are float32 [R][K]
template <int R, int P>
inline void outputs(const float* const* x, const uint16_t* w, int K, float* const* y, int64_t n) {
  __m256 acc[P][R];
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) acc[p][r] = _mm256_setzero_ps();
  for (int k = 0; k < K; k += 8) {
    __m256 wv[P];
    for (int p = 0; p < P; ++p) wv[p] = bf16x8(w + int64_t(p) * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x[r] + k);
      for (int p = 0; p < P; ++p) acc[p][r] = _mm256_fmadd_ps(xv, wv[p], acc[p][r]);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) y[r][n + p] = hsum(acc[p][r]);
}

template <int R>
void rows(const float* const* x, const uint16_t* w, int64_t N, int K, float* const* y) {
  const int64_t pairs = N / 2;
#pragma omp parallel for schedule(static) num_threads(std::max(1, at::get_num_threads()))
  for (int64_t i = 0; i < pairs; ++i) outputs<R, 2>(x, w + 2 * i * K, K, y, 2 * i);
  if (N % 2) outputs<R, 1>(x, w + (N - 1) * K, K, y, N - 1);
}

// x [M, K] bfloat16, w [N, K] bfloat16 (row-major, rows contiguous) -> [M, N] float32
at::Tensor logits_mm(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x must be bfloat16 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "w must be contiguous bfloat16 [N, K]");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 8 == 0, "w must be [N, K] with K a multiple of 8, K as x's");
  const at::Tensor xf = x_in.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  for (int64_t m0 = 0; m0 < M; m0 += MAX_R) {
    const int R = int(std::min<int64_t>(MAX_R, M - m0));
    const float* xr[MAX_R];
    float* yr[MAX_R];
    for (int r = 0; r < R; ++r) {
      xr[r] = xf.data_ptr<float>() + (m0 + r) * K;
      yr[r] = y.data_ptr<float>() + (m0 + r) * N;
    }
    switch (R) {
      case 1: rows<1>(xr, wp, N, int(K), yr); break;
      case 2: rows<2>(xr, wp, N, int(K), yr); break;
      case 3: rows<3>(xr, wp, N, int(K), yr); break;
      case 4: rows<4>(xr, wp, N, int(K), yr); break;
      case 5: rows<5>(xr, wp, N, int(K), yr); break;
      default: rows<6>(xr, wp, N, int(K), yr); break;
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(NAMESPACE, m) { m.def("logits_mm(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("logits_mm", &logits_mm); }
"""


def enabled() -> bool:
    return os.environ.get("PACELINE_LOGITS_KERNEL", "1") != "0"


def _library_path() -> tuple[Path, str, list[str]]:
    from paceline.model.cache_dir import cache_root
    flags = int4_kernel._flags()
    key = hashlib.sha256("\n".join([SOURCE, torch.__version__, *flags]).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"logits_mm-{key}.so", f"paceline_logits_{key}", flags


def load() -> Callable | None:
    """The op `(x bf16 [M, K], w bf16 [N, K]) -> float32 [M, N]`, building it first if needed; None when it is
    switched off or cannot be built or run here (the reason is logged once)."""
    if not enabled() or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    path, namespace, flags = _library_path()
    return int4_kernel.load_op(path, namespace, flags, SOURCE, "logits_mm",
                               "CPU few-row logits kernel unavailable, using oneDNN's matmul")


class FewRowLogits:
    """Logits of a few bfloat16 rows through the op, over a bfloat16 weight [vocab, hidden] it does not copy."""

    def __init__(self, weight: torch.Tensor, op: Callable):
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 8:
            raise ValueError(f"the few-row logits op needs a bfloat16 [N, K] weight with K a multiple of 8, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        self.weight, self.op = weight.contiguous(), op

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x.to(torch.bfloat16), self.weight)
