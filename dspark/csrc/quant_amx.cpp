// Weight-only int4 and int8 matmul on Intel AMX tiles, for decode and verification rows (int4: the
// decoder layers; int8: the LM head and drafters, as a GGUF's Q8_0 blocks, with int8 rows in
// mm_q8_rows or bf16 rows in mm_int8).
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

constexpr int kGroup = 32;   // inputs per quantization group = one tile's K (32 bf16)
constexpr int kCols = 16;    // output columns per tile
constexpr int kTileBytes = kCols * kGroup / 2;  // packed nibbles of one (column tile, group)
constexpr int kAhead = 8;  // groups of weights prefetched ahead
constexpr int kVnniRows = 8;  // up to this many rows the int4 path takes VNNI, past it AMX-INT8

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile 0: A (rows x a_bytes); tiles 1 and 3: B of two column tiles (b_rows x 64 bytes); tiles 2
// and 4: their C (rows x 16 fp32 or int32).
void configure(int rows, int a_bytes, int b_rows) {
  TileConfig cfg;
  cfg.colsb[0] = a_bytes; cfg.rows[0] = rows;
  cfg.colsb[1] = 64; cfg.rows[1] = b_rows;
  cfg.colsb[2] = 64; cfg.rows[2] = rows;
  cfg.colsb[3] = 64; cfg.rows[3] = b_rows;
  cfg.colsb[4] = 64; cfg.rows[4] = rows;
  // GCC does not count ldtilecfg as reading cfg, and drops the stores above once configure is
  // compiled on its own; the barrier keeps them
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
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

// 512 int8 codes, one tile row (32 codes in pair order) per 32 bytes -> bf16 through fp32 (exact
// for |q| <= 256).
inline void expand8(const int8_t* src, uint16_t* dst) {
  for (int r = 0; r < 16; ++r) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32 * r))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32 * r + 16))));
    _mm512_store_si512(dst + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

inline __m512 half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512 load_bf16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One group's exact dot products into a row's 16 outputs: acc += S * (d * dx); acc += m * (dx * sum xq).
inline __m512 combine(__m512 acc, __m512i dot, __m512 d, __m512 m, float dx, float cx) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc);
  return _mm512_fmadd_ps(m, _mm512_set1_ps(cx), acc);
}

// Rows of x -> int8 codes per group of 32 (xq [padded rows, K], zero past `rows`), each group's
// scale dx and dx * sum of its codes.
void quantize_rows(const c10::BFloat16* x, int64_t rows, int64_t k, int8_t* xq, float* dx, float* cx) {
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

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
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
struct QuantizedRows {
  const int8_t* xq;
  const float* dx;
  const float* cx;
};

QuantizedRows quantize_batch(const at::Tensor& x, int64_t rows, bool vnni) {
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

// int4 weights, int8 activations (see the header). Column tiles go in pairs: two independent
// chains per group keep the units busy.
void mm_int4(const at::Tensor& x, int64_t rows, const uint8_t* wp, const uint16_t* dmp, c10::BFloat16* yp,
             int64_t n, int64_t pairs) {
  const int64_t k = x.size(1), g = k / kGroup, scales = 2 * kCols;
  const bool vnni = rows <= kVnniRows;
  const QuantizedRows qr = quantize_batch(x, rows, vnni);
  const int8_t* xqp = qr.xq;
  const float *dxp = qr.dx, *cxp = qr.cx;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) uint8_t btile[2][8 * 64];
    alignas(64) int32_t ctile[2][16 * 16];
    std::vector<__m512> acc(rows * 2);
    __m512i w[2][8];
    if (!vnni) configure(static_cast<int>(std::min<int64_t>(rows, 16)), kGroup, 8);
    for (int64_t pr = p0; pr < p1; ++pr) {
      const int64_t t = 2 * pr;
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      const uint8_t* wt[2] = {wp + t * g * kTileBytes, wp + (t + 1) * g * kTileBytes};
      const uint16_t* dm[2] = {dmp + t * g * scales, dmp + (t + 1) * g * scales};
      for (int64_t gi = 0; gi < g; ++gi) {
        prefetch(wt[0] + (gi + kAhead) * kTileBytes, kTileBytes);  // memory-bound at one row
        prefetch(wt[1] + (gi + kAhead) * kTileBytes, kTileBytes);
        __m512 dv[2], mv[2];
        for (int j = 0; j < 2; ++j) {
          widen(wt[j] + gi * kTileBytes, w[j]);
          dv[j] = half16(dm[j] + gi * scales);
          mv[j] = half16(dm[j] + gi * scales + kCols);
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
      }
      store_rows(acc, rows, yp, n, t);
    }
    if (!vnni) _tile_release();
  });
}

