// Attention of query rows over paged keys with one fixed summation order per row, so a token decoded
// alone, verified in a chain or tree, or computed as a prompt row in a chunk of any length gets the
// same bits: what keeps speculative output equal to plain output, and a cached prompt prefix equal
// to the same prefix computed again.

#include "ops.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#if defined(__AVX2__) && !defined(__AVX512F__)
#include "attend_avx2.h"
#endif

#include <algorithm>
#include <type_traits>
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

// NH query heads of one KV head over their visible keys (qr[h], orow[h], score[h]), head_dim =
// 16 * C held in registers: each score as C products added in a fixed pairwise tree, its 16 lanes
// summed by hsum16. The heads share each key's load; each head's bits do not depend on NH.
template <int C, int NH, typename T>
void heads_attend(const T* const* qr, const T* kc, const T* vc, const int64_t* slots, const bool* m, int64_t lmax,
                  int64_t stride, float sc, float* const* score, int64_t* key, T* const* orow) {
  __m512 qv[NH][C];
  float mx[NH];
  for (int h = 0; h < NH; ++h) {
    for (int c = 0; c < C; ++c) qv[h][c] = load16(qr[h] + 16 * c);
    mx[h] = -INFINITY;
  }
  int64_t seen = 0;
  for (int64_t j = 0; j < lmax; ++j) {
    if (!m[j]) continue;
    const T* kr = kc + slots[j] * stride;
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load16(kr + 16 * c);
    for (int h = 0; h < NH; ++h) {
      __m512 prod[C];
      for (int c = 0; c < C; ++c) prod[c] = _mm512_mul_ps(qv[h][c], kv[c]);
      for (int w = C / 2; w > 0; w /= 2) {
        for (int c = 0; c < w; ++c) prod[c] = _mm512_add_ps(prod[c], prod[c + w]);
      }
      const float v = hsum16(prod[0]) * sc;
      score[h][seen] = v;
      mx[h] = v > mx[h] ? v : mx[h];
    }
    key[seen++] = slots[j];
  }
  softmax_values_heads<C, NH>(score, mx, key, seen, vc, stride, orow);
}

