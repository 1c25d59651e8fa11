// Weight-only int4 and int8 matmul on Intel AMX tiles, for decode and verification rows (int4: the
// decoder layers and drafters; int8: the LM head, as a GGUF's Q8_0 blocks, with int8 rows in
// quant_q8_rows.cpp or bf16 rows in mm_int8 here; shared pieces in amx_tiles.h). Built without
// DSPARK_AMX, for a CPU with AVX512-VNNI and AVX512-BF16 but no tiles, every row count takes the
// VNNI path below (and mm_int8 AVX512-BF16's pair dot product).
//
// Why: torch's int4 CPU kernel works through the weights once per block of 4 rows, so verifying a
// block of draft tokens costs several decode steps. AMX multiplies a 16-row tile for about the
// price of one row, so here a pass over the weights costs nearly the same for 1 and 16 rows.
//
// int4 (as llama.cpp runs a Q4_1 file): each row's inputs are quantized to int8 per group of 32
// (scale dx = max|x| / 127, codes xq = round(x / dx)), and per group the integer dot product
// S = sum xq * q is exact in int32, whichever instructions compute it: AVX512-VNNI for a few rows
// (a decode step; codes widened by a mask and a shift, nothing stored), AMX-INT8 tiles for more.
// Each output then takes acc += S * (d * dx); acc += m * (dx * sum xq) over groups in order, with
// w = d * q + m (fp16 d, m), so a row's result is the same bits in any batch and either path.
//
// int8 with bf16 rows (mm_int8): codes in [-128, 127] are exact in bf16 and x * q is exact in fp32,
// so per group the bf16 tile multiply gives sum x*q accumulated in fp32 in the hardware's fixed
// pair order; each output takes acc += d * S over groups in order.
//
// A row's result depends on its own inputs only; threads split output columns, never a sum.

#include "amx_tiles.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace dspark::amx {

// 512 int8 codes, one tile row (32 codes in pair order) per 32 bytes -> bf16 through fp32 (exact
// for |q| <= 256).
inline void expand8(const int8_t* src, uint16_t* dst) {
  for (int r = 0; r < 16; ++r) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32 * r))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32 * r + 16))));
    _mm512_store_si512(dst + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// One group's exact dot products into a row's 16 outputs: acc += S * (d * dx); acc += m * (dx * sum xq).
inline __m512 combine(__m512 acc, __m512i dot, __m512 d, __m512 m, float dx, float cx) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc);
  return _mm512_fmadd_ps(m, _mm512_set1_ps(cx), acc);
}

