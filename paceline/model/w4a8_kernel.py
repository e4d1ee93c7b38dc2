"""An int4-weight x int8-activation matmul for CPU steps of many rows (AVX2, or AVX512-VNNI), built once and cached.

Why: on this kind of CPU (AVX2, no VNNI, no AVX-512) the many-row steps of an int4 model were float32 FMA-bound:
int4_kernel.py's GEMM dequantizes the codes and runs at the two cores' float32 peak. `vpmaddubsw` multiplies 32
unsigned bytes by 32 signed bytes and adds pairs into int16: 32 multiply-adds per instruction against an FMA's 8.
Q4_1's codes are unsigned 0..15, so with int8 activations a pair is at most 2 * 15 * 127 = 3810 and eight such
products summed in int16 (a whole block of 32 inputs, 4 inputs per 32-bit lane) stay below 32767: no saturation,
the block's integer dot product is exact.

Numerics (weights exact, activations rounded): per group of 32 inputs the weight is w = d * q + m (the GGUF's own
Q4_1 code q, scale d and minimum m, held in float32: no rounding of d and m to bfloat16 as the int4 op does). Each
row's activations are quantized per block of 32 inputs: the block's largest |x| is taken out first (its index t and
value xo kept, a 0 in its place; without this a large channel of the residual stream rounded its block's other 31
values to a few steps, and top-1 agreement with fp32 fell from 99.4 to 97.7 %), then symmetric: a = max|rest| /
127, xq = round(x / a) in int8 (computed as x * (127 / max|rest|), round half to even). Then

    y[r, c] = sum over blocks b of  d[c, b] * a[r, b] * (sum_k q[c, k] * xq[r, k])  +  m[c, b] * s[r, b]
                                    + (d[c, b] * q[c, t] + m[c, b]) * xo[r, b]

with s[r, b] = a[r, b] * sum_k xq[r, k], the block sum of the quantized activations rather than of x: the error
of the product is then sum_k w_k e_k (e the activation rounding) instead of d * sum_k q_k e_k, and with centred
weights (m ~ -7.5 d) |w_k| is on average about half of d * q_k. Float32 for the per-block scaling and the sums.

Layout (pack): columns in tiles of 16, each tile's blocks in order; per block 8 steps of 4 inputs, then the 16
scales and the 16 minimums as float32. A step holds, per column, its 4 inputs' codes in one 32-bit lane, so one
broadcast of 4 activation bytes against one vector of codes makes 32 multiply-adds (the VNNI layout). Codes are
either bytes (two vectors of 8 columns a step: 1.25 bytes a weight with the scales) or nibbles (one vector a step,
column j in the low and j + 8 in the high nibble, unpacked with an and and a shift: 0.75 bytes a weight); which one
is faster was measured (benchmarks/int4_linear.py --w4a8), see docs/performance.md.

The micro-kernel holds R rows x 16 columns of int16 accumulators over a block, then per block and row one
`vpmaddwd` with ones to int32, a conversion, and two FMAs (scale and minimum) into float32 sums (kept in a per-thread buffer, not registers: see tile_rows), and the
taken-out element: its 16 codes picked from the block with a shift, dequantized, one more FMA. Rows are
cut into chunks of 128 whose int8 activations stay in L2 while every tile of weights runs over them.

Two builds of this one source, picked at build time from what the CPU reports (isa()): "avx2" (-mavx2 -mfma
-mf16c, the kernel above) and, where /proc/cpuinfo lists avx512f, avx512bw, avx512vl and avx512_vnni, "vnni"
(those flags added): `vpdpbusd` multiplies the unsigned codes by the signed activations and adds 4 products into
each int32 lane in one instruction (in place of vpmaddubsw + vpaddw, and no vpmaddwd per block), a step's 16
columns fill one zmm, the 32 registers hold every sum of up to 12 rows a pass (its best, 0 in max_rows), and the
activation quantizer searches each block with vector reductions instead of a compare and a branch per value. The
integer block sums are exact in both and the float32 operations are the same, lane by lane and in the same order,
so the two builds give the same bits (tests/model/test_w4a8.py checks it). Zen 4 runs a zmm instruction as two
256-bit halves; zmm still beat ymm VNNI here (fewer instructions a step: one code vector, one broadcast per row).
The VNNI build's data path (run_vnni): the quantizer writes the int8 activations step-major ([K / 4][M][4]) and
the per-block values as [G][M], so a pass of R rows reads them through one pointer with constant offsets (row-major,
the 12 rows' pointers spilled to the stack and were reloaded every block); the quantizer and the tiles share one
parallel region; bfloat16 sums are rounded and stored from the registers (no float32 scratch of the whole output,
no zeroed buffers); and the first pass over a tile prefetches the next tile into L2 (a weight streamed from memory
ran ~10 % slower than one in cache without it). The same bits; figures in docs/performance.md (2026-11-24). What
bounds it now: on Zen 4 vpdpbusd and the float32 multiply/FMAs share the FMA pipes (in a loop of independent ones,
vpdpbusd alone, FMAs alone and a mix of both ran at the same total rate), and each row and block costs 8 vpdpbusd
and 5 multiplies/FMAs (scale, minimum, the taken-out element), so these numerics cap the op at 8/13 of the
vpdpbusd rate.

Row numerics (numerics(), the VNNI build's default since 2026-11-25; SOURCE's run_row): the block numerics above
spend 5 FMA-pipe operations per row and block besides the 8 vpdpbusd. Here each row's ROW_TOPK (4) largest |x| are
taken out (exact, float32) and the rest is quantized with one scale per row, A / 127 (A = max|rest|), refined per
block by a power of two 2^-f (f in 0..ROW_FMAX = 3, the largest with max|block| * 2^f <= A), so the block's integer
dot product only needs a left shift by ROW_FMAX - f (an integer op) to share the row's unit, then one conversion and
two FMAs (scale d, and the minimum m times the block's shifted int8 sum); the unit multiplies the row once at the
end. The taken-out inputs' weights are dequantized once per tile and chunk for every distinct index among the
chunk's rows (a step's rows mostly share their largest channels), then one FMA per row and index. Per row, block of
32 and tile: 8 vpdpbusd + 1 shift + 1 conversion + 2 FMAs, against 8 + 2 conversions + 5 multiplies/FMAs. Quality
(torch emulation first, benchmarks/quality.py's "emu SPEC" modes, then the op; benchmarks/summaries/w4a8_rows.md):
one scale per row without refinement lost (top-1 vs fp32 97.21 % with 4 outliers out, KL 0.0024), the refinement
and the 4 outliers out meet the int4 default's bar (whole windows top-1 97.87 %, KL 0.0015, against 97.82 % /
0.0017 with the dense copies; the block numerics at every row count: 98.21 % / 0.0009). Measured on Zen 4 (same
file): the op alone 1.00-1.13x the block numerics at 12-512 rows with 4 outliers, 1.13-1.27x without any (the
outliers' search and table cost the difference), whole steps 1.10-1.26x from 128 rows; it serves every int4 step
of 7+ rows by default there (llama.w4a8_serves_every_row), with no dense copy. What bounds it now: a pure integer loop (no float
work at all, wrong numerics) was 1.45-1.5x the block numerics, so the remaining conversion and FMAs still cost ~20 %.
The AVX2 build keeps the block numerics (it has no others); `PACELINE_W4A8_NUMERICS=block` gives the VNNI build
the block numerics again (then the two builds give the same bits, as above).
`PACELINE_W4A8_ISA=avx2` forces the AVX2 build (A/B runs, tests); the key of a build hashes its flags, so no two
builds (ISA, numerics) share a file. Built with int4_kernel.load_op (same cache, lock and fallback). `PACELINE_W4A8_KERNEL=0` switches it off (the
model then serves those steps as before; PACELINE_W4A8_LINEARS, llama.py, picks the linears). CUDA never builds it (Int4Linear is CPU only).
"""
from __future__ import annotations

