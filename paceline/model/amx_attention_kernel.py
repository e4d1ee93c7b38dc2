"""Causal bfloat16 attention of one sequence's prompt rows on the AMX tiles (Intel Sapphire Rapids and later).

Why: on a CPU with AMX, oneDNN runs the linears of a long prompt at the tiles' rate (~2.5 TFLOP/s on 2 cores) and
attention becomes the largest part of a 1,500-token step: torch's flash SDPA ran at ~0.25 TFLOP/s there (155 of
336 ms, 2026-11-25). This op computes Q.K^T and P.V with TDPBF16PS and keeps only the softmax on AVX-512.

Layout (one work item = one KV head x 16 query positions, the GQA group's query heads stacked: 48 rows for
SmolLM2): K and V are first packed per call into the pair layout the B operand wants (K: 16 keys x 32 dims per
tile, each row a pair of dims for all 16 keys; V: 32 keys x 16 dims, each row a pair of keys), zero beyond the
keys. An item computes all of its causal scores (its rows x keys up to its last position, in 32-key steps) into
a float32 buffer that stays in L2, taking each row's max from L1 right behind the tiles' stores; then, per query
head and 32-key step, the exact softmax's numerators (2^x by a degree-4 polynomial and scalef, P rounded to
bfloat16 as torch's bfloat16 SDPA does) go into a two-slot L1 ring one step ahead of their P.V product, which
accumulates in float32 tiles over every key with no rescaling; the output is divided by the row sums and rounded
to bfloat16. Why that order: the op is bound by L2 traffic, not by the tiles; a separate max pass and P written
whole to L2 and read back cost ~10 % of a 1,500-token prompt's attention (the same bits either way).

Linux grants the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); each thread loads its tile
configuration per call, because oneDNN reconfigures the tiles between ours. gcc 12's tile load/store intrinsics do
not tell the compiler they touch memory, so compiler barriers sit between the vector code that writes a buffer and
the tile loads that read it (and the reverse).

Built like the other ops (int4_kernel.load_op: g++ once, cached by source hash), only where /proc/cpuinfo lists
amx_bf16, amx_tile and avx512_bf16; head_dim 32 or 64. `PACELINE_ATTN_AMX=0` switches it off (SDPA then).
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Callable

import torch

from paceline.model import int4_kernel
from paceline.model.attention_kernel import EXP2_DEG4

# The includes and helpers every AMX op needs (pasted at the top of their sources): the tile state's
# request, a tile configuration of 8 tiles of 16 rows x 64 bytes, 64-byte aligned scratch, and the compiler
# barrier that gcc 12's tile intrinsics lack.
AMX_COMMON = r"""
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace amx {

#define BARRIER() asm volatile("" ::: "memory")

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool amx_granted() {
  // ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18: once per process, every thread inherits it
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

void load_tile_config() {  // all 8 tiles 16 rows x 64 bytes
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) { cfg.colsb[i] = 64; cfg.rows[i] = 16; }
  BARRIER();  // else gcc drops the stores above: it does not see ldtilecfg read cfg
  _tile_loadconfig(&cfg);
}

// 64-byte aligned scratch: a tile row is one whole cache line only when its start is aligned
template <typename T>
struct Aligned {
  T* p;
  explicit Aligned(size_t n) : p(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64))) {}
  ~Aligned() { std::free(p); }
  T* data() { return p; }
};

}  // namespace amx
"""

SOURCE = AMX_COMMON + r"""
namespace {

using namespace amx;

""" + EXP2_DEG4 + r"""
inline __mmask16 first(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max(n, 0)) - 1); }

