// The weight-only kernels' packing (quant_layout.h), plain C++ so that every build holds the same
// one: int4 codes with scales and offsets, or int8 codes with scales, for mm (pack) and int8 codes
// for the int8-rows product mm8 (pack8); and the checks of mm's and mm8's arguments.
#include "ops.h"
#include "quant_layout.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace dspark::amx {

namespace {
// codes [N, K] -> [N/16, G, tile bytes]: int4 (uint8) nibbles as widen() reads them, or int8 codes
// as a bf16 B tile's pairs.
at::Tensor pack_codes(const at::Tensor& q) {
  const bool bytes = q.scalar_type() == at::kChar;
  const int64_t n = q.size(0), k = q.size(1), g = k / kGroup;
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
          } else {  // byte 64c + 4 * column + b: k = 8c + b low, k = 8c + 4 + b high (widen())
            tile[64 * (kk / 8) + 4 * col + kk % 4] |= code << (4 * ((kk / 4) % 2));
          }
        }
    }
  return packed;
}
}  // namespace

// codes [N, K] (uint8 in [0, 15] with offsets m: int4; int8 without: Q8_0), d and m [N, K / 32]
// -> (packed codes [N/16, G, tile bytes], fp16 scales [N/16, G, 2 (d|m) or 1 (d), 16]). int4 codes
// without offsets are the symmetric form w = d * (q - 8) (Q4_0's): d alone, half the scale bytes.
std::vector<at::Tensor> pack(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m) {
  const bool bytes = q.scalar_type() == at::kChar;
  TORCH_CHECK(q.dim() == 2 && (bytes || q.scalar_type() == at::kByte), "pack: codes must be [N, K] uint8 or int8");
  const int64_t n = q.size(0), k = q.size(1), g = k / kGroup;
  TORCH_CHECK(n % (2 * kCols) == 0 && k % kGroup == 0, "pack: N must divide by 32 and K by 32");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == n && d.size(1) == g, "pack: scales must be [N, K / 32]");
  TORCH_CHECK(!(bytes && m.has_value()), "pack: int8 codes take no offsets");
  TORCH_CHECK(!m.has_value() || m->sizes() == d.sizes(), "pack: offsets must be [N, K / 32]");
  const at::Tensor packed = pack_codes(q);
  auto per_tile = [&](const at::Tensor& v) { return v.to(at::kHalf).view({n / kCols, kCols, g}).permute({0, 2, 1}); };
  auto dm = m.has_value() ? at::stack({per_tile(d), per_tile(*m)}, 2).contiguous() : per_tile(d).unsqueeze(2).contiguous();
  return {packed, dm};
}

// GGUF's Q4_K kept as it is (quant_layout.h's kSub): codes [N, K] uint8 in [0, 15], the super-blocks'
// d and dmin [N, K / 256] (fp16 values), the groups' 6-bit scales sc and mins mn [N, K / 32] uint8
// -> (packed codes as pack()'s, bytes [N/16, G/8, kSubBytes]); w = fp16(d sc) q - fp16(dmin mn).
std::vector<at::Tensor> pack_q4k(const at::Tensor& q, const at::Tensor& d, const at::Tensor& dmin, const at::Tensor& sc,
                                 const at::Tensor& mn) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "pack_q4k: codes must be [N, K] uint8");
  const int64_t n = q.size(0), k = q.size(1), g = k / kGroup, sb = g / kSubGroups;
  TORCH_CHECK(n % (2 * kCols) == 0 && k % (kGroup * kSubGroups) == 0, "pack_q4k: N must divide by 32 and K by 256");
  TORCH_CHECK(d.sizes() == at::IntArrayRef({n, sb}) && dmin.sizes() == d.sizes(),
              "pack_q4k: d and dmin must be [N, K / 256]");
  TORCH_CHECK(sc.scalar_type() == at::kByte && mn.scalar_type() == at::kByte && sc.sizes() == at::IntArrayRef({n, g}) &&
              mn.sizes() == sc.sizes(), "pack_q4k: scales and mins must be [N, K / 32] uint8");
  // [T, SB, 16] fp16 halves, then [T, SB, 8 groups, 16] bytes, per (tile, super-block)
  auto per_tile = [&](const at::Tensor& v, int64_t cols) {
    return v.contiguous().view({n / kCols, kCols, cols}).permute({0, 2, 1});
  };
  const at::Tensor halves = at::stack({per_tile(d.to(at::kHalf), sb), per_tile(dmin.to(at::kHalf), sb)}, 2)
                                .contiguous().view(at::kByte).view({n / kCols, sb, 4 * kCols});
  auto groups = [&](const at::Tensor& v) {
    return per_tile(v, g).reshape({n / kCols, sb, kSubGroups * kCols});
  };
  const at::Tensor sub = at::cat({halves, groups(sc), groups(mn)}, 2).contiguous();
  return {pack_codes(q), sub};
}

