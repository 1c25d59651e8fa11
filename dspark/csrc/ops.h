// The CPU kernels' entry points, shared by the Python module (module.cpp) and the decoder stack
// (decode_stack.cpp), which calls them directly so that a pass through either gets the same bits.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

// Builds whose attention runs on vector registers (attend.cpp: AVX512, or AVX2 via attend_avx2.h):
// heads_attend for short groups and attend_causal for prompt chunks, with the same bits per row.
#if defined(__AVX512F__) || defined(__AVX2__)
#define DSPARK_REGISTER_ATTENTION 1
#endif

namespace dspark::cpu {  // cpu_ops.cpp and attend.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gu);
void rope_store(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots);
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& gather,
            const at::Tensor& q_index, const at::Tensor& mask, double scale, at::Tensor out);
#ifdef DSPARK_REGISTER_ATTENTION
void attend_causal(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& gather,
                   const at::Tensor& q_index, const at::Tensor& visible, double scale, at::Tensor out);
#endif
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor markov_walk(const at::Tensor& base, const at::Tensor& w1, const at::Tensor& w2t, const at::Tensor& anchors,
                       const at::Tensor& to_target);
}  // namespace dspark::cpu

namespace dspark::amx {  // quant_amx.cpp
bool enable();
std::vector<at::Tensor> pack(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m);
std::vector<at::Tensor> pack_q4k(const at::Tensor& q, const at::Tensor& d, const at::Tensor& dmin, const at::Tensor& sc,
                                 const at::Tensor& mn);
at::Tensor mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& dm,
              const std::optional<at::Tensor>& sums = std::nullopt);
std::vector<at::Tensor> pack8(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m = std::nullopt);
at::Tensor mm8(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& dm, const at::Tensor& wsum);
#ifdef DSPARK_AMX
at::Tensor mm_prompt(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& dm,
                     const std::optional<at::Tensor>& sums = std::nullopt);
#endif
}  // namespace dspark::amx

namespace dspark {  // decode_stack.cpp
std::vector<at::Tensor> decode_stack(at::Tensor h, const std::vector<at::Tensor>& weights, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin,
                                     const at::Tensor& slots, const std::vector<at::Tensor>& groups,
                                     std::vector<int64_t> shape, std::vector<double> eps,
                                     const std::vector<int64_t>& capture, const at::Tensor& prompt_rows,
                                     const at::Tensor& rest_rows, const std::vector<int64_t>& prompt_kernel);
}  // namespace dspark
