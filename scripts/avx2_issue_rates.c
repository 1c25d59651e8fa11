// How many AVX2 integer products this CPU issues per nanosecond on one core: the ceiling for
// quant_avx2.cpp's int4 and Q8_0 kernels past one row, where they stop being bound by memory.
// Twelve independent chains per instruction, so latency does not hide the throughput.
//
//     gcc -O2 -mavx2 -mfma scripts/avx2_issue_rates.c -o /tmp/rates && /tmp/rates
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define RATE(T, INIT, OP)                                                                              \
  {                                                                                                     \
    T a0 = INIT, a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,    \
      a10 = a0, a11 = a0, b = INIT;                                                                     \
    const long n = 50000000;                                                                            \
    const double t = now();                                                                             \
    for (long i = 0; i < n; i++) {                                                                      \
      a0 = OP(a0, b); a1 = OP(a1, b); a2 = OP(a2, b); a3 = OP(a3, b); a4 = OP(a4, b); a5 = OP(a5, b);   \
      a6 = OP(a6, b); a7 = OP(a7, b); a8 = OP(a8, b); a9 = OP(a9, b); a10 = OP(a10, b); a11 = OP(a11, b); \
      __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6),      \
                       "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));                              \
    }                                                                                                   \
    printf("%-22s %.2f per ns\n", #OP, 12.0 * n / (now() - t) / 1e9);                                  \
  }

static inline __m256 fma_ps(__m256 a, __m256 b) { return _mm256_fmadd_ps(a, b, b); }

int main(void) {
  RATE(__m256i, _mm256_set1_epi8(3), _mm256_maddubs_epi16)
  RATE(__m256i, _mm256_set1_epi8(3), _mm256_madd_epi16)
  RATE(__m256i, _mm256_set1_epi8(3), _mm256_add_epi16)
  RATE(__m256, _mm256_set1_ps(0.5f), fma_ps)
  return 0;
}
