/* A segment's panels shared out among the threads: row blocks (MC) by panel chunks taken dynamically,
 * each chunk through the tiles of its kind and row count, the partial last panel through a buffer.
 *
 * A part of cpu_gemm.c (included once, in its order; not a header of its own).
 */
/* Whether a step of `rows` rows prefetches each next panel (not one float32 row: gemm_segment_run). */
static inline int prefetches(int kind, int rows) { return rows > 1 || kind != K_F32; }

/* x and y of the segment are bfloat16 (else float32). */
static inline int bf16_io(const gemm_segment *s) { return s->kind == K_BF16 || s->bf16_io; }

/* Past MR rows the quantized panels go through the wide tiles and their buffer (rows_by_panels). In
 * the AVX2 build, for the kinds in SPLIT, up to HR rows the half tiles (each half panel formed once
 * in registers for all the rows), then up to SPLIT_ROWS rows blocks of at most MR rows through the
 * tiles that convert in registers, are faster (the same products, so the same bits): its buffer
 * path has only MR x 1 tiles. The AVX-512 build's 8 x 3 wide tiles in blocks of equal rows are as
 * fast or faster through the buffer, so that build does not split. int4 and Q4_K never paid split
 * (docs/kernels.md). -DSPLIT_ROWS=6 (MR) builds the AVX2 kernel with every kind through the buffer. */
#ifndef SPLIT_ROWS
#if defined(PV_ZMM)
#define SPLIT_ROWS MR /* none */
#else
#define SPLIT_ROWS 16
#endif
#endif
#define SPLIT_ENTRY(F) [F] = 1,
static const char SPLIT[K_COUNT] = {AVX2_SPLIT_KINDS(SPLIT_ENTRY)};
/* m rows of x times the full panels j .. j + np - 1 of segment s into y (panel j's first column; row
 * stride ldy); pf: the panel to prefetch meanwhile (NULL: none); one tile at a time, or past MR rows
 * row blocks over chunks of WP panels. */
