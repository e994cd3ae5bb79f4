/* bfloat16 activations with vdpbf16ps (AVX512-BF16): the tiles over bfloat16 pair panels and over
 * quantized panels turned into pair panels in registers (qtile_bf16).
 *
 * A part of cpu_gemm.c (included once, in its order; not a header of its own).
 */
#if NATIVE_BF16
#define MRB 8 /* rows per bfloat16 tile: 12, 16 and 24 ran slower at 64-2048 rows */
/* store_tile_bf16 of one 512-bit accumulator */
#define STORE_ZMM_BF16(y, acc, b, gated) store_tile_bf16(y, vh_lo((vh)(acc)), vh_hi((vh)(acc)), b, gated)

#define BKERNEL_STEP(ROWS, PREFETCH)                                                               \
    for (int kp = 0; kp < k / 2; kp++) {                                                           \
        PREFETCH;                                                                                  \
        const __m512bh w = (__m512bh)_mm512_loadu_si512(p + (int64_t)kp * 2 * NR);                  \
        for (int r = 0; r < ROWS; r++) {                                                           \
            int32_t pair;                                                                          \
            memcpy(&pair, x + r * lda + 2 * kp, sizeof pair);                                      \
            acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(pair), w);               \
        }                                                                                          \
    }
#define BKERNEL(ROWS)                                                                              \
    static inline void bkernel_##ROWS(const uint16_t *x, int64_t lda, const uint16_t *p, int k,     \
                                      uint16_t *y, int64_t ldy, const uint16_t *pf, const float *b, \
                                      int gated) {                                                 \
        __m512 acc[ROWS];                                                                          \
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();                               \
        if (pf)                                                                                    \
            BKERNEL_STEP(ROWS, __builtin_prefetch(pf + (int64_t)kp * 2 * NR, 0, 2))                 \
        else                                                                                       \
            BKERNEL_STEP(ROWS, (void)0)                                                            \
        for (int r = 0; r < ROWS; r++) STORE_ZMM_BF16(y + r * ldy, acc[r], b, gated);             \
    }
BKERNEL(1)
BKERNEL(2)
BKERNEL(3)
BKERNEL(4)
BKERNEL(5)
BKERNEL(6)
BKERNEL(7)
BKERNEL(8)

/* Past MRB rows: tiles of WRB rows by WPB pair panels, 24 accumulators (3 panel loads and 8 x
 * broadcasts for 24 vdpbf16ps, where an 8 x 1 tile loads 9 for 8 and falls well behind oneDNN at
 * prefill row counts on cores that issue two 512-bit vdpbf16ps a cycle; 6 x 4 ran slower than 8 x 3,
 * in blocks of equal rows). Each sum takes the same vdpbf16ps steps in the same order as in an 8 x 1
 * tile, so the bits do not depend on the tile. pf: the next panels, prefetched beside the loads,
 * spread over the row blocks: block `phase` of `step` fetches the lines kp = phase (mod step). (All
 * of them in the first block left memory idle while the others ran; docs/kernels.md.) */
#ifndef WRB
#define WRB 8
#define WPB 3
#endif
#define BWIDE(ROWS)                                                                                \
    static void bwide_##ROWS(const uint16_t *x, int64_t lda, const uint16_t *p, int64_t pstride, int k, \
                             uint16_t *y, int64_t ldy, int cols, const uint16_t *pf, int phase, int step, \
                             const float *b, int gated) {                                          \
        __m512 acc[ROWS][WPB];                                                                     \
        for (int r = 0; r < ROWS; r++)                                                             \
            for (int u = 0; u < WPB; u++) acc[r][u] = _mm512_setzero_ps();                         \
        for (int kp = 0, due = phase; kp < k / 2; kp++, due--) {                                   \
            __m512bh w[WPB];                                                                       \
            for (int u = 0; u < WPB; u++) w[u] = (__m512bh)_mm512_loadu_si512(p + u * pstride + (int64_t)kp * 2 * NR); \
            if (pf && due == 0) { /* the lines kp = phase (mod step) of the next panels */          \
                due = step;                                                                        \
                for (int u = 0; u < WPB; u++) __builtin_prefetch(pf + u * pstride + (int64_t)kp * 2 * NR, 0, 2); \
            }                                                                                      \
            for (int r = 0; r < ROWS; r++) {                                                       \
                int32_t pair;                                                                      \
                memcpy(&pair, x + r * lda + 2 * kp, sizeof pair);                                  \
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                             \
                for (int u = 0; u < WPB; u++) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], xb, w[u]);   \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < ROWS; r++)                                                             \
            for (int u = 0; u < WPB; u++)                                                          \
                STORE_ZMM_BF16(y + r * ldy + u * cols, acc[r][u], b ? b + u * NR : NULL, gated);   \
    }