// K [S, KVH, D] -> kp[g][b][c][r][n] (uint32 = a pair of dims): key b*16+n, dims c*32 + 2r, +1; zero past s_eff
void pack_k(const uint32_t* k, int64_t k_stride, int kvh, int d, int s_eff, int nb16, uint32_t* kp) {
  const int dc = d / 32;
#pragma omp parallel for collapse(2) schedule(static)
  for (int g = 0; g < kvh; ++g)
    for (int b = 0; b < nb16; ++b) {
      uint32_t* dst = kp + (size_t(g) * nb16 + b) * dc * 256;
      for (int n = 0; n < 16; ++n) {
        const int key = b * 16 + n;
        const uint32_t* src = k + key * k_stride + g * (d / 2);
        for (int c = 0; c < dc; ++c)
          for (int r = 0; r < 16; ++r) dst[c * 256 + r * 16 + n] = key < s_eff ? src[c * 16 + r] : 0u;
      }
    }
}

// V [S, KVH, D] -> vp[g][kb][cc][r][2c + i] (bfloat16): key kb*32 + 2r + i, dim cc*16 + c; zero past s_eff
void pack_v(const uint16_t* v, int64_t v_stride, int kvh, int d, int s_eff, int nb32, uint16_t* vp) {
  const int oc = d / 16;
#pragma omp parallel for collapse(2) schedule(static)
  for (int g = 0; g < kvh; ++g)
    for (int kb = 0; kb < nb32; ++kb) {
      uint16_t* dst = vp + (size_t(g) * nb32 + kb) * oc * 512;
      for (int r = 0; r < 16; ++r)
        for (int i = 0; i < 2; ++i) {
          const int key = kb * 32 + 2 * r + i;
          const uint16_t* src = v + key * v_stride + g * d;
          for (int cc = 0; cc < oc; ++cc)
            for (int c = 0; c < 16; ++c) dst[cc * 512 + r * 32 + 2 * c + i] = key < s_eff ? src[cc * 16 + c] : 0;
        }
    }
}

