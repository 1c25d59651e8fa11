// The AVX2 build's attention primitives (attend.cpp's AVX512 ones in 8 lanes): the register type
// and block helpers attend_causal_impl takes, heads_attend for short groups and its value sums.
// Included by attend.cpp alone, where the CPU has AVX2 but not AVX512.
#pragma once

#include "cpu_vec.h"

#include <cmath>
#include <cstdint>

namespace dspark::cpu {

constexpr int kVec = 8;
using VecF = __m256;
template <typename T>
inline VecF load_vec(const T* p) { return load8(p); }
inline void store_vec(float* p, VecF v) { _mm256_storeu_ps(p, v); }
inline VecF zero_vec() { return _mm256_setzero_ps(); }

// The largest of x[0..n) (-inf when n == 0): the same value in any order.
inline float max_of(const float* x, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + j));
  float mx = hmax8(m);
  for (; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

// The 8 lanes of v summed in one fixed tree (halves, then pairs).
inline float hsum8(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, 1));
}

// Chunks of the value sums held at once for NH heads: a power of two (so it divides C, 8 or 16)
// with G * NH at most 12 of the 16 registers.
constexpr int value_slice(int C, int NH) {
  int g = 1;
  while (2 * g <= C && 2 * g * NH <= 12) g *= 2;
  return g;
}

// The AVX512 path's softmax_values_heads in 8 lanes. 16 registers cannot hold every head's whole
// value sum, so the sums go by slices of G chunks and the keys are walked once per slice; a value
// row's slice is read once for all NH heads (one head at a time read it NH times: decode attention
// at 1,000 keys took 82 us a layer that way, 47-49 us this way). Each sum is the same chain of FMAs
// in key order whatever the slicing, so the bits do not depend on NH.
template <int C, int NH, typename T>
void softmax_values_heads(float* const* score, const float* mx, const int64_t* slots, int64_t n, const T* vc,
                          int64_t stride, T* const* orow) {
  constexpr int G = value_slice(C, NH);
  float total[NH];
  for (int h = 0; h < NH; ++h) {
    exp_inplace(score[h], n, mx[h]);
    total[h] = 0.f;
    for (int64_t j = 0; j < n; ++j) total[h] += score[h][j];
  }
  for (int c0 = 0; c0 < C; c0 += G) {
    __m256 acc[NH][G];
    for (int h = 0; h < NH; ++h) {
      for (int c = 0; c < G; ++c) acc[h][c] = _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = vc + slots[j] * stride + 8 * c0;
      __m256 v[G];
      for (int c = 0; c < G; ++c) v[c] = load8(vr + 8 * c);
      for (int h = 0; h < NH; ++h) {
        const __m256 p = _mm256_set1_ps(score[h][j]);
        for (int c = 0; c < G; ++c) acc[h][c] = _mm256_fmadd_ps(p, v[c], acc[h][c]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      const __m256 inv = _mm256_set1_ps(total[h] > 0.f ? 1.f / total[h] : 0.f);
      for (int c = 0; c < G; ++c) {
        float tmp[8];
        _mm256_storeu_ps(tmp, _mm256_mul_ps(acc[h][c], inv));
        for (int i = 0; i < 8; ++i) orow[h][8 * (c0 + c) + i] = static_cast<T>(tmp[i]);
      }
    }
  }
}

// The AVX512 path's heads_attend in 8 lanes: each score as two FMA chains over the C chunks (even
// and odd), added, then hsum8. The heads share each key's chunk loads; a head's bits do not depend
// on NH, so a row decoded alone and the same row in a chain or a prompt chunk agree.
template <int C, int NH, typename T>
void heads_attend(const T* const* qr, const T* kc, const T* vc, const int64_t* slots, const bool* m, int64_t lmax,
                  int64_t stride, float sc, float* const* score, int64_t* key, T* const* orow) {
  static_assert(C % 2 == 0, "head_dim must be a multiple of 16");
  float qf[NH][8 * C];  // the query rows in float32, read from L1 for every key
  float mx[NH];
  for (int h = 0; h < NH; ++h) {
    for (int i = 0; i < 8 * C; ++i) qf[h][i] = f32(qr[h][i]);
    mx[h] = -INFINITY;
  }
  int64_t seen = 0;
  for (int64_t j = 0; j < lmax; ++j) {
    if (!m[j]) continue;
    const T* kr = kc + slots[j] * stride;
    __m256 even[NH], odd[NH];
    for (int h = 0; h < NH; ++h) {
      even[h] = _mm256_mul_ps(_mm256_loadu_ps(qf[h]), load8(kr));
      odd[h] = _mm256_mul_ps(_mm256_loadu_ps(qf[h] + 8), load8(kr + 8));
    }
    for (int c = 2; c < C; c += 2) {
      const __m256 k0 = load8(kr + 8 * c), k1 = load8(kr + 8 * c + 8);
      for (int h = 0; h < NH; ++h) {
        even[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qf[h] + 8 * c), k0, even[h]);
        odd[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qf[h] + 8 * c + 8), k1, odd[h]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      const float v = hsum8(_mm256_add_ps(even[h], odd[h])) * sc;
      score[h][seen] = v;
      mx[h] = v > mx[h] ? v : mx[h];
    }
    key[seen++] = slots[j];
  }
  softmax_values_heads<C, NH>(score, mx, key, seen, vc, stride, orow);
}

// r[i][x] -> r[x][i]: an 8 x 8 float32 block transposed in registers (pairs, quads, then halves).
inline void transpose_block(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// heads_attend's scores of 8 consecutive keys at once, one key per lane: kt holds the keys
// transposed ([8 * C dims][8 keys]), qf the query row. Lane j computes exactly what heads_attend
// computes for key j: dim i of the even chunks in one FMA chain, of the odd ones in another, their
// sum, then hsum8's tree over the 8 dims (i + 4 onto i, then 2 onto 0 and 3 onto 1, then 1 onto
// 0), then the scale.
template <int C>
inline __m256 block_scores(const float* qf, const float* kt, float sc) {
  __m256 s[8];
  for (int i = 0; i < 8; ++i) {
    auto at = [&](int c) { return _mm256_loadu_ps(kt + (8 * c + i) * 8); };
    __m256 even = _mm256_mul_ps(_mm256_set1_ps(qf[i]), at(0));
    __m256 odd = _mm256_mul_ps(_mm256_set1_ps(qf[8 + i]), at(1));
    for (int c = 2; c < C; c += 2) {
      even = _mm256_fmadd_ps(_mm256_set1_ps(qf[8 * c + i]), at(c), even);
      odd = _mm256_fmadd_ps(_mm256_set1_ps(qf[8 * c + 8 + i]), at(c + 1), odd);
    }
    s[i] = _mm256_add_ps(even, odd);
  }
  for (int i = 0; i < 4; ++i) s[i] = _mm256_add_ps(s[i + 4], s[i]);
  const __m256 p0 = _mm256_add_ps(s[0], s[2]), p1 = _mm256_add_ps(s[1], s[3]);
  return _mm256_mul_ps(_mm256_add_ps(p0, p1), _mm256_set1_ps(sc));
}

}  // namespace dspark::cpu
