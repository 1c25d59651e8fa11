// Attention of query rows over paged keys with one fixed summation order per row, so a token decoded
// alone, verified in a chain or tree, or computed as a prompt row in a chunk of any length gets the
// same bits: what keeps speculative output equal to plain output, and a cached prompt prefix equal
// to the same prefix computed again.

#include "ops.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace dspark::cpu {

#if defined(__AVX512F__)
// The 16 lanes of v summed in one fixed tree (halves, quarters, then pairs), written out so that
// attend_causal can repeat it across keys whatever the compiler's own reduction does.
inline float hsum16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_extractf32x8_ps(v, 1), _mm512_castps512_ps256(v));
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  const __m128 p = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, 1));
}

// The largest of x[0..n) (-inf when n == 0): the same value in any order.
inline float max_of(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + j));
  float mx = _mm512_reduce_max_ps(m);
  for (; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

// The softmax of n scores (already scaled; mx their maximum) and the value sum over their keys in
// order, for NH query heads of one KV head at once, into orow[h]: the second half of every
// attention row. Each head sums alone and in order; the heads' sums run side by side
// (independent dependency chains, where one head alone waits on each add) and share each value
// row's load.
template <int C, int NH, typename T>
void softmax_values_heads(float* const* score, const float* mx, const int64_t* slots, int64_t n, const T* vc,
                          int64_t stride, T* const* orow) {
  float total[NH];
  for (int h = 0; h < NH; ++h) {
    exp_inplace(score[h], n, mx[h]);
    total[h] = 0.f;
  }
  for (int64_t j = 0; j < n; ++j) {
    for (int h = 0; h < NH; ++h) total[h] += score[h][j];
  }
  __m512 acc[NH][C];
  for (int h = 0; h < NH; ++h) {
    for (int c = 0; c < C; ++c) acc[h][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = vc + slots[j] * stride;
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(vr + 16 * c);
    for (int h = 0; h < NH; ++h) {
      const __m512 p = _mm512_set1_ps(score[h][j]);
      for (int c = 0; c < C; ++c) acc[h][c] = _mm512_fmadd_ps(p, v[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m512 inv = _mm512_set1_ps(total[h] > 0.f ? 1.f / total[h] : 0.f);
    float tmp[16 * C];
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(tmp + 16 * c, _mm512_mul_ps(acc[h][c], inv));
    for (int i = 0; i < 16 * C; ++i) orow[h][i] = static_cast<T>(tmp[i]);
  }
}

// One query head over its visible keys with head_dim = 16 * C held in registers: each score as C
// products added in a fixed pairwise tree, its 16 lanes summed by hsum16.
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
    const float v = hsum16(prod[0]) * sc;
    key[seen] = slots[j];
    score[seen++] = v;
    mx = v > mx ? v : mx;
  }
  float* scores[1] = {score};
  T* out[1] = {orow};
  softmax_values_heads<C, 1>(scores, &mx, key, seen, vc, stride, out);
}

// head_attend's scores of 16 consecutive keys at once, one key per lane: kt holds the keys
// transposed ([16 * C dims][16 keys], float32), qf the query row in float32. Lane j computes
// exactly what head_attend computes for key j: the same products, the same pairwise tree over
// the C chunks, then hsum16's tree over the 16 dims of a chunk, then the scale.
template <int C>
inline __m512 scores16(const float* qf, const float* kt, float sc) {
  __m512 u[16];
  for (int i = 0; i < 16; ++i) {
    __m512 prod[C];
    for (int c = 0; c < C; ++c) prod[c] = _mm512_mul_ps(_mm512_set1_ps(qf[16 * c + i]), _mm512_loadu_ps(kt + (16 * c + i) * 16));
    for (int w = C / 2; w > 0; w /= 2) {
      for (int c = 0; c < w; ++c) prod[c] = _mm512_add_ps(prod[c], prod[c + w]);
    }
    u[i] = prod[0];
  }
  for (int i = 0; i < 8; ++i) u[i] = _mm512_add_ps(u[i + 8], u[i]);
  for (int i = 0; i < 4; ++i) u[i] = _mm512_add_ps(u[i + 4], u[i]);
  const __m512 s = _mm512_add_ps(_mm512_add_ps(u[0], u[2]), _mm512_add_ps(u[1], u[3]));
  return _mm512_mul_ps(s, _mm512_set1_ps(sc));
}

// Causal groups (prompt chunks and chains): row q_index[g][i] sees the first visible[g][i] keys of
// gather[g]. Each group's keys are transposed once per KV head into blocks of 16, shared by every
// row and query head that reads them, so a long prompt chunk costs a few instructions per key and
// row instead of head_attend's per-key horizontal sum, with head_attend's bits.
template <int C, typename T>
void attend_causal_impl(const T* qp, int64_t sq0, int64_t sq1, const T* kc, const T* vc, int64_t nkv, int64_t nh,
                        const int64_t* gp, int64_t groups, int64_t lmax, const int64_t* qi, const int64_t* vis,
                        int64_t qmax, int64_t rows, float sc, T* op, int64_t so0, int64_t so1) {
  constexpr int64_t d = 16 * C;
  const int64_t nblk = (lmax + 15) / 16, per_kv = nh / nkv, stride = nkv * d;
  std::vector<float> kt(static_cast<size_t>(groups * nkv * nblk) * d * 16);
  at::parallel_for(0, groups * nkv * nblk, 4, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t blk = it % nblk, g = it / nblk / nkv, kvh = it / nblk % nkv;
      float* dst = kt.data() + it * d * 16;
      for (int64_t jj = 0; jj < 16; ++jj) {
        const int64_t j = blk * 16 + jj;
        if (j >= lmax) {
          for (int64_t x = 0; x < d; ++x) dst[x * 16 + jj] = 0.f;
          continue;
        }
        const T* kr = kc + gp[g * lmax + j] * stride + kvh * d;
        float tmp[d];
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(tmp + 16 * c, load16(kr + 16 * c));
        for (int64_t x = 0; x < d; ++x) dst[x * 16 + jj] = tmp[x];
      }
    }
  });
  constexpr int64_t kRows = 4;  // query rows per work item
  constexpr int64_t kHeads = C == 4 ? 4 : 2;  // query heads of a KV head whose sums run side by side
  const int64_t rblk = (qmax + kRows - 1) / kRows;
  at::parallel_for(0, groups * nkv * rblk, 1, [&](int64_t b, int64_t e) {
    // scores[r][h] of the item's rows and the KV head's query heads; each block of keys is read
    // once for all of them while it sits in L1
    std::vector<float> score(kRows * per_kv * nblk * 16);
    std::vector<float> qf(kRows * per_kv * d);
    for (int64_t it = b; it < e; ++it) {
      const int64_t rb = it % rblk, kvh = it / rblk % nkv, g = it / rblk / nkv;
      const float* ktg = kt.data() + (g * nkv + kvh) * nblk * d * 16;
      int64_t rowid[kRows], n[kRows], most = 0;
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t i = rb * kRows + r;
        rowid[r] = i < qmax ? qi[g * qmax + i] : -1;
        n[r] = i < qmax && rowid[r] >= 0 && rowid[r] < rows ? vis[g * qmax + i] : 0;
        TORCH_CHECK(n[r] <= lmax, "a row sees more keys than its group holds");
        most = std::max(most, n[r]);
        for (int64_t h = 0; h < per_kv && n[r] > 0; ++h) {
          const T* qr = qp + rowid[r] * sq0 + (kvh * per_kv + h) * sq1;
          for (int c = 0; c < C; ++c) _mm512_storeu_ps(qf.data() + (r * per_kv + h) * d + 16 * c, load16(qr + 16 * c));
        }
      }
      for (int64_t blk = 0; blk * 16 < most; ++blk) {
        const float* kb = ktg + blk * d * 16;
        for (int64_t r = 0; r < kRows; ++r) {
          if (blk * 16 >= n[r]) continue;
          for (int64_t h = 0; h < per_kv; ++h) {
            const int64_t rh = r * per_kv + h;
            _mm512_storeu_ps(score.data() + rh * nblk * 16 + blk * 16, scores16<C>(qf.data() + rh * d, kb, sc));
          }
        }
      }
      const int64_t* slots = gp + g * lmax;
      const T* vkv = vc + kvh * d;
      for (int64_t r = 0; r < kRows; ++r) {
        if (n[r] <= 0) continue;
        for (int64_t h0 = 0; h0 < per_kv; h0 += kHeads) {
          const int64_t nhere = std::min(kHeads, per_kv - h0);
          float* rows_h[kHeads];
          float mx[kHeads];
          T* out_h[kHeads];
          for (int64_t h = 0; h < nhere; ++h) {
            rows_h[h] = score.data() + (r * per_kv + h0 + h) * nblk * 16;
            out_h[h] = op + rowid[r] * so0 + (kvh * per_kv + h0 + h) * so1;
            mx[h] = max_of(rows_h[h], n[r]);
          }
          switch (nhere) {
            case 1: softmax_values_heads<C, 1>(rows_h, mx, slots, n[r], vkv, stride, out_h); break;
            case 2: softmax_values_heads<C, 2>(rows_h, mx, slots, n[r], vkv, stride, out_h); break;
            case 3: softmax_values_heads<C, kHeads >= 3 ? 3 : 1>(rows_h, mx, slots, n[r], vkv, stride, out_h); break;
            default: softmax_values_heads<C, kHeads>(rows_h, mx, slots, n[r], vkv, stride, out_h); break;
          }
        }
      }
    }
  });
}
#endif

