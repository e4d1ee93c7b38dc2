"""An int8-weight x int8-activation linear for CPU steps of many rows: the activations quantized per row, oneDNN's
int8 GEMM (torch._int_mm, s8 x s8 -> s32: AVX512-VNNI's vpdpbusd where the CPU has it), then the scales, built
once and cached like the other ops (int4_kernel.load_op).

Why: on a CPU with AVX512-VNNI an int8 GEMM does about twice the multiply-adds per cycle of oneDNN's bfloat16 one
(AVX512-BF16's vdpbf16ps adds 2 products per 32-bit lane, vpdpbusd 4): measured here (AMD Zen 4, 2 threads,
2026-11-24 08:08 UTC) torch._int_mm vs the prepacked bf16 linear, [576 -> 1536] at 512 rows 1.13 vs 2.25 ms, [1536
-> 576] 1.10 vs 2.08 ms. The quantization of the activations and the scaling of the int32 sums are passes over the
step's rows; done as torch ops (abs, amax, div, round, cast; cast, two muls, cast) they cost more than the GEMM
saves at 512 rows (2.53 ms in all for [576 -> 1536]), so they are the two C++ loops below, one pass each.

Numerics (the reference is `reference` below, torch ops on the same definition):
- weights (at load, `quantize_weight`): per output channel, symmetric, w ~ col_scale[n] * wq[n, k] with
  col_scale = max_k |w[n, k]| / 127 and wq = round(w / col_scale) in -127..127;
- activations (every call): per row, symmetric, each row on its own scale, so that a request's result does not
  depend on which other rows share its step: a[m] = max_k |x[m, k]| / 127, xq = round(x * (127 / max|x|)) (round
  half to even; a row of zeros gives zeros), in float32 from the row's bfloat16 or float32 values;
- outliers (0..8): first, each row's `outliers` largest |x| (the first index on a tie) are taken out of it (set to
  0 before its scale is found) and multiply the int8 weight rows in float32 instead: per-row int8 activations
  were most of this op's quality loss (a transformer's few large activation values take a row's whole int8 range),
  and 4 values a row recovered most of it (benchmarks/summaries/w8a8.md); they cost 4 x N multiply-adds a row;
- y[m, n] = (float(sum_k xq[m, k] wq[k, n]) * a[m] + sum_t val[m, t] wq[idx[m, t], n]) * col_scale[n]
  (+ bias[n]), in float32, rounded once to x's dtype. The int32 sum is exact (|sum| <= 127 * 127 * K), its
  conversion to float32 rounds above 2^24.
- inv_smooth (optional, [K]): x is multiplied by it channel by channel before the quantization (SmoothQuant: the
  weight's columns were multiplied by its inverse at load, so the product is unchanged).
- gated (`w8a8_mm_silu`, gate_up's product: gate the first N / 2 columns, up the rest): silu(gate) * up written
  by the epilogue, [M, N / 2], so the [M, N] product is never written and read back by a separate pass; with
  `rounded` gate and up are first rounded to x's dtype and the SiLU is fused_kernel's silu_mul arithmetic (the
  unfused path's bits), else it is computed from the float32 values (`reference_gated`).

Two builds of the one source: "avx512" (AVX-512 F/BW/VL intrinsics, 16 floats a vector and masked tails) where
/proc/cpuinfo lists those flags, else "generic" (plain loops, the int4 op's AVX2 flags for the compiler to vectorize;
the GEMM is oneDNN's either way). `PACELINE_W8A8_KERNEL=0` switches the op off: W8A8Linear (llama.py) then runs
`reference` (the same definition in torch ops, slower), so a model built for int8 steps still serves them.
"""
from __future__ import annotations

import hashlib
import os
from typing import Callable

import torch

from paceline.model import int4_kernel
from paceline.model.attention_kernel import AVX512_MATH
from paceline.model.fused_kernel import SILU_BF16_AVX512

SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

// threads for a pass over `elems` values: one below ~32k (a fork costs more than the pass)
inline int threads_for(int64_t elems) { return elems < 32768 ? 1 : std::max(1, at::get_num_threads()); }

inline float to_float(float v) { return v; }
inline float to_float(bf16 v) { return float(v); }
inline void from_float(float* p, float v) { *p = v; }
inline void from_float(bf16* p, float v) { *p = bf16(v); }  // round to nearest even

