// Weight-only int4 and int8 matmuls for CPUs with AVX2 but without AVX512-VNNI and AVX512-BF16
// (AMD Zen 2/3, Intel Haswell to Ice Lake), float32 rows in and out: the same packed weights
// (quant_pack.cpp), argument checks and entry points as quant_amx.cpp and quant_q8_rows.cpp, so
// the decoder stack and the Python linears run unchanged on them.
//
// Why: such a CPU has no fast bf16, so the model runs in float32, and a dense float32 decoder
// reads ~6x the bytes of the GGUF's own Q4 blocks per token; a batch-1 step is bound by exactly
// those bytes.
//
// As llama.cpp runs a Q4_1 / Q8_0 product, each row is quantized to int8 per group of 32 (dx =
// max|x| / 127, xq = round(x / dx), ties to even) and per group the integer dot product S is exact:
// int4 codes (0..15) times xq through _mm256_maddubs_epi16 (pairs of at most 2 * 15 * 127, eight
// of them summed in int16 stay below 2^15) and _mm256_madd_epi16; int8 codes w through
// maddubs(|w|, sign(xq, w)), |w| read unsigned (so -128 is 128), pairs below 2 * 128 * 127. Each
// output then takes acc += S * (d * dx) (int4: acc += m * (dx * sum xq)) over groups in order, so a
// row's result is the same bits alone or in any batch. Threads split column tiles, never a sum.

#include "cpu_vec.h"
#include "ops.h"
#include "quant_layout.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace dspark::amx {

namespace {

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// Rows of x -> int8 codes per group of 32 (xq [rows, K]), each group's dx and dx * sum of codes.
void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* xq, float* dx, float* cx) {
  const int64_t g = k / kGroup;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' lane interleave
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t gi = 0; gi < g; ++gi) {
      const float* p = x + r * k + gi * kGroup;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(p + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      }
      const float a = cpu::hmax8(amax);
      const __m256 inv = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // to nearest, ties to even
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * k + gi * kGroup), bytes);
      const float d = a / 127.0f;
      dx[r * g + gi] = d;
      cx[r * g + gi] = d * static_cast<float>(hsum(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                                                     _mm256_add_epi32(q[2], q[3]))));
    }
}

// In the calling thread's scratch, reused across calls (allocations cost as much as a small
// layer's arithmetic at one row).
QuantizedRows quantize_batch(const float* x, int64_t rows, int64_t k) {
  const int64_t g = k / kGroup;
  thread_local std::vector<int8_t> xq_buf;
  thread_local std::vector<float> scale_buf;
  xq_buf.resize(rows * k);
  scale_buf.resize(2 * rows * g);
  int8_t* xq = xq_buf.data();
  float *dx = scale_buf.data(), *cx = dx + rows * g;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    quantize_rows(x + r0 * k, r1 - r0, k, xq + r0 * k, dx + r0 * g, cx + r0 * g);
  });
  return {xq, dx, cx};
}

inline __m256 half8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m256 round_half8(__m256 v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// amx_tiles.h's int4_scales for half h (columns 8h .. 8h + 7) of column tile t, group gi.
inline void int4_scales8(const void* scales, Int4Form form, int64_t t, int64_t g, int64_t gi, int h, __m256& d,
                         __m256& m) {
  const Int4ScalesAt at = int4_scales_at(scales, form, t, g, gi);
  const uint16_t* p = at.half + 8 * h;
  if (form == Int4Form::kSub) {
    auto bytes = [](const uint8_t* q) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
    };
    const uint8_t* sc = at.sc + 8 * h;
    d = round_half8(_mm256_mul_ps(half8(p), bytes(sc)));
    m = _mm256_xor_ps(round_half8(_mm256_mul_ps(half8(p + kCols), bytes(sc + kSubGroups * kCols))),
                      _mm256_set1_ps(-0.0f));
    return;
  }
  d = half8(p);
  m = form == Int4Form::kSym ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)) : half8(p + kCols);
}

// A column tile's accumulators (two halves of 8 outputs per row) into y [rows, n] at tile t.
inline void store_rows(const std::vector<__m256>& acc, int64_t rows, float* y, int64_t n, int64_t t) {
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + r * n + t * kCols + 8 * h, acc[2 * r + h]);
}

inline __m256i quad(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// int4 codes: half h (columns 8h .. 8h + 7) of one (column tile, group) of 256 bytes -> w[j], k =
// 4j .. 4j + 3 of each of those columns (widen() in quant_amx.cpp, by halves: AVX2 has 16
// registers, and a whole tile's codes would take them all).
inline void widen_half(const uint8_t* src, int h, __m256i w[8]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64 * c + 32 * h));
    w[2 * c] = _mm256_and_si256(b, low);
    w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
  }
}

