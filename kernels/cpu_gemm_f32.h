/* float32 activations: the tiles over float32 panels and over quantized (int8, int4, GGUF) panels,
 * whose weights are formed in float32 in registers (or read from a dequantized chunk past MR rows).
 *
 * A part of cpu_gemm.c (included once, in its order; not a header of its own).
 */
/* Whether a tile of ROWS rows reads kind f from its nibbles in registers (cpu_gemm_formats.h): at 1
 * and 2 rows, where converting the weights is most of the work; from 3 rows the rows share each
 * unpacked group, and unpacking once is as fast or faster (docs/kernels.md). */
#define DIRECT(f, ROWS) (fmt_direct(f) && (ROWS) <= 2)

/* Group gi's record (gl values a column) of each of np panels from pf (pbytes apart), fetched ahead:
 * what the tile after this one reads, a group at a time as this one reads its own. */
static inline __attribute__((always_inline)) void prefetch_group(int f, const uint8_t *pf, int np, int64_t pbytes,
                                                                 int gi, int g, int gl) {
    const int64_t at = group_offset(f, gi, g), rec = fmt_record_bytes(f, gl);
    for (int j = 0; j < np; j++)
        for (int64_t o = 0; o < rec; o += 64) __builtin_prefetch(pf + j * pbytes + at + o, 0, 2);
}

/* Lines to prefetch spread evenly over a tile's k steps: `lines` lines from `at` of each of the
 * tile's NP panels' successors (pbytes apart), the share of the next panels that one of the row
 * blocks over the same panels fetches. */
typedef struct {
    const uint8_t *at; /* the next line of the first panel */
    int64_t pbytes;
    int lines, acc; /* acc: lines * steps so far, less k per line fetched */
} spread;

/* Step kk of group gi (k index i = g0 + kk) of a tile (below): the NP panels' 16 weights at i times
 * ROWS values of x, into the accumulators (and, with wout, into wout: panel j's k x 16 floats at
 * j * k * NR); the prefetches spread over the k. */
static inline __attribute__((always_inline)) void tile_step(const int f, const int ROWS, const int NP, const float *x,
                                                            int64_t lda, const uint8_t *p, int64_t pbytes, int k,
                                                            int g, const uint8_t *pf, spread *sp, int gi, int gl,
                                                            int kk, int i, const vh (*s)[PV_HALVES],
                                                            const vh (*m)[PV_HALVES], const int8_t *const *q,
                                                            float *wout, vh (*acc)[4][PV_HALVES]) {
    /* Q8_0 at one row: the next tile's 8.5 lines a group spread over the group, as int8's lines (a
     * burst at the group's start fills the miss buffers and stalls the loads behind it) */
    if (f == K_Q8_0 && ROWS == 1 && pf && kk % 4 == 0) {
        const int64_t at = group_offset(f, gi, g), rec = fmt_record_bytes(f, gl);
        for (int j = 0; j < NP; j++)
            for (int64_t o = rec * kk / gl / 64 * 64; o < rec * (kk + 4) / gl; o += 64)
                __builtin_prefetch(pf + j * pbytes + at + o, 0, 2);
    }
    if (sp->lines)
        if ((sp->acc += sp->lines) >= k) { /* lines <= k (two blocks or more): one a step at most */
            sp->acc -= k;
            for (int j = 0; j < NP; j++) __builtin_prefetch(sp->at + j * sp->pbytes, 0, 2);
            sp->at += 64;
        }
    /* a 64-byte line's k: float32's every one, int8's every fourth */
    if (pf && (f == K_F32 || (f == K_I8 && i % 4 == 0)))
        for (int j = 0; j < NP; j++)
            __builtin_prefetch(pf + j * pbytes + (int64_t)i * NR * (f == K_F32 ? 4 : 1), 0, 2);
    vh w[4][PV_HALVES];
    for (int j = 0; j < NP; j++)
        for (int h = 0; h < PV_HALVES; h++)
            w[j][h] = f == K_F32 ? vh_load((const float *)(p + j * pbytes) + (int64_t)i * NR + h * VW)
                                 : group_weights(f, DIRECT(f, ROWS), s[j], m[j], q[j], kk, h);
    if (wout)
        for (int j = 0; j < NP; j++)
            for (int h = 0; h < PV_HALVES; h++) vh_store(wout + ((int64_t)j * k + i) * NR + h * VW, w[j][h]);
    for (int r = 0; r < ROWS; r++) {
        const vh a = vh_splat(x[r * lda + i]);
        for (int j = 0; j < NP; j++)
            for (int h = 0; h < PV_HALVES; h++) acc[r][j][h] += a * w[j][h];
    }
}

