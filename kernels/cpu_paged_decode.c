// Paged decode attention for the CPU (float32, bfloat16, float16 K/V; float32 arithmetic): one query token per sequence, K/V read in place
// through the block table, never gathered into a contiguous copy. All query heads of a KV head are
// served from one read of each K/V row (grouped-query attention). Online softmax, block by block.
// Compiled at first use with the system C compiler and called through ctypes. Sequence ranges run
// in parallel on OpenMP threads: linked by soname to the libgomp torch has already loaded, they are
// torch's own workers, so no second pool competes with them for the cores. Head sizes must be
// multiples of 8: rows are processed as 8-float vectors (vector extensions of GCC >= 12 or Clang).
// The element-typed functions live in cpu_paged_decode_body.h, instantiated at the end of this file:
// paged_decode_{f32,bf16,f16}_ranges (f16 where the compiler has _Float16).
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
static inline v8 load8_f16(const _Float16 *p) {
  v8h h;
  memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, v8);
}

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

// Write this step's K/V rows of n tokens into their pool slots (slot < 0: padding, skipped). The
// sources are strided views ([token, head, dim] with any token/head stride in elements, unit dim
// stride) of the pool's element type, elem_bytes wide: the rows are copied, never converted.
void store_kv(char *k_cache, char *v_cache, const char *k, const char *v, const int64_t *slots, int n,
              int num_kv_heads, int head_dim, int head_dim_v, int64_t k_token_stride,
              int64_t k_head_stride, int64_t v_token_stride, int64_t v_head_stride, int elem_bytes) {
  const size_t k_row = (size_t)head_dim * elem_bytes, v_row = (size_t)head_dim_v * elem_bytes;
  for (int i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    char *kd = k_cache + slots[i] * num_kv_heads * k_row;
    char *vd = v_cache + slots[i] * num_kv_heads * v_row;
    for (int h = 0; h < num_kv_heads; ++h) {
      memcpy(kd + h * k_row, k + (i * k_token_stride + h * k_head_stride) * elem_bytes, k_row);
      memcpy(vd + h * v_row, v + (i * v_token_stride + h * v_head_stride) * elem_bytes, v_row);
    }
  }
}

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
#undef WIDEN_BLOCKS
