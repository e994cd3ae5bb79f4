/* y = x W^T (+ bias) for any row count of x: every CPU linear of a step (decode and prefill), with W
 * in float32, bfloat16, int8 or int4 (weight-only quantization) or a GGUF block type kept as stored.
 *
 * W is repacked once at load into panels of NR = 16 weight rows, k-major: panel j holds W[16j ..
 * 16j+15, kk] for kk = 0 .. k-1 (the last panel zero-padded), in the weight's own format
 * (cpu_gemm_formats.h: float32 as 16 floats per k; quantized types as their values with the scale
 * fields of each group). A tile multiplies up to MR rows of x by one panel (or, at one to three rows,
 * by two or four panels, so enough independent FMA chains run) with its accumulators in registers:
 * per kk it forms the panel's 16 weights in float32 (a load; or a widening load, a conversion and a
 * multiply by the group's scale, plus its offset, for quantized types: in registers), broadcasts
 * each row's input and issues one FMA per row and panel. Every weight enters as the float32 value its
 * format's dequantizer gives, and every product is fma(x, w, acc) in k order, so a quantized panel's
 * products are those of the float32 kernel on the dequantized weight, bit for bit, at every row
 * count and tile shape (batch-invariant). With AVX-512 a panel row is one 512-bit register (MR 12);
 * elsewhere two 8-float vectors (MR 6); both give the same bits (cpu_panel_vec.h).
 *
 * More than MR rows (AVX-512): row blocks of up to WR = 8 rows by WP = 3 panels (24 accumulators, each
 * broadcast of x feeding three FMAs). On cores with full-width 512-bit FMA units a tile of one panel
 * loads a panel vector per MR FMAs and falls behind oneDNN there; of the wide shapes tried 8 x 3 was the
 * fastest, for float32, the quantized kinds and bfloat16 alike (-DWR=6 -DWP=4, -DWRB=6 -DWPB=4 build
 * the 6 x 4 runner-up; docs/kernels.md). Over a quantized chunk of WP panels the first row block goes
 * through a tile that converts in registers and also stores the float32 weights it forms into a
 * per-thread buffer, which the float32 tiles of the other rows then read from cache (a separate pass
 * that dequantized the chunk before the tiles waited on memory with nothing to overlap it). Every row
 * block prefetches its share of the next chunk's lines. AVX2 builds keep MR x 1 tiles (WR = MR,
 * WP = 1).
 *
 * Threads take panels a chunk at a time (dynamically: on a shared machine one core is often slower
 * than the other, and a static split left the faster one waiting); each panel is read once per block
 * of MC rows and then serves every row tile of that block from cache, while the first tile prefetches
 * the thread's next panel. So the weight streams near memory speed at decode row counts (where
 * oneDNN's and MKL's GEMMs stream it well below that) and the FMA units stay busy at prefill row
 * counts. MC keeps a block of x (MC x k) within about 384 KB of L2.
 *
 * A fused gate-up weight of a gated MLP is packed with its halves paired (panel j: gate rows
 * 8j..8j+7, then the up rows of the same index), so one tile holds gate and up of the same 8
 * columns and the kernel writes silu(gate) * up directly: the [m, 2I] product is never stored and
 * read back, and the SiLU costs no pass of its own. Biases are packed the same way (16 per panel)
 * and added before the activation.
 *
 * bfloat16: the same panels with k in pairs (panel j, pair kp: W[16j + c, 2kp + e] at 32 kp + 2c +
 * e, one 64-byte vector), multiplied by pairs of x with vdpbf16ps into float32 accumulators, 8 rows
 * per tile (without AVX512-BF16 the same products in the same order by fused multiply-adds, the
 * instruction's bits: epairs_tile); the sums are rounded once to bfloat16 as a bfloat16
 * linear's output is, and the gated epilogue rounds gate and up first and silu(gate) again, as
 * cpu_llama_ops.c's bfloat16 silu_mul does. Requires an even k (x is read in pairs). With AMX, from
 * AMX_MIN_ROWS rows and k a multiple of 32, the same panels feed TDPBF16PS as its B tiles. Quantized
 * panels under bfloat16 activations (a segment's bf16_io) become such pair panels in registers, each
 * weight rounded to bfloat16 (qtile_bf16; past 8 rows the first row block leaves them in a buffer for
 * the others), so their products are a bfloat16 linear's over the dequantized weight, bit for bit.
 *
 * A linear is one or more segments (gemm_segment: a run of output columns in one format, e.g. the
 * fused QKV of a GGUF whose V is Q6_K and Q, K are Q4_K), each written into its columns of y.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bounds.h"       /* the entry points' index checks, refusal */
