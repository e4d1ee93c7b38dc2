"""The LM head on a GGUF's own Q8_0 codes: int8 weights x int8 activations (AVX512-VNNI), float32 logits.

Why: the LM head is the largest matrix of a small model (SmolLM2-135M: the tied embedding, 49152 x 576), and in
the default mode it ran as a bfloat16 matmul: 57 MB to stream for one decode, bf16 dot products for many rows (a
step profile put it at 2.5 of a decode's 10.2 ms and 5.8 of a 32-decode step's 32.3, 2026-11-25 00:47 UTC). The
bundled GGUF stores that tensor as Q8_0 (blocks of 32 int8 codes in [-127, 127] and one scale each), so its exact
values are codes x a scale: here the head reads those codes (1.125 bytes a weight with a float32 scale per block,
half the bf16 copy's bytes) and multiplies them with `vpdpbusd` (64 int8 multiply-adds per instruction, twice a
bf16 dot product's). The weights are exact (the bf16 copy even rounded them); only the activations are rounded.

Numerics. Per block b of 32 inputs the weight is w = d[n, b] * q[n, k] (the GGUF's code q and scale d, d held in
float32). Each row's activations are quantized per block, as w4a8_kernel.py does: a = max|x| / 127 and
xq = round(x * (127 / max|x|)) in int8 (round half to even). Then

    y[r, n] = sum over blocks b of  d[n, b] * a[r, b] * (sum_k q[n, k] * xq[r, k])

with the integer block sum exact and float32 for the rest. `vpdpbusd` multiplies unsigned by signed bytes, so the
pack stores q + 128 (1..255) and the block sum starts from -128 * sum_k xq[r, k] (the quantizer's by-product):
sum (q + 128) xq - 128 sum xq = sum q xq, exactly, with no instruction more than a broadcast load a row and block.

`outliers`: each block's largest |x| (index t) is taken out before the scale is chosen, so that one large channel
does not coarsen the other 31 values (a = max|rest| / 127), and goes back in as an int16 in units of a,
k = round(x_t / a) (a raised to |x_t| / 32767 where it is smaller, so that k fits): one `vpdpwssd` of the block's
16 codes at t by k adds (q_t + 128) * k to the same exact integer sum, whose start is then -128 * (sum xq + k). It
is w4a8's trick with the taken-out value rounded like the others (to a / 2) instead of multiplied in float32: the
same quality here, and no float32 work per row and block beyond the scale's.

Each output (r, n) is summed block by block in the same order whatever the other rows of the call, the number of
rows a pass takes or the thread that runs its tile, so a position's logits are bitwise the same in a one-row
decode and in a five-row verification (speculative = non-speculative for greedy) (tests/model/test_q8_head.py).

Layout (pack): columns in tiles of 16, each tile's blocks in order; per block 8 steps of 4 inputs x 16 columns
(one 32-bit lane per column: one broadcast of 4 activation bytes against a step makes 64 multiply-adds), then the
16 scales as float32: 576 bytes per block of 16 x 32 weights.

Only an AVX512-VNNI build (F, BW, VL, VNNI; w4a8_kernel.has_vnni()): elsewhere load() gives None and the model
keeps its bf16 head. Built once with the system compiler and cached (int4_kernel.load_op). `PACELINE_Q8_HEAD=0`
switches it off (A/B runs); `PACELINE_Q8_HEAD_OUTLIERS=0` leaves the outliers in (faster from ~32 rows, but on
held-out text KL to fp32 0.0026 nats a token against 0.0017 with them and 0.0021 for the bf16 head:
benchmarks/summaries/q8_head.md).
"""
from __future__ import annotations

import hashlib
import os
from typing import Callable

import torch

from paceline.model import int4_kernel, w4a8_kernel

GROUP = 32  # inputs per scale: Q8_0's block
TILE = 16  # output columns per tile
BLOCK_BYTES = GROUP * TILE + 4 * TILE  # codes, then 16 float32 scales

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
#include <cstring>
#include <memory>
#include <type_traits>