/* ROWS rows of x (row stride lda) times NP consecutive panels of format f at p (pbytes apart) into y
 * (row stride ldy, panel j's columns at j * cols), each panel's accumulators in registers; pf: the
 * next tile's first panel, prefetched while these are multiplied (NULL: none); or rlines lines from
 * rpf spread over the k (a row block's share of the next panels); b, scale: the first panel's bias
 * and (I8) column scales, the next panels' NR floats apart; wout: where the panels' float32 weights
 * go as they are formed (NULL: nowhere). */
static inline __attribute__((always_inline)) void tile(const int f, const int ROWS, const int NP, const float *x,
                                                       int64_t lda, const uint8_t *p, int64_t pbytes, int k, int g,
                                                       float *y, int64_t ldy, int cols, const uint8_t *pf,
                                                       const uint8_t *rpf, int64_t rpbytes, int rlines,
                                                       const float *b, const float *scale, int gated, float *wout) {
    vh acc[MR][4][PV_HALVES];
    spread sp = {rpf, rpbytes, rpf ? rlines : 0, 0};
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < NP; j++)
            for (int h = 0; h < PV_HALVES; h++) acc[r][j][h] = (vh){0};
    const int G = f == K_F32 || f == K_I8 ? k : fmt_group(f, g);
    int8_t buf[4][MAX_GROUP * NR]; /* a group's unpacked values per panel (formats stored in nibbles) */
    for (int g0 = 0, gi = 0; g0 < k; g0 += G, gi++) {
        const int gl = k - g0 < G ? k - g0 : G;
        vh s[4][PV_HALVES], m[4][PV_HALVES];
        const int8_t *q[4];
        if (f != K_F32) {
            for (int j = 0; j < NP; j++)
                group_setup(f, DIRECT(f, ROWS), p + j * pbytes, gi, g0, gl, g, scale ? scale + j * NR : NULL, s[j],
                            m[j], &q[j], buf[j]);
            if (pf && f != K_I8 && (f != K_Q8_0 || ROWS > 1)) prefetch_group(f, pf, NP, pbytes, gi, g, gl);
        }
        if (DIRECT(f, ROWS)) /* by 4, so that each step knows kk & 3 (nibble_values) */
            for (int kk = 0; kk < gl; kk += 4)
                for (int u = 0; u < 4 && kk + u < gl; u++)
                    tile_step(f, ROWS, NP, x, lda, p, pbytes, k, g, pf, &sp, gi, gl, kk + u, g0 + kk + u, s, m, q,
                              wout, acc);
        else
            for (int kk = 0; kk < gl; kk++)
                tile_step(f, ROWS, NP, x, lda, p, pbytes, k, g, pf, &sp, gi, gl, kk, g0 + kk, s, m, q, wout, acc);
    }
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < NP; j++) STORE_TILE(y + r * ldy + j * cols, acc[r][j], b ? b + j * NR : NULL, gated);
}