// One work item: KV head g, query positions p0 .. p0+15 of the chunk (absolute q_start + p0 ...), its G query
// heads stacked as G x 16 rows. D = 32 or 64.
template <int D>
void attend_item(const uint16_t* q, int64_t q_stride, uint16_t* out, int64_t out_stride, const uint32_t* kp,
                 const uint16_t* vp, int g, int p0, int t, int q_start, int s_eff, int group, int nb16, int nb32,
                 float scale2, uint16_t* qp, float* sc, uint16_t* pb, float* ob) {
  constexpr int DC = D / 32, OC = D / 16;
  const int rows_valid = std::min(16, t - p0);
  const int kmax = std::min(s_eff, q_start + p0 + 16);  // keys the block's last row may see
  const int ncols = (kmax + 31) / 32 * 32;
  // Q rows into [G][16][D], zero past the chunk
  for (int h = 0; h < group; ++h)
    for (int i = 0; i < 16; ++i) {
      uint16_t* dst = qp + (h * 16 + i) * D;
      if (i < rows_valid) std::memcpy(dst, q + (p0 + i) * q_stride + (g * group + h) * D, D * 2);
      else std::memset(dst, 0, D * 2);
    }
  BARRIER();
  // scores: sc[h*16 + i][key], float32, row stride ncols; 64 keys a step in 4 accumulators (TDPBF16PS's latency
  // is ~3x its issue interval: 4 independent tiles keep it busy), a last 32-key step in 2
  const uint32_t* kg = kp + size_t(g) * nb16 * DC * 256;
  constexpr int KB = DC * 256;  // one 16-key block of packed K, in uint32
  // each row's max, taken one key step behind the tiles' stores (those scores still sit in L1, and the loads do not
  // wait on the stores in flight), so that the softmax reads the scores from L2 once, not twice
  float rowmax[16 * 8];
  const __m512 lowest = _mm512_set1_ps(-INFINITY);
  for (int h = 0; h < group; ++h) {
    float* sh = sc + size_t(h * 16) * ncols;
    __m512 mx[16];
    for (int i = 0; i < 16; ++i) mx[i] = lowest;
    auto take_max = [&](int k0, int w) {  // keys [k0, k0 + w) of each row, masked to the keys it sees
      BARRIER();
      for (int i = 0; i < rows_valid; ++i) {
        const int n = std::min(s_eff, q_start + p0 + i + 1);
        const float* s = sh + size_t(i) * ncols + k0;
        for (int c = 0; c < w; c += 16)
          mx[i] = _mm512_max_ps(mx[i], _mm512_mask_loadu_ps(lowest, first(n - k0 - c), s + c));
      }
    };
    _tile_loadd(0, qp + h * 16 * D, D * 2);
    if (DC == 2) _tile_loadd(1, qp + h * 16 * D + 32, D * 2);
    int key = 0;
    for (; key + 64 <= ncols; key += 64) {
      const uint32_t* kb = kg + size_t(key / 16) * KB;
      _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);
      _tile_loadd(6, kb, 64); _tile_dpbf16ps(2, 0, 6);
      _tile_loadd(7, kb + KB, 64); _tile_dpbf16ps(3, 0, 7);
      _tile_loadd(6, kb + 2 * KB, 64); _tile_dpbf16ps(4, 0, 6);
      _tile_loadd(7, kb + 3 * KB, 64); _tile_dpbf16ps(5, 0, 7);
      if (DC == 2) {
        _tile_loadd(6, kb + 256, 64); _tile_dpbf16ps(2, 1, 6);
        _tile_loadd(7, kb + KB + 256, 64); _tile_dpbf16ps(3, 1, 7);
        _tile_loadd(6, kb + 2 * KB + 256, 64); _tile_dpbf16ps(4, 1, 6);
        _tile_loadd(7, kb + 3 * KB + 256, 64); _tile_dpbf16ps(5, 1, 7);
      }
      _tile_stored(2, sh + key, ncols * 4);
      _tile_stored(3, sh + key + 16, ncols * 4);
      _tile_stored(4, sh + key + 32, ncols * 4);
      _tile_stored(5, sh + key + 48, ncols * 4);
      if (key > 0) take_max(key - 64, 64);
    }
    if (key > 0) take_max(key - 64, 64);
    if (key < ncols) {
      const uint32_t* kb = kg + size_t(key / 16) * KB;
      _tile_zero(2); _tile_zero(3);
      _tile_loadd(6, kb, 64); _tile_dpbf16ps(2, 0, 6);
      _tile_loadd(7, kb + KB, 64); _tile_dpbf16ps(3, 0, 7);
      if (DC == 2) {
        _tile_loadd(6, kb + 256, 64); _tile_dpbf16ps(2, 1, 6);
        _tile_loadd(7, kb + KB + 256, 64); _tile_dpbf16ps(3, 1, 7);
      }
      _tile_stored(2, sh + key, ncols * 4);
      _tile_stored(3, sh + key + 16, ncols * 4);
      take_max(key, 32);
    }
    for (int i = 0; i < 16; ++i) rowmax[h * 16 + i] = i < rows_valid ? _mm512_reduce_max_ps(mx[i]) : 0.0f;
  }
  BARRIER();
  // exact softmax and P.V per query head, 32 keys a step: the step's P (16 rows x 32 keys, bfloat16, zero past
  // each row's keys) is written into a two-slot ring in L1 one step ahead of its tile load (so the load does not
  // wait on the stores in flight), then multiplied by OC float32 tiles of V. Each row's sums follow the order of
  // the whole-row loop this replaced (two chains over whole 32-key steps, joined at the row's first partial step,
  // then the rest in one): the same bits, without P's round trip through L2.
  const uint16_t* vg = vp + size_t(g) * nb32 * OC * 512;
  const int steps = ncols / 32;
  const __m512 sv = _mm512_set1_ps(scale2);
  for (int h = 0; h < group; ++h) {
    __m512 sum[16], sum1[16], ms[16];
    int n[16];
    for (int i = 0; i < 16; ++i) {
      n[i] = i < rows_valid ? std::min(s_eff, q_start + p0 + i + 1) : 0;
      ms[i] = _mm512_set1_ps(rowmax[h * 16 + i] * scale2);
      sum[i] = _mm512_setzero_ps();
      sum1[i] = _mm512_setzero_ps();
    }
    const float* sh = sc + size_t(h * 16) * ncols;
    auto make_p = [&](int kb, uint16_t* slot) {  // P of keys [32 kb, 32 kb + 32) of the head's 16 rows
      const int j = kb * 32;
      for (int i = 0; i < 16; ++i) {
        uint16_t* p = slot + i * 32;
        if (j > n[i]) {  // past the row's last step: zeros
          _mm512_storeu_si512(p, _mm512_setzero_si512());
          continue;
        }
        const float* s = sh + size_t(i) * ncols + j;
        __m512 e = exp2_deg4(_mm512_fmsub_ps(_mm512_loadu_ps(s), sv, ms[i]));
        __m512 e1 = exp2_deg4(_mm512_fmsub_ps(_mm512_loadu_ps(s + 16), sv, ms[i]));
        if (j + 32 <= n[i]) {
          sum[i] = _mm512_add_ps(sum[i], e);
          sum1[i] = _mm512_add_ps(sum1[i], e1);
        } else {  // the row's first step that is not whole: join the chains, then its last keys
          sum[i] = _mm512_add_ps(sum[i], sum1[i]);
          e = _mm512_maskz_mov_ps(first(n[i] - j), e);
          e1 = _mm512_maskz_mov_ps(first(n[i] - j - 16), e1);
          sum[i] = _mm512_add_ps(_mm512_add_ps(sum[i], e), e1);
        }
        _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(e1, e));
      }
    };
    _tile_zero(0);
    _tile_zero(1);
    if (OC == 4) { _tile_zero(2); _tile_zero(3); }
    make_p(0, pb);
    for (int kb = 0; kb < steps; ++kb) {
      if (kb + 1 < steps) make_p(kb + 1, pb + ((kb + 1) & 1) * 512);
      BARRIER();
      const uint16_t* vb = vg + size_t(kb) * OC * 512;
      _tile_loadd(4, pb + (kb & 1) * 512, 64);
      _tile_loadd(5, vb, 64);
      _tile_loadd(6, vb + 512, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      if (OC == 4) {
        _tile_loadd(7, vb + 1024, 64);
        _tile_loadd(5, vb + 1536, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 4, 5);
      }
      BARRIER();  // the slot is written again two steps on: after this load
    }
    float sums[16];
    for (int i = 0; i < 16; ++i) {
      if (n[i] == ncols) sum[i] = _mm512_add_ps(sum[i], sum1[i]);  // every step whole: the chains are joined here
      sums[i] = n[i] > 0 ? _mm512_reduce_add_ps(sum[i]) : 1.0f;
    }
    _tile_stored(0, ob, D * 4);
    _tile_stored(1, ob + 16, D * 4);
    if (OC == 4) { _tile_stored(2, ob + 32, D * 4); _tile_stored(3, ob + 48, D * 4); }
    BARRIER();
    for (int i = 0; i < rows_valid; ++i) {
      const __m512 inv = _mm512_set1_ps(1.0f / sums[i]);
      uint16_t* o = out + (p0 + i) * out_stride + (g * group + h) * D;
      for (int c = 0; c < D; c += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(ob + i * D + c), inv)));
    }
    BARRIER();
  }
}

