/* The vector of cpu_gemm.c's tiles: a panel row of 16 float32 weights is PV_HALVES vectors of VW
 * lanes each: one 512-bit register with AVX-512 (VW 16), two 8-float vectors elsewhere (AVX2, or the
 * portable vector extensions), so every kernel is written once over `vh`, a native vector type in
 * either build (arrays of it indexed by constants stay in registers). Each lane does the same
 * float32 operations in either form (a lane never sees its neighbours), so both builds give the same
 * bits. The loads widen VW stored values of a panel row (int8, uint8, float16) to float32 exactly.
 */
#ifndef PAGEDINFER_CPU_PANEL_VEC_H
#define PAGEDINFER_CPU_PANEL_VEC_H
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h" /* v8, load8, store8, WIDENING_LOAD8 */
#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* float16 bits -> float32, exactly (subnormals, infinities and NaN included): the portable form. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant) { /* subnormal: normalise */
        int e = -1;
        uint32_t m = mant;
        do {
            e++;
            m <<= 1;
        } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__)
#define PV_ZMM 1
#define PV_HALVES 1
#define VW 16
typedef float vh __attribute__((vector_size(64)));

static inline vh vh_splat(float s) { return (vh)_mm512_set1_ps(s); }
static inline vh vh_load(const float *p) { return (vh)_mm512_loadu_ps(p); }
static inline void vh_store(float *p, vh a) { _mm512_storeu_ps(p, (__m512)a); }
static inline vh vh_i8(const int8_t *p) {
    return (vh)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vh vh_u8(const uint8_t *p) {
    return (vh)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vh vh_f16(const uint16_t *p) { return (vh)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* the 8-float halves of a panel row (the tiles' epilogue works on 8 columns) */
static inline v8 vh_lo(vh a) { return (v8)_mm512_castps512_ps256((__m512)a); }
static inline v8 vh_hi(vh a) { return (v8)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd((__m512)a), 1)); }
#else
#define PV_HALVES 2
#define VW 8
typedef v8 vh;

static inline vh vh_splat(float s) { return (vh){s, s, s, s, s, s, s, s}; }
static inline vh vh_load(const float *p) { return load8(p); }
static inline void vh_store(float *p, vh a) { store8(p, a); }
#if defined(__AVX2__)
static inline vh vh_i8(const int8_t *p) { /* vpmovsxbd + vcvtdq2ps (GCC 12 converts lane by lane) */
    return (vh)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vh vh_u8(const uint8_t *p) {
    return (vh)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
WIDENING_LOAD8(vh_i8, int8_t)
WIDENING_LOAD8(vh_u8, uint8_t)
#endif
#if defined(__F16C__)
static inline vh vh_f16(const uint16_t *p) { return (vh)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
static inline vh vh_f16(const uint16_t *p) {
    vh v;
    for (int i = 0; i < 8; i++) v[i] = half_to_float(p[i]);
    return v;
}
#endif
#endif
#endif