/* tiles_<format>(rows, np, ...): the tile of that shape (rows <= MR; np = f32_tile_panels(rows), or 1). */
#define TILE_CASE(F, R, NP)                                                                                 \
    case (R) * 8 + (NP):                                                                                    \
        tile(F, R, NP, x, lda, p, pbytes, k, g, y, ldy, cols, pf, rpf, rpbytes, rlines, b, scale, gated, wout); \
        return;
#if defined(PV_ZMM)
#define TILE_CASES(F)                                                                                        \
    TILE_CASE(F, 1, 4) TILE_CASE(F, 2, 2) TILE_CASE(F, 3, 2) TILE_CASE(F, 4, 2) TILE_CASE(F, 5, 2)          \
    TILE_CASE(F, 1, 1) TILE_CASE(F, 2, 1)                                                                    \
    TILE_CASE(F, 3, 1) TILE_CASE(F, 4, 1) TILE_CASE(F, 5, 1) TILE_CASE(F, 6, 1) TILE_CASE(F, 7, 1)          \
    TILE_CASE(F, 8, 1) TILE_CASE(F, 9, 1) TILE_CASE(F, 10, 1) TILE_CASE(F, 11, 1) TILE_CASE(F, 12, 1)
#else
#define TILE_CASES(F)                                                                                        \
    TILE_CASE(F, 1, 2) TILE_CASE(F, 1, 1) TILE_CASE(F, 2, 1) TILE_CASE(F, 3, 1) TILE_CASE(F, 4, 1)          \
    TILE_CASE(F, 5, 1) TILE_CASE(F, 6, 1)
#endif
/* Panels per float32-activation tile at `rows` rows: tile_panels, but two at 4 and 5 rows with
 * AVX-512 (one panel left 4 or 5 FMA chains, too few to cover the FMA latency; from 6 rows two
 * panels ran as fast or slower: docs/kernels.md). Any shape gives the same bits. */
#if defined(PV_ZMM)
static inline int f32_tile_panels(int rows) { return rows == 4 || rows == 5 ? 2 : tile_panels(rows); }
#else
static inline int f32_tile_panels(int rows) { return tile_panels(rows); }
#endif
#define TILES(F)                                                                                             \
    static void tiles_##F(int rows, int np, const float *x, int64_t lda, const uint8_t *p, int64_t pbytes,   \
                          int k, int g, float *y, int64_t ldy, int cols, const uint8_t *pf, const float *b,  \
                          const float *scale, int gated) {                                                   \
        const uint8_t *const rpf = NULL;                                                                     \
        const int64_t rpbytes = 0;                                                                           \
        const int rlines = 0;                                                                                \
        float *const wout = NULL;                                                                            \
        switch (rows * 8 + np) { TILE_CASES(F) }                                                             \
    }
TILES(K_F32)
QUANTIZED_KINDS(TILES)
#if !defined(PV_ZMM)
/* most rows of a half tile (HR accumulators, a weight vector and a broadcast of the 16 registers):
 * 12 rows gained nothing on two blocks of MR rows, and two half tiles lost to them (docs/kernels.md) */
#define HR 11
/* AVX2, MR + 1 to HR rows: ROWS rows by half h of one quantized panel (8 columns), the half's
 * weights formed once for all the rows (where two MR-row blocks each formed the whole panel's): one
 * pass per half, the group set up again for the second half (a widening of bytes, no conversion to
 * float32 wasted). The same weights, x and fma(x, w, acc) in k order as tile(): the same bits. Gated:
 * half 0 leaves gate + bias in y, half 1 reads it back and writes silu(gate) * up there, as store_tile
 * does in registers. pf: the next panel, prefetched in the first pass. */