import hashlib
import os
from typing import Callable

import torch

from paceline.model import int4_kernel

GROUP = 32  # inputs per scale/minimum pair (llama.INT4_GROUP, Q4_1's block)
TILE = 16  # output columns per tile
MAX_R = 0  # rows per pass of the micro-kernel: 0 lets the build pick its best (4 AVX2, 12 VNNI; it takes 1-6 / 1-12)


def block_bytes(nibbles: bool) -> int:
    return (GROUP * TILE // 2 if nibbles else GROUP * TILE) + 2 * 4 * TILE


SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int GROUP = 32, TILE = 16, STEPS = GROUP / 4, ROW_CHUNK = 128;

template <bool NIB> constexpr int code_bytes() { return NIB ? GROUP * TILE / 2 : GROUP * TILE; }
template <bool NIB> constexpr int block_bytes() { return code_bytes<NIB>() + 2 * 4 * TILE; }

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// one block of 32 inputs as float32: the input's own floats, or a bfloat16 input widened (exact) into buf
template <typename T>
inline const float* block_floats(const T* p, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return p;
  } else {
    for (int k = 0; k < GROUP; ++k) buf[k] = float(p[k]);
    return buf;
  }
}

// rows of x [M, K] (row stride ldx) -> xq [M][K] int8, a [M][G] = max|x| / 127, s [M][G] = a * sum xq, with each
// block's largest element (the first of equal ones) taken out first: its index in top [M][G], its value in xo [M][G]
// and a 0 in its place, so that one large channel does not round the block's other 31 values away
template <typename T>
void quantize_rows(const T* x, int64_t ldx, int M, int K, int8_t* xq, float* a, float* s, int32_t* top,
                   float* xo, int nthreads) {
  const int G = K / GROUP;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the lane interleave of the packs
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) {
      alignas(32) float blk[GROUP], wide[GROUP];
      std::memcpy(blk, block_floats(x + int64_t(m) * ldx + g * GROUP, wide), sizeof(blk));
      int ti = 0;
      float tv = std::fabs(blk[0]);
      for (int k = 1; k < GROUP; ++k)
        if (std::fabs(blk[k]) > tv) { tv = std::fabs(blk[k]); ti = k; }
      top[int64_t(m) * G + g] = ti;
      xo[int64_t(m) * G + g] = blk[ti];
      blk[ti] = 0.0f;
      const __m256 v0 = _mm256_load_ps(blk), v1 = _mm256_load_ps(blk + 8), v2 = _mm256_load_ps(blk + 16),
                   v3 = _mm256_load_ps(blk + 24);
      const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                      _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
      const float amax = hmax8(mx);
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      // cvtps rounds half to even (the default MXCSR mode); |x * inv| <= 127, so the packs never saturate
      const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv)),
                    q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
      const __m256i b = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3)), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + int64_t(m) * K + g * GROUP), b);
      const float scale = amax / 127.0f;
      a[int64_t(m) * G + g] = scale;
      s[int64_t(m) * G + g] = scale * float(hsum8i(_mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3))));
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
// quantize_rows for the VNNI build, the same bits without the scalar search: with the tile kernel's int8 work 1.4x
// faster, the AVX2 build's element-by-element search for the block's largest |x| (a compare and a branch each)
// took 13 % of a 512-row linear's time (perf, 2026-11-24). Here the largest |x| of a block's 32 values is one
// vector reduction, its first index the lowest set bit of an equality mask (the first of equal ones, as above),
// the rest's maximum a second reduction; max and the integer sum do not depend on their order, and each value's
// rounding is the same multiply and conversion, so every output equals the AVX2 build's.
// one block of 32 values: its int8 values (two vectors of 16 int32), and through the references its scale a,
// sum s, taken-out index ti and value xo
template <typename T>
inline void quantize_block_avx512(const T* p, __m512i& q0, __m512i& q1, float& a, float& s, int& ti, float& xo) {
  alignas(64) float wide[GROUP];
  const float* blk = block_floats(p, wide);
  __m512 v0 = _mm512_loadu_ps(blk), v1 = _mm512_loadu_ps(blk + 16);
  const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
  const __m512 tv = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(a0, a1)));
  const uint32_t eq = uint32_t(_mm512_cmp_ps_mask(a0, tv, _CMP_EQ_OQ)) |
                      (uint32_t(_mm512_cmp_ps_mask(a1, tv, _CMP_EQ_OQ)) << 16);
  ti = eq ? __builtin_ctz(eq) : 0;  // eq == 0 only for NaNs
  xo = blk[ti];
  const __mmask16 k0 = ti < 16 ? __mmask16(1u << ti) : 0, k1 = ti >= 16 ? __mmask16(1u << (ti - 16)) : 0;
  v0 = _mm512_mask_mov_ps(v0, k0, _mm512_setzero_ps());
  v1 = _mm512_mask_mov_ps(v1, k1, _mm512_setzero_ps());
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
  q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  a = amax / 127.0f;
  s = a * float(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
}

template <typename T>
void quantize_rows_avx512(const T* x, int64_t ldx, int M, int K, int8_t* xq, float* a, float* s, int32_t* top,
                          float* xo, int nthreads) {
  const int G = K / GROUP;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) {
      __m512i q0, q1;
      const int64_t i = int64_t(m) * G + g;
      quantize_block_avx512(x + int64_t(m) * ldx + g * GROUP, q0, q1, a[i], s[i], top[i], xo[i]);
      int8_t* out = xq + int64_t(m) * K + g * GROUP;  // |q| <= 127: the narrowing never saturates
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(q1));
    }
}

// The same values in the layout the VNNI matmul reads (inside one parallel region, hence `omp for`): xq step-major,
// the M rows' 4 bytes of one step of 4 inputs side by side ([K / 4][M][4]), and a, s, xo as [G][M], so that a pass
// of R rows reads each with one pointer and constant offsets (row-major, 12 rows' pointers did not fit the 16
// general registers and the micro-kernel reloaded them from the stack every block: perf annotate, 2026-11-24); in
// place of the index ti its code's byte offset in the unpacked step buffer of tile_rows_vnni, 64 * (ti / 4) + ti % 4.
// Blocks, not rows, are split between the threads: a step's M * 4 bytes are then written by one thread.
template <typename T>
void quantize_steps(const T* x, int64_t ldx, int M, int K, int8_t* xs, float* a, float* s, int32_t* off, float* xo) {
  const int G = K / GROUP;
#pragma omp for schedule(static)
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < M; ++m) {
      __m512i q0, q1;
      const int64_t i = int64_t(g) * M + m;
      int ti;
      quantize_block_avx512(x + int64_t(m) * ldx + g * GROUP, q0, q1, a[i], s[i], ti, xo[i]);
      off[i] = 64 * (ti >> 2) + (ti & 3);
      alignas(16) int32_t q4[8];  // the block's 8 steps of 4 int8 (|q| <= 127: the narrowing never saturates)
      _mm_store_si128(reinterpret_cast<__m128i*>(q4), _mm512_cvtsepi32_epi8(q0));
      _mm_store_si128(reinterpret_cast<__m128i*>(q4 + 4), _mm512_cvtsepi32_epi8(q1));
      int8_t* out = xs + 4 * (int64_t(g) * STEPS * M + m);  // bytes, read back with memcpy: no type punning
      for (int st = 0; st < STEPS; ++st) std::memcpy(out + 4 * int64_t(st) * M, q4 + st, 4);
    }
}
#define QUANTIZE_ROWS quantize_rows_avx512
#else
#define QUANTIZE_ROWS quantize_rows
#endif

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// block g of the next tile into L2, a block per block (see run_vnni); nothing for pf == nullptr. always_inline:
// with a plain `inline` gcc 12 weighed the micro-kernels anew and built constprop clones of tile_rows_row<10..12>,
// whose code ran a 32-decode step in 36.6 ms against 30.4 for the same source written out in place (Zen 4 VM,
// 2026-11-29); with the attribute the build has no such clones and the step takes 27.9 ms against 27.9
template <bool NIB>
__attribute__((always_inline)) inline void prefetch_block(const uint8_t* pf, int g) {
  if (pf != nullptr)
    for (int l = 0; l < block_bytes<NIB>(); l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(pf + size_t(g) * block_bytes<NIB>() + l), _MM_HINT_T1);
}

