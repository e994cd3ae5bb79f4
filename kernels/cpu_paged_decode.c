// Paged decode attention for the CPU (float32, bfloat16, float16 K/V; float32 arithmetic): one query token per sequence, K/V read in place
// through the block table, never gathered into a contiguous copy. All query heads of a KV head are
// served from one read of each K/V row (grouped-query attention). Two passes over the context with
// an exact softmax between them (cpu_paged_decode_body.h says why).
// Compiled at first use with the system C compiler and called through ctypes. Sequence ranges run
// in parallel on OpenMP threads: linked by soname to the libgomp torch has already loaded, they are
// torch's own workers, so no second pool competes with them for the cores. Head sizes must be
// multiples of 8: rows are processed as 8-float vectors (vector extensions of GCC >= 12 or Clang).
// The element-typed functions live in cpu_paged_decode_body.h, instantiated at the end of this file:
// paged_decode_ranges_{f32,bf16,f16} and store_kv_{...} (queries and pool of one type), and
// _f32_kv_{bf16,f16} (float32 queries over a 16-bit pool); f16 where the compiler has _Float16.
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h" /* v8, load8, store8 */

typedef int32_t v8i __attribute__((vector_size(32)));

#ifdef __FLT16_MAX__  // _Float16 (GCC >= 12, Clang): float16 K/V
#ifdef __F16C__  // x86: one vcvtph2ps / vcvtps2ph per 8 values (GCC 12 converts lane by lane otherwise)
#include <immintrin.h>
static inline v8 load8_f16(const _Float16 *p) {
  return (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline void store8_f16(_Float16 *p, v8 v) {
  _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT));
}
#else
typedef _Float16 v8h __attribute__((vector_size(16)));
WIDENING_LOAD8(load8_f16, _Float16)

static inline void store8_f16(_Float16 *p, v8 v) {
  const v8h h = __builtin_convertvector(v, v8h);
  memcpy(p, &h, sizeof h);
}
#endif
#endif