// q [T, H, D], k/v [S, KVH, D] (rows may be strided; S >= q_start + T), bfloat16. Query row i is position
// q_start + i and sees keys 0 .. q_start + i. -> [T, H, D] bfloat16.
at::Tensor amx_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t q_start,
                         double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "amx_attention takes bfloat16 q, k, v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  const int t = q.size(0), h = q.size(1), d = q.size(2), kvh = k.size(1);
  TORCH_CHECK(d == 32 || d == 64, "amx_attention: head_dim must be 32 or 64");
  TORCH_CHECK(h % kvh == 0 && h / kvh <= 8, "amx_attention: query heads per KV head must divide and be <= 8");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d && k.stride(2) == 1 && k.stride(1) == d &&
              v.stride(2) == 1 && v.stride(1) == d, "amx_attention: each row's heads must be contiguous");
  TORCH_CHECK(q_start >= 0 && k.size(0) >= q_start + t && v.size(0) >= q_start + t, "amx_attention: too few keys");
  TORCH_CHECK(amx_granted(), "amx_attention: the kernel refused the AMX tile state");
  const int group = h / kvh, s_eff = q_start + t;
  const int nb32 = (s_eff + 31) / 32, nb16 = 2 * nb32;
  Aligned<uint32_t> kp(size_t(kvh) * nb16 * (d / 32) * 256);
  Aligned<uint16_t> vp(size_t(kvh) * nb32 * (d / 16) * 512);
  pack_k(reinterpret_cast<const uint32_t*>(k.data_ptr()), k.stride(0) / 2, kvh, d, s_eff, nb16, kp.data());
  pack_v(reinterpret_cast<const uint16_t*>(v.data_ptr()), v.stride(0), kvh, d, s_eff, nb32, vp.data());
  at::Tensor out = at::empty({t, h, d}, q.options());
  const uint16_t* qd = reinterpret_cast<const uint16_t*>(q.data_ptr());
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int nqb = (t + 15) / 16, items = kvh * nqb;
  const float scale2 = float(scale) * 1.4426950408889634f;
