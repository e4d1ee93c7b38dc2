"""The elementwise work of a decoder layer as three small C++ ops for CPU: RMSNorm (with the residual add before
the second one), RoPE on the q/k heads, and SiLU(gate) * up. Built once with the system compiler and cached (the
int4 op's build: int4_kernel.load_op).

Why: torch runs `F.rms_norm` on CPU as about ten kernels (pow, mean, add, rsqrt, muls, casts) and the complex RoPE
product and SiLU * up as three or four more, each a pass over the step's activations with its own dispatch and
thread fork: about 28 kernels a layer, 840 a step of SmolLM2-135M, which is 10-15 % of a 32-row step here
(benchmarks/profile_step.py, "norms/rope/elem"). Each op below is one pass over rows in float32 registers.

Numerics: float32 math whatever the input dtype (bfloat16 inputs are widened exactly), the result rounded once to
the input's dtype; within float32 rounding of torch's ops (the sums of squares are added in another order).
- rms_norm(x, w, eps) = x * rsqrt(mean(x^2) + eps) * w, x [T, D] (any row stride), w [D].
- add_rms_norm(h, r, w, eps) = (s, rms_norm(s, w, eps)) with s = h + r rounded to h's dtype first, as `h + r` is.
- rope(qkv, rot, heads, d): the first `heads` heads of d of each row of qkv, pairs (2i, 2i + 1) rotated by
  rot [T, d / 2, 2] = (cos, sin): (a c - b s, a s + b c), as the complex product the eager path takes.
- silu_mul(gu) = silu(gu[:, :I]) * gu[:, I:] for gu [T, 2I]. bfloat16 rows on an AVX-512 CPU take a shorter
  arithmetic (SILU_BF16_AVX512: relative error < 1.3e-4 before the rounding to bfloat16's 8 bits, against the float32
  path's ~1e-7), 1.47x faster over a 1,500-token prompt's rows (benchmarks/fused_ops.py, docs/performance.md).
And one for the greedy sampler (model/sampler.py), built here rather than as a fifth library:
- argmax_rows(x) = torch.argmax(x, -1) for float32 logits [M, V] (first index of the largest, NaN the largest).
- sample_rows(x, inv_temp, u): a draw per row from softmax(x * inv_temp) by its inverse CDF at u (the sampler's
  plain-temperature rows: one pass for the max, one for the weights and their block sums, a walk for the index;
  torch's divide, softmax, cumsum and search took ~6 ms over 32 x 49152 logits, 2026-11-25).

No compiler, a failed build or a CPU without AVX2: load() gives None and the layer runs torch's ops.
`PACELINE_FUSED_KERNEL=0` switches it off (for A/B runs).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import NamedTuple

import torch

from paceline.model import int4_kernel
from paceline.model.attention_kernel import AVX2_MATH, EXP2_DEG4

# silu(g) * u for 16 float32 lanes whose result is rounded to bfloat16 (a bfloat16 model's SiLU * up): silu_mul's
# AVX-512 path and the int8 op's fused epilogue (w8a8_kernel.py) paste this one definition, so their bits agree.
# Why not exp16 and a division as the float32 path does: the result keeps 8 significant bits, so e^-g as 2^t by a
# degree-4 polynomial (relative error < 5e-5) and 1 / (1 + e^-g) by vrcp14ps (< 2^-14, and the same bits on every
# AVX-512 CPU) cost a third of the instructions, where vdivps alone held the 1,500-row pass (~0.7 ms a layer) to
# the divider's rate. The clamps keep t finite for infinite g (silu(-inf) = -inf, silu(inf) = inf).
SILU_BF16_AVX512 = EXP2_DEG4 + r"""
__attribute__((target("avx512f"))) inline __m512 silu_mul_bf16_16(__m512 g, __m512 u) {
  __m512 t = _mm512_mul_ps(g, _mm512_set1_ps(-1.44269504088896341f));  // e^-g = 2^t
  t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(126.0f));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), exp2_deg4(t));
  return _mm512_mul_ps(_mm512_mul_ps(g, _mm512_rcp14_ps(d)), u);
}
"""

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
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) {  // round to nearest even, as c10::BFloat16's conversion does (no NaN inputs)
  __m256i i = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1));
  i = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

""" + AVX2_MATH + SILU_BF16_AVX512 + r"""
// threads for a pass over `elems` values: one below ~32k (a fork costs more than the pass)
inline int threads_for(int64_t elems) { return elems < 32768 ? 1 : std::max(1, at::get_num_threads()); }

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              name, " must be a float32 or bfloat16 [T, D] tensor with unit column stride");
}

// one row: y = x * rsqrt(mean(x^2) + eps) * w (float32 math), D a multiple of 8
template <typename T, typename W>
inline void norm_row(const T* x, const W* w, T* y, int64_t D, float eps) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    const __m256 a = load8(x + i), b = load8(x + i + 8);
    s0 = _mm256_fmadd_ps(a, a, s0);
    s1 = _mm256_fmadd_ps(b, b, s1);
  }
  for (; i < D; i += 8) { const __m256 a = load8(x + i); s0 = _mm256_fmadd_ps(a, a, s0); }
  const float rstd = 1.0f / std::sqrt(hsum(_mm256_add_ps(s0, s1)) / float(D) + eps);
  const __m256 rv = _mm256_set1_ps(rstd);
  for (i = 0; i < D; i += 8) store8(y + i, _mm256_mul_ps(_mm256_mul_ps(load8(x + i), rv), load8(w + i)));
}

template <typename T, typename W>
void norm_rows(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, double eps) {
  const int64_t T_ = x.size(0), D = x.size(1), ld = x.stride(0);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const W* wp = reinterpret_cast<const W*>(w.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
#pragma omp parallel for schedule(static) num_threads(threads_for(T_ * D))
  for (int64_t t = 0; t < T_; ++t) norm_row<T, W>(xp + t * ld, wp, yp + t * D, D, float(eps));
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  check_rows(x, "x");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1) && x.size(1) % 8 == 0 &&
              (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "w must be a contiguous float32 or bfloat16 [D] tensor, D = x's columns, a multiple of 8");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w);
  auto y = at::empty({x.size(0), x.size(1)}, x.options());
  const bool xf = x.scalar_type() == at::kFloat, wf = w.scalar_type() == at::kFloat;
  if (xf && wf) norm_rows<float, float>(x, w, y, eps);
  else if (xf) norm_rows<float, bf16>(x, w, y, eps);
  else if (wf) norm_rows<bf16, float>(x, w, y, eps);
  else norm_rows<bf16, bf16>(x, w, y, eps);
  return y;
}

// s = h + r (rounded to T, as `h + r` is), then y = rms_norm(s, w), row by row: a row of s is normed while it is
// still in L1 (adding every row first and then norming them read s back from L2 or memory: one pass more over
// the hidden states a layer); the same functions, so the same bits
template <typename T, typename W>
void add_norm_rows(const at::Tensor& h, const at::Tensor& r, const at::Tensor& w, at::Tensor& s, at::Tensor& y,
                   double eps) {
  const int64_t T_ = h.size(0), D = h.size(1), lh = h.stride(0), lr = r.stride(0);
  const T* hp = reinterpret_cast<const T*>(h.data_ptr());
  const T* rp = reinterpret_cast<const T*>(r.data_ptr());
  const W* wp = reinterpret_cast<const W*>(w.data_ptr());
  T* sp = reinterpret_cast<T*>(s.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
#pragma omp parallel for schedule(static) num_threads(threads_for(T_ * D))
  for (int64_t t = 0; t < T_; ++t) {
    T* srow = sp + t * D;
    for (int64_t i = 0; i < D; i += 8) store8(srow + i, _mm256_add_ps(load8(hp + t * lh + i), load8(rp + t * lr + i)));
    norm_row<T, W>(srow, wp, yp + t * D, D, float(eps));
  }
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& r, const at::Tensor& w,
                                                double eps) {
  check_norm(h, w);
  check_rows(r, "r");
  TORCH_CHECK(r.sizes() == h.sizes() && r.scalar_type() == h.scalar_type(), "h and r must have one shape and dtype");
  auto s = at::empty({h.size(0), h.size(1)}, h.options());
  auto y = at::empty({h.size(0), h.size(1)}, h.options());
  const bool hf = h.scalar_type() == at::kFloat, wf = w.scalar_type() == at::kFloat;
  if (hf && wf) add_norm_rows<float, float>(h, r, w, s, y, eps);
  else if (hf) add_norm_rows<float, bf16>(h, r, w, s, y, eps);
  else if (wf) add_norm_rows<bf16, float>(h, r, w, s, y, eps);
  else add_norm_rows<bf16, bf16>(h, r, w, s, y, eps);
  return {s, y};
}

template <typename T>
void rope_rows(const at::Tensor& qkv, const float* rot, at::Tensor& y, int64_t heads, int64_t d) {
  const int64_t T_ = qkv.size(0), ld = qkv.stride(0), half = d / 2;
  const T* xp = reinterpret_cast<const T*>(qkv.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
#pragma omp parallel for schedule(static) num_threads(threads_for(T_ * heads * d))
  for (int64_t t = 0; t < T_; ++t) {
    const float* cs = rot + t * d;  // [d / 2] pairs (cos, sin), interleaved like the pairs they rotate
    for (int64_t hd = 0; hd < heads; ++hd) {
      const T* x = xp + t * ld + hd * d;
      T* o = yp + (t * heads + hd) * d;
      for (int64_t i = 0; i < d; i += 8) {  // 4 pairs (a, b) against 4 pairs (c, s)
        const __m256 ab = load8(x + i), c_s = _mm256_loadu_ps(cs + i);
        const __m256 cc = _mm256_moveldup_ps(c_s), ss = _mm256_movehdup_ps(c_s);  // (c, c), (s, s)
        const __m256 ba = _mm256_permute_ps(ab, 0xB1);                             // (b, a)
        // (a c - b s, b c + a s): a*c then -/+ (b*s, a*s)
        store8(o + i, _mm256_addsub_ps(_mm256_mul_ps(ab, cc), _mm256_mul_ps(ba, ss)));
      }
    }
  }
  (void)half;
}

at::Tensor rope(const at::Tensor& qkv, const at::Tensor& rot, int64_t heads, int64_t d) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(d % 8 == 0 && heads > 0 && qkv.size(1) >= heads * d, "need d a multiple of 8 and heads * d <= qkv's columns");
  TORCH_CHECK(rot.scalar_type() == at::kFloat && rot.is_contiguous() && rot.numel() == qkv.size(0) * d,
              "rot must be a contiguous float32 [T, d / 2, 2] tensor");
  auto y = at::empty({qkv.size(0), heads, d}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) rope_rows<float>(qkv, rot.data_ptr<float>(), y, heads, d);
  else rope_rows<bf16>(qkv, rot.data_ptr<float>(), y, heads, d);
  return y;
}

template <typename T>
void silu_mul_rows(const at::Tensor& gu, at::Tensor& y) {
  const int64_t T_ = gu.size(0), I = gu.size(1) / 2, ld = gu.stride(0);
  const T* xp = reinterpret_cast<const T*>(gu.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for schedule(static) num_threads(threads_for(T_ * I))
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t i = 0; i < I; i += 8) {
      const __m256 g = load8(xp + t * ld + i), u = load8(xp + t * ld + I + i);
      const __m256 sg = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      store8(yp + t * I + i, _mm256_mul_ps(sg, u));
    }
}

// bfloat16 rows on AVX-512 (silu_mul_bf16_16's arithmetic): 16 lanes a step, the last 8 of a row masked
__attribute__((target("avx512f,avx512bw,avx512vl")))
void silu_mul_rows_bf16_avx512(const at::Tensor& gu, at::Tensor& y) {
  const int64_t T_ = gu.size(0), I = gu.size(1) / 2, ld = gu.stride(0);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(gu.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
#pragma omp parallel for schedule(static) num_threads(threads_for(T_ * I))
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = I - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (I - i)) - 1);
      const uint16_t* x = xp + t * ld + i;
      const __m512i g16 = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x));
      const __m512i u16 = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x + I));
      const __m512 g = _mm512_castsi512_ps(_mm512_slli_epi32(g16, 16));
      const __m512 u = _mm512_castsi512_ps(_mm512_slli_epi32(u16, 16));
      // to bfloat16, nearest even (no NaNs), as store8
      __m512i r = _mm512_castps_si512(silu_mul_bf16_16(g, u));
      r = _mm512_add_epi32(_mm512_add_epi32(r, bias), _mm512_and_si512(_mm512_srli_epi32(r, 16), one));
      _mm256_mask_storeu_epi16(yp + t * I + i, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
    }
}

bool has_avx512bw() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "gu");
  TORCH_CHECK(gu.size(1) % 16 == 0, "gu's columns must be a multiple of 16 (gate and up, 8 each at least)");
  auto y = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  if (gu.scalar_type() == at::kFloat) silu_mul_rows<float>(gu, y);
  else if (has_avx512bw()) silu_mul_rows_bf16_avx512(gu, y);
  else silu_mul_rows<bf16>(gu, y);
  return y;
}

// the first index of each row's largest value, as torch.argmax(x, -1) gives it (a NaN counts as the largest: the
// first NaN's index), x float32 [M, V] with unit column stride. Why: the greedy sampler's torch.argmax took ~0.65 ms
// of a 32-decode step over [32, 49152] logits (one thread a row, no vectors; 2026-11-24), this ~0.09 ms. Two
// passes a row: the maximum in vectors (and whether a NaN is there), then the first position equal to it.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "x must be float32 [M, V] with V > 0 and unit column stride");
  const int64_t M = x.size(0), V = x.size(1), ld = x.stride(0);
  const float* xp = x.data_ptr<float>();
  auto out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(static) num_threads(threads_for(M * V))
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * ld;
    __m256 mx = _mm256_set1_ps(-INFINITY);
    __m256 nan = _mm256_setzero_ps();
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) {
      const __m256 a = _mm256_loadu_ps(r + v);
      mx = _mm256_max_ps(mx, a);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    float best = lanes[0];
    for (int i = 1; i < 8; ++i) best = std::max(best, lanes[i]);
    bool has_nan = _mm256_movemask_ps(nan) != 0;
    for (; v < V; ++v) {
      if (std::isnan(r[v])) has_nan = true;
      else best = std::max(best, r[v]);
    }
    int64_t at = 0;
    if (has_nan) {
      while (!std::isnan(r[at])) ++at;
    } else {
      const __m256 b = _mm256_set1_ps(best);
      int64_t u = 0;
      for (; u + 8 <= V; u += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + u), b, _CMP_EQ_OQ));
        if (hit) break;
      }
      while (r[u] != best) ++u;  // the vector with the first hit, or the tail
      at = u;
    }
    op[m] = at;
  }
  return out;
}


// A draw per row from softmax(x * inv_temp) by its inverse CDF: the first index whose cumulative weight exceeds
// u * total, where weight_v = e^((x_v - max) * inv_temp) (0 for -inf logits). The weights are kept in a per-thread
// buffer with their sums per block of 64, so the search walks blocks, then one block. -1 for a row with no finite
// positive total (NaN logits): the caller keeps its argmax.
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& inv_temp, const at::Tensor& u) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.size(1) > 0 &&
              x.size(1) % 8 == 0, "x must be float32 [M, V] with V a positive multiple of 8 and unit column stride");
  const int64_t M = x.size(0), V = x.size(1), ld = x.stride(0), B = 64, NB = (V + B - 1) / B;
  TORCH_CHECK(inv_temp.scalar_type() == at::kFloat && inv_temp.is_contiguous() && inv_temp.numel() == M &&
              u.scalar_type() == at::kFloat && u.is_contiguous() && u.numel() == M,
              "inv_temp and u must be contiguous float32 [M]");
  const float* xp = x.data_ptr<float>();
  const float* tp = inv_temp.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  auto out = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
#pragma omp parallel num_threads(threads_for(M * V))
  {
    std::vector<float> w(V), bsum(NB);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      const float* r = xp + m * ld;
      __m256 mx = _mm256_set1_ps(-INFINITY);
      for (int64_t v = 0; v < V; v += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(r + v));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mx);
      float best = lanes[0];
      for (int i = 1; i < 8; ++i) best = std::max(best, lanes[i]);
      if (!std::isfinite(best)) { op[m] = -1; continue; }
      const __m256 bv = _mm256_set1_ps(best), it = _mm256_set1_ps(tp[m]), ninf = _mm256_set1_ps(-INFINITY);
      float total = 0.0f;
      for (int64_t b = 0; b < NB; ++b) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t v = b * B; v < std::min(V, (b + 1) * B); v += 8) {
          const __m256 xv = _mm256_loadu_ps(r + v);
          const __m256 e = _mm256_and_ps(_mm256_cmp_ps(xv, ninf, _CMP_NEQ_OQ),  // -inf and NaN weigh 0
                                         exp8(_mm256_mul_ps(_mm256_sub_ps(xv, bv), it)));
          _mm256_storeu_ps(w.data() + v, e);
          acc = _mm256_add_ps(acc, e);
        }
        bsum[b] = hsum(acc);
        total += bsum[b];
      }
      if (!(total > 0.0f) || !std::isfinite(total)) { op[m] = -1; continue; }
      const float target = up[m] * total;
      float run = 0.0f;
      int64_t b = 0;
      while (b + 1 < NB && run + bsum[b] <= target) run += bsum[b++];
      int64_t at = -1, v = b * B;
      for (const int64_t end = std::min(V, v + B); v < end; ++v) {
        if (w[v] > 0.0f) at = v;  // the block's last positive weight, if the sums' rounding overshoots it
        run += w[v];
        if (w[v] > 0.0f && run > target) break;
      }
      for (int64_t k = V - 1; at < 0 && k >= 0; --k)  // the last block's sum rounded to 0: the last positive weight
        if (w[k] > 0.0f) at = k;
      op[m] = at;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor h, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor qkv, Tensor rot, int heads, int d) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("sample_rows(Tensor x, Tensor inv_temp, Tensor u) -> Tensor");
}
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("sample_rows", &sample_rows);
}
"""