#include "cpu_exp.h"          /* exp_poly, exp_poly8 */
#include "cpu_gemm_formats.h" /* formats, vh, NR */
#include "cpu_vec.h"          /* v8, load8, store8 */

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h> /* _mm_getcsr (flush_subnormals); the AVX-512 intrinsics */
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define NATIVE_BF16 1 /* vdpbf16ps; else the pair panels' products emulated (epairs_tile) */

/* Two k's 16 float32 weights (a: k, b: k + 1) as one vector of a bfloat16 pair panel: word c holds
 * (a[c], b[c]), each rounded to nearest even as torch rounds (vcvtne2ps2bf16 would flush a float32
 * subnormal, which no format's weight is: the smallest is a float16 subnormal times a small integer). */
static inline __attribute__((always_inline)) __m512bh bf16_pairs(__m512 a, __m512 b) {
    static const uint16_t order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_loadu_si512(order), (__m512i)_mm512_cvtne2ps_pbh(b, a));
}
#else
#define NATIVE_BF16 0
typedef uint32_t vhu __attribute__((vector_size(VW * 4))); /* a pair panel's words, VW at a time */

/* Each lane's bfloat16, rounded to nearest even, in the lane's top half (the bottom half is garbage), as
 * vcvtne2ps2bf16 rounds: a subnormal is flushed to a zero of its sign (checked against it lane for
 * lane); no NaN comes here (a format's weights are finite). */
static inline vhu bf16_round_bits(vh v) {
    vhu b = (vhu)v;
    const vhu subnormal = (vhu)((b & 0x7f800000u) == 0);
    b &= ~subnormal | 0x80000000u;
    return b + 0x7fffu + ((b >> 16) & 1u);
}
#endif

/* X(kind) for every quantized kind: the per-kind instances of the kernels below and their tables. */
#define QUANTIZED_KINDS(X)                                                                                   \
    X(K_I8) X(K_I4) X(K_I4Z) X(K_Q8_0) X(K_Q4_0) X(K_Q4_1) X(K_Q5_0) X(K_Q5_1) X(K_Q4_K) X(K_Q5_K) X(K_Q6_K)

#if defined(PV_ZMM)
#define MR 12 /* rows per tile: 8 and 16 measured slower (docs/kernels.md) */
#else
#define MR 6
#endif
#define MC_BYTES (384 << 10)
#define MIN_PARALLEL (1 << 16) /* multiply-adds; below this one thread is faster */

/* Panels per tile at `rows` rows: enough independent FMA chains to cover the FMA latency. */
static inline int tile_panels(int rows) {
#if defined(PV_ZMM)
    return rows == 1 ? 4 : rows <= 3 ? 2 : 1;
#else
    return rows == 1 ? 2 : 1;
#endif
}

/* Rows a block when m rows are cut into the fewest blocks of at most `most` rows, of equal size but
 * the last (17 rows, at most 8: 6, 6, 5). */
static inline int equal_blocks(int m, int most) {
    const int blocks = (m + most - 1) / most;
    return (m + blocks - 1) / blocks;
}

/* exp(-g) lane by lane, as cpu_llama_ops.c's SiLU takes it. */
static inline v8 exp_neg8(v8 g) {
#if defined(__AVX2__) && defined(__FMA__)
    return (v8)exp_poly8((__m256)((v8){0} - g));
#else
    v8 e;
    for (int i = 0; i < 8; i++) e[i] = exp_poly(-g[i]);
    return e;
#endif
}

/* silu(g) * u as cpu_llama_ops.c's silu_mul computes it: g / (1 + exp(-g)) * u. */
static inline v8 silu_mul8(v8 g, v8 u) { return g / (1.0f + exp_neg8(g)) * u; }

/* A bfloat16 tile row's 16 float32 sums (lo: columns 0-7, hi: 8-15; + bias) out as 16 bfloat16, or 8 of
 * silu(gate) * up when gated. Inline: called once per accumulator, as a function it had the tiles
 * spill all of them to the stack and reload each as an argument (docs/kernels.md). */
