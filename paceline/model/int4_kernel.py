"""A small C++ int4 matmul for CPU steps of a few to a hundred rows, built once with the system compiler and cached.

Why: torch's `_weight_int4pack_mm_for_cpu` re-expands the 4-bit codes of each weight block for every block of rows
it serves, so a 5-row step (one decode plus four speculated tokens to verify) costs more than twice a one-row step
here, where it should cost little more: a one-row decode step is bound by getting the weights in, not by the
arithmetic. This op reads each tile of codes once per step and applies it to all the step's rows.

Two paths over the same packed codes, chosen by the step's rows (FEW_ROWS):
- few rows (up to 6): the codes are widened to float32 in registers per pass of up to 6 rows and the per-group
  sums factored: sum_k x_k W[n, k] = scale * (sum_k code_k x_k - 8 sum_k x_k) + zero * sum_k x_k, one FMA per code
  and row, no per-weight dequantization. Bound by streaming the codes in.
  On a CPU with AVX512-BF16 and bfloat16 x (an int4 model's steps), the same sums in the same order run on
  vdpbf16ps, two inputs a row per instruction, the codes turned into bfloat16 by a table lookup: the same bits,
  30 layers of the bundled model's linears at one row on one thread 7.20 -> 5.31 ms, six rows 18.30 -> 11.54 ms
  (a /tmp script, 2026-11-29 15:50 UTC; PACELINE_INT4_BF16_DOT=0 switches it off for A/B runs).
- more rows: per tile of 16 outputs and per block of up to 256 inputs, the codes are dequantized once into float32
  weights in L1 (w = (code - 8) * scale + zero, one rounding), then every row runs over them in a float32 GEMM
  micro-kernel (6 rows x 16 columns of accumulators in registers). Per weight that is 2 FMAs for every 16 rows
  instead of the few-row path's code expansion per 6 rows, so from ~8 rows on the FMAs are nearly all the work and
  the op runs about as fast as oneDNN's prepacked float32 matmul (measured up to 256 rows,
  benchmarks/int4_linear.py --sweep) while reading 8x fewer weight bytes.

Numerics, the same contract as torch's op: y = x W^T with W[n, k] = (code - 8) * scale + zero, scale and zero
bfloat16 per group of 32 inputs, x read as float32, float32 accumulation, the result rounded to x's dtype once
(bias added before that rounding). The two paths differ only by float32 rounding.

Layout (pack): columns in tiles of 16, each tile's groups in order, each group one block of 320 bytes: 32 inputs x
8 bytes of codes (byte j = column j in the low nibble, column j + 8 in the high one), then the 16 scales and the 16
zeros as bfloat16. 0.625 bytes per weight, the same as torch's packing plus its scales; a thread streams its tiles
front to back. pack(exact=True) keeps the scales and zeros in float32 (blocks of 384 bytes, 0.75 bytes per weight;
the op tells the layouts apart by the block's size): a float32 model's weights from a 4-bit GGUF's codes
(llama.Int4Linear.exact), where bfloat16 scales would change the weights.

The build follows attention_kernel.py: compiled with g++/c++ into `<cache>/kernels/int4_mm-<key>.so` under a file
lock the first time a process needs it, keyed by the source, the flags and torch's version. No compiler, a failed
build or a CPU without AVX2: load() gives None and Int4Linear uses torch's op. `PACELINE_INT4_KERNEL=0` switches it
off (for A/B runs). CUDA never builds it (Int4Linear is CPU only).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("paceline.int4")

GROUP = 32  # inputs per scale/zero pair (llama.INT4_GROUP)
TILE = 16  # output columns per tile: two AVX2 vectors
BLOCK_BYTES = GROUP * TILE // 2 + 4 * TILE  # codes, then 16 bfloat16 scales and 16 bfloat16 zeros

SOURCE = r"""
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <string>
#include <vector>

