// int8 weights times int8 rows on VNNI and AMX-INT8 (see mm_q8_rows): the LM head, Q8_0 / Q5_0
// layers, and GGUF's k-quant layers (Q6_K, Q5_K) in pack8's split form.
#include "amx_tiles.h"
#include "ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace dspark::amx {

#ifdef DSPARK_AMX
// mm_q8_rows past kVnniRows rows (not the split form) on tiles, a block of up to 16 rows at a
// time, pipelined over groups: at step s group s's tile products run into one C pair while group
// s - 1's, in the other, are stored and group s - 2's combined into the rows' outputs, so no
// vector load waits on a tile store just made and the tile unit is not idle while the rows are
// combined. Groups combine in order, so a row gets VNNI's bits.
void mm_q8_tiles(const QuantizedRows& qr, int64_t rows, int64_t k, const uint8_t* wp, const uint16_t* dmp,
                 c10::BFloat16* yp, int64_t n, int64_t pairs) {
  const int64_t g = k / kGroup, tile_bytes = 2 * kTileBytes;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    std::vector<__m512> acc(rows * 2);
    alignas(64) int32_t ctile[2][2][16 * 16];  // [group parity][column tile]
    configure(static_cast<int>(std::min<int64_t>(rows, 16)), kGroup, 8);
    for (int64_t pr = p0; pr < p1; ++pr) {
      const int64_t t = 2 * pr;
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      const uint8_t* wt[2] = {wp + t * g * tile_bytes, wp + (t + 1) * g * tile_bytes};
      const uint16_t* dm[2] = {dmp + t * g * kCols, dmp + (t + 1) * g * kCols};
      // past 16 rows quantize_batch pads the rows to whole tiles with zeros
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        for (int64_t st = 0; st < g + 2; ++st) {
          if (st < g) {
            prefetch(wt[0] + (st + kAhead) * tile_bytes, tile_bytes);
            prefetch(wt[1] + (st + kAhead) * tile_bytes, tile_bytes);
            _tile_loadd(1, wt[0] + st * tile_bytes, 64);  // the packed layout is the B tile itself
            _tile_loadd(3, wt[1] + st * tile_bytes, 64);
            _tile_loadd(0, qr.xq + r0 * k + st * kGroup, k);
            if (st & 1) {
              _tile_zero(5);
              _tile_zero(6);
              _tile_dpbssd(5, 0, 1);
              _tile_dpbssd(6, 0, 3);
            } else {
              _tile_zero(2);
              _tile_zero(4);
              _tile_dpbssd(2, 0, 1);
              _tile_dpbssd(4, 0, 3);
            }
          }
          if (st >= 1 && st <= g) {
            if ((st - 1) & 1) {
              _tile_stored(5, ctile[1][0], 64);
              _tile_stored(6, ctile[1][1], 64);
            } else {
              _tile_stored(2, ctile[0][0], 64);
              _tile_stored(4, ctile[0][1], 64);
            }
          }
          if (st >= 2) {
            const int64_t gi = st - 2;
            const __m512 dv[2] = {half16(dm[0] + gi * kCols), half16(dm[1] + gi * kCols)};
            for (int64_t i = 0, mr = std::min<int64_t>(16, rows - r0); i < mr; ++i) {
              const int64_t r = r0 + i;
              const __m512 d = _mm512_set1_ps(qr.dx[r * g + gi]);
              for (int j = 0; j < 2; ++j)
                acc[2 * r + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ctile[gi & 1][j] + 16 * i)),
                                                 _mm512_mul_ps(dv[j], d), acc[2 * r + j]);
            }
          }
        }
      }
      store_rows(acc, rows, yp, n, t);
    }
    _tile_release();
  });
}
#endif

