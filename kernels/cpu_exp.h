/* exp for the SiLU, shared by cpu_llama_ops.c and cpu_gemm.c: Cephes' single-precision polynomial
 * (about 1 ulp). GCC 12 does not vectorize floorf / fminf without -ffast-math, so AVX2 machines get
 * the same steps as intrinsics (exp_poly8). */
#ifndef PAGEDINFER_CPU_EXP_H
#define PAGEDINFER_CPU_EXP_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f
static const float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_poly(float x) {
    x = fminf(fmaxf(x, -87.0f), 88.0f);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * EXP_C1 - n * EXP_C2;
    float p = EXP_P[0];
    for (int j = 1; j < 6; j++) p = p * r + EXP_P[j];
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23; /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp_poly8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C1), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_C2), r);
    __m256 p = _mm256_set1_ps(EXP_P[0]);
    for (int j = 1; j < 6; j++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[j]));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#endif