class FusedOps(NamedTuple):
    rms_norm: object
    add_rms_norm: object
    rope: object
    silu_mul: object
    argmax_rows: object  # the greedy sampler's (model/sampler.py), not the layers'
    sample_rows: object  # the sampler's draw for rows with a temperature and no top-k/top-p/min-p


def enabled() -> bool:
    return os.environ.get("PACELINE_FUSED_KERNEL", "1") != "0"


def _library_path() -> tuple[Path, str, list[str]]:
    from paceline.model.cache_dir import cache_root
    flags = int4_kernel._flags()
    key = hashlib.sha256("\n".join([SOURCE, torch.__version__, *flags]).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"fused-{key}.so", f"paceline_fused_{key}", flags


def load() -> FusedOps | None:
    """The ops, building them first if needed; None when switched off or they cannot be built or run here
    (the reason is logged once)."""
    if not enabled() or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    path, namespace, flags = _library_path()
    first = int4_kernel.load_op(path, namespace, flags, SOURCE, "rms_norm",
                                "CPU fused norm/rope/silu kernels unavailable, using torch's ops")
    if first is None:
        return None
    ns = getattr(torch.ops, namespace)
    return FusedOps(ns.rms_norm, ns.add_rms_norm, ns.rope, ns.silu_mul, ns.argmax_rows, ns.sample_rows)


def supports(hidden: int, head_dim: int, intermediate: int) -> bool:
    """Whether a model's sizes fit the ops (whole vectors of 8)."""
    return hidden % 8 == 0 and head_dim % 8 == 0 and intermediate % 8 == 0
