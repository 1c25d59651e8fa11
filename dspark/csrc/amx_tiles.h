// The pieces the AMX/VNNI weight-only kernels share (quant_amx.cpp: int4 and int8 with bf16 rows;
// quant_q8_rows.cpp: int8 with int8 rows): tile shapes and configuration, row quantization,
// loads and stores. Built with DSPARK_AMX (a CPU with AMX tiles), many rows go to the tiles; built
// without it (AVX512-VNNI and AVX512-BF16 only, as on AMD Zen 4), every row count takes the VNNI
// path, whose integer sums are the same exact int32 values, so a row gets the same bits either way.
#pragma once

#include "quant_layout.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace dspark::amx {
// Up to this many rows a product takes VNNI, past it AMX-INT8 (measured on Sapphire Rapids: per
// extra row, the tiles' per-group store and combine cost more than VNNI's dot products until about
// 4 rows for int8 codes (the LM head and Q8_0 layers: 10-15% less at 6-8 rows on tiles) and 16
// for int4 ones, whose codes VNNI widens once for every row; the k-quant form's two half-group
// sums never pay on tiles). Either way a row gets the same bits.
#ifdef DSPARK_AMX
constexpr int64_t kVnniRows = 4;
constexpr int64_t kVnniRowsInt4 = 16;
#else
constexpr int64_t kVnniRows = INT64_MAX;  // no tiles: VNNI for every row count
constexpr int64_t kVnniRowsInt4 = INT64_MAX;
#endif

#ifdef DSPARK_AMX
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile 0: A (rows x a_bytes); tiles 1 and 3: B of two column tiles (b_rows x 64 bytes); tiles 2
// and 4: their C (rows x 16 fp32 or int32).
inline void configure(int rows, int a_bytes, int b_rows) {
  TileConfig cfg;
  cfg.colsb[0] = a_bytes; cfg.rows[0] = rows;
  cfg.colsb[1] = 64; cfg.rows[1] = b_rows;
  cfg.colsb[2] = 64; cfg.rows[2] = rows;
  cfg.colsb[3] = 64; cfg.rows[3] = b_rows;
  cfg.colsb[4] = 64; cfg.rows[4] = rows;
  cfg.colsb[5] = 64; cfg.rows[5] = rows;  // tiles 5 and 6: a second C pair, for pipelined groups
  cfg.colsb[6] = 64; cfg.rows[6] = rows;
  // GCC does not count ldtilecfg as reading cfg, and drops the stores above once configure is
  // compiled on its own; the barrier keeps them
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

#endif

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// fp32 -> fp16 -> fp32: the rounding a stored fp16 value has (to nearest, ties to even).
inline __m512 round_half(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// One (column tile t, group gi)'s int4 scales d and offsets m for its 16 columns, in any of
// quant_layout.h's forms (scales: the tensor pack() or pack_q4k() returned; g groups per row).
// kSym's m = -8 d and kSub's products are exact in fp32, so each form gives the values a stored
// fp16 d and m would.
inline void int4_scales(const void* scales, Int4Form form, int64_t t, int64_t g, int64_t gi, __m512& d, __m512& m) {
  const Int4ScalesAt at = int4_scales_at(scales, form, t, g, gi);
  if (form == Int4Form::kSub) {
    auto bytes = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    d = round_half(_mm512_mul_ps(half16(at.half), bytes(at.sc)));
    m = _mm512_xor_ps(round_half(_mm512_mul_ps(half16(at.half + kCols), bytes(at.sc + kSubGroups * kCols))),
                      _mm512_set1_ps(-0.0f));  // -fp16(dmin * mn), signed zero included
    return;
  }
  d = half16(at.half);
  m = form == Int4Form::kSym ? _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)) : half16(at.half + kCols);
}

// 256 packed bytes of one (column tile, group) -> 8 vectors of unsigned codes, vector j holding
// k = 4j .. 4j + 3 of each of the 16 columns (VNNI's layout, and AMX-INT8's B tile row j). Byte
// 64c + 4 * column + b keeps k = 8c + b in its low nibble and k = 8c + 4 + b in its high one.
inline void widen(const uint8_t* src, __m512i* w) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m512i b = _mm512_loadu_si512(src + 64 * c);
    w[2 * c] = _mm512_and_si512(b, low);
    w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
  }
}

inline __m512 load_bf16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Rows of x -> int8 codes per group of 32 (xq [padded rows, K], zero past `rows`), each group's
// scale dx and dx * sum of its codes.
inline void quantize_rows(const c10::BFloat16* x, int64_t rows, int64_t k, int8_t* xq, float* dx, float* cx) {
  const int64_t g = k / kGroup;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t gi = 0; gi < g; ++gi) {
      const auto* p = x + r * k + gi * kGroup;
      const __m512 a = load_bf16(p), b = load_bf16(p + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));  // to nearest, ties to even
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * k + gi * kGroup), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + r * k + gi * kGroup + 16), _mm512_cvtsepi32_epi8(qb));
      const float d = amax / 127.0f;
      dx[r * g + gi] = d;
      cx[r * g + gi] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
    }
}

inline void store_rows(const std::vector<__m512>& acc, int64_t rows, c10::BFloat16* y, int64_t n, int64_t t) {
  for (int64_t i = 0; i < rows; ++i)
    for (int j = 0; j < 2; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * n + (t + j) * kCols),
                          (__m256i)_mm512_cvtneps_pbh(acc[2 * i + j]));
}

// A batch's rows as int8 codes (padded with zero rows to whole tiles past kVnniRows rows) and
// each group's dx and dx * sum of codes, in the calling thread's scratch, reused across calls:
// three tensor allocations per linear cost as much as a small layer's arithmetic at one row.
inline QuantizedRows quantize_batch(const at::Tensor& x, int64_t rows, bool vnni) {
  const int64_t k = x.size(1), g = k / kGroup;
  const int64_t padded = vnni || rows <= 16 ? rows : (rows + 15) / 16 * 16;
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> scale_buf;
  xq_buf.resize(padded * k);
  scale_buf.resize(2 * rows * g);
  int8_t* xqp = xq_buf.data();
  float* dxp = scale_buf.data();
  float* cxp = dxp + rows * g;
  std::memset(xqp + rows * k, 0, (padded - rows) * k);  // padding rows multiply as zeros
  const auto* xp = x.data_ptr<c10::BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    quantize_rows(xp + r0 * k, r1 - r0, k, xqp + r0 * k, dxp + r0 * g, cxp + r0 * g);
  });
  return {xqp, dxp, cxp};
}

}  // namespace dspark::amx
