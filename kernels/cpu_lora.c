/* A LoRA adapter's delta on its rows of one linear's output, in float32 whatever the activations:
 *
 *     y[i] = y[i] + scaling * ((x[i] A^T) B^T)        for each row i in [lo, hi)
 *
 * with A^T [in, R] and B^T [R, out] held in float32 (the adapter's values, unscaled). Each value
 * depends on its own row alone, whatever the row count, the tile it falls in, the thread split or
 * the vector width, so a line's bits do not change with the rows of the same adapter beside it:
 *
 *   t[i][r]   = one multiply-add chain over k = 0 .. in-1 in order, fused, from zero;
 *   d[i][c]   = one multiply-add chain over r = 0 .. R-1 in order, fused, from zero;
 *   y[i][c]   = fma(d[i][c], scaling, y[i][c]), then, for bfloat16 rows, rounded to bfloat16 once.
 *
 * Vectors run across r (first product) and across c (second), never along a sum: A^T's and B^T's
 * columns are taken in panels of 16, each PV_HALVES vectors of cpu_panel_vec.h (one AVX-512 register,
 * two AVX2 ones), and every lane does the same scalar operations in the same order in either build,
 * so both give the same bits. The first product's rows are written to a scratch of the call; threads
 * split row tiles, then (row tile, panel group) pairs, never a sum.
 *
 * A^T's columns are padded with zeros to a multiple of LANES (`a_ld`) and so are B^T's (`b_ld`), so
 * every tile is whole panels; the columns of y past `out` are never written. bfloat16 rows are read
 * as their float32 values (exact) and rounded to nearest even on the one store (cpu_vec.h's).
 */
#include <stdint.h>
#include <string.h>

#include "cpu_bounds.h"    /* refusal, REFUSED_ROW_RANGE; assert() in the debug build */
#include "cpu_panel_vec.h" /* vh, VW, PV_HALVES, vh_load, vh_store, vh_splat; v8 and bfloat16 from cpu_vec.h */

#define LANES 16 /* a panel's width: A^T's and B^T's columns are padded to a multiple of it */
#define MR    6  /* rows per register tile */
#if defined(PV_ZMM)
#define NP 2 /* panels per register tile: 12 accumulators of AVX-512's 32 registers */
#else
#define NP 1 /* AVX2: 6 x 2 eight-float halves of its 16 registers */
#endif
#define GROUP 4 /* panels a thread takes at a time in the second product */
/* multiply-adds of a call below which it runs on one thread: 2^16 a thread, as the other kernels'
 * MIN_PARALLEL, not tuned for this one */
#define MIN_PARALLEL (1 << 17)

