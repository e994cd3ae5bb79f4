/* The elementwise parts of a Llama-family layer on float32 or bfloat16 rows, one call each instead of
 * 3-8 torch ops, and the greedy sampler's argmax.
 *
 * A decode step at batch 1-16 spends more time dispatching small torch ops than computing them;
 * these loops do each chain (residual add + RMSNorm, per-head RMSNorm + RoPE in place, SiLU x up)
 * in one pass over the rows. Rows run in parallel only when the work pays for waking threads.
 * The chains live in cpu_llama_ops_body.h, instantiated at the end of this file per element type:
 * add_rms_norm_{f32,bf16}, qk_norm_rope_{f32,bf16}, silu_mul_{f32,bf16}. Arithmetic is float32 in
 * both; the bfloat16 ones round where transformers' bfloat16 modules round (each op's output).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define MIN_PARALLEL (1 << 16) /* the argmax: elements; below this one thread is faster */
/* The chains run their rows on all threads from this many elements (4 rows of a 576-wide model).
 * In a decode step their input rows were just written by a GEMM that splits its columns across the
 * threads, so one thread alone pulls half of every row from the other core's cache: SmolLM2 steps
 * (AMD EPYC Zen 3, 2 threads) spent 0.13-0.17 ms in the norms at 4 rows against 0.23-0.33 ms on one
 * thread, 0.20-0.24 against 0.33-0.53 at 8, 0.36-0.37 against 0.42-1.14 at 16. */
#define ROWS_MIN_PARALLEL (1 << 11)

#include "cpu_exp.h" /* exp_poly, exp_poly8: the SiLU's exp */
#include "cpu_vec.h" /* load8_bf16, store8_bf16, round8_bf16 */

/* bfloat16 is the top half of a float32: widening is a shift, narrowing rounds to nearest even. */
static inline uint32_t bf16_rounded_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b + 0x7fffu + ((b >> 16) & 1u);
}

static inline float bf16_load(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) { return (uint16_t)(bf16_rounded_bits(f) >> 16); }

static inline float bf16_round(float f) { return bf16_load(bf16_store(f)); }

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)

/* float32: loads, stores and roundings are the identity */
#define ELEM float
#define LD(x) (x)
#define ST(x) (x)
#define RND(x) (x)
#define LOAD8(p) _mm256_loadu_ps(p)
#define STORE8(p, v) _mm256_storeu_ps(p, v)
#define RND8(v) (v)
#define FN(name) CAT(name, f32)
#include "cpu_llama_ops_body.h"

#define ELEM uint16_t
#define LD(x) bf16_load(x)
#define ST(x) bf16_store(x)
#define RND(x) bf16_round(x)
#define LOAD8(p) ((__m256)load8_bf16(p))
#define STORE8(p, v) store8_bf16(p, (v8)(v))
#define RND8(v) ((__m256)round8_bf16((v8)(v)))
#define FN(name) CAT(name, bf16)
#include "cpu_llama_ops_body.h"

/* *arg = the index of the first maximum of x[0, n); *nan set where x holds a NaN. */
static void first_max(const float *x, int n, int64_t *arg, int *nan) {
    typedef int32_t v8i __attribute__((vector_size(32)));
    v8 best = (v8){0} - INFINITY;
    v8i at = {0, 1, 2, 3, 4, 5, 6, 7}, lane = at, bad = {0};
    int c = 0;
    for (; c + 8 <= n; c += 8, lane += 8) { /* per lane: the first maximum of its column */
        const v8 v = load8(x + c);
        const v8i gt = v > best;
        best = (v8)(((v8i)v & gt) | ((v8i)best & ~gt));
        at = (lane & gt) | (at & ~gt);
        bad |= v != v;
    }
    float m = -INFINITY;
    int64_t i_m = 0;
    for (int i = 0; i < 8; i++) { /* the lanes' maxima, ties to the lower index */
        *nan |= bad[i] != 0;
        if (c > 0 && (best[i] > m || (best[i] == m && at[i] < i_m))) m = best[i], i_m = at[i];
    }
    for (; c < n; c++) {
        *nan |= x[c] != x[c];
        if (x[c] > m) m = x[c], i_m = c;
    }
    *arg = i_m;
}

/* out[r] = the index of the first maximum of row r of x [rows, cols] (row stride `stride`); returns
 * how many rows hold a NaN (their out[r] is -1: torch's argmax then names the NaN; the caller asks
 * torch). Vectorized: torch's CPU argmax runs lane by lane, 1 ms for 16 rows of a 49152-token
 * vocabulary (AMD EPYC, 2 threads) against 0.12 ms here. */
int argmax_rows_f32(const float *x, int rows, int cols, int64_t stride, int64_t *out) {
    int nan_rows = 0;
#pragma omp parallel for if ((int64_t)rows * cols >= MIN_PARALLEL) reduction(+ : nan_rows)
    for (int r = 0; r < rows; r++) {
        int nan = 0;
        int64_t arg;
        first_max(x + r * stride, cols, &arg, &nan);
        out[r] = nan ? -1 : arg;
        nan_rows += nan;
    }
    return nan_rows;
}