static void rows_by_panels(const gemm_segment *s, const char *x, int m, int k, int j, int np, char *y,
                           int64_t ldy, int cols, const uint8_t *pf, int gated) {
    const int64_t pbytes = panel_bytes(s->kind, k, s->group);
    const uint8_t *p = (const uint8_t *)s->panels + j * pbytes;
    const float *b = s->bias ? s->bias + j * NR : NULL, *sc = s->scale ? s->scale + j * NR : NULL;
#if NATIVE_BF16
    if (s->kind == K_BF16) {
        pair_panels(x, m, k, p, pbytes, np, y, ldy, cols, b, gated, pf);
        return;
    }
    if (s->bf16_io && m <= MRB) { /* in registers: tiles of tile_panels(m) panels */
        for (int t = 0; t < np;) {
            const int n = tile_panels(m) <= np - t ? tile_panels(m) : 1;
            QTILES_OF[s->kind](m, n, (const uint16_t *)x, k, p + t * pbytes, pbytes, k, s->group,
                               (uint16_t *)y + t * cols, ldy, cols, t + n < np ? p + (t + n) * pbytes : pf,
                               b ? b + t * NR : NULL, sc ? sc + t * NR : NULL, gated, NULL);
            t += n;
        }
        return;
    }
    if (s->bf16_io) { /* the panels as pairs in the thread's buffer, the next chunk's fetched meanwhile */
        const int64_t pair_bytes = (int64_t)k * NR * 2;
        uint8_t *w = (uint8_t *)thread_buffer(PANEL_BUFFER, (size_t)np * k * NR / 2);
        const int per = equal_blocks(m, WRB); /* the first block's rows: 5 to 8 */
#if HAVE_AMX
        const int amx = m >= AMX_MIN_ROWS && k % 32 == 0 && amx_ready(); /* every row on the tiles, as BF16 */
#else
        const int amx = 0;
#endif
        if (np == WPB && !amx) { /* the first block converts as it multiplies, the others read its pairs */
            QTILES_OF[s->kind](per, np, (const uint16_t *)x, k, p, pbytes, k, s->group, (uint16_t *)y, ldy, cols, pf, b,
                               sc, gated, (uint32_t *)w);
            rows_by_panels_bf16((const uint16_t *)x, m, k, (const uint16_t *)w, pair_bytes / 2, np, (uint16_t *)y, ldy,
                                cols, NULL, b, gated, per);
            return;
        }
        for (int t = 0; t < np; t++)
            DEQUANTIZE_OF[s->kind](p + t * pbytes, k, s->group, sc ? sc + t * NR : NULL, NULL,
                                   (uint32_t *)(w + t * pair_bytes), pf ? pf + t * pbytes : NULL);
        pair_panels(x, m, k, w, pair_bytes, np, y, ldy, cols, b, gated, NULL);
        return;
    }
#else
    if (bf16_io(s)) { /* x widened (widen_pairs); quantized panels first as pairs in the thread's buffer */
        const uint32_t *w = (const uint32_t *)p;
        int64_t words = pbytes / 4;
        if (s->kind != K_BF16) {
            uint32_t *pairs = (uint32_t *)thread_buffer(PANEL_BUFFER, (size_t)np * k * NR / 2);
            for (int t = 0; t < np; t++)
                DEQUANTIZE_OF[s->kind](p + t * pbytes, k, s->group, sc ? sc + t * NR : NULL, NULL,
                                       pairs + (int64_t)t * k * NR / 2, pf ? pf + t * pbytes : NULL);
            w = pairs, words = (int64_t)k * NR / 2, pf = NULL;
        }
        rows_by_panels_bf16((const float *)x, m, k, w, words, np, (uint16_t *)y, ldy, cols, (const uint32_t *)pf, b,
                            gated);
        return;
    }
#endif
#if !defined(PV_ZMM)
    if (m > MR && m <= HR && m <= SPLIT_ROWS && SPLIT[s->kind]) { /* all m rows, each half panel formed once */
        for (int t = 0; t < np; t++)
            HALVES_OF[s->kind](m, (const float *)x, k, p + t * pbytes, k, s->group, (float *)y + t * cols, ldy,
                               t + 1 < np ? p + (t + 1) * pbytes : pf, b ? b + t * NR : NULL, sc ? sc + t * NR : NULL,
                               gated);
        return;
    }
    if (m > MR && m <= SPLIT_ROWS && SPLIT[s->kind]) { /* row blocks of in-register tiles */
        const int per = equal_blocks(m, MR);
        for (int r = 0; r < m; r += per)
            rows_by_panels(s, x + (int64_t)r * k * 4, m - r < per ? m - r : per, k, j, np, y + (int64_t)r * ldy * 4,
                           ldy, cols, r ? NULL : pf, gated);
        return;
    }
#endif
    const float *xf = (const float *)x;
    float *yf = (float *)y;
    if (m <= MR) { /* in registers: tiles of f32_tile_panels(m) panels */
        const tiles_fn tiles = TILES_OF[s->kind];
        for (int t = 0; t < np;) {
            const int n = f32_tile_panels(m) <= np - t ? f32_tile_panels(m) : 1;
            const uint8_t *next = t + n < np ? p + (t + n) * pbytes : pf;
            tiles(m, n, xf, k, p + t * pbytes, pbytes, k, s->group, yf + t * cols, ldy, cols,
                  prefetches(s->kind, m) ? next : NULL, b ? b + t * NR : NULL, sc ? sc + t * NR : NULL, gated);
            t += n;
        }
        return;
    }
    /* Groups of WP panels, each by blocks of at most WR rows (m > MR: the first block has WR - 2 to WR,
     * FIRST_CASES). A quantized group's first block converts its weights in registers and leaves them in the thread's
     * buffer as float32 for the other blocks (the same products: the same bits). Every block
     * prefetches its share of the next group's lines, so memory streams while the FMAs run. */
    float *w = s->kind == K_F32 ? NULL : thread_buffer(PANEL_BUFFER, (size_t)WP * k * NR);
    const int passes = (m + WR - 1) / WR, per = BALANCED ? equal_blocks(m, WR) : WR; /* rows a block */
    for (int t = 0; t < np; t += WP) {
        const int n = np - t < WP ? np - t : WP;
        const uint8_t *pt = p + t * pbytes, *next = t + n < np ? pt + n * pbytes : pf;
        const int lines = next ? (int)((pbytes + 63) / 64) : 0; /* of each next panel, over the passes */
        for (int r = 0, pass = 0; r < m; r += per, pass++) {
            const int rows = m - r < per ? m - r : per, lo = lines * pass / passes;
            const int buffered = w && pass > 0; /* float32 tiles over the buffer the first block filled */
            WIDE_OF[buffered ? K_F32 : s->kind](rows, n, xf + (int64_t)r * k, k, buffered ? (const uint8_t *)w : pt,
                                                buffered ? (int64_t)k * NR * 4 : pbytes, k, s->group,
                                                yf + r * ldy + t * cols, ldy, cols, next ? next + (int64_t)lo * 64 : NULL,
                                                pbytes, lines * (pass + 1) / passes - lo, b ? b + t * NR : NULL,
                                                sc ? sc + t * NR : NULL, gated, w);
        }
    }
}

/* Panel j (partial: only `own` of its columns are real) through a buffer, MR rows at a time; ex, ey:
 * the bytes of an element of x and of y. */
