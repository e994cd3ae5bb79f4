/* The typed half of cpu_llama_ops.c, included once per element type (a C template): ELEM is the
 * element type of every row, weight and output; LD / ST widen one element to float32 / narrow one
 * back; RND rounds a float32 to ELEM's precision (where transformers' module would hold an ELEM);
 * LOAD8 / STORE8 / RND8 do the same for 8 lanes (AVX2), LD8 widens 8 elements in any build; FN(name)
 * names each instantiation. The parameters are undefined at the end, ready for the next instantiation. */

/* 1 / sqrt(mean(x^2) + eps). The squares are summed in 16 lanes, lane l taking i = l (mod 16) in i
 * order (one fused multiply-add each; a last partial chunk zero-padded, which adds nothing), and the
 * lanes added in a fixed tree: the same bits in every build, whatever its vector width (a `simd
 * reduction` lets the compiler pick the lanes: 16 in an AVX-512 build, 8 in an AVX2 one). */
static inline float FN(row_inv_rms)(const ELEM *x, int dim, float eps) {
    v8 lo = {0}, hi = {0}; /* lanes 0-7, 8-15 (a 16-float vector: GCC 12 spills it in AVX2 builds) */
    int i = 0;
    for (; i + 16 <= dim; i += 16) {
        const v8 a = LD8(x + i), b = LD8(x + i + 8);
        lo += a * a;
        hi += b * b;
    }
    if (i < dim) {
        ELEM pad[16] = {0};
        memcpy(pad, x + i, (size_t)(dim - i) * sizeof(ELEM));
        const v8 a = LD8(pad), b = LD8(pad + 8);
        lo += a * a;
        hi += b * b;
    }
    const v8 s = lo + hi;
    const float sum = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    return 1.0f / sqrtf(sum / (float)dim + eps);
}

/* residual[r] += x[r] (when x is not NULL); out[r] = w * (residual[r] * inv_rms). */
void FN(add_rms_norm)(ELEM *residual, const ELEM *x, const ELEM *w, ELEM *out, int rows, int dim,
                      float eps) {
#pragma omp parallel for if (rows > 1 && (int64_t)rows * dim >= ROWS_MIN_PARALLEL)
    for (int r = 0; r < rows; r++) {
        ELEM *res = residual + (int64_t)r * dim;
        ELEM *o = out + (int64_t)r * dim;
        if (x) {
            const ELEM *xr = x + (int64_t)r * dim;
#pragma omp simd
            for (int i = 0; i < dim; i++) res[i] = ST(LD(res[i]) + LD(xr[i]));
        }
        float inv = FN(row_inv_rms)(res, dim, eps);
#pragma omp simd
        for (int i = 0; i < dim; i++) o[i] = ST(LD(w[i]) * RND(LD(res[i]) * inv));
    }
}

/* In place on the first q_heads + k_heads heads of each row of a fused QKV matrix (row stride
 * row_stride elements): an optional per-head RMSNorm (q_w / k_w, Qwen3), then rotate-half RoPE with
 * cos/sin [rows, dim / 2] (the halves of HF's cat(freqs, freqs) are equal). */
void FN(qk_norm_rope)(ELEM *qkv, int64_t row_stride, int rows, int q_heads, int k_heads, int dim,
                      const ELEM *cos_t, const ELEM *sin_t, const ELEM *q_w, const ELEM *k_w, float eps) {
    int half = dim / 2, heads = q_heads + k_heads;
#pragma omp parallel for if (rows > 1 && (int64_t)rows * heads * dim >= ROWS_MIN_PARALLEL)
    for (int r = 0; r < rows; r++) {
        const ELEM *c = cos_t + (int64_t)r * half, *s = sin_t + (int64_t)r * half;
        for (int h = 0; h < heads; h++) {
            ELEM *x = qkv + (int64_t)r * row_stride + (int64_t)h * dim;
            const ELEM *w = h < q_heads ? q_w : k_w;
            if (w) {
                float inv = FN(row_inv_rms)(x, dim, eps);
#pragma omp simd
                for (int i = 0; i < dim; i++) x[i] = ST(LD(w[i]) * RND(LD(x[i]) * inv));
            }
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float x1 = LD(x[i]), x2 = LD(x[i + half]), ci = LD(c[i]), si = LD(s[i]);
                x[i] = ST(RND(x1 * ci) - RND(x2 * si));
                x[i + half] = ST(RND(x2 * ci) + RND(x1 * si));
            }
        }
    }
}

/* x[i] += y[i] for i < n: a residual add without a norm (OLMo-2's stream takes its normed branches so). */
void FN(add_rows)(ELEM *x, const ELEM *y, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = ST(LD(x[i]) + LD(y[i]));
}

