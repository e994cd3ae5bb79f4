/* The elementwise parts of a Llama-family layer on float32 rows, one call each instead of 3-8 torch ops.
 *
 * A decode step at batch 1-16 spends more time dispatching small torch ops than computing them;
 * these loops do each chain (residual add + RMSNorm, per-head RMSNorm + RoPE in place, SiLU x up)
 * in one pass over the rows. Rows run in parallel only when the work pays for waking threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define MIN_PARALLEL (1 << 16) /* elements; below this one thread is faster */

static inline float row_inv_rms(const float *x, int dim, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < dim; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)dim + eps);
}

/* residual[r] += x[r] (when x is not NULL); out[r] = residual[r] * inv_rms * w. */
void add_rms_norm_f32(float *residual, const float *x, const float *w, float *out, int rows, int dim,
                      float eps) {
#pragma omp parallel for if ((int64_t)rows * dim >= MIN_PARALLEL)
    for (int r = 0; r < rows; r++) {
        float *res = residual + (int64_t)r * dim;
        float *o = out + (int64_t)r * dim;
        if (x) {
            const float *xr = x + (int64_t)r * dim;
#pragma omp simd
            for (int i = 0; i < dim; i++) res[i] += xr[i];
        }
        float inv = row_inv_rms(res, dim, eps);
#pragma omp simd
        for (int i = 0; i < dim; i++) o[i] = w[i] * (res[i] * inv);
    }
}

/* In place on the first q_heads + k_heads heads of each row of a fused QKV matrix (row stride
 * row_stride floats): an optional per-head RMSNorm (q_w / k_w, Qwen3), then rotate-half RoPE with
 * cos/sin [rows, dim / 2] (the halves of HF's cat(freqs, freqs) are equal). */
void qk_norm_rope_f32(float *qkv, int64_t row_stride, int rows, int q_heads, int k_heads, int dim,
                      const float *cos_t, const float *sin_t, const float *q_w, const float *k_w, float eps) {
    int half = dim / 2, heads = q_heads + k_heads;
#pragma omp parallel for if ((int64_t)rows * heads * dim >= MIN_PARALLEL)
    for (int r = 0; r < rows; r++) {
        const float *c = cos_t + (int64_t)r * half, *s = sin_t + (int64_t)r * half;
        for (int h = 0; h < heads; h++) {
            float *x = qkv + (int64_t)r * row_stride + (int64_t)h * dim;
            const float *w = h < q_heads ? q_w : k_w;
            if (w) {
                float inv = row_inv_rms(x, dim, eps);
#pragma omp simd
                for (int i = 0; i < dim; i++) x[i] = w[i] * (x[i] * inv);
            }
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* exp for the SiLU: Cephes' single-precision polynomial (about 1 ulp). GCC 12 does not vectorize
 * floorf / fminf without -ffast-math, so AVX2 machines get the same steps as intrinsics. */
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

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]: the gate and up halves of one fused GEMM. */
void silu_mul_f32(const float *gate_up, float *out, int rows, int inter) {
#pragma omp parallel for if ((int64_t)rows * inter >= MIN_PARALLEL)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (int64_t)r * 2 * inter, *u = g + inter;
        float *o = out + (int64_t)r * inter;
        int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= inter; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp_poly8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) o[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
    }
}