static inline float hsum8(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// exp(x) for x <= 0 (logit minus running maximum), 8 lanes at once: Cephes' expf polynomial after
// x = n ln2 + r, |r| <= ln2 / 2; lanes below -87.3 (and -inf) give 0. About 1 ulp from expf.
static inline v8 exp8_nonpos(v8 x) {
  const v8 lo = (v8){0} - 87.3f;
  const v8i under = x < lo;
  x = (v8)(((v8i)x & ~under) | ((v8i)lo & under));
  const v8i n = __builtin_convertvector(x * 1.44269504f - 0.5f, v8i);  // round to nearest, x <= 0
  const v8 nf = __builtin_convertvector(n, v8);
  const v8 r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
  v8 p = (v8){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const v8 scale = (v8)((n + 127) << 23);  // 2^n
  return (v8)((v8i)(p * scale) & ~under);
}

// Lane j of the result is the sum of the 8 lanes of a[j]: 8 dot products finished at once.
static inline v8 sum_lanes8(const v8 *a) {
#define PAIRS(x, y, i0, i1, i2, i3, i4, i5, i6, i7) \
  __builtin_shufflevector(x, y, i0, i1, i2, i3, i4, i5, i6, i7)
  v8 p[4], r[2];
  for (int j = 0; j < 4; ++j)
    p[j] = PAIRS(a[2 * j], a[2 * j + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
           PAIRS(a[2 * j], a[2 * j + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int j = 0; j < 2; ++j)
    r[j] = PAIRS(p[2 * j], p[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           PAIRS(p[2 * j], p[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return PAIRS(r[0], r[1], 0, 1, 2, 3, 8, 9, 10, 11) + PAIRS(r[0], r[1], 4, 5, 6, 7, 12, 13, 14, 15);
#undef PAIRS
}

// q . k for one key row (float32: the block as the passes read it): four independent accumulators
// hide the FMA latency.
static inline float dot8(const v8 *q, const float *k, int chunks) {
  v8 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
  int c = 0;
  for (; c + 4 <= chunks; c += 4) {
    s0 += q[c] * load8(k + 8 * c);
    s1 += q[c + 1] * load8(k + 8 * c + 8);
    s2 += q[c + 2] * load8(k + 8 * c + 16);
    s3 += q[c + 3] * load8(k + 8 * c + 24);
  }
  for (; c < chunks; ++c) s0 += q[c] * load8(k + 8 * c);
  return hsum8((s0 + s1) + (s2 + s3));
}

// State s of `states` prefetches its share of the next block's lines: spread over the block's work,
// the reads of the next block overlap its arithmetic. (Issued all at once ahead of a pass, they
// filled the core's miss buffers: batch-16 calls 1.4x slower, AMD EPYC Zen 3; prefetching two blocks
// ahead instead of one, or none, was slower too.)
static inline void prefetch_share(const char *next, size_t lines, int s, int states) {
  const size_t share = (lines + states - 1) / states, l0 = s * share;
  for (size_t i = l0; i < l0 + share && i < lines; ++i) __builtin_prefetch(next + 64 * i, 0, 3);
}

// Pass 1 over one block of n K rows for states [0, states) (state j * num_heads + i: query head i
// of the j-th member): logits[state * lstride + pos, + n). State by state, so the block stays in L1
// while its query heads read it; each state prefetches its share of the next block's lines.
static void block_logits(int states, int num_heads, int g, int kc, int lstride, const v8 *qs,
                         float *logits, int pos, const float *k, int n, size_t k_row, int head_dim,
                         const char *next, size_t next_lines) {
  for (int s = 0; s < states; ++s) {
    prefetch_share(next, next_lines, s, states);
    const float *kh = k + (size_t)(s % num_heads / g) * head_dim;  // KV head of query head s % num_heads
    const v8 *qv = qs + s * kc;
    float *li = logits + (size_t)s * lstride + pos;
    int t = 0;
    for (; t + 8 <= n; t += 8) {  // 8 rows at a time: 8 independent FMA chains
      v8 d[8] = {{0}};
      for (int c = 0; c < kc; ++c) {
        const v8 qc = qv[c];
        for (int r = 0; r < 8; ++r) d[r] += qc * load8(kh + (t + r) * k_row + 8 * c);
      }
      const v8 sums = sum_lanes8(d);
      memcpy(li + t, &sums, sizeof sums);
    }
    for (; t < n; ++t) li[t] = dot8(qv, kh + t * k_row, kc);
  }
}

// Pass 2 over one block of n V rows: acc[state] += sum over its rows of p[pos + t] * v[t], output
// chunks 8 vectors at a time in registers over the rows.
static void block_values(int states, int num_heads, int g, int vc, int lstride, v8 *acc,
                         const float *probs, int pos, const float *v, int n, size_t v_row,
                         int head_dim_v, const char *next, size_t next_lines) {
  for (int s = 0; s < states; ++s) {
    prefetch_share(next, next_lines, s, states);
    const float *vh = v + (size_t)(s % num_heads / g) * head_dim_v;
    const float *p = probs + (size_t)s * lstride + pos;
    v8 *a = acc + s * vc;
    for (int c0 = 0; c0 < vc; c0 += 8) {
      const int w = vc - c0 < 8 ? vc - c0 : 8;
      v8 o[8];
      for (int c = 0; c < 8; ++c) o[c] = c < w ? a[c0 + c] : (v8){0};
      for (int t = 0; t < n; ++t) {
        const float pt = p[t];
        const float *vt = vh + t * v_row + 8 * c0;
        if (w == 8)
          for (int c = 0; c < 8; ++c) o[c] += pt * load8(vt + 8 * c);
        else
          for (int c = 0; c < w; ++c) o[c] += pt * load8(vt + 8 * c);
      }
      for (int c = 0; c < w; ++c) a[c0 + c] = o[c];
    }
  }
}

// Softmax of one state's logits row [0, n) in place (probabilities, unnormalised: exp(x - max)),
// padding lanes to a multiple of 8 set to probability 0; returns the maximum and stores the sum.
static float softmax_row(float *li, int n, float softcap, float *sum) {
  if (softcap > 0.f)
    for (int t = 0; t < n; ++t) li[t] = softcap * tanhf(li[t] / softcap);
  const int n8 = (n + 7) & ~7;
  for (int t = n; t < n8; ++t) li[t] = -INFINITY;
  v8 mx = load8(li);
  for (int t = 8; t < n8; t += 8) {
    const v8 x = load8(li + t);
    const v8i gt = x > mx;
    mx = (v8)(((v8i)x & gt) | ((v8i)mx & ~gt));
  }
  float m = mx[0];
  for (int i = 1; i < 8; ++i) m = mx[i] > m ? mx[i] : m;
  v8 sum8 = {0};
  for (int t = 0; t < n8; t += 8) {
    const v8 p = exp8_nonpos(load8(li + t) - m);
    store8(li + t, p);
    sum8 += p;
  }
  *sum = hsum8(sum8);
  return m;
}

// One piece of a group's context: n rows of K/V at pool slot `slot`, logit position pos, read by
// members [j0, j1) of the group.
typedef struct {
  size_t slot;
  int n, pos, j0, j1;
} piece;

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

#define ELEM float
#define LOAD8 load8
#define STORE8 store8
#define FN(name) CAT(name, f32)
#include "cpu_paged_decode_body.h"
#undef ELEM
#undef LOAD8
#undef STORE8
#undef FN

#define WIDEN_BLOCKS  // the 16-bit instantiations below
#define ELEM uint16_t
#define LOAD8 load8_bf16
#define STORE8 store8_bf16
#define FN(name) CAT(name, bf16)
#include "cpu_paged_decode_body.h"
#undef ELEM
#undef LOAD8
#undef STORE8
#undef FN

#ifdef __FLT16_MAX__
#define ELEM _Float16
#define LOAD8 load8_f16
#define STORE8 store8_f16
#define FN(name) CAT(name, f16)
#include "cpu_paged_decode_body.h"
#undef ELEM
#undef LOAD8
#undef STORE8
#undef FN
#endif

// float32 activations over a 16-bit pool (--kv-cache-dtype): paged_decode_ranges_f32_kv_bf16, _f16
#define QELEM float
#define QLOAD8 load8
#define QSTORE8 store8
#define ELEM uint16_t
#define LOAD8 load8_bf16
#define STORE8 store8_bf16
#define FN(name) CAT(name, f32_kv_bf16)
#include "cpu_paged_decode_body.h"
#undef ELEM
#undef LOAD8
#undef STORE8
#undef FN

#ifdef __FLT16_MAX__
#define QELEM float
#define QLOAD8 load8
#define QSTORE8 store8
#define ELEM _Float16
#define LOAD8 load8_f16
#define STORE8 store8_f16
#define FN(name) CAT(name, f32_kv_f16)
#include "cpu_paged_decode_body.h"
#undef ELEM
#undef LOAD8
#undef STORE8
#undef FN
#endif
#undef WIDEN_BLOCKS