namespace {

constexpr int GROUP = 32, TILE = 16, CODE_BYTES = GROUP * TILE / 2, BLOCK = CODE_BYTES + 4 * TILE;
constexpr int BLOCK_F32 = CODE_BYTES + 8 * TILE;  // the layout with float32 scales and zeros (pack(exact=True))
constexpr int MAX_R = 6;  // rows per pass: 2 x 6 accumulators + 2 code vectors + 1 broadcast fit the 16 registers
constexpr int FEW_ROWS = 6;  // steps of up to this many rows take the few-row path (few_rows < 0 in the op's call)

inline __m256 bf16x8(const uint16_t* p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// a block's 16 scales and 16 zeros (after its codes) as float32, from either layout: `block` is its size in bytes
inline void scales8(const uint8_t* c, int block, __m256& s0, __m256& s1, __m256& z0, __m256& z1) {
  if (block == BLOCK_F32) {
    const float* p = reinterpret_cast<const float*>(c + CODE_BYTES);
    s0 = _mm256_loadu_ps(p), s1 = _mm256_loadu_ps(p + 8), z0 = _mm256_loadu_ps(p + 16), z1 = _mm256_loadu_ps(p + 24);
  } else {
    const uint16_t* sz = reinterpret_cast<const uint16_t*>(c + CODE_BYTES);
    s0 = bf16x8(sz), s1 = bf16x8(sz + 8), z0 = bf16x8(sz + 16), z1 = bf16x8(sz + 24);
  }
}

// out[r][0..16) = sum over all groups for R rows of one tile; x rows [R][K] float, xs rows [R][G] group sums
template <int R>
inline void tile_rows(const float* const* x, const float* const* xs, const uint8_t* tile, int G, float (*out)[TILE],
                      int block) {
  const __m256i low = _mm256_set1_epi32(0xF);
  const __m256 eight = _mm256_set1_ps(8.0f);
  __m256 o[R][2];
  for (int r = 0; r < R; ++r) o[r][0] = o[r][1] = _mm256_setzero_ps();
  for (int g = 0; g < G; ++g) {
    const uint8_t* c = tile + size_t(g) * block;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int k0 = g * GROUP;
#pragma GCC unroll 8
    for (int k = 0; k < GROUP; ++k) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * k)));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x[r] + k0 + k);
        acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      }
    }
    __m256 s0, s1, z0, z1;
    scales8(c, block, s0, s1, z0, z1);
    for (int r = 0; r < R; ++r) {  // o += scale * (sum code x - 8 sum x) + zero * sum x
      const __m256 sx = _mm256_broadcast_ss(xs[r] + g);
      o[r][0] = _mm256_fmadd_ps(s0, _mm256_fnmadd_ps(eight, sx, acc[r][0]), o[r][0]);
      o[r][1] = _mm256_fmadd_ps(s1, _mm256_fnmadd_ps(eight, sx, acc[r][1]), o[r][1]);
      o[r][0] = _mm256_fmadd_ps(z0, sx, o[r][0]);
      o[r][1] = _mm256_fmadd_ps(z1, sx, o[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out[r], o[r][0]);
    _mm256_storeu_ps(out[r] + 8, o[r][1]);
  }
}

// The many-row path: per tile, per block of at most KB_GROUPS groups, the block's codes are dequantized once into
// float32 weights [k][16] in L1 (w = (code - 8) * scale + zero, one rounding, as torch's op does), then every
// row block of the step runs over them as a plain float32 GEMM micro-kernel: R rows x 16 columns of accumulators
// in registers, per input 2 weight loads, R broadcasts and 2R FMAs. Against the few-row path below this drops the
// per-row-pass code expansion and the per-group scale arithmetic, so the FMAs are nearly all the work.
constexpr int KB_GROUPS = 8;  // 256 inputs x 16 columns x 4 bytes = 16 KiB of dequantized weights

inline void dequant_block(const uint8_t* tile, int g0, int ng, float* wb, int block) {
  const __m256i low = _mm256_set1_epi32(0xF), eight = _mm256_set1_epi32(8);
  for (int g = 0; g < ng; ++g) {
    const uint8_t* c = tile + size_t(g0 + g) * block;
    __m256 s0, s1, z0, z1;
    scales8(c, block, s0, s1, z0, z1);
    float* out = wb + size_t(g) * GROUP * TILE;
#pragma GCC unroll 4
    for (int k = 0; k < GROUP; ++k) {
      const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * k)));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v, low), eight));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v, 4), eight));
      _mm256_store_ps(out + k * TILE, _mm256_fmadd_ps(w0, s0, z0));
      _mm256_store_ps(out + k * TILE + 8, _mm256_fmadd_ps(w1, s1, z1));
    }
  }
}