#pragma omp parallel
  {
    load_tile_config();
    Aligned<uint16_t> qp(size_t(group) * 16 * d);
    Aligned<float> sc(size_t(group) * 16 * nb32 * 32);
    Aligned<uint16_t> pb(1024);  // the two-slot ring of P tiles
    Aligned<float> ob(16 * d);
#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < items; ++it) {
      const int qb = nqb - 1 - it / kvh, g = it % kvh;  // longest rows first
      if (d == 64)
        attend_item<64>(qd, q.stride(0), od, int64_t(h) * d, kp.data(), vp.data(), g, qb * 16, t, q_start, s_eff,
                        group, nb16, nb32, scale2, qp.data(), sc.data(), pb.data(), ob.data());
      else
        attend_item<32>(qd, q.stride(0), od, int64_t(h) * d, kp.data(), vp.data(), g, qb * 16, t, q_start, s_eff,
                        group, nb16, nb32, scale2, qp.data(), sc.data(), pb.data(), ob.data());
    }
    _tile_release();
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(NAMESPACE, m) {
  m.def("amx_attention(Tensor q, Tensor k, Tensor v, int q_start, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("amx_attention", &amx_attention); }
"""

REQUIRED_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx512bw", "avx512vl")
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-w", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512bf16", "-mavx512dq", "-mamx-tile", "-mamx-bf16",
         f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def cpu_has_amx() -> bool:
    """This CPU has the bfloat16 tiles and the AVX-512 (BF16) the AMX ops' vector parts run on."""
    return set(REQUIRED_FLAGS) <= int4_kernel.cpu_flags()


def supported() -> bool:
    """This CPU has the tiles; PACELINE_ATTN_AMX=0 says no."""
    return os.environ.get("PACELINE_ATTN_AMX", "1") != "0" and cpu_has_amx()


def supports(head_dim: int, heads: int, kv_heads: int) -> bool:
    return head_dim in (32, 64) and heads % kv_heads == 0 and heads // kv_heads <= 8


@functools.cache
def library_path(source: str, stem: str) -> tuple[Path, str]:
    """Where an AMX op built from `source` with FLAGS is cached, and its torch.ops namespace: both named by `stem`
    and a hash of the stem, the source, the flags and torch's version (a library built under another namespace never
    shares the name). Remembered: layers ask for their op every step."""
    from paceline.model.cache_dir import cache_root
    key = hashlib.sha256("\n".join([stem, source, torch.__version__, *FLAGS]).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"{stem}-{key}.so", f"paceline_{stem}_{key}"


def load() -> Callable | None:
    """The op `(q, k, v, q_start, scale) -> out`, building it first if needed; None where this CPU lacks AMX, it
    is switched off, or it cannot be built (the reason logged once)."""
    if not supported():
        return None
    path, namespace = library_path(SOURCE, "amx_attention")
    return int4_kernel.load_op(path, namespace, FLAGS, SOURCE, "amx_attention",
                               "AMX attention kernel unavailable, using SDPA")