static inline __attribute__((always_inline)) void store_tile_bf16(uint16_t *y, v8 lo, v8 hi, const float *b,
                                                                  int gated) {
    if (b) lo += load8(b), hi += load8(b + 8);
    if (!gated) {
        store8_bf16(y, lo);
        store8_bf16(y + 8, hi);
        return;
    }
    const v8 g = round8_bf16(lo), u = round8_bf16(hi); /* the GEMM's bfloat16 outputs */
    store8_bf16(y, round8_bf16(g / (1.0f + exp_neg8(g))) * u);
}

/* A tile's accumulators out: 16 columns plus the panel's bias (b, or NULL), or 8 columns of
 * silu(lo) * hi when gated. Inline, as store_tile_bf16 (above) says why. */
static inline __attribute__((always_inline)) void store_tile(float *y, v8 lo, v8 hi, const float *b, int gated) {
    if (b) lo += load8(b), hi += load8(b + 8);
    if (gated) {
        store8(y, silu_mul8(lo, hi));
        return;
    }
    store8(y, lo);
    store8(y + 8, hi);
}
#if defined(PV_ZMM)
#define STORE_TILE(y, acc, b, gated) store_tile(y, vh_lo((acc)[0]), vh_hi((acc)[0]), b, gated)
#else
#define STORE_TILE(y, acc, b, gated) store_tile(y, (acc)[0], (acc)[1], b, gated)
#endif

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

/* tiles_<format>(rows, np, ...): the tile of that shape (rows <= MR; np = tile_panels(rows), or 1). */
#define TILE_CASE(F, R, NP)                                                                                 \
    case (R) * 8 + (NP):                                                                                    \
        tile(F, R, NP, x, lda, p, pbytes, k, g, y, ldy, cols, pf, rpf, rpbytes, rlines, b, scale, gated, wout); \
        return;
#if defined(PV_ZMM)
#define TILE_CASES(F)                                                                                        \
    TILE_CASE(F, 1, 4) TILE_CASE(F, 2, 2) TILE_CASE(F, 3, 2) TILE_CASE(F, 1, 1) TILE_CASE(F, 2, 1)          \
    TILE_CASE(F, 3, 1) TILE_CASE(F, 4, 1) TILE_CASE(F, 5, 1) TILE_CASE(F, 6, 1) TILE_CASE(F, 7, 1)          \
    TILE_CASE(F, 8, 1) TILE_CASE(F, 9, 1) TILE_CASE(F, 10, 1) TILE_CASE(F, 11, 1) TILE_CASE(F, 12, 1)
#else
#define TILE_CASES(F)                                                                                        \
    TILE_CASE(F, 1, 2) TILE_CASE(F, 1, 1) TILE_CASE(F, 2, 1) TILE_CASE(F, 3, 1) TILE_CASE(F, 4, 1)          \
    TILE_CASE(F, 5, 1) TILE_CASE(F, 6, 1)
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

/* The panel at p of format f as k x 16 float32 weights into w (the values the tiles multiply by); or,
 * with pairs, as a bfloat16 pair panel there instead (K_BF16's layout: 32-bit word
 * 16 kp + c holds column c's weights at k 2 kp and 2 kp + 1, each rounded to bfloat16 as torch rounds),
 * so bfloat16 activations over a quantized weight take the products of a bfloat16 linear over the
 * dequantized weight: the same tiles over the same panel, the same bits. pf: a panel to prefetch
 * meanwhile (NULL: none), a group's record per group (int8's 64-byte line every 4 k). */
