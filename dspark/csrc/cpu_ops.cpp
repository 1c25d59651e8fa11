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

#include <ATen/Parallel.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace dspark::cpu {

constexpr int kLanes = 16;

// Runs f(T{}) for the activation dtypes the kernels handle.
template <typename F>
void dispatch(at::ScalarType t, const char* name, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", t);
  }
}

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

// Rounds like one torch op on T: the float result converted to T.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// e^x, 16 lanes: 2^n * p(r) with r = x - n ln2, degree-6 polynomial (x clamped to [-87, 88]).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#elif defined(__AVX2__)
// 8 floats from T (the AVX2 build runs float32 models; bf16 and fp16 widen exactly).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// e^x, 8 lanes: exp16's polynomial and clamps.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// sum_i a[i] * b[i] in a fixed order: kLanes partial sums, then a fixed reduction.
template <typename A, typename B>
inline float dot(const A* a, const B* b, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 v0 = _mm512_setzero_ps(), v1 = v0, v2 = v0, v3 = v0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    v0 = _mm512_fmadd_ps(load16(a + i), load16(b + i), v0);
    v1 = _mm512_fmadd_ps(load16(a + i + 16), load16(b + i + 16), v1);
    v2 = _mm512_fmadd_ps(load16(a + i + 32), load16(b + i + 32), v2);
    v3 = _mm512_fmadd_ps(load16(a + i + 48), load16(b + i + 48), v3);
  }
  for (; i + kLanes <= n; i += kLanes) v0 = _mm512_fmadd_ps(load16(a + i), load16(b + i), v0);
  __m512 v = _mm512_add_ps(_mm512_add_ps(v0, v1), _mm512_add_ps(v2, v3));
  if (i == n) return _mm512_reduce_add_ps(v);
  float acc[kLanes];
  _mm512_storeu_ps(acc, v);
#elif defined(__AVX2__)
  __m256 v[8];  // 16 lanes x 4 chains, as the AVX512 path, each 16 lanes as two halves
  for (auto& x : v) x = _mm256_setzero_ps();
  for (; i + 4 * kLanes <= n; i += 4 * kLanes)
    for (int c = 0; c < 8; ++c) v[c] = _mm256_fmadd_ps(load8(a + i + 8 * c), load8(b + i + 8 * c), v[c]);
  for (; i + kLanes <= n; i += kLanes) {
    v[0] = _mm256_fmadd_ps(load8(a + i), load8(b + i), v[0]);
    v[1] = _mm256_fmadd_ps(load8(a + i + 8), load8(b + i + 8), v[1]);
  }
  float acc[kLanes];
  _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[4], v[6])));
  _mm256_storeu_ps(acc + 8, _mm256_add_ps(_mm256_add_ps(v[1], v[3]), _mm256_add_ps(v[5], v[7])));
#else
  float acc[kLanes] = {0.f};
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += f32(a[i + l]) * f32(b[i + l]);
  }
#endif
  for (int l = 0; i < n; ++i, ++l) acc[l] += f32(a[i]) * f32(b[i]);
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// out[i] += p * v[i] for i < n.
template <typename T>
inline void axpy(float p, const T* v, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 pv = _mm512_set1_ps(p);
  for (; i + kLanes <= n; i += kLanes) {
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(pv, load16(v + i), _mm512_loadu_ps(out + i)));
  }
#elif defined(__AVX2__)
  const __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, load8(v + i), _mm256_loadu_ps(out + i)));
#endif
  for (; i < n; ++i) out[i] += p * f32(v[i]);
}

// x[i] = e^(x[i] - mx) for i < n; returns their sum, added in index order.
inline float exp_shifted(float* x, int64_t n, float mx) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + kLanes <= n; i += kLanes) {
    _mm512_storeu_ps(x + i, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(mx))));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(mx))));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i] - mx);
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) total += x[j];
  return total;
}

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

void check_heads(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, name,
              " must be a CPU [rows, heads, head_dim] tensor with contiguous head_dim");
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
// One query head over its visible keys with head_dim = 16 * C held in registers: scores as C
// products added in a fixed pairwise tree, then the value sum over the keys in order.
template <int C, typename T>
void head_attend(const T* qr, const T* kc, const T* vc, const int64_t* slots, const bool* m, int64_t lmax,
                 int64_t stride, float sc, float* score, int64_t* key, T* orow) {
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = load16(qr + 16 * c);
  int64_t seen = 0;
  float mx = -INFINITY;
  for (int64_t j = 0; j < lmax; ++j) {
    if (!m[j]) continue;
    const T* kr = kc + slots[j] * stride;
    __m512 prod[C];
    for (int c = 0; c < C; ++c) prod[c] = _mm512_mul_ps(qv[c], load16(kr + 16 * c));
    for (int w = C / 2; w > 0; w /= 2) {
      for (int c = 0; c < w; ++c) prod[c] = _mm512_add_ps(prod[c], prod[c + w]);
    }
    const float v = _mm512_reduce_add_ps(prod[0]) * sc;
    key[seen] = slots[j];
    score[seen++] = v;
    mx = v > mx ? v : mx;
  }
  const float total = exp_shifted(score, seen, mx);
  __m512 acc[C];
  for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < seen; ++j) {
    const __m512 p = _mm512_set1_ps(score[j]);
    const T* vr = vc + key[j] * stride;
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(p, load16(vr + 16 * c), acc[c]);
  }
  const __m512 inv = _mm512_set1_ps(total > 0.f ? 1.f / total : 0.f);
  float tmp[16 * C];
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(tmp + 16 * c, _mm512_mul_ps(acc[c], inv));
  for (int i = 0; i < 16 * C; ++i) orow[i] = static_cast<T>(tmp[i]);
}
#endif