static void partial_panel(const gemm_segment *s, const char *x, int m, int k, int j, char *y, int64_t ldy,
                          int cols, int own, int ex, int ey, int gated) {
    float tile[MR * NR];
    for (int r0 = 0; r0 < m; r0 += MR) {
        const int tr = m - r0 < MR ? m - r0 : MR;
        rows_by_panels(s, x + (int64_t)r0 * k * ex, tr, k, j, 1, (char *)tile, NR, cols, NULL, gated);
        for (int r = 0; r < tr; r++)
            memcpy(y + ((int64_t)(r0 + r) * ldy + j * cols) * ey, (char *)tile + (int64_t)r * NR * ey, (size_t)own * ey);
    }
}

/* y[m, s->cols] (row stride ldy) from x[m, k] and the segment's panels: each panel writes the
 * `cols` = NR or NR / 2 (gated) columns it owns.
 *
 * Threads take chunks of panels from a shared counter and claim their next chunk when they start
 * one, so the panel each one prefetches is always one it will multiply itself (with OpenMP's
 * dynamic schedule the next panel often went to the other thread, into the wrong core's cache). A
 * single float32 row prefetches nothing: the hardware prefetcher alone streams it faster (from a few
 * rows on, the prefetch pays). Quantized and bfloat16 panels, with more work per byte, do prefetch at
 * one row: on the hardware prefetcher alone they streamed well below the memory's rate
 * (docs/kernels.md). */
/* Panels a thread takes at a time at m rows: one wide tile's (its row blocks then share them), else
 * enough for tiles of tile_panels(m) panels and for the prefetch of the next to pay. */
static inline int chunk_panels(int kind, int m) {
#if HAVE_AMX /* AMX multiplies panels two at a time: an even chunk (4 past MR rows, as before 8 x 3) */
    if (kind == K_BF16 && amx_ready()) return m > MR ? 4 : tile_panels(m) > 2 ? tile_panels(m) : 2;
#endif
#if NATIVE_BF16
    if (kind == K_BF16 && m > MRB) return WPB;
#else
    if (kind == K_BF16) return epanels(m) > 2 ? epanels(m) : 2;
#endif
    return m > MR ? (WP > 2 ? WP : 2) : tile_panels(m) > 2 ? tile_panels(m) : 2;
}

static void gemm_segment_run(const gemm_segment *s, const void *x, void *y, int64_t ldy, int m, int k, int gated) {
    if (s->q8_dot) {
        q8_segment_run(s, (const float *)x, (float *)y, ldy, m, k, gated);
        return;
    }
    const int cols = gated ? NR / 2 : NR, width = s->cols, panels = (width + cols - 1) / cols;
    const int chunk = chunk_panels(bf16_io(s) ? K_BF16 : s->kind, m);
    const int chunks = (panels + chunk - 1) / chunk;
    const int ey = bf16_io(s) ? 2 : 4, mr = bf16_io(s) ? 8 : MR;
    const int ex = NATIVE_BF16 ? ey : 4; /* the tiles' x: emulated bfloat16 reads it widened (widen_pairs) */
    const int64_t blocks = ((int64_t)m * k * ex + MC_BYTES - 1) / MC_BYTES; /* equal blocks of x */
    const int mc = (int)((m + blocks - 1) / blocks + mr - 1) / mr * mr;
    const int64_t pbytes = panel_bytes(s->kind, k, s->group);
    for (int m0 = 0; m0 < m; m0 += mc) {
        const int rows = m - m0 < mc ? m - m0 : mc;
        const char *xb = (const char *)x + (int64_t)m0 * k * ey;
#if !NATIVE_BF16
        if (bf16_io(s)) xb = (const char *)widen_pairs((const uint16_t *)xb, rows, k);
#endif
        char *yb = (char *)y + (int64_t)m0 * ldy * ey;
        int counter = 0;
#pragma omp parallel if ((int64_t)rows * width * k >= MIN_PARALLEL)
        for (int c = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED); c < chunks;) {
            const int after = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED); /* this thread's next chunk */
            const int j0 = c * chunk, j1 = (c + 1) * chunk < panels ? (c + 1) * chunk : panels;
            const int full = j1 * cols <= width ? j1 : j1 - 1; /* panels before the partial last one */
            const uint8_t *next =
                prefetches(s->kind, rows) && after < chunks ? (const uint8_t *)s->panels + after * chunk * pbytes : NULL;
            if (full > j0)
                rows_by_panels(s, xb, rows, k, j0, full - j0, yb + (int64_t)j0 * cols * ey, ldy, cols,
                               full == j1 ? next : NULL, gated);
            if (full < j1) partial_panel(s, xb, rows, k, full, yb, ldy, cols, width - full * cols, ex, ey, gated);
            c = after;
        }
    }
}

