/* bfloat16 activations without AVX512-BF16: vdpbf16ps's products over the pair panels emulated by
 * fused multiply-adds, the same bits.
 *
 * A part of cpu_gemm.c (included once, in its order; not a header of its own).
 */
#if !NATIVE_BF16
/* vdpbf16ps adds to each float32 lane x[2kp + 1] w[2kp + 1], then x[2kp] w[2kp]: each product exact
 * (bfloat16 values have 8 significant bits), each sum rounded once, subnormal inputs and results
 * flushed to zero whatever MXCSR says. Without it each pair's halves are widened (a mask, a shift) and
 * taken by two fused multiply-adds in that order under MXCSR's DAZ and FTZ (flush_subnormals): the
 * same bits, lane for lane, edge cases included (docs/kernels.md), so the products do not depend on
 * the CPU having the instruction. x is widened once per block of rows (widen_pairs), each pair's odd
 * value first, so that every multiply-add takes its x as a broadcast from memory, as the float32
 * tiles do. */
#if defined(PV_ZMM)
#define ER 8 /* rows per tile */
#define EP 3 /* panels per tile from 4 rows (fewer rows: tile_panels) */
#else
#define ER 6
#define EP 1
#endif

/* MXCSR with DAZ and FTZ set; returns the value to restore. (x86; elsewhere a no-op: subnormals are
 * not flushed there.) */
static inline unsigned flush_subnormals(void) {
#if defined(__x86_64__) || defined(__i386__)
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
    return csr;
#else
    return 0;
#endif
}

static inline void restore_csr(unsigned csr) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(csr);
#else
    (void)csr;
#endif
}

/* x [m, k] bfloat16 (k even) as float32 in the calling thread's X_BUFFER, the two values of each pair
 * swapped (out[2kp] = x[2kp + 1], out[2kp + 1] = x[2kp]): the order epairs_tile takes them in. */
static const float *widen_pairs(const uint16_t *x, int m, int k) {
    const int64_t n = (int64_t)m * k;
    float *out = thread_buffer(X_BUFFER, (size_t)n);
    if (!out) abort(); /* no way to report from here; a block of rows, about a megabyte */
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v8u w;
        memcpy(&w, x + i, sizeof w);
        const v8 odd = (v8)(w & 0xffff0000u), even = (v8)(w << 16);
        store8(out + i, __builtin_shufflevector(odd, even, 0, 8, 1, 9, 2, 10, 3, 11));
        store8(out + i + 8, __builtin_shufflevector(odd, even, 4, 12, 5, 13, 6, 14, 7, 15));
    }
    for (; i < n; i += 2) {
        uint32_t w;
        memcpy(&w, x + i, sizeof w);
        const uint32_t odd = w & 0xffff0000u, even = w << 16;
        memcpy(out + i, &odd, sizeof odd);
        memcpy(out + i + 1, &even, sizeof even);
    }
    return out;
}

/* VW words at p, as a value: a memcpy into the tile's array of them kept its accumulators on the stack
 * (AVX2, one row: 40% slower). */
static inline vhu vhu_load(const uint32_t *p) {
    vhu v;
    memcpy(&v, p, sizeof v);
    return v;
}

#if defined(PV_ZMM)
#define STORE_VH_BF16(y, acc, b, gated) store_tile_bf16(y, vh_lo((acc)[0]), vh_hi((acc)[0]), b, gated)
#else
#define STORE_VH_BF16(y, acc, b, gated) store_tile_bf16(y, (acc)[0], (acc)[1], b, gated)
#endif

/* ROWS rows of widened x (widen_pairs; row stride lda) times NP pair panels at p (pstride words
 * apart) into y (row stride ldy, panel j's columns at j * cols); pf: the panels to prefetch meanwhile
 * (NULL: none), a line each per pair; b: the first panel's bias, the next ones NR floats apart. */