// y[r][0..nn) = sum over the G blocks of one tile, for R rows of int8 activations (row stride K); bias b[16].
// Not inlined: alone it gets the 16 vector registers for the 2R int16 accumulators, the codes and a broadcast.
// The float32 sums live in `acc` (R x 16, the caller's scratch), loaded and stored once per block: held in
// registers across the blocks (2R more) they pushed the int16 accumulators of the inner loop onto the stack
// (perf annotate, 2026-11-24: a spill and reload per multiply-add step); in memory the compiler cannot keep them
// in registers (acc may alias the other float inputs), and the bits are the same.
template <int R, bool NIB>
__attribute__((noinline)) void tile_rows(const int8_t* xq, int64_t K, const float* a, const float* s,
                                         const int32_t* top, const float* xo, int G, const uint8_t* tile,
                                         const float* b, float* y, int64_t ldy, int nn, float* acc) {
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F), lowd = _mm256_set1_epi32(0x0F);
  for (int r = 0; r < 2 * R; ++r) _mm256_storeu_ps(acc + 8 * r, _mm256_setzero_ps());
  for (int g = 0; g < G; ++g) {
    const uint8_t* blk = tile + size_t(g) * block_bytes<NIB>();
    const int8_t* xg = xq + g * GROUP;
    __m256i c0[R], c1[R];
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int st = 0; st < STEPS; ++st) {
      __m256i w0, w1;
      if (NIB) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * st));
        w0 = _mm256_and_si256(v, low);
        w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      } else {
        w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * st));
        w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * st + 32));
      }
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256i xb = bcast4(xg + r * K + 4 * st);
        const __m256i p0 = _mm256_maddubs_epi16(w0, xb), p1 = _mm256_maddubs_epi16(w1, xb);
        c0[r] = _mm256_add_epi16(c0[r], p0);
        c1[r] = _mm256_add_epi16(c1[r], p1);
      }
    }
    const float* sc = reinterpret_cast<const float*>(blk + code_bytes<NIB>());
    const __m256 d0 = _mm256_loadu_ps(sc), d1 = _mm256_loadu_ps(sc + 8), m0 = _mm256_loadu_ps(sc + 16),
                 m1 = _mm256_loadu_ps(sc + 24);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r * G + g), sr = _mm256_broadcast_ss(s + r * G + g);
      const __m256 i0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(c0[r], ones));
      const __m256 i1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(c1[r], ones));
      __m256 f0 = _mm256_loadu_ps(acc + 16 * r), f1 = _mm256_loadu_ps(acc + 16 * r + 8);
      f0 = _mm256_fmadd_ps(m0, sr, _mm256_fmadd_ps(_mm256_mul_ps(i0, d0), ar, f0));
      f1 = _mm256_fmadd_ps(m1, sr, _mm256_fmadd_ps(_mm256_mul_ps(i1, d1), ar, f1));
      // the block's largest element, taken out of the int8 block: its 16 codes, w = d * q + m, times it in float32
      const int ti = top[r * G + g];
      const __m128i sh = _mm_cvtsi32_si128(8 * (ti & 3));
      __m256i q0, q1;
      if (NIB) {
        const __m256i v = _mm256_srl_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * (ti >> 2))), sh);
        q0 = _mm256_and_si256(v, lowd);
        q1 = _mm256_and_si256(_mm256_srli_epi32(v, 4), lowd);
      } else {
        q0 = _mm256_and_si256(_mm256_srl_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * (ti >> 2))), sh), lowd);
        q1 = _mm256_and_si256(_mm256_srl_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * (ti >> 2) + 32)), sh), lowd);
      }
      const __m256 xr = _mm256_broadcast_ss(xo + r * G + g);
      _mm256_storeu_ps(acc + 16 * r, _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), d0, m0), xr, f0));
      _mm256_storeu_ps(acc + 16 * r + 8, _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), d1, m1), xr, f1));
    }
  }
  const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
  for (int r = 0; r < R; ++r) {
    const __m256 f0 = _mm256_loadu_ps(acc + 16 * r), f1 = _mm256_loadu_ps(acc + 16 * r + 8);
    if (nn == TILE) {
      _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(f0, b0));
      _mm256_storeu_ps(y + r * ldy + 8, _mm256_add_ps(f1, b1));
    } else {  // the last, partial tile of an output size that is not a multiple of 16
      alignas(32) float tmp[TILE];
      _mm256_store_ps(tmp, _mm256_add_ps(f0, b0));
      _mm256_store_ps(tmp + 8, _mm256_add_ps(f1, b1));
      std::memcpy(y + r * ldy, tmp, sizeof(float) * nn);
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
// The VNNI build (w4a8_kernel.isa() == "vnni"): the same sums, one `vpdpbusd` (unsigned codes x signed activations,
// 4 products added into each int32 lane) per step and row in place of vpmaddubsw + vpaddw, and the block's
// vpmaddwd gone. A step's 16 columns fill one zmm (lane j = column j), so the per-block float32 work runs once per
// row on 16 lanes instead of twice on 8, and the 32 vector registers hold every sum (integer and float32) of up
// to 12 rows (MAX_ROWS; 12 measured best: BEST_ROWS). The integer block sums are exact in both builds and the
// float32 operations, lane by lane, are the AVX2 path's in the same order, so the two builds give the same bits
// (tests/model/test_w4a8.py).
template <bool NIB>
inline __m512i step_codes(const uint8_t* blk, int st, __m512i nibshift, __m512i low) {
  if (NIB) {  // 8 columns' low nibbles in the low half, the other 8's high nibbles in the high half
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * st)));
    return _mm512_and_si512(_mm512_srlv_epi64(v, nibshift), low);
  }
  return _mm512_loadu_si512(blk + 64 * st);
}