// The checks attend and attend_causal share: q and out [rows, heads, head_dim], contiguous caches
// [slots, kv heads, head_dim], gather [groups, keys] of slots in range, q_index [groups, queries].
void check_group(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& gather,
                 const at::Tensor& q_index, const at::Tensor& out) {
  check_heads(q, "q");
  check_heads(out, "out");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) == q.size(2),
              "caches must be contiguous");
  TORCH_CHECK(gather.is_contiguous() && gather.scalar_type() == at::kLong, "gather must be contiguous int64");
  TORCH_CHECK(q_index.is_contiguous() && q_index.scalar_type() == at::kLong && q_index.size(0) == gather.size(0),
              "q_index must be contiguous int64 [groups, queries]");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be shaped like q");
  const int64_t slot_count = k_cache.size(0);
  const int64_t* gp = gather.data_ptr<int64_t>();
  for (int64_t i = 0; i < gather.numel(); ++i) TORCH_CHECK(gp[i] >= 0 && gp[i] < slot_count, "slot out of range");
}

// Attention of query rows over paged keys, for sequences padded into a group: row q_index[g][i]
// (>= rows: padding) sees the cached slots gather[g][j] where mask[g][i][j], visited in j order
// (position order; a tree node's ancestors come before it). Softmax and the value sum run in
// float32; out rows not named by q_index are left as they are.
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& gather,
            const at::Tensor& q_index, const at::Tensor& mask, double scale, at::Tensor out) {
  check_group(q, k_cache, v_cache, gather, q_index, out);
  const int64_t rows = q.size(0), nh = q.size(1), d = q.size(2), nkv = k_cache.size(1);
  const int64_t groups = gather.size(0), lmax = gather.size(1), qmax = q_index.size(1);
  TORCH_CHECK(mask.is_contiguous() && mask.scalar_type() == at::kBool && mask.dim() == 3 && mask.size(0) == groups &&
                  mask.size(1) == qmax && mask.size(2) == lmax,
              "mask must be contiguous bool [groups, queries, keys]");
  const int64_t* gp = gather.data_ptr<int64_t>();
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
void attend_causal(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& gather,
                   const at::Tensor& q_index, const at::Tensor& visible, double scale, at::Tensor out) {
  check_group(q, k_cache, v_cache, gather, q_index, out);
  const int64_t rows = q.size(0), nh = q.size(1), d = q.size(2), nkv = k_cache.size(1);
  const int64_t groups = gather.size(0), lmax = gather.size(1), qmax = q_index.size(1);
  TORCH_CHECK(d == 64 || d == 128, "attend_causal: head_dim must be 64 or 128");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "q, the caches and out must share a dtype");
  TORCH_CHECK(visible.is_contiguous() && visible.scalar_type() == at::kLong && visible.sizes() == q_index.sizes(),
              "visible must be contiguous int64 shaped like q_index");
  const int64_t* gp = gather.data_ptr<int64_t>();
  dispatch(q.scalar_type(), "attend_causal", [&](auto tag) {
    using scalar_t = decltype(tag);
    (d == 64 ? attend_causal_impl<4, scalar_t> : attend_causal_impl<8, scalar_t>)(
        q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        nkv, nh, gp, groups, lmax, q_index.data_ptr<int64_t>(), visible.data_ptr<int64_t>(), qmax, rows,
        static_cast<float>(scale), out.data_ptr<scalar_t>(), out.stride(0), out.stride(1));
  });
}
#endif

}  // namespace dspark::cpu