// c[r][0..16) (+)= sum over kn inputs of x[r * ldx + k] * wb[k][0..16), R rows. Not inlined: on its own the 12
// accumulators, 2 weights and 1 broadcast get the 16 registers; inlined, a constant of the caller took one and an
// accumulator went through the stack on every input.
template <int R>
__attribute__((noinline)) void gemm_rows(const float* x, int64_t ldx, const float* wb, int kn, float* c, bool first) {
  __m256 a0[R], a1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    a0[r] = _mm256_setzero_ps();
    a1[r] = _mm256_setzero_ps();
  }
  if (!first) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_loadu_ps(c + r * TILE);
      a1[r] = _mm256_loadu_ps(c + r * TILE + 8);
    }
  }
  for (int k = 0; k < kn; ++k) {
    const __m256 w0 = _mm256_load_ps(wb + k * TILE), w1 = _mm256_load_ps(wb + k * TILE + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * TILE, a0[r]);
    _mm256_storeu_ps(c + r * TILE + 8, a1[r]);
  }
}

// y rows [M, N] of T from float32 x rows (row stride ldx), many-row path
template <typename T>
void run_gemm(const float* xf, int64_t ldx, int M, int K, const uint8_t* w, int64_t N, const float* b, T* yp,
              int nthreads, int block) {
  const int G = K / GROUP, T_ = int((N + TILE - 1) / TILE);
  const int blocks = (G + KB_GROUPS - 1) / KB_GROUPS, per = (G + blocks - 1) / blocks;
  const int passes = (M + MAX_R - 1) / MAX_R;
#pragma omp parallel num_threads(nthreads)
  {
    float* wb = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * per * GROUP * TILE));
    std::vector<float> cbuf(size_t(M) * TILE);
#pragma omp for schedule(static)
    for (int t = 0; t < T_; ++t) {
      const uint8_t* tile = w + size_t(t) * G * block;
      for (int g0 = 0; g0 < G; g0 += per) {
        const int ng = std::min(per, G - g0), k0 = g0 * GROUP, kn = ng * GROUP;
        dequant_block(tile, g0, ng, wb, block);
        for (int p = 0, m0 = 0; p < passes; ++p) {
          const int R = (M - m0 + (passes - p) - 1) / (passes - p);  // rows split evenly over the passes
          const float* xr = xf + int64_t(m0) * ldx + k0;
          float* c = cbuf.data() + size_t(m0) * TILE;
          switch (R) {
            case 1: gemm_rows<1>(xr, ldx, wb, kn, c, g0 == 0); break;
            case 2: gemm_rows<2>(xr, ldx, wb, kn, c, g0 == 0); break;
            case 3: gemm_rows<3>(xr, ldx, wb, kn, c, g0 == 0); break;
            case 4: gemm_rows<4>(xr, ldx, wb, kn, c, g0 == 0); break;
            case 5: gemm_rows<5>(xr, ldx, wb, kn, c, g0 == 0); break;
            default: gemm_rows<6>(xr, ldx, wb, kn, c, g0 == 0); break;
          }
          m0 += R;
        }
      }
      const int n0 = t * TILE, nn = int(std::min<int64_t>(TILE, N - n0));
      if (std::is_same<T, float>::value && nn == TILE) {  // the common case, two vectors a row
        const __m256 b0 = _mm256_loadu_ps(b + n0), b1 = _mm256_loadu_ps(b + n0 + 8);
        for (int m = 0; m < M; ++m) {
          float* yr = reinterpret_cast<float*>(yp + int64_t(m) * N + n0);
          _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(&cbuf[size_t(m) * TILE]), b0));
          _mm256_storeu_ps(yr + 8, _mm256_add_ps(_mm256_loadu_ps(&cbuf[size_t(m) * TILE + 8]), b1));
        }
      } else {
        for (int m = 0; m < M; ++m)
          for (int j = 0; j < nn; ++j) yp[int64_t(m) * N + n0 + j] = T(cbuf[size_t(m) * TILE + j] + b[n0 + j]);
      }
    }
    std::free(wb);
  }
}

// The few-row path on AVX512-BF16 (bfloat16 x only): each pair of inputs' 16 column codes are spread into 32 words
// (vpermb), their nibbles picked (vpsrlvw, vpand) and turned into bfloat16 by a table lookup (vpermw: codes 0..15
// are exact in bfloat16), then one vdpbf16ps a row adds both inputs' products: per 32 weights 5 instructions and 2
// a row, against 10 and 6 a row on AVX2. The product of two bfloat16 values is exact in float32 and vdpbf16ps
// rounds after each product, the odd word's first: with x[k] in the odd word and x[k + 1] in the even one each
// column's sum runs in the AVX2 loop's order, so both paths give the same bits (test_int4_kernel.py), subnormal
// values aside (vdpbf16ps reads and writes them as zero; activations and sums this small do not occur in practice).
#define PL_BF16_DOT __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16")))