// int8 codes [N, K] and scales [N, K / 32] -> (codes [N/16, G, 512], 64 bytes q holding k = 4q ..
// 4q + 3 of the 16 columns as widen()'s output does, fp16 scales [N/16, G, 16], the codes' sum
// per column and group [N/16, G, 16] int16), for mm8. The k-quant form (split), for GGUF's
// Q6_K / Q5_K / Q4_K blocks: scales [N, K / 16] (one per half group) and/or offsets m
// [N, K / 32] (w = d * q + m) -> fp16 (d of inputs 0-15, d of 16-31, m) [N/16, G, 3, 16] and
// code sums per half group [N/16, G, 2, 16].
std::vector<at::Tensor> pack8(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "pack8: codes must be [N, K] int8");
  const int64_t n = q.size(0), k = q.size(1), g = k / kGroup;
  TORCH_CHECK(n % (2 * kCols) == 0 && k % kGroup == 0, "pack8: N must divide by 32 and K by 32");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == n && (d.size(1) == g || d.size(1) == 2 * g),
              "pack8: scales must be [N, K / 32] or [N, K / 16]");
  TORCH_CHECK(!m.has_value() || (m->dim() == 2 && m->size(0) == n && m->size(1) == g), "pack8: offsets must be [N, K / 32]");
  const bool split = d.size(1) == 2 * g || m.has_value();
  const int64_t halves = split ? 2 : 1;
  auto qc = q.contiguous();
  auto packed = at::zeros({n / kCols, g, 2 * kTileBytes}, q.options());
  // int16: |a sum of 32 codes| <= 4096; half the bytes of int32 sums (the split form: 1/8 byte a weight)
  auto wsum = at::zeros({n / kCols, g, halves, kCols}, q.options().dtype(at::kShort));
  const int8_t* src = qc.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int16_t* sum = wsum.data_ptr<int16_t>();
  for (int64_t t = 0; t < n / kCols; ++t)
    for (int64_t gi = 0; gi < g; ++gi)
      for (int col = 0; col < kCols; ++col)
        for (int kk = 0; kk < kGroup; ++kk) {
          const int8_t code = src[(t * kCols + col) * k + gi * kGroup + kk];
          dst[(t * g + gi) * 2 * kTileBytes + 64 * (kk / 4) + 4 * col + kk % 4] = code;
          sum[((t * g + gi) * halves + (split ? kk / 16 : 0)) * kCols + col] += code;
        }
  auto per_tile = [&](const at::Tensor& v, int64_t groups) {
    return v.to(at::kHalf).contiguous().view({n / kCols, kCols, groups}).permute({0, 2, 1});  // [T, groups, 16]
  };
  if (!split) return {packed, per_tile(d, g).contiguous(), wsum.view({n / kCols, g, kCols})};
  const at::Tensor d16 = d.size(1) == g ? d.repeat_interleave(2, 1) : d;
  const at::Tensor halves_d = per_tile(d16, 2 * g).reshape({n / kCols, g, 2, kCols});
  const at::Tensor offsets = per_tile(m.has_value() ? *m : at::zeros({n, g}, d.options()), g).unsqueeze(2);
  const at::Tensor dm = at::cat({halves_d, offsets}, 2).contiguous();
  return {packed, dm, wsum};
}

namespace {
void check_rows(const char* name, const at::Tensor& x, at::ScalarType rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == rows, name, ": x must be [M, K] ",
              rows == at::kBFloat16 ? "bf16" : "float32", " in this build");
}

void check_inputs(const char* name, int64_t k, const at::Tensor& packed) {
  TORCH_CHECK(k % kGroup == 0 && packed.size(1) == k / kGroup, name, ": x has ", k, " inputs, the weight ",
              packed.size(1) * kGroup);
}
}  // namespace

MatmulShape check_mm(const at::Tensor& x, at::ScalarType rows, const at::Tensor& packed, const at::Tensor& dm) {
  check_rows("mm", x, rows);
  const bool bytes = packed.scalar_type() == at::kChar;
  const int64_t tile_bytes = bytes ? 2 * kTileBytes : kTileBytes;
  TORCH_CHECK(packed.dim() == 3 && (bytes || packed.scalar_type() == at::kByte) && packed.size(2) == tile_bytes &&
              packed.size(0) % 2 == 0 && packed.is_contiguous(), "mm: not a packed weight");
  // fp16 values per (column tile, group): d, and m for int4 unless symmetric; or pack_q4k's bytes
  const int64_t cells = packed.size(0) * packed.size(1) * kCols;
  Int4Form form = Int4Form::kFull;
  if (!bytes && dm.scalar_type() == at::kByte) {
    TORCH_CHECK(packed.size(1) % kSubGroups == 0 && dm.is_contiguous() &&
                dm.numel() == packed.size(0) * (packed.size(1) / kSubGroups) * kSubBytes,
                "mm: Q4_K scales must be the bytes pack_q4k() returned");
    form = Int4Form::kSub;
  } else {
    TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.is_contiguous() &&
                (dm.numel() == (bytes ? 1 : 2) * cells || (!bytes && dm.numel() == cells)),
                "mm: scales must be the fp16 tensor pack() returned");
    if (!bytes && dm.numel() == cells) form = Int4Form::kSym;
  }
  check_inputs("mm", x.size(1), packed);
  return {x.size(0), x.size(1), packed.size(0) * kCols, bytes, false, form};
}

MatmulShape check_mm8(const at::Tensor& x, at::ScalarType rows, const at::Tensor& packed, const at::Tensor& dm,
                      const at::Tensor& wsum) {
  check_rows("mm8", x, rows);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.size(2) == 2 * kTileBytes &&
              packed.size(0) % 2 == 0 && packed.is_contiguous(), "mm8: not a weight from pack8");
  const int64_t cells = packed.size(0) * packed.size(1) * kCols;
  const bool split = dm.numel() == 3 * cells;  // the k-quant form: two scales and an offset per cell
  TORCH_CHECK(dm.scalar_type() == at::kHalf && dm.is_contiguous() && (dm.numel() == cells || split) &&
              wsum.scalar_type() == at::kShort && wsum.is_contiguous() && wsum.numel() == (split ? 2 : 1) * cells,
              "mm8: scales and sums must be the tensors pack8 returned");
  check_inputs("mm8", x.size(1), packed);
  return {x.size(0), x.size(1), packed.size(0) * kCols, true, split};
}

}  // namespace dspark::amx