// int8 weights (Q8_0), bf16 activations (see the header).
void mm_int8(const at::Tensor& x_in, int64_t rows, const uint8_t* wp, const uint16_t* dmp, c10::BFloat16* yp,
             int64_t n, int64_t pairs) {
  const int64_t k = x_in.size(1), g = k / kGroup, tile_bytes = 2 * kTileBytes;
  // more than one tile of rows: pad to whole tiles (zero rows cost the tile unit nothing per row)
  const int tile_rows = static_cast<int>(std::min<int64_t>(rows, 16));
  const int64_t padded = rows <= 16 ? rows : (rows + 15) / 16 * 16;
  at::Tensor x = x_in;
  if (padded != rows) x = at::cat({x, at::zeros({padded - rows, k}, x.options())});
  const auto* xp = x.data_ptr<c10::BFloat16>();
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) uint16_t btile[2][16 * 32];
    alignas(64) float ctile[2][16 * 16];
    std::vector<__m512> acc(rows * 2);
    configure(tile_rows, 64, 16);
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
        _tile_loadd(1, btile[0], 64);
        _tile_loadd(3, btile[1], 64);
        const __m512 dv[2] = {half16(dm[0] + gi * kCols), half16(dm[1] + gi * kCols)};
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
      }
      store_rows(acc, rows, yp, n, t);
    }
    _tile_release();
  });
}

// int8 weights (Q8_0) times int8 rows (each row quantized per group of 32 as for int4), for the
// LM head and drafters. The bf16 path expands every code to bf16 on each call and is bound by
// that, not by memory, up to the whole head at one row; here the codes go to the units as they
// are. Either way a group's sum is an exact int32, so VNNI and AMX rows get the same bits.
// Layout as widen()'s output: (column tile, group) = 8 vectors, vector q holding k = 4q .. 4q + 3
// of the 16 columns, which is also AMX-INT8's B tile. VNNI multiplies unsigned by signed
// bytes, so rows go in as xq + 128 and each group's sum loses 128 * (the column's code sum), wsum.
void mm_q8_rows(const at::Tensor& x, int64_t rows, const uint8_t* wp, const uint16_t* dmp, const int32_t* wsp,
                c10::BFloat16* yp, int64_t n, int64_t pairs) {
  const int64_t k = x.size(1), g = k / kGroup, tile_bytes = 2 * kTileBytes;
  const bool vnni = rows <= kVnniRows;
  const QuantizedRows qr = quantize_batch(x, rows, vnni);
  const int8_t* xqp = qr.xq;
  const float* dxp = qr.dx;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) int32_t ctile[2][16 * 16];
    std::vector<__m512> acc(rows * 2);
    __m512i w[2][8];
    if (!vnni) configure(static_cast<int>(std::min<int64_t>(rows, 16)), kGroup, 8);
    for (int64_t pr = p0; pr < p1; ++pr) {
      const int64_t t = 2 * pr;
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      const uint8_t* wt[2] = {wp + t * g * tile_bytes, wp + (t + 1) * g * tile_bytes};
      const uint16_t* dm[2] = {dmp + t * g * kCols, dmp + (t + 1) * g * kCols};
      const int32_t* ws[2] = {wsp + t * g * kCols, wsp + (t + 1) * g * kCols};
      for (int64_t gi = 0; gi < g; ++gi) {
        prefetch(wt[0] + (gi + kAhead) * tile_bytes, tile_bytes);
        prefetch(wt[1] + (gi + kAhead) * tile_bytes, tile_bytes);
        const __m512 dv[2] = {half16(dm[0] + gi * kCols), half16(dm[1] + gi * kCols)};
        if (vnni) {
          __m512i off[2];
          for (int j = 0; j < 2; ++j) {
            for (int q = 0; q < 8; ++q) w[j][q] = _mm512_loadu_si512(wt[j] + gi * tile_bytes + 64 * q);
            off[j] = _mm512_slli_epi32(_mm512_loadu_si512(ws[j] + gi * kCols), 7);
          }
          for (int64_t r = 0; r < rows; ++r) {
            const int8_t* xr = xqp + r * k + gi * kGroup;
            __m512i s[2][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()},
                               {_mm512_setzero_si512(), _mm512_setzero_si512()}};
            for (int q = 0; q < 8; ++q) {
              uint32_t quad;
              std::memcpy(&quad, xr + 4 * q, 4);
              const __m512i xv = _mm512_set1_epi32(static_cast<int32_t>(quad ^ 0x80808080u));  // xq + 128
              s[0][q & 1] = _mm512_dpbusd_epi32(s[0][q & 1], xv, w[0][q]);
              s[1][q & 1] = _mm512_dpbusd_epi32(s[1][q & 1], xv, w[1][q]);
            }
            const __m512 d = _mm512_set1_ps(dxp[r * g + gi]);
            for (int j = 0; j < 2; ++j) {
              const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(s[j][0], s[j][1]), off[j]);
              acc[2 * r + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv[j], d), acc[2 * r + j]);
            }
          }
          continue;
        }
        _tile_loadd(1, wt[0] + gi * tile_bytes, 64);  // the packed layout is the B tile itself
        _tile_loadd(3, wt[1] + gi * tile_bytes, 64);
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
          _tile_loadd(0, xqp + r0 * k + gi * kGroup, k);
          _tile_zero(2);
          _tile_zero(4);
          _tile_dpbssd(2, 0, 1);
          _tile_dpbssd(4, 0, 3);
          _tile_stored(2, ctile[0], 64);
          _tile_stored(4, ctile[1], 64);
          const int64_t mr = std::min<int64_t>(16, rows - r0);
          for (int64_t i = 0; i < mr; ++i) {
            const __m512 d = _mm512_set1_ps(dxp[(r0 + i) * g + gi]);
            for (int j = 0; j < 2; ++j)
              acc[2 * (r0 + i) + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(ctile[j] + 16 * i)),
                                                      _mm512_mul_ps(dv[j], d), acc[2 * (r0 + i) + j]);
          }
        }
      }
      store_rows(acc, rows, yp, n, t);
    }
    if (!vnni) _tile_release();
  });
}

