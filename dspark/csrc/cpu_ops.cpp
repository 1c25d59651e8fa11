// Fused CPU kernels for the target's decoder layers (bf16, fp16 or fp32 activations), vectorized
// for AVX512 and, with 8-lane versions of the same loops, for AVX2.
//
// Every output row is computed from its own input row (and, for attention, its own visible keys)
// with the same loop structure whatever the batch holds: sums run over fixed 16-lane partial
// accumulators reduced in a fixed tree, and attention visits a row's keys in position order. So a
// token decoded alone and the same token verified inside a chain or tree get identical bits, which
// is what keeps speculative output equal to plain output. Work is split across threads only
// between rows and heads, never inside a sum.

#include "ops.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace dspark::cpu {
// Rows of x [n, h] (row stride sx) -> out [n, h]: w * round(x * rsqrt(mean(x^2) + eps)), as HF's
// RMSNorm (float32 statistics, normalized value rounded to T before the weight multiplies it).
template <typename T>
void rms_rows(const T* x, int64_t sx, const T* w, T* out, int64_t n, int64_t h, float eps) {
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const T* xr = x + r * sx;
      float inv = 1.f / std::sqrt(dot(xr, xr, h) / static_cast<float>(h) + eps);
      T* o = out + r * h;
      for (int64_t i = 0; i < h; ++i) o[i] = static_cast<T>(f32(w[i]) * round_to<T>(f32(xr[i]) * inv));
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, features] with contiguous features");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [features] tensor of x's dtype");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                       x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// (h + d, rms_norm(h + d)): the residual add rounded to T as torch's add would, then the norm.
std::vector<at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps) {
  check_rows(h, "h");
  check_rows(d, "d");
  TORCH_CHECK(h.sizes() == d.sizes() && h.scalar_type() == d.scalar_type(), "h and d must match");
  TORCH_CHECK(w.is_contiguous() && w.numel() == h.size(1) && w.scalar_type() == h.scalar_type(),
              "weight must be a contiguous [features] tensor of h's dtype");
  auto sum = at::empty_like(h, at::MemoryFormat::Contiguous);
  auto out = at::empty_like(h, at::MemoryFormat::Contiguous);
  const int64_t n = h.size(0), f = h.size(1), sh = h.stride(0), sd = d.stride(0);
  dispatch(h.scalar_type(), "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* hp = h.data_ptr<scalar_t>();
    const scalar_t* dp = d.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        for (int64_t i = 0; i < f; ++i) {
          sp[r * f + i] = static_cast<scalar_t>(f32(hp[r * sh + i]) + f32(dp[r * sd + i]));
        }
      }
    });
    rms_rows<scalar_t>(sp, f, w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, f, static_cast<float>(eps));
  });
  return {sum, out};
}

// gate_up [n, 2i] -> silu(gate) * up [n, i], each op rounded to T as torch's would be.
at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "gate_up");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t n = gu.size(0), half = gu.size(1) / 2;
  auto out = at::empty({n, half}, gu.options());
  dispatch(gu.scalar_type(), "silu_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* g = gu.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const int64_t sg = gu.stride(0);
    at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* gr = g + r * sg;
        int64_t i = 0;
#if defined(__AVX512F__)
        float s[kLanes];
        for (; i + kLanes <= half; i += kLanes) {
          __m512 x = load16(gr + i);
          __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
          _mm512_storeu_ps(s, _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
          for (int l = 0; l < kLanes; ++l) {
            o[r * half + i + l] = static_cast<scalar_t>(round_to<scalar_t>(s[l]) * f32(gr[half + i + l]));
          }
        }
#elif defined(__AVX2__)
        float s[8];
        for (; i + 8 <= half; i += 8) {
          __m256 x = load8(gr + i);
          __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
          _mm256_storeu_ps(s, _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
          for (int l = 0; l < 8; ++l) {
            o[r * half + i + l] = static_cast<scalar_t>(round_to<scalar_t>(s[l]) * f32(gr[half + i + l]));
          }
        }
#endif
        for (; i < half; ++i) {
          float x = f32(gr[i]);
          float s1 = round_to<scalar_t>(x / (1.f + std::exp(-x)));
          o[r * half + i] = static_cast<scalar_t>(s1 * f32(gr[half + i]));
        }
      }
    });
  });
  return out;
}

// HF's rotate-half rotary, each product and the sum rounded to T as torch's ops would be.
template <typename T>
inline void rotate(T* x, const T* c, const T* s, int64_t d) {
  const int64_t half = d / 2;
  float tmp[512];
  for (int64_t i = 0; i < d; ++i) {
    float other = i < half ? -f32(x[i + half]) : f32(x[i - half]);
    tmp[i] = round_to<T>(round_to<T>(f32(x[i]) * f32(c[i])) + round_to<T>(other * f32(s[i])));
  }
  for (int64_t i = 0; i < d; ++i) x[i] = static_cast<T>(tmp[i]);
}