// int4 weights, int8 activations (see the header). Column tiles go in pairs: two independent
// chains per group keep the units busy.
void mm_int4(const at::Tensor& x, int64_t rows, const uint8_t* wp, const void* scales, Int4Form form,
             c10::BFloat16* yp, int64_t n, int64_t pairs) {
  const int64_t k = x.size(1), g = k / kGroup;
  const bool vnni = rows <= kVnniRowsInt4;
  const QuantizedRows qr = quantize_batch(x, rows, vnni);
  const int8_t* xqp = qr.xq;
  const float *dxp = qr.dx, *cxp = qr.cx;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    std::vector<__m512> acc(rows * 2);
    __m512i w[2][8];
#ifdef DSPARK_AMX
    if (!vnni) configure(static_cast<int>(std::min<int64_t>(rows, 16)), kGroup, 8);
#endif
    for (int64_t pr = p0; pr < p1; ++pr) {
      const int64_t t = 2 * pr;
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      const uint8_t* wt[2] = {wp + t * g * kTileBytes, wp + (t + 1) * g * kTileBytes};
      for (int64_t gi = 0; gi < g; ++gi) {
        prefetch(wt[0] + (gi + kAhead) * kTileBytes, kTileBytes);  // memory-bound at one row
        prefetch(wt[1] + (gi + kAhead) * kTileBytes, kTileBytes);
        __m512 dv[2], mv[2];
        for (int j = 0; j < 2; ++j) {
          widen(wt[j] + gi * kTileBytes, w[j]);
          int4_scales(scales, form, t + j, g, gi, dv[j], mv[j]);
        }
        if (vnni) {
          for (int64_t r = 0; r < rows; ++r) {
            const int8_t* xr = xqp + r * k + gi * kGroup;
            __m512i s[2][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()},
                               {_mm512_setzero_si512(), _mm512_setzero_si512()}};
            for (int q = 0; q < 8; ++q) {  // two chains per column tile: even and odd quads
              int32_t quad;
              std::memcpy(&quad, xr + 4 * q, 4);
              const __m512i xv = _mm512_set1_epi32(quad);
              s[0][q & 1] = _mm512_dpbusd_epi32(s[0][q & 1], w[0][q], xv);
              s[1][q & 1] = _mm512_dpbusd_epi32(s[1][q & 1], w[1][q], xv);
            }
            const float d = dxp[r * g + gi], c = cxp[r * g + gi];
            for (int j = 0; j < 2; ++j)
              acc[2 * r + j] = combine(acc[2 * r + j], _mm512_add_epi32(s[j][0], s[j][1]), dv[j], mv[j], d, c);
          }
          continue;
        }
#ifdef DSPARK_AMX
        alignas(64) uint8_t btile[2][8 * 64];
        alignas(64) int32_t ctile[2][16 * 16];
        for (int j = 0; j < 2; ++j)
          for (int q = 0; q < 8; ++q) _mm512_store_si512(btile[j] + 64 * q, w[j][q]);
        _tile_loadd(1, btile[0], 64);
        _tile_loadd(3, btile[1], 64);
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
          _tile_loadd(0, xqp + r0 * k + gi * kGroup, k);
          _tile_zero(2);
          _tile_zero(4);
          _tile_dpbsud(2, 0, 1);  // signed activations x unsigned codes
          _tile_dpbsud(4, 0, 3);
          _tile_stored(2, ctile[0], 64);
          _tile_stored(4, ctile[1], 64);
          const int64_t mr = std::min<int64_t>(16, rows - r0);
          for (int64_t i = 0; i < mr; ++i) {
            const int64_t r = r0 + i;
            const float d = dxp[r * g + gi], c = cxp[r * g + gi];
            for (int j = 0; j < 2; ++j)
              acc[2 * r + j] = combine(acc[2 * r + j], _mm512_load_si512(ctile[j] + 16 * i), dv[j], mv[j], d, c);
          }
        }
#endif
      }
      store_rows(acc, rows, yp, n, t);
    }
#ifdef DSPARK_AMX
    if (!vnni) _tile_release();
#endif
  });
}

// int8 weights (Q8_0), bf16 activations (see the header). Without tiles, AVX512-BF16's pair dot
// product takes a group's 16 tile rows in order per output, one row at a time.
void mm_int8(const at::Tensor& x_in, int64_t rows, const uint8_t* wp, const uint16_t* dmp, c10::BFloat16* yp,
             int64_t n, int64_t pairs) {
  const int64_t k = x_in.size(1), g = k / kGroup, tile_bytes = 2 * kTileBytes;
  at::Tensor x = x_in;
#ifdef DSPARK_AMX
  // more than one tile of rows: pad to whole tiles (zero rows cost the tile unit nothing per row)
  const int tile_rows = static_cast<int>(std::min<int64_t>(rows, 16));
  const int64_t padded = rows <= 16 ? rows : (rows + 15) / 16 * 16;
  if (padded != rows) x = at::cat({x, at::zeros({padded - rows, k}, x.options())});
#endif
  const auto* xp = x.data_ptr<c10::BFloat16>();
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) uint16_t btile[2][16 * 32];
    std::vector<__m512> acc(rows * 2);
#ifdef DSPARK_AMX
    alignas(64) float ctile[2][16 * 16];
    configure(tile_rows, 64, 16);
