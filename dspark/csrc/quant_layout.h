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

// x [rows, k] times a packed weight of n outputs; bytes: int8 codes (pack()'s Q8_0), else int4.
// split: a pack8 weight in the k-quant form (two scales per group, one per 16 inputs, and an offset).
// sym: an int4 weight whose offsets are all -8 * scale (GGUF's Q4_0: w = d * (q - 8)), packed
// with its scales alone.
struct MatmulShape {
  int64_t rows, k, n;
  bool bytes;
  bool split = false;
  bool sym = false;
};

// mm's arguments checked: x [M, K] of dtype rows (the build's), a weight from pack() with its
// fp16 scales. mm8's: the same with a weight from pack8() and its code sums.
MatmulShape check_mm(const at::Tensor& x, at::ScalarType rows, const at::Tensor& packed, const at::Tensor& dm);
MatmulShape check_mm8(const at::Tensor& x, at::ScalarType rows, const at::Tensor& packed, const at::Tensor& dm,
                      const at::Tensor& wsum);

}  // namespace dspark::amx