// float32 -> bfloat16 of 16 lanes, as c10::BFloat16(float) rounds: to nearest even by adding 0x7FFF plus the
// kept part's lowest bit, NaN as 0x7FC0
inline __m256i bf16_round(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// R rows of one tile. xs: the step-major int8 activations (quantize_steps) from the pass's first row on, sstride
// bytes a step (4 * M); a, s, off, xo: [G][M] from the pass's first row on, M apart per block. The sums go to y
// (float32) or, where ybf is given, straight to bfloat16 (no float32 scratch of the whole output, no second pass).
template <int R, bool NIB>
__attribute__((noinline)) void tile_rows_vnni(const int8_t* xs, int64_t sstride, const float* a, const float* s,
                                              const int32_t* off, const float* xo, int64_t M, int G,
                                              const uint8_t* tile, const float* b, float* y, c10::BFloat16* ybf,
                                              int64_t ldy, int nn, const uint8_t* pf) {
  const __m512i low = _mm512_set1_epi8(0x0F), lowd = _mm512_set1_epi32(0x0F);
  const __m512i nibshift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
  // the block's codes as bytes, one step of 4 inputs x 16 columns per 64 bytes, and 64 bytes of slack: an
  // unaligned load at 64 * (t / 4) + t % 4 puts input t's code of column j in the low byte of lane j
  alignas(64) uint8_t steps[NIB ? (STEPS + 1) * 64 : 64];
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    const uint8_t* blk = tile + size_t(g) * block_bytes<NIB>();
    prefetch_block<NIB>(pf, g);
    const uint8_t* codes = NIB ? steps : blk;  // bytes: the pack's own steps (the scales follow the last one)
    const int8_t* xg = xs + int64_t(g) * STEPS * sstride;
    const int64_t gi = int64_t(g) * M;
    __m512i c[R];
    for (int r = 0; r < R; ++r) c[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int st = 0; st < STEPS; ++st) {
      const __m512i w = step_codes<NIB>(blk, st, nibshift, low);
      if (NIB) _mm512_store_si512(steps + 64 * st, w);
      const int8_t* xst = xg + st * sstride;
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xst + 4 * r, 4);
        c[r] = _mm512_dpbusd_epi32(c[r], w, _mm512_set1_epi32(x4));
      }
    }
    const float* sc = reinterpret_cast<const float*>(blk + code_bytes<NIB>());
    const __m512 d = _mm512_loadu_ps(sc), m = _mm512_loadu_ps(sc + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 ar = _mm512_set1_ps(a[gi + r]), sr = _mm512_set1_ps(s[gi + r]);
      f[r] = _mm512_fmadd_ps(m, sr, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c[r]), d), ar, f[r]));
      // the taken-out element: its 16 codes, w = d * q + m, times it
      const __m512i q = _mm512_and_si512(_mm512_loadu_si512(codes + off[gi + r]), lowd);
      f[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m), _mm512_set1_ps(xo[gi + r]), f[r]);
    }
  }
  const __m512 bv = _mm512_loadu_ps(b);
  const __mmask16 keep = __mmask16((1u << nn) - 1);  // the last tile of an output size not a multiple of 16
  for (int r = 0; r < R; ++r) {
    if (ybf != nullptr)
      _mm256_mask_storeu_epi16(ybf + r * ldy, keep, bf16_round(_mm512_add_ps(f[r], bv)));
    else
      _mm512_mask_storeu_ps(y + r * ldy, keep, _mm512_add_ps(f[r], bv));
  }
}

// run's VNNI form: the quantizer and the tiles in one parallel region (one fork and join a call, not two), the
// activations in quantize_steps's layout
template <bool NIB, typename T>
void run_vnni(const T* x, int64_t ldx, int M, int K, const uint8_t* w, int64_t N, const float* b, float* y,
              c10::BFloat16* ybf, int nthreads, int max_r) {
  const int G = K / GROUP, T_ = int((N + TILE - 1) / TILE);
  // not std::vector: its zeroing of every buffer took ~4 % of a 32-row call (perf, 2026-11-24); each is written
  // whole by the quantizer before it is read
  std::unique_ptr<int8_t[]> xs(new int8_t[size_t(M) * K]);
  std::unique_ptr<float[]> a(new float[size_t(M) * G]), s(new float[size_t(M) * G]), xo(new float[size_t(M) * G]);
  std::unique_ptr<int32_t[]> off(new int32_t[size_t(M) * G]);
#pragma omp parallel num_threads(nthreads)
  {
  quantize_steps<T>(x, ldx, M, K, xs.get(), a.get(), s.get(), off.get(), xo.get());  // ends in a barrier
  for (int mc = 0; mc < M; mc += ROW_CHUNK) {  // a chunk's int8 rows stay in L2 while every tile runs over them
    const int mn = std::min(ROW_CHUNK, M - mc), passes = (mn + max_r - 1) / max_r;
#pragma omp for schedule(static) nowait
    for (int t = 0; t < T_; ++t) {
      const uint8_t* tile = w + size_t(t) * G * block_bytes<NIB>();
      const int n0 = t * TILE, nn = int(std::min<int64_t>(TILE, N - n0));
      // the first pass over a tile pulls the next one into L2
      const uint8_t* next = t + 1 < T_ ? tile + size_t(G) * block_bytes<NIB>() : nullptr;
      for (int p = 0, m0 = mc; p < passes; ++p) {
        const int R = (mc + mn - m0 + (passes - p) - 1) / (passes - p);  // rows split evenly over the passes
        const uint8_t* pf = p == 0 ? next : nullptr;
        const int8_t* xr = xs.get() + 4 * int64_t(m0);
        const float *ar = a.get() + m0, *sr = s.get() + m0, *xr_o = xo.get() + m0;
        const int32_t* tr = off.get() + m0;
        float* yr = y == nullptr ? nullptr : y + int64_t(m0) * N + n0;
        c10::BFloat16* yb = ybf == nullptr ? nullptr : ybf + int64_t(m0) * N + n0;
        switch (R) {
#define W4A8_CASE(n) case n: tile_rows_vnni<n, NIB>(xr, 4 * int64_t(M), ar, sr, tr, xr_o, M, G, tile, b + n0, yr, yb, N, nn, pf); break;
          W4A8_CASE(1) W4A8_CASE(2) W4A8_CASE(3) W4A8_CASE(4) W4A8_CASE(5) W4A8_CASE(6) W4A8_CASE(7) W4A8_CASE(8)
          W4A8_CASE(9) W4A8_CASE(10) W4A8_CASE(11)
          default: tile_rows_vnni<12, NIB>(xr, 4 * int64_t(M), ar, sr, tr, xr_o, M, G, tile, b + n0, yr, yb, N, nn, pf); break;
#undef W4A8_CASE
        }
        m0 += R;
      }
    }
  }
  }
}
#ifdef W4A8_ROW_TOPK
// The "row" numerics (w4a8_kernel.numerics(); the VNNI build's default). Why: per row and block of 32 the block
// numerics above spend 5 FMA-pipe operations besides the 8 vpdpbusd (the scale multiply, the minimum's FMA, the
// taken-out element's dequantize and FMA), and on Zen 4 both kinds share the FMA pipes. Here a row-block costs a
// conversion and two FMAs. Each row's TOPK largest |x| are taken out (kept exact in float32); the rest is
// quantized with one scale per row, A / 127 (A = max|rest|), refined per block by a power of two: block b's
// values are rounded at A / 127 * 2^-f_b, f_b in 0..FMAX the largest with max|block| * 2^f_b <= A, so that a block
// of small values keeps its precision. The block's exact integer dot product c_b is then shifted left by
// FMAX - f_b (an integer op: |c_b| < 2^16, so < 2^30 after it, and its conversion stays exact) and every block of
// the row shares one float32 unit u = A / 127 * 2^-FMAX, applied once per row at the end:
//     y[r, c] = u * sum_b (float(c_b << (FMAX - f_b)) * d[c, b] + m[c, b] * S[r, b])  +  sum_j w[c, t_j] * x[r, t_j]
// with S[r, b] = (block b's sum of int8 values) << (FMAX - f_b): the minimum times the quantized block sum, as in
// the block numerics. The taken-out inputs' weights w[c, t] = d * q + m are dequantized once per tile and input
// index for all of a chunk's rows (the rows of a step mostly share their largest channels), then one FMA per row
// and index: per row in a fixed order from values that depend on nothing but the weights, so a row's result does
// not depend on the other rows or the thread count. A row with a NaN gives NaN everywhere (u = NaN).
constexpr int TOPK = W4A8_ROW_TOPK, FMAX = W4A8_ROW_FMAX, TK = TOPK > 0 ? TOPK : 1;
static_assert(TOPK >= 0 && TOPK <= 16 && FMAX >= 0 && FMAX <= 14, "W4A8_ROW_TOPK 0..16, W4A8_ROW_FMAX 0..14");
constexpr float POW2[16] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768};