#ifdef __AVX512F__
inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const bf16* p, __mmask16 k) {
  const __m256i w = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
}
inline void store16(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
inline void store16(bf16* p, __m512 v, __mmask16 k) {  // round to nearest even, as c10::BFloat16 does (no NaNs)
  __m512i i = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  i = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(i));
}
inline __mmask16 tail(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// the outliers' search where pass 1 could not narrow it (a row with more than MAX_CAND values at or above its
// threshold, e.g. mostly zeros): `outliers` + 1 passes over buf, each taking the first index of the largest |v|
inline float take_outliers_slow(float* buf, int64_t K, int outliers, int32_t* out_idx, float* out_val) {
  float amax = 0.0f;
  for (int t = 0; t <= outliers; ++t) {
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
      mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail(K - k), buf + k)));
    amax = _mm512_reduce_max_ps(mx);
    if (t == outliers) break;
    int64_t at = 0;
    const __m512 target = _mm512_set1_ps(amax);
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 hit = _mm512_mask_cmp_ps_mask(tail(K - k), _mm512_abs_ps(_mm512_maskz_loadu_ps(tail(K - k), buf + k)),
                                                    target, _CMP_EQ_OQ);
      if (hit) { at = k + __builtin_ctz(unsigned(hit)); break; }
    }
    out_idx[t] = int32_t(at);
    out_val[t] = buf[at];
    buf[at] = 0.0f;
  }
  return amax;
}

// candidates kept by the threshold pass before a row falls back to take_outliers_slow
constexpr int MAX_CAND = 64;

// one row: v = x * s (s = inv_smooth or 1) into buf; the `outliers` largest |v| are taken out (their index and
// value kept, 0 left in their place, the first index on a tie); q = round(v * 127 / max|v|) over the rest; returns
// max|v| / 127 of the rest.
// Why three passes and not outliers + 1 searches (the first version; that search was most of this function's
// time): the 16 lanes' largest |v| are 16 distinct values of the row, so the (outliers + 1)-th largest of them, tau,
// is at most the row's (outliers + 1)-th largest |v|: every value taken out, and the largest one left, is >= tau.
// One pass finds the lanes' maxima (while it converts), one collects the few values >= tau in index order, and the
// choice among them is the same as searching the whole row (the first index on a tie). Bit for bit the first
// version's result; rows with more than MAX_CAND candidates (ties, zeros) run that version.
template <typename T>
inline float quantize_row(const T* x, const float* s, int64_t K, int8_t* q, float* buf, int outliers,
                          int32_t* out_idx, float* out_val) {
  __m512 mx0 = _mm512_setzero_ps(), mx1 = _mm512_setzero_ps();  // two chains: vmaxps' latency, not its throughput
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512 v0 = load16(x + k, 0xFFFF), v1 = load16(x + k + 16, 0xFFFF);
    if (s) {
      v0 = _mm512_mul_ps(v0, _mm512_loadu_ps(s + k));
      v1 = _mm512_mul_ps(v1, _mm512_loadu_ps(s + k + 16));
    }
    _mm512_storeu_ps(buf + k, v0);
    _mm512_storeu_ps(buf + k + 16, v1);
    mx0 = _mm512_max_ps(mx0, _mm512_abs_ps(v0));
    mx1 = _mm512_max_ps(mx1, _mm512_abs_ps(v1));
  }
  for (; k < K; k += 16) {
    const __mmask16 m = tail(K - k);
    __m512 v = load16(x + k, m);
    if (s) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, s + k));
    _mm512_mask_storeu_ps(buf + k, m, v);
    mx0 = _mm512_max_ps(mx0, _mm512_abs_ps(v));  // masked-off lanes are 0: never above a real |v|
  }
  const __m512 mx = _mm512_max_ps(mx0, mx1);
  float amax = _mm512_reduce_max_ps(mx);
  if (outliers > 0) {
    alignas(64) float lane[16];
    _mm512_store_ps(lane, mx);
    std::nth_element(lane, lane + outliers, lane + 16, [](float a, float b) { return a > b; });
    const float tau = lane[outliers];
    // candidates in index order: vpcompressd into a register and a plain store (its memory form is slow on Zen 4)
    alignas(64) int32_t cidx[MAX_CAND + 16];
    alignas(64) float cabs[MAX_CAND + 16];
    int nc = 0;
    const __m512 tv = _mm512_set1_ps(tau);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    bool overflow = tau <= 0.0f;  // every value is a candidate: the plain search costs no more
    for (k = 0; k < K && !overflow; k += 16) {
      const __mmask16 m = tail(K - k);
      const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(m, buf + k));
      const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, a, tv, _CMP_GE_OQ);
      if (!hit) continue;
      const int cnt = __builtin_popcount(unsigned(hit));
      if (nc + cnt > MAX_CAND) { overflow = true; break; }
      _mm512_storeu_si512(cidx + nc, _mm512_maskz_compress_epi32(hit, _mm512_add_epi32(iota, _mm512_set1_epi32(int32_t(k)))));
      _mm512_storeu_ps(cabs + nc, _mm512_maskz_compress_ps(hit, a));
      nc += cnt;
    }
    if (overflow) {
      amax = take_outliers_slow(buf, K, outliers, out_idx, out_val);
    } else {
      for (int t = 0; t < outliers; ++t) {
        int best = 0;  // strictly larger only: the first index on a tie
        for (int j = 1; j < nc; ++j) if (cabs[j] > cabs[best]) best = j;
        out_idx[t] = cidx[best];
        out_val[t] = buf[cidx[best]];
        buf[cidx[best]] = 0.0f;
        cabs[best] = -1.0f;  // taken
      }
      amax = 0.0f;  // at least one candidate is left (nc >= outliers + 1), and it is >= every non-candidate
      for (int j = 0; j < nc; ++j) amax = std::max(amax, cabs[j]);
    }
  }
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  for (k = 0; k < K; k += 16) {
    const __mmask16 m = tail(K - k);
    const __m512 v = _mm512_maskz_loadu_ps(m, buf + k);
    // cvtps rounds half to even (the default MXCSR mode); |v * inv| <= 127, so the narrowing never saturates
    _mm_mask_storeu_epi8(q + k, m, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv))));
  }
  return amax / 127.0f;
}