// Attention of query rows over paged keys, for sequences padded into a group: row q_index[g][i]
// (>= rows: padding) sees the cached slots gather[g][j] where mask[g][i][j], visited in j order
// (position order; a tree node's ancestors come before it). Softmax and the value sum run in
// float32; out rows not named by q_index are left as they are.
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& gather,
            const at::Tensor& q_index, const at::Tensor& mask, double scale, at::Tensor out) {
  check_heads(q, "q");
  check_heads(out, "out");
  const int64_t rows = q.size(0), nh = q.size(1), d = q.size(2), nkv = k_cache.size(1);
  const int64_t groups = gather.size(0), lmax = gather.size(1), qmax = q_index.size(1);
  TORCH_CHECK(nh % nkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) == d, "caches must be contiguous");
  TORCH_CHECK(gather.is_contiguous() && gather.scalar_type() == at::kLong, "gather must be contiguous int64");
  TORCH_CHECK(q_index.is_contiguous() && q_index.scalar_type() == at::kLong && q_index.size(0) == groups,
              "q_index must be contiguous int64 [groups, queries]");
  TORCH_CHECK(mask.is_contiguous() && mask.scalar_type() == at::kBool && mask.dim() == 3 && mask.size(0) == groups &&
                  mask.size(1) == qmax && mask.size(2) == lmax,
              "mask must be contiguous bool [groups, queries, keys]");
  TORCH_CHECK(out.size(0) == rows && out.size(1) == nh && out.size(2) == d, "out must be shaped like q");
  const int64_t slot_count = k_cache.size(0);
  const int64_t* gp = gather.data_ptr<int64_t>();
  for (int64_t i = 0; i < gather.numel(); ++i) TORCH_CHECK(gp[i] >= 0 && gp[i] < slot_count, "slot out of range");
  const int64_t per_kv = nh / nkv, sq0 = q.stride(0), sq1 = q.stride(1), so0 = out.stride(0), so1 = out.stride(1);
  dispatch(q.scalar_type(), "attend", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t* qi = q_index.data_ptr<int64_t>();
    const bool* mp = mask.data_ptr<bool>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float sc = static_cast<float>(scale);
    // one work item = (group, query, head); items never share a sum
    at::parallel_for(0, groups * qmax * nh, 4, [&](int64_t b, int64_t e) {
      std::vector<float> score(lmax);
      std::vector<int64_t> key(lmax);
      std::vector<float> acc(d);
      for (int64_t it = b; it < e; ++it) {
        const int64_t hh = it % nh, gi = it / nh;  // gi = group * qmax + query
        const int64_t row = qi[gi];
        if (row < 0 || row >= rows) continue;
        const int64_t g = gi / qmax, kvh = hh / per_kv;
        const scalar_t* qr = qp + row * sq0 + hh * sq1;
        const bool* m = mp + gi * lmax;
        const int64_t* slots = gp + g * lmax;
        scalar_t* orow = op + row * so0 + hh * so1;
#if defined(__AVX512F__)
        if (d == 64 || d == 128) {
          const scalar_t* kbase = kc + kvh * d;
          const scalar_t* vbase = vc + kvh * d;
          (d == 64 ? head_attend<4, scalar_t> : head_attend<8, scalar_t>)(
              qr, kbase, vbase, slots, m, lmax, nkv * d, sc, score.data(), key.data(), orow);
          continue;
        }
#endif
        int64_t seen = 0;
        float mx = -INFINITY;
        for (int64_t j = 0; j < lmax; ++j) {
          if (!m[j]) continue;
          float s = dot(qr, kc + (slots[j] * nkv + kvh) * d, d) * sc;
          key[seen] = slots[j];
          score[seen++] = s;
          mx = s > mx ? s : mx;
        }
        const float total = exp_shifted(score.data(), seen, mx);
        for (int64_t i = 0; i < d; ++i) acc[i] = 0.f;
        for (int64_t j = 0; j < seen; ++j) axpy(score[j], vc + (key[j] * nkv + kvh) * d, acc.data(), d);
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t i = 0; i < d; ++i) orow[i] = static_cast<scalar_t>(acc[i] * inv);
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