BWIDE(1)
BWIDE(2)
BWIDE(3)
BWIDE(4)
BWIDE(5)
BWIDE(6)
#if WRB > 6
BWIDE(7)
BWIDE(8)
#endif

/* m rows of bfloat16 x times one pair panel into y (row stride ldy). */
static void rows_by_panel_bf16(const uint16_t *x, int m, int64_t lda, const uint16_t *p, int k, uint16_t *y,
                               int64_t ldy, const uint16_t *pf, const float *b, int gated) {
    static void (*const tail[MRB])(const uint16_t *, int64_t, const uint16_t *, int, uint16_t *, int64_t,
                                   const uint16_t *, const float *, int) = {
        NULL, bkernel_1, bkernel_2, bkernel_3, bkernel_4, bkernel_5, bkernel_6, bkernel_7};
    int r = 0;
    for (; r + MRB <= m; r += MRB, pf = NULL) bkernel_8(x + r * lda, lda, p, k, y + r * ldy, ldy, pf, b, gated);
    if (m > r) tail[m - r](x + r * lda, lda, p, k, y + r * ldy, ldy, pf, b, gated);
}

/* m rows of bfloat16 x times np pair panels (pstride apart) into y: WRB x WPB tiles past MRB rows
 * while WPB panels are left, then panel by panel in MRB-row tiles; `done`: rows [0, done) over the
 * first WPB panels are in y already (a quantized chunk's converting block, rows_by_panels). */
static void rows_by_panels_bf16(const uint16_t *x, int m, int k, const uint16_t *p, int64_t pstride, int np,
                                uint16_t *y, int64_t ldy, int cols, const uint16_t *pf, const float *b,
                                int gated, int done) {
    static void (*const wide[WRB + 1])(const uint16_t *, int64_t, const uint16_t *, int64_t, int, uint16_t *,
                                       int64_t, int, const uint16_t *, int, int, const float *, int) = {
        NULL, bwide_1, bwide_2, bwide_3, bwide_4, bwide_5, bwide_6,
#if WRB > 6
        bwide_7, bwide_8
#endif
    };
    int t = 0;
    if (m > MRB)
        for (; t + WPB <= np; t += WPB) {
            const uint16_t *next = t + 2 * WPB <= np ? p + (t + WPB) * pstride : t + WPB < np ? NULL : pf;
            const int passes = (m + WRB - 1) / WRB, per = equal_blocks(m, WRB);
            for (int r = t ? 0 : done, pass = r / per; r < m; r += per, pass++) {
                const int rows = m - r < per ? m - r : per;
                wide[rows](x + (int64_t)r * k, k, p + t * pstride, pstride, k, y + (int64_t)r * ldy + t * cols, ldy,
                           cols, next, pass, passes, b ? b + t * NR : NULL, gated);
            }
        }
    for (; t < np; t++)
        rows_by_panel_bf16(x, m, k, p + t * pstride, k, y + t * cols, ldy, t + 1 < np ? p + (t + 1) * pstride : pf,
                           b ? b + t * NR : NULL, gated);
}

/* ROWS (<= MRB) rows of bfloat16 x times NP quantized panels of format f, each k pair's weights
 * converted in registers (bf16_pairs) and multiplied as bkernel multiplies a pair panel's: the same
 * vdpbf16ps steps in the same order, so the same bits as a bfloat16 linear over the dequantized
 * weight, without the pass through a buffer (at these rows the conversion is most of the work). pf:
 * the next tile's first panel, each group's record lines fetched meanwhile (NULL: none). wout: where
 * the pairs also go, as NP pair panels (k / 2 x 16 words each), for the row blocks after this one
 * (NULL: nowhere). */