// Rotates q and k in place (cos/sin: [n, head_dim]) and writes k and v to the caches' slots.
void rope_store(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots) {
  check_heads(q, "q");
  check_heads(k, "k");
  check_heads(v, "v");
  const int64_t n = q.size(0), nh = q.size(1), nkv = k.size(1), d = q.size(2);
  TORCH_CHECK(d <= 512 && d % 2 == 0, "head_dim must be even and at most 512");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == n && cos.size(1) == d,
              "cos/sin must be contiguous [rows, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(1) == nkv && k_cache.size(2) == d,
              "caches must be contiguous [slots, kv_heads, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == n, "slots must be int64 [rows]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && cos.scalar_type() == q.scalar_type(),
              "q, cos/sin and the caches must share a dtype");
  dispatch(q.scalar_type(), "rope_store", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t* sl = slots.data_ptr<int64_t>();
    const int64_t slot_count = k_cache.size(0);
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(sl[r] >= 0 && sl[r] < slot_count, "slot out of range");
    }
    const int64_t sq0 = q.stride(0), sq1 = q.stride(1), sk0 = k.stride(0), sk1 = k.stride(1);
    const int64_t sv0 = v.stride(0), sv1 = v.stride(1);
    at::parallel_for(0, n, 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* c = cp + r * d;
        const scalar_t* s = sp + r * d;
        for (int64_t hh = 0; hh < nh; ++hh) rotate(qp + r * sq0 + hh * sq1, c, s, d);
        for (int64_t hh = 0; hh < nkv; ++hh) {
          scalar_t* kr = kp + r * sk0 + hh * sk1;
          rotate(kr, c, s, d);
          const scalar_t* vr = vp + r * sv0 + hh * sv1;
          scalar_t* kd = kc + (sl[r] * nkv + hh) * d;
          scalar_t* vd = vc + (sl[r] * nkv + hh) * d;
          for (int64_t i = 0; i < d; ++i) {
            kd[i] = kr[i];
            vd[i] = vr[i];
          }
        }
      }
    });
  });
}


#if defined(__AVX512F__)
// Running maxima of 16 lanes over consecutive 16-column steps from column v0, each lane keeping
// the first column of its maximum (a strict compare), and their reduction to one (value, index):
// the larger value, the lower index among equal ones.
struct LaneMax {
  __m512 v;
  __m512i i, idx;
  LaneMax(float init, int64_t v0)
      : v(_mm512_set1_ps(init)), i(_mm512_set1_epi32(static_cast<int32_t>(v0))),
        idx(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(v0)),
                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))) {}
  void step(__m512 a) {
    const __mmask16 gt = _mm512_cmp_ps_mask(a, v, _CMP_GT_OQ);
    v = _mm512_mask_blend_ps(gt, v, a);
    i = _mm512_mask_blend_epi32(gt, i, idx);
    idx = _mm512_add_epi32(idx, _mm512_set1_epi32(kLanes));
  }
  // folds the lanes into (top, best); any: whether (top, best) already holds a value
  void reduce(float& top, int64_t& best, bool& any) const {
    alignas(64) float mv[kLanes];
    alignas(64) int32_t mi[kLanes];
    _mm512_store_ps(mv, v);
    _mm512_store_si512(mi, i);
    for (int l = 0; l < kLanes; ++l)
      if (!any || mv[l] > top || (mv[l] == top && mi[l] < best)) top = mv[l], best = mi[l], any = true;
  }
};
#elif defined(__AVX2__)
// LaneMax in 8 lanes (steps of 8 columns).
struct LaneMax {
  static constexpr int kWidth = 8;
  __m256 v;
  __m256i i, idx;
  LaneMax(float init, int64_t v0)
      : v(_mm256_set1_ps(init)), i(_mm256_set1_epi32(static_cast<int32_t>(v0))),
        idx(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(v0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))) {}
  void step(__m256 a) {
    const __m256 gt = _mm256_cmp_ps(a, v, _CMP_GT_OQ);
    v = _mm256_blendv_ps(v, a, gt);
    i = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(i), _mm256_castsi256_ps(idx), gt));
    idx = _mm256_add_epi32(idx, _mm256_set1_epi32(kWidth));
  }
  void reduce(float& top, int64_t& best, bool& any) const {
    alignas(32) float mv[kWidth];
    alignas(32) int32_t mi[kWidth];
    _mm256_store_ps(mv, v);
    _mm256_store_si256(reinterpret_cast<__m256i*>(mi), i);
    for (int l = 0; l < kWidth; ++l)
      if (!any || mv[l] > top || (mv[l] == top && mi[l] < best)) top = mv[l], best = mi[l], any = true;
  }
};
#endif