static inline __attribute__((always_inline)) void half_pass(const int f, const int ROWS, const int h, const float *x,
                                                            int64_t lda, const uint8_t *p, int k, int g, float *y,
                                                            int64_t ldy, const uint8_t *pf, const float *b,
                                                            const float *scale, int gated) {
    vh acc[HR];
    for (int r = 0; r < ROWS; r++) acc[r] = (vh){0};
    const int G = f == K_I8 ? k : fmt_group(f, g);
    int8_t buf[MAX_GROUP * NR];
    for (int g0 = 0, gi = 0; g0 < k; g0 += G, gi++) {
        const int gl = k - g0 < G ? k - g0 : G;
        vh s[PV_HALVES], m[PV_HALVES];
        const int8_t *q;
        group_setup(f, 0, p, gi, g0, gl, g, scale, s, m, &q, buf);
        if (pf && f != K_I8) prefetch_group(f, pf, 1, 0, gi, g, gl);
        for (int kk = 0; kk < gl; kk++) {
            if (pf && f == K_I8 && (g0 + kk) % 4 == 0) __builtin_prefetch(pf + (int64_t)(g0 + kk) * NR, 0, 2);
            const vh w = group_weights(f, 0, s, m, q, kk, h);
            for (int r = 0; r < ROWS; r++) acc[r] += vh_splat(x[r * lda + g0 + kk]) * w;
        }
    }
    for (int r = 0; r < ROWS; r++) {
        float *yr = y + r * ldy;
        vh v = acc[r];
        if (b) v += load8(b + h * VW);
        if (!gated)
            store8(yr + h * VW, v);
        else if (h == 0)
            store8(yr, v); /* gate + bias, until half 1 */
        else
            store8(yr, silu_mul8(load8(yr), v));
    }
}

static inline __attribute__((always_inline)) void half_tile(const int f, const int ROWS, const float *x, int64_t lda,
                                                            const uint8_t *p, int k, int g, float *y, int64_t ldy,
                                                            const uint8_t *pf, const float *b, const float *scale,
                                                            int gated) {
    half_pass(f, ROWS, 0, x, lda, p, k, g, y, ldy, pf, b, scale, gated);
    half_pass(f, ROWS, 1, x, lda, p, k, g, y, ldy, NULL, b, scale, gated);
}

#define HALF_CASE(F, R)                                                                                     \
    case R: half_tile(F, R, x, lda, p, k, g, y, ldy, pf, b, scale, gated); return;
/* halves_<format>(rows, ...): the half tiles of MR + 1 to HR rows. */
#define HALVES(F)                                                                                            \
    static void halves_##F(int rows, const float *x, int64_t lda, const uint8_t *p, int k, int g, float *y,   \
                           int64_t ldy, const uint8_t *pf, const float *b, const float *scale, int gated) {  \
        switch (rows) {                                                                                      \
            HALF_CASE(F, 7) HALF_CASE(F, 8) HALF_CASE(F, 9) HALF_CASE(F, 10) HALF_CASE(F, 11)                 \
        }                                                                                                    \
    }
AVX2_SPLIT_KINDS(HALVES)
typedef void (*halves_fn)(int rows, const float *x, int64_t lda, const uint8_t *p, int k, int g, float *y,
                          int64_t ldy, const uint8_t *pf, const float *b, const float *scale, int gated);
#define HALVES_ENTRY(F) [F] = halves_##F,
static const halves_fn HALVES_OF[K_COUNT] = {AVX2_SPLIT_KINDS(HALVES_ENTRY)};
#endif
#if defined(PV_ZMM)
#ifndef WR
#define WR 8 /* past MR rows: tiles of WR rows by WP float32 panels, 24 accumulators */
#define WP 3
#endif
#if WR < 6 || WR > 8 || WP < 1 || WP > 4
#error "WR: 6 to 8 rows (FIRST_CASES), WP: 1 to 4 panels"
#endif
#if WP == 4 /* the tiles of R rows by 1 to WP panels */
#define WIDE_ROW_OF(F, R) TILE_CASE(F, R, 1) TILE_CASE(F, R, 2) TILE_CASE(F, R, 3) TILE_CASE(F, R, 4)
#elif WP == 3
#define WIDE_ROW_OF(F, R) TILE_CASE(F, R, 1) TILE_CASE(F, R, 2) TILE_CASE(F, R, 3)
#elif WP == 2
#define WIDE_ROW_OF(F, R) TILE_CASE(F, R, 1) TILE_CASE(F, R, 2)
#else
#define WIDE_ROW_OF(F, R) TILE_CASE(F, R, 1)
#endif
#define WIDE_CASES                                                                                           \
    WIDE_ROW_OF(K_F32, 1) WIDE_ROW_OF(K_F32, 2) WIDE_ROW_OF(K_F32, 3) WIDE_ROW_OF(K_F32, 4)                  \
    WIDE_ROW_OF(K_F32, 5) WIDE_ROW_OF(K_F32, 6) WIDE_ROW_OF(K_F32, 7) WIDE_ROW_OF(K_F32, 8)