// columns n..n+15 (mask m) of one row: (float(acc) * a + sum_t val[t] * wq[idx[t], n]) * cs (+ b), float32;
// wq [K, ldw] contiguous
inline __m512 scaled16(const int32_t* acc, __m512 av, const float* cs, const float* b, int64_t n, __mmask16 m,
                       int outliers, const int32_t* idx, const float* val, const int8_t* wq, int64_t ldw) {
  __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(m, acc + n)), av);
  for (int t = 0; t < outliers; ++t) {
    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, wq + int64_t(idx[t]) * ldw + n)));
    v = _mm512_fmadd_ps(_mm512_set1_ps(val[t]), w, v);
  }
  v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, cs + n));
  if (b) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, b + n));
  return v;
}

// one row: y = (float(acc) * a + sum_t val[t] * wq[idx[t], :]) * cs (+ b); wq [K, N] contiguous
template <typename T>
inline void scale_row(const int32_t* acc, float a, const float* cs, const float* b, int64_t N, T* y,
                      int outliers, const int32_t* idx, const float* val, const int8_t* wq) {
  const __m512 av = _mm512_set1_ps(a);
  for (int64_t n = 0; n < N; n += 16) {
    const __mmask16 m = tail(N - n);
    store16(y + n, scaled16(acc, av, cs, b, n, m, outliers, idx, val, wq, N), m);
  }
}

