// Vector helpers shared by the fused CPU kernels (cpu_ops.cpp, attend.cpp): loads that widen bf16/fp16
// to float32, e^x, and sums in one fixed order. Header-only so each kernel inlines them.
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>

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

// The largest of v's 8 lanes (exact in any order).
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

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

// x[i] = e^(x[i] - mx) for i < n.
inline void exp_inplace(float* x, int64_t n, float mx) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + kLanes <= n; i += kLanes) {
    _mm512_storeu_ps(x + i, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(mx))));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(mx))));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i] - mx);
}

// x[i] = e^(x[i] - mx) for i < n; returns their sum, added in index order.
inline float exp_shifted(float* x, int64_t n, float mx) {
  exp_inplace(x, n, mx);
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) total += x[j];
  return total;
}
inline void check_heads(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, name,
              " must be a CPU [rows, heads, head_dim] tensor with contiguous head_dim");
}

}  // namespace dspark::cpu
