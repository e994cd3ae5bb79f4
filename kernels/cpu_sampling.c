/* The sampler's loops over float32 logits rows: the argmax (greedy) and the temperature draw without
 * top-k, top-p or min-p, each reading a row in place instead of torch's passes over [R, V] tensors. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define MIN_PARALLEL (1 << 16) /* elements; below this one thread is faster */

#include "cpu_bounds.h" /* the entry points' index checks, refusal */
#include "cpu_exp.h"    /* exp_poly, exp_poly8: the draw's weights */
#include "cpu_vec.h"    /* v8, load8 */

/* *arg = the index of the first maximum of x[0, n); *nan set where x holds a NaN. */
static void first_max(const float *x, int n, int64_t *arg, int *nan) {
    typedef int32_t v8i __attribute__((vector_size(32)));
    v8 best = (v8){0} - INFINITY;
    v8i at = {0, 1, 2, 3, 4, 5, 6, 7}, lane = at, bad = {0};
    int c = 0;
    for (; c + 8 <= n; c += 8, lane += 8) { /* per lane: the first maximum of its column */
        const v8 v = load8(x + c);
        const v8i gt = v > best;
        best = (v8)(((v8i)v & gt) | ((v8i)best & ~gt));
        at = (lane & gt) | (at & ~gt);
        bad |= v != v;
    }
    float m = -INFINITY;
    int64_t i_m = 0;
    for (int i = 0; i < 8; i++) { /* the lanes' maxima, ties to the lower index */
        *nan |= bad[i] != 0;
        if (c > 0 && (best[i] > m || (best[i] == m && at[i] < i_m))) m = best[i], i_m = at[i];
    }
    for (; c < n; c++) {
        *nan |= x[c] != x[c];
        if (x[c] > m) m = x[c], i_m = c;
    }
    *arg = i_m;
}

/* out[r] = the index of the first maximum of row index[r] of x [x_rows, cols] (row stride `stride`;
 * with index NULL, row r); returns how many rows have no finite maximum: a NaN, +inf, or every logit
 * -inf (their out[r] is -1; the caller fails them, never draws from them); -REFUSED_LOGITS (nothing
 * written, `why` says which) where an index is not one of the x_rows rows. Vectorized: torch's CPU
 * argmax runs lane by lane, several times slower over a large vocabulary (docs/fast_path.md). */
int argmax_rows_f32(const float *x, int rows, const int64_t *index, int cols, int64_t stride, int64_t *out,
                    int x_rows, refusal *why) {
    assert(index || rows <= x_rows);
    if (index && check_indexes(index, rows, 0, x_rows, REFUSED_LOGITS, why)) return -REFUSED_LOGITS;
    int bad_rows = 0;
#pragma omp parallel for if ((int64_t)rows * cols >= MIN_PARALLEL) reduction(+ : bad_rows)
    for (int r = 0; r < rows; r++) {
        const float *row = x + (index ? index[r] : r) * stride;
        int nan = 0;
        int64_t arg;
        first_max(row, cols, &arg, &nan);
        const int bad = nan || !isfinite(row[arg]);
        out[r] = bad ? -1 : arg;
        bad_rows += bad;
    }
    return bad_rows;
}

/* The sampler's weights of x[0, n) (n <= SAMPLE_BLOCK) into w: exp(x / temp - top), 0 where that is
 * below exp's range (a masked token stays impossible); returns their float32 sum, lane by lane then
 * across the lanes. The same tokens always go the same way (8 at a time, then one by one), so a
 * block's weights come out with the same bits however often they are formed. */