""" + AVX512_MATH + SILU_BF16_AVX512 + r"""
// a float32 vector rounded to bfloat16 (nearest even, as store16) and kept as float32
inline __m512 round_bf16(__m512 v) {
  __m512i i = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(i, 16), _mm512_set1_epi32(1));
  i = _mm512_add_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(i, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
inline __m512 round_to(__m512 v, const float*) { return v; }
inline __m512 round_to(__m512 v, const bf16*) { return round_bf16(v); }

// one row of a gate/up linear (gate the first I = N / 2 columns, up the rest): y[i] = silu(g[i]) * u[i], y [I].
// rounded: g and u rounded to T first and silu_mul's arithmetic (for bfloat16 its AVX-512 one, SILU_BF16_AVX512;
// for float32 e^x by exp16 and a true division): the bits of scale_row's output followed by fused_kernel's
// silu_mul, only without writing and reading back the [rows, N] product. Else from the float32 g and u, the
// reciprocal as vrcp14ps and one Newton step (~2^-28 relative) in place of vdivps.
template <typename T, bool rounded>
inline void gated_row(const int32_t* acc, float a, const float* cs, const float* b, int64_t N, T* y,
                      int outliers, const int32_t* idx, const float* val, const int8_t* wq) {
  const int64_t I = N / 2;
  const __m512 av = _mm512_set1_ps(a), one = _mm512_set1_ps(1.0f);
  for (int64_t n = 0; n < I; n += 16) {
    const __mmask16 m = tail(I - n);
    __m512 g = scaled16(acc, av, cs, b, n, m, outliers, idx, val, wq, N);
    __m512 u = scaled16(acc, av, cs, b, n + I, m, outliers, idx, val, wq, N);
    if (rounded) {
      g = round_to(g, y);
      u = round_to(u, y);
    }
    if (rounded && std::is_same<T, bf16>::value) {  // silu_mul's bfloat16 arithmetic on AVX-512
      store16(y + n, silu_mul_bf16_16(g, u), m);
      continue;
    }
    const __m512 d = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    if (rounded) {
      store16(y + n, _mm512_mul_ps(_mm512_div_ps(g, d), u), m);
    } else {
      const __m512 r0 = _mm512_rcp14_ps(d);
      const __m512 r = _mm512_mul_ps(r0, _mm512_fnmadd_ps(d, r0, _mm512_set1_ps(2.0f)));
      store16(y + n, _mm512_mul_ps(_mm512_mul_ps(g, r), u), m);
    }
  }
}
#else
template <typename T>
inline float quantize_row(const T* x, const float* s, int64_t K, int8_t* q, float* buf, int outliers,
                          int32_t* out_idx, float* out_val) {
  for (int64_t k = 0; k < K; ++k) buf[k] = s ? to_float(x[k]) * s[k] : to_float(x[k]);
  for (int t = 0; t < outliers; ++t) {
    int64_t at = 0;
    for (int64_t k = 1; k < K; ++k) if (std::fabs(buf[k]) > std::fabs(buf[at])) at = k;
    out_idx[t] = int32_t(at);
    out_val[t] = buf[at];
    buf[at] = 0.0f;
  }
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(buf[k]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t k = 0; k < K; ++k) q[k] = int8_t(std::nearbyint(buf[k] * inv));  // half to even
  return amax / 127.0f;
}

template <typename T>
inline void scale_row(const int32_t* acc, float a, const float* cs, const float* b, int64_t N, T* y,
                      int outliers, const int32_t* idx, const float* val, const int8_t* wq) {
  for (int64_t n = 0; n < N; ++n) {
    float v = float(acc[n]) * a;
    for (int t = 0; t < outliers; ++t) v += val[t] * float(wq[int64_t(idx[t]) * N + n]);
    v *= cs[n];
    if (b) v += b[n];
    from_float(y + n, v);
  }
}

inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const bf16*) { return float(bf16(v)); }

template <typename T, bool rounded>
inline void gated_row(const int32_t* acc, float a, const float* cs, const float* b, int64_t N, T* y,
                      int outliers, const int32_t* idx, const float* val, const int8_t* wq) {
  const int64_t I = N / 2;
  for (int64_t n = 0; n < I; ++n) {
    float g = float(acc[n]) * a, u = float(acc[n + I]) * a;
    for (int t = 0; t < outliers; ++t) {
      g += val[t] * float(wq[int64_t(idx[t]) * N + n]);
      u += val[t] * float(wq[int64_t(idx[t]) * N + n + I]);
    }
    g *= cs[n];
    u *= cs[n + I];
    if (b) { g += b[n]; u += b[n + I]; }
    if (rounded) { g = round_to(g, y); u = round_to(u, y); }
    from_float(y + n, g / (1.0f + std::exp(-g)) * u);
  }
}
#endif

void check_x(const at::Tensor& x, const c10::optional<at::Tensor>& inv_smooth) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 [M, K] tensor with unit column stride");
  if (inv_smooth.has_value() && inv_smooth->defined())
    TORCH_CHECK(inv_smooth->scalar_type() == at::kFloat && inv_smooth->is_contiguous() && inv_smooth->dim() == 1 &&
                inv_smooth->size(0) == x.size(1), "inv_smooth must be a contiguous float32 [K] tensor");
}

constexpr int MAX_OUTLIERS = 8;

