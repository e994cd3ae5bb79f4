// Paged decode attention for the CPU (float32, bfloat16, float16 K/V; float32 sums, and in the
// bfloat16 instantiation bfloat16 pair products, DOT_BF16): one query token per sequence, K/V read in place
// through the block table, never gathered into a contiguous copy. All query heads of a KV head are
// served from one read of each K/V row (grouped-query attention). Two passes over the context with
// an exact softmax between them (cpu_paged_decode_body.h says why).
// Compiled at first use with the system C compiler and called through ctypes. Sequence ranges run
// in parallel on OpenMP threads: linked by soname to the libgomp torch has already loaded, they are
// torch's own workers, so no second pool competes with them for the cores. Head sizes must be
// multiples of 8: rows are processed 16 floats at a time, a last 8 alone (vector extensions of GCC >= 12 or Clang).
// The element-typed functions live in cpu_paged_decode_body.h, instantiated at the end of this file:
// paged_decode_ranges_{f32,bf16,f16} and store_kv_{...} (queries and pool of one type), and
// _f32_kv_{bf16,f16} (float32 queries over a 16-bit pool); f16 where the compiler has _Float16. Both
// check every slot, block id, context length and row they are given first (cpu_bounds.h).
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bounds.h" /* the entry points' index checks, refusal */
#include "cpu_vec.h" /* v8, load8, store8, and from and to bfloat16 */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* the vector intrinsics below; _mm_getcsr (DOT_BF16) */
#endif

typedef int32_t v8i __attribute__((vector_size(32)));

#ifdef __FLT16_MAX__  // _Float16 (GCC >= 12, Clang): float16 K/V
#ifdef __F16C__  // x86: one vcvtph2ps / vcvtps2ph per 8 values (GCC 12 converts lane by lane otherwise)
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

// 16 floats: two 8-float chunks side by side, one AVX-512 register (two AVX2 ones, the same lanes
// and so the same bits). A 16-bit row is widened 16 values per conversion.
typedef float v16 __attribute__((vector_size(64)));