namespace {

constexpr int GROUP = 32, TILE = 16, STEPS = GROUP / 4, CODE_BYTES = GROUP * TILE, BLOCK = CODE_BYTES + 4 * TILE;
constexpr int MAX_R = 12;  // rows per pass: 12 int32 and 12 float32 sums, a code vector and temporaries in 32 zmm
constexpr int ROW_CHUNK = 128;  // a chunk's int8 rows (72 KiB at K = 576) stay in L2 while every tile runs over them

// 32 inputs as two vectors of 16 float32 (a bfloat16 is the top half of its float32: exact)
template <typename T>
inline void load32(const T* p, __m512& v0, __m512& v1) {
  if constexpr (std::is_same_v<T, float>) {
    v0 = _mm512_loadu_ps(p);
    v1 = _mm512_loadu_ps(p + 16);
  } else {
    const __m512i w = _mm512_loadu_si512(p);
    v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(w)), 16));
    v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1)), 16));
  }
}

// The rows' activations in the layout the tiles read (inside the parallel region, hence `omp for`): xq step-major,
// the M rows' 4 bytes of one step side by side ([K / 4][M][4]), so that a pass of R rows reads them through one
// pointer at constant offsets; a (scale), c0 (-128 * the block's integer sum: the start of the block sum), off and
// kt (the taken-out element: its code's byte offset in a block, 64 * (t / 4) + t % 4, and its int16 value in units
// of a, in the low half of an int32 lane as vpdpwssd reads it) as [G][M].
template <typename T, bool OUT>
void quantize_steps(const T* x, int64_t ldx, int M, int K, int8_t* xs, float* a, int32_t* c0, int32_t* off,
                    int32_t* kt) {
  const int G = K / GROUP;
#pragma omp for schedule(static)
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < M; ++m) {
      __m512 v0, v1;
      load32(x + int64_t(m) * ldx + g * GROUP, v0, v1);
      const int64_t i = int64_t(g) * M + m;
      float xt = 0.0f;  // the taken-out value (OUT)
      if (OUT) {  // the block's largest |x| (the first of equal ones) out of the int8 block
        const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1);
        const __m512 tv = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(a0, a1)));
        const uint32_t eq = uint32_t(_mm512_cmp_ps_mask(a0, tv, _CMP_EQ_OQ)) |
                            (uint32_t(_mm512_cmp_ps_mask(a1, tv, _CMP_EQ_OQ)) << 16);
        const int ti = eq ? __builtin_ctz(eq) : 0;  // eq == 0 only for NaNs
        alignas(64) float blk[GROUP];
        _mm512_store_ps(blk, v0);
        _mm512_store_ps(blk + 16, v1);
        xt = blk[ti];
        off[i] = 64 * (ti >> 2) + (ti & 3);
        v0 = _mm512_mask_mov_ps(v0, ti < 16 ? __mmask16(1u << ti) : 0, _mm512_setzero_ps());
        v1 = _mm512_mask_mov_ps(v1, ti >= 16 ? __mmask16(1u << (ti - 16)) : 0, _mm512_setzero_ps());
      }
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      // the taken-out element must fit an int16 in units of a: only a block whose largest value is over 258x the
      // rest's gets a coarser scale than the rest's own
      if (OUT) amax = std::max(amax, std::fabs(xt) * (127.0f / 32767.0f));
      const float invs = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512 inv = _mm512_set1_ps(invs);
      // cvtps rounds half to even (the default MXCSR mode); |x * inv| <= 127, so the narrowing never saturates
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      a[i] = amax / 127.0f;
      int32_t k = 0;
      if (OUT) {  // rounded as the others (the same multiply, MXCSR's half to even), clamped against NaN
        k = std::min(32767, std::max(-32767, _mm_cvtss_si32(_mm_set_ss(xt * invs))));
        kt[i] = k & 0xFFFF;
      }
      c0[i] = -128 * (_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)) + k);
      alignas(16) int32_t q4[8];  // the block's 8 steps of 4 int8
      _mm_store_si128(reinterpret_cast<__m128i*>(q4), _mm512_cvtsepi32_epi8(q0));
      _mm_store_si128(reinterpret_cast<__m128i*>(q4 + 4), _mm512_cvtsepi32_epi8(q1));
      int8_t* out = xs + 4 * (int64_t(g) * STEPS * M + m);
      for (int st = 0; st < STEPS; ++st) std::memcpy(out + 4 * int64_t(st) * M, q4 + st, 4);
    }
}