// Ask Linux for the AMX register state (once per process; threads inherit it). False if refused.
bool enable() {
  constexpr long kReqPerm = 0x1023, kXtileData = 18;
  return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
}

// codes [N, K] (uint8 in [0, 15] with offsets m: int4; int8 without: Q8_0), d and m [N, K / 32]
// -> (packed codes [N/16, G, tile bytes], fp16 scales [N/16, G, 2 (d|m) or 1 (d), 16]).
std::vector<at::Tensor> pack(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m) {
  const bool bytes = q.scalar_type() == at::kChar;
  TORCH_CHECK(q.dim() == 2 && (bytes || q.scalar_type() == at::kByte), "pack: codes must be [N, K] uint8 or int8");
  const int64_t n = q.size(0), k = q.size(1), g = k / kGroup;
  TORCH_CHECK(n % (2 * kCols) == 0 && k % kGroup == 0, "pack: N must divide by 32 and K by 32");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == n && d.size(1) == g, "pack: scales must be [N, K / 32]");
  TORCH_CHECK(bytes != m.has_value(), "pack: int4 codes need offsets [N, K / 32], int8 codes take none");
  TORCH_CHECK(bytes || m->sizes() == d.sizes(), "pack: offsets must be [N, K / 32]");
  auto qc = q.contiguous();
  const int64_t tile_bytes = bytes ? 2 * kTileBytes : kTileBytes;
  auto packed = at::zeros({n / kCols, g, tile_bytes}, q.options());
  const uint8_t* src = reinterpret_cast<const uint8_t*>(qc.data_ptr());
  uint8_t* dst = reinterpret_cast<uint8_t*>(packed.data_ptr());
  for (int64_t t = 0; t < n / kCols; ++t)
    for (int64_t gi = 0; gi < g; ++gi) {
      uint8_t* tile = dst + (t * g + gi) * tile_bytes;
      for (int col = 0; col < kCols; ++col)
        for (int kk = 0; kk < kGroup; ++kk) {
          const uint8_t code = src[(t * kCols + col) * k + gi * kGroup + kk];
          if (bytes) {  // bf16 B tile: row kk / 2 holds k = 2r, 2r + 1 of every column
            tile[32 * (kk / 2) + 2 * col + kk % 2] = code;
          } else {  // see widen()
            tile[64 * (kk / 8) + 4 * col + kk % 4] |= code << (4 * ((kk / 4) % 2));
          }
        }
    }
  auto per_tile = [&](const at::Tensor& v) { return v.to(at::kHalf).view({n / kCols, kCols, g}).permute({0, 2, 1}); };
  auto dm = bytes ? per_tile(d).unsqueeze(2).contiguous() : at::stack({per_tile(d), per_tile(*m)}, 2).contiguous();
  return {packed, dm};
}

