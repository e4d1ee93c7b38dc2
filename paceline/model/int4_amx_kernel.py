"""An int4 model's linears for steps of a few dozen rows on the AMX tiles: the 4-bit codes expanded to bfloat16
in registers, then TDPBF16PS.

Why: on a CPU with AMX, a step of 16-127 rows (a batch of decodes, a short prompt chunk beside them) is bound by
reading weights, not by arithmetic: the dense bfloat16 copy streams 212 MB a step for SmolLM2-135M's layers (16 of
a 32-decode step's 33 ms went to its linears, 2026-11-25), and the int4 x int8 op, which reads a quarter of that,
spends its time in AVX512-VNNI arithmetic instead. Here each 32-column block of the weight is expanded once per
call (codes -> float32 -> lo + code * scale in one fused multiply-add -> bfloat16: the dense copy's weights, but
for a rare one-ulp difference where its two roundings land elsewhere) into the pair layout of the tiles' B operand, and every 16-row block of the step's rows runs
against it from L2; the codes, 4 bits, and a float32 scale and minimum per 32 inputs are what streams.

Layout (pack()): codes [N/32, K/32, 2, 16, 16] uint8: column block, group of 32 inputs, tile (16 columns), tile row
r (inputs 2r, 2r + 1), byte j holding the codes of pair positions j (low nibble) and j + 16 (high nibble), where
position p = 2c + i is column c's input 2r + i; scale_lo [N/32, K/32, 2, 2, 16] float32: the 16 columns' scales,
then their minimums. The accumulation order differs from oneDNN's, so results match the dense copy within
float32 rounding of the sums, not bit for bit; a row's result does not depend on the other rows of its step.

Built like the other ops, only where the CPU has amx_bf16 (amx_attention_kernel.supported's flags).
`PACELINE_INT4_AMX=0` switches it off.
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from paceline.model import amx_attention_kernel, int4_kernel

SOURCE = amx_attention_kernel.AMX_COMMON + r"""
namespace {

using namespace amx;

// one 32-column block's weights for all K: B tiles [K/32][2][16 rows][32 bf16], from the packed codes
void expand_block(const uint8_t* codes, const float* sl, int groups, uint16_t* wb) {
  // pair position p = 2c + i takes column c's scale: lanes 0..15 are columns 0..7, lanes 16..31 columns 8..15
  const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
  const __m512i nibble = _mm512_set1_epi32(15);
  for (int g = 0; g < groups; ++g)
    for (int t = 0; t < 2; ++t) {
      const float* s = sl + (size_t(g) * 2 + t) * 32;
      const __m512 sc = _mm512_loadu_ps(s), mn = _mm512_loadu_ps(s + 16);
      const __m512 sc0 = _mm512_permutexvar_ps(lo_cols, sc), sc1 = _mm512_permutexvar_ps(hi_cols, sc);
      const __m512 mn0 = _mm512_permutexvar_ps(lo_cols, mn), mn1 = _mm512_permutexvar_ps(hi_cols, mn);
      const uint8_t* c = codes + (size_t(g) * 2 + t) * 256;
      uint16_t* w = wb + (size_t(g) * 2 + t) * 512;
      for (int r = 0; r < 16; ++r) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + r * 16)));
        const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, nibble));
        const __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        // lo + code * scale in one rounding (the dense copy rounds twice: a weight may differ from it by one
        // bfloat16 ulp where the float32 sum sits on a rounding edge), then round to bfloat16
        const __m512 w0 = _mm512_fmadd_ps(q0, sc0, mn0);
        const __m512 w1 = _mm512_fmadd_ps(q1, sc1, mn1);
        _mm512_store_si512(reinterpret_cast<__m512i*>(w + r * 32), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
      }
    }
}

