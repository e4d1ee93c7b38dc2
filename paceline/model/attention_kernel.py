"""A small C++ paged-attention op for CPU, built once with the system compiler and cached on disk.

Why: on CPU, torch has no kernel that reads a paged KV cache in place, so the eager path (attention.py) gathers
each request's context into a contiguous buffer per layer and then calls SDPA, once per decode group: a copy of
every context position, then a second read of it, and a handful of ops per group per layer. This op reads K/V
straight from the cache through the block table, shares each KV head between the query heads of its GQA group,
and runs the whole flat batch (prompt chunks and decodes) in one call per layer, with a flash-style online
softmax in float32 over chunks of 64 positions that stay in L1.

Prompt chunks (work items of more than FEW_TOKENS tokens, one KV head) take a second loop nest, `attend_tiles`:
the item's query rows (tokens x GQA group, 48 for SmolLM2's 16-token items) are kept transposed, so scores and
P.V are small register-blocked GEMMs (a broadcast key/value element times vectors of rows, up to 24 accumulators)
and the online softmax runs along the rows in whole vectors; the decode loops reduce each score horizontally and
reuse a key over at most 3 rows. Built for AVX-512 where /proc/cpuinfo lists avx512f/bw/vl (16-float vectors, 32
registers), and with AVX512_BF16 a bfloat16 cache's chunks whose queries are bfloat16 values (a bfloat16 model's)
use pair dot products (vdpbf16ps), twice float32's multiply-adds per instruction; P is then rounded to bfloat16
for P.V, as torch's bfloat16 SDPA does. There a sequence whose chunk spans two items or more per KV head first
packs its context once (K rows contiguous, V rows interleaved into the pairs P.V needs) for all of its items. The
tiles' softmax runs in base 2 (scores scaled by log2 e), so exp is a split by vreduceps, a short polynomial and
scalef.

Decodes (items of up to FEW_TOKENS tokens) in the AVX-512 build take a third loop nest, `attend_rows`, where
head_dim is 32, 64 or 128: a decode has only its GQA group's rows (3), too few for row vectors, so the context
runs in tiles of 16 positions with the positions in the lanes: one key row loaded per position serves all rows,
each row's 16 dot products are folded into one score vector, and mask, exp and sums cost one vector op per 16
positions (the AVX2 loops pay a horizontal sum per score and scalar softmax bookkeeping per position; 1.5-1.7x on
bf16 decodes with K/V in cache). A bfloat16 cache with bfloat16 queries uses pair dot products there too. Other
head sizes and the AVX2 build keep the AVX2 loops. `PACELINE_ATTN_ISA=avx2` forces the AVX2 build (what AVX2-only
machines run; tests and A/B runs); the ISA is part of the library's name.

The build: the source below is compiled with g++/c++ into `<cache>/kernels/paged_attention-<isa>-<key>.so` (the key
hashes the source, the flags and torch's version), under a file lock, the first time a process needs it; later
starts only load the library (milliseconds). With no compiler, a failed build or an unsupported shape, callers
get None and use the eager path. `PACELINE_ATTN_KERNEL=0` switches it off (for A/B runs).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

import torch

from paceline.model import int4_kernel

log = logging.getLogger("paceline.attention")

# e^x and a horizontal sum in AVX2 registers, for every C++ op that needs them (pasted into their sources)
AVX2_MATH = r"""
// e^x for any float x: clamped to [-87, 88], 2^n * e^r with n = round(x log2 e), |r| <= ln2 / 2, degree-6 Taylor
// polynomial (relative error ~1e-7)
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
"""

# e^x in AVX-512 registers, for every C++ op that needs it (pasted into their sources inside #ifdef __AVX512F__): the
# same steps as exp8, with 2^n applied by vscalefps (so the same values where exp8's clamps keep it finite)
AVX512_MATH = r"""
// e^x for finite x: no clamps (scalef takes any n: a very negative x gives 0, a large one inf, never NaN)
inline __m512 exp16_finite(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
// e^x for any float x, exp8's clamps first
inline __m512 exp16(__m512 x) {
  return exp16_finite(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)));
}
"""

# 2^t with a degree-4 polynomial, for values rounded to bfloat16 right after (the AMX attention's P, the bf16 SiLU):
# 8 significant bits need no more. Pasted into those sources; the target attribute lets a source built for AVX2
# (fused_kernel's) hold it beside its AVX2 code, to be called only where the CPU has AVX-512.
EXP2_DEG4 = r"""
// 2^t for finite t (scalef takes a very negative n to 0, a large one to inf): round to n, f = t - n in [-0.5, 0.5],
// degree-4 Taylor polynomial of 2^f (relative error < 5e-5), times 2^n
__attribute__((target("avx512f"))) inline __m512 exp2_deg4(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.6181291076284772e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
"""

SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int KC = 64;   // context positions per chunk: their K/V rows stay in L1 while every query row reads them
constexpr int TQ = 16;   // query tokens of one chunk per work item (x the GQA group = rows sharing those K/V reads)
constexpr int PREFETCH = 16;  // positions ahead whose K/V rows are prefetched (into L2: attend() below)
constexpr int FEW_TOKENS = 4;  // slices of up to this many tokens may take all KV heads in one item (see the op)

inline void to_float(const float* src, float* dst, int d) { std::memcpy(dst, src, sizeof(float) * d); }
inline void to_float(const c10::BFloat16* src, float* dst, int d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int i = 0;
#ifdef __AVX2__
  for (; i + 8 <= d; i += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
#endif
  for (; i < d; ++i) { uint32_t b = uint32_t(s[i]) << 16; std::memcpy(dst + i, &b, 4); }
}
inline void to_float(const c10::Half* src, float* dst, int d) {
  int i = 0;
#ifdef __AVX2__
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < d; ++i) dst[i] = float(src[i]);
}

#ifdef __AVX2__
""" + AVX2_MATH + r"""
// [sum(a[0]), ..., sum(a[7])]
inline __m256 reduce8(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// s[r][j] = q[r] . k[j] for NR query rows (the query heads of one token that share a KV head) and j < n:
// each key vector loaded once serves all NR rows; d a multiple of 8
template <int NR>
inline void scores(const float* const* q, const float* const* k, int n, int d, float* const* s) {
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 a[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int u = 0; u < 4; ++u) a[r][u] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
      __m256 qv[NR];
      for (int r = 0; r < NR; ++r) qv[r] = _mm256_loadu_ps(q[r] + i);
      for (int u = 0; u < 4; ++u) {
        const __m256 kv = _mm256_loadu_ps(k[j + u] + i);
        for (int r = 0; r < NR; ++r) a[r][u] = _mm256_fmadd_ps(qv[r], kv, a[r][u]);
      }
    }
    for (int r = 0; r < NR; ++r) _mm_storeu_ps(s[r] + j, reduce4(a[r][0], a[r][1], a[r][2], a[r][3]));
  }
  for (; j < n; ++j) {
    __m256 a[NR];
    for (int r = 0; r < NR; ++r) a[r] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
      const __m256 kv = _mm256_loadu_ps(k[j] + i);
      for (int r = 0; r < NR; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q[r] + i), kv, a[r]);
    }
    for (int r = 0; r < NR; ++r) s[r][j] = hsum(a[r]);
  }
}

inline float max_of(const float* s, int n, float m) {
  int j = 0;
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(s);
    for (j = 8; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    m = std::max(m, _mm_cvtss_f32(h));
  }
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// s[j] = exp(s[j] - m) for j < n; returns their sum
inline float exp_sub(float* s, int n, float m) {
  __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; j < n; ++j) { s[j] = std::exp(s[j] - m); sum += s[j]; }
  return sum;
}

// acc[r][c..c+8W) = alpha[r] * acc[r] + sum_j p[r][j] v[j][c..c+8W) for NR rows: each V vector loaded once serves
// all NR rows
template <int NR, int W>
inline void pv_slab(const float* const* p, const float* const* v, int n, int c, const float* alpha, float* const* acc) {
  __m256 a[NR][W];
  for (int r = 0; r < NR; ++r) {
    const __m256 al = _mm256_set1_ps(alpha[r]);
    for (int w = 0; w < W; ++w) a[r][w] = _mm256_mul_ps(al, _mm256_loadu_ps(acc[r] + c + 8 * w));
  }
  for (int j = 0; j < n; ++j) {
    __m256 vv[W];
    for (int w = 0; w < W; ++w) vv[w] = _mm256_loadu_ps(v[j] + c + 8 * w);
    for (int r = 0; r < NR; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p[r] + j);
      for (int w = 0; w < W; ++w) a[r][w] = _mm256_fmadd_ps(pj, vv[w], a[r][w]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc[r] + c + 8 * w, a[r][w]);
}

// slabs of W vectors: 8-9 independent accumulators keep both FMA pipes busy (4-cycle latency) and leave
// registers for the V vectors and the broadcast weight; then one slab for what is left of d
template <int NR>
inline void pv(const float* const* p, const float* const* v, int n, int d, const float* alpha, float* const* acc) {
  constexpr int W = NR == 1 ? 8 : NR == 2 ? 4 : 3;
  int c = 0;
  for (; c + 8 * W <= d; c += 8 * W) pv_slab<NR, W>(p, v, n, c, alpha, acc);
  for (; c + 16 <= d; c += 16) pv_slab<NR, 2>(p, v, n, c, alpha, acc);
  if (c < d) pv_slab<NR, 1>(p, v, n, c, alpha, acc);
}
#endif

// ---- prompt chunks: row-vectorised tiles (AVX-512 where built with it, else AVX2) ----
//
// A work item of several tokens (a prompt chunk's slice of up to TQ tokens, one KV head) keeps its R = tokens x
// group query rows TRANSPOSED: q^T [d][R], scores^T [positions][R], out^T [d][R], so every step runs along the
// rows in whole vectors. Scores are a small GEMM: for each of JB keys, one broadcast key element times RV vectors
// of query rows, JB x RV independent accumulators in registers, each key row read once for all R rows (the
// dot-product loops above reduce every score horizontally and reuse a key over 3 rows only). P.V likewise: one
// broadcast V element times RV vectors of probabilities. The online softmax (max, exp, sum, rescale) is then
// vectorised over rows too, and the causal mask is a compare per position on the diagonal chunks only.
#if defined(__AVX512F__)
""" + AVX512_MATH + r"""
#define PL_TILE 1
using vf = __m512;
constexpr int VW = 16;
constexpr int RV_MAX = 4;  // row vectors per panel: JB x RV accumulators + RV loads within 32 registers
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
// a where pos <= lim, else b
inline vf vsel_le(vf pos, vf lim, vf a, vf b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(pos, lim, _CMP_LE_OQ), b, a); }
// whether a < b in any lane
inline bool vany_lt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ) != 0; }
// vexp_finite: the prompt tiles' exp of s - max, where s and max are finite and lanes past the mask are dropped after
inline vf vexp_finite(vf x) { return exp16_finite(x); }
inline vf vexp(vf x) { return exp16(x); }
// The prompt tiles' softmax runs in base 2: scores are scaled by log2 e along with 1/sqrt(d), so that e^x is
// 2^t = 2^f 2^floor(t) with f = t - floor(t) in [0, 1) (vreduceps, exact) and no range reduction by ln 2; 2^f by
// a degree-DEG polynomial fitted for relative error on [0, 1), times 2^floor(t) by scalef (a very negative t
// gives 0, never NaN). Relative error with float32 Horner steps (numpy check, 2026-11-24): degree 5 1.5e-7 (the
// degree-6 Taylor e^x above: 1.2e-7), degree 3 7.5e-5, a fiftieth of bfloat16's rounding of P. Degree 5 plus
// the fmsub costs 8 ops per vector where the e^x path costs 12, degree 3 costs 6.
constexpr float SOFTMAX_UNIT = 1.44269504088896341f;  // score units per nat
template <int DEG>
inline vf vexp_unit(vf t) {  // e^(t / SOFTMAX_UNIT) = 2^t for finite t
#ifdef __AVX512DQ__
  const vf f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
#else
  const vf f = _mm512_sub_ps(t, _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#endif
  vf p;
  if constexpr (DEG == 3) {
    p = _mm512_fmadd_ps(_mm512_set1_ps(7.802402973e-02f), f, _mm512_set1_ps(2.260670662e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958339810e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999251366e-01f));
  } else {
    static_assert(DEG == 5, "degree 3 or 5");
    p = _mm512_fmadd_ps(_mm512_set1_ps(1.877572737e-03f), f, _mm512_set1_ps(8.989344351e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.582631752e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.401536107e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931530833e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999999404e-01f));
  }
  return _mm512_scalef_ps(p, t);
}
// s * a - b
inline vf vfmsub(vf s, vf a, vf b) { return _mm512_fmsub_ps(s, a, b); }
// keys per score block and V columns per P.V block, by row vectors per panel: at most 24 accumulators
constexpr int jb_for(int rv) { return rv <= 2 ? 12 : rv == 3 ? 8 : 6; }
constexpr int cb_for(int rv) { return rv <= 3 ? 8 : 4; }
#elif defined(__AVX2__)
#define PL_TILE 1
using vf = __m256;
constexpr int VW = 8;
constexpr int RV_MAX = 2;  // 16 registers: JB x RV accumulators + RV loads + a broadcast
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vsel_le(vf pos, vf lim, vf a, vf b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(pos, lim, _CMP_LE_OQ)); }
inline bool vany_lt(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_LT_OQ)) != 0; }
inline vf vexp(vf x) { return exp8(x); }
inline vf vexp_finite(vf x) { return exp8(x); }  // exp8 builds 2^n from exponent bits: it needs its clamps
inline vf vfmsub(vf s, vf a, vf b) { return _mm256_fmsub_ps(s, a, b); }
constexpr float SOFTMAX_UNIT = 1.0f;  // natural units: exp8 has its own range reduction
template <int DEG> inline vf vexp_unit(vf t) { return exp8(t); }
constexpr int jb_for(int rv) { return rv == 1 ? 10 : 6; }
constexpr int cb_for(int rv) { return rv == 1 ? 8 : 4; }
#endif

#ifdef PL_TILE
// st[u][.] = sum_i k[u][i] * qt[i][.] for JB keys u, RV row vectors
template <int RV, int JB>
inline void tile_scores(const float* qt, int ld, const float* const* k, int d, float* st) {
  vf a[JB][RV];
  for (int u = 0; u < JB; ++u)
    for (int r = 0; r < RV; ++r) a[u][r] = vzero();
  for (int i = 0; i < d; ++i) {
    vf qv[RV];
    for (int r = 0; r < RV; ++r) qv[r] = vload(qt + size_t(i) * ld + r * VW);
    for (int u = 0; u < JB; ++u) {
      const vf kb = vset1(k[u][i]);
      for (int r = 0; r < RV; ++r) a[u][r] = vfma(kb, qv[r], a[u][r]);
    }
  }
  for (int u = 0; u < JB; ++u)
    for (int r = 0; r < RV; ++r) vstore(st + size_t(u) * ld + r * VW, a[u][r]);
}

// ot[c0 + u][.] = alpha * ot[c0 + u][.] + sum_j v[j][c0 + u] * pt[j][.] for CB columns u, RV row vectors (alpha
// null: 1)
template <int RV, int CB>
inline void tile_pv(const float* pt, int ld, const float* const* v, int n, int c0, const vf* alpha, float* ot) {
  vf a[CB][RV];
  for (int u = 0; u < CB; ++u)
    for (int r = 0; r < RV; ++r) {
      const vf x = vload(ot + size_t(c0 + u) * ld + r * VW);
      a[u][r] = alpha ? vmul(alpha[r], x) : x;
    }
  for (int j = 0; j < n; ++j) {
    vf pv[RV];
    for (int r = 0; r < RV; ++r) pv[r] = vload(pt + size_t(j) * ld + r * VW);
    for (int u = 0; u < CB; ++u) {
      const vf vb = vset1(v[j][c0 + u]);
      for (int r = 0; r < RV; ++r) a[u][r] = vfma(vb, pv[r], a[u][r]);
    }
  }
  for (int u = 0; u < CB; ++u)
    for (int r = 0; r < RV; ++r) vstore(ot + size_t(c0 + u) * ld + r * VW, a[u][r]);
}

#if defined(__AVX512BF16__)
#define PL_BF16_DOT 1
// bfloat16 pair dot products (vdpbf16ps: 16 lanes, each a += x[2l] y[2l] + x[2l+1] y[2l+1], products exact in
// float32) for a bfloat16 cache when the item's queries are bfloat16 values (a bfloat16 model's, widened): twice
// the multiply-adds per instruction of float32 FMAs. Scores are exact products of the stored values; P is rounded
// to bfloat16 for P.V (the same rounding torch's bfloat16 SDPA makes), its sum stays float32.
// q^T as pairs: qp[i/2][r] = (q[r][i], q[r][i+1]); keys read in place, each dword one pair of a key row
template <int RV, int JB>
inline void dot_scores(const uint32_t* qp, int ld, const uint32_t* const* k, int d2, float* st) {
  vf a[JB][RV];
  for (int u = 0; u < JB; ++u)
    for (int r = 0; r < RV; ++r) a[u][r] = vzero();
  for (int i = 0; i < d2; ++i) {
    __m512bh qv[RV];
    for (int r = 0; r < RV; ++r) qv[r] = (__m512bh)_mm512_loadu_si512(qp + size_t(i) * ld + r * VW);
    for (int u = 0; u < JB; ++u) {
      const __m512bh kb = (__m512bh)_mm512_set1_epi32(int(k[u][i]));
      for (int r = 0; r < RV; ++r) a[u][r] = _mm512_dpbf16_ps(a[u][r], kb, qv[r]);
    }
  }
  for (int u = 0; u < JB; ++u)
    for (int r = 0; r < RV; ++r) vstore(st + size_t(u) * ld + r * VW, a[u][r]);
}

// ot[c0 + u][.] = alpha * ot[c0 + u][.] + sum over position pairs of (v[j][c], v[j+1][c]) . (p[j][.], p[j+1][.]);
// pp[j/2][r] and vp[j/2][c] hold the pairs; alpha null: 1
template <int RV, int CB>
inline void dot_pv(const uint32_t* pp, int ld, const uint32_t* vp, int d, int n2, int c0, const vf* alpha, float* ot) {
  vf a[CB][RV];
  for (int u = 0; u < CB; ++u)
    for (int r = 0; r < RV; ++r) {
      const vf x = vload(ot + size_t(c0 + u) * ld + r * VW);
      a[u][r] = alpha ? vmul(alpha[r], x) : x;
    }
  for (int j = 0; j < n2; ++j) {
    __m512bh pv[RV];
    for (int r = 0; r < RV; ++r) pv[r] = (__m512bh)_mm512_loadu_si512(pp + size_t(j) * ld + r * VW);
    for (int u = 0; u < CB; ++u) {
      const __m512bh vb = (__m512bh)_mm512_set1_epi32(int(vp[size_t(j) * d + c0 + u]));
      for (int r = 0; r < RV; ++r) a[u][r] = _mm512_dpbf16_ps(a[u][r], vb, pv[r]);
    }
  }
  for (int u = 0; u < CB; ++u)
    for (int r = 0; r < RV; ++r) vstore(ot + size_t(c0 + u) * ld + r * VW, a[u][r]);
}

// vp[c] = (a[c], b[c]) for c < d (d a multiple of 32): two V rows interleaved into pairs
inline void pair_rows(const uint16_t* a, const uint16_t* b, uint32_t* vp, int d) {
  alignas(64) static const uint16_t lo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                              8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                              24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i il = _mm512_load_si512(lo), ih = _mm512_load_si512(hi);
  for (int c = 0; c < d; c += 32) {
    const __m512i x = _mm512_loadu_si512(a + c), y = _mm512_loadu_si512(b + c);
    _mm512_storeu_si512(vp + c, _mm512_permutex2var_epi16(x, il, y));
    _mm512_storeu_si512(vp + c + 16, _mm512_permutex2var_epi16(x, ih, y));
  }
}

// whether every query value of an item is a bfloat16 (its low 16 bits zero)
inline bool queries_are_bf16(const float* q, int64_t q_stride, int row0, int ntok, int64_t col0, int width) {
  for (int t = 0; t < ntok; ++t) {
    const uint32_t* s = reinterpret_cast<const uint32_t*>(q + (int64_t(row0) + t) * q_stride + col0);
    uint32_t any = 0;
    for (int i = 0; i < width; ++i) any |= s[i] & 0xffffu;
    if (any) return false;
  }
  return true;
}
#endif

// The float32 operands of one chunk for tile_panel, or (bf16) its bfloat16 pairs
struct TileChunk {
  const float* const* k;  // n key rows, then zero rows up to a whole score block
  const float* const* v;  // n value rows
  const uint32_t* qp = nullptr;  // bf16: q^T pairs [d/2][ld] (unscaled), else null
  const uint32_t* const* kd = nullptr;  // bf16: key rows as pairs, padded like k
  const uint32_t* vp = nullptr;  // bf16: value pairs [(n+1)/2][d]
  uint32_t* pp = nullptr;  // bf16: room for P pairs [(n+1)/2][ld]
};

// One panel (RV row vectors, starting at row vector rv0) of one chunk of n positions c0..c0+n-1: scores, online
// softmax, P.V. pos[r] is row r's last visible position (rows past the item's are +inf), diag whether any row of
// the item may not see the whole chunk; sc scales the scores (1 when q^T holds scaled queries).
template <int RV>
void tile_panel(const float* qt, float* st, float* ot, float* m, float* l, const float* pos, int ld, int rv0,
                const TileChunk& ch, int n, int d, int c0, bool diag, float sc) {
  constexpr int JB = jb_for(RV), CB = cb_for(RV);
  const int o = rv0 * VW;
  st += o; ot += o; m += o; l += o; pos += o;
#ifdef PL_BF16_DOT
  if (ch.qp) {
    for (int j = 0; j < n; j += JB) dot_scores<RV, JB>(ch.qp + o, ld, ch.kd + j, d / 2, st + size_t(j) * ld);
  } else
#endif
    for (int j = 0; j < n; j += JB) tile_scores<RV, JB>(qt + o, ld, ch.k + j, d, st + size_t(j) * ld);
  vf alpha[RV];
  bool rescale = false;
  // scv scales unscaled scores into SOFTMAX_UNIT units; m holds the running max in those units
  const vf ninf = vset1(-std::numeric_limits<float>::infinity()), zero = vzero(), scv = vset1(sc * SOFTMAX_UNIT);
#ifdef PL_BF16_DOT
  // the bfloat16 pairs of P: 32 words (p_j lanes 0-15, then p_j+1's) into 16 dwords (p_j[r], p_j+1[r])
  const __m512i pair_idx = _mm512_setr_epi32(0x100000, 0x110001, 0x120002, 0x130003, 0x140004, 0x150005, 0x160006,
                                             0x170007, 0x180008, 0x190009, 0x1a000a, 0x1b000b, 0x1c000c, 0x1d000d,
                                             0x1e000e, 0x1f000f);
#endif
  for (int r = 0; r < RV; ++r) {
    const vf lim = vload(pos + r * VW), m0 = vload(m + r * VW);
    // the max of the unscaled scores, scaled once (sc > 0); two chains halve the wait on vmax's latency
    vf mr0 = ninf, mr1 = ninf;
    int j = 0;
    for (; j + 2 <= n; j += 2) {
      vf s0 = vload(st + size_t(j) * ld + r * VW), s1 = vload(st + size_t(j + 1) * ld + r * VW);
      if (diag) {
        s0 = vsel_le(vset1(float(c0 + j)), lim, s0, ninf);
        s1 = vsel_le(vset1(float(c0 + j + 1)), lim, s1, ninf);
      }
      mr0 = vmax(mr0, s0);
      mr1 = vmax(mr1, s1);
    }
    if (j < n) {
      vf s0 = vload(st + size_t(j) * ld + r * VW);
      if (diag) s0 = vsel_le(vset1(float(c0 + j)), lim, s0, ninf);
      mr0 = vmax(mr0, s0);
    }
    const vf mx = vmax(m0, vmul(vmax(mr0, mr1), scv));
    // a row that sees nothing yet keeps m = -inf: shift it by 0 so that exp never sees inf - inf; m0 = -inf gives
    // alpha 0 (clamped: vexp_unit wants finite t)
    const vf safe = vsel_le(mx, ninf, zero, mx);
    // rows whose max stayed keep alpha exactly 1 (the polynomial's 2^0 is 1 - 6e-8); where no row's max moved, P.V
    // skips the rescale of its accumulators (the usual case once a row has seen its largest scores)
    alpha[r] = vsel_le(mx, m0, vset1(1.0f), vexp_unit<5>(vmax(vsub(m0, safe), vset1(-200.0f))));
    rescale = rescale || vany_lt(m0, mx);
    vf sum = zero;
#ifdef PL_BF16_DOT
    if (ch.qp) {
      // P straight into bfloat16 pairs of positions: never stored as float32. Degree 3: P is rounded to 8 bits
      for (int j = 0; j < n; j += 2) {
        const float* sp = st + size_t(j) * ld + r * VW;
        vf p0 = vexp_unit<3>(vfmsub(vload(sp), scv, safe));
        vf p1 = j + 1 < n ? vexp_unit<3>(vfmsub(vload(sp + ld), scv, safe)) : zero;
        if (diag) {
          p0 = vsel_le(vset1(float(c0 + j)), lim, p0, zero);
          p1 = vsel_le(vset1(float(c0 + j + 1)), lim, p1, zero);
        }
        sum = vadd(sum, vadd(p0, p1));
        const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
        _mm512_storeu_si512(ch.pp + size_t(j / 2) * ld + o + r * VW, _mm512_permutexvar_epi16(pair_idx, w));
      }
    } else
#endif
      for (int j = 0; j < n; ++j) {
        float* sp = st + size_t(j) * ld + r * VW;
        vf p = vexp_unit<5>(vfmsub(vload(sp), scv, safe));
        if (diag) p = vsel_le(vset1(float(c0 + j)), lim, p, zero);
        vstore(sp, p);
        sum = vadd(sum, p);
      }
    vstore(l + r * VW, vfma(vload(l + r * VW), alpha[r], sum));
    vstore(m + r * VW, mx);
  }
#ifdef PL_BF16_DOT
  if (ch.qp) {
    const int n2 = (n + 1) / 2;
    int c = 0;
    const vf* al = rescale ? alpha : nullptr;
    for (; c + CB <= d; c += CB) dot_pv<RV, CB>(ch.pp + o, ld, ch.vp, d, n2, c, al, ot);
    for (; c < d; ++c) dot_pv<RV, 1>(ch.pp + o, ld, ch.vp, d, n2, c, al, ot);
    return;
  }
#endif
  int c = 0;
  const vf* al = rescale ? alpha : nullptr;
  for (; c + CB <= d; c += CB) tile_pv<RV, CB>(st, ld, ch.v, n, c, al, ot);
  for (; c < d; ++c) tile_pv<RV, 1>(st, ld, ch.v, n, c, al, ot);
}

#if defined(__AVX512F__)
#define PL_TRANSPOSE 1
// m[k] = row k of a 16 x 16 block of dwords -> m[k] = its column k: pairs of rows interleaved, then pairs of
// pairs, then 128-bit lanes gathered (64 shuffles where scalar moves take 256 inserts or extracts and stores)
inline void transpose16(__m512* m) {
  __m512 t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_ps(m[2 * k], m[2 * k + 1]);  // lane L: rows 2k, 2k+1 at columns 4L, 4L+1
    t[2 * k + 1] = _mm512_unpackhi_ps(m[2 * k], m[2 * k + 1]);  // columns 4L+2, 4L+3
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c] lane L: rows 4g..4g+3 of column 4L + c
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 2]), e = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512 a = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), b = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 e = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD), f = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    m[c] = _mm512_shuffle_f32x4(a, b, 0x88);
    m[8 + c] = _mm512_shuffle_f32x4(a, b, 0xDD);
    m[4 + c] = _mm512_shuffle_f32x4(e, f, 0x88);
    m[12 + c] = _mm512_shuffle_f32x4(e, f, 0xDD);
  }
}
#endif

// One KV head's context of one sequence, packed once per call for all of its prompt-chunk items (bf16 pairs):
// key rows contiguous ([end + JB_MAX][d/2] pairs, the padding zero) and value pairs ([(end+1)/2][d], pairs of
// positions 2j, 2j+1; past the end zero). Without it every item gathers and pairs every chunk it reads again: a
// 1,500-token prompt's chunks were gathered and paired ~47 times each (pointers and pairing ~6 % of its attention)
struct KvPack { const uint32_t* k = nullptr; const uint32_t* v = nullptr; };
constexpr int PACK_PAD = 12;  // key rows past the end: the widest score block (jb_for(1)) less one, rounded up
inline int64_t pack_words(int end, int d) { return int64_t(end + PACK_PAD) * (d / 2) + int64_t((end + 1) / 2) * d; }

#ifdef PL_BF16_DOT
// positions c0..c1-1 (c0 even) of KV head h of one sequence into its pack at `dst`; the chunk holding the end also
// writes the padding
inline void pack_kv(const c10::BFloat16* kc, const c10::BFloat16* vc, int64_t blk_stride, int64_t tok_stride,
                    int bs, const int32_t* table, int h, int d, int end, int c0, int c1, uint32_t* dst) {
  alignas(64) static const uint16_t zeros[256] = {};
  uint32_t* kp = dst;
  uint32_t* vp = dst + int64_t(end + PACK_PAD) * (d / 2);
  auto off = [&](int p) { return int64_t(table[p / bs]) * blk_stride + int64_t(p % bs) * tok_stride + int64_t(h) * d; };
  for (int p = c0; p < c1; p += 2) {
    const int64_t o0 = off(p);
    const uint16_t* v0 = reinterpret_cast<const uint16_t*>(vc + o0);
    const uint16_t* v1 = zeros;
    std::memcpy(kp + int64_t(p) * (d / 2), kc + o0, sizeof(uint16_t) * d);
    if (p + 1 < end) {
      const int64_t o1 = off(p + 1);
      v1 = reinterpret_cast<const uint16_t*>(vc + o1);
      std::memcpy(kp + int64_t(p + 1) * (d / 2), kc + o1, sizeof(uint16_t) * d);
    }
    pair_rows(v0, v1, vp + int64_t(p / 2) * d, d);
  }
  if (c1 == end) std::memset(kp + int64_t(end) * (d / 2), 0, sizeof(uint32_t) * PACK_PAD * (d / 2));
}
#endif

// A work item of ntok tokens and one KV head h0, as attend() computes it, in transposed row tiles.
template <typename T>
void attend_tiles(const float* q, int64_t q_stride, float* out, int64_t H, int G, int h0, int d, const T* kc,
                  const T* vc, int64_t blk_stride, int64_t tok_stride, int bs, const int32_t* table, int row0,
                  int start, int ntok, float scale, const KvPack& pk) {
  constexpr int JB_MAX = jb_for(1) > jb_for(2) ? jb_for(1) : jb_for(2);
  static_assert(PACK_PAD >= JB_MAX, "a pack's padding covers the widest score block");
  const int R = ntok * G, nrv = (R + VW - 1) / VW, ld = nrv * VW;
  bool bf = false;
#ifdef PL_BF16_DOT
  if constexpr (std::is_same<T, c10::BFloat16>::value)
    bf = d % 32 == 0 && queries_are_bf16(q, q_stride, row0, ntok, int64_t(h0) * G * d, G * d);
#endif
  thread_local std::vector<float> buf;
  const size_t need = size_t(ld) * (2 * d + KC + JB_MAX + 3) + size_t(2 * KC + 1) * d +
                      (bf ? size_t(ld) * (d / 2 + KC / 2 + 1) + size_t(KC / 2 + 1) * d : 0);
  if (buf.size() < need) buf.resize(need);
  float* qt = buf.data();
  float* ot = qt + size_t(ld) * d;
  float* st = ot + size_t(ld) * d;
  float* m = st + size_t(ld) * (KC + JB_MAX);
  float* l = m + ld;
  float* pos = l + ld;
  float* conv = pos + ld;  // K then V rows of one chunk widened to float (half-precision caches)
  float* zrow = conv + size_t(2 * KC) * d;  // the zero key that pads a chunk to whole score blocks
  uint32_t* qp = reinterpret_cast<uint32_t*>(zrow + d);  // bf16 only: q^T pairs, P pairs, V pairs
  uint32_t* pp = qp + size_t(ld) * (d / 2);
  uint32_t* vp = pp + size_t(ld) * (KC / 2 + 1);
  std::fill(ot, ot + size_t(ld) * d, 0.0f);
  std::fill(zrow, zrow + d, 0.0f);
  for (int r = 0; r < ld; ++r) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
    pos[r] = r < R ? float(start + r / G) : std::numeric_limits<float>::infinity();
  }
  // query row r (token r / G, head h0 G + r % G), unscaled
  auto qrow = [&](int r) { return q + (int64_t(row0) + r / G) * q_stride + (int64_t(h0) * G + r % G) * d; };
  // q^T for the float32 tiles (scaled), or (bf) the pairs of the unscaled queries (exact: they are bfloat16 values),
  // padded rows zero; 16 x 16 blocks through registers where d allows (the scalar stores of one column element at a
  // time were ~4 % of a 1,500-token chunk's attention)
#ifdef PL_TRANSPOSE
  if (bf) {
    // dword k of a pair vector: the high words of floats 2k and 2k+1 of 32 (word 4k+1 and 4k+3 of a:b)
    const __m512i hi_idx = _mm512_setr_epi32(0x30001, 0x70005, 0xb0009, 0xf000d, 0x130011, 0x170015, 0x1b0019, 0x1f001d,
                                             0x230021, 0x270025, 0x2b0029, 0x2f002d, 0x330031, 0x370035, 0x3b0039, 0x3f003d);
    for (int rb = 0; rb < nrv; ++rb)
      for (int c = 0; c < d / 32; ++c) {
        __m512 blk[16];
        for (int k = 0; k < 16; ++k) {
          const int r = rb * 16 + k;
          if (r >= R) { blk[k] = _mm512_setzero_ps(); continue; }
          const float* src = qrow(r) + 32 * c;
          blk[k] = _mm512_castsi512_ps(_mm512_permutex2var_epi16(_mm512_castps_si512(_mm512_loadu_ps(src)), hi_idx,
                                                                  _mm512_castps_si512(_mm512_loadu_ps(src + 16))));
        }
        transpose16(blk);
        for (int k = 0; k < 16; ++k) _mm512_storeu_ps(reinterpret_cast<float*>(qp) + size_t(16 * c + k) * ld + 16 * rb, blk[k]);
      }
  } else if (d % 16 == 0) {
    const __m512 scv = _mm512_set1_ps(scale);
    for (int rb = 0; rb < nrv; ++rb)
      for (int c = 0; c < d / 16; ++c) {
        __m512 blk[16];
        for (int k = 0; k < 16; ++k) {
          const int r = rb * 16 + k;
          blk[k] = r < R ? _mm512_mul_ps(scv, _mm512_loadu_ps(qrow(r) + 16 * c)) : _mm512_setzero_ps();
        }
        transpose16(blk);
        for (int k = 0; k < 16; ++k) _mm512_storeu_ps(qt + size_t(16 * c + k) * ld + 16 * rb, blk[k]);
      }
  } else
#endif
  {
    if (bf) {
      std::fill(qp, qp + size_t(ld) * (d / 2), 0u);
      for (int r = 0; r < R; ++r) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(qrow(r));
        for (int i = 0; i < d; i += 2) qp[size_t(i / 2) * ld + r] = (src[i] >> 16) | (src[i + 1] & 0xffff0000u);
      }
    } else {
      std::fill(qt, qt + size_t(ld) * d, 0.0f);
      for (int r = 0; r < R; ++r) {
        const float* src = qrow(r);
        for (int i = 0; i < d; ++i) qt[size_t(i) * ld + r] = src[i] * scale;
      }
    }
  }
  const float* krow[KC + JB_MAX];
  const float* vrow[KC];
  const uint32_t* kdrow[KC + JB_MAX];
  TileChunk ch{krow, vrow};
  if (bf) { ch.qp = qp; ch.kd = kdrow; ch.vp = vp; ch.pp = pp; }
  const int end = start + ntok;
  for (int c0 = 0; c0 < end; c0 += KC) {
    const int n = std::min(KC, end - c0);
#ifdef PL_BF16_DOT
    if (bf && pk.k) {  // the sequence's packed K rows and V pairs (their padding covers the last score block)
      for (int j = 0; j < n + JB_MAX; ++j) kdrow[j] = pk.k + size_t(c0 + j) * (d / 2);
      ch.vp = pk.v + size_t(c0 / 2) * d;
    } else
#endif
    {
    // position c0 + j lies in block table[blk], slot `slot`: counted along, not divided per position (an integer
    // division per position was ~3 % of a 1,500-token chunk's attention)
    int blk = c0 / bs, slot = c0 % bs;
    for (int j = 0; j < n; ++j) {
      const int64_t off = int64_t(table[blk]) * blk_stride + int64_t(slot) * tok_stride + int64_t(h0) * d;
      if (++slot == bs) { slot = 0; ++blk; }
      if constexpr (std::is_same<T, float>::value) {
        krow[j] = kc + off;
        vrow[j] = vc + off;
      } else {
        if (bf) {  // keys read in place; value rows paired below
          kdrow[j] = reinterpret_cast<const uint32_t*>(kc + off);
          vrow[j] = reinterpret_cast<const float*>(vc + off);
          continue;
        }
        to_float(kc + off, conv + size_t(j) * d, d);
        to_float(vc + off, conv + size_t(KC + j) * d, d);
        krow[j] = conv + size_t(j) * d;
        vrow[j] = conv + size_t(KC + j) * d;
      }
    }
    for (int j = n; j < KC + JB_MAX; ++j) { krow[j] = zrow; kdrow[j] = reinterpret_cast<const uint32_t*>(zrow); }
#ifdef PL_BF16_DOT
    if (bf)
      for (int j = 0; j < n; j += 2)
        pair_rows(reinterpret_cast<const uint16_t*>(vrow[j]),
                  reinterpret_cast<const uint16_t*>(j + 1 < n ? vrow[j + 1] : zrow), vp + size_t(j / 2) * d, d);
#endif
    }
    const bool diag = c0 + n - 1 > start;  // the first token cannot see the chunk's last position
    const float sc = bf ? scale : 1.0f;
    for (int rv0 = 0; rv0 < nrv;) {  // panels of at most RV_MAX row vectors, balanced (6: 3 + 3, not 4 + 2)
      const int left = (nrv - rv0 + RV_MAX - 1) / RV_MAX;
      const int rv = (nrv - rv0 + left - 1) / left;
      switch (rv) {
        case 1: tile_panel<1>(qt, st, ot, m, l, pos, ld, rv0, ch, n, d, c0, diag, sc); break;
        case 2: tile_panel<2>(qt, st, ot, m, l, pos, ld, rv0, ch, n, d, c0, diag, sc); break;
        case 3: tile_panel<3>(qt, st, ot, m, l, pos, ld, rv0, ch, n, d, c0, diag, sc); break;
        default: tile_panel<4>(qt, st, ot, m, l, pos, ld, rv0, ch, n, d, c0, diag, sc);
      }
      rv0 += rv;
    }
  }
  // out row r (token r / G, head h0 G + r % G) = its column of out^T / l[r]
  auto orow = [&](int r) { return out + ((int64_t(row0) + r / G) * H + int64_t(h0) * G + r % G) * d; };
#ifdef PL_TRANSPOSE
  if (d % 16 == 0) {
    for (int rb = 0; rb < nrv; ++rb) {
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l + 16 * rb));  // padded rows: unused
      for (int c = 0; c < d / 16; ++c) {
        __m512 blk[16];
        for (int k = 0; k < 16; ++k) blk[k] = _mm512_mul_ps(inv, _mm512_loadu_ps(ot + size_t(16 * c + k) * ld + 16 * rb));
        transpose16(blk);
        for (int k = 0; k < 16 && rb * 16 + k < R; ++k) _mm512_storeu_ps(orow(rb * 16 + k) + 16 * c, blk[k]);
      }
    }
    return;
  }
#endif
  for (int r = 0; r < R; ++r) {
    const float inv = 1.0f / l[r];
    float* dst = orow(r);
    for (int i = 0; i < d; ++i) dst[i] = ot[size_t(i) * ld + r] * inv;
  }
}
#endif

// ---- decodes (slices of up to FEW_TOKENS tokens): positions in vector lanes (AVX-512 builds) ----
//
// A decode has only the G query rows of a KV head (3 for SmolLM2), too few to fill a vector, so attend_rows runs
// the context in tiles of 16 positions instead: a position's key row (d values, loaded once for all rows of the
// head) gives one dot-product vector per row, folded 4 positions at a time into a vector whose lane u is
// position u's score; the tile's 16 scores of a row then sit in one vector, so the mask, exp and the sum of the
// online softmax cost one vector op per 16 positions, and the running max one horizontal max per tile (the AVX2
// loops did a horizontal sum per score and scalar softmax bookkeeping per position). The accumulators of a
// group of rows stay in registers through P.V. Tiles run over all of the item's KV heads before the next tile, so
// a block's rows (all heads of a position are contiguous in the cache) are read once, in order.
#if defined(__AVX512F__)
#define PL_ROWS 1
constexpr int RT = 16;  // positions per tile: one score vector per row

// a K/V row of d = 16 D values as D float vectors; bfloat16 rows come out in unpack order (see to_lanes): the rows'
// dot products do not care, and the output is put back in column order at the end
template <int D> inline void load_row(const float* s, __m512* o) {
  for (int v = 0; v < D; ++v) o[v] = _mm512_loadu_ps(s + 16 * v);
}
template <int D> inline void load_row(const c10::Half* s, __m512* o) {
  for (int v = 0; v < D; ++v) o[v] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16 * v)));
}
template <int D> inline void load_row(const c10::BFloat16* s, __m512* o) {
  static_assert(D % 2 == 0, "bfloat16 rows load 32 values at a time");
  const __m512i z = _mm512_setzero_si512();
  for (int c = 0; c < D / 2; ++c) {  // a bfloat16 shifted into the high half of a dword is that float: 2 ops / 32
    const __m512i x = _mm512_loadu_si512(s + 32 * c);
    o[2 * c] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, x));
    o[2 * c + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, x));
  }
}
// a row of d = 16 D floats into load_row's lane order, times sc (queries), and back (outputs): bfloat16 rows put
// columns 0-3, 8-11, 16-19, 24-27 of each 32 in one vector and 4-7, 12-15, ... in the next (unpacklo / unpackhi
// take words 0-3 / 4-7 of each 128-bit lane)
template <int D, typename T> inline void to_lanes(const float* src, float* dst, float sc) {
  const __m512 s = _mm512_set1_ps(sc);
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(4));
    for (int c = 0; c < D / 2; ++c) {
      const __m512 a = _mm512_loadu_ps(src + 32 * c), b = _mm512_loadu_ps(src + 32 * c + 16);
      _mm512_storeu_ps(dst + 32 * c, _mm512_mul_ps(s, _mm512_permutex2var_ps(a, lo, b)));
      _mm512_storeu_ps(dst + 32 * c + 16, _mm512_mul_ps(s, _mm512_permutex2var_ps(a, hi, b)));
    }
  } else {
    for (int v = 0; v < D; ++v) _mm512_storeu_ps(dst + 16 * v, _mm512_mul_ps(s, _mm512_loadu_ps(src + 16 * v)));
  }
}
template <int D, typename T> inline void from_lanes(const float* src, float* dst, float sc) {
  const __m512 s = _mm512_set1_ps(sc);
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    // column w of 32 sits in vector (w / 4) % 2, lane 4 (w / 8) + w % 4
    const __m512i a0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i a1 = _mm512_add_epi32(a0, _mm512_set1_epi32(8));
    for (int c = 0; c < D / 2; ++c) {
      const __m512 lo = _mm512_loadu_ps(src + 32 * c), hi = _mm512_loadu_ps(src + 32 * c + 16);
      _mm512_storeu_ps(dst + 32 * c, _mm512_mul_ps(s, _mm512_permutex2var_ps(lo, a0, hi)));
      _mm512_storeu_ps(dst + 32 * c + 16, _mm512_mul_ps(s, _mm512_permutex2var_ps(lo, a1, hi)));
    }
  } else {
    for (int v = 0; v < D; ++v) _mm512_storeu_ps(dst + 16 * v, _mm512_mul_ps(s, _mm512_loadu_ps(src + 16 * v)));
  }
}

// lane 4L+u = the part of sum(a[u]) held in 128-bit lane L
inline __m512 fold4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 b01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 b23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(b01), _mm512_castps_pd(b23))),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(b01), _mm512_castps_pd(b23))));
}
// lane 4g+u = the sum over the 128-bit lanes L of c[g]'s lane 4L+u: four fold4 results into one score vector
inline __m512 fold_lanes(__m512 c0, __m512 c1, __m512 c2, __m512 c3) {
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x44), _mm512_shuffle_f32x4(c0, c1, 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(c2, c3, 0x44), _mm512_shuffle_f32x4(c2, c3, 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// The running state of one row of attend_rows: output accumulators (load_row's lane order), max, sum per lane
struct RowState { float* acc; float* m; float* l; };

// One tile of n <= RT positions c0.. for NR rows of one KV head: qs [NR][d] scaled queries (load_row's lane order),
// lim[r] row r's last visible position, acc [NR][d], m [NR], l [NR][16] the online softmax's state.
template <int NR, int D, typename T>
inline void rows_tile(const float* qs, const int* lim, float* acc, float* m, float* l, const T* const* krow,
                      const T* const* vrow, int n, int c0) {
  constexpr int d = 16 * D;
  __m512 s[NR];
  {
    __m512 c[NR][4];
    for (int g = 0; g < 4; ++g) {
      if (4 * g >= n) {
        for (int r = 0; r < NR; ++r) c[r][g] = _mm512_setzero_ps();
        continue;
      }
      __m512 a[NR][4];
      for (int u = 0; u < 4; ++u) {
        __m512 kv[D];
        load_row<D>(krow[4 * g + u], kv);
        for (int r = 0; r < NR; ++r) {
          __m512 x = _mm512_mul_ps(_mm512_loadu_ps(qs + r * d), kv[0]);
          for (int v = 1; v < D; ++v) x = _mm512_fmadd_ps(_mm512_loadu_ps(qs + r * d + 16 * v), kv[v], x);
          a[r][u] = x;
        }
      }
      for (int r = 0; r < NR; ++r) c[r][g] = fold4(a[r][0], a[r][1], a[r][2], a[r][3]);
    }
    for (int r = 0; r < NR; ++r) s[r] = fold_lanes(c[r][0], c[r][1], c[r][2], c[r][3]);
  }
  alignas(64) float p[NR][RT];
  alignas(64) float mo[16] = {0}, mn[16] = {0};
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 e[NR];
  for (int r = 0; r < NR; ++r) {
    const int nv = std::min(n, lim[r] - c0 + 1);  // positions of the tile row r sees (causal, and the tile's end)
    const __mmask16 k = nv <= 0 ? 0 : nv >= 16 ? __mmask16(0xffff) : __mmask16((1u << nv) - 1);
    const float mx = _mm512_reduce_max_ps(_mm512_mask_blend_ps(k, ninf, s[r]));
    mo[r] = m[r];
    // every row sees position 0, so after the first tile m is finite: exp(m - mn) never meets inf - inf
    mn[r] = std::max(m[r], mx);
    m[r] = mn[r];
    e[r] = _mm512_maskz_mov_ps(k, vexp(_mm512_sub_ps(s[r], _mm512_set1_ps(mn[r]))));
    _mm512_store_ps(p[r], e[r]);
  }
  alignas(64) float alpha[16];
  _mm512_store_ps(alpha, vexp(_mm512_sub_ps(_mm512_load_ps(mo), _mm512_load_ps(mn))));  // -inf - x: exp ~0
  __m512 o[NR][D];
  for (int r = 0; r < NR; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    _mm512_storeu_ps(l + 16 * r, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * r), al, e[r]));
    for (int v = 0; v < D; ++v) o[r][v] = _mm512_mul_ps(al, _mm512_loadu_ps(acc + r * d + 16 * v));
  }
  for (int j = 0; j < n; ++j) {
    __m512 vv[D];
    load_row<D>(vrow[j], vv);
    for (int r = 0; r < NR; ++r) {
      const __m512 pb = _mm512_set1_ps(p[r][j]);
      for (int v = 0; v < D; ++v) o[r][v] = _mm512_fmadd_ps(pb, vv[v], o[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < D; ++v) _mm512_storeu_ps(acc + r * d + 16 * v, o[r][v]);
}

#ifdef PL_BF16_DOT
// rows_tile for a bfloat16 cache and bfloat16-valued queries (a bfloat16 model's): scores are pair dot products
// (vdpbf16ps) of the raw query pairs qb (row r at qb + r d, d/2 pairs; unscaled: exact products, scaled after)
// with the key rows read in place, and P.V pair dot products of P rounded to bfloat16 (as the prompt tiles and
// torch's bfloat16 SDPA do; its sum l stays float32) with two value rows interleaved into column pairs; acc is in
// column order
template <int NR, int D>
inline void rows_tile_bf(const uint32_t* qb, float sc, const int* lim, float* acc, float* m, float* l,
                         const c10::BFloat16* const* krow, const c10::BFloat16* const* vrow, int n, int c0) {
  constexpr int d = 16 * D, P = D / 2;  // P vectors of 32 values per row
  __m512 s[NR];
  {
    __m512 c[NR][4];
    for (int g = 0; g < 4; ++g) {
      if (4 * g >= n) {
        for (int r = 0; r < NR; ++r) c[r][g] = _mm512_setzero_ps();
        continue;
      }
      __m512 a[NR][4];
      for (int u = 0; u < 4; ++u) {
        __m512bh kv[P];
        for (int i = 0; i < P; ++i) kv[i] = (__m512bh)_mm512_loadu_si512(krow[4 * g + u] + 32 * i);
        for (int r = 0; r < NR; ++r) {
          __m512 x = _mm512_setzero_ps();
          for (int i = 0; i < P; ++i)
            x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(qb + r * d + 16 * i), kv[i]);
          a[r][u] = x;
        }
      }
      for (int r = 0; r < NR; ++r) c[r][g] = fold4(a[r][0], a[r][1], a[r][2], a[r][3]);
    }
    const __m512 scv = _mm512_set1_ps(sc);
    for (int r = 0; r < NR; ++r) s[r] = _mm512_mul_ps(scv, fold_lanes(c[r][0], c[r][1], c[r][2], c[r][3]));
  }
  alignas(64) uint32_t pp[NR][RT / 2];  // row r's P as bfloat16 pairs of positions (2j, 2j+1)
  alignas(64) float mo[16] = {0}, mn[16] = {0};
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 e[NR];
  for (int r = 0; r < NR; ++r) {
    const int nv = std::min(n, lim[r] - c0 + 1);
    const __mmask16 k = nv <= 0 ? 0 : nv >= 16 ? __mmask16(0xffff) : __mmask16((1u << nv) - 1);
    const float mx = _mm512_reduce_max_ps(_mm512_mask_blend_ps(k, ninf, s[r]));
    mo[r] = m[r];
    mn[r] = std::max(m[r], mx);
    m[r] = mn[r];
    e[r] = _mm512_maskz_mov_ps(k, vexp(_mm512_sub_ps(s[r], _mm512_set1_ps(mn[r]))));
    _mm256_store_si256(reinterpret_cast<__m256i*>(pp[r]), (__m256i)_mm512_cvtneps_pbh(e[r]));
  }
  alignas(64) float alpha[16];
  _mm512_store_ps(alpha, vexp(_mm512_sub_ps(_mm512_load_ps(mo), _mm512_load_ps(mn))));
  __m512 o[NR][D];
  for (int r = 0; r < NR; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    _mm512_storeu_ps(l + 16 * r, _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * r), al, e[r]));
    for (int v = 0; v < D; ++v) o[r][v] = _mm512_mul_ps(al, _mm512_loadu_ps(acc + r * d + 16 * v));
  }
  const __m512i il = _mm512_setr_epi32(0x200000, 0x210001, 0x220002, 0x230003, 0x240004, 0x250005, 0x260006, 0x270007,
                                       0x280008, 0x290009, 0x2a000a, 0x2b000b, 0x2c000c, 0x2d000d, 0x2e000e, 0x2f000f);
  const __m512i ih = _mm512_add_epi16(il, _mm512_set1_epi16(16));
  for (int j = 0; j < n; j += 2) {  // past n: the tile's padding rows (finite values), weighted 0
    __m512bh vv[D];
    for (int i = 0; i < P; ++i) {
      const __m512i x = _mm512_loadu_si512(vrow[j] + 32 * i), y = _mm512_loadu_si512(vrow[j + 1] + 32 * i);
      vv[2 * i] = (__m512bh)_mm512_permutex2var_epi16(x, il, y);  // columns 32i.. +16 as (row j, row j+1) pairs
      vv[2 * i + 1] = (__m512bh)_mm512_permutex2var_epi16(x, ih, y);
    }
    for (int r = 0; r < NR; ++r) {
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(int(pp[r][j / 2]));
      for (int v = 0; v < D; ++v) o[r][v] = _mm512_dpbf16_ps(o[r][v], pb, vv[v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < D; ++v) _mm512_storeu_ps(acc + r * d + 16 * v, o[r][v]);
}
#endif

// the row group sizes rows_tile is built for: NR x D accumulators + D row vectors within 32 registers
constexpr int rows_max(int D) { return D <= 4 ? 4 : 2; }

// one tile for a group of nr rows (bf: rows_tile_bf, qs then holds query pairs)
template <int D, typename T>
inline void rows_tile_any(int nr, bool bf, const float* qs, float sc, const int* lim, float* acc, float* m, float* l,
                          const T* const* krow, const T* const* vrow, int n, int c0) {
#ifdef PL_BF16_DOT
  if constexpr (std::is_same<T, c10::BFloat16>::value && D % 2 == 0) {
    if (bf) {
      const uint32_t* qb = reinterpret_cast<const uint32_t*>(qs);
      switch (nr) {
        case 1: rows_tile_bf<1, D>(qb, sc, lim, acc, m, l, krow, vrow, n, c0); return;
        case 2: rows_tile_bf<2, D>(qb, sc, lim, acc, m, l, krow, vrow, n, c0); return;
        case 3:
          if constexpr (rows_max(D) >= 3) { rows_tile_bf<3, D>(qb, sc, lim, acc, m, l, krow, vrow, n, c0); return; }
        default: if constexpr (rows_max(D) >= 4) rows_tile_bf<4, D>(qb, sc, lim, acc, m, l, krow, vrow, n, c0);
      }
      return;
    }
  }
#endif
  switch (nr) {
    case 1: rows_tile<1, D, T>(qs, lim, acc, m, l, krow, vrow, n, c0); break;
    case 2: rows_tile<2, D, T>(qs, lim, acc, m, l, krow, vrow, n, c0); break;
    case 3: if constexpr (rows_max(D) >= 3) { rows_tile<3, D, T>(qs, lim, acc, m, l, krow, vrow, n, c0); break; }
    default: if constexpr (rows_max(D) >= 4) rows_tile<4, D, T>(qs, lim, acc, m, l, krow, vrow, n, c0);
  }
}

// `bytes` of the K row and of the V row at element offset off, into L2
template <typename T>
inline void prefetch_kv_l2(const T* kc, const T* vc, int64_t off, int64_t bytes) {
  const char* kp = reinterpret_cast<const char*>(kc + off);
  const char* vp = reinterpret_cast<const char*>(vc + off);
  for (int64_t b = 0; b < bytes; b += 64) {
    _mm_prefetch(kp + b, _MM_HINT_T1);
    _mm_prefetch(vp + b, _MM_HINT_T1);
  }
}

// A work item of a few tokens (decodes, verifications) as attend() computes it, in tiles of RT positions.
template <int D, typename T>
void attend_rows(const float* q, int64_t q_stride, float* out, int64_t H, int G, int h0, int nh, const T* kc,
                 const T* vc, int64_t blk_stride, int64_t tok_stride, int bs, const int32_t* table, int row0,
                 int start, int ntok, float scale) {
  constexpr int d = 16 * D;
  const int R = ntok * G;  // query rows of one KV head
  bool bf = false;  // bfloat16 pair dot products: a bfloat16 cache and a bfloat16 model's queries
#ifdef PL_BF16_DOT
  if constexpr (std::is_same<T, c10::BFloat16>::value)
    bf = queries_are_bf16(q, q_stride, row0, ntok, int64_t(h0) * G * d, nh * G * d);
#endif
  thread_local std::vector<float> buf;
  thread_local std::vector<int> lims;
  const size_t per_head = size_t(R) * (2 * d + 1 + 16);
  if (buf.size() < per_head * nh) buf.resize(per_head * nh);
  if (lims.size() < size_t(R)) lims.resize(R);
  for (int r = 0; r < R; ++r) lims[r] = start + r / G;
  // head hh: queries [R][d] (scaled, load_row's lane order; bf: raw bfloat16 pairs in d/2 of the d) and
  // accumulators [R][d] in the same order (bf: column order), max [R], sums [R][16]
  auto qs_of = [&](int hh) { return buf.data() + per_head * hh; };
  auto acc_of = [&](int hh) { return qs_of(hh) + size_t(R) * d; };
  auto m_of = [&](int hh) { return acc_of(hh) + size_t(R) * d; };
  auto l_of = [&](int hh) { return m_of(hh) + R; };
  for (int hh = 0; hh < nh; ++hh) {
    float* qs = qs_of(hh);
    for (int r = 0; r < R; ++r) {
      const float* src = q + (int64_t(row0) + r / G) * q_stride + (int64_t(h0 + hh) * G + r % G) * d;
      if (bf) {  // exact: the queries are bfloat16 values
        const uint32_t* w = reinterpret_cast<const uint32_t*>(src);
        uint32_t* dst = reinterpret_cast<uint32_t*>(qs + r * d);
        for (int i = 0; i < d; i += 2) dst[i / 2] = (w[i] >> 16) | (w[i + 1] & 0xffff0000u);
      } else {
        to_lanes<D, T>(src, qs + r * d, scale);
      }
    }
    std::fill(acc_of(hh), acc_of(hh) + size_t(R) * d, 0.0f);
    std::fill(m_of(hh), m_of(hh) + R, -std::numeric_limits<float>::infinity());
    std::fill(l_of(hh), l_of(hh) + size_t(R) * 16, 0.0f);
  }
  constexpr int NRM = rows_max(D);
  const int end = start + ntok;  // positions the last token sees
  int64_t base[RT];
  const T* krow[RT];
  const T* vrow[RT];
  for (int c0 = 0; c0 < end; c0 += RT) {
    const int n = std::min(RT, end - c0);
    for (int j = 0; j < RT; ++j) {
      const int p = c0 + std::min(j, n - 1);  // past the end: a repeat of the last row (masked)
      base[j] = int64_t(table[p / bs]) * blk_stride + int64_t(p % bs) * tok_stride + int64_t(h0) * d;
    }
    // prefetch: at the first tile, tiles 0-1 of every head; then, before each head's part of a tile, that head's
    // rows two tiles on. Into L2 (T1), not L1: two tiles ahead of all heads plus the tile in use (36 KB of bf16 K/V
    // for SmolLM2) overran the 32 KB L1 and evicted rows before their use. A block lies anywhere, a decode's
    // context is a few blocks, and from memory (a whole step's K/V do not stay in cache) one tile ahead came too
    // late. One layer, K/V from memory (decode_attention.py --layer --cold, 2026-11-24 16:15 UTC): 32 bf16 decodes
    // at 100-200 tokens 0.285-0.436 -> 0.199-0.220 ms, 6 at 1,900 0.646-0.882 -> 0.334-0.336 ms
    if (c0 == 0)
      for (int pf = 0; pf < std::min(end, 2 * RT); ++pf)
        prefetch_kv_l2(kc, vc, int64_t(table[pf / bs]) * blk_stride + int64_t(pf % bs) * tok_stride + int64_t(h0) * d,
                       int64_t(sizeof(T)) * nh * d);
    for (int hh = 0; hh < nh; ++hh) {
      for (int pf = c0 + 2 * RT; pf < std::min(end, c0 + 3 * RT); ++pf)
        prefetch_kv_l2(kc, vc,
                       int64_t(table[pf / bs]) * blk_stride + int64_t(pf % bs) * tok_stride + int64_t(h0 + hh) * d,
                       int64_t(sizeof(T)) * d);
      for (int j = 0; j < RT; ++j) {
        krow[j] = kc + base[j] + int64_t(hh) * d;
        vrow[j] = vc + base[j] + int64_t(hh) * d;
      }
      float* qs = qs_of(hh);
      float* acc = acc_of(hh);
      float* m = m_of(hh);
      float* l = l_of(hh);
      for (int r0 = 0; r0 < R;) {  // rows in groups of at most NRM, balanced
        const int groups = (R - r0 + NRM - 1) / NRM;
        const int nr = (R - r0 + groups - 1) / groups;
        if (lims[r0 + nr - 1] >= c0)  // the group's last row sees the tile (earlier rows see at most as much)
          rows_tile_any<D, T>(nr, bf, qs + r0 * d, scale, lims.data() + r0, acc + r0 * d, m + r0, l + 16 * r0,
                              krow, vrow, n, c0);
        r0 += nr;
      }
    }
  }
  for (int hh = 0; hh < nh; ++hh) {
    const float* acc = acc_of(hh);
    const float* l = l_of(hh);
    for (int r = 0; r < R; ++r) {
      const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(l + 16 * r));
      float* dst = out + ((int64_t(row0) + r / G) * H + int64_t(h0 + hh) * G + r % G) * d;
      if (bf) from_lanes<D, float>(acc + r * d, dst, inv);
      else from_lanes<D, T>(acc + r * d, dst, inv);
    }
  }
}
#endif

// attend_rows for head sizes it is built for; false where the caller runs attend()
template <typename T>
bool attend_rows_fit(const float* q, int64_t q_stride, float* out, int64_t H, int G, int h0, int nh, int d,
                     const T* kc, const T* vc, int64_t blk_stride, int64_t tok_stride, int bs, const int32_t* table,
                     int row0, int start, int ntok, float scale) {
#ifdef PL_ROWS
  switch (d) {
    case 32:
      attend_rows<2, T>(q, q_stride, out, H, G, h0, nh, kc, vc, blk_stride, tok_stride, bs, table, row0, start, ntok,
                         scale);
      return true;
    case 64:
      attend_rows<4, T>(q, q_stride, out, H, G, h0, nh, kc, vc, blk_stride, tok_stride, bs, table, row0, start, ntok,
                         scale);
      return true;
    case 128:
      attend_rows<8, T>(q, q_stride, out, H, G, h0, nh, kc, vc, blk_stride, tok_stride, bs, table, row0, start, ntok,
                         scale);
      return true;
  }
#endif
  return false;
}

// plain loops: head sizes that are not a multiple of 8, and builds without AVX2 (the compiler vectorises what it can)
inline void scores_ref(const float* q, const float* const* k, int n, int d, float* s) {
  for (int j = 0; j < n; ++j) { float a = 0; for (int i = 0; i < d; ++i) a += q[i] * k[j][i]; s[j] = a; }
}
inline float exp_sub_ref(float* s, int n, float m) {
  float sum = 0;
  for (int j = 0; j < n; ++j) { s[j] = std::exp(s[j] - m); sum += s[j]; }
  return sum;
}
inline void pv_ref(const float* p, const float* const* v, int n, int d, float alpha, float* acc) {
  for (int i = 0; i < d; ++i) acc[i] *= alpha;
  for (int j = 0; j < n; ++j) for (int i = 0; i < d; ++i) acc[i] += p[j] * v[j][i];
}

struct Item { int seq, head0, heads, tok0, ntok; int64_t cost; };

// One work item: tokens tok0..tok0+ntok-1 of sequence `seq` (flat rows row0 + ...), the query heads of KV heads
// h0..h0+nh-1, over context positions 0..start+t of each token t (causal; this step's K/V are already in the cache).
// Each chunk of positions is read once for all nh heads: a position's K (and V) row of all KV heads is contiguous
// in the cache ([blocks, block_size, kv_heads, d]), so a whole block is one sequential read; one head at a time read
// every third 128-byte piece and waited on memory (perf, 2026-11-24: 75 % of the op's time in its loads at 32
// decodes). Per head the arithmetic and its order are as before.
template <typename T>
void attend(const float* q, int64_t q_stride, float* out, int64_t H, int G, int h0, int nh, int d, const T* kc,
            const T* vc, int64_t blk_stride, int64_t tok_stride, int bs, const int32_t* table, int row0, int start,
            int ntok, float scale) {
  const int R = ntok * G;  // query rows of one KV head
  const int W = nh * d;     // floats of one position's K (or V) row over the item's heads
  const bool vec = d % 8 == 0;  // the AVX2 loops take whole vectors of 8
  thread_local std::vector<float> buf;
  const size_t per_head = size_t(R) * d * 2 + size_t(R) * KC + 2 * R;
  const size_t need = per_head * nh + (std::is_same<T, float>::value ? 0 : 2 * size_t(KC) * W);
  if (buf.size() < need) buf.resize(need);
  float* conv = buf.data() + per_head * nh;
  // head hh's part of the buffer: its scaled query rows, output accumulators, scores of one chunk, running max and
  // running sum of the online softmax (one place for the layout, read by the three loops below)
  struct Head { float *qs, *acc, *s, *m, *l; };
  auto head = [&](int hh) {
    Head b;
    b.qs = buf.data() + per_head * hh;
    b.acc = b.qs + size_t(R) * d;
    b.s = b.acc + size_t(R) * d;
    b.m = b.s + size_t(R) * KC;
    b.l = b.m + R;
    return b;
  };
  for (int hh = 0; hh < nh; ++hh) {
    const auto [qs, acc, s, m, l] = head(hh);
    for (int t = 0; t < ntok; ++t)
      for (int g = 0; g < G; ++g) {
        const float* src = q + (int64_t(row0) + t) * q_stride + (int64_t(h0 + hh) * G + g) * d;
        float* dst = qs + size_t(t * G + g) * d;
        for (int i = 0; i < d; ++i) dst[i] = src[i] * scale;
      }
    std::fill(acc, acc + size_t(R) * d, 0.0f);
    std::fill(m, m + R, -std::numeric_limits<float>::infinity());
    std::fill(l, l + R, 0.0f);
  }
  const float* kbase[KC];
  const float* vbase[KC];
  const float* krow[KC];
  const float* vrow[KC];
  const int end = start + ntok;  // positions the last token sees
  for (int c0 = 0; c0 < end; c0 += KC) {
    const int n = std::min(KC, end - c0);
    for (int j = 0; j < n; ++j) {
      const int p = c0 + j;
      const int64_t off = int64_t(table[p / bs]) * blk_stride + int64_t(p % bs) * tok_stride + int64_t(h0) * d;
#ifdef __AVX2__
      // the row PREFETCH positions on (across a block boundary it lies anywhere), into L2 as in attend_rows: 4 on
      // into L1 left this build's decodes waiting on memory. The AVX2 build forced on the Zen 4 VM, one layer, K/V
      // from memory (decode_attention.py --layer --cold, PACELINE_ATTN_ISA=avx2, 2026-11-24 17:05 UTC, two rounds):
      // float32 32 decodes at 100-200 tokens 1.23-1.27x, 6 at 1,900 2.09-2.22x; bfloat16 0.93-1.03x, 1.27-1.32x
      if (p + PREFETCH < end) {
        const int pf = p + PREFETCH;
        const int64_t poff = int64_t(table[pf / bs]) * blk_stride + int64_t(pf % bs) * tok_stride + int64_t(h0) * d;
        const char* kp = reinterpret_cast<const char*>(kc + poff);
        const char* vp = reinterpret_cast<const char*>(vc + poff);
        for (int64_t b = 0; b < int64_t(sizeof(T)) * W; b += 64) {
          _mm_prefetch(kp + b, _MM_HINT_T1);
          _mm_prefetch(vp + b, _MM_HINT_T1);
        }
      }
#endif
      if constexpr (std::is_same<T, float>::value) {
        kbase[j] = kc + off;
        vbase[j] = vc + off;
      } else {
        to_float(kc + off, conv + size_t(j) * W, W);
        to_float(vc + off, conv + size_t(KC + j) * W, W);
        kbase[j] = conv + size_t(j) * W;
        vbase[j] = conv + size_t(KC + j) * W;
      }
    }
    for (int hh = 0; hh < nh; ++hh) {
      const auto [qs, acc, s, m, l] = head(hh);
      for (int j = 0; j < n; ++j) {
        krow[j] = kbase[j] + int64_t(hh) * d;
        vrow[j] = vbase[j] + int64_t(hh) * d;
      }
      for (int t = 0; t < ntok; ++t) {
        const int nv = std::min(n, start + t + 1 - c0);  // causal: token t sees positions <= start + t
        if (nv <= 0) continue;
        for (int g0 = 0; g0 < G;) {  // the token's query heads in groups of at most 3 (balanced), sharing K/V loads
          const int nr = std::min(3, (G - g0 + (G - g0 + 2) / 3 - 1) / ((G - g0 + 2) / 3));
          const float* qr[3];
          float* sr[3];
          float* ar[3];
          float alpha[3];
          for (int u = 0; u < nr; ++u) {
            const int r = t * G + g0 + u;
            qr[u] = qs + size_t(r) * d;
            sr[u] = s + size_t(r) * KC;
            ar[u] = acc + size_t(r) * d;
          }
#ifdef __AVX2__
          if (vec) {
            if (nr == 3) scores<3>(qr, krow, nv, d, sr);
            else if (nr == 2) scores<2>(qr, krow, nv, d, sr);
            else scores<1>(qr, krow, nv, d, sr);
          } else
#endif
            for (int u = 0; u < nr; ++u) scores_ref(qr[u], krow, nv, d, sr[u]);
          for (int u = 0; u < nr; ++u) {
            const int r = t * G + g0 + u;
#ifdef __AVX2__
            const float mx = max_of(sr[u], nv, m[r]);
#else
            float mx = m[r];
            for (int j = 0; j < nv; ++j) mx = std::max(mx, sr[u][j]);
#endif
            alpha[u] = m[r] == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(m[r] - mx);
#ifdef __AVX2__
            const float sum = vec ? exp_sub(sr[u], nv, mx) : exp_sub_ref(sr[u], nv, mx);
#else
            const float sum = exp_sub_ref(sr[u], nv, mx);
#endif
            l[r] = l[r] * alpha[u] + sum;
            m[r] = mx;
          }
#ifdef __AVX2__
          if (vec) {
            if (nr == 3) pv<3>(sr, vrow, nv, d, alpha, ar);
            else if (nr == 2) pv<2>(sr, vrow, nv, d, alpha, ar);
            else pv<1>(sr, vrow, nv, d, alpha, ar);
          } else
#endif
            for (int u = 0; u < nr; ++u) pv_ref(sr[u], vrow, nv, d, alpha[u], ar[u]);
          g0 += nr;
        }
      }
    }
  }
  for (int hh = 0; hh < nh; ++hh) {
    const auto [qs, acc, s, m, l] = head(hh);
    for (int t = 0; t < ntok; ++t)
      for (int g = 0; g < G; ++g) {
        const int r = t * G + g;
        const float inv = 1.0f / l[r];
        float* dst = out + ((int64_t(row0) + t) * H + int64_t(h0 + hh) * G + g) * d;
        for (int i = 0; i < d; ++i) dst[i] = acc[size_t(r) * d + i] * inv;
      }
  }
}

// this step's K/V rows [T, KVH, D] (any row stride) into their cache slots, widened or rounded to the cache's dtype
template <typename T>
void write_slots(const at::Tensor& x, T* cache, const int64_t* slots, int64_t row_elems) {
  const int64_t t = x.size(0), stride = x.stride(0);
  if (x.scalar_type() == at::kFloat) {
    const float* src = x.data_ptr<float>();
    for (int64_t i = 0; i < t; ++i) {
      T* dst = cache + slots[i] * row_elems;
      for (int64_t e = 0; e < row_elems; ++e) dst[e] = T(src[i * stride + e]);
    }
  } else {
    TORCH_CHECK(x.scalar_type() == c10::CppTypeToScalarType<T>::value, "new K/V must be float32 or the cache's dtype");
    const T* src = x.data_ptr<T>();
    for (int64_t i = 0; i < t; ++i) std::memcpy(cache + slots[i] * row_elems, src + i * stride, sizeof(T) * row_elems);
  }
}

// bfloat16 [T, H, D] (contiguous rows, any row stride) -> float32 [T, H, D], exact (a bfloat16 is a float's top half)
at::Tensor widen_bf16(const at::Tensor& x) {
  auto out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const int64_t t = x.size(0), row = x.size(1) * x.size(2), ld = x.stride(0);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
#pragma omp parallel for schedule(static) if (t * row >= 65536)
  for (int64_t i = 0; i < t; ++i)
    for (int64_t e = 0; e < row; ++e) dst[i * row + e] = uint32_t(src[i * ld + e]) << 16;
  return out;
}

// float32 -> bfloat16, round to nearest even and NaN to 0x7FC0: c10::BFloat16's conversion (what .to() does)
at::Tensor narrow_bf16(const at::Tensor& x) {
  auto out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const int64_t n = x.numel();
  const uint32_t* src = reinterpret_cast<const uint32_t*>(x.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel for schedule(static) if (n >= 65536)
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = src[i];
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    dst[i] = nan ? uint16_t(0x7FC0) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  return out;
}

// Writes this step's k/v [T, KVH, D] into slots [T] (int64) of the caches, then: q [T, H, D] float32 or bfloat16;
// caches [num_blocks, block_size, KVH, D] (float32, bfloat16 or float16); block_tables [S, max_blocks] int32; seqs
// [S, 3] int32 rows (first flat row, number of tokens, position of the first token) -> [T, H, D] in q's dtype.
// bfloat16 queries are widened here and the output rounded back (the bits of q.float() in and .to(bfloat16) out):
// the two casts a bfloat16 model's layer made around the op cost two dispatches (~15 us each) a layer, 4 % of a
// 32-decode step
at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& block_tables,
                           const at::Tensor& seqs, double scale) {
  TORCH_CHECK(q_in.dim() == 3 && (q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16) &&
              q_in.stride(2) == 1 && q_in.stride(1) == q_in.size(2),
              "q must be float32 or bfloat16 [T, H, D] with contiguous rows");
  const bool bf16_q = q_in.scalar_type() == at::kBFloat16;
  const at::Tensor q = bf16_q ? widen_bf16(q_in) : q_in;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim] of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables must be contiguous int32 [S, max_blocks]");
  TORCH_CHECK(seqs.scalar_type() == at::kInt && seqs.is_contiguous() && seqs.dim() == 2 && seqs.size(1) == 3 &&
              seqs.size(0) == block_tables.size(0), "seqs must be contiguous int32 [S, 3]");
  const int64_t H = q.size(1), d = q.size(2), kvh = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == d && H % kvh == 0, "head shapes do not match");
  const int G = int(H / kvh);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == kvh &&
              v.size(1) == kvh && k.size(2) == d && v.size(2) == d && k.stride(2) == 1 && k.stride(1) == d &&
              v.stride(2) == 1 && v.stride(1) == d, "new K/V must be [T, kv_heads, head_dim] with contiguous rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == q.size(0),
              "slots must be contiguous int64 [T]");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < q.size(0); ++i)
    TORCH_CHECK(sl[i] >= 0 && sl[i] < k_cache.size(0) * bs, "slot ", sl[i], " is outside the cache");
  auto out = at::empty({q.size(0), H, d}, q.options());
  const int S = int(seqs.size(0)), max_blocks = int(block_tables.size(1));
  const int32_t* sq = seqs.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  // the slices of a few tokens (decodes, verifications) as items of all KV heads at once (each chunk of context
  // read once, sequentially) when there are enough of them to balance over the threads; else one per KV head, as
  // a lone decode needs both cores. Longer slices reuse each chunk for up to TQ tokens, where one head's chunk
  // staying in L1 (32 KB of float32 K/V) matters more: all heads' was 0.87x on a 512-token chunk
  int slices = 0;
  for (int i = 0; i < S; ++i) slices += (std::max(1, sq[3 * i + 1]) + TQ - 1) / TQ;
  const int few_heads = slices >= 4 * std::max(1, at::get_num_threads()) ? int(kvh) : 1;
  std::vector<Item> items;
  for (int i = 0; i < S; ++i) {
    const int row0 = sq[3 * i], ntok = sq[3 * i + 1], start = sq[3 * i + 2];
    TORCH_CHECK(row0 >= 0 && ntok >= 1 && start >= 0 && row0 + ntok <= q.size(0) &&
                (start + ntok + bs - 1) / bs <= max_blocks, "sequence ", i, " does not fit q or its block table");
    for (int t0 = 0; t0 < ntok; t0 += TQ) {
      const int nt = std::min(TQ, ntok - t0);
      const int per_item = nt <= FEW_TOKENS ? few_heads : 1;
      for (int h = 0; h < kvh; h += per_item)
        items.push_back({i, h, per_item, t0, nt, int64_t(nt) * (start + t0 + nt) * per_item});
    }
  }
  // heaviest first, handed out one at a time: prompt chunks and decodes of any lengths balance over the threads
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t blk_stride = bs * kvh * d, tok_stride = kvh * d;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int nitems = int(items.size());
  const int nthreads = std::max(1, std::min(at::get_num_threads(), nitems));
  // bf16 packs (KvPack) of the sequences whose chunk spans two items or more per KV head: words from pack_at[i]
  std::vector<int64_t> pack_at(S, -1);
  std::unique_ptr<uint32_t[]> packs;  // not value-initialised: pack_kv writes every word
  auto run = [&](auto* kc, auto* vc) {
#ifdef PL_BF16_DOT
    if constexpr (std::is_same<std::remove_cv_t<std::remove_pointer_t<decltype(kc)>>, c10::BFloat16>::value) {
      if (d % 32 == 0 && d <= 256) {
        struct Task { int seq, head, c0; };
        std::vector<Task> tasks;
        int64_t words = 0;
        for (int i = 0; i < S; ++i) {
          if (sq[3 * i + 1] < 2 * TQ) continue;
          const int end = sq[3 * i + 2] + sq[3 * i + 1];
          pack_at[i] = words;
          words += pack_words(end, int(d)) * kvh;
          for (int h = 0; h < kvh; ++h)
            for (int c0 = 0; c0 < end; c0 += KC) tasks.push_back({i, h, c0});
        }
        if (words) {
          packs.reset(new uint32_t[words]);
          const int ntasks = int(tasks.size());
#pragma omp parallel for schedule(static) num_threads(std::max(1, std::min(at::get_num_threads(), ntasks)))
          for (int w = 0; w < ntasks; ++w) {
            const Task& t = tasks[w];
            const int end = sq[3 * t.seq + 2] + sq[3 * t.seq + 1];
            pack_kv(kc, vc, blk_stride, tok_stride, int(bs), bt + int64_t(t.seq) * max_blocks, t.head, int(d), end,
                    t.c0, std::min(end, t.c0 + KC), packs.get() + pack_at[t.seq] + pack_words(end, int(d)) * t.head);
          }
        }
      }
    }
#endif
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int w = 0; w < nitems; ++w) {
      const Item& it = items[w];
      const int32_t* s = sq + 3 * it.seq;
#ifdef PL_TILE
      if (it.heads == 1 && it.ntok > FEW_TOKENS) {  // a prompt chunk's slice: the row tiles
        KvPack pk;
        if (pack_at[it.seq] >= 0) {
          const int end = s[2] + s[1];
          pk.k = packs.get() + pack_at[it.seq] + pack_words(end, int(d)) * it.head0;
          pk.v = pk.k + int64_t(end + PACK_PAD) * (d / 2);
        }
        attend_tiles(qp, q.stride(0), op, H, G, it.head0, int(d), kc, vc, blk_stride, tok_stride, int(bs),
                     bt + int64_t(it.seq) * max_blocks, s[0] + it.tok0, s[2] + it.tok0, it.ntok, float(scale), pk);
        continue;
      }
#endif
      if (it.ntok <= FEW_TOKENS &&
          attend_rows_fit(qp, q.stride(0), op, H, G, it.head0, it.heads, int(d), kc, vc, blk_stride, tok_stride,
                          int(bs), bt + int64_t(it.seq) * max_blocks, s[0] + it.tok0, s[2] + it.tok0, it.ntok,
                          float(scale)))
        continue;
      attend(qp, q.stride(0), op, H, G, it.head0, it.heads, int(d), kc, vc, blk_stride, tok_stride, int(bs),
             bt + int64_t(it.seq) * max_blocks, s[0] + it.tok0, s[2] + it.tok0, it.ntok, float(scale));
    }
  };
  auto write_and_run = [&](auto* kc, auto* vc) {
    write_slots(k, kc, sl, kvh * d);
    write_slots(v, vc, sl, kvh * d);
    run(kc, vc);
  };
  if (k_cache.scalar_type() == at::kFloat) {
    write_and_run(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    write_and_run(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(k_cache.scalar_type() == at::kHalf, "caches must be float32, bfloat16 or float16");
    write_and_run(k_cache.data_ptr<c10::Half>(), v_cache.data_ptr<c10::Half>());
  }
  return bf16_q ? narrow_bf16(out) : out;
}

}  // namespace

TORCH_LIBRARY(NAMESPACE, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "Tensor block_tables, Tensor seqs, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("paged_attention", &paged_attention); }
"""

AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl")


def supported_isas() -> tuple[str, ...]:
    """The builds this CPU can run, worst first: "generic" always, "avx2" where torch dispatches to AVX2 or
    AVX-512, "avx512" where /proc/cpuinfo also lists avx512f/bw/vl."""
    avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    avx512 = avx2 and set(AVX512_FLAGS) <= int4_kernel.cpu_flags()
    return ("generic",) + (("avx2",) if avx2 else ()) + (("avx512",) if avx512 else ())


def isa() -> str:
    """The instruction set the op is built for: the best of supported_isas(). PACELINE_ATTN_ISA=avx2 forces the
    AVX2 build on an AVX-512 machine (its tests and A/B runs); asking for an ISA this CPU lacks is a ValueError."""
    want = os.environ.get("PACELINE_ATTN_ISA", "auto")
    if want not in ("auto", "avx512", "avx2", "generic"):
        raise ValueError(f"PACELINE_ATTN_ISA must be auto, avx512, avx2 or generic, got {want!r}")
    supported = supported_isas()
    if want == "auto":
        return supported[-1]
    if want not in supported:
        raise ValueError(f"PACELINE_ATTN_ISA={want}: this CPU (or torch's dispatch) does not support it")
    return want


def _flags(target: str) -> list[str]:
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    if target in ("avx2", "avx512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if target == "avx512":  # the prompt-chunk row tiles and the decode position tiles in zmm registers
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl"]
        if "avx512_bf16" in int4_kernel.cpu_flags():  # bfloat16 pair dot products for a bfloat16 cache
            flags += ["-mavx512bf16"]
        if "avx512dq" in int4_kernel.cpu_flags():  # vreduceps: the prompt tiles' exp splits t in one op
            flags += ["-mavx512dq"]
    return flags


def _library_path() -> tuple[Path, str, list[str]]:
    from paceline.model.cache_dir import cache_root
    target = isa()
    key, flags = _key(target)
    # the ISA in the file name and the namespace: AVX2 and AVX-512 builds never collide, and both load in one
    # process (an A/B run switches PACELINE_ATTN_ISA between calls)
    return (cache_root() / "kernels" / f"paged_attention-{target}-{key}.so", f"paceline_attn_{target}_{key}",
            flags)


@functools.cache  # once per ISA: load() runs every step, and hashing the source costs ~20 us
def _key(target: str) -> tuple[str, list[str]]:
    flags = _flags(target)
    return hashlib.sha256("\n".join([SOURCE, torch.__version__, *flags]).encode()).hexdigest()[:16], flags


def enabled() -> bool:
    return os.environ.get("PACELINE_ATTN_KERNEL", "1") != "0"


def load() -> Callable | None:
    """The op `(q, k, v, k_cache, v_cache, slots, block_tables, seqs, scale) -> out`, building it first if needed; None when it
    is switched off or cannot be built here (the reason is logged once)."""
    if not enabled():
        return None
    path, namespace, flags = _library_path()
    return int4_kernel.load_op(path, namespace, flags, SOURCE, "paged_attention",
                               "CPU paged-attention kernel unavailable, using gather + SDPA")