// Index of each row's maximum [R] int64 from x [R, V]: the first of equal maxima, and the first
// NaN where a row has one (torch's argmax rules), without the float copy torch's bf16 argmax
// needs on CPU to be fast.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  const int64_t R = x.size(0), V = x.size(1), sx = x.stride(0);
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  dispatch(x.scalar_type(), "argmax_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T* row = xp + r * sx;
        int64_t v = 0, best = 0;
        float top = f32(row[0]);
        bool nan = std::isnan(top);
#if defined(__AVX512F__)
        if (!nan && V >= 2 * kLanes) {
          LaneMax lanes(top, 0);  // every lane starts at column 0's value
          for (; v + kLanes <= V; v += kLanes) {
            const __m512 a = load16(row + v);
            if (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q)) break;  // a NaN: the scalar loop finds the first
            lanes.step(a);
          }
          bool any = true;
          lanes.reduce(top, best, any);
        }
#elif defined(__AVX2__)
        if (!nan && V >= 16) {
          LaneMax lanes(top, 0);
          for (; v + 8 <= V; v += 8) {
            const __m256 a = load8(row + v);
            if (_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q))) break;
            lanes.step(a);
          }
          bool any = true;
          lanes.reduce(top, best, any);
        }
#endif
        for (; v < V && !nan; ++v) {
          const float a = f32(row[v]);
          if (std::isnan(a)) {
            nan = true;
            best = v;
          } else if (a > top) {
            top = a;
            best = v;
          }
        }
        op[r] = best;
      }
    });
  });
  return out;
}

// (max, argmax) over columns [v0, v1) of base[v] + sum_j e[j] * wt[j, v] (rows V wide; the first
// index among equal maxima, as torch's argmax; index v1 for an empty range). Each sum is taken from
// base in j order by one fused multiply-add per j, the bits an axpy per j would leave, but 16
// columns at a time stay in a register through every j instead of the row passing through memory
// once per j.
inline std::pair<float, int64_t> biased_argmax(const float* base, const float* e, const float* wt, int64_t rank,
                                               int64_t V, int64_t v0, int64_t v1) {
  int64_t v = v0, best = v1;
  float top = -std::numeric_limits<float>::infinity();
  bool any = false;
#if defined(__AVX512F__)
  if (v1 - v0 >= kLanes) {
    LaneMax lanes(-std::numeric_limits<float>::infinity(), v0);
    // four vectors of columns at a time: four independent chains of rank FMAs keep the FMA units
    // busy where one chain waits out each FMA's latency; each is folded in column order
    for (; v + 4 * kLanes <= v1; v += 4 * kLanes) {
      __m512 acc[4];
      for (int c = 0; c < 4; ++c) acc[c] = _mm512_loadu_ps(base + v + c * kLanes);
      for (int64_t j = 0; j < rank; ++j) {
        const __m512 ej = _mm512_set1_ps(e[j]);
        const float* w = wt + j * V + v;
        for (int c = 0; c < 4; ++c) acc[c] = _mm512_fmadd_ps(ej, _mm512_loadu_ps(w + c * kLanes), acc[c]);
      }
      for (int c = 0; c < 4; ++c) lanes.step(acc[c]);
    }
    for (; v + kLanes <= v1; v += kLanes) {
      __m512 acc = _mm512_loadu_ps(base + v);
      for (int64_t j = 0; j < rank; ++j) acc = _mm512_fmadd_ps(_mm512_set1_ps(e[j]), _mm512_loadu_ps(wt + j * V + v), acc);
      lanes.step(acc);
    }
    lanes.reduce(top, best, any);
  }
#elif defined(__AVX2__)
  if (v1 - v0 >= 8) {
    LaneMax lanes(-std::numeric_limits<float>::infinity(), v0);
    for (; v + 32 <= v1; v += 32) {
      __m256 acc[4];
      for (int c = 0; c < 4; ++c) acc[c] = _mm256_loadu_ps(base + v + c * 8);
      for (int64_t j = 0; j < rank; ++j) {
        const __m256 ej = _mm256_set1_ps(e[j]);
        const float* w = wt + j * V + v;
        for (int c = 0; c < 4; ++c) acc[c] = _mm256_fmadd_ps(ej, _mm256_loadu_ps(w + c * 8), acc[c]);
      }
      for (int c = 0; c < 4; ++c) lanes.step(acc[c]);
    }
    for (; v + 8 <= v1; v += 8) {
      __m256 acc = _mm256_loadu_ps(base + v);
      for (int64_t j = 0; j < rank; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(e[j]), _mm256_loadu_ps(wt + j * V + v), acc);
      lanes.step(acc);
    }
    lanes.reduce(top, best, any);
  }
#endif
  for (; v < v1; ++v) {
    float x = base[v];
    for (int64_t j = 0; j < rank; ++j) x = std::fma(e[j], wt[j * V + v], x);
    if (!any || x > top) top = x, best = v, any = true;
  }
  return {top, best};
}