// int8 weights (Q8_0) times int8 rows (each row quantized per group of 32 as for int4), for the
// LM head and drafters. The bf16 path expands every code to bf16 on each call and is bound by
// that, not by memory, up to the whole head at one row; here the codes go to the units as they
// are. Either way a group's sum is an exact int32, so VNNI and AMX rows get the same bits.
// Layout as widen()'s output: (column tile, group) = 8 vectors, vector q holding k = 4q .. 4q + 3
// of the 16 columns, which is also AMX-INT8's B tile. VNNI multiplies unsigned by signed
// bytes, so rows go in as xq + 128 and each group's sum loses 128 * (the column's code sum), wsum.
// kSplit (pack8's k-quant form: GGUF's Q6_K, Q5_K, Q4_K in int8 codes): the two halves of a group
// (vectors 0-3 and 4-7) are summed apart and take their own scales, then the group's offset
// m * (dx * sum xq), as the int4 kernel's: acc += S_lo * (d_lo * dx); acc += S_hi * (d_hi * dx);
// acc += m * cx. Always on VNNI (amx_tiles.h says why).
template <bool kSplit>
void mm_q8_rows(const at::Tensor& x, int64_t rows, const uint8_t* wp, const uint16_t* dmp, const int16_t* wsp,
                c10::BFloat16* yp, int64_t n, int64_t pairs) {
  constexpr int64_t kScales = kSplit ? 3 * kCols : kCols, kSums = kSplit ? 2 * kCols : kCols;
  const int64_t k = x.size(1), g = k / kGroup, tile_bytes = 2 * kTileBytes;
  const bool vnni = kSplit || rows <= kVnniRows;  // the split form: VNNI at any row count (amx_tiles.h)
  const QuantizedRows qr = quantize_batch(x, rows, vnni);
#ifdef DSPARK_AMX
  if (!vnni) return mm_q8_tiles(qr, rows, k, wp, dmp, yp, n, pairs);
#endif
  const int8_t* xqp = qr.xq;
  const float *dxp = qr.dx, *cxp = qr.cx;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    std::vector<__m512> acc(rows * 2);
    __m512i w[2][8];
    for (int64_t pr = p0; pr < p1; ++pr) {
      const int64_t t = 2 * pr;
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      const uint8_t* wt[2] = {wp + t * g * tile_bytes, wp + (t + 1) * g * tile_bytes};
      const uint16_t* dm[2] = {dmp + t * g * kScales, dmp + (t + 1) * g * kScales};
      const int16_t* ws[2] = {wsp + t * g * kSums, wsp + (t + 1) * g * kSums};
      for (int64_t gi = 0; gi < g; ++gi) {
        prefetch(wt[0] + (gi + kAhead) * tile_bytes, tile_bytes);
        prefetch(wt[1] + (gi + kAhead) * tile_bytes, tile_bytes);
        __m512 dv[2], dh[2], mv[2];  // scales (of inputs 0-15), of inputs 16-31 and offsets: kSplit
        for (int j = 0; j < 2; ++j) {
          dv[j] = half16(dm[j] + gi * kScales);
          if (kSplit) {
            dh[j] = half16(dm[j] + gi * kScales + kCols);
            mv[j] = half16(dm[j] + gi * kScales + 2 * kCols);
          }
        }
        // one row's exact half-group sums (or the group's, in lo) into its 16 outputs of tile j
        auto combine = [&](int64_t r, int j, __m512i lo, __m512i hi) {
          const float dx = dxp[r * g + gi];
          const __m512 d = _mm512_set1_ps(dx);
          __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(dv[j], d), acc[2 * r + j]);
          if (kSplit) {
            a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(dh[j], d), a);
            a = _mm512_fmadd_ps(mv[j], _mm512_set1_ps(cxp[r * g + gi]), a);
          }
          acc[2 * r + j] = a;
        };
        __m512i off[2][2];
        for (int j = 0; j < 2; ++j) {
          for (int q = 0; q < 8; ++q) w[j][q] = _mm512_loadu_si512(wt[j] + gi * tile_bytes + 64 * q);
          for (int h = 0; h < (kSplit ? 2 : 1); ++h)
            off[j][h] = _mm512_slli_epi32(
                _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ws[j] + gi * kSums + h * kCols))), 7);
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int8_t* xr = xqp + r * k + gi * kGroup;
          __m512i s[2][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()},
                             {_mm512_setzero_si512(), _mm512_setzero_si512()}};
          for (int q = 0; q < 8; ++q) {  // two chains per column tile: even and odd quads, or the halves
            uint32_t quad;
            std::memcpy(&quad, xr + 4 * q, 4);
            const __m512i xv = _mm512_set1_epi32(static_cast<int32_t>(quad ^ 0x80808080u));  // xq + 128
            const int c = kSplit ? q / 4 : q & 1;
            s[0][c] = _mm512_dpbusd_epi32(s[0][c], xv, w[0][q]);
            s[1][c] = _mm512_dpbusd_epi32(s[1][c], xv, w[1][q]);
          }
          for (int j = 0; j < 2; ++j) {
            if (kSplit) {
              combine(r, j, _mm512_sub_epi32(s[j][0], off[j][0]), _mm512_sub_epi32(s[j][1], off[j][1]));
            } else {
              combine(r, j, _mm512_sub_epi32(_mm512_add_epi32(s[j][0], s[j][1]), off[j][0]), s[j][1]);
            }
          }
        }
      }
      store_rows(acc, rows, yp, n, t);
    }
  });
}

// y [M, N] bf16 = x [M, K] bf16 (quantized to int8 per row and group of 32) @ w.T, w from pack8().
at::Tensor mm8(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& dm, const at::Tensor& wsum) {
  const MatmulShape s = check_mm8(x_in, at::kBFloat16, packed, dm, wsum);
  const int64_t rows = s.rows, n = s.n, pairs = packed.size(0) / 2;
  auto y = at::empty({rows, n}, x_in.options());
  if (rows == 0) return y;
  const at::Tensor x = x_in.contiguous();
  const auto* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const auto* dmp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  if (s.split) {
    mm_q8_rows<true>(x, rows, wp, dmp, wsum.data_ptr<int16_t>(), y.data_ptr<c10::BFloat16>(), n, pairs);
  } else {
    mm_q8_rows<false>(x, rows, wp, dmp, wsum.data_ptr<int16_t>(), y.data_ptr<c10::BFloat16>(), n, pairs);
  }
  return y;
}

}  // namespace dspark::amx