// one row -> its int8 values step-major (xs, rows 4 * M bytes apart per step), sh and S per block ([G][M] from this
// row on, M apart), u, and its TOPK taken-out inputs (index, value). buf: K floats, vmax: K / 16 floats of scratch
// and 16 of zeros after them.
template <typename T>
inline void quantize_row(const T* x, int K, int64_t M, float* buf, float* vmax, int8_t* xs, int32_t* sh, float* S,
                         float* u, int32_t* tidx, float* tval) {
  const int G = K / GROUP, V = K / 16;
  __m512 nan = _mm512_setzero_ps();
  for (int v = 0; v < V; ++v) {
    __m512 x16;
    if constexpr (std::is_same_v<T, float>) x16 = _mm512_loadu_ps(x + 16 * v);
    else x16 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * v))), 16));
    const __mmask16 bad = _mm512_cmp_ps_mask(x16, x16, _CMP_UNORD_Q);
    nan = _mm512_mask_mov_ps(nan, bad, x16);
    x16 = _mm512_maskz_mov_ps(__mmask16(~bad), x16);  // NaNs out of the search and the sums (u says NaN)
    _mm512_storeu_ps(buf + 16 * v, x16);
    vmax[v] = _mm512_reduce_max_ps(_mm512_abs_ps(x16));
  }
  for (int j = 0; j < TOPK; ++j) {  // the largest |x| left (the first of equal ones): through the 16-wide maxima
    __m512 mv = _mm512_setzero_ps();
    for (int v = 0; v < V; v += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(vmax + v));  // vmax is padded with 0s
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    int bv = 0;
    for (int v = 0; v < V; v += 16) {
      const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(vmax + v), top, _CMP_EQ_OQ);
      if (eq) { bv = v + __builtin_ctz(eq); break; }
    }
    const __m512 x16 = _mm512_loadu_ps(buf + 16 * bv);
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_abs_ps(x16), top, _CMP_EQ_OQ);
    const int t = 16 * bv + __builtin_ctz(uint32_t(eq) | 0x10000u);
    tidx[j] = t;
    tval[j] = buf[t];  // 0 where the row has fewer nonzero values than TOPK: it adds nothing
    buf[t] = 0.0f;
    vmax[bv] = _mm512_reduce_max_ps(_mm512_abs_ps(_mm512_loadu_ps(buf + 16 * bv)));
  }
  float A = 0.0f;
  for (int v = 0; v < V; ++v) A = std::max(A, vmax[v]);
  const float inv = A > 0.0f ? 127.0f / A : 0.0f;
  for (int g = 0; g < G; ++g) {
    const __m512 v0 = _mm512_loadu_ps(buf + g * GROUP), v1 = _mm512_loadu_ps(buf + g * GROUP + 16);
    const float B = std::max(vmax[2 * g], vmax[2 * g + 1]);
    int f = 0;  // multiplying by a power of two is exact: B * 2^f <= A compares the true values
    while (f < FMAX && (B == 0.0f || B * POW2[f + 1] <= A)) ++f;
    const __m512 bi = _mm512_set1_ps(inv * POW2[f]);  // a power of two times inv
    // cvtps rounds half to even (the default MXCSR mode); |x * bi| <= 127, so the narrowing never saturates
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, bi)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, bi));
    const int s = FMAX - f;
    sh[int64_t(g) * M] = s;
    S[int64_t(g) * M] = float(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)) * (1 << s));  // |.| < 2^26: exact
    alignas(16) int32_t q4[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(q4), _mm512_cvtsepi32_epi8(q0));
    _mm_store_si128(reinterpret_cast<__m128i*>(q4 + 4), _mm512_cvtsepi32_epi8(q1));
    int8_t* out = xs + int64_t(g) * STEPS * 4 * M;  // bytes, read back with memcpy: no type punning
    for (int st = 0; st < STEPS; ++st) std::memcpy(out + 4 * int64_t(st) * M, q4 + st, 4);
  }
  const float unit = A / 127.0f / POW2[FMAX];
  *u = _mm512_reduce_add_ps(nan) == 0.0f ? unit : std::numeric_limits<float>::quiet_NaN();
}

// R rows of one tile in the row numerics. xs, sh, S: as tile_rows_vnni's xs, a, s; u: the rows' units; slot,
// tval: the rows' TOPK taken-out inputs as rows of `table` (this tile's dequantized weights of the chunk's
// taken-out inputs, 16 floats each) and their values.
template <int R, bool NIB>
__attribute__((noinline)) void tile_rows_row(const int8_t* xs, int64_t sstride, const int32_t* sh, const float* S,
                                             const float* u, const int32_t* slot, const float* tval,
                                             const float* table, int64_t M, int G, const uint8_t* tile,
                                             const float* b, float* y, c10::BFloat16* ybf, int64_t ldy, int nn,
                                             const uint8_t* pf) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i nibshift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    const uint8_t* blk = tile + size_t(g) * block_bytes<NIB>();
    prefetch_block<NIB>(pf, g);
    const int8_t* xg = xs + int64_t(g) * STEPS * sstride;
    const int64_t gi = int64_t(g) * M;
    __m512i c[R];
    for (int r = 0; r < R; ++r) c[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int st = 0; st < STEPS; ++st) {
      const __m512i w = step_codes<NIB>(blk, st, nibshift, low);
      const int8_t* xst = xg + st * sstride;
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r)  // the row's 4 activation bytes broadcast by the vpdpbusd itself ({1to16}):
        // for the intrinsic with _mm512_set1_epi32, GCC emits a vpbroadcastd apiece (8 % slower at 128 rows)
        asm("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(c[r]) : "m"(*reinterpret_cast<const int32_t*>(xst + 4 * r)), "v"(w));
    }
    const float* sc = reinterpret_cast<const float*>(blk + code_bytes<NIB>());
    const __m512 d = _mm512_loadu_ps(sc), m = _mm512_loadu_ps(sc + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512i ci = FMAX > 0 ? _mm512_sllv_epi32(c[r], _mm512_set1_epi32(sh[gi + r])) : c[r];
      f[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(S[gi + r]), _mm512_fmadd_ps(_mm512_cvtepi32_ps(ci), d, f[r]));
    }
  }
  const __m512 bv = _mm512_loadu_ps(b);
  const __mmask16 keep = __mmask16((1u << nn) - 1);  // the last tile of an output size not a multiple of 16
  for (int r = 0; r < R; ++r) {
    __m512 v = _mm512_mul_ps(f[r], _mm512_set1_ps(u[r]));
    for (int j = 0; j < TOPK; ++j)
      v = _mm512_fmadd_ps(_mm512_load_ps(table + 16 * slot[r * TK + j]), _mm512_set1_ps(tval[r * TK + j]), v);
    v = _mm512_add_ps(v, bv);
    if (ybf != nullptr) _mm256_mask_storeu_epi16(ybf + r * ldy, keep, bf16_round(v));
    else _mm512_mask_storeu_ps(y + r * ldy, keep, v);
  }
}