static inline v16 cat16(v8 a, v8 b) {
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
static inline v8 lo8(v16 v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline v8 hi8(v16 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }

static inline v16 load16(const float *p) {
  v16 v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

#ifdef __AVX512F__  // one vpmovzxwd (or vcvtph2ps) of 16 values; GCC splits the portable form in two
static inline v16 load16_bf16(const uint16_t *p) {
  return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
#ifdef __FLT16_MAX__
static inline v16 load16_f16(const _Float16 *p) {
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#endif
#else
static inline v16 load16_bf16(const uint16_t *p) { return cat16(load8_bf16(p), load8_bf16(p + 8)); }
#ifdef __FLT16_MAX__
static inline v16 load16_f16(const _Float16 *p) { return cat16(load8_f16(p), load8_f16(p + 8)); }
#endif
#endif

// bfloat16 logits (the bfloat16 instantiation): q . k as pair dot products, 32 values (16 pairs) a
// chunk into 16 lanes; lane l adds q[2l+1] k[2l+1], then q[2l] k[2l], each product exact and each sum
// rounded once. That is vdpbf16ps (AVX512_BF16), its order checked lane for lane, and two FMAs on the
// widened halves elsewhere; with subnormals flushed as vdpbf16ps flushes them (MXCSR's FTZ and
// DAZ for the whole call in every build), the two give the same bits.
typedef uint32_t v16u __attribute__((vector_size(64)));

// 32 values of a bfloat16 row as pairs; pair_tail: the last `left` (< 32) values, zero-padded.
static inline __attribute__((always_inline)) v16u pair_chunk(const uint16_t *p) {
  v16u v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline __attribute__((always_inline)) v16u pair_tail(const uint16_t *p, int left) {
#ifdef __AVX512BW__
  return (v16u)_mm512_maskz_loadu_epi16((__mmask32)((1u << left) - 1), p);
#else
  v16u v = {0};
  memcpy(&v, p, (size_t)left * 2);
  return v;
#endif
}

static inline __attribute__((always_inline)) v16 dot_pairs(v16 acc, v16u q, v16u k) {
#ifdef __AVX512BF16__
  return (v16)_mm512_dpbf16_ps((__m512)acc, (__m512bh)q, (__m512bh)k);
#else
  const v16u hi = (v16u){0} + 0xffff0000u;
  acc += (v16)(q & hi) * (v16)(k & hi);
  return acc + (v16)(q << 16) * (v16)(k << 16);
#endif
}

static inline float hsum8(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// A row's 8 lanes summed as sum_lanes8 sums each of its rows (neighbouring lanes first), so that a
// dot product finished alone has the bits it has finished among 8: a row's logit must not depend on
// where a piece of its context starts (block size, sliding window).
static inline float hsum8_rows(v8 v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
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

// exp's reduction and polynomial, shared by the 8- and 16-lane forms (the same operations lane for
// lane): declares n (x / ln2 rounded to nearest, x <= 0), nf (n as floats) and p (exp(x - n ln2)).
#define EXP_NONPOS_POLY(VI, V, x, n, nf, p)                                 \
  const VI n = __builtin_convertvector(x * 1.44269504f - 0.5f, VI);         \
  const V nf = __builtin_convertvector(n, V);                               \
  const V r_##p = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;            \
  V p = (V){0} + 1.9875691500e-4f;                                          \
  p = p * r_##p + 1.3981999507e-3f;                                         \
  p = p * r_##p + 8.3334519073e-3f;                                         \
  p = p * r_##p + 4.1665795894e-2f;                                         \
  p = p * r_##p + 1.6666665459e-1f;                                         \
  p = p * r_##p + 5.0000001201e-1f;                                         \
  p = p * r_##p * r_##p + r_##p + 1.f

#ifndef __AVX512F__
// AVX2: exp16_nonpos, max16 and softmax_row below in 8-lane halves, the same operations lane for lane
// (16-float vectors live in memory between operations in GCC 12's AVX2 code: a slow pass).
static inline v8 exp8_nonpos(v8 x) {
  const v8 lo = (v8){0} - 87.3f;
  const v8i under = x < lo;
  x = (v8)(((v8i)x & ~under) | ((v8i)lo & under));
  EXP_NONPOS_POLY(v8i, v8, x, n, nf, p);
  const v8 scale = (v8)((n + 127) << 23);  // 2^n
  return (v8)((v8i)(p * scale) & ~under);
}

static inline v8 max8(v8 x, v8 m) {
  const v8i gt = x > m;
  return (v8)(((v8i)x & gt) | ((v8i)m & ~gt));
}

// put_probs, 8 values
static inline v8 put_probs8(float *li, int t, v8 p, int bf16) {
  if (!bf16) {
    store8(li + t, p);
    return p;
  }
  store8_bf16((uint16_t *)li + t, p);
  return round8_bf16(p);
}

// softmax_row as below, 8 lanes at a time (the sum is taken 8 lanes at a time in t order there too)
static float softmax_row(float *li, int n, float softcap, float *sum, int bf16) {
  if (softcap > 0.f)
    for (int t = 0; t < n; ++t) li[t] = softcap * tanhf(li[t] / softcap);
  const int n8 = (n + 7) & ~7;
  for (int t = n; t < n8; ++t) li[t] = -INFINITY;
  v8 mx[4] = {(v8){0} - INFINITY, (v8){0} - INFINITY, (v8){0} - INFINITY, (v8){0} - INFINITY};
  int t = 0;
  for (; t + 32 <= n8; t += 32)
    for (int j = 0; j < 4; ++j) mx[j] = max8(load8(li + t + 8 * j), mx[j]);
  for (; t < n8; t += 8) mx[0] = max8(load8(li + t), mx[0]);
  for (int j = 1; j < 4; ++j) mx[0] = max8(mx[j], mx[0]);
  float m = mx[0][0];
  for (int i = 1; i < 8; ++i) m = mx[0][i] > m ? mx[0][i] : m;
  v8 sum8 = {0};
  for (t = 0; t < n8; t += 8) sum8 += put_probs8(li, t, exp8_nonpos(load8(li + t) - m), bf16);
  *sum = hsum8(sum8);
  return m;
}
#else
// exp(x) for x <= 0 (logit minus running maximum), 16 lanes at once: Cephes' expf polynomial after
// x = n ln2 + r, |r| <= ln2 / 2; lanes below -87.3 (and -inf) give 0. About 1 ulp from expf.
typedef int32_t v16i __attribute__((vector_size(64)));
static inline v16 exp16_nonpos(v16 x) {
  const v16 lo = (v16){0} - 87.3f;
  // lanes below lo zeroed by the mask of the last step, 2^n applied by vscalefps (exp8_nonpos: the
  // same values, lanes below lo clamped, then zeroed)
  const __mmask16 keep = _mm512_cmp_ps_mask((__m512)x, (__m512)lo, _CMP_NLT_UQ);
  EXP_NONPOS_POLY(v16i, v16, x, n, nf, p);
  return (v16)_mm512_maskz_scalef_ps(keep, (__m512)p, (__m512)nf);  // p 2^n: exact, as the product
}

static inline v16 max16(v16 x, v16 m) {
  const v16i gt = x > m;
  return (v16)(((v16i)x & gt) | ((v16i)m & ~gt));
}

// The probabilities p of values t .. t + count - 1 (count 16 or 8) into the row, as float32 or, bf16,
// rounded to bfloat16 (cpu_vec.h's store8_bf16 and round8_bf16) and stored as such (value t at bytes
// 2t, 2t + 1: behind the reads); returns what was stored, as float32, for the sum.
static inline v16 put_probs(float *li, int t, v16 p, int count, int bf16) {
#ifdef __AVX512BF16__  // one vcvtneps2bf16: the same rounding (p is never NaN or subnormal: FTZ)
  if (bf16 && count == 16) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)p);
    memcpy((uint16_t *)li + t, &h, sizeof h);
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  }
#endif
  if (bf16) {
    uint16_t *pb = (uint16_t *)li + t;
    store8_bf16(pb, lo8(p));
    if (count == 16) store8_bf16(pb + 8, hi8(p));
    return cat16(round8_bf16(lo8(p)), round8_bf16(hi8(p)));
  }
  if (count == 16) store16(li + t, p);
  else store8(li + t, lo8(p));
  return p;
}

// Softmax of one state's logits row [0, n) in place (probabilities, unnormalised: exp(x - max)),
// padding lanes to a multiple of 8 set to probability 0; returns the maximum and stores the sum.
// bf16: the probabilities rounded to bfloat16 (summed so) and stored as bfloat16, value t at
// ((uint16_t *)li)[t], for the bfloat16 pass over V (pair dot products).
static float softmax_row(float *li, int n, float softcap, float *sum, int bf16) {
  if (softcap > 0.f)
    for (int t = 0; t < n; ++t) li[t] = softcap * tanhf(li[t] / softcap);
  const int n8 = (n + 7) & ~7;
  for (int t = n; t < n8; ++t) li[t] = -INFINITY;
  // the maximum in 4 independent chains of 16 lanes (one chain waited on each compare): exact, so
  // the same value in any order
  v16 mx[4] = {(v16){0} - INFINITY, (v16){0} - INFINITY, (v16){0} - INFINITY, (v16){0} - INFINITY};
  int t = 0;
  for (; t + 64 <= n8; t += 64)
    for (int j = 0; j < 4; ++j) {
      const v16 x = load16(li + t + 16 * j);
      mx[j] = max16(x, mx[j]);
    }
  for (; t < n8; t += 8) {
    const v16 x = cat16(load8(li + t), (v8){0} - INFINITY);
    mx[0] = max16(x, mx[0]);
  }
  for (int j = 1; j < 4; ++j) mx[0] = max16(mx[j], mx[0]);
  float m = mx[0][0];
  for (int i = 1; i < 16; ++i) m = mx[0][i] > m ? mx[0][i] : m;
  v8 sum8 = {0};  // added 8 lanes at a time in t order, however wide the exps
  for (t = 0; t + 16 <= n8; t += 16) {
    const v16 p = put_probs(li, t, exp16_nonpos(load16(li + t) - m), 16, bf16);
    sum8 += lo8(p);
    sum8 += hi8(p);
  }
  if (t < n8) sum8 += lo8(put_probs(li, t, exp16_nonpos(cat16(load8(li + t), (v8){0}) - m), 8, bf16));
  *sum = hsum8(sum8);
  return m;
}
#endif

// One piece of a group's context: n rows of K/V at pool slot `slot`, logit position pos, read by
// members [j0, j1) of the group.
typedef struct {
  size_t slot;
  int n, pos, j0, j1;
} piece;

// The pieces of a group of sequences [s0, *s1) (neighbours whose tables start with the same block,
// at most gmax; none with a window): the full blocks all of them read whole, once, then each
// member's own rows block by block. Returns the piece count.
static int group_pieces(piece *pieces, int s0, int s_end, int *s1_out, int gmax, const int32_t *block_tables,
                        const int32_t *ctx_lens, int max_blocks, int block_size, int window) {
  const int32_t *lead = block_tables + (size_t)s0 * max_blocks;
  int s1 = s0 + 1, min_len = ctx_lens[s0];
  while (window <= 0 && s1 < s_end && s1 - s0 < gmax && ctx_lens[s1] >= block_size && min_len >= block_size &&
         block_tables[(size_t)s1 * max_blocks] == lead[0]) {
    min_len = ctx_lens[s1] < min_len ? ctx_lens[s1] : min_len;
    ++s1;
  }
  const int nm = s1 - s0;
  int shared = nm > 1 ? min_len / block_size : 0;  // full blocks every member reads whole
  for (int j = s0 + 1; j < s1; ++j) {
    const int32_t *table = block_tables + (size_t)j * max_blocks;
    int b = 0;
    while (b < shared && table[b] == lead[b]) ++b;
    shared = b;
  }
  int np = 0;
  for (int b = 0; b < shared; ++b)
    pieces[np++] = (piece){(size_t)lead[b] * block_size, block_size, b * block_size, 0, nm};
  for (int j = 0; j < nm; ++j) {  // each member's own blocks, after the shared ones
    const int s = s0 + j, len = ctx_lens[s];
    const int first = (window > 0 && len > window) ? len - window : shared * block_size;
    const int origin = window > 0 && len > window ? first : 0;  // logit position 0
    const int32_t *table = block_tables + (size_t)s * max_blocks;
    for (int b = first / block_size; b * block_size < len; ++b) {
      const int t0 = b * block_size > first ? b * block_size : first;
      const int t1 = (b + 1) * block_size < len ? (b + 1) * block_size : len;
      pieces[np++] = (piece){(size_t)table[b] * block_size + t0 % block_size, t1 - t0, t0 - origin, j, j + 1};
    }
  }
  *s1_out = s1;
  return np;
}

// The rows the next pass will read, prefetched one pass ahead: the K pass of a group prefetches
// its V rows, its V pass the next group's K rows, a share of lines at every 8-row group of every
// tile (ahead_step), so that a whole pass of arithmetic covers the reads. The first group's K pass,
// which nobody prefetched, prefetches its own pieces after the first, then its V rows. Spread, not
// issued at once: all at once ahead of a pass they filled the core's miss buffers and slowed the call.
// (Prefetching only the next piece left the engine's calls, their K/V read from memory, well behind
// the same calls over cached rows; docs/kernels.md.)
typedef struct {
  const piece *pieces;
  int np;
  const char *base;  // the pool: piece p's rows at base + p.slot * row bytes
  size_t row;
} rows_list;

typedef struct {
  rows_list list[2];      // the lines of list[0], then list[1]
  int at, e;              // the list and its piece at the cursor
  size_t line, share;     // the cursor's line in that piece; lines a step
} ahead;

// The lines of piece p of a list: 64-byte lines from the one holding its first byte.
static inline const char *first_line(const rows_list *l, const piece *p) {
  return (const char *)((uintptr_t)(l->base + p->slot * l->row) & ~(uintptr_t)63);
}

static inline size_t piece_lines(const rows_list *l, const piece *p) {
  return (size_t)(l->base + (p->slot + p->n) * l->row - first_line(l, p) + 63) / 64;
}

// A cursor over the lines of `first` then `then`, `steps` steps in all.
static ahead ahead_of(rows_list first, rows_list then, size_t steps) {
  size_t lines = 0;
  for (int e = 0; e < first.np; ++e) lines += piece_lines(&first, first.pieces + e);
  for (int e = 0; e < then.np; ++e) lines += piece_lines(&then, then.pieces + e);
  return (ahead){{first, then}, 0, 0, 0, steps ? (lines + steps - 1) / steps : lines};
}

static inline void ahead_step(ahead *a) {
  for (size_t left = a->share; left && a->at < 2;) {
    const rows_list *l = a->list + a->at;
    if (a->e == l->np) {
      ++a->at, a->e = 0;
      continue;
    }
    const piece *p = l->pieces + a->e;
    const char *line0 = first_line(l, p);
    const size_t lines = piece_lines(l, p);
    for (; left && a->line < lines; --left, ++a->line) __builtin_prefetch(line0 + 64 * a->line, 0, 3);
    if (a->line == lines) ++a->e, a->line = 0;
  }
}

// Query heads of one KV head that share each load of a K/V row chunk (a "tile"): with AVX-512's 32
// vector registers, 3 heads x 8 rows of logit accumulators + 3 query chunks fit, and a 16-bit pool
// is widened in registers, once per load for all 3 heads. With AVX2's 16 registers the logits take
// the tile's heads one at a time (4 rows) and pass 2 shares each V load among the 3 (32 columns); a
// float16 row is widened as it is loaded (one F16C vcvtph2ps), a bfloat16 block into a float32
// buffer first (WIDEN_BLOCKS below: its widening is two instructions, which the logits would take
// once per head). Each way was the faster for its type (docs/kernels.md).
#define HEAD_TILE 3

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

#define ELEM float
#define LOAD8 load8
#define LOAD16 load16
#define STORE8 store8
#define FN(name) CAT(name, f32)
#include "cpu_paged_decode_body.h"
#undef ELEM
#undef LOAD8
#undef LOAD16
#undef STORE8
#undef FN

#ifndef __AVX512F__  // the bfloat16 instantiations below (HEAD_TILE says why)
#define WIDEN_BLOCKS
#endif
#define ELEM uint16_t
#define LOAD8 load8_bf16
#define LOAD16 load16_bf16
#define STORE8 store8_bf16
#define FN(name) CAT(name, bf16)
#define DOT_BF16
#include "cpu_paged_decode_body.h"
#undef DOT_BF16
#undef ELEM
#undef LOAD8
#undef LOAD16
#undef STORE8
#undef FN
#undef WIDEN_BLOCKS

#ifdef __FLT16_MAX__
#define ELEM _Float16
#define LOAD8 load8_f16
#define LOAD16 load16_f16
#define STORE8 store8_f16
#define FN(name) CAT(name, f16)
#include "cpu_paged_decode_body.h"
#undef ELEM
#undef LOAD8
#undef LOAD16
#undef STORE8
#undef FN
#endif

// float32 activations over a 16-bit pool (--kv-cache-dtype): paged_decode_ranges_f32_kv_bf16, _f16
#ifndef __AVX512F__
#define WIDEN_BLOCKS
#endif
#define QELEM float
#define QLOAD8 load8
#define QSTORE8 store8
#define ELEM uint16_t
#define LOAD8 load8_bf16
#define LOAD16 load16_bf16
#define STORE8 store8_bf16
#define FN(name) CAT(name, f32_kv_bf16)
#include "cpu_paged_decode_body.h"
#undef ELEM
#undef LOAD8
#undef LOAD16
#undef STORE8
#undef FN
#undef WIDEN_BLOCKS

#ifdef __FLT16_MAX__
#define QELEM float
#define QLOAD8 load8
#define QSTORE8 store8
#define ELEM _Float16
#define LOAD8 load8_f16
#define LOAD16 load16_f16
#define STORE8 store8_f16
#define FN(name) CAT(name, f32_kv_f16)
#include "cpu_paged_decode_body.h"
#undef ELEM
#undef LOAD8
#undef LOAD16
#undef STORE8
#undef FN
#endif