/* Row blocks of equal rows (equal_blocks; 17 rows: 6, 6, 5 rather than 8, 8, 1): WR - 2 to WR past MR
 * rows, the first block's, which a quantized group's converting tiles cover. */
#define BALANCED 1
#define FIRST_CASES(F) WIDE_ROW_OF(F, WR - 2) WIDE_ROW_OF(F, WR - 1) WIDE_ROW_OF(F, WR)
#else
#define WR MR
#define WP 1
#define WIDE_CASES TILE_CASES(K_F32)
/* Full blocks first: with these tiles of one panel fewer rows give fewer FMA chains (7 and 8 rows as
 * 4 + 3 and 4 + 4 ran slower than 6 + 1 and 6 + 2). */
#define BALANCED 0
#define FIRST_CASES(F) TILE_CASE(F, WR, 1)
#endif
/* wide_<format>(rows, np, ...): past MR rows, a block of at most WR rows by np <= WP panels, with its
 * share (rlines lines from rpf) of the next panels to prefetch: float32 at any rows, reading float32
 * panels or the buffer w; a quantized format at a first block's rows (FIRST_CASES), converting in
 * registers and storing the float32 weights into w for the blocks after it over the same panels. */
#define WIDE(F, CASES, WOUT)                                                                                 \
    static void wide_##F(int rows, int np, const float *x, int64_t lda, const uint8_t *p, int64_t pbytes,    \
                         int k, int g, float *y, int64_t ldy, int cols, const uint8_t *rpf, int64_t rpbytes, \
                         int rlines, const float *b, const float *scale, int gated, float *w) {              \
        const uint8_t *const pf = NULL;                                                                      \
        float *const wout = WOUT;                                                                            \
        (void)w;                                                                                             \
        switch (rows * 8 + np) { CASES }                                                                     \
    }
WIDE(K_F32, WIDE_CASES, NULL)
#define WIDE_QUANTIZED(F) WIDE(F, FIRST_CASES(F), w)
QUANTIZED_KINDS(WIDE_QUANTIZED)

typedef void (*wide_fn)(int rows, int np, const float *x, int64_t lda, const uint8_t *p, int64_t pbytes, int k,
                        int g, float *y, int64_t ldy, int cols, const uint8_t *rpf, int64_t rpbytes,
                        int rlines, const float *b, const float *scale, int gated, float *w);
#define WIDE_ENTRY(F) [F] = wide_##F,
static const wide_fn WIDE_OF[K_COUNT] = {[K_F32] = wide_K_F32, QUANTIZED_KINDS(WIDE_ENTRY)};
typedef void (*tiles_fn)(int rows, int np, const float *x, int64_t lda, const uint8_t *p, int64_t pbytes, int k,
                         int g, float *y, int64_t ldy, int cols, const uint8_t *pf, const float *b,
                         const float *scale, int gated);
#define TILES_ENTRY(F) [F] = tiles_##F,
static const tiles_fn TILES_OF[K_COUNT] = {[K_F32] = tiles_K_F32, QUANTIZED_KINDS(TILES_ENTRY)};

