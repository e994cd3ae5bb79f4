/* The elementwise parts of a Llama-family layer on float32 or bfloat16 rows (norm, RoPE, activation),
 * one call each instead of 3-8 torch ops (the sampler's loops are cpu_sampling.c).
 *
 * A decode step at batch 1-16 spends more time dispatching small torch ops than computing them;
 * these loops do each chain (residual add + RMSNorm, per-head RMSNorm + RoPE in place, SiLU x up)
 * in one pass over the rows (Gemma's gelu-tanh x up too). Rows run in parallel only when the work
 * pays for waking threads. The chains live in cpu_llama_ops_body.h, instantiated at the end of this
 * file per element type: add_rms_norm_{f32,bf16}, qk_norm_rope_{f32,bf16}, silu_mul_{f32,bf16},
 * gelu_tanh_mul_{f32,bf16}, clamped_swiglu_mul_{f32,bf16} (gpt-oss's experts). Arithmetic is float32
 * in both; the bfloat16 ones round where transformers' bfloat16 modules round (each op's output).
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

/* The MLP activations of the form act(x) = x / (1 + exp(-z(x))), each by its z: SiLU's z = x; the
 * tanh form of gelu, x / 2 * (1 + tanh(u)) with u = sqrt(2 / pi) * (x + 0.044715 x^3), is the same
 * function with z = 2 u (Gemma's GeGLU). One chain serves both (act_mul in cpu_llama_ops_body.h). */
#define GELU_TWO_K 1.5957691216057308f /* 2 sqrt(2 / pi) */
#define GELU_CUBE 0.044715f
static inline float silu_z(float x) { return x; }
static inline float gelu_tanh_z(float x) { return GELU_TWO_K * (x + GELU_CUBE * (x * x * x)); }
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 silu_z8(__m256 x) { return x; }
static inline __m256 gelu_tanh_z8(__m256 x) {
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 inner = _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(GELU_CUBE), x3));
    return _mm256_mul_ps(_mm256_set1_ps(GELU_TWO_K), inner);
}
#endif

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