static inline __attribute__((always_inline)) void epairs_tile(const int ROWS, const int NP, const float *x, int64_t lda,
                                                              const uint32_t *p, int64_t pstride, int k, uint16_t *y,
                                                              int64_t ldy, int cols, const uint32_t *pf,
                                                              const float *b, int gated) {
    vh acc[ER][4][PV_HALVES];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < NP; j++)
            for (int h = 0; h < PV_HALVES; h++) acc[r][j][h] = (vh){0};
    const unsigned csr = flush_subnormals();
    for (int kp = 0; kp < k / 2; kp++) {
        if (pf)
            for (int j = 0; j < NP; j++) __builtin_prefetch(pf + j * pstride + (int64_t)kp * NR, 0, 2);
        vhu w[4][PV_HALVES];
        for (int j = 0; j < NP; j++)
            for (int h = 0; h < PV_HALVES; h++) w[j][h] = vhu_load(p + j * pstride + (int64_t)kp * NR + h * VW);
        for (int r = 0; r < ROWS; r++) { /* the odd k of the pair first, as vdpbf16ps */
            const vh a = vh_splat(x[r * lda + 2 * kp]);
            for (int j = 0; j < NP; j++)
                for (int h = 0; h < PV_HALVES; h++) acc[r][j][h] += a * (vh)(w[j][h] & 0xffff0000u);
        }
        for (int r = 0; r < ROWS; r++) {
            const vh a = vh_splat(x[r * lda + 2 * kp + 1]);
            for (int j = 0; j < NP; j++)
                for (int h = 0; h < PV_HALVES; h++) acc[r][j][h] += a * (vh)(w[j][h] << 16);
        }
    }
    restore_csr(csr); /* the epilogue rounds as the native tiles' does, under the caller's MXCSR */
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < NP; j++) STORE_VH_BF16(y + r * ldy + j * cols, acc[r][j], b ? b + j * NR : NULL, gated);
}

#define ETILE_CASE(R, NP)                                                                                  \
    case (R) * 8 + (NP):                                                                                   \
        epairs_tile(R, NP, x, lda, p, pstride, k, y, ldy, cols, pf, b, gated);                             \
        return;
#if defined(PV_ZMM)
#define ETILE_CASES                                                                                        \
    ETILE_CASE(1, 4) ETILE_CASE(2, 2) ETILE_CASE(3, 2) ETILE_CASE(4, 3) ETILE_CASE(5, 3) ETILE_CASE(6, 3)  \
    ETILE_CASE(7, 3) ETILE_CASE(8, 3) ETILE_CASE(1, 1) ETILE_CASE(2, 1) ETILE_CASE(3, 1) ETILE_CASE(4, 1)  \
    ETILE_CASE(5, 1) ETILE_CASE(6, 1) ETILE_CASE(7, 1) ETILE_CASE(8, 1)
#else
#define ETILE_CASES                                                                                        \
    ETILE_CASE(1, 2) ETILE_CASE(1, 1) ETILE_CASE(2, 1) ETILE_CASE(3, 1) ETILE_CASE(4, 1) ETILE_CASE(5, 1)  \
    ETILE_CASE(6, 1)
#endif
/* epairs_tile of `rows` (<= ER) rows by np panels (epanels(rows), or 1) */
static void etiles(int rows, int np, const float *x, int64_t lda, const uint32_t *p, int64_t pstride, int k,
                   uint16_t *y, int64_t ldy, int cols, const uint32_t *pf, const float *b, int gated) {
    switch (rows * 8 + np) { ETILE_CASES }
}

/* Panels per emulated tile at m rows: enough independent multiply-add chains at one to three rows. */
static inline int epanels(int m) { return m <= 3 ? tile_panels(m) : EP; }

/* m rows of widened x (row stride k) times np pair panels (pstride words apart) into y: row blocks of
 * equal rows (at most ER) over epanels(m) panels at a time, the first block prefetching the panels
 * after them (the next tile's, or pf after the last). */
static void rows_by_panels_bf16(const float *x, int m, int k, const uint32_t *p, int64_t pstride, int np, uint16_t *y,
                                int64_t ldy, int cols, const uint32_t *pf, const float *b, int gated) {
    const int per = equal_blocks(m, ER), want = epanels(m);
    for (int t = 0; t < np;) {
        const int n = want <= np - t ? want : 1;
        const uint32_t *next = t + n < np ? p + (t + n) * pstride : pf;
        for (int r = 0; r < m; r += per)
            etiles(m - r < per ? m - r : per, n, x + (int64_t)r * k, k, p + t * pstride, pstride, k,
                   y + (int64_t)r * ldy + t * cols, ldy, cols, r ? NULL : next, b ? b + t * NR : NULL, gated);
        t += n;
    }
}
#endif
