/* y = x W^T (+ bias) on float32 for any row count of x: every CPU linear of a step (decode and prefill).
 *
 * W is repacked once at load into panels of NR = 16 weight rows, k-major: panel j holds
 * W[16j .. 16j+15, kk] for kk = 0 .. k-1 as k runs of 16 floats (the last panel zero-padded). A
 * micro-kernel multiplies MR <= 6 rows of x by one panel with 6 x 2 vector accumulators in
 * registers: per kk it loads 16 weights (two 8-float vectors), broadcasts 6 inputs and issues 12
 * FMAs, so it runs at the FMA units' rate (measured: 89-91 GFLOP/s on one AMD EPYC core, 93.5 peak).
 *
 * Threads take panels two at a time (dynamically: on these shared 2-vCPU machines one core is often
 * slower than the other, and a static split left the faster one waiting); each panel is read once per
 * block of MC rows and then serves every row tile of that block from cache, while the first tile
 * prefetches the next panel. So the weight streams near memory speed at 1-16 rows (where oneDNN's
 * and MKL's GEMMs stream it at half that or less) and the FMA units stay busy at 64 rows and more.
 * MC keeps a block of x (MC x k) within about 384 KB of L2.
 *
 * A fused gate-up weight of a gated MLP is packed with its halves paired (panel j: gate rows
 * 8j..8j+7, then the up rows of the same index), so one tile holds gate and up of the same 8
 * columns and the kernel writes silu(gate) * up directly: the [m, 2I] product is never stored and
 * read back, and the SiLU costs no pass of its own (gemm_panels_silu_mul_f32). Biases are packed
 * the same way (16 per panel) and added before the activation.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_exp.h" /* exp_poly, exp_poly8 */
#include "cpu_vec.h" /* v8, load8, store8 */

#define NR 16
#define MR 6
#define MC_BYTES (384 << 10)
#define MIN_PARALLEL (1 << 16) /* multiply-adds; below this one thread is faster */

/* silu(g) * u as cpu_llama_ops.c's silu_mul computes it: g / (1 + exp(-g)) * u. */
static inline v8 silu_mul8(v8 g, v8 u) {
#if defined(__AVX2__) && defined(__FMA__)
    const v8 e = (v8)exp_poly8((__m256)((v8){0} - g));
#else
    v8 e;
    for (int i = 0; i < 8; i++) e[i] = exp_poly(-g[i]);
#endif
    return g / (1.0f + e) * u;
}

/* A tile's accumulators out: 16 columns plus the panel's bias (b, or NULL), or 8 columns of
 * silu(lo) * hi when gated. */
__attribute__((noinline)) /* out of the kernels' loops: their 12 accumulators keep the registers */
static void store_tile(float *y, v8 lo, v8 hi, const float *b, int gated) {
    if (b) lo += load8(b), hi += load8(b + 8);
    if (gated) {
        store8(y, silu_mul8(lo, hi));
        return;
    }
    store8(y, lo);
    store8(y + 8, hi);
}

/* ROWS rows of x (row stride lda) times one panel into y (row stride ldy) through store_tile; pf:
 * the next panel, prefetched a line per kk while this one is multiplied (NULL: none). */
#define KERNEL_STEP(ROWS, PREFETCH)                                                                 \
    for (int kk = 0; kk < k; kk++) {                                                                \
        PREFETCH;                                                                                   \
        const v8 w0 = load8(p + (int64_t)kk * NR), w1 = load8(p + (int64_t)kk * NR + 8);            \
        for (int r = 0; r < ROWS; r++) {                                                            \
            const float s = x[r * lda + kk];                                                        \
            const v8 a = {s, s, s, s, s, s, s, s};                                                  \
            lo[r] += a * w0;                                                                        \
            hi[r] += a * w1;                                                                        \
        }                                                                                           \
    }
#define KERNEL(ROWS)                                                                                \
    static inline void kernel_##ROWS(const float *x, int64_t lda, const float *p, int k, float *y, \
                                     int64_t ldy, const float *pf, const float *b, int gated) {    \
        v8 lo[ROWS], hi[ROWS];                                                                      \
        for (int r = 0; r < ROWS; r++) lo[r] = hi[r] = (v8){0};                                     \
        if (pf)                                                                                     \
            KERNEL_STEP(ROWS, __builtin_prefetch(pf + (int64_t)kk * NR, 0, 2))                      \
        else                                                                                        \
            KERNEL_STEP(ROWS, (void)0)                                                              \
        for (int r = 0; r < ROWS; r++) store_tile(y + r * ldy, lo[r], hi[r], b, gated);             \
    }
