/* llama.cpp's numerics for Q4_0 and Q8_0 panels (a segment's q8_dot, `--matmul-numerics llama.cpp`):
 * each row of x quantized per block of 32 values to int8 with one scale (Q8_0 as llama.cpp's
 * quantize_row_q8_0: d = amax / 127 stored as float16, q = roundf(x / d) with x / d taken as
 * x * (1 / d)), integer dot products of those values with the weights' stored integers, block by
 * block, and the block sums added in float32: acc = fma(d_w * d_x, (float)isum, acc) in block order
 * from 0, per row and column. The integer sums are exact and the float steps the same IEEE
 * operations in every build (AVX2 lanes do what the scalar loop does, column by column), so every
 * build, ISA and row count gives the same bits, and a row's outputs depend on that row alone.
 *
 * Layout (cpu_gemm_formats.h): a group record's values are k-major, 16 columns per k (Q4_0 as nibble
 * chunks of 4 k). The AVX2 path turns each 4-k chunk into two vectors of 8 columns x 4 bytes (a column's
 * 4 values in one 32-bit lane, in the order k0, k2, k1, k3), the layout of vpdpbusd and of
 * vpmaddubsw + vpmaddwd; x's values are stored in that order too (Q8_SLOT), so a chunk's 4 values of a
 * row are one broadcast. Unsigned by signed: Q4_0's nibbles as they are (the 8 subtracted from the sum:
 * isum - 8 * sum(x)); Q8_0's signed values through vpsignb (AVX2) or plus 128 (VNNI: isum - 128 * sum(x)).
 *
 * A part of cpu_gemm.c (included once, in its order; not a header of its own).
 */
#include <math.h>

#define Q8_BLOCK 32 /* values per activation block: the Q4_0 / Q8_0 group */
#define Q8_ROWS 4   /* rows multiplied per pass over a panel's chunk (each chunk rearranged once for them) */
#define Q8_MC 256   /* rows per block of x over which the panels are shared out */

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define Q8_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#else
#define Q8_VNNI 0
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q8_VECTOR 1
#else
#define Q8_VECTOR 0
#endif

/* Where the value at k index j of a block goes in x's quantized block: chunk j / 4, order k0, k2, k1, k3. */
static inline int q8_slot(int j) { return (j & ~3) | (j & 1) << 1 | (j & 3) >> 1; }

/* Rows x[m, k] (k a multiple of 32) quantized per block: q[m, k] int8 (Q8_SLOT order), d[m, k / 32] the
 * float16 scale widened, sum[m, k / 32] the block's sum of q. */
static void q8_quantize_rows(const float *x, int m, int k, int8_t *q, float *d, int32_t *sum) {
    const int nb = k / Q8_BLOCK;
    for (int64_t b = 0; b < (int64_t)m * nb; b++) {
        const float *v = x + b * Q8_BLOCK;
        float amax = 0.0f;
        for (int j = 0; j < Q8_BLOCK; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float s = amax / 127.0f, inv = s != 0.0f ? 1.0f / s : 0.0f;
        d[b] = (float)(_Float16)s; /* rounded to nearest even, as llama.cpp stores it */
        int32_t total = 0;
        for (int j = 0; j < Q8_BLOCK; j++) {
            const int8_t qj = (int8_t)roundf(v[j] * inv);
            q[b * Q8_BLOCK + q8_slot(j)] = qj;
            total += qj;
        }
        sum[b] = total;
    }
}

/* The integer each weight of a record's values holds at k index kk, column c (Q4_0: the nibble, 0..15). */
static inline int q8_weight(int f, const uint8_t *v, int kk, int c) {
    if (f == K_Q8_0) return ((const int8_t *)v)[kk * NR + c];
    const uint8_t b = v[32 * (kk >> 2) + 16 * (kk & 1) + c];
    return kk & 2 ? b >> 4 : b & 15;
}

/* The stored integer subtracted from every weight: Q4_0's 8. */
static inline int q8_zero(int f) { return f == K_Q4_0 ? 8 : 0; }

#if Q8_VECTOR
/* Chunk ch (k 4 ch .. 4 ch + 3) of a record's values as two vectors of 8 columns x 4 bytes: w[0] columns
 * 0-3 and 8-11, w[1] columns 4-7 and 12-15, each column's bytes k0, k2, k1, k3; Q8_0's signed, plus 128
 * with VNNI. */
static inline __attribute__((always_inline)) void q8_chunk(int f, const uint8_t *v, int ch, __m256i *w) {
    __m256i lo, hi; /* lane 0: k0 (k2), lane 1: k1 (k3), 16 columns each */
    if (f == K_Q4_0) {
        const __m256i nib = _mm256_loadu_si256((const __m256i *)(v + 32 * ch)), mask = _mm256_set1_epi8(15);
        lo = _mm256_and_si256(nib, mask);
        hi = _mm256_and_si256(_mm256_srli_epi16(nib, 4), mask);
    } else {
        lo = _mm256_loadu_si256((const __m256i *)(v + 64 * ch));
        hi = _mm256_loadu_si256((const __m256i *)(v + 64 * ch + 32));
        if (Q8_VNNI) {
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            lo = _mm256_xor_si256(lo, flip), hi = _mm256_xor_si256(hi, flip);
        }
    }
    lo = _mm256_permute4x64_epi64(lo, 0xD8); /* lane 0: k0 of columns 0-7, k1 of 0-7; lane 1: of 8-15 */
    hi = _mm256_permute4x64_epi64(hi, 0xD8);
    const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi); /* (k0, k2), (k1, k3) */
    w[0] = _mm256_unpacklo_epi16(a, b);
    w[1] = _mm256_unpackhi_epi16(a, b);
}