// A drafter's greedy walk of its low-rank Markov head over a block (drafts only: no bit-exactness
// asked). For each request r and slot k: logits = base[r, k] + W2t^T W1[prev], pick = the first
// maximum, prev = to_target[pick] (the anchor before slot 0). base [R, K, V] float32, W1 [vocab,
// rank], W2t [rank, V] float32, anchors [R] int64, to_target [V] int64 (empty: identity). Returns
// target ids [R, K]. Doing the K steps here saves ~10 torch calls per slot.
at::Tensor markov_walk(const at::Tensor& base, const at::Tensor& w1, const at::Tensor& w2t, const at::Tensor& anchors,
                       const at::Tensor& to_target) {
  TORCH_CHECK(base.dim() == 3 && base.scalar_type() == at::kFloat && base.is_contiguous(),
              "markov_walk: base must be contiguous float32 [R, K, V]");
  const int64_t R = base.size(0), K = base.size(1), V = base.size(2), rank = w1.size(1);
  TORCH_CHECK(w1.dim() == 2 && w1.is_contiguous(), "markov_walk: W1 must be contiguous [vocab, rank]");
  TORCH_CHECK(w2t.scalar_type() == at::kFloat && w2t.is_contiguous() && w2t.size(0) == rank && w2t.size(1) == V,
              "markov_walk: W2t must be contiguous float32 [rank, V]");
  TORCH_CHECK(anchors.scalar_type() == at::kLong && anchors.numel() == R, "markov_walk: anchors must be int64 [R]");
  const bool mapped = to_target.numel() > 0;
  TORCH_CHECK(!mapped || (to_target.scalar_type() == at::kLong && to_target.numel() == V && to_target.is_contiguous()),
              "markov_walk: to_target must be int64 [V]");
  auto out = at::empty({R, K}, anchors.options());
  const float* bp = base.data_ptr<float>();
  const float* wt = w2t.data_ptr<float>();
  const int64_t* ap = anchors.data_ptr<int64_t>();
  const int64_t* tp = mapped ? to_target.data_ptr<int64_t>() : nullptr;
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t vocab = w1.size(0);
  dispatch(w1.scalar_type(), "markov_walk", [&](auto tag) {
    using T = decltype(tag);
    const T* w1p = w1.data_ptr<T>();
    // fewer rows than threads (batch 1): each slot's columns split over the threads, the parts'
    // maxima combined in column order (the first of equal maxima still wins); else a row per thread
    const int64_t threads = at::get_num_threads();
    const int64_t parts = R < threads ? std::min<int64_t>(threads, V / 1024 + 1) : 1;
    const int64_t span = (V / parts + kLanes - 1) / kLanes * kLanes;
    auto pick = [&](const float* b, const float* e) -> int64_t {
      if (parts == 1) return biased_argmax(b, e, wt, rank, V, 0, V).second;
      std::vector<std::pair<float, int64_t>> found(parts);
      at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1; ++p)
          found[p] = biased_argmax(b, e, wt, rank, V, std::min(V, p * span), std::min(V, (p + 1) * span));
      });
      auto best = found[0];
      for (const auto& f : found)
        if (f.second < V && (best.second >= V || f.first > best.first)) best = f;
      return best.second;
    };
    auto walk = [&](int64_t r) {
      std::vector<float> e(rank);
      int64_t prev = ap[r];
      for (int64_t k = 0; k < K; ++k) {
        TORCH_CHECK(prev >= 0 && prev < vocab, "markov_walk: token ", prev, " outside W1");
        for (int64_t j = 0; j < rank; ++j) e[j] = f32(w1p[prev * rank + j]);
        const int64_t best = pick(bp + (r * K + k) * V, e.data());
        prev = mapped ? tp[best] : best;
        op[r * K + k] = prev;
      }
    };
    if (parts > 1) {
      for (int64_t r = 0; r < R; ++r) walk(r);
      return;
    }
    at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) walk(r);
    });
  });
  return out;
}

}  // namespace dspark::cpu