static inline __attribute__((always_inline)) void qtile_bf16(const int f, const int ROWS, const int NP, const uint16_t *x,
                                                             int64_t lda, const uint8_t *p, int64_t pbytes, int k, int g,
                                                             uint16_t *y, int64_t ldy, int cols, const uint8_t *pf,
                                                             const float *b, const float *scale, int gated,
                                                             uint32_t *wout) {
    __m512 acc[MRB][4];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < NP; j++) acc[r][j] = _mm512_setzero_ps();
    const int G = f == K_I8 ? k : fmt_group(f, g), direct = fmt_direct(f);
    int8_t buf[4][MAX_GROUP * NR];
    for (int g0 = 0, gi = 0; g0 < k; g0 += G, gi++) {
        const int gl = k - g0 < G ? k - g0 : G;
        vh s[4][PV_HALVES], m[4][PV_HALVES];
        const int8_t *q[4];
        for (int j = 0; j < NP; j++)
            group_setup(f, direct, p + j * pbytes, gi, g0, gl, g, scale ? scale + j * NR : NULL, s[j], m[j], &q[j],
                        buf[j]);
        if (pf && f != K_I8) prefetch_group(f, pf, NP, pbytes, gi, g, gl);
        for (int kk = 0; kk < gl; kk += 2) {
            if (pf && f == K_I8 && kk % 4 == 0)
                for (int j = 0; j < NP; j++) __builtin_prefetch(pf + j * pbytes + (int64_t)(g0 + kk) * NR, 0, 2);
            __m512bh w[4];
            for (int j = 0; j < NP; j++)
                w[j] = bf16_pairs((__m512)group_weights(f, direct, s[j], m[j], q[j], kk, 0),
                                  (__m512)group_weights(f, direct, s[j], m[j], q[j], kk + 1, 0));
            if (wout)
                for (int j = 0; j < NP; j++)
                    _mm512_storeu_si512(wout + ((int64_t)j * k + g0 + kk) / 2 * NR, (__m512i)w[j]);
            for (int r = 0; r < ROWS; r++) {
                int32_t pair;
                memcpy(&pair, x + r * lda + g0 + kk, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
                for (int j = 0; j < NP; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, w[j]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < NP; j++) STORE_ZMM_BF16(y + r * ldy + j * cols, acc[r][j], b ? b + j * NR : NULL, gated);
}

/* qtiles_<format>(rows, np, ...): the in-register tile of that shape (rows <= MRB; np = tile_panels(rows),
 * or 1; or, the first row block past MRB rows, 5 to 8 rows by WPB panels, wout given). */
#define QTILE_CASE(F, R, NP)                                                                                \
    case (R) * 8 + (NP):                                                                                    \
        qtile_bf16(F, R, NP, x, lda, p, pbytes, k, g, y, ldy, cols, pf, b, scale, gated, wout);              \
        return;
#define QTILES(F)                                                                                           \
    static void qtiles_##F(int rows, int np, const uint16_t *x, int64_t lda, const uint8_t *p, int64_t pbytes, \
                           int k, int g, uint16_t *y, int64_t ldy, int cols, const uint8_t *pf, const float *b, \
                           const float *scale, int gated, uint32_t *wout) {                                 \
        switch (rows * 8 + np) {                                                                            \
            QTILE_CASE(F, 1, 4) QTILE_CASE(F, 2, 2) QTILE_CASE(F, 3, 2) QTILE_CASE(F, 1, 1)                 \
            QTILE_CASE(F, 2, 1) QTILE_CASE(F, 3, 1) QTILE_CASE(F, 4, 1) QTILE_CASE(F, 5, 1)                 \
            QTILE_CASE(F, 6, 1) QTILE_CASE(F, 7, 1) QTILE_CASE(F, 8, 1) QTILE_CASE(F, 5, WPB)               \
            QTILE_CASE(F, 6, WPB) QTILE_CASE(F, 7, WPB) QTILE_CASE(F, 8, WPB)                               \
        }                                                                                                   \
    }
QUANTIZED_KINDS(QTILES)
typedef void (*qtiles_fn)(int rows, int np, const uint16_t *x, int64_t lda, const uint8_t *p, int64_t pbytes, int k,
                          int g, uint16_t *y, int64_t ldy, int cols, const uint8_t *pf, const float *b,
                          const float *scale, int gated, uint32_t *wout);
#define QTILES_ENTRY(F) [F] = qtiles_##F,
static const qtiles_fn QTILES_OF[K_COUNT] = {QUANTIZED_KINDS(QTILES_ENTRY)};
#endif