// run_vnni with the row numerics. The quantizer splits rows, not blocks, between the threads (a row's scale needs
// the whole row); static scheduling gives each thread a contiguous run of rows, so the step-major writes of two
// threads meet in at most one cache line per step.
template <bool NIB, typename T>
void run_row(const T* x, int64_t ldx, int M, int K, const uint8_t* w, int64_t N, const float* b, float* y,
             c10::BFloat16* ybf, int nthreads, int max_r) {
  const int G = K / GROUP, T_ = int((N + TILE - 1) / TILE), chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
  std::unique_ptr<int8_t[]> xs(new int8_t[size_t(M) * K]);
  std::unique_ptr<float[]> S(new float[size_t(M) * G]), u(new float[M]), tval(new float[size_t(M) * TK]);
  std::unique_ptr<int32_t[]> sh(new int32_t[size_t(M) * G]), tidx(new int32_t[size_t(M) * TK]);
#pragma omp parallel num_threads(nthreads)
  {
  {
    std::unique_ptr<float[]> buf(new float[K]), vmax(new float[K / 16 + 16]);
    std::fill(vmax.get(), vmax.get() + K / 16 + 16, 0.0f);  // the padding stays 0 (quantize_row's vector search)
#pragma omp for schedule(static)
    for (int r = 0; r < M; ++r)
      quantize_row<T>(x + int64_t(r) * ldx, K, M, buf.get(), vmax.get(), xs.get() + 4 * int64_t(r), sh.get() + r,
                      S.get() + r, u.get() + r, tidx.get() + int64_t(r) * TK, tval.get() + int64_t(r) * TK);
  }  // the omp for ends in a barrier
  // per chunk of rows: its distinct taken-out input indices (uniq, from ustart[chunk]) and each row's as a slot;
  // every thread finds the same ones itself (a few hundred entries at most), which spares a barrier per call
  std::vector<int32_t> slot(size_t(M) * TK), uniq(size_t(M) * TK), ustart(chunks + 1, 0);
  if (TOPK > 0) {
    std::vector<int32_t> seen(K, -1);  // input index -> its slot in the current chunk
    int nu = 0;
    for (int ch = 0; ch < chunks; ++ch) {
      ustart[ch] = nu;
      for (int64_t i = int64_t(ch) * ROW_CHUNK * TK; i < std::min<int64_t>(M, int64_t(ch + 1) * ROW_CHUNK) * TK; ++i) {
        const int t = tidx[i];
        if (seen[t] < ustart[ch]) { seen[t] = nu; uniq[nu++] = t; }
        slot[i] = seen[t] - ustart[ch];
      }
    }
    ustart[chunks] = nu;
  }
  int most = 1;
  for (int ch = 0; ch < chunks; ++ch) most = std::max(most, ustart[ch + 1] - ustart[ch]);
  std::unique_ptr<float[], decltype(&std::free)> table(
      static_cast<float*>(std::aligned_alloc(64, sizeof(float) * 16 * size_t(most))), &std::free);
  for (int mc = 0, ch = 0; mc < M; mc += ROW_CHUNK, ++ch) {  // a chunk's int8 rows stay in L2 over every tile
    const int mn = std::min(ROW_CHUNK, M - mc), passes = (mn + max_r - 1) / max_r;
    const int32_t* cu = uniq.data() + ustart[ch];
    const int nu = ustart[ch + 1] - ustart[ch];
#pragma omp for schedule(static) nowait
    for (int t = 0; t < T_; ++t) {
      const uint8_t* tile = w + size_t(t) * G * block_bytes<NIB>();
      const int n0 = t * TILE, nn = int(std::min<int64_t>(TILE, N - n0));
      const __m512i low = _mm512_set1_epi8(0x0F), lowd = _mm512_set1_epi32(0x0F);
      const __m512i nibshift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
      for (int i = 0; i < nu; ++i) {  // this tile's weights of the chunk's taken-out inputs: w = d * q + m
        const int ti = cu[i] % GROUP;
        const uint8_t* blk = tile + size_t(cu[i] / GROUP) * block_bytes<NIB>();
        const __m512i q = _mm512_and_si512(_mm512_srl_epi32(step_codes<NIB>(blk, ti >> 2, nibshift, low),
                                                            _mm_cvtsi32_si128(8 * (ti & 3))), lowd);
        const float* sc = reinterpret_cast<const float*>(blk + code_bytes<NIB>());
        _mm512_store_ps(table.get() + 16 * i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_loadu_ps(sc), _mm512_loadu_ps(sc + 16)));
      }
      const uint8_t* next = t + 1 < T_ ? tile + size_t(G) * block_bytes<NIB>() : nullptr;
      for (int p = 0, m0 = mc; p < passes; ++p) {
        const int R = (mc + mn - m0 + (passes - p) - 1) / (passes - p);  // rows split evenly over the passes
        const uint8_t* pf = p == 0 ? next : nullptr;
        const int8_t* xr = xs.get() + 4 * int64_t(m0);
        const int32_t *shr = sh.get() + m0, *sl = slot.data() + int64_t(m0) * TK;
        const float *Sr = S.get() + m0, *ur = u.get() + m0, *tv = tval.get() + int64_t(m0) * TK;
        float* yr = y == nullptr ? nullptr : y + int64_t(m0) * N + n0;
        c10::BFloat16* yb = ybf == nullptr ? nullptr : ybf + int64_t(m0) * N + n0;
        switch (R) {
#define W4A8_CASE(n) case n: tile_rows_row<n, NIB>(xr, 4 * int64_t(M), shr, Sr, ur, sl, tv, table.get(), M, G, tile, b + n0, yr, yb, N, nn, pf); break;
          W4A8_CASE(1) W4A8_CASE(2) W4A8_CASE(3) W4A8_CASE(4) W4A8_CASE(5) W4A8_CASE(6) W4A8_CASE(7) W4A8_CASE(8)
          W4A8_CASE(9) W4A8_CASE(10) W4A8_CASE(11)
          default: tile_rows_row<12, NIB>(xr, 4 * int64_t(M), shr, Sr, ur, sl, tv, table.get(), M, G, tile, b + n0, yr, yb, N, nn, pf); break;
#undef W4A8_CASE
        }
        m0 += R;
      }
    }
  }
  }
}
#define RUN_VNNI run_row
#else
#define RUN_VNNI run_vnni
#endif
#define W4A8_VNNI 1
#define MAX_ROWS 12
#define BEST_ROWS 12  // rows per pass when the caller says 0: measured, see the module's docstring
#else
#define TILE_ROWS tile_rows
#define MAX_ROWS 6
#define BEST_ROWS 4
#endif

#ifndef W4A8_VNNI  // the AVX2 build's output path (the VNNI build's is run_vnni)
// rows x nn float32 sums (row stride ld) -> bfloat16 (row stride ld), rounded to nearest even as at::Tensor::to
// does, NaN as its quiet NaN: written tile by tile while the sums are in L1, in place of an aten copy of the whole
// output (a torch profile put that and the input's widening at ~8 % of a 32-decode step; whole steps measured
// 0.99-1.02x without them, docs/performance.md)
inline void to_bf16(const float* y, c10::BFloat16* out, int64_t ld, int rows, int nn) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < nn; ++j) out[r * ld + j] = c10::BFloat16(y[r * ld + j]);
}

template <bool NIB>
void run(const int8_t* xq, const float* a, const float* s, const int32_t* top, const float* xo, int M, int K,
         const uint8_t* w, int64_t N, const float* b, float* y, int nthreads, int max_r,
         c10::BFloat16* ybf = nullptr) {
  const int G = K / GROUP, T_ = int((N + TILE - 1) / TILE);
#pragma omp parallel num_threads(nthreads)
  {
  alignas(32) float acc[6 * TILE];  // this thread's float32 sums of one pass (tile_rows)
  for (int mc = 0; mc < M; mc += ROW_CHUNK) {  // a chunk's int8 rows stay in L2 while every tile runs over them
    const int mn = std::min(ROW_CHUNK, M - mc), passes = (mn + max_r - 1) / max_r;
#pragma omp for schedule(static) nowait
    for (int t = 0; t < T_; ++t) {
      const uint8_t* tile = w + size_t(t) * G * block_bytes<NIB>();
      const int n0 = t * TILE, nn = int(std::min<int64_t>(TILE, N - n0));
      for (int p = 0, m0 = mc; p < passes; ++p) {
        const int R = (mc + mn - m0 + (passes - p) - 1) / (passes - p);  // rows split evenly over the passes
        const int8_t* xr = xq + int64_t(m0) * K;
        const float *ar = a + int64_t(m0) * G, *sr = s + int64_t(m0) * G, *xr_o = xo + int64_t(m0) * G;
        const int32_t* tr = top + int64_t(m0) * G;
        float* yr = y + int64_t(m0) * N + n0;
        switch (R) {
#define W4A8_CASE(n) case n: TILE_ROWS<n, NIB>(xr, K, ar, sr, tr, xr_o, G, tile, b + n0, yr, N, nn, acc); break;
          W4A8_CASE(1) W4A8_CASE(2) W4A8_CASE(3) W4A8_CASE(4) W4A8_CASE(5)
#if MAX_ROWS > 6
          W4A8_CASE(6) W4A8_CASE(7) W4A8_CASE(8) W4A8_CASE(9) W4A8_CASE(10) W4A8_CASE(11)
#endif
          default: TILE_ROWS<MAX_ROWS, NIB>(xr, K, ar, sr, tr, xr_o, G, tile, b + n0, yr, N, nn, acc); break;
#undef W4A8_CASE
        }
        if (ybf != nullptr) to_bf16(yr, ybf + int64_t(m0) * N + n0, N, R, nn);
        m0 += R;
      }
    }
  }
  }
}
#endif