struct Bf16DotTables {  // vpermb's byte picks, vpsrlvw's shifts and vpermw's code -> bfloat16 table
  alignas(64) int8_t pick[64];
  alignas(64) int16_t shift[32], table[32];
  Bf16DotTables() {
    for (int w = 0; w < 32; ++w) {
      const int j = w / 2;  // the column (dword lane) this word belongs to
      pick[2 * w] = pick[2 * w + 1] = int8_t((w % 2 ? 0 : 8) + j % 8);  // odd word: input k (bytes 0-7), even: k + 1
      shift[w] = j < 8 ? 0 : 4;  // columns 8-15 are the high nibbles
      const float c = float(w % 16);
      uint32_t bits;
      std::memcpy(&bits, &c, 4);
      table[w] = int16_t(bits >> 16);
    }
  }
};
const Bf16DotTables BF16_DOT_TABLES;

PL_BF16_DOT inline __m512 bf16x16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// xp rows [R][K / 2] pairs (x[2p] in the high word, x[2p + 1] in the low one), xs rows [R][G] group sums
template <int R>
PL_BF16_DOT void tile_rows_bf16(const uint32_t* const* xp, const float* const* xs, const uint8_t* tile, int G,
                                float (*out)[TILE], int block) {
  const Bf16DotTables& t = BF16_DOT_TABLES;
  const __m512i pick = _mm512_load_si512(t.pick), shift = _mm512_load_si512(t.shift);
  const __m512i table = _mm512_load_si512(t.table), low = _mm512_set1_epi16(0xF);
  const __m512 eight = _mm512_set1_ps(8.0f);
  __m512 o[R];
  for (int r = 0; r < R; ++r) o[r] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    const uint8_t* c = tile + size_t(g) * block;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int p0 = g * GROUP / 2;
#pragma GCC unroll 8
    for (int p = 0; p < GROUP / 2; ++p) {
      const __m512i bytes = _mm512_permutexvar_epi8(
          pick, _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * p))));
      const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(bytes, shift), low);
      const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(codes, table);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_set1_epi32(int(xp[r][p0 + p])));
    }
    const uint16_t* sz = reinterpret_cast<const uint16_t*>(c + CODE_BYTES);
    const float* sf = reinterpret_cast<const float*>(c + CODE_BYTES);
    const bool f32 = block == BLOCK_F32;
    const __m512 s = f32 ? _mm512_loadu_ps(sf) : bf16x16(sz), z = f32 ? _mm512_loadu_ps(sf + 16) : bf16x16(sz + 16);
    for (int r = 0; r < R; ++r) {  // o += scale * (sum code x - 8 sum x) + zero * sum x, as the AVX2 path
      const __m512 sx = _mm512_set1_ps(xs[r][g]);
      o[r] = _mm512_fmadd_ps(s, _mm512_fnmadd_ps(eight, sx, acc[r]), o[r]);
      o[r] = _mm512_fmadd_ps(z, sx, o[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], o[r]);
}

// the CPU has the instructions, and PACELINE_INT4_BF16_DOT=0 (the A/B) does not switch the path off
bool bf16_dot_ok() {
  static const bool ok = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") &&
                         __builtin_cpu_supports("avx512bf16") && [] {
                           const char* v = std::getenv("PACELINE_INT4_BF16_DOT");
                           return v == nullptr || std::string(v) != "0";
                         }();
  return ok;
}

// f(std::integral_constant<int, R>) for R rows of a pass (1..MAX_R): the row count as a template argument
template <typename F>
void with_rows(int R, F&& f) {
  switch (R) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    default: f(std::integral_constant<int, 6>{}); break;
  }
}

