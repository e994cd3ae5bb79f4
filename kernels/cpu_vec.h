/* The 8-float vector type of the CPU kernels (GCC / Clang vector extensions: AVX2 on x86, two NEON
 * registers on Arm), its unaligned load and store, and the same from and to bfloat16, shared by
 * cpu_gemm.c, cpu_llama_ops.c and cpu_paged_decode.c. */
#ifndef PAGEDINFER_CPU_VEC_H
#define PAGEDINFER_CPU_VEC_H
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

/* bfloat16 is the top half of a float32: widening is a shift, narrowing rounds to nearest even. */
static inline v8 load8_bf16(const uint16_t *p) {
    v8u16 h;
    memcpy(&h, p, sizeof h);
    return (v8)(__builtin_convertvector(h, v8u) << 16);
}

static inline v8u bf16_rounded_bits8v(v8 v) {
    const v8u b = (v8u)v;
    return b + 0x7fffu + ((b >> 16) & 1u);
}

static inline void store8_bf16(uint16_t *p, v8 v) {
    const v8u16 h = __builtin_convertvector(bf16_rounded_bits8v(v) >> 16, v8u16);
    memcpy(p, &h, sizeof h);
}

/* Defines v8 NAME(const T *p): 8 consecutive T widened to float32 (the portable form; on x86 the
 * kernels use one conversion instruction instead where GCC would convert lane by lane). */
#define WIDENING_LOAD8(NAME, T)                                   \
    static inline v8 NAME(const T *p) {                           \
        T q __attribute__((vector_size(8 * sizeof(T))));          \
        memcpy(&q, p, sizeof q);                                  \
        return __builtin_convertvector(q, v8);                    \
    }

/* v rounded to bfloat16's precision, kept in float32 */
static inline v8 round8_bf16(v8 v) { return (v8)(bf16_rounded_bits8v(v) & 0xffff0000u); }
#endif