/* acc += per 32-bit lane, the sum of its 4 byte products of w and x (w unsigned but Q8_0's without VNNI,
 * signed then; x signed). */
static inline __attribute__((always_inline)) __m256i q8_dot4(int f, __m256i acc, __m256i w, __m256i x) {
#if Q8_VNNI
    (void)f;
    return DPBUSD(acc, w, x);
#else
    const __m256i pairs = f == K_Q8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
                                      : _mm256_maddubs_epi16(w, x);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* The offset every stored value carries in the vector path's products (subtracted as off * sum(x)). */
static inline int q8_offset(int f) { return f == K_Q4_0 ? 8 : Q8_VNNI ? 128 : 0; }
#endif

/* Rows `rows` (at most Q8_ROWS) of quantized x (q, d, sum of their first row; nb blocks a row) times one
 * panel at p into acc[rows][16] float32 sums (before bias). */
static inline __attribute__((always_inline)) void q8_panel(int f, const uint8_t *p, int nb, const int8_t *q,
                                                           const float *d, const int32_t *sum, int rows,
                                                           float acc[Q8_ROWS][NR]) {
    const int64_t rec = fmt_record_bytes(f, Q8_BLOCK), k = (int64_t)nb * Q8_BLOCK;
#if Q8_VECTOR
    __m256 lo[Q8_ROWS], hi[Q8_ROWS];
    for (int r = 0; r < rows; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *head = p + b * rec, *v = head + 32;
        __m256i s0[Q8_ROWS], s1[Q8_ROWS];
        for (int r = 0; r < rows; r++) s0[r] = s1[r] = _mm256_setzero_si256();
        for (int ch = 0; ch < Q8_BLOCK / 4; ch++) {
            __m256i w[2];
            q8_chunk(f, v, ch, w);
            for (int r = 0; r < rows; r++) {
                int32_t four;
                memcpy(&four, q + r * k + (int64_t)b * Q8_BLOCK + 4 * ch, sizeof four);
                const __m256i xb = _mm256_set1_epi32(four);
                s0[r] = q8_dot4(f, s0[r], w[0], xb);
                s1[r] = q8_dot4(f, s1[r], w[1], xb);
            }
        }
        const __m256 dw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)head));
        const __m256 dw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 16)));
        for (int r = 0; r < rows; r++) {
            const __m256i off = _mm256_set1_epi32(q8_offset(f) * sum[r * nb + b]);
            const __m256i i0 = _mm256_sub_epi32(_mm256_permute2x128_si256(s0[r], s1[r], 0x20), off); /* 0-7 */
            const __m256i i1 = _mm256_sub_epi32(_mm256_permute2x128_si256(s0[r], s1[r], 0x31), off); /* 8-15 */
            const __m256 dx = _mm256_set1_ps(d[r * nb + b]);
            lo[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw0, dx), _mm256_cvtepi32_ps(i0), lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw1, dx), _mm256_cvtepi32_ps(i1), hi[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(acc[r], lo[r]);
        _mm256_storeu_ps(acc[r] + 8, hi[r]);
    }