// y [M, N] bf16 = x [M, K] bf16 @ w.T, w from pack().
at::Tensor mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& dm) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "mm: x must be [M, K] bf16");
  const int64_t rows = x_in.size(0), k = x_in.size(1), g = k / kGroup, pairs = packed.size(0) / 2;
  const int64_t n = packed.size(0) * kCols;
  const bool bytes = packed.scalar_type() == at::kChar;
  const int64_t tile_bytes = bytes ? 2 * kTileBytes : kTileBytes;
  const int64_t scales = (bytes ? 1 : 2) * kCols;  // fp16 values per (column tile, group): d, and m for int4
  TORCH_CHECK(packed.dim() == 3 && (bytes || packed.scalar_type() == at::kByte) && packed.size(2) == tile_bytes &&
              packed.size(0) % 2 == 0 && packed.is_contiguous(), "mm: not a packed weight");
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.numel() == packed.size(0) * packed.size(1) * scales,
              "mm: scales must be the fp16 tensor pack() returned");
  TORCH_CHECK(k % kGroup == 0 && packed.size(1) == g, "mm: x has ", k, " inputs, the weight ", packed.size(1) * kGroup);
  auto y = at::empty({rows, n}, x_in.options());
  if (rows == 0) return y;
  const at::Tensor x = x_in.contiguous();
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const auto* dmp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  auto* yp = y.data_ptr<c10::BFloat16>();
  if (bytes) {
    mm_int8(x, rows, wp, dmp, yp, n, pairs);
  } else {
    mm_int4(x, rows, wp, dmp, yp, n, pairs);
  }
  return y;
}

}  // namespace dspark::amx

namespace dspark::amx {

// int8 codes [N, K] and scales [N, K / 32] -> (codes in widen()'s layout [N/16, G, 512], fp16
// scales [N/16, G, 16], the codes' sum per column and group [N/16, G, 16] int32), for mm8.
std::vector<at::Tensor> pack8(const at::Tensor& q, const at::Tensor& d) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack8: codes must be [N, K] int8");
  const int64_t n = q.size(0), k = q.size(1), g = k / kGroup;
  TORCH_CHECK(n % (2 * kCols) == 0 && k % kGroup == 0, "pack8: N must divide by 32 and K by 32");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == n && d.size(1) == g, "pack8: scales must be [N, K / 32]");
  auto qc = q.contiguous();
  auto packed = at::zeros({n / kCols, g, 2 * kTileBytes}, q.options());
  auto wsum = at::zeros({n / kCols, g, kCols}, q.options().dtype(at::kInt));
  const int8_t* src = qc.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* sum = wsum.data_ptr<int32_t>();
  for (int64_t t = 0; t < n / kCols; ++t)
    for (int64_t gi = 0; gi < g; ++gi)
      for (int col = 0; col < kCols; ++col)
        for (int kk = 0; kk < kGroup; ++kk) {
          const int8_t code = src[(t * kCols + col) * k + gi * kGroup + kk];
          dst[(t * g + gi) * 2 * kTileBytes + 64 * (kk / 4) + 4 * col + kk % 4] = code;
          sum[(t * g + gi) * kCols + col] += code;
        }
  auto dm = d.to(at::kHalf).view({n / kCols, kCols, g}).permute({0, 2, 1}).contiguous();
  return {packed, dm, wsum};
}

// y [M, N] bf16 = x [M, K] bf16 (quantized to int8 per row and group of 32) @ w.T, w from pack8().
at::Tensor mm8(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& dm, const at::Tensor& wsum) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "mm8: x must be [M, K] bf16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.size(2) == 2 * kTileBytes &&
              packed.size(0) % 2 == 0 && packed.is_contiguous(), "mm8: not a weight from pack8");
  const int64_t rows = x_in.size(0), k = x_in.size(1), g = k / kGroup, pairs = packed.size(0) / 2;
  const int64_t n = packed.size(0) * kCols, cells = packed.size(0) * packed.size(1) * kCols;
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.is_contiguous() && dm.numel() == cells &&
              wsum.scalar_type() == at::kInt && wsum.is_contiguous() && wsum.numel() == cells,
              "mm8: scales and sums must be the tensors pack8 returned");
  TORCH_CHECK(k % kGroup == 0 && packed.size(1) == g, "mm8: x has ", k, " inputs, the weight ", packed.size(1) * kGroup);
  auto y = at::empty({rows, n}, x_in.options());
  if (rows == 0) return y;
  const at::Tensor x = x_in.contiguous();
  mm_q8_rows(x, rows, reinterpret_cast<const uint8_t*>(packed.data_ptr()),
             reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>()), wsum.data_ptr<int32_t>(),
             y.data_ptr<c10::BFloat16>(), n, pairs);
  return y;
}

}  // namespace dspark::amx