// R rows x one tile of 16 columns. xs: the step-major activations from the pass's first row on (sstride bytes a
// step, 4 * M); a, c0, off, kt: [G][M] from the pass's first row on. Not inlined: alone it gets the registers.
template <int R, bool OUT>
__attribute__((noinline)) void tile_rows(const int8_t* xs, int64_t sstride, const float* a, const int32_t* c0,
                                         const int32_t* off, const int32_t* kt, int64_t M, int G, const uint8_t* tile,
                                         float* y, int64_t ldy, int nn, const uint8_t* pf) {
  const __m512i lowd = _mm512_set1_epi32(0xFF);
  __m512 f[R];
  for (int r = 0; r < R; ++r) f[r] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    const uint8_t* blk = tile + size_t(g) * BLOCK;
    if (pf != nullptr)  // the next tile, block by block, into L2 (the first pass over a tile only: see run)
      for (int l = 0; l < BLOCK; l += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + size_t(g) * BLOCK + l), _MM_HINT_T1);
    const int8_t* xg = xs + int64_t(g) * STEPS * sstride;
    const int64_t gi = int64_t(g) * M;
    __m512i c[R];
    for (int r = 0; r < R; ++r) c[r] = _mm512_set1_epi32(c0[gi + r]);  // undoes the codes' +128, exactly
#pragma GCC unroll 8
    for (int st = 0; st < STEPS; ++st) {
      const __m512i w = _mm512_loadu_si512(blk + 64 * st);
      const int8_t* xst = xg + st * sstride;
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xst + 4 * r, 4);
        c[r] = _mm512_dpbusd_epi32(c[r], w, _mm512_set1_epi32(x4));
      }
    }
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + CODE_BYTES));
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      if (OUT) {  // the taken-out element into the exact integer sum: its 16 codes q + 128 (an unaligned load puts
        // each in its lane's low byte, as the low int16 of the lane) times its int16 value, one vpdpwssd
        const __m512i u = _mm512_and_si512(_mm512_loadu_si512(blk + off[gi + r]), lowd);
        c[r] = _mm512_dpwssd_epi32(c[r], u, _mm512_set1_epi32(kt[gi + r]));
      }
      // |sum| < 2^24 (31 * 127 * 127 + 127 * 32767): the conversion is exact
      f[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c[r]), d), _mm512_set1_ps(a[gi + r]), f[r]);
    }
  }
  const __mmask16 keep = __mmask16((1u << nn) - 1);  // the last tile of an output size not a multiple of 16
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, f[r]);
}

template <bool OUT, typename T>
void run(const T* x, int64_t ldx, int M, int K, const uint8_t* w, int64_t N, float* y, int nthreads) {
  const int G = K / GROUP, T_ = int((N + TILE - 1) / TILE);
  // written whole by the quantizer before any tile reads them: no zeroing (std::vector's costs a few % at 32 rows)
  std::unique_ptr<int8_t[]> xs(new int8_t[size_t(M) * K]);
  std::unique_ptr<float[]> a(new float[size_t(M) * G]);
  std::unique_ptr<int32_t[]> c0(new int32_t[size_t(M) * G]), off(new int32_t[size_t(M) * G]), kt(new int32_t[size_t(M) * G]);
#pragma omp parallel num_threads(nthreads)
  {
  quantize_steps<T, OUT>(x, ldx, M, K, xs.get(), a.get(), c0.get(), off.get(), kt.get());  // ends in a barrier
  for (int mc = 0; mc < M; mc += ROW_CHUNK) {
    const int mn = std::min(ROW_CHUNK, M - mc), passes = (mn + MAX_R - 1) / MAX_R;
#pragma omp for schedule(static) nowait
    for (int t = 0; t < T_; ++t) {
      const uint8_t* tile = w + size_t(t) * G * BLOCK;
      const int n0 = t * TILE, nn = int(std::min<int64_t>(TILE, N - n0));
      const uint8_t* next = t + 1 < T_ ? tile + size_t(G) * BLOCK : nullptr;
      for (int p = 0, m0 = mc; p < passes; ++p) {
        const int R = (mc + mn - m0 + (passes - p) - 1) / (passes - p);  // rows split evenly over the passes
        const uint8_t* pf = p == 0 ? next : nullptr;
        const int8_t* xr = xs.get() + 4 * int64_t(m0);
        float* yr = y + int64_t(m0) * N + n0;
        switch (R) {
#define Q8_CASE(n) case n: tile_rows<n, OUT>(xr, 4 * int64_t(M), a.get() + m0, c0.get() + m0, off.get() + m0, kt.get() + m0, M, G, tile, yr, N, nn, pf); break;
          Q8_CASE(1) Q8_CASE(2) Q8_CASE(3) Q8_CASE(4) Q8_CASE(5) Q8_CASE(6) Q8_CASE(7) Q8_CASE(8) Q8_CASE(9)
          Q8_CASE(10) Q8_CASE(11)
          default: tile_rows<MAX_R, OUT>(xr, 4 * int64_t(M), a.get() + m0, c0.get() + m0, off.get() + m0, kt.get() + m0, M, G, tile, yr, N, nn, pf); break;
#undef Q8_CASE
        }
        m0 += R;
      }
    }
  }
  }
}