#endif
    for (int64_t pr = p0; pr < p1; ++pr) {
      const int64_t t = 2 * pr;
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      const uint8_t* wt[2] = {wp + t * g * tile_bytes, wp + (t + 1) * g * tile_bytes};
      const uint16_t* dm[2] = {dmp + t * g * kCols, dmp + (t + 1) * g * kCols};
      for (int64_t gi = 0; gi < g; ++gi) {
        prefetch(wt[0] + (gi + kAhead) * tile_bytes, tile_bytes);
        prefetch(wt[1] + (gi + kAhead) * tile_bytes, tile_bytes);
        expand8(reinterpret_cast<const int8_t*>(wt[0] + gi * tile_bytes), btile[0]);
        expand8(reinterpret_cast<const int8_t*>(wt[1] + gi * tile_bytes), btile[1]);
        const __m512 dv[2] = {half16(dm[0] + gi * kCols), half16(dm[1] + gi * kCols)};
#ifdef DSPARK_AMX
        _tile_loadd(1, btile[0], 64);
        _tile_loadd(3, btile[1], 64);
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
          _tile_loadd(0, xp + r0 * k + gi * kGroup, k * 2);
          _tile_zero(2);
          _tile_zero(4);
          _tile_dpbf16ps(2, 0, 1);
          _tile_dpbf16ps(4, 0, 3);
          _tile_stored(2, ctile[0], 64);
          _tile_stored(4, ctile[1], 64);
          const int64_t mr = std::min<int64_t>(16, rows - r0);
          for (int64_t i = 0; i < mr; ++i)
            for (int j = 0; j < 2; ++j)
              acc[2 * (r0 + i) + j] = _mm512_fmadd_ps(dv[j], _mm512_load_ps(ctile[j] + 16 * i), acc[2 * (r0 + i) + j]);
        }
#else
        for (int64_t r = 0; r < rows; ++r) {
          const c10::BFloat16* xr = xp + r * k + gi * kGroup;
          for (int j = 0; j < 2; ++j) {
            __m512 sum = _mm512_setzero_ps();
            for (int q = 0; q < 16; ++q) {  // tile row q: inputs 2q, 2q + 1 of the 16 columns
              int32_t pair;
              std::memcpy(&pair, xr + 2 * q, 4);
              sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_set1_epi32(pair),
                                     (__m512bh)_mm512_load_si512(btile[j] + 32 * q));
            }
            acc[2 * r + j] = _mm512_fmadd_ps(dv[j], sum, acc[2 * r + j]);
          }
        }
#endif
      }
      store_rows(acc, rows, yp, n, t);
    }
#ifdef DSPARK_AMX
    _tile_release();
#endif
  });
}

// Ask Linux for the AMX register state (once per process; threads inherit it). False if refused.
bool enable() {
#ifdef DSPARK_AMX
  constexpr long kReqPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
#else
  return true;  // no tiles, nothing to ask for
#endif
}

// y [M, N] bf16 = x [M, K] bf16 @ w.T, w from pack(); or, given pack8()'s code sums (not
// empty), from pack8() with the rows quantized to int8 (mm8).
at::Tensor mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& dm,
              const std::optional<at::Tensor>& sums) {
  if (sums.has_value() && sums->numel() > 0) return mm8(x_in, packed, dm, *sums);
  const MatmulShape s = check_mm(x_in, at::kBFloat16, packed, dm);
  const int64_t rows = s.rows, n = s.n, pairs = packed.size(0) / 2;
  auto y = at::empty({rows, n}, x_in.options());
  if (rows == 0) return y;
  const at::Tensor x = x_in.contiguous();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  auto* yp = y.data_ptr<c10::BFloat16>();
  if (s.bytes) {
    mm_int8(x, rows, wp, reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>()), yp, n, pairs);
  } else {
    mm_int4(x, rows, wp, dm.data_ptr(), s.form, yp, n, pairs);
  }
  return y;
}

}  // namespace dspark::amx