KERNEL(1)
KERNEL(2)
KERNEL(3)
KERNEL(4)
KERNEL(5)
KERNEL(6)

/* m rows of x times one panel: tiles of MR rows, then the rest; only the first tile prefetches. */
static void rows_by_panel(const float *x, int m, int64_t lda, const float *p, int k, float *y,
                          int64_t ldy, const float *pf, const float *b, int gated) {
    int r = 0;
    for (; r + MR <= m; r += MR, pf = NULL) kernel_6(x + r * lda, lda, p, k, y + r * ldy, ldy, pf, b, gated);
    x += r * lda, y += r * ldy;
    switch (m - r) {
        case 5: kernel_5(x, lda, p, k, y, ldy, pf, b, gated); break;
        case 4: kernel_4(x, lda, p, k, y, ldy, pf, b, gated); break;
        case 3: kernel_3(x, lda, p, k, y, ldy, pf, b, gated); break;
        case 2: kernel_2(x, lda, p, k, y, ldy, pf, b, gated); break;
        case 1: kernel_1(x, lda, p, k, y, ldy, pf, b, gated); break;
    }
}

/* y[m, width] from x[m, k] and the panels of p: width = n (plain) or n / 2 (gated), each panel
 * writing the `cols` = NR or NR / 2 columns it owns; bias: [panels][16] or NULL. */
static void gemm_panels(const float *x, const float *p, const float *bias, float *y, int m, int n, int k,
                        int gated) {
    const int panels = (n + NR - 1) / NR, cols = gated ? NR / 2 : NR, width = gated ? n / 2 : n;
    const int64_t blocks = ((int64_t)m * k * 4 + MC_BYTES - 1) / MC_BYTES; /* equal blocks of x */
    const int mc = (int)((m + blocks - 1) / blocks + MR - 1) / MR * MR;
    for (int m0 = 0; m0 < m; m0 += mc) {
        const int rows = m - m0 < mc ? m - m0 : mc;
        const float *xb = x + (int64_t)m0 * k;
        float *yb = y + (int64_t)m0 * width;
#pragma omp parallel for schedule(dynamic, 2) if ((int64_t)rows * n * k >= MIN_PARALLEL)
        for (int j = 0; j < panels; j++) {
            const float *pj = p + (int64_t)j * k * NR, *next = j + 1 < panels ? pj + (int64_t)k * NR : NULL;
            const float *bj = bias ? bias + j * NR : NULL;
            const int own = width - j * cols < cols ? width - j * cols : cols;
            if (own == cols) {
                rows_by_panel(xb, rows, k, pj, k, yb + j * cols, width, next, bj, gated);
                continue;
            }
            float tile[MR * NR]; /* the last, partial panel: through a buffer, its own columns kept */
            for (int r0 = 0; r0 < rows; r0 += MR) {
                const int tr = rows - r0 < MR ? rows - r0 : MR;
                rows_by_panel(xb + (int64_t)r0 * k, tr, k, pj, k, tile, NR, NULL, bj, gated);
                for (int r = 0; r < tr; r++)
                    memcpy(yb + (int64_t)(r0 + r) * width + j * cols, tile + r * NR, own * sizeof(float));
            }
        }
    }
}

/* y[m, n] = x[m, k] @ W^T (+ bias); x and y contiguous, W in panels, bias packed per panel or NULL. */
void gemm_panels_f32(const float *x, const float *p, const float *bias, float *y, int m, int n, int k) {
    gemm_panels(x, p, bias, y, m, n, k, 0);
}

/* y[m, n / 2] = silu(x Wg^T + bg) * (x Wu^T + bu) for a fused gate-up W [n = 2 I, k] in paired panels. */
void gemm_panels_silu_mul_f32(const float *x, const float *p, const float *bias, float *y, int m, int n,
                              int k) {
    gemm_panels(x, p, bias, y, m, n, k, 1);
}
