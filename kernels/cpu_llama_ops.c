/* The elementwise parts of a Llama-family layer on float32 or bfloat16 rows (norm, RoPE, activation),
 * one call each instead of 3-8 torch ops (the sampler's loops are cpu_sampling.c).
 *
 * A decode step at batch 1-16 spends more time dispatching small torch ops than computing them;
 * these loops do each chain (residual add + RMSNorm, per-head RMSNorm + RoPE in place, SiLU x up)
 * in one pass over the rows (Gemma's gelu-tanh x up too). Rows run in parallel only when the work pays for waking threads.
 * The chains live in cpu_llama_ops_body.h, instantiated at the end of this file per element type:
 * add_rms_norm_{f32,bf16}, qk_norm_rope_{f32,bf16}, silu_mul_{f32,bf16}, gelu_tanh_mul_{f32,bf16}. Arithmetic is float32 in
 * both; the bfloat16 ones round where transformers' bfloat16 modules round (each op's output).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* The chains run their rows on all threads from this many elements (4 rows of a 576-wide model).
 * In a decode step their input rows were just written by a GEMM that splits its columns across the
 * threads, so one thread alone pulls half of every row from the other core's cache; from 4 rows the
 * norms ran faster on all threads than on one (docs/kernels.md). */
#define ROWS_MIN_PARALLEL (1 << 11)

#include "cpu_llama_ops.h" /* the entry points below */
#include "cpu_exp.h" /* exp_poly, exp_poly8: the SiLU's exp */
#include "cpu_vec.h" /* load8, load8_bf16, store8_bf16, round8_bf16 */

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
#define LD8(p) load8(p)
#define STORE8(p, v) _mm256_storeu_ps(p, v)
#define RND8(v) (v)
#define FN(name) CAT(name, f32)
#include "cpu_llama_ops_body.h"

#define ELEM uint16_t
#define LD(x) bf16_load(x)
#define ST(x) bf16_store(x)
#define RND(x) bf16_round(x)
#define LOAD8(p) ((__m256)load8_bf16(p))
#define LD8(p) load8_bf16(p)
#define STORE8(p, v) store8_bf16(p, (v8)(v))
#define RND8(v) ((__m256)round8_bf16((v8)(v)))
#define FN(name) CAT(name, bf16)
#include "cpu_llama_ops_body.h"