// x as rows the quantizer reads in place: float32 or bfloat16, unit stride along K
at::Tensor as_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(x_in.size(1) % GROUP == 0, "K must be a multiple of 32");
  return x_in.stride(1) == 1 ? x_in : x_in.contiguous();
}

void quantize(const at::Tensor& x, int M, int K, int8_t* xq, float* a, float* s, int32_t* top, float* xo,
              int nthreads) {
  if (x.scalar_type() == at::kFloat)
    QUANTIZE_ROWS<float>(x.data_ptr<float>(), x.stride(0), M, K, xq, a, s, top, xo, nthreads);
  else
    QUANTIZE_ROWS<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K, xq, a, s, top, xo, nthreads);
}

// x [M, K] -> (xq [M, K] int8, a, s, top (int32), xo [M, K / 32] float32): the activations as the matmul sees them
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> w4a8_quantize(const at::Tensor& x_in) {
  const at::Tensor x = as_rows(x_in);
  const int M = int(x.size(0)), K = int(x.size(1));
  const auto f32 = x.options().dtype(at::kFloat);
  auto xq = at::empty({M, K}, x.options().dtype(at::kChar));
  auto a = at::empty({M, K / GROUP}, f32);
  auto s = at::empty({M, K / GROUP}, f32);
  auto top = at::empty({M, K / GROUP}, x.options().dtype(at::kInt));
  auto xo = at::empty({M, K / GROUP}, f32);
  if (M > 0)
    quantize(x, M, K, xq.data_ptr<int8_t>(), a.data_ptr<float>(), s.data_ptr<float>(), top.data_ptr<int32_t>(),
             xo.data_ptr<float>(), std::max(1, std::min(at::get_num_threads(), M)));
  return {xq, a, s, top, xo};
}

// x [M, K] float32 or bfloat16 (any row stride), w the packed uint8 [tiles, K / 32, block], n outputs, bias [n] or
// None -> [M, n] in x's dtype. nibbles: w holds 4-bit codes (else bytes). max_rows: rows per micro-kernel pass,
// 1-MAX_ROWS (6 AVX2, 12 VNNI), or 0: this build's BEST_ROWS.
at::Tensor w4a8_mm(const at::Tensor& x_in, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias,
                   bool nibbles, int64_t max_rows) {
  const at::Tensor x = as_rows(x_in);
  const int M = int(x.size(0)), K = int(x.size(1)), G = K / GROUP, T_ = int((n + TILE - 1) / TILE);
  const int bb = nibbles ? block_bytes<true>() : block_bytes<false>();
  TORCH_CHECK(n > 0 && max_rows >= 0 && max_rows <= MAX_ROWS, "n must be positive and max_rows 0-", MAX_ROWS);
  if (max_rows == 0) max_rows = BEST_ROWS;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 && w.size(0) == T_ &&
              w.size(1) == G && w.size(2) == bb, "w must be the packed [tiles, K / 32, block] uint8 weight");
  std::vector<float> b(size_t(TILE) * T_, 0.0f);
  if (bias.has_value() && bias->defined()) {
    const at::Tensor bf = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bf.numel() == n, "bias must have n elements");
    std::memcpy(b.data(), bf.data_ptr<float>(), sizeof(float) * n);
  }
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  auto y = at::empty({M, n}, x.options());  // x's dtype (the AVX2 build writes bfloat16 through a float32 scratch)
  if (M == 0) return y;
  const int nthreads = std::max(1, at::get_num_threads());
  const int workers = std::min(nthreads, T_);
#ifdef W4A8_VNNI
  // the VNNI build writes bfloat16 outputs straight from the micro-kernel's registers, rounded as c10 rounds
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  c10::BFloat16* yb = bf16 ? y.data_ptr<c10::BFloat16>() : nullptr;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kFloat) {
    if (nibbles) RUN_VNNI<true>(x.data_ptr<float>(), x.stride(0), M, K, wp, n, b.data(), yf, yb, workers, int(max_rows));
    else RUN_VNNI<false>(x.data_ptr<float>(), x.stride(0), M, K, wp, n, b.data(), yf, yb, workers, int(max_rows));
  } else {
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
    if (nibbles) RUN_VNNI<true>(xb, x.stride(0), M, K, wp, n, b.data(), yf, yb, workers, int(max_rows));
    else RUN_VNNI<false>(xb, x.stride(0), M, K, wp, n, b.data(), yf, yb, workers, int(max_rows));
  }
