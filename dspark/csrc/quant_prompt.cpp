// Prompt rows times a packed int4 or int8 weight as a GEMM on AMX-BF16 tiles (mm_prompt, below):
// the many-row path of the AMX build. The decode kernels (quant_amx.cpp, quant_q8_rows.cpp) keep
// their int8 rows, whose exact per-group sums give a decoded and a verified token the same bits;
// prompt rows need no such match, so here the weights are expanded to bf16 instead and the tiles
// accumulate over the whole K. Built only with DSPARK_AMX.
#ifdef DSPARK_AMX
#include "amx_tiles.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace dspark::amx {

namespace {
// Byte b of each 32-bit lane, zero- or sign-extended: one instruction where a shift or a shuffle
// does it alone (the expansion below is the fixed cost of every prompt-carrying pass).
inline __m512i unsigned_byte(__m512i w, int b) {
  if (b == 0) return _mm512_and_si512(w, _mm512_set1_epi32(0xFF));
  if (b == 3) return _mm512_srli_epi32(w, 24);
  // within each 128-bit lane, dword i takes its byte b (index 4i + b) and zeros (0x80) above it
  const int e = static_cast<int>(0x80808000u) + b;
  const __m512i pick = _mm512_set_epi32(e + 12, e + 8, e + 4, e, e + 12, e + 8, e + 4, e,
                                        e + 12, e + 8, e + 4, e, e + 12, e + 8, e + 4, e);
  return _mm512_shuffle_epi8(w, pick);
}

inline __m512i signed_byte(__m512i w, int b) {
  return b == 3 ? _mm512_srai_epi32(w, 24) : _mm512_srai_epi32(_mm512_slli_epi32(w, 24 - 8 * b), 24);
}

// Two rows of 16 floats -> one tile row of bf16 pairs (lo[c] in the low half of lane c, hi[c] in
// the high one), rounded as _mm512_cvtneps_pbh rounds each.
inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words 0-15: lo, 16-31: hi
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, both);
}
}  // namespace

// Prompt rows (many of them) times an int4 weight from pack(), or an int8 one from pack8() (given
// its code sums: Q8_0 codes, or the k-quant form), as a GEMM on bf16 tiles: each column-tile
// pair's codes are expanded once to bf16 weights w = d * q + m (fp32, then rounded to bf16) in a
// panel that stays in cache, then every block of 16 rows runs the whole K through AMX-BF16 with
// fp32 accumulators held in the tiles. The rows stay bf16, so a prompt row's result is not the
// bits mm() gives a decoded row (the engine never mixes the two for one token: packed.py's
// RowSplit); each row's result still depends on that row alone.
at::Tensor mm_prompt(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& dm,
                     const std::optional<at::Tensor>& sums) {
  const bool codes8 = sums.has_value() && sums->numel() > 0;
  const MatmulShape s = codes8 ? check_mm8(x_in, at::kBFloat16, packed, dm, *sums)
                               : check_mm(x_in, at::kBFloat16, packed, dm);
  TORCH_CHECK(codes8 || !s.bytes, "mm_prompt: int8 codes take pack8's weights and code sums");
  const int64_t rows = s.rows, k = s.k, n = s.n, g = k / kGroup, pairs = packed.size(0) / 2;
  // per (column tile, group): packed bytes, and pack8's fp16 values (d, or d_lo, d_hi, m); int4
  // weights' scales in any of their forms through int4_scales
  const int64_t tile_bytes = codes8 ? 2 * kTileBytes : kTileBytes;
  const int64_t scales = s.split ? 3 * kCols : kCols;
  auto y = at::empty({rows, n}, x_in.options());
  if (rows == 0) return y;
  const int64_t padded = (rows + 15) / 16 * 16;
  at::Tensor x = x_in.contiguous();
  if (padded != rows) x = at::cat({x, at::zeros({padded - rows, k}, x.options())});
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const auto* dmp = reinterpret_cast<const uint16_t*>(dm.data_ptr());
  auto* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    std::vector<uint32_t> panel(2 * g * 16 * 16);  // [tile][group][tile row][column]: bf16 pairs
    alignas(64) float ctile[2][16 * 16];
    configure(16, 64, 16);
    for (int64_t pr = p0; pr < p1; ++pr) {
      for (int j = 0; j < 2; ++j) {
        const int64_t t = 2 * pr + j;
        for (int64_t gi = 0; gi < g; ++gi) {
          __m512i w[8];  // w[q]: k = 4q .. 4q + 3 of the 16 columns, a byte each per lane
          const uint8_t* src = wp + (t * g + gi) * tile_bytes;
          __m512 d_lo, d_hi, m = _mm512_setzero_ps();
          if (!codes8) {
            widen(src, w);
            int4_scales(dmp, s.form, t, g, gi, d_lo, m);
            d_hi = d_lo;
          } else {
            const uint16_t* sc = dmp + (t * g + gi) * scales;
            d_lo = d_hi = half16(sc);
            for (int q = 0; q < 8; ++q) w[q] = _mm512_loadu_si512(src + 64 * q);
            if (s.split) {
              d_hi = half16(sc + kCols);
              m = half16(sc + 2 * kCols);
            }
          }
          uint32_t* dst = panel.data() + (j * g + gi) * 256;
          for (int q = 0; q < 8; ++q) {
            const __m512 d = q < 4 ? d_lo : d_hi;  // inputs 0-15, then 16-31
            __m512 f[4];
            for (int b = 0; b < 4; ++b)
              f[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes8 ? signed_byte(w[q], b) : unsigned_byte(w[q], b)), d, m);
            for (int h = 0; h < 2; ++h)  // tile row 2q + h holds k = 4q + 2h (low half) and 4q + 2h + 1
              _mm512_storeu_si512(dst + 16 * (2 * q + h), bf16_pairs(f[2 * h], f[2 * h + 1]));
          }
        }
      }
      const uint32_t* b0 = panel.data();
      const uint32_t* b1 = panel.data() + g * 256;
      for (int64_t r0 = 0; r0 < padded; r0 += 16) {
        _tile_zero(2);
        _tile_zero(4);
        for (int64_t gi = 0; gi < g; ++gi) {
          _tile_loadd(0, xp + r0 * k + gi * kGroup, k * 2);
          _tile_loadd(1, b0 + gi * 256, 64);
          _tile_loadd(3, b1 + gi * 256, 64);
          _tile_dpbf16ps(2, 0, 1);
          _tile_dpbf16ps(4, 0, 3);
        }
        _tile_stored(2, ctile[0], 64);
        _tile_stored(4, ctile[1], 64);
        const int64_t mr = std::min<int64_t>(16, rows - r0);
        for (int64_t i = 0; i < mr; ++i)
          for (int j = 0; j < 2; ++j)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + (r0 + i) * n + (2 * pr + j) * kCols),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(ctile[j] + 16 * i)));
      }
    }
    _tile_release();
  });
  return y;
}

}  // namespace dspark::amx
#endif