// y rows [M, N] of T from float32 x rows (contiguous, row stride K), few-row path
template <typename T>
void run_few(const float* xf, int M, int K, const uint8_t* w, int64_t N, const float* b, T* yp, int nthreads,
             int block) {
  const int G = K / GROUP, T_ = int((N + TILE - 1) / TILE);
  std::vector<float> xsum(size_t(M) * G);  // per-group sums of x, once for all tiles
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) {
      float s = 0;
      for (int k = 0; k < GROUP; ++k) s += xf[size_t(m) * K + g * GROUP + k];
      xsum[size_t(m) * G + g] = s;
    }
  // bfloat16 x on AVX512-BF16: its pairs for vdpbf16ps (x[2p] in the high word: added first), once for all tiles
  const bool dot = std::is_same<T, c10::BFloat16>::value && bf16_dot_ok();
  std::vector<uint32_t> xpairs(dot ? size_t(M) * K / 2 : 0);
  if (dot)
    for (int m = 0; m < M; ++m)
      for (int p = 0; p < K / 2; ++p) {
        uint32_t h, l;
        std::memcpy(&h, xf + size_t(m) * K + 2 * p, 4);
        std::memcpy(&l, xf + size_t(m) * K + 2 * p + 1, 4);
        xpairs[size_t(m) * K / 2 + p] = (h & 0xFFFF0000u) | (l >> 16);
      }
  const int passes = (M + MAX_R - 1) / MAX_R;
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int t = 0; t < T_; ++t) {
    const uint8_t* tile = w + size_t(t) * G * block;
    float out[MAX_R][TILE];
    for (int p = 0, m0 = 0; p < passes; ++p) {
      const int R = (M - m0 + (passes - p) - 1) / (passes - p);  // rows split evenly over the passes
      const float* xr[MAX_R];
      const float* sr[MAX_R];
      for (int r = 0; r < R; ++r) {
        xr[r] = xf + size_t(m0 + r) * K;
        sr[r] = xsum.data() + size_t(m0 + r) * G;
      }
      const uint32_t* pr[MAX_R];
      if (dot)
        for (int r = 0; r < R; ++r) pr[r] = xpairs.data() + size_t(m0 + r) * K / 2;
      with_rows(R, [&](auto rows) {
        constexpr int RR = decltype(rows)::value;
        if (dot) tile_rows_bf16<RR>(pr, sr, tile, G, out, block);
        else tile_rows<RR>(xr, sr, tile, G, out, block);
      });
      const int n0 = t * TILE, nn = int(std::min<int64_t>(TILE, N - n0));
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < nn; ++j) yp[int64_t(m0 + r) * N + n0 + j] = T(out[r][j] + b[n0 + j]);
      m0 += R;
    }
  }
}

template <typename T>
void run(const at::Tensor& x, const uint8_t* w, int64_t N, const at::Tensor& bias, at::Tensor& y, int64_t few_rows,
         int block) {
  const int M = int(x.size(0)), K = int(x.size(1)), T_ = int((N + TILE - 1) / TILE);
  std::vector<float> b(TILE * T_, 0.0f);
  if (bias.defined())
    for (int64_t n = 0; n < N; ++n) b[n] = bias.scalar_type() == at::kFloat ? bias.data_ptr<float>()[n]
                                                                       : float(bias.data_ptr<c10::BFloat16>()[n]);
  const int nthreads = std::max(1, std::min(at::get_num_threads(), T_));
  const bool gemm = M > few_rows;
  // float32 input with unit column stride is read in place by the many-row path; anything else is copied once
  std::vector<float> xf;
  const float* xp;
  int64_t ldx = K;
  if (gemm && std::is_same<T, float>::value) {
    xp = reinterpret_cast<const float*>(x.data_ptr<T>());
    ldx = x.stride(0);
  } else {
    xf.resize(size_t(M) * K);
    const T* src = x.data_ptr<T>();
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k) xf[size_t(m) * K + k] = float(src[m * x.stride(0) + k]);
    xp = xf.data();
  }
  if (gemm) run_gemm<T>(xp, ldx, M, K, w, N, b.data(), y.data_ptr<T>(), nthreads, block);
  else run_few<T>(xp, M, K, w, N, b.data(), y.data_ptr<T>(), nthreads, block);
}

// x [M, K] float32 or bfloat16 (any strides), w the packed uint8 [tiles, K / 32, 320 or 384], n outputs,
// bias [n] or None -> [M, n] in x's dtype
at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias,
                   int64_t few_rows) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, K]");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t K = x.size(1);
  TORCH_CHECK(K % GROUP == 0 && n > 0, "K must be a multiple of 32 and n positive");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 && w.size(0) == (n + TILE - 1) / TILE &&
              w.size(1) == K / GROUP && (w.size(2) == BLOCK || w.size(2) == BLOCK_F32),
              "w must be the packed [tiles, K / 32, 320 or 384] uint8 weight");
  const int block = int(w.size(2));
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == n && (b.scalar_type() == at::kFloat || b.scalar_type() == at::kBFloat16),
                "bias must be float32 or bfloat16 [n]");
  }
  auto y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  if (few_rows < 0) few_rows = FEW_ROWS;
  if (x.scalar_type() == at::kFloat) run<float>(x, w.data_ptr<uint8_t>(), n, b, y, few_rows, block);
  else run<c10::BFloat16>(x, w.data_ptr<uint8_t>(), n, b, y, few_rows, block);
  return y;
}

}  // namespace

