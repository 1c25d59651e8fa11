// The packed layout every weight-only kernel build shares (quant_pack.cpp writes it; quant_amx.cpp,
// quant_q8_rows.cpp and quant_avx2.cpp read it): output columns in tiles of 16, inputs in groups
// of 32, one block of bytes per (column tile, group) in the order AMX's B tiles want.
#pragma once

#include <cstdint>

namespace dspark::amx {

constexpr int kGroup = 32;   // inputs per quantization group = one tile's K (32 bf16)
constexpr int kCols = 16;    // output columns per tile
constexpr int kTileBytes = kCols * kGroup / 2;  // packed nibbles of one (column tile, group)
constexpr int kAhead = 8;  // groups of weights prefetched ahead

}  // namespace dspark::amx