template <typename T>
void quantize_rows(const at::Tensor& x, const float* s, int8_t* q, float* a, int outliers, int32_t* idx, float* val) {
  const int64_t M = x.size(0), K = x.size(1), ld = x.stride(0);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
#pragma omp parallel num_threads(threads_for(M * K))
  {
    std::vector<float> buf(K);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
      a[m] = quantize_row<T>(xp + m * ld, s, K, q + m * K, buf.data(), outliers, idx + m * MAX_OUTLIERS,
                             val + m * MAX_OUTLIERS);
  }
}

// x [M, K] -> (xq [M, K] int8, a [M] float32, idx [M, 8] int32, val [M, 8] float32): the activations as the GEMM
// sees them, and the `outliers` (0..8) values of each row taken out of them (the first `outliers` columns)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> w8a8_quantize(
    const at::Tensor& x, const c10::optional<at::Tensor>& inv_smooth, int64_t outliers) {
  check_x(x, inv_smooth);
  TORCH_CHECK(outliers >= 0 && outliers <= MAX_OUTLIERS && outliers < x.size(1), "outliers must be in 0..8 and < K");
  const int64_t M = x.size(0), K = x.size(1);
  auto xq = at::empty({M, K}, x.options().dtype(at::kChar));
  auto a = at::empty({M}, x.options().dtype(at::kFloat));
  auto idx = at::zeros({M, MAX_OUTLIERS}, x.options().dtype(at::kInt));
  auto val = at::zeros({M, MAX_OUTLIERS}, x.options().dtype(at::kFloat));
  const float* s = inv_smooth.has_value() && inv_smooth->defined() ? inv_smooth->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    quantize_rows<float>(x, s, xq.data_ptr<int8_t>(), a.data_ptr<float>(), int(outliers), idx.data_ptr<int32_t>(),
                         val.data_ptr<float>());
  else
    quantize_rows<bf16>(x, s, xq.data_ptr<int8_t>(), a.data_ptr<float>(), int(outliers), idx.data_ptr<int32_t>(),
                        val.data_ptr<float>());
  return {xq, a, idx, val};
}

template <typename T>
void scale_rows(const at::Tensor& acc, const float* a, const float* cs, const float* b, at::Tensor& y, int outliers,
                const int32_t* idx, const float* val, const int8_t* wq, bool gated, bool rounded) {
  const int64_t M = acc.size(0), N = acc.size(1), ldy = y.size(1);
  const int32_t* ap = acc.data_ptr<int32_t>();
  T* yp = reinterpret_cast<T*>(y.data_ptr());
#pragma omp parallel for schedule(static) num_threads(threads_for(M * N))
  for (int64_t m = 0; m < M; ++m) {
    if (gated && rounded)
      gated_row<T, true>(ap + m * N, a[m], cs, b, N, yp + m * ldy, outliers, idx + m * MAX_OUTLIERS, val + m * MAX_OUTLIERS, wq);
    else if (gated)
      gated_row<T, false>(ap + m * N, a[m], cs, b, N, yp + m * ldy, outliers, idx + m * MAX_OUTLIERS, val + m * MAX_OUTLIERS, wq);
    else
      scale_row<T>(ap + m * N, a[m], cs, b, N, yp + m * ldy, outliers, idx + m * MAX_OUTLIERS, val + m * MAX_OUTLIERS, wq);
  }
}

// x [M, K] float32 or bfloat16, wq [K, N] int8 (contiguous where outliers > 0, else any strides torch._int_mm
// takes), col_scale [N] float32, bias [N] or None, inv_smooth [K] or None, outliers 0..8 -> [M, N] in x's dtype;
// gated (N even): [M, N / 2], silu(y[:, :N/2]) * y[:, N/2:] from y rounded to x's dtype (rounded) or its float32
// values
at::Tensor product(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& col_scale,
                   const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& inv_smooth,
                   int64_t outliers, bool gated, bool rounded) {
  check_x(x, inv_smooth);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(wq.dim() == 2 && wq.scalar_type() == at::kChar && wq.size(0) == K, "wq must be an int8 [K, N] tensor");
  TORCH_CHECK(outliers == 0 || wq.is_contiguous(), "wq must be contiguous when outliers are taken out");
  const int64_t N = wq.size(1);
  TORCH_CHECK(!gated || N % 2 == 0, "a gated product needs an even N (gate, then up)");
  TORCH_CHECK(col_scale.scalar_type() == at::kFloat && col_scale.is_contiguous() && col_scale.numel() == N,
              "col_scale must be a contiguous float32 [N] tensor");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == N, "bias must have N elements");
  }
  auto y = at::empty({M, gated ? N / 2 : N}, x.options());
  if (M == 0) return y;
  auto [xq, a, idx, val] = w8a8_quantize(x, inv_smooth, outliers);
  const at::Tensor acc = at::_int_mm(xq, wq).contiguous();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int o = int(outliers);
  if (x.scalar_type() == at::kFloat)
    scale_rows<float>(acc, a.data_ptr<float>(), col_scale.data_ptr<float>(), bp, y, o, idx.data_ptr<int32_t>(),
                      val.data_ptr<float>(), wq.data_ptr<int8_t>(), gated, rounded);
  else
    scale_rows<bf16>(acc, a.data_ptr<float>(), col_scale.data_ptr<float>(), bp, y, o, idx.data_ptr<int32_t>(),
                     val.data_ptr<float>(), wq.data_ptr<int8_t>(), gated, rounded);
  return y;
}