#define SAMPLE_BLOCK 256
static float block_weights(const float *x, int n, float temp, float top, float *w) {
    v8 sum = {0};
    int c = 0;
    for (; c + 8 <= n; c += 8) {
        const v8 d = load8(x + c) / temp - top;
#if defined(__AVX2__) && defined(__FMA__)
        const v8 e = (v8)exp_poly8((__m256)d);
#else
        v8 e;
        for (int i = 0; i < 8; i++) e[i] = exp_poly(d[i]);
#endif
        typedef int32_t v8i __attribute__((vector_size(32)));
        const v8 kept = (v8)((v8i)e & (d >= -87.0f));
        store8(w + c, kept);
        sum += kept;
    }
    float s = ((sum[0] + sum[1]) + (sum[2] + sum[3])) + ((sum[4] + sum[5]) + (sum[6] + sum[7]));
    for (; c < n; c++) {
        const float d = x[c] / temp - top;
        w[c] = d >= -87.0f ? exp_poly(d) : 0.0f;
        s += w[c];
    }
    return s;
}

/* The temperature sampler for n rows without top-k, top-p or min-p: for each i, row rows[i] of x
 * [*, cols] (row stride `stride`) tempered by temps[i], weights w_c = exp(x_c / temp - max), and
 * out[i] = the first token whose running sum of weights passes u[i] (in [0, 1)) times the row's
 * total: the CDF inverted at one uniform number, as the torch sampler does it in five passes over
 * [n, V] tensors (divide, max, exp, cumsum, search) where this reads the row twice and writes
 * nothing. The total: float32 sums of blocks of SAMPLE_BLOCK tokens, added in double; the crossing
 * block is found on those, then its tokens' weights are added in order (a rounding shortfall there
 * takes the block's last token of nonzero weight). Returns how many rows have no finite maximum
 * (a NaN, +inf, every token masked, or a maximum that overflows at its temperature: out[i] = -1, the
 * caller fails them); -REFUSED_LOGITS (nothing written, `why` says which) where a row index is not
 * one of x's x_rows rows. */
int sample_rows_f32(const float *x, int n, const int64_t *rows, int cols, int64_t stride, const float *temps,
                    const float *u, int64_t *out, int x_rows, refusal *why) {
    if (check_indexes(rows, n, 0, x_rows, REFUSED_LOGITS, why)) return -REFUSED_LOGITS;
    int bad_rows = 0;
#pragma omp parallel for if ((int64_t)n * cols >= MIN_PARALLEL) reduction(+ : bad_rows)
    for (int i = 0; i < n; i++) {
        const float *row = x + rows[i] * stride;
        int nan = 0;
        int64_t arg;
        first_max(row, cols, &arg, &nan);
        const float top = row[arg] / temps[i];
        if (nan || !isfinite(top)) {
            out[i] = -1;
            bad_rows++;
            continue;
        }
        const int blocks = (cols + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
        float sums[blocks], w[SAMPLE_BLOCK];
        double total = 0.0;
        for (int b = 0; b < blocks; b++) {
            const int c0 = b * SAMPLE_BLOCK;
            total += sums[b] = block_weights(row + c0, cols - c0 < SAMPLE_BLOCK ? cols - c0 : SAMPLE_BLOCK,
                                             temps[i], top, w);
        }
        const double target = (double)u[i] * total;
        double before = 0.0;
        int b = 0, last = 0; /* the block whose sum crosses the target; else the last of nonzero sum */
        for (; b < blocks && before + sums[b] <= target; b++) {
            before += sums[b];
            if (sums[b] > 0.0f) last = b;
        }
        if (b == blocks) b = last, before = -INFINITY; /* then its last token of nonzero weight */
        const int c0 = b * SAMPLE_BLOCK, len = cols - c0 < SAMPLE_BLOCK ? cols - c0 : SAMPLE_BLOCK;
        block_weights(row + c0, len, temps[i], top, w); /* the same bits as above */
        int pick = -1;
        for (int c = 0; c < len && pick < 0; c++)
            if ((before += w[c]) > target) pick = c;
        for (int c = len - 1; pick < 0 && c >= 0; c--)
            if (w[c] > 0.0f) pick = c;
        out[i] = (int64_t)c0 + pick; /* pick >= 0: the block holds a weight above 0 (the maximum's at least) */
    }
    return bad_rows;
}