#else
  std::vector<int8_t> xq(size_t(M) * K);
  std::vector<float> a(size_t(M) * G), s(size_t(M) * G), xo(size_t(M) * G), sums(bf16 ? size_t(M) * n : 0);
  std::vector<int32_t> top(size_t(M) * G);
  quantize(x, M, K, xq.data(), a.data(), s.data(), top.data(), xo.data(), std::min(nthreads, M));
  float* yf = bf16 ? sums.data() : y.data_ptr<float>();
  c10::BFloat16* ybf = bf16 ? y.data_ptr<c10::BFloat16>() : nullptr;
  if (nibbles) run<true>(xq.data(), a.data(), s.data(), top.data(), xo.data(), M, K, w.data_ptr<uint8_t>(), n,
                         b.data(), yf, workers, int(max_rows), ybf);
  else run<false>(xq.data(), a.data(), s.data(), top.data(), xo.data(), M, K, w.data_ptr<uint8_t>(), n, b.data(),
                  yf, workers, int(max_rows), ybf);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(NAMESPACE, m) {
  m.def("w4a8_mm(Tensor x, Tensor w, int n, Tensor? bias, bool nibbles, int max_rows=0) -> Tensor");
  m.def("w4a8_quantize(Tensor x) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) {
  m.impl("w4a8_mm", &w4a8_mm);
  m.impl("w4a8_quantize", &w4a8_quantize);
}
"""


def enabled() -> bool:
    return os.environ.get("PACELINE_W4A8_KERNEL", "1") != "0"


def pack(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, nibbles: bool) -> torch.Tensor:
    """codes [N, K] (0..15), scale and minimum [N, K / 32] (w = scale * code + lo, kept in float32) -> the op's
    uint8 layout [ceil(N / 16), K / 32, block_bytes(nibbles)]; padding columns get code 0, scale 0, minimum 0."""
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"int4 input size must be a multiple of {GROUP}, got {k}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("int4 codes must lie in 0..15")
    tiles, groups, pad = -(-n // TILE), k // GROUP, -n % TILE
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad)).view(tiles, TILE, groups, GROUP // 4, 4)
    c = c.permute(0, 2, 3, 1, 4)  # [tiles, groups, steps, 16 columns, 4 inputs]: one 32-bit lane per column
    if nibbles:
        c = c[:, :, :, :8] | (c[:, :, :, 8:] << 4)
    c = c.reshape(tiles, groups, -1)

    def per_tile(v: torch.Tensor) -> torch.Tensor:  # [N, groups] -> float32 bytes [tiles, groups, 64]
        v = torch.nn.functional.pad(v.float(), (0, 0, 0, pad)).view(tiles, TILE, groups)
        return v.permute(0, 2, 1).contiguous().view(torch.uint8)

    return torch.cat([c, per_tile(scale), per_tile(lo)], -1).contiguous()


ISAS = ("avx2", "vnni")
# what the VNNI build needs from the CPU (/proc/cpuinfo's names): vpdpbusd on 512-bit registers (avx512_vnni with
# avx512f) and on 256-bit ones (avx512vl), byte and word ops on them (avx512bw)
VNNI_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")


def has_vnni() -> bool:
    """Whether this CPU runs the VNNI build: torch sees AVX-512 and /proc/cpuinfo lists VNNI_CPU_FLAGS."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and all(f in int4_kernel.cpu_flags() for f in VNNI_CPU_FLAGS)


def isa() -> str:
    """The build this CPU runs: "vnni" where it reports AVX512-VNNI (with F, BW and VL), else "avx2".
    `PACELINE_W4A8_ISA=avx2` forces the AVX2 build (A/B runs, tests); asking for "vnni" on a CPU without it is an
    error rather than an illegal instruction later."""
    want = os.environ.get("PACELINE_W4A8_ISA", "").strip().lower()
    if want not in ("", *ISAS):
        raise ValueError(f"PACELINE_W4A8_ISA must be one of {', '.join(ISAS)}, got {want!r}")
    if want == "vnni" and not has_vnni():
        raise ValueError("PACELINE_W4A8_ISA=vnni but this CPU does not report " + ", ".join(VNNI_CPU_FLAGS))
    return want or ("vnni" if has_vnni() else "avx2")


NUMERICS = ("block", "row")
# the row numerics' parameters (SOURCE's run_row): each row's ROW_TOPK largest |x| taken out, per-block refinement
# of the row's scale by 2^-f, f in 0..ROW_FMAX
ROW_TOPK = 4
ROW_FMAX = 3


def numerics(which: str | None = None) -> str:
    """The activation numerics of the build `which` (default isa()'s): "row" (one int8 scale per row refined per
    block by a power of two, the row's ROW_TOPK largest |x| out: SOURCE's run_row) on the VNNI build, "block" (a
    scale and a taken-out element per block of 32) on the AVX2 build, which has only those.
    `PACELINE_W4A8_NUMERICS=block` gives the VNNI build the block numerics (A/B runs); "row" on the AVX2 build is an
    error."""
    which = which or isa()
    want = os.environ.get("PACELINE_W4A8_NUMERICS", "").strip().lower()
    if want not in ("", *NUMERICS):
        raise ValueError(f"PACELINE_W4A8_NUMERICS must be one of {', '.join(NUMERICS)}, got {want!r}")
    if want == "row" and which != "vnni":
        raise ValueError("PACELINE_W4A8_NUMERICS=row needs the VNNI build (AVX512-VNNI)")
    return want or ("row" if which == "vnni" else "block")


def build_flags(which: str, numerics_: str = "block") -> list[str]:
    """The compiler flags of a build: the int4 op's (AVX2, FMA, F16C), plus AVX-512 F/BW/VL/VNNI for "vnni", plus
    the row numerics' parameters where asked for (VNNI only)."""
    if which not in ISAS:
        raise ValueError(f"unknown w4a8 build {which!r}")
    if numerics_ not in NUMERICS or (numerics_ == "row" and which != "vnni"):
        raise ValueError(f"w4a8 numerics {numerics_!r} not available on the {which} build")
    extra = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"] if which == "vnni" else []
    if numerics_ == "row":
        extra += [f"-DW4A8_ROW_TOPK={ROW_TOPK}", f"-DW4A8_ROW_FMAX={ROW_FMAX}"]
    return int4_kernel._flags() + extra


def build_key() -> str:
    """Which build and numerics serve the op here ("vnni:row", "avx2:block", ...), for the keys of measured step
    times: the two numerics' steps cost differently."""
    return f"{isa()}:{numerics()}"


def _library(which: str | None = None, numerics_: str | None = None):
    """(path, namespace, flags) of a build, `which` by default the one isa() picks, with `numerics_` (default
    numerics(which)); the key hashes the flags, so no two builds share a file or a namespace."""
    which = which or isa()
    fl = build_flags(which, numerics_ or numerics(which))
    key = hashlib.sha256("\n".join([SOURCE, torch.__version__, *fl]).encode()).hexdigest()[:16]
    from paceline.model.cache_dir import cache_root
    return cache_root() / "kernels" / f"w4a8_mm-{key}.so", f"paceline_w4a8_{key}", fl


def op_for(which: str, numerics_: str | None = None) -> Callable | None:
    """The op of one build and numerics (default numerics(which)), whatever isa() says (tests and A/B runs in one
    process); None where it cannot be built or run. Asking for "vnni" on a CPU without it is a ValueError, not a
    crash."""
    if which == "vnni" and not has_vnni():
        raise ValueError("this CPU has no AVX512-VNNI")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    path, namespace, fl = _library(which, numerics_)
    return int4_kernel.load_op(path, namespace, fl, SOURCE, "w4a8_mm", f"CPU w4a8 matmul kernel ({which}) unavailable")


def load() -> Callable | None:
    """The op `(x, packed, n, bias, nibbles, max_rows=0) -> y`, building it first if needed; None when switched off
    or it cannot be built or run here (the reason is logged once)."""
    if not enabled():
        return None
    return op()


_op: list = []  # op()'s answer, found once per process


def op() -> Callable | None:
    """The op whatever the switch says: a model decides at build time (load) whether to pack for it, and the
    Int4Linears it built keep using it, so that two models of one process can be compared.

    Remembered after the first call: every Int4Linear call of a many-row step asks for it (120 calls a step for
    the bundled model), and finding it hashes this module's source (~80 us a call measured here, 2026-11-24:
    ~10 ms of a 32-decode step)."""
    if not _op:
        _op.append(op_for(isa()))
    return _op[0]


def load_quantize(which: str | None = None) -> Callable | None:
    """The block numerics' activation quantizer `x -> (xq, a, s, top, xo)` of a build (by default isa()'s), from
    its block-numerics library, for tests and emulations."""
    if load() is None:
        return None
    if op_for(which or isa(), "block") is None:
        return None
    _, namespace, _ = _library(which, "block")
    return getattr(torch.ops, namespace).w4a8_quantize


def unpack(packed: torch.Tensor, n: int, nibbles: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack's inverse: the op's uint8 layout -> (codes [n, K] uint8, scale, minimum [n, K / 32] float32), for
    tests and emulations."""
    tiles, groups, _ = packed.shape
    cb = GROUP * TILE // 2 if nibbles else GROUP * TILE
    c = packed[..., :cb].reshape(tiles, groups, GROUP // 4, -1, 4)  # [tiles, groups, steps, 8 or 16 columns, 4]
    if nibbles:
        c = torch.cat([c & 0x0F, c >> 4], 3)
    codes = c.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, groups * GROUP)[:n]

    def per_column(v: torch.Tensor) -> torch.Tensor:  # float32 bytes [tiles, groups, 64] -> [n, groups]
        return v.contiguous().view(torch.float32).permute(0, 2, 1).reshape(tiles * TILE, groups)[:n]

    return codes.contiguous(), per_column(packed[..., cb:cb + 4 * TILE]), per_column(packed[..., cb + 4 * TILE:])
