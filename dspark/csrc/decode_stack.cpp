// A decoder stack's decode or verification pass (every layer: norms, int4/int8 linears,
// rotary and cache write, attention, SwiGLU) in one call from Python.
//
// Why: at batch 1 a layer's arithmetic is tens of microseconds, and the Python around its nine
// kernel calls (module calls, splits, views) costs about as much again. The gaps also cost the
// kernels themselves: weights touched less often stay less in the shared cache. This loop calls
// the very kernels models/fused.py calls, in the same order on the same views, so a pass through
// it and a pass through Python give the same bits (the Python loop still serves tensor-parallel
// shards, dense prompt copies, attention groups without a fused kernel and layers this loop does
// not take). A pass with prompt rows runs here too: a step that admits one short prompt beside
// the decoding requests would otherwise pay the Python loop's overhead once per layer.

#include "ops.h"

namespace dspark {

namespace {
constexpr int64_t kPerLayer = 16;  // see decode_stack's weights

// The prompt rows of a pass and the others (undefined: a pass without prompt rows), as
// packed.RowSplit holds them.
struct RowSplit {
  at::Tensor prompt, rest;
};

// A linear given as (packed, scales, code sums: empty for bf16 rows), as amx::mm takes it. Prompt
// rows take mm_prompt where prompt_kernel (the linear's _prompt_args in Python), each part in a call
// of its own as RowSplit.apply runs them.
at::Tensor linear(const at::Tensor& x, const at::Tensor* w, const RowSplit& split, bool prompt_kernel) {
#ifdef DSPARK_AMX
  if (split.prompt.defined() && prompt_kernel) {
    if (!split.rest.defined()) return amx::mm_prompt(x, w[0], w[1], w[2]);
    const at::Tensor rest = amx::mm(x.index_select(0, split.rest), w[0], w[1], w[2]);
    at::Tensor y = at::empty({x.size(0), rest.size(1)}, x.options());
    y.index_copy_(0, split.rest, rest);
    y.index_copy_(0, split.prompt, amx::mm_prompt(x.index_select(0, split.prompt), w[0], w[1], w[2]));
    return y;
  }
#endif
  return amx::mm(x, w[0], w[1], w[2]);
}
}  // namespace

// weights: the first layer's input-norm weight, then per layer: qkv (packed, scales, code sums:
// empty for bf16 rows), q and k norm weights (empty: none), o, the post-attention norm, gate/up,
// down (each linear as qkv), and the norm after the layer (the next layer's input norm, or the final
// one). Caches [layers, slots, kv heads, head dim]; cos/sin [rows, head dim]; groups: the
// attention plan's (gather, q_index, mask) per group, flattened; shape: (heads, kv heads, head
// dim); eps: (the layers' norm eps, the q/k norms' eps, the attention scale). A group's third
// tensor is a mask [S, Qmax, Lmax] (attend) or, for a causal prompt-chunk group, each row's visible
// keys [S, Qmax] (attend_causal). prompt_rows / rest_rows: the pass's prompt rows and the others
// (both empty: no prompt rows); prompt_kernel: per layer and linear (qkv, o, gate/up, down),
// whether its prompt rows take mm_prompt (empty: none does). Returns the final normed hidden rows,
// then the residual stream after each layer in capture, in that order.
std::vector<at::Tensor> decode_stack(at::Tensor h, const std::vector<at::Tensor>& weights, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& cos, const at::Tensor& sin,
                                     const at::Tensor& slots, const std::vector<at::Tensor>& groups,
                                     std::vector<int64_t> shape, std::vector<double> eps,
                                     const std::vector<int64_t>& capture, const at::Tensor& prompt_rows,
                                     const at::Tensor& rest_rows, const std::vector<int64_t>& prompt_kernel) {
  TORCH_CHECK(shape.size() == 3 && eps.size() == 3, "decode_stack: shape is (heads, kv heads, head dim), eps is "
              "(norm eps, q/k norm eps, attention scale)");
  TORCH_CHECK(h.dim() == 2 && (h.scalar_type() == at::kBFloat16 || h.scalar_type() == at::kFloat),
              "decode_stack: h must be [rows, hidden] bf16 (float32 in the AVX2 build)");
  TORCH_CHECK(!weights.empty() && (weights.size() - 1) % kPerLayer == 0,
              "decode_stack: weights must be 1 + ", kPerLayer, " per layer");
  TORCH_CHECK(groups.size() % 3 == 0, "decode_stack: groups come as (gather, q_index, mask) triples");
  const int64_t layers = static_cast<int64_t>((weights.size() - 1) / kPerLayer);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == layers && v_cache.sizes() == k_cache.sizes(),
              "decode_stack: caches must be [layers, slots, kv heads, head dim], one per layer");
  TORCH_CHECK(prompt_kernel.empty() || static_cast<int64_t>(prompt_kernel.size()) == 4 * layers,
              "decode_stack: prompt_kernel holds 4 flags per layer, or none");
  RowSplit split;
  if (prompt_rows.numel() > 0) {
    split.prompt = prompt_rows;
    if (rest_rows.numel() > 0) split.rest = rest_rows;
  }
  const auto prompt_kernel_of = [&](int64_t layer, int which) {
    return !prompt_kernel.empty() && prompt_kernel[4 * layer + which] != 0;
  };
  const int64_t n = h.size(0), nh = shape[0], nkv = shape[1], hd = shape[2];
  const double norm_eps = eps[0], qk_eps = eps[1], scale = eps[2];
  std::vector<at::Tensor> taken(capture.size());
  at::Tensor x = cpu::rms_norm(h, weights[0], norm_eps);
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + 1 + i * kPerLayer;
    const at::Tensor qkv = linear(x, w, split, prompt_kernel_of(i, 0));
    at::Tensor q = qkv.narrow(1, 0, nh * hd).view({n, nh, hd});
    at::Tensor k = qkv.narrow(1, nh * hd, nkv * hd).view({n, nkv, hd});
    const at::Tensor v = qkv.narrow(1, (nh + nkv) * hd, nkv * hd).view({n, nkv, hd});
    if (w[3].numel() > 0) {  // as the drafter's KernelRMSNorm: rows of head_dim
      q = cpu::rms_norm(q.reshape({-1, hd}), w[3], qk_eps).view({n, nh, hd});
      k = cpu::rms_norm(k.reshape({-1, hd}), w[4], qk_eps).view({n, nkv, hd});
    }
    const at::Tensor kc = k_cache.select(0, i), vc = v_cache.select(0, i);
    cpu::rope_store(q, k, v, cos, sin, kc, vc, slots);
    at::Tensor o = at::empty({n, nh, hd}, q.options());
    for (size_t g = 0; g < groups.size(); g += 3) {
      if (groups[g + 2].dim() == 3) {
        cpu::attend(q, kc, vc, groups[g], groups[g + 1], groups[g + 2], scale, o);
        continue;
      }
#ifdef DSPARK_REGISTER_ATTENTION
      cpu::attend_causal(q, kc, vc, groups[g], groups[g + 1], groups[g + 2], scale, o);
#else
      TORCH_CHECK(false, "decode_stack: this build attends no causal group");
#endif
    }
    auto hx = cpu::add_rms_norm(h, linear(o.view({n, nh * hd}), w + 5, split, prompt_kernel_of(i, 1)), w[8], norm_eps);
    const at::Tensor gu = linear(hx[1], w + 9, split, prompt_kernel_of(i, 2));
    const at::Tensor down = linear(cpu::silu_mul(gu), w + 12, split, prompt_kernel_of(i, 3));
    hx = cpu::add_rms_norm(hx[0], down, w[15], norm_eps);
    h = hx[0];
    x = hx[1];
    for (size_t c = 0; c < capture.size(); ++c)
      if (capture[c] == i) taken[c] = h;
  }
  std::vector<at::Tensor> out{x};
  for (size_t c = 0; c < capture.size(); ++c) {
    TORCH_CHECK(taken[c].defined(), "decode_stack: no layer ", capture[c], " to capture");
    out.push_back(taken[c]);
  }
  return out;
}

}  // namespace dspark