void mm_int4(const float* xp, int64_t rows, int64_t k, const uint8_t* wp, const void* scales, Int4Form form, float* yp,
             int64_t n) {
  const int64_t g = k / kGroup, tiles = n / kCols;
  const QuantizedRows qr = quantize_batch(xp, rows, k);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<__m256> acc(rows * 2);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i w[8];
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
      const uint8_t* wt = wp + t * g * kTileBytes;
      for (int64_t gi = 0; gi < g; ++gi) {
        prefetch(wt + (gi + kAhead) * kTileBytes, kTileBytes);
        for (int h = 0; h < 2; ++h) {
          widen_half(wt + gi * kTileBytes, h, w);
          __m256 dv, mv;
          int4_scales8(scales, form, t, g, gi, h, dv, mv);
          for (int64_t r = 0; r < rows; ++r) {
            const int8_t* xr = qr.xq + r * k + gi * kGroup;
            __m256i s0 = _mm256_maddubs_epi16(w[0], quad(xr)), s1 = _mm256_maddubs_epi16(w[1], quad(xr + 4));
            for (int j = 2; j < 8; j += 2) {  // two int16 chains, each at most 4 pairs
              s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(w[j], quad(xr + 4 * j)));
              s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(w[j + 1], quad(xr + 4 * j + 4)));
            }
            // the two chains' eight pairs still fit int16 (see the top), so one widening serves both
            const __m256i dot = _mm256_madd_epi16(_mm256_add_epi16(s0, s1), ones);
            const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dv, _mm256_set1_ps(qr.dx[r * g + gi])),
                                             acc[2 * r + h]);
            acc[2 * r + h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(qr.cx[r * g + gi]), a);
          }
        }
      }
      store_rows(acc, rows, yp, n, t);
    }
  });
}

// kSplit: pack8's k-quant form, halves of a group summed apart with their own scales, then the
// group's offset (the order quant_q8_rows.cpp gives).
template <bool kSplit>
void mm_q8_rows(const float* xp, int64_t rows, int64_t k, const uint8_t* wp, const uint16_t* dmp, float* yp,
                int64_t n) {
  constexpr int64_t kScales = kSplit ? 3 * kCols : kCols;
  const int64_t g = k / kGroup, tiles = n / kCols, tile_bytes = 2 * kTileBytes;
  const QuantizedRows qr = quantize_batch(xp, rows, k);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<__m256> acc(rows * 2);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), _mm256_setzero_ps());
      const uint8_t* wt = wp + t * g * tile_bytes;
      const uint16_t* dm = dmp + t * g * kScales;
      for (int64_t gi = 0; gi < g; ++gi) {
        const uint8_t* wg = wt + gi * tile_bytes;
        prefetch(wt + (gi + kAhead) * tile_bytes, tile_bytes);
        for (int h = 0; h < 2; ++h) {
          const uint16_t* sc = dm + gi * kScales + 8 * h;
          const __m256 dv = half8(sc);
          for (int64_t r = 0; r < rows; ++r) {
            const int8_t* xr = qr.xq + r * k + gi * kGroup;
            __m256i s[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int j = 0; j < 8; ++j) {  // the codes come from L1 each row: 16 registers hold no more
              const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64 * j + 32 * h));
              const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(quad(xr + 4 * j), w));
              const int c = kSplit ? j / 4 : 0;
              s[c] = _mm256_add_epi32(s[c], _mm256_madd_epi16(p, ones));
            }
            const __m256 d = _mm256_set1_ps(qr.dx[r * g + gi]);
            __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[0]), _mm256_mul_ps(dv, d), acc[2 * r + h]);
            if (kSplit) {
              a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[1]), _mm256_mul_ps(half8(sc + kCols), d), a);
              a = _mm256_fmadd_ps(half8(sc + 2 * kCols), _mm256_set1_ps(qr.cx[r * g + gi]), a);
            }
            acc[2 * r + h] = a;
          }
        }
      }
      store_rows(acc, rows, yp, n, t);
    }
  });
}

}  // namespace

bool enable() { return true; }  // no tiles, nothing to ask for

// y [M, N] float32 = x [M, K] float32 @ w.T, w from pack() (int4), or from pack8() given its code
// sums (int8: mm8). int8 weights from pack() (bf16 rows) have no path in this build.
at::Tensor mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& dm,
              const std::optional<at::Tensor>& sums) {
  if (sums.has_value() && sums->numel() > 0) return mm8(x_in, packed, dm, *sums);
  const MatmulShape s = check_mm(x_in, at::kFloat, packed, dm);
  TORCH_CHECK(!s.bytes, "mm: int8 weights take pack8 and its code sums in this build");
  auto y = at::empty({s.rows, s.n}, x_in.options());
  if (s.rows == 0) return y;
  const at::Tensor x = x_in.contiguous();
  mm_int4(x.data_ptr<float>(), s.rows, s.k, reinterpret_cast<const uint8_t*>(packed.data_ptr()),
          dm.data_ptr(), s.form, y.data_ptr<float>(), s.n);
  return y;
}

// y [M, N] float32 = x [M, K] float32 (quantized to int8 per row and group of 32) @ w.T, w from
// pack8() (its code sums are checked, not needed: the sign trick takes signed codes as they are).
at::Tensor mm8(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& dm, const at::Tensor& wsum) {
  const MatmulShape s = check_mm8(x_in, at::kFloat, packed, dm, wsum);
  auto y = at::empty({s.rows, s.n}, x_in.options());
  if (s.rows == 0) return y;
  const at::Tensor x = x_in.contiguous();
  const auto* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const auto* dmp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  if (s.split) {
    mm_q8_rows<true>(x.data_ptr<float>(), s.rows, s.k, wp, dmp, y.data_ptr<float>(), s.n);
  } else {
    mm_q8_rows<false>(x.data_ptr<float>(), s.rows, s.k, wp, dmp, y.data_ptr<float>(), s.n);
  }
  return y;
}

}  // namespace dspark::amx