/* x[at] as float32 (a bfloat16 value exactly) */
static inline float x_at(const void *x, size_t at, const int bf16) {
    if (!bf16)
        return ((const float *)x)[at];
    const uint32_t b = (uint32_t)((const uint16_t *)x)[at] << 16;
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* t[i][r0 .. r0 + P LANES) for the M rows from `row` (M and P constants: the accumulators stay in
 * registers) */
static inline __attribute__((always_inline)) void first_tile(const void *x, size_t row, int in, const float *a_t,
                                                             int a_ld, int r0, float *t, const int M, const int P,
                                                             const int bf16) {
    vh acc[MR][NP][PV_HALVES];
    for (int i = 0; i < M; i++)
        for (int j = 0; j < P; j++)
            for (int h = 0; h < PV_HALVES; h++) acc[i][j][h] = (vh){0};
    for (int k = 0; k < in; k++) {
        vh a[NP][PV_HALVES];
        for (int j = 0; j < P; j++)
            for (int h = 0; h < PV_HALVES; h++) a[j][h] = vh_load(a_t + (size_t)k * a_ld + r0 + j * LANES + h * VW);
        for (int i = 0; i < M; i++) {
            const vh xs = vh_splat(x_at(x, (row + i) * (size_t)in + k, bf16));
            for (int j = 0; j < P; j++)
                for (int h = 0; h < PV_HALVES; h++) acc[i][j][h] += xs * a[j][h];
        }
    }
    for (int i = 0; i < M; i++)
        for (int j = 0; j < P; j++)
            for (int h = 0; h < PV_HALVES; h++) vh_store(t + (size_t)i * a_ld + r0 + j * LANES + h * VW, acc[i][j][h]);
}

/* y[at .. at + width) = fma(d, scaling, y) for the first `width` (at most 8) of d's columns; the
 * others untouched */
static inline __attribute__((always_inline)) void add_scaled8(void *y, size_t at, v8 d, float scaling, int width,
                                                              const int bf16) {
    if (width <= 0)
        return;
    if (bf16) {
        uint16_t part[8] = {0}, *dst = width >= 8 ? (uint16_t *)y + at : part;
        if (width < 8)
            memcpy(part, (uint16_t *)y + at, width * sizeof *part);
        store8_bf16(dst, load8_bf16(dst) + d * scaling);
        if (width < 8)
            memcpy((uint16_t *)y + at, part, width * sizeof *part);
    } else {
        float part[8] = {0}, *dst = width >= 8 ? (float *)y + at : part;
        if (width < 8)
            memcpy(part, (float *)y + at, width * sizeof *part);
        store8(dst, load8(dst) + d * scaling);
        if (width < 8)
            memcpy((float *)y + at, part, width * sizeof *part);
    }
}

/* The two 8-column halves of a panel's accumulators */
#if defined(PV_ZMM)
#define HALF(acc, e) ((e) ? vh_hi((acc)[0]) : vh_lo((acc)[0]))
#else
#define HALF(acc, e) ((acc)[e])
#endif

/* y[i][c0 .. c0 + P LANES) (up to column `out`) for the M rows from `row`; t holds their first product */
static inline __attribute__((always_inline)) void second_tile(void *y, size_t row, int out, const float *t, int a_ld,
                                                              int rank, const float *b_t, int b_ld, int c0,
                                                              float scaling, const int M, const int P,
                                                              const int bf16) {
    vh acc[MR][NP][PV_HALVES];
    for (int i = 0; i < M; i++)
        for (int j = 0; j < P; j++)
            for (int h = 0; h < PV_HALVES; h++) acc[i][j][h] = (vh){0};
    for (int r = 0; r < rank; r++) {
        vh b[NP][PV_HALVES];
        for (int j = 0; j < P; j++)
            for (int h = 0; h < PV_HALVES; h++) b[j][h] = vh_load(b_t + (size_t)r * b_ld + c0 + j * LANES + h * VW);
        for (int i = 0; i < M; i++) {
            const vh ts = vh_splat(t[(size_t)i * a_ld + r]);
            for (int j = 0; j < P; j++)
                for (int h = 0; h < PV_HALVES; h++) acc[i][j][h] += ts * b[j][h];
        }
    }
    for (int i = 0; i < M; i++)
        for (int j = 0; j < P; j++)
            for (int e = 0; e < 2; e++) {
                const int c = c0 + j * LANES + e * 8;
                add_scaled8(y, (row + i) * (size_t)out + c, HALF(acc[i][j], e), scaling, out - c, bf16);
            }
}

/* A tile of `m` rows (1 .. MR) by `p` panels (1 .. NP): each shape its own constants, so its own
 * registers */
#define BY_ROWS(m, call, P)      \
    switch (m) {                 \
    case 1: call(1, P); break;   \
    case 2: call(2, P); break;   \
    case 3: call(3, P); break;   \
    case 4: call(4, P); break;   \
    case 5: call(5, P); break;   \
    default: call(MR, P); break; \
    }
#define BY_SHAPE(m, p, call)  \
    if ((p) == NP) {          \
        BY_ROWS(m, call, NP)  \
    } else {                  \
        BY_ROWS(m, call, 1)   \
    }

static inline __attribute__((always_inline)) int lora_delta(const void *x, void *y, int rows, int lo, int hi,
                                                            int in, int out, const float *a_t, int a_ld,
                                                            const float *b_t, int b_ld, int rank,
                                                            float scaling, float *t, refusal *why,
                                                            const int bf16) {
    if (lo < 0 || lo > hi || hi > rows)
        return refuse(why, REFUSED_ROW_RANGE, lo, hi, rows);
    assert(x && y && a_t && b_t && in > 0 && out > 0 && rank > 0);
    assert(a_ld >= rank && a_ld % LANES == 0 && b_ld >= out && b_ld % LANES == 0);
    const int n = hi - lo;
    if (n == 0)
        return REFUSED_NONE;
    assert(t);
    const int tiles = (n + MR - 1) / MR, rank_panels = a_ld / LANES;
#pragma omp parallel for schedule(static) if (tiles > 1 && (int64_t)n * in * a_ld >= MIN_PARALLEL)
    for (int tile = 0; tile < tiles; tile++) {
        const int i0 = tile * MR, m = n - i0 < MR ? n - i0 : MR;
        for (int v = 0; v < rank_panels;) {
            const int step = rank_panels - v >= NP ? NP : 1;
#define FIRST(M, P) first_tile(x, (size_t)lo + i0, in, a_t, a_ld, v * LANES, t + (size_t)i0 * a_ld, M, P, bf16)
            BY_SHAPE(m, step, FIRST)
#undef FIRST
            v += step;
        }
    }
    const int panels = (out + LANES - 1) / LANES, groups = (panels + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(dynamic) if (tiles * groups > 1 && (int64_t)n * rank * panels * LANES >= MIN_PARALLEL)
    for (int job = 0; job < tiles * groups; job++) {
        const int tile = job / groups, group = job % groups;
        const int i0 = tile * MR, m = n - i0 < MR ? n - i0 : MR;
        const int end = (group + 1) * GROUP < panels ? (group + 1) * GROUP : panels;
        for (int v = group * GROUP; v < end;) {
            const int step = end - v >= NP ? NP : 1;
#define SECOND(M, P)                                                                                         \
    second_tile(y, (size_t)lo + i0, out, t + (size_t)i0 * a_ld, a_ld, rank, b_t, b_ld, v * LANES, scaling, M, \
                P, bf16)
            BY_SHAPE(m, step, SECOND)
#undef SECOND
            v += step;
        }
    }
    return REFUSED_NONE;
}

/* Rows [lo, hi) of x [rows, in] and y [rows, out], float32; A^T [in, a_ld] and B^T [rank, b_ld] float32
 * (zeros past rank and out); t [hi - lo, a_ld] float32, the call's scratch. REFUSED_NONE when done, or
 * REFUSED_ROW_RANGE (nothing written) for a range that is not one of the rows. */
int lora_delta_f32(const float *x, float *y, int rows, int lo, int hi, int in, int out, const float *a_t,
                   int a_ld, const float *b_t, int b_ld, int rank, float scaling, float *t, refusal *why) {
    return lora_delta(x, y, rows, lo, hi, in, out, a_t, a_ld, b_t, b_ld, rank, scaling, t, why, 0);
}

/* The same on bfloat16 rows of x and y (their float32 values in, one rounding out). */
int lora_delta_bf16(const uint16_t *x, uint16_t *y, int rows, int lo, int hi, int in, int out,
                    const float *a_t, int a_ld, const float *b_t, int b_ld, int rank, float scaling, float *t,
                    refusal *why) {
    return lora_delta(x, y, rows, lo, hi, in, out, a_t, a_ld, b_t, b_ld, rank, scaling, t, why, 1);
}