// rows [m, m + 16 * two) x this block's 32 columns: C tiles 0/1 (rows m, columns 0-15 / 16-31), 2/3 (rows m + 16).
// B tiles: the block's expanded groups in wb ([K/32][1024]), or, FUSED (at most 32 rows), each group expanded right
// before its products into a two-slot ring (wb's first 2048) that stays in L1, so that the vector expansion of group
// g + 1 overlaps the tiles' work on group g (the unfused path expands a whole block first, for reuse over more rows)
template <bool TWO, bool FUSED>
void block_rows(const uint16_t* xp, int k, const uint8_t* codes, const float* sl, int groups, uint16_t* wb,
                float* cb) {
  _tile_zero(0);
  _tile_zero(1);
  if (TWO) { _tile_zero(2); _tile_zero(3); }
  for (int g = 0; g < groups; ++g) {
    uint16_t* w = wb + size_t(FUSED ? (g & 1) : g) * 1024;
    if (FUSED) {
      expand_block(codes + size_t(g) * 512, sl + size_t(g) * 64, 1, w);
      BARRIER();
    }
    _tile_loadd(4, xp + g * 32, k * 2);
    _tile_loadd(6, w, 64);
    _tile_loadd(7, w + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (TWO) {
      _tile_loadd(5, xp + size_t(16) * k + g * 32, k * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    if (FUSED) BARRIER();  // the ring slot is written again two groups on: after these loads
  }
  _tile_stored(0, cb, 128);
  _tile_stored(1, cb + 16, 128);
  if (TWO) { _tile_stored(2, cb + 512, 128); _tile_stored(3, cb + 528, 128); }
  BARRIER();
}

// x [M, K] bfloat16 (any row stride), codes/scale_lo as pack() lays them out -> [M, N] bfloat16 (+ bias)
at::Tensor int4_amx_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_lo,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "int4_amx_mm: x must be a bfloat16 [M, K] tensor with unit column stride");
  TORCH_CHECK(codes.dim() == 5 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
              scale_lo.scalar_type() == at::kFloat && scale_lo.is_contiguous(), "int4_amx_mm: bad packed weight");
  const int m = x.size(0), k = x.size(1), nblocks = codes.size(0), groups = codes.size(1), n = nblocks * 32;
  TORCH_CHECK(k == groups * 32, "int4_amx_mm: x has ", k, " columns, the weight ", groups * 32, " inputs");
  TORCH_CHECK(scale_lo.numel() == int64_t(nblocks) * groups * 64, "int4_amx_mm: scale_lo does not fit codes");
  TORCH_CHECK(!bias.has_value() || (bias->numel() == n && bias->is_contiguous()), "int4_amx_mm: bad bias");
  TORCH_CHECK(amx_granted(), "int4_amx_mm: the kernel refused the AMX tile state");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const int mb = (m + 15) / 16;
  // the rows, padded with zeros to whole 16-row tiles, 64-byte aligned
  Aligned<uint16_t> xp(size_t(mb) * 16 * k);
  const uint16_t* xd = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for (int i = 0; i < mb * 16; ++i) {
    if (i < m) std::memcpy(xp.data() + size_t(i) * k, xd + size_t(i) * x.stride(0), size_t(k) * 2);
    else std::memset(xp.data() + size_t(i) * k, 0, size_t(k) * 2);
  }
  std::vector<float> bias_f(n, 0.0f);
  if (bias.has_value()) {
    at::Tensor bf = bias->to(at::kFloat).contiguous();
    std::memcpy(bias_f.data(), bf.data_ptr<float>(), size_t(n) * 4);
  }
  const uint8_t* cd = codes.data_ptr<uint8_t>();
  const float* sd = scale_lo.data_ptr<float>();
  uint16_t* od = reinterpret_cast<uint16_t*>(out.data_ptr());
#pragma omp parallel
  {
    load_tile_config();
    Aligned<uint16_t> wb(size_t(std::max(groups, 2)) * 1024);  // a block's tiles, or the fused path's two-slot ring
    Aligned<float> cb(1024);
#pragma omp for schedule(static)
    for (int nb = 0; nb < nblocks; ++nb) {
      const uint8_t* codes_nb = cd + size_t(nb) * groups * 512;
      const float* sl_nb = sd + size_t(nb) * groups * 64;
      if (mb > 2) {
        expand_block(codes_nb, sl_nb, groups, wb.data());
        BARRIER();
      }
      for (int b = 0; b < mb; b += 2) {
        const bool two = b + 1 < mb;
        const uint16_t* xb = xp.data() + size_t(b) * 16 * k;
        if (mb <= 2 && two) block_rows<true, true>(xb, k, codes_nb, sl_nb, groups, wb.data(), cb.data());
        else if (mb <= 2) block_rows<false, true>(xb, k, codes_nb, sl_nb, groups, wb.data(), cb.data());
        else if (two) block_rows<true, false>(xb, k, codes_nb, sl_nb, groups, wb.data(), cb.data());
        else block_rows<false, false>(xb, k, codes_nb, sl_nb, groups, wb.data(), cb.data());
        for (int i = 0; i < (two ? 32 : 16) && b * 16 + i < m; ++i) {
          const float* c = cb.data() + i * 32;
          uint16_t* o = od + size_t(b * 16 + i) * n + nb * 32;
          const __m512 y0 = _mm512_add_ps(_mm512_loadu_ps(c), _mm512_loadu_ps(bias_f.data() + nb * 32));
          const __m512 y1 = _mm512_add_ps(_mm512_loadu_ps(c + 16), _mm512_loadu_ps(bias_f.data() + nb * 32 + 16));
          _mm512_storeu_si512(reinterpret_cast<__m512i*>(o), (__m512i)_mm512_cvtne2ps_pbh(y1, y0));
        }
      }
    }
    _tile_release();
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(NAMESPACE, m) {
  m.def("int4_amx_mm(Tensor x, Tensor codes, Tensor scale_lo, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("int4_amx_mm", &int4_amx_mm); }
"""

GROUP = 32  # inputs per scale: Q4_1's block


def supported() -> bool:
    """This CPU has the tiles and the op is not switched off (PACELINE_INT4_AMX=0)."""
    return os.environ.get("PACELINE_INT4_AMX", "1") != "0" and amx_attention_kernel.cpu_has_amx()


def supports(out_features: int, in_features: int) -> bool:
    return out_features % 32 == 0 and in_features % GROUP == 0


def pack(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] (0..15), scale and lo [N, K / 32] (weight = lo + code * scale) -> (codes, scale_lo) in the
    op's layout (module docstring)."""
    n, k = codes.shape
    if not supports(n, k):
        raise ValueError(f"int4_amx_kernel.pack: {n} x {k} needs outputs a multiple of 32 and inputs of {GROUP}")
    g = k // GROUP
    # [nb, t, c, g, r, i] -> [nb, g, t, r, c, i]: position p = 2c + i of tile row r
    pos = codes.to(torch.uint8).view(n // 32, 2, 16, g, 16, 2).permute(0, 3, 1, 4, 2, 5).reshape(n // 32, g, 2, 16, 32)
    packed = (pos[..., :16] | (pos[..., 16:] << 4)).contiguous()
    per_tile = lambda v: v.float().reshape(n // 32, 2, 16, g).permute(0, 3, 1, 2)  # [nb, g, t, 16]
    scale_lo = torch.stack([per_tile(scale), per_tile(lo)], 3).contiguous()  # [nb, g, t, 2, 16]
    return packed, scale_lo


def load() -> Callable | None:
    """The op `(x, codes, scale_lo, bias) -> y`, building it first if needed; None where this CPU lacks AMX, it
    is switched off, or it cannot be built (the reason logged once)."""
    if not supported():
        return None
    path, namespace = amx_attention_kernel.library_path(SOURCE, "int4_amx")
    return int4_kernel.load_op(path, namespace, amx_attention_kernel.FLAGS, SOURCE, "int4_amx_mm",
                               "AMX int4 matmul unavailable, using the dense copy")
