// Weight-only int4 and int8 matmul on Intel AMX tiles (bf16 activations), for decode and
// verification rows (int4: the decoder layers; int8: the LM head, as a GGUF's Q8_0 blocks).
//
// Why: torch's int4 CPU kernel works through the weights once per block of 4 rows, so verifying a
// block of draft tokens costs several decode steps. AMX multiplies a 16-row tile for about the
// price of one row, so here a pass over the weights costs nearly the same for 1 and 16 rows.
//
// Numerics (the same for every row count, so decode and verification agree bit for bit): codes q
// (int4 in [0, 15], int8 in [-128, 127]) are exact in bf16 and x * q is exact in fp32, so per
// group of 32 inputs the tile multiply gives S = sum x*q accumulated in fp32 in the hardware's
// fixed pair order. Each output is then acc += d * S; acc += m * sum(x) over groups in order, with
// w = d * q + m (fp16 d, m; int8 codes have no offset m, as Q8_0). A row's result depends on its
// own inputs only; threads split output columns, never a sum.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int kGroup = 32;   // inputs per quantization group = one tile's K (32 bf16)
constexpr int kCols = 16;    // output columns per tile
constexpr int kTileBytes = kCols * kGroup / 2;  // packed nibbles of one (column tile, group)
constexpr int kAhead = 8;  // groups of weights prefetched ahead

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile 0: A (rows x 32 bf16); tiles 1 and 3: B of two column tiles (16 pair-rows x 16 columns);
// tiles 2 and 4: their C (rows x 16 fp32).
void configure(int rows) {
  TileConfig cfg;
  cfg.colsb[0] = 64; cfg.rows[0] = rows;
  cfg.colsb[1] = 64; cfg.rows[1] = 16;
  cfg.colsb[2] = 64; cfg.rows[2] = rows;
  cfg.colsb[3] = 64; cfg.rows[3] = 16;
  cfg.colsb[4] = 64; cfg.rows[4] = rows;
  _tile_loadconfig(&cfg);
}

// bf16 bit patterns of 0..15, indexed by a code (vpermw reads the low 5 bits of each index).
__m512i code_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    float f = static_cast<float>(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    t[i] = static_cast<uint16_t>(bits >> 16);  // small integers are exact in bf16
  }
  return _mm512_load_si512(t);
}