// x [M, K] float32 or bfloat16 (unit stride along K), w the packed uint8 [tiles, K / 32, 576], n outputs ->
// float32 [M, n]. outliers: each block's largest activation in float32 (see the module's docstring).
at::Tensor q8_mm(const at::Tensor& x_in, const at::Tensor& w, int64_t n, bool outliers) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(x_in.size(1) % GROUP == 0, "K must be a multiple of 32");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int M = int(x.size(0)), K = int(x.size(1)), G = K / GROUP, T_ = int((n + TILE - 1) / TILE);
  TORCH_CHECK(n > 0, "n must be positive");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 && w.size(0) == T_ &&
              w.size(1) == G && w.size(2) == BLOCK, "w must be the packed [tiles, K / 32, 576] uint8 weight");
  auto y = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  const int workers = std::min(std::max(1, at::get_num_threads()), T_);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    if (outliers) run<true>(x.data_ptr<float>(), x.stride(0), M, K, wp, n, yp, workers);
    else run<false>(x.data_ptr<float>(), x.stride(0), M, K, wp, n, yp, workers);
  } else {
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();
    if (outliers) run<true>(xb, x.stride(0), M, K, wp, n, yp, workers);
    else run<false>(xb, x.stride(0), M, K, wp, n, yp, workers);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(NAMESPACE, m) { m.def("q8_mm(Tensor x, Tensor w, int n, bool outliers) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("q8_mm", &q8_mm); }
"""

SWITCH = "PACELINE_Q8_HEAD"
OUTLIERS_SWITCH = "PACELINE_Q8_HEAD_OUTLIERS"


def _flag(var: str, default: str) -> bool:
    value = os.environ.get(var, default).strip()
    if value not in ("0", "1"):
        raise ValueError(f"{var} must be 0 or 1, got {value!r}")
    return value == "1"


def enabled() -> bool:
    """PACELINE_Q8_HEAD: whether a model built afterwards serves its LM head with this op (where it loads)."""
    return _flag(SWITCH, "1")


def outliers() -> bool:
    """PACELINE_Q8_HEAD_OUTLIERS (default 1): whether each block's largest activation is taken out of the int8
    block and added back as an int16 (see the module's docstring)."""
    return _flag(OUTLIERS_SWITCH, "1")


def build_key() -> str:
    """What serves a bfloat16 model's LM head as far as the switches and the CPU say, for the keys of measured
    step times and runtime snapshots: "off", or "vnni" with ":t0" when the outliers stay in."""
    if not enabled() or not w4a8_kernel.has_vnni():
        return "off"
    return "vnni" + ("" if outliers() else ":t0")


def _library():
    from paceline.model.cache_dir import cache_root
    fl = w4a8_kernel.build_flags("vnni")  # the same instruction sets as the w4a8 op's VNNI build
    key = hashlib.sha256("\n".join([SOURCE, torch.__version__, *fl]).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"q8_mm-{key}.so", f"paceline_q8_{key}", fl


_op: list = []  # op()'s answer, found once per process (finding it hashes the source)


def op() -> Callable | None:
    """The op `(x [M, K], packed, n, outliers) -> float32 [M, n]` whatever the switch says (a model built with it
    keeps using it), building it first if needed; None where the CPU has no AVX512-VNNI or it cannot be built."""
    if not _op:
        found = None
        if w4a8_kernel.has_vnni():
            path, namespace, fl = _library()
            found = int4_kernel.load_op(path, namespace, fl, SOURCE, "q8_mm", "CPU Q8_0 LM-head kernel unavailable")
        _op.append(found)
    return _op[0]


def load() -> Callable | None:
    """op() unless PACELINE_Q8_HEAD=0."""
    return op() if enabled() else None


def q8_codes(weight: torch.Tensor, chunk_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Q8_0 codes [N, K] (int8, -127..127) and scales [N, K / 32] (float32) whose products are `weight`
    exactly, or None when some block has none (not a dequantized Q8_0 tensor, or rounded since).

    A Q8_0 block was quantized with d = max|w| / 127, so its largest value has code +-127 and d = max|v| / 127 of
    the dequantized values v = q * d (exact in float32: an 8-bit code times an fp16 scale) gives d back exactly,
    and v / d the codes. Whether that holds is checked, not assumed: every v must equal q * d bit for bit."""
    if weight.dim() != 2 or weight.shape[1] % GROUP or not weight.dtype.is_floating_point:
        return None
    n, k = weight.shape
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // GROUP, dtype=torch.float32)
    for r0 in range(0, n, chunk_rows):  # a few rows at a time: the float32 temporaries of a whole head are 113 MB
        g = weight[r0:r0 + chunk_rows].to("cpu", torch.float32).reshape(-1, k // GROUP, GROUP)
        d = g.abs().amax(-1) / 127
        q = torch.where(d[..., None] > 0, g / torch.where(d > 0, d, 1)[..., None], 0).round_()
        if not torch.isfinite(d).all() or q.abs().amax() > 127 or not torch.equal(q * d[..., None], g):
            return None
        codes[r0:r0 + chunk_rows] = q.reshape(-1, k).to(torch.int8)
        scales[r0:r0 + chunk_rows] = d
    return codes, scales


def pack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (int8, -127..127) and scales [N, K / 32] -> the op's uint8 layout [ceil(N / 16), K / 32, 576];
    padding columns get code 0 and scale 0."""
    n, k = codes.shape
    if k % GROUP or scales.shape != (n, k // GROUP):
        raise ValueError(f"Q8_0 codes need K a multiple of {GROUP} and one scale per block, got {tuple(codes.shape)} "
                         f"and {tuple(scales.shape)}")
    if codes.numel() and int(codes.to(torch.int16).abs().max()) > 127:
        raise ValueError("Q8_0 codes must lie in -127..127")
    tiles, groups, pad = -(-n // TILE), k // GROUP, -n % TILE
    u = (codes.to(torch.int16) + 128).to(torch.uint8)  # vpdpbusd's unsigned side (see the module's docstring)
    u = torch.nn.functional.pad(u, (0, 0, 0, pad), value=128).view(tiles, TILE, groups, GROUP // 4, 4)
    u = u.permute(0, 2, 3, 1, 4).reshape(tiles, groups, -1)  # [tiles, groups, steps x 16 columns x 4 inputs]
    s = torch.nn.functional.pad(scales.float(), (0, 0, 0, pad)).view(tiles, TILE, groups)
    s = s.permute(0, 2, 1).contiguous().view(torch.uint8)  # [tiles, groups, 16 float32 as bytes]
    return torch.cat([u, s], -1).contiguous()


class Q8Head:
    """An LM head [vocab, hidden] held as Q8_0 codes in the op's layout; float32 logits of bfloat16 (or float32)
    rows. Holds no op (a runtime snapshot pickles it as plain tensors): op() is looked up per call."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, outliers: bool = True):
        self.out_features, self.in_features = codes.shape
        self.packed = pack(codes, scales)
        self.outliers = outliers

    @classmethod
    def from_weight(cls, weight: torch.Tensor, outliers: bool = True) -> "Q8Head | None":
        """The head of a dequantized Q8_0 weight, or None when its values are not exactly codes x scales."""
        found = q8_codes(weight)
        return None if found is None else cls(*found, outliers=outliers)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits [M, vocab] in float32; None when the op is not available in this process (the caller's head)."""
        f = op()
        if f is None:
            return None
        return f(x, self.packed, self.out_features, self.outliers)