#else
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < NR; c++) acc[r][c] = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *head = p + b * rec, *v = head + 32;
        for (int r = 0; r < rows; r++) {
            const int8_t *xq = q + r * k + (int64_t)b * Q8_BLOCK;
            const float dx = d[r * nb + b];
            for (int c = 0; c < NR; c++) {
                int32_t isum = 0;
                for (int j = 0; j < Q8_BLOCK; j++) isum += q8_weight(f, v, j, c) * xq[q8_slot(j)];
                isum -= q8_zero(f) * sum[r * nb + b];
                acc[r][c] = fmaf(half_to_float(((const uint16_t *)head)[c]) * dx, (float)isum, acc[r][c]);
            }
        }
    }
#endif
}

/* q8_panel instantiated per kind and row count (its accumulators then stay in registers). */
typedef void (*q8_panel_fn)(const uint8_t *p, int nb, const int8_t *q, const float *d, const int32_t *sum,
                            float acc[Q8_ROWS][NR]);
#define Q8_PANEL(F, R)                                                                                          \
    static void q8_panel_##F##_##R(const uint8_t *p, int nb, const int8_t *q, const float *d, const int32_t *sum, \
                                   float acc[Q8_ROWS][NR]) {                                                   \
        q8_panel(F, p, nb, q, d, sum, R, acc);                                                                  \
    }
#define Q8_PANELS(F) Q8_PANEL(F, 1) Q8_PANEL(F, 2) Q8_PANEL(F, 3) Q8_PANEL(F, 4)
Q8_PANELS(K_Q4_0)
Q8_PANELS(K_Q8_0)
#define Q8_ROW_ENTRIES(F) {q8_panel_##F##_1, q8_panel_##F##_2, q8_panel_##F##_3, q8_panel_##F##_4}
static const q8_panel_fn Q8_PANEL_OF[2][Q8_ROWS] = {Q8_ROW_ENTRIES(K_Q4_0), Q8_ROW_ENTRIES(K_Q8_0)};

/* y[m, s->cols] (row stride ldy) = x[m, k] W^T under llama.cpp's numerics (s->q8_dot: Q4_0 and Q8_0,
 * float32 x and y, k a multiple of 32): x quantized per row and block, then the panels shared out
 * among the threads, each panel's rows Q8_ROWS at a time; bias and silu(gate) * up as store_tile adds them. */
static void q8_segment_run(const gemm_segment *s, const float *x, float *y, int64_t ldy, int m, int k, int gated) {
    const int f = s->kind, nb = k / Q8_BLOCK, cols = gated ? NR / 2 : NR, width = s->cols;
    const int panels = (width + cols - 1) / cols;
    const int64_t pbytes = panel_bytes(f, k, s->group);
    for (int m0 = 0; m0 < m; m0 += Q8_MC) {
        const int rows = m - m0 < Q8_MC ? m - m0 : Q8_MC;
        /* this block's x as int8 values, then scales and sums: (rows k + 2 rows nb) x 4 bytes */
        float *buf = thread_buffer(X_BUFFER, (size_t)rows * k / 4 + (size_t)2 * rows * nb);
        int8_t *q = (int8_t *)buf;
        float *d = buf + (size_t)rows * k / 4;
        int32_t *sum = (int32_t *)(d + (size_t)rows * nb);
        q8_quantize_rows(x + (int64_t)m0 * k, rows, k, q, d, sum);
        /* static: panels cost alike, and a dynamic schedule's hand-offs outweigh a few-row panel's work */
#pragma omp parallel for schedule(static) if ((int64_t)rows * width * k >= MIN_PARALLEL)
        for (int j = 0; j < panels; j++) {
            const uint8_t *p = (const uint8_t *)s->panels + j * pbytes;
            const float *bias = s->bias ? s->bias + (int64_t)j * NR : NULL;
            const int own = width - j * cols < cols ? width - j * cols : cols;
            for (int r0 = 0; r0 < rows; r0 += Q8_ROWS) {
                const int n = rows - r0 < Q8_ROWS ? rows - r0 : Q8_ROWS;
                float acc[Q8_ROWS][NR], out[NR];
                Q8_PANEL_OF[f == K_Q8_0][n - 1](p, nb, q + (int64_t)r0 * k, d + (int64_t)r0 * nb, sum + (int64_t)r0 * nb,
                                                acc);
                for (int r = 0; r < n; r++) {
                    store_tile(out, load8(acc[r]), load8(acc[r] + 8), bias, gated);
                    memcpy(y + (int64_t)(m0 + r0 + r) * ldy + (int64_t)j * cols, out, (size_t)own * sizeof(float));
                }
            }
        }
    }
}