static inline __attribute__((always_inline)) void dequantize_panel(const int f, const uint8_t *p, int k, int g,
                                                                   const float *scale, float *w, uint32_t *pairs,
                                                                   const uint8_t *pf) {
    const int G = f == K_I8 ? k : fmt_group(f, g);
    int8_t buf[MAX_GROUP * NR];
    for (int g0 = 0, gi = 0; g0 < k; g0 += G, gi++) {
        const int gl = k - g0 < G ? k - g0 : G;
        vh s[PV_HALVES], m[PV_HALVES];
        const int8_t *q;
        const int direct = pairs && fmt_direct(f); /* the pairs read nibbles in registers */
        group_setup(f, direct, p, gi, g0, gl, g, scale, s, m, &q, buf);
        if (pf && f != K_I8) prefetch_group(f, pf, 1, 0, gi, g, gl);
        if (pairs) { /* gl is even: k is (bfloat16 x is read in pairs), and so is every group length */
            for (int kk = 0; kk < gl; kk += 2) {
                if (pf && f == K_I8 && kk % 4 == 0) __builtin_prefetch(pf + (int64_t)(g0 + kk) * NR, 0, 2);
#if NATIVE_BF16
                const __m512bh w = bf16_pairs((__m512)group_weights(f, direct, s, m, q, kk, 0),
                                              (__m512)group_weights(f, direct, s, m, q, kk + 1, 0));
                _mm512_storeu_si512(pairs + (int64_t)(g0 + kk) / 2 * NR, (__m512i)w);
#else
                for (int h = 0; h < PV_HALVES; h++) {
                    const vhu w = bf16_round_bits(group_weights(f, direct, s, m, q, kk, h)) >> 16 |
                                  (bf16_round_bits(group_weights(f, direct, s, m, q, kk + 1, h)) & 0xffff0000u);
                    memcpy(pairs + (int64_t)(g0 + kk) / 2 * NR + h * VW, &w, sizeof w);
                }
#endif
            }
            continue;
        }
        for (int kk = 0; kk < gl; kk++)
            for (int h = 0; h < PV_HALVES; h++)
                vh_store(w + (int64_t)(g0 + kk) * NR + h * VW, group_weights(f, 0, s, m, q, kk, h));
    }
}
#define DEQUANTIZE(F)                                                                                       \
    static void dequantize_##F(const uint8_t *p, int k, int g, const float *scale, float *w, uint32_t *pairs, \
                               const uint8_t *pf) {                                                        \
        dequantize_panel(F, p, k, g, scale, w, pairs, pf);                                                  \
    }
QUANTIZED_KINDS(DEQUANTIZE)
typedef void (*dequantize_fn)(const uint8_t *p, int k, int g, const float *scale, float *w, uint32_t *pairs,
                              const uint8_t *pf);
#define DEQUANTIZE_ENTRY(F) [F] = dequantize_##F,
static const dequantize_fn DEQUANTIZE_OF[K_COUNT] = {QUANTIZED_KINDS(DEQUANTIZE_ENTRY)};

/* The calling thread's buffers (kept for the thread's life): PANEL_BUFFER for a chunk of panels in
 * float32 or as pairs, X_BUFFER for a block of bfloat16 x widened (widen_pairs) before the threads
 * start, which they all read. */
enum { PANEL_BUFFER, X_BUFFER };

/* The calling thread's buffer `slot` of at least n floats. */
static float *thread_buffer(int slot, size_t n) {
    static __thread float *buf[2];
    static __thread size_t cap[2];
    if (n > cap[slot]) {
        free(buf[slot]);
        buf[slot] = malloc(n * sizeof(float));
        cap[slot] = buf[slot] ? n : 0;
    }
    return buf[slot];
}

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
#else /* no AVX512-BF16: the pair panels' products emulated */
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

#if NATIVE_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 8 /* fewer rows: vdpbf16ps tiles (as fast or faster there) */
#endif