// r[i][x] -> r[x][i]: a 16 x 16 float32 block transposed in registers (pairs, then quads, then
// 128-bit lanes twice).
inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e]: rows 4i .. 4i + 3 of element 4L + e in lane L
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 a = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88), b = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xdd);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
    const __m512 f = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xdd);
    t[e] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[8 + e] = _mm512_shuffle_f32x4(a, c, 0xdd);
    t[4 + e] = _mm512_shuffle_f32x4(b, f, 0x88);
    t[12 + e] = _mm512_shuffle_f32x4(b, f, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// heads_attend's scores of 16 consecutive keys at once, one key per lane: kt holds the keys
// transposed ([16 * C dims][16 keys], float32), qf the query row in float32. Lane j computes
// exactly what heads_attend computes for key j: the same products, the same pairwise tree over
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

// The ISA's register for attend_causal_impl: kVec floats (head_dim = kVec * C), and its loads,
// stores, key-block transpose and block scores.
constexpr int kVec = 16;
using VecF = __m512;
template <typename T>
inline VecF load_vec(const T* p) { return load16(p); }
inline void store_vec(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline VecF zero_vec() { return _mm512_setzero_ps(); }
inline void transpose_block(VecF* r) { transpose16(r); }
template <int C>
inline VecF block_scores(const float* qf, const float* kt, float sc) { return scores16<C>(qf, kt, sc); }
#endif

#ifdef DSPARK_REGISTER_ATTENTION
// Causal groups (prompt chunks and chains): row q_index[g][i] sees the first visible[g][i] keys of
// gather[g]. Each group's keys are transposed once per KV head into blocks of kVec, shared by every
// row and query head that reads them, so a long prompt chunk costs a few instructions per key and
// row instead of heads_attend's per-key horizontal sum, with heads_attend's bits.
template <int C, typename T>
void attend_causal_impl(const T* qp, int64_t sq0, int64_t sq1, const T* kc, const T* vc, int64_t nkv, int64_t nh,
                        const int64_t* gp, int64_t groups, int64_t lmax, const int64_t* qi, const int64_t* vis,
                        int64_t qmax, int64_t rows, float sc, T* op, int64_t so0, int64_t so1) {
  constexpr int64_t d = kVec * C;
  const int64_t nblk = (lmax + kVec - 1) / kVec, per_kv = nh / nkv, stride = nkv * d;
  // Each (group, KV head)'s keys transposed, once for every row and query head that reads them.
  // In the calling thread's scratch, kept between calls: every float read is written first, and a
  // fresh allocation of this size costs page faults each layer.
  const size_t block_floats = static_cast<size_t>(d) * kVec, blocks = static_cast<size_t>(groups * nkv * nblk);
  thread_local std::vector<float> scratch;
  if (scratch.size() < blocks * block_floats) scratch.resize(blocks * block_floats);
  float* const kt = scratch.data();
  at::parallel_for(0, groups * nkv * nblk, 4, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t blk = it % nblk, g = it / nblk / nkv, kvh = it / nblk % nkv;
      float* dst = kt + it * block_floats;
      const int64_t keys = std::min<int64_t>(kVec, lmax - blk * kVec);
      const T* kr[kVec];
      for (int64_t jj = 0; jj < keys; ++jj) kr[jj] = kc + gp[g * lmax + blk * kVec + jj] * stride + kvh * d;
      for (int c = 0; c < C; ++c) {
        VecF r[kVec];
        for (int64_t jj = 0; jj < kVec; ++jj) r[jj] = jj < keys ? load_vec(kr[jj] + kVec * c) : zero_vec();
        transpose_block(r);
        for (int x = 0; x < kVec; ++x) store_vec(dst + (kVec * c + x) * kVec, r[x]);
      }
    }
  });
  constexpr int64_t kRows = 4;  // query rows per work item
  constexpr int64_t kHeads = d == 64 ? 4 : 2;  // query heads of a KV head whose sums run side by side
  const int64_t rblk = (qmax + kRows - 1) / kRows;
  at::parallel_for(0, groups * nkv * rblk, 1, [&](int64_t b, int64_t e) {
    // scores[r][h] of the item's rows and the KV head's query heads; each block of keys is read
    // once for all of them while it sits in L1
    std::vector<float> score(kRows * per_kv * nblk * kVec);
    std::vector<float> qf(kRows * per_kv * d);
    for (int64_t it = b; it < e; ++it) {
      const int64_t rb = it % rblk, kvh = it / rblk % nkv, g = it / rblk / nkv;
      const float* ktg = kt + (g * nkv + kvh) * nblk * d * kVec;
      int64_t rowid[kRows], n[kRows], most = 0;
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t i = rb * kRows + r;
        rowid[r] = i < qmax ? qi[g * qmax + i] : -1;
        n[r] = i < qmax && rowid[r] >= 0 && rowid[r] < rows ? vis[g * qmax + i] : 0;
        TORCH_CHECK(n[r] <= lmax, "a row sees more keys than its group holds");
        most = std::max(most, n[r]);
        for (int64_t h = 0; h < per_kv && n[r] > 0; ++h) {
          const T* qr = qp + rowid[r] * sq0 + (kvh * per_kv + h) * sq1;
          for (int c = 0; c < C; ++c) store_vec(qf.data() + (r * per_kv + h) * d + kVec * c, load_vec(qr + kVec * c));
        }
      }
      for (int64_t blk = 0; blk * kVec < most; ++blk) {
        const float* kb = ktg + blk * d * kVec;
        for (int64_t r = 0; r < kRows; ++r) {
          if (blk * kVec >= n[r]) continue;
          for (int64_t h = 0; h < per_kv; ++h) {
            const int64_t rh = r * per_kv + h;
            store_vec(score.data() + rh * nblk * kVec + blk * kVec, block_scores<C>(qf.data() + rh * d, kb, sc));
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
            rows_h[h] = score.data() + (r * per_kv + h0 + h) * nblk * kVec;
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
      constexpr int64_t kMaxHeads = 4;  // query heads of one KV head attended side by side
      std::vector<float> score(kMaxHeads * lmax);
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
#ifdef DSPARK_REGISTER_ATTENTION
        if (d == 64 || d == 128) {
          // this item and the next ones of the same row and KV head in this range, at most kMaxHeads
          const int64_t nhere = std::min({kMaxHeads, (kvh + 1) * per_kv - hh, e - it});
          const scalar_t* qs[kMaxHeads];
          scalar_t* os[kMaxHeads];
          float* ss[kMaxHeads];
          for (int64_t h = 0; h < nhere; ++h) {
            qs[h] = qr + h * sq1;
            os[h] = orow + h * so1;
            ss[h] = score.data() + h * lmax;
          }
          const scalar_t* kbase = kc + kvh * d;
          const scalar_t* vbase = vc + kvh * d;
          const int64_t stride = nkv * d;
          auto run = [&](auto c_tag, auto nh_tag) {
            heads_attend<decltype(c_tag)::value, decltype(nh_tag)::value, scalar_t>(
                qs, kbase, vbase, slots, m, lmax, stride, sc, ss, key.data(), os);
          };
          auto by_heads = [&](auto c_tag) {
            switch (nhere) {
              case 1: run(c_tag, std::integral_constant<int, 1>{}); break;
              case 2: run(c_tag, std::integral_constant<int, 2>{}); break;
              case 3: run(c_tag, std::integral_constant<int, 3>{}); break;
              default: run(c_tag, std::integral_constant<int, 4>{}); break;
            }
          };
          if (d == 64) by_heads(std::integral_constant<int, 64 / kVec>{});
          else by_heads(std::integral_constant<int, 128 / kVec>{});
          it += nhere - 1;
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

#ifdef DSPARK_REGISTER_ATTENTION
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
    (d == 64 ? attend_causal_impl<64 / kVec, scalar_t> : attend_causal_impl<128 / kVec, scalar_t>)(
        q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        nkv, nh, gp, groups, lmax, q_index.data_ptr<int64_t>(), visible.data_ptr<int64_t>(), qmax, rows,
        static_cast<float>(scale), out.data_ptr<scalar_t>(), out.stride(0), out.stride(1));
  });
}
#endif

}  // namespace dspark::cpu