TORCH_LIBRARY(NAMESPACE, m) { m.def("int4_mm(Tensor x, Tensor w, int n, Tensor? bias, int few_rows=-1) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("int4_mm", &int4_mm); }
"""

_lock = threading.Lock()
_loaded: dict[str, Callable | None] = {}


def enabled() -> bool:
    return os.environ.get("PACELINE_INT4_KERNEL", "1") != "0"


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, exact: bool = False) -> torch.Tensor:
    """codes [N, K] (0..15), scale and zero [N, K / 32] (rounded to bfloat16 here, as torch's op holds them) ->
    the op's uint8 layout [ceil(N / 16), K / 32, 320]; padding columns get code 0, scale 0 and zero 0. `exact`:
    scale and zero kept in float32, blocks of 384 bytes (a float32 model's weights from a 4-bit GGUF's codes)."""
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"int4 input size must be a multiple of {GROUP}, got {k}")
    tiles, groups, pad = -(-n // TILE), k // GROUP, -n % TILE
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad)).view(tiles, TILE, groups, GROUP)
    c = c.permute(0, 2, 3, 1)  # [tiles, groups, 32 inputs, 16 columns]
    c = (c[..., :8] | (c[..., 8:] << 4)).reshape(tiles, groups, GROUP * TILE // 2)

    def per_tile(v: torch.Tensor) -> torch.Tensor:  # [N, groups] -> bfloat16 (float32) bytes [tiles, groups, 32 (64)]
        v = torch.nn.functional.pad(v.to(torch.float32 if exact else torch.bfloat16), (0, 0, 0, pad))
        v = v.view(tiles, TILE, groups)
        return v.permute(0, 2, 1).contiguous().view(torch.uint8)

    return torch.cat([c, per_tile(scale), per_tile(zero)], -1).contiguous()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none): which build of an op
    (AVX2, AVX-512, VNNI, BF16) this machine can run. Read once per process."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _flags() -> list[str]:
    return ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-w", "-mavx2", "-mfma", "-mf16c",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def _library_path() -> tuple[Path, str, list[str]]:
    from paceline.model.cache_dir import cache_root
    flags = _flags()
    key = hashlib.sha256("\n".join([SOURCE, torch.__version__, *flags]).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"int4_mm-{key}.so", f"paceline_int4_{key}", flags


def _build(path: Path, namespace: str, flags: list[str], source: str = SOURCE, what: str = "int4 matmul") -> None:
    """Compile `source` (its NAMESPACE placeholder set) into `path` once; the attention, fused and logits ops
    build here too."""
    from torch.utils import cpp_extension
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process builds; the others wait, then load its result
        if path.exists():
            return
        src = path.with_suffix(f".{os.getpid()}.cpp")
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        src.write_text(source.replace("NAMESPACE", namespace))
        lib_dirs = cpp_extension.library_paths()
        cmd = [cxx, *flags, *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
               str(src), "-o", str(tmp), *(f"-L{p}" for p in lib_dirs), *(f"-Wl,-rpath,{p}" for p in lib_dirs),
               "-lc10", "-ltorch_cpu"]
        log.info("building the CPU %s kernel once (about a minute): %s", what, path)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{cxx} failed: {proc.stderr[-2000:]}")
            os.replace(tmp, path)
        finally:
            src.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)


def load() -> Callable | None:
    """The op `(x, packed, n, bias) -> y`, building it first if needed; None when it is switched off or cannot be
    built or run here (the reason is logged once)."""
    if not enabled():
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None  # the op is AVX2 code only
    path, namespace, flags = _library_path()
    return load_op(path, namespace, flags, SOURCE, "int4_mm", "CPU int4 matmul kernel unavailable, using torch's")


def load_op(path: Path, namespace: str, flags: list[str], source: str, name: str, fallback: str) -> Callable | None:
    """torch.ops.<namespace>.<name> from the library at `path`, built from `source` first if needed, once per
    process; None (and `fallback: reason` logged once) when the build or the load fails."""
    with _lock:
        if namespace not in _loaded:
            op = None
            try:
                if not path.exists():
                    _build(path, namespace, flags, source, name)
                torch.ops.load_library(str(path))
                op = getattr(getattr(torch.ops, namespace), name)
            except Exception as e:  # a missing compiler or a failed build: the caller's fallback still works
                log.warning("%s: %s", fallback, e)
            _loaded[namespace] = op
        return _loaded[namespace]