/* 1 once Linux lets this process use the AMX tile registers (ARCH_REQ_XCOMP_PERM for XTILEDATA). */
static int amx_ready(void) {
    static int state; /* 0 unknown, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELAXED);
    }
    return s > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* m rows of bfloat16 x (row stride k, k a multiple of 32) times np pair panels through AMX: a pair
 * panel's 16 pairs of k (64 bytes each) are exactly a TDPBF16PS B tile, so the panels need no other
 * layout. Blocks of up to 32 rows by 2 panels: C tiles 0-3 (rows 0-15 / 16-31 by panel 0 / 1), x
 * tiles 4-5, panel tiles 6-7; the float32 sums then leave through store_tile_bf16 as the vdpbf16ps
 * tiles' do. The first block of rows prefetches the next pair of panels (after the last pair: pf),
 * slice by slice beside its own loads: the tile loads alone left the multiplies waiting on memory. */
static void rows_by_panels_amx(const uint16_t *x, int m, int k, const uint8_t *p, int64_t pbytes, int np,
                               uint16_t *y, int64_t ldy, int cols, const float *b, int gated, const uint8_t *pf) {
    float c[4][16 * 16] __attribute__((aligned(64)));
    for (int r0 = 0; r0 < m; r0 += 32) {
        const int rows = m - r0 < 32 ? m - r0 : 32, ra = rows < 16 ? rows : 16, rb = rows - ra;
        tile_config cfg = {.palette = 1};
        for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
        cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)ra;
        cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(rb ? rb : 1);
        cfg.rows[6] = cfg.rows[7] = 16;
        _tile_loadconfig(&cfg);
        const uint16_t *xa = x + (int64_t)r0 * k, *xb = xa + (int64_t)16 * k;
        for (int t = 0; t < np; t += 2) {
            const int two = t + 1 < np;
            const uint8_t *p0 = p + t * pbytes, *p1 = p0 + pbytes;
            const uint8_t *n0 = r0 ? NULL : t + 2 < np ? p0 + 2 * pbytes : pf; /* the pair to prefetch */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int k0 = 0; k0 < k; k0 += 32) {
                if (n0)
                    for (int l = 0; l < 1024; l += 64) {
                        __builtin_prefetch(n0 + (int64_t)k0 * 32 + l, 0, 3);
                        __builtin_prefetch(n0 + pbytes + (int64_t)k0 * 32 + l, 0, 3);
                    }
                _tile_loadd(4, xa + k0, k * 2);
                _tile_loadd(6, p0 + (int64_t)k0 * 32, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (rb) {
                    _tile_loadd(5, xb + k0, k * 2);
                    _tile_dpbf16ps(2, 5, 6);
                }
                if (two) {
                    _tile_loadd(7, p1 + (int64_t)k0 * 32, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    if (rb) _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            for (int u = 0; u <= two; u++) {
                const float *bu = b ? b + (t + u) * NR : NULL;
                for (int r = 0; r < rows; r++)
                    STORE_ZMM_BF16(y + (int64_t)(r0 + r) * ldy + (t + u) * cols,
                                    _mm512_load_ps(c[(r >= 16) * 2 + u] + (r & 15) * 16), bu, gated);
            }
        }
    }
    _tile_release();
}
#else
#define HAVE_AMX 0
#endif

#if NATIVE_BF16
/* m rows of bfloat16 x times np pair panels at p (pbytes apart) into y: AMX tiles where they serve,
 * else vdpbf16ps tiles; pf: the panel after them, prefetched meanwhile (NULL: none). */
static void pair_panels(const char *x, int m, int k, const uint8_t *p, int64_t pbytes, int np, char *y, int64_t ldy,
                        int cols, const float *b, int gated, const uint8_t *pf) {
#if HAVE_AMX
    if (m >= AMX_MIN_ROWS && k % 32 == 0 && amx_ready()) {
        rows_by_panels_amx((const uint16_t *)x, m, k, p, pbytes, np, (uint16_t *)y, ldy, cols, b, gated, pf);
        return;
    }
#endif
    rows_by_panels_bf16((const uint16_t *)x, m, k, (const uint16_t *)p, pbytes / 2, np, (uint16_t *)y, ldy, cols,
                        (const uint16_t *)pf, b, gated, 0);
}
#endif

/* Whether a step of `rows` rows prefetches each next panel (not one float32 row: gemm_segment_run). */
static inline int prefetches(int kind, int rows) { return rows > 1 || kind != K_F32; }

/* One run of a linear's output columns in one format (pagedinfer/model/packed_linear.py builds them):
 * panels [P][panel_bytes(kind, k, group)], bias and scale (I8) [P][16] float32 or NULL. bf16_io: x and
 * y in bfloat16 over a quantized kind: its weights are rounded to bfloat16 pairs (qtile_bf16 in
 * registers, or dequantize_panel) and multiplied as K_BF16's are. */
typedef struct {
    int kind, group, cols; /* cols: this segment's outputs (the gated half's for a gated one) */
    const void *panels;
    const float *bias, *scale;
    int bf16_io;
} gemm_segment;

/* x and y of the segment are bfloat16 (else float32). */
static inline int bf16_io(const gemm_segment *s) { return s->kind == K_BF16 || s->bf16_io; }

/* Past MR rows the quantized panels go through the wide tiles and their buffer (rows_by_panels). In
 * the AVX2 build, up to SPLIT_ROWS rows, for the kinds in SPLIT, row blocks of at most MR rows through
 * the tiles that convert in registers are faster (the same products, so the same bits): its buffer
 * path has only MR x 1 tiles. The AVX-512 build's 8 x 3 wide tiles in blocks of equal rows are as
 * fast or faster through the buffer, so that build does not split. int4 and Q4_K never paid split
 * (docs/kernels.md). */
#ifndef SPLIT_ROWS
#if defined(PV_ZMM)
#define SPLIT_ROWS MR /* none */
#else
#define SPLIT_ROWS 16
#endif
#endif
static const char SPLIT[K_COUNT] = {[K_I8] = 1, [K_Q8_0] = 1, [K_Q6_K] = 1, [K_Q4_0] = 1, [K_Q4_1] = 1};
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
    if (m > MR && m <= SPLIT_ROWS && SPLIT[s->kind]) { /* row blocks of in-register tiles */
        const int per = equal_blocks(m, MR);
        for (int r = 0; r < m; r += per)
            rows_by_panels(s, x + (int64_t)r * k * 4, m - r < per ? m - r : per, k, j, np, y + (int64_t)r * ldy * 4,
                           ldy, cols, r ? NULL : pf, gated);
        return;
    }
    const float *xf = (const float *)x;
    float *yf = (float *)y;
    if (m <= MR) { /* in registers: tiles of tile_panels(m) panels */
        const tiles_fn tiles = TILES_OF[s->kind];
        for (int t = 0; t < np;) {
            const int n = tile_panels(m) <= np - t ? tile_panels(m) : 1;
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

/* 1 where this build has the kind's kernel (every build has every kind's), else 0. */
int gemm_kind_available(int kind) { return kind >= 0 && kind < K_COUNT; }

/* 1 where the bfloat16 pair panels multiply with vdpbf16ps, 0 where the same products are emulated. */
int gemm_native_bf16(void) { return NATIVE_BF16; }

/* 1 where bfloat16 panels of 8 rows and more run on AMX tiles here (built for them, and Linux lets
 * this process use them), else 0. */
int gemm_amx(void) {
#if HAVE_AMX
    return amx_ready();
#else
    return 0;
#endif
}

/* Bytes of one panel of k weights per column in this kind (group: I4's), as packed_linear.py lays it. */
int64_t gemm_panel_bytes(int kind, int k, int group) { return panel_bytes(kind, k, group); }

/* y[m, sum of cols] = x[m, k] @ W^T (+ bias) for W in nseg segments, each writing its columns (x and y
 * float32, or bfloat16 for BF16 panels and bf16_io segments); gated: silu(gate) * up of each paired panel (one segment).
 * Safe at m = 0 (nothing to do). */
void gemm_segments(const gemm_segment *seg, int nseg, const void *x, void *y, int m, int k, int gated) {
    if (m <= 0 || k <= 0) return;
    int64_t width = 0;
    for (int i = 0; i < nseg; i++) {
        assert(gemm_kind_available(seg[i].kind) && bf16_io(&seg[i]) == bf16_io(&seg[0]));
        width += seg[i].cols;
    }
    const int e = bf16_io(&seg[0]) ? 2 : 4;
    for (int i = 0, at = 0; i < nseg; at += seg[i].cols, i++)
        gemm_segment_run(&seg[i], x, (char *)y + (int64_t)at * e, width, m, k, gated);
}

/* Rows `rows[0 .. n)` of the segment's W (output features; not gated) as float32 into out[n, k]: the
 * weights the kernels multiply by (an embedding lookup on a quantized, tied lm_head). Every row is
 * checked against the segment's s->cols first: 0, or (nothing written) REFUSED_TOKEN. */
int gemm_panel_rows(const gemm_segment *s, const int64_t *rows, int n, int k, float *out, refusal *why) {
    assert(gemm_kind_available(s->kind) && s->kind != K_BF16);
    const int refused = check_indexes(rows, n, 0, s->cols, REFUSED_TOKEN, why);
    if (refused || n <= 0 || k <= 0) return refused;
    const int64_t pbytes = panel_bytes(s->kind, k, s->group);
#pragma omp parallel if ((int64_t)n * k >= MIN_PARALLEL)
    {
        float *w = thread_buffer(PANEL_BUFFER, (size_t)k * NR);
#pragma omp for
        for (int i = 0; i < n; i++) {
            const int64_t j = rows[i] / NR, c = rows[i] % NR;
            const uint8_t *p = (const uint8_t *)s->panels + j * pbytes;
            if (s->kind == K_F32) {
                for (int kk = 0; kk < k; kk++) out[(int64_t)i * k + kk] = ((const float *)p)[(int64_t)kk * NR + c];
                continue;
            }
            DEQUANTIZE_OF[s->kind](p, k, s->group, s->scale ? s->scale + j * NR : NULL, w, NULL, NULL);
            for (int kk = 0; kk < k; kk++) out[(int64_t)i * k + kk] = w[(int64_t)kk * NR + c];
        }
    }
    return REFUSED_NONE;
}