// 256 packed bytes -> the B tile in AMX's pair layout (row r: k = 2r, 2r + 1 for 16 columns).
// Each 16-bit word of a 64-byte chunk holds the same word of four consecutive tile rows, one per
// nibble, so a row is a shift, a mask and a table lookup (no byte widening).
inline void expand(const uint8_t* src, uint16_t* dst, __m512i table) {
  for (int c = 0; c < 4; ++c) {
    const __m512i b = _mm512_loadu_si512(src + 64 * c);
    _mm512_store_si512(dst + 128 * c, _mm512_permutexvar_epi16(b, table));
    _mm512_store_si512(dst + 128 * c + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table));
    _mm512_store_si512(dst + 128 * c + 64, _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 8), table));
    _mm512_store_si512(dst + 128 * c + 96, _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 12), table));
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

}  // namespace

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
      for (int r = 0; r < 16; ++r)  // tile row r: k = 2r + (w % 2) of column w / 2
        for (int w = 0; w < 32; ++w) {
          const int64_t col = t * kCols + w / 2, kk = gi * kGroup + 2 * r + w % 2;
          if (bytes) {
            tile[32 * r + w] = src[col * k + kk];
          } else {
            tile[64 * (r / 4) + 2 * w + (r % 4) / 2] |= src[col * k + kk] << (4 * (r % 2));
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
  // more than one tile of rows: pad to whole tiles (zero rows cost the tile unit nothing per row)
  const int tile_rows = static_cast<int>(std::min<int64_t>(rows, 16));
  const int64_t padded = rows <= 16 ? rows : (rows + 15) / 16 * 16;
  at::Tensor x = x_in.contiguous();
  if (padded != rows) x = at::cat({x, at::zeros({padded - rows, k}, x.options())});
  // per row and group: sum of x in fp32, in a fixed order (for the offsets: int4 only)
  auto sx = at::empty({bytes ? 0 : rows, g}, x.options().dtype(at::kFloat));
  const auto* xp = x.data_ptr<c10::BFloat16>();
  float* sxp = sx.data_ptr<float>();
  for (int64_t r = 0; r < (bytes ? 0 : rows); ++r)
    for (int64_t gi = 0; gi < g; ++gi) {
      const auto* p = xp + r * k + gi * kGroup;
      sxp[r * g + gi] = _mm512_reduce_add_ps(_mm512_add_ps(load_bf16(p), load_bf16(p + 16)));
    }
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  const auto* dmp = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
  auto* yp = y.data_ptr<c10::BFloat16>();
  // Column tiles go in pairs (two independent tile chains per group keep the unit busy); each
  // group's codes are expanded once and multiplied with every block of 16 rows.
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    const __m512i table = code_table();
    alignas(64) uint16_t btile[2][16 * 32];
    alignas(64) float ctile[2][16 * 16];
    std::vector<__m512> acc(rows * 2);
    configure(tile_rows);
    for (int64_t pr = p0; pr < p1; ++pr) {
      const int64_t t = 2 * pr;
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      const uint8_t* wt0 = wp + t * g * tile_bytes;
      const uint8_t* wt1 = wt0 + g * tile_bytes;
      const uint16_t* dm0 = dmp + t * g * scales;
      const uint16_t* dm1 = dm0 + g * scales;
      for (int64_t gi = 0; gi < g; ++gi) {
        for (int64_t line = 0; line < tile_bytes; line += 64) {  // memory-bound at one row: fetch ahead
          _mm_prefetch(reinterpret_cast<const char*>(wt0 + (gi + kAhead) * tile_bytes + line), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(wt1 + (gi + kAhead) * tile_bytes + line), _MM_HINT_T0);
        }
        if (bytes) {
          expand8(reinterpret_cast<const int8_t*>(wt0 + gi * tile_bytes), btile[0]);
          expand8(reinterpret_cast<const int8_t*>(wt1 + gi * tile_bytes), btile[1]);
        } else {
          expand(wt0 + gi * tile_bytes, btile[0], table);
          expand(wt1 + gi * tile_bytes, btile[1], table);
        }
        _tile_loadd(1, btile[0], 64);
        _tile_loadd(3, btile[1], 64);
        const __m512 dv0 = half16(dm0 + gi * scales), dv1 = half16(dm1 + gi * scales);
        const __m512 mv0 = bytes ? dv0 : half16(dm0 + gi * scales + kCols);
        const __m512 mv1 = bytes ? dv1 : half16(dm1 + gi * scales + kCols);
        for (int64_t r0 = 0; r0 < rows; r0 += 16) {
          _tile_loadd(0, xp + r0 * k + gi * kGroup, k * 2);
          _tile_zero(2);
          _tile_zero(4);
          _tile_dpbf16ps(2, 0, 1);
          _tile_dpbf16ps(4, 0, 3);
          _tile_stored(2, ctile[0], 64);
          _tile_stored(4, ctile[1], 64);
          const int64_t mr = std::min<int64_t>(16, rows - r0);
          __m512* a = acc.data() + 2 * r0;
          for (int64_t i = 0; i < mr; ++i) {
            a[2 * i] = _mm512_fmadd_ps(dv0, _mm512_load_ps(ctile[0] + 16 * i), a[2 * i]);
            a[2 * i + 1] = _mm512_fmadd_ps(dv1, _mm512_load_ps(ctile[1] + 16 * i), a[2 * i + 1]);
            if (!bytes) {
              const __m512 s = _mm512_set1_ps(sxp[(r0 + i) * g + gi]);
              a[2 * i] = _mm512_fmadd_ps(mv0, s, a[2 * i]);
              a[2 * i + 1] = _mm512_fmadd_ps(mv1, s, a[2 * i + 1]);
            }
          }
        }
      }
      for (int64_t i = 0; i < rows; ++i)
        for (int j = 0; j < 2; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + i * n + (t + j) * kCols),
                              (__m256i)_mm512_cvtneps_pbh(acc[2 * i + j]));
    }
    _tile_release();
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("enable", &enable, "request the AMX register state from the kernel");
  m.def("pack", &pack, "int4 (uint8) codes with scales and offsets, or int8 codes with scales -> the AMX layout",
        py::arg("q"), py::arg("d"), py::arg("m") = py::none());
  m.def("mm", &mm, "bf16 rows times a packed int4 or int8 weight");
}