/* x[i] *= s for i < n, in float32 and rounded once (Granite's residual multiplier on a branch). */
void FN(scale_rows)(ELEM *x, int64_t n, float s) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] = ST(LD(x[i]) * s);
}

/* x[i] clamped to [-c, c] in place, c first rounded to ELEM (torch's clamp_ with a float bound); a NaN
 * stays a NaN. */
void FN(clamp_rows)(ELEM *x, int64_t n, float c) {
    const float hi = LD(ST(c)), lo = -hi;
    for (int64_t i = 0; i < n; i++) {
        const float v = LD(x[i]);
        if (v < lo) x[i] = ST(lo);
        else if (v > hi) x[i] = ST(hi);
    }
}

/* out[r, i] = act(gate_up[r, i]) * gate_up[r, inter + i], the gate and up halves of one fused GEMM, for
 * an activation x / (1 + exp(-Z(x))) (cpu_llama_ops.c: silu_z, gelu_tanh_z; Z8 their 8-lane forms),
 * the activation rounded where transformers' module rounds it. */
#if defined(__AVX2__) && defined(__FMA__)
#define ACT_MUL_LANES8(Z8)                                                                                  \
    for (; i + 8 <= inter; i += 8) {                                                                      \
        const __m256 x = LOAD8(g + i);                                                                    \
        const __m256 e = exp_poly8(_mm256_sub_ps(_mm256_setzero_ps(), Z8(x)));                            \
        const __m256 act = RND8(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));               \
        STORE8(o + i, _mm256_mul_ps(act, LOAD8(u + i)));                                                  \
    }
#else
#define ACT_MUL_LANES8(Z8)
#endif
#define ACT_MUL(NAME, Z, Z8)                                                                                \
    void FN(NAME)(const ELEM *gate_up, ELEM *out, int rows, int inter) {                                  \
        _Pragma("omp parallel for if (rows > 1 && (int64_t)rows * inter >= ROWS_MIN_PARALLEL)")           \
        for (int r = 0; r < rows; r++) {                                                                  \
            const ELEM *g = gate_up + (int64_t)r * 2 * inter, *u = g + inter;                             \
            ELEM *o = out + (int64_t)r * inter;                                                           \
            int i = 0;                                                                                    \
            ACT_MUL_LANES8(Z8)                                                                            \
            for (; i < inter; i++) {                                                                      \
                const float x = LD(g[i]);                                                                 \
                o[i] = ST(RND(x / (1.0f + exp_poly(-Z(x)))) * LD(u[i]));                                 \
            }                                                                                             \
        }                                                                                                 \
    }
ACT_MUL(silu_mul, silu_z, silu_z8)
ACT_MUL(gelu_tanh_mul, gelu_tanh_z, gelu_tanh_z8)
#undef ACT_MUL
#undef ACT_MUL_LANES8

/* gpt-oss's clamped SwiGLU over the gate and up halves of one fused GEMM: out[r, i] = (clamp(u, -limit,
 * limit) + 1) * g / (1 + exp(-alpha g)) with g = min(gate, limit), u the up (transformers' GptOssExperts;
 * its g * sigmoid(alpha g) as the chains above compute x * sigmoid(z)); the activation and up + 1 rounded
 * where transformers' module rounds them. */
void FN(clamped_swiglu_mul)(const ELEM *gate_up, ELEM *out, int rows, int inter, float alpha, float limit) {
#pragma omp parallel for if (rows > 1 && (int64_t)rows * inter >= ROWS_MIN_PARALLEL)
    for (int r = 0; r < rows; r++) {
        const ELEM *g = gate_up + (int64_t)r * 2 * inter, *u = g + inter;
        ELEM *o = out + (int64_t)r * inter;
        int i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), lim = _mm256_set1_ps(limit);
        for (; i + 8 <= inter; i += 8) {
            const __m256 x = _mm256_min_ps(LOAD8(g + i), lim);
            const __m256 e = exp_poly8(_mm256_mul_ps(_mm256_set1_ps(-alpha), x));
            const __m256 act = RND8(_mm256_div_ps(x, _mm256_add_ps(one, e)));
            const __m256 up = _mm256_max_ps(_mm256_min_ps(LOAD8(u + i), lim), _mm256_set1_ps(-limit));
            STORE8(o + i, _mm256_mul_ps(act, RND8(_mm256_add_ps(up, one))));
        }
#endif
        for (; i < inter; i++) {
            const float x = fminf(LD(g[i]), limit);
            const float act = RND(x / (1.0f + exp_poly(-alpha * x)));
            o[i] = ST(act * RND(fmaxf(fminf(LD(u[i]), limit), -limit) + 1.0f));
        }
    }
}

#undef ELEM
#undef LD
#undef ST
#undef RND
#undef LOAD8
#undef LD8
#undef STORE8
#undef RND8
#undef FN