at::Tensor w8a8_mm(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& col_scale,
                   const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& inv_smooth,
                   int64_t outliers) {
  return product(x, wq, col_scale, bias, inv_smooth, outliers, false, false);
}

at::Tensor w8a8_mm_silu(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& col_scale,
                        const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& inv_smooth,
                        int64_t outliers, bool rounded) {
  return product(x, wq, col_scale, bias, inv_smooth, outliers, true, rounded);
}

}  // namespace

TORCH_LIBRARY(NAMESPACE, m) {
  m.def("w8a8_mm(Tensor x, Tensor wq, Tensor col_scale, Tensor? bias, Tensor? inv_smooth, int outliers) -> Tensor");
  m.def("w8a8_mm_silu(Tensor x, Tensor wq, Tensor col_scale, Tensor? bias, Tensor? inv_smooth, int outliers, bool rounded) -> Tensor");
  m.def("w8a8_quantize(Tensor x, Tensor? inv_smooth, int outliers) -> (Tensor, Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) {
  m.impl("w8a8_mm", &w8a8_mm);
  m.impl("w8a8_mm_silu", &w8a8_mm_silu);
  m.impl("w8a8_quantize", &w8a8_quantize);
}
"""

ISAS = ("generic", "avx512")
# what the avx512 build needs (/proc/cpuinfo's names): 512-bit float and integer ops (avx512f), masked byte and
# word loads and stores (avx512bw, with avx512vl for their 256- and 128-bit forms)
AVX512_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")


def enabled() -> bool:
    return os.environ.get("PACELINE_W8A8_KERNEL", "1") != "0"


def isa() -> str:
    """The build this CPU runs: "avx512" where torch sees AVX-512 and the CPU lists AVX512_CPU_FLAGS, else
    "generic". PACELINE_W8A8_ISA=generic forces the plain build (A/B runs, tests)."""
    want = os.environ.get("PACELINE_W8A8_ISA", "").strip().lower()
    if want not in ("", *ISAS):
        raise ValueError(f"PACELINE_W8A8_ISA must be one of {', '.join(ISAS)}, got {want!r}")
    has = (torch.backends.cpu.get_cpu_capability() == "AVX512"
           and all(f in int4_kernel.cpu_flags() for f in AVX512_CPU_FLAGS))
    if want == "avx512" and not has:
        raise ValueError("PACELINE_W8A8_ISA=avx512 but this CPU does not report " + ", ".join(AVX512_CPU_FLAGS))
    return want or ("avx512" if has else "generic")


def build_flags(which: str) -> list[str]:
    if which not in ISAS:
        raise ValueError(f"unknown w8a8 build {which!r}")
    extra = ["-mavx512f", "-mavx512bw", "-mavx512vl"] if which == "avx512" else []
    return int4_kernel._flags() + extra


def _library(which: str):
    fl = build_flags(which)
    key = hashlib.sha256("\n".join([SOURCE, torch.__version__, *fl]).encode()).hexdigest()[:16]
    from paceline.model.cache_dir import cache_root
    return cache_root() / "kernels" / f"w8a8_mm-{key}.so", f"paceline_w8a8_{key}", fl


_ops: dict[str, Callable | None] = {}  # op_for's answers, found once per process per build


def op_for(which: str) -> Callable | None:
    """The op `(x, wq, col_scale, bias, inv_smooth, outliers) -> y` of one build, building it first if needed; None where it
    cannot be built or run (the reason is logged once). Remembered: a many-row step asks for it 120 times, and
    finding it hashes the source."""
    if which not in _ops:
        if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
            _ops[which] = None  # the generic build still compiles with the int4 op's AVX2 flags
        else:
            path, namespace, fl = _library(which)
            _ops[which] = int4_kernel.load_op(path, namespace, fl, SOURCE, "w8a8_mm",
                                              f"CPU w8a8 matmul kernel ({which}) unavailable, using torch ops")
    return _ops[which]


def load() -> Callable | None:
    """This CPU's build of the op (isa()), or None when switched off or it cannot be built here."""
    return op_for(isa()) if enabled() else None


_gated_ops: dict[str, Callable | None] = {}  # gated_op_for's answers (a gate_up linear asks every wide step)


def gated_op_for(which: str) -> Callable | None:
    """The gated op `(x, wq, col_scale, bias, inv_smooth, outliers, rounded) -> silu(y[:, :N/2]) * y[:, N/2:]` of
    one build (`reference_gated`), or None where op_for(which) is None. rounded: y rounded to x's dtype first and
    the SiLU as fused_kernel's silu_mul computes it (the unfused path's bits); else from y's float32 values."""
    if which not in _gated_ops:
        _gated_ops[which] = (None if op_for(which) is None
                             else getattr(torch.ops, _library(which)[1]).w8a8_mm_silu)
    return _gated_ops[which]


def load_gated() -> Callable | None:
    """This CPU's build of the gated op, or None when the op is switched off or cannot be built here."""
    return gated_op_for(isa()) if enabled() else None


def load_quantize(which: str | None = None) -> Callable | None:
    """The activation quantizer `(x, inv_smooth, outliers) -> (xq, a, idx [M, 8], val [M, 8])` of a build, for
    tests."""
    which = which or isa()
    if op_for(which) is None:
        return None
    return getattr(torch.ops, _library(which)[1]).w8a8_quantize


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (wq [K, N] int8, contiguous: the epilogue reads the rows of the taken-out
    inputs, and torch._int_mm ran as fast on this layout as on the transposed one; col_scale [N] float32): per
    output channel, symmetric, -127..127. A channel of zeros gets scale 1 (its codes are 0)."""
    w = w.float()
    amax = w.abs().amax(1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    wq = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return wq.t().contiguous(), scale.contiguous()


def reference(x: torch.Tensor, wq: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None = None,
              inv_smooth: torch.Tensor | None = None, outliers: int = 0) -> torch.Tensor:
    """The op's definition in torch ops (module docstring): its stand-in where it cannot build, and the tests'
    reference."""
    return _reference_f32(x, wq, col_scale, bias, inv_smooth, outliers).to(x.dtype)


def reference_gated(x: torch.Tensor, wq: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None = None,
                    inv_smooth: torch.Tensor | None = None, outliers: int = 0, rounded: bool = True) -> torch.Tensor:
    """The gated op's definition: silu(gate) * up (gate the product's first N / 2 columns) from the product rounded
    to x's dtype (rounded) or its float32 values, computed in float32 and rounded once to x's dtype."""
    y = _reference_f32(x, wq, col_scale, bias, inv_smooth, outliers)
    if rounded:
        y = y.to(x.dtype).float()
    g, u = y.chunk(2, dim=1)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


def _reference_f32(x: torch.Tensor, wq: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None,
                   inv_smooth: torch.Tensor | None, outliers: int) -> torch.Tensor:
    xf = x.float() if inv_smooth is None else x.float() * inv_smooth
    y_out = None
    if outliers:
        # each row's `outliers` largest |x| leave the int8 product and multiply the int8 weight rows in float32
        idx = xf.abs().topk(outliers, dim=1).indices
        vals = xf.gather(1, idx)
        xf = xf.scatter(1, idx, 0.0)
        y_out = (vals[:, :, None] * wq[idx.flatten()].view(*idx.shape, -1).float()).sum(1)
    amax = xf.abs().amax(1, keepdim=True)
    # a true division (127 / tensor is 127 * reciprocal in torch, another rounding than the op's)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv).to(torch.int8)
    acc = torch._int_mm(xq, wq) if x.shape[0] else torch.zeros(0, wq.shape[1], dtype=torch.int32)
    y = acc.float() * (amax / 127)
    if y_out is not None:
        y = y + y_out
    y = y * col_scale
    if bias is not None:
        y = y + bias.float()
    return y
