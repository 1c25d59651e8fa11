// The packed layout every weight-only kernel build shares (quant_pack.cpp writes it; quant_amx.cpp,
// quant_q8_rows.cpp and quant_avx2.cpp read it): output columns in tiles of 16, inputs in groups
// of 32, one block of bytes per (column tile, group) in the order AMX's B tiles want. Also what
// every build's kernels share around it: the rows' int8 form, prefetching, and the checks of the
// entry points' arguments (quant_pack.cpp), so that each build reports bad input alike.
#pragma once

#include <ATen/ATen.h>
#include <xmmintrin.h>

#include <cstdint>

namespace dspark::amx {

constexpr int kGroup = 32;   // inputs per quantization group = one tile's K (32 bf16)
constexpr int kCols = 16;    // output columns per tile
constexpr int kTileBytes = kCols * kGroup / 2;  // packed nibbles of one (column tile, group)
constexpr int kAhead = 8;  // groups of weights prefetched ahead

// A batch's rows as int8 codes per group of 32 and each group's dx and dx * sum of codes (in the
// calling thread's scratch: each build's quantize_batch).
struct QuantizedRows {
  const int8_t* xq;
  const float* dx;
  const float* cx;
};

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
}

// How an int4 weight keeps its per-group scale d and offset m (w = d * q + m, q in [0, 15]):
// kFull: fp16 d and m per (column tile, group), [T, G, 2, 16] (pack with offsets);
// kSym: fp16 d alone, m = -8 d (GGUF's Q4_0), [T, G, 1, 16] (pack without offsets);
// kSub: GGUF's Q4_K super-blocks of 8 groups (pack_q4k): per (column tile, super-block) fp16 d
// and dmin of the 16 columns, then the groups' 6-bit scales sc and mins mn as bytes, [T, G / 8,
// kSubBytes] uint8; d_g = fp16(d * sc), m_g = -fp16(dmin * mn). 2.5 bytes a group and column
// against kFull's 4.
enum class Int4Form : uint8_t { kFull, kSym, kSub };
constexpr int kSubGroups = 8;
constexpr int64_t kSubBytes = 4 * kCols + 2 * kSubGroups * kCols;

// Where (column tile t, group gi)'s int4 scales sit (scales: the tensor pack() or pack_q4k()
// returned, g groups per row), for each build's int4_scales. half: 16 fp16 values d, then (kFull)
// 16 offsets m, or (kSub) the super-block's d then dmin; sc (kSub alone): the group's 16 6-bit
// scales, its mins kSubGroups * kCols bytes further.
struct Int4ScalesAt {
  const uint16_t* half;
  const uint8_t* sc;
};

inline Int4ScalesAt int4_scales_at(const void* scales, Int4Form form, int64_t t, int64_t g, int64_t gi) {
  if (form == Int4Form::kSub) {
    const uint8_t* b = static_cast<const uint8_t*>(scales) + (t * (g / kSubGroups) + gi / kSubGroups) * kSubBytes;
    return {reinterpret_cast<const uint16_t*>(b), b + 4 * kCols + (gi % kSubGroups) * kCols};
  }
  const int64_t per = form == Int4Form::kSym ? kCols : 2 * kCols;
  return {static_cast<const uint16_t*>(scales) + (t * g + gi) * per, nullptr};
}

// x [rows, k] times a packed weight of n outputs; bytes: int8 codes (pack()'s Q8_0), else int4.
// split: a pack8 weight in the k-quant form (two scales per group, one per 16 inputs, and an offset).
// form: an int4 weight's scale form.
struct MatmulShape {
  int64_t rows, k, n;
  bool bytes;
  bool split = false;
  Int4Form form = Int4Form::kFull;
};

// mm's arguments checked: x [M, K] of dtype rows (the build's), a weight from pack() with its
// fp16 scales (or pack_q4k()'s with its bytes). mm8's: the same with a weight from pack8() and its
// code sums.
MatmulShape check_mm(const at::Tensor& x, at::ScalarType rows, const at::Tensor& packed, const at::Tensor& dm);
MatmulShape check_mm8(const at::Tensor& x, at::ScalarType rows, const at::Tensor& packed, const at::Tensor& dm,
                      const at::Tensor& wsum);

}  // namespace dspark::amx
